"""The streamed route: a factored weight's per-sample block added to the Gram a bounded piece at a time and dropped.

For the exact iEF, EF and SF steps everything after the Gram needs only ``J^T c`` (:mod:`ief.directions`), and a
weight whose layer has factors (``nn.Linear``, HF ``Conv1D``, a one-group convolution: inputs ``A [M, T, I]``, output
gradients ``G [M, T, O]``, which the backward hands the per-sample hooks anyway) gives both products from them. So
its ``[M, I O]`` rows never need to be kept: :class:`StreamedRows` keeps the factors and forms the rows
``J_n = G_n^T A_n`` a block of output features at a time (at most :data:`STREAM_BYTES` of float64), adds the block's
``M x M`` product to the Gram and drops it; the direction's block ``J^T c = sum_n c_n G_n^T A_n`` is formed the
same way, block by block. The ghost kernel ``(A_i A_j^T) * (G_i G_j^T)`` (:func:`ief.rows.ghost_kernel`) is the
other form from the same factors, cheaper where ``T^2 (I + O) < I O`` (:func:`ief.rows.prefer_ghost`). No ``[M, P]``
buffer is formed: what a step holds beyond the backward is the factors (the backward's own activations and output
gradients), the ``[M, P_small]`` columns of the parameters without factors (biases, norms, an embedding table's used
rows, a tied weight: the existing route, named in ``last_step_report``), and one block.

Precision (re-derived for a block, :mod:`ief.precision`). A block ``G_n^T A_n`` is formed in the model's dtype by
one batched product, as the rows route's hook forms it: the same ``J`` (the same products of the same factors,
rounded once to the model's dtype), so the rounding floor of the solve (:func:`ief.directions.rounding_floor`) holds
unchanged. Every product of two blocks, ``sum_k J_nk J_mk``, is taken in float64 (the block converted, exactly:
a float32 or bfloat16 number is a float64 number), as the dense route's column blocks are; only ``M x M`` objects
and one block are float64. Hence a near-duplicate pair's rows, which round to the same bits when their factors do,
keep their exactly cancelling difference in the Gram and in ``sum_n c_n J_n`` (the direction's block, accumulated
in float64 and rounded once), which a float32 product ``(c G)^T A`` would not (its error ``eps sum_n |c_n| |J_n|``,
far beyond the result when ``c`` cancels: ``tests/ief/test_directions.py``). A float32 Gram of a block would err by
``eps32 tr G``, far above the floor ``(10 eps32)^2 tr G``: it is not used.

**Cost model** of one weight ``[O, I]`` over ``M`` samples of ``T`` positions (``b`` bytes per entry of the model's
dtype; flops count a multiply-add as 2; launches are dispatched operators), the Gram and one combination:

======== ========================================== ============================== ==================================
form     flops                                      memory held / transient        launches
======== ========================================== ============================== ==================================
ghost    ``2 M^2 T^2 (I + O) + 2 M T I O``          ``8 M T (I + O)`` (float64     ~8
                                                    factors) / ``16 M^2 T^2``
rows     ``2 M T I O + 2 M^2 I O + 2 M I O``        ``b M I O`` (the ``[M, P]``     ``1 + 4 ceil(8 M I O / S)``
                                                    buffer's share) / ``S``
streamed ``4 M T I O + 2 M^2 I O + 2 M I O``        factors / ``S (1 + b / 8)``     ``8 ceil(8 M I O / S)``
======== ========================================== ============================== ==================================

(``S`` = :data:`STREAM_BYTES`; the factors ``b M T (I + O)`` are what the backward hands the hooks, held in every
form; the ghost kernel holds their float64 copies beside them when ``b < 8``.) The streamed form pays one batched
product more than the rows (the block is formed for the Gram and again for the combination) and holds no ``M I O``:
``form="auto"`` (:func:`layer_form`) takes the ghost kernel where its flops are the fewest
(:func:`ief.rows.prefer_ghost`), the rows where the block is small (``b M I O <=`` :data:`ROWS_BYTES`: the extra
product is then not worth the memory it saves), the streamed form otherwise.

Across processes (:mod:`ief.distributed`) a streamed weight's factors are all-gathered as a ghost's are, and every
rank forms the union batch's Gram block from them (:func:`factor_gram`); the combination stays each rank's own.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .rows import FactoredJacobian, _gram_finite_flag, ghost_kernel, prefer_ghost

STREAM_BYTES = 4 << 20  # float64 bytes of one streamed block (its narrow source is at most as large again)
ROWS_BYTES = 1 << 20  # a weight's rows at most this many bytes stay in J's buffer under form="auto"
LAYER_FORMS = ("ghost", "rows", "streamed")


@dataclass(frozen=True)
class FormCost:
    """One form's cost for one weight (the module docstring's table).

    Attributes:
        flops: floating-point operations of the form's Gram, ``J^T c`` and ``J v`` products.
        held: bytes the form keeps from the backward to the step (beyond the layer's factors).
        transient: bytes the form allocates while it runs and frees after.
        launches: dispatched operators (kernel launches on a GPU).
    """

    flops: int
    held: int
    transient: int
    launches: int


def form_costs(m: int, t: int, fan_in: int, fan_out: int, itemsize: int = 4) -> dict[str, FormCost]:
    """The cost model's row of every form (module docstring) for one weight.

    Args:
        m: the samples ``M``.
        t: the positions ``T`` per sample.
        fan_in: ``I``.
        fan_out: ``O``.
        itemsize: bytes per entry of the model's dtype.

    Returns:
        ``{"ghost": FormCost, "rows": FormCost, "streamed": FormCost}``.
    """
    block = m * fan_in * fan_out
    chunks = math.ceil(8 * block / STREAM_BYTES)
    return {
        "ghost": FormCost(2 * m * m * t * t * (fan_in + fan_out) + 2 * m * t * fan_in * fan_out,
                          8 * m * t * (fan_in + fan_out) if itemsize < 8 else 0, 16 * m * m * t * t, 8),
        "rows": FormCost(2 * m * t * fan_in * fan_out + 2 * m * block + 2 * block, itemsize * block,
                         min(8 * block, STREAM_BYTES), 1 + 4 * chunks),
        "streamed": FormCost(4 * m * t * fan_in * fan_out + 2 * m * block + 2 * block, 0,
                             min(block * (8 + itemsize), STREAM_BYTES + STREAM_BYTES * itemsize // 8), 8 * chunks),
    }


def layer_form(form: str, m: int, t: int, fan_in: int, fan_out: int, itemsize: int = 4) -> str:
    """The form of one factored weight (module docstring): ``"ghost"``, ``"rows"`` or ``"streamed"``.

    Args:
        form: a checked form of :func:`ief.per_sample` other than ``"dense"``: ``"auto"`` chooses by the cost model;
            ``"ghost"``, ``"rows"`` and ``"streamed"`` force themselves.
        m: the samples ``M``.
        t: the positions ``T`` per sample (all calls of the layer).
        fan_in: ``I``.
        fan_out: ``O``.
        itemsize: bytes per entry of the model's dtype.

    Returns:
        The form's name.
    """
    if form in LAYER_FORMS:
        return form
    if prefer_ghost("auto", m, t, fan_in, fan_out):
        return "ghost"
    return "rows" if itemsize * m * fan_in * fan_out <= ROWS_BYTES else "streamed"


def _block_rows(m: int, fan_in: int) -> int:
    """Output features per streamed block: ``M rows I`` float64 entries within :data:`STREAM_BYTES`."""
    return max(1, STREAM_BYTES // (8 * m * max(1, fan_in)))


def streamed_blocks(a: torch.Tensor, g: torch.Tensor):
    """The rows ``G_n^T A_n`` of one weight, a block of output features at a time, in float64.

    Args:
        a: ``[M, T, I]`` inputs (any floating dtype: the block is formed in it, then converted exactly).
        g: ``[M, T, O]`` output gradients, of ``a``'s dtype.

    Yields:
        ``(lo, block)``: the block's first column in the weight's ``O I`` columns and ``[M, rows I]`` float64, valid
        until the next is drawn (one narrow and one float64 buffer, reused).
    """
    m, fan_in, fan_out = a.shape[0], a.shape[2], g.shape[2]
    rows = _block_rows(m, fan_in)
    gt = g.transpose(1, 2)  # [M, O, T]
    narrow = wide = None
    for lo in range(0, fan_out, rows):
        hi = min(fan_out, lo + rows)
        if a.dtype == torch.float64:
            yield lo * fan_in, torch.bmm(gt[:, lo:hi], a).view(m, -1)
            continue
        if narrow is None:
            narrow = torch.empty(m, min(rows, fan_out), fan_in, dtype=a.dtype, device=a.device)
            wide = torch.empty(m, min(rows, fan_out) * fan_in, dtype=torch.float64, device=a.device)
        part = narrow[:, : hi - lo]
        torch.bmm(gt[:, lo:hi], a, out=part)
        out = wide[:, : (hi - lo) * fan_in]
        out.copy_(part.view(m, -1))
        yield lo * fan_in, out


def streamed_gram(a: torch.Tensor, g: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out += J J^T`` of one weight from its factors, block by block (:func:`streamed_blocks`); returns ``out``."""
    for _, block in streamed_blocks(a, g):
        out.addmm_(block, block.T)
    return out


def factor_gram(a: torch.Tensor, g: torch.Tensor, streamed: bool) -> torch.Tensor:
    """One weight's ``[M, M]`` float64 Gram block from its factors ``A [M, T, I]``, ``G [M, T, O]`` (the union
    batch's across processes): its rows formed a block at a time for a ``streamed`` weight (the same rows, in the
    factors' dtype, as each rank's ``J^T c`` forms), else the ghost kernel (``a`` and ``g`` float64)."""
    if streamed:
        m = a.shape[0]
        return streamed_gram(a, g, torch.zeros(m, m, dtype=torch.float64, device=a.device))
    return ghost_kernel(a, g)


class StreamedRows(FactoredJacobian):
    """A :class:`~ief.rows.FactoredJacobian` whose weights in ``streamed`` take the streamed form (module
    docstring): their factors are kept as a ghost's are (so every product of the base class that reads the factors,
    the batch gradient, the guard's, ``times``, the materialised tensor, holds for them), and the Gram and ``J^T c``
    form their rows a block at a time.

    Args:
        m, sizes, ref, ghosts, dense, dense_index, used_rows: as :class:`~ief.rows.FactoredJacobian` (``ghosts``
            holds the streamed weights too).
        streamed: the parameter indices of ``ghosts`` in the streamed form.
    """

    def __init__(self, m, sizes, ref, ghosts, dense, dense_index, used_rows=None, *, streamed=()):
        super().__init__(m, sizes, ref, ghosts, dense, dense_index, used_rows)
        self.streamed = frozenset(streamed)

    def _kernel_ghosts(self) -> list:
        return [entry for entry in self.ghosts if entry[0] not in self.streamed]

    def _streamed_factors(self, scale: float):
        """``(i, A, G)`` of the streamed weights with ``(G/scale)^T A`` their rows: the factors as they are at
        ``scale = 1`` (the block formed in their dtype, as the rows route's hook forms it), else float64 scaled."""
        for i, a, g in self.ghosts:
            if i in self.streamed:
                yield (i, a, g) if scale == 1.0 else (i, *self.scaled_factors(a, g, scale))

    def gram(self, scale: float = 1.0) -> torch.Tensor:
        out = super().gram(scale)
        for _, a, g in self._streamed_factors(scale):
            streamed_gram(a, g, out)
        out = 0.5 * (out + out.T)
        self._gram_finite = _gram_finite_flag(out, self.dtype, scale)
        return out

    def combine_rows(self, coeff: torch.Tensor, scale: float = 1.0, final: bool = False) -> torch.Tensor:
        out = super().combine_rows(coeff, scale, final)  # every column but the streamed weights'
        row = coeff.to(torch.float64).unsqueeze(0)  # [1, M]
        part = None
        for i, a, g in self._streamed_factors(scale):
            dest = out[self.offsets[i] : self.offsets[i + 1]]
            for lo, block in streamed_blocks(a, g):
                width = block.shape[1]
                if dest.dtype == torch.float64:
                    torch.mm(row, block, out=dest[lo : lo + width].unsqueeze(0))
                    continue
                if part is None or part.numel() < width:
                    part = torch.empty(width, dtype=torch.float64, device=self.device)
                torch.mm(row, block, out=part[:width].unsqueeze(0))
                dest[lo : lo + width].copy_(part[:width])  # the float64 sum rounded once
        return out

    def times(self, v: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        out = super().times(v, scale)
        v = v.to(torch.float64)
        for i, a, g in self._streamed_factors(scale):  # the same rows as the Gram's and J^T c's (SF cancels them)
            for lo, block in streamed_blocks(a, g):
                out += block @ v[self.offsets[i] + lo : self.offsets[i] + lo + block.shape[1]]
        return out


__all__ = ["LAYER_FORMS", "ROWS_BYTES", "STREAM_BYTES", "FormCost", "StreamedRows", "factor_gram", "form_costs",
           "layer_form", "streamed_blocks", "streamed_gram"]
