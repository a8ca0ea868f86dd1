"""peft LoKr on linear layers (``peft.tuners.lokr.layer.Linear``): per-sample gradients of the Kronecker factors.

The wrapper adds ``x dW^T`` to the base output, ``dW = s kron(W1, W2)`` with ``W1 [a, c]`` and ``W2 [b, d]``
(``out = a b``, ``in = c d``), each factor a full matrix (``lokr_w1`` / ``lokr_w2``) or a product
(``lokr_w1_a @ lokr_w1_b``, ``lokr_w2_a @ lokr_w2_b``). Viewing each position's input as ``X_t [c, d]`` and output
gradient as ``G_t [a, b]``, the delta is ``s W1 X_t W2^T``, so sample ``n``'s gradients are
``grad W1 = s sum_t G_t W2 X_t^T`` and ``grad W2 = s sum_t G_t^T W1 X_t`` (never the ``[out, in]`` update), then the
chain rule to a product's factors (``grad W1a = grad W1 W1b^T``, ``grad W1b = W1a^T grad W1``). In training mode
``rank_dropout`` and ``module_dropout`` must be 0 (masks drawn inside the wrapper are not recorded; peft still draws
``torch.rand(1) > 0`` per call, which skips the adapter with probability 2^-24: not detected). LoKr on convolutions
(``lokr.layer.Conv2d`` / ``Conv1d``, the CP form ``lokr_t2``) stays on the exact per-sample loop.
"""
from __future__ import annotations

import torch

from .peft_common import PeftAdapterRule, base_layer, flat_positions, rows_of
from .registry import register_by_name


def _factor(module: torch.nn.Module, which: str, adapter: str, dtype: torch.dtype):
    """``(W, (Wa, Wb) or None)`` of factor ``which`` (``"w1"`` / ``"w2"``): the full matrix and its two factors."""
    full = getattr(module, f"lokr_{which}")
    if adapter in full:
        return full[adapter].detach().to(dtype), None
    wa = getattr(module, f"lokr_{which}_a")[adapter].detach().to(dtype)
    wb = getattr(module, f"lokr_{which}_b")[adapter].detach().to(dtype)
    return wa @ wb, (wa, wb)


def _factor_rows(blocks: dict, which: str, grad: torch.Tensor, parts, accumulate: bool) -> None:
    """Rows of factor ``which`` from the per-sample gradient of the full matrix ``grad [M, rows, cols]``."""
    if parts is None:
        rows_of(blocks, f"lokr_{which}", grad, accumulate)
        return
    wa, wb = parts
    rows_of(blocks, f"lokr_{which}_a", grad @ wb.t(), accumulate)
    rows_of(blocks, f"lokr_{which}_b", wa.t() @ grad, accumulate)


class LoKrLinearRule(PeftAdapterRule):
    """``lokr.layer.Linear``: rows of ``lokr_w1`` (or ``lokr_w1_a`` / ``lokr_w1_b``) and ``lokr_w2`` (or
    ``lokr_w2_a`` / ``lokr_w2_b``) (see the module docstring)."""

    adapter_dicts = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b")

    def applies(self, module):
        return type(base_layer(module)) is torch.nn.Linear and super().applies(module)

    def has_adapter(self, module, adapter):
        return adapter in module._available_adapters

    def adapter_applies(self, module, adapter):
        if adapter in module.lokr_t2:
            return False  # the CP (convolution) form
        if not ((adapter in module.lokr_w1) != (adapter in module.lokr_w1_a)
                and (adapter in module.lokr_w2) != (adapter in module.lokr_w2_a)):
            return False
        if module.training and (module.rank_dropout[adapter] or module.module_dropout[adapter]):
            return False
        return True

    def adapter_grads(self, module, adapter, active, x, g, blocks, accumulate):
        dtype = next(iter(blocks.values())).dtype
        u, d = flat_positions(x, g, dtype)  # [M, T, in], [M, T, out]
        m, t = u.shape[:2]
        w1, parts1 = _factor(module, "w1", adapter, dtype)  # [a, c]
        w2, parts2 = _factor(module, "w2", adapter, dtype)  # [b, d]
        s = module.scaling[adapter]
        xs = u.reshape(m, t, w1.shape[1], w2.shape[1])  # X_t [c, d]
        gs = d.reshape(m, t, w1.shape[0], w2.shape[0])  # G_t [a, b]
        if any(n.startswith("lokr_w1") for n in blocks):
            grad1 = s * torch.einsum("ntab,ntcb->nac", gs, xs @ w2.t())  # sum_t G_t W2 X_t^T
            _factor_rows(blocks, "w1", grad1, parts1, accumulate)
        if any(n.startswith("lokr_w2") for n in blocks):
            grad2 = s * torch.einsum("ntac,ntcd->nad", gs.transpose(2, 3) @ w1, xs)  # sum_t G_t^T W1 X_t
            _factor_rows(blocks, "w2", grad2, parts2, accumulate)


register_by_name("peft.tuners.lokr.layer.Linear", LoKrLinearRule())
