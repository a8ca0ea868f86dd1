"""Learning-rate search over the paper's own grids, chosen on the validation split (``sec:app-optimiser``,
``sec:app-mlp-cifar10``).

The paper searched one learning rate per optimiser and fine-tuning method on the validation (dev) sets; at ``cpu``
scale we repeat that search for the CPU siblings with the same grids:

- prompt tuning (``*-pt``): SGD {0.1, 1, 10, 20, 50, 100}, iEF {1, 10, 50, 100}, EF and SF
  {1e-3, 5e-3, 1e-2, 1e-1, 1, 10} (normalised, linearly decaying);
- LoRA: AdamW {1e-3, 5e-4, 1e-4}, SGD and iEF as above, EF and SF {1e-3, 5e-3, 1e-2, 1e-1, 1};
- the MLP trained from scratch: Adam {5e-5, 1e-4, 5e-4}, SGD {0.01, 0.1, 0.5}, iEF {10, 50, 100},
  SF {0.01, 0.1, 0.5}, EF {1e-5, 1e-4, 1e-3, 1e-2, 1e-1}.

Optimisers the paper did not search for a method (Adafactor: used at its fixed published settings for prompt tuning,
not run at all for LoRA and the MLP; AdamW for prompt tuning and the MLP) get a grid marked ``ours``.

Choice: the highest best-validation score (:func:`~companion.experiments.metrics.score`, the mean of the split's
metrics) among the runs that did not diverge; ties go to the lower final training loss, then to the smaller learning
rate. Test metrics are recorded but never used. One seed (0) per learning rate: a small search. Searches of more
seeds or of other optimisers merge into the record (a rate's seeds are averaged for the choice).
"""
from __future__ import annotations

import datetime
import math
import os
import platform
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterable
from typing import Any

import torch

from . import store
from .metrics import score
from .aggregate import final_loss
from .runner import package_versions, run_dir, train
from .setups import OPTIMIZERS, SetupConfig, resolve
from .summaries import final_window

RECORDS = Path(__file__).with_name("lr_search")  # the recorded cpu-scale searches: cpu-<setup>.json
PAPER_PEFT = "paper: sec:app-optimiser"
PAPER_MLP = "paper: sec:app-mlp-cifar10"


@dataclass(frozen=True)
class Grid:
    """A learning-rate grid: ``paper`` (the paper's values, or ours where it ran no search) and ``extended`` (rates we
    added because the cpu search chose an edge of ``paper``: a search must bracket its optimum), with where
    each comes from. ``values``: all of them, ascending."""
    paper: tuple[float, ...]
    source: str
    extended: tuple[float, ...] = ()
    extension_source: str = ""

    @property
    def values(self) -> tuple[float, ...]:
        return tuple(sorted(set(self.paper) | set(self.extended)))

    def extend(self, values: tuple[float, ...], why: str) -> "Grid":
        return Grid(self.paper, self.source, tuple(sorted(set(self.extended) | set(values))), why)


def _edge(why: str) -> str:
    return f"ours, added because the cpu search chose {why} of the paper's grid: a search must bracket its optimum"


