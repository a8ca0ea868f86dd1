"""RMS normalisations: Hugging Face's (Llama, Mistral, Qwen2, ..., Gemma's ``1 + weight``, T5's) and torch's own
``nn.RMSNorm``.

Their ``forward`` normalises each position of each sample on its own, in float32 (the variance at least) whatever
the input's dtype::

    # Llama-style (LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm, ...)
    x32 = x.to(float32); x_hat = x32 * rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * x_hat.to(x.dtype)
    # Gemma-style (GemmaRMSNorm, Gemma2RMSNorm, Gemma3RMSNorm)
    x_hat = x.float() * rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    y = (x_hat * (1 + weight.float())).type_as(x)
    # T5-style (T5LayerNorm, MT5, UMT5, LongT5, SwitchTransformers): only the variance in float32
    x_hat = x * rsqrt(x.to(float32).pow(2).mean(-1, keepdim=True) + eps)  # (promoted dtype)
    y = weight * (x_hat.to(weight.dtype) if weight is half precision else x_hat)

so sample ``n``'s gradient of the weight is ``sum_positions g * x_hat`` (``g`` the gradient of ``y``), with ``x_hat``
rebuilt from the call's input by the very same arithmetic (the float32 upcast included: a float64 Llama's norm
computes in float32 too, and so does its rule), cast as the module casts it.

The modules are recognised by what can be checked, never by a guess: a class of one of the names below, defined in
transformers' own modelling module of that name, whose ``forward`` (the class's own: not replaced on the instance,
not swapped for a hub kernel) has exactly the source text of one of the three forms above as this transformers
release writes it (:data:`_FORWARDS`), with a one-dimensional ``weight`` and a number ``variance_epsilon`` /
``eps``. Any other module, or a release whose forward reads differently, keeps the exact per-sample loop.
transformers is never imported here.

``nn.RMSNorm`` (exact type, with its affine weight) is ``F.rms_norm``: ``x_hat = x * rsqrt(mean(x^2) + eps)`` over its
``normalized_shape`` (the features), ``eps`` the input dtype's machine epsilon when ``None``, computed in float32 for
half-precision inputs, times the weight: rows ``sum_positions g * x_hat`` again.
"""
from __future__ import annotations

import hashlib
import inspect
import textwrap

import torch

from .registry import LayerRule, register_by_name, register_rule, write_block

# :func:`_fingerprint` of a verified class -> (form, the attribute holding epsilon); the sources as transformers 5.23
# writes them (the module docstring's two forms). A release that writes them otherwise keeps the loop until added.
_FORWARDS = {
    "7f6be55b177fa1d7": ("llama", "variance_epsilon"),  # LlamaRMSNorm.forward and its copies
    "e5559c7750c32d00": ("gemma", "eps"),  # GemmaRMSNorm.forward and _norm (and Gemma2's, Gemma3's)
    "3152525beceb0d02": ("t5", "variance_epsilon"),  # T5LayerNorm.forward and its copies
}
_GEMMA = "gemma"
_LLAMA = "llama"
_T5 = "t5"

# class name -> its defining module (transformers.models.<family>.modeling_<family>)
_LLAMA_STYLE = {
    "LlamaRMSNorm": "llama", "MistralRMSNorm": "mistral", "Qwen2RMSNorm": "qwen2", "Qwen3RMSNorm": "qwen3",
    "MixtralRMSNorm": "mixtral", "Qwen2MoeRMSNorm": "qwen2_moe", "Qwen3MoeRMSNorm": "qwen3_moe",
    "Phi3RMSNorm": "phi3", "GraniteRMSNorm": "granite", "SmolLM3RMSNorm": "smollm3",
}
_GEMMA_STYLE = {"GemmaRMSNorm": "gemma", "Gemma2RMSNorm": "gemma2", "Gemma3RMSNorm": "gemma3"}
_T5_STYLE = {"T5LayerNorm": "t5", "MT5LayerNorm": "mt5", "UMT5LayerNorm": "umt5", "LongT5LayerNorm": "longt5",
             "SwitchTransformersLayerNorm": "switch_transformers"}
_STYLE = {**{n: _LLAMA for n in _LLAMA_STYLE}, **{n: _GEMMA for n in _GEMMA_STYLE}, **{n: _T5 for n in _T5_STYLE}}

_VERIFIED: dict[type, tuple[str, str] | None] = {}


