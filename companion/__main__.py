"""Command line: ``python -m companion describe ...`` and ``python -m companion train ...`` (see
:mod:`companion.experiments`).

Exit codes: 0 done (or skipped: finished), 2 bad input or an unreadable run file (an ``error:`` line naming the value
or the file, nothing written; every number an option takes is checked when the arguments are parsed, see the
argument types below), 1 missing data or weights, 75 the run is being run by another process (try again
later, or pass ``--wait-lock``), 128 + N interrupted by signal N (SIGINT 130, SIGTERM 143, SIGHUP 129: the run
stopped after its current update and saved ``resume.pt``; run the same command to resume), 3 stopped at once by a
second signal (nothing saved after the last ``resume.pt``, which stays valid; resume from it). The two stops differ
so that a script or a scheduler can tell a run that saved its place from one that did not.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

EXIT_LOCKED = 75  # EX_TEMPFAIL: another process owns the run folder; try again later
EXIT_STOPPED_AT_ONCE = 3  # a second signal stopped the run at once (no 128 + N: that is the saved, interrupted run)
SEED_LIMIT = 2 ** 32  # numpy's legacy seeding (runner) takes 0 <= seed < 2**32


# ------------------------------------------------------------------------------------------- argument types
# argparse ``type=`` functions: a bad value stops the parse with the usage line and one line
# ``error: argument --OPT: invalid value 'V': <what is accepted> expected`` (exit 2), before anything is imported,
# created or written.
def _reject(text: str, accepted: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(f"invalid value {text!r}: {accepted} expected")


def _integer(text: str, low: int, high: int | None, accepted: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise _reject(text, accepted) from None
    if value < low or (high is not None and value > high):
        raise _reject(text, accepted)
    return value


def positive_int(text: str) -> int:
    """A whole number >= 1 (counts: batches, repeats, CG iterations, dampings)."""
    return _integer(text, 1, None, "an integer >= 1")


def run_seed(text: str) -> int:
    """A run's seed: a whole number 0 .. 2**32 - 1 (what numpy's seeding takes)."""
    return _integer(text, 0, SEED_LIMIT - 1, f"an integer from 0 to {SEED_LIMIT - 1}")


def run_seeds(text: str) -> list[int]:
    """Several runs' seeds: comma-separated seeds and inclusive ranges, e.g. ``0-59`` or ``0,1,5-7`` (in that order,
    each once)."""
    accepted = f"comma-separated seeds or ranges A-B (0 .. {SEED_LIMIT - 1}, each once; e.g. 0-59 or 0,1,5-7)"
    seeds: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        first, dash, last = part.partition("-")
        try:
            low = run_seed(first)
            seeds.extend(range(low, run_seed(last) + 1) if dash else [low])
        except argparse.ArgumentTypeError:
            raise _reject(text, accepted) from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise _reject(text, accepted)
    return seeds


def percent(text: str) -> int:
    """A stage: a whole percentage of training, 0 .. 100."""
    return _integer(text, 0, 100, "an integer percentage from 0 to 100")


def percents(text: str) -> list[int]:
    """Comma-separated stages, e.g. ``0,50,100`` (at least one; each 0 .. 100)."""
    accepted = "comma-separated integer percentages from 0 to 100 (e.g. 0,50,100)"
    parts = [p for p in text.split(",") if p.strip()]
    if not parts:
        raise _reject(text, accepted)
    try:
        return [percent(p) for p in parts]
    except argparse.ArgumentTypeError:
        raise _reject(text, accepted) from None


def positive_float(text: str) -> float:
    """A finite number > 0 (a learning rate)."""
    try:
        value = float(text)
    except ValueError:
        raise _reject(text, "a finite number > 0") from None
    if not (math.isfinite(value) and value > 0):
        raise _reject(text, "a finite number > 0")
    return value


def positive_seconds(text: str) -> float:
    """A finite number of seconds > 0 (checkpoint and log intervals: 0 or less would act at every update, nan or
    inf never)."""
    try:
        value = float(text)
    except ValueError:
        raise _reject(text, "a finite number of seconds > 0") from None
    if not (math.isfinite(value) and value > 0):
        raise _reject(text, "a finite number of seconds > 0")
    return value


def folder(text: str) -> str:
    """A folder to write into, existing or new: neither it nor any existing folder above it may be a file."""
    path = Path(text)
    for above in (path, *path.parents):
        if above.exists() or above.is_symlink():
            if not above.is_dir():
                what = "an existing file" if above == path else f"under the file {str(above)!r}"
                raise argparse.ArgumentTypeError(f"invalid value {text!r}: {what}; a folder (existing or new) "
                                                 "expected")
            break
    return text


def precision(text: str) -> str:
    """A forward precision: float32, bfloat16 or bf16 (recorded as ``"float32"`` / ``"bfloat16"``); float16 refused
    with the library's reason (:func:`companion.experiments.precision.check_precision`)."""
    from .experiments.precision import ACCEPTED, FLOAT16_NAMES, check_precision

    try:
        return check_precision(text)
    except ValueError as err:
        if text.strip().lower() in FLOAT16_NAMES:
            raise argparse.ArgumentTypeError(str(err)) from None
        raise _reject(text, ACCEPTED) from None


