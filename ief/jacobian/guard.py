"""The guard and the exact check: that the hooked rows are the per-sample gradients.

The guard (``check=True``, ~free) refuses batch norm with batch statistics and reads what the batch backward gives
each hooked parameter itself, ``o = g - sum_n J_n``: ``None`` by construction (its hooked calls ran with stand-ins)
unless a use escaped the search for outside uses, when :class:`PerSampleGradientMismatch` names the parameter.
The exact check (``check="exact"``) compares every row with exact per-sample directional derivatives. Both know the
precision the forward ran in: the guard's tolerance comes from the lowest floating format of the forward (bfloat16
under autocast or with bfloat16 weights), not from ``J``'s dtype (:mod:`ief.precision`, which derives it). The exact
check of a 16-bit forward runs in float32 (autocast disabled, 16-bit parameters on a float32 copy:
:mod:`ief.jacobian.api`), where no rounding hides a sample mixing, and the 16-bit rows are then held against the
float32 rows within the format's ``16 u`` (:func:`check_rounding`); where no float32 forward is to be had (autocast
entered inside the model, a sharded or quantised 16-bit parameter, a float32 copy that does not fit in memory) it
measures the rounding of its own products on the batch (:func:`check_directional_derivatives`). Non-finite losses or
rows raise ``FloatingPointError`` naming the samples.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Callable, Iterator, Sequence

import torch

from ..logit_jvp import differentiable_kernels, double_backward_jvps, jvps_any_mode
from ..model_call import ReplayableForward, all_finite, nonfinite_message
from ..precision import FLOAT32_FLOOR, SIXTEEN_BIT, describe, mismatch_tolerance, outside_use_tolerance, unit_roundoff
from ..rows import DenseRows, FactoredJacobian, Rows, as_rows
from .capture import PerSampleCapture
from .errors import PerSampleGradientMismatch


def check_no_outside_use(capture: PerSampleCapture, jacobian: torch.Tensor | FactoredJacobian,
                         autograd: Sequence[torch.Tensor | None], names: Sequence[str],
                         forward_format: torch.dtype | None = None) -> None:
    """The guard (``check=True``): raise :class:`PerSampleGradientMismatch` if a hooked parameter is used outside
    its hooked module calls beyond rounding error.

    Its hooked calls ran with stand-ins (:class:`PerSampleCapture`), so autograd's gradient of the parameter itself,
    ``o = autograd[i]``, is exactly the part of the batch gradient that the hooked rows miss: ``o = g - sum_n J_n``.
    ``None`` or zero: the rows are the whole gradient by construction (no gradient is read). Otherwise the block
    fails when ``||o|| > tol * sqrt(M) ||J_block||_F`` (the right side bounds ``tol * sum_n ||J_n||``),
    ``tol = 50 sqrt(eps)`` of ``J``'s dtype (32-bit at least), and at least ``16 u`` of ``forward_format``, the
    lowest format the forward ran in (:func:`ief.precision.outside_use_tolerance`). Parameters of the per-sample
    loop are not checked: their rows are gradients of the individual losses whatever the model does. A non-finite ``o``
    is left to the caller (``FloatingPointError`` in the optimisers). A parameter whose outside use is in the forward's
    graph (a weight tied to an unhooked use) has already been sent to the loop
    (:meth:`PerSampleCapture.demote_outside_uses`): this is the safety net behind that search."""
    found = [i for i in sorted(capture.hooked - set(capture.broadcast))
             if autograd[i] is not None and bool(autograd[i].any())]
    if not found:
        return
    err = torch.stack([torch.linalg.vector_norm(autograd[i], dtype=torch.float64) for i in found])
    rows, offsets = as_rows(jacobian), capture.offsets
    scale = torch.stack([rows.column_norm(offsets[i], offsets[i + 1]) for i in found]) * math.sqrt(jacobian.shape[0])
    _raise_if_beyond(err, scale + torch.finfo(jacobian.dtype).tiny,
                     outside_use_tolerance(forward_format, jacobian.dtype), [names[i] for i in found])


def _raise_if_beyond(err: torch.Tensor, scale: torch.Tensor, tol: float, names: Sequence[str]) -> None:
    """Raise :class:`PerSampleGradientMismatch` naming the blocks with ``err > tol * scale``."""
    failing = torch.nonzero(err > tol * scale).flatten().tolist()
    if failing:
        bad = [f"{names[k]} (relative error {float(err[k] / scale[k]):.2e})" for k in failing[:5]]
        raise PerSampleGradientMismatch(
            "per-sample gradients do not sum to the batch gradient for: " + ", ".join(bad)
            + ". A parameter is used outside the module that owns it where the per-sample hooks cannot see it (a "
            "weight tied to an unhooked use is found before the backward and takes the exact per-sample loop: this "
            "use escaped that search); pass params= to leave it out."
        )


CHECKS = (True, False, "exact")


def _check_mode(check) -> str | None:
    if check is True:
        return "sum"
    if check is False or check is None:
        return None
    if check == "exact":
        return "exact"
    raise ValueError(f"check must be one of {CHECKS}, got {check!r}")


def _refuse_sample_mixing(model: torch.nn.Module) -> None:
    """Batch norm that normalises with batch statistics makes every l_n depend on every sample's input."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and (
            module.training or module.running_mean is None
        ):
            raise PerSampleGradientMismatch(
                f"module {name or type(module).__name__!r} ({type(module).__name__}) normalises with batch "
                "statistics, so samples are mixed and per-sample gradients from one backward are not the gradients "
                "of the individual losses; put it in eval mode (module.eval()), or replace it by a per-sample "
                "normalisation (e.g. nn.GroupNorm / nn.LayerNorm)"
            )


