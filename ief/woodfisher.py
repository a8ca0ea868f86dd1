"""Optimal-brain-surgeon pruning with an EF, iEF, SF or exact (GGN) curvature: WoodFisher, and the iEF-WoodFisher
that the paper proposes and does not run (Appendix D.2.3).

OBS (Hassibi & Stork, 1993) prunes weight ``q`` at the cost ``rho_q = w_q^2 / (2 [F^{-1}]_qq)`` (the second-order
increase of the loss when ``w_q`` is set to zero and the other weights move to compensate), and moves the others by
``dw = -w_q F^{-1} e_q / [F^{-1}]_qq``. WoodFisher (Singh & Alistarh, NeurIPS 2020) takes for ``F`` the empirical
Fisher of ``N`` per-sample gradients, damped and inverted by the Woodbury recursion the paper quotes:
``F_0 = lambda I``, ``F_{n+1} = F_n + (1/N) r_n r_n^T``, i.e. ``F = lambda I + (1/N) sum_n r_n r_n^T``. The row
``r_n`` is, per ``fisher=``:

- ``"ef"``: ``grad_theta l_n`` (Eq. (3));
- ``"ief"``: ``grad_theta l_n / ||grad_{z_n} l_n||`` (Eq. (41); the norm from ``s_iEF`` of
  :func:`ief.per_sample`);
- ``"sf"``: the per-sample gradient at a label drawn from the model (Appendix E,
  :func:`ief.sampled_jacobian`);
- ``"ggn"``: the exact Fisher (= GGN for softmax cross-entropy), ``(1/N) sum_n sum_c p_n(c) grad log p_n(c) grad
  log p_n(c)^T`` (Eq. (2)): the reference, as a dense matrix per block, for small blocks only.

Blocks (``block_size``): WoodFisher's block-diagonal approximation: every pruned parameter tensor, flattened, is cut
into consecutive blocks of ``block_size`` entries and ``F`` keeps only its diagonal blocks; ``None``: one block over
all pruned parameters (the whole matrix). The inverse of a block is never formed: with ``U = R / sqrt(N)`` the
block's ``[N, B]`` rows, the Woodbury identity ``(lambda I + U^T U)^{-1} = (1/lambda)(I - U^T (lambda I + U U^T)^{-1}
U)`` needs only the ``N x N`` Gram ``U U^T``; it is evaluated from ``U``'s thin SVD ``U = A diag(s) V^T`` (the Gram's
eigenvectors ``A`` and eigenvalues ``s^2``, without squaring ``U``'s condition number), float64:

    ``(lambda I + U^T U)^{-1} c = (c - V V^T c) / lambda + V diag(1 / (s^2 + lambda)) V^T c``,

so a block holds ``V [B, min(N, B)]`` and ``s``, and the diagonal ``[F^{-1}]_qq`` is the same formula for
``c = e_q``. The ``ggn`` reference forms its ``B x B`` blocks (at most :data:`GGN_MAX_BLOCK` entries a side).

The decomposition does not depend on ``lambda``: :func:`obs_curvature` computes it once and
:meth:`OBSCurvature.saliency` / :meth:`OBSCurvature.prune` take the damping, so a damping sweep or several
sparsities cost one pass over the data.
"""
from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from .jacobian import per_sample, sampled_jacobian
from .directions import rounding_floor
from .losses import Loss, check_damping, get_loss
from .model_call import (Inputs, all_finite, call_model, check_batch, nonfinite_message, nonfinite_samples,
                         param_names, resolve_params)

FISHERS = ("ef", "ief", "sf", "ggn")
METHODS = ("magnitude", *FISHERS)
GGN_MAX_BLOCK = 4096  # the exact reference's largest dense block (a side): 128 MiB in float64


def _check_choice(kind: str, value, accepted: Sequence[str]) -> str:
    if not isinstance(value, str) or value not in accepted:
        raise ValueError(f"unknown {kind} {value!r}; accepted: {', '.join(map(repr, accepted))}")
    return value


def _check_block_size(block_size) -> int | None:
    if block_size is None:
        return None
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be None (one block over all pruned parameters) or an integer >= 1, got "
                         f"{block_size!r}")
    return block_size


