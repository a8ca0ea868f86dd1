"""A steady-state optimiser step at a GPU's pace, counted on the CPU: host round-trips (each stalls the host
until a GPU drains its queue) and dispatched aten operators (each at least one kernel launch), against an AdamW step
on the same model (forward, backward, ``step``, ``zero_grad``), with :mod:`benchmarks.host_syncs`.

Budgets: a steady IEF / EF step (after the warm-up steps: step 0's exact check, first-shape caches) makes at most
2 round-trips more than AdamW's step, and 2 beyond the model's own forward (the loss's range check of the targets,
which must precede the loss, and the step's one read of every other check: the per-sample guard's finiteness of the
losses and rows, the direction's, and for a normalised update the norm; T5's forward makes 2 of its own, AdamW's CPU
step reads its step counters); the only operator that synchronises inside its CUDA call is the float32 Gram's
``eigh`` (its error check); it dispatches at most
3 times AdamW's operators. Models: the benchmarks' 3-layer MLP (784-256-256-10, M 64) and tiny T5 + LoRA (M 16).
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch

import ief
from benchmarks.host_syncs import RoundTripCounter, OperatorCounter, adamw_step_fn, count_call, steady_counts
from benchmarks.workloads import build_mlp, build_t5_lora, logits_of, summed_cross_entropy

CPU = torch.device("cpu")


def _workload(name: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_mlp(64, CPU, 0) if name == "mlp" else build_t5_lora(16, CPU, 0, "tiny")


def _forward_trips(w) -> int:
    """The round-trips of the model's own forward (T5's makes 2: the budget is counted beyond them)."""
    with torch.no_grad():
        return steady_counts(lambda: logits_of(w.model, w.inputs)).round_trips


def _adamw_counts(w):
    step = adamw_step_fn(w.model, lambda: summed_cross_entropy(logits_of(w.model, w.inputs), w.targets))
    return steady_counts(step)


def _step_counts(opt, w):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SlowPathWarning and transformers' own warnings: not what is counted
        return steady_counts(lambda: opt.step(w.inputs, w.targets))


def test_the_counters_count_every_kind_once():
    """Each host read the counter looks for, once each; the operator counter sees the aten operators."""
    x = torch.tensor([1.0, 2.0])
    trips = RoundTripCounter()
    with trips:
        bool(x[0])
        float(x[0])
        int(x[1])
        x[0].item()
        x.tolist()
        x.cpu()
        x.numpy()
        x.nonzero()
        torch.nonzero(x)
        x + 1  # not a round-trip
    assert dict(trips.counts) == {"bool": 1, "float": 1, "int": 1, "item": 1, "tolist": 1, "cpu": 1, "numpy": 1,
                                  "nonzero": 2}
    assert all(where for _, where in trips.stacks)  # the test's own frames name where
    ops = OperatorCounter()
    with ops:
        torch.mm(x[None], x[:, None]).add_(1)
    assert ops.counts["aten.mm.default"] == 1 and ops.counts["aten.add_.Tensor"] == 1
    counts = count_call(lambda: float(x.sum()))
    assert counts.round_trips == 1 and counts.kinds == {"float": 1} and counts.operators >= 1
    # what synchronises inside a CUDA call with no Python read: eigh's error check, boolean-mask indexing
    g = torch.eye(2, dtype=torch.float64)
    counts = count_call(lambda: (torch.linalg.eigh(g), x[x > 1.5], x[torch.tensor([0])]))
    assert counts.round_trips == 0
    assert counts.implicit_syncs == {"aten._linalg_eigh.default": 1, "aten.index.Tensor": 1}


@pytest.mark.parametrize("model", ["mlp", "t5-lora"])
@pytest.mark.parametrize("cls", [ief.optim.IEF, ief.optim.EF], ids=lambda k: k.__name__)
def test_a_steady_step_is_within_the_budgets(model, cls):
    """IEF (un-normalised: the norm is never read) and EF (normalised: the norm read with the checks)."""
    w = _workload(model)
    adamw = _adamw_counts(w)
    step = _step_counts(cls(w.model), w)  # the defaults (IEF's: set per batch, ief.optim.defaults)
    where = "\n".join(f"{kind}: {frames}" for kind, frames in step.where)
    own = _forward_trips(w)
    assert step.round_trips <= own + 2, f"{step.round_trips} round-trips ({step.kinds}), the forward's {own}:\n{where}"
    assert step.round_trips <= adamw.round_trips + 2
    assert step.operators <= 3 * adamw.operators, (step.operators, adamw.operators)
    # the sync inside a CUDA call that remains (what a GPU's sync debug mode will also name): the float32 Gram's eigh
    # (its error check reads info)
    assert step.implicit_syncs == {"aten._linalg_eigh.default": 1}, step.implicit_syncs


@pytest.mark.parametrize("model", ["mlp", "t5-lora"])
def test_sf_within_the_round_trip_budget(model):
    """SF (normalised) reads 4 times beyond the forward's own: the targets' range, the batch gradient's losses, the
    sampled labels' logits (one read for NaN/+inf and all -inf positions, before they are sampled from), and the
    step's checks (the guard's losses and sampled rows among them) with the norm; its extra backward costs
    operators."""
    w = _workload(model)
    adamw = _adamw_counts(w)
    step = _step_counts(ief.optim.SF(w.model), w)
    assert step.round_trips <= _forward_trips(w) + 4, (step.kinds, step.where)
    assert step.round_trips <= adamw.round_trips + 2
    assert step.operators <= 4 * adamw.operators, (step.operators, adamw.operators)


def test_kfac_between_refreshes_reads_once():
    """K-FAC between its inverse refreshes: the running factors' finiteness and the direction's are read with the
    step's one read (a refresh step also reads the factors before their eigendecomposition)."""
    w = _workload("mlp")
    linear = [p for m in w.model.modules() if isinstance(m, torch.nn.Linear) for p in m.parameters()]
    opt = ief.optim.KFAC(w.model, "iekfac", lr=0.1, damping=1e-3, params=linear, inverse_every=10)
    step = _step_counts(opt, w)  # steps 0-2 warm up, step 3 counted: no refresh
    assert step.round_trips <= 2, (step.kinds, step.where)  # the targets' range check and the step's read


