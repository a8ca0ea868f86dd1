"""Identities of the paper checked numerically with the package against the dense float64 oracle.

- sec:app-eval-LQA (eqn:LQA): along a direction d, the best local-quadratic loss change is -1/(2 gamma(d)^2).
- sec:app-sample-fisher: the sampled Fisher (SF) is unbiased, E[A^T A] = F, with error shrinking like 1/sqrt(K).
- sec:app-ief-gn-ngd / sec:app-lls (eqn:lls-F-equal): for scalar-output least squares iEF = GN = NGD.
"""
from __future__ import annotations

import math

import pytest
import torch

import ief
import oracle
from curvature_reference import directions, model_dtype, reference, rtol
from tiny_models import ALL_CASES, Case, mlp_case, mse_case, sequence_case


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().to(torch.float64), b.detach().to(torch.float64)
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


# ------------------------------------------------------------------------------------------------ LQA
LQA_CASES = ["mlp", "mse-mlp", "sequence", "vit-lora", "t5-prompt"]


@pytest.mark.parametrize("name", LQA_CASES)
def test_lqa_best_loss_change_is_minus_half_inverse_gamma_squared(name):
    """sec:app-eval-LQA: min_eta  eta d^T g + eta^2/2 d^T F d  =  -(d^T g)^2 / (2 d^T F d)  =  -1/(2 gamma(d)^2).

    Checked three ways for SGD/iEF/EF/SF/random directions: the closed form with the oracle F and g, the package's
    ``ief.gamma``, and a brute-force scan over eta (which may not go below the closed form)."""

    case = ALL_CASES[name]()
    ref = reference(name)
    tol = rtol(name)
    for dname, d in directions(case).items():
        d = d.double()
        slope, curv = float(d @ ref.gradient), float(d @ ref.fisher @ d)
        closed = -(slope**2) / (2 * curv)
        gam = ief.gamma(case.model, case.inputs, case.targets, d.to(model_dtype(case)), loss=case.loss)
        assert -1 / (2 * gam**2) == pytest.approx(closed, rel=2 * tol), dname
        assert -1 / (2 * ref.gamma(d) ** 2) == pytest.approx(closed, rel=1e-12), dname
        # brute force: q(eta) on a grid spanning both signs, without using the minimiser's location
        span = 3 * abs(slope) / curv
        etas = torch.linspace(-span, span, 600_001, dtype=torch.float64)
        q = etas * slope + 0.5 * etas**2 * curv
        scanned = float(q.min())
        assert scanned >= closed * (1 + 1e-12), dname  # closed is negative: nothing below it
        assert scanned == pytest.approx(closed, rel=1e-8), dname
        # the best step is eta* = -d^T g / d^T F d, i.e. a descent step along -sign(d^T g) d
        assert float(etas[q.argmin()]) == pytest.approx(-slope / curv, rel=1e-4), dname