def _check_sparsity(sparsity) -> float:
    try:
        value = float(sparsity)
    except (TypeError, ValueError):
        raise ValueError(f"sparsity must be a number in [0, 1] (the fraction of weights set to zero), got "
                         f"{sparsity!r}") from None
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"sparsity must be a number in [0, 1] (the fraction of weights set to zero), got "
                         f"{sparsity!r}")
    return value


def _check_damping(damping, fisher: str) -> float:
    if damping is None:
        raise ValueError(f"fisher={fisher!r} needs a damping lambda (a finite number > 0): the curvature of N "
                         "per-sample rows has rank at most N. No one value suits every model: choose it on held-out "
                         "data, e.g. with ief.woodfisher.prune_searched(..., validation=batches)")
    return check_damping(damping, allow_zero=False)


def pruned_parameters(model: torch.nn.Module, params: Iterable[torch.nn.Parameter] | None = None
                      ) -> tuple[list[str], list[torch.Tensor]]:
    """``(names, tensors)`` of the parameters to prune: ``params``, or (``None``) every trainable parameter with two
    or more dimensions (the weight matrices and kernels; biases and normalisation scales are kept, as in WoodFisher).

    Args:
        model: the model.
        params: the tensors to prune, or ``None``.

    Returns:
        ``(names, tensors)``, in the model's parameter order.

    Raises:
        ValueError: a given tensor is not a trainable parameter of ``model``, or there is nothing to prune.
    """
    if params is None:
        chosen = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
        if not chosen:
            raise ValueError("the model has no trainable parameter with two or more dimensions to prune; pass params=")
    else:
        chosen = resolve_params(model, params)
    return param_names(model, chosen), chosen


def _batches(batches) -> list[tuple[Inputs, torch.Tensor]]:
    out = list(batches) if batches is not None else []
    if not out:
        raise ValueError("batches must hold at least one (inputs, targets) pair: the samples the curvature is "
                         "estimated from")
    return [check_batch(b, i) for i, b in enumerate(out)]


# ---------------------------------------------------------------------------------------------------- rows
def curvature_rows(
    model: torch.nn.Module,
    batches: Iterable[tuple[Inputs, torch.Tensor]],
    fisher: str,
    params: Sequence[torch.Tensor],
    *,
    generator: torch.Generator | None = None,
    loss: str | Loss = "cross_entropy",
) -> torch.Tensor:
    """The rows ``r_n`` of an ``ef`` / ``ief`` / ``sf`` curvature (see the module docstring), ``[N, P]`` float64.

    Args:
        model: the model, used in the mode it is in.
        batches: ``(inputs, targets)`` pairs; ``N`` is their total number of samples.
        fisher: ``"ef"``, ``"ief"`` or ``"sf"``.
        params: the parameters whose columns are taken (:func:`pruned_parameters`).
        generator: SF's label draws.
        loss: ``"cross_entropy"`` or ``"mse"``.

    Returns:
        ``[N, P]`` float64, unscaled (``F = lambda I + R^T R / N``).

    Raises:
        ValueError: ``fisher`` is not one of ``ef``, ``ief``, ``sf``.
    """
    _check_choice("fisher (rows)", fisher, ("ef", "ief", "sf"))
    rows = []
    for inputs, targets in _batches(batches):
        if fisher == "sf":
            jac = sampled_jacobian(model, inputs, targets, generator, params, loss=loss)
            rows.append(jac.detach().to(torch.float64))
            continue
        ps = per_sample(model, inputs, targets, params, loss=loss)
        jac = ps.jacobian.detach().to(torch.float64)
        if fisher == "ief":  # eqn:iEF_mat_persample: each row over ||grad_z l_n|| (a zero row stays zero)
            norm = ps.logit_sqnorm.detach().to(torch.float64).sqrt()
            jac = jac / torch.where(norm > 0, norm, torch.ones_like(norm)).unsqueeze(1)
        rows.append(jac)
    return torch.cat(rows)


