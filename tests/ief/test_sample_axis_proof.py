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


# A first batch that routes exactly one token of every sample to every expert: each expert's rows are the samples, in
# order, so the proof passes there. A later batch of the same shapes routes two tokens of sample 1 to expert 1 and
# none of sample 2 (each expert still gets M tokens: the same shapes, the same cache key).
LUCKY = [[0, 1], [1, 0], [0, 1], [1, 0]]
UNEVEN = [[0, 1], [1, 1], [0, 0], [1, 0]]


def _rel(got, ref) -> float:
    return float((got.double() - ref).norm() / ref.norm())


def test_a_lucky_first_batch_does_not_prove_a_router_for_later_batches():
    """The proof of a lucky first batch holds for that batch only: its experts read rows the data selected
    (``flat[idx]``), so the model is proven again on every batch, and the unevenly routed batch of the same shapes
    is exact with the default check (its experts take the loop)."""
    _every_batch_exact(GatherMoE, lambda model, batch, y: oracle.per_sample(model, batch, y)[1])


def _every_batch_exact(router, reference) -> None:
    """A lucky batch, an unevenly routed one of the same shapes, twice over: each call's J (default check) within
    1e-10 of ``reference(model, batch, y)``, float64."""
    torch.manual_seed(0)
    model = router().double()
    y = torch.tensor([0, 1, 2, 0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowPathWarning)
        for routes in (LUCKY, UNEVEN, LUCKY, UNEVEN):
            batch = _routed(routes)
            assert _rel(ief.per_sample(model, batch, y).jacobian, reference(model, batch, y)) < 1e-10, routes


@pytest.mark.parametrize("check", [True, 2])
def test_iEF_steps_on_a_router_are_exact_after_a_lucky_first_batch(check):
    """``IEF()`` and ``IEF(check=2)``: the step on the unevenly routed batch, after a step on the lucky one, is the
    dense float64 formula ``-lr J^T (J J^T + lambda I)^{-1} s`` with the oracle's ``J`` and ``s``."""
    torch.manual_seed(0)
    model = GatherMoE().double()
    y = torch.tensor([0, 1, 2, 0])
    lr, damping = 0.5, 1e-3
    opt = ief.optim.IEF(model, lr=lr, damping=damping, check=check)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowPathWarning)
        opt.step(_routed(LUCKY), y)
        batch = _routed(UNEVEN)
        _, jac, s = oracle.per_sample(model, batch, y)
        expected = -lr * jac.T @ torch.linalg.solve(jac @ jac.T + damping * torch.eye(len(s), dtype=torch.float64), s)
        before = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        opt.step(batch, y)
    after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert _rel(after - before, expected) < 1e-8


