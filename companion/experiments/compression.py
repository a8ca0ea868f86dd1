"""The compression study (``sec:app-iEF-woodfisher``; chapter ``notebooks/compression.ipynb``): one-shot pruning of
the trained ``digits-mlp`` baseline with magnitude, EF-, iEF-, SF-WoodFisher and the exact GGN (:mod:`ief.woodfisher`)
over sparsities, dampings and draws of the gradient sample. A workflow job computes it
(``python -m companion compression``, :func:`write_study`) and writes its tables; the chapter
(:mod:`companion.chapters.compression`) reads them and draws."""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from ief.woodfisher import DAMPING_GRID, FISHERS, magnitude_prune, obs_curvature, obs_saliency, prune

SETUP = "digits-mlp"
BASELINE_OPTIMIZER = "adam"
# The setup's scale per book scale: digits-mlp exists at cpu and smoke; a full build runs the cpu chapter (the
# paper has no compression experiment to stand for, and a 10M-parameter MLP's N x P rows do not fit a node).
SETUP_SCALE = {"smoke": "smoke", "cpu": "cpu", "full": "cpu"}
DEFAULTS = {
    "smoke": dict(samples=32, block_size=128, sparsities=(0.5, 0.7, 0.9), dampings=(1e-6, 1e-3, 1.0)),
    "cpu": dict(samples=512, block_size=256, sparsities=(0.5, 0.6, 0.7, 0.8, 0.9, 0.95),
                dampings=DAMPING_GRID),
}
DEFAULTS["full"] = DEFAULTS["cpu"]


@dataclass
class Baseline:
    """The trained model (eval mode, best-validation weights) and its data as tensors."""

    model: torch.nn.Module
    setup_scale: str
    summary: dict[str, Any]
    train: list[dict]
    collate: Any
    validation: tuple[torch.Tensor, torch.Tensor]
    test: tuple[torch.Tensor, torch.Tensor]
    pruned_weights: int


def load_baseline(scale: str, runs: str | Path, seed: int = 0) -> Baseline:
    """Train (or find finished) the ``digits-mlp`` Adam baseline run with :func:`companion.experiments.train` and load
    its best-validation checkpoint. ``ValueError`` for an unknown scale (accepted: smoke, cpu, full)."""
    from . import run_dir, train
    from .data import load_data
    from .models import build_model
    from .setups import resolve
    from .store import load_trainable, read_trainable
    from .tasks import make_task

    if scale not in SETUP_SCALE:
        raise ValueError(f"unknown scale {scale!r}; accepted: {', '.join(SETUP_SCALE)}")
    setup_scale = SETUP_SCALE[scale]
    summary = train(SETUP, BASELINE_OPTIMIZER, seed, setup_scale, runs, progress=False, verbose=False)
    cfg = resolve(SETUP, setup_scale)
    data = load_data(cfg)
    model, pre = build_model(cfg, data)
    task = make_task(cfg, model, pre)
    load_trainable(model, read_trainable(run_dir(runs, setup_scale, SETUP, BASELINE_OPTIMIZER, seed)
                                         / "checkpoints" / "best.pt"))
    model.eval()
    (val,) = data.validation.values()
    (test,) = data.test.values()
    weights = sum(p.numel() for p in model.parameters() if p.dim() >= 2)
    return Baseline(model, setup_scale, summary, list(data.train), task.collate, task.collate(list(val)),
                    task.collate(list(test)), weights)


def draw_batches(base: Baseline, samples: int, draw: int, seed: int = 0, batch_size: int = 128) -> list:
    """Draw ``draw``'s gradient sample: ``samples`` training examples without replacement (a fixed function of
    ``(seed, draw)``), in batches of ``batch_size``."""
    rng = np.random.default_rng([seed, 23, draw])
    idx = rng.choice(len(base.train), size=min(samples, len(base.train)), replace=False)
    x, y = base.collate([base.train[int(i)] for i in idx])
    return [(x[lo : lo + batch_size], y[lo : lo + batch_size]) for lo in range(0, len(idx), batch_size)]


