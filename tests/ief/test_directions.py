"""``ief.ief_direction`` / ``ief.ef_direction`` / ``ief.sf_direction`` against dense ``P x P`` linear algebra.

- EF (``eqn:EF_update``): ``(J^T J + lambda I)^{-1} J^T 1``; its Woodbury form ``J^T (J J^T + lambda I)^{-1} 1``
  (``eqn:EF_lsq``) is what the package computes.
- iEF (``eqn:iEF_lsq``): ``J^T (J J^T + lambda I)^{-1} s``; by the push-through identity this is
  ``(J^T J + lambda I)^{-1} J^T s``, and for ``lambda -> 0`` the minimum-norm solution of the iEF-matrix system
  ``(J^T diag(s)^{-1} J) d = J^T 1`` (``eqn:iEF_mat``, ``sec:app-iEF-mat``).
- SF (``eqn:SF-smw``): ``(A^T A + lambda I)^{-1} g``.

References are computed densely in float64 with ``torch.linalg.solve`` / ``torch.linalg.pinv``. Tolerances: the
random Jacobians below have ``cond(J J^T) < 1e3`` and the tiny-model ones ``< 1e2``; a backward-stable solve then
loses at most ``cond * eps ~ 1e-13`` relative, so ``1e-9`` relative leaves four orders of headroom while still
catching any wrong formula (which errs at O(1)). Where the dense ``P x P`` system itself has ``cond ~ 1/lambda``
(``lambda = 1e-3``) the bound is ``1e3 * 1e2 * eps ~ 1e-11``, still inside ``1e-9``.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch

import ief
from tiny_models import saturated_case

RTOL = 1e-9
PINV_RTOL = 1e-10  # spectrum cutoff for pinv: genuine eigenvalues here are >= 1e-4 relative, spurious ones ~1e-16



def ghost_factors(j: torch.Tensor) -> "ief.rows.FactoredJacobian":
    """Any ``J [M, P]`` as a :class:`ief.rows.FactoredJacobian`: its first ``P - 2`` columns as one Linear weight
    ``[O, I]`` held as factors (``A`` = the identity over ``T = I`` positions, ``G[n, t] = J_n[:, t]``, so that
    ``sum_t g_t a_t^T = J_n`` exactly), the last two as a materialised block: every direction test then also runs
    through the ghost Gram, ``J^T c`` from the factors and the scaling that keeps them in float64 range."""
    m, p = j.shape
    width = p - 2 if p >= 4 else p
    fan_in = max(d for d in range(1, int(width**0.5) + 1) if width % d == 0)
    fan_out = width // fan_in
    a = torch.eye(fan_in, dtype=j.dtype).expand(m, fan_in, fan_in)  # [M, T = I, I]
    g = j[:, :width].reshape(m, fan_out, fan_in).transpose(1, 2)  # [M, T, O]
    sizes, dense_index = ([width, p - width], {1: 0}) if width < p else ([p], {})
    return ief.rows.FactoredJacobian(m, sizes, j, [(0, a, g)], j[:, width:], dense_index)


def streamed_factors(j: torch.Tensor) -> "ief.streamed.StreamedRows":
    """:func:`ghost_factors`'s factors in the streamed form (:mod:`ief.streamed`): the Gram, ``J^T c`` and ``J v``
    from the rows ``G_n^T A_n`` formed a block at a time."""
    f = ghost_factors(j)
    return ief.streamed.StreamedRows(f.shape[0], f.sizes, j, f.ghosts, f.dense, f.dense_index, streamed={0})


@pytest.fixture(params=["dense", "factored", "streamed"])
def as_j(request):
    """``J`` as the Gram solve receives it: the ``[M, P]`` tensor, factored (:func:`ghost_factors`) or streamed
    (:func:`streamed_factors`)."""
    return {"dense": lambda j: j, "factored": ghost_factors, "streamed": streamed_factors}[request.param]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def assert_rel(actual, expected, rtol=RTOL, what=""):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite entries"
    err = rel_err(actual, expected)
    assert err <= rtol, f"{what}: relative error {err:.3e} > {rtol:.1e}"


def random_jacobian(m=5, p=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, p, generator=g, dtype=torch.float64)


def random_s(m=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(m, generator=g, dtype=torch.float64) + 0.1  # positive, like ||grad_z l_n||^2


def dense_solve(j, rhs_vec, damping):
    """``(J^T J + lambda I)^{-1} rhs_vec`` with a dense ``P x P`` solve."""
    p = j.shape[1]
    return torch.linalg.solve(j.T @ j + damping * torch.eye(p, dtype=torch.float64), rhs_vec)


def min_norm(j, s):
    """``J^T pinv(J J^T) s``: the minimum-norm least-squares solution of ``J d = s``."""
    return j.T @ (torch.linalg.pinv(j @ j.T, hermitian=True, rtol=PINV_RTOL) @ s)


# ------------------------------------------------------------------------------------------- Woodbury identities
@pytest.mark.parametrize("damping", [1e-3, 1e-1, 1.0])
def test_ef_direction_equals_dense_ef_update(damping, as_j):
    """``J^T (J J^T + lambda I)^{-1} 1 = (J^T J + lambda I)^{-1} J^T 1`` (``eqn:EF_lsq`` = ``eqn:EF_update``)."""
    j = random_jacobian()
    ones = torch.ones(j.shape[0], dtype=torch.float64)
    assert_rel(ief.ef_direction(as_j(j), damping), dense_solve(j, j.T @ ones, damping), what=f"EF lambda={damping}")


@pytest.mark.parametrize("damping", [1e-3, 1e-1, 1.0])
def test_ief_direction_push_through_identity(damping, as_j):
    """``J^T (J J^T + lambda I)^{-1} s = (J^T J + lambda I)^{-1} J^T s`` (push-through form of ``eqn:iEF_lsq``)."""
    j, s = random_jacobian(), random_s()
    got = ief.ief_direction(as_j(j), s, damping)
    assert_rel(got, dense_solve(j, j.T @ s, damping), what=f"iEF lambda={damping}")
    # and literally the M x M form of eqn:iEF_lsq
    m = j.shape[0]
    assert_rel(got, j.T @ torch.linalg.solve(j @ j.T + damping * torch.eye(m, dtype=torch.float64), s))


def test_woodbury_on_a_real_jacobian(as_j):
    """The same identities on per-sample gradients of the mlp tiny model (``eqn:EF_update``, ``eqn:iEF_lsq``)."""
    from tiny_models import mlp_case

    c = mlp_case()
    r = ief.per_sample(c.model, c.inputs, c.targets)
    j, s = r.jacobian, r.logit_sqnorm
    ones = torch.ones(j.shape[0], dtype=torch.float64)
    for damping in (1e-3, 1e-1, 1.0):
        assert_rel(ief.ef_direction(as_j(j), damping), dense_solve(j, j.T @ ones, damping), what="EF")
        assert_rel(ief.ief_direction(as_j(j), s, damping), dense_solve(j, j.T @ s, damping), what="iEF")


# --------------------------------------------------------------------------------------------- iEF matrix form
def test_ief_matrix_form_min_norm_solution(as_j):
    """With full-row-rank ``J`` and ``lambda = 0``, the iEF direction is the minimum-norm solution of
    ``F* d = grad L`` with ``F* = J^T diag(s)^{-1} J`` (``eqn:iEF_mat``, derivation in ``sec:app-iEF-mat``)."""
    j, s = random_jacobian(), random_s()
    f_star = j.T @ torch.diag(1.0 / s) @ j  # P x P, rank M
    grad = j.T @ torch.ones(j.shape[0], dtype=torch.float64)
    expected = torch.linalg.pinv(f_star, hermitian=True, rtol=PINV_RTOL) @ grad
    assert_rel(ief.ief_direction(as_j(j), s, 0.0), expected, what="pinv(F*) grad")


def test_ief_matrix_form_on_a_real_jacobian(as_j):
    """``eqn:iEF_mat`` with the mlp model's real ``J`` and ``s_iEF`` (all ``s_n > 0``)."""
    from tiny_models import mlp_case

    c = mlp_case()
    r = ief.per_sample(c.model, c.inputs, c.targets)
    j, s = r.jacobian, r.logit_sqnorm
    assert (s > 0).all()
    f_star = j.T @ torch.diag(1.0 / s) @ j
    expected = torch.linalg.pinv(f_star, hermitian=True, rtol=PINV_RTOL) @ r.gradient
    assert_rel(ief.ief_direction(as_j(j), s, 0.0), expected, rtol=1e-8, what="pinv(F*) grad")  # cond(F*|rowspace)~1e2


