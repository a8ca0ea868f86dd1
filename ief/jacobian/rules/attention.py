"""``nn.MultiheadAttention``: its calls replayed per sample.

Its parameters (``in_proj_weight`` / ``in_proj_bias``, the separate ``q/k/v_proj_weight``, ``bias_k`` / ``bias_v``
and ``out_proj``) are used inside ``F.multi_head_attention_forward``, out of reach of hooks, so the whole call is
recorded (its arguments detached) and replayed per sample, ``torch.func.vmap`` over the samples of
``grad_theta <f_theta(x_n), g_n>`` (plus the attention weights' term when they reach the loss): one vectorised
forward and backward of that layer instead of ``M`` backward passes of the model. Only without dropout inside the
layer (eval mode or ``dropout=0``), whose masks a replay would redraw; its samples must be its own batch dimension.
"""
from __future__ import annotations

import inspect

import torch

from .registry import LayerRule, register_rule, write_block


def mha_is_replayable(module: torch.nn.Module) -> bool:
    """Whether ``module`` is an ``nn.MultiheadAttention`` whose calls :func:`mha_grads` can replay exactly (no dropout
    masks to redraw)."""
    return type(module) is torch.nn.MultiheadAttention and not (module.training and module.dropout > 0)


def mha_batch_dim(module: torch.nn.MultiheadAttention) -> int:
    """The dimension of a batched query that indexes the batch (``batch_first``: 0, else 1)."""
    return 0 if module.batch_first else 1


_MHA_SIGNATURE = inspect.signature(torch.nn.MultiheadAttention.forward)


def mha_grads(module: torch.nn.MultiheadAttention, call, grads, dests, accumulate: bool) -> None:
    """``nn.MultiheadAttention``: ``call = ((args, kwargs), axis)`` as recorded (tensors detached, ``axis`` the batch
    dimension of query, key and value), ``grads = (dL/d attn_output, dL/d attn_weights or None)``; each sample's
    gradient of ``<out_n, g_n> (+ <w_n, h_n>)`` by ``torch.func.vmap`` of ``grad`` over the samples."""
    from torch.func import functional_call, grad, vmap

    (args, kwargs), axis = call
    bound = _MHA_SIGNATURE.bind(module, *args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    query, key, value = a["query"], a["key"], a["value"]
    m = query.shape[axis]
    padding, mask = a["key_padding_mask"], a["attn_mask"]
    mask_dim = None
    if mask is not None and mask.dim() == 3:  # [M * heads, T, S]: sample n's [heads, T, S]
        mask, mask_dim = mask.reshape(m, -1, *mask.shape[1:]), 0
    out_grad, weight_grad = grads
    if out_grad is None:
        out_grad = torch.zeros_like(query)
    options = dict(need_weights=a["need_weights"], average_attn_weights=a["average_attn_weights"],
                   is_causal=a["is_causal"])
    params = {n: p.detach() for n, p in module.named_parameters()}

    def contracted(p, q, k, v, pad, msk, g_out, g_weights):
        out, weights = functional_call(module, p, (q.unsqueeze(axis), k.unsqueeze(axis), v.unsqueeze(axis)), dict(
            key_padding_mask=None if pad is None else pad.unsqueeze(0), attn_mask=msk, **options))
        total = (out * g_out.unsqueeze(axis)).sum()
        if g_weights is not None:
            total = total + (weights * g_weights.unsqueeze(0)).sum()
        return total

    in_dims = (None, axis, axis, axis, None if padding is None else 0, mask_dim, axis,
               None if weight_grad is None else 0)
    rows = vmap(grad(contracted), in_dims=in_dims)(params, query, key, value, padding, mask, out_grad, weight_grad)
    for name, dest in dests.items():
        write_block(dest, rows[name].reshape(m, -1).to(dest.dtype), accumulate)


class AttentionRule(LayerRule):
    """``nn.MultiheadAttention`` without dropout: records ``[query, dL/d attn_output, axis, (args, kwargs),
    dL/d weights]`` per call and replays it (:func:`mha_grads`)."""

    owns_submodules = True  # also owns its out_proj's parameters (used inside its call, never as a module)

    def applies(self, module):
        return mha_is_replayable(module)

    def grads(self, module, x, g, dests, accumulate):
        mha_grads(module, x, g, dests, accumulate)

    def one_sample_axis(self, module, x, features):  # a batched call: the batch is the sample
        one = x is not None and x.dim() == 3 and x.shape[mha_batch_dim(module)] == 1
        return mha_batch_dim(module) if one else None

    def keep_axis(self, module, axis):  # its samples must be its own batch: no other mixes
        return axis if axis == mha_batch_dim(module) else None

    def call_recorder(self, calls: list, edges: list):
        """Records a ``MultiheadAttention`` call: ``[query, dL/d attn_output, axis, (args, kwargs), dL/d weights]``,
        its inputs detached (:func:`mha_grads` replays the call per sample)."""

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


register_rule(torch.nn.MultiheadAttention, AttentionRule())
