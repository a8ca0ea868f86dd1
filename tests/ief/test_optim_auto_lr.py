"""``lr="auto"`` (:mod:`ief.optim.auto_lr`): the rate set every step from the new batch's loss along the previous step.

The rule's arithmetic against a quadratic written by hand; one step's measurement (``D``, ``E``) and update against a
float64 oracle (autograd on the summed loss, and a plain ``IEF`` with the rate the rule must pick), with momentum and
weight decay; the sum and mean conventions giving the same steps; a case where the paper's ``lr=100`` (token mean)
and ``lr=100`` (sum) blow the loss up and ``"auto"`` does not; ``state_dict`` round trips; refused values.
"""
from __future__ import annotations

import copy
import math
import sys
from pathlib import Path

import pytest
import torch

import ief
import oracle
from ief.optim import auto_lr
from tiny_models import mlp_case, mse_case

sys.path.insert(0, str(Path(__file__).parent))  # test_optim's tiny BERT-LoRA
from test_optim import _bert_loss, _tiny_bert_lora  # noqa: E402


def _batches(n: int, m: int = 6, seed: int = 1, classes: int = 4):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(m, 5, generator=g, dtype=torch.float64), torch.randint(0, classes, (m,), generator=g))
            for _ in range(n)]


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# ------------------------------------------------------------------------------------------- the rule's arithmetic
@pytest.mark.parametrize("gain, curvature, factor", [
    (3.0, 4.0, 0.75),       # the quadratic's minimiser inside [1/2, 2]
    (1.0, 0.25, 2.0),       # a minimiser at 4: the factor is capped at GROW
    (0.2, 4.0, 0.5),        # at 0.05: floored at SHRINK
    (-1.0, 4.0, 0.5),       # the step went uphill on the new batch: negative minimiser, floored
    (1.0, -2.0, 2.0),       # concave, descending: grow
    (-1.0, -2.0, 0.5),      # concave, ascending: shrink
])
def test_the_rate_is_multiplied_by_the_fitted_quadratics_minimiser(gain, curvature, factor):
    """``f(a) = f0 - gain a + curvature a^2 / 2``: ``D = f(0) - f(1)`` and ``E = -f'(1)`` determine it."""
    achieved, slope = gain - curvature / 2, gain - curvature
    assert auto_lr.next_rate(0.3, achieved, slope) == pytest.approx(0.3 * factor, rel=1e-14)


def test_a_non_finite_measurement_shrinks_and_the_rate_stays_in_range():
    assert auto_lr.next_rate(0.4, math.inf, 1.0) == 0.2
    assert auto_lr.next_rate(0.4, 1.0, math.nan) == 0.2
    assert auto_lr.next_rate(1e-6 * 0.01, -1.0, 1.0, first=0.01) == pytest.approx(1e-8)  # the floor, relative
    assert auto_lr.next_rate(8.0, 1.0, 1.5) == 10.0  # concave, descending: doubled, then capped at 10 x the first
    assert auto_lr.next_rate(0.08, 1.0, 1.5, first=0.01) == pytest.approx(0.1)


def test_the_cap_candidate_never_binds_below_1_2277_for_cross_entropy():
    """The module docstring's reason for not choosing the per-sample cap: ``l_n / s_n >= 1.2277`` for cross-entropy at
    any prediction (random logits of 2 to 50 classes, including near-saturated ones)."""
    g = torch.Generator().manual_seed(0)
    for classes in (2, 3, 10, 50):
        scale = torch.logspace(-2, 1.5, 4000, dtype=torch.float64)[:, None]
        logits = torch.randn(4000, classes, generator=g, dtype=torch.float64) * scale
        y = torch.randint(0, classes, (4000,), generator=g)
        loss = torch.nn.functional.cross_entropy(logits, y, reduction="none")
        s = (torch.softmax(logits, -1) - torch.nn.functional.one_hot(y, classes)).pow(2).sum(-1)
        kept = loss > 1e-6  # (a saturated sample's loss rounds to 0 before its s does)
        assert float((loss / s)[kept].min()) >= 1.2277
        assert float((loss / s)[kept].min()) < 1.25  # the bound is approached


# ----------------------------------------------------------------------------------------------- one step, float64
def _summed_loss(model, x, y, loss="cross_entropy") -> torch.Tensor:
    return oracle.sample_loss(model(x), y, loss).sum()


@pytest.mark.parametrize("extras", [{}, {"momentum": 0.9, "weight_decay": 0.05},
                                    {"normalize": True, "total_steps": 10}],
                         ids=["plain", "momentum-wd", "normalised-decay"])
