"""Per-sample gradient rules for layers beyond ``nn.Linear`` / ``nn.Embedding`` / ``nn.LayerNorm`` / ``nn.Conv2d``,
for the hooks of :mod:`ief.jacobian` (``sec:app-iEF-impl``).

Each rule gets one module call's input ``x`` and the gradient ``g`` flowing into its output, both with the sample axis
first, and writes sample ``n``'s gradient of every parameter into ``dests`` (name -> ``[M, numel]`` column block of
``J``), copying on a module's first call and adding on later ones (``accumulate``):

- HF ``Conv1D`` (``transformers.pytorch_utils``: GPT-2's linear layer, ``y = x W + b`` with ``W [in, out]``, the
  transpose of ``nn.Linear``'s layout): ``J_n = A_n^T G_n`` summed over the positions, ``G_n^T 1`` for the bias.
- ``nn.GroupNorm``: each sample is normalised on its own (per group), ``x_hat`` from that sample's statistics; the
  rows are ``sum_positions g * x_hat`` (weight) and ``sum_positions g`` (bias) per channel.
- ``nn.MultiheadAttention`` (``in_proj_weight`` / ``in_proj_bias``, the separate ``q/k/v_proj_weight``,
  ``bias_k`` / ``bias_v`` and ``out_proj``): its projections happen inside ``F.multi_head_attention_forward``, out of
  reach of hooks, so the call is replayed per sample from its recorded inputs, ``torch.func.vmap`` over the samples
  of ``grad_theta <f_theta(x_n), g_n>`` (plus the attention weights' term when they reach the loss): one vectorised
  forward and backward of that layer instead of ``M`` backward passes of the model. Only without dropout inside the
  layer (eval mode or ``dropout=0``), whose masks a replay would redraw.
"""
from __future__ import annotations

import inspect

import torch


def is_hf_conv1d(module: torch.nn.Module) -> bool:
    """Whether ``module`` is exactly transformers' ``Conv1D`` (``y = x W + b``, ``W [in, out]``): checked by class
    name and defining module, so that transformers is never imported here."""
    cls = type(module)
    return (cls.__name__ == "Conv1D" and cls.__module__ == "transformers.pytorch_utils"
            and getattr(module, "weight", None) is not None and module.weight.dim() == 2)


def write_block(dest: torch.Tensor, value: torch.Tensor, accumulate: bool) -> None:
    """Write one call's per-sample gradients into their column block of J: copied on a module's first call, added on
    later calls (``accumulate``). ``dest``: a strided ``[M, numel]`` view; ``value``: anything of its size."""
    value = value.reshape(dest.shape)
    dest.add_(value) if accumulate else dest.copy_(value)


def hf_conv1d_grads(module: torch.nn.Module, x: torch.Tensor, g: torch.Tensor, dests, accumulate: bool) -> None:
    """HF ``Conv1D``: ``sum_t a_t g_t^T`` (``[in, out]``, the weight's own layout) and ``sum_t g_t``."""
    m, dtype = x.shape[0], next(iter(dests.values())).dtype
    a = x.reshape(m, -1, x.shape[-1]).to(dtype)  # [M, T, in]
    g = g.reshape(m, -1, g.shape[-1]).to(dtype)  # [M, T, out]
    if "weight" in dests:  # written in place: no J-sized temporary
        block = dests["weight"].unflatten(1, (a.shape[-1], g.shape[-1]))  # [M, in, out]
        block.baddbmm_(a.transpose(1, 2), g, beta=1 if accumulate else 0)
    if "bias" in dests:
        write_block(dests["bias"], g.sum(dim=1), accumulate)


def groupnorm_grads(module: torch.nn.GroupNorm, x: torch.Tensor, g: torch.Tensor, dests, accumulate: bool) -> None:
    """``nn.GroupNorm`` on ``x [M, C, *positions]``: per channel ``sum_positions g * x_hat`` and ``sum_positions g``,
    ``x_hat`` normalised over each sample's group (two-pass variance, as the layer computes it)."""
    m, c = x.shape[:2]
    grouped = x.to(g.dtype).reshape(m, module.num_groups, -1)
    centred = grouped - grouped.mean(dim=2, keepdim=True)
    x_hat = (centred * torch.rsqrt(centred.square().mean(dim=2, keepdim=True) + module.eps)).reshape(m, c, -1)
    g = g.reshape(m, c, -1)
    if "weight" in dests:
        write_block(dests["weight"], (g * x_hat).sum(dim=2), accumulate)
    if "bias" in dests:
        write_block(dests["bias"], g.sum(dim=2), accumulate)


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
