"""peft VeRA on linear layers (``peft.tuners.vera.layer.Linear``): per-sample gradients of the scaling vectors
``vera_lambda_b`` and ``vera_lambda_d``.

The wrapper adds ``lambda_b * ((lambda_d * (u A^T)) B^T)`` to the base output, ``u`` the input after the adapter's
dropout (its output recorded in training: see :mod:`.peft_common`), ``A [r, in]`` and ``B [out, r]`` slices of the
frozen matrices shared by every layer (buffers, never differentiated). With ``h = u A^T`` and
``z = (lambda_d * h) B^T``, sample ``n``'s gradients are ``sum_t g_t * z_t`` (``lambda_b``) and
``sum_t ((g_t * lambda_b) B) * h_t`` (``lambda_d``). Only without a quantization backend (its base results are cloned
and cast). VeRA on other layer types stays on the exact per-sample loop.
"""
from __future__ import annotations

from .peft_common import PeftAdapterRule, flat_positions, rows_of
from .registry import register_by_name


class VeraLinearRule(PeftAdapterRule):
    """``vera.layer.Linear``: rows of ``vera_lambda_b`` and ``vera_lambda_d`` (see the module docstring)."""

    adapter_dicts = ("vera_lambda_d", "vera_lambda_b")
    dropout_dict = "vera_dropout"  # x: the dropped input (recorded in training)

    def applies(self, module):
        return getattr(module, "quantization_backend", None) is None and super().applies(module)

    def adapter_applies(self, module, adapter):
        return adapter in module.vera_lambda_b

    def adapter_grads(self, module, adapter, active, x, g, blocks, accumulate):
        dtype = next(iter(blocks.values())).dtype
        u, d = flat_positions(x, g, dtype)  # [M, T, in], [M, T, out]
        lam_d = module.vera_lambda_d[adapter].detach().to(dtype)  # [r]
        lam_b = module.vera_lambda_b[adapter].detach().to(dtype)  # [out]
        a = module.vera_A[adapter][:, : module.in_features].to(device=u.device, dtype=dtype)  # [r, in]
        b = module.vera_B[adapter][: module.out_features, :].to(device=u.device, dtype=dtype)  # [out, r]
        h = u @ a.t()  # [M, T, r]
        if "vera_lambda_b" in blocks:
            rows_of(blocks, "vera_lambda_b", ((h * lam_d) @ b.t() * d).sum(dim=1), accumulate)
        if "vera_lambda_d" in blocks:
            rows_of(blocks, "vera_lambda_d", (((d * lam_b) @ b) * h).sum(dim=1), accumulate)


register_by_name("peft.tuners.vera.layer.Linear", VeraLinearRule())
