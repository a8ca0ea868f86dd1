"""Momentum and decoupled weight decay of ``ief.optim.IEF`` / ``EF`` / ``SF`` (beyond ``sec:app-limitations``).

The update (:mod:`ief.optim.momentum`): ``u_t = c_t d_t`` (``d_t`` the exact direction of batch ``t``, ``c_t`` its
factor: ``1/||d_t||`` when normalised, the token conversion with ``reduction="mean"``), ``b_1 = u_1``,
``b_t = mu b_{t-1} + (1 - tau) u_t``, ``theta <- (1 - eta_t wd_g) theta - eta_t b_t`` with ``eta_t = lr_t (1 - t/T)``.

Oracle: a hand-written float64 loop of that sequence on dense per-sample quantities from ``tests/oracle.py``
(explicit per-sample loops), with the dense formulas of ``eqn:iEF_lsq`` / ``eqn:EF_lsq`` / ``eqn:SF-smw``; float64
runs agree to ``1e-9`` relative, float32 runs to ``2e-3`` (six steps of rounding, a normalisation and momentum).
"""
from __future__ import annotations

import copy
import io
import math

import pytest
import torch

import ief
import oracle
from tiny_models import mlp_case, sequence_case, t5_lora_case
from ief.jacobian import gradient_and_sampled_jacobian

CLASSES = {"ief": ief.optim.IEF, "ef": ief.optim.EF, "sf": ief.optim.SF}


@pytest.fixture(autouse=True)
def _single_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def trainable(model) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in trainable(model)]).clone()


def cast(case, dtype):
    def to(x):
        if isinstance(x, dict):
            return {k: to(v) for k, v in x.items()}
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.dtype.is_floating_point else x
    case.model.to(dtype)
    case.inputs, case.targets = to(case.inputs), to(case.targets)
    return case


def two_groups(model, wd0: float, wd1: float) -> list[dict]:
    """The trainable parameters, in model order, split in two groups with their own weight decay."""
    params = trainable(model)
    half = len(params) // 2
    return [{"params": params[:half], "weight_decay": wd0}, {"params": params[half:], "weight_decay": wd1}]


def tokens_of(targets) -> int:
    return targets.numel() if targets.dtype.is_floating_point else int((targets != -100).sum())


# ------------------------------------------------------------------------------------ the hand-written float64 loop
def reference_run(case, method, *, lr, lrs, damping, momentum, dampening, wds, normalize, total_steps, reduction,
                  steps, seed=5):
    """The update sequence in float64, written out: ``lrs[t]`` is the scheduler's factor at step ``t``; ``wds``
    the two groups' weight decays (split as :func:`two_groups`). Returns ``theta_t - theta_0`` for every step."""
    model = copy.deepcopy(case.model).double()
    inputs = {k: v.double() if v.is_floating_point() else v for k, v in case.inputs.items()} \
        if isinstance(case.inputs, dict) else (case.inputs.double() if case.inputs.is_floating_point()
                                               else case.inputs)
    params = trainable(model)
    half = len(params) // 2
    wd = torch.cat([torch.full((p.numel(),), wds[0] if i < half else wds[1], dtype=torch.float64)
                    for i, p in enumerate(params)])
    generator = torch.Generator().manual_seed(seed)
    theta0, buf, out = flat(model), None, []
    for t in range(steps):
        losses, jac, s = oracle.per_sample(model, inputs, case.targets, case.loss)
        k = tokens_of(case.targets)
        lam = damping * k * k if reduction == "mean" else damping
        if method == "sf":
            a = ief.sampled_jacobian(model, inputs, case.targets, generator).double()
            d = torch.linalg.solve(a.T @ a + lam * torch.eye(a.shape[1], dtype=torch.float64), jac.sum(0))
        else:
            rhs = s if method == "ief" else torch.ones_like(s)
            d = jac.T @ torch.linalg.solve(jac @ jac.T + lam * torch.eye(len(s), dtype=torch.float64), rhs)
        c = 1.0
        if normalize:
            c = 1.0 / float(d.norm())
        elif reduction == "mean":
            c = 1.0 / k if method == "ief" else float(k)
        u = c * d
        buf = u.clone() if buf is None else momentum * buf + (1.0 - dampening) * u
        eta = lr * lrs[t] * (max(0.0, 1.0 - t / total_steps) if total_steps else 1.0)
        theta = (1.0 - eta * wd) * flat(model) - eta * buf
        with torch.no_grad():
            for p, v in zip(params, torch.split(theta, [p.numel() for p in params])):
                p.copy_(v.view(p.shape))
        out.append(theta - theta0)
    return out