def ggn_blocks(
    model: torch.nn.Module,
    batches: Iterable[tuple[Inputs, torch.Tensor]],
    params: Sequence[torch.Tensor],
    spans: Sequence[tuple[int, int]],
    *,
    loss: str | Loss = "cross_entropy",
) -> tuple[list[torch.Tensor], int]:
    """The exact Fisher's diagonal blocks ``(1/N) sum_n sum_c p_n(c) g_nc[span] g_nc[span]^T`` (Eq. (2); ``g_nc =
    grad_theta log p_n(c)``, from :func:`ief.per_sample` with every label set to ``c``), dense float64.

    Args:
        model: the model (its forward on each batch's inputs gives ``[M, C]`` logits).
        batches: ``(inputs, targets)`` pairs; the targets only fix which samples count (one class each).
        params: the pruned tensors.
        spans: the blocks (:func:`block_spans`).
        loss: cross-entropy only (the Fisher summed over classes needs a softmax).

    Returns:
        ``(blocks, N)``: one ``[B, B]`` float64 matrix per span, and the number of samples.

    Raises:
        ValueError: a loss other than cross-entropy, targets that are not one class per sample (``[M]``), or a
            block wider than :data:`GGN_MAX_BLOCK`.
    """
    if get_loss(loss).name != "cross_entropy":
        raise ValueError(f"fisher='ggn' sums over the classes of a softmax cross-entropy (eqn:FIM); got loss="
                         f"{get_loss(loss).name!r}; accepted: 'cross_entropy'")
    widest = max(hi - lo for lo, hi in spans)
    if widest > GGN_MAX_BLOCK:
        raise ValueError(f"fisher='ggn' forms dense blocks; the widest here has {widest} entries, over the limit "
                         f"GGN_MAX_BLOCK={GGN_MAX_BLOCK}: pass a block_size <= {GGN_MAX_BLOCK}")
    blocks = [torch.zeros(hi - lo, hi - lo, dtype=torch.float64) for lo, hi in spans]
    n = 0
    for inputs, targets in _batches(batches):
        if targets.dim() != 1:
            raise ValueError(f"fisher='ggn' needs one class per sample (targets [M]), got targets of shape "
                             f"{tuple(targets.shape)}")
        with torch.no_grad():
            classes = int(call_model(model, inputs).shape[-1])
        for c in range(classes):
            ps = per_sample(model, inputs, torch.full_like(targets, c), params, loss=loss)
            weight = torch.exp(-ps.losses.detach().to(torch.float64)).sqrt()  # sqrt p_n(c): l_n = -log p_n(c)
            rows = ps.jacobian.detach().to(torch.float64) * weight.unsqueeze(1)
            for block, (lo, hi) in zip(blocks, spans):
                block += rows[:, lo:hi].T @ rows[:, lo:hi]
        n += targets.shape[0]
    return [b / n for b in blocks], n


# -------------------------------------------------------------------------------------------------- blocks
class _WoodburyBlock:
    """``(lambda I + U^T U)^{-1}`` of one block from its rows ``U [N, B]``, holding ``V [B, min(N, B)]`` and never the
    ``B x B`` inverse (module docstring), through ``U``'s thin SVD ``U = A diag(s) V^T`` (``V [B, k]``,
    ``k = min(N, B)``): the Woodbury form ``(1/lambda)(I - U^T (lambda I + U U^T)^{-1} U)`` is
    ``(I - V V^T)/lambda + V diag(1/(s^2 + lambda)) V^T``.

    The SVD of ``U`` rather than the eigen-decomposition of the ``N x N`` Gram ``U U^T = A diag(s^2) A^T`` (the same
    factors): the Gram squares ``U``'s condition number, and where the rows span the whole block (``N >= B``) the
    part of ``e_q`` outside their span, ``1 - ||V_q||^2``, exactly 0, came out ~1e-12 from the Gram's small
    eigenpairs, an error that the division by ``lambda`` (1e-8) magnifies to order 1e-4 in ``[F^{-1}]_qq``, which
    can be the entry's own size (the case measured: ``benchmarks/README.md``). ``V``'s columns are
    orthonormal to rounding whatever the conditioning, and where the kept rows span the block (rank ``B``) that part is
    set to exactly 0 (``1 - ||V_q||^2`` is rounding there). Singular values at ``U``'s rounding are dropped (their
    directions count as the null space): ``s <= max(N, B) eps s_max``, and for rows computed in float32 ``s^2 <=``
    :func:`ief.directions.rounding_floor`, as the exact directions do.
    """

    def __init__(self, u: torch.Tensor, dtype: torch.dtype):
        _, s, vh = torch.linalg.svd(u, full_matrices=False)
        top = float(s.max()) if s.numel() else 0.0
        floor = rounding_floor(dtype, u.square().sum().reshape(1, 1))
        keep = (s > max(u.shape) * torch.finfo(torch.float64).eps * top) & (s.square() > floor) & (s > 0)
        self.e = s[keep].square()  # eigenvalues of U U^T (and U^T U) kept
        self.v = vh[keep].T  # [B, r], orthonormal columns
        # ||(I - V V^T) e_q||^2; exactly 0 when the kept rows span the block (rank B), not rounding over lambda
        self.full = self.v.shape[1] == self.v.shape[0]
        self.null = torch.zeros(u.shape[1], dtype=u.dtype) if self.full else \
            (1.0 - self.v.square().sum(1)).clamp_min(0.0)

    def trace(self) -> float:
        return float(self.e.sum())

    def inverse_diagonal(self, damping: float) -> torch.Tensor:
        return self.null / damping + (self.v.square() / (self.e + damping)).sum(1)

    def inverse_times(self, c: torch.Tensor, damping: float) -> torch.Tensor:
        vc = self.v.T @ c
        inside = self.v @ (vc / (self.e + damping))
        return inside if self.full else (c - self.v @ vc) / damping + inside


