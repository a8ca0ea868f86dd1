"""A certificate of what a step ran (``opt.last_step_report``): the method, the route each parameter's rows took,
the rows in the Gram system, the processes and the sharding, so that a user can see that the exact method, not a
fallback, trained the model (:class:`ief.hf.IEFTrainer` logs it).

A parameter's route (its per-sample rows, :func:`ief.per_sample`):

- ``"factored"``: a linear weight kept as its layer's inputs and output gradients (the ghost Gram;
  :class:`ief.rows.FactoredJacobian`), never its ``[M, I O]`` rows;
- ``"streamed"``: a linear weight kept as its layer's inputs and output gradients, its rows formed a block at a time
  for each product and dropped (:mod:`ief.streamed`), never kept;
- ``"used rows"``: an embedding table kept as the rows the batch used;
- ``"dense"``: its block of rows formed by its layer's hook (a bias, a norm, a linear weight whose rows are cheaper
  than its factors, or any parameter with ``form="dense"``);
- ``"looped"``: the exact per-sample loop of backward passes (no hook covers it: :class:`ief.SlowPathWarning`).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..jacobian.loop import LOOPED_ATTRIBUTE


@dataclass(frozen=True)
class StepReport:
    """What one step of an exact optimiser ran.

    Attributes:
        step: the step's number (0 for the first).
        method: ``"iEF"``, ``"EF"``, ``"SF"`` (the Gram solve that gave the direction), or the optimiser's class name
            for one without a Gram solve (``"KFAC"``).
        routes: parameter name -> ``"factored"``, ``"streamed"``, ``"used rows"``, ``"dense"`` or ``"looped"``
            (module docstring),
            this rank's (every rank's are the same for the same model and batch shapes); empty where not recorded.
        rows: the rows of the Gram system, ``M`` of the union batch across processes.
        ranks: the processes the step was exact over (1: one process).
        across_processes: whether the step combined several processes' batches.
        sharding: ``None`` (replicated or one process) or the FSDP2 route the step took (:data:`ief.sharded.ROUTE`,
            every module unsharded once; :data:`ief.sharded.LAYERWISE_ROUTE`, rows under FSDP2's per-module unshard).
        gram_factors: across processes, the parameters whose cross-rank Gram blocks came from gathered factors
            (:func:`ief.distributed.gram_plan`); the others' rows were gathered.
    """

    step: int
    method: str
    routes: dict[str, str] = field(default_factory=dict)
    rows: int = 0
    ranks: int = 1
    across_processes: bool = False
    sharding: str | None = None
    gram_factors: tuple[str, ...] = ()

    def summary(self) -> str:
        """One line for a log: the method, the routes counted, the rows, the processes and the sharding."""
        where = f"{self.ranks} processes" if self.across_processes else "1 process"
        sharded = f", {self.sharding}" if self.sharding else ""
        if not self.routes and not self.rows:
            return f"step {self.step}: {self.method} on {where}{sharded} (no per-sample rows recorded)"
        counts: dict[str, int] = {}
        for route in self.routes.values():
            counts[route] = counts.get(route, 0) + 1
        routes = ", ".join(f"{n} {route}" for route, n in sorted(counts.items())) or "routes not recorded"
        return f"step {self.step}: {self.method} over {self.rows} rows on {where}{sharded} ({routes})"


def routes_of(rows: Any, names: Sequence[str]) -> dict[str, str]:
    """Every parameter's route in ``rows`` (this rank's ``J``: a tensor or a :class:`ief.rows.FactoredJacobian`),
    by name."""
    looped = set(getattr(rows, LOOPED_ATTRIBUTE, ()))
    ghosts = {i for i, _, _ in getattr(rows, "ghosts", ())}
    streamed = set(getattr(rows, "streamed", ()))
    tables = set(getattr(rows, "used_rows", {}))
    out = {}
    for i, name in enumerate(names):
        out[name] = ("looped" if i in looped else "streamed" if i in streamed else "factored" if i in ghosts
                     else "used rows" if i in tables else "dense")
    return out


def step_report(step: int, method: str, rows: Any, names: Sequence[str], union: Any = None,
                sharding: str | None = None) -> StepReport:
    """The :class:`StepReport` of a step.

    Args:
        step: the step's number.
        method: the solve's name (or the optimiser's class name).
        rows: this rank's rows (``None``: no rows recorded).
        names: the parameters' names, in ``J``'s column order.
        union: the :class:`ief.distributed.DistributedRows` the solve used across processes, else ``None``.
        sharding: the sharded route's name, or ``None``.

    Returns:
        The report.
    """
    routes = {} if rows is None else routes_of(rows, names)
    if union is None:
        m = 0 if rows is None else int(rows.shape[0])
        return StepReport(step, method, routes, m, 1, False, sharding)
    plan = union._plan  # the plan the Gram used (None when no Gram was formed)
    factors = () if plan is None or not plan.factors else tuple(names[i] for i, *_ in plan.factors)
    return StepReport(step, method, routes, int(union.shape[0]), len(union.sizes), True, sharding, factors)
