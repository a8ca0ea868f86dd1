"""Per-sample gradients of tensors used *broadcast over the batch*: bare parameters and embedding outputs that every
sample shares, for the hooks of :mod:`ief.jacobian` (``sec:app-iEF-impl``).

ViT's ``cls_token [1, 1, D]`` is expanded to ``[M, 1, D]``; its ``position_embeddings [1, T, D]`` and the position
embeddings of BERT and GPT-2 (an ``nn.Embedding`` fed ``[1, T]`` ids) are added to the ``[M, T, D]`` hidden states;
T5's relative attention bias (an ``nn.Embedding`` fed ``[T, T]`` bucket ids) is permuted and unsqueezed to
``[1, H, T, T]`` and added to every layer's ``[M, H, T, T]`` scores (eager attention), or given to
``scaled_dot_product_attention`` as its mask, alone or through ``torch.where`` with a padding or causal mask (SDPA).
Such a tensor ``u`` has no sample axis of its own, but the result ``R`` of the op that broadcasts it has one, and
because sample ``n``'s slice of ``R`` reaches only ``l_n`` (the hooks' standing assumption), sample ``n``'s gradient
of ``u`` through that op is ``dL/dR[n]`` summed over the dimensions along which ``u`` was broadcast, pulled back
through the linear ops that led from ``u`` to that op.

How: while the forward runs, a :class:`UseTracker` (a ``TorchFunctionMode``) sees every torch call that takes a
watched tensor (``u`` or a tensor derived from it by links, below). Calls whose result needs no gradient (``.shape``,
``.detach()``) or is the tensor itself (a no-op ``.to(device)``) are not uses. Supported calls:

- *links*, ops linear in the watched tensor whose result every sample still shares: the shape-only ops
  (``permute``, ``transpose``, ``unsqueeze``, ``squeeze``, ``view`` / ``reshape`` / ``flatten`` / ``movedim`` to
  given sizes, ``contiguous``, a cast ``.to(dtype)`` / ``.float()``), and an addition or ``torch.where`` whose result
  is no larger than the watched tensor (``u + causal_mask`` with a mask ``[1, 1, T, T]``). The result is watched in
  turn; the op is kept (its other tensors detached) to be replayed under ``torch.func.vjp``, vmapped over samples;
- *uses*, the calls that broadcast it over the batch: an addition of two tensors (``+``, ``+=`` into another tensor,
  ``torch.add`` without ``alpha``), an ``expand`` / ``expand_as``, ``torch.where(cond, u, other)`` (either branch)
  whose result is larger than ``u``, and ``scaled_dot_product_attention(..., attn_mask=u)``; for the last two the
  call is given ``u.expand(shape of the result)`` instead of ``u`` (the same values), so autograd's gradient of that
  expansion is ``dL/dR`` already masked as the call masks it, and the use is recorded as that ``expand`` (a padding
  mask that the one-sample probe drops turns ``where`` then attention into attention alone: the same expansion).
  A gradient hook on the result (the expansion) keeps it.

A ``contiguous()`` or ``.to()`` that changes neither shape, dtype nor device gives the same values: its result is
watched as the same tensor, no call recorded.

Any other call (``u * x``, ``u[0]``, an in-place update of ``u``, ``u + u``, a ``view`` to a dtype) marks ``u``
unsupported, and its tensors are no longer watched. In the batch forward an addition, ``where`` or expansion is a
link when its result has as many elements as the watched tensor, else a use; the one-sample probe forward, where
the sizes cannot tell them apart, takes the batch forward's verdict (its ``plan``), and the two forwards must then
record the very same calls. The sample axis of every use's result is established as for hooked calls, never guessed
from a size: it is the one dimension of ``R`` that shrinks from ``M`` to 1 in the probe, along which the watched
tensor is broadcast (size 1 or absent); every link must have the same shapes, arguments and result in both forwards
(so its result is shared by the samples). A tensor with an unsupported call, a use without such an axis, a link that
differs, no use at all, or calls that differ between the two forwards keeps the exact per-sample loop. Behind this,
the rows are checked to sum to autograd's batch gradient of ``u`` (:func:`sum_mismatch`): a use the mode could not
see (e.g. inside a custom ``autograd.Function``) raises rather than being missed.

The tracker holds the watched tensors only while the forward runs (their ids key it); use records keep the gradient,
shapes and detached operands, never a graph node, so that no gradient hook closes a reference cycle through autograd.
"""
from __future__ import annotations

