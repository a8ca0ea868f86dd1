"""The capture: hooks that keep every hooked call's input and output gradient, and each call's sample axis.

Forward hooks keep each hooked module's input and a tensor hook on its output keeps the gradient flowing back; while
a hooked module runs, its parameters are replaced by stand-ins (see :class:`PerSampleCapture`). Which modules are
hooked, and how, is their :class:`~ief.jacobian.rules.registry.LayerRule`'s (:func:`~ief.jacobian.rules.rule_for`).

The sample axis of every hooked call is established, never guessed from a size: a probe forward of the batch's first
sample alone shows which dimension of each call's input shrinks from ``M`` to 1 while every other dimension stays
put (the candidate), and a proof forward of the batch in reverse sample order must give every call the batch call's
input reversed along that dimension (:meth:`PerSampleCapture.establish_axes`, cached per model and shape signature).
The size test alone is fooled by a layer called on rows gathered from the flattened batch (a mixture of experts's
expert on its routed tokens, ``hidden.reshape(-1, d)[idx]``: ``k`` routed tokens, ``k = M`` in the batch and 1 for
sample 0 alone); reversing the samples does not reverse such rows (unless every sample routes exactly one token,
when the rows are the samples), so the call has no sample axis and its module's parameters take the exact
per-sample loop.

A call whose output does not reach the loss (peft DoRA's weight-norm call of ``lora_A`` / ``lora_B`` on an identity
matrix, used only detached; any side call) contributes nothing to any sample's gradient, so it needs no sample axis:
the autograd graph behind the logits is walked, and a call whose output's gradient node is not in it is marked
:data:`UNREACHED` instead of demoting its module (:meth:`PerSampleCapture.unreached_calls`); should such a call
receive a gradient after all, its rows are refused, never dropped (:meth:`PerSampleCapture.calls`).
"""
from __future__ import annotations

import contextlib
import itertools
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence

import torch

from ..model_call import extract_logits, graph_nodes
from .errors import PerSampleGradientMismatch
from .routing import RoutingTracker
from .rules import LayerRule, rule_for
from .axes import _same, _sample_axis, _use_shapes, _uses_from
from .broadcast import UseTracker, check_sums, establish, per_sample_rows
from .rules.registry import WHOLE_CALL, recording_hook


