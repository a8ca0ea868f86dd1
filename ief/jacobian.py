"""Per-sample gradients ``J = grad_theta l`` (``[M, P]``), logit-gradient norms ``s_iEF`` and sampled Jacobians (SF).

How: module hooks, as in the paper (``sec:app-iEF-impl``). One forward and one backward of ``L = sum_n l_n``;
forward hooks keep each hooked module's input and a tensor hook on its output keeps the gradient flowing back.
Because sample ``n``'s output only reaches ``l_n``, the per-sample weight gradient of a linear layer is
``g_n^T a_n`` summed over that sample's positions, formed with one batched matmul.

Why hooks rather than ``torch.func.vmap``: vmapping a transformers 5.x forward that takes an ``attention_mask``
fails on a data-dependent check in ``transformers.masking_utils``, whereas hooks only see ordinary module calls,
work with every attention implementation (SDPA included) and add little to a plain backward for LoRA and prompt
parameters. Layers with hooks: ``nn.Linear`` (LoRA A/B, heads, MLPs), HF ``Conv1D`` (GPT-2, :mod:`ief.layer_rules`),
``nn.Embedding`` (prompt tuning),
``nn.LayerNorm``, ``nn.GroupNorm``, ``nn.Conv2d`` / ``nn.Conv1d`` with zero padding (unfolded: a linear layer over
the output positions, see :mod:`ief.conv_rules`) and ``nn.BatchNorm1d`` / ``nn.BatchNorm2d`` in eval mode (running
statistics: a per-channel affine map). Bare
parameters and embedding calls that every sample shares (ViT's ``cls_token`` and ``position_embeddings``, position
embeddings fed ``[1, T]`` ids) have rows too when their only uses add them to, or expand them over, the batch
(:mod:`ief.broadcast_uses`).

The sample axis of every hooked call is established, never guessed from a size: a probe forward of the batch's first
sample alone (every input tensor cut to one sample along its leading dimension; hooks that only record shapes; the
random state and the model's buffers untouched) shows which dimension of each call's input shrinks from ``M`` to 1
while every other dimension stays put. That dimension is the call's sample axis (dimension 1 for a sequence-first
``[T, M, E]`` layer, whatever ``T``); a call without exactly one such dimension (a batch of one prompt shared by all
samples, inputs flattened across samples, a call the probe does not repeat) has no established axis. The probe's
verdict is cached per model and per shape signature (every hooked call's input shape and the inputs' shapes), so a
training loop with fixed shapes pays for it once; any new shape, ``T == M`` included, is probed afresh. With
``M = 1`` every call belongs to the one sample and no probe is needed.

``J`` comes in two forms (``form=``): the ``[M, P]`` tensor (``"dense"``), or a :class:`~ief.rows.FactoredJacobian`
(``"auto"``, the optimisers' default; ``"ghost"``, ``"rows"``) that keeps each ``nn.Linear`` / HF ``Conv1D`` weight
(and each one-group ``nn.Conv2d`` / ``nn.Conv1d`` weight, its input unfolded) as its layer's hooked inputs and output
gradients and gives ``J J^T``, ``J^T c``, ``J v``, ``J^T 1`` and the row norms from them (the Gram solve, the batch
gradient, the guard and the exact check need nothing else), so that exact EF / iEF / SF never form ``[M, P]``.

Every trainable parameter that is not in a hooked module (a convolution with reflect / circular padding, an RNN, an
``nn.MultiheadAttention`` with dropout in training, a bare ``nn.Parameter`` used otherwise than broadcast), whose
module had a call without an established sample axis, or that is also used outside its hooked module (a tied weight,
see below) falls back to an exact per-sample loop of backward passes (``M`` backward passes: exact, slower); a
:class:`SlowPathWarning` names those parameters once per model.

The hooks assume what per-sample gradients presuppose: sample ``n``'s slice of a hooked input depends on sample ``n``
alone (no layer mixes or reorders samples along the sample axis), and that a hooked parameter is used only by its
module's calls. The latter is made structural: while a hooked module runs its forward, each of its parameters being
differentiated is replaced by a *stand-in* (``p.detach().requires_grad_()``: a fresh leaf on ``p``'s storage, no
copy), so autograd reaches ``p`` itself only through uses outside its hooked calls (a tied weight: an
``nn.Embedding`` table reused by an ``F.linear`` head, GPT-2's ``lm_head``). One walk over the forward's graph
(:func:`ief.model_call.scan_graph`) finds such a ``p`` (its gradient accumulator is in the graph) before the
backward, and its module's parameters take the loop, whose backward passes differentiate ``p`` and its stand-ins
together: the rows are then exact whatever ``check``. The guard, on by default, reads what the batch backward gives
the remaining hooked parameters, ``o = g - sum_n J_n``: ``None`` (by construction, cost ~0) unless a use escaped that
search, when :class:`PerSampleGradientMismatch` names the parameter. It also refuses batch norm with batch
statistics. A side effect is a cheaper backward: autograd never computes the hooked layers' batch weight gradients
(the stand-ins are not asked for); the batch gradient, when wanted, is ``J^T 1`` (:attr:`PerSample.gradient`,
computed on first access). A custom layer that mixes or reorders samples (its hooked rows still add up) is what
``check="exact"`` is for (:func:`check_directional_derivatives`: every row against ``K = 8`` exact per-sample
directional derivatives, relative to their own size, so that a 1 % error in any row is caught whatever ``P`` and
the dtype); the optimisers run that exact check on their first step. Non-finite losses or rows raise
``FloatingPointError`` naming the samples.

Activation checkpointing (``torch.utils.checkpoint``): the non-reentrant kind is exact (the backward runs in the
forward's kernel context, so its recomputation saves what the forward saved); HuggingFace layers checkpointed
reentrantly are run non-reentrantly, and any other reentrant checkpoint raises (:mod:`ief.model_call`).
"""
from __future__ import annotations

import contextlib
import math
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from .conv_rules import conv_factors, conv_is_unfoldable
from .broadcast_uses import Use, UseTracker, establish, per_sample_rows, sum_mismatch
from .layer_rules import (groupnorm_grads, hf_conv1d_grads, is_hf_conv1d, mha_batch_dim, mha_grads, mha_is_replayable,
                          write_block)
from .logit_jvp import differentiable_kernels, jvps_any_mode
from .losses import Loss, get_loss, logit_sqnorm
from .model_call import (
    Inputs,
    ReplayableForward,
    all_finite,
    batch_size,
    call_model,
    check_targets,
    column_chunks,
    flatten,
    large_empty,
    non_reentrant_checkpointing,
    param_names,
    resolve_params,
    shapes_of,
    take_first,
    unwrap_model,
)
from .rows import FactoredJacobian, check_form, prefer_ghost


class PerSampleGradientMismatch(RuntimeError):
    """The per-sample gradients do not add up to the batch gradient.

    Raised by :func:`per_sample`, :func:`sampled_jacobian` and the optimisers' steps when the guard (``check=True``,
    the default) finds batch norm with batch statistics or a hooked parameter used outside its hooked module, or when
    ``check="exact"`` (the optimisers' first step) finds a row that differs from the exact per-sample directional
    derivatives (a layer that mixes samples). The message names the parameter or the samples. Tied weights are not
    refused: they take the exact per-sample loop.
    """


def _check_sums(rows: torch.Tensor, batch_grad: torch.Tensor | None, name: str) -> None:
    """:class:`PerSampleGradientMismatch` when a broadcast tensor's rows miss a use
    (:func:`ief.broadcast_uses.sum_mismatch`)."""
    mismatch = sum_mismatch(rows, batch_grad, name)
    if mismatch is not None:
        raise PerSampleGradientMismatch(mismatch)


class SlowPathWarning(UserWarning):
    """A trainable parameter's per-sample gradients need one backward pass per sample (exact, but slow).

    Issued by :func:`per_sample` (and everything built on it), once per model, naming the parameters: layers without
    a hook (``Conv2d`` with reflect/circular padding, ``Conv1d``, RNNs, ``MultiheadAttention``'s projections, bare
    ``nn.Parameter`` s), a hooked layer whose input has no sample dimension, or peft prompt tuning before
    :func:`ief.per_sample_prompts`. Cost: about ``M`` times a gradient for those parameters.
    """


@dataclass
class PerSample:
    """Per-sample quantities at one point (``eqn:prob_loss``), returned by :func:`per_sample`.

    Attributes:
        losses: ``[M]``, ``l_n``.
        jacobian: ``[M, P]``, row ``n`` is ``grad_theta l_n`` (a tensor, or a :class:`~ief.rows.FactoredJacobian` with
            ``per_sample(..., form="auto")``).
        logit_sqnorm: ``[M]``, ``||grad_{z_n} l_n||^2`` (``s_iEF``, ``eqn:s_ief``).
        gradient: ``[P]``, the batch gradient ``grad_theta L``.

    From :func:`per_sample`, ``gradient`` is computed on first access: the hooked parameters' rows summed
    (``J^T 1``, the batch backward does not compute their batch gradients) plus any use outside their hooked
    modules, autograd's batch gradient for the others. It reads ``jacobian``: with ``out=``, read it before the
    buffer is reused.
    """

    losses: torch.Tensor
    jacobian: torch.Tensor | FactoredJacobian
    logit_sqnorm: torch.Tensor
    gradient: torch.Tensor

    def __getstate__(self) -> dict:  # pickling and deep copies hold the gradient, not the way to compute it
        self.gradient
        return self.__dict__


