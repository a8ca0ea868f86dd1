"""The cost of one update of each optimiser of a setup, measured side by side in one process.

Wall times of separate runs are not comparable: they ran at different times, beside different jobs. Here every
optimiser gets its own copy of the setup's model (the same initial weights) and steps on the same batches, the
optimisers interleaved within every repetition, so that a load that comes and goes affects them alike. The first
update of each is a warm-up (caches, lazily built state) and is not counted; the cost is the median of the rest, and
the ratio is to the setup's baseline (AdamW for LoRA, Adafactor for prompt tuning, Adam for the MLP) measured in the
same repetitions.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import pandas as pd
import torch

from .data import load_data
from .models import build_model
from .optimizers import make_optimizer, train_step
from .run_checks import check_setup, resolve_device
from .runner import epoch_order, seed_everything
from .setups import optimizer_config, practical_optimizers, resolve
from .tasks import make_task, to_device

COLUMNS = ["setup", "optimizer", "median_s", "min_s", "max_s", "updates", "ratio", "baseline"]
STEP_COSTS_FILE = "step_costs.csv"  # the workflow's table of practical_step_costs, in results/<scale>/
# A millisecond update (the MLP) is timed this many times as often as a one-second one: the same few seconds of timing.
MLP_REPEAT_FACTOR = 20


def step_costs(setup: str, scale: str, optimizers: Sequence[str], baseline: str, *, repeats: int = 5,
               seed: int = 0, device: str | None = None) -> pd.DataFrame:
    """Seconds per update of each optimiser on ``setup`` at ``scale``, measured side by side.

    Args:
        setup: a setup name of :mod:`.setups` (e.g. ``"tweets-minilm-lora"``).
        scale: ``"smoke"``, ``"cpu"`` or ``"full"``.
        optimizers: the optimisers to time (each must be defined for the setup).
        baseline: the optimiser the ratios are taken to (it is timed too, added if not in ``optimizers``).
        repeats: timed updates per optimiser (>= 1), after one warm-up update each.
        seed: the seed of the initial weights and of the batch order (the runner's ``seed``).
        device: torch device (default: cuda if available, else cpu).

    Returns:
        One row per optimiser (``baseline`` first), columns :data:`COLUMNS`: ``median_s`` (and ``min_s``,
        ``max_s``) of the timed updates, ``updates`` timed, ``ratio`` = ``median_s`` over the baseline's.

    Raises:
        ValueError: ``repeats`` is not a positive integer, an optimiser is not defined for the setup, or a timed
            update did not produce a finite loss (named).
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive integer (timed updates per optimiser), got {repeats!r}")
    cfg = check_setup(resolve(setup, scale))
    names = [baseline, *[o for o in optimizers if o != baseline]]
    configs = {o: optimizer_config(cfg, o) for o in names}  # unknown optimisers fail before anything is built
    dev = resolve_device(device)
    data = load_data(cfg)
    n, bs = len(data.train), cfg.batch_size
    total = cfg.epochs * -(-n // bs)
    order = epoch_order(seed, 0, n)
    if (repeats + 1) * bs > n:
        order = torch.arange(n).repeat(-(-(repeats + 1) * bs // n)).numpy()
    runs = {}
    for o in names:
        seed_everything(seed)
        model, preprocessor = build_model(cfg, data)
        model.to(dev).train()
        task = make_task(cfg, model, preprocessor)
        opt, _ = make_optimizer(model, configs[o], total)
        runs[o] = (model, task, opt)
    times: dict[str, list[float]] = {o: [] for o in names}
    for r in range(repeats + 1):
        batch = [data.train[int(i)] for i in order[r * bs: (r + 1) * bs]]
        for o in names:
            model, task, opt = runs[o]
            inputs, targets = task.collate(batch)
            inputs, targets = to_device(inputs, dev), targets.to(dev)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            start = time.perf_counter()
            loss = train_step(model, opt, inputs, targets)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            elapsed = time.perf_counter() - start
            if loss != loss or loss in (float("inf"), float("-inf")):
                raise ValueError(f"{setup}/{o}: update {r} gave a non-finite loss {loss}: the cost of a "
                                 f"diverging run is not measured")
            if r > 0:
                times[o].append(elapsed)
    base = statistics.median(times[baseline])
    rows = [{"setup": setup, "optimizer": o, "median_s": statistics.median(t), "min_s": min(t), "max_s": max(t),
             "updates": len(t), "ratio": statistics.median(t) / base, "baseline": baseline}
            for o, t in times.items()]
    return pd.DataFrame(rows, columns=COLUMNS)


def practical_step_costs(setups: Sequence[str], scale: str, *, repeats: int = 5, device: str | None = None
                         ) -> pd.DataFrame:
    """:func:`step_costs` of the practical comparison's optimisers (:func:`.setups.practical_optimizers`) on every
    setup, against its baseline: the table of chapter ``notebooks/practical.ipynb`` ("Cost per update"), which the
    workflow measures as a job of its own (``python -m companion step-costs``) beside the training runs.

    Args:
        setups: setup names.
        scale: ``"smoke"``, ``"cpu"`` or ``"full"``.
        repeats: timed updates per optimiser (>= 1); an MLP's updates are timed :data:`MLP_REPEAT_FACTOR` times
            as often.
        device: torch device (default: cuda if available, else cpu).

    Returns:
        The rows of :func:`step_costs` of every setup, in the order of ``setups``.

    Raises:
        ValueError: as :func:`step_costs`, or an unknown setup or scale.
    """
    frames = []
    for setup in setups:
        optimizers = practical_optimizers(setup, scale)
        factor = MLP_REPEAT_FACTOR if resolve(setup, scale).family == "mlp" else 1
        frames.append(step_costs(setup, scale, optimizers[1:], optimizers[0], repeats=repeats * factor,
                                 device=device))
    return pd.concat(frames, ignore_index=True)
