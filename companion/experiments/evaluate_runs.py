"""Evaluation jobs: E1 (``fig:sample_gamma``), the block-diagonal study (``fig:sample_blockdiag_gamma``) and E3
(``fig:damping_gamma_*``) on the checkpoints of a setup's baseline run, as tidy CSV records.

The paper evaluates the checkpoints of its baseline optimiser's runs (``sec:eval_exp``): AdamW for LoRA, Adafactor
for prompt tuning, Adam for the MLP (:data:`companion.experiments.setups.BASELINE`). For every training stage (0 % = the
initial model ... 100 % = the last checkpoint) the job draws ``batches`` fixed batches of ``batch_size`` training
examples (the same batches at every stage) and records, per batch and method, ``gamma``, ``gamma / gamma_SGD`` and
the batch's gradient-norm imbalance (:func:`ief.evaluate`). At the first checkpoint after initialisation, the middle
and the last one it adds a damping sweep of EF / iEF / SF (:func:`ief.damping_sweep`).

Checkpoints (the contract with the runner): ``checkpoints/stage-PPP.pt`` in the run folder, ``PPP`` the percentage
of training, each the trainable state (``store.trainable_state``), ``stage-000.pt`` the initial model. Until a run
has them, its per-epoch checkpoints ``checkpoints/epoch-EEE.pt`` are used (stage ``round(100 E / epochs)``; the
epoch nearest to each of 25/50/75/100 %, so a 2-epoch run gives only 0/50/100 %) and stage 0 is the initial model
rebuilt exactly as the runner builds it (``seed_everything(seed)``, data, model); the ``source`` column says which.

Redoing work is Snakemake's decision alone (the workflow's ``evaluate_stage`` and ``evaluate`` rules depend on the
baseline run, the core and experiments code and the knobs, and Snakemake removes a job's outputs before it reruns it);
this module keeps no cache of its own. What it keeps is a *resume*: every stage's records go to
``OUT.parts/stage-PPP.csv`` as soon as they are computed, beside ``stage-PPP.json`` naming the job that wrote them
(:func:`job_key`: setup, scale, seed, optimiser, batches, batch size, damping, the sweep's dampings, CG steps, the
stage, its source, and the checkpoint file read with its size and modification time). A job reuses a part only when
that key is its own, i.e. when it is the same job resumed after an interruption (or a duplicate of it: a SLURM
requeue, a second terminal); a part any other job wrote (other knobs, a checkpoint written since) is computed again
and replaced. Each stage is computed under a lock (``OUT.parts/stage-PPP.lock``), so a duplicate running at the same
time waits and then reuses the part instead of computing it twice. There is no fingerprint of the package's code or of
checkpoint bytes and no "up to date" skip: a call without ``stages`` always writes ``OUT`` (atomically, last) from the
parts, computing those it lacks. By hand, after a change of the code, remove ``OUT.parts`` (or use another ``OUT``).

The evaluation seed and the knobs per scale (batches, batch size, CG steps, the sweep's dampings, the setups that get
E3) are the grid's (:data:`companion.experiments.setups.EVALUATION_SEED`,
:data:`~companion.experiments.setups.EVALUATION_KNOBS`); the workflow states them on each job's command line, and they
are this module's defaults.

Damping (the axis-conversion point, :data:`DAMPING_CONVENTION`): every damping here is in the package's convention,
the sum loss ``L = sum_n l_n``. The paper's code uses the mean over the batch's ``K`` target tokens, so
``lambda_paper = lambda_ief / K^2``; each record carries ``target_tokens`` = ``K`` (:func:`ief.count_targets`) so the
conversion can be applied when plotting (:func:`companion.chapters.evaluation.damping_axis`).
"""
from __future__ import annotations

import csv
import io
import json
import math
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ief import batch_generator, check_linear_only, count_targets, damping_sweep, DegenerateIndicator, evaluate_batch
from . import store
from .runner import recorded_overrides, run_dir, seed_everything
from .setups import BASELINE, evaluation_knobs, resolve
from .setups import baseline_optimizer  # noqa: F401  (read from here: notebooks/evaluation.ipynb, tests)

