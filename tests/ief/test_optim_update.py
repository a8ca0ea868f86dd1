"""The update as a function (:func:`ief.optim.preconditioned_update`), called without any optimiser class and held to
a plain-torch float64 reference of its formula: heavy-ball momentum with dampening, decoupled weight decay (one value
per parameter), the linear decay ``1 - t/T``, the normalised update, the batch factor, a 16-bit parameter's single
rounding; refusals before anything changes; its checks read with the caller's in one host round-trip
(:class:`ief.optim.checks.StepChecks`); and an optimiser-free loop equal to :class:`ief.optim.IEF` bit for bit."""
from __future__ import annotations

import math

import pytest
import torch
from tiny_models import mlp_case
from torch.overrides import TorchFunctionMode

import ief
from ief.optim import preconditioned_update
from ief.optim.checks import StepChecks

SHAPES = [(3, 4), (4,), (2, 3)]


def _params(dtype=torch.float64, seed=0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=torch.float64).to(dtype) for s in SHAPES]


def _directions(steps: int, seed=1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = sum(math.prod(s) for s in SHAPES)
    return [torch.randn(p, generator=g, dtype=torch.float64) for _ in range(steps)]


def _reference(params, directions, lr, momentum, dampening, wd, normalize, total_steps, factor):
    """The formula of :mod:`ief.optim.update`, written out in float64 for flat vectors."""
    theta = torch.cat([p.reshape(-1) for p in params]).clone()
    decay = torch.cat([torch.full((p.numel(),), w, dtype=torch.float64) for p, w in zip(params, wd)])
    buffer = None
    for t, d in enumerate(directions):
        eta = lr * (max(0.0, 1.0 - t / total_steps) if total_steps else 1.0)
        u = factor * d / (d.norm() if normalize else 1.0)
        if momentum:
            buffer = u.clone() if buffer is None else momentum * buffer + (1 - dampening) * u
            step = buffer
        else:
            step = u
        theta = (1 - eta * decay) * theta - eta * step
    return theta


@pytest.mark.parametrize("momentum, dampening", [(0.0, 0.0), (0.9, 0.0), (0.5, 0.5)])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("total_steps", [None, 3])
@pytest.mark.parametrize("factor", [1.0, 0.25])
def test_the_update_is_its_formula(momentum, dampening, normalize, total_steps, factor):
    params, directions = _params(), _directions(4)
    wd = [0.1, 0.0, 0.02]
    state: dict = {}
    for d in directions:
        preconditioned_update(params, d, state, lr=0.3, momentum=momentum, dampening=dampening, weight_decay=wd,
                              normalize=normalize, total_steps=total_steps, batch_factor=factor)
    want = _reference(_params(), directions, 0.3, momentum, dampening, wd, normalize, total_steps, factor)
    got = torch.cat([p.reshape(-1) for p in params])
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-14)
    assert all(state[p]["step"] == 4 for p in params)
    assert all(("momentum_buffer" in state[p]) == bool(momentum) for p in params)


def test_a_zero_direction_normalised_is_a_zero_step_and_the_rate_is_the_norm():
    params = _params()
    before = [p.clone() for p in params]
    update = preconditioned_update(params, torch.zeros(sum(p.numel() for p in params), dtype=torch.float64), {},
                                   lr=0.5, normalize=True)
    assert update.size == 0.0 and update.norm == 0.0
    assert all(torch.equal(p, q) for p, q in zip(params, before))
    d = _directions(1)[0]
    update = preconditioned_update(params, d, {}, lr=0.5, normalize=True)
    change = torch.cat([(q - p).reshape(-1) for p, q in zip(params, before)])
    assert math.isclose(float(change.norm()), 0.5, rel_tol=1e-12) and math.isclose(update.norm, 0.5, rel_tol=1e-12)


def test_a_16_bit_parameter_is_updated_in_float32_and_rounded_once():
    params = _params(torch.bfloat16)
    d = _directions(1)[0].to(torch.float32)
    want = [(p.float() * (1 - 0.1 * 0.05) - 0.1 * c.view(p.shape)).to(torch.bfloat16)
            for p, c in zip(params, torch.split(d, [p.numel() for p in params]))]
    preconditioned_update(params, d, {}, lr=0.1, weight_decay=0.05)
    assert all(torch.equal(p, w) for p, w in zip(params, want))


