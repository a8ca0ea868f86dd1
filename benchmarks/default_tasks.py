"""The tasks of ``benchmarks/defaults.py``: tiny random-weight models from small configs, each with a stream of
training batches, a validation set (to choose a searched rate) and a test set (the reported held-out numbers).

Every task draws its data from fixed seeds and builds the same initial model on every call, so that every optimiser
starts from the same parameters and sees the same batches. Batches hold 32 samples. The data are synthetic and
learnable (a keyword, a Markov chain, a copy, a teacher network), so that a loss that stays at its initial value is a
stall, not an unlearnable task.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

import ief

BATCH = 32
HELD_OUT = 256  # samples of the validation set and of the test set each
IGNORE = -100


@dataclasses.dataclass
class Task:
    """A training problem: ``build()`` the initial model (the same each call), ``batch(step)`` the training batch of
    that step, ``validation`` / ``test`` held-out batches ``(inputs, targets)``, what kind of task it is and whether
    it was used to choose the default (``tuning``) or held out from that choice."""

    name: str
    kind: str
    build: Callable[[], torch.nn.Module]
    batch: Callable[[int], tuple[Any, torch.Tensor]]
    validation: tuple[Any, torch.Tensor]
    test: tuple[Any, torch.Tensor]
    tuning: bool
    note: str


def _lora_b_zero(model: torch.nn.Module) -> torch.nn.Module:
    return model  # peft's own initialisation (B = 0), what a user gets


# ----------------------------------------------------------------------------------------------------------- data
def _keyword(n: int, seed: int, vocab: int = 64, classes: int = 3) -> tuple[dict, torch.Tensor]:
    """Sequences of 6-12 random tokens (ids >= 4; padding 0 on the right, masked) with one keyword ``1 + c`` at a
    random position; the label is ``c``."""
    g = torch.Generator().manual_seed(seed)
    length = 12
    ids = torch.randint(4, vocab, (n, length), generator=g)
    mask = torch.ones(n, length, dtype=torch.long)
    labels = torch.randint(0, classes, (n,), generator=g)
    lengths = torch.randint(6, length + 1, (n,), generator=g)
    for i in range(n):
        ids[i, int(torch.randint(1, int(lengths[i]), (1,), generator=g))] = 1 + labels[i]
        ids[i, lengths[i]:] = 0
        mask[i, lengths[i]:] = 0
    ids[:, 0] = 2  # a [CLS]-like first token
    return {"input_ids": ids, "attention_mask": mask}, labels


def _chain(vocab: int) -> torch.Tensor:
    """A fixed random Markov chain over the ids ``1 .. vocab - 1`` (each has two likely successors)."""
    g = torch.Generator().manual_seed(1234)
    logits = torch.full((vocab, vocab), -2.0)
    logits[:, 0] = -1e9  # 0 is the padding id
    for a in range(vocab):
        logits[a, 1 + torch.randperm(vocab - 1, generator=g)[:2]] = 2.0
    return torch.softmax(logits, -1)


def _sequences(n: int, length: int, vocab: int, seed: int, padded: bool) -> tuple[dict, torch.Tensor]:
    """Markov-chain sequences as a causal LM's batch: ``input_ids``, ``attention_mask`` and the shifted targets
    (:func:`ief.causal_lm_targets` of labels with ``-100`` on padding); ``padded``: lengths 6 .. ``length``."""
    probs = _chain(vocab)
    g = torch.Generator().manual_seed(seed)
    seq = torch.empty(n, length, dtype=torch.long)
    seq[:, 0] = torch.randint(1, vocab, (n,), generator=g)
    for t in range(1, length):
        seq[:, t] = torch.multinomial(probs[seq[:, t - 1]], 1, generator=g).squeeze(1)
    mask = torch.ones(n, length, dtype=torch.long)
    labels = seq.clone()
    if padded:
        lengths = torch.randint(6, length + 1, (n,), generator=g)
        for i in range(n):
            seq[i, lengths[i]:] = 0
            mask[i, lengths[i]:] = 0
            labels[i, lengths[i]:] = IGNORE
    return {"input_ids": seq, "attention_mask": mask}, ief.causal_lm_targets(labels)


def _copy(n: int, seed: int, vocab: int = 64, copied: int = 3) -> tuple[dict, torch.Tensor]:
    """Seq2seq: 10 random tokens in; out: their first ``copied`` tokens (teacher-forced decoder inputs)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (n, 10), generator=g)
    labels = ids[:, :copied].clone()
    decoder = torch.cat([torch.zeros(n, 1, dtype=torch.long), labels[:, :-1]], dim=1)
    return {"input_ids": ids, "decoder_input_ids": decoder}, labels


