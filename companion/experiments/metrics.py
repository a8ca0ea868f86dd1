"""Metrics as the paper reports them (``tab:sum-test`` and the GLUE conventions it follows) and GLUE submission files.

Accuracy everywhere; Matthews correlation for CoLA; F1 (positive class 1: equivalent / duplicate) and accuracy for
MRPC and QQP; matched and mismatched accuracy for MNLI. A checkpoint's *score* (used to pick the best validation
checkpoint) is the mean of its metrics, as GLUE averages a task's metrics (``tab:sum-test``).
"""
from __future__ import annotations

import csv
import io
import math
from pathlib import Path

import torch

from .setups import GLUE_TASKS
from .store import write_atomically


def accuracy(pred: torch.Tensor, gold: torch.Tensor) -> float:
    return float((pred == gold).double().mean()) if len(gold) else float("nan")


def f1_binary(pred: torch.Tensor, gold: torch.Tensor, positive: int = 1) -> float:
    tp = int(((pred == positive) & (gold == positive)).sum())
    fp = int(((pred == positive) & (gold != positive)).sum())
    fn = int(((pred != positive) & (gold == positive)).sum())
    return 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0


def matthews(pred: torch.Tensor, gold: torch.Tensor) -> float:
    """Matthews correlation of binary labels (0 when a row or column of the confusion matrix is empty)."""
    tp = int(((pred == 1) & (gold == 1)).sum())
    tn = int(((pred == 0) & (gold == 0)).sum())
    fp = int(((pred == 1) & (gold == 0)).sum())
    fn = int(((pred == 0) & (gold == 1)).sum())
    den = math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    return (tp * tn - fp * fn) / den if den else 0.0


def split_metrics(task: str, split: str, pred: torch.Tensor, gold: torch.Tensor) -> dict[str, float]:
    """The metrics of one evaluation split (e.g. ``validation_matched`` -> ``accuracy_matched``)."""
    if task == "cola":
        out = {"matthews_correlation": matthews(pred, gold)}
    elif task in ("mrpc", "qqp"):
        out = {"f1": f1_binary(pred, gold), "accuracy": accuracy(pred, gold)}
    else:
        out = {"accuracy": accuracy(pred, gold)}
    suffix = split.split("_", 1)[1] if "_" in split else ""
    return {f"{k}_{suffix}" if suffix else k: v for k, v in out.items()}


def score(metrics: dict[str, float]) -> float:
    """The mean of a split's metrics (GLUE's per-task average)."""
    return sum(metrics.values()) / len(metrics)


# GLUE submission format: one TSV per task, "index<TAB>prediction", labels as the GLUE server expects them.
_GLUE_FILES = {"cola": "CoLA", "sst2": "SST-2", "mrpc": "MRPC", "qqp": "QQP", "qnli": "QNLI", "rte": "RTE",
               "mnli_matched": "MNLI-m", "mnli_mismatched": "MNLI-mm"}
_GLUE_NAMES = {"mnli": ("entailment", "neutral", "contradiction"), "qnli": ("entailment", "not_entailment"),
               "rte": ("entailment", "not_entailment")}


def write_glue_predictions(task: str, split: str, idx: list[int], pred: torch.Tensor, directory: Path) -> Path:
    """Write ``<Task>.tsv`` (``MNLI-m.tsv`` / ``MNLI-mm.tsv`` for MNLI) atomically; returns its path."""
    if task not in GLUE_TASKS:
        raise ValueError(f"{task!r} is not a GLUE task")
    key = f"mnli_{split.split('_', 1)[1]}" if task == "mnli" else task
    path = Path(directory) / f"{_GLUE_FILES[key]}.tsv"
    names = _GLUE_NAMES.get(task)
    text = io.StringIO(newline="")
    writer = csv.writer(text, delimiter="\t", lineterminator="\n")
    writer.writerow(["index", "prediction"])
    for i, p in zip(idx, pred.tolist()):
        writer.writerow([int(i), names[p] if names else int(p)])
    write_atomically(path, text.getvalue())
    return path
