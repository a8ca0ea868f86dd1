"""peft LoRA on embeddings (``peft.tuners.lora.layer.Embedding``): per-sample gradients of ``lora_embedding_A`` and
``lora_embedding_B``.

The wrapper adds ``c * E(ids; A^T) B^T`` to the base embedding, ``E(ids; A^T)`` the rows of ``A^T`` (``[V, r]``)
that the ids look up (``h``, ``[T, r]``), ``c`` the adapter's ``scaling`` times the base layer's ``embed_scale`` if
it has one (Gemma's scaled embeddings). Sample ``n``'s gradients are ``c sum_t g_t h_t^T`` (``B``, ``[out, r]``) and,
for ``A`` (``[r, V]``), ``c g_t B`` scattered to the column of each looked-up id (none at ``padding_idx``). Vanilla
LoRA only: an adapter with a variant (DoRA, MiCA), tensor-parallel input/output functions, a base table with
``max_norm`` or ``scale_grad_by_freq``, or a base layer that is not an ``nn.Embedding`` (a subclass is fine: the
adapter's term reads only its ``padding_idx`` and ``embed_scale``) keeps the exact per-sample loop.
"""
from __future__ import annotations

import torch

from .peft_common import PeftAdapterRule, base_layer, rows_of
from .registry import register_by_name


def _embed_scale(module: torch.nn.Module, dtype: torch.dtype):
    """The base layer's ``embed_scale`` as peft applies it (``_get_embed_scale``), or ``None``."""
    scale = module._get_embed_scale()
    return None if scale is None else scale.detach().to(dtype)


class LoraEmbeddingRule(PeftAdapterRule):
    """``lora.layer.Embedding``: rows of ``lora_embedding_A`` (scattered) and ``lora_embedding_B``."""

    adapter_dicts = ("lora_embedding_A", "lora_embedding_B")

    def applies(self, module):
        base = base_layer(module)
        if not isinstance(base, torch.nn.Embedding) or base.max_norm is not None or base.scale_grad_by_freq:
            return False
        return super().applies(module)

    def adapter_applies(self, module, adapter):
        return (adapter in module.lora_embedding_B and adapter not in getattr(module, "lora_variant", {})
                and module.input_fns.get(adapter) is None and module.output_fns.get(adapter) is None)

    def adapter_grads(self, module, adapter, active, x, g, blocks, accumulate):
        dtype = next(iter(blocks.values())).dtype
        m = x.shape[0]
        ids = x.reshape(m, -1)  # [M, T]
        d = g.reshape(m, -1, g.shape[-1]).to(dtype)  # [M, T, out]
        a = module.lora_embedding_A[adapter].detach().to(dtype)  # [r, V]
        b = module.lora_embedding_B[adapter].detach().to(dtype)  # [out, r]
        c = torch.as_tensor(module.scaling[adapter], dtype=dtype, device=d.device)
        scale = _embed_scale(module, dtype)
        if scale is not None:
            c = c * scale
        padding = base_layer(module).padding_idx
        if padding is not None:
            d = d * (ids != padding).unsqueeze(-1).to(dtype)
        if "lora_embedding_B" in blocks:
            h = a.t()[ids]  # [M, T, r]
            rows_of(blocks, "lora_embedding_B", c * (d.transpose(1, 2) @ h), accumulate)
        if "lora_embedding_A" in blocks:
            k = (c * (d @ b)).transpose(1, 2)  # [M, r, T]
            block = blocks["lora_embedding_A"].unflatten(1, tuple(a.shape))  # [M, r, V], written in place
            if not accumulate:
                block.zero_()
            block.scatter_add_(2, ids.unsqueeze(1).expand(-1, a.shape[0], -1), k.to(block.dtype))  # autocast: k bf16


register_by_name("peft.tuners.lora.layer.Embedding", LoraEmbeddingRule(features=0))