# ------------------------------------------------------------------------------------------- defining properties
def test_defining_properties_random(as_j):
    """``J d_iEF = s`` and ``J d_EF = 1`` for full-row-rank ``J`` and ``lambda = 0`` (``eqn:iEF_dl``,
    ``eqn:EF_dl``): each sample's loss changes by ``-eta s_n`` (iEF) or ``-eta`` (EF) to first order."""
    j, s = random_jacobian(), random_s()
    assert_rel(j @ ief.ief_direction(as_j(j), s, 0.0), s, what="J d_iEF")
    assert_rel(j @ ief.ef_direction(as_j(j), 0.0), torch.ones_like(s), what="J d_EF")
    # the directions lie in the row space of J (minimum norm): d = J^T c
    d = ief.ief_direction(as_j(j), s, 0.0)
    coeff = torch.linalg.lstsq(j.T, d.unsqueeze(-1)).solution.squeeze(-1)
    assert_rel(j.T @ coeff, d, what="row space")


def test_defining_properties_on_tiny_models(any_case, as_j):
    """The same on every tiny model's real per-sample Jacobian (all full row rank, ``cond(J J^T) < 1e2``)."""
    c = any_case
    r = ief.per_sample(c.model, c.inputs, c.targets, loss=c.loss)
    j, s = r.jacobian, r.logit_sqnorm
    assert int(torch.linalg.matrix_rank(j)) == j.shape[0]
    assert_rel(j @ ief.ief_direction(as_j(j), s, 0.0), s, what=f"{c.name}: J d_iEF")
    assert_rel(j @ ief.ef_direction(as_j(j), 0.0), torch.ones_like(s), what=f"{c.name}: J d_EF")


# ------------------------------------------------------------------------------------- singular / rank-deficient
def _singular_jacobians():
    j, s = random_jacobian(), random_s()
    dup = torch.cat([j, j[1:2], j[3:4]])  # two duplicated samples
    s_dup_consistent = torch.cat([s, s[1:2], s[3:4]])
    s_dup_inconsistent = torch.cat([s, s[1:2] + 0.5, s[3:4] * 2])
    zero = torch.cat([j[:2], torch.zeros(1, j.shape[1], dtype=torch.float64), j[2:]])  # a zero-gradient sample
    s_zero = torch.cat([s[:2], torch.zeros(1, dtype=torch.float64), s[2:]])
    tall = random_jacobian(m=9, p=4, seed=3)  # more samples than parameters: J J^T has rank 4 < 9
    return {
        "duplicates-consistent": (dup, s_dup_consistent),
        "duplicates-inconsistent": (dup, s_dup_inconsistent),
        "zero-row": (zero, s_zero),
        "M>P": (tall, random_s(m=9)),
    }


SINGULAR = _singular_jacobians()


@pytest.mark.parametrize("name", sorted(SINGULAR))
def test_singular_gram_lambda0_is_min_norm(name, as_j):
    """``J J^T`` singular and ``lambda = 0``: finite, and equal to ``J^T pinv(J J^T) s`` (iEF) and
    ``J^T pinv(J J^T) 1`` (EF), the minimum-norm least-squares solutions (``eqn:iEF_lsq``, ``eqn:EF_lsq``)."""
    j, s = SINGULAR[name]
    ones = torch.ones_like(s)
    assert_rel(ief.ief_direction(as_j(j), s, 0.0), min_norm(j, s), what=f"{name} iEF")
    assert_rel(ief.ef_direction(as_j(j), 0.0), min_norm(j, ones), what=f"{name} EF")


@pytest.mark.parametrize("name", sorted(SINGULAR))
def test_singular_gram_tiny_damping_close_to_min_norm(name, as_j):
    """``lambda = 1e-12``: still finite; the damped solution differs from the ``lambda = 0`` minimum-norm one by
    ``O(lambda / sigma_min^2) ~ 1e-11`` (smallest non-zero eigenvalue of ``J J^T`` here ~1), checked at ``1e-6``."""
    j, s = SINGULAR[name]
    ones = torch.ones_like(s)
    assert_rel(ief.ief_direction(as_j(j), s, 1e-12), min_norm(j, s), rtol=1e-6, what=f"{name} iEF")
    assert_rel(ief.ef_direction(as_j(j), 1e-12), min_norm(j, ones), rtol=1e-6, what=f"{name} EF")


def test_zero_gradient_sample_from_a_real_model(as_j):
    """A sample with exactly zero loss and gradient (saturated logits, cf. ``test_jacobian``) in a real ``J``: with
    ``lambda = 0`` the directions are finite; iEF still satisfies ``J d = s`` exactly (``s_n = 0`` for that sample),
    and EF is the minimum-norm least-squares solution (``0 = 1`` cannot hold for the zero row)."""
    model, x, y = saturated_case()  # sample 1 has exactly zero loss and gradient
    r = ief.per_sample(model, x, y)
    assert torch.count_nonzero(r.jacobian[1]) == 0 and float(r.logit_sqnorm[1]) == 0.0
    j, s = r.jacobian, r.logit_sqnorm
    d_ief = ief.ief_direction(as_j(j), s, 0.0)
    d_ef = ief.ef_direction(as_j(j), 0.0)
    assert_rel(d_ief, min_norm(j, s), what="iEF")
    assert_rel(j @ d_ief, s, what="J d_iEF")
    assert_rel(d_ef, min_norm(j, torch.ones_like(s)), what="EF")


