"""Normalisations with per-sample statistics (or running ones): ``nn.LayerNorm``, ``nn.GroupNorm``, and
``nn.BatchNorm1d`` / ``nn.BatchNorm2d`` in eval mode.

Each is an affine map of a normalised ``x_hat`` that depends on the sample alone, so sample ``n``'s gradients are
``sum_positions g * x_hat`` (weight) and ``sum_positions g`` (bias). ``nn.GroupNorm`` normalises each sample per
group (two-pass variance, as the layer computes it); batch norm with running statistics is a per-channel affine map.
Batch norm with batch statistics mixes samples and is refused by the guard.
"""
from __future__ import annotations

import torch

from .registry import BATCH_FIRST, LayerRule, register_rule, write_block


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


class LayerNormRule(LayerRule):
    """``nn.LayerNorm`` with an affine map; its normalised dimensions are the features."""

    def applies(self, module):
        return getattr(module, "elementwise_affine", True)

    def feature_dims(self, module):
        return len(module.normalized_shape)

    def grads(self, module, x, g, dests, accumulate):
        _layernorm_grads(module, x, g, dests, accumulate)


class GroupNormRule(LayerRule):
    """``nn.GroupNorm`` with an affine map, on ``[M, C, *]``."""

    def applies(self, module):
        return module.affine

    def grads(self, module, x, g, dests, accumulate):
        groupnorm_grads(module, x, g, dests, accumulate)


class BatchNormEvalRule(LayerRule):
    """``nn.BatchNorm1d`` / ``nn.BatchNorm2d`` with an affine map and running statistics, in eval mode."""

    def applies(self, module):
        return module.affine and not module.training and module.running_mean is not None

    def grads(self, module, x, g, dests, accumulate):
        _batchnorm_eval_grads(module, x, g, dests, accumulate)


register_rule(torch.nn.LayerNorm, LayerNormRule())
register_rule(torch.nn.GroupNorm, GroupNormRule(features=BATCH_FIRST))
register_rule(torch.nn.BatchNorm1d, BatchNormEvalRule(features=BATCH_FIRST))
register_rule(torch.nn.BatchNorm2d, BatchNormEvalRule(features=BATCH_FIRST))
