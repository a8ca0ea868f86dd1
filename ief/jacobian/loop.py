"""The fallback: an exact per-sample loop of ``M`` backward passes for the parameters no hook covers, and the
:class:`~ief.jacobian.SlowPathWarning` that names them.

Every trainable parameter that is not in a hooked module (a layer type without a rule, a convolution with reflect /
circular padding, an RNN, an ``nn.MultiheadAttention`` with dropout in training, a bare ``nn.Parameter`` used
otherwise than broadcast), whose module had a call without an established sample axis, or that is also used outside
its hooked modules (e.g. a tied weight also used bare; a weight tied between hooked modules is hooked in each, see
:class:`~ief.jacobian.capture.PerSampleCapture`) takes this loop: exact, about ``M`` times a gradient for those
parameters.
"""
from __future__ import annotations

import warnings
import weakref
from collections.abc import Sequence

import torch

from .capture import PerSampleCapture
from .errors import SlowPathWarning

LOOPED_ATTRIBUTE = "_ief_looped"  # set on J: the parameter indices whose rows took the per-sample loop

# The sets of slow-path parameters already reported, per model (a SlowPathWarning once per model and set).
_WARNED: "weakref.WeakKeyDictionary[torch.nn.Module, set]" = weakref.WeakKeyDictionary()


def loop_rows(capture: PerSampleCapture, losses: torch.Tensor, loop_owners: Sequence[int],
              loop_inputs: Sequence[torch.Tensor], jac: torch.Tensor, columns: dict[int, int],
              retain_graph: bool) -> None:
    """Add each sample's gradient of the loop's parameters (``loop_inputs``: the parameters, then their stand-ins;
    ``loop_owners``: the parameter index of each) to their zeroed column blocks of ``jac``, one backward per sample.

    The loop's backward passes also reach the hooks: the records keep the batch backward's output gradients."""
    m = losses.shape[0]
    batch_grads = [[rec[1] for rec in calls] for calls in capture.records.values()]
    for n in range(m):
        rows = torch.autograd.grad(losses[n], loop_inputs, retain_graph=retain_graph or n < m - 1, allow_unused=True)
        for i, g in zip(loop_owners, rows):
            if g is not None:
                jac[n, columns[i] : columns[i] + capture.sizes[i]] += g.reshape(-1)
    for calls, kept in zip(capture.records.values(), batch_grads):
        for rec, g in zip(calls, kept):
            rec[1] = g


def _warn_slow_path(model: torch.nn.Module, capture: PerSampleCapture, names: Sequence[str], m: int) -> None:
    """One :class:`SlowPathWarning` per model (and set of parameters) naming the parameters that take the loop."""
    loop = [i for i in range(len(names)) if i not in capture.hooked]
    if not loop or m == 1:
        return
    reported = _WARNED.setdefault(model, set())
    key = frozenset(names[i] for i in loop)
    if key in reported:
        return
    reported.add(key)
    owner = {id(p): mod for mod in model.modules() for p in mod.parameters(recurse=False)}
    reasons: dict[str, list[str]] = {}
    for i in loop:
        why = capture.demoted.get(i)
        if why is None:
            mod = owner[id(capture.params[i])]
            kind = type(mod).__name__
            if type(mod).__module__.startswith("torch.nn"):
                why = f"{kind}: no per-sample hook for this layer type"
            else:
                why = f"a bare parameter of {kind}, used outside any hooked layer"
        reasons.setdefault(why, []).append(names[i])
    listed = "; ".join(f"{', '.join(ns)} ({why})" for why, ns in reasons.items())
    warnings.warn(
        f"{len(loop)} of {len(names)} parameter tensors take the per-sample loop of {m} backward passes (exact, but "
        f"about {m}x a gradient): {listed}. Hooked layers: nn.Linear, HF Conv1D, nn.Embedding, HF scaled word "
        "embeddings, nn.LayerNorm, nn.GroupNorm, RMS norms (nn.RMSNorm, HF Llama-style and T5 layer norms), "
        "nn.Conv1d / nn.Conv2d (zero padding), nn.BatchNorm1d / 2d (eval mode), torch.nn attention (no dropout) whose "
        "input has a sample dimension, peft's IA3 / AdaLoRA / LoHa / LoKr / VeRA linear wrappers and LoRA embeddings "
        "(not merged or disabled, frozen base layer, no LoHa / LoKr rank or module dropout in training), a weight "
        "tied between such layers (an embedding table that is also the output "
        "layer's weight), and parameters or embedding outputs only added to or expanded over the batch or given as "
        "its attention mask (after views, casts or a shared mask, as T5's relative attention biases), and layer "
        "types given a rule with ief.register_rule; pass params= to precondition only "
        "those. For peft prompt tuning or p-tuning, call ief.per_sample_prompts(model) once after get_peft_model.",
        SlowPathWarning,
        stacklevel=4,
    )

