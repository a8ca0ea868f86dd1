"""The block-diagonal study's gammas (``sec:app-iEF-eNGDopt``) at a checkpoint-like MLP against a dense float64 oracle:
``ief.evaluation.evaluate_batch`` (the numbers of the evaluation records) and ``companion.experiments.blockdiag_check``
(the chapter's dense check) both held to the explicit Fisher of ``tests/oracle.py`` and Kronecker factors formed
sample by sample and inverted as dense ``P_l x P_l`` matrices."""
from __future__ import annotations

import copy
import math

import pandas as pd
import pytest
import torch

from ief.evaluation import batch_generator, evaluate_batch, fresh_generator
from companion.experiments.blockdiag_check import DENSE_METHODS, blockdiag_check, check_summary, dense_check
from ief.losses import get_loss
from oracle import fisher, per_sample
from tiny_models import mlp_case


def checkpoint_like(m: int = 12, steps: int = 15, dtype=torch.float64, seed: int = 0):
    """A ReLU MLP (6 -> 9 -> 8 -> 4, P = 173) after ``steps`` Adam steps on its own data, as a stage checkpoint: the
    predictions are no longer uniform, so ``s_n`` spreads over the batch (eKFAC and ieKFAC differ)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.ReLU(), torch.nn.Linear(9, 8), torch.nn.ReLU(),
                                torch.nn.Linear(8, 4)).to(dtype)
    x = torch.randn(64, 6, dtype=dtype)
    y = (x[:, :4] + torch.randn(64, 4, dtype=dtype)).argmax(1)  # noisy labels: some stay wrong
    opt = torch.optim.Adam(model.parameters(), lr=0.03)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model, x[:m].clone(), y[:m].clone()


def _oracle_kfac(model, x, y, kind, damping, sampled):
    """Per-sample layer inputs and output gradients (forward hooks, one sample at a time), the factors, and
    ``(G (x) A + lambda I)^{-1} vec(grad)`` as a dense solve (pseudo-inverse at 0) of the whole ``P_l x P_l`` block."""
    layers = [mod for mod in model.modules() if isinstance(mod, torch.nn.Linear)]
    m = y.shape[0]
    a_rows, g_true, g_draw = [[] for _ in layers], [[] for _ in layers], [[] for _ in layers]
    s = []
    for n in range(m):
        seen = {}
        handles = [lay.register_forward_hook(lambda mod, i, o, k=k: seen.__setitem__(k, (i[0], o)))
                   for k, lay in enumerate(layers)]
        z = model(x[n : n + 1])[0]
        for h in handles:
            h.remove()
        logp = torch.log_softmax(z, -1)
        outs = [seen[k][1] for k in range(len(layers))]
        for labels, rows in ((y, g_true), (sampled, g_draw)):
            grads = torch.autograd.grad(-logp[int(labels[n])], outs, retain_graph=True)
            for k in range(len(layers)):
                rows[k].append(grads[k][0])
        for k in range(len(layers)):
            a_rows[k].append(torch.cat([seen[k][0][0].detach(), torch.ones(1, dtype=x.dtype)]))
        e = logp.detach().exp() - torch.nn.functional.one_hot(y[n], z.shape[0]).to(x.dtype)
        s.append(e @ e)
    w = 1.0 / torch.stack(s) if kind == "iekfac" else torch.ones(m, dtype=x.dtype)
    parts = []
    for k in range(len(layers)):
        a, gt, gd = torch.stack(a_rows[k]), torch.stack(g_true[k]), torch.stack(g_draw[k])
        gg = gd if kind == "kfac" else gt
        big = torch.kron((gg * w[:, None]).T @ gg, a.T @ a / m)
        rhs = (gt.T @ a).reshape(-1)
        if damping > 0:
            d = torch.linalg.solve(big + damping * torch.eye(big.shape[0], dtype=x.dtype), rhs)
        else:
            d = torch.linalg.pinv(big, hermitian=True) @ rhs
        d = d.reshape(gt.shape[1], a.shape[1])
        parts += [d[:, :-1].reshape(-1), d[:, -1]]
    return torch.cat(parts)


def _oracle_gammas(model, x, y, damping, generator):
    """Every method's ``gamma`` from the explicit Fisher ``[P, P]`` of ``tests/oracle.py`` (``eqn:FIM``)."""
    m64 = copy.deepcopy(model).to(torch.float64)
    x64 = x.to(torch.float64)
    F = fisher(m64, x64, y)
    _, J, s = per_sample(m64, x64, y)
    J, s = J.double(), s.double()
    g = J.sum(0)
    gamma = lambda d: float(torch.sqrt(d @ F @ d) / (d @ g).abs())  # noqa: E731
    eye = torch.eye(J.shape[0], dtype=torch.float64)
    gram_inv = (lambda K: torch.linalg.inv(K + damping * eye)) if damping > 0 else \
        (lambda K: torch.linalg.pinv(K, hermitian=True))
    with torch.no_grad():
        sampled = get_loss("cross_entropy").sample_targets(m64(x64), y, fresh_generator(generator)())
    out = {"sgd": gamma(g), "ief": gamma(J.T @ gram_inv(J @ J.T) @ s)}
    layers = [mod for mod in m64.modules() if isinstance(mod, torch.nn.Linear)]
    block, start = torch.zeros_like(g), 0
    for lay in layers:
        stop = start + lay.weight.numel() + lay.bias.numel()
        Jl = J[:, start:stop]
        block[start:stop] = Jl.T @ gram_inv(Jl @ Jl.T) @ s
        start = stop
    out["blockdiag_ief"] = gamma(block)
    for kind in ("kfac", "ekfac", "iekfac"):
        out[kind] = gamma(_oracle_kfac(m64, x64, y, kind, damping, sampled))
    out["ngd"] = gamma(torch.linalg.pinv(F, hermitian=True, rtol=1e-10) @ g)
    out["span_best"] = math.sqrt(1.0 / float((J @ g) @ torch.linalg.pinv(J @ F @ J.T, hermitian=True) @ (J @ g)))
    return out


