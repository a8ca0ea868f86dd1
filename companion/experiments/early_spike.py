"""iEF's early loss spike on the MLP trained from scratch (``sec:app-mlp-cifar10``): measured in the run records and
explained by the first update.

iEF's direction solves ``J d = s`` (``eqn:iEF_lsq``): to first order, a step of rate ``eta`` (the package's sum-loss
convention) lowers every sample's loss ``l_n`` by ``eta * s_n``, ``s_n = ||grad_z l_n||^2`` (``eqn:s_ief``). At a
random initialisation of a ``C``-class classifier every sample has ``l_n ~ ln C`` and ``s_n ~ 1 - 1/C``, so a rate
above ``ln C / (1 - 1/C)`` asks the linearised model for more than the whole loss: the step overshoots, the logits
move far past the linear regime and the loss rises instead (:func:`first_step` measures it: the first-order drop the
step asks for over the loss, the Gram matrix's smallest eigenvalue against the damping, the losses after the step).

:func:`spike_stats` summarises a loss curve (first loss, peak and when, the last update still above the first loss);
:func:`curve_spikes` applies it to the E2 runs (``e2_curves.csv``) and :func:`search_spikes` to the learning-rate
search's trials (one curve per rate); :func:`spike_glue` gives the chapter's strings.
"""
from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from ief import per_sample
from .optimizers import make_optimizer, train_step
from .runner import epoch_order, seed_everything
from .setups import resolve

ASKED_RATES = (1.0, 3.0, 10.0)  # iEF's digits-mlp rate before the extended search (10) and the two below it


def spike_stats(losses: Sequence[float]) -> dict[str, float | int]:
    """``{"first", "peak", "peak_step", "peak_ratio", "last_above"}`` of a training-loss curve (update 1 first).

    ``peak_ratio`` is the largest loss over the first; ``last_above`` the last update (1-based) whose loss exceeds the
    first one (0: never, the curve stays below its start after update 1).

    Raises:
        ValueError: an empty curve or a non-finite first loss.
    """
    values = np.asarray(losses, dtype=float)
    if values.size == 0 or not math.isfinite(values[0]):
        raise ValueError(f"a loss curve needs a finite first loss, got {values[:1].tolist() or 'no losses'}")
    above = np.nonzero(values[1:] > values[0])[0]
    peak = int(np.nanargmax(values))
    return {"first": float(values[0]), "peak": float(values[peak]), "peak_step": peak + 1,
            "peak_ratio": float(values[peak] / values[0]) if values[0] > 0 else math.inf,
            "last_above": int(above[-1]) + 2 if above.size else 0}


def curve_spikes(curves: pd.DataFrame, setup: str, optimizer: str = "ief") -> pd.DataFrame:
    """One row per seed of ``setup``/``optimizer`` in ``e2_curves.csv``'s long format: :func:`spike_stats` of its
    ``train_loss`` curve (``steps``: its length)."""
    rows = []
    sel = curves[(curves["setup"] == setup) & (curves["optimizer"] == optimizer) & (curves["quantity"] == "train_loss")]
    for seed, group in sel.groupby("seed"):
        losses = group.sort_values("step")["value"].to_numpy()
        rows.append({"seed": int(seed), "steps": len(losses), **spike_stats(losses)})
    return pd.DataFrame(rows)


def search_spikes(record: dict[str, Any], optimizer: str = "ief") -> pd.DataFrame:
    """One row per trial of ``optimizer`` in a learning-rate search record (``lr``, ``seed``, ``chosen``,
    ``diverged``, ``steps`` and :func:`spike_stats` of its ``train_losses``)."""
    entry = record["optimizers"].get(optimizer)
    if entry is None:
        raise ValueError(f"the search record has no {optimizer!r}; it has {sorted(record['optimizers'])}")
    rows = []
    for t in entry["trials"]:
        losses = t.get("train_losses") or []
        if losses:
            rows.append({"lr": float(t["lr"]), "seed": t.get("seed"), "chosen": t["lr"] == entry["chosen_lr"],
                         "diverged": t.get("diverged"), "steps": len(losses), **spike_stats(losses)})
    return pd.DataFrame(rows).sort_values(["lr", "seed"]).reset_index(drop=True)