class _Deferred:
    """A value computed on first use (:attr:`PerSample.gradient`)."""

    def __init__(self, compute: Callable[[], torch.Tensor]):
        self.compute = compute


def _get_gradient(self: PerSample) -> torch.Tensor:
    if isinstance(self._gradient, _Deferred):
        self._gradient = self._gradient.compute()
    return self._gradient


def _set_gradient(self: PerSample, value) -> None:
    self._gradient = value


PerSample.gradient = property(_get_gradient, _set_gradient, doc="``grad_theta L``, ``[P]``")


# --------------------------------------------------------------------------------------------------- hooked layers
# Each rule writes the per-sample gradients of one module call into ``dests`` (name -> ``[M, numel]`` column block of
# J, a strided view), copying on the first call of the module and adding on later calls (``accumulate``).
def _linear_grads(module: torch.nn.Linear, a: torch.Tensor, g: torch.Tensor, dests, accumulate: bool) -> None:
    m, dtype = a.shape[0], next(iter(dests.values())).dtype
    a = a.reshape(m, -1, a.shape[-1]).to(dtype)  # [M, T, in]
    g = g.reshape(m, -1, g.shape[-1]).to(dtype)  # [M, T, out]
    if "weight" in dests:  # sum_t g_t a_t^T, written in place: no J-sized temporary
        block = dests["weight"].unflatten(1, (g.shape[-1], a.shape[-1]))  # [M, out, in]
        block.baddbmm_(g.transpose(1, 2), a, beta=1 if accumulate else 0)
    if "bias" in dests:
        write_block(dests["bias"], g.sum(dim=1), accumulate)


def _embedding_grads(module: torch.nn.Embedding, idx: torch.Tensor, g: torch.Tensor, dests, accumulate: bool,
                     rows: torch.Tensor | None = None) -> None:
    """Per-sample gradients of an embedding table: ``dests["weight"]`` ``[M, V D]``, or with ``rows`` (sorted
    distinct ids, ``[U]``, holding every id of ``idx``) only those rows of the table, ``[M, U D]``."""
    dest = dests["weight"]
    m, dim = idx.shape[0], g.shape[-1]
    idx = idx.reshape(m, -1)  # [M, T]
    g = g.reshape(m, -1, dim).to(dest.dtype)  # [M, T, D]
    if module.padding_idx is not None:
        g = g * (idx != module.padding_idx).unsqueeze(-1).to(g.dtype)
    if rows is not None:
        idx = torch.searchsorted(rows, idx.contiguous())  # each id's place among the used rows
    block = dest.unflatten(1, (module.num_embeddings if rows is None else rows.numel(), dim))  # [M, V or U, D]
    if not accumulate:
        block.zero_()
    block.scatter_add_(1, idx.unsqueeze(-1).expand(-1, -1, dim), g)


def _layernorm_grads(module: torch.nn.LayerNorm, x: torch.Tensor, g: torch.Tensor, dests, accumulate: bool) -> None:
    m, dims = x.shape[0], tuple(range(-len(module.normalized_shape), 0))
    x = x.to(g.dtype)
    centred = x - x.mean(dim=dims, keepdim=True)  # two passes, as Tensor.var, without its slower CPU kernel
    x_hat = centred * torch.rsqrt(centred.square().mean(dim=dims, keepdim=True) + module.eps)
    shape = (m, -1, *module.normalized_shape)
    if "weight" in dests:
        write_block(dests["weight"], (g * x_hat).reshape(shape).sum(dim=1), accumulate)
    if "bias" in dests:
        write_block(dests["bias"], g.reshape(shape).sum(dim=1), accumulate)


def _conv_grads(module: torch.nn.Module, x: torch.Tensor, g: torch.Tensor, dests, accumulate: bool) -> None:
    dtype = next(iter(dests.values())).dtype
    a, g = conv_factors(module, x.to(dtype), g.to(dtype))  # [M, groups, L, I], [M, groups, L, O]
    m, groups = a.shape[:2]
    if "weight" in dests:  # per group sum_l g_l a_l^T; in place (no J-sized temporary) without groups
        block = dests["weight"].unflatten(1, (groups, g.shape[-1], a.shape[-1]))  # [M, groups, O, I]
        if groups == 1:
            block[:, 0].baddbmm_(g[:, 0].transpose(1, 2), a[:, 0], beta=1 if accumulate else 0)
        else:
            write_block(block, g.transpose(2, 3) @ a, accumulate)
    if "bias" in dests:
        write_block(dests["bias"], g.sum(dim=2), accumulate)


def _batchnorm_eval_grads(module: torch.nn.Module, x: torch.Tensor, g: torch.Tensor, dests, accumulate) -> None:
    """Batch norm with running statistics (eval mode) is a per-channel affine map of ``x_hat``: sample ``n``'s
    gradients are ``sum_positions g * x_hat`` (weight) and ``sum_positions g`` (bias); ``x [M, C, *positions]``
    (``BatchNorm1d``: ``[M, C]`` or ``[M, C, L]``; ``BatchNorm2d``: ``[M, C, H, W]``)."""
    m, c = x.shape[:2]
    x, g = x.to(g.dtype).reshape(m, c, -1), g.reshape(m, c, -1)
    x_hat = (x - module.running_mean.to(g.dtype).view(1, -1, 1)) * torch.rsqrt(
        module.running_var.to(g.dtype).view(1, -1, 1) + module.eps
    )
    if "weight" in dests:
        write_block(dests["weight"], (g * x_hat).sum(dim=2), accumulate)
    if "bias" in dests:
        write_block(dests["bias"], g.sum(dim=2), accumulate)


BATCH_FIRST = -1  # "features" of a layer whose input is [N, C, *] and whose sample axis can only be N (normalisations)


def _hook_rule(module: torch.nn.Module) -> tuple[Callable, int] | None:
    """The rule of a hooked module type and how many trailing dimensions of its input are features (not samples), or
    :data:`BATCH_FIRST`."""
    if type(module) is torch.nn.Linear:
        return _linear_grads, 1
    if is_hf_conv1d(module):
        return hf_conv1d_grads, 1
    if conv_is_unfoldable(module):
        return _conv_grads, 3 if type(module) is torch.nn.Conv2d else 2
    if (
        type(module) in (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d) and module.affine and not module.training
        and module.running_mean is not None
    ):
        return _batchnorm_eval_grads, BATCH_FIRST
    if type(module) is torch.nn.GroupNorm and module.affine:
        return groupnorm_grads, BATCH_FIRST
    if mha_is_replayable(module):
        return mha_grads, 1
    if type(module) is torch.nn.Embedding and module.max_norm is None and not module.scale_grad_by_freq:
        return _embedding_grads, 0
    if type(module) is torch.nn.LayerNorm and getattr(module, "elementwise_affine", True):
        return _layernorm_grads, len(module.normalized_shape)
    return None


WHOLE_CALL = -1  # the sample "axis" of every call when M = 1: the whole call belongs to sample 0


