"""A damping sweep (E3, ``sec:exp-damping``) with ``ief.damping_sweep`` against K separate evaluations.

Run from the repository root (single-threaded, as everything on a shared small CPU)::

    OMP_NUM_THREADS=1 python -m benchmarks.damping_sweep                 # K = 20, M = 32, both models
    OMP_NUM_THREADS=1 python -m benchmarks.damping_sweep --k 20 --m 64 --models mlp

Both sides compute gamma and gamma/gamma_SGD of EF, iEF and SF at K dampings (log-spaced 1e-10 .. 1e2) on one batch:

- ``separate``: for each damping, ``ief.evaluate(model, [batch], ["ef", "ief", "sf"], damping)`` (a per-sample
  backward, a sampled backward, three Woodbury solves and four ``ief.gamma`` forward-mode passes, per damping);
- ``sweep``: one ``ief.damping_sweep(model, *batch, dampings)`` (one per-sample and one sampled backward, one
  ``eigh`` per Gram, ``2M`` logit JVPs, then ``O(M^2)`` per damping).

Models (float32, eval mode): ``mlp``: the digits-mlp architecture (64-128-128-10 ReLU, 26,122 parameters) on random
inputs; ``minilm-lora``: the cpu setup tweets-minilm-lora (packaged all-MiniLM-L6-v2 + LoRA r=8 + 3-class head,
74,883 trainable parameters) on 32-token made-up sentences, skipped with a note if the package is missing.
Timing: one warm-up of each, then ``--repeats`` rounds alternating the order; medians and the median per-round ratio.
The largest relative difference between the two sides' gammas is printed as a check (not a test: see
tests/test_damping_sweep.py). Not part of pass/fail.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import ief


def _mlp(m: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 10))
    return model.eval(), torch.randn(m, 64), torch.randint(0, 10, (m,))


def _minilm(m: int):
    from ief.experiments.data import load_data
    from ief.experiments.models import build_model
    from ief.experiments.setups import resolve
    from ief.experiments.tasks import make_task

    cfg = resolve("tweets-minilm-lora", "cpu")
    torch.manual_seed(0)
    data = load_data(cfg)
    model, pre = build_model(cfg, data)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    inputs, targets = make_task(cfg, model, pre).collate([data.train[i] for i in range(m)])
    return model.eval(), inputs, targets


def _separate(model, x, y, dampings):
    out = []
    for lam in dampings:
        out += ief.evaluate(model, [(x, y)], ["ef", "ief", "sf"], lam, seed=0)
    return out


def _sweep(model, x, y, dampings):
    from ief.evaluation import batch_generator

    return ief.damping_sweep(model, x, y, dampings, generator=batch_generator(0, 0))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--k", type=int, default=20, help="number of dampings (default 20)")
    p.add_argument("--m", type=int, default=32, help="batch size (default 32)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--models", default="mlp,minilm-lora")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dampings = torch.logspace(-10, 2, args.k).tolist()
    print(f"K = {args.k} dampings, M = {args.m}, {args.repeats} rounds, torch {torch.__version__}, 1 thread")
    print(f"{'model':12s} {'separate (s)':>13s} {'sweep (s)':>10s} {'speed-up':>9s} {'max rel. diff':>14s}")
    for name in args.models.split(","):
        try:
            model, x, y = {"mlp": _mlp, "minilm-lora": _minilm}[name](args.m)
        except Exception as err:  # a missing packaged model/data set
            print(f"{name:12s} skipped: {type(err).__name__}: {err}", flush=True)
            continue
        sep, swp = _separate(model, x, y, dampings), _sweep(model, x, y, dampings)  # warm-up + check
        by_key = {(r["method"], r["damping"]): r["gamma"] for r in sep}
        diff = max(abs(r["gamma"] - by_key[(r["method"], r["damping"])]) / by_key[(r["method"], r["damping"])]
                   for r in swp if r["method"] != "sgd")
        times = {"separate": [], "sweep": []}
        for rnd in range(args.repeats):
            order = ["separate", "sweep"] if rnd % 2 == 0 else ["sweep", "separate"]
            for which in order:
                t0 = time.perf_counter()
                (_separate if which == "separate" else _sweep)(model, x, y, dampings)
                times[which].append(time.perf_counter() - t0)
        ratio = statistics.median(a / b for a, b in zip(times["separate"], times["sweep"]))
        print(f"{name:12s} {statistics.median(times['separate']):13.3f} {statistics.median(times['sweep']):10.3f} "
              f"{ratio:8.1f}x {diff:14.1e}", flush=True)


if __name__ == "__main__":
    main()
