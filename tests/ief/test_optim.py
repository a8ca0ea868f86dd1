"""``ief.optim.IEF`` / ``EF`` / ``SF``: the exact stochastic optimisers of ``alg:iEF``, ``alg:EF``, ``alg:SF``.

A step must be exactly ``theta <- theta - eta * d`` with ``d`` from :func:`ief.ief_direction` /
:func:`ief.ef_direction` / :func:`ief.sf_direction` on the per-sample quantities of the current batch, with the
schedules of ``sec:app-optimiser`` (normalised update of norm ``eta``; linear decay ``1 - t/T``).

Tolerances: the optimiser and the reference run the same float64 computation on the same parameters, so the
updates agree to a few ulps; ``1e-10`` relative is used. Step-size/norm identities are checked at ``1e-12``.

The tiny models are a few hundred parameters: BLAS threading only adds synchronisation cost, and on a loaded
2-core machine OpenMP spin-waiting made a tiny T5 step ~50x slower; the module runs single-threaded (restored after).
"""
from __future__ import annotations

import copy
import importlib
import io
import math
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import ief
import oracle
from ief.optim.base import Direction
from tiny_models import _t5_batch, mlp_case, mse_case, sequence_case, t5_lora_case, t5_prompt_case

RTOL = 1e-10

# The optimisers' forms of J (default "auto"): every step test below runs with the [M, P] tensor and with the
# factored Jacobian (nn.Linear weights as factors, "ghost", or as materialised rows, "rows").
FORMS = ["dense", "ghost", "rows"]


@pytest.fixture(params=FORMS)
def form(request):
    return request.param


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters() if p.requires_grad]).clone()


def rel_err(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def assert_rel(actual, expected, rtol=RTOL, what=""):
    assert actual.shape == expected.shape
    err = rel_err(actual, expected)
    assert err <= rtol, f"{what}: relative error {err:.3e} > {rtol:.1e}"


def batch_loss(case) -> float:
    return float(ief.per_sample(case.model, case.inputs, case.targets, loss=case.loss).losses.sum())


# --------------------------------------------------------------------------------------------- one step = formula
def test_ief_step_equals_manual_update(form):
    """``alg:iEF``: ``theta_1 = theta_0 - lr * J^T (J J^T + lambda I)^{-1} s``; ``step`` returns ``L(theta_0)``."""
    c = mlp_case()
    r = ief.per_sample(c.model, c.inputs, c.targets)
    d = ief.ief_direction(r.jacobian, r.logit_sqnorm, 1e-3)
    theta0 = flat(c.model)
    opt = ief.optim.IEF(c.model, lr=0.5, damping=1e-3, form=form)
    loss = opt.step(c.inputs, c.targets)
    assert_rel(flat(c.model) - theta0, -0.5 * d, what="update")
    losses, _, _ = oracle.per_sample(mlp_case().model, c.inputs, c.targets)
    assert math.isclose(float(loss), float(losses.sum()), rel_tol=RTOL)
    assert math.isclose(opt.last_update_norm, 0.5 * float(d.norm()), rel_tol=1e-12)
    assert opt.steps_taken == 1


def test_ief_second_step_uses_the_new_parameters(form):
    """Two steps: the second direction is computed at ``theta_1`` (the forward is re-run on updated weights)."""
    c = mlp_case()
    opt = ief.optim.IEF(c.model, lr=0.5, damping=1e-3, form=form)
    opt.step(c.inputs, c.targets)
    theta1 = flat(c.model)
    r = ief.per_sample(c.model, c.inputs, c.targets)
    d = ief.ief_direction(r.jacobian, r.logit_sqnorm, 1e-3)
    opt.step(c.inputs, c.targets)
    assert_rel(flat(c.model) - theta1, -0.5 * d, what="second update")


@pytest.mark.parametrize("normalize", [False, True])
def test_ef_step_equals_manual_update(normalize, form):
    """``alg:EF``: ``d = J^T (J J^T + lambda I)^{-1} 1``; with ``normalize=True`` the update is ``lr d/||d||``, so
    its norm is exactly ``lr`` (the paper's normalised update, ``sec:app-optimiser``)."""
    c = mlp_case()
    r = ief.per_sample(c.model, c.inputs, c.targets)
    d = ief.ef_direction(r.jacobian, 1e-4)
    theta0 = flat(c.model)
    opt = ief.optim.EF(c.model, lr=0.05, damping=1e-4, normalize=normalize, form=form)
    opt.step(c.inputs, c.targets)
    expected = -0.05 * (d / d.norm() if normalize else d)
    assert_rel(flat(c.model) - theta0, expected, what="update")
    if normalize:
        assert math.isclose(float((flat(c.model) - theta0).norm()), 0.05, rel_tol=1e-12)


def test_ef_linear_decay_schedule(form):
    """``total_steps=T`` with the normalised update: the ``k``-th update (from 0) has norm ``lr (1 - k/T)`` and is
    0 for ``k >= T`` (parameters stop moving)."""
    c = mlp_case()
    lr, total = 0.05, 3
    opt = ief.optim.EF(c.model, lr=lr, damping=1e-4, total_steps=total, form=form)
    for k in range(5):
        before = flat(c.model)
        opt.step(c.inputs, c.targets)
        norm = float((flat(c.model) - before).norm())
        expected = lr * max(0.0, 1 - k / total)
        assert math.isclose(norm, expected, rel_tol=1e-12, abs_tol=0.0), f"step {k}: {norm} != {expected}"
        assert math.isclose(opt.last_update_norm, expected, rel_tol=1e-12, abs_tol=0.0)
    assert opt.steps_taken == 5


def test_ief_linear_decay_scales_the_direction(form):
    """Without normalisation the decay multiplies the iEF direction: update ``k`` is ``-lr (1 - k/T) d_k``."""
    c = mlp_case()
    opt = ief.optim.IEF(c.model, lr=0.5, damping=1e-3, total_steps=4, form=form)
    opt.step(c.inputs, c.targets)
    r = ief.per_sample(c.model, c.inputs, c.targets)
    d = ief.ief_direction(r.jacobian, r.logit_sqnorm, 1e-3)
    before = flat(c.model)
    opt.step(c.inputs, c.targets)
    assert_rel(flat(c.model) - before, -0.5 * (1 - 1 / 4) * d, what="decayed update")


@pytest.mark.parametrize("normalize", [False, True])
def test_sf_steps_equal_manual_computation_with_the_same_generator(normalize, form):
    """``alg:SF``: ``d = (A^T A + lambda I)^{-1} grad L`` with ``A`` the Jacobian at labels drawn by the optimiser's
    generator. A second generator with the same seed reproduces both steps (the optimiser keeps drawing from its
    generator: step 2 uses the continuation of the stream, not a re-seeded one)."""
    c = mlp_case()
    damping, lr = 1e-2, 0.05
    ref_model = copy.deepcopy(c.model)
    opt = ief.optim.SF(c.model, lr=lr, damping=damping, normalize=normalize, generator=torch.Generator().manual_seed(9),
                       form=form)
    g_ref = torch.Generator().manual_seed(9)
    for k in range(2):
        grad = ief.per_sample(ref_model, c.inputs, c.targets).gradient
        a = ief.sampled_jacobian(ref_model, c.inputs, c.targets, g_ref)
        d = ief.sf_direction(a, grad, damping)
        update = lr * (d / d.norm() if normalize else d)
        with torch.no_grad():
            for p, u in zip(ref_model.parameters(), torch.split(update, [p.numel() for p in ref_model.parameters()])):
                p.sub_(u.reshape(p.shape))
        opt.step(c.inputs, c.targets)
        assert_rel(flat(c.model), flat(ref_model), what=f"SF step {k}")


def test_sf_generator_changes_the_update():
    """Different generator seeds draw different labels, hence different SF updates (the draw is really used)."""
    updates = []
    for seed in (1, 2):
        c = mlp_case()
        before = flat(c.model)
        ief.optim.SF(c.model, lr=0.05, damping=1e-2, generator=torch.Generator().manual_seed(seed)).step(
            c.inputs, c.targets
        )
        updates.append(flat(c.model) - before)
    assert rel_err(updates[0], updates[1]) > 1e-3


# ------------------------------------------------------------------------------------------------- training works
def test_ief_training_reduces_loss_mlp(form):
    """20 iEF steps (lr 10) on the mlp batch: ``L`` falls by more than 50x (7.8 -> ~0.014)."""
    c = mlp_case()
    start = batch_loss(c)
    opt = ief.optim.IEF(c.model, lr=10.0, form=form)
    for _ in range(20):
        opt.step(c.inputs, c.targets)
    assert batch_loss(c) < 0.02 * start


@pytest.mark.parametrize("cls,lr,damping", [(ief.optim.EF, 0.3, 1e-7), (ief.optim.SF, 0.3, 1e-3)])
def test_ef_sf_training_reduces_loss_mlp(cls, lr, damping, form):
    """EF and SF with the paper's normalised update (``sec:app-optimiser``): 20 steps more than halve ``L``."""
    c = mlp_case()
    start = batch_loss(c)
    opt = cls(c.model, lr=lr, damping=damping, form=form)
    for _ in range(20):
        opt.step(c.inputs, c.targets)
    assert batch_loss(c) < 0.5 * start


def test_ief_training_reduces_loss_t5_lora(form):
    """20 iEF steps on the t5-lora batch (LoRA r=8 on q/v): ``L`` drops from ~23 to ~11, checked as < 0.7x."""
    c = t5_lora_case()
    start = batch_loss(c)
    opt = ief.optim.IEF(c.model, lr=1.0, form=form)
    for _ in range(20):
        loss = opt.step(c.inputs, c.targets)
        assert torch.isfinite(loss)
    assert batch_loss(c) < 0.7 * start


def test_ief_training_reduces_loss_t5_prompt():
    """20 iEF steps on the t5-prompt batch (20 virtual tokens only): ``L`` drops from ~22.7 to ~20.9 (the tiny
    random T5 cannot be fitted by a prompt alone), checked as < 0.95x; the frozen body does not move."""
    c = t5_prompt_case()
    frozen = [p.detach().clone() for p in c.model.parameters() if not p.requires_grad]
    start = batch_loss(c)
    opt = ief.optim.IEF(c.model, lr=30.0)
    for _ in range(20):
        opt.step(c.inputs, c.targets)
    assert batch_loss(c) < 0.95 * start
    assert all(torch.equal(a, b) for a, b in zip(frozen, [p for p in c.model.parameters() if not p.requires_grad]))


def test_plain_training_loop_on_a_peft_lora_model():
    """What a user writes: ``model.train()`` (LoRA dropout 0.1 active), loop over batches, ``opt.step(inputs,
    targets)``. Six epochs over three batches (random labels, so the batches pull apart) lower the eval-mode loss
    summed over the batches from ~101.6 to ~84, checked as < 0.9x; only the LoRA weights move."""
    c = t5_lora_case()
    model = c.model
    batches = [_t5_batch(4, seed) for seed in (10, 11, 12)]

    def eval_loss():
        model.eval()
        total = 0.0
        for inputs, labels in batches:
            total += float(ief.per_sample(model, inputs, labels).losses.sum())
        return total

    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    start = eval_loss()
    model.train()
    opt = ief.optim.IEF(model, lr=0.3)
    for _ in range(6):
        for inputs, labels in batches:
            loss = opt.step(inputs, labels)
            assert torch.isfinite(loss)
    assert opt.steps_taken == 18
    assert model.training
    assert eval_loss() < 0.9 * start
    for n, p in model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, frozen[n]), n


