"""The sample-axis proof's comparisons (:meth:`ief.jacobian.capture.PerSampleCapture.establish_axes`): which
dimension of a hooked call's input the one-sample probe shrinks to 1 (the candidate axis), whether a proof forward's
call input is the batch call's reversed along it, and the broadcast uses' shapes that key the proof's cache."""
from __future__ import annotations

import torch

from .broadcast import Use
from .rules.registry import BATCH_FIRST


def _use_shapes(uses: dict) -> tuple:
    """The recorded uses as hashable shapes: ``((key, ((name, shape, result shape), ...)), ...)``."""
    return tuple((key, tuple((u.name, u.shape, u.result_shape) for u in us)) for key, us in uses.items())


def _uses_from(shapes: tuple) -> dict:
    """The inverse of :func:`_use_shapes` (shapes only, no gradients)."""
    return {key: [Use(*u) for u in us] for key, us in shapes}


def _same(probe: torch.Tensor | None, ref: torch.Tensor | None) -> bool:
    """Whether a proof forward's call input equals the batch call's (reversed) input: equal shapes, equal integers,
    floats equal up to ``max(sqrt(eps), 1e-3)`` of the reference's largest entry (a reordered batch may round
    differently, TF32 products more than float32's ``sqrt(eps)``; rows gathered from other samples differ by far
    more)."""
    if probe is None or ref is None or probe.shape != ref.shape or probe.dtype != ref.dtype:
        return False
    if not probe.is_floating_point() and not probe.is_complex():
        return torch.equal(probe, ref)
    if probe.numel() == 0:
        return True
    tol = max(torch.finfo(probe.dtype).eps ** 0.5, 1e-3) if probe.is_floating_point() else 1e-3
    finite = torch.isfinite(ref)
    scale = float(ref[finite].abs().max()) if bool(finite.any()) else 0.0
    close = (probe - ref).abs() <= tol * max(scale, 1e-30)
    # a non-finite entry (an inf or NaN input, refused later naming its sample) must be the same non-finite entry
    return bool((close | (probe == ref) | (probe.isnan() & ref.isnan())).all())


def _sample_axis(full: tuple | None, probe: tuple | None, m: int, features: int) -> int | None:
    """The one dimension of a call's input that is ``m`` in the batch forward and 1 in the one-sample probe, every
    other dimension unchanged, and that is not a feature dimension; ``None`` if there is no such single dimension."""
    if full is None or probe is None or len(full) != len(probe):
        return None
    changed = [d for d, (a, b) in enumerate(zip(full, probe)) if a != b]
    if len(changed) != 1:
        return None
    d = changed[0]
    limit = 1 if features == BATCH_FIRST else len(full) - features
    return d if full[d] == m and probe[d] == 1 and d < limit else None
