"""One exact-iEF step on the paper's train-from-scratch MLP against one Adam step: time and peak memory.

The setup of ``sec:app-mlp-cifar10``: a 3072-2048-2048-10 ReLU MLP (10,510,346 parameters, float32), batch 64, random
CIFAR-shaped data (``[64, 3072]`` inputs, 10 classes). Run from the repository root::

    OMP_NUM_THREADS=1 python -m benchmarks.paper_mlp                 # CPU, one thread
    python -m benchmarks.paper_mlp --cases adam,ief-auto,ief-dense --repeats 20 --json out.json

Cases:

- ``adam``: forward + ``backward()`` of ``L = sum_n l_n`` + ``torch.optim.Adam.step()`` + ``zero_grad()``.
- ``ief-auto``: ``ief.optim.IEF(model).step(x, y)`` with the default ``form="auto"``: every Linear weight stays factored
  (ghost Gram ``(A A^T) * (G G^T)``, direction ``(c-weighted G)^T A``); no ``[M, P]`` tensor.
- ``ief-auto-nocheck``: the same with ``check=False`` (no guard: shows what the default guard, the structural check
  that no hooked parameter is used outside its hooked calls, costs).
- ``ief-dense``: the same with ``form="dense"``: the ``[64, 10.5M]`` per-sample Jacobian (2.7 GB in float32).

Time: in one process (``--threads``, default one), every case's model is built side by side (same weights and
data), takes ``--warmup`` steps (the optimisers' first step runs the exact per-sample check: not timed), then
``--repeats`` round-robin rounds of one step each, the order rotated each round (``benchmarks.harness.round_robin``).
Reported: median and inter-quartile range per case, and the median over rounds of the within-round ratio to the Adam
step (robust to a shared machine's slow phases). ``ief-dense`` (seconds per step, 2.7 GB) is timed only in its memory
run.

Host round-trips and operators (what a GPU would wait for): after the timed rounds, one more steady-state step of
each timed case is counted with :mod:`benchmarks.host_syncs` (a ``TorchFunctionMode`` for the reads of a tensor's
value by the host, ``bool``/``float``/``item``/``tolist``/``cpu``/``nonzero``/..., each a stall on a GPU, and a
``TorchDispatchMode``
for the aten operators dispatched, each a kernel launch on a GPU; Adam's CPU step reads its step counters, which on
a GPU live on the host). With ``--device cuda`` each timed case also runs one steady step inside
``torch.cuda.set_sync_debug_mode("error")`` and the first synchronising call is reported (``first sync``; none: the
step never waited for the device).

Peak memory: each case in its own subprocess: the resident-set high-water mark
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``) after ``--warmup + --memory-steps`` steps minus the resident set just
before the first step (model, batch and one no-grad forward in place): what the steps added at their peak, the
optimiser's state included. The cores other processes kept busy meanwhile are recorded: on a busy machine times are
upper bounds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from benchmarks import harness, host_syncs

CASES = ("adam", "ief-auto", "ief-auto-nocheck", "ief-dense")
LABELS = {
    "adam": "`torch.optim.Adam` (forward + backward + update)",
    "ief-auto": '`ief.optim.IEF`, `form="auto"` (default guard on)',
    "ief-auto-nocheck": '`ief.optim.IEF`, `form="auto"`, `check=False`',
    "ief-dense": '`ief.optim.IEF`, `form="dense"` (the `[64, 10.5M]` J)',
}
MIB = 2**20


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _build(case: str, batch: int, seed: int, device: str = "cpu"):
    """The model and one-step closure of a case (every case gets the same weights and data)."""
    import torch

    import ief
    from benchmarks.workloads import build_paper_mlp

    w = build_paper_mlp(batch, device, seed)
    model, x, y = w.model, w.inputs, w.targets
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


def _memory_case(case: str, steps: int, warmup: int, batch: int, threads: int, device: str = "cpu") -> dict:
    """Inside a subprocess: the memory high-water mark added by ``warmup + steps`` steps, and their times.

    On the CPU the resident set (``ru_maxrss``); on CUDA the allocator's peak (``torch.cuda.max_memory_allocated``)."""
    import resource

    import torch

    torch.set_num_threads(threads)
    model, step = _build(case, batch, 0, device)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = _rss_bytes()
    times = []
    for k in range(warmup + steps):
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        if k >= warmup:
            times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return dict(case=case, extra_peak_mib=(peak - base) / MIB, times_s=times,
                params=sum(p.numel() for p in model.parameters()))


