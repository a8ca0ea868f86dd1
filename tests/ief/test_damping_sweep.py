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


# --- exact on singular and near-singular Grams, against ief.evaluate and a dense float64 oracle ----------------

import copy  # noqa: E402
import math  # noqa: E402
import importlib  # noqa: E402

import oracle  # noqa: E402
from ief.curvature import DegenerateIndicator  # noqa: E402
from tiny_models import IGNORE, Case  # noqa: E402

SINGULAR_DAMPINGS = [0.0, 1e-10, 1e-8, 1e-6, 1e-4, 1.0]


def linear_case(dtype=torch.float64) -> Case:
    """``Linear(4, 3)`` on ``M = 32`` samples: ``P = 15 < M``, so ``J J^T`` has a 17-dimensional null space."""
    torch.manual_seed(3)
    model = torch.nn.Linear(4, 3).to(dtype)
    return Case("linear", model, torch.randn(32, 4, dtype=dtype), torch.randint(0, 3, (32,)))


class PromptedMLP(torch.nn.Module):
    """A frozen MLP read at ``T = 3`` positions, each input concatenated with its trainable prompt vector (``3 x 2``:
    6 parameters), per-position logits ``[M, T, 3]``: prompt tuning in miniature."""

    def __init__(self):
        super().__init__()
        self.prompt = torch.nn.Parameter(0.5 * torch.randn(3, 2))
        self.mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        self.mlp.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([x, self.prompt.expand(x.shape[0], -1, -1)], dim=-1))


def prompt_case(dtype=torch.float64) -> Case:
    """``PromptedMLP``, ``M = 16``, ``T = 3``: ``P = 6 < M``, ignored positions, and samples 2 and 9 ignored at every
    position (zero rows of ``J``)."""
    torch.manual_seed(5)
    model = PromptedMLP().to(dtype)
    y = torch.randint(0, 3, (16, 3))
    y[2] = IGNORE
    y[9] = IGNORE
    y[4, 1] = IGNORE
    y[11, 0] = IGNORE
    return Case("prompt", model, torch.randn(16, 3, 2, dtype=dtype), y)


def repeated_case(dtype=torch.float64, jitter: float = 0.0) -> Case:
    """The MLP of ``mlp_case`` on 4 distinct samples, each repeated 3 times (``rank J J^T = 4 < M = 12``); with
    ``jitter`` the copies' inputs differ by that much: a near-singular Gram."""
    base = mlp_case(m=4, dtype=dtype, seed=2)
    gen = torch.Generator().manual_seed(9)
    x = base.inputs.repeat(3, 1) + jitter * torch.randn(12, 5, generator=gen).to(dtype)
    return Case("repeated" if not jitter else "near-singular", base.model, x, base.targets.repeat(3))


CASES = {"linear": linear_case, "prompt": prompt_case, "repeated": repeated_case,
         "near-singular": lambda dtype=torch.float64: repeated_case(dtype, jitter=1e-3)}


def _oracle_gammas(case: Case, dampings, seed: int) -> dict[tuple[str, float], float]:
    """Dense float64 ``gamma`` of SGD and of EF / iEF / SF at every damping (``eqn:EF_lsq``, ``eqn:iEF_lsq``,
    ``eqn:SF-smw``): explicit per-sample loops, the Fisher summed over classes, the Woodbury forms by an SVD of ``J``
    (``J^T (J J^T + lambda I)^{-1} w = V S/(S^2 + lambda) U^T w``, the pseudo-inverse at ``lambda = 0``: no null
    eigenvector is ever multiplied by ``1/lambda``) and SF by an SVD of ``A``. SF's labels: drawn as the package draws
    them (``torch.multinomial`` on the float64 softmax with a generator seeded ``seed``)."""
    model = copy.deepcopy(case.model).double()
    x = case.inputs.double()
    _, jac, s = oracle.per_sample(model, x, case.targets)
    fisher = oracle.fisher(model, x, case.targets)
    g = jac.sum(0)
    with torch.no_grad():
        logits = oracle.logits_of(model, x).double()
    probs = torch.softmax(logits, dim=-1).reshape(-1, logits.shape[-1])
    drawn = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(seed)).reshape(case.targets.shape)
    _, a, _ = oracle.per_sample(model, x, torch.where(case.targets == IGNORE, case.targets, drawn))

    def gam(d):
        return float(torch.sqrt(d @ fisher @ d) / (d @ g).abs())

    u, sv, vh = torch.linalg.svd(jac, full_matrices=False)
    _, sa, vah = torch.linalg.svd(a, full_matrices=True)
    sa = torch.cat([sa, sa.new_zeros(vah.shape[0] - sa.shape[0])])
    out = {("sgd", None): gam(g), ("sf-smax2", None): float(sa.max() ** 2)}  # sigma_max(A)^2: SF's conditioning
    for lam in dampings:
        if lam == 0:
            keep = sv > sv.max() * 1e-6
            scale = torch.where(keep, 1 / torch.where(keep, sv, torch.ones_like(sv)), torch.zeros_like(sv))
        else:
            scale = sv / (sv**2 + lam)
        for m, w in (("ef", torch.ones_like(s)), ("ief", s)):
            out[(m, lam)] = gam(vh.T @ (scale * (u.T @ w)))
        if lam > 0:
            out[("sf", lam)] = gam(vah.T @ ((vah @ g) / (sa**2 + lam)))
    return out