def test_lqa_is_exact_for_linear_least_squares():
    """For a model linear in its parameters with the squared error, F (= GN) is the exact Hessian and eqn:LQA is
    exact: the best actual loss change along d, min_eta L(theta - eta d) - L(theta), equals -1/(2 gamma(d)^2), with
    gamma from ``ief.gamma`` and eta* = d^T g / d^T F d from ``ief.fisher_vp``."""
    torch.manual_seed(3)
    model = torch.nn.Linear(6, 2).double()
    x, y = torch.randn(5, 6, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    case = Case("linear-lsq", model, x, y, loss="mse")
    theta0 = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()

    def loss_at(theta):
        torch.nn.utils.vector_to_parameters(theta, model.parameters())
        with torch.no_grad():
            value = float(0.5 * ((model(x) - y) ** 2).sum())
        torch.nn.utils.vector_to_parameters(theta0, model.parameters())
        return value

    l0 = loss_at(theta0)
    g = ief.per_sample(model, x, y, loss="mse").gradient
    for dname, d in directions(case).items():
        gam = ief.gamma(model, x, y, d, loss="mse")
        fd = ief.fisher_vp(model, x, y, d, loss="mse")
        eta_star = float(d @ g) / float(d @ fd)
        best = loss_at(theta0 - eta_star * d) - l0
        assert best == pytest.approx(-1 / (2 * gam**2), rel=1e-9, abs=1e-12 * l0), dname
        scan = min(loss_at(theta0 - eta * d) - l0 for eta in (eta_star * t for t in torch.linspace(0, 2, 201).tolist()))
        assert scan >= best - 1e-12 * l0, dname
        assert scan == pytest.approx(best, rel=1e-3), dname


# ------------------------------------------------------------------------------------------------ SF
def _replicate(x: torch.Tensor, r: int) -> torch.Tensor:
    return x.repeat(r, *([1] * (x.dim() - 1)))


def _sf_draws(case: Case, draws: int, replicas: int, seed: int, params=None):
    """Accumulate ``sum_k A_k^T A_k`` over ``draws`` SF draws of the batch (sec:app-sample-fisher, K labels per
    sample), batching ``replicas`` independent draws per call by replicating the batch (the rows of replica r are
    the per-sample gradients of draw r). Returns the running sums after K and 4K draws plus sum ||S_k||_F^2, and the
    rows of every draw (for the distribution checks)."""
    gen = torch.Generator().manual_seed(seed)
    m = case.targets.shape[0]
    inputs, targets = _replicate(case.inputs, replicas), _replicate(case.targets, replicas)
    total, sq, n, rows, snapshots = None, 0.0, 0, [], {}
    while n < draws:
        a = ief.sampled_jacobian(case.model, inputs, targets, gen, params=params, loss=case.loss).double()
        a = a.reshape(replicas, m, -1)
        s = torch.einsum("rmp,rmq->rpq", a, a)
        for r in range(replicas):
            total = s[r].clone() if total is None else total + s[r]
            sq += float((s[r] * s[r]).sum())
            n += 1
            if n in (draws // 4, draws):
                snapshots[n] = total / n
        rows.append(a)
    return snapshots, sq / n, torch.cat(rows)


def _check_rate(snapshots, fisher, variance, k):
    """Relative Frobenius errors after K and 4K draws: small, and each within a factor ~2 of the predicted
    sqrt(V / K) / ||F|| with V = E||A^T A - F||_F^2 (so the error shrinks like 1/sqrt(K))."""
    norm = float(fisher.norm())
    err_k = float((snapshots[k] - fisher).norm()) / norm
    err_4k = float((snapshots[4 * k] - fisher).norm()) / norm
    pred_k = math.sqrt(variance / k) / norm
    pred_4k = math.sqrt(variance / (4 * k)) / norm
    assert err_4k < 0.1
    assert 0.4 < err_k / pred_k < 2.0, (err_k, pred_k)
    assert 0.4 < err_4k / pred_4k < 2.0, (err_4k, pred_4k)
    return err_k, err_4k


def test_sf_is_unbiased_mlp():
    """sec:app-sample-fisher: E_{y ~ p}[A^T A] = F. Every sampled row is exactly -grad log p_n(c) for some class c
    (oracle), classes are drawn with frequencies p_n(c), and the average of A^T A over K and 4K = 4000 draws
    approaches oracle.fisher at the rate predicted by the exact per-draw variance
    V = sum_n [sum_c p_nc ||grad log p_nc||^4 - ||F_n||_F^2]."""
    case = mlp_case()
    ref = reference("mlp")
    params = oracle.trainable(case.model)
    m, classes = case.targets.shape[0], 4
    grads = torch.zeros(m, classes, ref.fisher.shape[0], dtype=torch.float64)
    probs = torch.zeros(m, classes, dtype=torch.float64)
    for n in range(m):
        logp = torch.log_softmax(oracle.logits_of(case.model, oracle.take(case.inputs, n))[0], dim=-1)
        probs[n] = logp.detach().exp()
        for c in range(classes):
            grads[n, c] = oracle.flat_grad(logp[c], params)
    per_sample_f = torch.einsum("nc,ncp,ncq->npq", probs, grads, grads)
    assert _rel(per_sample_f.sum(0), ref.fisher) < 1e-12
    variance = float(sum((probs[n] * (grads[n] ** 2).sum(-1) ** 2).sum() - (per_sample_f[n] ** 2).sum()
                         for n in range(m)))
    k = 1000
    snapshots, _, rows = _sf_draws(case, 4 * k, replicas=200, seed=0)
    _check_rate(snapshots, ref.fisher, variance, k)
    # rows: each is -grad log p_n(c) for a class c; empirical class frequencies match p_n(c)
    rows = rows.reshape(-1, m, rows.shape[-1])  # [draws, M, P]
    dist = torch.cdist(rows.transpose(0, 1), -grads, compute_mode="donot_use_mm_for_euclid_dist")  # [M, draws, C]
    nearest = dist.min(-1)
    assert float(nearest.values.max()) < 1e-10 * float(grads.norm(dim=-1).max())
    counts = torch.nn.functional.one_hot(nearest.indices, classes).sum(1).double()  # [M, C]
    expected = probs * rows.shape[0]
    sd = (expected * (1 - probs)).sqrt().clamp_min(1.0)
    assert float(((counts - expected).abs() / sd).max()) < 5


def test_sf_is_unbiased_mse():
    """loss="mse": sampled targets y ~ N(z, I) give rows grad l_n = -J_z^T eps, E[A^T A] = sum_n J_zn^T J_zn, the
    Gauss-Newton matrix (= oracle.fisher for mse). Rate predicted by V = sum_n [(tr Q_n)^2 + tr(Q_n^2)],
    Q_n = J_zn J_zn^T (Gaussian fourth moments)."""
    case = mse_case()
    ref = reference("mse-mlp")
    params = oracle.trainable(case.model)
    variance = 0.0
    for n in range(case.targets.shape[0]):
        z = oracle.logits_of(case.model, oracle.take(case.inputs, n)).reshape(-1)
        jz = torch.stack([oracle.flat_grad(z[k], params) for k in range(z.shape[0])])
        q = jz @ jz.T
        variance += float(q.trace() ** 2 + (q @ q).trace())
    k = 1000
    snapshots, _, _ = _sf_draws(case, 4 * k, replicas=200, seed=0)
    _check_rate(snapshots, ref.fisher, variance, k)


def test_sf_is_unbiased_sequence_with_ignored_positions():
    """Sequence case (several kept positions per sample, padding, ignored targets): a label is drawn at every kept
    position and none at ignored ones, and the per-sample gradient sums the positions; cross-position terms vanish
    in expectation (E_c[grad log p_t(c)] = 0), so E[A^T A] is still the eqn:FIM sum over positions. Restricted to
    the hook-covered parameters (embedding, LayerNorm, head; the attention's raw Parameters fall back to a slow
    per-sample loop), compared with the matching principal block of oracle.fisher; the predicted rate uses the
    empirical per-draw variance."""
    case = sequence_case()
    ref = reference("sequence")
    model = case.model
    chosen = [model.embed.weight, model.norm.weight, model.norm.bias, model.head.weight, model.head.bias]
    offsets, idx = 0, []
    for p in model.parameters():
        if any(p is q for q in chosen):
            idx.append(torch.arange(offsets, offsets + p.numel()))
        offsets += p.numel()
    idx = torch.cat(idx)
    fisher = ref.fisher[idx][:, idx]
    k = 500
    snapshots, mean_sq, _ = _sf_draws(case, 4 * k, replicas=100, seed=0, params=chosen)
    variance = mean_sq - float((snapshots[4 * k] ** 2).sum())
    _check_rate(snapshots, fisher, variance, k)


# ------------------------------------------------------------------------------------------------ least squares
def _scalar_lsq_case(m: int = 4) -> Case:
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1)).double()
    return Case("scalar-lsq", model, torch.randn(m, 3, dtype=torch.float64), torch.randn(m, 1, dtype=torch.float64),
                loss="mse")


