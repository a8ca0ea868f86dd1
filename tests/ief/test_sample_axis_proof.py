"""The sample axis of a hooked call is proven, never guessed from its size.

A mixture of experts that calls its ``nn.Linear`` experts on tokens gathered from the flattened batch
(``hidden.reshape(-1, d)[idx]``) gives an expert an input ``[k, d]``, ``k`` the tokens routed to it. When the batch
routes exactly ``k = M`` tokens to an expert and sample 0 alone routes 1, the one-sample probe's size test passes for
dimension 0, and filling ``J`` token by token would be silently wrong (the rows still sum to the batch gradient). The
proof (a probe forward of the batch in reverse order, whose calls must be the batch's calls reversed along the
axis) refuses that axis; the experts' rows come from the exact per-sample loop. Held to the dense float64 oracle.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import ief
from ief.jacobian import SlowPathWarning
from tests import oracle

M, T, D, E, C = 4, 2, 6, 2, 3
# the expert each token is routed to: expert 1 gets 1 + 2 + 1 + 0 = 4 = M tokens, expert 0 gets 1 + 0 + 1 + 2 = 4
ROUTES = [[0, 1], [1, 1], [1, 0], [0, 0]]


class GatherMoE(torch.nn.Module):
    """Embedding-free MoE block: a router (``nn.Linear``), ``E`` ``nn.Linear`` experts called on the gathered tokens
    routed to them (top-1, gated by the router's probability), then a head on the mean over tokens."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(D, D)
        self.router = torch.nn.Linear(D, E, bias=False)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(D, D) for _ in range(E))
        self.head = torch.nn.Linear(D, C)

    def forward(self, x):
        h = x + 0.1 * torch.tanh(self.inp(x))
        probs = torch.softmax(self.router(h), dim=-1)  # [M, T, E]
        choice = x[..., 0].long()  # routing fixed by the input's first feature (the tokens' expert)
        flat, pflat, cflat = h.reshape(-1, D), probs.reshape(-1, E), choice.reshape(-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            idx = torch.nonzero(cflat == e).squeeze(-1)
            if idx.numel():
                out = out.index_add(0, idx, pflat[idx, e : e + 1] * torch.tanh(expert(flat[idx])))
        h = h + out.reshape(h.shape)
        return self.head(h.mean(dim=1))


def _batch(dtype=torch.float64):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(M, T, D, generator=gen, dtype=dtype)
    x[..., 0] = torch.tensor(ROUTES, dtype=dtype)
    y = torch.randint(0, C, (M,), generator=gen)
    return x, y


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_gathered_tokens_are_not_a_sample_axis(dtype):
    torch.manual_seed(0)
    model = GatherMoE().to(dtype)
    x, y = _batch(dtype)
    counts = [sum(r.count(e) for r in ROUTES) for e in range(E)]
    assert counts == [M] * E and ROUTES[0].count(1) == 1  # the case the size test alone gets wrong
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = ief.per_sample(model, x, y, check=True)
    _, ref, _ = oracle.per_sample(model.double(), x.double(), y)
    model.to(dtype)
    err = (got.jacobian.double() - ref).norm() / ref.norm()
    assert err < (1e-10 if dtype == torch.float64 else 1e-5), err
    slow = [str(w.message) for w in seen if issubclass(w.category, SlowPathWarning)]
    assert slow and "experts.0.weight" in slow[0] and "reverse" in slow[0], slow


def test_exact_check_passes_on_gathered_tokens():
    torch.manual_seed(0)
    model = GatherMoE().double()
    x, y = _batch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowPathWarning)
        ief.per_sample(model, x, y, check="exact")


def _routed(routes, dtype=torch.float64):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(len(routes), len(routes[0]), D, generator=gen, dtype=dtype)
    x[..., 0] = torch.tensor(routes, dtype=dtype)
    return x


def test_a_model_that_routes_is_not_trusted_on_a_lucky_batch():
    """After a batch that shows the gather, a batch of other shapes that routes exactly one token per sample to
    expert 1 (the proof passes there, the hooked rows would be right for it) does not make expert 1 hooked for a
    later batch of the same shapes routed otherwise (expert 1: 1 + 2 + 1 + 0 tokens)."""
    torch.manual_seed(0)
    model = GatherMoE().double()
    x, y = _batch()
    lucky = _routed([[0, 1, 0], [1, 0, 0], [0, 0, 1], [0, 1, 0]])
    uneven = _routed([[0, 1, 0], [1, 1, 0], [0, 0, 1], [0, 0, 0]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowPathWarning)
        for batch in (x, lucky, uneven):
            got = ief.per_sample(model, batch, y, check=True)
            _, ref, _ = oracle.per_sample(model, batch, y)
            assert (got.jacobian - ref).norm() / ref.norm() < 1e-10


class NoisyMoE(GatherMoE):
    """:class:`GatherMoE` in training: dropout and a router-style ``uniform_`` jitter on the features (not on the
    routing feature)."""

    def forward(self, x):
        rest = torch.nn.functional.dropout(x[..., 1:], 0.2, self.training)
        rest = rest * torch.empty_like(rest).uniform_(0.9, 1.1)
        return super().forward(torch.cat([x[..., :1], rest], dim=-1))


def test_dropout_and_jitter_do_not_demote_layers_with_a_sample_axis():
    """In training mode (dropout, a jitter drawn with ``uniform_``) the proof's forwards run without randomness: the
    layers with a sample axis stay hooked, only the experts take the loop."""
    torch.manual_seed(0)
    model = NoisyMoE().double().train()
    x, y = _batch()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ief.per_sample(model, x, y, check=True)
    slow = " ".join(str(w.message) for w in seen if issubclass(w.category, SlowPathWarning))
    assert "experts.0.weight" in slow and "inp.weight" not in slow and "head.weight" not in slow, slow