# -------------------------------------------------------------------------------------------------- non-finite
def _nan_weight(c):
    with torch.no_grad():
        c.model[0].weight[0, 0] = float("nan")
    return c.inputs


def _inf_input(c):
    x = c.inputs.clone()
    x[2, 1] = float("inf")
    return x


@pytest.mark.parametrize("make_bad", [_nan_weight, _inf_input], ids=["nan-weight", "inf-input"])
@pytest.mark.parametrize("cls", [ief.optim.IEF, ief.optim.EF, ief.optim.SF], ids=lambda k: k.__name__)
def test_non_finite_raises_and_leaves_parameters(cls, make_bad):
    """A forward with NaN/inf: ``FloatingPointError`` naming ``step 0`` (the optimisers' documented contract) and
    every parameter bit-for-bit unchanged, step counter not advanced.
    (SF must not let NaN logits reach ``torch.multinomial``, which would raise a ``RuntimeError`` instead.)"""
    c = mlp_case()
    inputs = make_bad(c)
    snapshot = [p.detach().clone() for p in c.model.parameters()]
    opt = cls(c.model, lr=0.1)
    with pytest.raises(FloatingPointError, match="step 0"):
        opt.step(inputs, c.targets)
    for p, q in zip(c.model.parameters(), snapshot):
        torch.testing.assert_close(p.detach(), q, rtol=0, atol=0, equal_nan=True)
    assert opt.steps_taken == 0


def test_non_finite_after_a_good_step_names_that_step():
    """The message carries the step number: a good step, then a batch with an inf input fails as ``step 1``."""
    c = mlp_case()
    opt = ief.optim.IEF(c.model, lr=0.1)
    opt.step(c.inputs, c.targets)
    after_good = flat(c.model)
    with pytest.raises(FloatingPointError, match="step 1"):
        opt.step(_inf_input(c), c.targets)
    assert torch.equal(flat(c.model), after_good)
    assert opt.steps_taken == 1


# ------------------------------------------------------------------------------------------------- constructor
@pytest.mark.parametrize("cls", [ief.optim.IEF, ief.optim.EF, ief.optim.SF], ids=lambda k: k.__name__)
@pytest.mark.parametrize(
    "kwargs,name,value",
    [
        (dict(lr=0.0), "lr", "0.0"),
        (dict(lr=-1.0), "lr", "-1.0"),
        (dict(lr=float("nan")), "lr", "nan"),
        (dict(lr=float("inf")), "lr", "inf"),
        (dict(damping=-1e-3), "damping", "-0.001"),
        (dict(damping=float("nan")), "damping", "nan"),
        (dict(total_steps=0), "total_steps", "0"),
        (dict(total_steps=-3), "total_steps", "-3"),
        (dict(total_steps=2.5), "total_steps", "2.5"),
    ],
)
def test_bad_constructor_arguments(cls, kwargs, name, value):
    c = mlp_case()
    with pytest.raises(ValueError, match=name) as info:
        cls(c.model, **kwargs)
    assert value in str(info.value)


def test_sf_damping_must_be_positive():
    """SF divides by ``lambda`` (``eqn:SF-smw``): damping 0 is rejected for SF, accepted for iEF / EF."""
    c = mlp_case()
    with pytest.raises(ValueError, match="damping") as info:
        ief.optim.SF(c.model, damping=0.0)
    assert "0.0" in str(info.value)
    ief.optim.IEF(c.model, damping=0.0)
    ief.optim.EF(c.model, damping=0.0)


