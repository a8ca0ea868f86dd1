"""The assembly: one backward through the capture's hooks, and the per-sample rows it gives, as a tensor or as
:class:`~ief.rows.FactoredJacobian`.

``J`` comes in two forms (``form=``): the ``[M, P]`` tensor (``"dense"``), or a :class:`~ief.rows.FactoredJacobian`
(``"auto"``, ``"ghost"``, ``"rows"``) that keeps the weight of every layer whose rule has ghost factors
(:meth:`LayerRule.factored <ief.jacobian.rules.registry.LayerRule.factored>`: ``nn.Linear``, HF ``Conv1D``,
one-group convolutions) as its layer's inputs and output gradients when that is cheaper (:func:`ief.rows.prefer_ghost`),
and an embedding table as the rows the batch uses.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..model_call import large_empty
from ..rows import FactoredJacobian, as_rows
from ..streamed import StreamedRows, choose_forms
from .capture import PerSampleCapture
from .loop import loop_rows
from .broadcast import check_sums, per_sample_rows


def _positions(parts: list[torch.Tensor]) -> torch.Tensor:
    """The calls of one layer concatenated along the positions (no copy for a single call)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _summed(grads: Sequence[torch.Tensor | None], owners: Sequence[int], extra: Sequence[torch.Tensor | None]):
    """``grads`` (one per parameter) with the gradients ``extra`` of further leaves added to their ``owners``."""
    out = list(grads)
    for i, g in zip(owners, extra):
        if g is not None:
            out[i] = g if out[i] is None else out[i] + g
    return out


def _batch_backward(capture: PerSampleCapture, losses: torch.Tensor, params: Sequence[torch.Tensor],
                    retain_graph: bool, fallback: list[int], loop_owners: list[int], loop_inputs: list[torch.Tensor]):
    """The one batch backward: fills the hooks' output gradients; returns what autograd gives each parameter."""
    extra = len(loop_inputs) - len(fallback)
    inputs = [*params, *loop_inputs[len(fallback):], *capture.output_edges()]
    grads = torch.autograd.grad(losses.sum(), inputs, retain_graph=retain_graph or bool(fallback), allow_unused=True)
    return _summed(grads[: len(params)], loop_owners[len(fallback):], grads[len(params) : len(params) + extra])


def _factored_layers(capture: PerSampleCapture, m: int, form: str, dtype: torch.dtype, budget: float):
    """The layers a factored form keeps unexpanded: ``(ghosts, ghost modules, bias rows, tables, streamed)``.

    ``ghosts``: ``[(parameter index, A [M, T, I], G [M, T, O])]`` of the weights kept as factors (the ghost kernel's,
    or the streamed form's: :func:`ief.streamed.choose_forms`, with ``budget`` the bytes of rows ``"auto"`` may keep);
    ``bias rows``: parameter index -> ``[M, O]`` of their layers' biases; ``tables``: ``k -> (parameter index, used
    ids [U], the calls)`` of embedding tables kept as their used rows; ``streamed``: the parameter indices of
    ``ghosts`` in the streamed form."""
    ghosts, ghost_modules, bias_rows, tables, streamed = [], set(), {}, {}, set()
    if form == "dense":
        return ghosts, ghost_modules, bias_rows, tables, streamed
    tied = {k for ks in capture.shared.values() for k in ks}
    factored, shapes, kept = [], [], sum(capture.sizes)  # kept: the columns of J whatever the weights' forms
    for k, (module, rule, _, owned) in enumerate(capture.modules):
        if k in tied:  # a tied weight's rows sum several rules' rows: kept dense (capture.fill)
            continue
        if rule.table and "weight" in owned:
            calls = list(capture.calls(k))
            if calls:
                ids = torch.unique(torch.cat([x.reshape(-1) for x, _ in calls]))  # sorted
                if ids.numel() < module.num_embeddings:
                    tables[k] = (owned["weight"], ids, calls)
                    kept -= capture.sizes[owned["weight"]] - ids.numel() * module.embedding_dim
            continue
        calls = list(capture.calls(k)) if "weight" in owned and rule.factored(module) else []
        if not calls:
            continue
        positions = sum(rule.positions(module, d) for _, d in calls)
        fan_out, fan_in = getattr(module, "weight").flatten(1).shape
        factored.append((k, calls))
        shapes.append((m, positions, fan_in, fan_out))
        kept -= capture.sizes[owned["weight"]]
    itemsize = torch.empty((), dtype=dtype).element_size()
    for (k, calls), kind in zip(factored, choose_forms(form, shapes, itemsize, budget, itemsize * m * kept)):
        if kind == "rows":
            continue
        module, rule, _, owned = capture.modules[k]
        calls = [rule.factors(module, x, d) for x, d in calls]  # the factors only now: an unfold is not free
        a = _positions([x for x, _ in calls]).to(dtype)  # [M, T, I]
        g = _positions([d for _, d in calls]).to(dtype)  # [M, T, O]
        ghosts.append((owned["weight"], a, g))
        ghost_modules.add(k)
        if kind == "streamed":
            streamed.add(owned["weight"])
        if "bias" in owned:  # the output gradients (A for HF Conv1D, see its rule)
            bias_rows[owned["bias"]] = rule.bias_rows(module, a, g)
    return ghosts, ghost_modules, bias_rows, tables, streamed