STAGES = (0, 25, 50, 75, 100)  # the runner's stage checkpoints (percent of training)
E1_METHODS = ("sgd", "ef", "ief", "sf", "hf")
BLOCK_METHODS = ("kfac", "ekfac", "iekfac")
DAMPING_CONVENTION = "ief"  # dampings are stored in the sum-loss convention; see the module docstring


def sweep_grid(n: int) -> tuple[float, ...]:
    """``n`` dampings log-spaced over ``1e-10 .. 1e2`` (the package's sum-loss convention), E3's axis."""
    if n < 1:
        raise ValueError(f"the damping sweep needs at least 1 damping, got {n}")
    return tuple(float(x) for x in np.logspace(-10, 2, n))


COLUMNS = ("setup", "scale", "seed", "optimizer", "stage", "source", "kind", "batch", "method", "damping", "gamma",
           "ratio", "imbalance", "target_tokens")
_STAGE = re.compile(r"stage-(\d{3})\.pt$")
_EPOCH = re.compile(r"epoch-(\d{3})\.pt$")


def stage_checkpoints(run_root: Path) -> dict[int, Path]:
    """``{stage percentage: checkpoint}`` of ``checkpoints/stage-PPP.pt`` (the runner's stage checkpoints)."""
    found = {}
    for path in sorted((Path(run_root) / "checkpoints").glob("stage-*.pt")):
        match = _STAGE.search(path.name)
        if match:
            found[int(match.group(1))] = path
    return found


def _checkpoints(run_root: Path, epochs: int) -> dict[int, tuple[str, Path | None]]:
    """``{stage: (source, path)}``: stage files if present, else epoch checkpoints + the rebuilt initial model."""
    reader = getattr(store, "stage_checkpoints", stage_checkpoints)
    stages = reader(run_root)
    if stages:
        return {s: ("stage", p) for s, p in sorted(stages.items())}
    by_stage: dict[int, Path] = {}
    for path in sorted((Path(run_root) / "checkpoints").glob("epoch-*.pt")):
        match = _EPOCH.search(path.name)
        if match:
            by_stage[round(100 * int(match.group(1)) / epochs)] = path
    # the epoch nearest to each of the runner's stages (25/50/75/100 % of 20 epochs: epochs 5/10/15/20)
    out: dict[int, tuple[str, Path | None]] = {0: ("initial", None)}
    for target in STAGES[1:]:
        if by_stage:
            nearest = min(by_stage, key=lambda s: (abs(s - target), -s))
            out[nearest] = ("epoch", by_stage[nearest])
    return dict(sorted(out.items()))