CHECK_TANGENTS = 8  # random tangents of the exact check
RESCALE = 3.0  # the factor of the second set of tangents of a 16-bit check (not a power of two: rounded otherwise)
SAMPLE_FACTOR = 8.0  # a 16-bit check: one sample's bound, in units of the products' measured rounding
MEDIAN_FACTOR = 2.5  # a 16-bit check: the samples' median's bound, in the same units
ROW_ROUNDING_FACTOR = 4.0  # check_rounding: one sample's bound, in units of the format's 16 u (the median's bound)


def _sixteen_bit(forward_format: torch.dtype | None, jac_dtype: torch.dtype) -> torch.dtype | None:
    """The 16-bit format the forward ran in or ``J`` is stored in (``None``: neither)."""
    return forward_format if forward_format in SIXTEEN_BIT else jac_dtype if jac_dtype in SIXTEEN_BIT else None


def exact_check_tolerance(dtype: torch.dtype, forward_format: torch.dtype | None = None) -> float:
    """The exact check's bound on ``||J_n V - exact_n|| / ||exact_n||`` from the formats alone: ``max(1.2e-3, 16 u)``.

    ``u`` is the unit roundoff of the lower of ``dtype`` and ``forward_format``
    (:func:`ief.precision.mismatch_tolerance`, whose module derives it): ``1e4`` units of float32 rounding (1.2e-3)
    for float32 and float64 alike (models compute parts in float32 whatever their parameters' dtype: T5's layer norm;
    the exact products of a float64 T5-LoRA differ from its rows by 7.5e-8). A float32 or float64 check uses it as it
    is (so does the check of a 16-bit forward, which runs in float32); its 16-bit value bounds a 16-bit forward's
    rows against the float32 ones (:func:`check_rounding`), and caps the tolerance a 16-bit check measures on the
    batch where no float32 forward is to be had (:func:`check_directional_derivatives`).

    Args:
        dtype: the dtype ``J`` is stored in.
        forward_format: the lowest floating format the forward ran in (``None``: ``dtype`` alone).

    Returns:
        The relative tolerance.
    """
    return mismatch_tolerance(forward_format, dtype)


