"""A run's files, every one written atomically (a temporary file in the same folder, fsync, then ``os.replace``), so
an interrupted write leaves the previous version intact.

Layout of ``DIR/<scale>/<setup>/<optimizer>/seed-<K>/``::

    config.json            the resolved setup and optimiser (compared on re-invocation)
    train_loss.csv         step, epoch, loss (mean cross-entropy per target token) of every update
    validation.jsonl       one line per evaluation: step, epoch, metrics, score
    checkpoints/epoch-NNN.pt   trainable parameters at the end of every epoch
    checkpoints/best.pt    trainable parameters of the best validation score
    resume.pt              everything needed to continue (removed once summary.json exists)
    predictions/*.tsv      GLUE test predictions in the submission format (GLUE setups)
    summary.json           written last: its presence marks a finished run
"""
from __future__ import annotations

import io
import json
import math
import os
from pathlib import Path
from typing import Any

import torch


def _atomic_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def finite_or_none(value: Any) -> Any:
    """JSON has no NaN/inf: non-finite floats become null (recursively)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    return value


def write_json(path: Path, obj: Any) -> None:
    _atomic_bytes(path, (json.dumps(finite_or_none(obj), indent=2, sort_keys=True) + "\n").encode())


def read_json(path: Path) -> Any:
    with open(path) as f:
        return json.load(f)


def write_text(path: Path, text: str) -> None:
    _atomic_bytes(path, text.encode())


def write_torch(path: Path, obj: Any) -> None:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    _atomic_bytes(path, buffer.getvalue())


def read_torch(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=False)  # our own files: RNG states are numpy objects


def loss_csv(losses: list[float], steps_per_epoch: int) -> str:
    rows = ["step,epoch,loss"]
    rows += [f"{i + 1},{i // steps_per_epoch + 1},{v!r}" for i, v in enumerate(losses)]
    return "\n".join(rows) + "\n"


def evals_jsonl(evals: list[dict]) -> str:
    return "".join(json.dumps(finite_or_none(e), sort_keys=True) + "\n" for e in evals)


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters by name, on the CPU."""
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}


@torch.no_grad()
def load_trainable(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if set(params) != set(state):
        differ = sorted(set(params) ^ set(state))[:3]
        raise ValueError(f"checkpoint does not match the model's trainable parameters (e.g. {differ})")
    for n, p in params.items():
        p.copy_(state[n])


def read_run(root: Path) -> dict[str, Any]:
    """A run folder read back: ``config``, ``losses`` (one per update), ``evals`` (the validation history) and
    ``summary`` (``None`` while the run is unfinished)."""
    root = Path(root)
    if not (root / "config.json").exists():
        raise FileNotFoundError(f"{root} is not a run folder (no config.json)")
    losses_file, evals_file = root / "train_loss.csv", root / "validation.jsonl"
    losses = [float(line.split(",")[2]) for line in losses_file.read_text().splitlines()[1:]] \
        if losses_file.exists() else []
    evals = [json.loads(line) for line in evals_file.read_text().splitlines()] if evals_file.exists() else []
    summary = read_json(root / "summary.json") if (root / "summary.json").exists() else None
    return {"config": read_json(root / "config.json"), "losses": losses, "evals": evals, "summary": summary}