@pytest.mark.parametrize("cls", [ief.optim.IEF, ief.optim.EF, ief.optim.SF], ids=lambda k: k.__name__)
def test_model_must_be_a_module(cls):
    c = mlp_case()
    with pytest.raises(ValueError, match="nn.Module"):
        cls(list(c.model.parameters()))
    with pytest.raises(ValueError, match="nn.Module"):
        cls(lambda x: c.model(x))


def test_model_without_trainable_parameters():
    c = mlp_case()
    for p in c.model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        ief.optim.IEF(c.model)


# ------------------------------------------------------------------------------------ state_dict and schedulers
def test_state_dict_round_trip_keeps_step_counter_and_lr():
    """Save after two steps (with a changed lr), serialise with ``torch.save``, load into a fresh optimiser built
    with other hyper-parameters: ``steps_taken``, ``lr`` and the decay position carry over, so the next update
    has norm ``lr (1 - 2/T)``."""
    c = mlp_case()
    opt = ief.optim.EF(c.model, lr=0.05, damping=1e-4, total_steps=4)
    opt.step(c.inputs, c.targets)
    opt.step(c.inputs, c.targets)
    opt.param_groups[0]["lr"] = 0.02
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer)

    fresh = ief.optim.EF(c.model, lr=1.0, damping=1e-4, total_steps=4)
    assert fresh.steps_taken == 0
    fresh.load_state_dict(state)
    assert fresh.steps_taken == 2
    assert fresh.param_groups[0]["lr"] == 0.02
    assert fresh.param_groups[0]["total_steps"] == 4
    before = flat(c.model)
    fresh.step(c.inputs, c.targets)
    assert math.isclose(float((flat(c.model) - before).norm()), 0.02 * (1 - 2 / 4), rel_tol=1e-12)
    assert fresh.steps_taken == 3