def _owner(module: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    """The (sub)module holding parameter ``name`` of ``module`` (``"out_proj.weight"``) and its own name for it."""
    prefix, _, leaf = name.rpartition(".")
    return (module.get_submodule(prefix) if prefix else module), leaf


class _BroadcastCall:
    """The "axis" of an embedding call whose ids every sample shares (``[1, T]`` positions): its output's uses
    broadcast it over the batch, and each sample's gradient of the output comes from them (:mod:`ief.broadcast_uses`).
    """

    __slots__ = ("uses",)

    def __init__(self, uses: list):
        self.uses = uses


def _use_shapes(uses: dict) -> tuple:
    """The recorded uses as hashable shapes: ``((key, ((name, shape, result shape), ...)), ...)``."""
    return tuple((key, tuple((u.name, u.shape, u.result_shape) for u in us)) for key, us in uses.items())


def _uses_from(shapes: tuple) -> dict:
    """The inverse of :func:`_use_shapes` (shapes only, no gradients)."""
    return {key: [Use(*u) for u in us] for key, us in shapes}


def _sample_axis(full: tuple | None, probe: tuple | None, m: int, features: int) -> int | None:
    """The one dimension of a call's input that is ``m`` in the batch forward and 1 in the one-sample probe, every
    other dimension unchanged, and that is not a feature dimension; ``None`` if there is no such single dimension."""
    if full is None or probe is None or len(full) != len(probe):
        return None
    changed = [d for d, (a, b) in enumerate(zip(full, probe)) if a != b]
    if len(changed) != 1:
        return None
    d = changed[0]
    limit = 1 if features == BATCH_FIRST else len(full) - features
    return d if full[d] == m and probe[d] == 1 and d < limit else None


# The established axes, per model and shape signature (a handful of signatures per model: the last ones used).
_AXIS_CACHE: "weakref.WeakKeyDictionary[torch.nn.Module, OrderedDict]" = weakref.WeakKeyDictionary()
_AXIS_CACHE_SIZE = 256
# The sets of slow-path parameters already reported, per model (a SlowPathWarning once per model and set).
_WARNED: "weakref.WeakKeyDictionary[torch.nn.Module, set]" = weakref.WeakKeyDictionary()


def recording_hook(records: list, slots: int = 2) -> Callable:
    """A forward hook that appends ``[input, output grad, None, ...]`` (``slots`` entries) to ``records`` for every
    call whose output reaches a loss, and fills in the gradient flowing back into that output (summed if it arrives
    in parts). The input is ``None`` when the call had no positional tensor. Shared by the per-sample capture here
    and the K-FAC factors (:mod:`ief.kfac`)."""

    def hook(module, args, output):
        if not torch.is_grad_enabled() or not isinstance(output, torch.Tensor) or not output.requires_grad:
            return
        x = args[0].detach() if args and isinstance(args[0], torch.Tensor) else None
        record = [x] + [None] * (slots - 1)
        records.append(record)

        def keep_grad(grad):
            record[1] = grad if record[1] is None else record[1] + grad

        output.register_hook(keep_grad)

    return hook


class PerSampleCapture:
    """Hooks that keep (input, output-gradient) pairs of every call of the modules owning trainable parameters.

    With ``stand_ins=True`` (the per-sample capture; K-FAC's does without) each hooked call runs with *stand-ins*
    of its module's parameters in ``params``: ``p.detach().requires_grad_()``, a fresh leaf sharing ``p``'s storage
    (no copy), put in place by a forward pre-hook and put back by a forward hook that runs even when the forward
    raises (and by ``__exit__``). Autograd then reaches ``p`` itself only through its uses outside its hooked calls
    (normally none: the guard's structural check), and a backward that asks for ``params`` never computes the hooked
    layers' batch weight gradients (their stand-ins are not asked for); the records also keep every call's output
    gradient edge (``edges[k]``, beside the records, never in them: a record is reachable from the graph through its
    gradient hook, so an edge inside it would close a cycle through C++ that Python's collector cannot see, and every
    call would leak its graph and activations), which such a backward asks for instead so that it reaches every
    hooked call.
    ``stand_ins[i]``: the stand-ins made for parameter ``i`` (one per call), for a backward that needs the whole
    gradient (:meth:`leaves`). Calls with gradients off run with the real parameters."""

    def __init__(self, model: torch.nn.Module, params: Sequence[torch.Tensor], stand_ins: bool = False):
        self.swap = stand_ins
        self.stand_ins: dict[int, list[torch.Tensor]] = {}
        self._originals: dict[tuple[int, str], tuple[torch.nn.Module, torch.Tensor]] = {}
        self.params = list(params)
        index = {id(p): i for i, p in enumerate(self.params)}
        self.sizes = [p.numel() for p in self.params]
        self.offsets = [0, *torch.tensor(self.sizes).cumsum(0).tolist()]
        # (module, rule, trailing feature dims, {parameter name in module: index in params})
        self.modules: list[tuple[torch.nn.Module, Callable, int, dict[str, int]]] = []
        covered: set[int] = set()
        for module in model.modules():
            rule = _hook_rule(module)
            if rule is None:
                continue
            # a MultiheadAttention also owns its out_proj's parameters (used inside its call, never as a module)
            recurse = type(module) is torch.nn.MultiheadAttention
            owned = {n: index[id(p)] for n, p in module.named_parameters(recurse=recurse) if id(p) in index}
            if owned and not (set(owned.values()) & covered):
                self.modules.append((module, *rule, owned))
                covered.update(owned.values())
        self.hooked = covered
        # Broadcast uses (ief.broadcast_uses), per-sample capture with more than one sample only: the trainable
        # parameters outside hooked modules (candidates), those whose every use is broadcast over the batch
        # (``broadcast``, rows from their uses; autograd's gradient of them is their whole batch gradient), the
        # embedding calls without a sample dimension of their own (``(k, j)``: module k's call j).
        self.batch_size = 1  # M, set before the forward
        self.names: Sequence[str] | None = None
        self.tracker: UseTracker | None = None
        self.bare = [i for i in range(len(self.params)) if i not in covered] if stand_ins else []
        self.broadcast: dict[int, list] = {}  # parameter index -> its uses
        self.embedding_candidates: set[tuple[int, int]] = set()
        self.probe_uses: tuple | None = None  # the uses the one-sample probe recorded (shapes)
        self.records: dict[int, list] = {}  # k -> [[input, output grad, sample axis], ...] in call order
        self.edges: dict[int, list] = {}  # k -> the gradient edges of its recorded calls' outputs (stand-ins only)
        self.demoted: dict[int, str] = {}  # parameter index -> why its hooked module fell back to the loop
        self.handles: list = []

    def __enter__(self) -> "PerSampleCapture":
        self.stand_ins.clear()
        self.broadcast.clear()
        self.embedding_candidates.clear()
        self.tracker = None
        if self.swap and self.batch_size > 1 and (
                self.bare or any(type(module) is torch.nn.Embedding for module, *_ in self.modules)):
            self.tracker = UseTracker()
            for i in self.bare:
                self.tracker.watch(self.params[i], ("param", i))
            self.tracker.__enter__()
        for k, (module, _, _, owned) in enumerate(self.modules):
            self.records[k] = []
            self.edges[k] = []
            # first of the module's forward hooks: the output as the layer returned it (another hook may replace it)
            if type(module) is torch.nn.MultiheadAttention and self.swap:
                self.handles.append(module.register_forward_hook(self._mha_hook(k), prepend=True, with_kwargs=True))
            else:
                self.handles.append(module.register_forward_hook(self._forward_hook(k), prepend=True))
            if self.swap:  # last of the pre-hooks, first of the hooks: other hooks see the real parameters
                self.handles.append(module.register_forward_pre_hook(self._install(owned)))
                self.handles.append(module.register_forward_hook(self._restore(owned), prepend=True, always_call=True))
        return self

    def __exit__(self, *exc) -> None:
        if self.tracker is not None:
            self.tracker.__exit__(*exc)
            self.tracker.release()
        for h in self.handles:
            h.remove()
        self.handles.clear()
        for module_id, name in list(self._originals):  # e.g. a pre-hook raised before the forward
            self._put_back(module_id, name)

    def _install(self, owned: dict[str, int]):
        def pre_hook(module, args):
            if not torch.is_grad_enabled():
                return
            for name, i in owned.items():
                owner, leaf = _owner(module, name)
                p = owner._parameters.get(leaf)
                if p is not self.params[i] or (id(owner), leaf) in self._originals:
                    continue
                stand_in = p.detach().requires_grad_()  # shares p's storage and version counter
                self._originals[(id(owner), leaf)] = (owner, p)
                owner._parameters[leaf] = stand_in
                self.stand_ins.setdefault(i, []).append(stand_in)

        return pre_hook

    def _restore(self, owned: dict[str, int]):
        def hook(module, args, output):
            for name in owned:
                owner, leaf = _owner(module, name)
                self._put_back(id(owner), leaf)

        return hook

    def _put_back(self, module_id: int, name: str) -> None:
        entry = self._originals.pop((module_id, name), None)
        if entry is not None:
            entry[0]._parameters[name] = entry[1]

    def _forward_hook(self, k: int):
        if not self.swap:
            return recording_hook(self.records[k], slots=3)  # [input, output grad, sample axis]
        calls, edges = self.records[k], self.edges[k]
        record = recording_hook(calls, slots=3)  # [input, output grad, sample axis]

        def hook(module, args, output):
            n = len(calls)
            record(module, args, output)
            if len(calls) > n:
                edges.append(torch.autograd.graph.get_gradient_edge(output))
                x = calls[-1][0]
                if self.tracker is not None and type(module) is torch.nn.Embedding and x is not None and (
                        x.dim() == 0 or x.shape[0] == 1 or self.batch_size not in x.shape):
                    self.embedding_candidates.add((k, n))  # ids shared by all samples (e.g. [1, T] positions)
                    self.tracker.watch(output, ("call", k, n))

        return hook

    def _mha_hook(self, k: int):
        """Records a ``MultiheadAttention`` call: ``[query, dL/d attn_output, axis, (args, kwargs), dL/d weights]``,
        its inputs detached (:func:`ief.layer_rules.mha_grads` replays the call per sample)."""
        calls, edges = self.records[k], self.edges[k]

        def hook(module, args, kwargs, output):
            out, weights = output
            if not torch.is_grad_enabled() or not isinstance(out, torch.Tensor) or not out.requires_grad:
                return
            detach = lambda v: v.detach() if isinstance(v, torch.Tensor) else v  # noqa: E731
            call = (tuple(detach(v) for v in args), {n: detach(v) for n, v in kwargs.items()})
            query = call[0][0] if call[0] else call[1].get("query")
            record = [query, None, None, call, None]
            calls.append(record)

            def keep(slot):
                def add(grad):
                    record[slot] = grad if record[slot] is None else record[slot] + grad
                return add

            out.register_hook(keep(1))
            edges.append(torch.autograd.graph.get_gradient_edge(out))
            if isinstance(weights, torch.Tensor) and weights.requires_grad:
                weights.register_hook(keep(4))
                edges.append(torch.autograd.graph.get_gradient_edge(weights))

        return hook

    def output_edges(self) -> list:
        """The gradient edges of the hooked calls' outputs (modules with an established sample axis)."""
        return [e for k in self.records for e in self.edges[k]] if self.swap else []

    def leaves(self, params: Sequence[torch.Tensor], which: Iterable[int]) -> tuple[list[int], list[torch.Tensor]]:
        """``(owners, leaves)``: the parameters ``which`` (in that order), then the stand-ins made for them; a
        backward asking for all of them gets each parameter's whole gradient (summed over its owner)."""
        which = list(which)
        extra = [(i, s) for i in which for s in self.stand_ins.get(i, [])]
        return which + [i for i, _ in extra], [params[i] for i in which] + [s for _, s in extra]

    def call_shapes(self) -> tuple:
        """Every hooked call's input shape, per hooked module, in call order."""
        return tuple(
            tuple(None if rec[0] is None else tuple(rec[0].shape) for rec in self.records[k])
            for k in range(len(self.modules))
        )

    def probe_shapes(self, run: Callable[[], torch.Tensor]) -> tuple | str:
        """The call shapes of the hooked modules during ``run()`` (the one-sample probe), or why it failed."""
        seen: dict[int, list] = {k: [] for k in range(len(self.modules))}
        handles = []
        tracker = UseTracker(hooks=False) if self.tracker is not None else None  # the same uses, shapes only
        self.probe_uses = None
        if tracker is not None:
            for i in self.bare:
                tracker.watch(self.params[i], ("param", i))

        def shape_hook(k):
            def hook(module, args, output):
                if isinstance(output, tuple) and type(module) is torch.nn.MultiheadAttention:
                    output = output[0]
                if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad:
                    if tracker is not None and (k, len(seen[k])) in self.embedding_candidates:
                        tracker.watch(output, ("call", k, len(seen[k])))
                    seen[k].append(tuple(args[0].shape) if args and isinstance(args[0], torch.Tensor) else None)

            return hook

        for k, (module, *_) in enumerate(self.modules):
            handles.append(module.register_forward_hook(shape_hook(k)))
        try:
            with tracker if tracker is not None else contextlib.nullcontext():
                run()
        except Exception as err:  # the model cannot run one sample alone (e.g. batch norm with batch statistics)
            return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        finally:
            for h in handles:
                h.remove()
            if tracker is not None:
                tracker.release()
        if tracker is not None:
            self.probe_uses = (_use_shapes(tracker.uses), frozenset(tracker.unsupported))
        return tuple(tuple(seen[k]) for k in range(len(self.modules)))

    def establish_axes(self, m: int, model: torch.nn.Module, inputs, probe: Callable[[], tuple | str]) -> None:
        """Give every call its sample axis (probed or cached); modules with a call without one fall back."""
        if not self.modules and self.tracker is None:
            return
        if m == 1:  # the whole call is sample 0's; a [N, C, *] layer's own batch dimension N must be that sample
            reasons = {}
            for k, (module, _, features, _) in enumerate(self.modules):
                batched = features == BATCH_FIRST or conv_is_unfoldable(module)
                for rec in self.records[k]:
                    x = rec[0]
                    if type(module) is torch.nn.MultiheadAttention:  # a batched call: the batch is the sample
                        one = x is not None and x.dim() == 3 and x.shape[mha_batch_dim(module)] == 1
                        rec[2] = mha_batch_dim(module) if one else None
                    elif not batched or (x is not None and x.dim() == features):  # flattened rules; unbatched conv
                        rec[2] = WHOLE_CALL
                    else:
                        rec[2] = 0 if x is not None and x.dim() > 1 and x.shape[0] == 1 else None
                if any(rec[2] is None for rec in self.records[k]):
                    reasons[k] = f"{type(module).__name__} called on a batch of several instances for one sample"
            self.demote(reasons)
            return
        full = self.call_shapes()
        uses = None if self.tracker is None else (_use_shapes(self.tracker.uses), frozenset(self.tracker.unsupported))
        key = (m, shapes_of(inputs), tuple(id(module) for module, *_ in self.modules), full, uses)
        cache = _AXIS_CACHE.setdefault(model, OrderedDict())
        cached = cache.get(key)
        if cached is None:
            shrunk = probe()
            failed = isinstance(shrunk, str)
            axes = tuple(
                tuple(
                    _sample_axis(shape, None if failed or len(shrunk[k]) != len(calls) else shrunk[k][j], m,
                                 self.modules[k][2])
                    for j, shape in enumerate(calls)
                )
                for k, calls in enumerate(full)
            )
            cached = cache[key] = (axes, shrunk if failed else None, None if failed else self.probe_uses)
            while len(cache) > _AXIS_CACHE_SIZE:
                cache.popitem(last=False)
        else:
            cache.move_to_end(key)
        axes, probe_error, probe_uses = cached
        shared = {}  # the watched tensors whose every use is broadcast over the batch, with an established axis
        if uses is not None and probe_uses is not None:
            shared = establish(self.tracker.uses, _uses_from(probe_uses[0]), self.tracker.unsupported | probe_uses[1],
                               m)
        for i in self.bare:
            if ("param", i) in shared:
                self.broadcast[i] = shared[("param", i)]
                self.hooked.add(i)
        reasons = {}
        for k, entry in enumerate(self.modules):
            call_axes = [_BroadcastCall(shared[("call", k, j)]) if axis is None and ("call", k, j) in shared else axis
                         for j, axis in enumerate(axes[k])]
            if type(entry[0]) is torch.nn.MultiheadAttention:  # its samples must be its own batch: no other mixes
                call_axes = [axis if axis == mha_batch_dim(entry[0]) else None for axis in call_axes]
            if all(axis is not None for axis in call_axes):
                for rec, axis in zip(self.records[k], call_axes):
                    rec[2] = axis
                continue
            shapes = sorted({str(shape) for shape, axis in zip(full[k], axes[k]) if axis is None})
            if probe_error is not None:
                reasons[k] = f"the one-sample probe forward that finds the sample axis failed: {probe_error}"
            else:
                reasons[k] = (
                    f"{type(entry[0]).__name__} input shapes {', '.join(shapes)} have no dimension that is the {m} "
                    "samples (a probe forward of one sample does not shrink exactly one of them to 1)"
                )
        self.demote(reasons)

    def demote(self, reasons: dict[int, str]) -> None:
        """Send the parameters of hooked modules ``k`` (``reasons``: ``k -> why``) to the per-sample loop: the module
        is no longer hooked; its calls' stand-ins stay, so that the loop differentiates every use (:meth:`leaves`)."""
        if not reasons:
            return
        kept = []
        for k, entry in enumerate(self.modules):
            if k not in reasons:
                kept.append((k, entry))
                continue
            for i in entry[3].values():
                self.demoted[i] = reasons[k]
            self.hooked -= set(entry[3].values())
        self.modules = [e for _, e in kept]
        self.records = {new: self.records[old] for new, (old, _) in enumerate(kept)}
        self.edges = {new: self.edges[old] for new, (old, _) in enumerate(kept)}

    def demote_outside_uses(self, reached: set[int], names: Sequence[str]) -> None:
        """Demote the modules of hooked parameters that the graph reaches outside their hooked calls (``reached``:
        their own gradient accumulators are in the graph, see :func:`ief.model_call.scan_graph`; e.g. tied weights):
        their hooked rows would miss that use, the loop's rows are exact."""
        reasons = {}
        for k, (module, _, _, owned) in enumerate(self.modules):
            outside = [i for i in owned.values() if i in reached]
            if outside:
                reasons[k] = (f"{', '.join(names[i] for i in outside)} also used outside its {type(module).__name__} "
                              "(e.g. tied weights)")
        self.demote(reasons)

    def clear_grads(self) -> None:
        for calls in self.records.values():
            for rec in calls:
                rec[1] = None
        if self.tracker is not None:
            for uses in self.tracker.uses.values():
                for use in uses:
                    use.grad = None

    def name(self, i: int) -> str:
        return self.names[i] if self.names is not None else f"parameter {i}"

    def calls(self, k: int):
        """``(input, output gradient)`` of module ``k``'s calls that reached the loss, sample axis first."""
        for x, grad, axis, *rest in self.records[k]:
            if rest and rest[0] is not None:  # a MultiheadAttention call: replayed from its whole input
                if grad is not None or rest[1] is not None:
                    yield (rest[0], axis), (grad, rest[1])
                continue
            if grad is None:  # this call's output did not reach the loss
                continue
            if isinstance(axis, _BroadcastCall):  # ids shared by every sample: each sample's gradient of the output
                m = self.batch_size
                rows = per_sample_rows(axis.uses, m, grad.numel(), grad.dtype, grad.device)
                _check_sums(rows, grad, self.name(self.modules[k][3]["weight"]))
                yield x.reshape(1, -1).expand(m, -1), rows.view(m, -1, grad.shape[-1])
                continue
            if axis == WHOLE_CALL:
                x, grad = x.unsqueeze(0), grad.unsqueeze(0)
            elif axis != 0:  # e.g. [T, M, E] -> [M, T, E]
                x, grad = x.movedim(axis, 0), grad.movedim(axis, 0)
            yield x, grad

    def fill(self, jac: torch.Tensor, columns: dict[int, int] | None = None, skip: Iterable[int] = ()) -> set[int]:
        """Write the hooked per-sample gradients into their column blocks of ``jac`` (uninitialised memory: a
        module's first call writes its blocks, later calls add); returns the parameter indices written.

        ``columns``: parameter index -> its first column in ``jac`` (default: its offset in ``J [M, P]``);
        parameters not in it and modules in ``skip`` are left out."""
        columns = {i: self.offsets[i] for i in range(len(self.params))} if columns is None else columns
        written: set[int] = set()
        for k, (module, rule, _, owned) in enumerate(self.modules):
            dests = {name: jac[:, columns[i] : columns[i] + self.sizes[i]] for name, i in owned.items() if i in columns}
            if k in skip or not dests:
                continue
            accumulate = False
            for x, grad in self.calls(k):
                rule(module, x, grad, dests, accumulate)
                accumulate = True
            if accumulate:
                written.update(owned[name] for name in dests)
        return written


def _warn_slow_path(model: torch.nn.Module, capture: PerSampleCapture, names: Sequence[str], m: int) -> None:
    """One :class:`SlowPathWarning` per model (and set of parameters) naming the parameters that take the loop."""
    loop = [i for i in range(len(names)) if i not in capture.hooked]
    if not loop or m == 1:
        return
    reported = _WARNED.setdefault(model, set())
    key = frozenset(names[i] for i in loop)
    if key in reported:
        return
    reported.add(key)
    owner = {id(p): mod for mod in model.modules() for p in mod.parameters(recurse=False)}
    reasons: dict[str, list[str]] = {}
    for i in loop:
        why = capture.demoted.get(i)
        if why is None:
            mod = owner[id(capture.params[i])]
            kind = type(mod).__name__
            if type(mod).__module__.startswith("torch.nn"):
                why = f"{kind}: no per-sample hook for this layer type"
            else:
                why = f"a bare parameter of {kind}, used outside any hooked layer"
        reasons.setdefault(why, []).append(names[i])
    listed = "; ".join(f"{', '.join(ns)} ({why})" for why, ns in reasons.items())
    warnings.warn(
        f"{len(loop)} of {len(names)} parameter tensors take the per-sample loop of {m} backward passes (exact, but "
        f"about {m}x a gradient): {listed}. Hooked layers: nn.Linear, HF Conv1D, nn.Embedding, nn.LayerNorm, "
        "nn.GroupNorm, nn.Conv1d / nn.Conv2d (zero padding), nn.BatchNorm1d / 2d (eval mode), torch.nn attention (no "
        "dropout) whose input has a sample dimension, and parameters or embedding outputs only added to or expanded "
        "over the batch; pass params= to precondition only those. For peft prompt tuning, call "
        "ief.per_sample_prompts(model) once after get_peft_model.",
        SlowPathWarning,
        stacklevel=4,
    )


# ----------------------------------------------------------------------------------------------------------- core
def _positions(parts: list[torch.Tensor]) -> torch.Tensor:
    """The calls of one layer concatenated along the positions (no copy for a single call)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _factored_weight(module: torch.nn.Module) -> bool:
    """Whether the module's weight, viewed ``[O, I]``, has per-sample rows ``G_n^T A_n`` (``nn.Linear``;
    ``nn.Conv2d`` with one group, ``A`` its unfolded input; HF ``Conv1D``, whose ``[in, out]`` weight is
    ``X_n^T G_n``: ``A`` its output gradients, ``G`` its inputs)."""
    return type(module) is torch.nn.Linear or is_hf_conv1d(module) or (
        conv_is_unfoldable(module) and module.groups == 1)


def _positions_of(module: torch.nn.Module, grad: torch.Tensor) -> int:
    """``T`` of one call (sample axis first): the positions over which a weight is shared."""
    features_last = type(module) is torch.nn.Linear or is_hf_conv1d(module)
    return grad[0].numel() // (grad.shape[-1] if features_last else grad.shape[1])


def _weight_factors(module: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A [M, T, I], G [M, T, O])`` of one call of a module with :func:`_factored_weight` (``[O, I]`` the weight's
    layout: for HF ``Conv1D``, ``I`` its outputs and ``O`` its inputs)."""
    m = x.shape[0]
    if type(module) is torch.nn.Linear:
        return x.reshape(m, -1, x.shape[-1]), grad.reshape(m, -1, grad.shape[-1])
    if is_hf_conv1d(module):
        return grad.reshape(m, -1, grad.shape[-1]), x.reshape(m, -1, x.shape[-1])
    a, g = conv_factors(module, x, grad)
    return a[:, 0], g[:, 0]


