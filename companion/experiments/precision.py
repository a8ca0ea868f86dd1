"""A run's forward precision (``python -m companion train --precision``): float32 (the default) or bfloat16 autocast.

``bfloat16`` (alias ``bf16``) runs every forward of the run, the training steps' (the per-sample backward of iEF, EF
and SF included) and the validation and test evaluations', under ``torch.autocast(device, torch.bfloat16)``: the
parameters, the optimiser states and the checkpoints stay float32, the matrix products round to bfloat16, and the
library accumulates and solves wider (the contract of :mod:`ief.precision`). float16 is refused with the library's
reason (:func:`ief.refuse_float16`).

A bfloat16 run is a different run from a float32 one: its folder is ``OUT/bfloat16/<scale>/<setup>/<optimizer>/
seed-<K>`` (:func:`run_folder`), never the float32 run's, so it neither overwrites nor resumes a float32 run, and the
E2 aggregate of ``OUT/<scale>`` does not take it in; ``config.json`` and ``summary.json`` record ``precision``.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from ief import refuse_float16

DEFAULT = "float32"
PRECISIONS = {"float32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}  # accepted name -> recorded name
ACCEPTED = "float32 (the default), bfloat16 or bf16"
FLOAT16_NAMES = ("float16", "fp16", "half")
AUTOCAST_DTYPE = {"bfloat16": torch.bfloat16}


def check_precision(value: object) -> str:
    """The recorded name of a precision (``"float32"`` or ``"bfloat16"``).

    Args:
        value: ``"float32"``, ``"bfloat16"`` or ``"bf16"`` (case-insensitive).

    Returns:
        ``"float32"`` or ``"bfloat16"``.

    Raises:
        ValueError: float16 (the library's reason, :func:`ief.refuse_float16`), or any other value (the
            sentence names it and the accepted ones).
    """
    name = value.strip().lower() if isinstance(value, str) else value
    if name in FLOAT16_NAMES:
        try:
            refuse_float16([torch.float16])
        except ValueError as err:
            raise ValueError(f"precision {value!r}: {err}") from None
    if name not in PRECISIONS:
        raise ValueError(f"unknown precision {value!r}; accepted: {ACCEPTED}")
    return PRECISIONS[name]


def forward_precision(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The context a run's forwards (training steps and evaluations) run in.

    Args:
        precision: a checked precision (:func:`check_precision`).
        device: the run's device.

    Returns:
        ``torch.autocast(device.type, torch.bfloat16)`` for ``"bfloat16"``, a null context for ``"float32"``.
    """
    if precision == DEFAULT:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=AUTOCAST_DTYPE[precision])


def run_folder(out: str | Path, precision: str) -> Path:
    """The folder a run of ``precision`` goes under: ``out`` for float32, ``out/bfloat16`` for bfloat16.

    Args:
        out: the runs folder (``--out``).
        precision: ``"float32"``, ``"bfloat16"`` or ``"bf16"``.

    Returns:
        The folder that holds ``<scale>/<setup>/<optimizer>/seed-<K>``.

    Raises:
        ValueError: ``precision`` is not accepted (:func:`check_precision`).
    """
    name = check_precision(precision)
    return Path(out) if name == DEFAULT else Path(out) / name
