"""ief.damping_sweep: every (method, damping) gamma equals a separate ief.gamma of the exact direction."""
from __future__ import annotations

import pytest
import torch

import ief
from tiny_models import mlp_case, mse_case, sequence_case, t5_lora_case

DAMPINGS = [1e-8, 1e-4, 1e-2, 1.0, 100.0]


def _separate(case, lam, seed):
    ps = ief.per_sample(case.model, case.inputs, case.targets, loss=case.loss)
    sampled = ief.sampled_jacobian(case.model, case.inputs, case.targets, torch.Generator().manual_seed(seed),
                                   loss=case.loss)
    dirs = {"ef": ief.ef_direction(ps.jacobian, lam), "ief": ief.ief_direction(ps.jacobian, ps.logit_sqnorm, lam),
            "sf": ief.sf_direction(sampled, ps.gradient, lam), "sgd": ps.gradient}
    return {m: ief.gamma(case.model, case.inputs, case.targets, d, loss=case.loss) for m, d in dirs.items()}


@pytest.mark.parametrize("make", [mlp_case, mse_case, sequence_case, t5_lora_case], ids=lambda f: f.__name__)
def test_sweep_equals_separate_gamma_calls(make):
    case = make()
    if make is not sequence_case:  # (no dropout there; eval-mode nn.MultiheadAttention has no forward-mode AD)
        case.model.eval()  # dropout off: the separate calls draw their own masks
    dampings = [1e-4, 1.0] if make is t5_lora_case else DAMPINGS  # (the separate calls are slow on T5)
    records = ief.damping_sweep(case.model, case.inputs, case.targets, dampings, loss=case.loss,
                                generator=torch.Generator().manual_seed(7))
    assert len(records) == 1 + 3 * len(dampings)
    sgd = records[0]
    # T5's layer norm computes its variance in float32 even in a float64 model, so its JVPs are linear in the
    # tangent only to ~1e-8 (measured: J_z(sum_n J_n) vs sum_n J_z J_n, 8e-8); exact float64 elsewhere.
    rel = 1e-6 if make is t5_lora_case else 1e-9
    for lam in dampings:
        expected = _separate(case, lam, 7)
        assert sgd["gamma"] == pytest.approx(expected["sgd"], rel=rel)
        for r in (r for r in records if r["damping"] == lam):
            assert r["gamma"] == pytest.approx(expected[r["method"]], rel=rel), (r, expected)
            assert r["ratio"] == pytest.approx(expected[r["method"]] / expected["sgd"], rel=rel)


def test_sweep_without_sf_allows_zero_damping_and_matches_evaluate():
    case = mlp_case(m=5)
    records = ief.damping_sweep(case.model, case.inputs, case.targets, [0.0, 1e-3], methods=["ief", "ef"])
    ev = ief.evaluate(case.model, [(case.inputs, case.targets)], ["ef", "ief"], damping=1e-3)
    by = {r["method"]: r for r in ev}
    for r in records:
        if r["damping"] == 1e-3:
            assert r["gamma"] == pytest.approx(by[r["method"]]["gamma"], rel=1e-9)


@pytest.mark.parametrize("kwargs, match", [
    (dict(dampings=[0.0]), "damping must be a finite number > 0"),
    (dict(dampings=[]), "dampings is empty"),
    (dict(dampings=[1.0], methods=["kfac"]), "unknown sweep method"),
    (dict(dampings=[float("inf")]), "damping"),
])
def test_bad_input(kwargs, match):
    case = mlp_case()
    with pytest.raises(ValueError, match=match):
        ief.damping_sweep(case.model, case.inputs, case.targets, **kwargs)