def _backward_jacobian(
    capture: PerSampleCapture,
    losses: torch.Tensor,
    params: Sequence[torch.Tensor],
    retain_graph: bool,
    out: torch.Tensor | None = None,
    form: str = "dense",
) -> tuple[torch.Tensor | FactoredJacobian, list[torch.Tensor | None]]:
    """One backward of ``sum(losses)`` through the hooks (plus the loop for unhooked parameters): ``(J, autograd)``,
    ``J`` an ``[M, P]`` tensor (``form="dense"``) or a :class:`~ief.rows.FactoredJacobian` (``"auto"``, ``"ghost"``,
    ``"rows"``: the form of every ``nn.Linear`` weight, see :func:`ief.rows.prefer_ghost`).

    ``autograd[i]`` is what autograd's batch backward gives parameter ``i``: its whole batch gradient for a parameter
    of the per-sample loop; for a hooked one (its module's calls ran with stand-ins, see :class:`PerSampleCapture`)
    only the contribution of its uses outside those calls, ``None`` when there are none (the guard reads it, and
    :func:`_batch_gradient` adds it to ``J^T 1``). Autograd never computes a hooked layer's batch weight gradient:
    the backward asks for the hooked calls' outputs instead (their gradient edges), which is all the rules need."""
    m = losses.shape[0]
    fallback = [i for i in range(len(params)) if i not in capture.hooked]
    capture.clear_grads()
    loop_owners, loop_inputs = capture.leaves(params, fallback)  # demoted modules: the parameter and its stand-ins
    extra = len(loop_inputs) - len(fallback)
    inputs = [*params, *loop_inputs[len(fallback):], *capture.output_edges()]
    grads = torch.autograd.grad(losses.sum(), inputs, retain_graph=retain_graph or bool(fallback), allow_unused=True)
    autograd = _summed(grads[: len(params)], loop_owners[len(fallback):], grads[len(params) : len(params) + extra])
    ref = params[0]
    ghosts, ghost_modules, bias_rows = [], set(), {}
    tables = {}  # k -> (parameter index, used ids [U], the calls): embedding tables kept as their used rows
    if form != "dense":
        for k, (module, rule, _, owned) in enumerate(capture.modules):
            if rule is _embedding_grads and "weight" in owned:
                calls = list(capture.calls(k))
                if calls:
                    ids = torch.unique(torch.cat([x.reshape(-1) for x, _ in calls]))  # sorted
                    if ids.numel() < module.num_embeddings:
                        tables[k] = (owned["weight"], ids, calls)
                continue
            calls = list(capture.calls(k)) if "weight" in owned and _factored_weight(module) else []
            if not calls:
                continue
            positions = sum(_positions_of(module, d) for _, d in calls)
            fan_out, fan_in = getattr(module, "weight").flatten(1).shape
            if prefer_ghost(form, m, positions, fan_in, fan_out):  # the factors only now: an unfold is not free
                calls = [_weight_factors(module, x, d) for x, d in calls]
                a = _positions([x for x, _ in calls]).to(ref.dtype)  # [M, T, I]
                g = _positions([d for _, d in calls]).to(ref.dtype)  # [M, T, O]
                ghosts.append((owned["weight"], a, g))
                ghost_modules.add(k)
                if "bias" in owned:  # the output gradients: A for HF Conv1D (see _weight_factors)
                    bias_rows[owned["bias"]] = (a if is_hf_conv1d(module) else g).sum(dim=1)
    ghosted = {i for i, _, _ in ghosts}
    used_rows = {i: (ids, capture.modules[k][0].embedding_dim) for k, (i, ids, _) in tables.items()}
    widths = {i: ids.numel() * dim for i, (ids, dim) in used_rows.items()}  # a table's columns: its used rows
    columns, width = {}, 0
    for i, size in enumerate(capture.sizes):
        if i not in ghosted:
            columns[i] = width
            width += widths.get(i, size)
    if out is not None and out.dtype == ref.dtype and out.device == ref.device and out.shape[0] == m and (
            out.shape[1] == width or (form != "dense" and out.shape[1] > width)):
        jac = out[:, :width]  # a reused buffer (its pages are already mapped: a fresh J-sized allocation page-faults)
    else:
        jac = large_empty((m, width), ref.dtype, ref.device)
    written = capture.fill(jac, columns, skip=ghost_modules | set(tables))
    for k, (i, ids, calls) in tables.items():
        dest = {"weight": jac[:, columns[i] : columns[i] + widths[i]]}
        for n, (x, grad) in enumerate(calls):
            _embedding_grads(capture.modules[k][0], x, grad, dest, n > 0, rows=ids)
        written.add(i)
    for i, uses in capture.broadcast.items():  # bare parameters broadcast over the batch: rows from their uses
        if i in columns:
            rows = per_sample_rows(uses, m, capture.sizes[i], ref.dtype, ref.device)
            _check_sums(rows, autograd[i], capture.name(i))
            jac[:, columns[i] : columns[i] + capture.sizes[i]] = rows
            written.add(i)
    for i, rows in bias_rows.items():
        jac[:, columns[i] : columns[i] + capture.sizes[i]] = rows
        written.add(i)
    for i, lo in columns.items():
        if i not in written:  # fallback blocks and hooked parameters the loss did not reach
            jac[:, lo : lo + capture.sizes[i]].zero_()
    # the loop's backward passes also reach the hooks: the records keep the batch backward's output gradients
    batch_grads = [[rec[1] for rec in calls] for calls in capture.records.values()] if fallback else []
    for n in range(m):
        if not fallback:
            break
        rows = torch.autograd.grad(losses[n], loop_inputs, retain_graph=retain_graph or n < m - 1, allow_unused=True)
        for i, g in zip(loop_owners, rows):
            if g is not None:
                jac[n, columns[i] : columns[i] + capture.sizes[i]] += g.reshape(-1)
    for calls, kept in zip(capture.records.values(), batch_grads):
        for rec, g in zip(calls, kept):
            rec[1] = g
    if form == "dense":
        return jac, autograd
    return FactoredJacobian(m, capture.sizes, ref, ghosts, jac, columns, used_rows), autograd