def test_the_change_kept_is_the_parameters_change():
    params = _params()
    before = torch.cat([p.reshape(-1) for p in params]).clone()
    state: dict = {}
    for d in _directions(3):
        update = preconditioned_update(params, d, state, lr=0.2, momentum=0.9, weight_decay=[0.1, 0.0, 0.3],
                                       keep_change=True)
        after = torch.cat([p.reshape(-1) for p in params])
        kept = torch.cat([c.reshape(-1) for c in update.change])
        assert torch.allclose(kept, before - after, rtol=1e-12, atol=1e-15)
        before = after.clone()


@pytest.mark.parametrize("what", ["direction", "buffer", "caller"])
def test_a_failed_check_raises_before_anything_changes(what):
    params = _params()
    state: dict = {}
    preconditioned_update(params, _directions(1)[0], state, lr=0.1, momentum=0.5)
    before = [p.clone() for p in params]
    buffers = [state[p]["momentum_buffer"].clone() for p in params]
    d = _directions(1, seed=5)[0]
    checks = StepChecks(7)
    if what == "direction":
        d[2] = math.nan
        message = r"^step 7: non-finite update direction; parameters left unchanged$"
    elif what == "buffer":
        state[params[1]]["momentum_buffer"] = torch.full((4,), math.inf, dtype=torch.float64)
        buffers[1] = state[params[1]]["momentum_buffer"]
        message = r"^step 7: non-finite momentum buffer; parameters left unchanged$"
    else:
        checks.add(torch.tensor(False), lambda: "the caller's own check")
        message = r"^step 7: the caller's own check; parameters left unchanged$"
    with pytest.raises(FloatingPointError, match=message):
        preconditioned_update(params, d, state, lr=0.1, momentum=0.5, checks=checks)
    assert all(torch.equal(p, q) for p, q in zip(params, before))
    assert all(torch.equal(state[p]["momentum_buffer"], b) for p, b in zip(params, buffers))
    assert all(state[p]["step"] == 1 for p in params)


class _Reads(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__float__):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_the_checks_and_the_norm_are_read_with_the_callers_in_one_round_trip():
    params = _params()
    checks = StepChecks(0)
    checks.add(lambda: torch.tensor(True), "asked at the read")  # a deferred flag: a function, asked late
    where = checks.also_read(torch.tensor(2.5, dtype=torch.float64))
    with _Reads() as reads:
        update = preconditioned_update(params, _directions(1)[0], {}, lr=lambda: (0.1, 0.1), normalize=True,
                                       checks=checks)  # a rate set from what the read returned
    assert reads.count == 1 and checks.values(where) == [2.5]
    assert math.isclose(update.norm, 0.1, rel_tol=1e-12)


def test_an_optimiser_free_loop_is_ief_bit_for_bit():
    """The per-sample rows, the exact iEF solve and the update, with no optimiser: the steps of ``IEF`` with momentum,
    weight decay and a decay schedule, bit for bit."""
    import copy

    c = mlp_case()
    reference = ief.optim.IEF(c.model, lr=0.5, damping=1e-3, momentum=0.9, weight_decay=0.01, total_steps=5)
    model = copy.deepcopy(c.model)
    params = [p for p in model.parameters() if p.requires_grad]
    state: dict = {}
    for _ in range(3):
        reference.step(c.inputs, c.targets)
        r = ief.per_sample(model, c.inputs, c.targets, check=False, form="auto")  # the optimiser's default form
        d = ief.ief_direction(r.jacobian, r.logit_sqnorm, 1e-3)
        preconditioned_update(params, d, state, lr=0.5, momentum=0.9, weight_decay=0.01, total_steps=5)
    assert all(torch.equal(p, q) for p, q in zip(params, c.model.parameters()))


def test_the_first_failed_check_is_named_in_the_order_added():
    checks = StepChecks(3)
    checks.add(torch.tensor(True), "fine")
    checks.add(torch.tensor(False), "the first failure")
    checks.add(lambda: torch.tensor(False), lambda: "a later one")
    with pytest.raises(FloatingPointError, match=r"^step 3: the first failure; parameters left unchanged$"):
        checks.read()
    with pytest.raises(RuntimeError, match="already read"):
        checks.add(torch.tensor(True), "too late")