def test_step_lr_scheduler_changes_the_lr_used():
    """``torch.optim.lr_scheduler.StepLR`` (gamma 0.5 every step) drives ``param_groups[0]['lr']``; with the
    normalised EF update the update norms are ``lr, lr/2, lr/4``."""
    c = mlp_case()
    opt = ief.optim.EF(c.model, lr=0.04, damping=1e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    norms = []
    for _ in range(3):
        before = flat(c.model)
        opt.step(c.inputs, c.targets)
        norms.append(float((flat(c.model) - before).norm()))
        sched.step()
    for got, expected in zip(norms, [0.04, 0.02, 0.01]):
        assert math.isclose(got, expected, rel_tol=1e-12)
    assert math.isclose(opt.param_groups[0]["lr"], 0.005, rel_tol=1e-12)


def test_lambda_lr_scheduler_with_ief():
    """A scheduler on iEF (un-normalised): update ``k`` is ``-lr_k d_k`` with ``lr_k`` from ``LambdaLR``."""
    c = mlp_case()
    opt = ief.optim.IEF(c.model, lr=0.5, damping=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.1 if k >= 1 else 1.0)
    opt.step(c.inputs, c.targets)
    sched.step()
    r = ief.per_sample(c.model, c.inputs, c.targets)
    d = ief.ief_direction(r.jacobian, r.logit_sqnorm, 1e-3)
    before = flat(c.model)
    opt.step(c.inputs, c.targets)
    assert_rel(flat(c.model) - before, -0.05 * d, what="scheduled update")


# --------------------------------------------------------------------------- values arriving through param_groups
_BAD_GROUP_VALUES = [
    ("lr", float("nan"), "nan"), ("lr", float("inf"), "inf"), ("lr", -0.1, "-0.1"), ("lr", "fast", "'fast'"),
    ("lr", None, "None"), ("damping", float("nan"), "damping must be a finite"), ("damping", -1.0, "-1.0"),
    ("total_steps", 0, "total_steps"),
]


@pytest.mark.parametrize("cls", [ief.optim.IEF, ief.optim.EF, ief.optim.SF], ids=lambda k: k.__name__)
@pytest.mark.parametrize("key,value,shown", _BAD_GROUP_VALUES, ids=lambda v: repr(v)[:12])
def test_bad_values_written_into_param_groups_are_refused_at_every_step(cls, key, value, shown):
    """After a good step, a value written into ``param_groups`` (by hand, a scheduler or ``load_state_dict``) is
    checked before the next step touches anything: ``ValueError`` naming the group, the key and the value; the
    parameters and the step counter are unchanged (before: NaN parameters or an ascent step)."""
    c = mlp_case()
    opt = cls(c.model, lr=0.05, damping=1e-3)
    opt.step(c.inputs, c.targets)
    before = flat(c.model)
    opt.param_groups[0][key] = value
    with pytest.raises(ValueError, match=r"step 1: param_groups\[0\]") as info:
        opt.step(c.inputs, c.targets)
    assert shown in str(info.value) and key in str(info.value)
    assert torch.equal(flat(c.model), before) and opt.steps_taken == 1


def test_zero_damping_from_param_groups_refused_for_sf_only():
    c = mlp_case()
    sf, ief_opt = ief.optim.SF(c.model, damping=1e-3), ief.optim.IEF(copy.deepcopy(c.model), damping=1e-3)
    sf.param_groups[0]["damping"] = ief_opt.param_groups[0]["damping"] = 0.0
    with pytest.raises(ValueError, match=r"damping must be a finite number > 0, got 0.0"):
        sf.step(c.inputs, c.targets)
    ief_opt.step(c.inputs, c.targets)
    assert ief_opt.steps_taken == 1


def test_bad_lr_through_a_scheduler_and_through_load_state_dict():
    c = mlp_case()
    opt = ief.optim.EF(c.model, lr=0.05, damping=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: [1.0, -2.0][min(k, 1)])
    opt.step(c.inputs, c.targets)
    sched.step()  # lr -> -0.1
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['lr'\] must be a finite number >= 0.*got -0.1"):
        opt.step(c.inputs, c.targets)
    state = ief.optim.EF(c.model, lr=0.05, damping=1e-3).state_dict()
    state["param_groups"][0]["lr"] = float("nan")
    fresh = ief.optim.EF(c.model, lr=0.05, damping=1e-3)
    fresh.load_state_dict(state)
    before = flat(c.model)
    with pytest.raises(ValueError, match=r"\['lr'\].*got nan"):
        fresh.step(c.inputs, c.targets)
    assert torch.equal(flat(c.model), before)


def test_zero_lr_from_a_warmup_scheduler_is_a_zero_update():
    """A warm-up schedule starts at ``lr = 0`` (as torch's optimisers allow): the step leaves the parameters, counts."""
    c = mlp_case()
    opt = ief.optim.IEF(c.model, lr=1.0, damping=1e-3)
    torch.optim.lr_scheduler.LambdaLR(opt, lambda k: k / 2)
    before = flat(c.model)
    opt.step(c.inputs, c.targets)
    assert torch.equal(flat(c.model), before) and opt.steps_taken == 1


@pytest.mark.parametrize("cls", [ief.optim.IEF, ief.optim.EF, ief.optim.SF], ids=lambda k: k.__name__)
def test_error_text_is_not_doubled(cls):
    """"step 1: non-finite ...; parameters left unchanged" once (before: "step 1: step 1: ... unchanged;
    parameters left unchanged")."""
    c = mlp_case()
    opt = cls(c.model, lr=0.05, damping=1e-3)
    opt.step(c.inputs, c.targets)
    with pytest.raises(FloatingPointError) as info:
        opt.step(_inf_input(c), c.targets)
    text = str(info.value)
    assert text.startswith("step 1: ") and text.count("step 1") == 1
    assert text.count("parameters left unchanged") == 1 and text.endswith("parameters left unchanged")


@pytest.mark.parametrize("check", ["bogus", "EXACT", 0, -2, 2.5, "sum", None])
@pytest.mark.parametrize("cls", [ief.optim.IEF, ief.optim.EF, ief.optim.SF], ids=lambda k: k.__name__)
def test_bad_check_is_refused_by_the_constructor(cls, check):
    c = mlp_case()
    with pytest.raises(ValueError, match=r"check must be one of True, False, 'exact' or a whole number N >= 1 of "
                                         r"steps \(the exact check every N steps\), got") as info:
        cls(c.model, check=check)
    assert repr(check) in str(info.value)


def test_sf_state_dict_saves_and_restores_the_generator():
    """SF(generator=g): a run saved after 2 steps and resumed in a fresh process-like setting (new model copy, new
    generator with another seed, state loaded) takes exactly the steps of the uninterrupted run."""
    c = mlp_case()
    start = copy.deepcopy(c.model)
    straight = ief.optim.SF(c.model, lr=0.05, damping=1e-2, generator=torch.Generator().manual_seed(5))
    for _ in range(4):
        straight.step(c.inputs, c.targets)
    expected = flat(c.model)

    model = copy.deepcopy(start)
    first = ief.optim.SF(model, lr=0.05, damping=1e-2, generator=torch.Generator().manual_seed(5))
    for _ in range(2):
        first.step(c.inputs, c.targets)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": first.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    assert "generator_state" in saved["opt"]
    resumed_model = copy.deepcopy(start)
    resumed_model.load_state_dict(saved["model"])
    resumed = ief.optim.SF(resumed_model, lr=0.05, damping=1e-2, generator=torch.Generator().manual_seed(123))
    resumed.load_state_dict(saved["opt"])
    for _ in range(2):
        resumed.step(c.inputs, c.targets)
    assert torch.equal(flat(resumed_model), expected)
    with pytest.raises(ValueError, match="generator=torch.Generator"):
        ief.optim.SF(copy.deepcopy(start)).load_state_dict(saved["opt"])
    assert "generator_state" not in ief.optim.SF(copy.deepcopy(start)).state_dict()  # global RNG: nothing to save


def test_default_form_never_forms_the_per_sample_jacobian():
    """``form="auto"`` (default): on an MLP every Linear weight stays factored, so the only [M, *] buffer the optimiser
    keeps is the biases' column block; the update equals the dense form's to rounding."""
    c = mlp_case()
    dense_model = copy.deepcopy(c.model)
    opt = ief.optim.IEF(c.model, lr=0.5, damping=1e-3)
    ref = ief.optim.IEF(dense_model, lr=0.5, damping=1e-3, form="dense")
    opt.step(c.inputs, c.targets)
    ref.step(c.inputs, c.targets)
    biases = sum(p.numel() for p in c.model.parameters() if p.dim() == 1)
    assert opt._buffer.shape == (c.targets.shape[0], biases)
    assert ref._buffer.shape == (c.targets.shape[0], sum(p.numel() for p in c.model.parameters()))
    assert_rel(flat(c.model), flat(dense_model), what="auto vs dense")


@pytest.mark.parametrize("bad", ["Dense", "factored", None])
def test_bad_form_is_refused_by_the_constructor(bad):
    c = mlp_case()
    with pytest.raises(ValueError, match="form must be one of"):
        ief.optim.IEF(c.model, form=bad)


# ------------------------------------------------------------------------------ driving the optimisers: API edges
@pytest.mark.parametrize("cls", [ief.optim.IEF, ief.optim.EF, ief.optim.SF], ids=lambda k: k.__name__)
def test_add_param_group_is_refused_with_the_reason_and_the_remedy(cls):
    """One joint direction over the groups fixed at construction: a group added later would never be updated, so it
    is refused."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).double()
    opt = cls(model, damping=1e-3, params=list(model[0].parameters()))
    with pytest.raises(ValueError, match=rf"{cls.__name__}'s parameter groups are fixed at construction.*never be updated.*params="):
        opt.add_param_group({"params": list(model[1].parameters())})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("call", [lambda o: o.step(), lambda o: o.step(lambda: torch.tensor(0.0)),
                                  lambda o: o.step(None), lambda o: o.step(closure=lambda: 0.0)],
                         ids=["step()", "step(closure)", "step(None)", "step(closure=)"])
def test_step_without_a_batch_says_how_the_optimiser_is_driven(call):
    c = mlp_case()
    opt = ief.optim.IEF(c.model, damping=1e-3)
    theta = flat(c.model)
    with pytest.raises(TypeError) as info:
        call(opt)
    text = str(info.value)
    assert "opt.step(inputs, targets)" in text and "transformers.Trainer" in text and "not supported" in text
    assert text.count(". ") == 0 and "missing" not in text  # one sentence, not Python's bare signature error
    assert torch.equal(flat(c.model), theta) and opt.steps_taken == 0


def test_hf_trainer_with_an_ief_optimiser_stops_with_the_sentence(tmp_path):
    """What ``transformers.Trainer(optimizers=(opt, None))`` does: its own forward and backward, then ``step()``."""
    transformers = pytest.importorskip("transformers")
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(vocab_size=30, hidden_size=8, num_hidden_layers=1,
                                                     num_attention_heads=2, intermediate_size=16))
    data = [{"input_ids": torch.randint(1, 30, (6,)), "labels": torch.tensor(i % 2)} for i in range(4)]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=1, report_to=[],
                             use_cpu=True, save_strategy="no", logging_strategy="no")
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      optimizers=(ief.optim.IEF(model), None))
    with pytest.raises(TypeError, match=r"IEF\.step needs the batch.*transformers\.Trainer.*is not supported"):
        trainer.train()
    assert transformers.__version__


def test_empty_params_names_what_was_given():
    c = mlp_case()
    for params in ([], (), iter([])):
        with pytest.raises(ValueError, match=r"params= was given but holds no parameter \(got \w+ of length 0\).*"
                                             r"params=None"):
            ief.optim.IEF(c.model, params=params)


# ----------------------------------------------------------------------------------------------- reduction="mean"
def _mean_convention_oracle(case, lr, damping, method, normalize=False):
    """The update of the paper's code, by brute force in float64: per-sample gradients of the *mean* loss
    ``L / K`` (rows ``J / K``, ``s / K^2``) and the dense formula of ``alg:iEF`` / ``alg:EF``."""
    losses, jac, s = oracle.per_sample(case.model, case.inputs, case.targets, case.loss)
    targets = case.targets
    k = targets.numel() if targets.dtype.is_floating_point else int((targets != -100).sum())
    jp, sp = jac.double() / k, s.double() / k**2
    rhs = sp if method == "ief" else torch.ones_like(sp)
    gram = jp @ jp.T + damping * torch.eye(len(sp), dtype=torch.float64)
    d = jp.T @ torch.linalg.solve(gram, rhs)
    update = -lr * (d / d.norm() if normalize else d)
    return update, float(losses.sum()) / k


def _cast(case, dtype):
    def cast(x):
        if isinstance(x, dict):
            return {k: cast(v) for k, v in x.items()}
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.dtype.is_floating_point else x
    case.model.to(dtype)
    case.inputs, case.targets = cast(case.inputs), cast(case.targets)
    return case


@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-9), (torch.float32, 2e-4)], ids=["f64", "f32"])
@pytest.mark.parametrize("make", [mlp_case, sequence_case, t5_lora_case], ids=["mlp", "sequence", "t5-lora"])
@pytest.mark.parametrize("method,normalize", [("ief", False), ("ef", False), ("ef", True)])
def test_reduction_mean_is_the_paper_codes_update(make, method, normalize, dtype, rtol):
    """``reduction="mean"``: lr and damping of the mean loss over the K counted targets (ignored positions and a
    sample with none among them), the update equal to the brute-force token-mean computation; ``step`` returns
    ``L / K``; ``param_groups`` keep the given values."""
    case = make(dtype=torch.float64)
    lr, damping = (50.0, 1e-4) if method == "ief" else (0.3, 1e-4)
    expected, mean_loss = _mean_convention_oracle(case, lr, damping, method, normalize)
    case = _cast(make(dtype=torch.float64), dtype)  # the same weights and inputs, rounded
    cls = ief.optim.IEF if method == "ief" else ief.optim.EF
    opt = cls(case.model, lr=lr, damping=damping, reduction="mean", normalize=normalize)
    theta = flat(case.model)
    loss = opt.step(case.inputs, case.targets)
    assert_rel((flat(case.model) - theta).double(), expected, rtol=rtol, what=f"{method} update")
    assert math.isclose(float(loss), mean_loss, rel_tol=max(rtol, 1e-12))
    assert opt.param_groups[0]["lr"] == lr and opt.param_groups[0]["damping"] == damping
    assert opt.last_tokens == int((case.targets != -100).sum())


def test_reduction_mean_with_mse_counts_every_target_entry():
    c = mse_case()
    expected, mean_loss = _mean_convention_oracle(mse_case(), 2.0, 1e-3, "ief")
    opt = ief.optim.IEF(c.model, lr=2.0, damping=1e-3, loss="mse", reduction="mean")
    theta = flat(c.model)
    assert math.isclose(float(opt.step(c.inputs, c.targets)), mean_loss, rel_tol=1e-12)
    assert_rel(flat(c.model) - theta, expected, rtol=1e-9, what="mse update")
    assert opt.last_tokens == c.targets.numel()


@pytest.mark.parametrize("normalize", [False, True])
def test_reduction_mean_sf_equals_the_sum_convention_with_converted_values(normalize):
    """SF samples its labels: with the same generator, ``reduction="mean"`` is the sum-convention SF with
    ``to_sum_convention``'s values for the batch (which ``test_convention`` checks against the paper's code)."""
    from ief.optim.convention import to_sum_convention

    c = sequence_case()
    k = int((c.targets != -100).sum())
    lr, damping = to_sum_convention("sf", 0.2, 1e-3, k, normalized=normalize)
    ref = sequence_case()
    theta = flat(c.model)
    ief.optim.SF(ref.model, lr=lr, damping=damping, normalize=normalize,
                 generator=torch.Generator().manual_seed(3)).step(ref.inputs, ref.targets)
    ief.optim.SF(c.model, lr=0.2, damping=1e-3, normalize=normalize, reduction="mean",
                 generator=torch.Generator().manual_seed(3)).step(c.inputs, c.targets)
    assert_rel(flat(c.model) - theta, flat(ref.model) - theta, rtol=1e-9, what="SF update")


@pytest.mark.parametrize("bad", ["Mean", "none", None, 1])
def test_bad_reduction_is_refused(bad):
    with pytest.raises(ValueError, match=r"reduction must be one of 'sum', 'mean'.*got"):
        ief.optim.IEF(mlp_case().model, reduction=bad)


def test_reduction_mean_refuses_a_batch_without_a_counted_target():
    c = sequence_case()
    theta = flat(c.model)
    with pytest.raises(ValueError, match="no counted target.*parameters left unchanged"):
        ief.optim.IEF(c.model, reduction="mean").step(c.inputs, torch.full_like(c.targets, -100))
    assert torch.equal(flat(c.model), theta)


# --------------------------------------------------------------------------------------- defaults cannot mislead
def _tiny_bert_lora(seed: int = 0):
    import peft
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return peft.get_peft_model(BertForSequenceClassification(config),
                               peft.LoraConfig(r=8, target_modules=["query", "value"], modules_to_save=["classifier"]))


def _bert_loss(model, inputs, targets) -> float:
    with torch.no_grad():
        return float(torch.nn.functional.cross_entropy(model(**inputs).logits, targets, reduction="sum"))


def test_defaults_of_each_reduction():
    model = mlp_case().model
    assert {k: ief.optim.IEF(model).param_groups[0][k] for k in ("lr", "damping")} == {"lr": 1.0, "damping": 1e-4}
    assert {k: ief.optim.IEF(model, reduction="mean").param_groups[0][k] for k in ("lr", "damping")} == \
        {"lr": 100.0, "damping": 1e-7}  # the paper's LoRA values (sec:app-optimiser)
    for cls in (ief.optim.EF, ief.optim.SF):
        assert cls(model).param_groups[0]["damping"] == 1e-4
        assert cls(model, reduction="mean").param_groups[0]["damping"] == 1e-7


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("batch,seed", [(4, 0), (32, 0), (32, 1), (32, 2)])
def test_default_iEF_step_lowers_a_tiny_bert_lora_loss(reduction, batch, seed):
    """``IEF(model)`` (and ``IEF(model, reduction="mean")``) with every other setting left at its default: one step
    on a tiny BERT-LoRA built from a config lowers the batch loss. (The paper's values read in the sum convention,
    ``lr=100, damping=1e-7``, raise it from 22 to 58,000: see the next test.)"""
    model = _tiny_bert_lora()
    torch.manual_seed(seed)
    inputs, targets = {"input_ids": torch.randint(1, 100, (batch, 12))}, torch.randint(0, 2, (batch,))
    before = _bert_loss(model, inputs, targets)
    ief.optim.IEF(model, reduction=reduction).step(inputs, targets)
    assert _bert_loss(model, inputs, targets) < before


def test_the_paper_values_in_the_sum_convention_do_diverge():
    """The check above can fail: the old default (the paper's token-mean values used as sum-convention values)."""
    model = _tiny_bert_lora()
    torch.manual_seed(0)
    inputs, targets = {"input_ids": torch.randint(1, 100, (32, 12))}, torch.randint(0, 2, (32,))
    before = _bert_loss(model, inputs, targets)
    ief.optim.IEF(model, lr=100.0, damping=1e-7).step(inputs, targets)
    assert _bert_loss(model, inputs, targets) > 100 * before


# --------------------------------------------------------------------------------------------------- causal LMs
def _causal_lm(kind: str):
    torch.manual_seed(0)
    if kind == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                          tie_word_embeddings=False)).double()  # tied weights: another test's
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
                                        pad_token_id=0)).double()


