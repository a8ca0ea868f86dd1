"""peft IA3 on linear layers (``peft.tuners.ia3.layer.Linear``): per-sample gradients of the scaling vectors.

With ``s`` the product of the active adapters' vectors ``ia3_l`` (flattened), the wrapper computes
``y = base(x) * s`` (``[out, 1]`` vectors) or, for a feedforward module, ``y = base(x * s)`` (``[1, in]``). Sample
``n``'s gradient of adapter ``a``'s vector is ``prod_{b != a} l_b`` times ``sum_t base(x_t) * g_t`` (the base output
recomputed: one matmul) or ``sum_t x_t * (W^T g_t)``. The base layer must be exactly ``nn.Linear`` or transformers'
``Conv1D`` (``fan_in_fan_out``: ``y = x W + b``). IA3 on convolutions (``ia3.layer.Conv2d`` / ``Conv3d``) stays on the
exact per-sample loop. Conditions common to the peft rules: :mod:`.peft_common`.
"""
from __future__ import annotations

import torch

from .linear import is_hf_conv1d
from .peft_common import PeftAdapterRule, base_layer, flat_positions, rows_of
from .registry import register_by_name


def _weight_in_out(base: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The base weight as ``[in, out]`` (``y = x W_io + b``)."""
    w = base.weight.to(dtype)
    return w if is_hf_conv1d(base) else w.t()


class IA3LinearRule(PeftAdapterRule):
    """``ia3.layer.Linear``: rows ``sum_t base(x_t) * g_t`` or ``sum_t x_t * (W^T g_t)`` times the other active
    vectors (see the module docstring)."""

    adapter_dicts = ("ia3_l",)

    def applies(self, module):
        base = base_layer(module)
        return (type(base) is torch.nn.Linear or is_hf_conv1d(base)) and super().applies(module)

    def adapter_grads(self, module, adapter, active, x, g, blocks, accumulate):
        dtype = blocks["ia3_l"].dtype
        a, d = flat_positions(x, g, dtype)  # [M, T, in], [M, T, out]
        base = base_layer(module)
        w = _weight_in_out(base, dtype)  # [in, out]
        if module.is_feedforward:
            rows = (a * (d @ w.t())).sum(dim=1)  # [M, in]
        else:
            out = a @ w
            if base.bias is not None:
                out = out + base.bias.to(dtype)
            rows = (out * d).sum(dim=1)  # [M, out]
        for other in active:
            if other != adapter:
                rows = rows * module.ia3_l[other].detach().flatten().to(dtype)
        rows_of(blocks, "ia3_l", rows, accumulate)


register_by_name("peft.tuners.ia3.layer.Linear", IA3LinearRule())
