"""Where a steady ``ief.optim`` step spends its time: per-sample J, finiteness, Gram, solve, combination, update.

:func:`attribute` wraps, for the duration of the measurement only, the functions of one ``ief`` package (the current
one, or an older one loaded by :func:`benchmarks.hf_layers.load_before`) that a step of :class:`ief.optim.IEF` /
``EF`` calls once each, times every call (wall clock, the device synchronised at both ends of each wrapped call, so
on a GPU the phases are device time and sum to a step made slower only by those synchronisations), and gives each
phase's median over the measured steps:

- ``per_sample``: :func:`ief.per_sample` as the step calls it (forward, backward, the rows of ``J``; before the
  deferred finiteness check also the pass over ``J`` that checks it);
- ``finite``: :meth:`ief.rows.Rows.finite_flag`, wherever it is called (inside ``per_sample`` or ``update``: a nested
  phase, also counted in its caller);
- ``gram``, ``solve``, ``combine``: :meth:`~ief.rows.Rows.gram` (of every form: the dense rows, the factored ones,
  :class:`ief.streamed.StreamedRows`), the ``[M, M]`` solve, :meth:`~ief.rows.Rows.combine_rows`; a call made inside
  another of the same phase (``StreamedRows.gram`` calls the factored form's) counts once;
- ``stream_gram``, ``stream_combine``: the streamed weights' share of ``gram`` and ``combine`` (their rows formed a
  block at a time for each product: :func:`ief.streamed.streamed_gram`, :func:`ief.streamed.streamed_combine`;
  nested phases, also counted in ``gram`` / ``combine``; zero where no weight is streamed);
- ``update``: the step's one host read of its checks and the parameter update;
- ``other``: the step less ``per_sample``, ``gram``, ``solve``, ``combine`` and ``update``.
"""
from __future__ import annotations

import contextlib
import functools
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from benchmarks import harness

PHASES = ("per_sample", "finite", "gram", "stream_gram", "solve", "combine", "stream_combine", "update", "other",
          "step")
TOP_LEVEL = ("per_sample", "gram", "solve", "combine", "update")  # disjoint parts of a step; the others nest


def _targets(lib: Any) -> list[tuple[Any, str, str]]:
    """``(owner, attribute, phase)`` of the functions timed in package ``lib`` (``ief`` or an older copy)."""
    rows, exact, directions = lib.rows, lib.optim.exact, lib.directions
    out = [(exact, "per_sample", "per_sample"), (directions, "_solve_gram", "solve"),
           (exact.PreconditionedOptimizer, "_update", "update")]
    for cls in (rows.DenseRows, rows.FactoredJacobian):
        out += [(cls, "gram", "gram"), (cls, "combine_rows", "combine"), (cls, "finite_flag", "finite")]
    streamed = getattr(lib, "streamed", None)  # a package before the streamed route has none
    if streamed is not None:
        out += [(streamed.StreamedRows, "gram", "gram"), (streamed.StreamedRows, "combine_rows", "combine")]
        out += [(streamed, name, phase) for name, phase in (("streamed_gram", "stream_gram"),
                                                             ("streamed_combine", "stream_combine"))
                if name in vars(streamed)]
    return out


@contextlib.contextmanager
def _timed(lib: Any, device: torch.device, seconds: dict[str, float]) -> Iterator[None]:
    """Inside it, every call of :func:`_targets` adds its wall seconds to ``seconds[phase]`` (once: a call inside
    another of its phase is not timed again)."""
    saved, active = [], set()
    for owner, name, phase in _targets(lib):
        original = owner.__dict__[name]

        @functools.wraps(original)
        def wrapper(*args, _original=original, _phase=phase, **kwargs):
            if _phase in active:  # inside a call of the same phase: timed there
                return _original(*args, **kwargs)
            active.add(_phase)
            harness.synchronize(device)
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                harness.synchronize(device)
                seconds[_phase] = seconds.get(_phase, 0.0) + time.perf_counter() - start
                active.discard(_phase)

        saved.append((owner, name, original))
        setattr(owner, name, wrapper)
    try:
        yield
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


def attribute(lib: Any, step: Callable[[], Any], device: torch.device, repeats: int) -> dict[str, float]:
    """Median milliseconds of each of :data:`PHASES` over ``repeats`` calls of ``step`` (a steady step of an
    optimiser of package ``lib``: warm it up first).

    Args:
        lib: the ``ief`` package whose optimiser ``step`` drives.
        step: one optimiser step, a function of no argument.
        device: where it runs.
        repeats: measured steps (``>= 1``).

    Returns:
        ``{phase: median ms}``.
    """
    per_step: list[dict[str, float]] = []
    for _ in range(max(1, repeats)):
        seconds: dict[str, float] = {}
        with _timed(lib, device, seconds):
            harness.synchronize(device)
            start = time.perf_counter()
            step()
            harness.synchronize(device)
            seconds["step"] = time.perf_counter() - start
        seconds["other"] = seconds.get("step", 0.0) - sum(seconds.get(k, 0.0) for k in TOP_LEVEL)
        per_step.append(seconds)
    return {k: 1e3 * statistics.median(s.get(k, 0.0) for s in per_step) for k in PHASES}