@pytest.mark.parametrize("damping", [1e-7, 1e-3, 0.0])
def test_package_block_gammas_match_the_dense_oracle_in_float64(damping):
    model, x, y = checkpoint_like()
    expected = _oracle_gammas(model, x, y, damping, batch_generator(3, 0))
    records, _ = evaluate_batch(model, x, y, ["sgd", "ief", "kfac", "ekfac", "iekfac"], damping,
                                generator=batch_generator(3, 0))
    got = {r["method"]: r["gamma"] for r in records}
    for method, value in got.items():
        assert value == pytest.approx(expected[method], rel=1e-7), method
    # the case is a real test of the study: the three K-FAC kinds and iEF differ here
    assert len({round(got[k] / got["sgd"], 3) for k in ("ief", "kfac", "ekfac", "iekfac")}) == 4


def test_package_block_gammas_of_a_float32_model_are_close_to_the_float64_oracle():
    model, x, y = checkpoint_like()
    m32 = copy.deepcopy(model).float()  # the oracle sees the float32 weights exactly (widened to float64)
    expected = _oracle_gammas(copy.deepcopy(m32).double(), x.float().double(), y, 1e-7, batch_generator(5, 0))
    records, _ = evaluate_batch(m32, x.float(), y, ["sgd", "ief", "kfac", "ekfac", "iekfac"], 1e-7,
                                generator=batch_generator(5, 0))
    for r in records:
        assert r["gamma"] == pytest.approx(expected[r["method"]], rel=2e-3), r["method"]


@pytest.mark.parametrize("damping", [1e-7, 1e-2, 0.0])
def test_dense_check_matches_the_oracle(damping):
    """The chapter's dense check (span-restricted Kronecker solves, factored Fisher) equals the brute-force oracle,
    the references included: NGD is the smallest gamma and nothing beats it."""
    model, x, y = checkpoint_like(m=10, seed=1)
    expected = _oracle_gammas(model, x, y, damping, batch_generator(7, 0))
    got = dense_check(model, x, y, damping, generator=batch_generator(7, 0))
    assert set(got["gamma"]) == set(DENSE_METHODS)
    for method in DENSE_METHODS:
        assert got["gamma"][method] == pytest.approx(expected[method], rel=1e-6), method
    assert got["gamma"]["ngd"] <= min(got["gamma"].values()) * (1 + 1e-9)
    assert got["gamma"]["span_best"] <= min(got["gamma"]["ief"], got["gamma"]["sgd"]) * (1 + 1e-9)
    assert got["s_spread"] > 1.5


def test_ekfac_equals_iekfac_when_every_s_n_is_equal():
    """ieKFAC divides each sample's rows of G by s_n: with one s for the whole batch its G is eKFAC's over s, the
    direction eKFAC's times s and gamma (scale-invariant) the same: the reason eKFAC ~ ieKFAC where s_n barely
    varies (uniform predictions, e.g. at initialisation)."""
    case = mlp_case(m=7)
    with torch.no_grad():
        case.model[2].weight.zero_()
        case.model[2].bias.zero_()  # uniform p for every sample: s_n = 1 - 1/C for all n
    got = dense_check(case.model, case.inputs, case.targets, 0.0)
    assert got["s_spread"] == pytest.approx(1.0)
    assert got["gamma"]["iekfac"] == pytest.approx(got["gamma"]["ekfac"], rel=1e-9)
    records, _ = evaluate_batch(case.model, case.inputs, case.targets, ["sgd", "ekfac", "iekfac"], 0.0)
    g = {r["method"]: r["gamma"] for r in records}
    assert g["iekfac"] == pytest.approx(g["ekfac"], rel=1e-9)