def _by_key(records):
    return {(r["method"], r["damping"]): r for r in records}


@pytest.mark.parametrize("logit_space", [False, None], ids=["per-pass", "logit-space"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name", list(CASES))
def test_sweep_equals_evaluate_and_dense_oracle_on_singular_grams(name, dtype, logit_space):
    """The old 2M-JVP algebra returned gamma = 0 (Linear(4, 3), M = 32, f64, 1e-8; the prompt case, f64,
    1e-10) or 2.22 against 0.630 (prompt, f32, 1e-8) where J J^T is singular: every (method, lambda) must equal one
    ief.evaluate at that damping and the dense oracle."""
    case = CASES[name](dtype)
    case.model.eval()
    sweep = _by_key(ief.damping_sweep(case.model, case.inputs, case.targets, SINGULAR_DAMPINGS, methods=["ef", "ief"],
                                      logit_space=logit_space))
    sweep.update(_by_key(ief.damping_sweep(case.model, case.inputs, case.targets, SINGULAR_DAMPINGS[1:],
                                           generator=torch.Generator().manual_seed(4), logit_space=logit_space)))
    expected = _oracle_gammas(case, SINGULAR_DAMPINGS, seed=4)
    rel_eval, rel_oracle = (1e-6, 1e-6) if dtype == torch.float64 else (1e-2, 1e-2)
    # SF's Woodbury form (eqn:SF-smw, ief.sf_direction, which evaluate uses too) solves (A A^T + lambda I) c = A g,
    # whose condition number is kappa = (sigma_max(A)^2 + lambda) / lambda, and forms its bracket g - A^T c ~ lambda d
    # from O(|g|) terms: in float64 it keeps ~eps * kappa relative. Measured at lambda = 1e-10 on the linear case
    # (kappa = 3.2e11, eps * kappa = 7.1e-5): 4.5e-6 with the AVX2 kernels, 1.3e-5 with ATen's default ones; an
    # empirical 1e-15 / lambda (= 1e-5) passed the first and failed the second, so the bound is the derived one.
    for lam in SINGULAR_DAMPINGS:
        kappa = (expected[("sf-smax2", None)] + lam) / lam if lam > 0 else math.inf
        rel_sf = max(rel_oracle, torch.finfo(torch.float64).eps * kappa) if dtype == torch.float64 and lam > 0 \
            else rel_oracle
        methods = ["ef", "ief"] if lam == 0 else ["ef", "ief", "sf"]
        ev = _by_key(ief.evaluate(case.model, [(case.inputs, case.targets)], methods, lam, seed=0,
                                  logit_space=logit_space))
        for m in methods:
            got = sweep[(m, lam)]
            tol = rel_sf if m == "sf" else rel_oracle
            assert got["gamma"] == pytest.approx(expected[(m, lam)], rel=tol), (m, lam, "oracle")
            if m != "sf":  # (evaluate draws SF's labels from batch_generator(0, 0), the sweep from seed 4)
                assert got["gamma"] == pytest.approx(ev[(m, lam)]["gamma"], rel=rel_eval), (m, lam, "evaluate")
                assert got["ratio"] == pytest.approx(ev[(m, lam)]["ratio"], rel=rel_eval), (m, lam, "evaluate")
    assert sweep[("sgd", None)]["gamma"] == pytest.approx(expected[("sgd", None)], rel=rel_oracle)


@pytest.mark.parametrize("logit_space", [False, None], ids=["per-pass", "logit-space"])
def test_sweep_sf_equals_evaluate_with_the_same_generator(logit_space):
    case = prompt_case()
    case.model.eval()
    from ief.evaluation import batch_generator
    for lam in (1e-10, 1e-4):
        ev = _by_key(ief.evaluate(case.model, [(case.inputs, case.targets)], ["sf"], lam, seed=3,
                                  logit_space=logit_space))
        sw = _by_key(ief.damping_sweep(case.model, case.inputs, case.targets, [lam], methods=["sf"],
                                       generator=batch_generator(3, 0), logit_space=logit_space))
        assert sw[("sf", lam)]["gamma"] == pytest.approx(ev[("sf", lam)]["gamma"], rel=1e-12)


def _margin_case(margin: float):
    """A linear classifier whose every sample predicts its label (class 0) by ``margin`` (bias ``[margin, 0, 0]``,
    small weights): ``p - y ~ exp(-margin)`` per sample."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 3).double()
    with torch.no_grad():
        model.weight.mul_(0.1)
        model.bias.copy_(torch.tensor([margin, 0.0, 0.0]))
    return model, torch.randn(6, 3, dtype=torch.float64), torch.zeros(6, dtype=torch.long)


@pytest.mark.parametrize("logit_space", [False, None], ids=["per-pass", "logit-space"])
def test_gamma_sgd_underflow_raises_naming_the_method_in_sweep_and_evaluate(logit_space):
    model, x, y = _margin_case(300.0)  # grad ~ 1e-130, g^T F g ~ 1e-390: underflows float64, gamma_SGD = 0
    ps = ief.per_sample(model, x, y)
    assert bool(ps.gradient.ne(0).any())  # not a zero gradient: the indicator itself underflows
    with pytest.raises(DegenerateIndicator, match="sgd"):
        ief.damping_sweep(model, x, y, [1e-4], logit_space=logit_space)
    with pytest.raises(DegenerateIndicator, match=r"batch 0.*sgd"):
        ief.evaluate(model, [(x, y)], ["ef", "ief"], 1e-4, logit_space=logit_space)


@pytest.mark.parametrize("logit_space", [False, None], ids=["per-pass", "logit-space"])
def test_saturated_batch_raises_the_same_in_sweep_and_evaluate(logit_space):
    """``J = 0`` (every sample's softmax exactly one-hot at its label): the old sweep said inf, evaluate NaN."""
    model, x, y = _margin_case(2000.0)  # exp(-2000) = 0 in float64
    assert not bool(ief.per_sample(model, x, y).jacobian.any())
    with pytest.raises(DegenerateIndicator, match="sgd direction is zero"):
        ief.damping_sweep(model, x, y, [1e-4, 1.0], logit_space=logit_space)
    with pytest.raises(DegenerateIndicator, match="batch 0: the sgd direction is zero"):
        ief.evaluate(model, [(x, y)], ["ef", "ief", "sf"], 1e-4, logit_space=logit_space)


# --- the sweep's contract beyond the values: parameters, arguments, records, errors, what it computes ---------------
@pytest.mark.parametrize("logit_space", [False, None], ids=["per-pass", "logit-space"])
def test_sweep_over_a_parameter_subset_equals_separate_gamma_calls_on_that_subset(logit_space):
    """``params=[last layer]``: J, s_iEF, grad L, SF's A and every gamma are those of the subset (``eqn:gamma`` with
    ``d`` and ``grad L`` in the subset's coordinates), as separate ``ief.per_sample`` / ``ief.gamma`` calls give."""
    case = mlp_case()
    case.model.eval()
    params = list(case.model[2].parameters())
    lam = 1e-3
    records = _by_key(ief.damping_sweep(case.model, case.inputs, case.targets, [lam], params=params,
                                        generator=torch.Generator().manual_seed(5), logit_space=logit_space))
    ps = ief.per_sample(case.model, case.inputs, case.targets, params)
    sampled = ief.sampled_jacobian(case.model, case.inputs, case.targets, torch.Generator().manual_seed(5), params)
    dirs = {"sgd": ps.gradient, "ef": ief.ef_direction(ps.jacobian, lam),
            "ief": ief.ief_direction(ps.jacobian, ps.logit_sqnorm, lam),
            "sf": ief.sf_direction(sampled, ps.gradient, lam)}
    for m, d in dirs.items():
        expected = ief.gamma(case.model, case.inputs, case.targets, d, params)
        assert records[(m, None if m == "sgd" else lam)]["gamma"] == pytest.approx(expected, rel=1e-9), m
    whole = _by_key(ief.damping_sweep(case.model, case.inputs, case.targets, [lam], logit_space=logit_space))
    assert whole[("ief", lam)]["gamma"] != pytest.approx(records[("ief", lam)]["gamma"], rel=1e-3)


def test_records_are_sgd_first_then_every_damping_and_method_in_the_given_orders():
    """Returns: ``sgd`` first (``damping=None``, ratio 1), then one record per damping and method, in the given
    orders, each with exactly the keys method, damping, gamma, ratio (ratio = gamma / gamma_SGD); a single method
    may be given as a string."""
    case = mlp_case()
    records = ief.damping_sweep(case.model, case.inputs, case.targets, [1.0, 1e-2], methods=["ief", "ef"])
    assert [(r["method"], r["damping"]) for r in records] == [
        ("sgd", None), ("ief", 1.0), ("ef", 1.0), ("ief", 1e-2), ("ef", 1e-2)]
    assert all(set(r) == {"method", "damping", "gamma", "ratio"} for r in records)
    assert records[0]["ratio"] == 1.0
    for r in records[1:]:
        assert r["ratio"] == pytest.approx(r["gamma"] / records[0]["gamma"], rel=1e-15)
    single = ief.damping_sweep(case.model, case.inputs, case.targets, [1.0, 1e-2], methods="ief")
    assert single == [r for r in records if r["method"] in ("sgd", "ief")]


@pytest.mark.parametrize("kwargs, match", [
    (dict(dampings=[1.0], methods=["kfac", "ief"]), r"^unknown sweep method\(s\) \['kfac'\]; accepted: ef, ief, sf$"),
    (dict(dampings=[1.0], methods=[]), r"^unknown sweep method\(s\) \[\]; accepted: ef, ief, sf$"),
    (dict(dampings=[]), r"^dampings is empty: give at least one damping$"),
    (dict(dampings=[1.0, 0.0]), r"^damping must be a finite number > 0, got 0\.0$"),
    (dict(dampings=[1.0, 0.0], methods=("ef", "sf")), r"^damping must be a finite number > 0, got 0\.0$"),
])
def test_bad_input_is_refused_by_name_before_the_model_runs(kwargs, match):
    """Each bad argument is named with the accepted values, before any forward (SF's ``eqn:SF-smw`` divides by the
    damping, so 0 is refused up front, not after the per-sample backward)."""
    case = mlp_case()
    calls = []
    handle = case.model.register_forward_hook(lambda *_: calls.append(1))
    with pytest.raises(ValueError, match=match):
        ief.damping_sweep(case.model, case.inputs, case.targets, **kwargs)
    handle.remove()
    assert not calls


def test_a_sweep_without_sf_draws_no_sampled_jacobian(monkeypatch):
    """SF's sampled ``A`` costs a backward (or a product with ``J_z``): an EF / iEF sweep never forms it."""
    sweep = importlib.import_module("ief.damping_sweep")  # (ief.damping_sweep is also the function's name)

    def refuse(*args, **kwargs):
        raise AssertionError("sampled_rows called for a sweep without sf")

    case = mlp_case()
    monkeypatch.setattr(sweep, "sampled_rows", refuse)
    records = ief.damping_sweep(case.model, case.inputs, case.targets, [1e-3], methods=["ef", "ief"])
    assert [r["method"] for r in records] == ["sgd", "ef", "ief"]


def test_the_logit_space_route_rates_every_direction_by_one_product_with_j_z(monkeypatch):
    """Module docstring: on the logit-space route all directions are rated together by one product with ``J_z``,
    no forward-mode pass per direction (``ief.gamma``)."""
    evaluation = importlib.import_module("ief.evaluation")

    def refuse(*args, **kwargs):
        raise AssertionError("a forward-mode gamma pass on the logit-space route")

    case = mlp_case()
    expected = ief.damping_sweep(case.model, case.inputs, case.targets, [1e-3], logit_space=False,
                                 generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(evaluation, "gamma", refuse)
    got = ief.damping_sweep(case.model, case.inputs, case.targets, [1e-3], logit_space=True,
                            generator=torch.Generator().manual_seed(1))
    for r, e in zip(got, expected, strict=True):
        assert (r["method"], r["damping"]) == (e["method"], e["damping"])
        assert r["gamma"] == pytest.approx(e["gamma"], rel=1e-9)


@pytest.mark.parametrize("logit_space", [False, None], ids=["per-pass", "logit-space"])
def test_a_saturated_batch_is_named_as_the_damping_sweep(logit_space):
    """The error names where it happened (``ief.evaluate`` names the batch, the sweep says "damping sweep")."""
    model, x, y = _margin_case(2000.0)
    with pytest.raises(DegenerateIndicator, match="^damping sweep: the sgd direction is zero"):
        ief.damping_sweep(model, x, y, [1e-4], logit_space=logit_space)


# --- SharedGram: J's Rows interface with the Gram computed once per scale -----------------------------------------
def _shared_gram_cases():
    c64, c32 = mlp_case(), mlp_case(dtype=torch.float32)
    torch.manual_seed(0)
    wide = torch.randn(2, (1 << 16) + 3, dtype=torch.float64)  # more columns than one chunk of column_chunks
    return {
        "dense f64": ief.per_sample(c64.model, c64.inputs, c64.targets).jacobian,
        "dense f32": ief.per_sample(c32.model, c32.inputs, c32.targets).jacobian,
        "dense 1e-200": ief.per_sample(c64.model, c64.inputs, c64.targets).jacobian * 1e-200,
        "wide": wide,
        "factored f64": ief.per_sample(c64.model, c64.inputs, c64.targets, form="ghost").jacobian,
        "factored f32": ief.per_sample(c32.model, c32.inputs, c32.targets, form="ghost").jacobian,
    }


@pytest.mark.parametrize("name", ["dense f64", "dense f32", "dense 1e-200", "wide", "factored f64", "factored f32"])
def test_shared_gram_is_j_in_every_rows_method(name):
    """``SharedGram(J)`` answers every :class:`ief.rows.Rows` method as ``J`` itself: ``(J/s)(J/s)^T``,
    ``(J/s)^T c`` (in ``J``'s dtype with ``final`` for a factored float32 ``J``), ``(J/s) v`` for any float ``v``,
    ``max|J|`` and finiteness; the defaults are ``scale = 1``, ``final = False``."""
    from ief.damping_sweep import SharedGram
    from ief.rows import DenseRows, as_rows

    j = _shared_gram_cases()[name]
    rows = as_rows(j)
    dense = rows.materialize()
    shared = SharedGram(j)
    gen = torch.Generator().manual_seed(0)
    coeff = torch.randn(j.shape[0], generator=gen, dtype=torch.float64)
    v = torch.randn(j.shape[1], generator=gen, dtype=torch.float64)
    rtol = 1e-12 if j.dtype == torch.float64 else 1e-6
    for scale in (1.0, 3.0, rows.gram_scale()):
        expected_gram = DenseRows(dense).gram(scale)
        assert_close(shared.gram(scale), expected_gram, rtol, "gram")
        assert_close(shared.gram(scale), expected_gram, rtol, "gram (cached)")
        for final in (False, True):
            got = shared.combine_rows(coeff, scale, final)
            expected = rows.combine_rows(coeff, scale, final)
            assert got.dtype == expected.dtype and torch.equal(got, expected), ("combine_rows", scale, final)
        assert_close(shared.combine_rows(coeff, scale), DenseRows(dense).combine_rows(coeff, scale), rtol, "J^T c")
        for vec in (v, v.float()):
            assert_close(shared.times(vec, scale), (dense.double() / scale) @ vec.double(), rtol, "J v")
    assert_close(shared.gram(), DenseRows(dense).gram(), rtol, "gram, default scale")
    assert shared.combine_rows(coeff).dtype == torch.float64
    assert_close(shared.combine_rows(coeff), DenseRows(dense).combine_rows(coeff), rtol, "J^T c, default scale")
    assert_close(shared.times(v), dense.double() @ v, rtol, "J v, default scale")
    assert shared.max_abs() == as_rows(j).max_abs() and shared.is_finite()


def test_shared_gram_reports_a_non_finite_j():
    from ief.damping_sweep import SharedGram

    for form in ("dense", "ghost"):
        case = mlp_case()
        j = ief.per_sample(case.model, case.inputs, case.targets, form=form).jacobian
        if form == "dense":
            j[1, 3] = float("nan")
        else:  # a fresh FactoredJacobian (per_sample has checked, and cached, the finiteness of its own)
            ghosts = [(i, a, g.clone()) for i, a, g in j.ghosts]
            ghosts[0][2][1, 0, 0] = float("inf")
            j = ief.rows.FactoredJacobian(j.shape[0], j.sizes, j.dense, ghosts, j.dense, j.dense_index)
        assert not SharedGram(j).is_finite(), form


def assert_close(actual, expected, rtol, what):
    err = float((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-300))
    assert actual.shape == expected.shape and err <= rtol, f"{what}: relative error {err:.2e} > {rtol:.0e}"


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_damping_sweep_refuses_a_non_finite_input_with_the_optimisers_message(bad):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    x[1, 2] = bad
    with pytest.raises(FloatingPointError, match=r"for samples \[1\] \(of 5\): a NaN or inf in those samples' "
                                                 r"inputs, logits or targets"):
        ief.damping_sweep(model, x, torch.tensor([0, 1, 2, 0, 1]), [1e-3, 1e-1])