_PEFT_COMMON = {
    "sgd": Grid((0.1, 1.0, 10.0, 20.0, 50.0, 100.0), PAPER_PEFT),
    "ief": Grid((1.0, 10.0, 50.0, 100.0), PAPER_PEFT),
}
_IEF_BELOW = (0.03, 0.1, 0.3)  # iEF in ief's sum convention steps further per unit lr than the paper's token mean
GRIDS: dict[str, dict[str, Grid]] = {
    "pt": {
        **_PEFT_COMMON,
        "ief": _PEFT_COMMON["ief"].extend(_IEF_BELOW, _edge("iEF's smallest rate (1) on both tweets setups")),
        "ef": Grid((1e-3, 5e-3, 1e-2, 1e-1, 1.0, 10.0), PAPER_PEFT),
        "sf": Grid((1e-3, 5e-3, 1e-2, 1e-1, 1.0, 10.0), PAPER_PEFT + " (EF's grid: 'the same set of hyperparameters')"),
        "adafactor": Grid((0.03, 0.1, 0.3), "ours: the paper uses 0.3 unsearched (from the prompt-tuning paper); "
                                            "0.3 and two smaller values").extend(
            (3e-3, 1e-2), _edge("the smallest rate (0.03) on tweets-minilm-pt")),
        "adamw": Grid((1e-4, 1e-3, 1e-2, 3e-2), "ours: AdamW is not run for prompt tuning in the paper; the LoRA "
                                                "grid's 1e-4 and 1e-3 plus the larger rates prompts usually need"),
    },
    "lora": {
        **_PEFT_COMMON,
        "ief": _PEFT_COMMON["ief"].extend(_IEF_BELOW, _edge("iEF's smallest rate (1) on both tweets setups")),
        "adamw": Grid((1e-4, 5e-4, 1e-3), PAPER_PEFT).extend((3e-3, 1e-2), _edge("the largest rate (1e-3)")),
        "ef": Grid((1e-3, 5e-3, 1e-2, 1e-1, 1.0), PAPER_PEFT),
        "sf": Grid((1e-3, 5e-3, 1e-2, 1e-1, 1.0), PAPER_PEFT + " (EF's grid: 'the same strategy and hyperparameters')"
                   ).extend((3.0, 10.0), _edge("the largest rate (1)")),
        "adafactor": Grid((1e-4, 1e-3, 1e-2), "ours: Adafactor is not run for LoRA in the paper; AdamW's scale"
                          ).extend((3e-2, 1e-1), _edge("the largest rate (1e-2)")),
    },
    "scratch": {  # the MLP trained from scratch (SetupConfig.method)
        "adam": Grid((5e-5, 1e-4, 5e-4), PAPER_MLP).extend((1e-3, 5e-3, 1e-2, 2e-2, 5e-2),
                                                            _edge("the largest rate (5e-4)")),
        "sgd": Grid((0.01, 0.1, 0.5), PAPER_MLP).extend((1.0, 2.0, 5.0), _edge("the largest rate (0.5)")),
        "ief": Grid((10.0, 50.0, 100.0), PAPER_MLP).extend((0.3, 1.0, 3.0), _edge("the smallest rate (10)")),
        "sf": Grid((0.01, 0.1, 0.5), PAPER_MLP),
        "ef": Grid((1e-5, 1e-4, 1e-3, 1e-2, 1e-1), PAPER_MLP).extend((0.3, 1.0, 3.0, 10.0, 30.0),
                                                                    _edge("the largest rate (0.1)")),
        "adamw": Grid((5e-5, 1e-4, 5e-4), "ours: AdamW is not run for the MLP in the paper; Adam's grid").extend(
            (1e-3, 5e-3, 1e-2, 2e-2, 5e-2), _edge("the largest rate (5e-4), as Adam's")),
        "adafactor": Grid((1e-4, 1e-3, 1e-2), "ours: Adafactor is not run for the MLP in the paper; Adam's scale"
                          ).extend((3e-2, 1e-1), _edge("the largest rate (1e-2)")),
    },
}


# Beyond the paper: the practical optimisers get grids of ours. iEF + momentum + weight decay: iEF's own
# cpu grid (the exponential-average momentum keeps the rate's meaning); the K-FAC family: a decade either side of 0.1
_PRACTICAL_SOURCE = "ours: beyond the paper"
# (the MLP: iEF's whole grid, cheap there; the tweets setups: four rates around iEF's chosen 0.3 and 1); the K-FAC
# family with damping 1 (companion.experiments.setups): rates around the 0.01 a probe found to train
_PRACTICAL: dict[str, dict[str, Grid]] = {
    "scratch": {"ief-momentum": Grid(GRIDS["scratch"]["ief"].values, _PRACTICAL_SOURCE + "; iEF's grid here").extend(
        (0.03, 0.1), "ours, added because the cpu search chose the smallest rate (0.3) on digits-mlp: a search "
                     "must bracket its optimum")},
    "lora": {"ief-momentum": Grid((0.1, 0.3, 1.0, 3.0), _PRACTICAL_SOURCE + "; around iEF's chosen rates")},
    "pt": {"ief-momentum": Grid((0.1, 0.3, 1.0, 3.0), _PRACTICAL_SOURCE + "; around iEF's chosen rates")},
}
_PRACTICAL["scratch"].update({k: Grid((1e-3, 3e-3, 0.01, 0.03, 0.1), _PRACTICAL_SOURCE)
                              for k in ("kfac", "ekfac", "iekfac")})