def first_step(setup: str, scale: str, lrs: Sequence[float], seeds: Sequence[int] = (0, 1, 2),
               optimizer: str = "ief", overrides: dict[str, Any] | None = None) -> pd.DataFrame:
    """The first update of each run, redone as the runner does it (same initial model, first batch and optimiser, the
    rate replaced): one row per (seed, lr).

    Columns: ``loss`` (the batch's mean loss before), ``s`` (mean ``s_n``), ``s_spread`` (max/min ``s_n``),
    ``asked`` (the first-order decrease of the batch's loss that the update asks for, ``-mean_n grad l_n . delta``,
    over ``loss``: above 1 the linearised model is asked for more than the whole loss), ``gram_min`` (smallest
    eigenvalue of ``J J^T``) and ``damping``,
    ``batch_after`` / ``train_after`` (mean loss of the same batch / of the whole training set after the update),
    ``logit_move`` (mean ``||z_n' - z_n||`` over the batch) and ``one_class`` (the largest share of the training set
    predicted as one class after the update).

    ``overrides``: the runs' setup overrides (:func:`.runner.recorded_overrides`), so that a run trained with
    ``--set`` is redone as it ran.

    Raises:
        ValueError: a rate that is not a finite number > 0.
    """
    from .data import load_data
    from .models import build_model
    from .tasks import make_task

    bad = [lr for lr in lrs if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0)]
    if bad:
        raise ValueError(f"learning rates must be finite numbers > 0, got {bad}")
    cfg = resolve(setup, scale, overrides)
    rows = []
    for seed in (int(k) for k in seeds):  # numpy integers (a table's seed column) included
        seed_everything(seed)
        data = load_data(cfg)
        model, pre = build_model(cfg, data)
        task = make_task(cfg, model, pre)
        model.train()
        n = len(data.train)
        order = epoch_order(seed, 0, n)
        x, y = task.collate([data.train[int(i)] for i in order[: cfg.batch_size]])
        xs, ys = task.collate([data.train[i] for i in range(n)])
        ps = per_sample(model, x, y)
        jac = ps.jacobian.to(torch.float64)
        gram_min = float(torch.linalg.eigvalsh(jac @ jac.T)[0])
        before = torch.cat([p.detach().reshape(-1) for p in model.parameters() if p.requires_grad])
        with torch.no_grad():
            z0 = model(x)
        for lr in lrs:
            net = copy.deepcopy(model)
            ocfg = dataclasses.replace(cfg.optimizers[optimizer], lr=float(lr))
            opt, _ = make_optimizer(net, ocfg, 1_000_000)
            loss = train_step(net, opt, x, y)
            after = torch.cat([p.detach().reshape(-1) for p in net.parameters() if p.requires_grad])
            asked = float(-(jac @ (after - before).to(torch.float64)).mean() / ps.losses.to(torch.float64).mean())
            with torch.no_grad():
                z1, zs = net(x), net(xs)
                rows.append({
                    "seed": seed, "lr": float(lr), "loss": loss, "s": float(ps.logit_sqnorm.mean()),
                    "s_spread": float(ps.logit_sqnorm.max() / ps.logit_sqnorm.min()), "asked": asked,
                    "gram_min": gram_min, "damping": ocfg.damping,
                    "batch_after": float(torch.nn.functional.cross_entropy(z1, y)),
                    "train_after": float(torch.nn.functional.cross_entropy(zs, ys)),
                    "logit_move": float((z1 - z0).norm(dim=1).mean()),
                    "one_class": float(zs.argmax(1).bincount().max() / len(ys)),
                })
    return pd.DataFrame(rows)


SPIKE_KEYS = ("sp_setup", "sp_lr", "sp_seeds", "sp_e2_peaks", "sp_e2_last_above", "sp_e2_verdict", "sp_search",
              "sp_search_source", "sp_loss0", "sp_s0", "sp_s_spread", "sp_threshold", "sp_asked", "sp_batch_after",
              "sp_train_after", "sp_logit_move", "sp_one_class", "sp_gram_min", "sp_gram_over_damping",
              "sp_damping_verdict", "sp_rescale_verdict")


def _by_lr(first: pd.DataFrame, column: str, fmt: str = "{:.3g}") -> str:
    """``"lr 1: a–b, lr 3: ..."``: the range over seeds of ``column`` per rate (one value when they agree)."""
    parts = []
    for lr, group in first.groupby("lr"):
        lo, hi = group[column].min(), group[column].max()
        text = fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}–{fmt.format(hi)}"
        parts.append(f"lr {lr:g}: {text}")
    return ", ".join(parts)


