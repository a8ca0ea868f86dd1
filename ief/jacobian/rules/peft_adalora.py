"""peft AdaLoRA on linear layers (``peft.tuners.adalora.layer.SVDLinear``): per-sample gradients of ``P``, ``Lambda``
and ``Q`` (``lora_B``, ``lora_E``, ``lora_A``).

The wrapper adds ``c * (u (A * E)^T) B^T`` to the base output, ``u`` the input after the adapter's dropout (its
output recorded in training: see :mod:`.peft_common`), ``c = scaling / (ranknum + 1e-5)``. With ``h = u A^T``
(``[T, r]``) and ``k = c g B`` (``[T, r]``), sample ``n``'s gradients are ``c sum_t g_t (h_t * E)^T`` (``B``,
``[out, r]``), ``sum_t (k_t * E) u_t^T`` (``A``, ``[r, in]``) and ``sum_t k_t * h_t`` (``E``, ``[r, 1]``): two batched
matmuls, never the ``[out, in]`` update. ``ranknum`` must stay frozen (it is a ``requires_grad=False`` parameter).
AdaLoRA on convolutions (``SVDConv2d``) stays on the exact per-sample loop.
"""
from __future__ import annotations

from .peft_common import PeftAdapterRule, flat_positions, rows_of
from .registry import register_by_name


class AdaLoraLinearRule(PeftAdapterRule):
    """``adalora.layer.SVDLinear``: rows of ``lora_A``, ``lora_E``, ``lora_B`` (see the module docstring)."""

    adapter_dicts = ("lora_A", "lora_B", "lora_E")
    dropout_dict = "lora_dropout"  # x: the dropped input (recorded in training)

    def adapter_grads(self, module, adapter, active, x, g, blocks, accumulate):
        dtype = next(iter(blocks.values())).dtype
        u, d = flat_positions(x, g, dtype)  # [M, T, in], [M, T, out]
        a = module.lora_A[adapter].detach().to(dtype)  # [r, in]
        e = module.lora_E[adapter].detach().to(dtype)  # [r, 1]
        b = module.lora_B[adapter].detach().to(dtype)  # [out, r]
        c = module.scaling[adapter] / (module.ranknum[adapter].detach().to(dtype) + 1e-5)  # [1]
        h = u @ a.t()  # [M, T, r]
        k = (d @ b) * c  # [M, T, r]
        if "lora_B" in blocks:
            rows_of(blocks, "lora_B", c * (d.transpose(1, 2) @ (h * e.t())), accumulate)
        if "lora_A" in blocks:
            rows_of(blocks, "lora_A", (k * e.t()).transpose(1, 2) @ u, accumulate)
        if "lora_E" in blocks:
            rows_of(blocks, "lora_E", (k * h).sum(dim=1), accumulate)


register_by_name("peft.tuners.adalora.layer.SVDLinear", AdaLoraLinearRule())