def _buffer(out: torch.Tensor | None, m: int, width: int, form: str, ref: torch.Tensor) -> torch.Tensor:
    """``[M, width]`` of ``ref``'s dtype and device: ``out`` (or its first columns) when it fits, else new memory."""
    if out is not None and out.dtype == ref.dtype and out.device == ref.device and out.shape[0] == m and (
            out.shape[1] == width or (form != "dense" and out.shape[1] > width)):
        return out[:, :width]  # a reused buffer (its pages are already mapped: a fresh J-sized allocation page-faults)
    return large_empty((m, width), ref.dtype, ref.device)


def _backward_jacobian(
    capture: PerSampleCapture,
    losses: torch.Tensor,
    params: Sequence[torch.Tensor],
    retain_graph: bool,
    out: torch.Tensor | None = None,
    form: str = "dense",
    budget: float = math.inf,
) -> tuple[torch.Tensor | FactoredJacobian, list[torch.Tensor | None]]:
    """One backward of ``sum(losses)`` through the hooks (plus the loop for unhooked parameters): ``(J, autograd)``,
    ``J`` an ``[M, P]`` tensor (``form="dense"``) or a :class:`~ief.rows.FactoredJacobian` (``"auto"``, ``"ghost"``,
    ``"rows"``, ``"streamed"``: the form of every factored weight, :func:`ief.streamed.choose_forms`, ``budget`` the
    bytes of rows ``"auto"`` may keep).

    ``autograd[i]`` is what autograd's batch backward gives parameter ``i``: its whole batch gradient for a parameter
    of the per-sample loop; for a hooked one (its module's calls ran with stand-ins, see :class:`PerSampleCapture`)
    only the contribution of its uses outside those calls, ``None`` when there are none (the guard reads it, and
    :func:`_batch_gradient` adds it to ``J^T 1``). Autograd never computes a hooked layer's batch weight gradient:
    the backward asks for the hooked calls' outputs instead (their gradient edges), which is all the rules need."""
    m = losses.shape[0]
    fallback = [i for i in range(len(params)) if i not in capture.hooked]
    capture.clear_grads()
    loop_owners, loop_inputs = capture.leaves(params, fallback)  # demoted modules: the parameter and its stand-ins
    autograd = _batch_backward(capture, losses, params, retain_graph, fallback, loop_owners, loop_inputs)
    ref = params[0]
    ghosts, ghost_modules, bias_rows, tables, streamed = _factored_layers(capture, m, form, ref.dtype, budget)
    # the column layout: every parameter not kept as factors, a table as its used rows
    ghosted = {i for i, _, _ in ghosts}
    used_rows = {i: (ids, capture.modules[k][0].embedding_dim) for k, (i, ids, _) in tables.items()}
    widths = {i: ids.numel() * dim for i, (ids, dim) in used_rows.items()}  # a table's columns: its used rows
    columns, width = {}, 0
    for i, size in enumerate(capture.sizes):
        if i not in ghosted:
            columns[i] = width
            width += widths.get(i, size)
    jac = _buffer(out, m, width, form, ref)
    written = capture.fill(jac, columns, skip=ghost_modules | set(tables))
    for k, (i, ids, calls) in tables.items():
        module, rule = capture.modules[k][:2]
        dest = {"weight": jac[:, columns[i] : columns[i] + widths[i]]}
        for n, (x, grad) in enumerate(calls):
            rule.grads(module, x, grad, dest, n > 0, rows=ids)
        written.add(i)
    for i, uses in capture.broadcast.items():  # bare parameters broadcast over the batch: rows from their uses
        if i in columns:
            rows = per_sample_rows(uses, m, capture.sizes[i], ref.dtype, ref.device)
            check_sums(rows, autograd[i], capture.name(i))
            jac[:, columns[i] : columns[i] + capture.sizes[i]] = rows
            written.add(i)
    for i, rows in bias_rows.items():
        jac[:, columns[i] : columns[i] + capture.sizes[i]] = rows
        written.add(i)
    for i, lo in columns.items():
        if i not in written:  # fallback blocks and hooked parameters the loss did not reach
            jac[:, lo : lo + capture.sizes[i]].zero_()
    if fallback:
        loop_rows(capture, losses, loop_owners, loop_inputs, jac, columns, retain_graph)
    if form == "dense":
        return jac, autograd
    if streamed:  # some weights' rows are formed a block at a time for each product (ief.streamed)
        return StreamedRows(m, capture.sizes, ref, ghosts, jac, columns, used_rows, streamed=streamed), autograd
    return FactoredJacobian(m, capture.sizes, ref, ghosts, jac, columns, used_rows), autograd


def _batch_gradient(jacobian: torch.Tensor | FactoredJacobian, autograd: Sequence[torch.Tensor | None],
                    offsets: Sequence[int], hooked: frozenset[int]) -> torch.Tensor:
    """``grad_theta L`` ``[P]`` after :func:`_backward_jacobian`: a hooked parameter's rows summed (``J^T 1``) plus
    its uses outside its hooked calls; autograd's batch gradient for a parameter of the per-sample loop."""
    total = as_rows(jacobian).row_sum()
    for i, g in enumerate(autograd):
        dest = total[offsets[i] : offsets[i + 1]]
        if i not in hooked:
            dest.copy_(g.reshape(-1)) if g is not None else dest.zero_()
        elif g is not None:
            dest += g.reshape(-1)
    return total
