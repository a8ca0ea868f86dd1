"""Tables of the setups chapter (``notebooks/setups.ipynb``): the paper's Tables 2-4 regenerated from the setup
registry (:mod:`companion.experiments.setups`) and the asset registry (:mod:`companion.experiments.assets`)."""
from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from ..experiments.asset_folder import assets_dir, held
from ..experiments.assets import ASSETS, package_licence, usage
from ..experiments.data import FULL_SIZES
from ..experiments.setups import (CPU_SETUPS, GLUE_LABEL_WORDS, GLUE_PROMPTS, GLUE_SCHEDULE, GLUE_TASKS, SETUPS,
                                  resolve, scales_of)

TASK_NAMES = {"cola": "CoLA", "sst2": "SST-2", "mrpc": "MRPC", "qqp": "QQP", "mnli": "MNLI", "qnli": "QNLI",
              "rte": "RTE", "cifar100": "CIFAR100", "cifar10": "CIFAR10", "digits": "digits", "tweets": "tweets"}


def glue_details() -> pd.DataFrame:
    """Table 2: input format and label words of the 7 GLUE tasks, as the T5 setups use them."""
    order = ("cola", "sst2", "qqp", "mrpc", "mnli", "qnli", "rte")  # the paper's row order
    assert set(order) == set(GLUE_TASKS)
    return pd.DataFrame([{"Task": TASK_NAMES[t], "Input Format": GLUE_PROMPTS[t],
                          "Labels (class 0, 1, ...)": ", ".join(GLUE_LABEL_WORDS[t])}
                         for t in order]).set_index("Task")


def train_epochs() -> pd.DataFrame:
    """Table 3: train epochs and evaluation frequency (update steps between validations) of the full setups."""
    rows = [{"Task": TASK_NAMES[t], "Train Epochs": GLUE_SCHEDULE[t][0], "Evaluation Frequency": GLUE_SCHEDULE[t][1]}
            for t in ("cola", "sst2", "qqp", "mrpc", "mnli", "qnli", "rte")]
    vit = resolve("cifar100-vit-lora", "full")
    rows.append({"Task": "CIFAR100", "Train Epochs": vit.epochs, "Evaluation Frequency": vit.eval_every})
    return pd.DataFrame(rows).set_index("Task")


def setups_at(scale: str) -> pd.DataFrame:
    """Every setup at ``scale``: model, data, sizes, batch, epochs, validation frequency and update steps."""
    rows = []
    for name in SETUPS:
        if scale not in scales_of(name):
            continue
        cfg = resolve(name, scale)
        sizes = dict(cfg.sizes)
        if any(v is None for v in sizes.values()):  # whole splits: the expected sizes of the hub data
            full = FULL_SIZES[cfg.task]
            sizes = {k: (v if v is not None else sum(n for s, n in full.items() if s.startswith(k))) for k, v in
                     sizes.items()}
        per_epoch = math.ceil(sizes["train"] / cfg.batch_size)
        rows.append({"setup": name, "model": cfg.model_source, "data": cfg.data_source,
                     "train / validation / test": " / ".join(f"{sizes[k]:,}" for k in ("train", "validation", "test")),
                     "batch": cfg.batch_size, "epochs": cfg.epochs,
                     "validation every": f"{cfg.eval_every} steps" if cfg.eval_every else "epoch",
                     "update steps": f"{cfg.epochs * per_epoch:,}"})
    return pd.DataFrame(rows).set_index("setup")


def _held_text(entries: list[dict] | None, key: str) -> str:
    """One cell of the assets-folder column: what the folder holds of an asset (revision, bytes) or that it lacks it."""
    if key not in HUB_ASSETS:
        return "-"
    if not entries:
        return "not held (python -m companion assets download --scale full --to DIR)"
    return "; ".join(f"{e['name'].split(' ', 1)[1]} @ {e['revision'][:12]} ({e['bytes']:,} bytes)" for e in entries)


HUB_ASSETS = ("t5-base", "vit-b16", "glue", "cifar")  # what full scale loads from the hub (an assets folder holds)


def licences(scale: str, assets: str | Path | None = None) -> pd.DataFrame:
    """Table 4 at one scale: every asset the setups use, with its licence and the licence of the package it ships in
    (read from the installed package metadata).

    Args:
        scale: ``full``, ``cpu`` or ``smoke``.
        assets: an assets folder (:mod:`companion.experiments.asset_folder`; default ``IEF_ASSETS``). At ``full`` with a
            folder, a column ``in the assets folder`` lists what it holds of each asset (revision and bytes from its
            manifest) or that it lacks it.

    Returns:
        One row per asset.
    """
    folder = Path(assets) if assets is not None else assets_dir()
    holdings = held(folder) if folder is not None and scale == "full" else None
    rows = []
    for key, names in usage(scale).items():
        a = ASSETS[key]
        every = sum(scale in scales_of(n) for n in SETUPS)
        used = (f"all {every} setups" if len(names) == every else ", ".join(names) if len(names) <= 3
                else f"{len(names)} setups: {names[0]} ... {names[-1]}")
        rows.append({"Asset Name": f"{a.name} ({a.kind})", "source": a.source, "License": a.licence,
                     "documented in": a.licence_note + (f"; cite {a.citation}" if a.citation else ""),
                     "package licence (metadata)": package_licence(a.package), "used by": used})
        if holdings is not None:
            rows[-1]["in the assets folder"] = _held_text(holdings.get(key), key)
    return pd.DataFrame(rows).set_index("Asset Name")


def cpu_siblings() -> pd.DataFrame:
    """Which paper setup each cpu setup stands in for."""
    stand_in = {"digits-mlp": "cifar10-mlp", "tweets-minilm-lora": "*-t5-lora", "tweets-minilm-pt": "*-t5-pt"}
    return pd.DataFrame([{"cpu setup": n, "stands in for": stand_in[n], "notes": resolve(n, "cpu").notes[0]}
                         for n in CPU_SETUPS]).set_index("cpu setup")