class _DenseBlock:
    """``(lambda I + F_b)^{-1}`` of one dense block (the ``ggn`` reference), Cholesky per damping."""

    def __init__(self, matrix: torch.Tensor):
        self.matrix = matrix
        self._cached: tuple[float, torch.Tensor] | None = None

    def _inverse(self, damping: float) -> torch.Tensor:
        if self._cached is None or self._cached[0] != damping:
            eye = torch.eye(self.matrix.shape[0], dtype=torch.float64)
            self._cached = (damping, torch.cholesky_inverse(torch.linalg.cholesky(self.matrix + damping * eye)))
        return self._cached[1]

    def trace(self) -> float:
        return float(self.matrix.trace())

    def inverse_diagonal(self, damping: float) -> torch.Tensor:
        return self._inverse(damping).diagonal().clone()

    def inverse_times(self, c: torch.Tensor, damping: float) -> torch.Tensor:
        return self._inverse(damping) @ c


def block_spans(params: Sequence[torch.Tensor], block_size: int | None) -> list[tuple[int, int]]:
    """The diagonal blocks of WoodFisher's block-diagonal curvature, as spans of the flat parameter vector.

    Args:
        params: the pruned tensors, each flattened, in order.
        block_size: entries per block (consecutive within each tensor; the last block of a tensor shorter), or
            ``None`` for one span over all.

    Returns:
        ``[(lo, hi), ...]``: each block's ``[lo, hi)``.
    """
    block_size = _check_block_size(block_size)
    sizes = [p.numel() for p in params]
    if block_size is None:
        return [(0, sum(sizes))]
    spans, offset = [], 0
    for size in sizes:
        spans += [(offset + lo, offset + min(lo + block_size, size)) for lo in range(0, size, block_size)]
        offset += size
    return spans


