"""A step's checks, computed on the device and read by the host once.

Every finiteness check of an optimiser step (the per-sample guard's, the direction's, SF's gradient, K-FAC's running
factors, the momentum buffers, the losses) is a 0-d bool tensor the step computes on the device; :class:`StepChecks`
gathers them, in the order they are met, with the few values the step needs on the host (a normalised update's norm,
the mean loss the divergence watch reads, ``lr="auto"``'s two scalars), and :meth:`StepChecks.read` reads them all in
one host round-trip. The first failed check raises ``FloatingPointError`` ("step N: ...; parameters left
unchanged") before anything changes. On a GPU each host read waits for the device's queue to drain, so a steady step
makes this read and the targets' range check of the loss, no other (``benchmarks/host_syncs.py`` counts them).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

Flag = torch.Tensor | Callable[[], torch.Tensor]  # a 0-d bool tensor, or a function asked for it at the read
Message = str | Callable[[], str]  # what a failed check says (a function: composed only when it fails)


def finite(*tensors: torch.Tensor) -> torch.Tensor:
    """Whether every entry of every tensor is finite, as a 0-d bool tensor (no host round-trip).

    One ``aminmax`` per tensor: NaN propagates into it, and an infinity is an extreme.

    Args:
        tensors: the tensors (empty ones are skipped).

    Returns:
        A 0-d bool tensor on the first tensor's device (``True`` when there is nothing to check).
    """
    extremes = [x for t in tensors if t.numel() for x in torch.aminmax(t)]
    if not extremes:
        return torch.ones((), dtype=torch.bool, device=tensors[0].device if tensors else None)
    return torch.isfinite(torch.stack(extremes)).all()


def raised_message(refuse: Callable[[], None]) -> str:
    """The message of the ``FloatingPointError`` that ``refuse()`` raises (a deferred check's diagnosis).

    Args:
        refuse: a function that raises the check's ``FloatingPointError`` (naming the samples).

    Returns:
        Its message, or a generic one if it does not raise.
    """
    try:
        refuse()
    except FloatingPointError as err:
        return str(err)
    return "non-finite per-sample losses or gradients"


class StepChecks:
    """The device-side checks and values of one step, read by the host together (the step's one round-trip).

    Args:
        number: the step's number, named by a failed check's message.
    """

    def __init__(self, number: int):
        self.number = number
        self._flags: list[tuple[Flag, Message]] = []
        self._values: list[torch.Tensor] = []
        self._read: list[float] | None = None

    def add(self, flag: Flag, message: Message) -> None:
        """Add a check: ``flag`` is a 0-d bool tensor, or a function of no argument returning one (asked for at the
        read, after the step's other device work); ``message`` says what a failure means (a string, or a function of
        no argument returning one)."""
        if self._read is not None:
            raise RuntimeError("this step's checks were already read")
        self._flags.append((flag, message))

    def also_read(self, *values: torch.Tensor) -> slice:
        """Read these 0-d float64 tensors with the checks; returns where their values will be in :meth:`values`."""
        if self._read is not None:
            raise RuntimeError("this step's checks were already read")
        start = len(self._values)
        self._values.extend(values)
        return slice(start, len(self._values))

    def read(self) -> None:
        """The one host round-trip: every flag and value, as float64. The first failed check (in the order added)
        raises.

        Raises:
            FloatingPointError: ``"step N: <message>; parameters left unchanged"``.
        """
        flags = [(flag() if callable(flag) else flag).to(torch.float64) for flag, _ in self._flags]
        read = [*flags, *self._values]
        got = torch.stack(read).tolist() if read else []
        self._read = got[len(flags):]
        for ok, (_, message) in zip(got, self._flags):
            if not ok:
                raise FloatingPointError(f"step {self.number}: {message() if callable(message) else message}; "
                                         f"parameters left unchanged")

    def values(self, where: slice) -> list[float]:
        """The values :meth:`also_read` returned ``where`` for, after :meth:`read`."""
        if self._read is None:
            raise RuntimeError("the step's checks are not read yet")
        return self._read[where]


__all__ = ["StepChecks", "finite", "raised_message"]
