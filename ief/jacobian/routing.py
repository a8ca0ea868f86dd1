"""Which hooked calls read rows the data selected: what decides whether a proven sample axis stays proven.

The sample-axis proof (:meth:`ief.jacobian.capture.PerSampleCapture.prove_axes`) holds for the batch it ran on. For
most calls it holds for every batch of the same shapes, since which rows of the batch a call sees is fixed by the
shapes. A call on rows *selected by data* from the batch (a mixture of experts's expert on
``hidden.reshape(-1, d)[idx]``, ``idx`` from the router) sees rows the next batch may choose otherwise: a batch that
routes exactly one token per sample to an expert passes the proof (its rows are the samples, in order), and a later
batch of the same shapes that routes two tokens of one sample and none of another does not. The shapes do not decide
such a proof; the routing does, and it changes with every batch.

:class:`RoutingTracker` runs during the proof forward (not during the steady calls: they pay nothing) and finds those
calls: it marks every tensor computed from the batch's inputs, and among them those *selected by data*: the result of
an indexing of a tensor computed from the batch, along its first dimension (or over its flattened elements), by an
index computed from the batch (``x[idx]``, ``x[None, idx]``, ``x[mask]``, ``index_select`` / ``gather`` /
``take_along_dim`` along dimension 0, ``take``, ``masked_select``; a Python list of indices counts as data, it may
come from ``.tolist()``), and everything computed from those (an expert's second layer, the sum the experts' outputs
are scattered back into). Indexing a parameter or a buffer (an embedding table, a rotary cache indexed by positions),
an index made from the shapes alone (``arange``: a padding mask read at ``[batch_idx, kv_idx]``, pooling
``h[arange(M), lengths]``, whose rows stay with their samples), and an index along another dimension are not
selections of batch rows. A hooked call whose input is marked is *routed*: its model is proven again on every batch
(:meth:`ief.jacobian.capture.PerSampleCapture.establish_axes`), whatever the shapes; the tracker itself only runs in
the proof's forwards, which a model with fixed shapes and no routing runs once.

Rows selected by arithmetic count too: a *contraction over the batch's rows* weighted by data, as Switch-style
dispatch does (a one-hot dispatch tensor made from the router's choice, ``einsum("sec,sd->ecd", dispatch, tokens)``):
an ``einsum`` that sums a tensor computed from the batch over its first index (absent from the output) against
another tensor computed from the batch, or a ``matmul`` / ``mm`` / ``@`` whose right operand is such a tensor of one
or two dimensions (contracted over its first) and whose left one is too. Each output row is then a mixture of batch
rows the data chose (one-hot: a selection; soft weights: a mixing, which the proof refuses), so the call is routed.
A contraction over another index (attention over positions, ``"bsd,bsd->bs"``) keeps the rows with their samples.

What the tracker does not see: rows selected inside a custom autograd function or by an operation not named here
(``tensordot``, ``bmm`` over flattened tokens). Such a model that routes one token per sample on its first batches is
caught by the exact check (``check="exact"``, or an optimiser's ``check=N``): a failed check forgets the model's
proven axes, so the next call proves them again on its own batch.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakTensorKeyDictionary

# the operations that select rows of their first tensor argument by the values of another
_SELECTIONS = frozenset({
    torch.Tensor.__getitem__, torch.Tensor.index_select, torch.index_select, torch.Tensor.gather, torch.gather,
    torch.take, torch.Tensor.take, torch.take_along_dim, torch.Tensor.take_along_dim, torch.masked_select,
    torch.Tensor.masked_select,
})


# the contractions whose sum over a tensor's rows the tracker reads (einsum: its equation; the matrix products: a right
# operand of one or two dimensions is summed over its first)
_MATMULS = frozenset({torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm})


def _einsum_output(inputs: list[str]) -> str:
    """The output subscripts of an implicit ``einsum`` equation: the letters met once, in alphabetical order."""
    letters = "".join(inputs)
    return "".join(sorted(c for c in set(letters) if c.isalpha() and letters.count(c) == 1))


def _tensors(obj, depth: int = 2) -> Iterator[torch.Tensor]:
    """The tensors in ``obj`` (a tensor, or lists, tuples and dicts of them, ``depth`` levels deep)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth and isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item, depth - 1)
    elif depth and isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item, depth - 1)