def test_all_zero_jacobian(as_j):
    """Every sample converged: ``J = 0``; the minimum-norm direction is 0 for ``lambda = 0`` and ``lambda > 0``."""
    j = torch.zeros(3, 7, dtype=torch.float64)
    s = torch.zeros(3, dtype=torch.float64)
    for damping in (0.0, 1e-7, 1.0):
        for d in (ief.ief_direction(as_j(j), s, damping), ief.ef_direction(as_j(j), damping)):
            assert torch.isfinite(d).all() and torch.count_nonzero(d) == 0


# -------------------------------------------------------------------------------------------------------- SF
@pytest.mark.parametrize("damping", [1e-3, 1e-1, 1.0, 10.0])
def test_sf_direction_equals_dense(damping, as_j):
    """``(1/lambda)[g - A^T (A A^T + lambda I)^{-1} A g] = (A^T A + lambda I)^{-1} g`` (``eqn:SF-smw``), with a
    gradient ``g`` that has a component outside the row space of ``A`` (the part the SMW form scales by
    ``1/lambda``)."""
    a = random_jacobian(seed=5)
    g = torch.randn(a.shape[1], generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    assert_rel(ief.sf_direction(as_j(a), g, damping), dense_solve(a, g, damping), what=f"SF lambda={damping}")


def test_sf_direction_with_duplicate_sampled_rows(as_j):
    """A singular ``A A^T`` (duplicated sampled gradient) is harmless for ``lambda > 0``."""
    a = random_jacobian(seed=5)
    a = torch.cat([a, a[:1]])
    g = torch.randn(a.shape[1], generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    assert_rel(ief.sf_direction(as_j(a), g, 1e-2), dense_solve(a, g, 1e-2), what="SF duplicates")


@pytest.mark.parametrize("bad", [0.0, 0, -1e-3, float("nan"), float("inf"), -float("inf")])
def test_sf_bad_damping(bad, as_j):
    """SF divides by ``lambda``: it must be finite and ``> 0``; the error names the offending value."""
    a, g = random_jacobian(), torch.ones(12, dtype=torch.float64)
    with pytest.raises(ValueError, match="damping") as info:
        ief.sf_direction(as_j(a), g, bad)
    assert repr(bad) in str(info.value)


@pytest.mark.parametrize("bad", [-1e-3, -1.0, float("nan"), float("inf")])
def test_ief_ef_bad_damping(bad, as_j):
    j, s = random_jacobian(), random_s()
    for call in (lambda: ief.ief_direction(as_j(j), s, bad), lambda: ief.ef_direction(as_j(j), bad)):
        with pytest.raises(ValueError, match="damping") as info:
            call()
        assert repr(bad) in str(info.value)


def test_bad_shapes(as_j):
    j, s = random_jacobian(), random_s()
    with pytest.raises(ValueError, match="length 5"):
        ief.ief_direction(as_j(j), s[:4], 0.0)
    with pytest.raises(ValueError, match="length 5"):
        ief.ief_direction(as_j(j), s.reshape(5, 1), 0.0)
    with pytest.raises(ValueError, match=r"\[M, P\]"):
        ief.ief_direction(j[0], s[:1], 0.0)
    with pytest.raises(ValueError, match=r"\[M, P\]"):
        ief.ef_direction(j[0], 0.0)
    with pytest.raises(ValueError, match=r"\[M, P\]"):
        ief.sf_direction(j[0], torch.ones(12, dtype=torch.float64), 1.0)
    with pytest.raises(ValueError, match="length 12"):
        ief.sf_direction(as_j(j), torch.ones(11, dtype=torch.float64), 1.0)
    with pytest.raises(ValueError, match="non-finite"):
        bad = j.clone()
        bad[0, 0] = float("nan")
        ief.ef_direction(as_j(bad), 0.0)
    with pytest.raises(ValueError, match="non-finite"):
        ief.ief_direction(as_j(j), torch.full_like(s, float("inf")), 0.0)


def test_float32_in_float32_out(as_j):
    """Float32 inputs give float32 directions equal to the float64 computation on the same (rounded) inputs, to
    output rounding (the Gram system is solved in float64): ``1e-6`` relative, about 8 float32 ulps."""
    j, s = random_jacobian().float(), random_s().float()
    g = torch.randn(12, generator=torch.Generator().manual_seed(6)).float()
    for damping in (0.0, 1e-3):
        d = ief.ief_direction(as_j(j), s, damping)
        assert d.dtype == torch.float32
        assert_rel(d, ief.ief_direction(as_j(j.double()), s.double(), damping), rtol=1e-6, what="iEF f32")
        d = ief.ef_direction(as_j(j), damping)
        assert d.dtype == torch.float32
        assert_rel(d, ief.ef_direction(as_j(j.double()), damping), rtol=1e-6, what="EF f32")
    d = ief.sf_direction(as_j(j), g, 1e-2)
    assert d.dtype == torch.float32
    assert_rel(d, ief.sf_direction(as_j(j.double()), g.double(), 1e-2), rtol=1e-6, what="SF f32")


# ---------------------------------------------------------------------------------------- scale behaviour (paper)
def _rows_with_spread_norms():
    """Random rows rescaled to norms spanning four decades (better- and worse-trained samples)."""
    j = random_jacobian(seed=11)
    norms = torch.tensor([1e-2, 1e-1, 1.0, 10.0, 100.0], dtype=torch.float64)
    return j / j.norm(dim=1, keepdim=True) * norms.unsqueeze(1), norms


def test_ef_projection_is_inversely_scaled(as_j):
    """``eqn:kappa_EF``: for ``lambda ~ 0`` the EF direction's projection onto each unit per-sample gradient is
    ``1 / ||grad l_n||`` (the inversely-scaled projection issue, ``sec:inversely-scaled-projection-issue``).
    Row norms span 1e-2..1e2, so ``cond(J J^T) ~ 1e8``: a ``1e-6`` relative check per sample."""
    j, norms = _rows_with_spread_norms()
    d = ief.ef_direction(as_j(j), 0.0)
    kappa = (j @ d) / norms
    assert_rel(kappa, 1.0 / norms, rtol=1e-6, what="kappa_EF")
    # the best-trained sample (smallest gradient) dominates: its projection is 1e4 times the worst-trained one's
    assert math.isclose(float(kappa[0] / kappa[-1]), 1e4, rel_tol=1e-6)


def test_ief_projection_scales_with_s(as_j):
    """iEF (``eqn:iEF_dl``): the projection onto each unit per-sample gradient is ``s_n / ||grad l_n||``, so
    samples with a small logit gradient (well trained) get a small step; on the same rows as above."""
    j, norms = _rows_with_spread_norms()
    s = torch.tensor([1e-4, 1e-2, 1.0, 3.0, 0.5], dtype=torch.float64)
    d = ief.ief_direction(as_j(j), s, 0.0)
    assert_rel((j @ d) / norms, s / norms, rtol=1e-6, what="kappa_iEF")


def test_ef_projection_inverse_scaling_on_a_real_model(as_j):
    """``eqn:kappa_EF`` on the vit-lora model's real per-sample gradients, and the iEF counterpart."""
    from tiny_models import vit_lora_case

    c = vit_lora_case()
    r = ief.per_sample(c.model, c.inputs, c.targets)
    j, s = r.jacobian, r.logit_sqnorm
    norms = j.norm(dim=1)
    assert_rel((j @ ief.ef_direction(as_j(j), 0.0)) / norms, 1.0 / norms, what="kappa_EF")
    assert_rel((j @ ief.ief_direction(as_j(j), s, 0.0)) / norms, s / norms, what="kappa_iEF")


@pytest.mark.parametrize("scale", [1e-200, 1e160], ids=["1e-200", "1e160"])
def test_ef_inverse_scaling_at_extreme_magnitudes(scale, as_j):
    """``eqn:kappa_EF`` taken literally: ``d_EF(c J) = d_EF(J) / c`` at ``lambda = 0``. The module docstring of
    ``ief/directions.py`` promises a finite result for any finite input; for ``c = 1e-200`` and ``c = 1e160`` the
    exact answer (entries ~1e200 / ~1e-160) is representable in float64.
    The Gram matrix is formed from ``J / max|J|`` so it neither underflows nor overflows."""
    j = random_jacobian()
    got = ief.ef_direction(as_j(j * scale), 0.0)
    assert torch.isfinite(got).all()
    # compare scale * d_EF(c J) with d_EF(J): the norm of a vector of 1e200 entries would itself overflow
    assert_rel(got * scale, ief.ef_direction(as_j(j), 0.0), what=f"EF at scale {scale}")


@pytest.mark.parametrize("scale", [1.0, 1e-200, 1e160], ids=["1", "1e-200", "1e160"])
def test_directions_leave_their_inputs_untouched(scale, as_j):
    """The float64 Gram path must never rescale the caller's Jacobian in place (``Tensor.to`` returns the same
    tensor when it already is float64)."""
    j = random_jacobian() * scale
    s = torch.rand(j.shape[0], dtype=torch.float64) + 0.1
    g = torch.randn(j.shape[1], dtype=torch.float64)
    j0, s0, g0 = j.clone(), s.clone(), g.clone()
    ief.ief_direction(as_j(j), s, 1e-3)
    ief.ef_direction(as_j(j), 0.0)
    try:
        ief.sf_direction(as_j(j), g, 1e-3)
    except FloatingPointError:
        pass  # 1/lambda times a 1e160-scale gradient component may not be representable; inputs still untouched
    assert torch.equal(j, j0) and torch.equal(s, s0) and torch.equal(g, g0)


@pytest.mark.parametrize("m", [4, 32])
def test_mean_loss_convention_scales_the_update_by_1_over_m(m, as_j):
    """README's learning-rate convention: per-sample gradients of the batch-*mean* loss (an explicit loop over
    d[(1/M) l_n]/d theta) are J/M and its logit gradients give s_iEF/M^2, so that update is 1/M of alg:iEF's with
    damping M^2 lambda. Checked on a real model against ief.per_sample's sum-convention J and s."""
    model, x, y = _tiny_classifier(m)
    ours = ief.per_sample(model, x, y, loss="cross_entropy")
    params = list(model.parameters())
    rows, s_mean = [], []
    for n in range(m):
        z = model(x[n : n + 1])
        mean_share = torch.nn.functional.cross_entropy(z, y[n : n + 1], reduction="sum") / m  # l_n / M
        gz, *gp = torch.autograd.grad(mean_share, [z, *params])
        rows.append(torch.cat([g.reshape(-1) for g in gp]))
        s_mean.append((gz**2).sum())
    j_mean, s_mean = torch.stack(rows), torch.stack(s_mean)
    assert_rel(j_mean, ours.jacobian / m, rtol=1e-12, what="J of the mean loss")
    assert_rel(s_mean, ours.logit_sqnorm / m**2, rtol=1e-12, what="s_iEF of the mean loss")
    lam = 1e-6
    assert_rel(ief.ief_direction(as_j(j_mean), s_mean, lam), ief.ief_direction(as_j(ours.jacobian), ours.logit_sqnorm,
                                                                          lam * m**2) / m, rtol=1e-8,
               what="mean-convention update")


def _tiny_classifier(m: int):
    g = torch.Generator().manual_seed(m)
    model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).double()
    x = torch.randn(m, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (m,), generator=g)
    return model, x, y


@pytest.mark.parametrize("form", ["ghost", "rows", "streamed", "auto"])
def test_directions_from_a_factored_per_sample_equal_the_dense_ones(any_case, form):
    """End to end on every tiny model: ``per_sample(form=...)`` and ``sampled_jacobian(form=...)`` give the same EF,
    iEF and SF directions as the ``[M, P]`` tensor of the same backward, to float64 rounding (the Gram solve is the
    same code; only ``J J^T``, ``J^T c`` and ``A g`` come from the factors)."""
    c = any_case
    runs = {}
    for which in ("dense", form):
        torch.manual_seed(0)
        r = ief.per_sample(c.model, c.inputs, c.targets, loss=c.loss, form=which)
        torch.manual_seed(0)
        a = ief.sampled_jacobian(c.model, c.inputs, c.targets, torch.Generator().manual_seed(3), loss=c.loss,
                                 form=which)
        runs[which] = (ief.ief_direction(r.jacobian, r.logit_sqnorm, 1e-3), ief.ef_direction(r.jacobian, 1e-3),
                       ief.sf_direction(a, r.gradient, 1e-2))
    for what, got, expected in zip(("iEF", "EF", "SF"), runs[form], runs["dense"]):
        assert_rel(got, expected, rtol=1e-10, what=f"{c.name} {form} {what}")


@pytest.mark.parametrize("damping", [1e-7, 1e-3])
def test_float32_factored_directions_are_accurate_to_float32(damping):
    """A float32 model, factored J: each Linear weight's ``J^T c`` is formed in float32 through an orthonormal basis
    of its inputs (float64 QR), so solve coefficients that cancel (``lambda = 1e-7``) cost no accuracy: the EF / iEF
    directions agree with the float64 computation on the same J to a few float32 ulps (``1e-6`` relative). SF (with
    ``A = J``, so ``g = J^T 1`` lies in ``A``'s row space) is held to the float64 *model*'s direction: the float32
    ``g``'s rounding outside that row space is dropped, not divided by ``lambda`` (which made it 5e-4 off at
    ``lambda = 1e-3``), so the same J in float64, whose ``g`` carries that rounding, is not the reference."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.ReLU(), torch.nn.Linear(30, 5))
    x, y = torch.randn(16, 40), torch.randint(0, 5, (16,))
    r64 = ief.per_sample(copy.deepcopy(model).double(), x.double(), y)
    r = ief.per_sample(model, x, y, form="auto")
    fac = r.jacobian
    assert len(fac.ghosts) == 2  # both weights factored: the float32 (QR) path is the one under test
    # the exact J of these factors (products formed in float64; SF amplifies J's own rounding by ~1/lambda)
    widened = [(i, a.double(), g.double()) for i, a, g in fac.ghosts]
    j = ief.rows.FactoredJacobian(fac.shape[0], fac.sizes, fac.dense.double(), widened, fac.dense.double(),
                                      fac.dense_index).materialize()
    s = r.logit_sqnorm.double()
    for got, expected in (
        (ief.ief_direction(r.jacobian, r.logit_sqnorm, damping), ief.ief_direction(j, s, damping)),
        (ief.ef_direction(r.jacobian, damping), ief.ef_direction(j, damping)),
        (ief.sf_direction(r.jacobian, r.gradient, max(damping, 1e-3)),
         ief.sf_direction(r64.jacobian, r64.gradient, max(damping, 1e-3))),
    ):
        assert got.dtype == torch.float32
        assert_rel(got, expected, rtol=1e-6, what=f"float32 factored, lambda={damping}")


# ------------------------------------------------------------------- damping, scale and degenerate J, end to end
@pytest.mark.parametrize("scale", [1e-120, 1e120], ids=["1e-120", "1e120"])
@pytest.mark.parametrize("damping", [1e-3, 1.0])
def test_damped_directions_at_extreme_magnitudes(scale, damping, as_j):
    """Beyond ``1e+-100`` the Gram system is solved for ``J' = J / c`` with the damping rescaled to ``lambda / c^2``.
    Exactly, ``d(cJ; lambda c^2) = d(J; lambda) / c`` (EF, iEF: ``eqn:EF_lsq``, ``eqn:iEF_lsq``) and
    ``d_SF(cA, g; lambda c^2) = d_SF(A, g; lambda) / c^2`` (``eqn:SF-smw``); the unscaled right-hand sides are
    the dense ``P x P`` solves. ``lambda c^2`` (1e-243 .. 1e240) and the results are representable in float64."""
    j, s = random_jacobian(), random_s()
    g = torch.randn(j.shape[1], generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    ones = torch.ones_like(s)
    lam = damping * scale**2
    assert lam > 0 and math.isfinite(lam)
    assert_rel(ief.ef_direction(as_j(j * scale), lam) * scale, dense_solve(j, j.T @ ones, damping), what="EF")
    assert_rel(ief.ief_direction(as_j(j * scale), s, lam) * scale, dense_solve(j, j.T @ s, damping), what="iEF")
    assert_rel(ief.sf_direction(as_j(j * scale), g, lam) * scale**2, dense_solve(j, g, damping), what="SF")


def test_damping_that_swamps_a_tiny_jacobian(as_j):
    """``|J| ~ 1e-150`` and ``lambda = 10``: ``lambda / max|J|^2`` overflows float64, and ``J J^T / lambda ~ 1e-301``
    is below float64 resolution of 1, so ``(J^T J + lambda I)^{-1} J^T w = J^T w / lambda`` to float64 precision
    (EF, iEF); SF is then ``g / lambda``, its ``A^T (...) A g`` term ``~1e-300`` relative."""
    j, s = random_jacobian() * 1e-150, random_s()
    g = torch.randn(j.shape[1], generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    ones = torch.ones_like(s)
    assert_rel(ief.ef_direction(as_j(j), 10.0), j.T @ ones / 10.0, rtol=1e-14, what="EF")
    assert_rel(ief.ief_direction(as_j(j), s, 10.0), j.T @ s / 10.0, rtol=1e-14, what="iEF")
    assert_rel(ief.sf_direction(as_j(j), g, 10.0), g / 10.0, rtol=1e-14, what="SF")


@pytest.mark.parametrize("gram_scale", [1e-16, 1e-8, 1e8, 1e16], ids=["1e-16", "1e-8", "1e8", "1e16"])
@pytest.mark.parametrize("name", sorted(SINGULAR))
def test_singular_gram_lambda0_is_min_norm_at_any_scale(name, gram_scale, as_j):
    """The ``lambda = 0`` minimum-norm solution with the Gram eigenvalues near ``1e-16`` .. ``1e16`` (inside the range
    where ``J`` is not rescaled): the cut-off of negligible eigenvalues is relative to the largest one, so genuine
    small eigenvalues are kept and rounding-level ones dropped at every scale; ``J^T pinv(J J^T) w`` (pinv's cut-off is
    relative too) is the oracle."""
    j, s = SINGULAR[name]
    j = j * gram_scale**0.5
    ones = torch.ones_like(s)
    assert_rel(ief.ief_direction(as_j(j), s, 0.0), min_norm(j, s), what=f"{name} iEF")
    assert_rel(ief.ef_direction(as_j(j), 0.0), min_norm(j, ones), what=f"{name} EF")


@pytest.mark.parametrize("damping", [0.0, 1e-7, 1.0])
def test_all_zero_jacobian_gives_a_zero_vector_of_length_p(damping, as_j):
    """``J = 0`` ``[3, 7]``: the EF / iEF directions are the zero vector of the parameters' length ``P = 7`` (not
    ``M = 3``), in J's dtype."""
    for dtype in (torch.float64, torch.float32):
        j = torch.zeros(3, 7, dtype=dtype)
        s = torch.zeros(3, dtype=dtype)
        for d in (ief.ief_direction(as_j(j), s, damping), ief.ef_direction(as_j(j), damping)):
            assert d.shape == (7,) and d.dtype == dtype and torch.count_nonzero(d) == 0


