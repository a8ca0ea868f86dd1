"""A run's files, every one written atomically (a temporary ``.NAME.tmp-PID`` in the same folder, fsync, read back
and compared, then ``os.replace``), so an interrupted write leaves the previous version intact and a short write is
never installed. Reading a file that is truncated or not what it should be raises :class:`CorruptFile` naming it.
Torch files hold tensors, numbers, strings and containers only and are read with ``weights_only=True``, so a run
folder written elsewhere (a shared scratch, a downloaded ``runs/``) cannot run code (:class:`UnsafeCheckpoint`).

Layout of ``DIR/<scale>/<setup>/<optimizer>/seed-<K>/``::

    run.lock               the lock (fcntl.flock) of the process that owns the folder; it names the last owner
    config.json            the resolved setup and optimiser (compared on re-invocation)
    train_loss.csv         step, epoch, loss (mean cross-entropy per target token) of every update
    validation.jsonl       one line per evaluation: step, epoch, metrics, score
    checkpoints/epoch-NNN.pt   trainable parameters at the end of every epoch
    checkpoints/stage-PPP.pt   trainable parameters at fraction PPP/100 of training (see :func:`stage_checkpoints`)
    checkpoints/best.pt    trainable parameters of the best validation score
    resume.pt              everything needed to continue (removed once summary.json exists)
    resume.prev.pt         the previous resume.pt, the fallback when resume.pt cannot be read
    predictions/*.tsv      GLUE test predictions in the submission format (GLUE setups)
    test_predictions.csv   split, idx, pred, gold of every labelled test example (the per-example comparisons)
    summary.json           written last: its presence marks a finished run, which is never written again

A run folder belongs to one process at a time (:func:`lock`); temporaries left by a killed writer are removed by the
next owner (:func:`remove_stale_temporaries`).
"""
from __future__ import annotations

import contextlib
import copy
import errno
import fcntl
import io
import json
import math
import os
import pickle
import re
import socket
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..atomic import write_atomically  # noqa: F401  (the one atomic writer; re-exported: store is where the companion writes)

LOCK_NAME = "run.lock"
_TMP = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)$")


class CorruptFile(ValueError):
    """A run file that is truncated, unreadable or not what it should be; the message names the file."""