_PRACTICAL["lora"].update({k: Grid((3e-3, 0.01, 0.03, 0.1), _PRACTICAL_SOURCE) for k in ("kfac", "ekfac", "iekfac")})
for _kind, _grids in _PRACTICAL.items():
    GRIDS[_kind].update(_grids)


def grid(cfg: SetupConfig, optimizer: str) -> Grid:
    """The learning-rate grid of ``optimizer`` for a resolved setup."""
    grids = GRIDS[cfg.method]  # the paper's grids are per fine-tuning method: pt, lora, scratch
    if optimizer not in grids or optimizer not in cfg.optimizers:
        valid = [o for o in OPTIMIZERS if o in grids and o in cfg.optimizers]
        raise ValueError(f"no learning-rate grid for optimizer {optimizer!r} on setup {cfg.name!r}; valid "
                         f"optimizers: {', '.join(valid)}")
    return grids[optimizer]


def choose(trials: list[dict[str, Any]]) -> float | None:
    """The chosen learning rate: best validation score among the non-diverged trials, then the lower final training
    loss, then the smaller rate; ``None`` when every trial diverged. With several seeds of one rate (merged searches),
    the rate's score and loss are the means over its seeds, and it counts as diverged when any seed diverged."""
    by_lr: dict[float, list[dict[str, Any]]] = {}
    for t in trials:
        by_lr.setdefault(t["lr"], []).append(t)
    ok = []
    for lr, ts in by_lr.items():
        if any(t["diverged"] or t["validation_score"] is None or not math.isfinite(t["validation_score"]) for t in ts):
            continue
        losses = [t["final_train_loss"] for t in ts]
        loss = math.inf if any(v is None for v in losses) else sum(losses) / len(losses)
        ok.append((-sum(t["validation_score"] for t in ts) / len(ts), loss, lr))
    return min(ok)[2] if ok else None


def trial_dir(out: str | Path, lr: float) -> Path:
    """Where the run of one learning rate goes: ``OUT/lr-search/lr=<lr>/`` (then the runner's own layout)."""
    return Path(out) / "lr-search" / f"lr={lr:g}"


