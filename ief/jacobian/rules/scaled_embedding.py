"""Hugging Face's scaled word embeddings: an ``nn.Embedding`` whose output is multiplied by a fixed ``embed_scale``
(Gemma's ``sqrt(hidden)``, BART's and its relatives' ``sqrt(d_model)`` when ``scale_embedding``)::

    # Gemma / Gemma2 / Gemma3 TextScaledWordEmbedding
    y = super().forward(input_ids) * self.embed_scale.to(self.weight.dtype)   # embed_scale a 0-d buffer
    # Bart / MBart / M2M100 / PLBart / BioGpt / Blenderbot ScaledWordEmbedding
    y = super().forward(input_ids) * self.embed_scale                         # embed_scale a number

Sample ``n``'s gradient of the table is the embedding's (its output gradients scattered to the rows it looked up)
with the output gradient times the same scale, formed as autograd forms it (``g * scale`` in the output's dtype). A
table like ``nn.Embedding``'s (used rows only in the factored forms).

Recognised as the RMS norms are (:mod:`ief.jacobian.rules.rmsnorm`): a listed class name in transformers' own
modelling module, a subclass of ``nn.Embedding``, its own ``forward`` (not replaced on the instance) with exactly the
source text of one of the two forms above, an ``embed_scale`` of the form's kind, and ``nn.Embedding``'s own
conditions (no ``max_norm``, no ``scale_grad_by_freq``). Anything else keeps the exact per-sample loop.
"""
from __future__ import annotations

import torch

from .embedding import EmbeddingRule, _embedding_grads
from .registry import register_by_name
from .rmsnorm import _fingerprint

_TENSOR, _NUMBER = "tensor", "number"
# :func:`~ief.jacobian.rules.rmsnorm._fingerprint` of a verified class's forward -> the kind of its embed_scale
_FORWARDS = {
    "34965dcc3d7ec448": _TENSOR,  # ... * self.embed_scale.to(self.weight.dtype)
    "642a1bc7c1ecd750": _NUMBER,  # ... * self.embed_scale
}
# class name -> its family (transformers.models.<family>.modeling_<family>)
_CLASSES = {
    "GemmaTextScaledWordEmbedding": "gemma", "Gemma2TextScaledWordEmbedding": "gemma2",
    "Gemma3TextScaledWordEmbedding": "gemma3", "BartScaledWordEmbedding": "bart", "MBartScaledWordEmbedding": "mbart",
    "M2M100ScaledWordEmbedding": "m2m_100", "PLBartScaledWordEmbedding": "plbart",
    "BioGptScaledWordEmbedding": "biogpt", "BlenderbotScaledWordEmbedding": "blenderbot",
}
_VERIFIED: dict[type, str | None] = {}


def _kind(module: torch.nn.Module) -> str | None:
    cls = type(module)
    if cls not in _VERIFIED:
        family, forward = _CLASSES.get(cls.__name__), cls.__dict__.get("forward")
        ok = (family is not None and issubclass(cls, torch.nn.Embedding) and forward is not None
              and cls.__module__ == f"transformers.models.{family}.modeling_{family}"
              and getattr(forward, "__module__", None) == cls.__module__)
        _VERIFIED[cls] = _FORWARDS.get(_fingerprint(cls)) if ok else None
    kind = _VERIFIED[cls]
    if kind is None or "forward" in module.__dict__:
        return None
    scale = getattr(module, "embed_scale", None)
    if kind == _TENSOR:
        return kind if isinstance(scale, torch.Tensor) and scale.numel() == 1 else None
    return kind if isinstance(scale, (int, float)) and not isinstance(scale, bool) else None


class ScaledEmbeddingRule(EmbeddingRule):
    """HF scaled word embeddings (see the module docstring); a table."""

    def applies(self, module):
        return super().applies(module) and _kind(module) is not None

    def grads(self, module, x, g, dests, accumulate, rows=None):
        scale = module.embed_scale
        if isinstance(scale, torch.Tensor):
            scale = scale.to(module.weight.dtype)
        _embedding_grads(module, x, g * scale, dests, accumulate, rows=rows)


for _name, _family in _CLASSES.items():
    register_by_name(f"transformers.models.{_family}.modeling_{_family}.{_name}", ScaledEmbeddingRule(features=0))