def _output_gradients(case: Case) -> torch.Tensor:
    """[M, P] rows grad_theta z_n (oracle loop)."""
    params = oracle.trainable(case.model)
    return torch.stack([oracle.flat_grad(oracle.logits_of(case.model, oracle.take(case.inputs, n)).reshape(()),
                                         params) for n in range(case.targets.shape[0])])


def test_least_squares_ief_equals_gn_equals_fisher():
    """eqn:lls-F-equal (sec:app-scalar-output-model, sec:app-lls): for a scalar-output model with the squared error,
    the iEF matrix J^T diag(s_iEF)^{-1} J (eqn:iEF_mat, from ief.per_sample), the GN matrix sum_n grad z_n grad z_n^T
    and the Fisher (oracle) coincide; ief.fisher_vp is the product with that matrix."""
    case = _scalar_lsq_case()
    ps = ief.per_sample(case.model, case.inputs, case.targets, loss="mse")
    assert bool((ps.logit_sqnorm > 1e-6).all())
    ief_matrix = ps.jacobian.T @ (ps.jacobian / ps.logit_sqnorm[:, None])
    zgrad = _output_gradients(case)
    gn = zgrad.T @ zgrad
    fisher = oracle.fisher(case.model, case.inputs, case.targets, "mse")
    assert _rel(ief_matrix, fisher) < 1e-10
    assert _rel(gn, fisher) < 1e-10
    v = torch.randn(fisher.shape[0], generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    assert _rel(ief.fisher_vp(case.model, case.inputs, case.targets, v, loss="mse"), ief_matrix @ v) < 1e-10


def test_least_squares_ief_direction_is_the_natural_gradient():
    """sec:app-lls: iEF = NGD for least squares. With N <= P the undamped iEF direction J^T (J J^T)^{-1} s_iEF
    (eqn:iEF_lsq) equals the minimum-norm natural gradient F^+ grad L, reaches the minimum gamma* = 1/sqrt(g^T F^+ g)
    (eqn:natural_gradient_alt) and is what Hessian-free converges to; EF is not (it weights samples by their
    squared residual)."""
    case = _scalar_lsq_case()
    ps = ief.per_sample(case.model, case.inputs, case.targets, loss="mse")
    fisher = oracle.fisher(case.model, case.inputs, case.targets, "mse")
    g = oracle.gradient(case.model, case.inputs, case.targets, "mse").detach()
    assert case.targets.shape[0] <= fisher.shape[0]
    ngd = torch.linalg.pinv(fisher, rtol=1e-10, hermitian=True) @ g
    d_ief = ief.ief_direction(ps.jacobian, ps.logit_sqnorm, 0.0)
    assert _rel(d_ief, ngd) < 1e-8
    gamma_star = 1 / math.sqrt(float(g @ ngd))
    assert ief.gamma(case.model, case.inputs, case.targets, d_ief, loss="mse") == pytest.approx(gamma_star, rel=1e-10)
    hf = ief.hessian_free(case.model, case.inputs, case.targets, 20, loss="mse", tolerance=1e-11)
    assert _rel(hf, ngd) < 1e-6
    d_ef = ief.ef_direction(ps.jacobian, 0.0)
    assert ief.gamma(case.model, case.inputs, case.targets, d_ef, loss="mse") > 1.01 * gamma_star


def test_ief_differs_from_fisher_for_multi_output_squared_error():
    """The equality of eqn:lls-F-equal needs a scalar output: with two outputs (mse-mlp) the rank-one-per-sample iEF
    matrix J^T diag(s)^{-1} J is not the Gauss-Newton matrix (rank up to 2 per sample)."""
    case = mse_case()
    ref = reference("mse-mlp")
    ps = ief.per_sample(case.model, case.inputs, case.targets, loss="mse")
    ief_matrix = ps.jacobian.T @ (ps.jacobian / ps.logit_sqnorm[:, None])
    assert _rel(ief_matrix, ref.fisher) > 1e-2
    assert int(torch.linalg.matrix_rank(ief_matrix)) == case.targets.shape[0] < ref.rank