def _summed(grads: Sequence[torch.Tensor | None], owners: Sequence[int], extra: Sequence[torch.Tensor | None]):
    """``grads`` (one per parameter) with the gradients ``extra`` of further leaves added to their ``owners``."""
    out = list(grads)
    for i, g in zip(owners, extra):
        if g is not None:
            out[i] = g if out[i] is None else out[i] + g
    return out


def _batch_gradient(jacobian: torch.Tensor | FactoredJacobian, autograd: Sequence[torch.Tensor | None],
                    offsets: Sequence[int], hooked: frozenset[int]) -> torch.Tensor:
    """``grad_theta L`` ``[P]`` after :func:`_backward_jacobian`: a hooked parameter's rows summed (``J^T 1``) plus
    its uses outside its hooked calls; autograd's batch gradient for a parameter of the per-sample loop."""
    if isinstance(jacobian, FactoredJacobian):
        total = jacobian.row_sum()
    else:
        total = torch.empty(jacobian.shape[1], dtype=jacobian.dtype, device=jacobian.device)
        for lo, block in column_chunks(jacobian):  # a dim-0 reduction over all of J at once is strided
            torch.sum(block, dim=0, out=total[lo : lo + block.shape[1]])
    for i, g in enumerate(autograd):
        dest = total[offsets[i] : offsets[i + 1]]
        if i not in hooked:
            dest.copy_(g.reshape(-1)) if g is not None else dest.zero_()
        elif g is not None:
            dest += g.reshape(-1)
    return total