SEQUENCES = [  # (make, method, reduction, normalize, total_steps, momentum, dampening, wds, lr, damping)
    (mlp_case, "ief", "sum", False, None, 0.9, 0.0, (0.05, 0.0), 0.3, 1e-3),
    (sequence_case, "ief", "mean", False, None, 0.5, 0.5, (0.01, 0.2), 2.0, 1e-4),
    (mlp_case, "ef", "sum", True, 4, 0.9, 0.1, (0.1, 0.0), 0.05, 1e-3),
    (sequence_case, "ef", "mean", False, None, 0.7, 0.0, (0.0, 0.03), 0.02, 1e-3),
    (mlp_case, "sf", "sum", True, 6, 0.8, 0.0, (0.0, 0.5), 0.05, 1e-2),
    (sequence_case, "sf", "mean", False, None, 0.6, 0.3, (0.02, 0.02), 0.01, 1e-2),
]
LR_FACTORS = [1.0, 0.5, 0.25, 1.0, 2.0, 0.0]  # a LambdaLR schedule (a zero-rate step at the end)


@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-9), (torch.float32, 2e-3)], ids=["f64", "f32"])
@pytest.mark.parametrize("spec", SEQUENCES, ids=lambda s: f"{s[1]}-{s[2]}-{s[0].__name__}")
def test_update_sequence_equals_the_hand_written_loop(spec, dtype, rtol):
    """Six steps, two parameter groups with their own weight decay, a ``LambdaLR`` changing the rate: every
    ``theta_t - theta_0`` equals the float64 loop's; ``last_update_norm`` is ``eta_t ||b_t||``."""
    make, method, reduction, normalize, total, mu, tau, wds, lr, damping = spec
    ref = reference_run(make(), method, lr=lr, lrs=LR_FACTORS, damping=damping, momentum=mu, dampening=tau,
                        wds=wds, normalize=normalize, total_steps=total, reduction=reduction, steps=len(LR_FACTORS))
    case = cast(make(), dtype)
    kwargs = dict(generator=torch.Generator().manual_seed(5)) if method == "sf" else {}
    opt = CLASSES[method](case.model, lr=lr, damping=damping, params=two_groups(case.model, *wds),
                          reduction=reduction, normalize=normalize, total_steps=total, momentum=mu, dampening=tau,
                          **kwargs)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: LR_FACTORS[min(k, len(LR_FACTORS) - 1)])
    theta0 = flat(case.model)
    for t, expected in enumerate(ref):
        opt.step(case.inputs, case.targets)
        got = (flat(case.model) - theta0).double()
        err = float((got - expected).norm() / expected.norm())
        assert err <= rtol, f"step {t}: relative error {err:.2e} > {rtol:.0e}"
        eta = opt.param_groups[0]["lr"] * (max(0.0, 1 - t / total) if total else 1.0)
        buffers = [opt.state[p]["momentum_buffer"] for p in trainable(case.model)]
        assert [b.shape for b in buffers] == [p.shape for p in trainable(case.model)]
        assert math.isclose(opt.last_update_norm, eta * math.sqrt(sum(float(b.norm()) ** 2 for b in buffers)),
                            rel_tol=1e-6, abs_tol=0.0)
        sched.step()
    assert [g["weight_decay"] for g in opt.param_groups] == list(wds)
    assert opt.steps_taken == len(LR_FACTORS)


def test_momentum_changes_the_update_and_weight_decay_shrinks_every_weight():
    """Not a no-op: a second step with momentum differs from the momentum-free one by ``mu eta b_1``; weight decay
    alone (momentum 0) is ``(1 - lr wd) theta - lr d``."""
    plain, heavy = mlp_case(), mlp_case()
    a = ief.optim.IEF(plain.model, lr=0.3, damping=1e-3)
    b = ief.optim.IEF(heavy.model, lr=0.3, damping=1e-3, momentum=0.9)
    theta0 = flat(plain.model)
    a.step(plain.inputs, plain.targets)
    b.step(heavy.inputs, heavy.targets)
    assert torch.equal(flat(plain.model), flat(heavy.model))  # b_1 = u_1: the first step is the same
    first = flat(heavy.model) - theta0
    before = flat(heavy.model)
    a.step(plain.inputs, plain.targets)
    b.step(heavy.inputs, heavy.targets)
    plain_step = flat(plain.model) - before
    torch.testing.assert_close(flat(heavy.model) - before, plain_step + 0.9 * first, rtol=1e-10, atol=0)

    c = mlp_case()
    theta = flat(c.model)
    r = ief.per_sample(c.model, c.inputs, c.targets)
    d = ief.ief_direction(r.jacobian, r.logit_sqnorm, 1e-3)
    ief.optim.IEF(c.model, lr=0.3, damping=1e-3, weight_decay=0.1).step(c.inputs, c.targets)
    torch.testing.assert_close(flat(c.model), (1 - 0.03) * theta - 0.3 * d, rtol=1e-10, atol=0)


