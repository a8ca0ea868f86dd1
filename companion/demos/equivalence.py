"""The iEF / GN / NGD relations of ``sec:app-ief-gn-ngd`` measured with dense ``[P, P]`` matrices on small networks.

:func:`gn_equivalence` compares the iEF matrix (``eqn:iEF_mat``) with the Gauss-Newton matrix and the Fisher:
equal for scalar-output least squares (``eqn:lls-F-equal``), proportional for a scalar output's binary
cross-entropy, different for a multi-class softmax model. Everything runs in float64 on a private copy of the model.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from ief import FisherOperator, per_sample

from .problems import classification_problem, private_copy, regression_problem, trainable_params

__all__ = ["curvature_matrices", "EquivalenceRow", "BinaryAsSoftmax", "gn_equivalence"]


# ------------------------------------------------------------------------------------------------ equivalences
def _output_jacobian(model: torch.nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """``[N * K, P]`` rows ``grad_theta z_{n,k}`` by plain autograd (independent of the package's hooks)."""
    params = trainable_params(model)
    with torch.enable_grad():
        out = model(inputs)
        out = getattr(out, "logits", out).reshape(out.shape[0], -1)
        rows = []
        for n in range(out.shape[0]):
            for k in range(out.shape[1]):
                grads = torch.autograd.grad(out[n, k], params, retain_graph=True, allow_unused=True)
                rows.append(torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for p, g in
                                       zip(params, grads)]))
    return torch.stack(rows).to(torch.float64)


def curvature_matrices(model: torch.nn.Module, inputs, targets: torch.Tensor, loss: str = "cross_entropy"):
    """Dense ``[P, P]`` matrices at the model's parameters (small ``P`` only), as a dict:

    - ``"iEF"``: ``J^T diag(s_iEF)^{-1} J`` (``eqn:iEF_mat``) from :func:`ief.per_sample`;
    - ``"GN"``: ``sum_n grad_theta z_n^T grad_theta z_n`` over all outputs of each sample, by plain autograd;
    - ``"Fisher"``: the exact Fisher, column by column from :class:`ief.FisherOperator` (for ``mse`` it is the GN
      matrix by definition, ``sec:app-lls``; for cross-entropy ``sum_n grad z_n^T (diag p - p p^T) grad z_n``).

    Also ``"J"`` (``[N, P]``), ``"s"`` (``s_iEF``), ``"losses"`` and ``"Z"`` (the output Jacobian rows).
    """
    work, inputs, targets = private_copy(model, inputs, targets)
    ps = per_sample(work, inputs, targets, loss=loss)
    jac, s = ps.jacobian.detach().to(torch.float64), ps.logit_sqnorm.detach().to(torch.float64)
    ief_matrix = jac.T @ (jac / s[:, None])
    zjac = _output_jacobian(work, inputs)
    op = FisherOperator(work, inputs, targets, loss=loss)
    p = jac.shape[1]
    eye = torch.eye(p, dtype=torch.float64)
    fisher = torch.stack([op.matvec(eye[i]).detach().to(torch.float64) for i in range(p)], dim=1)
    return {
        "iEF": 0.5 * (ief_matrix + ief_matrix.T), "GN": zjac.T @ zjac, "Fisher": 0.5 * (fisher + fisher.T),
        "J": jac, "s": s, "losses": ps.losses.detach().to(torch.float64), "Z": zjac,
    }


@dataclass
class EquivalenceRow:
    """One comparison ``A`` vs ``B``: ``rel_diff = ||A - B||_F / ||B||_F`` and
    ``scale_free_diff = min_a ||a A - B||_F / ||B||_F`` (zero when ``A`` is a multiple of ``B``)."""

    setting: str
    comparison: str
    rel_diff: float
    scale_free_diff: float
    frobenius_diff: float
    expected: str  # "equal", "proportional" or "different"

    @property
    def as_expected(self) -> bool:
        tol = 1e-10
        if self.expected == "equal":
            return self.rel_diff < tol
        if self.expected == "proportional":
            return self.scale_free_diff < tol and self.rel_diff > 1e-3
        return self.scale_free_diff > 1e-3


def _compare(setting: str, comparison: str, a: torch.Tensor, b: torch.Tensor, expected: str) -> EquivalenceRow:
    diff = float((a - b).norm())
    alpha = float((a * b).sum() / (a * a).sum())
    return EquivalenceRow(setting, comparison, diff / float(b.norm()), float((alpha * a - b).norm() / b.norm()),
                          diff, expected)


class BinaryAsSoftmax(torch.nn.Module):
    """A scalar-output network ``z = f(x)`` seen as a 2-class softmax model, so that the package's cross-entropy
    is the binary (sigmoid) cross-entropy of ``z``: logits ``[0, z]`` (``symmetric=False``) or ``[-z/2, z/2]``."""

    def __init__(self, body: torch.nn.Module, symmetric: bool = False):
        super().__init__()
        self.body, self.symmetric = body, symmetric

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.body(x)  # [N, 1]
        if self.symmetric:
            return torch.cat([-0.5 * z, 0.5 * z], dim=-1)
        return torch.cat([torch.zeros_like(z), z], dim=-1)