def _block_norm(jacobian: torch.Tensor | FactoredJacobian, i: int, offsets: Sequence[int]) -> torch.Tensor:
    """``||J_block||_F`` of parameter ``i`` (float64)."""
    if isinstance(jacobian, FactoredJacobian):
        if i not in jacobian.dense_index:
            return jacobian.row_sqnorms()[:, i].sum().sqrt()
        block = jacobian.dense_block(i)  # a table's used rows only: the others are zero
    else:
        block = jacobian[:, offsets[i] : offsets[i + 1]]
    return torch.linalg.vector_norm(block, dtype=torch.float64)


def check_no_outside_use(capture: PerSampleCapture, jacobian: torch.Tensor | FactoredJacobian,
                         autograd: Sequence[torch.Tensor | None], names: Sequence[str]) -> None:
    """The guard (``check=True``): raise :class:`PerSampleGradientMismatch` if a hooked parameter is used outside
    its hooked module calls beyond rounding error.

    Its hooked calls ran with stand-ins (:class:`PerSampleCapture`), so autograd's gradient of the parameter itself,
    ``o = autograd[i]``, is exactly the part of the batch gradient that the hooked rows miss: ``o = g - sum_n J_n``.
    ``None`` or zero: the rows are the whole gradient by construction (no gradient is read). Otherwise the block
    fails when ``||o|| > tol * sqrt(M) ||J_block||_F`` (the right side bounds ``tol * sum_n ||J_n||``),
    ``tol = 50 sqrt(eps)``. Parameters of the per-sample loop are not checked: their rows are gradients of the
    individual losses whatever the model does. A non-finite ``o`` is left to the caller (``FloatingPointError`` in
    the optimisers). A parameter whose outside use is in the forward's graph (tied weights) has already been sent to
    the loop (:meth:`PerSampleCapture.demote_outside_uses`): this is the safety net behind that search."""
    found = [i for i in sorted(capture.hooked - set(capture.broadcast))
             if autograd[i] is not None and bool(autograd[i].any())]
    if not found:
        return
    err = torch.stack([torch.linalg.vector_norm(autograd[i], dtype=torch.float64) for i in found])
    eps = torch.finfo(jacobian.dtype)
    scale = torch.stack([_block_norm(jacobian, i, capture.offsets) for i in found]) * math.sqrt(jacobian.shape[0])
    _raise_if_beyond(err, scale + eps.tiny, 50 * math.sqrt(eps.eps), [names[i] for i in found])


