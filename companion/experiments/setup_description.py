"""A setup described without training it: ``python -m companion describe`` (sources, sizes, schedule, optimisers'
hyperparameters, parameter counts beside the paper's)."""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from .data import FULL_SIZES, Data, load_data
from .models import build_model, count_parameters
from .runner import seed_everything
from .setups import resolve


def describe(setup: str, scale: str, *, random_weights: bool = False,
             overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The resolved setup: sources, data sizes, schedule, optimiser hyperparameters and parameter counts.

    ``random_weights=True`` builds the architecture from the config written in the code (no download); at full
    scale the data are then not loaded either and the sizes are the expected ones.
    """
    cfg = resolve(setup, scale, overrides)
    seed_everything(0)
    data: Data | None = None
    if scale == "full" and random_weights:
        sizes, sizes_source = dict(FULL_SIZES[cfg.task]), "expected (not loaded)"
    else:
        data = load_data(cfg)
        sizes, sizes_source = data.sizes(), "loaded"
    model, _ = build_model(cfg, data, random_weights=random_weights)
    total, trainable = count_parameters(model)
    spe = math.ceil(sizes["train"] / cfg.batch_size)
    paper = cfg.paper_trainable_parameters
    return {
        "setup": cfg.name, "scale": scale, "family": cfg.family, "method": cfg.method, "task": cfg.task,
        "model_source": "config (random weights)" if random_weights else cfg.model_source,
        "data_source": cfg.data_source, "sizes": sizes, "sizes_source": sizes_source,
        "num_classes": cfg.num_classes, "batch_size": cfg.batch_size, "epochs": cfg.epochs, "steps_per_epoch": spe,
        "total_steps": spe * cfg.epochs, "eval_every": cfg.eval_every or spe, "max_length": cfg.max_length,
        "optimizers": {k: dataclasses.asdict(v) for k, v in cfg.optimizers.items()},
        "total_parameters": total, "trainable_parameters": trainable,
        "paper_trainable_parameters": paper if scale == "full" else None,
        "difference_from_paper": trainable - paper if (paper is not None and scale == "full") else None,
        "provisional_hyperparameters": cfg.provisional, "notes": list(cfg.notes),
    }


def format_describe(d: dict[str, Any]) -> str:
    """:func:`describe`'s record as the lines ``python -m companion describe`` prints."""
    lines = [f"{d['setup']} [{d['scale']}]  {d['family']} / {d['method']} / {d['task']}",
             f"  model: {d['model_source']}", f"  data:  {d['data_source']}",
             f"  sizes ({d['sizes_source']}): " + ", ".join(f"{k} {v:,}" for k, v in d["sizes"].items()),
             f"  batch {d['batch_size']}, {d['epochs']} epochs x {d['steps_per_epoch']} steps = {d['total_steps']} "
             f"steps, validation every {d['eval_every']} steps" + (f", max_length {d['max_length']}"
                                                                  if d["max_length"] else ""),
             f"  parameters: total {d['total_parameters']:,}, trainable {d['trainable_parameters']:,}"
             + (f" (paper: {d['paper_trainable_parameters']:,}, difference {d['difference_from_paper']:+,})"
                if d["paper_trainable_parameters"] is not None else "")]
    lines.append("  optimizers" + (" (PROVISIONAL)" if d["provisional_hyperparameters"] else "") + ":")
    for name, o in d["optimizers"].items():
        extra = "".join(f", {k}={o[k]}" for k in ("weight_decay", "damping") if o[k])
        ms = f" {tuple(o['milestones'])}" if o["milestones"] else ""
        lines.append(f"    {name:9s} lr={o['lr']:g}{extra}, {o['schedule']}{ms}  [{o['source']}]")
    lines += [f"  note: {n}" for n in d["notes"]]
    return "\n".join(lines)