def _lm_batch():
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(1, 40, (3, 7), generator=g)
    attention_mask = torch.ones_like(input_ids)
    input_ids[1, 5:], attention_mask[1, 5:] = 0, 0  # right padding
    labels = input_ids.clone()
    labels[attention_mask == 0] = -100
    labels[2, :3] = -100  # a masked prompt
    return {"input_ids": input_ids, "attention_mask": attention_mask}, labels


def test_causal_lm_targets_shift_left_and_ignore_the_last_position():
    labels = torch.tensor([[5, 6, 7, -100], [1, -100, 3, 4]])
    assert ief.causal_lm_targets(labels).tolist() == [[6, 7, -100, -100], [-100, 3, 4, -100]]
    assert ief.causal_lm_targets(torch.tensor([[1, 0, 2]]), ignore_index=0).tolist() == [[-100, 2, -100]]
    for bad, shown in [(torch.tensor([1, 2]), "shape"), (torch.ones(2, 3), "dtype"), ([[1, 2]], "list")]:
        with pytest.raises(ValueError, match=shown):
            ief.causal_lm_targets(bad)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_causal_lm_targets_give_hugging_faces_own_shifted_loss(kind):
    """``sum_n l_n / K`` with ``causal_lm_targets(labels)`` is the model's ``outputs.loss`` for ``labels``, and
    ``IEF(reduction="mean").step`` returns it; the unshifted labels give another loss, and a step warns. (Hugging
    Face computes its loss in float32 whatever the model's dtype: 1e-6.)"""
    model = _causal_lm(kind)
    inputs, labels = _lm_batch()
    with torch.no_grad():
        hf = float(model(**inputs, labels=labels).loss)
    targets = ief.causal_lm_targets(labels)
    losses = ief.per_sample(model, inputs, targets).losses
    assert math.isclose(float(losses.sum()) / int((targets != -100).sum()), hf, rel_tol=1e-6)
    unshifted = float(ief.per_sample(model, inputs, labels).losses.sum()) / int((labels != -100).sum())
    assert not math.isclose(unshifted, hf, rel_tol=1e-3)
    opt = ief.optim.IEF(model, reduction="mean")
    assert math.isclose(float(opt.step(inputs, targets)), hf, rel_tol=1e-6)
    with pytest.warns(UserWarning, match=r"unshifted labels.*ief\.causal_lm_targets\(labels\)"):
        ief.optim.IEF(_causal_lm(kind)).step(inputs, labels)