# ------------------------------------------------------------------- momentum=0, weight_decay=0 is today's update
def todays_run(case, method, lr, damping, reduction, normalize, total_steps, steps):
    """The update as it was before momentum existed, written out with the same library calls and the same
    arithmetic: ``p.add_(d, alpha=-size)``, ``size = lr (1 - t/T) [/ ||d||]``, rates converted per batch."""
    from ief.optim.convention import to_sum_convention

    model, params = case.model, trainable(case.model)
    generator = torch.Generator().manual_seed(5)
    out = []
    for t in range(steps):
        lr_t, lam = lr, damping
        if reduction == "mean":
            lr_t, lam = to_sum_convention(method, lr, damping, tokens_of(case.targets), normalized=normalize)
        check = "exact" if t == 0 else True
        with torch.enable_grad():
            if method == "sf":
                _, grad, a = gradient_and_sampled_jacobian(model, case.inputs, case.targets, params,
                                                           loss=case.loss, generator=generator, check=check,
                                                           form="auto")
                d = ief.sf_direction(a, grad, lam)
            else:
                r = ief.per_sample(model, case.inputs, case.targets, params, loss=case.loss, check=check, form="auto")
                d = ief.ief_direction(r.jacobian, r.logit_sqnorm, lam) if method == "ief" else \
                    ief.ef_direction(r.jacobian, lam)
        norm = float(d.norm())
        size = lr_t
        if total_steps is not None:
            size *= max(0.0, 1.0 - t / total_steps)
        if normalize:
            size = size / norm if norm > 0 else 0.0
        with torch.no_grad():
            for p, chunk in zip(params, torch.split(d, [p.numel() for p in params])):
                p.add_(chunk.view(p.shape), alpha=-size)
        out.append((flat(model), abs(size) * norm))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("make", [mlp_case, sequence_case, t5_lora_case], ids=["mlp", "sequence", "t5-lora"])
@pytest.mark.parametrize("method,normalize,total", [("ief", False, None), ("ef", True, 3), ("sf", False, None)])
def test_zero_momentum_and_weight_decay_is_todays_update_bit_for_bit(make, reduction, dtype, method, normalize,
                                                                     total):
    """Three steps with ``momentum=0, dampening=0, weight_decay=0`` given explicitly: parameters and
    ``last_update_norm`` bit-identical to the update written as it was; no momentum buffer is kept."""
    ref = cast(make(), dtype)
    expected = todays_run(ref, method, 0.3 if method == "ief" else 0.05, 1e-3, reduction, normalize, total, 3)
    case = cast(make(), dtype)
    kwargs = dict(generator=torch.Generator().manual_seed(5)) if method == "sf" else {}
    opt = CLASSES[method](case.model, lr=0.3 if method == "ief" else 0.05, damping=1e-3, reduction=reduction,
                          normalize=normalize, total_steps=total, momentum=0, dampening=0.0, weight_decay=0.0,
                          **kwargs)
    for t, (theta, norm) in enumerate(expected):
        opt.step(case.inputs, case.targets)
        assert torch.equal(flat(case.model), theta), f"step {t}: not bit-identical"
        assert opt.last_update_norm == norm
    assert all("momentum_buffer" not in opt.state[p] for p in trainable(case.model))