def test_a_step_measures_the_new_batch_along_the_last_change_and_uses_the_rate_it_implies(extras):
    """Step 0 on batch A at rate 1; step 1 on batch B: ``delta`` is exactly the applied change (buffer and decay
    included), ``D = L_B(theta_0) - L_B(theta_1)`` and ``E = grad L_B(theta_1) . delta`` as autograd computes them in
    float64, and the step is a plain ``IEF`` step with the rate :func:`next_rate` gives."""
    case = mlp_case()
    (xa, ya), (xb, yb) = _batches(2)
    opt = ief.optim.IEF(case.model, lr="auto", damping=1e-3, **extras)
    theta0 = _params(case.model)
    opt.step(xa, ya)
    theta1 = _params(case.model)
    assert opt.last_lr == 1.0
    for d, a, b in zip(opt._auto.delta, theta0, theta1):
        assert torch.allclose(d, a - b, rtol=0, atol=1e-14)
    # the oracle's D and E on batch B
    probe = copy.deepcopy(case.model)
    with torch.no_grad():
        for p, a in zip(probe.parameters(), theta0):
            p.copy_(a)
        before = float(_summed_loss(probe, xb, yb))
    after_loss = _summed_loss(case.model, xb, yb)
    grad = torch.autograd.grad(after_loss, list(case.model.parameters()))
    achieved = before - float(after_loss.detach())
    slope = sum(float((g * (a - b)).sum()) for g, a, b in zip(grad, theta0, theta1))
    rate = auto_lr.next_rate(1.0, achieved, slope)
    assert rate != 1.0  # the comparison below must tell the rule's rate from the first one
    # the same step with that rate given: a copy at theta_1 with the same optimiser state
    twin = copy.deepcopy(case.model)
    plain = ief.optim.IEF(twin, lr=rate, damping=1e-3, **extras)
    plain.load_state_dict({k: v for k, v in opt.state_dict().items() if k != "auto_lr"} | {
        "param_groups": [dict(opt.state_dict()["param_groups"][0], lr=rate)]})
    opt.step(xb, yb)
    plain.step(xb, yb)
    assert opt.last_lr == pytest.approx(rate, rel=1e-10)
    for got, want in zip(case.model.parameters(), twin.parameters()):
        assert torch.allclose(got, want, rtol=1e-10, atol=1e-12), (got - want).abs().max()


def test_mse_and_ef_sf_take_the_rule():
    """The rule uses only the loss and the gradient: MSE and EF/SF (normalised: the rate is the update's norm)."""
    case = mse_case()
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(5, 3, generator=g, dtype=torch.float64), torch.randn(5, 2, generator=g,
                                                                                 dtype=torch.float64))
               for _ in range(4)]
    for cls in (ief.optim.IEF, ief.optim.EF, ief.optim.SF):
        model = copy.deepcopy(case.model)
        opt = cls(model, lr="auto", loss="mse", damping=1e-3)
        rates = []
        for x, y in batches:
            opt.step(x, y)
            rates.append(opt.last_lr)
        assert rates[0] == auto_lr.INITIAL[cls.method] and len(set(rates)) > 1, rates
        if cls is not ief.optim.IEF:
            assert opt.last_update_norm == pytest.approx(rates[-1], rel=1e-10)


def test_the_mean_convention_steps_exactly_as_the_sum_convention():
    """``reduction="mean"`` with damping ``lambda`` and ``"sum"`` with ``K^2 lambda`` (K = the batch's counted
    targets) take the same steps; ``last_lr`` is the rate in each convention (iEF: ``K`` times the sum's)."""
    case = mlp_case()
    batches = _batches(4)
    k = batches[0][1].numel()
    runs = {}
    for reduction, damping in (("sum", 1e-3 * k * k), ("mean", 1e-3)):
        model = copy.deepcopy(case.model)
        opt = ief.optim.IEF(model, lr="auto", damping=damping, reduction=reduction)
        rates = []
        for x, y in batches:
            opt.step(x, y)
            rates.append(opt.last_lr)
        runs[reduction] = (_params(model), rates)
    for a, b in zip(runs["sum"][0], runs["mean"][0]):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)
    assert [r * k for r in runs["sum"][1]] == pytest.approx(runs["mean"][1], rel=1e-10)
    assert len(set(runs["sum"][1])) > 1


# ------------------------------------------------------------------------------------------------ never diverges
@pytest.mark.parametrize("kwargs", [{"reduction": "mean"}, {"lr": 100.0, "damping": 1e-7}],
                         ids=["paper-mean-lr100", "sum-lr100"])
