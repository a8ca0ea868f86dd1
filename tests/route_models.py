"""The models of the differential route tests (``tests/ief/test_routes.py``), each in float32 and float64 with the very
same parameter values and inputs, and their dense float64 oracles, cached per model.

Models (every one small enough for an explicit ``[P, P]`` Fisher; every one but the P < M example has a sample whose
every target position is ignored, so its per-sample gradient is zero and ``J J^T`` is singular):

- ``digits-mlp``, ``minilm-lora``, ``minilm-pt``: the book's cpu setups (``digits-mlp``, ``tweets-minilm-lora``,
  ``tweets-minilm-pt``) at smoke size, the very models and batches their smoke configs build, rebuilt here from numpy,
  torch, tokenizers, transformers and peft alone (so the library's tier needs nothing but the library): a 16-32-32-4
  ReLU MLP on the generated 4x4 images; a tiny BERT (hidden 16, one layer) on a BPE tokenizer trained on the
  generated tweets, with LoRA on query/value or per-sample prompt tuning (eval mode; LoRA ``B`` moved off zero so
  that the Jacobian is generic);
- ``linear-p15-m32``: ``Linear(4, 3)`` on 32 samples, P = 15 < M = 32 (``J J^T`` singular by construction);
- ``t5-prompt``: a prompt-only model (tiny T5, prompt tuning made per-sample as the setups do it);
- ``t5-lora``: tiny T5 with LoRA, per-position vocabulary logits and padded labels;
- ``cnn``: two zero-padded ``Conv2d`` (hooked, unfolded) and a reflect-padded one (exact per-sample loop), a head;
- ``gru``: an ``nn.GRU`` (exact per-sample loop) with per-position logits and ignored positions;
- ``token-table``: a trainable ``nn.Embedding`` the batch uses only partly (the factored forms keep its used rows),
  a position table shared by every sample, a repeated sample and per-position logits;
- ``llama``, ``qwen2-tied``: full fine-tuning of tiny ``LlamaForCausalLM`` (train mode, untied head) and
  ``Qwen2ForCausalLM`` (eval mode, ``tie_word_embeddings=True``) from configs, right-padded with an attention mask,
  per-position next-token targets (RMS norms: their rule; Qwen2's tied table and head: hooked in both modules).
- ``llama-dora``: that Llama (eval mode) with peft DoRA on q_proj / v_proj: ``lora_A`` / ``lora_B`` hooked as linear
  layers (DoRA's identity-matrix weight-norm calls reach no loss), the magnitudes by their rule.
- ``t5-full``: full fine-tuning of a tiny ``T5ForConditionalGeneration`` (two layers each side, SDPA attention, tied
  table and head, padded inputs and labels): T5 layer norms by their rule, the relative attention biases (an
  ``[T, T]`` bucket table permuted to ``[1, H, T, T]`` and shared by both layers) by their broadcast uses.
- ``llama-ia3``, ``llama-lora-embedding``: that Llama wrapped by peft (IA3 with a feedforward module, train mode;
  LoRA on the token embedding and q_proj, adapter dropout 0.1, eval mode): the adapter wrappers' rules
  (``ief/jacobian/rules/peft_*.py``), adapter tensors only trainable.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import math
import zlib
from collections.abc import Callable, Mapping

import numpy as np
import torch

import oracle
from tiny_models import IGNORE, Case, TokenTableModel, t5_lora_case, t5_prompt_case


@dataclasses.dataclass(frozen=True)
class RouteModel:
    """A model of the matrix: its float32 builder and which routes apply to it.

    ``classifier``: one logit vector per sample (the logit-space route applies); ``kfac_params``: the names of the
    ``nn.Linear`` parameters K-FAC preconditions (all trainable ones, or a head; ``()``: K-FAC does not apply).
    """

    name: str
    build: Callable[[], Case]
    classifier: bool
    kfac_params: tuple[str, ...] | str = "all"


# The cpu setups at smoke size as the book's experiments build them for training (their setup registry's smoke
# configs, smoke data, model builder and collation), rebuilt from numpy, torch, tokenizers, transformers and peft
# alone and equal to those bit for bit (parameters, inputs, targets): the same generated data (numpy's generator
# seeded with [0, crc32("smoke"), crc32(task)]), tokenizer, architecture, peft wrapping, initialisation order and
# collation. A change to the smoke setups there is not followed here: these are the matrix's models, fixed.
_WORDS = ("apple river stone cloud table green quick lamp music paper garden window silver orange forest "
          "pencil rocket candle island bridge").split()


def _smoke_rng(task: str) -> np.random.Generator:
    return np.random.default_rng([0, *(zlib.crc32(k.encode()) for k in ("smoke", task))])


def _smoke_digits(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``m`` smoke digits: 4x4x1 noise images (0..4) with one quadrant brighter by 8 (the quadrant is the
    class of 4), pixels / 16 standardised with mean 0.5 and std 0.3, flattened in CHW order."""
    rng, images, labels = _smoke_rng("digits"), [], []
    for _ in range(m):
        label = int(rng.integers(4))
        img = rng.integers(0, 16 // 3, size=(4, 4, 1))
        r, q = divmod(label, 2)
        img[r * 2 : r * 2 + 2, q * 2 : q * 2 + 2] += 8
        images.append(np.clip(img, 0, 16).astype(np.uint8).astype(np.float32))
        labels.append(label)
    x = (np.stack(images) / 16.0 - np.float32(0.5)) / np.float32(0.3)
    return torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2))).reshape(m, -1), torch.tensor(labels)


