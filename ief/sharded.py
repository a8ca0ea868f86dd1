"""The exact EF / iEF / SF step on a model sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``), as one
process stepping on the union of the ranks' batches.

FSDP2 keeps every parameter as a ``DTensor`` whose local shard is rank ``r``'s slice of its first dimension
(``Shard(0)``, ``torch.chunk``'s split: ``ceil(d0 / R)`` rows a rank, the last ranks' fewer or none); a module's
forward all-gathers
its parameters (``unshard``), registers them as plain tensors, and its ``reshard`` puts the shards back. A step here:

1. **Rows, under FSDP2's own per-module unshard** (:meth:`ShardedModel.layerwise`). The step's forward and
   per-sample backward (:func:`ief.per_sample`: hooks on the modules, stand-ins for their parameters) run through
   FSDP2's hooks, gradient reduction switched off: each module's parameters are all-gathered for its forward and
   again for its backward and freed after each (with FSDP2's ``reshard_after_forward``), so no rank holds more of the
   model unsharded than FSDP2's own step does, and no reduce-scatter runs (no batch gradient is formed). Every FSDP2
   forward and backward is a collective, so every rank must run the same ones, while a rank's own batch decides
   whether its per-sample machinery runs more than one forward and one backward (the sample-axis probe and proof of
   a shape it has not proven, none for one sample; the per-sample loop's backward per sample). The ranks agree
   (:class:`RowAgreement`: one all-reduce of two numbers after the forward, one before the backward); where any rank
   needs more, every rank unshards every module for the rest of the step (the same all-gathers on every rank) and
   the extra forwards and backwards are its own, with no collective. **Every module unsharded once** for the whole
   step (:meth:`ShardedModel.unsharded`: one all-gather per parameter group, ``reshard_after_forward`` and
   reduction off) is the route of the exact check's steps (its forward-mode and float32 passes) and of a model
   FSDP2 has not yet unsharded; the step report's ``sharding`` names the route taken (:data:`LAYERWISE_ROUTE`,
   :data:`ROUTE`). A steady step (batch shapes seen before, every parameter covered by a layer rule) takes its rows
   layer by layer; the first step of a new shape on any rank does not.
2. **The union's Gram, as the replicated route.** This rank's rows go to
   :class:`ief.distributed.DistributedRows` (the Gram's cross-rank blocks from the layers' factors where
   :func:`ief.distributed.gram_plan` finds them smaller, one replicated float64 solve).
3. **A shard-sized direction.** Each rank forms only the entries of the direction its local shards hold
   (:meth:`ShardedModel.combine`): a Linear weight whose factors the Gram gathered takes its shard's output rows from
   the union's factors (no collective), every other parameter is reduce-scattered in FSDP2's ``Shard(0)`` chunks
   from this rank's part; the direction's norm and finiteness are the union's (one all-reduce of a number each).
4. **The update on the local shards.** ``DTensor.to_local()`` is updated in place, with the momentum buffers kept as
   local shards (:meth:`ShardedModel.local`). (``SF``'s direction needs the whole gradient: it is formed whole on
   every rank, as in the replicated route, and its shards taken from it.)

Cost against FSDP2 + AdamW on the same model: communication, layer by layer FSDP2's own all-gathers (forward and
backward; every module unsharded at once: one all-gather of every group) and no reduce-scatter of gradients, two
all-reduces of two numbers (the agreement), the replicated route's Gram all-gathers and reduce-scatters of the
non-factored parameters' direction (no all-reduce of a ``[P]`` vector); memory, layer by layer the parameters FSDP2
holds unsharded in its own forward and backward (every parameter unsharded during the forward, per-sample backward
and solve on the other route, as FSDP2 with ``reshard_after_forward=False``), the rows, and a ``[P / R]`` direction
in the rows' dtype (a float64 block of at most ``ief.rows.COLUMN_BYTES`` or one non-factored parameter at a time);
the optimiser state (momentum buffers) is sharded. A steady step's peak is then the update's (shards, momentum
buffers and the shard-sized direction), not the gathered parameters'. An error raised inside the forward on one rank
only leaves the other ranks in FSDP2's all-gathers until the process group's timeout, as under FSDP2 + AdamW; one
raised after it (a target out of range, a non-finite loss or row) ends every rank with that rank's sentence.

**Mixed precision** (``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``): the step runs
as :mod:`ief.precision` runs a model with bfloat16 weights, which is what FSDP2's all-gather hands the forward: the
forward, the per-sample backward and the rows in bfloat16, the Gram, the solve and each direction entry's sum in
float64, the direction rounded once to bfloat16 (the rows' dtype); it then updates FSDP2's float32 shards in float32
(a float32 master copy: a change below a bfloat16 spacing is kept, the momentum buffers are float32).
``reduce_dtype`` is not used: the step reduces no gradient (the direction's reduce-scatter sums float64).

**Checkpoints.** The optimisers' ``state_dict`` holds this rank's momentum shards; :func:`local_state` and
:func:`load_local_state` save and restore this rank's parameter shards beside it, one file a rank, resumed bit for
bit on the same number of processes (:class:`ief.hf.IEFTrainer` checkpoints an FSDP2 model so).

Refused before any work, in one sentence each (:func:`inspect`): HSDP and tensor parallel (a parameter on a mesh of
more than one dimension or not ``Shard(0)``), ``DTensor`` parameters that no ``fully_shard`` manages, CPU offload
(``CPUOffloadPolicy``), a ``MixedPrecisionPolicy`` computing in float16 (:mod:`ief.precision`), a model of
which some trained parameters are FSDP2's and others are not, FSDP2 modules on different process groups, a
``process_group`` other than FSDP2's, an optimiser that cannot step on shards (``KFAC``: its factors precondition
each layer's whole gradient) and ``lr="auto"`` (its probe forward sets every parameter).
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .distributed import PeerFailure
from .rows import COLUMN_BYTES

ROUTE = "fsdp2-unsharded-step"  # a step with every module unsharded once (the step report's "sharding")
LAYERWISE_ROUTE = "fsdp2-layerwise-rows"  # a step whose rows were taken under FSDP2's own per-module unshard
# The agreement of the ranks of a step taking its rows layer by layer (:class:`RowAgreement`), read by the per-sample
# forward (ief.jacobian) at the two points where a rank's own batch could make it call other collectives than the
# others; ``None`` outside such a step.
ROW_AGREEMENT: contextvars.ContextVar = contextvars.ContextVar("ief_row_agreement", default=None)


def _fsdp_types() -> tuple[type, type] | None:
    """``(FSDPModule, DTensor)``, or ``None`` where torch has no FSDP2."""
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - a torch without FSDP2
        return None
    return FSDPModule, DTensor


def _groups_of(module: Any) -> list:
    """The FSDP2 parameter groups of one ``fully_shard``-ed module (torch's private ``FSDPState``)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # older layout: at most one group
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return list(groups)


@dataclass
class ShardedModel:
    """An FSDP2 model as the exact optimisers step it (module docstring), built by :func:`inspect`.

    Attributes:
        modules: every ``fully_shard``-ed module of the model, in ``model.modules()`` order.
        params: the optimiser's parameters (``DTensor``), in its order.
        fsdp_params: FSDP2's record of each of ``params`` (its unsharded parameter, its shard's placement).
        group: the process group FSDP2 shards over (every module's).
        rank: this process's index in ``group``.
        world: the processes in ``group``.
        route: the route the last step took, :data:`LAYERWISE_ROUTE` or :data:`ROUTE` (the step report's
            ``sharding``).
    """

    modules: list
    params: list
    fsdp_params: list
    group: Any
    rank: int
    world: int
    route: str = ROUTE

    @contextlib.contextmanager
    def unsharded(self) -> Iterator[list[torch.Tensor]]:
        """Every module unsharded for the step's forward and per-sample backward, then resharded.

        Yields:
            The unsharded parameters (plain ``nn.Parameter``, registered in their modules) in :attr:`params`' order:
            what :func:`ief.per_sample` takes as ``params`` while the context is open.
        """
        saved = []
        for module in self.modules:
            for group in _groups_of(module):
                saved.append((group, group.post_forward_mesh_info, group.reduce_grads, group.all_reduce_grads,
                              group.reshard_after_backward))
                # no reshard after the forward or a backward (the per-sample loop's backward passes, as many as the
                # rank's samples, would each all-gather again), no reduce-scatter of a batch gradient
                group.post_forward_mesh_info = None
                group.reduce_grads = group.all_reduce_grads = group.reshard_after_backward = False
        failed = True
        try:
            for module in self.modules:
                module.unshard()
            out = [fsdp_param.unsharded_param for fsdp_param in self.fsdp_params]
            yield out
            failed = False
        finally:
            if failed:
                for module in self._roots():  # an aborted forward or backward: FSDP2's own recovery
                    with contextlib.suppress(Exception):
                        module.reset_iter_state()
            for module in self.modules:
                module.reshard()
            for group, mesh_info, reduce, all_reduce, after_backward in saved:
                group.post_forward_mesh_info = mesh_info
                group.reduce_grads, group.all_reduce_grads = reduce, all_reduce
                group.reshard_after_backward = after_backward

    def can_go_layerwise(self) -> bool:
        """Whether FSDP2 has made every parameter's unsharded tensor (at its first unshard; a model never stepped
        has not): the layer-by-layer route registers them before FSDP2's forward gathers them.

        Returns:
            ``True`` when :meth:`layerwise` can run.
        """
        return all(hasattr(fsdp_param, "_unsharded_param") for fsdp_param in self.fsdp_params)

    @contextlib.contextmanager
    def layerwise(self) -> Iterator[list[torch.Tensor]]:
        """The step's forward and per-sample backward under FSDP2's own per-module unshard and reshard (its
        all-gathers, forward and backward), with no gradient reduction; the ranks agree at the per-sample forward's
        two decision points (:class:`RowAgreement`) and, where any rank needs more than one forward and one backward,
        every module is unsharded for the rest of the step as :meth:`unsharded` does.

        The unsharded parameters stay registered in their modules between FSDP2's calls (their storage freed when
        FSDP2 reshards), so that the per-sample machinery names and hooks the same tensors as in :meth:`unsharded`;
        on exit every module is resharded and holds its sharded parameters again.

        Yields:
            The unsharded parameters in :attr:`params`' order (storage present only while FSDP2 holds them gathered).
        """
        saved = []
        for module in self.modules:
            for group in _groups_of(module):
                saved.append((group, group.post_forward_mesh_info, group.reduce_grads, group.all_reduce_grads,
                              group.reshard_after_backward))
                group.reduce_grads = group.all_reduce_grads = False  # no batch gradient is reduced
        for fsdp_param in self.fsdp_params:  # FSDP2's reshard frees the gathered data and keeps this registration
            fsdp_param.to_sharded = _freeing(fsdp_param)
            fsdp_param._setattr_on_modules(fsdp_param.unsharded_param)
        agreement = RowAgreement(self)
        token = ROW_AGREEMENT.set(agreement)
        failed = True
        try:
            yield [fsdp_param.unsharded_param for fsdp_param in self.fsdp_params]
            failed = False
        finally:
            ROW_AGREEMENT.reset(token)
            self.route = ROUTE if agreement.whole else LAYERWISE_ROUTE
            if failed:
                for module in self._roots():  # an aborted forward or backward: FSDP2's own recovery
                    with contextlib.suppress(Exception):
                        module.reset_iter_state()
            for fsdp_param in self.fsdp_params:
                del fsdp_param.to_sharded
            for module in self.modules:
                module.reshard()
            for fsdp_param in self.fsdp_params:
                fsdp_param._setattr_on_modules(fsdp_param.sharded_param)
            for group, mesh_info, reduce, all_reduce, after_backward in saved:
                group.post_forward_mesh_info = mesh_info
                group.reduce_grads, group.all_reduce_grads = reduce, all_reduce
                group.reshard_after_backward = after_backward

    def unshard_rest(self) -> None:
        """Every module unsharded, and kept so for the rest of the step (no reshard after a forward or a backward):
        the same all-gathers on every rank, from the same state.

        Returns:
            None.
        """
        for module in self.modules:
            for group in _groups_of(module):
                group.post_forward_mesh_info = None
                group.reshard_after_backward = False
        for module in self.modules:
            module.unshard()

    def _roots(self) -> list:
        inner = {id(m) for outer in self.modules for m in outer.modules() if m is not outer}
        return [m for m in self.modules if id(m) not in inner]

    @staticmethod
    def local(p: torch.Tensor) -> torch.Tensor:
        """The local shard of ``p`` (a view: an in-place change is FSDP2's next all-gather input)."""
        return p.to_local() if hasattr(p, "to_local") else p

    def bounds(self, i: int) -> tuple[int, int]:
        """The rows ``[lo, hi)`` of ``params[i]``'s first dimension that this rank's shard holds (``torch.chunk``'s
        split, FSDP2's), checked against the local shard's shape."""
        p = self.params[i]
        rows = p.shape[0]
        chunk = -(-rows // self.world)
        lo = min(self.rank * chunk, rows)
        hi = min(lo + chunk, rows)
        local = self.local(p)
        if local.shape[0] != hi - lo:
            raise RuntimeError(f"FSDP2's shard of parameter {i} has {local.shape[0]} rows on rank {self.rank}, not "
                               f"the {hi - lo} of torch.chunk's split of {rows} rows over {self.world}: this torch's "
                               f"FSDP2 shards otherwise than ief.sharded assumes")
        return lo, hi

    def local_piece(self, i: int, full: torch.Tensor) -> torch.Tensor:
        """The entries of ``full`` (``params[i]``'s whole flat ``[numel]`` slice of the direction) that this rank's
        shard holds, flat and contiguous."""
        p = self.params[i]
        lo, hi = self.bounds(i)
        return full.view(p.shape)[lo:hi].reshape(-1)

    def local_numel(self) -> int:
        """The entries of every parameter's local shard together: the size of :meth:`combine`'s direction."""
        return sum(self.local(p).numel() for p in self.params)

    def combine(self, rows: Any, coeff: torch.Tensor, scale: float) -> torch.Tensor:
        """This rank's pieces of the union's direction ``(J/scale)^T coeff``, ``[P_local]``: every parameter's rows
        ``[lo, hi)`` (:meth:`bounds`), flattened and side by side in :attr:`params`' order, the layout of the local
        shards. The whole ``[P]`` direction is never formed on any rank.

        A Linear weight whose factors the Gram gathered (``rows.plan().factors``: every rank's ``A [M, T, I]`` and
        ``G [M, T, O]``) takes its shard's output rows from the union's factors, ``(c-weighted G[..., lo:hi])^T A``:
        no collective. Every other parameter's block of this rank's ``J_r^T c_r`` (one parameter at a time, its
        full size) is summed over the ranks by a reduce-scatter of its ``Shard(0)`` chunks, FSDP2's own layout.
        Each entry is summed in float64 and rounded once to the result's dtype: the rows' own where narrower (the
        direction a one-process step returns, :meth:`ief.rows.Rows.combine_rows` with ``final``), else float64;
        float64 temporaries are bounded by ``ief.rows.COLUMN_BYTES`` for the factored weights and by one parameter
        for the others.

        Args:
            rows: the union's :class:`ief.distributed.DistributedRows` built with this model.
            coeff: the union batch's coefficients ``[M]``.
            scale: the common divisor of ``J`` (:meth:`ief.rows.Rows.gram_scale`).
        """
        coeff = coeff.to(torch.float64)
        mine = rows.local_coefficients(coeff)
        plan = rows.plan()
        factored = {entry[0]: k for k, entry in enumerate(plan.factors or [])}
        union = rows.union_factors(scale) if factored else []
        dtype = rows.dtype if rows.dtype.itemsize < 8 and rows.dtype.is_floating_point else torch.float64
        out = torch.empty(self.local_numel(), dtype=dtype, device=coeff.device)
        start = 0
        for i, p in enumerate(self.params):
            lo, hi = self.bounds(i)
            piece = out[start:start + self.local(p).numel()]
            start += piece.numel()
            if i in factored:
                a, g = union[factored[i]]
                if tuple(p.shape) == (g.shape[-1], a.shape[-1]):  # the weight's layout [O, I]: rows of G's columns
                    a = a.flatten(0, 1)  # [M T, I]
                    dest = piece.view(hi - lo, a.shape[1])
                    step = max(1, COLUMN_BYTES // (8 * max(1, a.shape[1])))
                    for r in range(lo, hi, step):  # a bounded block of output rows at a time
                        weighted = (g[..., r:min(r + step, hi)] * coeff[:, None, None]).flatten(0, 1)
                        dest[r - lo:r - lo + weighted.shape[1]].copy_(weighted.T @ a)
                    continue
            piece.copy_(self._reduce_scattered(i, rows.local_block(i, mine, scale)))
        return out

    def _reduce_scattered(self, i: int, block: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of ``block`` (this rank's ``[numel]`` float64 part of ``params[i]``'s direction),
        this rank's ``Shard(0)`` rows of it, flat: one reduce-scatter of ``ceil(d0 / R)``-row chunks (zero-padded)."""
        p = self.params[i]
        rows = p.shape[0]
        chunk = -(-rows // self.world)
        lo, hi = self.bounds(i)
        full = block.reshape(rows, -1)
        if chunk * self.world != rows:
            padded = torch.zeros(chunk * self.world, full.shape[1], dtype=full.dtype, device=full.device)
            padded[:rows] = full
            full = padded
        out = torch.empty(chunk, full.shape[1], dtype=full.dtype, device=full.device)
        gloo = dist.get_backend(self.group) == "gloo"
        source = full.cpu() if gloo else full.contiguous()
        target = out.cpu() if gloo else out
        dist.reduce_scatter_single(target, source, group=self.group)
        return target[:hi - lo].reshape(-1).to(block.device)

    def union_flag(self, flag: torch.Tensor) -> torch.Tensor:
        """A 0-d bool of this rank's shards (e.g. its momentum buffers' finiteness), true on every rank only when
        true on every rank (one all-reduce)."""
        value = flag.to(torch.float64).reshape(1).cpu() if dist.get_backend(self.group) == "gloo" else \
            flag.to(torch.float64).reshape(1)
        dist.all_reduce(value, op=dist.ReduceOp.MIN, group=self.group)
        return (value[0] > 0).to(flag.device)

    def union_sqnorm(self, local_sqnorm: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of a squared norm of their shards (float64)."""
        value = local_sqnorm.to(torch.float64).reshape(1)
        if dist.get_backend(self.group) == "gloo":
            value = value.cpu()
        dist.all_reduce(value, group=self.group)
        return value[0]


def _freeing(fsdp_param: Any):
    """FSDP2's ``to_sharded`` for :meth:`ShardedModel.layerwise`: the gathered data freed, the module left holding
    the (empty) unsharded parameter instead of the sharded one."""
    def to_sharded() -> None:
        fsdp_param.free_unsharded_param()
        fsdp_param.sharded_state = type(fsdp_param.sharded_state).SHARDED

    return to_sharded


class RowAgreement:
    """The ranks' agreement in a step that takes its rows layer by layer (:meth:`ShardedModel.layerwise`).

    Each FSDP2 module's forward and backward is a collective, so every rank must run the same forwards and backwards.
    A rank's own batch decides whether its per-sample machinery runs more than the step's one forward and one
    backward: the sample-axis probe and proof forwards (a batch of a shape it has not proven), the per-sample loop's
    backward passes (one per sample, for parameters no layer rule covers). The per-sample forward asks
    :meth:`agree` twice, after the forward (any rank about to probe?) and before the backward (any rank with a looped
    parameter?), each time with whether it failed: one all-reduce of two numbers. Where any rank needs more, every
    rank unshards every module for the rest of the step (:meth:`ShardedModel.unshard_rest`) and its extra forwards and
    backwards are its own, with no collective; where any rank failed, every rank raises before the backward's
    collectives (the failing rank its own error, the others :class:`ief.distributed.PeerFailure`, which
    :func:`ief.distributed.agree` turns into the failing rank's sentence). An error raised inside the forward itself
    on one rank only leaves the others in FSDP2's all-gathers until the process group's timeout, as it does under
    FSDP2 + AdamW.

    Attributes:
        whole: whether every module was unsharded for the rest of the step.
    """

    def __init__(self, sharded: ShardedModel):
        self.sharded = sharded
        self.whole = False

    def agree(self, failure: BaseException | None, more: bool) -> None:
        """Share this rank's failure and whether it needs more than one forward and one backward; unshard every
        module where any rank needs more (once a step). Once every module is unsharded, no collective: what follows
        is each rank's own, and :func:`ief.distributed.agree` ends the step on every rank alike.

        Args:
            failure: this rank's exception since the last agreement (``None``: none).
            more: whether this rank is about to run a forward or backward of its own (a probe, the per-sample loop).

        Returns:
            None.

        Raises:
            ``failure`` on this rank; :class:`ief.distributed.PeerFailure` where another rank failed.
        """
        if self.whole:  # every module unsharded: what follows is this rank's own (ief.distributed.agree's)
            if failure is not None:
                raise failure
            return
        flags = torch.tensor([float(failure is not None), float(more)], dtype=torch.float64)
        if dist.get_backend(self.sharded.group) != "gloo":
            flags = flags.to(self.sharded.fsdp_params[0].sharded_param.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.sharded.group)
        if failure is not None:
            raise failure
        if float(flags[0]) > 0:
            raise PeerFailure("another rank failed in its per-sample forward")
        if float(flags[1]) > 0 and not self.whole:
            self.sharded.unshard_rest()
            self.whole = True


def _refuse(name: str, what: str) -> ValueError:
    return ValueError(f"{name} cannot step on this FSDP2 model: {what}")


def _fsdp_records(model: torch.nn.Module, name: str) -> tuple[list, dict[int, Any]]:
    """The model's ``fully_shard``-ed modules and FSDP2's record of every parameter they shard (by ``id`` of the
    sharded parameter), each group checked for what :func:`inspect` refuses."""
    types = _fsdp_types()
    if types is None:
        return [], {}
    fsdp_module, _ = types
    modules = [m for m in model.modules() if isinstance(m, fsdp_module)]
    records: dict[int, Any] = {}
    for module in modules:
        for group in _groups_of(module):
            mesh_info = group.mesh_info
            if type(mesh_info).__name__ == "HSDPMeshInfo" or mesh_info.mesh.ndim != 1:
                raise _refuse(name, f"{type(module).__name__} is sharded over a {mesh_info.mesh.ndim}-dimensional "
                                    f"device mesh (HSDP or FSDP with tensor parallel); only a one-dimensional "
                                    f"fully_shard mesh is supported")
            for fsdp_param in group.fsdp_params:
                if getattr(fsdp_param, "offload_to_cpu", False):
                    raise _refuse(name, "its parameters are offloaded to the CPU (CPUOffloadPolicy), which the "
                                        "step's in-place update of the shards does not support; shard without "
                                        "offload_policy")
                policy = fsdp_param.mp_policy
                if torch.float16 in (policy.param_dtype, policy.output_dtype):
                    raise _refuse(name, f"its MixedPrecisionPolicy computes in float16 (param_dtype="
                                        f"{policy.param_dtype}, output_dtype={policy.output_dtype}), whose "
                                        f"per-sample gradients underflow (ief.precision); use "
                                        f"param_dtype=torch.bfloat16")
                if getattr(fsdp_param, "fsdp_placement", None) is not None and fsdp_param.fsdp_placement.dim != 0:
                    raise _refuse(name, f"a parameter is sharded on dimension {fsdp_param.fsdp_placement.dim} "
                                        f"(shard_placement_fn); only FSDP2's default Shard(0) is supported")
                records[id(fsdp_param.sharded_param)] = (fsdp_param, group)
    return modules, records


def _refuse_foreign(model: torch.nn.Module, records: dict[int, Any], name: str) -> None:
    """Refuse ``DTensor`` parameters that no ``fully_shard`` manages (tensor parallel, ``distribute_tensor``)."""
    _, dtensor = _fsdp_types()
    foreign = [p for p in model.parameters() if isinstance(p, dtensor) and id(p) not in records]
    if foreign:
        raise _refuse(name, f"it has DTensor parameters that no fully_shard manages (tensor parallel or "
                            f"distribute_tensor, placements {foreign[0].placements}); only fully_shard's "
                            f"one-dimensional sharding is supported")


def inspect(model: torch.nn.Module, params: Sequence[torch.Tensor], name: str, *, supported: str | None,
            auto_lr: bool, process_group: Any) -> ShardedModel | None:
    """Whether ``model`` is an FSDP2 model, and everything the step cannot do on it refused before any work.

    Args:
        model: the model as given to the optimiser.
        params: the optimiser's parameters.
        name: the optimiser's class name, for the messages.
        supported: ``None`` when the optimiser steps on FSDP2 shards, else the reason it cannot (one clause).
        auto_lr: whether ``lr="auto"`` was asked for.
        process_group: the ``process_group`` given to the optimiser (``None``: FSDP2's).

    Returns:
        ``None`` for a model with no FSDP2 module and no ``DTensor`` parameter; else its :class:`ShardedModel`.

    Raises:
        ValueError: one sentence naming what is refused (module docstring).
    """
    if _fsdp_types() is None:
        return None
    modules, records = _fsdp_records(model, name)
    _refuse_foreign(model, records, name)
    if not modules:
        return None
    if supported is not None:
        raise _refuse(name, supported)
    if auto_lr:
        raise _refuse(name, "lr='auto' measures the loss along the last step with every parameter set in place, "
                            "which the shards do not allow; give a number")
    unmanaged = [i for i, p in enumerate(params) if id(p) not in records]
    if unmanaged:
        raise _refuse(name, f"params[{unmanaged[0]}] (shape {tuple(params[unmanaged[0]].shape)}) is not sharded by "
                            f"fully_shard while others are (a model partly FSDP2 and partly not); apply "
                            f"fully_shard to the module holding every trained parameter (e.g. the root)")
    meshes = {id(records[id(p)][1].mesh_info.mesh) for p in params}
    groups = [records[id(p)][1].mesh_info.mesh.get_group() for p in params]
    ranks = {tuple(dist.get_process_group_ranks(g)) for g in groups}
    if len(ranks) > 1:
        raise _refuse(name, f"its modules are sharded over {len(meshes)} different process groups {sorted(ranks)}; "
                            f"shard them all over one mesh")
    group = groups[0]
    if process_group is not None and (
            tuple(dist.get_process_group_ranks(process_group)) != next(iter(ranks))):
        raise _refuse(name, f"process_group holds ranks {dist.get_process_group_ranks(process_group)} but FSDP2 "
                            f"shards over ranks {list(next(iter(ranks)))}; pass no process_group (FSDP2's is taken)")
    return ShardedModel(modules, list(params), [records[id(p)][0] for p in params], group,
                        dist.get_rank(group), dist.get_world_size(group))


def is_fsdp2(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds a module that ``fully_shard`` manages (FSDP2)."""
    types = _fsdp_types()
    return types is not None and any(isinstance(m, types[0]) for m in model.modules())


def local_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's part of ``model.state_dict()``: each ``DTensor`` entry's local shard (an FSDP2 parameter's rows on
    this rank), every other entry as it is, all cloned to the CPU: what :func:`load_local_state` writes back, bit for
    bit, on the same number of processes (a checkpoint of a sharded model, one file a rank)."""
    return {name: local_tensor(value).detach().to("cpu", copy=True) for name, value in model.state_dict().items()}


def load_local_state(model: torch.nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
    """Write :func:`local_state`'s output back into ``model``'s parameters and buffers, in place (an FSDP2
    parameter's local shard: FSDP2's next all-gather reads it).

    Args:
        model: the model, sharded as when ``state`` was taken.
        state: :func:`local_state`'s output for this rank.
        where: the checkpoint, for the message.

    Raises:
        ValueError: ``state`` lacks an entry of the model's, holds one it does not have, or an entry's shape or dtype
            differs (another model's, or another sharding's: another number of processes); nothing written.
    """
    targets = {name: local_tensor(value) for name, value in model.state_dict().items()}
    missing, extra = sorted(set(targets) - set(state)), sorted(set(state) - set(targets))
    if missing or extra:
        raise ValueError(f"{where} holds another model's state: it lacks {missing[:3]} and has {extra[:3]} that this "
                         f"model does not")
    for name, target in targets.items():
        saved = state[name]
        if tuple(saved.shape) != tuple(target.shape) or saved.dtype != target.dtype:
            raise ValueError(f"{where}: {name!r} is {saved.dtype} {tuple(saved.shape)} there and {target.dtype} "
                             f"{tuple(target.shape)} on this rank (another model, or sharded over another number of "
                             f"processes); resume on the processes that saved it")
    with torch.no_grad():
        for name, target in targets.items():
            target.copy_(state[name])


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """``p``'s local shard for a ``DTensor`` (a view, updated in place), ``p`` itself otherwise."""
    return p.to_local() if hasattr(p, "to_local") else p


def default_group(model: torch.nn.Module, name: str) -> Any:
    """The process group FSDP2 shards ``model`` over (its first ``fully_shard``-ed module's), ``None`` for a model
    without one: an optimiser given no ``process_group`` steps across FSDP2's. What no group could make right
    (:func:`inspect`'s refusals of the mesh, offload, mixed precision, ``DTensor`` parameters no ``fully_shard``
    manages) is refused here already, before the group is resolved.

    Raises:
        ValueError: as :func:`inspect`, for the model alone.
    """
    types = _fsdp_types()
    if types is None:
        return None
    modules, records = _fsdp_records(model, name)
    _refuse_foreign(model, records, name)
    for module in modules:
        for group in _groups_of(module):
            return group.mesh_info.mesh.get_group()
    return None


@contextlib.contextmanager
def unsharded_group(sharded: ShardedModel | None, group: dict, layerwise: bool = False) -> Iterator[dict]:
    """``group`` (an optimiser's step values) as the per-sample machinery takes it: unchanged without sharding,
    else with ``params`` the unsharded parameters while :meth:`ShardedModel.layerwise` (``layerwise``, where FSDP2
    has made them) or :meth:`ShardedModel.unsharded` holds them. ``layerwise`` must be the same on every rank."""
    if sharded is None:
        yield group
        return
    if layerwise and sharded.can_go_layerwise():
        with sharded.layerwise() as params:
            yield dict(group, params=params)
        return
    sharded.route = ROUTE
    with sharded.unsharded() as params:
        yield dict(group, params=params)
