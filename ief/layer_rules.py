"""Per-sample gradient rules for layers beyond ``nn.Linear`` / ``nn.Embedding`` / ``nn.LayerNorm`` / ``nn.Conv2d``,
for the hooks of :mod:`ief.jacobian` (``sec:app-iEF-impl``).

Each rule gets one module call's input ``x`` and the gradient ``g`` flowing into its output, both with the sample axis
first, and writes sample ``n``'s gradient of every parameter into ``dests`` (name -> ``[M, numel]`` column block of
``J``), copying on a module's first call and adding on later ones (``accumulate``):

- HF ``Conv1D`` (``transformers.pytorch_utils``: GPT-2's linear layer, ``y = x W + b`` with ``W [in, out]``, the
  transpose of ``nn.Linear``'s layout): ``J_n = A_n^T G_n`` summed over the positions, ``G_n^T 1`` for the bias.
- ``nn.GroupNorm``: each sample is normalised on its own (per group), ``x_hat`` from that sample's statistics; the
  rows are ``sum_positions g * x_hat`` (weight) and ``sum_positions g`` (bias) per channel.
"""
from __future__ import annotations

import torch


def is_hf_conv1d(module: torch.nn.Module) -> bool:
    """Whether ``module`` is exactly transformers' ``Conv1D`` (``y = x W + b``, ``W [in, out]``): checked by class
    name and defining module, so that transformers is never imported here."""
    cls = type(module)
    return (cls.__name__ == "Conv1D" and cls.__module__ == "transformers.pytorch_utils"
            and getattr(module, "weight", None) is not None and module.weight.dim() == 2)


def _write(dest: torch.Tensor, value: torch.Tensor, accumulate: bool) -> None:
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
        _write(dests["bias"], g.sum(dim=1), accumulate)


def groupnorm_grads(module: torch.nn.GroupNorm, x: torch.Tensor, g: torch.Tensor, dests, accumulate: bool) -> None:
    """``nn.GroupNorm`` on ``x [M, C, *positions]``: per channel ``sum_positions g * x_hat`` and ``sum_positions g``,
    ``x_hat`` normalised over each sample's group (two-pass variance, as the layer computes it)."""
    m, c = x.shape[:2]
    grouped = x.to(g.dtype).reshape(m, module.num_groups, -1)
    centred = grouped - grouped.mean(dim=2, keepdim=True)
    x_hat = (centred * torch.rsqrt(centred.square().mean(dim=2, keepdim=True) + module.eps)).reshape(m, c, -1)
    g = g.reshape(m, c, -1)
    if "weight" in dests:
        _write(dests["weight"], (g * x_hat).sum(dim=2), accumulate)
    if "bias" in dests:
        _write(dests["bias"], g.sum(dim=2), accumulate)