def _leading_index(index):
    """The part of a ``__getitem__`` index that selects along the first dimension (``None`` entries skipped; an
    ``...`` first selects nothing there)."""
    parts = index if isinstance(index, tuple) else (index,)
    for p in parts:
        if p is not None:
            return None if p is Ellipsis else p
    return None


class RoutingTracker(TorchFunctionMode):
    """Marks the tensors computed from ``inputs`` (:attr:`batch`) and those among them selected by data
    (:attr:`routed`), during a forward run inside it (see the module's docstring).

    Args:
        inputs: the model's inputs (a tensor, or a tuple, list or dict of them).
    """

    def __init__(self, inputs):
        super().__init__()
        self.batch = WeakTensorKeyDictionary()
        self.routed = WeakTensorKeyDictionary()
        for t in _tensors(inputs):
            self.batch[t] = True

    def is_routed(self, tensor: torch.Tensor | None) -> bool:
        """Whether ``tensor`` was computed from rows of the batch that the data selected."""
        return tensor is not None and tensor in self.routed

    def _by_data(self, index) -> bool:
        """Whether an index was chosen by the data: a tensor computed from the batch, or a list (its values may
        come from the data through ``.tolist()``)."""
        return isinstance(index, list) or (isinstance(index, torch.Tensor) and index in self.batch)

    def _selects_rows(self, func, args, kwargs) -> bool:
        """Whether ``func`` selects rows of ``args[0]`` (along its first dimension, or over its flattened elements)
        by an index the data chose."""
        if func is torch.Tensor.__getitem__:
            return len(args) > 1 and self._by_data(_leading_index(args[1]))
        if func in (torch.take, torch.Tensor.take, torch.masked_select, torch.Tensor.masked_select):
            return self._by_data(args[1] if len(args) > 1 else next(iter(kwargs.values()), None))
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        index = args[2] if len(args) > 2 else kwargs.get("index", kwargs.get("indices"))
        if func in (torch.take_along_dim, torch.Tensor.take_along_dim):
            index, dim = (args[1] if len(args) > 1 else kwargs.get("indices")), \
                (args[2] if len(args) > 2 else kwargs.get("dim"))
        first = dim is None or (isinstance(dim, int) and dim in (0, -args[0].dim()))
        return first and self._by_data(index)

    def _contracts_rows(self, func, args, kwargs) -> bool:
        """Whether ``func`` (an ``einsum`` or a matrix product) sums a tensor computed from the batch over its first
        dimension against another tensor computed from the batch (the module's docstring)."""
        if func is torch.einsum:
            if not args or not isinstance(args[0], str):
                return False
            operands = list(args[1:])
            if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
                operands = list(operands[0])
            equation = args[0].replace(" ", "")
            lhs, arrow, rhs = equation.partition("->")
            terms = lhs.split(",")
            rhs = rhs if arrow else _einsum_output(terms)
            data = [isinstance(op, torch.Tensor) and op in self.batch for op in operands]
            for i, term in enumerate(terms[:len(operands)]):
                first = term[:1]
                if not data[i] or not first.isalpha() or first in rhs:
                    continue
                if any(data[j] and first in other for j, other in enumerate(terms[:len(operands)]) if j != i):
                    return True
            return False
        left, right = (args[0], args[1]) if len(args) > 1 else (None, None)
        return (isinstance(left, torch.Tensor) and isinstance(right, torch.Tensor) and right.dim() <= 2
                and left in self.batch and right in self.batch)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        given = [*_tensors(args), *_tensors(kwargs)]
        if not any(t in self.batch for t in given):
            return out
        routed = any(t in self.routed for t in given)
        if not routed and func in _SELECTIONS and args and isinstance(args[0], torch.Tensor) \
                and args[0] in self.batch:
            routed = self._selects_rows(func, args, kwargs)
        if not routed and (func is torch.einsum or func in _MATMULS):
            routed = self._contracts_rows(func, args, kwargs)
        targets = list(_tensors(out))
        if func is torch.Tensor.__setitem__ and args and isinstance(args[0], torch.Tensor):
            targets.append(args[0])  # rows written in place: the written tensor holds them now
        for t in targets:
            self.batch[t] = True
            if routed:
                self.routed[t] = True
        return out