# ------------------------------------------------ the contract's details: defaults, checks, buffers, warnings, text
def test_ef_and_sf_defaults_are_the_normalised_update_of_rate_0_01():
    model = mlp_case().model
    for cls in (ief.optim.EF, ief.optim.SF):
        group = cls(model).param_groups[0]
        assert (group["lr"], group["normalize"], group["total_steps"]) == (0.01, True, None), cls.__name__


@pytest.mark.parametrize("cls", [ief.optim.IEF, ief.optim.EF, ief.optim.SF], ids=lambda k: k.__name__)
def test_a_parameter_subset_is_preconditioned_alone_with_the_given_loss(cls):
    """``params=[...]`` and ``loss="mse"``: the step is the method's direction of that subset's per-sample gradients
    of that loss; the other parameters do not move."""
    c = mse_case()
    params = list(c.model[2].parameters())
    others = [p.detach().clone() for p in c.model[0].parameters()]
    before = torch.cat([p.detach().reshape(-1) for p in params])
    lam, gen = 1e-3, torch.Generator().manual_seed(2)
    if cls is ief.optim.SF:
        opt = cls(c.model, lr=0.1, damping=lam, params=params, loss="mse", normalize=False, generator=gen)
        _, grad, sampled = ief.jacobian.gradient_and_sampled_jacobian(
            c.model, c.inputs, c.targets, params, loss="mse", generator=torch.Generator().manual_seed(2))
        d = ief.sf_direction(sampled, grad, lam)
    else:
        opt = cls(c.model, lr=0.1, damping=lam, params=params, loss="mse", normalize=False)
        r = ief.per_sample(c.model, c.inputs, c.targets, params, loss="mse")
        d = ief.ief_direction(r.jacobian, r.logit_sqnorm, lam) if cls is ief.optim.IEF else \
            ief.ef_direction(r.jacobian, lam)
    opt.step(c.inputs, c.targets)
    after = torch.cat([p.detach().reshape(-1) for p in params])
    assert_rel(after - before, -0.1 * d, what="update")
    assert all(torch.equal(p, q) for p, q in zip(c.model[0].parameters(), others))


@pytest.mark.parametrize("cls", [ief.optim.IEF, ief.optim.EF, ief.optim.SF], ids=lambda k: k.__name__)
@pytest.mark.parametrize("check", [True, False, "exact", 2, 1])
def test_the_exact_check_runs_on_the_first_step_and_the_chosen_one_after(cls, check, monkeypatch):
    """``check=True``: the thorough ("exact") per-sample check on the first step, the cheap one afterwards;
    ``check=False`` never checks; ``"exact"`` always does the thorough one; ``N``: the thorough one every N steps
    (0, N, 2N, ...), the cheap one between."""
    exact = importlib.import_module("ief.optim.exact")
    seen = []
    name = "gradient_and_sampled_jacobian" if cls is ief.optim.SF else "per_sample"
    real = getattr(exact, name)

    def spy(*args, **kwargs):
        seen.append(kwargs["check"])
        return real(*args, **kwargs)

    monkeypatch.setattr(exact, name, spy)
    c = mlp_case()
    opt = cls(c.model, lr=0.01, damping=1e-3, check=check)
    for _ in range(5):
        opt.step(c.inputs, c.targets)
    expected = (["exact", True, True, True, True] if check is True else [False] * 5 if check is False else
                ["exact", True, "exact", True, "exact"] if check == 2 else ["exact"] * 5)  # "exact" and 1
    assert seen == expected


def test_the_dense_form_reuses_one_buffer_for_j_across_steps():
    c = mlp_case()
    opt = ief.optim.IEF(c.model, lr=0.01, form="dense")
    opt.step(c.inputs, c.targets)
    buffer = opt._buffer
    opt.step(c.inputs, c.targets)
    assert opt._buffer is buffer


@pytest.mark.parametrize("cls", [ief.optim.EF, ief.optim.SF], ids=lambda k: k.__name__)
def test_a_normalised_step_on_a_saturated_batch_is_a_zero_update(cls):
    """``J = 0`` (every softmax exactly one-hot at its label): a zero direction, whose normalised step is 0, not
    0/0."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 3).double()
    with torch.no_grad():
        model.weight.mul_(0.1)
        model.bias.copy_(torch.tensor([2000.0, 0.0, 0.0]))
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.zeros(4, dtype=torch.long)
    before = flat(model)
    opt = cls(model, lr=0.1, damping=1e-3, normalize=True)
    opt.step(x, y)
    assert torch.equal(flat(model), before) and opt.last_update_norm == 0.0 and opt.steps_taken == 1


def test_zero_damping_written_into_sf_param_groups_is_refused_before_the_step():
    c = mlp_case()
    opt = ief.optim.SF(c.model, damping=1e-3)
    opt.param_groups[0]["damping"] = 0.0
    before = flat(c.model)
    with pytest.raises(ValueError, match=r"^step 0: param_groups\[0\]: damping must be a finite number > 0, got 0\.0; "
                                         r"parameters left unchanged$"):
        opt.step(c.inputs, c.targets)
    assert torch.equal(flat(c.model), before)


@pytest.mark.parametrize("form", ["dense", "auto"])
@pytest.mark.parametrize("cls", [ief.optim.IEF, ief.optim.EF, ief.optim.SF], ids=lambda k: k.__name__)
def test_a_non_finite_row_stops_the_step_naming_the_sample(cls, form, monkeypatch):
    """A row of ``J`` that overflows while every loss is finite: the step's per-sample gradients (``ief.per_sample``,
    the one check of them; the solves take them as checked) refuse it, naming the step and the sample, and leave the
    parameters and the step counter as they were."""
    c = mlp_case()
    jacobian = importlib.import_module("ief.jacobian.assemble")
    real = jacobian._backward_jacobian

    def overflowing(*args, **kwargs):
        jac, autograd = real(*args, **kwargs)
        (jac.dense if isinstance(jac, ief.rows.FactoredJacobian) else jac)[2, 0] = float("inf")
        return jac, autograd

    monkeypatch.setattr(jacobian, "_backward_jacobian", overflowing)
    opt = cls(c.model, lr=0.1, damping=1e-3, form=form)
    before = flat(c.model)
    with pytest.raises(FloatingPointError, match=r"^step 0: non-finite per-sample gradient for samples \[2\] .*; "
                                                 r"parameters left unchanged$"):
        opt.step(c.inputs, c.targets)
    assert torch.equal(flat(c.model), before) and opt.steps_taken == 0


@pytest.mark.parametrize("where", ["dense", "ghost-a", "ghost-g"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("cls", [ief.optim.IEF, ief.optim.EF, ief.optim.SF], ids=lambda k: k.__name__)
def test_a_non_finite_row_stops_a_steady_step_naming_the_sample(cls, dtype, where, monkeypatch):
    """The same on a steady step (step 1: the structural check, whose finiteness flag is asked for after the solve):
    an overflowing entry of ``J`` (a dense block's, a ghost weight's input or output gradient) with finite losses is
    refused, naming the step and the sample, parameters and counter unchanged. In float32 the flag is read off the
    Gram's diagonal (``ief.rows._gram_finite_flag``): no separate pass over ``J`` (``_finite_flag``) in a good step."""
    c = mlp_case(dtype=dtype)
    form = "dense" if where == "dense" else "ghost"
    opt = cls(c.model, lr=0.1, damping=1e-3, form=form)
    opt.step(c.inputs, c.targets)
    jacobian = importlib.import_module("ief.jacobian.assemble")
    real, passes = jacobian._backward_jacobian, []
    rows_module = importlib.import_module("ief.rows")
    real_pass = rows_module._finite_flag
    monkeypatch.setattr(rows_module, "_finite_flag", lambda *a: passes.append(1) or real_pass(*a))
    opt.step(c.inputs, c.targets)  # a good steady step
    # float64: the dense adaptor's max|J| pass (its Gram scale) decides it, the factors take the separate pass
    assert passes == ([1] if dtype == torch.float64 and form == "ghost" else []) and opt.steps_taken == 2

    def overflowing(*args, **kwargs):
        jac, autograd = real(*args, **kwargs)
        if where == "dense":
            jac[2, 0] = float("inf")
        else:
            _, a, g = jac.ghosts[-1]
            (a if where == "ghost-a" else g)[2, 0, 1] = float("inf")
        return jac, autograd

    monkeypatch.setattr(jacobian, "_backward_jacobian", overflowing)
    before = flat(c.model)
    with pytest.raises(FloatingPointError, match=r"^step 2: non-finite per-sample gradient for samples \[2\] .*; "
                                                 r"parameters left unchanged$"):
        opt.step(c.inputs, c.targets)
    assert torch.equal(flat(c.model), before) and opt.steps_taken == 2