class Locked(RuntimeError):
    """Another process holds the lock of a run folder (or of a search record)."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temporaries(folder: Path, *, owned: bool = True, recursive: bool = True) -> list[Path]:
    """Remove the ``.NAME.tmp-PID`` files a killed writer left in ``folder`` (and its subfolders); returns them.

    ``owned=True`` (the caller holds the folder's lock, so nobody else writes there): every temporary is stale.
    Otherwise only those whose PID is not alive are removed."""
    removed = []
    for tmp in (Path(folder).rglob if recursive else Path(folder).glob)(".*.tmp-*"):
        m = _TMP.match(tmp.name)
        if m is None or not tmp.is_file():
            continue
        if owned or not _pid_alive(int(m["pid"])):
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
                removed.append(tmp)
    return removed


def _holder(lock_file: Path) -> str:
    with contextlib.suppress(OSError):
        text = lock_file.read_text().strip()
        if text:
            return text
    return "another process"


@contextlib.contextmanager
def lock(folder: Path, *, wait: bool = False, name: str = LOCK_NAME, what: str = "run") -> Iterator[Path]:
    """Hold an exclusive ``fcntl.flock`` on ``folder/name`` (created) for the duration; a crash releases it.

    ``wait=False``: raise :class:`Locked` at once when another process holds it; ``wait=True``: block until it is
    free (printing one line to stderr). On a file system without locks a warning says duplicates are not excluded.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    lock_file = folder / name
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(lock_file)
            if not wait:
                raise Locked(f"{folder} is in use by {holder} (lock {lock_file}): this {what} is already running; "
                             f"wait for it to finish (or pass --wait-lock to wait), or stop it first") from None
            print(f"waiting for {holder} to release {lock_file} ...", file=sys.stderr, flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as err:
            if err.errno not in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                raise
            warnings.warn(f"{lock_file}: the file system does not support locks ({err}); a duplicate of this {what} "
                          f"would not be excluded", RuntimeWarning, stacklevel=3)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"PID {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
                  .encode(), 0)
        yield lock_file
    finally:
        os.close(fd)  # releases the lock


def finite_or_none(value: Any) -> Any:
    """JSON has no NaN/inf: non-finite floats become null (recursively)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    return value


def write_json(path: Path, obj: Any) -> None:
    write_atomically(path, (json.dumps(finite_or_none(obj), indent=2, sort_keys=True) + "\n").encode())


def read_json(path: Path) -> Any:
    """The JSON in ``path``; :class:`CorruptFile` (naming it) when it cannot be parsed."""
    try:
        with open(path) as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CorruptFile(f"{path} is truncated or not JSON ({err})") from None


def write_text(path: Path, text: str) -> None:
    write_atomically(path, text.encode())


class UnsafeCheckpoint(CorruptFile):
    """A torch file holding Python objects a weights-only load refuses: it is not unpickled, since that could run
    code (a run folder someone else wrote, a downloaded ``runs/``); the message names the objects."""


# What an old resume.pt (written before checkpoints held tensors only) needs besides tensors: numpy's MT19937 state,
# a uint32 array. Allowed during a load only; ``_reconstruct`` builds nothing but an ndarray of an allowed dtype.
_LEGACY_NUMPY_GLOBALS = [(getattr(np, "_core", None) or np.core).multiarray._reconstruct, np.ndarray, np.dtype,
                         np.dtypes.UInt32DType]


def storable(obj: Any) -> Any:
    """``obj`` with every numpy array made a tensor and every numpy scalar a Python number (dicts, lists and tuples
    recursed), so that a weights-only load (:func:`read_torch`) can read it back. ``np.random.set_state`` accepts the
    state so converted (its key array becomes a ``torch.uint32`` tensor)."""
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(np.array(obj, copy=True))
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):  # the same mapping type, filled by update(): Counter(pairs) would count the pairs
        converted = copy.copy(obj)
        converted.clear()
        converted.update({k: storable(v) for k, v in obj.items()})
        return converted
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(storable(v) for v in obj)
    return obj


def _load(source: Any) -> Any:
    with torch.serialization.safe_globals(_LEGACY_NUMPY_GLOBALS):
        return torch.load(source, map_location="cpu", weights_only=True)


def _unsafe_globals(source: Any) -> str | None:
    """The Python objects (module.name) a weights-only load refuses in a torch zip file, from a scan of its pickle
    opcodes (nothing is unpickled); ``None`` when there are none or the file cannot be scanned."""
    allowed = {f"{g.__module__}.{g.__qualname__}" for g in _LEGACY_NUMPY_GLOBALS} | {"numpy.dtype"}
    try:
        if hasattr(source, "seek"):
            source.seek(0)
        names = [g for g in torch.serialization.get_unsafe_globals_in_checkpoint(source) if g not in allowed]
    except Exception:  # noqa: BLE001 - not a zip file, truncated...: the caller reports the load's own error
        return None
    return ", ".join(names[:5]) + (" ..." if len(names) > 5 else "") if names else None


def write_torch(path: Path, obj: Any) -> None:
    """Write ``obj`` (tensors, numbers, strings, None, dicts/lists/tuples of them; numpy arrays and scalars are
    converted by :func:`storable`) atomically to ``path``.

    Raises:
        TypeError: ``obj`` holds something :func:`read_torch` would refuse (it is checked before writing)."""
    buffer = io.BytesIO()
    torch.save(storable(obj), buffer)
    try:
        buffer.seek(0)
        torch.load(buffer, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        what = _unsafe_globals(buffer) or str(err).splitlines()[-1][:160]
        raise TypeError(f"{path}: not written, it would hold {what}, which a weights-only load refuses; "
                        f"store tensors, numbers, strings, None and dicts/lists/tuples of them") from None
    write_atomically(path, buffer.getvalue())


def read_torch(path: Path) -> Any:
    """A file written by :func:`write_torch`, read with ``torch.load(weights_only=True)``: tensors, numbers, strings
    and containers only, so that a checkpoint from elsewhere cannot run code (an older ``resume.pt`` with numpy's RNG
    state still loads: numpy arrays are allowed during the load, nothing else).

    Raises:
        UnsafeCheckpoint: the file holds other Python objects (named); nothing of it is executed.
        CorruptFile: the file is truncated or not a torch file (named).
        FileNotFoundError: it does not exist."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    try:
        return _load(path)
    except pickle.UnpicklingError as err:
        unsafe = _unsafe_globals(path) or ", ".join(re.findall(r"Unsupported global: GLOBAL ([\w.]+)", str(err)))
        if not unsafe:
            detail = str(err).partition("WeightsUnpickler error:")[2].strip().split("\n\n")[0][:160]
            raise CorruptFile(f"{path} is truncated or not a torch checkpoint (UnpicklingError in a weights-only "
                              f"load: {detail or str(err).splitlines()[0][:160]})") from None
        raise UnsafeCheckpoint(
            f"{path} holds {unsafe}: refused (weights-only load), since unpickling it could run code. A checkpoint "
            f"written by this package holds only tensors, numbers, strings and containers; remove the file and re-run "
            f"the job that writes it (train, or evaluate's stage checkpoints), or use a run folder you wrote "
            f"yourself") from None
    except Exception as err:  # noqa: BLE001 - torch raises RuntimeError, EOFError, zipfile errors...
        reason = str(err).split(". ")[0].splitlines()[0][:160] if str(err) else ""
        raise CorruptFile(f"{path} is truncated or not a torch checkpoint ({type(err).__name__}: {reason})") from None


def read_trainable(path: Path) -> dict[str, torch.Tensor]:
    """A file of :func:`trainable_state` (``best.pt``, ``epoch-NNN.pt``, ``stage-PPP.pt``), checked to be a dict of
    tensors by name; :class:`CorruptFile` otherwise."""
    state = read_torch(path)
    if not isinstance(state, dict) or not state or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise CorruptFile(f"{path} is not a checkpoint of trainable parameters (a dict of tensors by name)")
    return state


def stage_name(fraction: float) -> str:
    """``checkpoints/stage-PPP.pt`` for a fraction of training: ``PPP = round(100 * fraction)``, 3 digits."""
    return f"stage-{round(100 * fraction):03d}.pt"


def stage_checkpoints(run_root: Path) -> dict[int, Path]:
    """The stage checkpoints of a run folder, ``{percent: path}`` in increasing order of percent.

    ``checkpoints/stage-PPP.pt`` holds the trainable parameters (:func:`trainable_state`) after update
    ``round(PPP/100 * total_steps)`` (``stage-000``: the initial model, ``stage-100``: after the last update); the
    fractions are the setup's ``stage_fractions`` (``config.json``). A run that diverged lacks the stages past its
    divergence; read one with :func:`read_trainable` and :func:`load_trainable`."""
    found = {}
    for path in (Path(run_root) / "checkpoints").glob("stage-*.pt"):
        m = re.fullmatch(r"stage-(\d{3})\.pt", path.name)
        if m:
            found[int(m[1])] = path
    return dict(sorted(found.items()))


def loss_csv(losses: list[float], steps_per_epoch: int) -> str:
    rows = ["step,epoch,loss"]
    rows += [f"{i + 1},{i // steps_per_epoch + 1},{v!r}" for i, v in enumerate(losses)]
    return "\n".join(rows) + "\n"


def evals_jsonl(evals: list[dict]) -> str:
    return "".join(json.dumps(finite_or_none(e), sort_keys=True) + "\n" for e in evals)


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters by name, on the CPU."""
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}


@torch.no_grad()
def load_trainable(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if set(params) != set(state):
        differ = sorted(set(params) ^ set(state))[:3]
        raise ValueError(f"checkpoint does not match the model's trainable parameters (e.g. {differ})")
    for n, p in params.items():
        p.copy_(state[n])


def read_run(root: Path) -> dict[str, Any]:
    """A run folder read back: ``config``, ``losses`` (one per update), ``evals`` (the validation history) and
    ``summary`` (``None`` while the run is unfinished)."""
    root = Path(root)
    if not (root / "config.json").exists():
        raise FileNotFoundError(f"{root} is not a run folder (no config.json)")
    losses_file, evals_file = root / "train_loss.csv", root / "validation.jsonl"
    losses = [float(line.split(",")[2]) for line in losses_file.read_text().splitlines()[1:]] \
        if losses_file.exists() else []
    evals = [json.loads(line) for line in evals_file.read_text().splitlines()] if evals_file.exists() else []
    summary = read_json(root / "summary.json") if (root / "summary.json").exists() else None
    return {"config": read_json(root / "config.json"), "losses": losses, "evals": evals, "summary": summary}


TEST_PREDICTIONS = "test_predictions.csv"


def test_predictions_csv(results: dict[str, dict[str, Any]]) -> str:
    """``split,idx,pred,gold`` of every test example of ``results`` (``{split: {"pred", "gold", "idx"}}``, the
    runner's evaluation): the rows the verdicts compare two optimisers on, example by example."""
    lines = ["split,idx,pred,gold"]
    for split, r in results.items():
        lines += [f"{split},{int(i)},{int(p)},{int(g)}" for i, p, g in zip(r["idx"], r["pred"].tolist(),
                                                                           r["gold"].tolist())]
    return "\n".join(lines) + "\n"


def read_test_predictions(root: Path) -> list[tuple[str, int, int, int]] | None:
    """The rows of a run's ``test_predictions.csv`` as ``(split, idx, pred, gold)``; None where it has none (a
    run made before they were stored, or private test labels)."""
    path = Path(root) / TEST_PREDICTIONS
    if not path.exists():
        return None
    rows = []
    for line in path.read_text().splitlines()[1:]:
        split, idx, pred, gold = line.split(",")
        rows.append((split, int(idx), int(pred), int(gold)))
    return rows