def main(argv=None) -> None:
    started = time.perf_counter()
    ap = argparse.ArgumentParser(prog="python -m benchmarks.paper_mlp", description=__doc__.split("\n")[0])
    harness.add_common_arguments(ap, repeats=15, warmup=2)
    ap.add_argument("--rounds", type=int, default=None, help=argparse.SUPPRESS)  # old name of --repeats
    ap.add_argument("--cases", default="adam,ief-auto,ief-auto-nocheck", help=f"comma-separated, from {CASES}")
    ap.add_argument("--memory-steps", type=int, default=3, help="steps after warm-up in each memory subprocess")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--_case", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rounds is not None:
        args.repeats = args.rounds
    if args._case:
        print(json.dumps(_memory_case(args._case, args.memory_steps, args.warmup, args.batch, args.threads,
                                      args.device)))
        return
    device = harness.check_common(ap, args)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = [c for c in cases if c not in CASES]
    if bad or "adam" not in cases:
        ap.error(f"--cases: unknown case(s) {bad} or no 'adam' (the reference); accepted: {', '.join(CASES)}")
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    memory = {}
    with harness.OtherLoad() as load:
        for case in cases:  # peak memory: one subprocess per case
            cmd = [sys.executable, "-m", "benchmarks.paper_mlp", "--_case", case, "--memory-steps",
                   str(args.memory_steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
                   "--threads", str(args.threads), "--device", args.device]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if out.returncode != 0:
                raise SystemExit(f"case {case} failed:\n{out.stderr[-3000:]}")
            memory[case] = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"  memory {case}: extra peak {memory[case]['extra_peak_mib']:.0f} MiB", flush=True)
        timed = [c for c in cases if c != "ief-dense"]  # dense: seconds per step and 2.7 GB: its memory run's times
        steps = {c: _build(c, args.batch, 0, args.device)[1] for c in timed}
        times = harness.round_robin(steps, args.repeats, args.warmup, device=device)
        counted = {c: host_syncs.count_call(steps[c]) for c in timed}  # one more steady step each
        syncs = {c: (host_syncs.first_cuda_sync(steps[c]) if device.type == "cuda" else None) for c in timed}
    params = memory["adam"]["params"]
    rows = harness.rows(times, {c: (None if c == "adam" else "adam") for c in timed}, LABELS)
    for c in cases:
        if c not in times:  # measured in its memory subprocess only: ratio of medians, said so in its row
            t = memory[c]["times_s"]
            rows.append(dict(key=c, label=LABELS[c], **harness.summary(t), reference="adam", ratio=None,
                             ratio_of_medians=statistics.median(t) / statistics.median(times["adam"]),
                             times_ms=[1e3 * x for x in t]))
    for r in rows:
        r["extra_peak_mib"] = memory[r["key"]]["extra_peak_mib"]
        counts = counted.get(r["key"])
        r["round_trips"] = counts.round_trips if counts else None
        r["operators"] = counts.operators if counts else None
        r["round_trip_kinds"] = counts.kinds if counts else None
        r["first_sync"] = syncs.get(r["key"])
    rows.sort(key=lambda r: cases.index(r["key"]))
    print(f"\npaper MLP 3072-2048-2048-10, {params:,} parameters, batch {args.batch}, float32, {device}, "
          f"{args.threads} thread(s), {args.repeats} round-robin rounds")
    print(f"{'case':<17} {'median ms':>10} {'IQR ms':>9} {'vs adam':>8} {'extra peak MiB':>15} {'round-trips':>12} "
          f"{'operators':>10}")
    for r in rows:
        ratio = r["ratio"] if r["ratio"] is not None else (r["ratio_of_medians"] if r["reference"] else 1.0)
        trips, ops = ("n/a" if r[k] is None else r[k] for k in ("round_trips", "operators"))
        print(f"{r['key']:<17} {r['median_ms']:>10.1f} {r['iqr_ms']:>9.1f} {ratio:>7.2f}x {r['extra_peak_mib']:>15.0f} "
              f"{trips:>12} {ops:>10}")
    if device.type == "cuda":
        for r in rows:
            if r["key"] in syncs:
                print(f"first sync of a steady {r['key']} step: {syncs[r['key']] or 'none'}")
    table = harness.table(
        f"One step on the paper's MLP (3072-2048-2048-10 ReLU, {params:,} parameters, batch {args.batch})",
        [("step", "s"), ("median ms", ",.0f"), ("IQR ms", ",.0f"), ("vs Adam step", ".2f"),
         ("extra peak memory (MiB)", ",.0f"), ("host round-trips", "d"), ("operators", ",d")],
        [[r["label"], r["median_ms"], r["iqr_ms"],
          1.0 if r["reference"] is None else (r["ratio"] if r["ratio"] is not None else r["ratio_of_medians"]),
          r["extra_peak_mib"], r["round_trips"], r["operators"]] for r in rows],
        note="vs Adam step: median of within-round ratios (ratio of medians for a case timed only in its memory "
             "subprocess, e.g. form=\"dense\"); extra peak memory: high-water mark added by the steps (CPU: resident "
             "set; CUDA: the allocator's peak), one subprocess per case; host round-trips and operators: one steady "
             "step "
             "counted (benchmarks/host_syncs.py: reads of a tensor's value by the host, dispatched aten operators).")
    doc = harness.record("paper_mlp", argv, device, args, load, dict(params=params, batch=args.batch, rows=rows,
                                                                    memory=memory), [table], started)
    harness.finish(doc, args.json)


if __name__ == "__main__":
    main()
