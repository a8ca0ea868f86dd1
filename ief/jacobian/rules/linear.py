"""``nn.Linear`` and HF ``Conv1D``: a weight shared over positions, ``J_n = sum_t g_t a_t^T``, with ghost factors.

``nn.Linear`` (LoRA A/B, heads, MLPs): ``y = x W^T + b``; per sample the weight gradient is ``G_n^T A_n`` (``A`` the
inputs ``[T, in]``, ``G`` the output gradients ``[T, out]``), formed with one batched matmul, and the bias gradient
``G_n^T 1``. HF ``Conv1D`` (``transformers.pytorch_utils``: GPT-2's linear layer, ``y = x W + b`` with ``W [in, out]``,
the transpose of ``nn.Linear``'s layout): ``J_n = A_n^T G_n`` summed over the positions; in the factored form its
``[in, out]`` weight is ``X_n^T G_n``, so ``A`` is its output gradients and ``G`` its inputs. HF ``Conv1D`` is
recognised by class name and defining module, so that transformers is never imported here.
"""
from __future__ import annotations

import torch

from .registry import LayerRule, register_by_name, register_rule, write_block


def _linear_grads(module: torch.nn.Linear, a: torch.Tensor, g: torch.Tensor, dests, accumulate: bool) -> None:
    m, dtype = a.shape[0], next(iter(dests.values())).dtype
    a = a.reshape(m, -1, a.shape[-1]).to(dtype)  # [M, T, in]
    g = g.reshape(m, -1, g.shape[-1]).to(dtype)  # [M, T, out]
    if "weight" in dests:  # sum_t g_t a_t^T, written in place: no J-sized temporary
        block = dests["weight"].unflatten(1, (g.shape[-1], a.shape[-1]))  # [M, out, in]
        block.baddbmm_(g.transpose(1, 2), a, beta=1 if accumulate else 0)
    if "bias" in dests:
        write_block(dests["bias"], g.sum(dim=1), accumulate)


def is_hf_conv1d(module: torch.nn.Module) -> bool:
    """Whether ``module`` is exactly transformers' ``Conv1D`` (``y = x W + b``, ``W [in, out]``): checked by class
    name and defining module, so that transformers is never imported here."""
    cls = type(module)
    return (cls.__name__ == "Conv1D" and cls.__module__ == "transformers.pytorch_utils"
            and getattr(module, "weight", None) is not None and module.weight.dim() == 2)


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


class LinearRule(LayerRule):
    """``nn.Linear``: rows ``G_n^T A_n`` (weight) and ``G_n^T 1`` (bias); factors ``(A, G)``."""

    def grads(self, module, x, g, dests, accumulate):
        _linear_grads(module, x, g, dests, accumulate)

    def factored(self, module):
        return True

    def factors(self, module, x, g):
        m = x.shape[0]
        return x.reshape(m, -1, x.shape[-1]), g.reshape(m, -1, g.shape[-1])


class HFConv1DRule(LayerRule):
    """HF ``Conv1D``: rows ``A_n^T G_n`` in the ``[in, out]`` layout; factors ``(G, X)`` (see the module docstring)."""

    def applies(self, module):
        return is_hf_conv1d(module)

    def grads(self, module, x, g, dests, accumulate):
        hf_conv1d_grads(module, x, g, dests, accumulate)

    def factored(self, module):
        return True

    def factors(self, module, x, g):
        m = x.shape[0]
        return g.reshape(m, -1, g.shape[-1]), x.reshape(m, -1, x.shape[-1])

    def bias_rows(self, module, a, g):
        return a.sum(dim=1)  # the output gradients are A here


register_rule(torch.nn.Linear, LinearRule())
register_by_name("transformers.pytorch_utils.Conv1D", HFConv1DRule())
