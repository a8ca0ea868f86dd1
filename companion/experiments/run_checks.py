"""The arguments of a run checked before anything is written: the setup's fields, the device and the learning rate.

:func:`.runner.train` calls these first, so that a bad ``--set``, ``--device`` or ``--lr`` is an error naming the
value and the accepted ones, and no run folder is created for it.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from . import store
from .setups import SetupConfig

DEVICES = "cpu, cuda, cuda:N, mps"


def _positive_int(field: str, value: Any, *, none_ok: bool = False) -> None:
    if none_ok and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"setup field {field} must be a positive integer{' or null' if none_ok else ''}, "
                         f"got {value!r}")


def check_setup(cfg: SetupConfig) -> SetupConfig:
    """The fields a run relies on, checked (``ValueError`` naming the field and the value); ``stage_fractions`` as a
    sorted tuple of floats."""
    _positive_int("epochs", cfg.epochs)
    _positive_int("batch_size", cfg.batch_size)
    _positive_int("eval_batch_size", cfg.eval_batch_size)
    _positive_int("eval_every", cfg.eval_every, none_ok=True)
    _positive_int("max_length", cfg.max_length, none_ok=True)
    if not isinstance(cfg.sizes, dict):
        raise ValueError(f"setup field sizes must be a mapping split -> size, got {cfg.sizes!r}")
    for split, size in cfg.sizes.items():
        _positive_int(f"sizes[{split!r}]", size, none_ok=True)
    fractions = cfg.stage_fractions
    bad = not isinstance(fractions, (list, tuple)) or not fractions or any(
        isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f <= 1 for f in fractions)
    if bad:
        raise ValueError(f"setup field stage_fractions must be a non-empty list of numbers in [0, 1], got "
                         f"{fractions!r}")
    names = [store.stage_name(f) for f in fractions]
    if len(set(names)) != len(names):
        raise ValueError(f"setup field stage_fractions {list(fractions)!r} name the same stage twice "
                         f"({sorted(names)}): fractions must differ by at least 0.01")
    return dataclasses.replace(cfg, stage_fractions=tuple(sorted(float(f) for f in fractions)))


def resolve_device(device: str | None) -> torch.device:
    """``device`` checked: known to torch, one of cpu / cuda[:N] / mps, and present here."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"unknown device {device!r}; valid devices: {DEVICES}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: no CUDA GPU is available here (torch {torch.__version__}); use "
                             f"--device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                             f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    elif dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"device {device!r}: MPS is not available here; use --device cpu")
    elif dev.type != "cpu":
        raise ValueError(f"device {device!r} is not supported; valid devices: {DEVICES}")
    return dev


def check_lr(lr: Any) -> float | None:
    """``lr`` as a float (``None`` kept: the registered rate); ``ValueError`` unless it is a finite number > 0."""
    if lr is None:
        return None
    try:
        value = float(lr)
    except (TypeError, ValueError):
        raise ValueError(f"lr must be a finite number > 0, got {lr!r}") from None
    if isinstance(lr, bool) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"lr must be a finite number > 0, got {lr!r}")
    return value