class DispatchMoE(GatherMoE):
    """:class:`GatherMoE` with Switch-style dispatch: the tokens reach the experts through a one-hot dispatch tensor
    (``einsum``), ``M`` slots per expert in token order (tokens beyond them dropped, as Switch does), rows no indexing
    selects (:mod:`ief.jacobian.routing` sees the contraction over the batch's rows). A sample run alone has one slot
    per expert, so its per-sample gradients are those of its loss in the batch (:func:`_in_batch_oracle`)."""

    def contract(self, equation: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.einsum(equation, a, b)

    def forward(self, x):
        h = x + 0.1 * torch.tanh(self.inp(x))
        probs = torch.softmax(self.router(h), dim=-1)
        onehot = torch.nn.functional.one_hot(x[..., 0].long().reshape(-1), E).to(h.dtype)  # [S, E]
        slot = ((onehot.cumsum(0) - 1) * onehot).long()  # each token's slot in its expert, in token order
        slots = torch.nn.functional.one_hot(slot.clamp(max=x.shape[0]), x.shape[0] + 1)[..., :-1]  # beyond: dropped
        dispatch = onehot[:, :, None] * slots.to(h.dtype)  # [S, E, M]
        flat, pflat = h.reshape(-1, D), probs.reshape(-1, E)
        slots = self.contract("sec,sd->ecd", dispatch, flat)
        outs = torch.stack([torch.tanh(expert(slots[e])) for e, expert in enumerate(self.experts)])
        out = self.contract("sec,ecd->sd", dispatch, outs) * (pflat * onehot).sum(-1, keepdim=True)
        return self.head((h + out.reshape(h.shape)).mean(dim=1))


class TensordotDispatchMoE(DispatchMoE):
    """:class:`DispatchMoE` dispatching and combining by ``tensordot``, which the routing tracker does not read."""

    def contract(self, equation: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        dims = ([0], [0]) if equation == "sec,sd->ecd" else ([1, 2], [0, 1])
        return torch.tensordot(a, b, dims=dims)


def _in_batch_oracle(model, x, y) -> torch.Tensor:
    """``J [M, P]``: row ``n`` the gradient of sample ``n``'s loss in the batch forward (autograd, one backward per
    sample, float64; nothing of the package)."""
    losses = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
    params = [p for p in model.parameters() if p.requires_grad]
    rows = [torch.cat([g.reshape(-1) for g in torch.autograd.grad(losses[n], params, retain_graph=True)])
            for n in range(len(y))]
    return torch.stack(rows)


def test_a_failed_exact_check_forgets_the_proof_it_disproved():
    """Routing by a dispatch matrix through ``tensordot`` is not seen by the routing tracker: the lucky batch's proof
    is cached. On the unevenly routed batch the exact check refuses; the refusal forgets the model's proven axes, so
    the next call (default check) proves that batch's axes again and is exact."""
    torch.manual_seed(0)
    model = TensordotDispatchMoE().double()
    y = torch.tensor([0, 1, 2, 0])
    lucky, uneven = _routed(LUCKY), _routed(UNEVEN)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowPathWarning)
        got = ief.per_sample(model, lucky, y, check="exact")
        assert _rel(got.jacobian, _in_batch_oracle(model, lucky, y)) < 1e-10
        with pytest.raises(ief.jacobian.PerSampleGradientMismatch, match="disagree with their exact"):
            ief.per_sample(model, uneven, y, check="exact")
        got = ief.per_sample(model, uneven, y)
    assert _rel(got.jacobian, _in_batch_oracle(model, uneven, y)) < 1e-10


def test_a_dispatch_router_is_proven_on_every_batch():
    """Switch-style dispatch (a one-hot dispatch tensor from the router's choice, ``einsum("sec,sd->ecd", ...)``)
    selects rows by arithmetic: the routing tracker sees the contraction over the batch's rows, so the lucky batch's
    proof is not reused for the unevenly routed batch of the same shapes, and every call is exact with the default
    check (before, the second call reused the lucky batch's axes: J 10-70 % off, silently)."""
    _every_batch_exact(DispatchMoE, _in_batch_oracle)


def test_a_contraction_that_keeps_the_rows_is_not_routing():
    """The tracker's contraction rule marks a sum over the batch's rows only: a one-hot contraction over positions
    (``"bte,btd->bed"``, each sample's tokens pooled per class) and a weight times the tokens are not routing (a
    model doing only these is proven once); the same one-hot summed over the flattened tokens is, by ``einsum`` or
    ``@``."""
    from ief.jacobian.routing import RoutingTracker

    x = torch.randn(M, T, D, dtype=torch.float64)
    w = torch.randn(D, D, dtype=torch.float64)
    with RoutingTracker(x) as tracker:
        onehot = torch.nn.functional.one_hot(x[..., 0].abs().long() % E, E).to(x.dtype)  # chosen by the data
        pooled = torch.einsum("bte,btd->bed", onehot, x)
        projected = x.reshape(-1, D) @ w
        dispatched = torch.einsum("se,sd->ed", onehot.reshape(-1, E), x.reshape(-1, D))
        mixed = onehot.reshape(-1, E).T @ x.reshape(-1, D)
    assert not tracker.is_routed(pooled) and not tracker.is_routed(projected)
    assert tracker.is_routed(dispatched) and tracker.is_routed(mixed)