@pytest.mark.parametrize("damping", [1e-3, 2.0])
def test_sf_on_an_all_zero_sampled_jacobian_is_the_scaled_gradient(damping, as_j):
    """``A = 0`` (every sampled label predicted with certainty): ``(A^T A + lambda I)^{-1} g = g / lambda``."""
    a = torch.zeros(4, 12, dtype=torch.float64)
    g = torch.randn(12, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    assert_rel(ief.sf_direction(as_j(a), g, damping), g / damping, rtol=1e-15, what="SF, A = 0")


def test_error_messages_name_the_argument_its_expected_shape_and_what_was_given(as_j):
    """Bad input: the message names the argument, the accepted shape (and what it indexes) and the given one."""
    j, s = random_jacobian(), random_s()
    g = torch.ones(12, dtype=torch.float64)
    cases = [
        (lambda: ief.ief_direction(as_j(j), s[:4], 0.0),
         r"^logit_sqnorm must be a vector of length 5 \(one entry per sample\), got \(4,\)$"),
        (lambda: ief.ief_direction(as_j(j), [1.0] * 5, 0.0),
         r"^logit_sqnorm must be a vector of length 5 \(one entry per sample\), got list$"),
        (lambda: ief.ief_direction(as_j(j), torch.full_like(s, float("nan")), 0.0),
         r"^logit_sqnorm contains non-finite values$"),
        (lambda: ief.sf_direction(as_j(j), g[:11], 1.0),
         r"^grad must be a vector of length 12 \(one entry per parameter\), got \(11,\)$"),
        (lambda: ief.sf_direction(j[0], g, 1.0), r"^sampled_jacobian must be a \[M, P\] tensor, got \(12,\)$"),
        (lambda: ief.sf_direction(j.int(), g, 1.0), r"^sampled_jacobian must be floating point, got torch\.int32$"),
        (lambda: ief.ef_direction(j.tolist(), 0.0), r"^jacobian must be a \[M, P\] tensor, got list$"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()


def test_directions_beyond_float32_raise_naming_the_method(as_j):
    """Never silently wrong: float32 input whose exact direction exceeds float32's range raises
    ``FloatingPointError`` naming the method and the dtype. ``|J| ~ 1e-40`` (float32 subnormals) at ``lambda = 0``
    gives EF / iEF directions ``~1e40``; SF with ``lambda = 1e-40`` gives ``~g / lambda = 1e40``."""
    j = (random_jacobian() * 1e-40).float()
    s = random_s().float()
    g = torch.ones(12)
    assert torch.count_nonzero(j) == j.numel()  # subnormal, not flushed to zero
    for call, what in ((lambda: ief.ief_direction(as_j(j), s, 0.0), "iEF"),
                       (lambda: ief.ef_direction(as_j(j), 0.0), "EF"),
                       (lambda: ief.sf_direction(as_j(j), g, 1e-40), "SF")):
        with pytest.raises(FloatingPointError,
                           match=rf"^the {what} direction is not representable in torch\.float32 "
                                 r"\(its entries exceed the dtype's range\): the per-sample gradients "
                                 r"are too close to zero for this damping; use a larger damping$"):
            call()


@pytest.mark.parametrize("scale", [1.0, 1e-120], ids=["1", "1e-120"])
def test_directions_of_a_jacobian_wider_than_one_column_block(scale):
    """``P = 2 * 65536 + 5``: the Gram matrix, ``J^T c``, ``A g`` and ``max|J|`` are accumulated over column blocks
    (``ief.model_call.COLUMN_CHUNK``). The first block is all zero (its parameters do not affect the loss), so the
    magnitude and the Gram matrix come from the later blocks only. Checked by the defining equations, formed
    directly in float64: ``(J^T J + lambda I) d = J^T w`` (EF, iEF: ``eqn:EF_update``, push-through of
    ``eqn:iEF_lsq``) and ``(A^T A + lambda I) d = g`` (SF, ``eqn:SF-smw``), with ``lambda`` scaled by ``scale^2``."""
    from ief.model_call import COLUMN_CHUNK

    p = 2 * COLUMN_CHUNK + 5
    gen = torch.Generator().manual_seed(9)
    j = torch.zeros(3, p, dtype=torch.float64)
    j[:, COLUMN_CHUNK:] = torch.randn(3, p - COLUMN_CHUNK, generator=gen, dtype=torch.float64) * 1e-2
    j = j * scale
    s = torch.tensor([0.3, 1.0, 2.0], dtype=torch.float64)
    g = torch.randn(p, generator=gen, dtype=torch.float64) * 1e-2
    lam = 1e-3 * scale**2

    def residual(d, rhs):  # ||(J^T J + lambda I) d - rhs|| / ||rhs||, J rescaled to O(1e-2) to stay in range
        js, ds = j / scale, d * scale
        return float((js.T @ (js @ ds) + 1e-3 * ds - rhs).norm() / rhs.norm())

    for w in (s, torch.ones(3, dtype=torch.float64)):
        d = ief.ief_direction(j, w, lam) if w is s else ief.ef_direction(j, lam)
        assert d.shape == (p,) and torch.count_nonzero(d[:COLUMN_CHUNK]) == 0
        assert residual(d, (j / scale).T @ w) < 1e-10
    d = ief.sf_direction(j, g, lam)
    assert float(((j / scale).T @ ((j / scale) @ (d * scale**2)) + 1e-3 * d * scale**2 - g).norm() / g.norm()) < 1e-10


def test_float64_directions_beyond_float64_raise_naming_the_method():
    """Even in float64: ``|J| ~ 1e-310`` (subnormal) at ``lambda = 0`` makes the exact EF / iEF directions ``~1e310``,
    past float64's range; SF with ``lambda = 1e-320`` makes ``g / lambda ~ 1e320``. Each raises
    ``FloatingPointError`` naming the method instead of returning inf. (A FactoredJacobian at a subnormal scale:
    tests/ief/test_jacobian.py::test_factored_jacobian_at_a_subnormal_scale_gives_the_dense_and_oracle_direction.)"""
    as_j = lambda j: j  # noqa: E731
    j = random_jacobian() * 1e-310
    s = random_s()
    g = torch.ones(12, dtype=torch.float64)
    assert torch.count_nonzero(j) == j.numel()
    for call, what in ((lambda: ief.ief_direction(as_j(j), s, 0.0), "iEF"),
                       (lambda: ief.ef_direction(as_j(j), 0.0), "EF"),
                       (lambda: ief.sf_direction(as_j(j), g, 1e-320), "SF")):
        with pytest.raises(FloatingPointError, match=rf"^the {what} direction is not representable in torch\.float64 "):
            call()


def test_solve_gram_with_several_right_hand_sides():
    """``solve_gram(G, rhs [M, K], lambda)``: every column solved, as ``K`` separate solves and the dense solve, on the
    Cholesky path (``lambda > 0``, well conditioned) and the eigen path (``lambda = 0``, duplicate rows)."""
    from ief.directions import solve_gram

    j = random_jacobian()
    rhs = torch.randn(5, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    g = j @ j.T
    got = solve_gram(g, rhs, 1e-2)
    assert got.shape == (5, 3)
    assert_rel(got, torch.linalg.solve(g + 1e-2 * torch.eye(5, dtype=torch.float64), rhs), what="Cholesky path")
    dup = torch.cat([j, j[:1]])
    g_dup = dup @ dup.T
    rhs_dup = torch.cat([rhs, rhs[:1]])  # consistent: the duplicate row has the same right-hand side
    got = solve_gram(g_dup, rhs_dup, 0.0)
    assert got.shape == (6, 3)
    for k in range(3):
        assert_rel(got[:, k], solve_gram(g_dup, rhs_dup[:, k], 0.0), rtol=1e-12, what=f"column {k}")
        assert_rel(got[:, k], torch.linalg.pinv(g_dup, hermitian=True, rtol=PINV_RTOL) @ rhs_dup[:, k], what="pinv")
    one = solve_gram(g, rhs[:, :1], 1e-2)  # K = 1 stays a column
    assert one.shape == (5, 1)
    assert_rel(one[:, 0], torch.linalg.solve(g + 1e-2 * torch.eye(5, dtype=torch.float64), rhs[:, 0]), what="K = 1")


def test_an_empty_batch(as_j):
    """``M = 0`` samples: no per-sample gradient, so the EF / iEF directions are the zero vector of length ``P`` and
    SF is ``g / lambda`` (``A^T A = 0``)."""
    j = torch.zeros(0, 12, dtype=torch.float64)
    g = torch.randn(12, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    for damping in (0.0, 1e-3):
        for d in (ief.ef_direction(as_j(j), damping), ief.ief_direction(as_j(j), torch.zeros(0, dtype=torch.float64),
                                                                         damping)):
            assert d.shape == (12,) and torch.count_nonzero(d) == 0
    assert_rel(ief.sf_direction(as_j(j), g, 0.5), g / 0.5, rtol=1e-15, what="SF, M = 0")


def test_damped_solve_on_the_eigen_path_with_a_small_genuine_eigenvalue(as_j):
    """Duplicate rows (an exactly singular ``J J^T``) and ``lambda = 5e-13``, too small for the Cholesky factor to be
    trusted: the eigen path runs with the damping. A third row nearly in the span of the first two gives ``J J^T``
    a genuine eigenvalue ``~1e-11``, which dominates the direction, so ``lambda`` must be added to it exactly. With
    consistent targets (the duplicate's ``s`` equals its original's) the exact damped direction is that of the
    de-duplicated rows weighted by their multiplicity ``W``: ``J_u^T (W J_u J_u^T + lambda I)^{-1} W s_u`` (a 3 x 3
    solve, ``cond ~ 1e11``, accurate to ~1e-5)."""
    gen = torch.Generator().manual_seed(12)
    r1, r2, noise = (torch.randn(12, generator=gen, dtype=torch.float64) for _ in range(3))
    r3 = 0.6 * r1 - 0.8 * r2 + 3e-6 * noise
    j_u = torch.stack([r1, r2, r3])
    w = torch.diag(torch.tensor([2.0, 1.0, 1.0], dtype=torch.float64))
    j = torch.cat([j_u, r1[None]])
    s_u = torch.tensor([0.5, 1.5, 1.0], dtype=torch.float64)
    s = torch.cat([s_u, s_u[:1]])
    lam = 5e-13
    eig = torch.linalg.eigvalsh(j @ j.T)
    assert float(eig[0]) < 1e-14 and 1e-12 < float(eig[1]) < 1e-10  # the exact zero and the genuine small one
    expected = j_u.T @ torch.linalg.solve(w @ j_u @ j_u.T + lam * torch.eye(3, dtype=torch.float64), w @ s_u)
    assert_rel(ief.ief_direction(as_j(j), s, lam), expected, rtol=1e-4, what="iEF")
    ones_u = torch.ones(3, dtype=torch.float64)
    expected = j_u.T @ torch.linalg.solve(w @ j_u @ j_u.T + lam * torch.eye(3, dtype=torch.float64), w @ ones_u)
    assert_rel(ief.ef_direction(as_j(j), lam), expected, rtol=1e-4, what="EF")


def test_directions_of_a_non_positive_jacobian(as_j):
    """Every entry ``<= 0`` (one exactly zero, the largest magnitude negative), also at ``|J| ~ 1e-120``: the
    magnitude that scales the Gram matrix is ``max|J|``, not ``max J = 0``; EF against the dense solve."""
    j = -random_jacobian().abs()
    j[:, 0] = 0.0
    ones = torch.ones(j.shape[0], dtype=torch.float64)
    for scale in (1.0, 1e-120):
        got = ief.ef_direction(as_j(j * scale), 1e-3 * scale**2) * scale
        assert_rel(got, dense_solve(j, j.T @ ones, 1e-3), what=f"EF, scale {scale}")


# --------------------------------------------------------------------- float32 Jacobians: J's own rounding floor
def _linear_p_below_m():
    """``Linear(4, 3)`` on 32 samples in float64 and the same weights in float32: ``J`` has rank 10 in exact
    arithmetic (softmax residuals sum to zero over the 3 classes, 15 parameters), 15 in float32 (5 singular values at
    ``~eps ||J||``)."""
    torch.manual_seed(0)
    m64 = torch.nn.Linear(4, 3).double()
    m32 = torch.nn.Linear(4, 3)
    m32.load_state_dict({k: v.float() for k, v in m64.state_dict().items()})
    x = torch.randn(32, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (32,))
    return ief.per_sample(m64, x, y), ief.per_sample(m32, x.float(), y)


@pytest.mark.parametrize("damping", [0.0, 1e-10, 1e-8, 1e-6, 1e-4, 1.0])
def test_float32_jacobian_gives_the_float64_direction_at_every_damping(damping, as_j):
    """The float32 per-sample gradients' rounding directions are dropped (``rounding_floor``), not weighted by
    ``1/lambda``: before, the float32 iEF direction was 10x too long at ``lambda = 1e-8`` and 10 % off at ``1e-6``."""
    ps64, ps32 = _linear_p_below_m()
    for what, d32, d64 in [
        ("iEF", ief.ief_direction(as_j(ps32.jacobian), ps32.logit_sqnorm, damping),
         ief.ief_direction(ps64.jacobian, ps64.logit_sqnorm, damping)),
        ("EF", ief.ef_direction(as_j(ps32.jacobian), damping), ief.ef_direction(ps64.jacobian, damping)),
    ] + ([] if damping == 0 else [  # SF with A = J: the float32 g's rounding outside J's row space is not / lambda
        ("SF", ief.sf_direction(as_j(ps32.jacobian), ps32.gradient, damping),
         ief.sf_direction(ps64.jacobian, ps64.gradient, damping)),
    ]):
        assert d32.dtype == torch.float32
        assert rel_err(d32, d64) < 1e-5, f"{what} at lambda={damping}: float32 vs float64 {rel_err(d32, d64):.2e}"


def test_rounding_floor_is_zero_for_float64_and_scales_with_the_trace():
    from ief.directions import rounding_floor

    g = torch.diag(torch.tensor([4.0, 1.0], dtype=torch.float64))
    assert rounding_floor(torch.float64, g) == 0.0
    eps = torch.finfo(torch.float32).eps
    assert rounding_floor(torch.float32, g) == pytest.approx((10 * eps) ** 2 * 5.0, rel=1e-12)
    assert rounding_floor(torch.bfloat16, g) > rounding_floor(torch.float32, g)
    assert rounding_floor(torch.float32, torch.zeros(0, 0, dtype=torch.float64)) == 0.0


def test_solve_gram_drops_eigendirections_below_the_noise_floor():
    """A floor between two eigenvalues: the small one's direction gets coefficient 0 (not ``1/(e + lambda)``)."""
    from ief.directions import solve_gram

    q, _ = torch.linalg.qr(torch.randn(3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0)))
    e = torch.tensor([1e-9, 0.5, 2.0], dtype=torch.float64)
    g = q @ torch.diag(e) @ q.T
    rhs = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    lam = 1e-6
    full = q @ ((q.T @ rhs) / (e + lam))
    kept = q[:, 1:] @ ((q[:, 1:].T @ rhs) / (e[1:] + lam))
    assert_rel(solve_gram(g, rhs, lam), full, rtol=1e-8, what="no floor")
    assert_rel(solve_gram(g, rhs, lam, noise_floor=1e-6), kept, rtol=1e-10, what="floor 1e-6")


def test_sf_with_a_zero_sampled_jacobian_keeps_its_dtype_and_names_an_overflow():
    """``A = 0``: the direction is ``g / lambda`` in ``A``'s dtype; beyond float32's range the error names SF."""
    a = torch.zeros(3, 4)
    g = torch.tensor([1.0, -2.0, 0.5, 0.0])
    d = ief.sf_direction(a, g, 0.5)
    assert d.dtype == torch.float32 and torch.equal(d, g / 0.5)
    with pytest.raises(FloatingPointError, match=r"^the SF direction is not representable in torch\.float32"):
        ief.sf_direction(a, torch.full((4,), 1e30), 1e-10)
    with pytest.raises(ValueError, match=r"^grad must be floating point, got torch\.int64$"):
        ief.sf_direction(a, torch.ones(4, dtype=torch.int64), 1.0)


def test_sf_at_a_small_gram_scale_equals_the_dense_solve():
    """Entries ~1e-7 (Gram ~1e-14, inside the range where no rescaling happens): the eigenvalue cut-off is relative
    to the Gram's scale, so nothing of ``A``'s row space is dropped and ``(A^T A + lambda I)^{-1} g`` is exact."""
    gen = torch.Generator().manual_seed(5)
    a = 1e-7 * torch.randn(4, 9, dtype=torch.float64, generator=gen)
    g = torch.randn(9, dtype=torch.float64, generator=gen)
    lam = 1e-15
    dense = torch.linalg.solve(a.T @ a + lam * torch.eye(9, dtype=torch.float64), g)
    assert_rel(ief.sf_direction(a, g, lam), dense, rtol=1e-6, what="SF at Gram scale 1e-14")


def test_sf_drops_the_float32_gradients_rounding_outside_a_float64_row_space():
    """A float64 ``A = J`` (rank 10 of 15: the softmax residuals sum to zero) and the batch gradient rounded to
    float32: its rounding outside ``J``'s row space (``~eps_32 |g|``) is not divided by ``lambda``; the threshold takes
    the coarser of the two dtypes' eps."""
    ps64, _ = _linear_p_below_m()
    g64 = ps64.jacobian.sum(0)
    got = ief.sf_direction(ps64.jacobian, g64.float(), 1e-8)
    assert rel_err(got, ief.sf_direction(ps64.jacobian, g64, 1e-8)) < 1e-5



@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("where", [0, 65536 + 3], ids=["first_block", "second_block"])
def test_one_pass_finds_a_non_finite_entry_anywhere(bad, where):
    """``max|J|`` (one ``aminmax`` pass per column block) is also the finiteness check of every direction: a NaN,
    ``+inf`` or ``-inf`` in any block of ``J`` raises the same ``ValueError`` as before, for EF, iEF and SF."""
    j = torch.randn(3, 2 * 65536, generator=torch.Generator().manual_seed(0))
    j[1, where] = bad
    for call in (lambda: ief.ief_direction(j, torch.ones(3), 1e-3), lambda: ief.ef_direction(j, 1e-3)):
        with pytest.raises(ValueError, match="^jacobian contains non-finite values$"):
            call()
    with pytest.raises(ValueError, match="^sampled_jacobian contains non-finite values$"):
        ief.sf_direction(j, torch.ones(2 * 65536), 1e-3)


def test_a_tensor_its_dense_adaptor_and_the_checked_solves_give_the_same_bits():
    """The public directions wrap a tensor once (``ief.rows.DenseRows``) and call the solves: the tensor, the adaptor
    and the solves on it (what the optimisers call, their input checked at the step) agree bit for bit, in float32
    and float64 and at a scale that needs the Gram's rescaling."""
    from ief.directions import ef_solve, ief_solve, sf_solve
    from ief.rows import DenseRows

    for dtype in (torch.float64, torch.float32):
        for scale in (1.0, 1e-120):
            j = (random_jacobian() * scale).to(dtype)
            s, g = random_s().to(dtype), (random_jacobian(1, 12, seed=3)[0] * scale).to(dtype)
            rows = DenseRows(j)
            for lam in (0.0, 1e-3):
                ief_d = ief.ief_direction(j, s, lam)
                assert torch.equal(ief_d, ief.ief_direction(rows, s, lam))
                assert torch.equal(ief_d, ief_solve(rows, s, lam))
                ef_d = ief.ef_direction(j, lam)
                assert torch.equal(ef_d, ief.ef_direction(rows, lam)) and torch.equal(ef_d, ef_solve(rows, lam))
            sf_d = ief.sf_direction(j, g, 1e-3)
            assert torch.equal(sf_d, ief.sf_direction(rows, g, 1e-3)) and torch.equal(sf_d, sf_solve(rows, g, 1e-3))


def test_a_non_finite_adaptor_is_refused_as_a_non_finite_tensor():
    from ief.rows import DenseRows

    j = random_jacobian()
    j[1, 1] = math.nan
    with pytest.raises(ValueError, match=r"^jacobian contains non-finite values$"):
        ief.ief_direction(DenseRows(j), random_s(), 1e-3)
    with pytest.raises(ValueError, match=r"^sampled_jacobian contains non-finite values$"):
        ief.sf_direction(DenseRows(j), torch.ones(12, dtype=torch.float64), 1e-3)