def _smoke_tweets(n: int = 32) -> tuple[list[str], list[int]]:
    """The smoke tweets (the setup's 32 training ones): 3 to 6 filler words and the class (negative / neutral /
    positive), with a negative or positive word inserted for classes 0 and 2."""
    rng, texts, labels = _smoke_rng("tweets"), [], []
    for _ in range(n):
        words = [str(w) for w in rng.choice(_WORDS, size=int(rng.integers(3, 7)))]
        label = int(rng.integers(3))
        if label in (0, 2):
            sentiment = ("bad", "awful", "poor") if label == 0 else ("good", "great", "lovely")
            words.insert(int(rng.integers(len(words) + 1)), str(rng.choice(sentiment)))
        texts.append(" ".join(words))
        labels.append(label)
    return texts, labels


def _bert_tokenizer(corpus: list[str], vocab_size: int = 120):
    """A BPE tokenizer trained on ``corpus`` with BERT's normaliser and pre-tokeniser ([PAD]=0, [CLS] ... [SEP])."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.BPEDecoder()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                                        show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2),
                                                                                             ("[SEP]", 3)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]")


class SmokeMLP(torch.nn.Module):
    """``digits-mlp`` at smoke size: ``net`` = 16 -> 32 -> ReLU -> 32 -> ReLU -> 4 (the experiments' ``MLP``, with
    its parameter names)."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                                       torch.nn.ReLU(), torch.nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _smoke_minilm(method: str, m: int):
    """``tweets-minilm-{lora,pt}`` at smoke size: a tiny ``BertForSequenceClassification`` (hidden 16, 1 layer, 2
    heads, 3 classes, eager attention) on a tokenizer trained on the 32 smoke tweets, with peft LoRA (r=8, alpha 8,
    dropout 0.1, query/value) or prompt tuning (20 virtual tokens sampled from the vocabulary, per sample); its
    inputs: the first ``m`` tweets tokenised (padded, truncated to 32 tokens)."""
    import peft
    from transformers import BertConfig, BertForSequenceClassification

    from ief import per_sample_prompts

    texts, labels = _smoke_tweets()
    tokenizer = _bert_tokenizer(texts)
    base = BertForSequenceClassification(BertConfig(
        vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=128, num_labels=3, attn_implementation="eager"))
    if method == "lora":
        model = peft.get_peft_model(base, peft.LoraConfig(task_type="SEQ_CLS", r=8, lora_alpha=8, lora_dropout=0.1,
                                                          target_modules=["query", "value"], bias="none"))
    else:
        model = per_sample_prompts(peft.get_peft_model(base, peft.PromptTuningConfig(
            task_type="SEQ_CLS", num_virtual_tokens=20, num_transformer_submodules=1,
            prompt_tuning_init=peft.PromptTuningInit.SAMPLE_VOCAB)))
    enc = tokenizer(texts[:m], max_length=32, truncation=True, padding=True, return_tensors="pt")
    return model, {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}, torch.tensor(labels[:m])


