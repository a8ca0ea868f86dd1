"""Per-example test predictions for finished runs made before the runner stored them.

A finished run is never rewritten (:mod:`.runner`), but its ``checkpoints/best.pt`` holds the parameters its test
metrics were measured with. ``python -m companion backfill --scale X --runs RUNS`` rebuilds each such run's model
(the setup as the run recorded it, the run's seed), loads ``best.pt``, evaluates the test split and writes the run's
``test_predictions.csv`` (:func:`.store.test_predictions_csv`) only when the predictions reproduce the metrics in
its ``summary.json`` exactly: a run whose checkpoint no longer gives its recorded result is named, not back-filled.
Inference only: a few seconds per cpu run.
"""
from __future__ import annotations

from pathlib import Path

import torch

from . import store
from .aggregate import find_runs
from .data import load_data
from .models import build_model
from .precision import forward_precision
from .runner import evaluate, metrics_of, recorded_overrides, seed_everything
from .setups import GLUE_TASKS, resolve
from .tasks import make_task


def backfill_run(root: Path) -> str:
    """Write ``root/test_predictions.csv`` from ``best.pt``; returns what was done, in words ("written", "present",
    or why not)."""
    root = Path(root)
    if (root / store.TEST_PREDICTIONS).exists():
        return "present"
    summary = store.read_json(root / "summary.json")
    if not summary.get("test"):
        return "no test labels (private): nothing to compare example by example"
    scale, setup, seed = summary["scale"], summary["setup"], int(summary["seed"])
    cfg = resolve(setup, scale, recorded_overrides(root, setup, scale))
    if cfg.task in GLUE_TASKS:
        return "a GLUE task: its test labels are private at cpu and full scale"
    seed_everything(seed)
    data = load_data(cfg)
    model, preprocessor = build_model(cfg, data)
    task = make_task(cfg, model, preprocessor)
    store.load_trainable(model, store.read_trainable(root / "checkpoints" / "best.pt"))
    dev = torch.device("cpu")
    with forward_precision(summary.get("precision", "float32"), dev):
        results = evaluate(model, task, data.test, dev, cfg.eval_batch_size)
    got = metrics_of(cfg.task, results)
    if got is None or any(abs(got[k] - float(v)) > 1e-9 for k, v in summary["test"].items()):
        return f"not written: best.pt gives test metrics {got}, the summary records {summary['test']}"
    store.write_text(root / store.TEST_PREDICTIONS, store.test_predictions_csv(results))
    return "written"


def backfill(runs: str | Path, scale: str) -> dict[Path, str]:
    """:func:`backfill_run` for every finished run under ``runs/<scale>``; ``{run folder: what was done}``."""
    return {folder: backfill_run(folder) for folder in find_runs(runs, scale)[0]}