import math
import threading
from collections.abc import Hashable, Sequence

import torch
from torch.overrides import TorchFunctionMode

from .errors import PerSampleGradientMismatch

ADDITIONS = frozenset({"add", "__add__", "__radd__"})
IN_PLACE_ADDITIONS = frozenset({"add_", "__iadd__"})
EXPANSIONS = frozenset({"expand", "expand_as"})
# Linear ops that only move, reshape or cast the entries: sizes, dims and dtypes as arguments, never a tensor.
SHAPE_OPS = frozenset({"permute", "transpose", "unsqueeze", "squeeze", "view", "reshape", "flatten", "movedim",
                       "contiguous", "to", "float", "double"})
ATTENTION = "scaled_dot_product_attention"

# The link/use verdicts of the last batch forward's tracker on this thread (``key -> [is a link, ...]``): the probe
# forward that follows it takes them as its plan (a plan from another forward can only make the two disagree, which
# keeps the loop; the establish step checks every shape).
_LAST_PLAN = threading.local()


def _has_tensor(value) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    return isinstance(value, (list, tuple)) and any(_has_tensor(v) for v in value)


def _describe(value) -> str:
    """An argument as it enters a link's name: a tensor by its shape and dtype, anything else by its ``repr``."""
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)}:{value.dtype}"
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(_describe(v) for v in value) + ")"
    return repr(value)


class _Replay:
    """A link's op as a function of the watched tensor alone (its other tensors detached), for ``torch.func.vjp``."""

    __slots__ = ("func", "args", "kwargs", "slot")

    def __init__(self, func, args: tuple, kwargs: dict, slot):
        self.func, self.slot = func, slot
        self.args = tuple(None if i == slot else a.detach() if isinstance(a, torch.Tensor) else a
                          for i, a in enumerate(args))
        self.kwargs = {k: None if k == slot else v.detach() if isinstance(v, torch.Tensor) else v
                       for k, v in kwargs.items()}

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        args, kwargs = list(self.args), dict(self.kwargs)
        if isinstance(self.slot, str):
            kwargs[self.slot] = t
        else:
            args[self.slot] = t
        return self.func(*args, **kwargs)


class Use:
    """One supported call on a watched tensor (a use, or a link when ``link``): ``shape`` is the shape of the watched
    tensor it takes (node ``parent``: 0 the tensor itself, ``i`` the result of link ``i``), ``result_shape`` its
    result's; a use keeps the gradient flowing into its result (summed if it arrives in parts) and the result's sample
    axis (set by :func:`establish`); a link keeps its op (``replay``) and the node it makes. ``name`` says all the two
    forwards must agree on (the call, its node; a link's arguments)."""

    __slots__ = ("name", "shape", "result_shape", "grad", "axis", "link", "parent", "node", "replay", "source")

    def __init__(self, name: str, shape: tuple, result_shape: tuple, link: bool = False, parent: int = 0,
                 node: int | None = None, replay: _Replay | None = None, source: tuple | None = None):
        self.name, self.shape, self.result_shape = name, shape, result_shape
        self.link, self.parent, self.node, self.replay, self.source = link, parent, node, replay, source
        self.grad: torch.Tensor | None = None
        self.axis: int | None = None

    def keep(self, grad: torch.Tensor) -> None:
        self.grad = grad if self.grad is None else self.grad + grad


