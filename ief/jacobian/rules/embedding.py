"""``nn.Embedding``: sample ``n``'s gradient of the table is its output gradients scattered to the rows it looked up.

In the factored forms a table keeps only the rows the batch uses (``[M, U D]``, exact: every other row is zero in
every sample's gradient). An embedding call whose ids every sample shares (position embeddings fed ``[1, T]`` ids)
has no sample axis of its own: its rows come from the uses that broadcast its output over the batch
(:mod:`ief.jacobian.broadcast`).
"""
from __future__ import annotations

import torch

from .registry import LayerRule, register_rule


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


class EmbeddingRule(LayerRule):
    """``nn.Embedding`` without ``max_norm`` or ``scale_grad_by_freq``; a table (see :attr:`LayerRule.table`)."""

    table = True

    def applies(self, module):
        return module.max_norm is None and not module.scale_grad_by_freq

    def grads(self, module, x, g, dests, accumulate, rows=None):
        _embedding_grads(module, x, g, dests, accumulate, rows=rows)


register_rule(torch.nn.Embedding, EmbeddingRule(features=0))
