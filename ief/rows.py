"""``J [M, P]`` as the Gram solves see it: one interface, :class:`Rows`, for every form of the per-sample rows.

What the Woodbury solves of :mod:`ief.directions` (Eq. (8), Eq. (5), Eq. (49)) need of ``J`` is
five products, all in float64: the Gram matrix ``J J^T`` (:meth:`Rows.gram`), ``J^T c`` (:meth:`Rows.combine_rows`),
``J v`` (:meth:`Rows.times`), a bound of ``max|J|`` that keeps the float64 Gram clear of overflow
(:meth:`Rows.max_abs`, :meth:`Rows.gram_scale`) and finiteness (:meth:`Rows.is_finite`). Two forms provide them:

- :class:`DenseRows`: an ``[M, P]`` tensor, read column block by column block (no float64 copy of the whole ``J``);
- :class:`FactoredJacobian`: ``ief.per_sample(..., form="auto")``'s rows, each ``nn.Linear`` weight kept as its
  layer's inputs and output gradients (the "ghost" Gram of Appendix D.1), never an ``[M, P]`` tensor.

:func:`as_rows` wraps a tensor once, so the solves never ask which form they hold. Which form
:func:`ief.per_sample` builds is its ``form=`` (:data:`FORMS`, :func:`check_form`, :func:`prefer_ghost`).
"""
from __future__ import annotations

import abc
import itertools
import math
from collections.abc import Iterator, Sequence

import torch

from .model_call import column_chunk, column_chunks, large_empty

COLUMN_BYTES = 8 << 20  # a float64 block of the direction formed at once (8 MiB), where it cannot be narrow

FORMS = ("dense", "auto", "ghost", "rows", "streamed")


def check_form(form: object) -> str:
    """``form`` if it is one of :data:`FORMS` (how :func:`ief.per_sample` returns ``J``).

    Raises:
        ValueError: any other value, named with the accepted ones.
    """
    if not isinstance(form, str) or form not in FORMS:
        raise ValueError(f"form must be one of {', '.join(map(repr, FORMS))}, got {form!r}")
    return form


def prefer_ghost(form: str, m: int, t: int, fan_in: int, fan_out: int) -> bool:
    """Whether a Linear weight is kept as factors (ghost Gram) rather than as per-sample rows: "ghost" / "rows"
    force it; "auto" compares the Gram's flops and memory, ``M^2 T^2 (I + O)`` and ``M^2 T^2`` for the ghost kernels
    against ``M T I O + M^2 I O`` and ``M I O`` for the rows.

    Args:
        form: a checked form (:func:`check_form`): ``"auto"``, ``"ghost"`` or ``"rows"``.
        m: the samples ``M``.
        t: the positions ``T`` per sample (all calls of the layer).
        fan_in: the weight's input features ``I``.
        fan_out: its output features ``O``.

    Returns:
        ``True`` for the factors, ``False`` for the rows.
    """
    if form != "auto":
        return form == "ghost"
    ghost_flops, rows_flops = m * m * t * t * (fan_in + fan_out), m * fan_in * fan_out * (t + m)
    return ghost_flops <= rows_flops and m * m * t * t <= m * fan_in * fan_out