def _teacher(n: int, seed: int, dim: int = 20, classes: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian inputs labelled by a fixed random tanh network (argmax of its 10 outputs)."""
    g = torch.Generator().manual_seed(4321)
    w1, w2 = torch.randn(dim, 32, generator=g), torch.randn(32, classes, generator=g)
    g.manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    return x, (torch.tanh(x @ w1) @ w2).argmax(-1)


def _stream(make: Callable[[int, int], Any]) -> Callable[[int], Any]:
    return lambda step: make(BATCH, 10_000 + step)


# --------------------------------------------------------------------------------------------------------- models
def _bert(roberta: bool = False) -> torch.nn.Module:
    import peft
    import transformers

    torch.manual_seed(0)
    kind = "Roberta" if roberta else "Bert"
    cfg = getattr(transformers, f"{kind}Config")(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=40, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        pad_token_id=0, attn_implementation="eager")
    base = getattr(transformers, f"{kind}ForSequenceClassification")(cfg)
    return peft.get_peft_model(base, peft.LoraConfig(task_type="SEQ_CLS", r=8, lora_alpha=8, lora_dropout=0.0,
                                                     target_modules=["query", "value"])).train()


def _decoder(kind: str) -> torch.nn.Module:
    import peft
    import transformers

    torch.manual_seed(0)
    cfg = getattr(transformers, f"{kind}Config")(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, pad_token_id=0, attn_implementation="eager",
        tie_word_embeddings=False)
    base = getattr(transformers, f"{kind}ForCausalLM")(cfg)
    return peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                     target_modules="all-linear")).train()


def _gpt2() -> torch.nn.Module:
    import peft
    import transformers

    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=50, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, attn_implementation="eager"))
    return peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, fan_in_fan_out=True,
                                                     target_modules=["c_attn", "c_fc"])).train()


def _t5() -> torch.nn.Module:
    import peft
    import transformers

    torch.manual_seed(0)
    base = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0))
    return peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                     target_modules=["q", "v"])).train()


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.Tanh(), torch.nn.Linear(64, 10)).train()


# ---------------------------------------------------------------------------------------------------------- tasks
def _task(name, kind, build, make, tuning, note) -> Task:
    return Task(name, kind, build, _stream(make), make(HELD_OUT, 1), make(HELD_OUT, 2), tuning, note)


def tasks() -> dict[str, Task]:
    """Every task by name: four that choose the default (a classifier, a causal LM with padding, a seq2seq task, an
    MLP) and three held out from that choice."""
    out = [
        _task("bert-lora-keyword", "classifier", _bert, _keyword, True,
              "BERT (2 layers, width 32) + LoRA r=8 on query/value, 3-class keyword task, 6-12 tokens, padded"),
        _task("llama-lora-lm", "causal LM, -100 padding", lambda: _decoder("Llama"),
              lambda n, s: _sequences(n, 16, 64, s, padded=True), True,
              "Llama (2 layers, width 32, vocab 64) + LoRA r=8 all-linear, Markov-chain next-token task, "
              "6-16 tokens right-padded (-100)"),
        _task("t5-lora-copy", "seq2seq", _t5, _copy, True,
              "T5 (2+2 layers, width 32, vocab 64) + LoRA r=8 on q/v, copy the first 3 of 10 tokens"),
        _task("mlp-teacher", "MLP (full training)", _mlp, _teacher, True,
              "MLP 20-64-10 (tanh), every parameter, labels of a fixed random tanh teacher"),
        _task("gpt2-lora-lm", "causal LM (held out)", _gpt2, lambda n, s: _sequences(n, 16, 50, s, padded=False),
              False, "GPT-2 (2 layers, width 32, vocab 50) + LoRA r=8 on c_attn/c_fc, Markov chain, 16 tokens"),
        _task("qwen2-lora-lm", "causal LM, -100 padding (held out)", lambda: _decoder("Qwen2"),
              lambda n, s: _sequences(n, 16, 64, s, padded=True), False,
              "Qwen2 (2 layers, width 32, vocab 64) + LoRA r=8 all-linear, the Llama task's data"),
        _task("roberta-lora-keyword", "classifier (held out)", lambda: _bert(roberta=True), _keyword, False,
              "RoBERTa (2 layers, width 32) + LoRA r=8 on query/value, the BERT task's data"),
    ]
    return {t.name: t for t in out}


@torch.no_grad()
def held_out(model: torch.nn.Module, data: tuple[Any, torch.Tensor]) -> tuple[float, float]:
    """The mean per-target loss (``L / K``, Hugging Face's ``outputs.loss``) and the accuracy over the counted
    targets of ``data``, in eval mode."""
    from ief.model_call import call_model

    inputs, targets = data
    was = model.training
    model.eval()
    logits = call_model(model, inputs).float()
    model.train(was)
    flat, gold = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    kept = gold != IGNORE
    loss = torch.nn.functional.cross_entropy(flat[kept], gold[kept])
    return float(loss), float((flat[kept].argmax(-1) == gold[kept]).float().mean())
