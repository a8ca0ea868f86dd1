"""Tied weights: a parameter held directly by several hooked modules (an embedding table that is also the output
head's weight: GPT-2, Qwen2 / Gemma / BART with tied embeddings) is hooked in each, its per-sample rows the sum of
their rules' rows (``shared`` of :class:`ief.jacobian.capture.PerSampleCapture`), so no per-sample loop; exact against
the dense float64 per-sample autograd oracle in every form, float32 and float64. A demoted holder demotes every holder
(to a fixed point), and the loop's rows are exact."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

import ief
import oracle

FORMS = ["dense", "ghost", "rows", "auto"]
DTYPES = {"float32": torch.float32, "float64": torch.float64}
TOL = {torch.float32: 1e-5, torch.float64: 1e-10}


def _dense(result) -> torch.Tensor:
    jac = result.jacobian
    return (jac.materialize() if hasattr(jac, "materialize") else jac).to(torch.float64)


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).norm() / ref.norm())


def _oracle(model, inputs, targets) -> torch.Tensor:
    return oracle.per_sample(copy.deepcopy(model).to(torch.float64), inputs, targets)[1].to(torch.float64)


def _no_loop(model, inputs, targets, form):
    with warnings.catch_warnings():
        warnings.simplefilter("error", ief.SlowPathWarning)
        return ief.per_sample(model, inputs, targets, check="exact", form=form)


class TiedLM(torch.nn.Module):
    """Embedding -> Linear -> tanh -> head whose weight is the embedding's table (no bias), per-position logits."""

    def __init__(self, vocab: int = 13, hidden: int = 5):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.mix = torch.nn.Linear(hidden, hidden)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mix(self.embed(ids))))


def _tied_lm(dtype):
    torch.manual_seed(0)
    model = TiedLM().to(dtype)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 13, (4, 6), generator=gen)
    ids[1] = ids[0]  # a repeated sample
    ids[2, :3] = 7  # a token used several times within a sample
    targets = torch.randint(0, 13, (4, 6), generator=gen)
    return model, ids, targets


def _gpt2(dtype):
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    config = GPT2Config(vocab_size=24, n_positions=16, n_embd=8, n_layer=1, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=1)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).to(dtype).eval()
    assert model.lm_head.weight is model.transformer.wte.weight
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 24, (4, 6), generator=gen)
    targets = ids.roll(-1, 1)
    targets[:, -1] = -100
    return model, {"input_ids": ids}, targets


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_a_table_tied_to_its_head_takes_no_loop(form, dtype):
    model, ids, targets = _tied_lm(DTYPES[dtype])
    result = _no_loop(model, ids, targets, form)
    assert _rel(_dense(result), _oracle(model, ids, targets)) < TOL[DTYPES[dtype]]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_gpt2_lm_head_tied_to_wte_takes_no_loop(form, dtype):
    pytest.importorskip("transformers")
    model, inputs, targets = _gpt2(DTYPES[dtype])
    result = _no_loop(model, inputs, targets, form)
    assert _rel(_dense(result), _oracle(model, inputs, targets)) < TOL[DTYPES[dtype]]


class TiedOutside(TiedLM):
    """The tied table is also used outside its hooked modules (a bare matmul): every holder goes to the loop."""

    def forward(self, ids):
        h = torch.tanh(self.mix(self.embed(ids)))
        return self.head(h) + 0.5 * (h @ self.embed.weight.T)


@pytest.mark.parametrize("form", FORMS)
def test_a_tied_table_used_outside_its_modules_takes_the_loop_exactly(form):
    torch.manual_seed(0)
    model = TiedOutside().double()
    _, ids, targets = _tied_lm(torch.float64)
    with pytest.warns(ief.SlowPathWarning, match="embed.weight|head.weight"):
        result = ief.per_sample(model, ids, targets, check="exact", form=form)
    assert _rel(_dense(result), _oracle(model, ids, targets)) < 1e-10


def test_demotion_spreads_over_tied_weights_to_a_fixed_point():
    """``y`` holds bias ``b``, ``x`` weight ``w``, ``a`` both (tied to each): demoting ``x`` demotes ``a`` (``w``),
    which demotes ``y`` (``b``), though ``b``'s holders are listed before ``w``'s; K-FAC's capture (no stand-ins)
    shares nothing."""
    from ief.jacobian.capture import PerSampleCapture as Capture

    y, x, a = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
    a.weight, a.bias = x.weight, y.bias
    model = torch.nn.Sequential(y, x, a)
    params = list(model.parameters())
    capture = Capture(model, params, stand_ins=True)
    assert [entry[0] for entry in capture.modules] == [y, x, a]
    assert list(capture.shared.items()) == [(1, [0, 2]), (2, [1, 2])]
    capture.records = {k: [] for k in range(3)}
    capture.edges = {k: [] for k in range(3)}
    capture.demote({1: "no sample axis"})
    assert capture.modules == [] and capture.shared == {} and not capture.hooked
    assert set(capture.demoted) == {0, 1, 2, 3}
    assert "tied" in capture.demoted[1] and "no sample axis" in capture.demoted[1]
    assert not Capture(model, params).shared
