"""peft adapters beyond LoRA on linear layers (:mod:`ief.jacobian.rules.peft_ia3`, ``peft_adalora``, ``peft_loha``,
``peft_lokr``, ``peft_vera``, ``peft_lora_embedding``): their wrappers' rules give exact per-sample gradients (against
the dense float64 per-sample autograd oracle, dense and factored forms, float32 and float64, eval and train mode)
without the per-sample loop; the configurations a rule does not cover (adapter dropout in training, merged or
disabled adapters, a trainable base layer, convolutions, mixed-adapter batches) keep the exact loop."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

import ief
import oracle
import route_models as rm
from ief.jacobian.rules import rule_for
from tiny_models import Case

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

# the wrapper type each adapter puts on the targeted layers, and whose rule must hook it
WRAPPERS = {
    "ia3": "peft.tuners.ia3.layer.Linear",
    "adalora": "peft.tuners.adalora.layer.SVDLinear",
    "loha": "peft.tuners.loha.layer.Linear",
    "lokr": "peft.tuners.lokr.layer.Linear",
    "vera": "peft.tuners.vera.layer.Linear",
    "lora-embedding": "peft.tuners.lora.layer.Embedding",
}


def adapter_config(kind: str, dropout: float = 0.0):
    """The peft config of ``kind`` on a tiny Llama's attention (and, for IA3, its feedforward ``down_proj``; for
    LoRA, its token embedding and ``q_proj``)."""
    attention = ["q_proj", "v_proj"]
    if kind == "ia3":
        return peft.IA3Config(target_modules=[*attention, "down_proj"], feedforward_modules=["down_proj"])
    if kind == "adalora":
        return peft.AdaLoraConfig(init_r=3, target_r=2, total_step=10, target_modules=attention, lora_alpha=4,
                                  lora_dropout=dropout)
    if kind == "loha":
        return peft.LoHaConfig(r=3, alpha=6, target_modules=attention)
    if kind == "lokr":  # r = 2 < 8 / 2 ... : w1 full, w2 a product (both forms of a factor)
        return peft.LoKrConfig(r=2, alpha=4, target_modules=attention, decompose_both=True)
    if kind == "vera":
        return peft.VeraConfig(r=4, target_modules=attention, vera_dropout=dropout)
    if kind == "lora-embedding":
        return peft.LoraConfig(r=3, lora_alpha=6, target_modules=["embed_tokens", "q_proj"], lora_dropout=dropout)
    raise ValueError(f"unknown adapter kind {kind!r}")


def adapter_model(kind: str, *, hidden: int = 32, layers: int = 2, vocab: int = 40, dropout: float = 0.0,
                  seed: int = 0) -> torch.nn.Module:
    """A tiny ``LlamaForCausalLM`` from a config (random weights, no dropout of its own) wrapped by peft with
    adapter ``kind``; every adapter tensor moved off its initial value (zeros, ones) so its Jacobian is generic."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, attn_implementation="eager", pad_token_id=0,
                                      tie_word_embeddings=False)
    model = peft.get_peft_model(transformers.LlamaForCausalLM(config), adapter_config(kind, dropout))
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.3 * torch.randn_like(p))
    return model


def adapter_case(kind: str, dtype: torch.dtype = torch.float32, train: bool = False, m: int = 4, t: int = 5,
                 dropout: float = 0.0, **sizes) -> Case:
    """``adapter_model(kind)`` in ``dtype`` and train / eval mode on a right-padded causal batch (per-position
    next-token targets, sample 2 every position ignored)."""
    model = adapter_model(kind, dropout=dropout, **sizes).to(dtype)
    model.train(train)
    inputs, targets = rm._causal_batch(m, t, model.config.vocab_size, seed=1)
    return Case(kind, model, inputs, targets)


def _wrappers(model: torch.nn.Module, kind: str) -> list[torch.nn.Module]:
    return [mod for mod in model.modules() if f"{type(mod).__module__}.{type(mod).__qualname__}" == WRAPPERS[kind]]


def _dense(jac) -> torch.Tensor:
    return (jac.materialize() if hasattr(jac, "materialize") else jac).to(torch.float64)


def _per_sample(c: Case, **kwargs):
    """``ief.per_sample`` and the SlowPathWarnings it raised."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always", ief.SlowPathWarning)
        result = ief.per_sample(c.model, c.inputs, c.targets, **kwargs)
    return result, [str(w.message) for w in record if issubclass(w.category, ief.SlowPathWarning)]


def _oracle(c: Case) -> torch.Tensor:
    model64 = copy.deepcopy(c.model).to(torch.float64)
    return oracle.per_sample(model64, c.inputs, c.targets, c.loss)[1].to(torch.float64)


def _blocks(model: torch.nn.Module, jac: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each trainable parameter's column block of ``jac``, by name."""
    blocks, lo = {}, 0
    for name, p in model.named_parameters():
        if p.requires_grad:
            blocks[name], lo = jac[:, lo : lo + p.numel()], lo + p.numel()
    assert lo == jac.shape[1]
    return blocks


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).norm() / ref.norm())


TOL = {torch.float32: 2e-5, torch.float64: 1e-11}


@pytest.mark.parametrize("kind", list(WRAPPERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_adapter_rows_are_exact_without_the_loop(kind, dtype, train):
    c = adapter_case(kind, dtype, train)
    wrappers = _wrappers(c.model, kind)
    assert wrappers and all(rule_for(w) is not None for w in wrappers)
    ref = _oracle(c)
    assert all(bool(block.any()) for block in _blocks(c.model, ref).values())  # generic: no all-zero tensor
    for form in ("dense", "auto"):
        result, slow = _per_sample(c, form=form, check=False)
        assert not slow, slow
        assert _rel(_dense(result.jacobian), ref) < TOL[dtype], form


@pytest.mark.parametrize("kind", list(WRAPPERS))
def test_every_adapter_column_is_exact(kind):
    """Each adapter tensor's own block (not only the whole J) equals the oracle's, float64."""
    c = adapter_case(kind, torch.float64)
    ref = _oracle(c)
    jac = _dense(ief.per_sample(c.model, c.inputs, c.targets, check="exact").jacobian)
    want = _blocks(c.model, ref)
    for name, block in _blocks(c.model, jac).items():
        scale = float(want[name].abs().max())
        assert scale > 0 and (block - want[name]).abs().max() <= 1e-11 * scale, name