@dataclass
class OBSCurvature:
    """A damped block-diagonal curvature of the pruned parameters, ready to score and prune at any damping.

    Attributes:
        fisher: the curvature's kind (``"ef"``, ``"ief"``, ``"sf"`` or ``"ggn"``).
        names: the pruned parameters' names.
        params: the pruned parameters (their current values are the ``w`` of OBS).
        samples: ``N``, the samples the curvature was built from.
        spans: the blocks' ``[lo, hi)`` in the flat vector.
        blocks: one factored block per span (its rows' thin SVD, or the dense GGN block), invertible at any damping.
    """

    fisher: str
    names: list[str]
    params: list[torch.Tensor]
    samples: int
    spans: list[tuple[int, int]]
    blocks: list

    def _weights(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params]).to(torch.float64)

    def trace(self) -> float:
        """The trace of the undamped curvature's kept blocks, ``sum_b tr F_b``: its scale, against which a damping
        is small or large (EF's rows carry ``||grad_z l_n||``, iEF's do not)."""
        return float(sum(b.trace() for b in self.blocks))

    def inverse_diagonal(self, damping: float) -> torch.Tensor:
        """``[F^{-1}]_qq`` for every pruned weight, ``[P]`` float64 (``F`` damped by ``damping > 0``)."""
        damping = _check_damping(damping, self.fisher)
        return torch.cat([b.inverse_diagonal(damping) for b in self.blocks])

    def saliency(self, damping: float) -> dict[str, torch.Tensor]:
        """OBS saliencies ``rho_q = w_q^2 / (2 [F^{-1}]_qq)``, name -> float64 tensor shaped like the parameter."""
        rho = self._weights().square() / (2 * self.inverse_diagonal(damping))
        return _unflatten(rho, self.names, self.params)

    def prune(self, sparsity: float, damping: float, update: bool = True) -> dict[str, torch.Tensor]:
        """Set the fraction ``sparsity`` of the pruned weights with the smallest saliency to zero, in place.

        The weights are ranked globally (over every pruned parameter; WoodFisher's global mode) and the
        ``round(sparsity * P)`` smallest are removed. ``update=True`` moves the other weights of each block by the
        OBS update of every weight removed from it, summed: ``dw = -F_b^{-1} sum_{q in Q_b} (w_q / [F_b^{-1}]_qq)
        e_q`` (for one weight, OBS's ``-w_q F^{-1} e_q / [F^{-1}]_qq``). This is how WoodFisher removes many weights
        at once in one-shot pruning (Singh & Alistarh, NeurIPS 2020; their reference implementation, IST-DASLab/
        WoodFisher ``pruners/woodfisherblock.py``): each weight's update computed from the same block inverse,
        independently of the others, then the removed weights set to zero (the summed update leaves them near,
        not at, zero).

        Returns:
            name -> bool mask shaped like the parameter (``True``: kept).

        Raises:
            ValueError: a sparsity outside ``[0, 1]`` or a damping that is not > 0.
        """
        sparsity = _check_sparsity(sparsity)
        damping = _check_damping(damping, self.fisher)
        w = self._weights()
        diag = self.inverse_diagonal(damping)
        rho = w.square() / (2 * diag)
        removed = _smallest(rho, sparsity)
        new = w.clone()
        if update:
            for (lo, hi), block in zip(self.spans, self.blocks):
                gone = removed[lo:hi]
                if bool(gone.any()):
                    c = torch.where(gone, w[lo:hi] / diag[lo:hi], torch.zeros_like(w[lo:hi]))
                    new[lo:hi] -= block.inverse_times(c, damping)
        new[removed] = 0.0
        _assign(new, self.params)
        return _unflatten(~removed, self.names, self.params)


def _smallest(score: torch.Tensor, sparsity: float) -> torch.Tensor:
    """Bool ``[P]``: the ``round(sparsity * P)`` entries of smallest score (ties: the first, a stable sort)."""
    k = int(round(sparsity * score.numel()))
    removed = torch.zeros(score.numel(), dtype=torch.bool)
    removed[torch.sort(score, stable=True).indices[:k]] = True
    return removed


