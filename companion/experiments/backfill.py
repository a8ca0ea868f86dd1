"""What the verdicts read of a run, for finished runs made before the runner recorded it.

A finished run is never trained again (:mod:`.runner`), but its checkpoints hold the parameters its numbers were
measured with. ``python -m companion backfill --scale X --runs RUNS`` rebuilds each finished run's model (the setup as
the run recorded it, the run's seed) and adds, where the run lacks them:

- ``test_predictions.csv`` (:func:`.store.test_predictions_csv`) from ``checkpoints/best.pt``, written only when the
  predictions reproduce the metrics in its ``summary.json`` exactly: a run whose checkpoint no longer gives its
  recorded result is named, not back-filled (:func:`backfill_predictions`);
- ``final_train_loss_full`` in ``summary.json`` (:mod:`.final_loss`), the full training-set loss of
  ``checkpoints/stage-100.pt``, the parameters after the last update; ``None`` for a run that diverged
  (:func:`backfill_final_loss`). The summary is rewritten atomically under the run's lock, its other fields
  unchanged.

Inference only: a few seconds per cpu run.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from . import store
from .aggregate import find_runs
from .data import load_data
from .final_loss import FIELD, FINAL_STAGE, training_set_loss
from .models import build_model
from .precision import forward_precision
from .runner import evaluate, metrics_of, recorded_overrides, seed_everything
from .setups import GLUE_TASKS, resolve
from .tasks import make_task


class _Rebuilt:
    """A finished run's model, task and data, built once (lazily) for every back-fill of the run."""

    def __init__(self, root: Path, summary: dict[str, Any]):
        self.root, self.summary = root, summary
        scale, setup = summary["scale"], summary["setup"]
        self.cfg = resolve(setup, scale, recorded_overrides(root, setup, scale))
        self._built: tuple[Any, Any, Any] | None = None
        self.dev = torch.device("cpu")

    def model_with(self, checkpoint: Path) -> tuple[Any, Any, Any]:
        """``(model, task, data)`` with ``checkpoint``'s trainable parameters loaded."""
        if self._built is None:
            seed_everything(int(self.summary["seed"]))
            data = load_data(self.cfg)
            model, preprocessor = build_model(self.cfg, data)
            self._built = model, make_task(self.cfg, model, preprocessor), data
        store.load_trainable(self._built[0], store.read_trainable(checkpoint))
        return self._built

    def precision(self):
        return forward_precision(self.summary.get("precision", "float32"), self.dev)


def backfill_predictions(root: Path, run: _Rebuilt | None = None) -> str:
    """Write ``root/test_predictions.csv`` from ``best.pt``; returns what was done, in words ("written", "present",
    or why not)."""
    root = Path(root)
    if (root / store.TEST_PREDICTIONS).exists():
        return "present"
    summary = store.read_json(root / "summary.json")
    if not summary.get("test"):
        return "no test labels (private): nothing to compare example by example"
    run = run or _Rebuilt(root, summary)
    if run.cfg.task in GLUE_TASKS:
        return "a GLUE task: its test labels are private at cpu and full scale"
    model, task, data = run.model_with(root / "checkpoints" / "best.pt")
    with run.precision():
        results = evaluate(model, task, data.test, run.dev, run.cfg.eval_batch_size)
    got = metrics_of(run.cfg.task, results)
    if got is None or any(abs(got[k] - float(v)) > 1e-9 for k, v in summary["test"].items()):
        return f"not written: best.pt gives test metrics {got}, the summary records {summary['test']}"
    store.write_text(root / store.TEST_PREDICTIONS, store.test_predictions_csv(results))
    return "written"


def backfill_final_loss(root: Path, run: _Rebuilt | None = None) -> str:
    """Add ``final_train_loss_full`` to ``root/summary.json`` from ``checkpoints/stage-100.pt``; returns what was
    done, in words ("written", "present", or why not)."""
    root = Path(root)
    with store.lock(root):
        summary = store.read_json(root / "summary.json")
        if FIELD in summary:
            return "present"
        if summary.get("diverged"):
            store.write_json(root / "summary.json", {**summary, FIELD: None})
            return "written (the run diverged: no final checkpoint, the worst loss)"
        final = root / "checkpoints" / FINAL_STAGE
        if not final.exists():
            return f"not written: {final} (the parameters after the last update) is missing"
        run = run or _Rebuilt(root, summary)
        model, task, data = run.model_with(final)
        with run.precision():
            value = training_set_loss(model, task, data.train, run.dev, run.cfg.eval_batch_size)
        store.write_json(root / "summary.json", {**summary, FIELD: value})
    return "written"


def backfill_run(root: Path) -> dict[str, str]:
    """Both back-fills of one finished run, on one rebuilt model; ``{"test predictions": ..., "final loss": ...}``,
    each what was done in words."""
    root = Path(root)
    run = _Rebuilt(root, store.read_json(root / "summary.json"))
    return {"test predictions": backfill_predictions(root, run), "final loss": backfill_final_loss(root, run)}


def backfill(runs: str | Path, scale: str) -> dict[Path, dict[str, str]]:
    """:func:`backfill_run` for every finished run under ``runs/<scale>``; ``{run folder: what was done}``."""
    return {folder: backfill_run(folder) for folder in find_runs(runs, scale)[0]}