class UseTracker(TorchFunctionMode):
    """Records the calls on watched tensors (``key -> [Use, ...]``, in call order); keys with an unsupported call are
    in ``unsupported``. ``hooks=False`` (the probe) records shapes only and classifies links and uses as ``plan``
    says (``key -> [is a link, ...]``; default: the last batch forward's tracker on this thread)."""

    def __init__(self, hooks: bool = True, plan: dict | None = None):
        super().__init__()
        self.hooks = hooks
        self.plan = plan if plan is not None or hooks else getattr(_LAST_PLAN, "plan", None)
        self.watched: dict[int, tuple[Hashable, int]] = {}  # id -> (key, node)
        self._alive: list[torch.Tensor] = []  # the watched tensors, while the forward runs (their ids stay theirs)
        self._nodes: dict[Hashable, int] = {}  # key -> how many nodes it has (the tensor itself and its links')
        self.uses: dict[Hashable, list[Use]] = {}
        self.unsupported: set[Hashable] = set()

    def watch(self, tensor: torch.Tensor, key: Hashable) -> None:
        self.watched[id(tensor)] = (key, 0)
        self._alive.append(tensor)
        self.uses.setdefault(key, [])
        self._nodes.setdefault(key, 1)

    def release(self) -> None:
        """Forget the watched tensors (after the forward); a batch tracker leaves its verdicts as the next probe's
        plan."""
        self.watched.clear()
        self._alive.clear()
        if self.hooks:
            _LAST_PLAN.plan = {key: [u.link for u in uses] for key, uses in self.uses.items()}

    def _refuse(self, keys) -> None:
        """Mark ``keys`` unsupported and stop watching their tensors."""
        self.unsupported |= set(keys)
        for i in [i for i, (key, _) in self.watched.items() if key in keys]:
            del self.watched[i]

    def _hits(self, args, kwargs) -> list[tuple[int | str | None, Hashable, int]]:
        """``(slot, key, node)`` per watched argument: its position, keyword, or ``None`` inside a list."""
        hits = []
        for slot, a in (*enumerate(args), *kwargs.items()):
            if type(a) in (list, tuple):
                hits += [(None, *self.watched[id(b)]) for b in a if id(b) in self.watched]
            elif id(a) in self.watched:
                hits.append((slot, *self.watched[id(a)]))
        return hits

    def _is_link(self, key: Hashable, larger: bool) -> bool:
        """The verdict for the key's next call: the plan's (probe), else whether the result is no larger."""
        if not self.hooks and self.plan is not None:
            planned = self.plan.get(key, [])
            index = len(self.uses[key])
            if index < len(planned):
                return planned[index]
        return not larger

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.watched:
            return func(*args, **kwargs)
        hits = self._hits(args, kwargs)
        if not hits:
            return func(*args, **kwargs)
        keys = {key for _, key, _ in hits}
        expanded = None
        if len(hits) == 1 and hits[0][0] is not None and (
                func is torch.where or getattr(func, "__name__", "") == ATTENTION):
            substituted = self._expand(func, args, kwargs, hits[0])
            if substituted is None:
                self._refuse(keys)
                return func(*args, **kwargs)
            args, kwargs, expanded = substituted
        versions = [(a, a._version) for a in (*args, *kwargs.values()) if id(a) in self.watched]
        result = func(*args, **kwargs)
        if any(a._version != v for a, v in versions):  # a watched tensor modified in place
            self._refuse(keys)
        else:
            self._record(func, args, kwargs, hits, result, keys, expanded)
        return result

    def _expand(self, func, args, kwargs, hit):
        """``torch.where`` and attention calls: ``(args, kwargs, expansion)`` with the watched tensor replaced by its
        expansion to the result's shape when the call broadcasts it over the batch (a use), ``(args, kwargs, None)``
        for a link (``where`` only), ``None`` for an unsupported call."""
        slot, key, _ = hit
        u = args[slot] if isinstance(slot, int) else kwargs[slot]
        if func is torch.where:
            if slot not in (1, 2, "input", "other") or len(args) + len(kwargs) != 3:
                return None
            operands = [*args, *kwargs.values()]
        else:
            if slot not in (3, "attn_mask") or len(args) < 3:
                return None
            q, k = args[0], args[1]
            operands = [u, (*q.shape[:-1], k.shape[-2])]  # the scores' shape
        try:
            shape = torch.broadcast_shapes(*(o.shape if isinstance(o, torch.Tensor) else o for o in operands
                                             if isinstance(o, (torch.Tensor, tuple))))
        except RuntimeError:
            return None
        if self._is_link(key, math.prod(shape) > u.numel()):
            return (args, kwargs, None) if func is torch.where else None
        expansion = u.expand(shape)
        if isinstance(slot, str):
            kwargs = {**kwargs, slot: expansion}
        else:
            args = (*args[:slot], expansion, *args[slot + 1 :])
        return args, kwargs, (expansion, tuple(u.shape))

    def _record(self, func, args, kwargs, hits, result, keys, expanded) -> None:
        name = getattr(func, "__name__", "")
        if not isinstance(result, torch.Tensor):
            tensors = [r for r in result if isinstance(r, torch.Tensor)] if isinstance(result, (list, tuple)) else []
            if any(t.requires_grad for t in tensors):  # e.g. split / unbind of a watched tensor
                self._refuse(keys)
            return
        if not result.requires_grad:  # no gradient path (.shape, .detach(), no_grad)
            return
        if name not in IN_PLACE_ADDITIONS and any(result is a for a in args):  # e.g. a no-op .to(device)
            return
        slot, key, parent = hits[0]
        if len(hits) != 1 or slot is None:
            self._refuse(keys)
            return
        where = " of node " + str(parent) if parent else ""
        if expanded is not None:  # where / attention: the expansion carries the gradient of the use
            expansion, shape = expanded
            self._use(key, Use("expand" + where, shape, tuple(expansion.shape), parent=parent), expansion)
            return
        u = args[slot] if isinstance(slot, int) else kwargs[slot]
        if name in ("contiguous", "to") and slot == 0 and (result.shape, result.dtype, result.device) == (
                u.shape, u.dtype, u.device):  # the same values: the same node (whether or not a copy was made)
            self.watched[id(result)] = (key, parent)
            self._alive.append(result)
            return
        rest = [a for i, a in enumerate(args) if i != slot] + [v for k, v in kwargs.items() if k != slot]
        binary = len(args) == 2 and not kwargs and all(isinstance(a, torch.Tensor) for a in args)
        if name in SHAPE_OPS and slot == 0 and not _has_tensor(rest) and not (
                name == "view" and any(isinstance(a, torch.dtype) for a in rest)):
            link = True
        elif func is torch.where or (name in ADDITIONS and binary) or (
                name in IN_PLACE_ADDITIONS and slot == 1 and binary) or (name in EXPANSIONS and slot == 0):
            link = self._is_link(key, result.numel() > u.numel())
        else:
            self._refuse(keys)
            return
        if not link:
            self._use(key, Use(name + where, tuple(u.shape), tuple(result.shape), parent=parent), result)
            return
        if name in IN_PLACE_ADDITIONS:  # x += u: the replay adds out of place
            func, args = torch.add, (args[0].detach(), args[1])
        node = self._nodes[key]
        self._nodes[key] = node + 1
        signature = ", ".join(_describe(a) for a in rest)
        self.uses[key].append(Use(f"{name}({signature}){where} -> node {node}", tuple(u.shape), tuple(result.shape),
                                  link=True, parent=parent, node=node, replay=_Replay(func, args, kwargs, slot),
                                  source=(u.dtype, u.device)))
        self.watched[id(result)] = (key, node)
        self._alive.append(result)

    def _use(self, key: Hashable, use: Use, result: torch.Tensor) -> None:
        self.uses[key].append(use)
        if self.hooks:
            result.register_hook(use.keep)


