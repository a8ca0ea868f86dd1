"""Train one (setup, optimiser, seed, scale) run, resumably, and describe a setup (``sec:exp``, ``sec:opt-exp``).

A run follows the paper's protocol (``sec:app-optimiser``): batches of the setup's size drawn without replacement
each epoch, validation every ``eval_every`` update steps (tab:train-epochs) and at the end, the best-validation
checkpoint kept and its test metrics reported; ``final_train_loss`` is the book's one definition
(:func:`.summaries.final_train_loss`: the mean loss of the last 10 % of the updates, ``final_train_loss_updates`` of
them; ``summary.json`` files written before held the mean of the last 100 updates and lack that field);
``final_train_loss_full`` the verdicts' (:mod:`.final_loss`: the full training-set loss of the parameters after the
last update, one forward pass over the training set before the test evaluation; ``None`` for a diverged run).

Progress: with ``progress=True`` a tqdm bar; without it (``--no-progress``, the workflow's and cluster jobs' choice)
and with ``verbose``, one line per validation and at least one every ``log_every_s`` seconds (step, epoch, the mean
training loss since the previous line, the last validation score, elapsed and remaining time), flushed at once, so a
cluster log shows how far a run is. A resumed run says so first: ``resuming from step k of n``.

Resuming: ``resume.pt`` holds the trainable parameters, the optimiser and scheduler states, every RNG state, the
position in the data (epoch orders are a function of the seed and the epoch, so the step count is the position)
and the histories. It is written every ``checkpoint_every_s`` seconds of wall time and when SIGTERM, SIGINT or
SIGHUP (a closed terminal or a dropped SSH session) arrives (the signal is honoured after the current update, or
aborts an evaluation, whose result is then recomputed on resume). A second signal stops at once; the last
checkpoint stays valid because every file is written atomically. Evaluation touches no RNG and no parameter, so a
resumed run ends with exactly the numbers of an uninterrupted one. A run whose ``summary.json`` exists is skipped and
never written again.

One process per run folder: the runner holds an ``fcntl.flock`` on ``run.lock`` in the folder (the kernel releases it
when the process dies, however it dies). A second invocation of the same run (a SLURM requeue, a second terminal)
stops with ``error: ... is in use by PID N ...`` (exit code 75, "try again later") or, with ``wait_lock=True``
(``--wait-lock``), waits for the first and then resumes it or, when it finished, skips it. Temporaries
``.NAME.tmp-PID`` left by a writer killed mid-write are removed by the next owner of the folder.

Everything is checked before anything is written: the setup fields (``--set``: epochs, batch sizes, evaluation
frequency, sizes, stage fractions), ``lr`` (finite, > 0; equal to the registered rate it is no override), the
schedule, the seed, the device (known, and present) and that ``out`` can be written. Checkpoints are read back when
written (:mod:`.store`) and checked when read: an unreadable ``resume.pt`` falls back to ``resume.prev.pt`` (the
previous one) and an unreadable or missing ``checkpoints/best.pt`` to another checkpoint of the same step; when
there is none, the run stops with an error naming the file and what to do.

Stage checkpoints (the contract with the evaluation code): ``checkpoints/stage-PPP.pt`` holds the trainable
parameters (:func:`.store.trainable_state`) after update ``round(f * total_steps)`` (Python's ``round``) for every
fraction ``f`` of the setup's ``stage_fractions`` (default 0, 0.25, 0.5, 0.75, 1; recorded in ``config.json``),
``PPP = round(100 * f)`` in 3 digits: ``stage-000`` is the initial model, ``stage-100`` the model after the last
update, so even a one-epoch run has five stages. A resumed run writes each exactly as an uninterrupted one (the
same file, the same parameters). :func:`.store.stage_checkpoints` lists them; ``summary.json`` maps each written
stage to its update (a run that diverged lacks the stages past the divergence).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
# tqdm's plain bar, not tqdm.auto: importing tqdm.auto in a kernel without ipywidgets warns (TqdmWarning: IProgress
# not found), and the chapters import this package to read its tables, so that warning showed on a book page.
from tqdm import tqdm

from . import processes, store
from .data import load_data
from .final_loss import FIELD as FULL_LOSS, Aborted as _LossAborted, training_set_loss
from .metrics import score, split_metrics, write_glue_predictions
from .models import build_model, count_parameters
from .optimizers import Diverged, make_optimizer, train_step
from .precision import DEFAULT as DEFAULT_PRECISION, check_precision, forward_precision, run_folder
from .resume import load_best, resume_state, rng_state
from .run_checks import check_lr, check_setup, resolve_device
from .run_log import ProgressLog, format_summary, scale_label
from .setups import GLUE_TASKS, SetupConfig, optimizer_config, resolve
from .summaries import final_train_loss, final_window
from .tasks import make_task, to_device


class RunInterrupted(Exception):
    """SIGTERM / SIGINT / SIGHUP stopped the run after saving ``resume.pt``; the same command resumes it."""

    def __init__(self, signum: int, where: str):
        self.signum = signum
        super().__init__(f"{signal.Signals(signum).name} received {where}; resume.pt saved: run the same command "
                         f"again to resume")


class RunConflict(ValueError):
    """The run folder holds a run with a different configuration."""


RunLocked = store.Locked  # another process owns the run folder


class _Aborted(Exception):
    pass


STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


class _Signals:
    """SIGINT/SIGTERM/SIGHUP set ``pending`` (handled at the next safe point); a second one raises
    KeyboardInterrupt."""

    def __init__(self) -> None:
        self.pending: int | None = None
        self._old: dict[int, Any] = {}

    def __enter__(self) -> "_Signals":
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.pending is not None:
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: stopping without saving")
        self.pending = signum

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)


def run_dir(out: str | Path, scale: str, setup: str, optimizer: str, seed: int, precision: str = DEFAULT_PRECISION
            ) -> Path:
    """A run's folder: ``out/<scale>/<setup>/<optimizer>/seed-<seed>``, under ``out/bfloat16/`` for a bfloat16 run
    (:func:`.precision.run_folder`).

    Args:
        out: the runs folder.
        scale: the scale.
        setup: the setup's name.
        optimizer: the optimiser's name.
        seed: the run's seed.
        precision: ``"float32"`` (default), ``"bfloat16"`` or ``"bf16"`` (:func:`.precision.check_precision`).

    Returns:
        The folder.
    """
    return run_folder(out, precision) / scale / setup / optimizer / f"seed-{seed}"


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


def _run_record(cfg: SetupConfig, opt: Any, seed: int, precision: str = DEFAULT_PRECISION) -> dict[str, Any]:
    record = {"setup": cfg.to_dict(), "optimizer": dataclasses.asdict(opt), "seed": seed, "precision": precision}
    return json.loads(json.dumps(store.finite_or_none(record)))  # tuples -> lists, as read back from JSON


def package_versions() -> dict[str, str]:
    """The versions a run records, read from the installed distributions: importing transformers and peft only to
    ask would cost a run of the MLP, which uses neither, a third of its process's time at smoke scale."""
    from importlib.metadata import version

    from ief import __version__

    return {"ief": __version__, "torch": torch.__version__, "transformers": version("transformers"),
            "peft": version("peft")}


