"""One exact-iEF step on the paper's train-from-scratch MLP against one Adam step: time and peak memory.

The setup of ``sec:app-mlp-cifar10``: a 3072-2048-2048-10 ReLU MLP (10,510,346 parameters, float32), batch 64, random
CIFAR-shaped data (``[64, 3072]`` inputs, 10 classes). Run from the repository root::

    OMP_NUM_THREADS=1 python -m benchmarks.paper_mlp                 # CPU, one thread
    python -m benchmarks.paper_mlp --cases adam,ief-auto,ief-dense --rounds 20 --json out.json

Cases:

- ``adam``: forward + ``backward()`` of ``L = sum_n l_n`` + ``torch.optim.Adam.step()`` + ``zero_grad()``.
- ``ief-auto``: ``ief.optim.IEF(model).step(x, y)`` with the default ``form="auto"``: every Linear weight stays factored
  (ghost Gram ``(A A^T) * (G G^T)``, direction ``(c-weighted G)^T A``); no ``[M, P]`` tensor.
- ``ief-auto-nocheck``: the same with ``check=False`` (no guard: shows what the default guard, ``J^T 1`` against the
  autograd gradient from the factors, costs).
- ``ief-dense``: the same with ``form="dense"``: the ``[64, 10.5M]`` per-sample Jacobian (2.7 GB in float32).

Time: in one process and one thread, every case's model is built side by side (same weights and data), takes
``--warmup`` steps (the optimisers' first step runs the exact per-sample check: not timed), then ``--rounds``
round-robin rounds of one step each, the order rotated each round. Reported: median and inter-quartile range per
case, and the median over rounds of the within-round ratio to the Adam step (robust to a shared machine's slow
phases). ``ief-dense`` (seconds per step, 2.7 GB) is timed only in its memory run.

Peak memory: each case in its own subprocess: the resident-set high-water mark
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``) after ``--warmup + --memory-steps`` steps minus the resident set just
before the first step (model, batch and one no-grad forward in place): what the steps added at their peak, the
optimiser's state included. The load average before and after is printed: on a busy machine times are upper bounds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CASES = ("adam", "ief-auto", "ief-auto-nocheck", "ief-dense")
MIB = 2**20


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _build(case: str, batch: int, seed: int):
    """The model, batch and one-step closure of a case (every case gets the same weights and data)."""
    import torch

    import ief

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
    elif case in ("ief-auto", "ief-auto-nocheck", "ief-dense"):
        opt = ief.optim.IEF(model, lr=1e-3, damping=1e-7, form=case.split("-")[1], check=not case.endswith("nocheck"))

        def step():
            opt.step(x, y)
    else:
        raise ValueError(f"case must be one of {CASES}, got {case!r}")
    return model, step


def _memory_case(case: str, steps: int, warmup: int, batch: int) -> dict:
    """Inside a subprocess: the resident-set high-water mark added by ``warmup + steps`` steps, and their times."""
    import resource

    import torch

    torch.set_num_threads(1)
    model, step = _build(case, batch, 0)
    base = _rss_bytes()
    times = []
    for k in range(warmup + steps):
        t0 = time.perf_counter()
        step()
        if k >= warmup:
            times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux
    return dict(case=case, extra_peak_mib=(peak - base) / MIB, times_s=times,
                params=sum(p.numel() for p in model.parameters()))


def _time_cases(cases: list[str], rounds: int, warmup: int, batch: int) -> dict[str, list[float]]:
    """One process, one thread: every case's model built side by side, steps taken round-robin (order rotated each
    round), so that a shared machine's slow phases hit every case alike."""
    import torch

    torch.set_num_threads(1)
    steps = {c: _build(c, batch, 0)[1] for c in cases}
    for c in cases:
        for _ in range(warmup):
            steps[c]()
    times: dict[str, list[float]] = {c: [] for c in cases}
    for r in range(rounds):
        for c in cases[r % len(cases):] + cases[: r % len(cases)]:
            t0 = time.perf_counter()
            steps[c]()
            times[c].append(time.perf_counter() - t0)
    return times


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="adam,ief-auto,ief-auto-nocheck", help=f"comma-separated, from {CASES}")
    ap.add_argument("--rounds", type=int, default=15, help="timed round-robin rounds (one step of each case)")
    ap.add_argument("--memory-steps", type=int, default=3, help="steps after warm-up in each memory subprocess")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--json", default=None, help="write every measurement here")
    ap.add_argument("--_case", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._case:
        print(json.dumps(_memory_case(args._case, args.memory_steps, args.warmup, args.batch)))
        return
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = [c for c in cases if c not in CASES]
    if bad or "adam" not in cases:
        raise SystemExit(f"unknown case(s) {bad} or no 'adam' (the reference); accepted: {', '.join(CASES)}")
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    load_before = os.getloadavg()
    memory = {}
    for case in cases:  # peak memory: one subprocess per case
        cmd = [sys.executable, "-m", "benchmarks.paper_mlp", "--_case", case, "--memory-steps",
               str(args.memory_steps), "--warmup", str(args.warmup), "--batch", str(args.batch)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"case {case} failed:\n{out.stderr[-3000:]}")
        memory[case] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"  memory {case}: extra peak {memory[case]['extra_peak_mib']:.0f} MiB", flush=True)
    timed = [c for c in cases if c != "ief-dense"]  # dense: seconds per step and 2.7 GB: its memory run's times
    times = _time_cases(timed, args.rounds, args.warmup, args.batch)
    load_after = os.getloadavg()
    params = memory["adam"]["params"]
    print(f"\npaper MLP 3072-2048-2048-10, {params:,} parameters, batch {args.batch}, float32, CPU, 1 thread, "
          f"{args.rounds} round-robin rounds; load average (1-min) before {load_before[0]:.2f} / after "
          f"{load_after[0]:.2f} on {os.cpu_count()} CPUs")
    print(f"{'case':<17} {'median ms':>10} {'IQR ms':>14} {'vs adam':>8} {'extra peak MiB':>15}")
    for c in cases:
        t = times.get(c, memory[c]["times_s"])
        q = statistics.quantiles(t, n=4) if len(t) > 1 else [t[0]] * 3
        if c in times:  # median over rounds of the within-round ratio
            ratio = statistics.median(a / b for a, b in zip(times[c], times["adam"]))
        else:
            ratio = statistics.median(t) / statistics.median(times["adam"])
        print(f"{c:<17} {statistics.median(t) * 1e3:>10.1f} {q[0] * 1e3:>6.0f}-{q[2] * 1e3:<7.0f} {ratio:>7.2f}x "
              f"{memory[c]['extra_peak_mib']:>15.0f}")
    if args.json:
        with open(args.json + ".tmp", "w") as f:
            json.dump(dict(load_before=load_before, load_after=load_after, cpus=os.cpu_count(), batch=args.batch,
                           memory=memory, times=times), f, indent=1)
        os.replace(args.json + ".tmp", args.json)


if __name__ == "__main__":
    main()
