"""The per-sample rows of a batch split across processes (``torch.distributed``), as one ``J`` of the union batch.

Data-parallel training gives each of ``R`` processes (ranks) its own ``M_r`` samples. The exact EF / iEF / SF update
of the union batch (``M = sum_r M_r`` samples, concatenated in rank order) couples every pair of samples through the
Gram matrix ``J J^T``, whose blocks ``J_r J_s^T`` need rows of two ranks; it needs no approximation
(Appendix D.1's Woodbury form):

- the Gram matrix: every rank forms the whole ``[M, M]`` float64 Gram from every rank's rows, all-gathered
  (``dist.all_gather``, each rank's part padded to the largest ``M_r``), so that every rank holds the same bits and
  solves the same small system (no broadcast of the solution is needed: a replicated solve). Rows kept as factors
  (:class:`~ief.rows.FactoredJacobian`: a Linear weight's rows ``J_n = G_n^T A_n``) send, where that is smaller, the
  factors ``A [M_r, T, I]`` and ``G [M_r, T, O]`` themselves, and every rank forms that layer's block of the Gram with
  the ghost kernel of one process (:func:`ief.rows.ghost_kernel`); an embedding table that every rank keeps as
  the rows its batch used (:attr:`~ief.rows.FactoredJacobian.used_rows`) is sent as the rows of the sorted union of
  the ranks' used ids, each rank's rows placed at its ids' places in the union and zero elsewhere: a row of the table
  that no rank used is zero in every row of ``J``, so its columns add nothing to ``J J^T``, and the Gram over the
  union's ``U D`` columns is that over the whole ``V D``; every other column is sent dense, in chunks of
  :data:`GRAM_CHUNK` columns (:func:`gram_plan`, :meth:`DistributedRows.gram`);
- ``s``, the losses and anything else per sample: all-gathered and concatenated;
- the direction ``J^T w = sum_r J_r^T w_r``: each rank combines its own rows with its slice of ``w``, and one
  all-reduce (sum) of ``P`` float64 numbers gives every rank the same direction;
- scalars that must agree (finiteness, ``max|J|``, token counts): all-reduced.

Communication per step, with ``P`` parameters, ``b`` bytes per entry of ``J`` (4 for float32) and ``M_max`` the
largest ``M_r``: the Gram's all-gathers, ``M_max R (P_dense + sum_l T_l (I_l + O_l)) b`` bytes received by each rank,
where the sum runs over the weights gathered as factors (``T_l`` their most positions on any rank) and ``P_dense`` is
every other column, a table kept as used rows on every rank counted as ``U_union D`` (its union's ids, not its
``V D``: :attr:`GramPlan.tables`; all ``P`` when some rank's rows are not factored: ``M_max R P b``); two small
all-gathers of the ranks' layouts (``8`` integers per parameter, and the used ids of their tables, padded to the most
of any rank) before them; and the direction's all-reduce of ``8 P`` bytes (a ring all-reduce sends about
``2 x 8 P``). DDP's own gradient all-reduce is ``~2 x 4 P`` for float32 gradients.

The rule (:func:`gram_plan`, the same on every rank, for it reads the all-gathered layouts and never this rank's rows
alone: ranks at different ``M_r`` may choose different forms, :func:`ief.rows.prefer_ghost`): a weight is gathered as
factors when every rank keeps it as factors and ``T_max (I + O) <= I O``, its factors per sample no more entries than
its row, or when every rank keeps it in the streamed form (:mod:`ief.streamed`: its rows are never formed whole, so
its factors are sent even where they are more entries, and every rank forms the union's Gram block from them a block
of rows at a time, :func:`ief.streamed.factor_gram`); otherwise its block of rows is gathered (a rank holding factors
forms ``G_n^T A_n`` for it). An embedding
table is gathered as the union of the ranks' used rows when every rank keeps it as its used rows, else in its full
``[V, D]`` layout (a rank whose batch used every row keeps the table whole, and so does every rank for a table tied
to the output layer, whose every row is in ``J``). An MLP's ``[256, 784]`` weight sends ``1,040`` numbers per sample
instead of ``200,704``; an untied GPT-2 token table (``50,257 x 768``) ``U_union x 768``, ``U_union`` at most the
``M T`` tokens of the union batch, instead of ``38.6`` million; the dense columns (biases, LayerNorms, a weight whose
factors would be larger, e.g. over many tokens, a tied table) cost what they did: the Gram's all-gather of dense
columns is about ``M b / 8`` times DDP's traffic for them, that of factors ``T (I + O) / (I O)`` times less.

Faults: a rank whose local work fails (a non-finite loss, a refused per-sample check, a bad value) must not leave the
others waiting in a collective: :func:`agree` runs the local work, all-reduces a failure flag, and then raises the
same error on every rank, naming the rank and its message. A rank that dies or hangs outright is caught by the
process group's own timeout (``torch.distributed.init_process_group(timeout=...)``; gloo's and NCCL's defaults are
30 and 10 minutes), after which every collective here raises.

Every collective runs in the group's device: gloo takes CPU tensors, NCCL CUDA ones (the rows' device must match).
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from .precision import ROUNDING_ATTRIBUTE, rounding_dtype, unit_roundoff
from .rows import DenseRows, FactoredJacobian, Rows, _matrix_combine
from .streamed import factor_gram

T = TypeVar("T")
GRAM_CHUNK = 1 << 16  # columns per all-gathered chunk of the rows (M_max R x GRAM_CHUNK entries in flight)


def world_size(group: Any) -> int:
    """The number of processes in ``group`` (1 when ``torch.distributed`` is not initialised)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def resolve_group(model: torch.nn.Module, process_group: Any, name: str) -> Any:
    """The process group an optimiser steps across: ``process_group`` if given, else a ``DistributedDataParallel``
    model's own group, else none (one process).

    Args:
        model: the model as given to the optimiser (maybe DDP-wrapped).
        process_group: ``None``, or a group of an initialised ``torch.distributed``
            (``torch.distributed.group.WORLD`` for every process).
        name: the optimiser's class name, for the error.

    Returns:
        The group, or ``None`` for a single process (no group, or a group of one process).

    Raises:
        ValueError: ``process_group`` given while ``torch.distributed`` is not initialised; or no group resolved while
            an initialised default group has several processes (each process would step on its own batch's
            direction, a different method, and the replicas would drift apart silently).
    """
    initialised = dist.is_available() and dist.is_initialized()
    if process_group is not None and not initialised:
        raise ValueError(f"{name}: process_group was given but torch.distributed is not initialised "
                         "(call torch.distributed.init_process_group first, as torchrun's scripts do)")
    group = process_group
    if group is None and isinstance(model, torch.nn.parallel.DistributedDataParallel):
        group = model.process_group
    if group is None:
        if initialised and dist.get_world_size() > 1:
            raise ValueError(
                f"{name}: torch.distributed is initialised with world size {dist.get_world_size()} but the optimiser "
                f"was given no process group: each process would solve its own batch's Gram system and the replicas "
                f"would drift apart silently; pass process_group=torch.distributed.group.WORLD (the exact step over "
                f"the union of the ranks' batches) or wrap the model in DistributedDataParallel")
        return None
    return group if world_size(group) > 1 else None