def _smoke_setup(setup: str, m: int, ignored: int) -> Case:
    """The first ``m`` training samples of a cpu setup at smoke size and its model (torch seeded with 0 before it is
    built), in eval mode, LoRA's ``B`` drawn from N(0, 0.3^2) so that the Jacobian is generic; every target of
    sample ``ignored`` ignored."""
    torch.manual_seed(0)
    if setup == "digits-mlp":
        model, (inputs, targets) = SmokeMLP(), _smoke_digits(m)
    else:
        model, inputs, targets = _smoke_minilm(setup.rsplit("-", 1)[1], m)
    model.eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    targets[ignored] = IGNORE
    return Case(setup, model, inputs, targets)


def digits_mlp() -> Case:
    return _smoke_setup("digits-mlp", 8, 5)


def minilm_lora() -> Case:
    return _smoke_setup("tweets-minilm-lora", 6, 1)


def minilm_pt() -> Case:
    return _smoke_setup("tweets-minilm-pt", 6, 1)


def linear_p_lt_m() -> Case:
    """``Linear(4, 3)`` on 32 samples: P = 15 < M = 32 (the sweep's known singular case)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    x = torch.randn(32, 4)
    y = torch.randint(0, 3, (32,))
    return Case("linear-p15-m32", model, x, y)


def _all_ignored(case: Case, n: int) -> Case:
    case.targets[n] = IGNORE
    return case


def t5_prompt() -> Case:
    from ief import per_sample_prompts

    case = t5_prompt_case(m=3, dtype=torch.float32)
    per_sample_prompts(case.model)
    return _all_ignored(case, 2)


def t5_lora() -> Case:
    return _all_ignored(t5_lora_case(m=3, dtype=torch.float32), 2)


class SmallCNN(torch.nn.Module):
    """Conv2d (zero padding: hooked) -> ReLU -> Conv2d (reflect padding: exact per-sample loop) -> ReLU -> Conv2d
    (no padding, stride 2: hooked) -> flatten -> Linear head."""

    def __init__(self, classes: int = 3):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(2, 3, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(3, 3, 3, padding=1, padding_mode="reflect")
        self.conv3 = torch.nn.Conv2d(3, 2, 3, stride=2)
        self.head = torch.nn.Linear(2 * 2 * 2, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return self.head(self.conv3(h).flatten(1))


def cnn() -> Case:
    torch.manual_seed(0)
    model = SmallCNN()
    x = torch.randn(6, 2, 5, 5)
    y = torch.randint(0, 3, (6,))
    y[3] = IGNORE
    return Case("cnn", model, x, y)


class SmallGRU(torch.nn.Module):
    """Frozen embedding -> GRU (exact per-sample loop) -> Linear head, per-position logits ``[M, T, C]``."""

    def __init__(self, vocab: int = 7, dim: int = 3, hidden: int = 4, classes: int = 3):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.embed.weight.requires_grad_(False)
        self.gru = torch.nn.GRU(dim, hidden, batch_first=True)
        self.head = torch.nn.Linear(hidden, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(self.embed(tokens))
        return self.head(out)


def gru() -> Case:
    torch.manual_seed(0)
    model = SmallGRU()
    tokens = torch.randint(0, 7, (4, 3))
    y = torch.randint(0, 3, (4, 3))
    y[0, 2] = IGNORE
    y[2] = IGNORE  # every position of sample 2 ignored
    return Case("gru", model, tokens, y)


def token_table() -> Case:
    torch.manual_seed(0)
    model = TokenTableModel()
    tokens = torch.randint(1, 7, (5, 4))  # rows 7..11 of the table unused
    tokens[0, 3] = 0  # padding
    tokens[4] = tokens[3]  # a repeated sample
    y = torch.randint(0, 3, (5, 4))
    y[4] = y[3]
    y[0, 3] = IGNORE
    y[1] = IGNORE  # every position of sample 1 ignored
    return Case("token-table", model, tokens, y)


def _causal_batch(m: int, t: int, vocab: int, seed: int):
    """Token ids with right padding of 0, 1 or 2 positions and the matching attention mask; per-position targets
    (the next id; padded positions ignored, sample 2 every position ignored)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (m, t + 1), generator=g)
    mask = torch.ones(m, t, dtype=torch.long)
    targets = ids[:, 1:].clone()
    ids = ids[:, :-1].contiguous()
    for n in range(m):
        pad = n % 3
        if pad:
            ids[n, -pad:] = 0
            mask[n, -pad:] = 0
            targets[n, -pad:] = IGNORE
    targets[2] = IGNORE  # every position of sample 2 ignored
    return {"input_ids": ids, "attention_mask": mask}, targets


