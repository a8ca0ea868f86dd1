"""Per-sample losses and their derivatives with respect to the logits.

The paper's loss is the sum of per-sample losses ``L = sum_n l_n`` (Eq. (1)). A sample may hold several
output positions (a token sequence): ``l_n`` is then the sum over its non-ignored positions (targets ``-100``).

Everything the curvature code needs about the loss lives here, for the two losses the package supports:

- ``cross_entropy``: softmax + categorical cross-entropy. Its logit-space Hessian per position is
  ``diag(p) - p p^T``; the Fisher equals the GGN (Appendix F.1.1).
- ``mse``: ``l_n = 1/2 ||z_n - y_n||^2``. Its logit-space Hessian is the identity, so its Fisher (unit-variance
  Gaussian likelihood) is the Gauss-Newton matrix (Appendix A.2).
"""
from __future__ import annotations

import math
import numbers
from typing import Protocol

import torch

IGNORE_INDEX = -100  # a class-index target equal to this marks an ignored position (Hugging Face's and torch's value)
LOSSES = ("cross_entropy", "mse")


class Loss(Protocol):
    """The interface the curvature code uses; ``logits`` are ``[M, C]`` or ``[M, T, C]``."""

    name: str

    def check(self, logits: torch.Tensor, targets: torch.Tensor) -> int | None:
        """Raise ``ValueError`` for targets the loss cannot take; return the batch's counted targets ``K``
        (:func:`count_targets`) when the check read them anyway, else ``None`` (they are then counted apart)."""

    def check_finite(self, logits: torch.Tensor, targets: torch.Tensor) -> None: ...

    def per_sample(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor: ...

    def logit_grad(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor: ...

    def hessian_vp(self, logits: torch.Tensor, targets: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...

    def sample_targets(
        self, logits: torch.Tensor, targets: torch.Tensor, generator: torch.Generator | None
    ) -> torch.Tensor: ...


def draw_device(generator: torch.Generator | None, tensor: torch.Tensor) -> torch.device:
    """Where random labels are drawn: the ``generator``'s device (a generator draws only on its own), else
    ``tensor``'s (the global generator of that device)."""
    return tensor.device if generator is None else torch.device(generator.device)


def _first_index(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in torch.nonzero(mask)[0])


def require_finite(logits: torch.Tensor, what: str = "logits") -> None:
    """``FloatingPointError`` naming the first non-finite entry of ``logits``."""
    bad = ~torch.isfinite(logits)
    if bool(bad.any()):
        at = _first_index(bad)
        raise FloatingPointError(
            f"non-finite {what}: {float(logits.detach()[at])} at index {at} of a tensor of shape {tuple(logits.shape)}"
        )


def _sum_per_sample(x: torch.Tensor) -> torch.Tensor:
    """Sum everything but the sample dimension: ``[M, ...] -> [M]``."""
    return x.reshape(x.shape[0], -1).sum(dim=1)


class CrossEntropy:
    """Softmax cross-entropy with class indices ``[M]`` / ``[M, T]``; ``-100`` marks ignored positions."""

    name = "cross_entropy"

    def check(self, logits: torch.Tensor, targets: torch.Tensor) -> int:
        """Refuse targets the loss cannot take (dtype, shape, a class index out of range); return ``K``
        (:func:`count_targets`), read with the range check (one host read for both)."""
        if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
            raise ValueError(
                f"loss='cross_entropy' needs integer class-index targets (any integer dtype), got dtype "
                f"{targets.dtype}; use loss='mse' for float targets"
            )
        if logits.dim() < 2 or tuple(targets.shape) != tuple(logits.shape[:-1]):
            raise ValueError(
                f"targets shape {tuple(targets.shape)} does not match logits shape {tuple(logits.shape)}: "
                "for cross_entropy, targets must have the logits' shape without the last (class) dimension"
            )
        num_classes = logits.shape[-1]
        # one host read, of the range check and the count together (no boolean-mask selection unless one is out of
        # range: a selection's size is a GPU sync)
        kept = targets != IGNORE_INDEX
        bad = kept & ((targets < 0) | (targets >= num_classes))
        out_of_range, counted = torch.stack([bad.any().to(torch.int64), kept.sum()]).tolist()
        if out_of_range:
            raise ValueError(
                f"class index {int(targets[bad][0])} out of range: targets must lie in [0, {num_classes - 1}] "
                f"or be {IGNORE_INDEX} (ignored position)"
            )
        return counted

    def check_finite(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        """``FloatingPointError`` for NaN or ``+inf`` logits, or a position whose every class is ``-inf``.

        ``-inf`` on some classes (masked vocabulary, constrained decoding) is accepted: those classes get
        probability 0, exactly as ``torch.nn.functional.cross_entropy`` treats them.
        """
        bad = torch.isnan(logits) | torch.isposinf(logits)
        empty = torch.isneginf(logits).all(dim=-1)
        if not bool(bad.any() | empty.any()):  # one host read; which check failed is told below
            return
        if bool(bad.any()):
            at = _first_index(bad)
            raise FloatingPointError(
                f"logits hold {float(logits.detach()[at])} at index {at} (shape {tuple(logits.shape)}): NaN and +inf "
                "logits have no softmax; -inf (a masked class) is the only non-finite value accepted"
            )
        if bool(empty.any()):
            at = _first_index(empty)
            raise FloatingPointError(
                f"every class is -inf at position {at} of logits of shape {tuple(logits.shape)}: no class has "
                "non-zero probability (mask at most all classes but one)"
            )

    def _mask(self, targets: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return (targets != IGNORE_INDEX).to(like.dtype)

    def per_sample(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        per_position = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).long(), ignore_index=IGNORE_INDEX,
            reduction="none",
        )
        return _sum_per_sample(per_position.reshape(targets.shape))

    def logit_grad(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """``softmax(z) - onehot(y)`` at kept positions, 0 at ignored ones."""
        probs = torch.softmax(logits, dim=-1)
        keep = targets != IGNORE_INDEX
        # the one-hot rows by a scatter at every position (an ignored one's row is masked below): no boolean-mask
        # indexing, whose output size a GPU would have to send to the host
        onehot = torch.zeros_like(probs).scatter_(-1, targets.long().clamp_min(0).unsqueeze(-1), 1.0)
        return (probs - onehot) * keep.unsqueeze(-1).to(probs.dtype)

    def hessian_vp(self, logits: torch.Tensor, targets: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``(diag(p) - p p^T) v`` per kept position."""
        probs = torch.softmax(logits, dim=-1)
        hv = probs * (v - (probs * v).sum(dim=-1, keepdim=True))
        return hv * self._mask(targets, hv).unsqueeze(-1)

    def sample_targets(
        self, logits: torch.Tensor, targets: torch.Tensor, generator: torch.Generator | None
    ) -> torch.Tensor:
        """Labels drawn from the model's own predictive distribution at every kept position (SF).

        Masked (``-inf``) classes have probability 0 and are never drawn, as in the other methods' losses. A
        ``generator`` on another device than the logits (a CPU generator for a CUDA model) draws on its own device, so
        the labels do not depend on the model's device.
        """
        self.check_finite(logits, targets)
        probs = torch.softmax(logits.detach().to(torch.float64), dim=-1).reshape(-1, logits.shape[-1])
        drawn = torch.multinomial(probs.to(draw_device(generator, probs)), 1, generator=generator)
        drawn = drawn.to(targets.device).reshape(targets.shape)
        return torch.where(targets == IGNORE_INDEX, targets, drawn.to(targets.dtype))


class MeanSquaredError:
    """``l_n = 1/2 ||z_n - y_n||^2`` with float targets shaped like the logits."""

    name = "mse"

    def check(self, logits: torch.Tensor, targets: torch.Tensor) -> int:
        """Refuse targets that are not float, not shaped like the logits or not finite; return ``K`` (every entry)."""
        if not targets.dtype.is_floating_point:
            raise ValueError(f"loss='mse' needs float targets shaped like the logits, got dtype {targets.dtype}")
        if tuple(targets.shape) != tuple(logits.shape):
            raise ValueError(
                f"targets shape {tuple(targets.shape)} does not match logits shape {tuple(logits.shape)}: "
                "for mse, targets must have exactly the logits' shape"
            )
        if not torch.isfinite(targets).all():
            raise ValueError("mse targets contain non-finite values")
        return targets.numel()

    def check_finite(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        require_finite(logits)

    def per_sample(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return 0.5 * _sum_per_sample((logits - targets.to(logits.dtype)) ** 2)

    def logit_grad(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return logits - targets.to(logits.dtype)

    def hessian_vp(self, logits: torch.Tensor, targets: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return v

    def sample_targets(
        self, logits: torch.Tensor, targets: torch.Tensor, generator: torch.Generator | None
    ) -> torch.Tensor:
        """``y ~ N(z, I)``, the predictive distribution whose Fisher is the Gauss-Newton matrix (drawn on the
        ``generator``'s device, as :meth:`CrossEntropy.sample_targets`)."""
        self.check_finite(logits, targets)
        noise = torch.randn(logits.shape, generator=generator, dtype=torch.float64,
                            device=draw_device(generator, logits))
        return (logits.detach().to(torch.float64) + noise.to(logits.device)).to(logits.dtype)


_LOSSES: dict[str, Loss] = {"cross_entropy": CrossEntropy(), "mse": MeanSquaredError()}


def get_loss(loss: str | Loss) -> Loss:
    """Resolve ``loss="cross_entropy"`` / ``"mse"`` (or pass a :class:`Loss` object through).

    Args:
        loss: ``"cross_entropy"`` (Eq. (1)), ``"mse"`` (``l_n = 1/2 ||z_n - y_n||^2``) or a ``Loss``.

    Returns:
        The ``Loss`` object: its per-sample losses, logit gradients and sampled targets.

    Raises:
        ValueError: an unknown name (the accepted ones are listed).
    """
    if not isinstance(loss, str):
        return loss
    try:
        return _LOSSES[loss]
    except KeyError:
        raise ValueError(f"unknown loss {loss!r}; accepted: {', '.join(map(repr, LOSSES))}") from None


SQNORM_CHUNK_ENTRIES = {"cpu": 1 << 22, "accelerator": 1 << 24}  # logit entries whose probabilities are held at once


def logit_sqnorm(loss: Loss, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``s_iEF`` (the unnumbered equation after the paper's Eq. (8)): ``||grad_{z_n} l_n||^2`` summed over the
    sample's positions, ``[M]``.

    For cross-entropy, ``||softmax(z) - onehot(y)||^2 = (1 - p_y)^2 + sum_{c != y} p_c^2`` per kept position, with
    ``1 - p_y`` summed from the other classes' probabilities: no cancellation where ``p_y`` is near 1, where
    ``p_y - 1`` in the logits' format would keep only its rounding. Cost: one pass over the logits in chunks of
    positions of at most :data:`SQNORM_CHUNK_ENTRIES` entries (16 MiB of float32 on a CPU, 64 MiB on an accelerator;
    per chunk a softmax, a scatter and two reductions), whose probabilities are the only temporary: never a
    logits-sized one (a causal LM's ``[M, T, vocabulary]`` logits are the largest tensor of its step). Another loss:
    its ``logit_grad``, squared and summed.

    Args:
        loss: the ``Loss`` (:func:`get_loss`).
        logits: ``[M, C]``, ``[M, T, C]`` or more position axes; 16-bit logits are read a chunk at a time in float32.
        targets: as the loss takes them (``-100`` positions add nothing).

    Returns:
        ``[M]``, in the logits' dtype (float32 for 16-bit logits, never summed in 16 bits).
    """
    logits = logits.detach()
    if isinstance(loss, CrossEntropy):
        return _cross_entropy_sqnorm(logits, targets)
    grad = loss.logit_grad(logits, targets)
    return _sum_per_sample(grad * grad)


def _cross_entropy_sqnorm(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """:func:`logit_sqnorm` of cross-entropy, a chunk of positions at a time (``[M, C]`` read as ``[M, 1, C]``, and
    ``[M, T1, T2, ..., C]`` as ``[M, T1 T2 ..., C]``)."""
    wide = torch.float32 if logits.dtype.itemsize < 4 else logits.dtype
    if logits.dim() == 2:
        z, y = logits.unsqueeze(1), targets.unsqueeze(1)
    else:
        z, y = logits.flatten(1, -2), targets.flatten(1)
    m, t, c = z.shape
    budget = SQNORM_CHUNK_ENTRIES["cpu" if z.device.type == "cpu" else "accelerator"]
    positions = max(1, budget // max(c, 1))  # per chunk
    out = torch.zeros(m, dtype=wide, device=z.device)
    if positions >= t:  # whole samples per chunk
        step = positions // max(t, 1)
        for lo in range(0, m, step):
            out[lo:lo + step] = _position_sqnorms(z[lo:lo + step], y[lo:lo + step], wide).sum(dim=1)
        return out
    for n in range(m):  # a sample's positions split over chunks
        for lo in range(0, t, positions):
            out[n] += _position_sqnorms(z[n:n + 1, lo:lo + positions], y[n:n + 1, lo:lo + positions], wide).sum()
    return out


def _position_sqnorms(z: torch.Tensor, y: torch.Tensor, wide: torch.dtype) -> torch.Tensor:
    """``||softmax(z) - onehot(y)||^2`` per position of a chunk ``[b, t, C]``, 0 where ``y`` is ignored."""
    probs = torch.softmax(z.to(wide), dim=-1)
    probs.scatter_(-1, y.long().clamp_min(0).unsqueeze(-1), 0.0)  # the other classes' probabilities
    rest = probs.sum(dim=-1)  # 1 - p_y
    others = torch.linalg.vector_norm(probs, dim=-1).square()
    return (rest.square() + others) * (y != IGNORE_INDEX).to(wide)


def _parses(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def check_damping(damping: float, *, allow_zero: bool = True) -> float:
    """Damping must be a finite real >= 0 (> 0 where the formula divides by it): a Python or NumPy real number.

    A string (``"1e-3"``, e.g. read from a config file) and a bool are refused rather than converted: ``float("1e-3")``
    would hide a config that was never parsed, and ``True`` would silently be ``1.0``; ``kl_clip`` and the rates are
    refused alike.
    """
    accepted = "a finite number >= 0" if allow_zero else "a finite number > 0"
    if isinstance(damping, (bool, str, bytes)) or not isinstance(damping, numbers.Real):
        hint = f" (parse it first: damping={float(damping)!r})" if isinstance(damping, str) and _parses(damping) else ""
        raise ValueError(f"damping must be {accepted} (a float such as 1e-4), got {damping!r} of type "
                         f"{type(damping).__name__}{hint}")
    try:
        value = float(damping)
    except (TypeError, ValueError):
        raise ValueError(f"damping must be a real number, got {damping!r}") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"damping must be {accepted}, got {damping!r}")
    return value


def count_targets(targets: torch.Tensor) -> int:
    """``K``: how many entries of ``targets`` count in the loss, the number a mean loss divides ``L = sum_n l_n`` by.

    One rule for every place that needs ``K`` (``reduction="mean"`` of :mod:`ief.optim`, :class:`ief.hf.IEFTrainer`'s
    logged loss, a training loop's mean loss): class-index targets count every position that is not
    ``IGNORE_INDEX`` (``-100``), so ``L / K`` is torch's ``cross_entropy(..., ignore_index=-100)`` and Hugging
    Face's ``outputs.loss``; a float target (``loss="mse"``) counts **every entry**, so ``L / K`` is half of
    ``torch.nn.functional.mse_loss``'s mean, which Hugging Face's regression heads use (its ``MSELoss`` averages over
    all entries, not per sample).

    Args:
        targets: class indices ``[M]`` / ``[M, T]`` (any integer dtype) with ``-100`` at ignored positions, or float
            targets (``loss="mse"``).

    Returns:
        ``K`` as an ``int`` (``0`` when every class-index target is ignored: a caller that divides by it decides).

    Raises:
        ValueError: ``targets`` is not a tensor, or a boolean or complex one.
    """
    if not isinstance(targets, torch.Tensor) or targets.dtype == torch.bool or targets.dtype.is_complex:
        kind = f"a tensor of dtype {targets.dtype}" if isinstance(targets, torch.Tensor) else type(targets).__name__
        raise ValueError(f"count_targets needs class-index targets (integers, {IGNORE_INDEX} = ignored) or float "
                         f"targets, got {kind}")
    if targets.dtype.is_floating_point:
        return targets.numel()
    return int((targets != IGNORE_INDEX).sum())


def causal_lm_targets(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Hugging Face causal-LM ``labels`` as this package's targets: shifted left by one position.

    A causal LM's logits at position ``t`` predict token ``t + 1``, and Hugging Face's ``*ForCausalLM`` models take
    *unshifted* ``labels`` (usually ``input_ids`` with ``-100`` on padding) and shift them inside their loss. ``ief``
    computes the loss itself, position by position (Eq. (1)), so it needs the shifted targets:
    ``targets[:, t] = labels[:, t + 1]`` and ``-100`` at the last position. Passing the labels unshifted would
    silently train every position to predict its own input token.

    Args:
        labels: integer tensor ``[M, T]`` (or ``[..., T]``), the labels a ``*ForCausalLM`` model takes.
        ignore_index: the value that marks ignored labels (``-100``, Hugging Face's default); they become ``-100``.

    Returns:
        The targets, same shape and dtype: ``-100`` where the next label is ignored and at the last position, so
        ``sum_n l_n / K`` (``K`` their non-ignored count) is the model's own ``outputs.loss``.

    Raises:
        ValueError: ``labels`` is not an integer tensor with a sequence dimension (``dim >= 2``).
    """
    if not isinstance(labels, torch.Tensor) or labels.dtype.is_floating_point or labels.dtype.is_complex \
            or labels.dtype == torch.bool:
        kind = f"a tensor of dtype {labels.dtype}" if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise ValueError(f"causal_lm_targets needs integer labels [M, T] (token ids, {ignore_index} = ignored), "
                         f"got {kind}")
    if labels.dim() < 2:
        raise ValueError(f"causal_lm_targets needs labels with a sequence dimension, [M, T], got shape "
                         f"{tuple(labels.shape)}")
    nxt = labels[..., 1:]
    targets = labels.new_full(labels.shape, IGNORE_INDEX)
    targets[..., :-1] = torch.where(nxt == ignore_index, torch.full_like(nxt, IGNORE_INDEX), nxt)
    return targets
