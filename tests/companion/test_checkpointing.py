"""Activation (gradient) checkpointing, against the float64 per-sample loop of ``tests/oracle.py`` run on a twin of the
model without checkpointing (same weights; the oracle's ``autograd.grad`` cannot enter a reentrant checkpoint).

What was seen before:

- peft LoRA + HuggingFace ``gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})``
  (+ ``enable_input_require_grads()``, the usual recipe): ``per_sample``'s ``J`` identically zero, ``fisher_vp`` zero,
  ``gamma`` inf, optimiser steps moving nothing, no error. ``autograd.grad(inputs=params)`` never enters a reentrant
  checkpoint, whose block runs under ``no_grad`` in the forward.
- the non-reentrant mode: ``per_sample`` exact, but ``check="exact"`` (so the optimisers' step 0) and
  ``fisher_vp(method="auto")`` raised a bare ``CheckpointError`` (the backward's recomputation ran outside the
  reference kernels / the dual forward).

Now: HuggingFace layers checkpointed reentrantly run non-reentrantly inside the package's forwards (the user's
setting restored afterwards, the recomputation still happening); every quantity equals the oracle's in both HF
modes; torch's non-reentrant ``checkpoint`` in a custom model is exact everywhere; torch's reentrant ``checkpoint`` in
a custom model raises :class:`ief.model_call.ReentrantCheckpointError` naming ``use_reentrant=False`` from every entry
point (never zeros).
"""
from __future__ import annotations

import math

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import ief
import oracle
from ief.model_call import ReentrantCheckpointError

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

RTOL = 1e-10  # float64 against float64


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _gamma_oracle(twin, inputs, targets, d: torch.Tensor) -> float:
    fisher = oracle.fisher(twin, inputs, targets)
    grad = oracle.gradient(twin, inputs, targets).double()
    d = d.double()
    return math.sqrt(float(d @ fisher @ d)) / abs(float(d @ grad))


def _ief_update(twin, inputs, targets, lr: float, damping: float) -> torch.Tensor:
    """``-lr J^T (J J^T + lambda I)^{-1} s_iEF`` from the oracle's rows (``alg:iEF``), float64."""
    _, jac, sq = oracle.per_sample(twin, inputs, targets)
    jac = jac.double()
    coeff = torch.linalg.solve(jac @ jac.T + damping * torch.eye(jac.shape[0], dtype=torch.float64), sq.double())
    return -lr * (jac.T @ coeff)


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters() if p.requires_grad])


