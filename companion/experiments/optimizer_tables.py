"""The optimisers' hyperparameters of the setup registry (:mod:`.setups`), per fine-tuning method: the paper's values
(``sec:app-optimiser``, ``sec:app-mlp-cifar10``), the values marked ``not in the paper`` for combinations it did not
run, the beyond-the-paper optimisers (iEF with momentum, the K-FAC family), and the cpu setups' searched learning
rates (:data:`CPU_LEARNING_RATES`). Like :mod:`.setups` it imports nothing beyond the standard library: the workflow
loads both at parse time, where torch may be absent.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class OptimizerConfig:
    """One optimiser's hyperparameters. ``schedule``: ``constant``; ``normalised-linear`` (each update rescaled to
    norm ``lr``, decaying linearly to 0 over the run: the paper's EF/SF schedule); ``multistep`` (``lr`` times
    ``gamma`` at each epoch in ``milestones``: the paper's Adam/SGD schedule for the MLP)."""

    name: str
    lr: float
    weight_decay: float = 0.0
    damping: float | None = None
    schedule: str = "constant"
    milestones: tuple[int, ...] = ()
    gamma: float = 0.1
    options: dict[str, Any] = field(default_factory=dict)
    source: str = ""



_NOT_IN_PAPER = "not in the paper"
_ADAFACTOR = dict(scale_parameter=False, relative_step=False, warmup_init=False, decay_rate=-0.8, clip_threshold=1.0)


# The paper's EF/SF/iEF values are for its code's loss, the mean over the batch's target tokens; they are converted to
# ief's sum convention for every batch (companion.experiments.convention). Setups searched here (cpu) are in ief's
# convention.
_TOKEN_MEAN = {"convention": "token-mean",
               "sum_convention": "per batch of K target tokens: iEF lr/K, damping*K^2; normalised EF/SF lr, "
                                 "damping*K^2; un-normalised EF/SF lr*K, damping*K^2 "
                                 "(companion.experiments.convention)"}


def _paper_rates(token_mean: bool) -> dict[str, Any]:
    return dict(_TOKEN_MEAN) if token_mean else {}


def pt_optimizers(source: str, token_mean: bool = True) -> dict[str, OptimizerConfig]:
    """Prompt tuning (sec:app-optimiser, "Prompt Tuning + T5-base on GLUE"). Adafactor's "beta_2 = 0.8" is the
    T5X ``decay_rate=0.8`` (beta_2 at step t = 1 - t^-0.8), which transformers' Adafactor spells ``decay_rate=-0.8``.

    Args:
        source: where the values come from, written into each row's ``source`` (rows not in the paper keep their own).
        token_mean: EF/SF/iEF rates and dampings in the paper's token-mean convention (converted per batch); False:
            in ief's sum convention, as the cpu searches chose them.

    Returns:
        ``{optimizer name: OptimizerConfig}``: the E2 optimisers of the method, then the practical ones it defines.
    """
    o = _paper_rates(token_mean)
    table = {
        "adafactor": OptimizerConfig("adafactor", 0.3, weight_decay=1e-5, options=dict(_ADAFACTOR), source=source),
        "sgd": OptimizerConfig("sgd", 100.0, source=source),
        "ief": OptimizerConfig("ief", 50.0, damping=1e-12, options=dict(o), source=source),
        "ef": OptimizerConfig("ef", 1.0, damping=1e-12, schedule="normalised-linear", options=dict(o), source=source),
        "sf": OptimizerConfig("sf", 1.0, damping=1e-12, schedule="normalised-linear", options=dict(o), source=source),
        "adamw": OptimizerConfig("adamw", 0.03, weight_decay=1e-5,
                                 source=f"{_NOT_IN_PAPER} (peft's prompt-tuning examples use AdamW lr 3e-2)"),
    }
    # prompt embeddings are not nn.Linear: no K-FAC family
    return {**table, **_practical_optimizers(table["ief"], linear=False, kfac_damping=0.0)}