def _unflatten(flat: torch.Tensor, names: Sequence[str], params: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    out, offset = {}, 0
    for name, p in zip(names, params):
        out[name] = flat[offset : offset + p.numel()].reshape(p.shape)
        offset += p.numel()
    return out


@torch.no_grad()
def _assign(flat: torch.Tensor, params: Sequence[torch.Tensor]) -> None:
    offset = 0
    for p in params:
        p.copy_(flat[offset : offset + p.numel()].reshape(p.shape).to(p.dtype))
        offset += p.numel()


# ------------------------------------------------------------------------------------------------ the API
def obs_curvature(
    model: torch.nn.Module,
    batches: Iterable[tuple[Inputs, torch.Tensor]],
    *,
    fisher: str,
    params: Iterable[torch.nn.Parameter] | None = None,
    block_size: int | None = None,
    generator: torch.Generator | None = None,
    loss: str | Loss = "cross_entropy",
) -> OBSCurvature:
    """The curvature of OBS pruning (module docstring), computed once for any damping and sparsity.

    Args:
        model: the model at the weights to prune, used in the mode it is in (``eval()`` for pruning).
        batches: ``(inputs, targets)`` pairs, the ``N`` samples of the estimate.
        fisher: ``"ef"``, ``"ief"`` (Eq. (41)), ``"sf"`` or ``"ggn"`` (exact, small blocks).
        params: the parameters to prune; default: :func:`pruned_parameters`.
        block_size: the diagonal blocks' size (``None``: one block, the whole matrix).
        generator: SF's label draws.
        loss: ``"cross_entropy"`` or ``"mse"`` (``ggn``: cross-entropy only).

    Returns:
        :class:`OBSCurvature`.

    Raises:
        ValueError: an unknown ``fisher``, a bad ``block_size``, no batches, a ``ggn`` block over
            :data:`GGN_MAX_BLOCK`, or parameters that are not the model's.
    """
    fisher = _check_choice("fisher", fisher, FISHERS)
    names, tensors = pruned_parameters(model, params)
    spans = block_spans(tensors, block_size)
    batches = _batches(batches)
    if fisher == "ggn":
        dense, n = ggn_blocks(model, batches, tensors, spans, loss=loss)
        return OBSCurvature(fisher, names, tensors, n, spans, [_DenseBlock(b) for b in dense])
    rows = curvature_rows(model, batches, fisher, tensors, generator=generator, loss=loss)
    u = rows / rows.shape[0] ** 0.5
    blocks = [_WoodburyBlock(u[:, lo:hi], tensors[0].dtype) for lo, hi in spans]
    return OBSCurvature(fisher, names, tensors, rows.shape[0], spans, blocks)


def obs_saliency(
    model: torch.nn.Module,
    batches: Iterable[tuple[Inputs, torch.Tensor]],
    *,
    fisher: str,
    damping: float | None = None,
    params: Iterable[torch.nn.Parameter] | None = None,
    block_size: int | None = None,
    generator: torch.Generator | None = None,
    loss: str | Loss = "cross_entropy",
) -> dict[str, torch.Tensor]:
    """Per-weight pruning saliencies, name -> float64 tensor shaped like the parameter.

    ``fisher="magnitude"``: ``w_q^2`` (no data, no damping). Otherwise OBS's ``rho_q = w_q^2 / (2 [F^{-1}]_qq)`` with
    ``F = lambda I + (1/N) sum_n r_n r_n^T`` block by block (Appendix D.2.3; rows and blocks in the
    module docstring).

    Args:
        model: the model whose weights are scored (not changed).
        batches: ``(inputs, targets)`` pairs: the ``N`` samples of the curvature (ignored by ``"magnitude"``).
        fisher: ``"magnitude"``, ``"ef"``, ``"ief"``, ``"sf"`` or ``"ggn"``.
        damping: ``lambda > 0`` (not used by ``"magnitude"``).
        params: the tensors to score (default: :func:`pruned_parameters`).
        block_size: WoodFisher's blocks (``None``: one block).
        generator: the RNG of ``"sf"``'s sampled labels.
        loss: as :func:`ief.per_sample`.

    Returns:
        name -> ``rho`` (float64, shaped like the parameter).

    Raises:
        ValueError: an unknown ``fisher`` (accepted: :data:`METHODS`), a missing or non-positive damping, and
            whatever :func:`obs_curvature` refuses.
    """
    fisher = _check_choice("fisher", fisher, METHODS)
    if fisher == "magnitude":
        names, tensors = pruned_parameters(model, params)
        return {n: p.detach().to(torch.float64).square() for n, p in zip(names, tensors)}
    damping = _check_damping(damping, fisher)
    curvature = obs_curvature(model, batches, fisher=fisher, params=params, block_size=block_size,
                              generator=generator, loss=loss)
    return curvature.saliency(damping)


def magnitude_prune(model: torch.nn.Module, sparsity: float,
                    params: Iterable[torch.nn.Parameter] | None = None) -> dict[str, torch.Tensor]:
    """Global magnitude pruning, in place: the ``round(sparsity * P)`` weights of smallest ``|w|`` set to zero.

    Args:
        model: pruned in place.
        sparsity: the fraction of the pruned parameters' weights set to zero, in ``[0, 1]``.
        params: the tensors to prune (default: :func:`pruned_parameters`).

    Returns:
        name -> bool mask (``True``: kept).
    """
    sparsity = _check_sparsity(sparsity)
    names, tensors = pruned_parameters(model, params)
    w = torch.cat([p.detach().reshape(-1) for p in tensors]).to(torch.float64)
    removed = _smallest(w.abs(), sparsity)
    _assign(torch.where(removed, torch.zeros_like(w), w), tensors)
    return _unflatten(~removed, names, tensors)


def prune(
    model: torch.nn.Module,
    batches: Iterable[tuple[Inputs, torch.Tensor]] | None,
    sparsity: float,
    *,
    fisher: str,
    damping: float | None = None,
    block_size: int | None = None,
    update: bool = True,
    params: Iterable[torch.nn.Parameter] | None = None,
    generator: torch.Generator | None = None,
    loss: str | Loss = "cross_entropy",
) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """One-shot pruning of ``model`` in place: magnitude, or (Wood)Fisher OBS with the chosen curvature.

    Args:
        model: pruned in place (its pruned parameters' values change).
        batches: ``(inputs, targets)`` pairs (ignored by ``"magnitude"``).
        sparsity: the fraction of the pruned parameters' weights set to zero, in ``[0, 1]``.
        fisher: ``"magnitude"``, ``"ef"``, ``"ief"``, ``"sf"`` or ``"ggn"``.
        damping: ``lambda > 0`` (not used by ``"magnitude"``).
        block_size: WoodFisher's blocks (``None``: one block).
        update: apply OBS's compensating update (see :meth:`OBSCurvature.prune`); ``False``: only zero the weights
            (OBS's choice of weights without its update).
        params: the tensors to prune (default: :func:`pruned_parameters`).
        generator: the RNG of ``"sf"``'s sampled labels.
        loss: as :func:`ief.per_sample`.

    Returns:
        ``(model, masks)``, masks name -> bool tensor (``True``: kept).

    Raises:
        ValueError: as :func:`obs_saliency`, and a sparsity outside ``[0, 1]``.
    """
    fisher = _check_choice("fisher", fisher, METHODS)
    sparsity = _check_sparsity(sparsity)
    if fisher == "magnitude":
        return model, magnitude_prune(model, sparsity, params)
    damping = _check_damping(damping, fisher)
    curvature = obs_curvature(model, batches, fisher=fisher, params=params, block_size=block_size,
                              generator=generator, loss=loss)
    return model, curvature.prune(sparsity, damping, update=update)


DAMPING_GRID = tuple(float(f"1e{k}") for k in range(-8, 3))  # 1e-8 ... 1e2, the compression chapter's grid


def validation_loss(model: torch.nn.Module, batches: Iterable[tuple[Inputs, torch.Tensor]],
                    loss: str | Loss = "cross_entropy") -> float:
    """The mean per-sample loss of ``model`` over ``batches`` (no gradient; the model in the mode it is in).

    Args:
        model: the model.
        batches: ``(inputs, targets)`` pairs.
        loss: ``"cross_entropy"``, ``"mse"`` or a :class:`ief.losses.Loss`.

    Returns:
        ``sum_n l_n / N`` over every sample of every batch (``l_n`` summed over a sample's positions).

    Raises:
        ValueError: no batch, or a batch that is not an ``(inputs, targets)`` pair.
        FloatingPointError: a non-finite loss, naming its batch and samples (the optimisers' message).
    """
    fn = get_loss(loss)
    total, count = 0.0, 0
    with torch.no_grad():
        for b, (inputs, targets) in enumerate(_batches(batches)):
            per = fn.per_sample(call_model(model, inputs), targets)
            if not all_finite(per):
                bad = nonfinite_samples(per, inputs, per.shape[0])
                raise FloatingPointError(f"batch {b}: " + nonfinite_message(
                    "loss", bad, per.shape[0], "the validation loss is refused rather than returned as NaN"))
            total += float(per.double().sum())
            count += per.shape[0]
    return total / count


def prune_searched(
    model: torch.nn.Module,
    batches: Iterable[tuple[Inputs, torch.Tensor]],
    sparsity: float,
    *,
    fisher: str,
    validation: Iterable[tuple[Inputs, torch.Tensor]],
    dampings: Sequence[float] = DAMPING_GRID,
    block_size: int | None = None,
    update: bool = True,
    params: Iterable[torch.nn.Parameter] | None = None,
    generator: torch.Generator | None = None,
    loss: str | Loss = "cross_entropy",
) -> tuple[torch.nn.Module, dict[str, torch.Tensor], float, dict[float, float]]:
    """:func:`prune` at the damping that leaves the lowest loss on held-out ``validation`` batches.

    The damping sets how far OBS trusts the curvature, and the best one depends on the curvature's scale (EF's rows
    carry ``||grad_z l_n||``, iEF's do not) and on the model: no one value suits every case (on the digits MLP at 80 %
    sparsity, iEF at a fixed ``1e-4`` kept 34 % accuracy, at its validated damping more than magnitude pruning; see the
    compression chapter). The curvature is computed once (:func:`obs_curvature`), then every candidate damping prunes
    the same starting weights; the candidate with the lowest :func:`validation_loss` (the smallest damping among
    equals) is applied to ``model``. Cost: one pass over ``batches`` plus, per candidate, one prune and one pass
    over ``validation``.

    Args:
        model: pruned in place at the chosen damping.
        batches: the ``(inputs, targets)`` pairs the curvature is estimated from.
        sparsity: the fraction of the pruned weights set to zero, in ``[0, 1]``.
        fisher: ``"ef"``, ``"ief"``, ``"sf"`` or ``"ggn"``.
        validation: held-out ``(inputs, targets)`` pairs that choose the damping (not ``batches``).
        dampings: the candidates, each > 0 (default :data:`DAMPING_GRID`, ``1e-8 ... 1e2``).
        block_size: as :func:`prune`.
        update: as :func:`prune`.
        params: as :func:`prune`.
        generator: as :func:`prune`.
        loss: as :func:`prune`.

    Returns:
        ``(model, masks, damping, losses)``: the pruned model, its masks (name -> bool, ``True`` kept), the chosen
        damping and every candidate's validation loss.

    Raises:
        ValueError: ``fisher`` not one of :data:`FISHERS` (magnitude pruning has no damping: use :func:`prune`), no
            candidate damping, a candidate that is not > 0, and as :func:`prune`.

    Warns:
        UserWarning: the chosen damping is the smallest or the largest candidate (the search did not bracket a
            minimum: extend ``dampings``).
    """
    fisher = _check_choice("fisher", fisher, FISHERS)
    sparsity = _check_sparsity(sparsity)
    candidates = [_check_damping(d, fisher) for d in dampings]
    if not candidates:
        raise ValueError("dampings must hold at least one candidate damping > 0")
    validation = _batches(validation)
    curvature = obs_curvature(model, batches, fisher=fisher, params=params, block_size=block_size,
                              generator=generator, loss=loss)
    start = [p.detach().clone() for p in curvature.params]
    losses: dict[float, float] = {}
    for damping in sorted(candidates):
        curvature.prune(sparsity, damping, update=update)
        losses[damping] = validation_loss(model, validation, loss)
        _restore(curvature.params, start)
    finite = {d: v for d, v in losses.items() if v == v and v != float("inf")}
    if not finite:
        raise FloatingPointError(f"every candidate damping left a non-finite validation loss: {losses}")
    best = min(finite, key=lambda d: (finite[d], d))
    _warn_at_grid_edge(best, losses)
    masks = curvature.prune(sparsity, best, update=update)
    return model, masks, best, losses


def _warn_at_grid_edge(best: float, losses: dict[float, float]) -> None:
    """Warn (``UserWarning``) when ``best`` is the smallest or the largest of several candidates: the search did not
    bracket a minimum, so the best damping may lie beyond the grid (or the loss is flat there and the damping does
    not matter), and the user should extend it."""
    grid = sorted(losses)
    if len(grid) < 2 or best not in (grid[0], grid[-1]):
        return
    smallest = best == grid[0]
    beyond = best / 100 if smallest else best * 100
    flat = losses[grid[1] if smallest else grid[-2]] == losses[best]
    warnings.warn(
        f"prune_searched chose damping={best:g}, the {'smallest' if smallest else 'largest'} of its candidates "
        f"({grid[0]:g} ... {grid[-1]:g}; validation loss {losses[best]:.6g}"
        f"{', equal at its neighbour: the loss is flat there' if flat else ''}): the best damping may lie beyond "
        f"the grid; pass dampings= reaching {beyond:g} to bracket it", UserWarning, stacklevel=3)


def _restore(params: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
    with torch.no_grad():
        for p, v in zip(params, values):
            p.copy_(v)


__all__ = [
    "DAMPING_GRID",
    "FISHERS",
    "METHODS",
    "GGN_MAX_BLOCK",
    "OBSCurvature",
    "block_spans",
    "curvature_rows",
    "ggn_blocks",
    "magnitude_prune",
    "obs_curvature",
    "obs_saliency",
    "pruned_parameters",
    "prune",
    "prune_searched",
    "validation_loss",
]
