"""peft LoHa on linear layers (``peft.tuners.loha.layer.Linear``): per-sample gradients of the four Hadamard factors.

The wrapper adds ``x dW^T`` to the base output, ``dW = s (W1a W1b) * (W2a W2b)`` (``[out, in]``, ``*``
elementwise). Sample ``n``'s gradient of ``dW`` is ``D = sum_t g_t x_t^T``; never formed (``[out, in]`` per sample),
it is contracted through the other factor's rank: with ``P_t[q, p] = sum_i x_ti W2b[q, i] W1b[p, i]`` and
``Q_t[p, q] = sum_o g_to W1a[o, p] W2a[o, q]`` (``[T, r, r]``, one matmul each),
``R = sum_t g_t (x) P_t`` (``[out, r, r]``) and ``S = sum_t Q_t (x) x_t`` (``[r, r, in]``):
``grad W1a[o, p] = s sum_q W2a[o, q] R[o, q, p]``, ``grad W2a[o, q] = s sum_p W1a[o, p] R[o, q, p]``,
``grad W1b[p, i] = s sum_q S[p, q, i] W2b[q, i]``, ``grad W2b[q, i] = s sum_p S[p, q, i] W1b[p, i]``:
``O(T r^2 (in + out))`` per sample instead of ``O(T in out)``. In training mode ``rank_dropout`` and
``module_dropout`` must be 0 (their masks are drawn inside the wrapper and not recorded; peft still draws
``torch.rand(1) > 0`` per call, which skips the adapter with probability 2^-24: not detected). LoHa on convolutions
(``loha.layer.Conv2d`` / ``Conv1d``, the CP form ``hada_t1``) stays on the exact per-sample loop.
"""
from __future__ import annotations

import torch

from .peft_common import PeftAdapterRule, base_layer, flat_positions, rows_of
from .registry import register_by_name


class LoHaLinearRule(PeftAdapterRule):
    """``loha.layer.Linear``: rows of ``hada_w1_a``, ``hada_w1_b``, ``hada_w2_a``, ``hada_w2_b`` (see the module
    docstring)."""

    adapter_dicts = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")

    def applies(self, module):
        return type(base_layer(module)) is torch.nn.Linear and super().applies(module)

    def has_adapter(self, module, adapter):
        return all(adapter in getattr(module, name) for name in self.adapter_dicts)

    def adapter_applies(self, module, adapter):
        if adapter in module.hada_t1 or adapter in module.hada_t2:
            return False  # the CP (convolution) form
        if module.training and (module.rank_dropout[adapter] or module.module_dropout[adapter]):
            return False
        return True

    def adapter_grads(self, module, adapter, active, x, g, blocks, accumulate):
        dtype = next(iter(blocks.values())).dtype
        a, d = flat_positions(x, g, dtype)  # [M, T, in], [M, T, out]
        m = a.shape[0]
        w1a, w1b, w2a, w2b = (getattr(module, n)[adapter].detach().to(dtype) for n in self.adapter_dicts)
        r1, r2 = w1b.shape[0], w2b.shape[0]
        s = module.scaling[adapter]
        if "hada_w1_a" in blocks or "hada_w2_a" in blocks:
            pairs = (w2b.unsqueeze(1) * w1b.unsqueeze(0)).reshape(r2 * r1, -1)  # [(q, p), in]
            p = a @ pairs.t()  # [M, T, (q, p)]
            r = (d.transpose(1, 2) @ p).view(m, -1, r2, r1)  # [M, out, q, p]
            rows_of(blocks, "hada_w1_a", s * torch.einsum("oq,noqp->nop", w2a, r), accumulate)
            rows_of(blocks, "hada_w2_a", s * torch.einsum("op,noqp->noq", w1a, r), accumulate)
        if "hada_w1_b" in blocks or "hada_w2_b" in blocks:
            pairs = (w1a.unsqueeze(2) * w2a.unsqueeze(1)).reshape(-1, r1 * r2)  # [out, (p, q)]
            q = d @ pairs  # [M, T, (p, q)]
            sq = (q.transpose(1, 2) @ a).view(m, r1, r2, -1)  # [M, p, q, in]
            rows_of(blocks, "hada_w1_b", s * torch.einsum("npqi,qi->npi", sq, w2b), accumulate)
            rows_of(blocks, "hada_w2_b", s * torch.einsum("npqi,pi->nqi", sq, w1b), accumulate)


register_by_name("peft.tuners.loha.layer.Linear", LoHaLinearRule())