def lora_optimizers(source: str, token_mean: bool = True) -> dict[str, OptimizerConfig]:
    """LoRA (sec:app-optimiser, "LoRA + T5-base on GLUE"; "the same hyperparameters" for ViT + CIFAR100), with the
    K-FAC family (LoRA's trainable parameters are ``nn.Linear``). Args and Returns: as :func:`pt_optimizers`."""
    o = _paper_rates(token_mean)
    table = {
        "adamw": OptimizerConfig("adamw", 1e-3, weight_decay=1e-2, source=source),
        "sgd": OptimizerConfig("sgd", 0.1, source=source),
        "ief": OptimizerConfig("ief", 100.0, damping=1e-7, options=dict(o), source=source),
        "ef": OptimizerConfig("ef", 0.01, damping=1e-7, schedule="normalised-linear", options=dict(o), source=source),
        "sf": OptimizerConfig("sf", 0.01, damping=1e-7, schedule="normalised-linear", options=dict(o), source=source),
        "adafactor": OptimizerConfig("adafactor", 1e-3, weight_decay=1e-5, options=dict(_ADAFACTOR),
                                     source=f"{_NOT_IN_PAPER} (prompt tuning's Adafactor settings, AdamW's lr)"),
    }
    # LoRA's trainable parameters are nn.Linear (the adapters; a classifier head where there is one). K-FAC damping 1:
    # on tweets-minilm-lora (sum over 32 samples) 1e-2 reached 40.6 % validation at lr 0.01, 1 reached 61.3 % (a probe
    # before the search); the MLP's value too
    return {**table, **_practical_optimizers(table["ief"], linear=True, kfac_damping=1.0)}


def mlp_optimizers(source: str, milestone: int, token_mean: bool = True) -> dict[str, OptimizerConfig]:
    """The MLP (sec:app-mlp-cifar10): multi-step (x0.1) schedule for Adam and SGD, constant iEF, normalised linear
    EF/SF. The paper states no damping for this experiment; iEF/EF/SF use the LoRA value 1e-7 here. The token-mean
    convention (K = M, the batch mean of torch's cross-entropy) is assumed: no code was released for this setup.

    Args:
        source: where the values come from, written into each row's ``source`` (rows not in the paper keep their own).
        milestone: the epoch at which Adam's and SGD's rate is multiplied by 0.1.
        token_mean: EF/SF/iEF rates and dampings in the paper's token-mean convention (converted per batch); False:
            in ief's sum convention, as the cpu searches chose them.

    Returns:
        ``{optimizer name: OptimizerConfig}``: the E2 optimisers of the method, then the practical ones it defines.
    """
    ms = (milestone,)
    damping_note = f"{source}; damping not stated in the paper (1e-7 as for LoRA)"
    o = _paper_rates(token_mean)
    table = {
        "adam": OptimizerConfig("adam", 1e-4, schedule="multistep", milestones=ms, source=source),
        "sgd": OptimizerConfig("sgd", 0.1, schedule="multistep", milestones=ms, source=source),
        "ief": OptimizerConfig("ief", 50.0, damping=1e-7, options=dict(o), source=damping_note),
        "ef": OptimizerConfig("ef", 1e-4, damping=1e-7, schedule="normalised-linear", options=dict(o),
                              source=damping_note),
        "sf": OptimizerConfig("sf", 0.1, damping=1e-7, schedule="normalised-linear", options=dict(o),
                              source=damping_note),
        "adamw": OptimizerConfig("adamw", 1e-4, weight_decay=1e-2, schedule="multistep", milestones=ms,
                                 source=f"{_NOT_IN_PAPER} (Adam's lr and schedule, AdamW's weight decay)"),
        "adafactor": OptimizerConfig("adafactor", 1e-3, weight_decay=0.0, options=dict(_ADAFACTOR),
                                     source=f"{_NOT_IN_PAPER} (prompt tuning's Adafactor settings)"),
    }
    # K-FAC damping 1: on digits-mlp (sum over 64 samples) 0.1 diverged at every rate 0.01..1 and 1 reached 97.5 %
    # validation at lr 0.01 (a probe before the search)
    return {**table, **_practical_optimizers(table["ief"], linear=True, kfac_damping=1.0)}