def _causal_lm(name: str, config, m: int = 4, t: int = 5, train: bool = False) -> Case:
    """A full fine-tuning causal LM from a tiny config (built offline), eager attention, per-position logits."""
    import transformers

    torch.manual_seed(0)
    cls = getattr(transformers, type(config).__name__.replace("Config", "ForCausalLM"))
    model = cls(config)
    with torch.no_grad():  # RMS norm weights start at 1: move them so that their gradients are generic
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.add_(0.2 * torch.randn_like(p))
    model.train(train)
    inputs, targets = _causal_batch(m, t, config.vocab_size, seed=0)
    return Case(name, model, inputs, targets)


def _tiny_decoder_config(kind: str, **overrides):
    import transformers

    cfg = dict(vocab_size=24, hidden_size=8, intermediate_size=12, num_hidden_layers=1, num_attention_heads=2,
               num_key_value_heads=1, max_position_embeddings=16, attn_implementation="eager", pad_token_id=0)
    cfg.update(overrides)
    return getattr(transformers, kind)(**cfg)


def llama() -> Case:
    """``LlamaForCausalLM`` (tiny config: hidden 8, one layer, grouped-query attention, untied head), train mode (no
    dropout in it: the same function), every parameter trainable: RMS norms hooked by their rule."""
    return _causal_lm("llama", _tiny_decoder_config("LlamaConfig", tie_word_embeddings=False), train=True)


def qwen2_tied() -> Case:
    """``Qwen2ForCausalLM`` (tiny config, tied input and output embeddings, q/k/v biases), eval mode, every parameter
    trainable."""
    return _causal_lm("qwen2-tied", _tiny_decoder_config("Qwen2Config", tie_word_embeddings=True))


def llama_dora() -> Case:
    """The tiny Llama (eval mode) with peft DoRA (rank 2, adapter dropout 0.1: identity in eval mode) on q_proj /
    v_proj, the adapter tensors (A, B, magnitudes) only trainable, moved off their initial values. No K-FAC route:
    this file's K-FAC block oracle puts every call in ``A``, DoRA's identity-matrix calls included, which K-FAC
    leaves out (they reach no loss); tests/ief/test_kfac.py checks DoRA's factors."""
    import peft

    case_ = _causal_lm("llama-dora", _tiny_decoder_config("LlamaConfig", tie_word_embeddings=False))
    torch.manual_seed(2)
    case_.model = peft.get_peft_model(case_.model, peft.LoraConfig(
        r=2, lora_alpha=4, lora_dropout=0.1, target_modules=["q_proj", "v_proj"], use_dora=True))
    with torch.no_grad():
        for p in case_.model.parameters():
            if p.requires_grad:
                p.add_(0.3 * torch.randn_like(p))
    case_.model.eval()
    return case_