class RankFailure(RuntimeError):
    """Raised on every rank when one rank's local work failed (see :func:`agree`); the first failing rank's error
    is named in the message, and re-raised there with its own type."""


class PeerFailure(RankFailure):
    """Raised on a rank whose work stopped because another rank's failed (:class:`ief.sharded.RowAgreement`):
    :func:`agree` reports the failing rank's error in its place."""


def agree(group: Any, device: torch.device, work: Callable[[], T]) -> T:
    """Run ``work`` on this rank and make every rank of ``group`` fail together when any rank's ``work`` raised.

    Args:
        group: the process group (``None``: no collective, ``work``'s own behaviour).
        device: where the group's collectives take tensors (CPU for gloo).
        work: the rank's local computation.

    Returns:
        ``work``'s result, when it succeeded on every rank.

    Raises:
        The failing rank's own exception on that rank; on the other ranks a :class:`RankFailure` (or the same type,
        for the library's own ``FloatingPointError`` / ``ValueError`` / per-sample mismatch) naming the rank and its
        message: no rank is left waiting in a later collective.
    """
    if group is None:
        return work()
    failure: BaseException | None = None
    result: Any = None
    try:
        result = work()
    except Exception as err:  # noqa: BLE001 - re-raised below, on every rank
        failure = err
    flag = torch.tensor([0.0 if failure is None else 1.0], dtype=torch.float64, device=device)
    dist.all_reduce(flag, group=group)
    if float(flag) == 0.0:
        return result
    own = None if isinstance(failure, PeerFailure) else failure  # (a peer's failure is reported as the peer's)
    messages: list[Any] = [None] * world_size(group)
    dist.all_gather_object(messages, None if own is None else (type(own).__name__, str(own)), group=group)
    if own is not None:
        raise own
    rank, (kind, message) = next(((r, m) for r, m in enumerate(messages) if m is not None),
                                 (None, ("RankFailure", str(failure))))
    text = f"rank {rank} failed ({kind}): {message}"
    if kind in ("FloatingPointError", "ValueError"):
        raise {"FloatingPointError": FloatingPointError, "ValueError": ValueError}[kind](text)
    raise RankFailure(text)


