"""What a full-scale run costs: its update steps (from the registry and the expected full data sizes) and the compute
the paper reports for its runs (Appendix H.3 of the paper), to warn before a run and to quote in prose.

"For standard SGD/AdamW/Adafactor/EF/iEF optimisers, on average each complete run takes 10 hours. The slowest task
(QQP + LoRA) takes 20 hours and the quickest task (RTE + Prompt Tuning) takes 0.3 hours" (8 A100 80 GB GPUs); SF
adds 60 % to the runtime.
"""
from __future__ import annotations

import math

from .data import FULL_SIZES
from .setups import resolve

PAPER_RUN_HOURS = {"mean": 10.0, "slowest": ("qqp-t5-lora", 20.0), "quickest": ("rte-t5-pt", 0.3)}
SF_EXTRA = 0.6  # SF's additional back-propagation: +60 % runtime


def cost_warning(setup: str, scale: str, optimizer: str) -> str | None:
    """A loud warning, before a full-scale run starts, with its update steps and the paper's hours.

    The steps come from the registry and the expected full data sizes (``companion.experiments.data.FULL_SIZES``), so
    nothing is downloaded to say how long the run is.

    Args:
        setup: a setup of the registry (``companion.experiments.SETUPS``), e.g. ``"rte-t5-pt"``.
        scale: ``"smoke"``, ``"cpu"`` or ``"full"``; only ``"full"`` warns.
        optimizer: the run's optimiser (``"sf"`` adds the paper's 60 % for its extra back-propagation).

    Returns:
        The warning (several lines, framed by ``!``), or ``None`` below full scale.

    Raises:
        ValueError: ``setup`` or ``scale`` unknown to the registry (the message names the accepted ones).
    """
    if scale != "full":
        return None
    cfg = resolve(setup, scale)
    per_epoch = math.ceil(FULL_SIZES[cfg.task]["train"] / cfg.batch_size)
    (slow_name, slow), (quick_name, quick) = PAPER_RUN_HOURS["slowest"], PAPER_RUN_HOURS["quickest"]
    factor = 1 + SF_EXTRA if optimizer == "sf" else 1.0
    if setup in (slow_name, quick_name):
        estimate = f"about {(slow if setup == slow_name else quick) * factor:g} hours"
    else:
        estimate = (f"about {PAPER_RUN_HOURS['mean'] * factor:g} hours on average per run "
                    f"({quick * factor:g} h for {quick_name} to {slow * factor:g} h for {slow_name})")
    bar = "!" * 100
    return (f"{bar}\nFULL SCALE: {setup} with {optimizer} runs {cfg.epochs * per_epoch:,} update steps "
            f"({cfg.epochs} epochs x {per_epoch:,} steps of batch {cfg.batch_size}).\n"
            f"The paper reports {estimate} on A100 GPUs (Appendix H.3). This needs a GPU and the Hugging Face hub "
            f"(or its cache). The run checkpoints and resumes: interrupt it and rerun the same command.\n{bar}")


def cost_summary(setup: str, optimizer: str) -> str:
    """One line for prose: the full-scale run's update steps and the hours the paper reports (Appendix H.3).

    Args:
        setup: a setup of the registry (``companion.experiments.SETUPS``), e.g. ``"rte-t5-pt"``.
        optimizer: the optimiser the sentence names.

    Returns:
        ``"<steps> update steps of <setup> with <optimizer>; the paper reports about ..."``.

    Raises:
        ValueError: ``setup`` unknown to the registry (the message names the accepted ones).
    """
    cfg = resolve(setup, "full")
    steps = cfg.epochs * math.ceil(FULL_SIZES[cfg.task]["train"] / cfg.batch_size)
    (slow_name, slow), (quick_name, quick) = PAPER_RUN_HOURS["slowest"], PAPER_RUN_HOURS["quickest"]
    return (f"{steps:,} update steps of {setup} with {optimizer}; the paper reports about "
            f"{PAPER_RUN_HOURS['mean']:g} hours per run on average on A100 GPUs ({quick:g} h for {quick_name} to "
            f"{slow:g} h for {slow_name}; Appendix H.3)")