def spike_glue(setup: str, lr: float, classes: int, runs: pd.DataFrame, search: pd.DataFrame | None,
               first: pd.DataFrame, spike: float = 1.5, search_source: str = "") -> dict[str, str]:
    """The chapter's strings (:data:`SPIKE_KEYS`) from :func:`curve_spikes` (``runs``, the E2 runs at rate ``lr``),
    :func:`search_spikes` (``search``; ``None`` where no search is recorded; ``search_source``: where it is read from)
    and :func:`first_step` (``first``). ``spike``: a peak above this multiple of the first loss counts as a spike in
    the verdict.

    Raises:
        ValueError: no E2 run or no first-step row.
    """
    if runs.empty or first.empty:
        raise ValueError("spike_glue needs at least one E2 run and one first-step row")
    peaks = ", ".join(f"×{r:.3g} at update {s}" for r, s in zip(runs["peak_ratio"], runs["peak_step"]))
    spiked = int((runs["peak_ratio"] > spike).sum())
    if search is None or search.empty:
        searched = "no learning-rate search is recorded at this scale"
    else:
        searched = "; ".join(f"lr {r.lr:g}{' (chosen)' if r.chosen else ''}: peak ×{r.peak_ratio:.3g} at update "
                             f"{r.peak_step}, last update above the first loss {r.last_above} of {r.steps}"
                             for r in search.itertuples())
    ratio = first["gram_min"] / first["damping"].where(first["damping"] > 0)
    return {
        "sp_setup": setup, "sp_lr": f"{lr:g}", "sp_seeds": str(len(runs)),
        "sp_e2_peaks": peaks,
        "sp_e2_last_above": ", ".join(str(v) for v in runs["last_above"]) + f" (of {int(runs['steps'].max())})",
        "sp_e2_verdict": (f"at this rate {spiked} of {len(runs)} seeds still spike (peak above {spike:g}× the first "
                          f"loss), the last back below its first loss after update {int(runs['last_above'].max())}"
                          if spiked else
                          f"there is no spike at this rate (no seed's peak exceeds {spike:g}× its first loss)"),
        "sp_search": searched, "sp_search_source": search_source or "no record at this scale",
        "sp_s_spread": f"{first['s_spread'].max():.3g}",
        "sp_loss0": f"{first['loss'].min():.3g}–{first['loss'].max():.3g}",
        "sp_s0": f"{first['s'].min():.3g}–{first['s'].max():.3g}",
        "sp_threshold": f"{math.log(classes) / (1 - 1 / classes):.3g}",
        "sp_asked": _by_lr(first, "asked"), "sp_batch_after": _by_lr(first, "batch_after"),
        "sp_train_after": _by_lr(first, "train_after"), "sp_logit_move": _by_lr(first, "logit_move"),
        "sp_one_class": _by_lr(first, "one_class", "{:.0%}"),
        "sp_gram_min": f"{first['gram_min'].min():.2g}–{first['gram_min'].max():.2g}",
        "sp_gram_over_damping": "n/a (no damping)" if ratio.isna().all() else f"{ratio.min():.2g}",
        "sp_damping_verdict": ("Damping plays no part" if ratio.isna().all() or ratio.min() > 1e3 else
                               "Damping can matter here"),
        "sp_rescale_verdict": ("iEF's rescaling singles out no sample" if first["s_spread"].max() < 1.5 else
                               "iEF's rescaling weighs the samples of a first batch differently"),
    }


EARLY_SPIKE_FILE = "early_spike.csv"  # the workflow's table of :func:`first_step` on the E2 runs, in results/<scale>/


def spike_setup(setups: Sequence[str], scale: str) -> str | None:
    """The setup whose early spike is measured: the first MLP trained from scratch among ``setups`` that iEF trains
    in E2 (``None``: none is)."""
    from .setups import e2_optimizers

    return next((s for s in setups if resolve(s, scale).method == "scratch" and "ief" in e2_optimizers(s)), None)


def e2_first_step(scale: str, runs_dir: str | Path, results_dir: str | Path) -> pd.DataFrame:
    """:func:`first_step` of the E2 grid's iEF runs of :func:`spike_setup` (the chapter E2's setups, read from the
    aggregated tables in ``results_dir``): at the runs' rate, :data:`ASKED_RATES` and the search's rates, for the
    runs' seeds, with the runs' own setup overrides (read from ``runs_dir``). An empty table (no row, no column)
    where the grid has no such setup. The workflow's ``early_spike`` job writes it (``python -m companion
    early-spike``)."""
    from .aggregate import load_e2
    from .runner import recorded_overrides, run_dir
    from .search import load_record

    grid = load_e2(scale, results_dir, runs_dir)
    setup = spike_setup(grid.setups, scale)
    if setup is None:
        return pd.DataFrame()
    table = grid.table
    ief_runs = table[(table.setup == setup) & (table.optimizer == "ief")]
    lr = float(ief_runs["lr"].iloc[0])
    record = load_record(setup, scale)
    searched = search_spikes(record) if record else None
    rates = sorted(set(ASKED_RATES) | {lr} | (set(searched["lr"]) if searched is not None else set()))
    seeds = sorted(ief_runs["seed"].unique())  # the runs' own setup (their --set overrides) where at hand
    overrides = recorded_overrides(run_dir(runs_dir, scale, setup, "ief", int(seeds[0])), setup, scale)
    return first_step(setup, scale, rates, seeds=seeds, overrides=overrides)


def write_e2_first_step(scale: str, runs_dir: str | Path, results_dir: str | Path, out: str | Path) -> Path:
    """:func:`e2_first_step` written to ``out`` atomically (an empty file where there is no setup to measure)."""
    from .store import write_text

    first = e2_first_step(scale, runs_dir, results_dir)
    write_text(Path(out), "" if first.empty else first.to_csv(index=False))
    return Path(out)


def read_e2_first_step(path: str | Path, scale: str) -> pd.DataFrame:
    """The table :func:`write_e2_first_step` wrote (floats read back exactly); ``FileNotFoundError`` naming the job
    that makes it when it is missing."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: the workflow's `early_spike` job makes it (`make book SCALE={scale}`); by hand, "
            f"after the E2 runs and `python -m companion aggregate`: `python -m companion early-spike --scale {scale} "
            f"--runs runs --results {path.parent} --out {path}`")
    return pd.read_csv(path, float_precision="round_trip") if path.stat().st_size else pd.DataFrame()
