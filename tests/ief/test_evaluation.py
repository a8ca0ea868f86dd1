"""ief.evaluate (alg:eval): tidy records whose gammas are those of the methods' directions, and its bad input."""
from __future__ import annotations

import math

import pytest
import torch

import ief
from ief.evaluation import batch_generator, imbalance
from oracle import per_sample as oracle_per_sample
from tiny_models import mlp_case


def _batches(k=2, m=6):
    case = mlp_case(m=m)
    batches = []
    for s in range(k):
        torch.manual_seed(100 + s)
        batches.append((torch.randn(m, 5, dtype=torch.float64), torch.randint(0, 4, (m,))))
    return case.model, batches


def test_records_are_tidy_and_gammas_are_those_of_the_directions():
    model, batches = _batches()
    lam = 1e-3
    records = ief.evaluate(model, batches, ief.METHODS, damping=lam, cg_iterations=10, seed=5, extra={"stage": 50})
    assert len(records) == len(batches) * len(ief.METHODS)
    assert {tuple(sorted(r)) for r in records} == {
        ("batch", "damping", "gamma", "imbalance", "method", "ratio", "stage")}
    for b, (x, y) in enumerate(batches):
        ps = ief.per_sample(model, x, y)
        gen = batch_generator(5, b)
        sampled = ief.sampled_jacobian(model, x, y, gen)
        dirs = {
            "sgd": ps.gradient, "ef": ief.ef_direction(ps.jacobian, lam),
            "ief": ief.ief_direction(ps.jacobian, ps.logit_sqnorm, lam),
            "sf": ief.sf_direction(sampled, ps.gradient, lam),
            "kfac": ief.kfac_direction(model, x, y, "kfac", lam, generator=batch_generator(5, b)),
            "ekfac": ief.kfac_direction(model, x, y, "ekfac", lam),
            "iekfac": ief.kfac_direction(model, x, y, "iekfac", lam),
            "hf": ief.hessian_free(model, x, y, 10),
        }
        got = {r["method"]: r for r in records if r["batch"] == b}
        g_sgd = ief.gamma(model, x, y, ps.gradient)
        for m, d in dirs.items():
            g = ief.gamma(model, x, y, d)
            assert got[m]["gamma"] == pytest.approx(g, rel=1e-10), m
            assert got[m]["ratio"] == pytest.approx(g / g_sgd, rel=1e-10), m
            assert got[m]["stage"] == 50
        assert got["sgd"]["ratio"] == 1.0 and got["sgd"]["damping"] is None and got["hf"]["damping"] is None
        # Hessian-free CG minimises gamma step by step from the gradient direction (sec:app-CG-gamma)
        assert got["hf"]["gamma"] <= got["sgd"]["gamma"] * (1 + 1e-12)


def test_imbalance_is_max_over_min_per_sample_gradient_norm():
    model, batches = _batches(k=1)
    x, y = batches[0]
    _, jac, _ = oracle_per_sample(model, x, y)
    norms = jac.norm(dim=1)
    records = ief.evaluate(model, batches, ["ief"], damping=0.0)
    assert records[0]["imbalance"] == pytest.approx(float(norms.max() / norms.min()), rel=1e-10)
    assert imbalance(torch.zeros(3, 4)) == 1.0
    assert imbalance(torch.tensor([[0.0, 0.0], [1.0, 0.0]])) == math.inf


def test_sgd_is_always_recorded_and_damping_per_method():
    model, batches = _batches(k=1)
    records = ief.evaluate(model, batches, ["ef", "sf"], damping={"ef": 0.0, "sf": 1e-2})
    assert [r["method"] for r in records] == ["sgd", "ef", "sf"]
    assert [r["damping"] for r in records] == [None, 0.0, 1e-2]


@pytest.mark.parametrize("methods, damping, match", [
    (["ef", "newton"], 1e-3, "unknown method"),
    ([], 1e-3, "unknown method"),
    (["sf"], 0.0, "SF direction"),
    (["ef", "ief"], {"ef": 1e-3}, "no value for method"),
    (["ef"], -1.0, "damping"),
])
def test_bad_input(methods, damping, match):
    model, batches = _batches(k=1)
    with pytest.raises(ValueError, match=match):
        ief.evaluate(model, batches, methods, damping)


def test_block_diagonal_methods_fail_before_the_first_batch_naming_the_parameter():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))

    def batches():
        raise AssertionError("no batch may be drawn before the parameters are checked")
        yield

    with pytest.raises(ValueError, match=r"outside any nn.Linear: \['1.weight', '1.bias'\]"):
        ief.evaluate(model, batches(), ["sgd", "ekfac"], 1e-3)


@pytest.mark.parametrize("batches, match", [
    (lambda x, y: [{"x": x, "labels": y}], r"batches\[0\] is a mapping with keys 'x', 'labels'; split it"),
    (lambda x, y: (x, y), r"batches\[0\] is a tensor of shape \[6, 5\] \(for one batch \(x, y\), pass \[\(x, y\)\]\)"),
    (lambda x, y: [(x, y, y)], r"batches\[0\] is a tuple of length 3"),
    (lambda x, y: [(x, y), "x"], r"batches\[1\] is a str"),
])
def test_batches_that_are_not_pairs_are_named_in_one_sentence(batches, match):
    """The natural mistakes (a Hugging Face style dict, one (x, y) pair passed as the batches, a triple) get a
    sentence saying what batches[i] is and what to pass, not "too many values to unpack" or a complaint about
    targets."""
    case = mlp_case()
    with pytest.raises(ValueError, match=r"batches must be an iterable of \(inputs, targets\) pairs; " + match):
        ief.evaluate(case.model, batches(case.inputs, case.targets), methods=["ief"])


def test_evaluate_refuses_an_inf_input_with_the_optimisers_message():
    """An inf behind a ``tanh`` (finite logits, NaN rows) is refused naming its sample, with SGD alone too."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    x[1, 2] = float("inf")
    y = torch.tensor([0, 1, 2, 0, 1])
    for methods in (["sgd"], ["sgd", "ef", "ief", "sf"]):
        with pytest.raises(FloatingPointError, match=r"for samples \[1\] \(of 5\): a NaN or inf in those samples' "
                                                     r"inputs, logits or targets"):
            ief.evaluate(model, [(x, y)], methods=methods)
