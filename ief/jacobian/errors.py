"""The errors and warnings of the per-sample machinery."""
from __future__ import annotations


class PerSampleGradientMismatch(RuntimeError):
    """The per-sample gradients do not add up to the batch gradient.

    Raised by :func:`per_sample`, :func:`sampled_jacobian` and the optimisers' steps when the guard (``check=True``,
    the default) finds batch norm with batch statistics or a hooked parameter used outside its hooked module, or when
    ``check="exact"`` (the optimisers' first step) finds a row that differs from the exact per-sample directional
    derivatives (a layer that mixes samples). The message names the parameter or the samples. Tied weights are not
    refused: tied between hooked layers they are hooked in each, tied to an unhooked use they take the exact
    per-sample loop.
    """



class SlowPathWarning(UserWarning):
    """A trainable parameter's per-sample gradients need one backward pass per sample (exact, but slow).

    Issued by :func:`per_sample` (and everything built on it), once per model, naming the parameters: layers without
    a hook (``Conv2d`` with reflect/circular padding, ``Conv1d``, RNNs, ``MultiheadAttention``'s projections, bare
    ``nn.Parameter`` s; a layer type of one's own until :func:`ief.register_rule` gives it a rule), a hooked layer
    whose input has no sample dimension, or peft prompt tuning before
    :func:`ief.per_sample_prompts`. Cost: about ``M`` times a gradient for those parameters.
    """

