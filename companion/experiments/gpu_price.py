"""What one more seed of a pair of optimisers costs on a GPU: H200 GPU-minutes, from the committed GPU benchmark
records (``benchmarks/results/*-h200.json``), beside the core-minutes the runs' own wall times give
(:mod:`companion.experiments.verdicts`).

No record times the cpu setups' own models on the H200, so the price is an upper estimate: the run's updates times the
H200's median time per update of a recorded model at least as large, at the setup's batch size or larger, with the
optimiser's kind of update (an exact per-sample step for iEF, EF, SF and the K-FAC kinds; a plain backward and
update for the others):

- ``bert`` (MiniLM, 6 layers of width 384, batch 32 of 32 tokens): the ``step`` record's T5-base + LoRA (24 layers of
  width 768, batch 32, 32 input tokens), rows ``ief`` and ``adamw``. On the H200 these steps are bound by kernel
  launches (a forward of T5-base at batch 32 takes 46 ms), which grow with the layers: MiniLM has a quarter of them.
- ``mlp`` (digits: 64-128-128-10, batch 64): the ``paper_mlp`` record's 3,072-2,048-2,048-10 MLP of the paper at batch
  64 (10.5 M parameters), rows ``ief-auto`` and ``adam``.
- ``t5`` (the paper's T5-base setups, batch 32): the ``step`` record's T5-base + LoRA itself (prompt tuning's step
  backpropagates through the same layers).

Validation and test passes, the process start and the model's load are left out (seconds on a GPU); a price says
"≤" for that reason too. A family without a record has no GPU price (None), never a guess.
"""
from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path
from typing import Any

RECORDS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
EXACT_KINDS = ("ief", "ef", "sf", "ief-momentum", "kfac", "ekfac", "iekfac")  # a per-sample (or curvature) step
# family -> (record, model within it or None, row for an exact step, row for a plain step, what bounds it)
BOUNDS: dict[str, tuple[str, str | None, str, str, str]] = {
    "bert": ("step-h200.json", "t5-lora", "ief", "adamw", "a T5-base + LoRA step at batch 32 (step-h200.json)"),
    "t5": ("step-h200.json", "t5-lora", "ief", "adamw", "a T5-base + LoRA step at batch 32 (step-h200.json)"),
    "mlp": ("paper_mlp-h200.json", None, "ief-auto", "adam", "the paper's 10.5 M-parameter MLP at batch 64 "
            "(paper_mlp-h200.json)"),
}


@lru_cache(maxsize=None)
def _rows(record: str, model: str | None, folder: str) -> dict[str, float]:
    """``{row key: median ms}`` of one model of one benchmark record; empty where the record is absent."""
    path = Path(folder) / record
    if not path.exists():
        return {}
    results: dict[str, Any] = json.loads(path.read_text())["results"]
    if model is not None:
        results = next((m for m in results.get("models", []) if m.get("model") == model), {})
    return {r["key"]: float(r["median_ms"]) for r in results.get("rows", []) if r.get("median_ms") is not None}


def update_ms(family: str, optimizer: str, records: Path = RECORDS) -> float | None:
    """The H200 milliseconds that bound one update of ``optimizer`` on a model of ``family`` (see the module
    docstring); None where no record bounds it."""
    if family not in BOUNDS:
        return None
    record, model, exact, plain, _ = BOUNDS[family]
    ms = _rows(record, model, str(records)).get(exact if optimizer in EXACT_KINDS else plain)
    return ms if ms is not None and math.isfinite(ms) else None


def seed_gpu_minutes(family: str, updates: dict[str, float], records: Path = RECORDS) -> float | None:
    """H200 GPU-minutes (an upper estimate) of one more seed of each optimiser of ``updates`` (``{optimizer: updates
    per run}``); None where any of them has no bounding record."""
    ms = {o: update_ms(family, o, records) for o in updates}
    if any(v is None for v in ms.values()) or not updates:
        return None
    return sum(ms[o] * n for o, n in updates.items()) / 60_000


def basis(family: str) -> str | None:
    """What bounds a GPU price of ``family``, in words (for the chapters' notes)."""
    return BOUNDS[family][4] if family in BOUNDS else None
