"""The shared harness of every benchmark: timing, statistics, memory, machine load, the machine, the JSON record.

- Timing (:func:`round_robin`): every case is warmed up, then run round-robin for ``rounds`` rounds with the order
  rotated each round, so that none always follows the same one and a shared machine's slow phases hit every case
  alike. The garbage collector runs between rounds, never inside a timed call; on CUDA ``torch.cuda.synchronize()``
  brackets each call.
- Statistics (:func:`summary`, :func:`within_round_ratio`): the median and inter-quartile range (IQR) of a case's times;
  a ratio is the median over rounds of the ratio of the two cases' times *in the same round* (robust to slow phases).
- Peak memory, measured in a separate pass after the timing (:func:`peak_memory_mib`): on CUDA
  ``max_memory_allocated()`` after ``reset_peak_memory_stats()`` minus ``memory_allocated()`` before the call; on CPU
  the peak of the running sum of the tensor allocations and frees that ``torch.profiler`` records
  (``profile_memory=True``; PyTorch keeps no CPU allocator statistics and ``tracemalloc`` does not see tensor storage).
  Both are the MiB of tensors the call had alive at its peak beyond what already existed. :func:`rss_peak_mib` is a
  process-level cross-check (``VmHWM`` after the call minus ``VmRSS`` before, after ``malloc_trim``).
- Machine load (:class:`OtherLoad`): how many CPU cores *other* processes kept busy while a block ran (from
  ``/proc/stat``), recorded in every JSON: on a small shared CPU a timing is only as good as this figure.
- The record (:func:`record`, :func:`write_json`): the machine (CPU model, cores, threads, torch, device), the date, the
  exact command, the arguments, the load, the raw measurements and the summary tables that ``benchmarks.report``
  turns into the tables of benchmarks/README.md and the book. Written atomically.
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import itertools
import json
import os
import platform
import re
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.cpu import cpu_model

SCHEMA = 1
MIB = 2.0**20


# ------------------------------------------------------------------------------------------------------------- timing
def synchronize(device: torch.device | str) -> None:
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], Any], device: torch.device | str = "cpu") -> float:
    """Seconds of wall time of one ``fn()`` (its result dropped after the clock stops)."""
    synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    synchronize(device)
    elapsed = time.perf_counter() - t0
    del out
    return elapsed


def rotations(keys: Sequence[str], rounds: int) -> list[list[str]]:
    """The order of each round: ``keys`` rotated by one more place each round."""
    keys = list(keys)
    return [keys[r % len(keys):] + keys[:r % len(keys)] for r in range(rounds)] if keys else []


def round_robin(cases: Mapping[str, Callable[[], Any]], rounds: int, warmup: int = 1, *,
                before_each: Callable[[], None] | None = None, device: torch.device | str = "cpu",
                progress: Callable[[int], None] | None = None) -> dict[str, list[float]]:
    """``{case: [seconds per round]}``: ``warmup`` untimed rounds, then ``rounds`` rounds in rotated order.

    ``before_each`` (untimed) runs before every call, e.g. to restore parameters and clear ``.grad``.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(max(0, warmup)):
        for key, fn in cases.items():
            if before_each:
                before_each()
            time_call(fn, device)
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()  # no collector pauses inside timed calls; collected between rounds instead
    try:
        for r, order in enumerate(rotations(list(cases), rounds)):
            for key in order:
                if before_each:
                    before_each()
                times[key].append(time_call(cases[key], device))
            gc.collect()
            if progress:
                progress(r)
    finally:
        if gc_was_enabled:
            gc.enable()
    return times


# --------------------------------------------------------------------------------------------------------- statistics
def quartiles(values: Sequence[float]) -> tuple[float, float, float]:
    """``(q1, median, q3)`` (inclusive method: the quartiles of the sample itself)."""
    if not values:
        raise ValueError("no values")
    v = sorted(values)
    if len(v) == 1:
        return v[0], v[0], v[0]
    q1, q2, q3 = statistics.quantiles(v, n=4, method="inclusive")
    return q1, q2, q3