def sweep_stages(stages: Sequence[int]) -> list[int]:
    """E3's first, middle and last checkpoint: the first after initialisation, the middle one and the last."""
    trained = [s for s in sorted(stages) if s > 0] or sorted(stages)
    picks = [trained[0], trained[(len(trained) - 1) // 2], trained[-1]]
    return sorted(set(picks))


def job_key(params: dict[str, Any], stage: int, source: str, checkpoint: Path | None, sweep: bool) -> dict[str, Any]:
    """What identifies the job that computes one stage: its parameters, the stage, its source, whether it sweeps, and
    the checkpoint file it reads (its name in the run folder, size and modification time; ``None``: the rebuilt initial
    model). A part is reused only by a job with the same key (a resume; see the module docstring). The name, not the
    absolute path: a cluster's nodes may mount the runs at different paths. Returned as JSON would read it back."""
    ck = None
    if checkpoint is not None:
        path = Path(checkpoint)
        st = path.stat()
        ck = {"file": f"{path.parent.name}/{path.name}", "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}
    return json.loads(json.dumps({**params, "stage": stage, "source": source, "sweep": sweep, "checkpoint": ck}))


def _csv_text(records: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    for r in records:
        writer.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in COLUMNS})
    return buf.getvalue()


def read_records(path: Path) -> list[dict[str, Any]]:
    """A job's CSV back as records (numbers as floats/ints, empty cells as ``None``)."""
    out = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            rec: dict[str, Any] = {}
            for k, v in row.items():
                if v == "":
                    rec[k] = None
                elif k in ("seed", "stage", "batch", "target_tokens"):
                    rec[k] = int(v)
                elif k in ("damping", "gamma", "ratio", "imbalance"):
                    rec[k] = float(v)
                else:
                    rec[k] = v
            out.append(rec)
    return out


def evaluate_run(
    setup: str,
    scale: str,
    seed: int,
    runs_dir: str | Path,
    out: str | Path,
    *,
    batches: int | None = None,
    batch_size: int | None = None,
    damping: float | None = None,
    sweep_dampings: Sequence[float] | None = None,
    cg_iterations: int | None = None,
    sweep: bool | None = None,
    stages: Sequence[int] | None = None,
    progress: bool = True,
) -> Path:
    """Evaluate the baseline run of ``setup`` at every stage and write ``out`` (CSV); returns its path.

    Args:
        setup, scale, seed: the run evaluated: the baseline optimiser's (:func:`~.setups.baseline_optimizer`).
        runs_dir: where the runs are (``python -m companion train --out``).
        out: the CSV written; the stages' parts go to ``OUT.parts/``.
        batches, batch_size, cg_iterations: default the scale's knobs (:data:`~.setups.EVALUATION_KNOBS`; batch size
            ``None`` there: the run's training batch size).
        damping: used by every method of E1 and the block-diagonal study; default the setup's iEF damping (the
            paper's near-zero value).
        sweep_dampings: E3's dampings; default the scale's number of them over ``1e-10 .. 1e2`` (:func:`sweep_grid`).
        sweep: whether to run E3 (at the first, middle and last stage); default whether the scale's knobs give the
            setup E3 (``sweep_setups``).
        stages: e.g. ``[50]``: compute only those stages' parts and return the parts folder without writing ``out``
            (the workflow's one job per checkpoint; a call without ``stages`` then assembles ``out`` from them).
        progress: a line per stage computed.

    Returns:
        ``out``, or the parts folder when ``stages`` is given.

    Raises:
        FileNotFoundError: the run, or its checkpoints, do not exist (the message names the command that trains it).
        ValueError: an unknown setup or scale, ``batches`` or ``batch_size`` < 1, or ``stages`` not among the run's
            checkpoints.

    The block-diagonal methods run when every trainable parameter belongs to an ``nn.Linear`` (LoRA, MLP); for
    prompt tuning they are left out, with a note on stderr. A part already written by this same job (same
    :func:`job_key`) is reused: the resume of an interrupted job (module docstring).
    """
    cfg = resolve(setup, scale)
    optimizer = BASELINE[cfg.method]
    root = run_dir(runs_dir, scale, setup, optimizer, seed)
    if not (root / "config.json").exists():
        raise FileNotFoundError(f"no {optimizer} run of {setup} [{scale}] seed {seed} under {runs_dir} ({root}): "
                                f"the evaluation reads the checkpoints of the setup's baseline optimiser, {optimizer} "
                                f"(as the paper evaluates the approximations along a baseline's trajectory), not "
                                f"those of an ief/ef/sf run; train it first: python -m companion train --setup "
                                f"{setup} --scale {scale} --optimizer {optimizer} --seed {seed} --out {runs_dir}")
    cfg = resolve(setup, scale, recorded_overrides(root, setup, scale))  # the run as trained (its --set included)
    knobs = evaluation_knobs(setup, scale)
    n_batches = batches if batches is not None else knobs["batches"]
    m = batch_size if batch_size is not None else (knobs["batch_size"] or cfg.batch_size)
    if n_batches < 1 or m < 1:
        raise ValueError(f"batches and batch_size must be >= 1, got {n_batches} and {m}")
    lam = float(damping if damping is not None else cfg.optimizers["ief"].damping)
    cg = cg_iterations if cg_iterations is not None else knobs["cg_iterations"]
    sweep = knobs["sweep"] if sweep is None else sweep
    if sweep_dampings is None:
        sweep_dampings = sweep_grid(knobs["sweep_dampings"])
    only = stages
    stages = _checkpoints(root, cfg.epochs)
    if len(stages) < 2:
        raise FileNotFoundError(f"{root} has no checkpoints (checkpoints/stage-*.pt or epoch-*.pt): is it trained?")
    if only is not None:
        only = sorted({int(s) for s in only})
        unknown = [s for s in only if s not in stages]
        if not only or unknown:
            raise ValueError(f"stages {unknown or only!r} not among the run's checkpoints; choose from "
                             f"{sorted(stages)} (percent of training)")
    out = Path(out)
    parts = out.with_name(out.name + ".parts")
    params = {"setup": setup, "scale": scale, "seed": seed, "optimizer": optimizer, "batches": n_batches,
              "batch_size": m, "damping": lam, "sweep_dampings": list(sweep_dampings) if sweep else None, "cg": cg}
    sweep_at = sweep_stages(list(stages)) if sweep else []
    common = {"setup": setup, "scale": scale, "seed": seed, "optimizer": optimizer}
    inputs = None  # the model and the fixed batches: built only when some stage has to be computed
    all_records: list[dict[str, Any]] = []
    for stage, (source, path) in stages.items():
        if only is not None and stage not in only:
            continue
        part, part_json = parts / f"stage-{stage:03d}.csv", parts / f"stage-{stage:03d}.json"
        key = job_key(params, stage, source, path, stage in sweep_at)
        # one job per stage at a time: a duplicate (a requeue) waits here, then resumes from the part written
        with store.lock(parts, wait=True, name=f"stage-{stage:03d}.lock", what="evaluation of this stage"):
            if part.exists() and part_json.exists() and store.read_json(part_json).get("job") == key:
                all_records += read_records(part)
                continue
            if inputs is None:
                inputs = _evaluation_inputs(cfg, setup, seed, m, n_batches, progress)
            model, initial, fixed, methods = inputs
            t0, c0 = time.time(), time.process_time()
            store.load_trainable(model, initial if path is None else store.read_torch(path))
            extra = {**common, "stage": stage, "source": source, "kind": "e1"}
            records, sweeps = [], []
            for b, (x, targets) in enumerate(fixed):
                # one logit Jacobian J_z per batch (ief.logit_space) serves every method's gamma, CG and the sweep
                e1, lj = evaluate_batch(model, x, targets, methods, lam, cg_iterations=cg,
                                        generator=batch_generator(seed * 7919 + b, 0), extra={**extra, "batch": b})
                records += [{**r, "target_tokens": count_targets(targets)} for r in e1]
                if stage in sweep_at:
                    try:
                        swept = damping_sweep(model, x, targets, sweep_dampings, logit_space=lj,
                                              generator=batch_generator(seed * 7919 + b, 0))
                    except DegenerateIndicator as err:
                        raise DegenerateIndicator(f"setup {setup}, stage {stage}, batch {b}: {err}") from err
                    for r in swept:
                        sweeps.append({**common, "stage": stage, "source": source, "kind": "sweep", "batch": b,
                                       "imbalance": None, "target_tokens": count_targets(targets), **r})
            records += sweeps
            store.write_text(part, _csv_text(records))
            store.write_json(part_json, {"job": key, "seconds": time.time() - t0,
                                         "cpu_seconds": time.process_time() - c0})
        if progress:
            print(f"{setup} [{scale}] stage {stage:3d}% ({source}): {len(records)} records in "
                  f"{time.time() - t0:.1f}s ({time.process_time() - c0:.1f}s of CPU)", flush=True)
        all_records += records
    if only is not None:
        return parts
    store.write_text(out, _csv_text(all_records))
    return out


def _evaluation_inputs(cfg, setup: str, seed: int, m: int, n_batches: int, progress: bool):
    """The run's initial model (eval mode), its initial trainable state, the fixed batches and the methods."""
    from .data import load_data
    from .models import build_model
    from .tasks import make_task

    seed_everything(seed)  # as the runner: the initial model is the run's own
    data = load_data(cfg)
    model, pre = build_model(cfg, data)
    task = make_task(cfg, model, pre)
    initial = store.trainable_state(model)
    model.eval()  # dropout off: every pass of one evaluation sees the same function
    rng = np.random.default_rng([seed, 12])
    chosen = [rng.choice(len(data.train), size=min(m, len(data.train)), replace=False) for _ in range(n_batches)]
    fixed = [task.collate([data.train[int(i)] for i in idx]) for idx in chosen]
    methods = list(E1_METHODS)
    try:
        check_linear_only(model)
        methods += list(BLOCK_METHODS)
    except ValueError as err:
        if progress:
            print(f"{setup}: block-diagonal methods left out ({err})")
    return model, initial, fixed, methods


def summarise(records: list[dict[str, Any]], kind: str = "e1") -> dict[tuple, dict[str, float]]:
    """``{(setup, stage, method): {"mean", "sd", "n"}}`` of ``ratio`` over batches (finite ``kind`` records)."""
    groups: dict[tuple, list[float]] = {}
    for r in records:
        if r["kind"] == kind and usable(r["ratio"]):
            groups.setdefault((r["setup"], r["stage"], r["method"]), []).append(r["ratio"])
    return {k: {"mean": float(np.mean(v)), "sd": float(np.std(v)), "n": len(v)} for k, v in groups.items()}



def summary_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chapter's tidy summary: one row per (setup, stage, method) of the E1 records, with the mean and sd over
    batches of ``gamma / gamma_SGD``, the number of batches ``n`` and the mean and sd of the batches' imbalance."""
    ratios: dict[tuple, list[float]] = {}
    imbalances: dict[tuple, list[float]] = {}
    for r in records:
        if r["kind"] != "e1":
            continue
        key = (r["setup"], r["stage"], r["method"])
        if usable(r["ratio"]):
            ratios.setdefault(key, []).append(r["ratio"])
        if r["imbalance"] is not None and math.isfinite(r["imbalance"]):
            imbalances.setdefault(key, []).append(r["imbalance"])
    order = {s: i for i, s in enumerate(dict.fromkeys(r["setup"] for r in records))}
    rows = []
    for key in sorted(ratios, key=lambda k: (order[k[0]], k[1])):
        imb = imbalances.get(key, [])
        rows.append({"setup": key[0], "stage": key[1], "method": key[2], "mean": float(np.mean(ratios[key])),
                     "sd": float(np.std(ratios[key])), "n": len(ratios[key]),
                     "imbalance_mean": float(np.mean(imb)) if imb else None,
                     "imbalance_sd": float(np.std(imb)) if imb else None})
    return rows

def _stage_means(records: list[dict[str, Any]], setup: str) -> dict[int, dict[str, float]]:
    """``{stage: {method: mean gamma/gamma_SGD, "imbalance": mean}}`` of a setup's E1 records."""
    out: dict[int, dict[str, list[float]]] = {}
    for r in records:
        if r["setup"] == setup and r["kind"] == "e1" and usable(r["ratio"]):
            out.setdefault(r["stage"], {}).setdefault(r["method"], []).append(r["ratio"])
            if r["method"] == "sgd" and r["imbalance"] is not None and math.isfinite(r["imbalance"]):
                out[r["stage"]].setdefault("imbalance", []).append(r["imbalance"])
    return {s: {m: float(np.mean(v)) for m, v in d.items()} for s, d in sorted(out.items())}


def _quotient(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator`` when both are finite and the denominator is > 0 (ratios of gammas are positive),
    else ``None``: :func:`findings` never divides by a value it did not check."""
    if numerator is None or denominator is None or not (math.isfinite(numerator) and math.isfinite(denominator)):
        return None
    return numerator / denominator if denominator > 0 else None


def usable(value: Any) -> bool:
    """A record's ratio that a finding may use: a finite number > 0 (the library records no other; older CSVs may)."""
    return value is not None and math.isfinite(value) and value > 0


def findings(records: list[dict[str, Any]], near_zero: float = 1e-6) -> dict[str, dict[str, Any]]:
    """The paper's findings (``sec:eval_exp``, ``sec:exp-damping``, ``sec:app-iEF-eNGDopt``) measured per setup.

    Fractions are over training stages, on the mean over batches of ``gamma / gamma_SGD``:

    - ``ef_worse_than_sgd``: EF/SGD > 1; ``ief_better_than_sgd``: iEF/SGD < 1;
    - ``ief_sf_ef_order``: gamma_iEF < gamma_SF < gamma_EF; ``ief_best_of_three``: iEF below both;
    - ``imbalance_growth``: mean imbalance at the last stage / at the first; ``imbalance_ef_correlation`` and
      ``imbalance_sf_correlation``: Pearson correlation over stages of log imbalance with log EF/SGD (SF/SGD);
    - E3 (sweep stages): ``ief_near_zero_spread``: the largest, over stages, max/min of iEF's ratio over the
      dampings <= ``near_zero`` (1: insensitive); ``ef_best_damping`` / ``sf_best_damping``: the damping of the
      lowest ratio at each sweep stage; ``ief_over_best_sf``: iEF at its smallest damping / SF at its best, per stage;
      ``ief_over_best_ef``: the same for EF;
    - block-diagonal: ``iekfac_beats_kfac_and_ekfac``: ieKFAC below both; ``iekfac_over_ief``: median ratio.
    """
    out: dict[str, dict[str, Any]] = {}
    for setup in dict.fromkeys(r["setup"] for r in records):
        means = _stage_means(records, setup)
        stages = list(means)
        f: dict[str, Any] = {"stages": stages}

        def frac(pred) -> float | None:
            usable = [s for s in stages if pred(means[s]) is not None]
            return float(np.mean([bool(pred(means[s])) for s in usable])) if usable else None

        def need(*ms):
            return lambda d, ms=ms: None if any(m not in d for m in ms) else True

        f["ef_worse_than_sgd"] = frac(lambda d: None if "ef" not in d else d["ef"] > 1)
        f["ief_better_than_sgd"] = frac(lambda d: None if "ief" not in d else d["ief"] < 1)
        f["ief_sf_ef_order"] = frac(lambda d: need("ief", "sf", "ef")(d) and d["ief"] < d["sf"] < d["ef"])
        f["ief_best_of_three"] = frac(lambda d: need("ief", "sf", "ef")(d) and d["ief"] < min(d["sf"], d["ef"]))
        imb = [means[s].get("imbalance") for s in stages]
        f["imbalance_growth"] = _quotient(imb[-1], imb[0]) if imb else None
        for m in ("ef", "sf"):
            pairs = [(math.log(means[s]["imbalance"]), math.log(means[s][m])) for s in stages
                     if usable(means[s].get("imbalance")) and usable(means[s].get(m))]
            f[f"imbalance_{m}_correlation"] = (float(np.corrcoef(np.array(pairs).T)[0, 1])
                                               if len(pairs) >= 3 else None)
        f["iekfac_beats_kfac_and_ekfac"] = frac(
            lambda d: need("iekfac", "kfac", "ekfac")(d) and d["iekfac"] < min(d["kfac"], d["ekfac"]))
        ratios = [q for s in stages if (q := _quotient(means[s].get("iekfac"), means[s].get("ief"))) is not None]
        f["iekfac_over_ief"] = float(np.median(ratios)) if ratios else None
        sweep: dict[tuple[int, str, float], list[float]] = {}
        for r in records:
            if r["setup"] == setup and r["kind"] == "sweep" and r["damping"] is not None and usable(r["ratio"]):
                sweep.setdefault((r["stage"], r["method"], r["damping"]), []).append(r["ratio"])
        curve = {k: float(np.mean(v)) for k, v in sweep.items()}
        sweep_stages_ = sorted({k[0] for k in curve})
        f["sweep_stages"] = sweep_stages_
        spreads, best, vs_sf, vs_ef = [], {"ef": [], "sf": []}, [], []
        for s in sweep_stages_:
            ief = {lam: v for (st, m, lam), v in curve.items() if st == s and m == "ief"}
            small = [v for lam, v in ief.items() if lam <= near_zero]
            if small:
                spreads.append(_quotient(max(small), min(small)))
            for m in ("ef", "sf"):
                pts = {lam: v for (st, mm, lam), v in curve.items() if st == s and mm == m}
                if pts:
                    best[m].append(min(pts, key=pts.get))
            if ief:
                lowest = ief[min(ief)]
                sf_pts = [v for (st, m, _), v in curve.items() if st == s and m == "sf"]
                ef_pts = [v for (st, m, _), v in curve.items() if st == s and m == "ef"]
                vs_sf.append(_quotient(lowest, min(sf_pts)) if sf_pts else None)
                vs_ef.append(_quotient(lowest, min(ef_pts)) if ef_pts else None)
        spreads = [x for x in spreads if x is not None]
        f["ief_near_zero_spread"] = max(spreads) if spreads else None
        f["ef_best_damping"] = best["ef"]
        f["sf_best_damping"] = best["sf"]
        f["ief_over_best_sf"] = vs_sf
        f["ief_over_best_ef"] = vs_ef
        out[setup] = f
    return out
