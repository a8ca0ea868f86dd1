"""The evaluation's records under another CPU kernel set (portable numbers): ``make test`` reruns the smoke evaluation
with ``ATEN_CPU_CAPABILITY=default`` (ATen's scalar kernels instead of the machine's AVX2/AVX-512 ones) on the same
checkpoints, with the same parameters, and compares every record with the first run's.

    python -m tools.kernels --results results/smoke --runs runs --out _build/smoke/kernels-default

What may differ, and why: both runs read the same stage checkpoints and draw the same batches with the same
parameters (the first run's stage records, ``eval/<setup>.csv.parts/stage-PPP.json``: :func:`evaluation_params`), so a
difference comes only from the order of floating-point operations inside the kernels (vectorised reductions, matmul
blocking). The setups' models are float32: the per-sample Jacobians carry float32 rounding (relative ~1e-7), which the
float64 solves of the exact directions (``ief.logit_space``, ``ief.damping_sweep``) amplify by up to ~1/damping relative
to the Gram matrix's scale. So a well-damped value agrees to ~1e-5 and a near-undamped one is decided by rounding; the
tolerances (:data:`E1_TOLERANCE`, :data:`SWEEP_TOLERANCES`, measured differences and reasons next to them) follow that.
A record present in one run only, or finite in one run only, is always a difference.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tools.book.steps import THREAD_VARIABLES

ROOT = Path(__file__).resolve().parents[1]
CAPABILITY = "default"
VALUES = ("gamma", "ratio", "imbalance")
KEY = ("setup", "stage", "kind", "batch", "method", "damping")


@dataclass(frozen=True)
class Tolerance:
    """``|a - b| <= rel * max(|a|, |b|) + abs``."""

    rel: float
    abs: float = 1e-8

    def holds(self, a: float, b: float) -> bool:
        return abs(a - b) <= self.rel * max(abs(a), abs(b)) + self.abs

    def __str__(self) -> str:
        return f"relative {self.rel:g} + absolute {self.abs:g}"


# The tolerances, by record kind and (for E3's damping sweep) damping band in the package's sum-loss convention. What
# the two kernel sets gave on the smoke grid (AVX-512 vs default, 2026-11-24, with the exact sweep and the float32
# rounding floor of ief.directions), the largest relative difference of gamma: digits-mlp bitwise equal except
# K-FAC/EK-FAC/iEK-FAC (3e-4); tweets-minilm-* E1 <= 5.1e-4 (their E1 damping, the setups' near-zero 1e-7 / 1e-12, is
# itself near-singular); sweep at dampings >= 1e-4 <= 5.8e-6, at 1e-6 <= 8.5e-5, at 1e-8 and 1e-10 <= 3.3e-4. Each
# tolerance is ~10x the largest seen. (The sweep's earlier algebra differed by up to a factor 2.7 below 1e-7, and
# recorded gamma = 0 in one run only: that was its algebra cancelling 1/lambda-sized terms in rounding, not the
# kernels.)
E1_TOLERANCE = Tolerance(5e-3)  # E1 and the block-diagonal study, every method
SWEEP_TOLERANCES = (  # E3's damping sweep: (smallest damping of the band, tolerance), searched in order
    (1e-4, Tolerance(1e-4)),
    (1e-7, Tolerance(1e-3)),
    (0.0, Tolerance(5e-3)),
)


def tolerance(record: dict[str, Any]) -> Tolerance:
    """The tolerance of a record's values (gamma, ratio = gamma / gamma_SGD, imbalance): :data:`E1_TOLERANCE`, or
    by damping :data:`SWEEP_TOLERANCES` (SGD's sweep records take no damping: the best-conditioned band).

    Raises:
        ValueError: a record kind other than ``e1`` and ``sweep``."""
    if record["kind"] == "e1":
        return E1_TOLERANCE
    if record["kind"] != "sweep":
        raise ValueError(f"record kind {record['kind']!r}: accepted kinds are 'e1' and 'sweep'")
    damping = record.get("damping")
    if damping is None:
        return SWEEP_TOLERANCES[0][1]
    return next(tol for smallest, tol in SWEEP_TOLERANCES if damping >= smallest)


def _key(record: dict[str, Any]) -> tuple:
    return tuple(record.get(k) for k in KEY)


def compare(first: list[dict[str, Any]], second: list[dict[str, Any]]) -> list[str]:
    """Every difference between two runs' records beyond :func:`tolerance`, one line each (empty: they agree).

    Raises:
        ValueError: a run holds two records with the same key (setup, stage, kind, batch, method, damping)."""
    tables = []
    for name, records in (("first", first), ("second", second)):
        table = {}
        for r in records:
            if _key(r) in table:
                raise ValueError(f"the {name} run has two records for {dict(zip(KEY, _key(r)))}")
            table[_key(r)] = r
        tables.append(table)
    a, b = tables
    problems = [f"only in the {name} run: {dict(zip(KEY, k))}" for name, mine, other in
                (("first", a, b), ("second", b, a)) for k in mine if k not in other]
    for k in (k for k in a if k in b):
        for column in VALUES:
            x, y = a[k].get(column), b[k].get(column)
            if x is None and y is None:
                continue
            label = ", ".join(f"{n}={v}" for n, v in zip(KEY, k) if v is not None)
            if x is None or y is None or math.isfinite(x) != math.isfinite(y):
                problems.append(f"{label}: {column} {x} vs {y} (finite in one run only)")
            elif math.isfinite(x) and not tolerance(a[k]).holds(x, y):
                rel = abs(x - y) / max(abs(x), abs(y))
                problems.append(f"{label}: {column} {x:.9g} vs {y:.9g} (relative {rel:.2g}; tolerance: "
                                f"{tolerance(a[k])})")
    return problems


def evaluation_params(table: Path) -> dict[str, Any]:
    """The parameters an evaluation table was computed with, read from its stage records
    (``TABLE.parts/stage-PPP.json``, each holding its job's parameters): setup, scale, seed, batches, batch size,
    damping, CG steps, whether damping sweeps ran (at the scale's sweep stages) and their dampings.

    Raises:
        FileNotFoundError: the table has no stage records (naming the folder).
    """
    parts = table.with_name(table.name + ".parts")
    jobs = [json.loads(p.read_text())["job"] for p in sorted(parts.glob("stage-*.json"))]
    if not jobs:
        raise FileNotFoundError(f"{table}: no stage records in {parts} (written by python -m companion evaluate)")
    first, swept = jobs[0], [j for j in jobs if j.get("sweep")]
    return dict(setup=first["setup"], scale=first["scale"], seed=first["seed"], batches=first["batches"],
                batch_size=first["batch_size"], damping=first["damping"], cg=first["cg"], sweep=bool(swept),
                sweep_dampings=swept[0]["sweep_dampings"] if swept else None)


def _rerun(results: Path, runs: Path, out: Path) -> dict[str, Any]:
    """In this process (started with ATEN_CPU_CAPABILITY set): every evaluation table of ``results`` again, with its
    parameters (:func:`evaluation_params`), into ``out``; returns the capability torch used."""
    import torch

    from companion.experiments.evaluate_runs import evaluate_run

    used = torch.backends.cpu.get_cpu_capability()
    wanted = os.environ.get("ATEN_CPU_CAPABILITY", "")
    if used.lower() != wanted.lower():
        raise RuntimeError(f"ATEN_CPU_CAPABILITY={wanted} asked, but torch runs {used} kernels")
    for table in sorted(results.glob("eval/*.csv")):
        p = evaluation_params(table)
        evaluate_run(p["setup"], p["scale"], p["seed"], runs, out / "eval" / table.name,
                     batches=p["batches"], batch_size=p["batch_size"], damping=p["damping"],
                     sweep_dampings=p["sweep_dampings"], sweep=p["sweep"], cg_iterations=p["cg"], progress=False)
    return {"capability": used}


def run(results: Path, runs: Path, out: Path, capability: str = CAPABILITY) -> int:
    """Rerun ``results``' evaluation under ``capability`` into ``out`` and compare; 0 when every record agrees."""
    import torch

    from companion.experiments.evaluate_runs import read_records

    results, runs, out = Path(results).resolve(), Path(runs).resolve(), Path(out).resolve()
    tables = sorted(results.glob("eval/*.csv"))
    if not tables:
        raise FileNotFoundError(f"no evaluation tables in {results}/eval (build them first: make book SCALE=smoke)")
    first_capability = torch.backends.cpu.get_cpu_capability()
    shutil.rmtree(out, ignore_errors=True)  # every stage computed again (a cached part does not know its kernels)
    start = time.time()
    # the same threads as the workflow's evaluate jobs (config threads_per_job): only the kernel set differs
    threads = str(yaml.safe_load((ROOT / "config" / "config.yaml").read_text())["threads_per_job"])
    env = {**os.environ, **{var: threads for var in THREAD_VARIABLES}, "ATEN_CPU_CAPABILITY": capability,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    child = subprocess.run([sys.executable, "-m", "tools.kernels", "--results", str(results), "--runs", str(runs),
                            "--out", str(out), "--child"], cwd=ROOT, env=env)
    if child.returncode != 0:
        print(f"[kernels] the rerun under ATEN_CPU_CAPABILITY={capability} failed (exit {child.returncode})")
        return child.returncode
    print(f"[kernels] evaluation of {len(tables)} setups rerun with {capability} kernels (the first run: "
          f"{first_capability}) in {time.time() - start:.0f} s")
    if first_capability.lower() == capability.lower():
        print(f"[kernels] note: this machine's own kernels are already {first_capability}; the comparison only checks "
              f"that the evaluation is deterministic")
    problems = []
    for table in tables:
        found = compare(read_records(table), read_records(out / "eval" / table.name))
        print(f"[kernels] {table.stem}: {'agrees' if not found else f'{len(found)} differences'}")
        problems += found
    for line in problems[:40]:
        print(f"  {line}")
    if len(problems) > 40:
        print(f"  ... and {len(problems) - 40} more")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.kernels", description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=Path("results/smoke"), help="the first run's tables (RESULTS)")
    ap.add_argument("--runs", type=Path, default=Path("runs"), help="the training runs the evaluation read")
    ap.add_argument("--out", type=Path, default=Path("_build/smoke/kernels-default"), help="the rerun's tables")
    ap.add_argument("--capability", default=CAPABILITY, help="ATEN_CPU_CAPABILITY of the rerun (default, avx2, ...)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _rerun(args.results, args.runs, args.out)
        return 0
    return run(args.results, args.runs, args.out, args.capability)


if __name__ == "__main__":
    sys.exit(main())