_PRACTICAL = "ours, beyond the paper"
# iEF + momentum + decoupled weight decay (ief.optim.momentum): momentum 0.9 with dampening 0.9 (the exponential
# average: a constant direction is stepped lr far, so the rate keeps iEF's meaning); weight decay 1e-4 (a shrink of
# lr * 1e-4 per step: about AdamW's lr 1e-3 * 1e-2 per step on LoRA at iEF's lr ~0.3)
_MOMENTUM = {"momentum": 0.9, "dampening": 0.9}
# the K-FAC family (ief.optim.KFAC): running factors (decay 0.95), eigendecompositions every 10 steps, Tikhonov
# damping on the whole Kronecker block; the sum convention only (KFAC refuses reduction="mean")
_KFAC = {"factor_decay": 0.95, "inverse_every": 10}


def _practical_optimizers(ief: OptimizerConfig, linear: bool, kfac_damping: float) -> dict[str, OptimizerConfig]:
    """The beyond-the-paper optimisers of a method: ``ief-momentum`` (from its ``ief`` row: the same rate, damping
    and loss convention) and, where every trainable parameter is an ``nn.Linear`` (``linear``), K-FAC, eKFAC and
    ieKFAC with ``kfac_damping``. Rates: iEF's for ``ief-momentum``, 0.1 for the K-FAC family (the cpu searches
    replace them; at full scale they are not searched: provisional)."""
    out = {"ief-momentum": dataclasses.replace(ief, name="ief-momentum", weight_decay=1e-4,
                                               options={**ief.options, **_MOMENTUM}, source=_PRACTICAL)}
    if linear:
        for kind in ("kfac", "ekfac", "iekfac"):
            out[kind] = OptimizerConfig(kind, 0.1, damping=kfac_damping, options=dict(_KFAC), source=_PRACTICAL)
    return out


# Chosen by `python -m companion search --scale cpu` (companion.experiments.search): one seed per rate, the paper's
# grids, the best validation score. The records, with every trial, are companion/experiments/lr_search/cpu-<setup>.json;
# a test keeps this table equal to them.
CPU_LEARNING_RATES: dict[str, dict[str, float]] = {
    "digits-mlp": {"adam": 1e-2, "adamw": 1e-2, "adafactor": 1e-2, "sgd": 0.5, "ief": 3.0, "ef": 10.0, "sf": 0.1,
                   "ief-momentum": 0.3, "kfac": 0.01, "ekfac": 0.01, "iekfac": 0.01},
    "tweets-minilm-lora": {"adamw": 3e-3, "adafactor": 1e-2, "sgd": 1.0, "ief": 0.3, "ef": 0.1, "sf": 1.0,
                           "ief-momentum": 1.0, "kfac": 0.03, "ekfac": 0.03, "iekfac": 0.03},
    "tweets-minilm-pt": {"adafactor": 0.03, "adamw": 1e-2, "sgd": 1.0, "ief": 1.0, "ef": 0.1, "sf": 1.0,
                         "ief-momentum": 0.3},
}


def cpu_searched(name: str, base: dict[str, OptimizerConfig]) -> tuple[dict[str, OptimizerConfig], bool]:
    """Setup ``name``'s optimiser table with the learning rates its cpu search chose (:data:`CPU_LEARNING_RATES`).

    Args:
        name: a cpu setup.
        base: its optimiser table before the search (``pt_optimizers`` and the like).

    Returns:
        ``(table, provisional)``: every searched row takes the chosen rate and says so in its ``source``; a row (or a
        setup) without a recorded search is marked ``PROVISIONAL``, and ``provisional`` is True when the setup has none.
    """
    chosen = CPU_LEARNING_RATES.get(name)
    if chosen is None:
        return {o: dataclasses.replace(c, source=f"PROVISIONAL ({c.source}) pending a learning-rate search")
                for o, c in base.items()}, True
    where = f"cpu lr search: companion/experiments/lr_search/cpu-{name}.json"
    return {o: dataclasses.replace(c, lr=chosen[o], source=f"{where}; other values: {c.source}") if o in chosen
            else dataclasses.replace(c, source=f"PROVISIONAL ({c.source}) pending a learning-rate search")
            for o, c in base.items()}, False