def broadcast_axis(use: Use, probed: Use | None, m: int) -> int | None:
    """The sample axis of a use's result: the one dimension that is ``m`` in the batch forward and 1 in the probe,
    every other dimension unchanged, along which the watched tensor is broadcast; ``None`` without such an axis."""
    if probed is None or probed.name != use.name or probed.shape != use.shape:
        return None
    full, one = use.result_shape, probed.result_shape
    if len(full) != len(one) or len(use.shape) > len(full):
        return None
    changed = [d for d, (a, b) in enumerate(zip(full, one)) if a != b]
    if len(changed) != 1 or full[changed[0]] != m or one[changed[0]] != 1:
        return None
    d = changed[0]
    aligned = (1,) * (len(full) - len(use.shape)) + use.shape
    return d if aligned[d] == 1 else None


def establish(batch: dict[Hashable, list[Use]], probe: dict[Hashable, list[Use]] | None, unsupported: set,
              m: int) -> dict[Hashable, list[Use]]:
    """The watched tensors whose calls are all supported, the same in both forwards, with at least one use, every
    use with a sample axis and every link shared by the samples (``key -> uses``, axes set).

    Args:
        batch: the batch forward's calls per watched tensor (:attr:`UseTracker.uses`).
        probe: the one-sample probe's (names and shapes), ``None`` if it failed.
        unsupported: the keys with an unsupported call in either forward.
        m: the number of samples.

    Returns:
        The established keys and their calls.
    """
    ok = {}
    for key, uses in batch.items():
        probed = None if probe is None else probe.get(key)
        if key in unsupported or probed is None or len(probed) != len(uses) or all(u.link for u in uses):
            continue
        axes = [broadcast_axis(u, p, m) if not u.link else (
            0 if (p.name, p.shape, p.result_shape) == (u.name, u.shape, u.result_shape) else None)
            for u, p in zip(uses, probed)]
        if all(a is not None for a in axes):
            for u, a in zip(uses, axes):
                u.axis = None if u.link else a
            ok[key] = uses
    return ok