class Rows(abc.ABC):
    """``J [M, P]`` (row ``n`` = ``grad_theta l_n``) as the Gram solves use it; every result is float64.

    Attributes:
        shape: ``(M, P)``, a ``torch.Size``.
        dtype: the dtype ``J`` was computed in (the directions are returned in it).
        device: where ``J`` lives.
    """

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device

    @abc.abstractmethod
    def gram(self, scale: float = 1.0) -> torch.Tensor:
        """``(J/scale)(J/scale)^T``, ``[M, M]`` float64, symmetric (Appendix D.1's Gram matrix)."""

    @abc.abstractmethod
    def combine_rows(self, coeff: torch.Tensor, scale: float = 1.0, final: bool = False) -> torch.Tensor:
        """``(J/scale)^T coeff``, ``[P]``, accumulated in float64 (solve coefficients can cancel).

        Args:
            coeff: ``[M]``.
            scale: the common divisor of ``J`` (see :meth:`gram_scale`).
            final: the result is the direction itself: a form may then return it in ``dtype`` when that is
                narrower (formed without cancellation error), otherwise it is float64.
        """

    @abc.abstractmethod
    def times(self, v: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """``(J/scale) v``, ``[M]`` float64, for ``v`` ``[P]``."""

    @abc.abstractmethod
    def max_abs(self) -> float:
        """An upper bound of ``max|J|`` within a factor ``T`` (exact for :class:`DenseRows`); any positive scale is
        exact for the solves, it only keeps the float64 Gram clear of overflow and underflow."""

    @abc.abstractmethod
    def is_finite(self) -> bool:
        """Whether every entry of ``J`` is finite."""

    def finite_flag(self) -> torch.Tensor:
        """Whether every entry of ``J`` is finite, as a 0-d bool tensor on :attr:`device`: the forms here compute
        it with no host round-trip (a caller folds it into its own checks and reads it once), from the diagonal of a
        Gram matrix they already formed where they can (:func:`_gram_finite_flag`); this default reads
        :meth:`is_finite`."""
        return torch.tensor(self.is_finite(), device=self.device)

    def finite_hint(self) -> torch.Tensor:
        """A one-sided :meth:`finite_flag`, cheaper where a form has a cheaper test: ``True`` proves every entry of
        ``J`` finite; ``False`` for any non-finite ``J`` and possibly for a finite one, which the caller then decides
        with :meth:`finite_rows` (a 0-d bool tensor, no host round-trip). This default is :meth:`finite_flag`."""
        return self.finite_flag()

    def gram_scale(self) -> float:
        """1, or :meth:`max_abs` when ``J J^T`` would overflow or underflow float64 (entries beyond ~1e+-100): the
        ``scale`` the solves pass to :meth:`gram`, :meth:`combine_rows` and :meth:`times`.

        A ``J`` narrower than float64 (float32, float16, bfloat16: magnitudes between ~1.4e-45 and ~3.4e38) is always
        in range, so its scale is 1 without a pass over ``J`` (an all-zero ``J`` then gives the zero direction through
        the solve, as through the shortcut for ``max|J| = 0``)."""
        if self.dtype.itemsize < 8 and not self.dtype.is_complex:
            return 1.0
        c = self.max_abs()
        return 1.0 if 1e-100 <= c <= 1e100 else c

    @property
    def direction_size(self) -> int:
        """The entries of :meth:`combine_rows`' result with ``final=True``: ``P`` (an FSDP2 model's rows across
        processes return this rank's shards only, :class:`ief.distributed.DistributedRows`)."""
        return self.shape[1]

    # ---- what the per-sample machinery's batch gradient, guard and exact check need (ief.jacobian)
    def row_sum(self) -> torch.Tensor:
        """``J^T 1``, ``[P]`` in :attr:`dtype` (the batch gradient of the rows)."""
        raise NotImplementedError(f"{type(self).__name__} has no row_sum")

    def column_norm(self, lo: int, hi: int) -> torch.Tensor:
        """``||J[:, lo:hi]||_F`` in float64 (0-d); a factored form takes one parameter's block only."""
        raise NotImplementedError(f"{type(self).__name__} has no column_norm")

    def finite_rows(self) -> torch.Tensor:
        """``[M]`` booleans: whether row ``n`` of ``J`` is finite."""
        raise NotImplementedError(f"{type(self).__name__} has no finite_rows")

    def add_rank_one_products(self, out: torch.Tensor, lo: int, hi: int, u: torch.Tensor,
                              w: torch.Tensor | None) -> None:
        """``out += J[:, lo:hi] V^T`` in float64 (``out [M, K]``), for the ``K`` tangents ``V`` of one parameter's
        block given as factors: ``V_k = vec(u_k w_k^T)`` (``u [K, O]``, ``w [K, I]``, the block viewed ``[O, I]``),
        or ``V = u`` (``[K, hi - lo]``) when ``w`` is ``None``; a factored form takes one parameter's block only."""
        raise NotImplementedError(f"{type(self).__name__} has no add_rank_one_products")


def as_rows(jacobian: torch.Tensor | Rows, name: str = "jacobian") -> Rows:
    """``jacobian`` itself if it is :class:`Rows`, a tensor wrapped as :class:`DenseRows`.

    Raises:
        ValueError: neither, or a tensor that is not a floating ``[M, P]`` (as :class:`DenseRows`), named ``name``.
    """
    return jacobian if isinstance(jacobian, Rows) else DenseRows(jacobian, name)


def _column_chunks(matrix: torch.Tensor, scale: float = 1.0) -> Iterator[tuple[int, torch.Tensor]]:
    """Column blocks of ``matrix / scale`` in float64, each valid until the next is drawn.

    A narrower ``matrix`` is converted block by block into one float64 buffer: a fresh float64 block of this size
    (:data:`COLUMN_BYTES`) is memory new from the operating system each time, paid in page faults on every block (a
    large share of an IEF step on full-parameter BERT: ``benchmarks/README.md``). The values are those of
    ``block.to(float64)``.
    """
    if matrix.dtype == torch.float64:
        for lo, block in column_chunks(matrix):
            # a private copy for the division (``to`` returns the caller's tensor itself when it is float64)
            yield lo, block if scale == 1.0 else block.to(torch.float64, copy=True).div_(scale)
        return
    buffer = None
    for lo, block in column_chunks(matrix):
        if buffer is None:
            buffer = large_empty(block.shape, torch.float64, matrix.device)
        out = buffer.view(-1)[: block.numel()].view(block.shape)  # contiguous, as block.to(float64) would be
        out.copy_(block)
        yield lo, out if scale == 1.0 else out.div_(scale)


def _tangent_columns(u: torch.Tensor, w: torch.Tensor | None, lo: int, hi: int) -> torch.Tensor:
    """Columns ``lo:hi`` of the flattened tangents ``vec(u_k w_k^T)`` (or of ``u``), ``[K, hi - lo]`` (float64)."""
    if w is None:
        return u[:, lo:hi]
    idx = torch.arange(lo, hi)
    return u[:, idx // w.shape[1]] * w[:, idx % w.shape[1]]


def _finite_flag(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Whether every entry of every tensor is finite, a 0-d bool tensor on ``device``: one ``aminmax`` per tensor
    (NaN propagates into it, an infinity is an extreme), per column block of one that is not contiguous (a strided
    reduction over all of it is ~5x slower), no tensor-sized temporary and no host round-trip."""
    extremes = [x for t in tensors if t.numel() for block in _reduction_blocks(t) for x in torch.aminmax(block)]
    if not extremes:
        return torch.ones((), dtype=torch.bool, device=device)
    return torch.isfinite(torch.stack(extremes)).all()


def _reduction_blocks(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """``t`` itself when contiguous, else its column blocks (:func:`column_chunks` of ``t`` viewed ``[M, -1]``)."""
    if t.is_contiguous():
        yield t
    else:
        yield from (block for _, block in column_chunks(t.reshape(t.shape[0], -1) if t.dim() != 2 else t))


def _gram_finite_flag(gram: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor | None:
    """Whether ``J`` is finite, read off the diagonal of its float64 Gram matrix ``(J/scale)(J/scale)^T``: a 0-d bool
    tensor, or ``None`` where the diagonal cannot decide it.

    ``G_nn`` is the float64 sum of the squares of row ``n``'s entries (each product a square of one entry, for the
    factored weights ``sum_{t,s} <a_t, a_s> <g_t, g_s>`` with the ``t = s`` terms squares too). An infinite entry makes
    its square infinite and a NaN makes it NaN, and the sum of a non-finite term with anything is non-finite (a square
    is never ``-inf``; ``inf - inf`` is NaN): a non-finite ``J`` gives a non-finite diagonal. The converse needs that
    no sum of finite terms overflows, which holds for a ``J`` narrower than float64 at ``scale = 1`` (magnitudes below
    ~3.4e38: a square below 1.2e77, a factored term below ~1e172, :meth:`FactoredJacobian.scaled_factors`) and only
    there: a float64 ``J`` of entries near 1e200 has finite rows and an infinite Gram. So the flag is that of the
    separate pass over ``J`` (:func:`_finite_flag`) without the pass, where it is given."""
    if scale != 1.0 or dtype.itemsize >= 8 or dtype.is_complex:
        return None
    return torch.isfinite(gram.diagonal()).all()


def _matrix_max_abs(matrix: torch.Tensor) -> float:
    """Largest magnitude in ``matrix`` (NaN if it holds one)."""
    if not matrix.numel():
        return 0.0
    extremes = [torch.stack(torch.aminmax(block)).abs().max() for _, block in column_chunks(matrix)]
    return float(torch.stack(extremes).max())


def _matrix_gram(matrix: torch.Tensor, scale: float) -> torch.Tensor:
    """``(X/scale)(X/scale)^T`` accumulated in float64, without a float64 copy of the whole ``X``."""
    m = matrix.shape[0]
    g = torch.zeros(m, m, dtype=torch.float64, device=matrix.device)
    for _, block in _column_chunks(matrix, scale):
        g += block @ block.T
    return 0.5 * (g + g.T)


def _matrix_combine(matrix: torch.Tensor, coeff: torch.Tensor, scale: float,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """``(X/scale)^T coeff`` accumulated in float64, written block by block into ``out`` (``[P]``, any floating dtype:
    each block's float64 sum is rounded to it once, the values of the whole float64 result ``.to(out.dtype)``, with no
    ``[P]`` float64 temporary); default a new ``[P]`` float64.

    Returns:
        ``out``.
    """
    coeff = coeff.to(torch.float64).unsqueeze(0)  # [1, M]: each block's product as ``coeff @ block`` forms it
    if out is None:
        out = torch.empty(matrix.shape[1], dtype=torch.float64, device=matrix.device)
    wide = None if out.dtype == torch.float64 else torch.empty(0, dtype=torch.float64, device=matrix.device)
    for lo, block in _column_chunks(matrix, scale):
        dest = out[lo : lo + block.shape[1]]
        if wide is None:
            torch.mm(coeff, block, out=dest.unsqueeze(0))
        else:
            if wide.numel() < block.shape[1]:
                wide = torch.empty(block.shape[1], dtype=torch.float64, device=matrix.device)
            part = wide[: block.shape[1]]
            torch.mm(coeff, block, out=part.unsqueeze(0))
            dest.copy_(part)
    return out


def _whitened_factors(weighted: torch.Tensor, a: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``F [O, K]`` and ``W [K, I]`` in ``dtype`` with ``F W = weighted^T a`` (``weighted [K, O]``, ``a [K, I]``
    float64, ``K = M T <= I``), such that the narrow product ``F W`` errs by ~``eps`` of ``dtype`` times each row's
    own norm, whatever cancels in the coefficients folded into ``weighted``.

    Why: the direction's block ``(cG)^T A = sum_n c_n G_n^T A_n`` of a Linear weight; near-duplicate samples make
    the solve's ``c`` large with cancelling entries, and a float32 product of ``(cG)^T`` and ``A`` then errs by
    ``eps sum_n |c_n| |G_n| |A_n|``, far beyond the result (2e-5 relative against 1e-7 on 8 duplicated pairs,
    ``tests/ief/test_directions.py``). Whitening ``A`` moves the cancellation into a small float64 factor: with
    ``A A^T + delta I = L L^T`` (Cholesky, ``[K, K]`` float64, ``delta = K eps64 tr(A A^T)``: ``A A^T`` is singular for
    ``K > rank A``), ``W = L^{-1} A`` has rows of norm ``<= 1`` that are orthonormal wherever ``A A^T`` is above
    ``delta``, and ``(cG)^T A = ((cG)^T L) W`` exactly; the float64 factor ``F = (cG)^T L`` carries every
    cancellation, and a product with (nearly) orthonormal rows errs by ~``eps ||F_o||``, which is ~``eps`` times the
    result row's norm. Everything over ``I`` is a triangular solve of ``[K, I]`` (the size of the layer's inputs, not
    ``[O, I]``), no QR or eigendecomposition over ``I``, and no host round-trip (``cholesky_ex``: its status is not
    read; ``A A^T + delta I`` is positive definite, and a failure would give NaN, which the caller's finiteness check
    refuses)."""
    k = a.shape[0]
    gram = a @ a.T  # [K, K] float64
    # delta from the trace (>= the largest diagonal entry, <= K times it), the smallest normal for an all-zero A
    gram.diagonal().add_(torch.trace(gram).mul_(k * torch.finfo(torch.float64).eps)
                         .clamp_min_(torch.finfo(torch.float64).tiny))
    chol, _ = torch.linalg.cholesky_ex(gram)
    white = torch.linalg.solve_triangular(chol, a, upper=False)  # L^{-1} A, [K, I]
    return (weighted.T @ chol).to(dtype), white.to(dtype)


def ghost_kernel(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """A factored weight's block of the Gram matrix, ``sum_{t,s} <a_{n,t}, a_{m,s}> <g_{n,t}, g_{m,s}>``, ``[M, M]``
    (Appendix D.1; ``(A A^T) * (G G^T)`` for ``T = 1``): the rows ``J_n = G_n^T A_n`` are never formed.

    Args:
        a: the layer's inputs ``[M, T, I]``, float64 (positions that are zero in ``a`` and ``g`` add nothing).
        g: its output gradients ``[M, T, O]``, float64.

    Returns:
        ``[M, M]`` float64.
    """
    if a.shape[1] == 1:
        return (a[:, 0] @ a[:, 0].T) * (g[:, 0] @ g[:, 0].T)
    ka = torch.einsum("nti,msi->nmts", a, a)
    kg = torch.einsum("nto,mso->nmts", g, g)
    return ka.mul_(kg).sum(dim=(2, 3))  # in place: two [M, M, T, T] float64 at once, not three


class DenseRows(Rows):
    """An ``[M, P]`` tensor behind the :class:`Rows` interface (the dense adaptor).

    Every product reads ``J`` column block by column block in float64 (:func:`ief.model_call.column_chunks`), so no
    float64 copy of ``J`` is made; ``max|J|`` (one pass, which also decides finiteness) is computed once.

    Args:
        matrix: ``[M, P]`` floating-point tensor (not copied).
        name: what to call it in errors.

    Raises:
        ValueError: ``matrix`` not a floating-point ``[M, P]`` tensor, naming ``name`` and what it got.
    """

    def __init__(self, matrix: torch.Tensor, name: str = "jacobian"):
        if not isinstance(matrix, torch.Tensor) or matrix.dim() != 2:
            shape = tuple(matrix.shape) if isinstance(matrix, torch.Tensor) else type(matrix).__name__
            raise ValueError(f"{name} must be a [M, P] tensor, got {shape}")
        if not matrix.dtype.is_floating_point:
            raise ValueError(f"{name} must be floating point, got {matrix.dtype}")
        self.matrix = matrix
        self.shape, self.dtype, self.device = matrix.shape, matrix.dtype, matrix.device
        self._max_abs: float | None = None
        self._gram_finite: torch.Tensor | None = None  # from the diagonal of the last Gram (_gram_finite_flag)

    def gram(self, scale: float = 1.0) -> torch.Tensor:
        g = _matrix_gram(self.matrix, scale)
        self._gram_finite = _gram_finite_flag(g, self.dtype, scale)
        return g

    def combine_rows(self, coeff: torch.Tensor, scale: float = 1.0, final: bool = False) -> torch.Tensor:
        # final and a narrower dtype: the direction in that dtype (see Rows.combine_rows), no [P] float64 temporary
        narrow = final and self.dtype.itemsize < 8
        out = torch.empty(self.shape[1], dtype=self.dtype if narrow else torch.float64, device=self.device)
        return _matrix_combine(self.matrix, coeff, scale, out=out)

    def times(self, v: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        v = v.to(torch.float64)
        out = torch.zeros(self.shape[0], dtype=torch.float64, device=self.device)
        for lo, block in _column_chunks(self.matrix, scale):
            out += block @ v[lo : lo + block.shape[1]]
        return out

    def max_abs(self) -> float:
        if self._max_abs is None:
            self._max_abs = _matrix_max_abs(self.matrix)
        return self._max_abs

    def finite_flag(self) -> torch.Tensor:
        if self._max_abs is not None:  # the pass of max_abs decided it already
            return torch.tensor(math.isfinite(self._max_abs), device=self.device)
        if self._gram_finite is not None:  # so did the Gram's diagonal
            return self._gram_finite
        return _finite_flag([self.matrix], self.device)

    def finite_hint(self) -> torch.Tensor:
        """One sum of ``J`` (NaN and infinities propagate into it; it overflows only where entries come near the
        dtype's largest): a third faster than :meth:`finite_flag`'s extremes on a CPU."""
        if self._max_abs is not None or self._gram_finite is not None:
            return self.finite_flag()
        return torch.isfinite(self.matrix.sum())

    def is_finite(self) -> bool:
        return math.isfinite(self.max_abs())

    def materialize(self) -> torch.Tensor:
        """The ``[M, P]`` tensor itself."""
        return self.matrix

    def row_sum(self) -> torch.Tensor:
        total = torch.empty(self.shape[1], dtype=self.dtype, device=self.device)
        for lo, block in column_chunks(self.matrix):  # a dim-0 reduction over all of J at once is strided
            torch.sum(block, dim=0, out=total[lo : lo + block.shape[1]])
        return total

    def column_norm(self, lo: int, hi: int) -> torch.Tensor:
        return torch.linalg.vector_norm(self.matrix[:, lo:hi], dtype=torch.float64)

    def finite_rows(self) -> torch.Tensor:
        return torch.isfinite(self.matrix).all(dim=1)

    def add_rank_one_products(self, out: torch.Tensor, lo: int, hi: int, u: torch.Tensor,
                              w: torch.Tensor | None) -> None:
        _add_block_products(out, self.matrix[:, lo:hi], u, w)


def _add_block_products(out: torch.Tensor, block: torch.Tensor, u: torch.Tensor, w: torch.Tensor | None) -> None:
    """``out += block V^T`` (float64), column chunk by column chunk: no float64 copy of ``J``, no ``[K, P]``."""
    for lo, chunk in column_chunks(block):
        cols = _tangent_columns(u, w, lo, lo + chunk.shape[1]).to(block.device)
        out += chunk.to(torch.float64) @ cols.T


class FactoredJacobian(Rows):
    """``J [M, P]`` without an ``[M, P]`` tensor: the weight of every ``nn.Linear`` chosen for the "ghost" form is kept
    as its layer's inputs ``A [M, T, I]`` and output gradients ``G [M, T, O]`` (all calls of the layer concatenated
    along the positions ``T``), so that its rows are ``J_n = G_n^T A_n`` (``[O, I]``, the weight's layout); every
    other parameter (biases, LayerNorm, Embedding, Linear weights in the "rows" form, loop parameters) has its
    column block materialised in ``dense [M, P_dense]``. An embedding table ``[V, D]`` keeps only the rows the batch
    uses (``used_rows``): every other row of it is zero in every sample's gradient, so its block in ``dense`` is
    ``[M, U D]`` for the ``U`` distinct ids (with a 30,522-word vocabulary and 2,048 tokens per batch, about 15
    times narrower), and the products read and write the full ``[V, D]`` layout through them.

    The Gram matrix (Appendix D.1's ``J J^T``, layer by layer, as in Opacus' ghost clipping):
    ``(J J^T)_{nm} = sum_{t,s} <a_{n,t}, a_{m,s}> <g_{n,t}, g_{m,s}>`` (``[M, M, T, T]`` kernels; ``T = 1`` for an
    MLP: ``(A A^T) * (G G^T)``), and ``J^T c = (c-weighted G)^T A`` per layer; both in float64.

    Built by :func:`ief.per_sample` (``form="auto"``, ``"ghost"``, ``"rows"``); ``materialize()`` gives the tensor.

    Args:
        m: the samples ``M``.
        sizes: every parameter's number of entries, in ``J``'s column order.
        ref: a tensor of ``J``'s dtype and device.
        ghosts: ``[(parameter index, A [M, T, I], G [M, T, O])]`` of the factored weights.
        dense: ``[M, P_dense]``, the other parameters' column blocks side by side.
        dense_index: parameter index -> its first column in ``dense``.
        used_rows: parameter index -> ``(ids, D)`` for a table whose block in ``dense`` holds only the rows ``ids``
            (sorted, distinct, ``[U]`` long) of its ``[V, D]`` layout, ``[M, U D]``; default none.
    """

    def __init__(self, m: int, sizes: Sequence[int], ref: torch.Tensor, ghosts: list, dense: torch.Tensor,
                 dense_index: dict[int, int], used_rows: dict[int, tuple[torch.Tensor, int]] | None = None):
        self.sizes = list(sizes)
        self.offsets = [0, *itertools.accumulate(self.sizes)]  # on the host: no round-trip
        self.shape = torch.Size((m, self.offsets[-1]))
        self.dtype, self.device = ref.dtype, ref.device
        self.ghosts = ghosts  # [(parameter index, A [M, T, I], G [M, T, O])]
        self.dense = dense  # [M, P_dense]
        self.dense_index = dense_index  # parameter index -> first column in dense
        self.used_rows = dict(used_rows or {})  # parameter index -> (ids [U], D): a table's used rows only
        self._finite: bool | None = None
        self._gram_finite: torch.Tensor | None = None  # from the diagonal of the last Gram (_gram_finite_flag)
        self._scaled: dict[float, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # scale -> float64 factors

    # ---- helpers
    def _dense_columns(self):
        """``(parameter index, lo in J, lo in dense, its width in dense)`` of the materialised blocks."""
        for i, lo in self.dense_index.items():
            yield i, self.offsets[i], lo, self.dense_width(i)

    def _dense_runs(self) -> Iterator[tuple[int, int, int]]:
        """``(lo in J, lo in dense, width)`` of the materialised blocks other than the tables' used rows, adjacent
        blocks (next to each other both in ``J`` and in ``dense``) merged into one run: one product per run."""
        run = None
        for i, lo, dlo, width in self._dense_columns():
            if i in self.used_rows:
                continue
            if run is not None and run[0] + run[2] == lo and run[1] + run[2] == dlo:
                run = (run[0], run[1], run[2] + width)
                continue
            if run is not None:
                yield run
            run = (lo, dlo, width)
        if run is not None:
            yield run

    def dense_width(self, i: int) -> int:
        """The columns of parameter ``i``'s block in ``dense``: its size, or ``U D`` for a table's used rows."""
        if i in self.used_rows:
            ids, dim = self.used_rows[i]
            return ids.numel() * dim
        return self.sizes[i]

    def dense_block(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s ``[M, width]`` block of ``dense`` (:meth:`dense_width`)."""
        lo = self.dense_index[i]
        return self.dense[:, lo : lo + self.dense_width(i)]

    def _expand(self, i: int, dest: torch.Tensor, part: torch.Tensor) -> None:
        """Write ``part`` (parameter ``i``'s columns as stored in ``dense``, leading dimensions kept) into ``dest``
        (its columns in ``J``): the same, or, for a table's used rows, those rows and zeros elsewhere."""
        if i not in self.used_rows:
            dest.copy_(part)
            return
        ids, dim = self.used_rows[i]
        table = dest.unflatten(-1, (-1, dim))  # [..., V, D]
        table.zero_()
        table.index_copy_(-2, ids, part.unflatten(-1, (-1, dim)).to(table.dtype))

    def _restrict(self, i: int, full: torch.Tensor) -> torch.Tensor:
        """Parameter ``i``'s entries of a ``[P_i]`` vector as its block in ``dense`` stores them."""
        if i not in self.used_rows:
            return full
        ids, dim = self.used_rows[i]
        return full.view(-1, dim).index_select(0, ids).reshape(-1)

    @staticmethod
    def scaled_factors(a: torch.Tensor, g: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``A`` and ``G`` in float64 with ``(G/scale)^T A`` unchanged: ``A / ca`` and ``(G / cg) (ca cg / scale)``
        (``ca, cg = max|A|, max|G|``). The factor ``ca cg / scale`` is formed from mantissas and exponents
        (``math.frexp``), so no intermediate overflows or underflows: with a subnormal ``max|J|`` (~1e-310, then
        ``scale = max|J|``) ``ca / scale`` alone would be inf, and the Gram NaN.

        Factors narrower than float64 at ``scale = 1`` (what :meth:`Rows.gram_scale` gives them) are converted as
        they are, with no pass over them and no host round-trip: their magnitudes lie in ``[1.4e-45, 3.4e38]``, so
        every product of four of them, summed over ``T^2 <= 1e12`` position pairs, stays in float64's range
        (``1e-180`` to ``1e166``)."""
        if scale == 1.0 and a.dtype.itemsize < 8 and g.dtype.itemsize < 8:
            return a.to(torch.float64), g.to(torch.float64)
        ca, cg = (float(t.abs().max()) if t.numel() else 1.0 for t in (a, g))
        ca, cg = (c if 0.0 < c < math.inf else 1.0 for c in (ca, cg))
        (ma, ea), (mg, eg), (ms, es) = math.frexp(ca), math.frexp(cg), math.frexp(scale)
        factor = math.ldexp(ma * mg / ms, ea + eg - es)
        return a.to(torch.float64) / ca, g.to(torch.float64) / cg * factor

    def _scaled_ghosts(self, scale: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every ghost's :meth:`scaled_factors` at ``scale``, converted once and kept for the next product (the
        Gram and the combination of one solve use the same scale): ``O(M T (I + O))`` float64, no ``[M, P]``."""
        if scale not in self._scaled:
            self._scaled = {scale: [self.scaled_factors(a, g, scale) for _, a, g in self._kernel_ghosts()]}
        return self._scaled[scale]

    def _kernel_ghosts(self) -> list:
        """The ghosts whose Gram is the ghost kernel and whose ``J^T c`` is a product of factors (all of them here;
        :class:`ief.streamed.StreamedRows` forms some as blocks of rows)."""
        return self.ghosts

    # ---- Rows
    def gram(self, scale: float = 1.0) -> torch.Tensor:
        out = _matrix_gram(self.dense, scale)
        for a, g in self._scaled_ghosts(scale):
            out += ghost_kernel(a, g)
        out = 0.5 * (out + out.T)
        self._gram_finite = _gram_finite_flag(out, self.dtype, scale)
        return out

    def combine_rows(self, coeff: torch.Tensor, scale: float = 1.0, final: bool = False) -> torch.Tensor:
        coeff = coeff.to(torch.float64)
        # final and a narrower model dtype: the direction in that dtype (see Rows.combine_rows), written in place
        narrow = final and self.dtype.itemsize < 8
        out = torch.empty(self.shape[1], dtype=self.dtype if narrow else torch.float64, device=self.device)
        # every column is written: here, for the tables or below. Runs of dense blocks a column block wide or more
        # (a transformer's weights in the rows form) are combined straight into their columns of out. Where every
        # run is narrower (an MLP's biases split by factored weights), one pass over dense gives a [P_dense] float64
        # part that serves the runs and the tables (a pass per narrow run would add operators, and dense is small);
        # beside wide runs, the narrow ones (biases and norms between streamed weights) are gathered into one
        # narrow matrix for that pass instead, so no float64 copy of the wide runs' columns is ever made
        runs, part = list(self._dense_runs()), None
        chunk = column_chunk(self.dense)
        wide_runs = [run for run in runs if len(runs) == 1 or run[2] >= chunk]
        narrow_runs = [run for run in runs if run not in wide_runs]
        for lo, dlo, width in wide_runs:
            _matrix_combine(self.dense[:, dlo : dlo + width], coeff, scale, out=out[lo : lo + width])
        if narrow_runs and not wide_runs:
            part = _matrix_combine(self.dense, coeff, scale)
            for lo, dlo, width in narrow_runs:
                out[lo : lo + width].copy_(part[dlo : dlo + width])
        elif narrow_runs:
            blocks = [self.dense[:, dlo : dlo + width] for _, dlo, width in narrow_runs]
            gathered = _matrix_combine(blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1), coeff, scale)
            for (lo, _, width), at in zip(narrow_runs, itertools.accumulate((w for _, _, w in narrow_runs), initial=0)):
                out[lo : lo + width].copy_(gathered[at : at + width])
        for i in self.used_rows:
            dlo, width = self.dense_index[i], self.dense_width(i)
            table = part[dlo : dlo + width] if part is not None else \
                _matrix_combine(self.dense[:, dlo : dlo + width], coeff, scale)
            self._expand(i, out[self.offsets[i] : self.offsets[i + 1]], table)
        for (i, _, _), (a, g) in zip(self._kernel_ghosts(), self._scaled_ghosts(scale)):
            weighted = (g * coeff[:, None, None]).flatten(0, 1)  # [M T, O]
            a = a.flatten(0, 1)  # [M T, I]
            dest = out[self.offsets[i] : self.offsets[i + 1]].view(weighted.shape[1], a.shape[1])  # [O, I]
            if narrow and a.shape[0] <= a.shape[1]:
                torch.mm(*_whitened_factors(weighted, a, self.dtype), out=dest)
            elif narrow:  # K = M T > I: float64 products, a bounded block of output rows at a time (no [O, I] float64)
                rows = max(1, COLUMN_BYTES // (8 * a.shape[1]))
                for lo in range(0, dest.shape[0], rows):
                    dest[lo : lo + rows].copy_(weighted[:, lo : lo + rows].T @ a)
            else:
                torch.mm(weighted.T, a, out=dest)
        return out

    def times(self, v: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        v = v.to(torch.float64)
        out = torch.zeros(self.shape[0], dtype=torch.float64, device=self.device)
        for i, lo, dlo, width in self._dense_columns():
            block = self.dense[:, dlo : dlo + width].to(torch.float64)
            out += block @ self._restrict(i, v[lo : lo + self.sizes[i]]) / scale
        for (i, _, _), (a, g) in zip(self._kernel_ghosts(), self._scaled_ghosts(scale)):
            weight = v[self.offsets[i] : self.offsets[i + 1]].reshape(g.shape[-1], a.shape[-1])  # [O, I]
            out += ((a @ weight.T) * g).sum(dim=(1, 2))
        return out

    def max_abs(self) -> float:
        bound = _matrix_max_abs(self.dense)
        for _, a, g in self.ghosts:
            if a.numel():
                bound = max(bound, float(a.abs().max()) * float(g.abs().max()) * a.shape[1])
        return bound

    def finite_flag(self) -> torch.Tensor:
        if self._gram_finite is not None:  # the Gram's diagonal decided it
            return self._gram_finite
        return _finite_flag([self.dense, *(t for _, a, g in self.ghosts for t in (a, g))], self.device)

    def is_finite(self) -> bool:
        if self._finite is None:
            self._finite = bool(self.finite_flag())
        return self._finite

    # ---- what the batch gradient and the guard need
    def row_sum(self) -> torch.Tensor:
        """``J^T 1`` in the parameters' dtype, ``[P]`` (the hooked parameters' batch gradients,
        :attr:`ief.jacobian.PerSample.gradient`)."""
        out = torch.empty(self.shape[1], dtype=self.dtype, device=self.device)  # every column is written below
        total = self.dense.sum(0)
        for i, lo, dlo, width in self._dense_columns():
            self._expand(i, out[lo : lo + self.sizes[i]], total[dlo : dlo + width])
        for i, a, g in self.ghosts:  # written in place: no P-sized temporary
            dest = out[self.offsets[i] : self.offsets[i + 1]].view(g.shape[-1], a.shape[-1])
            torch.mm(g.flatten(0, 1).T, a.flatten(0, 1), out=dest)
        return out

    def _parameter(self, lo: int, hi: int) -> int:
        """The parameter whose block is the columns ``lo:hi``."""
        for i, size in enumerate(self.sizes):
            if self.offsets[i] == lo and self.offsets[i] + size == hi:
                return i
        raise ValueError(f"columns {lo}:{hi} are not one parameter's block of a FactoredJacobian")

    def column_norm(self, lo: int, hi: int) -> torch.Tensor:
        i = self._parameter(lo, hi)
        if i not in self.dense_index:
            return self.row_sqnorms()[:, i].sum().sqrt()
        block = self.dense_block(i)  # a table's used rows only: the others are zero
        return torch.linalg.vector_norm(block, dtype=torch.float64)

    def finite_rows(self) -> torch.Tensor:
        ok = torch.isfinite(self.dense).all(dim=1)
        for _, a, g in self.ghosts:
            ok &= torch.isfinite(a).flatten(1).all(dim=1) & torch.isfinite(g).flatten(1).all(dim=1)
        return ok

    def add_rank_one_products(self, out: torch.Tensor, lo: int, hi: int, u: torch.Tensor,
                              w: torch.Tensor | None) -> None:
        i = self._parameter(lo, hi)
        for j, a, g in self.ghosts:
            if j == i:  # J_n . u w^T straight from the factors
                a, g = self.scaled_factors(a, g, 1.0)  # [M, T, I], [M, T, O]
                out += ((a @ w.T.to(a.device)) * (g @ u.T.to(g.device))).sum(dim=1)
                return
        if i in self.used_rows:  # a table's used rows: the tangent's entries of those rows
            ids, _ = self.used_rows[i]
            cols = (u[:, ids.cpu(), None] * w[:, None, :]).flatten(1).to(self.device)  # [K, U D]
            out += self.dense_block(i).to(torch.float64) @ cols.T
            return
        _add_block_products(out, self.dense_block(i), u, w)

    def row_sqnorms(self) -> torch.Tensor:
        """``||J_n restricted to parameter i||^2``, ``[M, number of parameters]``, float64."""
        out = torch.zeros(self.shape[0], len(self.sizes), dtype=torch.float64, device=self.device)
        for i, lo, dlo, width in self._dense_columns():
            out[:, i] = self.dense[:, dlo : dlo + width].to(torch.float64).square().sum(1)
        for i, a, g in self.ghosts:
            a, g = self.scaled_factors(a, g, 1.0)
            out[:, i] = (torch.einsum("nti,nsi->nts", a, a) * torch.einsum("nto,nso->nts", g, g)).sum(dim=(1, 2))
        return out

    def materialize(self) -> torch.Tensor:
        """The ``[M, P]`` tensor (for tests and small models)."""
        jac = torch.empty(self.shape, dtype=self.dtype, device=self.device)  # every column is written below
        for i in range(len(self.sizes)):
            self.write_block(i, jac[:, self.offsets[i] : self.offsets[i + 1]])
        return jac

    def write_block(self, i: int, out: torch.Tensor) -> None:
        """Write parameter ``i``'s columns of ``J`` into ``out`` (``[M, sizes[i]]``, e.g. a column slice of a larger
        matrix): its materialised block (a table's used rows in place, zeros elsewhere), or ``G_n^T A_n`` of a
        factored weight.

        Raises:
            ValueError: ``i`` is not a parameter index of these rows.
        """
        if i in self.dense_index:
            self._expand(i, out, self.dense_block(i))
            return
        for j, a, g in self.ghosts:
            if j == i:
                out.copy_(torch.bmm(g.transpose(1, 2), a).flatten(1))
                return
        raise ValueError(f"parameter index {i} is not one of these rows' {len(self.sizes)} parameters")