def _fingerprint(cls: type) -> str | None:
    """sha256 (16 hex digits) of the class's ``forward`` and ``_norm`` (where it has one) as written, comment lines
    and blank lines left out; ``None`` where the source cannot be read."""
    lines = []
    for name in ("forward", "_norm"):
        fn = cls.__dict__.get(name)
        if fn is None:
            continue
        try:
            source = textwrap.dedent(inspect.getsource(fn))
        except (OSError, TypeError):
            return None
        lines += [line.rstrip() for line in source.splitlines() if line.strip() and not line.strip().startswith("#")]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def _form(module: torch.nn.Module) -> tuple[str, str] | None:
    """``(form, epsilon attribute)`` of a module whose class and forward are verified (see the module docstring)."""
    cls = type(module)
    if cls not in _VERIFIED:
        found = None
        family = _LLAMA_STYLE.get(cls.__name__) or _GEMMA_STYLE.get(cls.__name__) or _T5_STYLE.get(cls.__name__)
        forward = cls.__dict__.get("forward")
        if (family is not None and cls.__module__ == f"transformers.models.{family}.modeling_{family}"
                and forward is not None and getattr(forward, "__module__", None) == cls.__module__):
            found = _FORWARDS.get(_fingerprint(cls))
            if found is not None and found[0] != _STYLE[cls.__name__]:
                found = None
        _VERIFIED[cls] = found
    found = _VERIFIED[cls]
    if found is None or "forward" in module.__dict__:  # a forward replaced on the instance (e.g. a hub kernel)
        return None
    weight = module._parameters.get("weight")
    eps = getattr(module, found[1], None)
    if weight is None or weight.dim() != 1 or isinstance(eps, bool) or not isinstance(eps, (int, float)):
        return None
    return found


def rmsnorm_grads(module: torch.nn.Module, x: torch.Tensor, g: torch.Tensor, dests, accumulate: bool) -> None:
    """Sample ``n``'s gradient of an HF RMS norm's weight, ``sum_positions g * x_hat`` (``x [M, ..., D]``)."""
    if "weight" not in dests:
        return
    form, eps_name = _form(module)
    eps = getattr(module, eps_name)
    m, d = x.shape[0], x.shape[-1]
    x32 = x.to(torch.float32)  # as the module computes: in float32, whatever x's dtype (float64 included)
    x_hat = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if form == _LLAMA:  # y = weight * x_hat.to(input_dtype), in the promoted dtype of the two (g's)
        rows = (g * x_hat.to(x.dtype).to(g.dtype)).reshape(m, -1, d).sum(dim=1)
    elif form == _GEMMA:  # y = (x_hat * (1 + weight.float())).type_as(x): the weight's gradient is taken in float32
        rows = (g.to(torch.float32) * x_hat).reshape(m, -1, d).sum(dim=1)
    else:  # T5: only the variance in float32, x_hat = x * rsqrt(...) (promoted), cast to a half weight's dtype
        x_hat = x * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        if module.weight.dtype in (torch.float16, torch.bfloat16):
            x_hat = x_hat.to(module.weight.dtype)
        rows = (g * x_hat.to(g.dtype)).reshape(m, -1, d).sum(dim=1)
    write_block(dests["weight"], rows, accumulate)


class HFRMSNormRule(LayerRule):
    """Hugging Face RMS norms of the Llama, Gemma and T5 forms, verified per class (see the module docstring)."""

    def applies(self, module):
        return _form(module) is not None

    def grads(self, module, x, g, dests, accumulate):
        rmsnorm_grads(module, x, g, dests, accumulate)


def torch_rmsnorm_grads(module: torch.nn.RMSNorm, x: torch.Tensor, g: torch.Tensor, dests, accumulate: bool) -> None:
    """Sample ``n``'s gradient of ``nn.RMSNorm``'s weight, ``sum_positions g * x_hat`` (``x [M, ..., *shape]``)."""
    if "weight" not in dests:
        return
    shape = tuple(module.normalized_shape)
    dims = tuple(range(-len(shape), 0))
    eps = module.eps if module.eps is not None else torch.finfo(x.dtype).eps
    xc = x.to(torch.float32) if x.dtype in (torch.float16, torch.bfloat16) else x
    x_hat = xc * torch.rsqrt(xc.pow(2).mean(dim=dims, keepdim=True) + eps)
    rows = (g * x_hat.to(g.dtype)).reshape(x.shape[0], -1, *shape).sum(dim=1)
    write_block(dests["weight"], rows, accumulate)


class TorchRMSNormRule(LayerRule):
    """``nn.RMSNorm`` with its affine weight; its normalised dimensions are the features."""

    def applies(self, module):
        return getattr(module, "weight", None) is not None

    def feature_dims(self, module):
        return len(module.normalized_shape)

    def grads(self, module, x, g, dests, accumulate):
        torch_rmsnorm_grads(module, x, g, dests, accumulate)


if hasattr(torch.nn, "RMSNorm"):
    register_rule(torch.nn.RMSNorm, TorchRMSNormRule())
for _name, _family in {**_LLAMA_STYLE, **_GEMMA_STYLE, **_T5_STYLE}.items():
    register_by_name(f"transformers.models.{_family}.modeling_{_family}.{_name}", HFRMSNormRule())
