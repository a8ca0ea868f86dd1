"""A damping sweep (E3, ``sec:exp-damping``) with ``ief.damping_sweep`` against K separate evaluations.

Run from the repository root (single-threaded, as everything on a shared small CPU)::

    OMP_NUM_THREADS=1 python -m benchmarks.damping_sweep                 # K = 20, M = 32, both models
    OMP_NUM_THREADS=1 python -m benchmarks.damping_sweep --k 20 --m 32,64 --models mlp --json out.json

Both sides compute gamma and gamma/gamma_SGD of EF, iEF and SF at K dampings (log-spaced 1e-10 .. 1e2) on one batch:

- ``separate``: for each damping, ``ief.evaluate(model, [batch], ["ef", "ief", "sf"], damping, logit_space=False)``
  (a per-sample backward, a sampled backward, three Woodbury solves and four ``ief.gamma`` forward-mode passes, per
  damping);
- ``sweep``: one ``ief.damping_sweep(model, *batch, dampings)`` (default route: the batch's logit Jacobian; one
  per-sample and one sampled Jacobian and one Gram matrix each, shared by all dampings, then per damping and method
  the exact direction and its ``gamma``, as ``ief.evaluate`` computes them; an earlier version rated every damping by
  an ``O(M^2)`` quadratic form after ``2M`` logit JVPs, which was wrong on singular Grams at small damping).

Models (float32, eval mode): ``mlp``: the digits-mlp architecture (64-128-128-10 ReLU, 26,122 parameters) on random
inputs; ``minilm-lora``: the cpu setup tweets-minilm-lora (packaged all-MiniLM-L6-v2 + LoRA r=8 + 3-class head,
74,883 trainable parameters) on 32-token made-up sentences, skipped with a note if the package is missing.
Timing: ``benchmarks.harness`` (one warm-up of each, then ``--repeats`` rounds in rotated order; medians and the
median of within-round ratios).
The largest relative difference between the two sides' gammas is printed as a check (not a test: see
tests/ief/test_damping_sweep.py). Not part of pass/fail.
"""
from __future__ import annotations

import argparse
import time

import torch

import ief
from benchmarks import harness
from benchmarks.workloads import randomise_lora_b

MODELS = ("mlp", "minilm-lora")


def _mlp(m: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 10))
    return model.eval(), torch.randn(m, 64), torch.randint(0, 10, (m,))


def _minilm(m: int):
    from companion.experiments.data import load_data
    from companion.experiments.models import build_model
    from companion.experiments.setups import resolve
    from companion.experiments.tasks import make_task

    cfg = resolve("tweets-minilm-lora", "cpu")
    torch.manual_seed(0)
    data = load_data(cfg)
    model, pre = build_model(cfg, data)
    randomise_lora_b(model)
    inputs, targets = make_task(cfg, model, pre).collate([data.train[i] for i in range(m)])
    return model.eval(), inputs, targets


def _separate(model, x, y, dampings):
    out = []
    for lam in dampings:
        # logit_space=False: K full model evaluations, the sweep's baseline (the default route would share one
        # logit Jacobian across calls' algebra and measure ief.evaluate's own shortcut instead)
        out += ief.evaluate(model, [(x, y)], ["ef", "ief", "sf"], lam, seed=0, logit_space=False)
    return out


def _sweep(model, x, y, dampings):
    from ief.evaluation import batch_generator

    return ief.damping_sweep(model, x, y, dampings, generator=batch_generator(0, 0))


def main(argv=None) -> None:
    started = time.perf_counter()
    p = argparse.ArgumentParser(prog="python -m benchmarks.damping_sweep", description=__doc__.splitlines()[0])
    harness.add_common_arguments(p, repeats=3, warmup=0, device=False)
    p.add_argument("--k", type=int, default=20, help="number of dampings (default 20)")
    p.add_argument("--m", default="32", help="batch size(s), comma-separated (default 32)")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {','.join(MODELS)}")
    args = p.parse_args(argv)
    harness.check_common(p, args)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not models or any(m not in MODELS for m in models):
        p.error(f"--models: {args.models!r}; choose from {', '.join(MODELS)}")
    try:
        sizes = [int(m) for m in str(args.m).split(",") if m.strip()]
    except ValueError:
        p.error(f"--m: comma-separated integers expected, got {args.m!r}")
    if args.k < 1 or not sizes or min(sizes) < 1:
        p.error(f"--k and every --m must be >= 1, got {args.k}, {args.m}")
    dampings = torch.logspace(-10, 2, args.k).tolist()
    print(f"K = {args.k} dampings, M = {args.m}, {args.repeats} rounds, torch {torch.__version__}, "
          f"{args.threads} thread(s)")
    print(f"{'model':12s} {'M':>4s} {'separate (s)':>13s} {'sweep (s)':>10s} {'speed-up':>9s} {'max rel. diff':>14s}")
    results, skipped = [], []
    with harness.OtherLoad() as load:
        for name, m in [(name, m) for name in models for m in sizes]:
            try:
                model, x, y = {"mlp": _mlp, "minilm-lora": _minilm}[name](m)
            except Exception as err:  # a missing packaged model/data set
                print(f"{name:12s} skipped: {type(err).__name__}: {err}", flush=True)
                skipped.append(dict(model=name, reason=f"{type(err).__name__}: {err}"))
                continue
            sep, swp = _separate(model, x, y, dampings), _sweep(model, x, y, dampings)  # warm-up + check
            by_key = {(r["method"], r["damping"]): r["gamma"] for r in sep}
            diff = max(abs(r["gamma"] - by_key[(r["method"], r["damping"])]) / by_key[(r["method"], r["damping"])]
                       for r in swp if r["method"] != "sgd")
            times = harness.round_robin({"separate": lambda: _separate(model, x, y, dampings),
                                         "sweep": lambda: _sweep(model, x, y, dampings)}, args.repeats, args.warmup)
            rows = harness.rows(times, {"separate": None, "sweep": None})
            speedup = harness.within_round_ratio(times["separate"], times["sweep"])
            results.append(dict(model=name, k=args.k, m=m, rows=rows, speedup=speedup, max_rel_diff=diff))
            print(f"{name:12s} {m:4d} {rows[0]['median_ms'] / 1e3:13.3f} {rows[1]['median_ms'] / 1e3:10.3f} "
                  f"{speedup:8.1f}x {diff:14.1e}", flush=True)
    table = harness.table(
        f"A damping sweep of EF, iEF and SF at K = {args.k} dampings on one batch of M samples",
        [("model", "s"), ("M", "d"), ("K separate evaluations (s)", ".2f"), ("one damping_sweep (s)", ".3f"),
         ("speed-up", ".1f"), ("max rel. difference of γ", ".1e")],
        [[r["model"], r["m"], r["rows"][0]["median_ms"] / 1e3, r["rows"][1]["median_ms"] / 1e3, r["speedup"],
          r["max_rel_diff"]] for r in results],
        note="speed-up: median of within-round ratios; mlp = digits-mlp architecture (64-128-128-10 ReLU, 26,122 "
             "parameters), minilm-lora = the cpu setup tweets-minilm-lora (74,883 trainable parameters).")
    doc = harness.record("damping_sweep", argv, "cpu", args, load, dict(models=results, skipped=skipped), [table],
                         started)
    harness.finish(doc, args.json)


if __name__ == "__main__":
    main()