def _comparable(record: dict[str, Any]) -> dict[str, Any]:
    """What must agree between config.json and an invocation: everything but the optimiser's provenance text (an
    ``--lr`` equal to the registered rate is no override) and the setup's table of registered optimisers (the run's
    own optimiser, as it ran, is ``optimizer``; a new search's rate for AdamW does not change an SGD run, nor a
    re-registered rate a finished run at an overridden one); a config.json from before ``stage_fractions`` existed
    takes the default, one from before ``precision`` existed float32 (the only precision then)."""
    out = json.loads(json.dumps(record))
    if out.get("precision") is None:
        out["precision"] = DEFAULT_PRECISION
    if isinstance(out.get("optimizer"), dict):
        out["optimizer"].pop("source", None)
    if isinstance(out.get("setup"), dict):
        out["setup"].setdefault("stage_fractions", list(SetupConfig.__dataclass_fields__["stage_fractions"].default))
        out["setup"].pop("optimizers", None)
        out["setup"].pop("provisional", None)
    return out


def _read_config(path: Path) -> dict[str, Any]:
    try:
        saved = store.read_json(path)
    except store.CorruptFile as err:
        raise store.CorruptFile(f"{err}: remove {path.parent} to start this run again, or restore the file") from None
    if not isinstance(saved, dict):
        raise store.CorruptFile(f"{path} is not a run configuration: remove {path.parent} to start this run again")
    return saved