def _padded(local: torch.Tensor, size: int) -> torch.Tensor:
    if local.shape[0] == size:
        return local.contiguous()
    pad = local.new_zeros((size - local.shape[0], *local.shape[1:]))
    return torch.cat([local, pad])


def all_gather_rows(local: torch.Tensor, sizes: Sequence[int], group: Any) -> torch.Tensor:
    """The ranks' ``[M_r, ...]`` tensors concatenated in rank order, ``[M, ...]``, on every rank.

    Args:
        local: this rank's rows (first dimension ``sizes[rank]``).
        sizes: every rank's ``M_r`` (:func:`batch_sizes`).
        group: the process group.

    Returns:
        ``[sum(sizes), ...]``, identical on every rank.
    """
    largest = max(sizes)
    parts = [local.new_empty((largest, *local.shape[1:])) for _ in sizes]
    dist.all_gather(parts, _padded(local, largest), group=group)
    return torch.cat([part[:m] for part, m in zip(parts, sizes)])


def collective_device(group: Any) -> torch.device:
    """Where ``group``'s collectives take their tensors: the current CUDA device for NCCL, else the CPU (gloo)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def batch_sizes(m: int, group: Any, device: torch.device) -> list[int]:
    """Every rank's ``M_r``, in rank order (one small all-gather and a host read)."""
    mine = torch.tensor([m], dtype=torch.int64, device=device)
    parts = [torch.empty_like(mine) for _ in range(world_size(group))]
    dist.all_gather(parts, mine, group=group)
    return [int(x) for x in torch.cat(parts).tolist()]


def all_reduce(tensor: torch.Tensor, group: Any, op: Any = None) -> torch.Tensor:
    """``tensor`` reduced over the group in place (default: sum), returned."""
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op is None else op, group=group)
    return tensor


@dataclass(frozen=True)
class GramPlan:
    """How :meth:`DistributedRows.gram` gathers the rows, the same on every rank (:func:`gram_plan`).

    Attributes:
        factors: ``(parameter index, T_max, I, O)`` of every weight gathered as its factors (padded to ``T_max``
            positions); ``None`` when some rank's rows are not a :class:`~ief.rows.FactoredJacobian` (then all of
            ``J`` is gathered dense).
        dense: the parameter indices gathered as dense column blocks, in column order (empty when ``factors`` is
            ``None``: then the whole ``J``).
        dense_width: the columns gathered dense (a table of ``tables`` counted as its ``U_union D``).
        factor_width: ``sum T_max (I + O)`` over ``factors``, the packed factors' entries per sample.
        received_bytes: the Gram's all-gathers' payload received by each rank, ``R M_max (dense_width +
            factor_width) b`` (every rank's part, its own included).
        tables: ``(parameter index, U_union, D)`` of every embedding table of ``dense`` that every rank keeps as its
            used rows, gathered as the ``U_union D`` columns of the union of the ranks' used ids (not ``V D``).
        union_ids: parameter index -> the union's ids (sorted, distinct, ``[U_union]`` int64 on the CPU) of every
            table of ``tables`` (not compared: ``tables`` holds their counts, and the ids follow from the same
            all-gathered layouts on every rank).
        streamed: the parameter indices of ``factors`` that every rank keeps in the streamed form.
    """

    factors: tuple[tuple[int, int, int, int], ...] | None
    dense: tuple[int, ...]
    dense_width: int
    factor_width: int
    received_bytes: int
    tables: tuple[tuple[int, int, int], ...] = ()
    streamed: frozenset[int] = frozenset()
    union_ids: dict[int, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)


LAYOUT_FIELDS = 8  # per parameter: (factored: 1, or 2 streamed; T, I, O, size, kept as used rows, U, D)