# ------------------------------------------------------------------------------- state_dict: a run split in two
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("method", ["ief", "ef", "sf"])
def test_a_run_split_by_state_dict_equals_the_unsplit_run_bit_for_bit(method, dtype):
    """Six steps in one go, and three steps, ``torch.save`` of the model, optimiser and scheduler states, a fresh
    model / optimiser (other hyper-parameters) / scheduler loading them, three more: the same bits."""
    def build(model, **overrides):
        kwargs = dict(lr=0.3 if method == "ief" else 0.05, damping=1e-3, momentum=0.9, dampening=0.1,
                      params=two_groups(model, 0.05, 0.0), total_steps=8 if method != "ief" else None)
        if method == "sf":
            kwargs["generator"] = torch.Generator().manual_seed(3)
        kwargs.update(overrides)
        opt = CLASSES[method](model, **kwargs)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    whole = cast(sequence_case(), dtype)
    opt, sched = build(whole.model)
    for _ in range(6):
        opt.step(whole.inputs, whole.targets)
        sched.step()

    first = cast(sequence_case(), dtype)
    opt, sched = build(first.model)
    for _ in range(3):
        opt.step(first.inputs, first.targets)
        sched.step()
    saved = io.BytesIO()
    torch.save({"model": first.model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, saved)
    saved.seek(0)
    state = torch.load(saved)

    second = cast(sequence_case(seed=1), dtype)  # other weights, overwritten by the checkpoint
    second.model.load_state_dict(state["model"])
    opt, sched = build(second.model, momentum=0.1, dampening=0.0, lr=1.0)
    opt.load_state_dict(state["opt"])
    sched.load_state_dict(state["sched"])
    assert opt.param_groups[0]["momentum"] == 0.9 and opt.param_groups[0]["dampening"] == 0.1
    assert [g["weight_decay"] for g in opt.param_groups] == [0.05, 0.0]
    for _ in range(3):
        opt.step(whole.inputs, whole.targets)
        sched.step()
    assert torch.equal(flat(second.model), flat(whole.model))


def test_a_state_dict_from_before_momentum_loads_as_zero_momentum_and_decay():
    """A checkpoint written before these keys existed (no ``momentum``/``dampening``/``weight_decay`` in its
    groups) loads, and the next step is the momentum-free one."""
    a, b = mlp_case(), mlp_case()
    old = ief.optim.IEF(a.model, lr=0.3, damping=1e-3)
    old.step(a.inputs, a.targets)
    state = old.state_dict()
    for group in state["param_groups"]:
        for key in ("momentum", "dampening", "weight_decay"):
            del group[key]
    fresh = ief.optim.IEF(b.model, lr=0.3, damping=1e-3, momentum=0.9, weight_decay=0.1)
    b.model.load_state_dict(a.model.state_dict())
    fresh.load_state_dict(state)
    assert {k: fresh.param_groups[0][k] for k in ("momentum", "dampening", "weight_decay")} == \
        {"momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0}
    old.step(a.inputs, a.targets)
    fresh.step(b.inputs, b.targets)
    assert torch.equal(flat(a.model), flat(b.model))


# ---------------------------------------------------------------------------------------------------- bad values
BAD = [
    ("momentum", -0.1, r"momentum must be a number in \[0, 1\).*got -0\.1"),
    ("momentum", 1.0, r"momentum must be a number in \[0, 1\).*got 1\.0"),
    ("momentum", 1.5, r"momentum must be a number in \[0, 1\).*got 1\.5"),
    ("momentum", float("nan"), r"momentum must be a number in \[0, 1\).*got nan"),
    ("momentum", "0.9", r"momentum must be a real number, got '0\.9'"),
    ("momentum", True, r"momentum must be a real number, got True"),
    ("momentum", None, r"momentum must be a real number, got None"),
    ("dampening", -0.5, r"dampening must be a number in \[0, 1\].*got -0\.5"),
    ("dampening", 2.0, r"dampening must be a number in \[0, 1\].*got 2\.0"),
    ("dampening", float("nan"), r"dampening must be a number in \[0, 1\].*got nan"),
    ("weight_decay", -1e-3, r"weight_decay must be a finite number >= 0.*got -0\.001"),
    ("weight_decay", float("inf"), r"weight_decay must be a finite number >= 0.*got inf"),
    ("weight_decay", float("nan"), r"weight_decay must be a finite number >= 0.*got nan"),
    ("weight_decay", "big", r"weight_decay must be a real number, got 'big'"),
    ("weight_decay", 20.0, r"lr \* weight_decay must be < 1.*lr=0\.05, weight_decay=20\.0"),
]


@pytest.mark.parametrize("cls", list(CLASSES.values()), ids=lambda k: k.__name__)
@pytest.mark.parametrize("key,value,message", BAD, ids=lambda v: repr(v)[:14])
def test_bad_values_are_refused_by_the_constructor(cls, key, value, message):
    c = mlp_case()
    with pytest.raises(ValueError, match=message):
        cls(c.model, lr=0.05, damping=1e-3, **{key: value})


@pytest.mark.parametrize("cls", list(CLASSES.values()), ids=lambda k: k.__name__)
@pytest.mark.parametrize("key,value,message", BAD, ids=lambda v: repr(v)[:14])
def test_bad_values_written_into_param_groups_are_refused_before_the_step(cls, key, value, message):
    """Written by hand, a scheduler or ``load_state_dict`` after a good step: refused, nothing changed."""
    c = mlp_case()
    opt = cls(c.model, lr=0.05, damping=1e-3, momentum=0.5)
    opt.step(c.inputs, c.targets)
    before, buffers = flat(c.model), [opt.state[p]["momentum_buffer"].clone() for p in trainable(c.model)]
    opt.param_groups[0][key] = value
    with pytest.raises(ValueError, match=r"^step 1: param_groups\[0\]: " + message + ".*parameters left unchanged"):
        opt.step(c.inputs, c.targets)
    assert torch.equal(flat(c.model), before) and opt.steps_taken == 1
    assert all(torch.equal(opt.state[p]["momentum_buffer"], b) for p, b in zip(trainable(c.model), buffers))


def test_integer_zero_is_accepted_and_kept_as_a_float():
    c = mlp_case()
    opt = ief.optim.IEF(c.model, momentum=0, dampening=0, weight_decay=0)
    assert {k: type(opt.param_groups[0][k]) for k in ("momentum", "dampening", "weight_decay")} == \
        dict.fromkeys(("momentum", "dampening", "weight_decay"), float)


def test_groups_must_agree_on_everything_but_weight_decay():
    c = mlp_case()
    opt = ief.optim.IEF(c.model, lr=0.3, damping=1e-3, params=two_groups(c.model, 0.1, 0.0))
    before = flat(c.model)
    opt.param_groups[1]["lr"] = 0.1
    with pytest.raises(ValueError, match=r"^step 0: param_groups\[1\]\['lr'\] is 0\.1 but param_groups\[0\]\['lr'\] "
                                         r"is 0\.3: the update is one joint direction.*only weight_decay may differ"):
        opt.step(c.inputs, c.targets)
    assert torch.equal(flat(c.model), before)
    params = trainable(c.model)
    with pytest.raises(ValueError, match=r"params\[1\] has keys \['lr', 'params'\]; a group takes 'params' and "
                                         r"optionally 'weight_decay'"):
        ief.optim.IEF(c.model, params=[{"params": params[:2]}, {"params": params[2:], "lr": 0.1}])
    with pytest.raises(ValueError, match="not a mix of both"):
        ief.optim.IEF(c.model, params=[{"params": params[:2]}, params[2]])
    with pytest.raises(ValueError, match=r"^params\[0\]: weight_decay must be a finite number >= 0 \(0: none\), "
                                         r"got -1$"):
        ief.optim.IEF(c.model, params=[{"params": params, "weight_decay": -1}])
    with pytest.raises(ValueError, match="more than one parameter group"):  # torch's own check
        ief.optim.IEF(c.model, params=[{"params": params}, {"params": params[:1]}])


def test_a_non_finite_momentum_buffer_is_refused_with_nothing_changed():
    """A buffer that is not finite (here loaded by hand; overflow in float32 would do the same) stops the step
    with ``FloatingPointError`` naming it: parameters, buffers and the step counter as they were."""
    c = mlp_case()
    opt = ief.optim.IEF(c.model, lr=0.3, damping=1e-3, momentum=0.9)
    opt.step(c.inputs, c.targets)
    first = trainable(c.model)[0]
    opt.state[first]["momentum_buffer"][0, 0] = float("inf")
    before, buffers = flat(c.model), [opt.state[p]["momentum_buffer"].clone() for p in trainable(c.model)]
    with pytest.raises(FloatingPointError, match=r"^step 1: non-finite momentum buffer; parameters left unchanged$"):
        opt.step(c.inputs, c.targets)
    assert torch.equal(flat(c.model), before) and opt.steps_taken == 1
    assert all(torch.equal(opt.state[p]["momentum_buffer"], b) for p, b in zip(trainable(c.model), buffers))