def _trial(summary: dict[str, Any], lr: float, losses: list[float], made: float, ran_here: bool) -> dict[str, Any]:
    """One trial of a record. ``final_train_loss`` is the book's one definition (:mod:`.summaries`: the mean of the
    last 10 % of the updates, ``final_train_loss_updates`` of them), computed from ``train_losses``, the trial's
    per-update losses, which the record keeps so that the final loss can be recomputed from the record alone (the
    runner's ``summary.json`` averages a fixed 100 updates). ``created``: when the run finished (its summary's
    time, ``made``); ``commit``: the checkout's HEAD when the run finished in this call (``ran_here``), else ``None``
    (a finished run found on disk: which code made it is not known; the merge keeps an earlier record's value)."""
    best = summary["best_validation"]
    final = final_loss(losses)
    return {"lr": lr, "seed": summary["seed"], "final_train_loss": final if math.isfinite(final) else None,
            "final_train_loss_updates": final_window(len(losses)) if losses else 0, "train_losses": losses,
            "validation_score": best["score"], "validation": best["metrics"], "best_step": best["step"],
            "steps": summary["steps"], "diverged": summary["diverged"]["step"] if summary["diverged"] else None,
            "test": summary["test"], "wall_time_s": summary["wall_time_s"],
            "created": datetime.datetime.fromtimestamp(made, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "commit": git_commit() if ran_here else None}


def final_loss_definition(trial: dict[str, Any]) -> str:
    """In words, what a trial's ``final_train_loss`` averages: trials recorded before the record kept per-update
    losses hold the runner's mean of the last 100 updates (all of them in a run of at most 100 updates)."""
    if "final_train_loss_updates" in trial:
        return f"mean of the last {trial['final_train_loss_updates']} of {trial['steps']} updates (last 10 %)"
    n = min(100, trial["steps"])
    return f"mean of the last {n} of {trial['steps']} updates" + (" (all of them)" if n == trial["steps"] else "")


def _merge_trials(old: list[dict[str, Any]], new: list[dict[str, Any]], seed_of_old: int | None,
                  values: tuple[float, ...]) -> list[dict[str, Any]]:
    """``old`` trials with ``new`` ones added (a new trial replaces the old one of the same rate and seed), ordered
    by the grid's rate order, then seed. Trials of records from before per-trial seeds take the record's seed."""
    merged = {(t["lr"], t.get("seed", seed_of_old)): {**t, "seed": t.get("seed", seed_of_old)} for t in old}
    for t in new:  # a re-recorded trial keeps the commit an earlier record knew for it
        before = merged.get((t["lr"], t["seed"]), {})
        merged[(t["lr"], t["seed"])] = {**t, "commit": t.get("commit") or before.get("commit")}
    order = {v: i for i, v in enumerate(values)}
    return sorted(merged.values(), key=lambda t: (order.get(t["lr"], len(order)), t["lr"], t["seed"]))


def search(setup: str, scale: str = "cpu", out: str | Path = "runs", *, optimizers: list[str] | None = None,
           seed: int = 0, progress: bool = True, verbose: bool = True, wait_lock: bool = False,
           missing_only: bool = False) -> dict[str, Any]:
    """Run every learning rate of every optimiser's grid (finished runs are skipped, interrupted ones resume) and
    return the record: the grids, every trial's numbers, the chosen rates, and when (``created``, UTC), at which
    ``commit`` (``None`` outside git) and by which ``command`` it was written. Also written to
    ``OUT/lr-search/<scale>-<setup>.json``, merged with what is there: a search of other optimisers or another seed
    adds its trials (each trial names its ``seed``; ``seeds`` lists them) and the choices are made again over all
    of an optimiser's trials. ``wait_lock``: wait for a trial that another process is running (see
    :func:`~companion.experiments.runner.train`). ``missing_only``: run only the rates of each grid that ``OUT``'s
    record holds no trial of (at this seed) -- how a grid extended after a search is completed without re-running the
    rest."""
    cfg = resolve(setup, scale)
    names = list(optimizers) if optimizers else [o for o in OPTIMIZERS if o in cfg.optimizers]
    grids = {name: grid(cfg, name) for name in names}  # unknown names fail before anything runs
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    folder = Path(out) / "lr-search"
    path = folder / f"{scale}-{setup}.json"
    results: dict[str, list[dict[str, Any]]] = {}
    started = time.time()
    have: set[tuple[str, float]] = set()
    if missing_only and path.exists():
        for name, o in store.read_json(path).get("optimizers", {}).items():
            have |= {(name, t["lr"]) for t in o["trials"] if t.get("seed", seed) == seed}
    for name, g in grids.items():
        results[name] = []
        for lr in g.values:
            if (name, lr) in have:
                continue
            summary = train(setup, name, seed, scale, trial_dir(out, lr), lr=lr, progress=progress, verbose=verbose,
                            wait_lock=wait_lock)
            root = run_dir(trial_dir(out, lr), scale, setup, name, seed)
            losses = store.read_run(root)["losses"]
            made = (root / "summary.json").stat().st_mtime
            results[name].append(_trial(summary, lr, losses, made, made >= started))
    with store.lock(folder, wait=True, name=f"{scale}-{setup}.lock", what="search record"):
        store.remove_stale_temporaries(folder, owned=False, recursive=False)  # trials: their own
        old = store.read_json(path) if path.exists() else None
        if old is not None and (not isinstance(old, dict) or (old.get("setup"), old.get("scale")) != (setup, scale)):
            raise store.CorruptFile(f"{path} is not the search record of {setup!r} at {scale!r}: move it away")
        old_seed = old.get("seed") if old is not None else None
        old_seed = old_seed if isinstance(old_seed, int) else None
        record: dict[str, Any] = {
            "setup": setup, "scale": scale, "grid_kind": cfg.method,
            "selection": "highest best-validation score among non-diverged runs (several seeds of a rate: their "
                         "mean; any diverged: diverged); ties: lower final train loss, then smaller lr; test metrics "
                         "recorded, not used",
            "environment": {**package_versions(), "torch_threads": torch.get_num_threads(),
                            "machine": platform.machine(), "cpu_count": os.cpu_count(),
                            "device": "cuda" if torch.cuda.is_available() else "cpu"},
            "optimizers": {},
            # when, at which commit and by which call this version of the record was written (records made before
            # they carried these have none: their readers say so rather than guess)
            "created": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "commit": git_commit(),
            "command": search_command(setup, scale, optimizers, seed, missing_only),
        }
        for name, o in (old["optimizers"] if old is not None else {}).items():  # every trial names its seed
            record["optimizers"][name] = {**o, "trials": _merge_trials(o["trials"], [], old_seed, tuple(o["grid"]))}
        for name, g in grids.items():
            before = record["optimizers"].get(name, {}).get("trials", [])
            trials = _merge_trials(before, results[name], old_seed, g.values)
            chosen = choose(trials)
            base = cfg.optimizers[name]
            record["optimizers"][name] = {
                "grid": list(g.values), "grid_source": g.source, "grid_extended": list(g.extended),
                "extension_source": g.extension_source or None, "chosen_lr": chosen, "trials": trials,
                "fixed": {"damping": base.damping, "weight_decay": base.weight_decay, "schedule": base.schedule,
                          "milestones": list(base.milestones)},
            }
            if verbose:
                print(f"{setup}/{name}: chosen lr {chosen} from {list(g.values)}")
        seeds = sorted({t.get("seed", old_seed) for o in record["optimizers"].values() for t in o["trials"]}
                       - {None})
        record["seeds"] = seeds
        record["seed"] = seeds[0] if len(seeds) == 1 else None  # the one seed of a single-seed search
        store.write_json(path, record)
    return record


def git_commit(root: str | Path | None = None) -> str | None:
    """``git rev-parse HEAD`` of the repository holding this package (or ``root``): the commit a record was made at;
    ``None`` outside a git checkout (an installed package) or where git is missing."""
    root = Path(root) if root is not None else Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip() or None


def search_command(setup: str, scale: str, optimizers: list[str] | None, seed: int, missing_only: bool = False) -> str:
    """The command line that makes (or extends) a search record as :func:`search` was called."""
    chosen = "".join(f" --optimizer {name}" for name in optimizers or [])
    return f"python -m companion search --setup {setup} --scale {scale}{chosen} --seed {seed}" + (
        " --missing" if missing_only else "")


def edge(optimizer_record: dict[str, Any]) -> str | None:
    """``None`` when an optimiser's chosen rate is interior to its grid (a rate on each side of it was tried);
    otherwise a sentence naming the edge it chose."""
    grid_values = sorted(optimizer_record["grid"])
    chosen = optimizer_record["chosen_lr"]
    if chosen is None:
        return "every rate diverged"
    if grid_values[0] < chosen < grid_values[-1]:
        return None
    side = "smallest" if chosen == grid_values[0] else "largest"
    return f"chose the {side} rate of its grid ({chosen:g}): the optimum is not bracketed"


def restricted(record: dict[str, Any], optimizers: Iterable[str]) -> dict[str, Any]:
    """A copy of a search record holding only ``optimizers``' searches (the training chapter shows the paper's
    optimisers, the practical chapter its own; one record per setup holds both).

    Args:
        record: a search record (:func:`load_record`).
        optimizers: the optimiser names to keep (absent ones are ignored).

    Returns:
        The record with ``optimizers`` filtered; every other key as it is.
    """
    keep = set(optimizers)
    return {**record, "optimizers": {o: r for o, r in record["optimizers"].items() if o in keep}}


def record_path(setup: str, scale: str = "cpu") -> Path:
    return RECORDS / f"{scale}-{setup}.json"


def load_record(setup: str, scale: str = "cpu") -> dict[str, Any] | None:
    """The recorded search of a setup (shipped with the package), or ``None`` when there is none at that scale."""
    path = record_path(setup, scale)
    return store.read_json(path) if path.exists() else None


def search_table(record: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (optimiser, learning rate) of a record: the numbers the choice was made on (and the test score of
    the best-validation checkpoint, which the choice ignores)."""
    rows = []
    for name, o in record["optimizers"].items():
        for t in o["trials"]:
            rows.append({"optimizer": name, "lr": t["lr"], "chosen": t["lr"] == o["chosen_lr"],
                         "validation_score": t["validation_score"], "final_train_loss": t["final_train_loss"],
                         "final_train_loss_definition": final_loss_definition(t),
                         "test_score": score(t["test"]) if t["test"] else None,
                         "diverged_at_step": t["diverged"], "wall_time_s": t["wall_time_s"]})
    return rows