def _all_layouts(local: Rows, group: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Every rank's layout of its rows and its tables' used ids (two small all-gathers).

    Returns:
        ``None`` when some rank's rows are not a :class:`~ief.rows.FactoredJacobian` or the ranks' parameter counts
        differ; else ``(layouts, ids)``: ``layouts [R, parameters, LAYOUT_FIELDS]`` int64 (per parameter: 1 and
        ``T, I, O`` for a weight kept as factors ``A [M_r, T, I]``, ``G [M_r, T, O]``, else zeros; its size; 1,
        ``U`` and ``D`` for a table kept as its ``U`` used rows of width ``D``, else zeros), and ``ids [R, L]``
        int64, each rank's tables' used ids one table after another in parameter order, padded with zeros to the
        most of any rank (CPU).
    """
    factored = isinstance(local, FactoredJacobian)
    count = len(local.sizes) if factored else 0
    tables = sorted(local.used_rows.items()) if factored else []
    ids = torch.cat([torch.zeros(0, dtype=torch.int64), *(used.reshape(-1).cpu() for _, (used, _) in tables)])
    header = all_gather_rows(torch.tensor([[int(factored), count, ids.numel()]], dtype=torch.int64, device=device),
                             [1] * world_size(group), group)
    if not bool(header[:, 0].all()) or bool((header[:, 1] != count).any()):
        return None
    mine = torch.zeros(count, LAYOUT_FIELDS, dtype=torch.int64)
    mine[:, 4] = torch.tensor(local.sizes, dtype=torch.int64)
    streamed = getattr(local, "streamed", frozenset())
    for i, a, g in local.ghosts:
        mine[i, :4] = torch.tensor([2 if i in streamed else 1, a.shape[1], a.shape[2], g.shape[2]])
    for i, (used, dim) in tables:
        mine[i, 5:] = torch.tensor([1, used.numel(), dim])
    longest = int(header[:, 2].max())
    packed = torch.cat([mine.reshape(-1), ids, ids.new_zeros(longest - ids.numel())]).unsqueeze(0)
    every = all_gather_rows(packed.to(device), [1] * world_size(group), group).cpu()
    return every[:, :count * LAYOUT_FIELDS].reshape(-1, count, LAYOUT_FIELDS), every[:, count * LAYOUT_FIELDS:]


def _union_ids(i: int, layouts: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The sorted union of every rank's used ids of table ``i`` (``[U_union]`` int64): rank ``r``'s lie in
    ``ids[r]`` after those of its tables of lower index."""
    counts = layouts[:, :, 6]  # U, zero for a parameter that is not a table kept as used rows
    starts = counts[:, :i].sum(dim=1).tolist()
    return torch.unique(torch.cat([ids[r, lo:lo + int(counts[r, i])] for r, lo in enumerate(starts)]))


def gram_plan(layouts: torch.Tensor | None, sizes: Sequence[int], columns: int, itemsize: int,
              ids: torch.Tensor | None = None) -> GramPlan:
    """Which weights the Gram gathers as factors: those every rank keeps as factors and whose factors are fewer
    entries than their rows, ``T_max (I + O) <= I O`` (per sample; ``T_max`` the most positions of any rank); every
    other parameter's block is gathered dense, an embedding table that every rank keeps as its used rows as the
    ``U_union D`` columns of the sorted union of the ranks' used ids (the rows no rank used are zero in every row of
    ``J``). Computed from the all-gathered layouts, so every rank makes the same plan (never from its own rows alone:
    the ranks' forms may differ, e.g. ``prefer_ghost`` at a different ``M_r``).

    Args:
        layouts: :func:`_all_layouts`'s ``[R, parameters, LAYOUT_FIELDS]``, or ``None`` (all of ``J`` dense).
        sizes: every rank's ``M_r``.
        columns: ``P``, the columns of ``J``.
        itemsize: bytes per entry of ``J``.
        ids: :func:`_all_layouts`'s ``[R, L]`` used ids of the ranks' tables; needed when some table is kept as
            used rows on every rank.

    Returns:
        The :class:`GramPlan`.

    Raises:
        ValueError: the ranks' parameters differ in size, a factored weight's ``I, O`` or a table's row width ``D``
            differ between ranks (not the same model), naming the parameter and the values; or a table kept as
            used rows on every rank and no ``ids``.
    """
    gathered = len(sizes) * max(sizes) * itemsize
    if layouts is None:
        return GramPlan(None, (), columns, 0, gathered * columns)
    factors, dense, tables, union_ids, dense_width, factor_width, streamed = [], [], [], {}, 0, 0, set()
    for i in range(layouts.shape[1]):
        kept, positions, fan_in, fan_out, size, table, _, dim = layouts[:, i].T.tolist()
        if len(set(size)) > 1:
            raise ValueError(f"parameter {i} has {size} entries on the ranks: the ranks must hold the same model")
        if all(kept) and (len(set(fan_in)) > 1 or len(set(fan_out)) > 1):
            raise ValueError(f"parameter {i}'s factors have inputs {fan_in} and outputs {fan_out} on the ranks: the "
                             f"ranks must hold the same model")
        t = max(positions)
        every_streamed = all(k == 2 for k in kept)
        if all(kept) and (every_streamed or t * (fan_in[0] + fan_out[0]) <= fan_in[0] * fan_out[0]):
            factors.append((i, t, fan_in[0], fan_out[0]))
            if every_streamed:
                streamed.add(i)
            factor_width += t * (fan_in[0] + fan_out[0])
            continue
        dense.append(i)
        if not all(table):
            dense_width += size[0]
            continue
        if len(set(dim)) > 1:
            raise ValueError(f"parameter {i}'s table has rows of {dim} entries on the ranks: the ranks must hold the "
                             f"same model")
        if ids is None:
            raise ValueError(f"parameter {i} is a table kept as used rows on every rank but no ids were given "
                             f"(ids=None): pass _all_layouts's all-gathered ids")
        union_ids[i] = _union_ids(i, layouts, ids)
        tables.append((i, union_ids[i].numel(), dim[0]))
        dense_width += union_ids[i].numel() * dim[0]
    return GramPlan(tuple(factors), tuple(dense), dense_width, factor_width, gathered * (dense_width + factor_width),
                    tables=tuple(tables), streamed=frozenset(streamed), union_ids=union_ids)


class DistributedRows(Rows):
    """The union batch's ``J [M, P]`` from this rank's rows ``J_r`` (any :class:`~ief.rows.Rows`), for the Gram solves
    of :mod:`ief.directions`: every method returns what :class:`~ief.rows.DenseRows` of the concatenated rows would,
    identically on every rank (see the module docstring for the collectives and their traffic, and :meth:`plan` for
    which weights the Gram gathers as factors).

    Args:
        local: this rank's rows.
        group: the process group (of more than one process).
        sizes: every rank's ``M_r`` (:func:`batch_sizes`).
        shard: ``None``, or an FSDP2 model's :class:`ief.sharded.ShardedModel` (the rows' columns its parameters'):
            the direction (``combine_rows(final=True)``) is then this rank's shards of it, ``[P_local]``
            (:meth:`ief.sharded.ShardedModel.combine`), and :attr:`direction_size` says so.

    Raises:
        ValueError: ``sizes`` does not hold this rank's ``M_r``.
    """

    def __init__(self, local: Rows, group: Any, sizes: Sequence[int], shard: Any = None):
        rank = dist.get_rank(group)
        self.shard = shard  # an FSDP2 model's ief.sharded.ShardedModel: the direction is this rank's shards only
        if sizes[rank] != local.shape[0]:
            raise ValueError(f"sizes[{rank}] = {sizes[rank]} but this rank's rows have {local.shape[0]}")
        self.local, self.group, self.sizes = local, group, list(sizes)
        self.offset = sum(self.sizes[:rank])
        self.shape = torch.Size((sum(self.sizes), local.shape[1]))
        self.dtype, self.device = local.dtype, local.device
        # the coarsest rounding any rank's forward carried (the same model and autocast give the same everywhere)
        own = rounding_dtype(local)
        u = torch.tensor([unit_roundoff(own)], dtype=torch.float64, device=self.device)
        all_reduce(u, group, dist.ReduceOp.MAX)
        coarsest = own if float(u) == unit_roundoff(own) else next(
            d for d in (torch.bfloat16, torch.float16, torch.float32, torch.float64) if unit_roundoff(d) == float(u))
        setattr(self, ROUNDING_ATTRIBUTE, coarsest if coarsest != self.dtype else None)
        self._plan: GramPlan | None = None
        self._gathered: torch.Tensor | None = None  # the ranks' packed factors, [M, plan.factor_width]

    def _local_dense(self) -> torch.Tensor:
        local = self.local
        return local.materialize() if hasattr(local, "materialize") else local.matrix

    def _slice(self, coeff: torch.Tensor) -> torch.Tensor:
        return coeff[self.offset:self.offset + self.local.shape[0]]

    def plan(self) -> GramPlan:
        """How :meth:`gram` gathers the rows (:func:`gram_plan` on every rank's layout, exchanged once)."""
        if self._plan is None:
            layouts = _all_layouts(self.local, self.group, self.device)
            self._plan = gram_plan(None if layouts is None else layouts[0], self.sizes, self.shape[1],
                                   self.dtype.itemsize, None if layouts is None else layouts[1])
        return self._plan

    def gram(self, scale: float = 1.0) -> torch.Tensor:
        """``(J/scale)(J/scale)^T`` of the union batch, ``[M, M]`` float64, the same bits on every rank: the dense
        columns' chunks (all of ``J`` for rows that are not factored on every rank) and every factored layer's ghost
        kernel on its gathered factors (:meth:`plan`)."""
        plan = self.plan()
        dense = self._local_dense() if plan.factors is None else self._dense_columns(plan)
        out = torch.zeros(self.shape[0], self.shape[0], dtype=torch.float64, device=self.device)
        for lo in range(0, dense.shape[1], GRAM_CHUNK):  # the same number of chunks on every rank (the plan's)
            chunk = all_gather_rows(dense[:, lo:lo + GRAM_CHUNK], self.sizes, self.group).to(torch.float64)
            if scale != 1.0:
                chunk = chunk / scale
            out.addmm_(chunk, chunk.T)
        for (i, *_), (a, g) in zip(plan.factors or (), self._union_factors(plan, scale)):
            out += factor_gram(a, g, i in plan.streamed)
        return (out + out.T) / 2

    def _dense_columns(self, plan: GramPlan) -> torch.Tensor:
        """This rank's ``[M_r, plan.dense_width]``: the blocks of the parameters the plan sends dense, side by side
        (a factored weight's rows ``G_n^T A_n`` formed here; a table of ``plan.tables`` as the union's rows, this
        rank's used rows at their ids' places and zeros at the ids only other ranks used)."""
        local = self.local
        out = torch.empty(local.shape[0], plan.dense_width, dtype=self.dtype, device=self.device)
        tables = {i: (plan.union_ids[i], dim) for i, _, dim in plan.tables}
        lo = 0
        for i in plan.dense:
            if i not in tables:
                local.write_block(i, out[:, lo:lo + local.sizes[i]])
                lo += local.sizes[i]
                continue
            union, dim = tables[i]
            used, _ = local.used_rows[i]
            rows = out[:, lo:lo + union.numel() * dim].unflatten(1, (-1, dim))  # [M_r, U_union, D]
            rows.zero_()
            places = torch.searchsorted(union.to(used.device), used)
            rows.index_copy_(1, places.to(self.device), local.dense_block(i).unflatten(1, (-1, dim)))
            lo += union.numel() * dim
        return out

    def _union_factors(self, plan: GramPlan, scale: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer the plan sends as factors: the union batch's ``A [M, T_max, I]`` and ``G [M, T_max, O]``,
        float64 at ``scale`` (each rank's part scaled by :meth:`~ief.rows.FactoredJacobian.scaled_factors` on its
        own, which keeps its rows ``G_n^T A_n / scale``), from one all-gather of every layer's factors, kept for
        the next :meth:`gram` of this step."""
        if not plan.factors:
            return []
        if self._gathered is None:
            ghosts = {i: (a, g) for i, a, g in self.local.ghosts}
            m = self.local.shape[0]
            packed = torch.zeros(m, plan.factor_width, dtype=self.dtype, device=self.device)
            lo = 0
            for i, t, fan_in, fan_out in plan.factors:
                a, g = ghosts[i]
                block = packed[:, lo:lo + t * (fan_in + fan_out)].view(m, t, fan_in + fan_out)
                block[:, :a.shape[1], :fan_in] = a
                block[:, :g.shape[1], fan_in:] = g
                lo += t * (fan_in + fan_out)
            self._gathered = all_gather_rows(packed, self.sizes, self.group)
        out, lo = [], 0
        bounds = [0, *itertools.accumulate(self.sizes)]
        for i, t, fan_in, fan_out in plan.factors:
            block = self._gathered[:, lo:lo + t * (fan_in + fan_out)].view(-1, t, fan_in + fan_out)
            lo += t * (fan_in + fan_out)
            if i in plan.streamed and scale == 1.0:  # the rows each rank's J^T c forms, in its dtype (ief.streamed)
                out.append((block[:, :, :fan_in], block[:, :, fan_in:]))
                continue
            parts = [FactoredJacobian.scaled_factors(block[r0:r1, :, :fan_in], block[r0:r1, :, fan_in:], scale)
                     for r0, r1 in zip(bounds, bounds[1:])]
            out.append((torch.cat([a for a, _ in parts]), torch.cat([g for _, g in parts])))
        return out

    @property
    def direction_size(self) -> int:
        """The entries of the direction :meth:`combine_rows` returns with ``final=True``: ``P``, or this rank's
        shards' with ``shard``."""
        return self.shape[1] if self.shard is None else self.shard.local_numel()

    def local_coefficients(self, coeff: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the union's ``[M]`` coefficients."""
        return self._slice(coeff)

    def union_factors(self, scale: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The union's float64 ``(A, G)`` of every layer :meth:`plan` gathers as factors, in ``plan().factors``'
        order (gathered once a step, with the Gram's)."""
        return self._union_factors(self.plan(), scale)

    def local_block(self, i: int, coeff: torch.Tensor, scale: float) -> torch.Tensor:
        """Parameter ``i``'s block of this rank's ``(J_r/scale)^T coeff``, ``[numel_i]`` float64 (``coeff``: this
        rank's ``[M_r]``), formed alone: no ``[P]`` vector."""
        local = self.local
        if isinstance(local, FactoredJacobian):
            lo, hi = local.offsets[i], local.offsets[i + 1]
            for (j, _, _), (a, g) in zip(local.ghosts, local._scaled_ghosts(scale)):
                if j == i:
                    weighted = (g * coeff.to(torch.float64)[:, None, None]).flatten(0, 1)
                    return (weighted.T @ a.flatten(0, 1)).reshape(-1)
            part = _matrix_combine(local.dense_block(i), coeff, scale)
            if i not in local.used_rows:
                return part
            out = torch.empty(hi - lo, dtype=torch.float64, device=self.device)
            local._expand(i, out, part)
            return out
        sizes = [p.numel() for p in self.shard.params]
        lo = sum(sizes[:i])
        if isinstance(local, DenseRows):
            return _matrix_combine(local.matrix[:, lo:lo + sizes[i]], coeff, scale)
        return local.combine_rows(coeff, scale).to(torch.float64)[lo:lo + sizes[i]]  # another form: sliced

    def combine_rows(self, coeff: torch.Tensor, scale: float = 1.0, final: bool = False) -> torch.Tensor:
        """``(J/scale)^T coeff``, ``[P]`` float64: this rank's rows with its slice of ``coeff``, summed over ranks;
        with ``shard`` and ``final``, this rank's shards of it only (:attr:`direction_size`)."""
        if final and self.shard is not None:
            return self.shard.combine(self, coeff, scale)
        part = self.local.combine_rows(self._slice(coeff), scale).to(torch.float64)
        return all_reduce(part.contiguous(), self.group)

    def times(self, v: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """``(J/scale) v``, ``[M]`` float64: this rank's products, all-gathered."""
        return all_gather_rows(self.local.times(v, scale).to(torch.float64), self.sizes, self.group)

    def max_abs(self) -> float:
        """The largest of the ranks' :meth:`~ief.rows.Rows.max_abs`."""
        value = torch.tensor([self.local.max_abs()], dtype=torch.float64, device=self.device)
        return float(all_reduce(value, self.group, dist.ReduceOp.MAX))

    def is_finite(self) -> bool:
        return bool(self.finite_flag())

    def finite_flag(self) -> torch.Tensor:
        """Whether every rank's rows are finite (0-d bool, the same on every rank)."""
        flag = self.local.finite_flag().to(torch.float64).reshape(1)
        return all_reduce(flag, self.group, dist.ReduceOp.MIN)[0] > 0

    def row_sum(self) -> torch.Tensor:
        """``J^T 1`` of the union batch, in :attr:`dtype` (summed in float64 over ranks)."""
        return all_reduce(self.local.row_sum().to(torch.float64), self.group).to(self.dtype)



class ReplicaMismatch(ValueError):
    """The processes of a group hold replicas that differ (parameters, optimiser state or settings): raised on every
    rank by :func:`check_replicas`, naming the first differing entry and the ranks that differ. A ``ValueError``."""


CHECKSUM_CHUNK = 1 << 24  # entries of a tensor hashed at a time (an int64 temporary of 128 MiB at most)
_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def tensor_checksum(tensor: torch.Tensor) -> torch.Tensor:
    """A position-weighted sum of ``tensor``'s bits, a 0-d int64 tensor on its device: ``sum_i b_i (i mod 65521 + 1)``
    over its entries' bit patterns ``b_i`` read as integers, plus a hash of its shape and dtype, modulo ``2^64``.

    Integer sums are exact and do not depend on the order of summation (nor on threads or kernels), so equal
    tensors give equal checksums on every rank; the weights make a permutation of the entries show, and a change of
    one bit in one entry changes the sum. Cost: one pass over the tensor, in chunks of :data:`CHECKSUM_CHUNK`.

    Args:
        tensor: any tensor (floating, integer or bool; complex as its real view).

    Returns:
        The checksum, 0-d int64.
    """
    flat = tensor.detach()
    if flat.is_complex():
        flat = torch.view_as_real(flat)
    flat = flat.reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.int8)
    bits = flat.contiguous().view(_INTS[flat.element_size()]) if flat.is_floating_point() else flat
    total = torch.tensor(_setting_hash((tuple(tensor.shape), str(tensor.dtype))), dtype=torch.int64,
                         device=tensor.device)
    for start in range(0, bits.numel(), CHECKSUM_CHUNK):
        part = bits[start:start + CHECKSUM_CHUNK].to(torch.int64)
        weights = torch.arange(start, start + part.numel(), dtype=torch.int64, device=part.device) % 65521 + 1
        total += (part * weights).sum()
    return total


def _setting_hash(value: Any) -> int:
    """A signed 64-bit hash of ``repr(value)`` (blake2b: the same on every process, unlike Python's ``hash``)."""
    import hashlib

    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little", signed=True)


def check_replicas(group: Any, device: torch.device, tensors: Sequence[tuple[str, torch.Tensor]],
                   settings: dict[str, Any], when: str = "before the first step") -> None:
    """Raise :class:`ReplicaMismatch` on every rank of ``group`` unless every rank holds the same ``tensors`` (bit for
    bit, by :func:`tensor_checksum`) and the same ``settings`` (by the ``repr`` of each value).

    Data-parallel replicas that start from different weights (a model initialised with another seed on one rank,
    a checkpoint loaded on one rank only) step from the same union-batch direction and drift apart silently; this
    compares them where they must agree (an optimiser's first step, and its first step after ``load_state_dict``).
    Communication: one all-gather of two int64 per rank (the number of entries and a weighted sum of their
    checksums); only when they differ, a second all-gather of one int64 per entry, to name the first entry that
    differs. Every rank compares the same gathered numbers, so every rank raises the same error.

    Args:
        group: the process group (``None``: nothing to compare).
        device: where the group's collectives take tensors (:func:`collective_device`).
        tensors: ``(name, tensor)`` in the same order on every rank (the model's parameters, the optimiser's state).
        settings: ``name -> value`` (the optimiser's hyperparameters and step count).
        when: when the check runs, for the message.

    Raises:
        ReplicaMismatch: on every rank, naming the first differing entry and the ranks whose value differs from
            rank 0's, or the ranks' numbers of entries when those differ.
    """
    if group is None:
        return
    names = [f"parameter or state {name!r}" for name, _ in tensors] + [f"setting {key!r}" for key in settings]
    sums = [tensor_checksum(t).to(device) for _, t in tensors]
    sums += [torch.tensor(_setting_hash(value), dtype=torch.int64, device=device) for value in settings.values()]
    local = torch.stack(sums) if sums else torch.zeros(0, dtype=torch.int64, device=device)
    weights = torch.arange(1, local.numel() + 1, dtype=torch.int64, device=device) * 2654435761
    head = torch.stack([torch.tensor(local.numel(), dtype=torch.int64, device=device), (local * weights).sum()])
    heads = all_gather_rows(head[None], [1] * world_size(group), group).cpu()  # [R, 2]
    if bool((heads == heads[0]).all()):
        return
    counts = heads[:, 0].tolist()
    advice = ("the replicas must start equal: load the same weights on every rank (or broadcast rank 0's, as "
              "DistributedDataParallel does when it wraps the model) and construct the optimiser with the same "
              "settings everywhere; nothing was changed")
    if len(set(counts)) > 1:
        raise ReplicaMismatch(f"the ranks hold different numbers of parameters, state tensors and settings {when} "
                              f"(per rank: {counts}): {advice}")
    table = all_gather_rows(local[None], [1] * world_size(group), group).cpu()  # [R, entries]
    differ = (table != table[0]).any(dim=0)
    first = int(torch.nonzero(differ)[0])
    ranks = [r for r in range(table.shape[0]) if table[r, first] != table[0, first]]
    raise ReplicaMismatch(f"the processes' replicas differ {when}: {names[first]} differs between rank 0 and "
                          f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} "
                          f"({int(differ.sum())} of {len(names)} entries differ): {advice}")
