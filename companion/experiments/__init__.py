"""The paper's experiments as code: one registry of setups at three scales and a resumable runner (``sec:exp``).

>>> from companion.experiments import describe, train
>>> describe("digits-mlp", "smoke")["trainable_parameters"]            # doctest: +SKIP
>>> train("digits-mlp", "ief", seed=0, scale="smoke", out="runs")       # doctest: +SKIP

Command line: ``python -m companion describe --setup S --scale X [--random-weights] [--json]`` and ``python -m companion
train --setup S --optimizer O --seed K --scale X --out DIR [--precision bf16]``. Modules: :mod:`.setups` (names and
sizes) with :mod:`.optimizer_tables` (hyperparameters), :mod:`.data`, :mod:`.models`, :mod:`.tasks` (inputs, targets,
predictions), :mod:`.metrics`, :mod:`.optimizers`, :mod:`.precision` (a run's forward precision), :mod:`.store` (the run
folder), :mod:`.runner` (a run) with :mod:`.run_checks` (its arguments checked), :mod:`.resume` (its checkpoints read
back) and :mod:`.run_log` (its printed lines), and :mod:`.setup_description` (a setup described).
"""
from .asset_folder import MissingResource
from .run_log import format_summary
from .runner import RunConflict, RunInterrupted, run_dir, train
from .setup_description import describe, format_describe
from .setups import CPU_SETUPS, OPTIMIZERS, PAPER_SETUPS, SCALES, SETUPS, resolve, scales_of

__all__ = [
    "SETUPS", "PAPER_SETUPS", "CPU_SETUPS", "SCALES", "OPTIMIZERS", "resolve", "scales_of", "describe", "train",
    "run_dir", "format_describe", "format_summary", "MissingResource", "RunInterrupted", "RunConflict",
]
