"""One exact-iEF step on the paper's train-from-scratch MLP against one Adam step: time and peak memory.

The setup of ``sec:app-mlp-cifar10``: a 3072-2048-2048-10 ReLU MLP (10,510,346 parameters, float32), batch 64, random
CIFAR-shaped data (``[64, 3072]`` inputs, 10 classes). Run from the repository root::

    OMP_NUM_THREADS=1 python -m benchmarks.paper_mlp                 # CPU, one thread
    python -m benchmarks.paper_mlp --cases adam,ief-auto --steps 20 --json out.json

Cases (each in its own subprocess, so that its peak memory is its own):

- ``adam``: forward + ``backward()`` of ``L = sum_n l_n`` + ``torch.optim.Adam.step()`` + ``zero_grad()``.
- ``ief-auto``: ``ief.optim.IEF(model).step(x, y)`` with the default ``form="auto"``: every Linear weight stays factored
  (ghost Gram ``(A A^T) * (G G^T)``, direction ``(c-weighted G)^T A``); no ``[M, P]`` tensor.
- ``ief-dense``: the same with ``form="dense"``: the ``[64, 10.5M]`` per-sample Jacobian (2.7 GB in float32).

Every case first takes ``--warmup`` steps (the optimisers' first step runs the exact per-sample check, not timed),
then ``--steps`` timed steps; the median is reported. Peak memory: the process's resident-set high-water mark
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``) at the end, minus the resident set just before the first step (model,
batch and one no-grad forward already in place): what the steps (warm-up included) added at their peak, the
optimiser's state included. ``--rounds`` repeats the cases round-robin; the per-case figure is the best round's
median (a shared machine's slow phases only ever add time). The load average before and after is printed: on a
busy machine the times are upper bounds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CASES = ("adam", "ief-auto", "ief-dense")
MIB = 2**20


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _run_case(case: str, steps: int, warmup: int, batch: int, seed: int) -> dict:
    """Inside the subprocess: build, measure, return a dict (printed as JSON)."""
    import resource

    import torch

    import ief

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(3072, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048), torch.nn.ReLU(),
        torch.nn.Linear(2048, 10),
    )
    x = torch.randn(batch, 3072)
    y = torch.randint(0, 10, (batch,))
    with torch.no_grad():
        model(x)
    if case == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)

        def step():
            loss = torch.nn.functional.cross_entropy(model(x), y, reduction="sum")
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    elif case in ("ief-auto", "ief-dense"):
        opt = ief.optim.IEF(model, lr=1e-3, damping=1e-7, form=case.split("-")[1])

        def step():
            opt.step(x, y)
    else:
        raise ValueError(f"case must be one of {CASES}, got {case!r}")
    base = _rss_bytes()
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux
    return dict(case=case, median_s=statistics.median(times), times_s=times, extra_peak_mib=(peak - base) / MIB,
                params=sum(p.numel() for p in model.parameters()), threads=torch.get_num_threads())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from {CASES}")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dense-steps", type=int, default=3, help="timed steps of ief-dense (seconds each)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--json", default=None, help="write every measurement here")
    ap.add_argument("--_case", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._case:
        steps = args.dense_steps if args._case == "ief-dense" else args.steps
        print(json.dumps(_run_case(args._case, steps, args.warmup, args.batch, 0)))
        return
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = [c for c in cases if c not in CASES]
    if bad:
        raise SystemExit(f"unknown case(s) {bad}; accepted: {', '.join(CASES)}")
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    load_before = os.getloadavg()
    results: dict[str, list[dict]] = {c: [] for c in cases}
    for r in range(args.rounds):
        for case in cases[r % len(cases):] + cases[: r % len(cases)]:  # rotated each round
            cmd = [sys.executable, "-m", "benchmarks.paper_mlp", "--_case", case, "--steps", str(args.steps),
                   "--dense-steps", str(args.dense_steps), "--warmup", str(args.warmup), "--batch", str(args.batch)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if out.returncode != 0:
                raise SystemExit(f"case {case} failed:\n{out.stderr[-3000:]}")
            results[case].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"  round {r} {case}: median {results[case][-1]['median_s'] * 1e3:.1f} ms, extra peak "
                  f"{results[case][-1]['extra_peak_mib']:.0f} MiB", flush=True)
    load_after = os.getloadavg()
    best = {c: min(results[c], key=lambda d: d["median_s"]) for c in cases}
    peak = {c: max(d["extra_peak_mib"] for d in results[c]) for c in cases}
    print(f"\npaper MLP 3072-2048-2048-10, {best[cases[0]]['params']:,} parameters, batch {args.batch}, float32, CPU, "
          f"1 thread; load average before {load_before[0]:.2f} / after {load_after[0]:.2f} (1-min), "
          f"{os.cpu_count()} CPUs")
    print(f"{'case':<10} {'step ms':>9} {'vs adam':>8} {'extra peak MiB':>15}")
    for c in cases:
        ratio = best[c]["median_s"] / best["adam"]["median_s"] if "adam" in best else float("nan")
        print(f"{c:<10} {best[c]['median_s'] * 1e3:>9.1f} {ratio:>7.2f}x {peak[c]:>15.0f}")
    if args.json:
        with open(args.json + ".tmp", "w") as f:
            json.dump(dict(load_before=load_before, load_after=load_after, cpus=os.cpu_count(), batch=args.batch,
                           results=results), f, indent=1)
        os.replace(args.json + ".tmp", args.json)


if __name__ == "__main__":
    main()