def _reverse_mode_products(forward: ReplayableForward, params: Sequence[torch.Tensor],
                           full: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[K, *z.shape]`` float64: ``J_z (RESCALE v_k)`` by double backward on a replay of the forward (one forward,
    one backward with ``create_graph``, one backward-type pass per tangent): the exact check's products computed a
    second time, along the reverse-mode path the rows themselves came from, with tangents rounded otherwise."""
    tangent_sets = [[t[k] * RESCALE for t in full] for k in range(CHECK_TANGENTS)]
    with differentiable_kernels(), torch.inference_mode(False), torch.enable_grad():
        logits = forward()
        jvs = double_backward_jvps(logits, params, tangent_sets)
    return torch.stack([j.detach().to(torch.float64) for j in jvs])


def _check_tangents(params: Sequence[torch.Tensor], k: int,
                    padding: dict[int, int] | None = None) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """``K`` random tangents per parameter (fixed seed), as float64 factors rounded to the parameter's dtype (both
    sides of the check then use the same numbers): ``(u [K, O], w [K, I])`` for a parameter of two or more dimensions
    viewed ``[O, I]`` (the rank-1 tangent ``u w^T``: ``O + I`` draws instead of ``O I``, and ``J_n . u w^T`` straight
    from a factored weight's ``G`` and ``A``), ``(t [K, numel], None)`` otherwise. ``E[(u^T D w)^2] = ||D||_F^2``:
    an error ``D`` shows in proportion to its size, as with a dense Gaussian tangent. ``padding``: ``id`` of an
    ``nn.Embedding`` weight -> its ``padding_idx``, whose row gets no tangent (autograd defines its gradient as 0,
    forward mode would differentiate it)."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for p in params:
        rows = p.shape[0] if p.dim() >= 2 else p.numel()
        u = torch.randn(k, rows, generator=gen, dtype=torch.float64).to(p.dtype).to(torch.float64)
        if padding and id(p) in padding:
            u[:, padding[id(p)]] = 0
        w = None
        if p.dim() >= 2:
            w = torch.randn(k, p.numel() // rows, generator=gen, dtype=torch.float64).to(p.dtype).to(torch.float64)
        out.append((u, w))
    return out


def _hooked_products(jac: torch.Tensor | FactoredJacobian, tangents, offsets: Sequence[int]) -> torch.Tensor:
    """``J_n v_k`` for the tangents of :func:`_check_tangents`, ``[M, K]`` in float64, column block by column block
    (no float64 copy of ``J``, no ``[K, P]`` matrix); a factored weight's from its ``G`` and ``A``
    (:meth:`ief.rows.Rows.add_rank_one_products`)."""
    rows = as_rows(jac)
    out = torch.zeros(jac.shape[0], CHECK_TANGENTS, dtype=torch.float64, device=jac.device)
    for i, (u, w) in enumerate(tangents):
        rows.add_rank_one_products(out, offsets[i], offsets[i + 1], u, w)
    return out


def check_directional_derivatives(forward: ReplayableForward, params: Sequence[torch.Tensor], names: Sequence[str],
                                  jac: torch.Tensor | FactoredJacobian, grad_z: torch.Tensor,
                                  forward_format: torch.dtype | None = None) -> None:
    """The exact check (``check="exact"``): every row ``J_n`` against sample ``n``'s exact directional derivatives.

    For ``K`` = :data:`CHECK_TANGENTS` random tangents ``v_k`` (:func:`_check_tangents`: rank one per weight matrix),
    ``exact_nk = (dl_n/dz_n)^T J_{z_n} v_k`` (one batched forward-mode pass, or double backward, on a replay of the
    forward with the real parameters; ``dl_n/dz_n`` as the batch backward computed it, so that a confident sample's
    rounded ``p - 1`` is shared) and ``J_n v_k`` from the rows, both summed in float64. Normalised by the size of
    the products themselves (``rel_n = ||J_n V - exact_n|| / max(||exact_n||, ||J_n V||)``, norms over the ``K``
    tangents), an error of relative size ``r`` in ``J_n`` shows as ``~r`` whatever ``P``.

    Float32 and float64 (and autocast with float32 parameters, whose check :mod:`ief.jacobian.api` runs in
    float32): sample ``n`` fails when ``rel_n > 1.2e-3`` (:func:`exact_check_tolerance`).

    A 16-bit forward (bfloat16 weights or autocast) runs this check in float32, at float32's tolerance
    (:mod:`ief.jacobian.api`), and its rows are held against the float32 ones (:func:`check_rounding`). Where no float32
    forward is to be had (autocast entered inside the model's own code, not accelerate's wrapper; a 16-bit parameter
    that is a tensor subclass; a float32 copy that does not fit in memory), the check runs on the 16-bit forward. Both
    sides then carry its rounding, which depends on the model (1e-2 to 3e-2 relative on tiny GPT-2, BERT, ViT and an MLP
    with bfloat16 weights), so the tolerance is measured on the batch rather than taken from the format: the same
    products are computed a second time by double backward (the reverse-mode path the rows came from) with the tangents
    scaled by :data:`RESCALE` (rounded otherwise), and ``rho``, the samples' median of their relative difference, is the
    products' rounding. Sample ``n`` fails when ``rel_n > SAMPLE_FACTOR rho`` (a row of another sample's size: a gather,
    a sequence-first layer read batch-first), and every sample above ``MEDIAN_FACTOR rho`` fails when the samples'
    median ``rel`` exceeds it (a sample-mixing layer shifts every row; rounding does not), both bounds at least 1.2e-3
    and at most the format's ``16 u``. The factors (8 and 2.5) leave a margin of 1.5 to 2.5 over the largest ratios of
    correct models measured (median ``rel / rho`` up to 1.7 for a bfloat16 base with float32 LoRA adapters). Cost of a
    16-bit check: one forward, one backward with ``create_graph`` and ``K`` backward-type passes more.

    The smallest sample mixing caught, ``h + c h.mean(0)`` after a tanh layer (M = 8, ``tests/ief/test_precision.py``,
    ``SMALLEST_CAUGHT``, measured by sweeping ``c`` from 0.001 to 0.3, at M = 16 too): ``c = 0.005`` (rows 0.12 %
    off; 0.08 % at M = 16) in float32, under bfloat16 autocast (also accelerate's) and with bfloat16 weights, all
    checked in float32; ``c = 0.1`` by this check in 16 bits (autocast entered in the model's own code: 0.05, rows
    1.2 % off, passes, below its products' own rounding; at M = 16, 0.1, rows 1.6 % off, passes and 0.2 is caught;
    the format's ``16 u`` alone let 0.2 pass).

    Args:
        forward: the replayable forward (the model and its inputs).
        params: the parameters of ``J``'s columns.
        names: their names.
        jac: ``J``, dense or factored.
        grad_z: ``dL/dz`` as the batch backward computed it.
        forward_format: the lowest floating format the forward ran in (``None``: ``J``'s dtype alone).

    Raises:
        PerSampleGradientMismatch: naming the samples that fail, the worst one and its relative error (and, for a
            16-bit check, the measured rounding).
    """
    m = jac.shape[0]
    padding = {id(mod.weight): mod.padding_idx for mod in forward.model.modules()
               if isinstance(mod, torch.nn.Embedding) and mod.padding_idx is not None}
    tangents = _check_tangents(params, CHECK_TANGENTS, padding)
    full = [(u.to(p) if w is None else u.to(p)[:, :, None] * w.to(p)[:, None, :]).reshape(-1, *p.shape)
            for (u, w), p in zip(tangents, params)]  # formed in the parameter's dtype (no float64 [K, P])
    low = _sixteen_bit(forward_format, jac.dtype)
    _, jvs = jvps_any_mode(forward, params, names, full)
    g = grad_z.detach().to(torch.float64).reshape(m, 1, -1)
    exact = _contract(g, jvs)  # [M, K]
    del jvs
    again = None
    if low is not None:  # the same products by reverse mode (double backward), tangents x 3: rounded otherwise
        again = _contract(g, _reverse_mode_products(forward, params, full))
    del full
    offsets = [0, *torch.tensor([p.numel() for p in params]).cumsum(0).tolist()]
    hooked = _hooked_products(jac, tangents, offsets)
    err = (hooked - exact).norm(dim=1)
    scale = torch.maximum(exact.norm(dim=1), hooked.norm(dim=1)).clamp_min(torch.finfo(torch.float64).tiny)
    rel = err / scale
    cap = exact_check_tolerance(jac.dtype, forward_format)
    if low is None:
        tol, median_tol, rounding = cap, math.inf, None
    else:  # the products' own rounding, measured on this batch: their change when the tangents are rescaled
        rounding = float(((again / RESCALE - exact).norm(dim=1) / scale).median())
        tol = min(cap, max(FLOAT32_FLOOR, SAMPLE_FACTOR * rounding))
        median_tol = min(cap, max(FLOAT32_FLOOR, MEDIAN_FACTOR * rounding))
    median = float(rel.median())
    failing = torch.nonzero(rel > (tol if median <= median_tol else median_tol)).flatten().tolist()
    if failing:
        n = int(rel.argmax())
        if median > median_tol:
            what = (f"beyond the rounding measured on this batch (median relative error over the samples "
                    f"{median:.2e} > {MEDIAN_FACTOR:g} x the products' measured rounding {rounding:.1e}; worst: "
                    f"sample {n}, {float(rel[n]):.2e})")
        else:
            what = f"(worst: sample {n}, relative error {float(rel[n]):.2e} > {tol:.1e}" + (
                f", {SAMPLE_FACTOR:g} x the products' measured rounding {rounding:.1e})" if rounding is not None
                else ")")
        mismatch = PerSampleGradientMismatch(
            f"per-sample gradients of samples {failing[:10]}{' ...' if len(failing) > 10 else ''} disagree with their "
            f"exact directional derivatives {what}: " + _likely_cause(rounding is not None, forward_format, jac.dtype)
        )
        mismatch.worst, mismatch.tolerance = float(rel[n]), tol
        raise mismatch


def _contract(g: torch.Tensor, products: torch.Tensor) -> torch.Tensor:
    """``sum_c g[n, c] products[k, n, c]`` in float64, ``[M, K]`` (``g``: ``[M, 1, C]`` float64; ``products``:
    ``[K, M, ...]`` logit-shaped), one tangent at a time: a float64 copy of one ``[M, C]``, never of all ``K`` (a
    causal LM's ``K x [M, T, vocabulary]`` products are the largest tensors of the check)."""
    m = g.shape[0]
    return torch.stack([torch.bmm(g, p.reshape(m, -1, 1).to(torch.float64)).reshape(m) for p in products], dim=1)


def check_rounding(jac: torch.Tensor | FactoredJacobian, reference: torch.Tensor | FactoredJacobian,
                   params: Sequence[torch.Tensor], names: Sequence[str], forward_format: torch.dtype | None) -> None:
    """A 16-bit forward's rows against the same rows computed in float32 (whose exact check passed): with
    ``rel_n = ||J_n V - R_n V|| / max(||J_n V||, ||R_n V||)`` along the exact check's ``K`` tangents ``V``, the
    samples fail when their median ``rel`` exceeds ``16 u`` (:func:`exact_check_tolerance`: the format's bound on a
    row's rounding, derived in :mod:`ief.precision`; a difference that shifts every row), and one sample fails when
    its ``rel`` exceeds :data:`ROW_ROUNDING_FACTOR` ``x 16 u`` (a row far from its float32 value).

    The float32 rows ``R`` carry no 16-bit rounding, so ``rel`` is ``J``'s own rounding. Measured on the route
    matrix's 15 models, T5 and ViT with LoRA and a bfloat16 base with float32 LoRA, bfloat16 weights and bfloat16
    autocast: the median over the samples 8e-4 to 1.1e-2 (``16 u = 0.0625``: a margin of 5.7), single rows up to
    7.0e-2 (T5 + LoRA under autocast; ``64 u = 0.25``: a margin of 3.6). What exceeds them is a computation that
    differs in 16 bits beyond rounding (a sample-mixing layer is refused before, by the float32 check). Cost: ``K``
    rank-one products with each of ``J`` and ``R``, no forward.

    Args:
        jac: the 16-bit forward's rows (dense or factored).
        reference: the float32 forward's rows, same columns.
        params: the parameters of the columns.
        names: their names.
        forward_format: the lowest format the 16-bit forward ran in.

    Raises:
        PerSampleGradientMismatch: naming the samples, the worst one's difference and the bound.
    """
    tangents = _check_tangents(params, CHECK_TANGENTS)
    offsets = [0, *torch.tensor([p.numel() for p in params]).cumsum(0).tolist()]
    low, high = _hooked_products(jac, tangents, offsets), _hooked_products(reference, tangents, offsets)
    scale = torch.maximum(low.norm(dim=1), high.norm(dim=1)).clamp_min(torch.finfo(torch.float64).tiny)
    rel = (low - high).norm(dim=1) / scale
    tol = exact_check_tolerance(jac.dtype, forward_format)
    median = float(rel.median())
    failing = torch.nonzero(rel > (ROW_ROUNDING_FACTOR * tol if median <= tol else tol)).flatten().tolist()
    if failing:
        n, fmt = int(rel.argmax()), describe(_sixteen_bit(forward_format, jac.dtype))
        bound = (f"16 u = {tol:.1e}" if median > tol
                 else f"{ROW_ROUNDING_FACTOR:g} x 16 u = {ROW_ROUNDING_FACTOR * tol:.1e}")
        mismatch = PerSampleGradientMismatch(
            f"per-sample gradients of samples {failing[:10]}{' ...' if len(failing) > 10 else ''} computed in {fmt} "
            f"differ from the same rows computed in float32, which passed the exact check, beyond {fmt}'s rounding "
            f"(median over the samples {median:.1e}, worst: sample {n}, {float(rel[n]):.2e}, bound {bound}): the "
            f"model computes something else in {fmt} than in float32; run it in float32, or pass params= to leave "
            "out the parameters of the layer that differs")
        mismatch.worst, mismatch.tolerance = float(rel[n]), tol
        raise mismatch


def _likely_cause(measured: bool, forward_format: torch.dtype | None, jac_dtype: torch.dtype) -> str:
    """The exact check's diagnosis: a layer that mixes samples; for a 16-bit check (``measured``: its tolerance from
    the products' measured rounding) how to tell it from the forward's rounding for certain."""
    mixing = ("a layer mixes samples or a hooked layer's leading dimension is not the sample dimension; pass params= "
              "to leave its parameters out, or make it a module without a per-sample hook (its parameters then take "
              "the exact per-sample loop)")
    low = _sixteen_bit(forward_format, jac_dtype)
    if not measured or low is None:
        return mixing
    return (mixing + f". The forward ran in {describe(low)} (unit roundoff {unit_roundoff(low):.1e}): the check "
            "measured its rounding on this batch and the error is beyond it; to see the error without rounding, run "
            "the check once in float32 (float32 weights, outside autocast)")


def _refuse_now(losses: torch.Tensor, rows) -> None:
    """:func:`_refuse_nonfinite` of losses and rows, read now whatever the context (a deferred check's raise)."""
    token = _DEFERRED.set(None)
    try:
        _refuse_nonfinite(losses, rows)
    finally:
        _DEFERRED.reset(token)


_DEFERRED: contextvars.ContextVar[list | None] = contextvars.ContextVar("ief_deferred_finiteness", default=None)


@contextlib.contextmanager
def deferred_finiteness() -> Iterator[list[tuple[Callable[..., torch.Tensor], Callable[[], None]]]]:
    """Inside it, the check of the losses and rows that :func:`ief.per_sample` makes after its backward is neither
    computed nor read on the host: it is appended to the yielded list as ``(function returning the 0-d bool tensor
    "all finite", function that raises the check's FloatingPointError)``, for a caller that reads it with its own
    checks (the optimisers: one host read per step) and must call the second function when the flag is false, before
    it uses anything computed from the rows. The flag is asked for late, after the caller's products with the rows,
    given the :class:`ief.rows.Rows` it made them with (:func:`_deferred_flag`): a form that formed its Gram matrix by
    then reads finiteness off its diagonal (:meth:`ief.rows.Rows.finite_flag`), with no pass over ``J`` of its own
    (the caller's products must tolerate non-finite rows meanwhile, as the Woodbury solves do).

    Returns:
        A context manager yielding that list.
    """
    pending: list = []
    token = _DEFERRED.set(pending)
    try:
        yield pending
    finally:
        _DEFERRED.reset(token)


def _deferred_flag(losses: torch.Tensor, rows: Rows, used: Rows | None = None) -> torch.Tensor:
    """Whether the losses and the rows are finite (0-d bool tensor), asked of ``used`` when it holds the same ``J`` as
    ``rows`` (the same object, or a :class:`ief.rows.DenseRows` of the same tensor: the wrapper the caller made its
    Gram with, which may know the answer from it), else of ``rows``.

    Args:
        losses: ``[M]`` per-sample losses.
        rows: the rows :func:`ief.per_sample` checked.
        used: the rows the caller made its products with, or ``None``.

    Returns:
        A 0-d bool tensor, no host round-trip.
    """
    same = used is rows or (isinstance(used, DenseRows) and isinstance(rows, DenseRows) and used.matrix is rows.matrix)
    return torch.isfinite(losses.detach()).all() & (used if same else rows).finite_flag()


def _refuse_nonfinite(losses: torch.Tensor, jac: torch.Tensor | FactoredJacobian | None) -> None:
    """``FloatingPointError`` naming the samples whose loss (or, given ``jac``, row of ``J``) is not finite; given
    ``jac``, the losses are checked too (first), so a caller needs no separate check of the losses."""
    if jac is None:
        if all_finite(losses):
            return
        bad = torch.nonzero(~torch.isfinite(losses.detach())).flatten().tolist()
        what = "loss"
    else:  # the losses and the rows in one host read (a steady optimiser step makes no other here)
        rows = as_rows(jac)
        pending = _DEFERRED.get()
        if pending is not None:  # computed and read by the caller with its own checks (deferred_finiteness)
            pending.append((functools.partial(_deferred_flag, losses, rows), lambda: _refuse_now(losses, rows)))
            return
        finite = torch.isfinite(losses.detach()).all() & rows.finite_hint()
        if bool(finite):
            return
        if not all_finite(losses):
            _refuse_nonfinite(losses, None)
        bad = torch.nonzero(~rows.finite_rows()).flatten().tolist()
        if not bad:  # the one-sided hint said no for finite rows (a sum that overflowed)
            return
        what = "per-sample gradient"
    raise FloatingPointError(nonfinite_message(what, bad, losses.shape[0]))
