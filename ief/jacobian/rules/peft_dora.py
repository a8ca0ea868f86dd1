"""peft DoRA's magnitude vector (``DoraLinearLayer.weight``, ``[out]``): its per-sample gradient from each call.

peft's DoRA (``LoraConfig(use_dora=True)``) adds to a linear layer's output ``y = (s - 1) * b + s * r * c`` with
``s = m / ||w||`` (``m`` the magnitude, ``||w||`` the detached column norm of the adapted weight), ``b`` the base
layer's result without its bias, ``r = lora_B(lora_A(x))`` and ``c`` the scaling. So ``dy / dm = (b + c r) / ||w||``
and sample ``n``'s gradient of ``m`` is ``sum_t g_t * (b_t + c r_t) / ||w||`` over its positions, ``g`` the gradient
flowing back into the call's output.

The call is recorded by a forward hook with keywords (:meth:`DoraMagnitudeRule.call_recorder`): its input ``x``
(the adapter's dropped input in training mode: peft applies the dropout before the call) and, per call, the factor
``h = (b + c r) / ||w||`` computed with gradients off by the module's own code path: its ``get_lora_weight`` /
``get_weight_norm`` (so the same norm, caching included), ``b`` from the ``base_result`` keyword less the base
layer's bias as peft does, or, when peft passes none (dropout in training mode), ``F.linear`` of ``x`` with the
(dequantised, ``fan_in_fan_out``-transposed) base weight, as peft does. The recorded output gradient is ``g * h``;
the rows are its sum over positions.

Only ``DoraLinearLayer`` itself is hooked, recognised by class name and defining module (peft is never imported
here), and only when its class ``forward`` is the verified one (peft 0.21's source, compared without comments and
blank lines) and not replaced on the instance; anything else keeps the exact per-sample loop. peft's
``DoraEmbeddingLayer`` and its convolution variants (``DoraConv2dLayer`` ...) are other classes with other forms and
stay on the loop. DoRA's weight-norm calls of ``lora_A`` / ``lora_B`` on an identity matrix reach no loss; the
capture proves that from the graph and leaves them out (:meth:`ief.jacobian.capture.PerSampleCapture.unreached_calls`).
"""
from __future__ import annotations

import hashlib
import inspect
import sys

import torch

from .registry import LayerRule, register_by_name, write_block

DORA_LINEAR = "peft.tuners.lora.dora.DoraLinearLayer"

# sha256 of DoraLinearLayer.forward's source as :func:`_normalised` gives it, verified for peft 0.21.x
_VERIFIED_FORWARDS = frozenset({"4f799a1d87cbf645ee1336d8d89068714b5108e275c402b728b6e7da2e5e22f7"})


def _normalised(source: str) -> str:
    """``source`` without blank lines, comment lines and indentation (the code as it runs)."""
    lines = (line.strip() for line in source.splitlines())
    return "\n".join(line for line in lines if line and not line.startswith("#"))


def forward_digest(cls: type) -> str | None:
    """sha256 of ``cls.forward``'s normalised source, or ``None`` when the source cannot be read."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return None
    return hashlib.sha256(_normalised(source).encode()).hexdigest()


def is_verified_dora_linear(module: torch.nn.Module) -> bool:
    """Whether ``module`` is exactly peft's ``DoraLinearLayer`` running the verified ``forward`` (class name and
    module, no ``forward`` set on the instance, a vector magnitude)."""
    cls = type(module)
    if f"{cls.__module__}.{cls.__qualname__}" != DORA_LINEAR or "forward" in vars(module):
        return False
    weight = module._parameters.get("weight")
    return weight is not None and weight.dim() == 1 and forward_digest(cls) in _VERIFIED_FORWARDS


def magnitude_factor(module: torch.nn.Module, x: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """``(b + c r) / ||w||`` of one call (``dy / dm``, shaped like its output), by the call's own code path.

    Args:
        module: the ``DoraLinearLayer``.
        x: the call's input (already dropped in training mode).
        kwargs: the call's keywords (``lora_A``, ``lora_B``, ``scaling``, ``base_layer``, ``base_result``,
            ``adapter_name``).

    Returns:
        The factor, in ``x``'s dtype.
    """
    dora = sys.modules[type(module).__module__]  # peft's dora module: the functions its forward calls
    lora_a, lora_b, scaling = kwargs["lora_A"], kwargs["lora_B"], kwargs["scaling"]
    base_layer, adapter = kwargs["base_layer"], kwargs.get("adapter_name", "default")
    base_result = kwargs.get("base_result")
    with torch.no_grad():
        lora_weight = module.get_lora_weight(lora_A=lora_a, lora_B=lora_b, adapter_name=adapter).to(x.dtype)
        weight = dora.dequantize_module_weight(base_layer).to(x.dtype)
        weight_norm = module.get_weight_norm(weight=weight, lora_weight=lora_weight.detach(), scaling=scaling,
                                             adapter_name=adapter).detach()
        lora_result = lora_b(lora_a(x))
        if base_result is not None:
            if base_layer.bias is not None:
                base_result = base_result - base_layer.bias
        else:
            base_result = torch.nn.functional.linear(x, dora.transpose(weight, module.fan_in_fan_out))
        return (base_result + lora_result * scaling) / weight_norm


class DoraMagnitudeRule(LayerRule):
    """peft ``DoraLinearLayer``: rows ``sum_t g_t * h_t`` of its magnitude, ``h = dy / dm`` recorded per call."""

    def applies(self, module):
        return is_verified_dora_linear(module)

    def grads(self, module, x, g, dests, accumulate):
        if "weight" in dests:  # g is the recorded g * h
            m = g.shape[0]
            rows = g.reshape(m, -1, g.shape[-1]).sum(dim=1)
            write_block(dests["weight"], rows.to(dests["weight"].dtype), accumulate)

    def call_recorder(self, calls: list, edges: list):
        """Records a ``DoraLinearLayer`` call as ``[x, g * h, axis]`` (``h``: :func:`magnitude_factor`) and its
        output's gradient edge; a call without a positional input is recorded without one (no sample axis: its
        module falls back to the loop)."""

        def hook(module, args, kwargs, output):
            if not torch.is_grad_enabled() or not isinstance(output, torch.Tensor) or not output.requires_grad:
                return
            x = args[0].detach() if args and isinstance(args[0], torch.Tensor) else None
            factor = None if x is None else magnitude_factor(module, x, kwargs)
            record = [x, None, None]
            calls.append(record)

            def keep(grad):
                part = grad * factor if factor is not None else grad
                record[1] = part if record[1] is None else record[1] + part

            output.register_hook(keep)
            edges.append(torch.autograd.graph.get_gradient_edge(output))

        return hook


register_by_name(DORA_LINEAR, DoraMagnitudeRule())