def test_dense_check_refuses_what_it_cannot_compute():
    model, x, y = checkpoint_like(m=4)
    with pytest.raises(ValueError, match="damping must be a finite number >= 0, got -1"):
        dense_check(model, x, y, -1.0)
    with pytest.raises(ValueError, match="class-index targets"):
        dense_check(model, x, y.double(), 0.0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.LayerNorm(4)).double()
    with pytest.raises(ValueError, match=r"nn.Linear weights and biases .*\[2, 3\]"):
        dense_check(net, x, y, 0.0)


def test_blockdiag_check_names_the_missing_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError,
                       match="python -m companion train --setup digits-mlp --scale smoke --optimizer adam"):
        blockdiag_check(tmp_path, "digits-mlp", "smoke")
    with pytest.raises(ValueError, match="batches must be >= 1, got 0"):
        blockdiag_check(tmp_path, "digits-mlp", "smoke", batches=0)


def test_check_summary_on_a_synthetic_table():
    rows = []
    for b, (ief_r, ie_r) in enumerate([(0.5, 0.4), (0.7, 0.5)]):
        for method, ratio in (("sgd", 1.0), ("ief", ief_r), ("iekfac", ie_r), ("blockdiag_ief", ief_r)):
            rows.append({"stage": 50, "batch": b, "damping": 1e-7, "method": method, "gamma": ratio * 2,
                         "ratio": ratio, "package": ratio * 2 * (1 + 1e-3 * b), "package64": ratio * 2,
                         "outside_span": 0.9 if method == "iekfac" else None, "s_spread": 10.0 * (b + 1)})
    out = check_summary(pd.DataFrame(rows))
    assert out["ief"] == pytest.approx(0.6) and out["iekfac"] == pytest.approx(0.45)
    assert out["iekfac_over_ief"] == pytest.approx(0.75)
    assert out["blockdiag_ief_over_ief"] == pytest.approx(1.0)
    assert out["s_spread"] == pytest.approx(15.0)
    assert out["package_rel_err"] == pytest.approx(1e-3) and out["package64_rel_err"] == 0.0
    with pytest.raises(ValueError, match="empty"):
        check_summary(pd.DataFrame(columns=list(rows[0])))


def test_blockdiag_check_on_a_smoke_run(tmp_path):
    """End to end at smoke scale: the baseline's checkpoint, the evaluation job's batches; the package's float64
    gammas equal the dense ones."""
    from companion.experiments import train

    train("digits-mlp", "adam", 0, "smoke", tmp_path, progress=False, verbose=False)
    table = blockdiag_check(tmp_path, "digits-mlp", "smoke", stage=50, batches=1)
    assert set(table["method"]) == set(DENSE_METHODS)
    summary = check_summary(table)
    assert summary["package64_rel_err"] < 1e-6
    assert summary["package_rel_err"] < 1e-2
    assert summary["ngd"] <= min(v for k, v in summary.items() if k in DENSE_METHODS) + 1e-12


def test_check_glue_states_the_verdicts_the_numbers_give():
    from companion.experiments.blockdiag_check import CHECK_KEYS, check_glue

    base = {"ief": 0.5, "iekfac": 0.4, "ekfac": 0.8, "kfac": 0.6, "blockdiag_ief": 0.51, "ngd": 0.3,
            "span_best": 0.39, "iekfac_over_ief": 0.8, "ief_undamped": 0.5, "iekfac_undamped": 0.41,
            "blockdiag_ief_over_ief": 1.02, "iekfac_outside_span": 0.999, "package_rel_err": 1e-4,
            "package64_rel_err": 1e-9, "s_spread": 100.0}
    args = dict(setup="digits-mlp", stage=50, batches=2, records_ratio=0.82, spreads={"digits-mlp": 2471.4},
                ekfac_over_iekfac={"digits-mlp": 2.1, "other": None})
    glued = check_glue(base, **args)
    assert tuple(glued) == CHECK_KEYS
    assert glued["kc_real_verdict"] == "is below" and "persists" in glued["kc_damping_verdict"]
    assert "not what helps" in glued["kc_blockdiag_verdict"] and "agree" in glued["kc_bug_verdict"]
    assert glued["kc_s_spreads"] == "digits-mlp: ×2.47e+03"
    assert glued["kc_ek_over_iek"] == "digits-mlp: 2.100, other: n/a"
    worse = check_glue({**base, "iekfac_undamped": 0.6, "blockdiag_ief_over_ief": 0.7, "package64_rel_err": 1e-3},
                       **args)
    assert "damping decides" in worse["kc_damping_verdict"] and "DISAGREE" in worse["kc_bug_verdict"]
    assert "restriction itself matters" in worse["kc_blockdiag_verdict"]
    assert check_glue({**base, "iekfac": 0.6}, **args)["kc_real_verdict"] == "is not below"