def t5_full() -> Case:
    """``T5ForConditionalGeneration`` (tiny config, two encoder and two decoder layers, default SDPA attention, tied
    table and head), eval mode, every parameter trainable, layer norms moved off 1; the T5 batch of the matrix."""
    from transformers import T5ForConditionalGeneration

    from tiny_models import _t5_batch, _t5_config

    torch.manual_seed(0)
    model = T5ForConditionalGeneration(_t5_config(num_layers=2, num_decoder_layers=2)).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "layer_norm" in pname:
                p.add_(0.2 * torch.randn_like(p))
    inputs, labels = _t5_batch(4, 0)
    return _all_ignored(Case("t5-full", model, inputs, labels), 2)


def _llama_adapter(name: str, config_of: Callable, train: bool = False) -> Case:
    """The matrix's tiny Llama wrapped by peft (``config_of(peft)``: the adapter's config), every adapter tensor moved
    off its initial zeros / ones so that its Jacobian is generic."""
    import peft

    case_ = _causal_lm(name, _tiny_decoder_config("LlamaConfig", tie_word_embeddings=False), train=train)
    torch.manual_seed(1)
    case_.model = peft.get_peft_model(case_.model, config_of(peft))
    with torch.no_grad():
        for p in case_.model.parameters():
            if p.requires_grad:
                p.add_(0.3 * torch.randn_like(p))
    case_.model.train(train)
    return case_