def summary(seconds: Sequence[float]) -> dict[str, float]:
    """Median, IQR and minimum of one case's times, in milliseconds."""
    q1, med, q3 = quartiles(seconds)
    return dict(median_ms=1e3 * med, iqr_ms=1e3 * (q3 - q1), q1_ms=1e3 * q1, q3_ms=1e3 * q3, min_ms=1e3 * min(seconds))


def within_round_ratio(times: Sequence[float], reference: Sequence[float]) -> float:
    """The median over rounds of ``times[r] / reference[r]``: a slow phase of the machine hits both calls of a round."""
    if len(times) != len(reference) or not times:
        raise ValueError(f"need one time per round for both cases, got {len(times)} and {len(reference)}")
    return statistics.median(a / b for a, b in zip(times, reference))


def ratio_of_medians(times: Sequence[float], reference: Sequence[float]) -> float:
    return statistics.median(times) / statistics.median(reference)


def rows(times: Mapping[str, Sequence[float]], references: Mapping[str, str | None],
         labels: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """One summary row per case: median/IQR, and the ratio to its reference case (``None`` for a reference)."""
    out = []
    for key, t in times.items():
        ref = references.get(key)
        out.append(dict(
            key=key, label=(labels or {}).get(key, key), **summary(t), reference=ref,
            ratio=within_round_ratio(t, times[ref]) if ref else None,
            ratio_of_medians=ratio_of_medians(t, times[ref]) if ref else None,
            times_ms=[1e3 * x for x in t],
        ))
    return out


# ------------------------------------------------------------------------------------------------------------- memory
def cuda_peak_mib(fn: Callable[[], Any], device: torch.device | str) -> float:
    synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = fn()
    synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del out
    return (peak - base) / MIB


def running_peak(nbytes: Sequence[int]) -> int:
    """The peak of the running sum of signed allocation sizes (frees negative), at least 0."""
    return max(0, max(itertools.accumulate(nbytes), default=0))


def cpu_tensor_peak_mib(fn: Callable[[], Any]) -> float | None:
    """Peak live CPU tensor memory above the start while ``fn()`` runs, from the profiler's memory events.

    Counts tensors only (not oneDNN/MKL scratch nor Python objects). The profiler does not record frees of blocks
    allocated before it started (it says so on stderr), which can only make the figure higher than the true peak.
    ``None`` if the profiler's event API is not the one expected (said rather than guessed).
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
        del out
    try:
        events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
                  and e.device_type() == torch.autograd.DeviceType.CPU]
    except AttributeError:
        return None
    events.sort(key=lambda e: e.start_ns())
    return running_peak([e.nbytes() for e in events]) / MIB


_LIBC = None


def _malloc_trim() -> None:
    global _LIBC
    try:
        if _LIBC is None:
            _LIBC = ctypes.CDLL("libc.so.6")
        _LIBC.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _proc_status_kib(field_name: str) -> int:
    with open("/proc/self/status") as fh:
        return int(re.search(rf"^{field_name}:\s+(\d+) kB", fh.read(), re.M).group(1))


def rss_peak_mib(fn: Callable[[], Any]) -> float | None:
    """``VmHWM`` after ``fn()`` minus ``VmRSS`` before it, the peak counter reset just before (Linux), else ``None``."""
    try:
        _malloc_trim()
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # reset the peak-RSS counter to the current RSS
        before = _proc_status_kib("VmRSS")
        out = fn()
        peak = _proc_status_kib("VmHWM")
        del out
        return max(0, peak - before) / 1024.0
    except (OSError, AttributeError):
        return None


def peak_memory_mib(fn: Callable[[], Any], device: torch.device | str = "cpu") -> float | None:
    """Peak tensor memory a call adds (CUDA allocator statistics, or the CPU profiler's tensor events)."""
    gc.collect()
    if torch.device(device).type == "cuda":
        return cuda_peak_mib(fn, device)
    return cpu_tensor_peak_mib(fn)


# ------------------------------------------------------------------------------------------------------- machine load
class OtherLoad:
    """Average number of CPU cores that *other* processes kept busy while the block ran (Linux ``/proc/stat``).

    Busy jiffies of the whole machine minus this process's own CPU time (children included), over the wall time. On a
    CPU shared with other jobs this is what a reader needs to judge a timing: when another process holds a core,
    multi-threaded torch ops wait at OpenMP barriers and times inflate many-fold; single-threaded ones slow down less.
    """

    def __enter__(self) -> "OtherLoad":
        self.cores: float | None = None
        self.load_average: tuple[float, float] | None = None
        self._start = self._read()
        self._load0 = _loadavg()
        return self

    def __exit__(self, *exc) -> None:
        end = self._read()
        load1 = _loadavg()
        if self._load0 is not None and load1 is not None:
            self.load_average = (self._load0, load1)
        if self._start is None or end is None:
            return
        (busy0, own0, wall0), (busy1, own1, wall1) = self._start, end
        if wall1 > wall0:
            self.cores = max(0.0, ((busy1 - busy0) - (own1 - own0)) / (wall1 - wall0))

    @staticmethod
    def _read() -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat") as fh:
                vals = [int(x) for x in fh.readline().split()[1:9]]
            tick = os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError):
            return None
        busy = (sum(vals) - vals[3] - vals[4]) / tick  # all but idle and iowait
        t = os.times()
        return busy, t.user + t.system + t.children_user + t.children_system, time.monotonic()


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def load_warning(cores: float | None, threads: int, device: torch.device | str = "cpu") -> str | None:
    """A warning when other processes and ``threads`` oversubscribe the CPU (CPU runs only), else ``None``."""
    ncpu = os.cpu_count() or 1
    if torch.device(device).type != "cpu" or cores is None or cores + threads <= ncpu + 0.2:
        return None
    return (f"WARNING: other processes kept {cores:.2f} CPU cores busy on average during this measurement; with "
            f"{threads} torch thread(s) on {ncpu} cores the times are upper bounds (rerun on an idle machine).")


# ------------------------------------------------------------------------------------------------------------ machine
def _version(name: str) -> str:
    import importlib.metadata as md

    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "not installed"


def machine(device: torch.device | str = "cpu") -> dict[str, Any]:
    """What the numbers were measured on: CPU model, cores, torch threads, versions, device (and GPU)."""
    device = torch.device(device)
    env: dict[str, Any] = dict(
        device=str(device), cpu=cpu_model(), cores=os.cpu_count(), threads=torch.get_num_threads(),
        interop_threads=torch.get_num_interop_threads(), torch=torch.__version__, python=platform.python_version(),
        transformers=_version("transformers"), peft=_version("peft"), platform=platform.platform(),
        omp_num_threads=os.environ.get("OMP_NUM_THREADS"),
    )
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    return env


def machine_line(env: Mapping[str, Any]) -> str:
    """One line naming the machine, as the tables' captions show it."""
    where = f"{env['gpu']} (CUDA {env.get('cuda')}), host {env['cpu']}" if env.get("gpu") else env["cpu"]
    return (f"{where}, {env['cores']} logical CPUs, {env['threads']} torch thread(s), torch {env['torch']}, "
            f"device {env['device']}")


# ------------------------------------------------------------------------------------------------------------- record
def command_line(module: str, argv: Sequence[str] | None) -> str:
    """The exact command that reproduces the run, with the thread variables it ran under."""
    argv = list(sys.argv[1:] if argv is None else argv)
    threads = " ".join(f"{v}={os.environ[v]}" for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS") if v in os.environ)
    return (threads + " " if threads else "") + shlex.join(["python", "-m", module, *argv])


def table(title: str, columns: Sequence[tuple[str, str]], body: Sequence[Sequence[Any]], note: str = "") -> dict:
    """A summary table for the report: ``columns`` are ``(header, format)``; a format is a ``format()`` spec applied
    to numbers (``"s"`` for text), a cell ``None`` prints as "n/a"."""
    cols = [dict(header=h, format=f) for h, f in columns]
    for row in body:
        if len(row) != len(cols):
            raise ValueError(f"row {row!r} has {len(row)} cells for {len(cols)} columns")
    return dict(title=title, columns=cols, rows=[list(r) for r in body], note=note)


def record(benchmark: str, argv: Sequence[str] | None, device: torch.device | str, args: argparse.Namespace | dict,
           load: OtherLoad | None, results: Any, tables: Sequence[dict], started: float | None = None) -> dict:
    """The JSON document of one run (schema :data:`SCHEMA`)."""
    arg_dict = dict(vars(args) if isinstance(args, argparse.Namespace) else args)
    return dict(
        schema=SCHEMA, benchmark=benchmark,
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        command=command_line(f"benchmarks.{benchmark}", argv), machine=machine(device),
        args={k: v for k, v in arg_dict.items() if not k.startswith("_")},
        other_load_cores=None if load is None else load.cores,
        load_average=None if load is None or load.load_average is None else list(load.load_average),
        seconds=None if started is None else time.perf_counter() - started,
        results=results, tables=list(tables),
    )


REQUIRED = {"schema": int, "benchmark": str, "date": str, "command": str, "machine": dict, "args": dict,
            "tables": list}
MACHINE_KEYS = ("device", "cpu", "cores", "threads", "torch")


def validate(doc: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` naming what is missing or malformed in a benchmark record."""
    for key, kind in REQUIRED.items():
        if not isinstance(doc.get(key), kind):
            raise ValueError(f"benchmark record: {key!r} must be a {kind.__name__}, got {doc.get(key)!r}")
    if doc["schema"] != SCHEMA:
        raise ValueError(f"benchmark record: schema {doc['schema']} (this code reads schema {SCHEMA})")
    missing = [k for k in MACHINE_KEYS if k not in doc["machine"]]
    if missing:
        raise ValueError(f"benchmark record: machine lacks {missing}")
    if "other_load_cores" not in doc:
        raise ValueError("benchmark record: 'other_load_cores' missing (None when it could not be measured)")
    for t in doc["tables"]:
        if not {"title", "columns", "rows"} <= set(t):
            raise ValueError(f"benchmark record: a table needs title, columns and rows, got {sorted(t)}")
        for row in t["rows"]:
            if len(row) != len(t["columns"]):
                raise ValueError(f"benchmark record: table {t['title']!r}: row {row!r} does not match its columns")


def write_json(path: str | Path, doc: Mapping[str, Any]) -> Path:
    """Validate and write ``doc`` atomically (temporary file in the same folder, then ``os.replace``)."""
    validate(doc)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=float) + "\n")
    os.replace(tmp, path)
    return path


# ------------------------------------------------------------------------------------------------------------ CLI glue
def add_common_arguments(p: argparse.ArgumentParser, *, repeats: int, warmup: int = 1, device: bool = True) -> None:
    """``--repeats --warmup --threads --json --seed`` (and ``--device``): the same meaning in every benchmark."""
    if device:
        p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--repeats", type=int, default=repeats, help=f"timed round-robin rounds (default {repeats})")
    p.add_argument("--warmup", type=int, default=warmup, help=f"untimed warm-up rounds (default {warmup})")
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads (default 1: on a small shared CPU more threads stall at barriers)")
    p.add_argument("--json", metavar="PATH", help="also write every measurement and the summary table(s) as JSON")
    p.add_argument("--seed", type=int, default=0)


def check_common(p: argparse.ArgumentParser, args: argparse.Namespace) -> torch.device:
    """Validate the common arguments, apply ``--threads``; returns the device."""
    if args.repeats < 1 or args.warmup < 0 or args.threads < 1:
        p.error(f"--repeats >= 1, --warmup >= 0 and --threads >= 1 required, got {args.repeats}, {args.warmup}, "
                f"{args.threads}")
    device = torch.device(getattr(args, "device", "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch.cuda.is_available() is False")
    torch.set_num_threads(args.threads)
    return device


def finish(doc: dict, json_path: str | None) -> None:
    """Print the load line (and a warning), write the JSON if asked."""
    cores = doc.get("other_load_cores")
    busy = "n/a" if cores is None else f"{cores:.2f}"
    print(f"\n(other processes kept {busy} CPU cores busy on average during the run; "
          f"{doc['seconds']:.0f} s)" if doc.get("seconds") is not None else f"\n(other load {busy} cores)", flush=True)
    warning = load_warning(cores, doc["machine"]["threads"], doc["machine"]["device"])
    if warning:
        print(warning, flush=True)
    if json_path:
        print(f"wrote {write_json(json_path, doc)}", flush=True)