def recorded_overrides(root: str | Path, setup: str, scale: str) -> dict[str, Any] | None:
    """The setup fields a run was trained with (its ``config.json``) that differ from the registry's: the run's
    ``--set`` overrides, so that what reads the run (the evaluation framework, iEF's first step redone) builds the
    model and data it was trained on. ``None`` when they agree or the folder has no ``config.json``.

    Args:
        root: the run folder (:func:`run_dir`).
        setup: its setup name.
        scale: its scale.

    Returns:
        ``{field: value}`` for :func:`~.setups.resolve`'s ``overrides``, or ``None``.
    """
    path = Path(root) / "config.json"
    if not path.exists():
        return None
    saved = _read_config(path).get("setup") or {}
    registered = json.loads(json.dumps(resolve(setup, scale).to_dict()))
    ignored = ("optimizers", "provisional", "notes", "source")  # provenance, not what the model or data are
    out = {k: v for k, v in saved.items() if k in registered and k not in ignored and v != registered[k]}
    return out or None


def train(setup: str, optimizer: str, seed: int = 0, scale: str = "cpu", out: str | Path = "runs", *,
          lr: float | None = None, schedule: str | None = None, overrides: dict[str, Any] | None = None,
          device: str | None = None, progress: bool = True, checkpoint_every_s: float = 120.0,
          verbose: bool = True, wait_lock: bool = False, log_every_s: float = 300.0,
          precision: str = DEFAULT_PRECISION) -> dict[str, Any]:
    """Run (or resume, or skip if finished) one training run; returns its summary (see :mod:`.store` for the files).

    ``lr`` and ``schedule`` override the optimiser's learning rate and schedule, ``overrides`` fields of the resolved
    setup (all recorded in ``config.json``). ``precision`` (``"float32"``, ``"bfloat16"`` or ``"bf16"``; float16
    refused) runs every forward under bfloat16 autocast, in its own folder (:mod:`.precision`). Every argument is
    checked before anything is written (``ValueError``).
    ``verbose`` without ``progress``: a progress line at every validation and at least every ``log_every_s`` seconds.
    Raises :class:`RunLocked` when another process runs this run (``wait_lock=True``: wait for it instead),
    :class:`RunInterrupted` after SIGTERM/SIGINT/SIGHUP (``resume.pt`` saved), :class:`.store.CorruptFile` when a
    file of the run cannot be read and nothing can replace it (the message names the file and the remedy).
    """
    cfg = check_setup(resolve(setup, scale, overrides))
    registered = optimizer_config(cfg, optimizer)
    lr = check_lr(lr)
    ocfg = optimizer_config(cfg, optimizer, None if lr == registered.lr else lr,
                            None if schedule == registered.schedule else schedule)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    if isinstance(log_every_s, bool) or not isinstance(log_every_s, (int, float)) or not log_every_s > 0:
        raise ValueError(f"log_every_s must be a number of seconds > 0, got {log_every_s!r}")
    precision = check_precision(precision)
    dev = resolve_device(device)
    root = run_dir(out, scale, setup, optimizer, seed, precision)
    record = _run_record(cfg, ocfg, seed, precision)
    procs = processes.from_environment(dev)  # torchrun: several processes, one run (rank 0 writes)
    dev = procs.device if procs is not None else dev
    if procs is not None and not procs.writer:  # one log and one bar: rank 0's
        verbose = progress = False
    with contextlib.ExitStack() as owner:
        owner.callback(processes.close, procs)

        def take_folder() -> None:
            try:
                owner.enter_context(store.lock(root, wait=wait_lock))
            except OSError as err:
                raise ValueError(f"cannot write the run folder {root} (out={str(out)!r}): "
                                 f"{err.strerror or err}") from None
            store.remove_stale_temporaries(root)

        processes.first_rank(procs, take_folder)
        if (root / "config.json").exists():
            saved = _read_config(root / "config.json")
            if _comparable({k: saved.get(k) for k in record}) != _comparable(record):
                raise RunConflict(f"{root} holds a run with a different configuration (config.json); use another "
                                  f"--out")
            if (root / "summary.json").exists():
                try:
                    summary = store.read_json(root / "summary.json")
                except store.CorruptFile as err:
                    raise store.CorruptFile(f"{err}: the run's result is lost; remove {root} to train it again"
                                            ) from None
                if verbose:
                    print(f"skipped (finished): {format_summary(summary)}")
                return summary
        log = ProgressLog(f"{setup}/{optimizer}/seed-{seed} [{scale_label(scale, precision)}]", verbose, progress,
                           log_every_s)
        summary = TrainingLoop(cfg, ocfg, record, root, setup, optimizer, seed, scale, dev, progress,
                               checkpoint_every_s, log, procs).run()
        if verbose:
            print(format_summary(summary))
        return summary