def test_a_token_mean_damping_that_overflows_for_the_sum_is_refused():
    """``reduction="mean"``: the checked damping times ``K^2`` must stay finite (``inf`` would silently give a zero
    step)."""
    c = mlp_case()
    opt = ief.optim.IEF(c.model, reduction="mean", damping=1e308)
    before = flat(c.model)
    with pytest.raises(ValueError, match=r"^step 0: damping 1e\+308 for the token mean is inf for the sum over this "
                                         r"batch's 6 tokens \(x K\^2\): use a smaller damping; parameters left "
                                         r"unchanged$"):
        opt.step(c.inputs, c.targets)
    assert torch.equal(flat(c.model), before) and opt.steps_taken == 0


def test_reduction_mean_accepts_one_counted_token_and_names_an_empty_batch():
    c = sequence_case()
    one = torch.full_like(c.targets, -100)
    one[0, 1] = c.targets[0, 1] if int(c.targets[0, 1]) != -100 else 1
    opt = ief.optim.IEF(c.model, lr=0.01, reduction="mean", check=False)
    opt.step(c.inputs, one)
    assert opt.last_tokens == 1
    with pytest.raises(ValueError, match=r"^reduction='mean': the batch has no counted target \(every target is "
                                         r"-100\), so the mean loss is undefined; parameters left unchanged$"):
        opt.step(c.inputs, torch.full_like(c.targets, -100))


def test_sf_without_a_generator_round_trips_its_state_and_names_a_missing_generator():
    c = mlp_case()
    opt = ief.optim.SF(c.model, damping=1e-3)
    opt.step(c.inputs, c.targets)
    other = ief.optim.SF(copy.deepcopy(c.model), damping=1e-3)
    other.load_state_dict(opt.state_dict())
    assert other.steps_taken == 1
    with_gen = ief.optim.SF(c.model, damping=1e-3, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError) as err:
        other.load_state_dict(with_gen.state_dict())
    assert str(err.value) == (
        "this state_dict holds the state of SF's generator, but this SF has none (it would draw labels from the "
        "global RNG): construct it with generator=torch.Generator() to resume")