@torch.no_grad()
def accuracy_and_loss(model: torch.nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> tuple[float, float]:
    """Accuracy and mean cross-entropy of ``model`` on ``(x, y)``."""
    x, y = data
    logits = model(x)
    return float((logits.argmax(-1) == y).float().mean()), float(torch.nn.functional.cross_entropy(logits, y))


def run(base: Baseline, *, samples: int, block_size: int | None, sparsities, dampings, draws: int = 3,
        seed: int = 0, methods=FISHERS) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Prune the baseline at every (method, draw, damping, sparsity), from the same trained weights each time.

    Returns:
        ``(results, costs)``: results one row per pruned model and split (``method, draw, damping, sparsity, split,
        accuracy, loss``; magnitude has no damping and is the same for every draw); costs one row per (method,
        draw): the seconds to build the curvature, the mean seconds of one pruning, ``N`` and the undamped
        curvature's mean diagonal entry ``tr F / P`` (its scale, against which a damping is small or large).
    """
    model = base.model
    original = copy.deepcopy(model.state_dict())
    rows, costs = [], []

    def record(method, draw, damping, sparsity):
        for split, data in (("validation", base.validation), ("test", base.test)):
            acc, loss = accuracy_and_loss(model, data)
            rows.append(dict(method=method, draw=draw, damping=damping, sparsity=sparsity, split=split, accuracy=acc,
                             loss=loss))

    try:
        spent = []
        for sparsity in sparsities:
            model.load_state_dict(original)
            start = time.perf_counter()
            magnitude_prune(model, sparsity)
            spent.append(time.perf_counter() - start)
            for draw in range(draws):
                record("magnitude", draw, np.nan, sparsity)
        costs.append(dict(method="magnitude", draw=0, curvature_s=0.0, prune_s=float(np.mean(spent)), samples=0,
                          mean_diagonal=np.nan))
        for draw in range(draws):
            batches = draw_batches(base, samples, draw, seed)
            n = sum(int(y.shape[0]) for _, y in batches)
            for fisher in methods:
                model.load_state_dict(original)
                start = time.perf_counter()
                curvature = obs_curvature(model, batches, fisher=fisher, block_size=block_size,
                                          generator=torch.Generator().manual_seed(1000 * seed + draw))
                built = time.perf_counter() - start
                spent = []
                for damping in dampings:
                    for sparsity in sparsities:
                        model.load_state_dict(original)
                        start = time.perf_counter()
                        curvature.prune(sparsity, damping)
                        spent.append(time.perf_counter() - start)
                        record(fisher, draw, damping, sparsity)
                costs.append(dict(method=fisher, draw=draw, curvature_s=built, prune_s=float(np.mean(spent)),
                                  samples=n, mean_diagonal=curvature.trace() / base.pruned_weights))
    finally:
        model.load_state_dict(original)
    return pd.DataFrame(rows), pd.DataFrame(costs)


STUDY_FILES = ("pruning_results.csv", "pruning_costs.csv", "study.json")  # in results/<scale>/compression/
API_EXAMPLE = dict(fisher="ief", damping=1e-4, sparsity=0.9)  # the chapter's API example (its cell's code)


def api_example(base: Baseline, samples: int, block_size: int | None, seed: int = 0) -> list[str]:
    """The chapter's API example on the baseline, as its code shows it: ``obs_saliency`` and ``prune`` with iEF at
    90 % sparsity on draw 0's gradient sample; returns the lines it prints."""
    batches = draw_batches(base, samples, draw=0, seed=seed)  # N training examples, in batches
    model = copy.deepcopy(base.model)
    rho = obs_saliency(model, batches, fisher="ief", damping=1e-4, block_size=block_size)
    lines = [str({name: tuple(r.shape) for name, r in rho.items()})]
    model, masks = prune(model, batches, sparsity=0.9, fisher="ief", damping=1e-4, block_size=block_size)
    kept = sum(int(m.sum()) for m in masks.values()) / sum(m.numel() for m in masks.values())
    lines.append(f"kept {kept:.1%} of the weights; test accuracy {accuracy_and_loss(model, base.test)[0]:.1%}")
    return lines


def study(scale: str, runs: str | Path, *, seed: int = 0, samples: int | None = None, block_size: int | None = None,
          sparsities=None, dampings=None, draws: int = 3) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, Any]]:
    """The whole study at ``scale`` (its :data:`DEFAULTS` unless given): the baseline (:func:`load_baseline`), the
    API example (:func:`api_example`) and every pruning (:func:`run`), in the order the chapter once ran them.

    Returns ``(results, costs, meta)``: :func:`run`'s two tables and what the chapter states about the study
    (its knobs, the baseline's dense accuracy and loss, its weights and blocks, the API example's printed lines)."""
    if scale not in DEFAULTS:
        raise ValueError(f"scale must be one of {sorted(DEFAULTS)}, got {scale!r}")
    defaults = DEFAULTS[scale]
    samples = samples or defaults["samples"]
    block_size = block_size or defaults["block_size"]
    sparsities = tuple(sparsities or defaults["sparsities"])
    dampings = tuple(dampings or defaults["dampings"])
    base = load_baseline(scale, runs, seed)
    dense = accuracy_and_loss(base.model, base.test)
    example = api_example(base, samples, block_size, seed)
    results, costs = run(base, samples=samples, block_size=block_size, sparsities=sparsities, dampings=dampings,
                         draws=draws, seed=seed)
    n_blocks = sum(-(-p.numel() // block_size) for p in base.model.parameters() if p.dim() >= 2)
    meta = dict(scale=scale, setup=SETUP, setup_scale=base.setup_scale, optimizer=BASELINE_OPTIMIZER, seed=seed,
                samples=samples, block_size=block_size, sparsities=list(sparsities), dampings=list(dampings),
                draws=draws, dense_accuracy=dense[0], dense_loss=dense[1], pruned_weights=base.pruned_weights,
                blocks=n_blocks, api_example=example)
    return results, costs, meta


def write_study(scale: str, runs: str | Path, out: str | Path, **knobs) -> list[Path]:
    """:func:`study` written to ``out`` (:data:`STUDY_FILES`, each atomically, ``study.json`` last)."""
    from .store import write_json, write_text

    results, costs, meta = study(scale, runs, **knobs)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / name for name in STUDY_FILES]
    write_text(paths[0], results.to_csv(index=False))
    write_text(paths[1], costs.to_csv(index=False))
    write_json(paths[2], meta)
    return paths


def read_study(folder: str | Path, scale: str) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, Any]]:
    """The tables :func:`write_study` wrote in ``folder`` (floats read back exactly); ``FileNotFoundError`` naming
    the job that makes them when one is missing."""
    import json

    paths = [Path(folder) / name for name in STUDY_FILES]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(
            f"the compression study's tables are missing ({', '.join(missing)}): the workflow's `compression` job "
            f"makes them (`make book SCALE={scale}`); by hand: `python -m companion compression --scale {scale} "
            f"--runs runs --out {folder}`")
    read = dict(float_precision="round_trip")
    return (pd.read_csv(paths[0], **read), pd.read_csv(paths[1], **read), json.loads(paths[2].read_text()))
