"""Train one (setup, optimiser, seed, scale) run, resumably, and describe a setup (``sec:exp``, ``sec:opt-exp``).

A run follows the paper's protocol (``sec:app-optimiser``): batches of the setup's size drawn without replacement
each epoch, validation every ``eval_every`` update steps (tab:train-epochs) and at the end, the best-validation
checkpoint kept and its test metrics reported; ``final_train_loss`` is the mean loss of the last 100 steps.

Resuming: ``resume.pt`` holds the trainable parameters, the optimiser and scheduler states, every RNG state, the
position in the data (epoch orders are a function of the seed and the epoch, so the step count is the position)
and the histories. It is written every ``checkpoint_every_s`` seconds of wall time and when SIGTERM or SIGINT
arrives (the signal is honoured after the current update, or aborts an evaluation, whose result is then recomputed
on resume). A second signal stops at once; the last checkpoint stays valid because every file is written
atomically. Evaluation touches no RNG and no parameter, so a resumed run ends with exactly the numbers of an
uninterrupted one. A run whose ``summary.json`` exists is skipped.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from . import store
from .data import FULL_SIZES, Data, load_data
from .metrics import score, split_metrics, write_glue_predictions
from .models import build_model, count_parameters
from .optimizers import Diverged, make_optimizer, train_step
from .setups import GLUE_TASKS, SetupConfig, optimizer_config, resolve
from .tasks import make_task, to_device


class RunInterrupted(Exception):
    """SIGTERM / SIGINT stopped the run after saving ``resume.pt``; the same command resumes it."""

    def __init__(self, signum: int, where: str):
        self.signum = signum
        super().__init__(f"{signal.Signals(signum).name} received {where}; resume.pt saved: run the same command "
                         f"again to resume")


class RunConflict(ValueError):
    """The run folder holds a run with a different configuration."""


class _Aborted(Exception):
    pass


class _Signals:
    """SIGINT/SIGTERM set ``pending`` (handled at the next safe point); a second one raises KeyboardInterrupt."""

    def __init__(self) -> None:
        self.pending: int | None = None
        self._old: dict[int, Any] = {}

    def __enter__(self) -> "_Signals":
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.pending is not None:
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: stopping without saving")
        self.pending = signum

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)


def run_dir(out: str | Path, scale: str, setup: str, optimizer: str, seed: int) -> Path:
    return Path(out) / scale / setup / optimizer / f"seed-{seed}"


def _rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def epoch_order(seed: int, epoch: int, n: int) -> np.ndarray:
    """The order of the training examples in one epoch: a function of (seed, epoch) only."""
    return np.random.default_rng([seed, epoch]).permutation(n)


def evaluate(model: torch.nn.Module, task: Any, sets: dict[str, Any], device: torch.device, batch_size: int, *,
             abort: Any = lambda: False, progress: bool = False) -> dict[str, dict[str, Any]]:
    """Predictions on every split: ``{split: {"pred", "gold", "idx"}}``; ``abort()`` is polled between batches."""
    model.eval()
    out = {}
    try:
        for name, examples in sets.items():
            preds, gold, idx = [], [], []
            for lo in tqdm(range(0, len(examples), batch_size), desc=f"eval {name}", leave=False,
                           disable=not progress):
                if abort():
                    raise _Aborted
                batch = [examples[i] for i in range(lo, min(lo + batch_size, len(examples)))]
                preds.append(task.predict(model, batch, device))
                gold += [int(e["label"]) for e in batch]
                idx += [int(e.get("idx", lo + k)) for k, e in enumerate(batch)]
            out[name] = {"pred": torch.cat(preds) if preds else torch.zeros(0, dtype=torch.long),
                         "gold": torch.tensor(gold, dtype=torch.long), "idx": idx}
    finally:
        model.train()
    return out


def metrics_of(task_name: str, results: dict[str, dict[str, Any]]) -> dict[str, float] | None:
    """The metrics of every labelled split merged (None when the labels are private, as for GLUE test)."""
    merged: dict[str, float] = {}
    for name, r in results.items():
        if len(r["gold"]) == 0 or bool((r["gold"] < 0).any()):
            return None
        merged.update(split_metrics(task_name, name, r["pred"], r["gold"]))
    return merged


def _run_record(cfg: SetupConfig, opt: Any, seed: int) -> dict[str, Any]:
    record = {"setup": cfg.to_dict(), "optimizer": dataclasses.asdict(opt), "seed": seed}
    return json.loads(json.dumps(store.finite_or_none(record)))  # tuples -> lists, as read back from JSON


def package_versions() -> dict[str, str]:
    import peft
    import transformers

    from .. import __version__

    return {"ief": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "peft": peft.__version__}


def format_summary(s: dict[str, Any]) -> str:
    def fmt(m: dict | None) -> str:
        return "n/a" if not m else " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}"
                                            for k, v in m.items())

    loss = s.get("final_train_loss")
    div = f" DIVERGED at step {s['diverged']['step']}" if s.get("diverged") else ""
    return (f"{s['setup']}/{s['optimizer']}/seed-{s['seed']} [{s['scale']}]: final_train_loss="
            f"{'n/a' if loss is None else f'{loss:.4f}'} | best validation (step {s['best_validation']['step']}): "
            f"{fmt(s['best_validation']['metrics'])} | test: {fmt(s['test'])}{div} | {s['wall_time_s']:.1f}s")


def train(setup: str, optimizer: str, seed: int = 0, scale: str = "cpu", out: str | Path = "runs", *,
          lr: float | None = None, schedule: str | None = None, overrides: dict[str, Any] | None = None,
          device: str | None = None, progress: bool = True, checkpoint_every_s: float = 120.0,
          verbose: bool = True) -> dict[str, Any]:
    """Run (or resume, or skip if finished) one training run; returns its summary (see :mod:`.store` for the files).

    ``lr`` and ``schedule`` override the optimiser's learning rate and schedule, ``overrides`` fields of the resolved
    setup (all recorded in ``config.json``). Raises :class:`RunInterrupted` after SIGTERM/SIGINT (``resume.pt`` saved).
    """
    cfg = resolve(setup, scale, overrides)
    ocfg = optimizer_config(cfg, optimizer, lr, schedule)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    root = run_dir(out, scale, setup, optimizer, seed)
    record = _run_record(cfg, ocfg, seed)
    if (root / "config.json").exists():
        saved = store.read_json(root / "config.json")
        if {k: saved.get(k) for k in record} != record:
            raise RunConflict(f"{root} holds a run with a different configuration (config.json); use another --out")
        if (root / "summary.json").exists():
            summary = store.read_json(root / "summary.json")
            if verbose:
                print(f"skipped (finished): {format_summary(summary)}")
            return summary
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    seed_everything(seed)
    data = load_data(cfg)  # missing data or weights fail here, before anything is written
    model, preprocessor = build_model(cfg, data)
    model.to(dev)
    task = make_task(cfg, model, preprocessor)
    store.write_json(root / "config.json", {**record, "device": str(dev), "versions": package_versions()})
    n, bs = len(data.train), cfg.batch_size
    spe = math.ceil(n / bs)
    total = cfg.epochs * spe
    eval_every = cfg.eval_every or spe
    opt, scheduler = make_optimizer(model, ocfg, total)
    total_params, trainable_params = count_parameters(model)

    state: dict[str, Any] = {"done": 0, "post_pending": False, "training_done": False, "losses": [], "evals": [],
                             "best": None, "diverged": None, "wall": 0.0}
    resume = root / "resume.pt"
    if resume.exists():
        ck = store.read_torch(resume)
        store.load_trainable(model, ck["model"])
        opt.load_state_dict(ck["optimizer"])
        if scheduler is not None:
            scheduler.load_state_dict(ck["scheduler"])
        state = ck["state"]
        _set_rng_state(ck["rng"])
    t0, wall0, last_save = time.time(), state["wall"], time.time()

    def save_resume() -> None:
        state["wall"] = wall0 + time.time() - t0
        store.write_text(root / "train_loss.csv", store.loss_csv(state["losses"], spe))
        store.write_torch(resume, {"model": store.trainable_state(model), "optimizer": opt.state_dict(),
                                   "scheduler": scheduler.state_dict() if scheduler is not None else None,
                                   "state": state, "rng": _rng_state()})

    def validate(done: int, sig: _Signals) -> None:
        if state["evals"] and state["evals"][-1]["step"] == done:
            return
        results = evaluate(model, task, data.validation, dev, cfg.eval_batch_size,
                           abort=lambda: sig.pending is not None, progress=progress)
        metrics = metrics_of(cfg.task, results)
        entry = {"step": done, "epoch": done / spe, "metrics": metrics, "score": score(metrics)}
        state["evals"].append(entry)
        store.write_text(root / "validation.jsonl", store.evals_jsonl(state["evals"]))
        if state["best"] is None or entry["score"] > state["best"]["score"]:
            state["best"] = entry
            store.write_torch(root / "checkpoints" / "best.pt", store.trainable_state(model))

    def post(done: int, sig: _Signals) -> None:
        """What follows update ``done``: validation when due, the epoch checkpoint and the epoch scheduler."""
        if done % eval_every == 0 or done == total:
            validate(done, sig)
        if done % spe == 0:
            store.write_torch(root / "checkpoints" / f"epoch-{done // spe:03d}.pt", store.trainable_state(model))
            if scheduler is not None:
                scheduler.step()
        state["post_pending"] = False

    name = f"{setup}/{optimizer}/seed-{seed}"
    with _Signals() as sig, contextlib.ExitStack() as stack:
        try:
            if not state["training_done"]:
                model.train()
                if state["post_pending"]:
                    post(state["done"], sig)
                bar = tqdm(total=total, initial=state["done"], desc=name, disable=not progress, dynamic_ncols=True)
                stack.callback(bar.close)
                order, order_epoch = None, -1
                while state["done"] < total and state["diverged"] is None:
                    step = state["done"]
                    epoch, b = divmod(step, spe)
                    if epoch != order_epoch:
                        order, order_epoch = epoch_order(seed, epoch, n), epoch
                    batch = [data.train[int(i)] for i in order[b * bs : (b + 1) * bs]]
                    inputs, targets = task.collate(batch)
                    try:
                        loss = train_step(model, opt, to_device(inputs, dev), targets.to(dev))
                    except Diverged as err:  # training ends; the update was not applied
                        state["diverged"] = {"step": step + 1, "reason": str(err)}
                        break
                    state["losses"].append(loss)
                    state["done"], state["post_pending"] = step + 1, True
                    bar.update(1)
                    bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
                    if sig.pending is not None or time.time() - last_save >= checkpoint_every_s:
                        save_resume()
                        last_save = time.time()
                    if sig.pending is not None:
                        raise RunInterrupted(sig.pending, f"after step {state['done']}")
                    post(state["done"], sig)
                bar.close()
                if state["diverged"] is not None:
                    validate(state["done"], sig)  # the parameters before the failed update (redone on resume)
                state["training_done"] = True
                save_resume()
            best = state["best"]
            store.load_trainable(model, store.read_torch(root / "checkpoints" / "best.pt"))
            results = evaluate(model, task, data.test, dev, cfg.eval_batch_size,
                               abort=lambda: sig.pending is not None, progress=progress)
        except _Aborted:
            if not state["training_done"]:
                save_resume()  # state as after the last update: the aborted evaluation is redone on resume
            raise RunInterrupted(sig.pending or signal.SIGTERM, "during an evaluation") from None
    predictions = []
    if cfg.task in GLUE_TASKS:
        for split, r in results.items():
            path = write_glue_predictions(cfg.task, split, r["idx"], r["pred"], root / "predictions")
            predictions.append(str(path.relative_to(root)))
    losses = state["losses"]
    summary = {
        "setup": setup, "scale": scale, "optimizer": optimizer, "seed": seed,
        "steps": state["done"], "epochs": cfg.epochs, "steps_per_epoch": spe,
        "final_train_loss": float(np.mean(losses[-100:])) if losses else None,
        "best_validation": {"step": best["step"], "epoch": best["epoch"], "metrics": best["metrics"],
                            "score": best["score"]},
        "test": metrics_of(cfg.task, results), "test_predictions": predictions,
        "diverged": state["diverged"], "total_parameters": total_params, "trainable_parameters": trainable_params,
        "wall_time_s": wall0 + time.time() - t0,
    }
    store.write_text(root / "train_loss.csv", store.loss_csv(losses, spe))
    store.write_json(root / "summary.json", summary)
    resume.unlink(missing_ok=True)
    summary = store.read_json(root / "summary.json")  # as a re-invocation would return it
    if verbose:
        print(format_summary(summary))
    return summary


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