def gn_equivalence(n_samples: int = 6, seed: int = 0) -> list[EquivalenceRow]:
    """The relations of ``sec:app-ief-gn-ngd`` measured with dense ``[P, P]`` matrices (see :func:`curvature_matrices`).

    1. Scalar-output least squares (tanh MLP 3-5-1, ``mse``): iEF = GN = Fisher (``eqn:lls-F-equal``).
    2. Scalar-output binary cross-entropy (``sec:app-scalar-output-model``). The package's losses are softmax
       cross-entropy and squared error, so ``l_n = -log sigmoid(+-z_n)`` is written as a 2-class softmax over
       logits ``[0, z_n]``. Its logit gradient is ``p - e_y = (dl/dz) [-1, 1]``, so the package's
       ``s_n = ||grad_{logits} l_n||^2 = 2 (dl_n/dz_n)^2`` and the iEF matrix is ``GN(z)/2`` with
       ``GN(z) = sum_n grad z_n grad z_n^T``: proportional to GN (same iEF update direction, half the matrix).
       With the scalar output's own ``s_n = (dl_n/dz_n)^2`` (the paper's statement; ``dl/dz = sigmoid(z) - y``
       computed independently) the iEF matrix equals ``GN(z)``. With symmetric logits ``[-z/2, z/2]`` the logits'
       GN matrix is itself ``GN(z)/2``, so iEF = GN of the logits. The Fisher, ``sum_n p_n (1 - p_n) grad z_n
       grad z_n^T``, differs: iEF = NGD needs least squares.
    3. Contrast, 3-class softmax MLP 4-6-3: iEF, GN and Fisher all differ (even up to scale).
    """
    rows: list[EquivalenceRow] = []
    # 1. least squares, scalar output
    lsq = regression_problem(n_samples=n_samples, n_features=3, hidden=5, outputs=1, seed=seed)
    mats = curvature_matrices(lsq.model, lsq.inputs, lsq.targets, "mse")
    name = "scalar output, least squares"
    rows += [
        _compare(name, "iEF vs GN", mats["iEF"], mats["GN"], "equal"),
        _compare(name, "iEF vs Fisher", mats["iEF"], mats["Fisher"], "equal"),
        _compare(name, "GN vs Fisher", mats["GN"], mats["Fisher"], "equal"),
    ]
    # 2. binary cross-entropy of a scalar output, through the package's 2-class softmax
    gen = torch.Generator().manual_seed(seed + 1)
    labels = torch.randint(0, 2, (n_samples,), generator=gen)
    body = regression_problem(n_samples=n_samples, n_features=3, hidden=5, outputs=1, seed=seed + 1)
    with torch.no_grad():  # spread the outputs so that p_n (1 - p_n) differs across samples (else F ~ GN / 4)
        body.model[-1].weight.mul_(3.0)
    for symmetric in (False, True):
        model = BinaryAsSoftmax(copy.deepcopy(body.model), symmetric=symmetric)
        mats = curvature_matrices(model, body.inputs, labels, "cross_entropy")
        zhat = _output_jacobian(model.body, body.inputs)  # rows grad_theta z_n of the scalar output
        gn_scalar = zhat.T @ zhat
        if not symmetric:
            name = "scalar output, binary CE (logits [0, z])"
            with torch.no_grad():
                z = model.body(body.inputs).reshape(-1)
            zz = z.detach().clone().requires_grad_(True)
            bce = torch.nn.functional.binary_cross_entropy_with_logits(zz, labels.to(z.dtype), reduction="sum")
            (dl_dz,) = torch.autograd.grad(bce, zz)
            jac = mats["J"]
            ief_scalar = jac.T @ (jac / dl_dz.square()[:, None])
            rows += [
                _compare(name, "l_n vs BCE(z_n)", mats["losses"],
                         torch.nn.functional.binary_cross_entropy_with_logits(
                             z, labels.to(z.dtype), reduction="none").detach(), "equal"),
                _compare(name, "s_n vs 2 (dl_n/dz_n)^2", mats["s"], 2 * dl_dz.square(), "equal"),
                _compare(name, "iEF vs GN(z)", mats["iEF"], gn_scalar, "proportional"),
                _compare(name, "iEF vs GN(z)/2", mats["iEF"], 0.5 * gn_scalar, "equal"),
                _compare(name, "iEF with s_n = (dl_n/dz_n)^2 vs GN(z)", 0.5 * (ief_scalar + ief_scalar.T),
                         gn_scalar, "equal"),
                _compare(name, "iEF vs Fisher", mats["iEF"], mats["Fisher"], "different"),
            ]
        else:
            name = "scalar output, binary CE (logits [-z/2, z/2])"
            rows += [
                _compare(name, "iEF vs GN of the logits", mats["iEF"], mats["GN"], "equal"),
                _compare(name, "iEF vs Fisher", mats["iEF"], mats["Fisher"], "different"),
            ]
    # 3. contrast: multi-class softmax
    cls = classification_problem(n_samples=n_samples, seed=seed)
    mats = curvature_matrices(cls.model, cls.inputs, cls.targets, "cross_entropy")
    name = "3-class softmax (contrast)"
    rows += [
        _compare(name, "iEF vs GN", mats["iEF"], mats["GN"], "different"),
        _compare(name, "iEF vs Fisher", mats["iEF"], mats["Fisher"], "different"),
        _compare(name, "GN vs Fisher", mats["GN"], mats["Fisher"], "different"),
    ]
    return rows
