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

(``S`` = :data:`STREAM_BYTES`; the factors ``b M T (I + O)`` are what the backward hands the hooks, held in every form;
the ghost kernel holds their float64 copies beside them when ``b < 8``.) Summed over a model's weights (``P_w``: their
entries, ``T`` one length for all), a step whose weights all keep their rows (the rows route, ``form="rows"``) costs
``2 M T P_w + 2 M^2 P_w`` flops and holds ``b M P_w`` bytes from the backward to the update (``J``'s buffer, reused
from step to step), one launch per layer and four per float64 column block (:data:`ief.rows.COLUMN_BYTES`); the
streamed route costs ``4 M T P_w + 2 M^2 P_w`` flops, holds no ``M P_w`` (one block of ``S`` at a time) and makes
eight launches per block. The streamed form pays one batched product more than the rows (the block is formed for the
Gram and again for the combination): ``2 M T I O`` flops for every ``b M I O`` bytes of rows it does not keep,
``2 T / b`` flops a byte, the same for every weight over the same positions.

**The rule of** ``form="auto"`` (:func:`choose_forms`): a weight takes the ghost kernel where its flops are the
fewest (:func:`ief.rows.prefer_ghost`: it holds no rows either); every other weight keeps its rows, the smallest
first (the same flops saved per byte, and a small weight's streamed blocks are the most launches per flop), while
the rows the step keeps in all, ``b M`` times the columns of every parameter without factors (biases, norms, an
embedding table's used rows, a tied weight: kept by every route) plus those weights' ``I O``, stay within the
memory budget; the rest are streamed. The budget is ``memory_budget`` bytes where the caller gives it
(``ief.per_sample(..., memory_budget=)``, the exact optimisers' ``memory_budget=``), else :data:`MODEL_MULTIPLE` times
the bytes of the model's parameters as this process holds them (frozen ones included), and at least
:data:`FLOOR_BYTES` (8 MiB). Twice the model is the state AdamW's two moments would hold in full fine-tuning, so that
the step's memory stays within a first-order step's, while an adapter's rows (a LoRA's, a few MiB beside a base model
of GiB) are kept; the floor is what the streamed route allocates for its own block and its narrow source (up to
``S (1 + b / 8)``), so that streaming rows smaller than it would save no memory on a small model. A user checks it with
``opt.last_step_report.routes`` (``"dense"``: the rows kept; ``"streamed"``). The choice reads only shapes and the
model's parameters: the same model, batch shape and budget give the same forms on every machine.

Across processes (:mod:`ief.distributed`) a streamed weight's factors are all-gathered as a ghost's are, and every
rank forms the union batch's Gram block from them (:func:`factor_gram`); the combination stays each rank's own.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .rows import FactoredJacobian, _gram_finite_flag, ghost_kernel, prefer_ghost

STREAM_BYTES = 4 << 20  # float64 bytes of one streamed block (its narrow source is at most as large again)
MODEL_MULTIPLE = 2  # form="auto"'s default budget of kept rows: this many times the model's parameter bytes,
FLOOR_BYTES = 2 * STREAM_BYTES  # and at least this: the streamed route's own block and its narrow source
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


def model_bytes(model: torch.nn.Module) -> int:
    """The bytes of ``model``'s parameters as this process holds them (frozen ones included; a sharded parameter's
    local shard)."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def check_memory_budget(memory_budget: object, form: str) -> float | None:
    """``memory_budget`` as a number of bytes (``None``: the default, :func:`rows_budget`).

    Args:
        memory_budget: ``None``, or a number of bytes ``>= 0`` (``math.inf``: every weight's rows kept where the
            ghost kernel is not cheaper).
        form: the checked form it comes with.

    Returns:
        The budget in bytes, or ``None``.

    Raises:
        ValueError: a budget that is not a number ``>= 0`` (NaN, negative, a bool, a string), or a budget given with
            a form other than ``"auto"`` (the only form that chooses), naming the value.
    """
    if memory_budget is None:
        return None
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float)) or not memory_budget >= 0:
        raise ValueError(f"memory_budget must be a number of bytes >= 0 (or None: {MODEL_MULTIPLE} times the model's "
                         f"parameter bytes, at least {FLOOR_BYTES >> 20} MiB), got {memory_budget!r}")
    if form != "auto":
        raise ValueError(f"memory_budget={memory_budget!r} is read by form='auto' only (it chooses which weights keep "
                         f"their rows), got form={form!r}")
    return float(memory_budget)


def rows_budget(model: torch.nn.Module, memory_budget: float | None) -> float:
    """The bytes of rows ``form="auto"`` may keep: ``memory_budget``, or :data:`MODEL_MULTIPLE` times
    :func:`model_bytes` and at least :data:`FLOOR_BYTES` (module docstring)."""
    if memory_budget is not None:
        return memory_budget
    return float(max(MODEL_MULTIPLE * model_bytes(model), FLOOR_BYTES))


def choose_forms(form: str, shapes: Sequence[tuple[int, int, int, int]], itemsize: int, budget: float,
                 kept: int = 0) -> list[str]:
    """The form of each factored weight (the module docstring's rule): ``"ghost"``, ``"rows"`` or ``"streamed"``.

    Args:
        form: a checked form of :func:`ief.per_sample` other than ``"dense"``: ``"auto"`` chooses;
            ``"ghost"``, ``"rows"`` and ``"streamed"`` force themselves.
        shapes: ``(M, T, I, O)`` of each weight (``T`` the positions of all calls of its layer).
        itemsize: bytes per entry of the model's dtype.
        budget: the bytes of rows the step may keep (:func:`rows_budget`).
        kept: the bytes of rows kept whatever the forms (the columns of the parameters without factors).

    Returns:
        One name per weight, in the order of ``shapes``.
    """
    if form in LAYER_FORMS:
        return [form] * len(shapes)
    out = ["ghost" if prefer_ghost("auto", *shape) else "streamed" for shape in shapes]
    sizes = [itemsize * m * fan_in * fan_out for m, _, fan_in, fan_out in shapes]
    used = kept
    for i in sorted((i for i, kind in enumerate(out) if kind == "streamed"), key=lambda i: (sizes[i], i)):
        if used + sizes[i] > budget:
            break  # the rest are larger
        used += sizes[i]
        out[i] = "rows"
    return out


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


def streamed_combine(a: torch.Tensor, g: torch.Tensor, row: torch.Tensor, dest: torch.Tensor) -> None:
    """``dest = sum_n row_n J_n`` of one weight (its ``[O I]`` columns of ``J^T c``), block by block: each block's
    sum in float64, rounded once into ``dest``'s dtype.

    Args:
        a, g: the weight's factors, as :func:`streamed_blocks`.
        row: ``[1, M]`` float64 coefficients.
        dest: ``[O I]``, written.
    """
    part = None
    for lo, block in streamed_blocks(a, g):
        width = block.shape[1]
        if dest.dtype == torch.float64:
            torch.mm(row, block, out=dest[lo : lo + width].unsqueeze(0))
            continue
        if part is None:
            part = torch.empty(width, dtype=torch.float64, device=dest.device)
        torch.mm(row, block, out=part[:width].unsqueeze(0))
        dest[lo : lo + width].copy_(part[:width])  # the float64 sum rounded once


def streamed_times(a: torch.Tensor, g: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
    """``out += J v`` of one weight (``v`` its ``[O I]`` float64 entries, ``out`` ``[M]`` float64), block by block."""
    for lo, block in streamed_blocks(a, g):
        out += block @ v[lo : lo + block.shape[1]]


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
        for i, a, g in self._streamed_factors(scale):
            streamed_combine(a, g, row, out[self.offsets[i] : self.offsets[i + 1]])
        return out

    def times(self, v: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        out = super().times(v, scale)
        v = v.to(torch.float64)
        for i, a, g in self._streamed_factors(scale):  # the same rows as the Gram's and J^T c's (SF cancels them)
            streamed_times(a, g, v[self.offsets[i] : self.offsets[i + 1]], out)
        return out


__all__ = ["FLOOR_BYTES", "LAYER_FORMS", "MODEL_MULTIPLE", "STREAM_BYTES", "FormCost", "StreamedRows",
           "check_memory_budget", "choose_forms", "factor_gram", "form_costs", "model_bytes", "rows_budget",
           "streamed_blocks", "streamed_combine", "streamed_gram", "streamed_times"]
