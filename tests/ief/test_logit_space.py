"""ief.logit_space: the batch's logit Jacobian J_z gives the per-sample gradients, gamma, the Fisher products and
the whole evaluation (alg:eval) and damping sweep exactly as the per-pass route (float64, dense oracle)."""
from __future__ import annotations

import pytest
import torch

import ief
from ief.curvature import FisherOperator, gamma_from
from ief.evaluation import batch_generator
from ief.logit_space import logit_jacobian
from oracle import per_sample as oracle_per_sample
from tiny_models import mlp_case, mse_case, sequence_case

CASES = [mlp_case, mse_case, sequence_case]


def _case(make):
    case = make()
    case.model.eval()
    return case


@pytest.mark.parametrize("make", CASES, ids=lambda f: f.__name__)
def test_rows_give_per_sample_gradients_gamma_and_fisher_products(make):
    case = _case(make)
    model, x, y = case.model, case.inputs, case.targets
    lj = logit_jacobian(model, x, y, loss=case.loss, max_entries=1000)
    _, jac, _ = oracle_per_sample(model, x, y, loss=case.loss)
    torch.testing.assert_close(lj.per_sample_gradients(y), jac.to(torch.float64), rtol=1e-10, atol=1e-12)
    ps = ief.per_sample(model, x, y, loss=case.loss)
    torch.testing.assert_close(lj.logit_sqnorm(y), ps.logit_sqnorm.to(torch.float64), rtol=1e-10, atol=1e-14)
    gen = torch.Generator().manual_seed(3)
    dirs = torch.randn(3, jac.shape[1], generator=gen, dtype=torch.float64)
    curv, slope = lj.curvature_and_slope(dirs)
    for d, c, s in zip(dirs, curv, slope):
        assert gamma_from(float(c), float(s)) == pytest.approx(ief.gamma(model, x, y, d, loss=case.loss),
                                                                   rel=1e-9)
    fisher = FisherOperator(model, x, y, loss=case.loss)
    torch.testing.assert_close(lj.fisher_vp(dirs[0]), fisher.matvec(dirs[0]), rtol=1e-9, atol=1e-12)


def test_sampled_labels_are_those_of_sampled_jacobian():
    case = _case(mlp_case)
    lj = logit_jacobian(case.model, case.inputs, case.targets)
    sampled = ief.sampled_jacobian(case.model, case.inputs, case.targets, torch.Generator().manual_seed(9))
    got = lj.per_sample_gradients(lj.sample_targets(torch.Generator().manual_seed(9)))
    torch.testing.assert_close(got, sampled, rtol=1e-10, atol=1e-12)


def test_evaluate_is_the_same_on_both_routes():
    case = _case(lambda: mlp_case(m=8))
    batches = [(case.inputs, case.targets), (case.inputs[:5], case.targets[:5])]
    fast = ief.evaluate(case.model, batches, ief.METHODS, 1e-3, cg_iterations=6, seed=2, logit_space=True)
    slow = ief.evaluate(case.model, batches, ief.METHODS, 1e-3, cg_iterations=6, seed=2, logit_space=False)
    assert [(r["batch"], r["method"]) for r in fast] == [(r["batch"], r["method"]) for r in slow]
    for f, s in zip(fast, slow):
        assert f["gamma"] == pytest.approx(s["gamma"], rel=1e-8), f
        assert f["imbalance"] == pytest.approx(s["imbalance"], rel=1e-10)


def test_sweep_reuses_a_given_logit_jacobian():
    case = _case(mlp_case)
    x, y = case.inputs, case.targets
    records, lj = ief.evaluation.evaluate_batch(case.model, x, y, ["sgd", "ief"], 1e-3,
                                                generator=batch_generator(0, 0))
    assert lj is not None
    reused = ief.damping_sweep(case.model, x, y, [1e-3, 1.0], generator=torch.Generator().manual_seed(1),
                               logit_space=lj)
    slow = ief.damping_sweep(case.model, x, y, [1e-3, 1.0], generator=torch.Generator().manual_seed(1),
                             logit_space=False)
    for a, b in zip(reused, slow):
        assert (a["method"], a["damping"]) == (b["method"], b["damping"])
        assert a["gamma"] == pytest.approx(b["gamma"], rel=1e-9)
    by = {r["method"]: r["gamma"] for r in records}
    assert next(r for r in reused if r["method"] == "ief" and r["damping"] == 1e-3)["gamma"] == \
        pytest.approx(by["ief"], rel=1e-9)


def test_route_choice():
    case = mlp_case(m=3)  # 4 classes > 3 samples: too many passes for the automatic route
    assert logit_jacobian(case.model, case.inputs, case.targets) is None
    assert logit_jacobian(case.model, case.inputs, case.targets, max_entries=4) is not None
    assert logit_jacobian(case.model, case.inputs, case.targets, max_entries=4, max_bytes=10) is None
    with pytest.raises(ValueError, match="logit_space=True"):
        ief.evaluate(case.model, [(case.inputs, case.targets)], ["ef"], 1e-3, logit_space=True)
    # training mode (dropout would differ per pass): the automatic choice is the per-pass route, still correct
    train = mlp_case(m=8)
    records = ief.evaluate(train.model, [(train.inputs, train.targets)], ["ief"], 1e-3)
    assert records[1]["gamma"] == pytest.approx(
        ief.evaluate(train.model.eval(), [(train.inputs, train.targets)], ["ief"], 1e-3)[1]["gamma"], rel=1e-8)