class _TokenLM(torch.nn.Module):
    """``model(input_ids=...)`` -> per-position logits ``[M, T, 6]`` (an LM-shaped toy for the unshifted-label
    warning)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(6, 4)
        self.head = torch.nn.Linear(4, 6)

    def forward(self, input_ids):
        return self.head(self.embed(input_ids))


UNSHIFTED = ("the targets equal inputs['input_ids'] at every counted position: for a causal LM (GPT-2, Llama, ...) "
             "these are Hugging Face's unshifted labels, and this step trains every position to predict its own input "
             "token; pass ief.causal_lm_targets(labels) (the next token at each position)")


def _step_warnings(inputs, targets, steps=1):
    torch.manual_seed(0)
    opt = ief.optim.IEF(_TokenLM().double(), lr=0.01, check=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            opt.step(inputs, targets)
    return [w for w in caught if not issubclass(w.category, ief.SlowPathWarning)]


def test_unshifted_causal_lm_labels_warn_once():
    ids = torch.randint(0, 6, (3, 2), generator=torch.Generator().manual_seed(0))
    caught = _step_warnings({"input_ids": ids}, ids.clone(), steps=2)
    assert len(caught) == 1
    assert caught[0].category is UserWarning and str(caught[0].message) == UNSHIFTED
    # (stacklevel 3 names this file's line; not asserted: mutation testing wraps every function in another frame)


def test_shifted_or_non_sequence_targets_do_not_warn():
    ids = torch.randint(0, 6, (3, 5), generator=torch.Generator().manual_seed(0))
    shifted = ief.causal_lm_targets(ids)
    assert _step_warnings({"input_ids": ids}, shifted) == []
    assert _step_warnings(ids, ids.clone()) == []  # not a dict: no input_ids to compare with
    options = importlib.import_module("ief.optim.options")
    flat_ids = ids[:, 0].contiguous()
    assert not options.looks_unshifted({"input_ids": flat_ids}, flat_ids.clone())  # [M] targets: no positions
    one = ids[:, :1].contiguous()
    assert not options.looks_unshifted({"input_ids": one}, one.clone())  # one position cannot be shifted
    assert options.looks_unshifted({"input_ids": ids[:, :2]}, ids[:, :2].clone())
    deep = ids[:, :3].reshape(3, 1, 3)
    assert options.looks_unshifted({"input_ids": deep}, deep.clone())  # positions along the last axis
    ignored = torch.full_like(ids, -100)
    assert not options.looks_unshifted({"input_ids": ids}, ignored)


# --- ief.optim.convention ----------------------------------------------------------------------------------------
def test_convention_round_trip_defaults_and_errors():
    from ief.optim import convention as conv

    assert conv.to_sum_convention("ief", 2.0, 3.0, 4) == (0.5, 48.0)
    assert conv.to_sum_convention("ef", 2.0, 3.0, 4) == (8.0, 48.0)
    assert conv.to_sum_convention("sf", 2.0, 3.0, 4, normalized=True) == (2.0, 48.0)
    assert conv.to_token_mean_convention("ief", 0.5, 48.0, 4) == (2.0, 3.0)
    assert conv.to_token_mean_convention("ef", 8.0, 48.0, 4) == (2.0, 3.0)
    assert conv.to_token_mean_convention("ef", 2.0, 48.0, 4, normalized=True) == (2.0, 3.0)
    for call, text in [
        (lambda: conv.to_sum_convention("kfac", 1.0, 1.0, 2),
         "unknown method 'kfac'; the conversion exists for: ief, ef, sf"),
        (lambda: conv.to_sum_convention("ief", 1.0, 1.0, 0),
         "tokens (K, target tokens in the batch) must be a positive integer, got 0"),
        (lambda: conv.to_sum_convention("ief", 1.0, 1.0, 2.0),
         "tokens (K, target tokens in the batch) must be a positive integer, got 2.0"),
        (lambda: conv.to_sum_convention("ief", 1.0, 1.0, True),
         "tokens (K, target tokens in the batch) must be a positive integer, got True"),
    ]:
        with pytest.raises(ValueError) as err:
            call()
        assert str(err.value) == text


@given(st.sampled_from(["ief", "ef", "sf"]), st.floats(1e-6, 1e3), st.floats(0.0, 1.0), st.integers(1, 10_000),
       st.booleans())
def test_conversion_round_trips_and_damping_scales_by_k_squared(method, lr, damping, k, normalized):
    from ief.optim.convention import to_sum_convention, to_token_mean_convention

    lr_s, d_s = to_sum_convention(method, lr, damping, k, normalized=normalized)
    assert d_s == pytest.approx(damping * k * k)
    assert lr_s == pytest.approx(lr if normalized else (lr / k if method == "ief" else lr * k))
    assert to_token_mean_convention(method, lr_s, d_s, k, normalized=normalized) == pytest.approx((lr, damping))


def test_count_targets_is_what_the_mean_losses_divide_by():
    """``ief.count_targets``: the ``K`` of torch's (and Hugging Face's) mean cross-entropy with ``-100`` ignored, and
    every entry of a float target, the ``K`` of ``mse_loss``'s mean (``l_n = 1/2 ||z_n - y_n||^2``)."""
    torch.manual_seed(0)
    logits = torch.randn(3, 4, 5, dtype=torch.float64)
    targets = torch.tensor([[1, -100, 2, 0], [-100, -100, -100, -100], [4, 4, -100, 3]])
    k = ief.count_targets(targets)
    assert k == 6 and ief.IGNORE_INDEX == -100 and ief.count_targets(targets.int()) == 6
    ce = ief.get_loss("cross_entropy")
    mean = torch.nn.functional.cross_entropy(logits.reshape(-1, 5), targets.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(ce.per_sample(logits, targets).sum() / k, mean, rtol=1e-14, atol=0)
    floats = torch.randn(3, 4, 5, dtype=torch.float64)
    mse = ief.get_loss("mse")
    assert ief.count_targets(floats) == floats.numel()
    torch.testing.assert_close(mse.per_sample(logits, floats).sum() / ief.count_targets(floats),
                               torch.nn.functional.mse_loss(logits, floats) / 2, rtol=1e-14, atol=0)
    assert ief.count_targets(torch.full((2, 3), -100)) == 0
    for bad, text in [(torch.ones(2, dtype=torch.bool), "tensor of dtype torch.bool"), ([1, 2], "got list")]:
        with pytest.raises(ValueError, match=f"count_targets needs class-index targets.*{text}"):
            ief.count_targets(bad)


def test_constructor_messages_name_the_argument_and_the_value():
    c = mlp_case()
    for kwargs, text in [
        (dict(lr=-1.0), "lr must be a finite number > 0, got -1.0"),
        (dict(lr="fast"), "lr must be a finite number > 0 or 'auto' (the rate set from the loss along the previous "
                          "step: ief.optim.auto_lr), got 'fast'"),
    ]:
        with pytest.raises(ValueError) as err:
            ief.optim.IEF(c.model, **kwargs)
        assert str(err.value) == text
    with pytest.raises(ValueError) as err:
        ief.optim.IEF([1, 2])
    assert str(err.value) == "model must be a torch.nn.Module (the optimiser runs its forward), got list"


def test_a_fresh_optimiser_has_no_last_step_and_total_steps_1_is_one_full_step():
    c = mlp_case()
    opt = ief.optim.IEF(c.model, lr=0.5, damping=1e-3, total_steps=1)
    assert opt.last_losses is None and opt.last_tokens is None and opt.last_update_norm is None
    r = ief.per_sample(c.model, c.inputs, c.targets)
    d = ief.ief_direction(r.jacobian, r.logit_sqnorm, 1e-3)
    theta0 = flat(c.model)
    opt.step(c.inputs, c.targets)
    assert_rel(flat(c.model) - theta0, -0.5 * d, what="the first (full) step of a 1-step decay")
    theta1 = flat(c.model)
    opt.step(c.inputs, c.targets)  # 1 - t/T = 0 from then on
    assert torch.equal(flat(c.model), theta1)


@pytest.mark.parametrize("which, text", [
    ("loss", r"^step 0: non-finite loss \[inf, 1\.0\]; parameters left unchanged$"),
    ("direction", r"^step 0: non-finite gradients or update; parameters left unchanged$"),
])
def test_a_non_finite_loss_or_update_is_refused_naming_the_step(which, text, monkeypatch):
    """The step's own checks of what ``_direction`` returns (overflow past the per-sample checks)."""
    c = mlp_case()
    opt = ief.optim.IEF(c.model, lr=0.1)
    p = sum(q.numel() for q in c.model.parameters())
    losses = torch.tensor([math.inf, 1.0]) if which == "loss" else torch.ones(2)
    direction = torch.full((p,), math.inf) if which == "direction" else torch.ones(p)
    monkeypatch.setattr(opt, "_direction", lambda *args: Direction(losses, direction))
    before = flat(c.model)
    with pytest.raises(FloatingPointError, match=text):
        opt.step(c.inputs, c.targets)
    assert torch.equal(flat(c.model), before) and opt.steps_taken == 0


def test_sf_refuses_a_non_finite_gradient_naming_the_step(monkeypatch):
    """SF's batch gradient comes from its own backward: an overflow there is named (finite losses and rows)."""
    exact = importlib.import_module("ief.optim.exact")
    real = exact.gradient_and_sampled_jacobian

    def overflowed(*args, **kwargs):
        losses, grad, sampled = real(*args, **kwargs)
        return losses, torch.full_like(grad, math.inf), sampled

    monkeypatch.setattr(exact, "gradient_and_sampled_jacobian", overflowed)
    c = mlp_case()
    with pytest.raises(FloatingPointError, match=r"^step 0: non-finite gradient; parameters left unchanged$"):
        ief.optim.SF(c.model, damping=1e-3).step(c.inputs, c.targets)


def test_a_diverging_run_is_warned_about_once_naming_the_rate_and_what_to_try():
    """iEF at lr 300 on a small MLP overshoots (mean loss 1.16 -> 1,461 in one step): one UserWarning names the growth,
    the rate and a 10x smaller one; a run at lr 1 is not warned about; the loss it watches is read with the step's
    own checks (tests/companion/test_host_syncs.py holds the round-trip budget)."""
    import warnings

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    x, y = torch.randn(32, 5), torch.randint(0, 3, (32,))
    calm = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = ief.optim.IEF(model, lr=300.0)
        for _ in range(4):
            opt.step(x, y)
        ief.optim.IEF(calm, lr=1.0).step(x, y)
    said = [str(w.message) for w in caught if "overshooting" in str(w.message)]
    assert len(said) == 1, said
    assert said[0].startswith("IEF: the mean per-sample loss grew from 1.158 (step 0) to ")
    assert "with lr=300: the updates are overshooting; try a rate about 10x smaller (lr=30)" in said[0]