def setting(text: str) -> str:
    """``KEY=VALUE`` with VALUE JSON (or plain text); a JSON NaN or Infinity anywhere in VALUE is refused."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise _reject(text, "KEY=VALUE (a setup field, VALUE as JSON)")

    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        return text  # plain text, as _value reads it

    def finite(x: Any) -> bool:
        if isinstance(x, float):
            return math.isfinite(x)
        if isinstance(x, list):
            return all(map(finite, x))
        return all(map(finite, x.values())) if isinstance(x, dict) else True

    if not finite(parsed):
        raise _reject(text, "KEY=VALUE with finite numbers (no NaN or Infinity)")
    return text


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _overrides(items: list[str]) -> dict[str, Any] | None:
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set takes KEY=VALUE (a setup field, VALUE as JSON), got {item!r}")
        out[key] = _value(value)
    return out or None


def parser() -> argparse.ArgumentParser:
    from .experiments import OPTIMIZERS, SCALES, SETUPS
    from .experiments.step_cost import MLP_REPEAT_FACTOR

    p = argparse.ArgumentParser(prog="python -m companion", description="Experiments of the iEF paper (sec:exp).")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("describe", help="print a resolved setup: data sizes, hyperparameters, parameter counts")
    t = sub.add_parser("train", help="train one run, or several seeds (resumes an interrupted run, skips a finished "
                       "one)")
    r = sub.add_parser("search", help="learning-rate search over the paper's grids, chosen on validation")
    sub.add_parser("list", help="list the setups, their scales and the optimisers")
    _add_evaluate_parser(sub)
    from .experiments.asset_folder import add_parser as add_assets_parser

    add_assets_parser(sub)
    p.add_argument("--assets", default=None, metavar="DIR",
                   help="read every hub model and data set from this assets folder, never the network "
                   "(as IEF_ASSETS=DIR; python -m companion assets download makes it)")
    v = sub.add_parser("verdicts", help="every verdict the book prints, as data: DIR/verdicts.csv (claim, setup, "
                       "verdict, statistic, interval, evidence, what would decide it)")
    v.add_argument("--scale", required=True, metavar="X", help="one of: " + ", ".join(SCALES))
    v.add_argument("--results", required=True, metavar="DIR", help="the workflow's tables of this scale (e2_runs.csv, "
                   "eval/*.csv); verdicts.csv is written there")
    v.add_argument("--runs", default="runs", metavar="RUNS", help="the runs folder, read where DIR has no E2 tables")
    f = sub.add_parser("backfill", help="for finished runs made before the runner recorded them: per-example test "
                       "predictions (test_predictions.csv, from best.pt) and the full training-set final loss "
                       "(final_train_loss_full in summary.json, from stage-100.pt); inference only")
    f.add_argument("--scale", required=True, metavar="X", help="one of: " + ", ".join(SCALES))
    f.add_argument("--runs", required=True, metavar="RUNS", help="the runs folder (RUNS/<scale>/<setup>/...)")
    a = sub.add_parser("aggregate", help="gather finished runs into DIR/e2_runs.csv and DIR/e2_curves.csv (E2)")
    a.add_argument("--scale", required=True, metavar="X", help="one of: " + ", ".join(SCALES))
    a.add_argument("--runs", required=True, metavar="RUNS", help="the runs folder (RUNS/<scale>/<setup>/...)")
    a.add_argument("--out", required=True, type=folder, metavar="DIR", help="where the two CSV files go")
    c = sub.add_parser("step-costs", help="seconds per update of the practical comparison's optimisers, measured "
                       "side by side, to a CSV (chapter practical.ipynb, 'Cost per update')")
    c.add_argument("--scale", required=True, metavar="X", help="one of: " + ", ".join(SCALES))
    c.add_argument("--setup", action="append", default=[], metavar="S",
                   help="time this setup (repeatable; default: every setup of the scale's grid)")
    c.add_argument("--repeats", type=positive_int, default=5, metavar="N",
                   help=f"timed updates per optimiser after one warm-up (an MLP's: {MLP_REPEAT_FACTOR} N; default 5)")
    c.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    c.add_argument("--out", required=True, metavar="OUT.csv", help="the table (written atomically)")
    w = sub.add_parser("compression", help="the compression study: one-shot pruning of the digits-mlp baseline with "
                       "every WoodFisher curvature, to DIR/pruning_results.csv, pruning_costs.csv, study.json "
                       "(chapter compression.ipynb)")
    w.add_argument("--scale", required=True, metavar="X", help="the book's scale: smoke, cpu or full (full prunes "
                   "the cpu baseline)")
    w.add_argument("--runs", default="runs", metavar="RUNS",
                   help="the runs folder: the baseline run is read there (trained there first if missing)")
    w.add_argument("--seed", type=run_seed, default=0, help="the baseline run's seed and the draws' seed")
    w.add_argument("--out", required=True, type=folder, metavar="DIR",
                   help="where the tables go (each written atomically)")
    k = sub.add_parser("early-spike", help="iEF's first update on the MLP from scratch redone for the E2 runs' "
                       "seeds and rates, to a CSV (chapter optimisation.ipynb)")
    k.add_argument("--scale", required=True, metavar="X", help="one of: " + ", ".join(SCALES))
    k.add_argument("--runs", default="runs", metavar="RUNS", help="the runs folder (their recorded setup overrides)")
    k.add_argument("--results", required=True, metavar="DIR",
                   help="the aggregated E2 tables (python -m companion aggregate --out DIR)")
    k.add_argument("--out", required=True, metavar="OUT.csv", help="the table (written atomically)")
    b = sub.add_parser("blockdiag-check", help="the block-diagonal study's dense float64 check at one stage "
                       "checkpoint of the baseline runs, to a CSV and its glue to OUT.json (chapter evaluation.ipynb)")
    b.add_argument("--scale", required=True, metavar="X", help="one of: " + ", ".join(SCALES))
    b.add_argument("--runs", default="runs", metavar="RUNS", help="the runs folder: the baseline runs' checkpoints")
    b.add_argument("--results", required=True, metavar="DIR",
                   help="the evaluation tables DIR/eval/<setup>.csv (python -m companion evaluate)")
    b.add_argument("--seed", type=run_seed, default=None,
                   help="the evaluated runs' seed (default: the grid's evaluation seed)")
    b.add_argument("--stage", type=percent, default=None,
                   help="the stage checkpoint, percent of training (default: the chapter's, 50)")
    b.add_argument("--out", required=True, metavar="OUT.csv", help="the table; its glue goes to OUT.json (each "
                   "written atomically)")
    for q in (d, t, r):
        q.add_argument("--setup", required=True, metavar="S", help="one of: " + ", ".join(SETUPS))
        q.add_argument("--scale", required=True, metavar="X", help="one of: " + ", ".join(SCALES))
        q.add_argument("--set", action="append", default=[], type=setting, metavar="KEY=VALUE",
                       help="override a field of the resolved setup (VALUE is JSON), e.g. epochs=1")
    d.add_argument("--random-weights", action="store_true", help="build the architecture from its config (no download)")
    d.add_argument("--json", action="store_true", help="print JSON")
    t.add_argument("--optimizer", required=True, metavar="O", help="one of: " + ", ".join(OPTIMIZERS))
    seeds = t.add_mutually_exclusive_group()
    seeds.add_argument("--seed", type=run_seed, default=0)
    seeds.add_argument("--seeds", type=run_seeds, default=None, metavar="LIST",
                       help="several runs of the setup and optimiser, one after another in this process (e.g. 0-59; "
                       "what the workflow's job for an MLP setup's seeds runs): a finished run is skipped, the first "
                       "that fails or is interrupted stops the rest")
    t.add_argument("--out", default="runs", help="runs go to OUT/<scale>/<setup>/<optimizer>/seed-<K>/")
    t.add_argument("--lr", type=positive_float, default=None, help="override the learning rate")
    t.add_argument("--schedule", default=None, metavar="NAME",
                   help="override the schedule: constant | normalised-linear (ief, ef, sf) | multistep")
    t.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    t.add_argument("--precision", type=precision, default="float32", metavar="P",
                   help="the forwards' precision: float32 (default) or bfloat16 / bf16 (every forward, training and "
                   "evaluation, under torch.autocast to bfloat16; parameters, optimiser states and checkpoints stay "
                   "float32); a bfloat16 run is recorded as such and goes to OUT/bfloat16/<scale>/...; float16 is "
                   "refused (ief.precision)")
    t.add_argument("--checkpoint-every", type=positive_seconds, default=120.0, metavar="SECONDS",
                   help="write resume.pt at least this often (default 120)")
    t.add_argument("--no-progress", action="store_true",
                   help="no tqdm progress bars: a progress line at every validation and every --log-every seconds")
    t.add_argument("--log-every", type=positive_seconds, default=300.0, metavar="SECONDS",
                   help="with --no-progress, a progress line at least this often (default 300)")
    for q in (t, r):
        q.add_argument("--wait-lock", action="store_true",
                       help="when another process runs this run (e.g. a requeued job), wait for it instead of "
                       "stopping with exit code 75; then resume it, or skip it if it finished")
    r.add_argument("--optimizer", action="append", default=[], metavar="O",
                   help="search only these optimisers (repeatable; default: every optimiser of the setup)")
    r.add_argument("--seed", type=run_seed, default=0)
    r.add_argument("--out", default="runs", help="trial runs go to OUT/lr-search/lr=<lr>/...; the record to "
                   "OUT/lr-search/<scale>-<setup>.json")
    r.add_argument("--record", default=None, metavar="PATH", help="also write the record here")
    r.add_argument("--missing", action="store_true",
                   help="run only the rates that OUT's record has no trial of (a grid extended after a search)")
    r.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    return p


def _add_evaluate_parser(sub: Any) -> None:
    """``python -m companion evaluate``: E1 / block-diagonal / E3 records of a setup's baseline run
    (companion.experiments.evaluate_runs)."""
    e = sub.add_parser(
        "evaluate", help="gamma indicators (alg:eval) of the baseline run's checkpoints, to a CSV",
        description="Evaluate EF, iEF, SF, K-FAC and the others (alg:eval) at the checkpoints of the setup's BASELINE "
                    "run, as the paper does (sec:exp): the first-order optimiser of the setup's method, AdamW for "
                    "LoRA, Adafactor for prompt tuning, Adam for the MLP (companion.experiments.setups.BASELINE). "
                    "It reads that run, not one of --optimizer ief/ef/sf: train the baseline first.")
    e.add_argument("--setup", required=True, metavar="S")
    e.add_argument("--scale", required=True, metavar="X")
    e.add_argument("--seed", type=run_seed, default=None,
                   help="the run's seed (default: the grid's evaluation seed, "
                        "companion.experiments.setups.EVALUATION_SEED)")
    e.add_argument("--runs", default="runs", metavar="RUNS_DIR",
                   help="where the runs are (python -m companion train --out)")
    e.add_argument("--out", required=True, metavar="OUT.csv")
    e.add_argument("--batches", type=positive_int, default=None, metavar="N",
                   help="batches per checkpoint (default by scale: companion.experiments.setups.EVALUATION_KNOBS)")
    e.add_argument("--batch-size", type=positive_int, default=None, metavar="M",
                   help="default: 160 at full, else the setup's")
    e.add_argument("--cg-iterations", type=positive_int, default=None, metavar="K",
                   help="Hessian-free CG steps of the reference (default by scale)")
    e.add_argument("--sweep-dampings", type=positive_int, default=None, metavar="K",
                   help="E3: K dampings log-spaced over 1e-10 .. 1e2 (default by scale)")
    e.add_argument("--no-sweep", action="store_true",
                   help="skip the E3 damping sweep (default: the sweep where the scale's knobs give the setup E3)")
    e.add_argument("--stages", type=percents, default=None, metavar="P[,P...]",
                   help="only these stages (percent of training): their cached parts OUT.parts/stage-PPP.csv are "
                        "computed and OUT is not written (the workflow's one job per checkpoint)")


def _evaluate_command(args: argparse.Namespace) -> int:
    from .experiments.evaluate_runs import evaluate_run, sweep_grid
    from .experiments.setups import EVALUATION_SEED

    try:
        grid = None if args.sweep_dampings is None else sweep_grid(args.sweep_dampings)
        stages = args.stages  # parsed and checked by percents()
        seed = EVALUATION_SEED if args.seed is None else args.seed
        path = evaluate_run(args.setup, args.scale, seed, args.runs, args.out, batches=args.batches,
                            batch_size=args.batch_size, cg_iterations=args.cg_iterations, sweep_dampings=grid,
                            sweep=False if args.no_sweep else None, stages=stages)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2 if isinstance(err, ValueError) else 1
    print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        args = parser().parse_args(argv)
    except SystemExit as stop:  # a bad argument (usage and an error: line printed: 2) or --help (0)
        return stop.code if isinstance(stop.code, int) else 0
    if args.command == "assets":
        from .experiments.asset_folder import run_command

        return run_command(args)
    if args.assets is not None:
        from .experiments.asset_folder import use_assets

        try:
            use_assets(args.assets)
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    if args.command == "evaluate":
        return _evaluate_command(args)
    from .experiments import (MissingResource, RunInterrupted, describe, format_describe, resolve, scales_of, train)
    from .experiments.runner import RunLocked
    from .experiments.setups import OPTIMIZERS, SETUPS

    try:
        if args.command == "list":
            for name in SETUPS:
                cfg = resolve(name, "smoke")
                opts = [o for o in OPTIMIZERS if o in cfg.optimizers]
                print(f"{name:20s} scales: {', '.join(scales_of(name)):12s} optimizers: {', '.join(opts)}")
            return 0
        if args.command == "backfill":
            from .experiments.backfill import backfill
            from .experiments.setups import SCALES

            if args.scale not in SCALES:
                raise ValueError(f"unknown scale {args.scale!r}; valid scales: {', '.join(SCALES)}")
            done = backfill(args.runs, args.scale)
            for folder, what in done.items():
                print(f"{folder}: " + "; ".join(f"{k}: {v}" for k, v in what.items()))
            return 1 if any(w.startswith("not written") for what in done.values() for w in what.values()) else 0
        if args.command == "verdicts":
            from .experiments.verdict_table import write_verdicts
            from .experiments.setups import SCALES

            if args.scale not in SCALES:
                raise ValueError(f"unknown scale {args.scale!r}; valid scales: {', '.join(SCALES)}")
            try:
                print(f"wrote {write_verdicts(args.scale, args.results, args.runs)}")
            except FileNotFoundError as err:
                print(f"error: {err}", file=sys.stderr)
                return 1
            return 0
        if args.command == "aggregate":
            from .experiments.aggregate import aggregate, find_runs
            from .experiments.setups import SCALES

            if args.scale not in SCALES:
                raise ValueError(f"unknown scale {args.scale!r}; valid scales: {', '.join(SCALES)}")
            done, unfinished = find_runs(args.runs, args.scale)
            try:
                paths = aggregate(args.runs, args.scale, args.out)
            except FileNotFoundError as err:
                print(f"error: {err}", file=sys.stderr)
                return 1
            for path in paths:
                print(f"wrote {path}")
            print(f"{len(done)} finished runs" + (f"; {len(unfinished)} unfinished (left out)" if unfinished else ""))
            return 0
        if args.command == "step-costs":
            from .experiments import store
            from .experiments.setups import SCALES, scale_grid
            from .experiments.step_cost import practical_step_costs

            if args.scale not in SCALES:
                raise ValueError(f"unknown scale {args.scale!r}; valid scales: {', '.join(SCALES)}")
            costs = practical_step_costs(args.setup or scale_grid(args.scale).setups, args.scale,
                                         repeats=args.repeats, device=args.device)
            store.write_text(args.out, costs.to_csv(index=False))
            print(f"wrote {args.out}")
            return 0
        if args.command == "compression":
            from .experiments.compression import write_study

            for path in write_study(args.scale, args.runs, args.out, seed=args.seed):
                print(f"wrote {path}")
            return 0
        if args.command == "blockdiag-check":
            from .experiments.blockdiag_check import CHECK_STAGE, write_chapter_check
            from .experiments.setups import SCALES

            if args.scale not in SCALES:
                raise ValueError(f"unknown scale {args.scale!r}; valid scales: {', '.join(SCALES)}")
            try:
                paths = write_chapter_check(args.scale, args.runs, args.results, args.out, seed=args.seed,
                                            stage=CHECK_STAGE if args.stage is None else args.stage)
            except FileNotFoundError as err:
                print(f"error: {err}", file=sys.stderr)
                return 1
            for path in paths:
                print(f"wrote {path}")
            return 0
        if args.command == "early-spike":
            from .experiments.early_spike import write_e2_first_step
            from .experiments.setups import SCALES

            if args.scale not in SCALES:
                raise ValueError(f"unknown scale {args.scale!r}; valid scales: {', '.join(SCALES)}")
            try:
                print(f"wrote {write_e2_first_step(args.scale, args.runs, args.results, args.out)}")
            except FileNotFoundError as err:
                print(f"error: {err}", file=sys.stderr)
                return 1
            return 0
        overrides = _overrides(args.set)
        if args.command == "search":
            if overrides:
                raise ValueError("search takes no --set: it searches the setup as registered")
            from .experiments import store
            from .experiments.search import search

            record = search(args.setup, args.scale, args.out, optimizers=args.optimizer or None, seed=args.seed,
                            progress=not args.no_progress, wait_lock=args.wait_lock, missing_only=args.missing)
            if args.record:
                store.write_json(args.record, record)
            return 0
        if args.command == "describe":
            info = describe(args.setup, args.scale, random_weights=args.random_weights, overrides=overrides)
            print(json.dumps(info, indent=2) if args.json else format_describe(info))
            return 0
        from .experiments.cost import cost_warning

        if (warning := cost_warning(args.setup, args.scale, args.optimizer)) is not None:  # full scale: hours
            print(warning, file=sys.stderr, flush=True)
        for seed in args.seeds or [args.seed]:
            train(args.setup, args.optimizer, seed, args.scale, args.out, lr=args.lr, schedule=args.schedule,
                  overrides=overrides, device=args.device, progress=not args.no_progress,
                  checkpoint_every_s=args.checkpoint_every, wait_lock=args.wait_lock, log_every_s=args.log_every,
                  precision=args.precision)
        return 0
    except RunInterrupted as err:
        print(f"interrupted: {err}", file=sys.stderr)
        return 128 + int(err.signum)
    except RunLocked as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_LOCKED
    except KeyboardInterrupt:
        print("stopped at once (second signal); the last resume.pt stays valid", file=sys.stderr)
        return EXIT_STOPPED_AT_ONCE
    except (ValueError, MissingResource) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2 if isinstance(err, ValueError) else 1


if __name__ == "__main__":
    sys.exit(main())