def _pull_back(link: Use, cotangent: torch.Tensor) -> torch.Tensor:
    """Each sample's gradient of a link's input from its result's, ``[M, *result] -> [M, *input]``: the op's vjp
    (linear in the input: its value does not matter), vmapped over the samples."""
    dtype, device = link.source
    _, vjp = torch.func.vjp(link.replay, torch.zeros(link.shape, dtype=dtype, device=device))
    return torch.func.vmap(vjp)(cotangent)[0]  # the cotangent is on the result's device, as a gradient of it


def per_sample_rows(uses: Sequence[Use], m: int, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Sample ``n``'s gradient of the watched tensor, ``[M, numel]``: per use, ``dL/dR`` with the sample axis first,
    summed over the dimensions along which its input was broadcast; summed per node, and pulled back through the links
    to the watched tensor, last link first.

    Args:
        uses: the tensor's established calls (:func:`establish`), gradients kept.
        m: the number of samples.
        numel: the watched tensor's number of entries.
        dtype: the rows' dtype.
        device: the rows' device.

    Returns:
        ``[M, numel]`` the per-sample gradients (zero where no use reached the loss).
    """
    cotangents: dict[int, torch.Tensor] = {}  # node -> [M, *its shape]
    for use in uses:
        if use.link or use.grad is None:  # a link, or a use whose result did not reach the loss
            continue
        g = use.grad.movedim(use.axis, 0)  # [M, rest of R]
        aligned = (1,) * (g.dim() - len(use.shape)) + use.shape
        rest = aligned[: use.axis] + aligned[use.axis + 1 :]
        dims = [d + 1 for d, (u, r) in enumerate(zip(rest, g.shape[1:])) if u == 1 and r != 1]
        if dims:
            g = g.sum(dim=dims, keepdim=True)
        g = g.reshape(m, *use.shape)
        cotangents[use.parent] = g if use.parent not in cotangents else cotangents[use.parent] + g
    for link in reversed(uses):
        g = cotangents.pop(link.node, None) if link.link else None
        if g is not None:
            g = _pull_back(link, g)
            cotangents[link.parent] = g if link.parent not in cotangents else cotangents[link.parent] + g
    root = cotangents.get(0)
    if root is None:
        return torch.zeros(m, numel, dtype=dtype, device=device)
    return root.reshape(m, numel).to(dtype=dtype, device=device)


def sum_mismatch(rows: torch.Tensor, batch_grad: torch.Tensor | None, name: str) -> str | None:
    """Why the rows of a broadcast tensor do not sum to autograd's batch gradient of it (a use the tracker did not
    see), or ``None`` when they do: ``||sum_n J_n - g|| > 50 sqrt(eps) sqrt(M) ||J||_F`` fails. :mod:`ief.jacobian`
    raises the message as ``PerSampleGradientMismatch``.

    Args:
        rows: ``[M, numel]`` the tensor's per-sample gradients (:func:`per_sample_rows`).
        batch_grad: autograd's batch gradient of it (``None``: it did not reach the loss).
        name: the parameter's name, for the message.

    Returns:
        The message naming ``name`` and the error, or ``None``.
    """
    total = rows.sum(0)
    batch = torch.zeros_like(total) if batch_grad is None else batch_grad.reshape(-1).to(total.dtype)
    err = float(torch.linalg.vector_norm(total - batch, dtype=torch.float64))
    eps = torch.finfo(rows.dtype)
    scale = float(torch.linalg.vector_norm(rows, dtype=torch.float64)) * math.sqrt(rows.shape[0]) + eps.tiny
    if err <= 50 * math.sqrt(eps.eps) * max(scale, float(torch.linalg.vector_norm(batch, dtype=torch.float64))):
        return None
    return (f"the per-sample gradients of {name} (used broadcast over the batch) do not sum to its batch gradient "
            f"(error {err:.2e}, scale {scale:.2e}): it is also used where the tracker of its uses cannot see it (e.g. "
            "inside a custom autograd.Function); pass params= to leave it out")


def check_sums(rows: torch.Tensor, batch_grad: torch.Tensor | None, name: str) -> None:
    """:class:`~ief.jacobian.PerSampleGradientMismatch` when a broadcast tensor's rows miss a use
    (:func:`sum_mismatch`)."""
    mismatch = sum_mismatch(rows, batch_grad, name)
    if mismatch is not None:
        raise PerSampleGradientMismatch(mismatch)