def llama_ia3() -> Case:
    """The tiny Llama with IA3 on q_proj / v_proj (output scaling) and down_proj (feedforward: input scaling), train
    mode: the IA3 wrapper's rule, no loop."""
    return _llama_adapter("llama-ia3", lambda peft: peft.IA3Config(
        target_modules=["q_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]), train=True)


def llama_lora_embedding() -> Case:
    """The tiny Llama with LoRA (rank 2, dropout 0.1: identity in eval mode) on its token embedding
    (``lora_embedding_A`` / ``_B``) and q_proj."""
    return _llama_adapter("llama-lora-embedding", lambda peft: peft.LoraConfig(
        r=2, lora_alpha=4, lora_dropout=0.1, target_modules=["embed_tokens", "q_proj"]))


MODELS = {
    m.name: m
    for m in (
        RouteModel("digits-mlp", digits_mlp, classifier=True),
        RouteModel("minilm-lora", minilm_lora, classifier=True),
        RouteModel("minilm-pt", minilm_pt, classifier=True, kfac_params=("classifier",)),
        RouteModel("linear-p15-m32", linear_p_lt_m, classifier=True),
        RouteModel("t5-prompt", t5_prompt, classifier=False, kfac_params=()),
        RouteModel("t5-lora", t5_lora, classifier=False),
        RouteModel("cnn", cnn, classifier=True, kfac_params=("head",)),
        RouteModel("gru", gru, classifier=False, kfac_params=("head",)),
        RouteModel("token-table", token_table, classifier=False, kfac_params=("head",)),
        RouteModel("llama", llama, classifier=False, kfac_params=("lm_head",)),
        RouteModel("qwen2-tied", qwen2_tied, classifier=False, kfac_params=()),
        RouteModel("llama-dora", llama_dora, classifier=False, kfac_params=()),
        RouteModel("t5-full", t5_full, classifier=False, kfac_params=()),
        RouteModel("llama-ia3", llama_ia3, classifier=False, kfac_params=()),
        RouteModel("llama-lora-embedding", llama_lora_embedding, classifier=False, kfac_params=()),
    )
}


# ------------------------------------------------------------------------------------------------------ cases
def _cast(x, dtype: torch.dtype):
    if isinstance(x, Mapping):
        return {k: _cast(v, dtype) for k, v in x.items()}
    if isinstance(x, torch.Tensor) and x.dtype.is_floating_point:
        return x.to(dtype)
    return x


@functools.lru_cache(maxsize=None)
def _float32(name: str) -> Case:
    case = MODELS[name].build()
    case.model.float()
    case.inputs = _cast(case.inputs, torch.float32)
    return case


@functools.lru_cache(maxsize=None)
def case(name: str, dtype: torch.dtype) -> Case:
    """The model ``name`` in ``dtype``: the float64 one holds exactly the float32 one's parameters and inputs."""
    base = _float32(name)
    if dtype == torch.float32:
        return base
    return Case(base.name, copy.deepcopy(base.model).to(dtype), _cast(base.inputs, dtype), base.targets.clone(),
                base.loss)


def trainable_names(case_: Case) -> list[str]:
    return [n for n, p in case_.model.named_parameters() if p.requires_grad]


def kfac_params(name: str, case_: Case) -> list[torch.nn.Parameter] | None:
    """The parameters K-FAC preconditions on this model (``None``: all trainable ones)."""
    wanted = MODELS[name].kfac_params
    if wanted == "all":
        return None
    return [p for n, p in case_.model.named_parameters() if p.requires_grad and set(n.split(".")) & set(wanted)]


# ------------------------------------------------------------------------------------------------------ oracles
@dataclasses.dataclass(frozen=True)
class Oracle:
    """Dense float64 quantities of one model at its (float32-representable) point, by explicit per-sample loops."""

    losses: torch.Tensor  # [M]
    jacobian: torch.Tensor  # [M, P]
    logit_sqnorm: torch.Tensor  # [M]
    gradient: torch.Tensor  # [P]
    fisher: torch.Tensor  # [P, P] (eqn:FIM)

    def gamma(self, d: torch.Tensor) -> float:
        """``sqrt(d^T F d) / |d^T g|`` (``sec:eval_framework``)."""
        d = d.to(torch.float64)
        return float((d @ self.fisher @ d).clamp_min(0).sqrt() / (d @ self.gradient).abs())


@functools.lru_cache(maxsize=None)
def dense_oracle(name: str) -> Oracle:
    c = case(name, torch.float64)
    losses, jac, sq = oracle.per_sample(c.model, c.inputs, c.targets, c.loss)
    fisher = oracle.fisher(c.model, c.inputs, c.targets, c.loss)
    jac = jac.detach().to(torch.float64)
    return Oracle(losses.to(torch.float64), jac, sq.detach().to(torch.float64), jac.sum(0), fisher)


def batch_logits(c: Case) -> torch.Tensor:
    with torch.no_grad():
        return oracle.logits_of(c.model, c.inputs)


def draw_labels(c: Case, seed: int) -> torch.Tensor:
    """The labels the package draws for SF / K-FAC from a generator seeded with ``seed``: one multinomial draw per
    kept position from the float64 softmax of the batch's logits (the model's own dtype), ignored positions kept."""
    logits = batch_logits(c)
    probs = torch.softmax(logits.to(torch.float64), dim=-1).reshape(-1, logits.shape[-1])
    drawn = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(seed)).reshape(c.targets.shape)
    return torch.where(c.targets == IGNORE, c.targets, drawn.to(c.targets.dtype))


@functools.lru_cache(maxsize=None)
def sampled_oracle(name: str, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """``A [M, P]``: the dense per-sample gradients for the labels the package draws in ``dtype`` with ``seed``."""
    labels = draw_labels(case(name, dtype), seed)
    c = case(name, torch.float64)
    _, jac, _ = oracle.per_sample(c.model, c.inputs, labels, c.loss)
    return jac.detach().to(torch.float64)


# ------------------------------------------------------------------------------------------- K-FAC block oracle
def _linear_modules(model: torch.nn.Module, params: list[torch.Tensor]) -> list[tuple[torch.nn.Linear, list[str]]]:
    """The ``nn.Linear`` modules owning ``params`` and which of their ``weight`` / ``bias`` are among them."""
    ids = {id(p) for p in params}
    out = []
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            owned = [k for k in ("weight", "bias") if getattr(module, k) is not None and id(getattr(module, k)) in ids]
            if owned:
                out.append((module, owned))
    return out


@functools.lru_cache(maxsize=None)
def kfac_blocks(name: str, dtype: torch.dtype, kind: str, seed: int) -> list[tuple]:
    """Every preconditioned layer's ``(g [R, out], a [R', k], grad [out, k], where)`` with ``G = g^T g`` and
    ``A = a^T a``, by explicit per-sample passes (``sec:app-iEF-eNGDopt``, expand):
    ``A = 1/M sum_n 1/T sum_t a a^T`` (``[a, 1]`` with a trained bias), ``G = sum_n w_n sum_t g g^T`` with ``g`` the
    gradient of ``l_n`` (true labels, or for ``"kfac"`` the labels the package draws in ``dtype`` with ``seed``)
    w.r.t. the layer's output at position ``t``; ``w_n = 1 / s_n`` for ``"iekfac"`` (0 where ``s_n = 0``), else 1.
    ``grad = [grad_W, grad_b]`` from the dense oracle, so that its row-major ``vec`` matches ``G (x) A``; ``where``:
    ``[("weight" | "bias", index in the parameters)]``. The rows are kept, not only ``G`` and ``A``, so that a
    sensitivity check can round them as a float32 computation does (which breaks ``sum_c g_c = 0`` at ``eps``)."""
    c = case(name, torch.float64)
    model = c.model
    params = kfac_params(name, c) or oracle.trainable(model)
    modules = _linear_modules(model, params)
    labels = draw_labels(case(name, dtype), seed) if kind == "kfac" else c.targets
    dense = dense_oracle(name)
    weights = torch.ones(c.targets.shape[0], dtype=torch.float64)
    if kind == "iekfac":
        s = dense.logit_sqnorm
        weights = torch.where(s > 0, 1.0 / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(s))
    m = c.targets.shape[0]
    a_rows: list[list[torch.Tensor]] = [[] for _ in modules]  # rows scaled so that A = sum a a^T
    g_rows: list[list[torch.Tensor]] = [[] for _ in modules]  # rows scaled so that G = sum g g^T
    for n in range(m):
        calls: list[list] = [[] for _ in modules]
        hooks = [mod.register_forward_hook(lambda mod_, args, out, k=k: calls[k].append((args[0], out)))
                 for k, (mod, _) in enumerate(modules)]
        try:
            z = oracle.logits_of(model, oracle.take(c.inputs, n))
        finally:
            for h in hooks:
                h.remove()
        l_n = oracle.sample_loss(z, labels[n : n + 1], c.loss)
        outputs = [out for k in range(len(modules)) for _, out in calls[k]]
        grads = iter(torch.autograd.grad(l_n, outputs, allow_unused=True))
        for k, (mod, owned) in enumerate(modules):
            for x, out in calls[k]:
                g = next(grads)
                a = x.detach().reshape(-1, x.shape[-1]).to(torch.float64)
                if "bias" in owned:
                    a = torch.cat([a, torch.ones(a.shape[0], 1, dtype=torch.float64)], dim=1)
                if "weight" not in owned:
                    a = a[:, -1:]
                a_rows[k].append(a / math.sqrt(a.shape[0] * m))
                if g is not None:
                    g_rows[k].append(weights[n].sqrt() * g.detach().reshape(-1, g.shape[-1]).to(torch.float64))
    index = {id(p): i for i, p in enumerate(params)}
    offsets, at = {}, 0
    for p in oracle.trainable(model):
        offsets[id(p)] = (at, at + p.numel())
        at += p.numel()
    out = []
    for (mod, owned), a_list, g_list in zip(modules, a_rows, g_rows):
        g_mat = torch.cat(g_list) if g_list else torch.zeros(0, mod.out_features, dtype=torch.float64)
        parts, where = [], []
        if "weight" in owned:
            lo, hi = offsets[id(mod.weight)]
            parts.append(dense.gradient[lo:hi].reshape(mod.weight.shape))
            where.append(("weight", index[id(mod.weight)]))
        if "bias" in owned:
            lo, hi = offsets[id(mod.bias)]
            parts.append(dense.gradient[lo:hi].reshape(-1, 1))
            where.append(("bias", index[id(mod.bias)]))
        out.append((g_mat, torch.cat(a_list), torch.cat(parts, dim=1), where))
    return out


def kronecker_solve(g_factor: torch.Tensor, a_factor: torch.Tensor, grad: torch.Tensor, damping: float
                    ) -> torch.Tensor:
    """``(G (x) A + lambda I)^{-1} vec(grad)`` through the eigendecompositions of ``G`` and ``A`` (the eigenvalues of
    ``G (x) A`` are the products ``e_G e_A``; a dense ``eigh`` of the Kronecker block would err by ``eps max`` on each,
    too much for the small products these models have). ``lambda = 0``: the pseudo-inverse, products below
    ``1e3 k eps`` of the largest dropped (``k`` the block's side: below that a product's own rounding error exceeds
    ~0.1% and the pseudo-inverse is not determined in float64)."""
    eg, u = torch.linalg.eigh(g_factor)
    ea, v = torch.linalg.eigh(a_factor)
    prod = eg.clamp_min(0).unsqueeze(1) * ea.clamp_min(0).unsqueeze(0)
    if damping == 0:
        keep = prod > 1e3 * max(prod.shape) * torch.finfo(torch.float64).eps * prod.max()
        inv = torch.where(keep, 1.0 / torch.where(keep, prod, torch.ones_like(prod)), torch.zeros_like(prod))
    else:
        inv = 1.0 / (prod + damping)
    return u @ ((u.T @ grad @ v) * inv) @ v.T


def kfac_oracle_direction(name: str, dtype: torch.dtype, kind: str, seed: int, damping: float,
                          perturb: Callable[[torch.Tensor, int], torch.Tensor] | None = None) -> torch.Tensor:
    """The K-FAC direction from the dense factors of :func:`kfac_blocks` (:func:`kronecker_solve` per layer), in the
    order of :func:`kfac_params`, float64. ``perturb(tensor, salt)``: applied to the rows of ``G`` and ``A`` and to
    the gradient first (a rounding model, for the sensitivity of the solve)."""
    c = case(name, torch.float64)
    params = kfac_params(name, c) or oracle.trainable(c.model)
    sizes = [p.numel() for p in params]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    direction = torch.zeros(sum(sizes), dtype=torch.float64)
    for layer, (g_rows, a_rows, grad, where) in enumerate(kfac_blocks(name, dtype, kind, seed)):
        if perturb is not None:
            g_rows, a_rows, grad = (perturb(t, 3 * layer + i) for i, t in enumerate((g_rows, a_rows, grad)))
        solved = kronecker_solve(g_rows.T @ g_rows, a_rows.T @ a_rows, grad, damping)
        for part, i in where:
            piece = solved[:, :-1] if part == "weight" and len(where) == 2 else solved
            piece = solved[:, -1] if part == "bias" else piece
            direction[starts[i] : starts[i] + sizes[i]] = piece.reshape(-1)
    return direction


def kfac_dense_direction(name: str, dtype: torch.dtype, kind: str, seed: int, damping: float) -> torch.Tensor:
    """As :func:`kfac_oracle_direction` (``damping > 0``), by a dense solve of ``G (x) A + lambda I`` per layer: the
    definition itself, accurate where the block is well conditioned (``damping`` not far below its largest
    eigenvalue)."""
    c = case(name, torch.float64)
    params = kfac_params(name, c) or oracle.trainable(c.model)
    sizes = [p.numel() for p in params]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    direction = torch.zeros(sum(sizes), dtype=torch.float64)
    for g_rows, a_rows, grad, where in kfac_blocks(name, dtype, kind, seed):
        block = torch.kron(g_rows.T @ g_rows, a_rows.T @ a_rows)
        eye = torch.eye(block.shape[0], dtype=torch.float64)
        solved = torch.linalg.solve(block + damping * eye, grad.reshape(-1)).reshape(grad.shape)
        for part, i in where:
            piece = solved[:, :-1] if part == "weight" and len(where) == 2 else solved
            piece = solved[:, -1] if part == "bias" else piece
            direction[starts[i] : starts[i] + sizes[i]] = piece.reshape(-1)
    return direction
