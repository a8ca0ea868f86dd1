"""Per-sample gradients of tensors used *broadcast over the batch*: bare parameters and embedding outputs that every
sample shares, for the hooks of :mod:`ief.jacobian` (``sec:app-iEF-impl``).

ViT's ``cls_token [1, 1, D]`` is expanded to ``[M, 1, D]``; its ``position_embeddings [1, T, D]`` and the position
embeddings of BERT and GPT-2 (an ``nn.Embedding`` fed ``[1, T]`` ids) are added to the ``[M, T, D]`` hidden states.
Such a tensor ``u`` has no sample axis of its own, but the result ``R`` of the op that broadcasts it has one, and
because sample ``n``'s slice of ``R`` reaches only ``l_n`` (the hooks' standing assumption), sample ``n``'s gradient
of ``u`` through that op is ``dL/dR[n]`` summed over the dimensions along which ``u`` was broadcast.

How: while the forward runs, a :class:`UseTracker` (a ``TorchFunctionMode``) sees every torch call that takes a
watched tensor. Calls whose result needs no gradient (``.shape``, ``.detach()``) or is the tensor itself (a no-op
``.to(device)``) are not uses. A use is supported when it is an addition of two tensors (``+``, ``+=`` into another
tensor, ``torch.add`` without ``alpha``) or an ``expand`` / ``expand_as``; a gradient hook on its result keeps
``dL/dR``. Any other use (``u * x``, ``u[0]``, an in-place update of ``u``, ``u + u``) marks ``u`` unsupported.
The sample axis of every use's result is established as for hooked calls, never guessed from a size: the one-sample
probe forward records the same uses, and the axis is the one dimension of ``R`` that shrinks from ``M`` to 1, along
which ``u`` must be broadcast (size 1 or absent). A tensor with an unsupported use, a use without such an axis, or
uses that differ between the two forwards keeps the exact per-sample loop. Behind this, the rows are checked to sum
to autograd's batch gradient of ``u`` (:func:`sum_mismatch`): a use the mode could not see (e.g. inside a custom
``autograd.Function``) raises rather than being missed.

The tracker holds the watched tensors only while the forward runs (their ids key it); use records keep the gradient
and shapes, never a graph node, so that no gradient hook closes a reference cycle through autograd.
"""
from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import torch
from torch.overrides import TorchFunctionMode

from ..errors import PerSampleGradientMismatch

ADDITIONS = frozenset({"add", "__add__", "__radd__"})
IN_PLACE_ADDITIONS = frozenset({"add_", "__iadd__"})
EXPANSIONS = frozenset({"expand", "expand_as"})


class Use:
    """One supported use of a watched tensor: the watched shape, its result's shape, the gradient flowing into the
    result (summed if it arrives in parts) and the result's sample axis (set by :func:`establish`)."""

    __slots__ = ("name", "shape", "result_shape", "grad", "axis")

    def __init__(self, name: str, shape: tuple, result_shape: tuple):
        self.name, self.shape, self.result_shape = name, shape, result_shape
        self.grad: torch.Tensor | None = None
        self.axis: int | None = None

    def keep(self, grad: torch.Tensor) -> None:
        self.grad = grad if self.grad is None else self.grad + grad


class UseTracker(TorchFunctionMode):
    """Records the uses of watched tensors (``key -> [Use, ...]``, in call order); keys with an unsupported use are
    in ``unsupported``. ``hooks=False`` (the probe) records shapes only."""

    def __init__(self, hooks: bool = True):
        super().__init__()
        self.hooks = hooks
        self.watched: dict[int, Hashable] = {}
        self._alive: list[torch.Tensor] = []  # the watched tensors, while the forward runs (their ids stay theirs)
        self.uses: dict[Hashable, list[Use]] = {}
        self.unsupported: set[Hashable] = set()

    def watch(self, tensor: torch.Tensor, key: Hashable) -> None:
        self.watched[id(tensor)] = key
        self._alive.append(tensor)
        self.uses.setdefault(key, [])

    def release(self) -> None:
        """Forget the watched tensors (after the forward)."""
        self.watched.clear()
        self._alive.clear()

    def _hits(self, args, kwargs) -> list[tuple[int, Hashable]]:
        hits = []
        for pos, a in enumerate((*args, *kwargs.values())):
            if type(a) in (list, tuple):
                hits += [(-1, self.watched[id(b)]) for b in a if id(b) in self.watched]
            elif id(a) in self.watched:
                hits.append((pos, self.watched[id(a)]))
        return hits

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.watched:
            return func(*args, **kwargs)
        hits = self._hits(args, kwargs)
        if not hits:
            return func(*args, **kwargs)
        versions = [(a, a._version) for a in args if id(a) in self.watched]
        result = func(*args, **kwargs)
        keys = {key for _, key in hits}
        if any(a._version != v for a, v in versions):  # a watched tensor modified in place
            self.unsupported |= keys
        else:
            self._record(func, args, kwargs, hits, result, keys)
        return result

    def _record(self, func, args, kwargs, hits, result, keys) -> None:
        if not isinstance(result, torch.Tensor):
            tensors = [r for r in result if isinstance(r, torch.Tensor)] if isinstance(result, (list, tuple)) else []
            if any(t.requires_grad for t in tensors):  # e.g. split / unbind of a watched tensor
                self.unsupported |= keys
            return
        if not result.requires_grad:  # no gradient path (.shape, .detach(), no_grad)
            return
        if func.__name__ not in IN_PLACE_ADDITIONS and any(result is a for a in args):  # e.g. a no-op .to(device)
            return
        name = func.__name__
        pos, key = hits[0]
        supported = len(hits) == 1 and pos >= 0 and (
            (name in ADDITIONS and len(args) == 2 and not kwargs and all(isinstance(a, torch.Tensor) for a in args))
            or (name in IN_PLACE_ADDITIONS and pos == 1 and len(args) == 2 and not kwargs)
            or (name in EXPANSIONS and pos == 0)
        )
        if not supported:
            self.unsupported |= keys
            return
        use = Use(name, tuple(args[pos].shape), tuple(result.shape))
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
    """The watched tensors whose every use is supported and has a sample axis (``key -> uses``, axes set)."""
    ok = {}
    for key, uses in batch.items():
        probed = None if probe is None else probe.get(key)
        if key in unsupported or probed is None or len(probed) != len(uses):
            continue
        axes = [broadcast_axis(u, p, m) for u, p in zip(uses, probed)]
        if uses and all(a is not None for a in axes):
            for u, a in zip(uses, axes):
                u.axis = a
            ok[key] = uses
    return ok


def per_sample_rows(uses: Sequence[Use], m: int, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Sample ``n``'s gradient of the watched tensor, ``[M, numel]``: per use, ``dL/dR`` with the sample axis first,
    summed over the dimensions along which the tensor was broadcast; summed over the uses."""
    rows = torch.zeros(m, numel, dtype=dtype, device=device)
    for use in uses:
        if use.grad is None:  # this use's result did not reach the loss
            continue
        g = use.grad.movedim(use.axis, 0)  # [M, rest of R]
        aligned = (1,) * (g.dim() - len(use.shape)) + use.shape
        rest = aligned[: use.axis] + aligned[use.axis + 1 :]
        dims = [d + 1 for d, (u, r) in enumerate(zip(rest, g.shape[1:])) if u == 1 and r != 1]
        if dims:
            g = g.sum(dim=dims, keepdim=True)
        rows += g.reshape(m, numel).to(dtype)
    return rows


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