class TrainingLoop:
    """One run, once :func:`train` holds its folder's lock and found it unfinished: the model, data and optimiser
    built, then updates, validations and checkpoints until the end, the test evaluation of the best-validation
    parameters and ``summary.json``.

    ``state`` is what ``resume.pt`` saves besides the parameters, optimiser, scheduler and RNG states: ``done``
    (updates applied), ``post_pending`` (what follows update ``done`` not yet done), ``training_done``, ``losses``,
    ``evals``, ``best``, ``diverged`` and ``wall`` (seconds trained before this session).

    Args:
        cfg: the checked setup (:func:`check_setup`).
        ocfg: the optimiser's configuration.
        record: what ``config.json`` records of the invocation (:func:`_run_record`), ``precision`` included.
        root: the run folder (:func:`run_dir`).
        setup: the setup's name.
        optimizer: the optimiser's name.
        seed: the run's seed (the initial model, the epoch orders).
        scale: ``"smoke"``, ``"cpu"`` or ``"full"``.
        dev: the device.
        progress: a tqdm bar.
        checkpoint_every_s: seconds of wall time between ``resume.pt`` writes.
        log: the progress lines.
    """

    def __init__(self, cfg: SetupConfig, ocfg: Any, record: dict[str, Any], root: Path, setup: str, optimizer: str,
                 seed: int, scale: str, dev: torch.device, progress: bool, checkpoint_every_s: float,
                 log: ProgressLog, procs: processes.Processes | None = None):
        self.cfg, self.root, self.dev, self.progress, self.log = cfg, root, dev, progress, log
        self.procs = procs
        self.writer = procs is None or procs.writer
        self.setup, self.optimizer, self.seed, self.scale = setup, optimizer, seed, scale
        self.checkpoint_every_s = checkpoint_every_s
        self.precision = record["precision"]
        seed_everything(seed)
        self.data = load_data(cfg)  # missing data or weights fail here, before anything is written
        self.model, preprocessor = build_model(cfg, self.data)
        self.model.to(dev)
        self.task = make_task(cfg, self.model, preprocessor)
        self.n = len(self.data.train)
        self.spe = math.ceil(self.n / cfg.batch_size)  # steps per epoch
        self.total = cfg.epochs * self.spe
        self.eval_every = cfg.eval_every or self.spe
        self.opt, self.scheduler = make_optimizer(self.model, ocfg, self.total,
                                                  None if procs is None else procs.group)
        self.parameter_counts = count_parameters(self.model)
        if self.writer:
            store.write_json(root / "config.json", {**record, "device": str(dev), "versions": package_versions(),
                                                    **({} if procs is None else {"processes": procs.world})})
        # stage checkpoint file -> the update after which it is written
        self.stages = {store.stage_name(f): round(f * self.total) for f in cfg.stage_fractions}
        self.state: dict[str, Any] = {"done": 0, "post_pending": False, "training_done": False, "losses": [],
                                      "evals": [], "best": None, "diverged": None, "wall": 0.0}
        resumed = resume_state(root, self.model, self.opt, self.scheduler)
        self.state = resumed or self.state
        log.begin(self.state, self.total, resumed is not None)
        self.t0, self.wall0, self.last_save = time.time(), self.state["wall"], time.time()
        self.signals = _Signals()
        self._order, self._order_epoch = None, -1  # the current epoch's example order (:func:`epoch_order`)

    def _stopping(self) -> bool:
        return self.signals.pending is not None

    def _abort_evaluation(self) -> bool:
        """Whether an evaluation stops between batches: on a stop signal, with one process only (several processes
        agree on stopping at updates, :func:`.processes.any_rank`; each would stop an evaluation elsewhere)."""
        return self.procs is None and self._stopping()

    def save_resume(self) -> None:
        """``resume.pt`` (the previous one kept as ``resume.prev.pt``) and ``train_loss.csv`` (rank 0 only)."""
        state, root = self.state, self.root
        if not self.writer:
            return
        state["wall"] = self.wall0 + time.time() - self.t0
        store.write_text(root / "train_loss.csv", store.loss_csv(state["losses"], self.spe))
        if (root / "resume.pt").exists():
            os.replace(root / "resume.pt", root / "resume.prev.pt")  # the fallback should the new one be unreadable
        store.write_torch(root / "resume.pt", {
            "model": store.trainable_state(self.model), "optimizer": self.opt.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "state": state, "rng": rng_state()})

    def write_stages(self, done: int) -> None:
        """Write the stage checkpoints due after update ``done``.

        Args:
            done: the updates applied (0: the initial model).
        """
        for name, at in self.stages.items():
            if at == done and self.writer:
                store.write_torch(self.root / "checkpoints" / name, store.trainable_state(self.model))

    def validate(self, done: int) -> None:
        """Validate after update ``done`` (once per step), rewrite ``validation.jsonl`` and, when the score is the
        best so far, ``checkpoints/best.pt``.

        Args:
            done: the updates applied.

        Raises:
            _Aborted: a stop signal arrived during the evaluation (nothing of it is recorded).
        """
        state = self.state
        if state["evals"] and state["evals"][-1]["step"] == done:
            return
        with forward_precision(self.precision, self.dev):
            results = evaluate(self.model, self.task, self.data.validation, self.dev, self.cfg.eval_batch_size,
                               abort=self._abort_evaluation, progress=self.progress)
        metrics = metrics_of(self.cfg.task, results)
        entry = {"step": done, "epoch": done / self.spe, "metrics": metrics, "score": score(metrics)}
        state["evals"].append(entry)
        if self.writer:
            store.write_text(self.root / "validation.jsonl", store.evals_jsonl(state["evals"]))
        if state["best"] is None or entry["score"] > state["best"]["score"]:
            state["best"] = entry
            if self.writer:
                store.write_torch(self.root / "checkpoints" / "best.pt", store.trainable_state(self.model))

    def after_update(self, done: int) -> None:
        """What follows update ``done``: validation when due, the progress line, the stage and epoch checkpoints and
        the epoch scheduler's step.

        Args:
            done: the updates applied.
        """
        due = done % self.eval_every == 0 or done == self.total
        if due:
            self.validate(done)
        self.log.step(self.state, self.total, self.spe, due)
        self.write_stages(done)
        if done % self.spe == 0:
            if self.writer:
                store.write_torch(self.root / "checkpoints" / f"epoch-{done // self.spe:03d}.pt",
                                  store.trainable_state(self.model))
            if self.scheduler is not None:
                self.scheduler.step()
        self.state["post_pending"] = False

    def _batch(self, step: int) -> list[Any]:
        epoch, b = divmod(step, self.spe)
        if epoch != self._order_epoch:
            self._order, self._order_epoch = epoch_order(self.seed, epoch, self.n), epoch
        bs = self.cfg.batch_size
        return processes.shard([self.data.train[int(i)] for i in self._order[b * bs : (b + 1) * bs]], self.procs)

    def update(self, bar: Any) -> bool:
        """One update on the next batch of the epoch's order, then ``resume.pt`` when one is due.

        Args:
            bar: the tqdm bar (advanced by one).

        Returns:
            ``False`` when the update diverged (it is not applied; ``state["diverged"]`` says where), else ``True``.

        Raises:
            RunInterrupted: a stop signal arrived (after the update, with ``resume.pt`` saved).
        """
        state = self.state
        step = state["done"]
        inputs, targets = self.task.collate(self._batch(step))
        try:
            with forward_precision(self.precision, self.dev):
                loss = train_step(self.model, self.opt, to_device(inputs, self.dev), targets.to(self.dev), self.procs)
        except Diverged as err:  # training ends; the update was not applied
            state["diverged"] = {"step": step + 1, "reason": str(err)}
            return False
        state["losses"].append(loss)
        state["done"], state["post_pending"] = step + 1, True
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        stopping = processes.any_rank(self._stopping(), self.procs)  # every rank stops after the same update
        if stopping or time.time() - self.last_save >= self.checkpoint_every_s:
            self.save_resume()
            self.last_save = time.time()
        if stopping:
            raise RunInterrupted(self.signals.pending or signal.SIGTERM, f"after step {state['done']}")
        return True

    def train_to_end(self) -> None:
        """Update until the last update or a divergence, from where ``state`` is; then ``resume.pt`` is written
        with ``training_done``."""
        state = self.state
        self.model.train()
        if state["done"] == 0:
            self.write_stages(0)  # the initial model
        if state["post_pending"]:
            self.after_update(state["done"])
        bar = tqdm(total=self.total, initial=state["done"], desc=f"{self.setup}/{self.optimizer}/seed-{self.seed}",
                   disable=not self.progress, dynamic_ncols=True)
        try:
            while state["done"] < self.total and state["diverged"] is None:
                if not self.update(bar):
                    break
                self.after_update(state["done"])
        finally:
            bar.close()
        if state["diverged"] is not None:
            self.validate(state["done"])  # the parameters before the failed update (redone on resume)
        state["training_done"] = True
        self.save_resume()

    def final_loss(self) -> float | None:
        """The full training-set loss of the parameters after the last update (:mod:`.final_loss`), measured
        before :meth:`test_best` puts the best-validation parameters back; None for a run that diverged (it has no
        final checkpoint).

        Raises:
            _Aborted: a stop signal arrived during the pass.
        """
        if self.state["diverged"] is not None:
            return None
        try:
            with forward_precision(self.precision, self.dev):
                return training_set_loss(self.model, self.task, self.data.train, self.dev, self.cfg.eval_batch_size,
                                         abort=self._abort_evaluation)
        except _LossAborted:
            raise _Aborted from None

    def test_best(self) -> dict[str, dict[str, Any]]:
        """Put the best-validation parameters back into the model (:func:`.resume.load_best`) and evaluate the test
        split.

        Returns:
            :func:`evaluate`'s predictions on the test split(s).
        """
        processes.barrier(self.procs)  # rank 0's last best.pt is written before any rank reads it
        best, root = self.state["best"], self.root
        same_step = [root / "checkpoints" / f"epoch-{best['step'] // self.spe:03d}.pt"] \
            if best["step"] % self.spe == 0 else []
        same_step += [root / "checkpoints" / name for name, at in self.stages.items() if at == best["step"]]
        load_best(root, self.model, self.state, same_step)
        with forward_precision(self.precision, self.dev):
            return evaluate(self.model, self.task, self.data.test, self.dev, self.cfg.eval_batch_size,
                            abort=self._abort_evaluation, progress=self.progress)

    def run(self) -> dict[str, Any]:
        """Train (or resume) to the end, then test the best-validation parameters.

        Returns:
            The run's summary (:meth:`write_summary`).

        Raises:
            RunInterrupted: a stop signal arrived (``resume.pt`` saved; the same command resumes).
        """
        with self.signals:
            try:
                if not self.state["training_done"]:
                    self.train_to_end()
                full = self.final_loss()
                results = self.test_best()
            except _Aborted:
                if not self.state["training_done"]:
                    self.save_resume()  # state as after the last update: the aborted evaluation is redone on resume
                raise RunInterrupted(self.signals.pending or signal.SIGTERM, "during an evaluation") from None
        return self.write_summary(results, full)

    def write_summary(self, results: dict[str, dict[str, Any]], full_loss: float | None = None) -> dict[str, Any]:
        """Write ``summary.json`` (and the GLUE prediction files) and remove ``resume.pt``.

        Args:
            results: :meth:`test_best`'s predictions.
            full_loss: :meth:`final_loss` (None: the run diverged).

        Returns:
            The summary as read back from ``summary.json`` (what a re-invocation returns).
        """
        cfg, root, state = self.cfg, self.root, self.state
        predictions = []
        if cfg.task in GLUE_TASKS and self.writer:  # the other ranks return rank 0's summary
            for split, r in results.items():
                path = write_glue_predictions(cfg.task, split, r["idx"], r["pred"], root / "predictions")
                predictions.append(str(path.relative_to(root)))
        labelled = all(len(r["gold"]) and not bool((r["gold"] < 0).any()) for r in results.values())
        if cfg.task not in GLUE_TASKS and labelled and results and self.writer:
            # every test example's prediction: the verdicts compare two optimisers example by example
            store.write_text(root / store.TEST_PREDICTIONS, store.test_predictions_csv(results))
            predictions.append(store.TEST_PREDICTIONS)
        losses, best = state["losses"], state["best"]
        total_params, trainable_params = self.parameter_counts
        summary = {
            "setup": self.setup, "scale": self.scale, "optimizer": self.optimizer, "seed": self.seed,
            "precision": self.precision, "steps": state["done"], "epochs": cfg.epochs, "steps_per_epoch": self.spe,
            "final_train_loss": final_train_loss(losses) if losses else None,
            "final_train_loss_updates": final_window(len(losses)) if losses else 0,
            FULL_LOSS: full_loss,
            "best_validation": {"step": best["step"], "epoch": best["epoch"], "metrics": best["metrics"],
                                "score": best["score"]},
            "test": metrics_of(cfg.task, results), "test_predictions": predictions,
            "diverged": state["diverged"], "total_parameters": total_params,
            "trainable_parameters": trainable_params,
            "stages": {name[len("stage-"):-len(".pt")]: at for name, at in self.stages.items()
                       if at <= state["done"]},
            "wall_time_s": self.wall0 + time.time() - self.t0,
        }
        if self.writer:
            store.write_text(root / "train_loss.csv", store.loss_csv(losses, self.spe))
            store.write_json(root / "summary.json", summary)
            (root / "resume.pt").unlink(missing_ok=True)
            (root / "resume.prev.pt").unlink(missing_ok=True)
        processes.barrier(self.procs)  # every rank returns rank 0's summary.json
        return store.read_json(root / "summary.json")  # as a re-invocation would return it
