"""Reading a run's checkpoints back: ``resume.pt`` (or the previous one) and the best-validation parameters.

What :class:`.runner.TrainingLoop` saves, :func:`resume_state` restores (parameters, optimiser, scheduler, every
RNG state, the run state); :func:`load_best` finds the best-validation parameters, in ``checkpoints/best.pt`` or
another checkpoint of the same step. A file that cannot be used is a :class:`.store.CorruptFile` naming it and the
remedy.
"""
from __future__ import annotations

import contextlib
import os
import random
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import store


def rng_state() -> dict[str, Any]:
    """Every RNG state a run draws from: torch (and CUDA's), Python's and numpy's."""
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


RESUME_KEYS = ("model", "optimizer", "scheduler", "state", "rng")


def resume_state(root: Path, model: torch.nn.Module, opt: Any, scheduler: Any) -> dict[str, Any] | None:
    """Load ``resume.pt``, or ``resume.prev.pt`` when it cannot be read or does not fit; the run state or ``None``
    (no checkpoint: start). :class:`.store.CorruptFile` naming the files when neither can be used."""
    problems = []
    for name in ("resume.pt", "resume.prev.pt"):
        path = root / name
        if not path.exists():
            continue
        try:
            ck = store.read_torch(path)
            if not isinstance(ck, dict) or not set(RESUME_KEYS) <= set(ck):
                raise store.CorruptFile(f"{path} is not a resume checkpoint (keys {RESUME_KEYS} expected)")
            try:
                store.load_trainable(model, ck["model"])
                opt.load_state_dict(ck["optimizer"])
                if scheduler is not None:
                    scheduler.load_state_dict(ck["scheduler"])
                state = dict(ck["state"])
                set_rng_state(ck["rng"])
            except (ValueError, KeyError, TypeError, RuntimeError) as err:
                raise store.CorruptFile(f"{path} does not fit this run ({type(err).__name__}: {err})") from None
        except store.CorruptFile as err:
            problems.append(str(err))
            continue
        if problems:
            warnings.warn(f"{problems[0]}; resumed from the previous checkpoint {path} (step {state['done']})",
                          RuntimeWarning, stacklevel=3)
            with contextlib.suppress(OSError):
                os.replace(root / "resume.pt", root / "resume.pt.corrupt")  # kept for inspection, out of the way
        return state
    if problems:
        raise store.CorruptFile(f"{'; '.join(problems)}; no readable resume checkpoint: remove "
                                f"{root / 'resume.pt'} (and resume.prev.pt) to restart this run from step 0, or "
                                f"restore it from a backup")
    return None


def load_best(root: Path, model: torch.nn.Module, state: dict[str, Any], candidates: list[Path]) -> None:
    """Put the best-validation parameters into ``model``: ``checkpoints/best.pt``, or, when it is missing or cannot
    be read, another checkpoint of the same step (rewritten as best.pt); else :class:`.store.CorruptFile`."""
    best = root / "checkpoints" / "best.pt"
    try:
        store.load_trainable(model, store.read_trainable(best))
        return
    except (FileNotFoundError, ValueError) as err:  # CorruptFile is a ValueError, as is a mismatch
        problem = f"{err}" if best.name in str(err) else f"{best}: {err}"
    step = state["best"]["step"]
    found = None
    if step == state["done"]:  # the model holds the parameters after the last update (or before a failed one)
        found = f"the parameters after update {step} (resume state)"
    for path in candidates if found is None else []:
        try:
            store.load_trainable(model, store.read_trainable(path))
        except (FileNotFoundError, ValueError):
            continue
        found = str(path.relative_to(root))
        break
    if found is None:
        raise store.CorruptFile(f"{problem}; no other checkpoint holds the parameters of the best validation (step "
                                f"{step}): remove {root} to train this run again")
    warnings.warn(f"{problem}; the best-validation parameters (step {step}) were taken from {found} and best.pt "
                  f"rewritten", RuntimeWarning, stacklevel=4)
    store.write_torch(best, store.trainable_state(model))