def test_auto_lr_adds_no_round_trip():
    """lr="auto" (ief.optim.auto_lr): its probe forward and the new batch's two scalars are read with the step's one
    read, so the steady MLP step keeps the budget of 2 (with momentum and weight decay as well)."""
    w = _workload("mlp")
    for opt in (ief.optim.IEF(w.model, lr="auto"),  # (the per-batch default damping: no read of its own)
                ief.optim.IEF(w.model, lr="auto", damping=1e-4, momentum=0.9, weight_decay=0.01)):
        step = _step_counts(opt, w)
        assert step.round_trips <= 2, (step.kinds, step.where)
        assert opt._auto.delta is not None  # the probe ran: the step is the rule's, not the plain one


def test_momentum_and_weight_decay_add_no_round_trip():
    """Heavy-ball buffers and the decoupled decay on the device: their finiteness is read with the step's checks."""
    w = _workload("mlp")
    step = _step_counts(ief.optim.IEF(w.model, lr=1.0, damping=1e-4, momentum=0.9, weight_decay=0.01), w)
    assert step.round_trips <= 2, (step.kinds, step.where)


@pytest.mark.parametrize("model", ["mlp", "t5-lora"])
def test_the_per_batch_default_reads_no_more_than_an_explicit_rate(model):
    """``IEF(model)``'s rate and damping are set from the batch's counted targets per sample (ief.optim.defaults),
    whose count is read with the loss's range check of the targets: a default step makes the reads of an explicit
    rate and damping, 2 beyond the forward's own (the range check with the count, the step's checks)."""
    w = _workload(model)
    explicit = _step_counts(ief.optim.IEF(w.model, lr=0.3, damping=1e-4), w)
    default = _step_counts(ief.optim.IEF(w.model), w)
    assert default.round_trips == explicit.round_trips == _forward_trips(w) + 2, (default.kinds, default.where)


@pytest.mark.parametrize("cls", [ief.optim.IEF, ief.optim.EF, ief.optim.SF], ids=lambda k: k.__name__)
def test_a_non_finite_batch_still_raises_in_the_steady_state(cls):
    """The checks are read once per step, not skipped: after warm-up steps a batch with an inf input (tanh keeps the
    losses finite, the rows are NaN) raises the per-sample guard's ``FloatingPointError`` naming that step and the
    sample, and the parameters and step counter are as they were."""
    w = _workload("mlp")
    opt = cls(w.model)
    for _ in range(3):
        opt.step(w.inputs, w.targets)
    before = [p.detach().clone() for p in w.model.parameters()]
    bad = w.inputs.clone()
    bad[5, 3] = math.inf
    with pytest.raises(FloatingPointError,
                       match=r"^step 3: non-finite per-sample gradient for samples \[5\] .*parameters left unchanged$"):
        opt.step(bad, w.targets)
    assert all(torch.equal(p, q) for p, q in zip(w.model.parameters(), before)) and opt.steps_taken == 3


def test_last_update_norm_is_read_when_asked():
    """``last_update_norm`` stays on the device until read, and is then the update's norm (float)."""
    w = _workload("mlp")
    opt = ief.optim.IEF(w.model, lr=0.5)
    theta = torch.cat([p.detach().reshape(-1) for p in w.model.parameters()])
    opt.step(w.inputs, w.targets)
    moved = torch.cat([p.detach().reshape(-1) for p in w.model.parameters()]) - theta
    assert isinstance(opt.last_update_norm, float)
    assert math.isclose(opt.last_update_norm, float(moved.norm()), rel_tol=1e-4)