def test_auto_does_not_blow_up_where_a_fixed_rate_does(kwargs):
    """A tiny BERT-LoRA (random weights, random binary labels, 6 batches of 16): the fixed rate takes a batch's
    summed loss above 10 times its start (the paper's mean-convention default: 11.1 -> 192 at the second step;
    ``lr=100`` in the sum convention: -> 3,872), ``"auto"`` with the same damping keeps it under 1.5 times."""
    torch.manual_seed(0)
    batches = [({"input_ids": torch.randint(1, 100, (16, 12))}, torch.randint(0, 2, (16,))) for _ in range(6)]
    auto_kwargs = {k: v for k, v in kwargs.items() if k != "lr"}
    worst = {}
    for name, kw in (("fixed", kwargs), ("auto", dict(auto_kwargs, lr="auto"))):
        model = _tiny_bert_lora()
        start = _bert_loss(model, *batches[0])
        opt = ief.optim.IEF(model, **kw)
        highest = start
        for inputs, targets in batches:
            opt.step(inputs, targets)
            highest = max(highest, _bert_loss(model, *batches[0]))
        worst[name] = highest / start
    assert worst["fixed"] > 10, worst
    assert worst["auto"] < 1.5, worst


# ------------------------------------------------------------------------------------------------------ the state
def test_state_dict_round_trips_the_rate_and_the_last_change():
    """Two steps, save, two more; a fresh optimiser loading the saved state on a copy of the saved model takes the
    same two steps (the rate and ``delta`` carried; ``last_lr`` as the uninterrupted run's)."""
    case = mlp_case()
    batches = _batches(4)
    opt = ief.optim.IEF(case.model, lr="auto", damping=1e-3, momentum=0.5)
    for x, y in batches[:2]:
        opt.step(x, y)
    saved_model = copy.deepcopy(case.model)
    saved = copy.deepcopy(opt.state_dict())
    assert saved["auto_lr"]["rate"] == opt._auto.rate and saved["param_groups"][0]["lr"] == "auto"
    for x, y in batches[2:]:
        opt.step(x, y)
    resumed = ief.optim.IEF(saved_model, lr="auto", damping=1e-3, momentum=0.5)
    resumed.load_state_dict(saved)
    for x, y in batches[2:]:
        resumed.step(x, y)
    assert resumed.last_lr == opt.last_lr
    for a, b in zip(case.model.parameters(), saved_model.parameters()):
        assert torch.equal(a, b)
    fresh = ief.optim.IEF(copy.deepcopy(saved_model), lr="auto", damping=1e-3, momentum=0.5)
    with pytest.raises(ValueError, match="rate must be a finite number > 0, got -1"):
        fresh.load_state_dict(dict(saved, auto_lr={"rate": -1.0, "delta": None}))
    assert fresh.state_dict()["auto_lr"]["delta"] is None  # refused before anything loaded


def test_auto_written_into_param_groups_switches_the_rule_on():
    case = mlp_case()
    opt = ief.optim.IEF(case.model, lr=0.5, damping=1e-3)
    opt.step(*_batches(1)[0])
    assert opt.last_lr == 0.5 and "auto_lr" not in opt.state_dict()
    opt.param_groups[0]["lr"] = "auto"
    opt.step(*_batches(1)[0])
    assert opt.last_lr == auto_lr.INITIAL["ief"] and "auto_lr" in opt.state_dict()


# ------------------------------------------------------------------------------------------------ refused values
def test_bad_values_are_refused_naming_the_accepted_ones():
    model = mlp_case().model
    for cls in (ief.optim.IEF, ief.optim.EF, ief.optim.SF):
        with pytest.raises(ValueError, match=r"finite number > 0 or 'auto'.*got 'autoo'"):
            cls(model, lr="autoo")
    with pytest.raises(ValueError, match=r"KFAC does not take lr='auto'"):
        ief.optim.KFAC(model, "kfac", lr="auto", damping=1.0, kl_clip=None)
    opt = ief.optim.IEF(model, lr="auto")
    theta = _params(model)
    opt.param_groups[0]["lr"] = "autoo"
    with pytest.raises(ValueError, match=r"\['lr'\] must be a finite number >= 0 or 'auto'.*'autoo'"):
        opt.step(*_batches(1)[0])
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), theta))


def test_bfloat16_weights_step_with_the_rule():
    """A bfloat16 model (ief.precision): the kept change is float32 and the probe puts the parameters back as they
    were (bit for bit), so the rule's steps match a plain IEF at the rates it chose."""
    case = mlp_case(dtype=torch.bfloat16)
    batches = [(x.to(torch.bfloat16), y) for x, y in _batches(3)]
    twin = copy.deepcopy(case.model)
    opt = ief.optim.IEF(case.model, lr="auto", damping=1e-3)
    plain = ief.optim.IEF(twin, lr=1.0, damping=1e-3)
    for x, y in batches:
        opt.step(x, y)
        plain.param_groups[0]["lr"] = opt.last_lr  # the probe ran first: the rate is now the step's
        plain.step(x, y)
        assert all(d.dtype == torch.float32 for d in opt._auto.delta)
    assert len({opt.last_lr, 1.0}) == 2
    for a, b in zip(case.model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