def _owner(module: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    """The (sub)module holding parameter ``name`` of ``module`` (``"out_proj.weight"``) and its own name for it."""
    prefix, _, leaf = name.rpartition(".")
    return (module.get_submodule(prefix) if prefix else module), leaf


class _BroadcastCall:
    """The "axis" of an embedding call whose ids every sample shares (``[1, T]`` positions): its output's uses
    broadcast it over the batch, and each sample's gradient of the output comes from them
    (:mod:`ief.jacobian.broadcast`).
    """

    __slots__ = ("uses",)

    def __init__(self, uses: list):
        self.uses = uses


class _Unreached:
    """The "axis" of a call whose output the graph behind the logits does not reach (:data:`UNREACHED`)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "UNREACHED"


UNREACHED = _Unreached()


def reached_nodes(roots: Iterable, targets: Iterable) -> set:
    """The autograd nodes among ``targets`` that the graphs behind the nodes ``roots`` reach (one walk, stopped
    early once every target is found).

    Args:
        roots: autograd nodes (``tensor.grad_fn``; ``None`` entries are skipped).
        targets: the nodes looked for (e.g. the ``node`` of a call's output gradient edge).

    Returns:
        The subset of ``targets`` found.
    """
    wanted, found = set(targets), set()
    for node in graph_nodes(roots):
        if len(found) == len(wanted):
            break
        if node in wanted:
            found.add(node)
    return found


# The established axes, per model and shape signature (a handful of signatures per model: the last ones used).
_AXIS_CACHE: "weakref.WeakKeyDictionary[torch.nn.Module, OrderedDict]" = weakref.WeakKeyDictionary()
_AXIS_CACHE_SIZE = 256
# The hooked modules whose calls once failed the sample-axis proof, per model (their ids, with the reason): a layer
# called on rows gathered over the batch is not proven again at another shape signature, where a batch that routes
# exactly one row per sample would pass the proof. A model with such a module routes by its data: its other calls are
# proven on every batch (no cached axes), since a batch routing one row per sample to another expert would pass the
# proof and be cached for later batches of the same shapes routed otherwise. (A model whose first batches route one
# row per sample everywhere passes the proof; it is known to route all the same, see _ROUTED.)
_GATHERED: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()
# The hooked modules, per model, with a call on rows the data selected from the batch (ief.jacobian.routing, seen in
# a proof forward): the shapes do not decide their proof, the routing does, so the model is proven on every batch
# even when every proof so far passed (a first batch routing one token per sample to every expert).
_ROUTED: "weakref.WeakKeyDictionary[torch.nn.Module, set]" = weakref.WeakKeyDictionary()
# The sets of slow-path parameters already reported, per model (a SlowPathWarning once per model and set).
_WARNED: "weakref.WeakKeyDictionary[torch.nn.Module, set]" = weakref.WeakKeyDictionary()


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
    gradient (:meth:`leaves`). Calls with gradients off run with the real parameters.
    ``shared[i]``: the hooked modules holding parameter ``i`` directly (stand-ins only), a tied weight (an embedding
    table that is also the output head's weight): hooked in each, its rows the sum of their rows (:meth:`fill`), kept
    dense in the factored forms; one of them demoted demotes them all (:meth:`demote`)."""

    def __init__(self, model: torch.nn.Module, params: Sequence[torch.Tensor], stand_ins: bool = False):
        self.swap = stand_ins
        self.model = model
        self.roots: list = []  # the gradient nodes of the logits of the model's calls in the capture
        self.stand_ins: dict[int, list[torch.Tensor]] = {}
        self._originals: dict[tuple[int, str], tuple[torch.nn.Module, torch.Tensor]] = {}
        self.params = list(params)
        index = {id(p): i for i, p in enumerate(self.params)}
        self.sizes = [p.numel() for p in self.params]
        self.offsets = [0, *itertools.accumulate(self.sizes)]  # on the host: no tensor round-trip
        # (module, rule, trailing feature dims, {parameter name in module: index in params})
        self.modules: list[tuple[torch.nn.Module, LayerRule, int, dict[str, int]]] = []
        covered: set[int] = set()
        direct: set[int] = set()  # parameters owned by a module's own _parameters (not through owns_submodules)
        # parameter index -> the hooked modules (k) that use it: a tied weight (an embedding table that is also the
        # output head's weight) is hooked in every module holding it, and its rows are the sum of their rules' rows
        self.shared: dict[int, list[int]] = {}
        for module in model.modules():
            rule = rule_for(module)
            if rule is None:
                continue
            # e.g. a MultiheadAttention also owns its out_proj's parameters (used inside its call, never as a module)
            owned = {n: index[id(p)] for n, p in module.named_parameters(recurse=rule.owns_submodules)
                     if id(p) in index}
            if not owned:
                continue
            overlap = set(owned.values()) & covered
            # shared only per-sample (stand-ins in every holder's calls), between modules holding it directly
            if overlap and not (stand_ins and not rule.owns_submodules and overlap <= direct
                                and all("." not in n for n in owned)):
                continue
            k = len(self.modules)
            for i in overlap:
                self.shared.setdefault(i, [next(j for j, e in enumerate(self.modules) if i in e[3].values())])
                self.shared[i].append(k)
            self.modules.append((module, rule, rule.feature_dims(module), owned))
            covered.update(owned.values())
            if not rule.owns_submodules:
                direct.update(owned.values())
        self.hooked = covered
        # Broadcast uses (broadcast), per-sample capture with more than one sample only: the trainable
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
        self.routed_calls: set[tuple[int, int]] = set()  # (k, j): calls on rows the data selected (a proof saw)
        self.track_routing = True  # whether the proof's forwards look for them (not once the model is known to)
        self.handles: list = []

    def __enter__(self) -> "PerSampleCapture":
        self.stand_ins.clear()
        self.broadcast.clear()
        self.embedding_candidates.clear()
        self.tracker = None
        self.roots = []
        self.handles.append(self.model.register_forward_hook(self._keep_root))
        if self.swap and self.batch_size > 1 and (
                self.bare or any(rule.table for _, rule, *_ in self.modules)):
            self.tracker = UseTracker()
            for i in self.bare:
                self.tracker.watch(self.params[i], ("param", i))
            self.tracker.__enter__()
        for k, (module, rule, _, owned) in enumerate(self.modules):
            self.records[k] = []
            self.edges[k] = []
            # first of the module's forward hooks: the output as the layer returned it (another hook may replace it)
            recorder = rule.call_recorder(self.records[k], self.edges[k]) if self.swap else None
            if recorder is not None:  # a rule that records whole calls (attention, peft wrappers)
                self.handles.append(module.register_forward_hook(recorder, prepend=True, with_kwargs=True))
                self.handles.extend(rule.inner_hooks(module, recorder))  # e.g. a peft wrapper's adapter dropout
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

    def _keep_root(self, module, args, output) -> None:
        """Forward hook of the model itself: keeps its logits' gradient node, the root of the graph the loss is
        differentiated through (:meth:`unreached_calls`); an output without logits keeps none (nothing is proven)."""
        try:
            logits = extract_logits(output)
        except ValueError:
            return
        self.roots.append(logits.grad_fn)

    def _forward_hook(self, k: int):
        calls, edges = self.records[k], self.edges[k]
        record = recording_hook(calls, slots=3)  # [input, output grad, sample axis]
        table = self.modules[k][1].table

        def hook(module, args, output):
            n = len(calls)
            record(module, args, output)
            if len(calls) > n:
                edges.append(torch.autograd.graph.get_gradient_edge(output))
                if not self.swap:
                    return
                x = calls[-1][0]
                if self.tracker is not None and table and x is not None and (
                        x.dim() == 0 or x.shape[0] != self.batch_size or self.batch_size in x.shape[1:]):
                    # ids perhaps shared by all samples ([1, T] positions, T5's [T, T] buckets, T = M included)
                    self.embedding_candidates.add((k, n))
                    self.tracker.watch(output, ("call", k, n))

        return hook

    def unreached_calls(self, calls: Iterable[tuple[int, int]] | None = None,
                        root: torch.Tensor | None = None) -> set[tuple[int, int]]:
        """The recorded calls ``(k, j)`` (module ``k``'s call ``j``) whose output the autograd graph behind the logits
        does not reach: no sample's loss depends on them (e.g. peft DoRA's identity-matrix calls of ``lora_A`` /
        ``lora_B``, whose result is used detached).

        Proven from the graph alone: a call is unreached when its output's gradient node is not among the nodes of
        the graph behind the root. Nothing is proven (an empty set) without a root with a gradient node (the model's
        output had no logits), and for a module whose calls did not record exactly one output edge each.

        Args:
            calls: the calls to decide (default: every recorded call).
            root: the logits the loss is computed from (default: those of the model's calls in the capture,
                :meth:`_keep_root`).

        Returns:
            The unreached calls among ``calls``.
        """
        roots = self.roots if root is None else [root.grad_fn]
        if not any(r is not None for r in roots):
            return set()
        if calls is None:
            calls = [(k, j) for k in self.records for j in range(len(self.records[k]))]
        nodes = {(k, j): self.edges[k][j].node for k, j in calls if len(self.edges[k]) == len(self.records[k])}
        found = reached_nodes(roots, nodes.values())
        return {kj for kj, node in nodes.items() if node not in found}

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
                if isinstance(output, tuple) and self.modules[k][1].records_own_calls:
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

    def call_inputs(self, run: Callable[[], object], batch=None) -> tuple | str:
        """The hooked calls' first inputs (copies) per module, in call order, during ``run()`` (a proof forward), or
        why it failed; calls as the batch forward records them (gradients on, output requiring grad). Given the
        ``batch`` ``run`` feeds the model (and :attr:`track_routing`), the calls on rows the data selected from it
        are added to :attr:`routed_calls` (:class:`ief.jacobian.routing.RoutingTracker`)."""
        seen: dict[int, list] = {k: [] for k in range(len(self.modules))}
        tracker = RoutingTracker(batch) if batch is not None and self.track_routing else None

        def hook_for(k):
            def hook(module, args, output):
                if isinstance(output, tuple) and self.modules[k][1].records_own_calls:
                    output = output[0]
                if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad:
                    x = args[0] if args and isinstance(args[0], torch.Tensor) else None
                    if tracker is not None and tracker.is_routed(x):
                        self.routed_calls.add((k, len(seen[k])))
                    seen[k].append(None if x is None else x.detach().clone())

            return hook

        handles = [module.register_forward_hook(hook_for(k)) for k, (module, *_) in enumerate(self.modules)]
        try:
            with tracker if tracker is not None else contextlib.nullcontext():
                run()
        except Exception as err:
            return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        finally:
            for h in handles:
                h.remove()
        return tuple(tuple(seen[k]) for k in range(len(self.modules)))

    def prove_axes(self, axes: tuple, m: int, prove: Callable[[bool, bool], tuple | str],
                   gathered: dict | None = None,
                   unreached: Callable[[int, int], bool] | None = None) -> tuple[tuple, dict]:
        """``(axes, why)``: the candidate axes (from the sizes) kept where proven, ``None`` where not, and why not
        (``(k, j) -> reason``).

        A candidate ``d`` of call ``j`` of module ``k`` is proven when a forward of the batch in reverse sample order
        gives that call the batch call's input reversed along ``d`` (:func:`_same`). ``prove(reverse, quiet)`` runs the
        batch (in reverse sample order with ``reverse``; with dropout switched off with ``quiet``) and returns
        :meth:`call_inputs`. The batch forward's own records are
        the reference first; the calls that fail against them (dropout drew other masks, an input changed in place
        after the call) are tried again between two quiet forwards, the batch and its reverse, whose calls must also
        have the batch forward's shapes. ``gathered``: ``id(module) -> reason`` of the modules that failed once (not
        proven again), updated with those failing now, unless the failing call is one that ``unreached(k, j)`` says
        does not reach the loss (it is no evidence of a gather: it needs no axis at all)."""
        gathered = {} if gathered is None else gathered
        known = {}
        for k, calls in enumerate(axes):
            why = gathered.get(id(self.modules[k][0]))
            for j, a in enumerate(calls):
                if a is not None and why is not None:
                    known[(k, j, a)] = f"{why}, seen on an earlier batch"
        cands = [(k, j, a) for k, calls in enumerate(axes) for j, a in enumerate(calls)
                 if a is not None and (k, j, a) not in known]
        if not cands and not known:
            return axes, {}

        def check(rev, ref, todo):
            if isinstance(rev, str):
                return {c: f"the proof forward (the batch in reverse order) failed: {rev}" for c in todo}
            bad = {}
            for k, j, a in todo:
                x = ref(k, j)
                if len(rev[k]) != len(self.records[k]) or x is None or not _same(rev[k][j], x.flip(a)):
                    bad[(k, j, a)] = (f"the batch run in reverse sample order does not reverse its input along "
                                      f"dimension {a} (rows gathered over the flattened batch, e.g. a mixture of "
                                      "experts's routed tokens: no sample axis)")
            return bad

        bad = check(prove(True, False), lambda k, j: self.records[k][j][0], cands) if cands else {}
        if bad:
            base = prove(False, True)
            if isinstance(base, str):
                pass
            else:
                def ref(k, j):
                    x, real = base[k][j] if j < len(base[k]) else None, self.records[k][j][0]
                    ok = x is not None and real is not None and len(base[k]) == len(self.records[k]) \
                        and x.shape == real.shape
                    return x if ok else None

                bad = check(prove(True, True), ref, list(bad))
        for (k, j, _), why in bad.items():
            if unreached is not None and unreached(k, j):
                continue
            if not why.startswith("the proof forward"):  # failed to run: no evidence of a gather
                gathered.setdefault(id(self.modules[k][0]), why)
        bad.update(known)
        out = [list(calls) for calls in axes]
        for k, j, _ in bad:
            out[k][j] = None
        return tuple(tuple(calls) for calls in out), {(k, j): why for (k, j, _), why in bad.items()}

    def establish_axes(self, m: int, model: torch.nn.Module, signature: Hashable, probe: Callable[[], tuple | str],
                       prove: Callable[[bool, bool], tuple | str] | None = None) -> None:
        """Give every call its sample axis (probed and proven, or cached); modules with a call without one fall back
        (``prove``: see :meth:`prove_axes`; without it, the sizes alone decide), unless that call's output does not
        reach the loss (:meth:`unreached_calls`, decided for this forward's graph, never cached): it is marked
        :data:`UNREACHED` and needs no axis. The cache's key: ``signature`` (the forward's,
        :func:`ief.model_call.forward_signature`: modules, hooks, dtypes, input shapes), the hooked modules, their
        calls' input shapes and the broadcast uses: a change to any of them proves again."""
        if not self.modules and self.tracker is None:
            return
        if m == 1:  # the whole call is sample 0's; a [N, C, *] layer's own batch dimension N must be that sample
            reasons = {}
            for k, (module, rule, features, _) in enumerate(self.modules):
                for rec in self.records[k]:
                    rec[2] = rule.one_sample_axis(module, rec[0], features)
                if any(rec[2] is None for rec in self.records[k]):
                    reasons[k] = f"{type(module).__name__} called on a batch of several instances for one sample"
            self.demote(reasons)
            return
        full = self.call_shapes()
        dead: list[set] = []

        def unreached(k: int, j: int) -> bool:  # one walk of the graph, on first need
            if not dead:
                dead.append(self.unreached_calls())
            return (k, j) in dead[0]

        key = self._axis_key(m, signature, full)
        cache = _AXIS_CACHE.setdefault(model, OrderedDict())
        cached = cache.get(key)
        if cached is not None and (_GATHERED.get(model) or _ROUTED.get(model)):  # routing depends on the data:
            cached = None  # every batch is proven
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
            unproven = {}
            if prove is not None and not failed:
                self.track_routing = not _ROUTED.get(model)
                axes, unproven = self.prove_axes(axes, m, prove, _GATHERED.setdefault(model, {}), unreached)
                routed = {id(self.modules[k][0]) for k, j in self.routed_calls if not unreached(k, j)}
                if routed:
                    _ROUTED.setdefault(model, set()).update(routed)
            cached = cache[key] = (axes, shrunk if failed else None, None if failed else self.probe_uses, unproven)
            while len(cache) > _AXIS_CACHE_SIZE:
                cache.popitem(last=False)
        else:
            cache.move_to_end(key)
        axes, probe_error, probe_uses, unproven = cached
        shared = {}  # the watched tensors whose every use is broadcast over the batch, with an established axis
        if key[4] is not None and probe_uses is not None:
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
            call_axes = [entry[1].keep_axis(entry[0], axis) for axis in call_axes]  # attention: its own batch
            call_axes = [UNREACHED if axis is None and unreached(k, j) else axis for j, axis in enumerate(call_axes)]
            if all(axis is not None for axis in call_axes):
                for rec, axis in zip(self.records[k], call_axes):
                    rec[2] = axis
                continue
            shapes = sorted({str(shape) for shape, axis in zip(full[k], axes[k]) if axis is None})
            why = [unproven[(k, j)] for j in range(len(axes[k])) if (k, j) in unproven]
            if probe_error is not None:
                reasons[k] = f"the one-sample probe forward that finds the sample axis failed: {probe_error}"
            elif why:
                reasons[k] = f"{type(entry[0]).__name__} input shapes {', '.join(shapes)}: {why[0]}"
            else:
                reasons[k] = (
                    f"{type(entry[0]).__name__} input shapes {', '.join(shapes)} have no dimension that is the {m} "
                    "samples (a probe forward of one sample does not shrink exactly one of them to 1)"
                )
        self.demote(reasons)

    def _axis_key(self, m: int, signature: Hashable, full: tuple) -> tuple:
        uses = None if self.tracker is None else (_use_shapes(self.tracker.uses), frozenset(self.tracker.unsupported))
        return m, signature, tuple(id(module) for module, *_ in self.modules), full, uses

    def will_probe(self, m: int, model: torch.nn.Module, signature: Hashable) -> bool:
        """Whether :meth:`establish_axes` with these arguments, now, runs forwards of its own (the one-sample probe
        and the proof's): no kept proof for this forward's key, or a model whose routing is proven on every batch."""
        if (not self.modules and self.tracker is None) or m == 1:
            return False
        cached = _AXIS_CACHE.get(model, {}).get(self._axis_key(m, signature, self.call_shapes()))
        return cached is None or bool(_GATHERED.get(model) or _ROUTED.get(model))

    @staticmethod
    def forget_axes(model: torch.nn.Module) -> None:
        """Forget the sample axes proven for ``model`` (every shape signature): a failed check has disproved what
        they promised (a sample-mixing layer, rows routed otherwise than on the batch that proved them), so the next
        call proves its own batch's axes again."""
        _AXIS_CACHE.pop(model, None)

    def demote(self, reasons: dict[int, str]) -> None:
        """Send the parameters of hooked modules ``k`` (``reasons``: ``k -> why``) to the per-sample loop: the module
        is no longer hooked; its calls' stand-ins stay, so that the loop differentiates every use (:meth:`leaves`)."""
        if not reasons:
            return
        spread = True  # a tied weight's rows need every holder: one demoted demotes them all (to a fixed point)
        while spread:
            spread = False
            for ks in self.shared.values():
                why = next((reasons[k] for k in ks if k in reasons), None)
                for k in ks if why is not None else ():
                    if k not in reasons:
                        reasons[k] = f"{why} (its weight is tied to this {type(self.modules[k][0]).__name__})"
                        spread = True
        kept = []
        for k, entry in enumerate(self.modules):
            if k not in reasons:
                kept.append((k, entry))
                continue
            for i in entry[3].values():
                self.demoted[i] = reasons[k]
            self.hooked -= set(entry[3].values())
        self.modules = [e for _, e in kept]
        renumber = {old: new for new, (old, _) in enumerate(kept)}
        self.shared = {i: [renumber[k] for k in ks] for i, ks in self.shared.items() if all(k in renumber for k in ks)}
        self.records = {new: self.records[old] for new, (old, _) in enumerate(kept)}
        self.edges = {new: self.edges[old] for new, (old, _) in enumerate(kept)}

    def demote_outside_uses(self, reached: set[int], names: Sequence[str]) -> None:
        """Demote the modules of hooked parameters that the graph reaches outside their hooked calls (``reached``:
        their own gradient accumulators are in the graph, see :func:`ief.model_call.scan_graph`; e.g. a tied weight
        also used bare): their hooked rows would miss that use, the loop's rows are exact."""
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
        for j, (x, grad, axis, *rest) in enumerate(self.records[k]):
            if axis is UNREACHED:  # proven not to reach the loss: a gradient here would be rows left out
                if grad is not None or (len(rest) > 1 and rest[1] is not None):
                    raise PerSampleGradientMismatch(
                        f"call {j} of {type(self.modules[k][0]).__name__} was found not to reach the loss (its "
                        "output's gradient node is not in the graph behind the logits), yet its output received a "
                        "gradient: its per-sample rows cannot be given; differentiate the loss of the logits the "
                        "model returned")
                continue
            if rest and rest[0] is not None:  # a MultiheadAttention call: replayed from its whole input
                if grad is not None or rest[1] is not None:
                    yield (rest[0], axis), (grad, rest[1])
                continue
            if grad is None:  # this call's output did not reach the loss
                continue
            if isinstance(axis, _BroadcastCall):  # ids shared by every sample: each sample's gradient of the output
                m = self.batch_size
                rows = per_sample_rows(axis.uses, m, grad.numel(), grad.dtype, grad.device)
                check_sums(rows, grad, self.name(self.modules[k][3]["weight"]))
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
        tied = {k for ks in self.shared.values() for k in ks}
        for k, (module, rule, _, owned) in enumerate(self.modules):
            dests = {name: jac[:, columns[i] : columns[i] + self.sizes[i]] for name, i in owned.items() if i in columns}
            if k in skip or not dests:
                continue
            accumulate = k in tied
            if accumulate:  # every holder of a tied weight adds its rows to a block zeroed by the first one
                for name, dest in dests.items():
                    if owned[name] not in written:
                        dest.zero_()
            for x, grad in self.calls(k):
                rule.grads(module, x, grad, dests, accumulate)
                accumulate = True
            if accumulate:
                written.update(owned[name] for name in dests)
        return written