def _raise_if_beyond(err: torch.Tensor, scale: torch.Tensor, tol: float, names: Sequence[str]) -> None:
    """Raise :class:`PerSampleGradientMismatch` naming the blocks with ``err > tol * scale``."""
    failing = torch.nonzero(err > tol * scale).flatten().tolist()
    if failing:
        bad = [f"{names[k]} (relative error {float(err[k] / scale[k]):.2e})" for k in failing[:5]]
        raise PerSampleGradientMismatch(
            "per-sample gradients do not sum to the batch gradient for: " + ", ".join(bad)
            + ". A parameter is used outside the module that owns it where the per-sample hooks cannot see it (tied "
            "weights are found before the backward and take the exact per-sample loop: this use escaped that "
            "search); pass params= to leave it out."
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


def exact_check_tolerance(dtype: torch.dtype) -> float:
    """The exact check's bound on ``||J_n V - exact_n|| / ||exact_n||``: ``1e4`` units of float32 rounding (1.2e-3)
    for float32 and float64 parameters alike (models compute parts in float32 whatever their parameters' dtype:
    T5's layer norm; the exact products of a float64 T5-LoRA differ from its rows by 7.5e-8), ``1e4`` units of the
    dtype's rounding for wider rounding, at most 0.1 (16-bit dtypes, whose rounding hides smaller errors)."""
    return min(1e4 * max(torch.finfo(dtype).eps, torch.finfo(torch.float32).eps), 0.1)


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


def _tangent_columns(u: torch.Tensor, w: torch.Tensor | None, lo: int, hi: int) -> torch.Tensor:
    """Columns ``lo:hi`` of the flattened tangents, ``[K, hi - lo]`` (float64)."""
    if w is None:
        return u[:, lo:hi]
    idx = torch.arange(lo, hi)
    return u[:, idx // w.shape[1]] * w[:, idx % w.shape[1]]


def _hooked_products(jac: torch.Tensor | FactoredJacobian, tangents, offsets: Sequence[int]) -> torch.Tensor:
    """``J_n v_k`` for the tangents of :func:`_check_tangents`, ``[M, K]`` in float64, column block by column block
    (no float64 copy of ``J``, no ``[K, P]`` matrix); a factored weight's from its ``G`` and ``A``."""
    factored = isinstance(jac, FactoredJacobian)
    out = torch.zeros(jac.shape[0], CHECK_TANGENTS, dtype=torch.float64, device=jac.device)
    ghosts = {i: (a, g) for i, a, g in jac.ghosts} if factored else {}
    for i, (u, w) in enumerate(tangents):
        if i in ghosts:
            a, g = FactoredJacobian.scaled_factors(*ghosts[i], 1.0)  # [M, T, I], [M, T, O]
            out += ((a @ w.T.to(a.device)) * (g @ u.T.to(g.device))).sum(dim=1)
            continue
        if factored and i in jac.used_rows:  # a table's used rows: the tangent's entries of those rows
            ids, _ = jac.used_rows[i]
            cols = (u[:, ids.cpu(), None] * w[:, None, :]).flatten(1).to(jac.device)  # [K, U D]
            out += jac.dense_block(i).to(torch.float64) @ cols.T
            continue
        block = jac.dense_block(i) if factored else jac[:, offsets[i] : offsets[i + 1]]
        for lo, chunk in column_chunks(block):
            cols = _tangent_columns(u, w, lo, lo + chunk.shape[1]).to(jac.device)
            out += chunk.to(torch.float64) @ cols.T
    return out


def check_directional_derivatives(forward: ReplayableForward, params: Sequence[torch.Tensor], names: Sequence[str],
                                  jac: torch.Tensor | FactoredJacobian, grad_z: torch.Tensor) -> None:
    """The exact check (``check="exact"``): every row ``J_n`` against sample ``n``'s exact directional derivatives.

    For ``K`` = :data:`CHECK_TANGENTS` random tangents ``v_k`` (:func:`_check_tangents`: rank one per weight matrix),
    ``exact_nk = (dl_n/dz_n)^T J_{z_n} v_k`` (one batched forward-mode pass, or double backward, on a replay of the
    forward with the real parameters; ``dl_n/dz_n`` as the batch backward computed it, so that a confident sample's
    rounded ``p - 1`` is shared) and ``J_n v_k`` from the rows, both summed in float64. Sample ``n`` fails when
    ``||J_n V - exact_n|| > tol * max(||exact_n||, ||J_n V||)`` (norms over the ``K`` tangents; ``tol`` from
    :func:`exact_check_tolerance`). Normalised by the size of the products themselves, an error of relative size
    ``r`` in ``J_n`` shows as ``~r`` whatever ``P`` (``exact_nk`` and the error's product both scale like
    ``1/sqrt(P)``), so a 1 % error is caught in float32 and float64 alike (``tol`` 1.2e-3: ten times below it).

    Raises:
        PerSampleGradientMismatch: naming the samples that fail, the worst one and its relative error.
    """
    m = jac.shape[0]
    padding = {id(mod.weight): mod.padding_idx for mod in forward.model.modules()
               if isinstance(mod, torch.nn.Embedding) and mod.padding_idx is not None}
    tangents = _check_tangents(params, CHECK_TANGENTS, padding)
    full = [(u.to(p) if w is None else u.to(p)[:, :, None] * w.to(p)[:, None, :]).reshape(-1, *p.shape)
            for (u, w), p in zip(tangents, params)]  # formed in the parameter's dtype (no float64 [K, P])
    _, jvs = jvps_any_mode(forward, params, names, full)
    del full
    g = grad_z.detach().to(torch.float64).reshape(1, m, -1)
    exact = (g * jvs.to(torch.float64).reshape(CHECK_TANGENTS, m, -1)).sum(dim=2).T  # [M, K]
    offsets = [0, *torch.tensor([p.numel() for p in params]).cumsum(0).tolist()]
    hooked = _hooked_products(jac, tangents, offsets)
    err = (hooked - exact).norm(dim=1)
    scale = torch.maximum(exact.norm(dim=1), hooked.norm(dim=1)).clamp_min(torch.finfo(torch.float64).tiny)
    rel = err / scale
    tol = exact_check_tolerance(jac.dtype)
    failing = torch.nonzero(rel > tol).flatten().tolist()
    if failing:
        n = int(rel.argmax())
        raise PerSampleGradientMismatch(
            f"per-sample gradients of samples {failing[:10]}{' ...' if len(failing) > 10 else ''} disagree with their "
            f"exact directional derivatives (worst: sample {n}, relative error {float(rel[n]):.2e} > {tol:.1e}): a "
            "layer mixes samples or a hooked layer's leading dimension is not the sample dimension; pass params= to "
            "leave its parameters out, or make it a module without a per-sample hook (its parameters then take the "
            "exact per-sample loop)"
        )


def _refuse_nonfinite(losses: torch.Tensor, jac: torch.Tensor | FactoredJacobian | None) -> None:
    """``FloatingPointError`` naming the samples whose loss (or, given ``jac``, row of ``J``) is not finite."""
    if jac is None:
        if all_finite(losses):
            return
        bad = torch.nonzero(~torch.isfinite(losses.detach())).flatten().tolist()
        what = "loss"
    else:
        if jac.is_finite() if isinstance(jac, FactoredJacobian) else all_finite(jac):
            return
        bad = torch.nonzero(~_finite_rows(jac)).flatten().tolist()
        what = "per-sample gradient"
    raise FloatingPointError(
        f"non-finite {what} for samples {bad[:10]}{' ...' if len(bad) > 10 else ''} (of {losses.shape[0]}): a NaN or "
        "inf in those samples' inputs, logits or targets, or in the parameters; per-sample gradients are refused "
        "rather than returned as non-finite rows (drop or fix those samples)"
    )


def _finite_rows(jac: torch.Tensor | FactoredJacobian) -> torch.Tensor:
    """``[M]`` booleans: whether row ``n`` of ``J`` is finite."""
    if isinstance(jac, FactoredJacobian):
        ok = torch.isfinite(jac.dense).all(dim=1)
        for _, a, g in jac.ghosts:
            ok &= torch.isfinite(a).flatten(1).all(dim=1) & torch.isfinite(g).flatten(1).all(dim=1)
        return ok
    return torch.isfinite(jac).all(dim=1)


class _HookedForward:
    """One forward through the capture hooks; per-sample backward passes of any loss of its logits.

    ``check``: ``True`` (~free: no sample-mixing batch norm, and no hooked parameter used outside its hooked calls
    that the graph search missed, see :func:`check_no_outside_use`), ``"exact"`` (additionally every row against
    exact per-sample directional derivatives, :func:`check_directional_derivatives`: catches a custom layer that
    mixes samples), or ``False``. Tied weights take the exact loop whatever ``check``.
    """

    def __init__(self, model, inputs, targets, params, loss, check):
        self.mode = _check_mode(check)
        self.loss = get_loss(loss)
        model = unwrap_model(model)
        m = check_targets(targets)
        self.params = resolve_params(model, params)
        if self.mode is not None:
            _refuse_sample_mixing(model)
        self.capture = PerSampleCapture(model, self.params, stand_ins=True)
        self.capture.batch_size = m
        self.forward = ReplayableForward(model, inputs)
        # which hooked parameters the graph reaches outside their hooked calls (they ran with stand-ins)
        self.forward.watch = {id(self.params[i]): i for i in self.capture.hooked}
        # The exact check replays this forward with the reference kernels (forward-mode AD needs them); fused kernels
        # draw attention-dropout masks differently, so with the exact check on, this forward uses them too, and so do
        # the backward passes (activation checkpointing recomputes the forward inside them: same kernels, same graph).
        kernels = differentiable_kernels if self.mode == "exact" else contextlib.nullcontext
        self.kernels = kernels
        with self.capture, torch.enable_grad(), kernels():
            self.logits = self.forward()
        self.loss.check(self.logits, targets)
        if batch_size(self.logits) != m:
            raise ValueError(f"the model returned logits of shape {tuple(self.logits.shape)} for {m} targets")

        def probe() -> tuple | str:  # the hooked calls' input shapes when the first sample runs alone
            def run():
                buffers = [(b, b.clone()) for b in model.buffers()]  # e.g. batch-norm running statistics
                try:
                    with torch.random.fork_rng(devices=self.forward._devices), torch.enable_grad(), kernels(), \
                            non_reentrant_checkpointing(model):
                        logits = call_model(model, take_first(inputs, m))
                finally:  # restored through .data: no version bump for the batch forward's saved tensors
                    for b, saved in buffers:
                        if not torch.equal(b, saved):
                            b.data.copy_(saved)
                if tuple(logits.shape) != (1, *self.logits.shape[1:]):
                    raise ValueError("the inputs were not cut to one sample")

            return self.capture.probe_shapes(run)

        self.capture.establish_axes(m, model, inputs, probe)
        names = param_names(model, self.params)
        self.capture.names = names
        self.capture.demote_outside_uses(self.forward.reached, names)
        _warn_slow_path(model, self.capture, names, m)
        self.targets = targets
        self.names = names if self.mode is not None else None

    def jacobian(
        self, targets: torch.Tensor, retain_graph: bool = False, out: torch.Tensor | None = None, form: str = "dense"
    ) -> tuple[torch.Tensor, torch.Tensor | FactoredJacobian, _Deferred]:
        """``(losses, J, grad)`` for the given targets (``J`` in the given form, see :func:`per_sample`; ``grad``
        computed on first use, see :class:`PerSample`). Raises ``FloatingPointError`` naming the samples whose loss
        or row of ``J`` is not finite."""
        logit_grads: list[torch.Tensor] = []  # dL/dz as the batch backward computed it (for the exact check)
        with torch.enable_grad(), self.kernels():
            losses = self.loss.per_sample(self.logits, targets)
            _refuse_nonfinite(losses, None)
            handle = self.logits.register_hook(lambda g: logit_grads.append(g) if not logit_grads else None) \
                if self.mode == "exact" and self.logits.requires_grad else None
            try:
                jac, autograd = _backward_jacobian(self.capture, losses, self.params, retain_graph, out, form)
            finally:
                if handle is not None:
                    handle.remove()
        _refuse_nonfinite(losses, jac)
        if self.mode is not None:
            check_no_outside_use(self.capture, jac, autograd, self.names)
        if self.mode == "exact":
            grad_z = logit_grads[0] if logit_grads else self.loss.logit_grad(self.logits.detach(), targets)
            check_directional_derivatives(self.forward, self.params, self.names, jac, grad_z)
        # the records are not kept alive; a broadcast parameter's autograd gradient is its whole batch gradient
        offsets, hooked = self.capture.offsets, frozenset(self.capture.hooked - set(self.capture.broadcast))
        return losses.detach(), jac, _Deferred(lambda: _batch_gradient(jac, autograd, offsets, hooked))

    def gradient(self, targets: torch.Tensor, retain_graph: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``(losses, grad)`` only: a plain backward (the hooks' records are not turned into a Jacobian); it asks
        for the hooked calls' stand-ins too, so that autograd gives every parameter its whole batch gradient."""
        owners, leaves = self.capture.leaves(self.params, range(len(self.params)))
        n = len(self.params)
        with torch.enable_grad(), self.kernels():
            losses = self.loss.per_sample(self.logits, targets)
            _refuse_nonfinite(losses, None)
            grads = torch.autograd.grad(losses.sum(), leaves, retain_graph=retain_graph, allow_unused=True)
        return losses.detach(), flatten(_summed(grads[:n], owners[n:], grads[n:]), self.params)

    def sampled_targets(self, generator: torch.Generator | None) -> torch.Tensor:
        return self.loss.sample_targets(self.logits, self.targets, generator)

    def logit_sqnorm(self, targets: torch.Tensor) -> torch.Tensor:
        return logit_sqnorm(self.loss, self.logits, targets)


def per_sample(
    model: torch.nn.Module,
    inputs: Inputs,
    targets: torch.Tensor,
    params: Iterable[torch.nn.Parameter] | None = None,
    *,
    loss: str | Loss = "cross_entropy",
    check: bool | str = True,
    out: torch.Tensor | None = None,
    form: str = "dense",
) -> PerSample:
    """Per-sample losses, Jacobian ``grad_theta l`` and ``s_iEF`` from one forward and one backward.

    Args:
        model: returns logits ``[M, C]`` / ``[M, T, C]`` (or an object with ``.logits``).
        inputs: tensor, tuple, or dict of keyword arguments for ``model``.
        targets: class indices ``[M]`` / ``[M, T]`` with ``-100`` ignored (cross-entropy), or float targets shaped
            like the logits (``loss="mse"``).
        params: parameters to differentiate; default: the model's trainable ones.
        loss: ``"cross_entropy"`` (default) or ``"mse"``.
        check: ``True`` (default, ~free): refuse batch norm with batch statistics and verify that no hooked
            parameter is used outside its hooked module, so that the rows of ``J`` sum to the batch gradient (see
            :func:`check_no_outside_use`; tied weights are found before and take the exact loop); ``"exact"``:
            that, and every row against exact per-sample directional derivatives along 8 random tangents (one
            batched forward-mode pass, :func:`check_directional_derivatives`); ``False``: no guard.
        out: optional ``[M, P]`` buffer of the parameters' dtype and device to write ``J`` into (overwritten; used
            when its shape matches; for a factored ``form``, the buffer of its materialised columns, whose first
            columns are used when it is wider). The optimisers reuse one across steps.
        form: how ``J`` is returned. ``"dense"`` (default): the ``[M, P]`` tensor. ``"auto"``: a
            :class:`~ief.rows.FactoredJacobian` that never forms ``[M, P]``: each ``nn.Linear`` weight is kept as its
            layer's inputs and output gradients (the "ghost" Gram, cost ``M^2 T^2 (I + O)``) or as per-sample rows
            (``M I O``), whichever is cheaper for that layer; an ``nn.Embedding`` table as the rows the batch uses
            (``[M, U D]``, exact: its other rows are zero in every sample's gradient); every other parameter as its
            (small) column block.
            ``"ghost"`` / ``"rows"`` force one of the two for every Linear weight. ``ief_direction``,
            ``ef_direction`` and ``sf_direction`` take either form; ``.materialize()`` gives the tensor.

    Returns:
        :class:`PerSample` (``losses``, ``jacobian``, ``logit_sqnorm``, ``gradient``).

    Raises:
        ValueError: a bad value, named with the accepted ones: no trainable parameters, a ``params=`` tensor that is
            not a parameter of the model, an empty batch (``M = 0``), a model returning ``()``, logits/targets shape
            mismatch, float targets for cross-entropy, a class index out of range, an unknown ``loss``, ``check`` or
            ``form``.
        FloatingPointError: naming the samples whose loss or row of ``J`` is not finite (never NaN rows).
        PerSampleGradientMismatch: from the guard / the exact check (naming the parameter or the samples).
        ief.model_call.ReentrantCheckpointError: a reentrant ``torch.utils.checkpoint`` outside HuggingFace layers
            (pass ``use_reentrant=False``; HuggingFace's reentrant layers are run non-reentrantly by ``ief``).
    """
    form = check_form(form)
    fwd = _HookedForward(model, inputs, targets, params, loss, check)
    losses, jac, gradient = fwd.jacobian(targets, out=out, form=form)
    return PerSample(losses=losses, jacobian=jac, logit_sqnorm=fwd.logit_sqnorm(targets), gradient=gradient)


def sampled_jacobian(
    model: torch.nn.Module,
    inputs: Inputs,
    targets: torch.Tensor,
    generator: torch.Generator | None = None,
    params: Iterable[torch.nn.Parameter] | None = None,
    *,
    loss: str | Loss = "cross_entropy",
    check: bool | str = True,
    form: str = "dense",
) -> torch.Tensor | FactoredJacobian:
    """``[M, P]`` per-sample gradients for labels drawn from the model's predictive distribution (SF, ``alg:SF``).

    A label is drawn at every non-ignored position of every sample (``targets`` only supply the ignore mask and
    shapes); ``E[J^T J]`` over the draws is the exact Fisher (``sec:app-sample-fisher``). Cost: one forward and one
    backward, as :func:`per_sample`.

    Args:
        model: returns logits ``[M, C]`` / ``[M, T, C]``, as :func:`per_sample`.
        inputs: tensor, tuple, or dict of keyword arguments for ``model``.
        targets: ``[M]`` / ``[M, T]``; only their ``-100`` mask and shape are used.
        generator: the ``torch.Generator`` the labels are drawn with (default ``None``: the global RNG).
        params: parameters to differentiate; default: the model's trainable ones.
        loss: ``"cross_entropy"`` (default) or ``"mse"`` (labels drawn from ``N(z, I)``).
        check: the per-sample guard, as :func:`per_sample` (default ``True``).
        form: ``"dense"`` (default), ``"auto"``, ``"ghost"`` or ``"rows"``, as :func:`per_sample`.

    Returns:
        The sampled per-sample Jacobian ``[M, P]``: a tensor, or a :class:`~ief.rows.FactoredJacobian` for a factored
        ``form``.

    Raises:
        ValueError: as :func:`per_sample`.
        FloatingPointError: logits the labels cannot be drawn from (NaN, ``+inf``, or every class ``-inf``).
    """
    form = check_form(form)
    fwd = _HookedForward(model, inputs, targets, params, loss, check)
    return fwd.jacobian(fwd.sampled_targets(generator), form=form)[1]


def gradient_and_sampled_jacobian(
    model: torch.nn.Module,
    inputs: Inputs,
    targets: torch.Tensor,
    params: Iterable[torch.nn.Parameter] | None = None,
    *,
    loss: str | Loss = "cross_entropy",
    generator: torch.Generator | None = None,
    check: bool | str = True,
    form: str = "dense",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | FactoredJacobian]:
    """``(losses [M], grad [P], sampled J [M, P])`` from one forward and two backward passes, as in ``alg:SF``
    (``form`` as in :func:`per_sample`)."""
    form = check_form(form)
    fwd = _HookedForward(model, inputs, targets, params, loss, check)
    losses, gradient = fwd.gradient(targets, retain_graph=True)
    sampled = fwd.jacobian(fwd.sampled_targets(generator), form=form)[1]
    return losses, gradient, sampled