# ------------------------------------------------------------------------------------------ custom torch models
class _Block(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.a, self.b = torch.nn.Linear(d, d), torch.nn.Linear(d, d)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class _Checkpointed(torch.nn.Module):
    """A Linear, a checkpointed block (``reentrant``: ``True``, ``False``, or ``None`` for no checkpoint), a head.
    With ``first=True`` the block is the first layer: its input does not require grad (reentrant checkpointing then
    hides the block from autograd.grad without torch's own error)."""

    def __init__(self, reentrant: bool | None, first: bool = False):
        super().__init__()
        self.inp, self.blk, self.head = torch.nn.Linear(5, 5), _Block(5), torch.nn.Linear(5, 3)
        self.reentrant, self.first = reentrant, first

    def forward(self, x):
        h = x if self.first else self.inp(x)
        h = self.blk(h) if self.reentrant is None else checkpoint(self.blk, h, use_reentrant=self.reentrant)
        return self.head(torch.tanh(h))


def _custom(reentrant: bool | None, first: bool = False):
    torch.manual_seed(0)
    model = _Checkpointed(reentrant, first).double()
    torch.manual_seed(1)
    x, y = torch.randn(6, 5, dtype=torch.float64), torch.randint(0, 3, (6,))
    return model, x, y


@pytest.mark.parametrize("first", [False, True], ids=["inner", "first-layer"])
def test_reentrant_torch_checkpoint_raises_a_clear_error_everywhere(first):
    model, x, y = _custom(True, first)
    v = torch.randn(sum(p.numel() for p in model.parameters()), dtype=torch.float64)
    calls = {
        "per_sample": lambda: ief.per_sample(model, x, y),
        "per_sample exact": lambda: ief.per_sample(model, x, y, check="exact", form="auto"),
        "fisher_vp": lambda: ief.fisher_vp(model, x, y, v),
        "fisher_vp double_backward": lambda: ief.fisher_vp(model, x, y, v, method="double_backward"),
        "gamma": lambda: ief.gamma(model, x, y, v),
        "gammas": lambda: ief.gammas(model, x, y, torch.stack([v, -v])),
        "IEF": lambda: ief.optim.IEF(model, lr=0.1, damping=1e-3).step(x, y),
        "SF": lambda: ief.optim.SF(model, lr=0.1, damping=1e-3).step(x, y),
    }
    before = _flat(model)
    for name, call in calls.items():
        with pytest.raises(ReentrantCheckpointError, match="use_reentrant=False"):
            call()
    assert torch.equal(_flat(model), before)


@pytest.mark.parametrize("form", ["dense", "auto"])
def test_non_reentrant_torch_checkpoint_is_exact_everywhere(form):
    model, x, y = _custom(False)
    twin, _, _ = _custom(None)
    losses, jac, sq = oracle.per_sample(twin, x, y)
    for check in (True, "exact"):
        got = ief.per_sample(model, x, y, check=check, form=form)
        dense = got.jacobian if form == "dense" else got.jacobian.materialize()
        assert _rel(dense, jac) < RTOL
        assert _rel(got.logit_sqnorm, sq) < RTOL
    v = torch.randn(jac.shape[1], dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    fv = oracle.fisher(twin, x, y) @ v
    for method in ("auto", "forward", "double_backward"):
        assert _rel(ief.fisher_vp(model, x, y, v, method=method), fv) < RTOL, method
    operator = ief.FisherOperator(model, x, y, method="forward")
    assert _rel(operator @ v, fv) < RTOL and _rel(operator @ v, fv) < RTOL  # repeated products
    assert ief.gamma(model, x, y, v) == pytest.approx(_gamma_oracle(twin, x, y, v), rel=1e-9)
    step = ief.optim.IEF(model, lr=0.1, damping=1e-3, form=form)
    start = _flat(model)
    step.step(x, y)
    assert _rel(_flat(model) - start, _ief_update(twin, x, y, 0.1, 1e-3)) < 1e-8


# ------------------------------------------------------------------------------------------- HF + peft LoRA
def _gpt2_lora(mode: bool | None):
    """A tiny GPT-2 classifier from a config (no hub), peft LoRA on ``c_attn``, no dropout (the oracle's loop draws
    no masks), train mode; ``mode``: HF checkpointing with ``use_reentrant=mode``, or none."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2ForSequenceClassification
    from transformers.utils import logging

    logging.set_verbosity_error()
    config = GPT2Config(vocab_size=40, n_positions=12, n_embd=16, n_layer=2, n_head=2, pad_token_id=0,
                        bos_token_id=1, eos_token_id=1, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        num_labels=3)
    torch.manual_seed(0)
    model = GPT2ForSequenceClassification(config).double()
    model = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=["c_attn"],
                                             fan_in_fan_out=True))
    with torch.no_grad():  # LoRA B starts at zero: give the adapters a generic point
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(len(name)))
    if mode is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": mode})
        model.enable_input_require_grads()
    model.train()
    gen = torch.Generator().manual_seed(5)
    inputs = {"input_ids": torch.randint(2, 40, (4, 6), generator=gen)}
    return model, inputs, torch.randint(0, 3, (4,), generator=gen)


def _checkpoint_funcs(model) -> list:
    return [m._gradient_checkpointing_func for m in model.modules() if getattr(m, "gradient_checkpointing", False)]


@pytest.mark.parametrize("mode", [True, False], ids=["reentrant", "non-reentrant"])
def test_hf_lora_with_gradient_checkpointing_is_exact_everywhere(mode):
    model, x, y = _gpt2_lora(mode)
    twin, _, _ = _gpt2_lora(None)
    funcs = _checkpoint_funcs(model)
    assert funcs and all(f.keywords["use_reentrant"] is mode for f in funcs)
    losses, jac, sq = oracle.per_sample(twin, x, y)
    for check in (True, False, "exact"):
        for form in ("dense", "auto"):
            got = ief.per_sample(model, x, y, check=check, form=form)
            dense = got.jacobian if form == "dense" else got.jacobian.materialize()
            assert _rel(dense, jac) < RTOL, (check, form)
            assert _rel(got.losses, losses) < RTOL
    v = torch.randn(jac.shape[1], dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    fv = oracle.fisher(twin, x, y) @ v
    for method in ("auto", "forward", "double_backward"):
        assert _rel(ief.fisher_vp(model, x, y, v, method=method), fv) < RTOL, method
    expected = _gamma_oracle(twin, x, y, v)
    assert ief.gamma(model, x, y, v) == pytest.approx(expected, rel=1e-9)
    assert ief.gammas(model, x, y, torch.stack([v, 2 * v]))[1] == pytest.approx(expected, rel=1e-9)
    records = ief.evaluate(model, [(x, y)], damping=1e-3)  # every method: sgd, ef, ief, sf, K-FACs, hf
    twin_records = ief.evaluate(twin, [(x, y)], damping=1e-3)
    assert [r["method"] for r in records] == list(ief.METHODS)
    for got, ref in zip(records, twin_records):
        assert got["method"] == ref["method"] and got["gamma"] == pytest.approx(ref["gamma"], rel=1e-8)
    start = _flat(model)
    ief.optim.IEF(model, lr=0.1, damping=1e-3).step(x, y)
    assert _rel(_flat(model) - start, _ief_update(twin, x, y, 0.1, 1e-3)) < 1e-8
    assert _checkpoint_funcs(model) == funcs  # the user's setting is left as it was


def test_hf_checkpointing_still_recomputes_inside_the_package():
    """The per-sample pass keeps the memory saving: the attention of every layer runs again in the backward
    (recomputation), as in a plain training step with checkpointing on, in both modes."""
    counts = {}
    for mode in (None, True, False):
        model, x, y = _gpt2_lora(mode)
        seen = []
        for layer in model.base_model.model.transformer.h:
            layer.attn.register_forward_hook(lambda *args: seen.append(1))
        ief.per_sample(model, x, y)
        counts[mode] = len(seen)
    # per layer: the one-sample probe forward, the reversed-order forward that proves the sample axis, the batch
    # forward; checkpointing adds one recomputation per layer in the backward
    assert counts[None] == 6 and counts[True] == counts[False] == 8


def test_hf_lora_checkpointing_in_float32_matches_the_float64_loop():
    model, x, y = _gpt2_lora(True)
    model.float()
    twin, _, _ = _gpt2_lora(None)
    _, jac, _ = oracle.per_sample(twin, x, y)
    for check in (True, "exact"):
        assert _rel(ief.per_sample(model, x, y, check=check).jacobian, jac) < 1e-5
