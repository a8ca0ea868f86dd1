"""GPT-2 full fine-tuning: an ``IEF`` step against an AdamW step, per-sample J against a backward, with a profile.

Run from the repository root::

    python -m benchmarks gpt2_full --device cuda --json benchmarks/results/gpt2_full-h200.json  # GPT-2 small, M 8
    OMP_NUM_THREADS=1 python -m benchmarks gpt2_full --size tiny                                 # the same on a CPU
    OMP_NUM_THREADS=1 python -m benchmarks gpt2_full --size mini --tokens 64 --before 7133bdc \
        --json benchmarks/results/gpt2_full-cpu.json                                             # the CPU proxy
    OMP_NUM_THREADS=1 python -m benchmarks gpt2_full --memory-only \
        --json benchmarks/results/gpt2_full-small-memory-cpu.json                               # GPT-2 small's memory

The model is ``GPT2LMHeadModel`` from a config with random weights (no download), every parameter trainable, eval mode
(dropout off), float32; ``--size small`` is GPT-2 small's architecture (768 wide, 12 layers, 12 heads, vocabulary
50,257: 124M parameters tied, 163M untied), ``--size mini`` a 4-layer, 256-wide one with an 8,192-word vocabulary
(5.3M tied, 7.4M untied: the proxy of GPT-2 small on one CPU thread, its Linear weights in the same "rows" form at
``M = 8``, ``T = 64``, its token table as large a share of ``P``), ``--size tiny`` a 2-layer, 64-wide one (a smoke
test). Both heads are measured:
``tied`` (the LM head shares the token table, as GPT-2 ships) and ``untied`` (``tie_word_embeddings=False``). The
targets are next tokens, the last position ignored; the loss is the sum of the token losses (``reduction="sum"``, the
optimisers' convention). Cases, round-robin (``benchmarks.harness``): ``backward`` (forward, loss, backward: the
reference of the per-sample rows), ``ief.per_sample(form="auto")`` (the optimisers' form), one ``torch.optim.AdamW``
step (forward, backward, update: the reference of the step) and one ``ief.optim.IEF`` step (``lr`` 1e-4, default
damping; its exact check is done in the warm-up). After the timing, on each head: the peak memory each step adds
(:func:`benchmarks.harness.peak_memory_mib`), one ``IEF`` step under ``torch.profiler`` (the operators with the most
self time on the device, or on the CPU without one), and on CUDA one steady-state step under
``torch.cuda.set_sync_debug_mode("error")``: the first host synchronisation it meets, or none; then the steady step's
time by phase (per-sample J, finiteness, Gram, solve, combination, update, the streamed weights' share of the Gram and
the combination: :mod:`benchmarks.phases`) and its host round-trips and dispatched operators
(:mod:`benchmarks.host_syncs`). ``--before REV`` also times the ``IEF`` step of the package as of git revision ``REV``
(``git archive``, imported as ``ief_before``) in the same rounds, with its phases and counts: before and after in one
run. ``--memory-only`` skips all of that: one steady AdamW step and one steady ``IEF`` step per head, the peak of new
tensors each adds and what each optimiser holds (:func:`memory_head`), for GPT-2 small on a CPU, where a step takes
seconds and the rounds would take hours.
"""
from __future__ import annotations

import argparse
import copy
import gc
import tempfile
import time
import warnings
from typing import Any

import torch

import ief
from benchmarks import harness, host_syncs, phases
from benchmarks.hf_layers import load_before

SIZES = {
    "small": dict(n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024),
    "mini": dict(n_embd=256, n_layer=4, n_head=4, vocab_size=8192, n_positions=128),
    "tiny": dict(n_embd=64, n_layer=2, n_head=4, vocab_size=1000, n_positions=128),
}
HEADS = ("tied", "untied")
LABELS = {
    "backward": "plain backward",
    "per_sample": "`ief.per_sample(form=\"auto\")`",
    "adamw_step": "AdamW step",
    "ief_step": "`IEF` step",
    "ief_step_rows": "`IEF` step, form=\"rows\"",
    "ief_step_before": "`IEF` step before",
}


def build(size: str, head: str, m: int, t: int, seed: int, device: torch.device):
    """``(model, inputs, targets)``: GPT-2 of ``size`` with a ``head`` (tied or untied) LM head, on ``device``."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.GPT2Config(**SIZES[size], bos_token_id=0, eos_token_id=0, tie_word_embeddings=head == "tied")
    model = tf.GPT2LMHeadModel(cfg).to(device).eval()
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, cfg.vocab_size, (m, t + 1), generator=gen)
    targets = ids[:, 1:].clone()
    targets[:, -1] = ief.IGNORE_INDEX
    return model, {"input_ids": ids[:, :-1].to(device)}, targets.to(device)


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum",
                                             ignore_index=ief.IGNORE_INDEX)


def adamw_case(model, x: dict, y: torch.Tensor):
    """``(step, optimiser)``: one AdamW step (forward, summed loss, backward, update) on its own copy of ``model``."""
    adam_model = copy.deepcopy(model)
    adam = torch.optim.AdamW(adam_model.parameters(), lr=1e-4)

    def adamw_step():
        adam.zero_grad(set_to_none=True)
        _loss(adam_model(**x).logits, y).backward()
        adam.step()

    return adamw_step, adam


def cases(model, x: dict, y: torch.Tensor, before: Any = None) -> dict:
    """The four timed calls, and with ``before`` (an older ``ief`` package) its ``IEF`` step; the steps on their own
    copies of the model."""
    params = [p for p in model.parameters() if p.requires_grad]

    def backward():
        for p in params:
            p.grad = None
        _loss(model(**x).logits, y).backward()

    adamw_step, adam = adamw_case(model, x, y)
    opt = ief.optim.IEF(copy.deepcopy(model), lr=1e-4)
    rows = ief.optim.IEF(copy.deepcopy(model), lr=1e-4, form="rows")  # every weight's rows kept: the route before
    out = {
        "backward": backward,
        "per_sample": lambda: ief.per_sample(model, x, y, form="auto"),
        "adamw_step": adamw_step,
        "ief_step": lambda: opt.step(x, y),
        "ief_step_rows": lambda: rows.step(x, y),
    }
    held = {"adamw_step": adam, "ief_step": opt, "ief_step_rows": rows}
    out["held_mib"] = lambda key: held_mib(held[key])
    if before is not None:
        old = before.optim.IEF(copy.deepcopy(model), lr=1e-4)
        out["ief_step_before"] = lambda: old.step(x, y)
    return out


def held_mib(opt: torch.optim.Optimizer) -> float:
    """The tensors an optimiser keeps from step to step (MiB): AdamW's moments and step counters, an exact
    optimiser's reused ``J`` buffer and momentum buffers; what a step's peak of new tensors does not count."""
    tensors = [t for state in opt.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    buffer = getattr(opt, "_buffer", None)
    return sum(t.numel() * t.element_size() for t in [*tensors, *([buffer] if buffer is not None else [])]) / 2**20


def first_sync(step, device: torch.device) -> str | None:
    """The first host synchronisation a steady-state call of ``step`` meets (CUDA), ``None`` if it meets none;
    ``"n/a"`` on a CPU, where the debug mode does not exist."""
    if device.type != "cuda":
        return "n/a"
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    except RuntimeError as err:
        return str(err).splitlines()[0][:200]
    finally:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize(device)
    return None


def profile_rows(step, device: torch.device, rows: int) -> list[list]:
    """``[operator, calls, self ms]`` of the ``rows`` operators with the most self time in one call of ``step``
    (device time on CUDA, CPU time otherwise)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        harness.synchronize(device)
    attr = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, attr, 0.0), reverse=True)
    return [[e.key[:60], e.count, getattr(e, attr, 0.0) / 1e3] for e in events[:rows]]


def memory_head(args, head: str, device: torch.device) -> dict:
    """``--memory-only``: one steady AdamW step and one steady ``IEF`` step (default ``form="auto"``) on their own
    copies of the model, after ``warmup + 1`` steps each (the first IEF step takes its exact per-sample check): the
    peak of new tensors each adds, what each optimiser holds from step to step and the measured step's wall seconds
    (with the memory profiler on). No timing rounds: made for GPT-2 small on a CPU, where a step takes seconds."""
    gc.collect()  # the previous head's models and optimisers (cycles through hooks), before this head's are built
    model, x, y = build(args.size, head, args.batch, args.tokens, args.seed, device)
    adamw_step, adam = adamw_case(model, x, y)
    opt = ief.optim.IEF(model, lr=1e-4)
    steps = {"adamw_step": (adamw_step, adam), "ief_step": (lambda: opt.step(x, y), opt)}
    peak, held, seconds = {}, {}, {}
    with harness.OtherLoad() as load, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for key, (step, optimiser) in steps.items():
            for _ in range(args.warmup + 1):
                step()
            start = time.perf_counter()
            peak[key] = harness.peak_memory_mib(step, device)
            seconds[key] = time.perf_counter() - start
            held[key] = held_mib(optimiser)
    routes = sorted(set(opt.last_step_report.routes.values()))
    print(f"\n{args.size} GPT-2, {head} head, one steady step: peak MiB added AdamW {peak['adamw_step']:.0f}, IEF "
          f"{peak['ief_step']:.0f}; held AdamW {held['adamw_step']:.0f}, IEF {held['ief_step']:.0f}; IEF routes "
          f"{', '.join(routes)}", flush=True)
    return dict(head=head, params=sum(p.numel() for p in model.parameters()), memory_only=True, peak_mib=peak,
                held_mib=held, seconds=seconds, routes=routes, other_load_cores=load.cores)


def run_head(args, head: str, device: torch.device, before: Any = None) -> dict:
    model, x, y = build(args.size, head, args.batch, args.tokens, args.seed, device)
    n_params = sum(p.numel() for p in model.parameters())
    calls = cases(model, x, y, before)
    held_of = calls.pop("held_mib")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        calls["per_sample"]()
    slow = [str(w.message)[:300] for w in caught if type(w.message).__name__ == "SlowPathWarning"]
    with harness.OtherLoad() as load, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        times = harness.round_robin(calls, args.repeats, args.warmup, device=device)
        refs = {"backward": None, "per_sample": "backward", "adamw_step": None, "ief_step": "adamw_step",
                "ief_step_rows": "adamw_step", "ief_step_before": "adamw_step"}
        rows = harness.rows(times, {k: v for k, v in refs.items() if k in calls}, LABELS)
        stepping = ("adamw_step", "ief_step", "ief_step_rows")
        memory = {k: harness.peak_memory_mib(calls[k], device) for k in stepping}
        held = {k: held_of(k) for k in stepping}
        sync = first_sync(calls["ief_step"], device)
        prof = profile_rows(calls["ief_step"], device, args.profile_rows)
        steps = {"ief_step": ief, "ief_step_before": before}
        split = {k: phases.attribute(lib, calls[k], device, args.repeats) for k, lib in steps.items() if k in calls}
        counts = {k: host_syncs.count_call(calls[k]) for k in (*steps, *stepping) if k in calls}
        counted = {k: dict(round_trips=c.round_trips, operators=c.operators) for k, c in counts.items()}
    print(f"\n{args.size} GPT-2, {head} head: P = {n_params:,}, M = {args.batch}, T = {args.tokens}, "
          f"loop: {slow[0] if slow else 'none'}", flush=True)
    for r in rows:
        print(f"{r['label']:<34} {r['median_ms']:>10.2f} ms  {(r['ratio'] or 1.0):>6.2f}x", flush=True)
    mib = {k: "n/a" if v is None else f"{v:.1f}" for k, v in memory.items()}
    print(f"peak MiB added: AdamW {mib['adamw_step']}, IEF {mib['ief_step']}, IEF rows {mib['ief_step_rows']}; held "
          f"from step to step: AdamW {held['adamw_step']:.1f}, IEF {held['ief_step']:.1f}, IEF rows "
          f"{held['ief_step_rows']:.1f}; operators: AdamW {counted['adamw_step']['operators']}, IEF "
          f"{counted['ief_step']['operators']}, IEF rows {counted['ief_step_rows']['operators']}; first host sync of "
          f"a steady IEF step: {sync}", flush=True)
    for name, count, ms in prof:
        print(f"  {name:<60} {count:>6} {ms:>9.3f} ms", flush=True)
    for k, ms in split.items():
        parts = ", ".join(f"{phase} {value:.1f}" for phase, value in ms.items())
        trips = counted[k]["round_trips"]
        print(f"{k} phases (median ms; finite and stream_* nest in their callers): {parts}; {trips} host "
              f"round-trips, {counted[k]['operators']} operators", flush=True)
    return dict(head=head, params=n_params, rows=rows, peak_mib=memory, held_mib=held, first_sync=sync, profile=prof,
                phases_ms=split, counts=counted, slow_path=slow, other_load_cores=load.cores)


def memory_table(results: list[dict]) -> dict:
    """The ``--memory-only`` table: one steady step's memory, IEF against AdamW."""
    body = []
    for r in results:
        peak, held = r["peak_mib"], r["held_mib"]
        both = {k: peak[k] + held[k] for k in peak}
        body.append([r["head"], r["params"], peak["ief_step"], peak["adamw_step"],
                     peak["ief_step"] / peak["adamw_step"], held["ief_step"], held["adamw_step"],
                     both["ief_step"] / both["adamw_step"], ", ".join(r["routes"])])
    return harness.table(
        "GPT-2 full fine-tuning: one steady step's memory, IEF (form=\"auto\") against AdamW",
        [("head", "s"), ("parameters", ",d"), ("IEF peak MiB", ".0f"), ("AdamW peak MiB", ".0f"),
         ("peak IEF / AdamW", ".2f"), ("IEF held MiB", ".0f"), ("AdamW held MiB", ".0f"),
         ("peak + held IEF / AdamW", ".2f"), ("IEF routes", "s")],
        body, note="peak: the new tensors the step adds at its peak (CPU: the profiler's tensor events); held: what "
                   "the optimiser keeps from step to step (AdamW's moments; IEF's reused J buffer of the rows it "
                   "keeps); each after its warm-up steps, one measured step each (--memory-only: no timing rounds)")


def summary_tables(results: list[dict], before: str | None) -> list[dict]:
    if results and all(r.get("memory_only") for r in results):
        return [memory_table(results)]
    body, split = [], []
    for r in results:
        by = {row["key"]: row for row in r["rows"]}
        peak, held, ops = r["peak_mib"], r.get("held_mib", {}), r["counts"]
        body.append([r["head"], r["params"], by["backward"]["median_ms"], by["per_sample"]["ratio"],
                     by["adamw_step"]["median_ms"], by["ief_step"]["median_ms"], by["ief_step"]["ratio"],
                     by.get("ief_step_rows", {}).get("ratio"), by.get("ief_step_before", {}).get("ratio"),
                     peak["ief_step"], peak["adamw_step"], held.get("ief_step"), held.get("adamw_step"),
                     ops.get("ief_step", {}).get("operators"), ops.get("adamw_step", {}).get("operators"),
                     r["first_sync"] or "none"])
        for key, ms in r["phases_ms"].items():
            split.append([r["head"], "before" if key == "ief_step_before" else "now",
                          *(ms.get(phase) for phase in phases.PHASES), r["counts"][key]["operators"],
                          r["counts"][key]["round_trips"]])
    return [harness.table(
        "GPT-2 full fine-tuning: per-sample J over a backward, the IEF step over an AdamW step",
        [("head", "s"), ("parameters", ",d"), ("backward ms", ".1f"), ("per-sample J / backward", ".2f"),
         ("AdamW step ms", ".1f"), ("IEF step ms", ".1f"), ("IEF / AdamW", ".2f"),
         ("IEF form=rows / AdamW", ".2f"), ("IEF before / AdamW", ".2f"), ("IEF peak MiB", ".0f"),
         ("AdamW peak MiB", ".0f"), ("IEF held MiB", ".1f"), ("AdamW held MiB", ".1f"), ("IEF operators", "d"),
         ("AdamW operators", "d"), ("first host sync in a steady IEF step", "s")],
        body, note="peak: the new tensors a steady step adds at its peak; held: what the optimiser keeps from step to "
                   "step (AdamW's moments; IEF's reused J buffer: with form=\"rows\" every weight's rows, with the "
                   "default form=\"auto\" the streamed weights' are not in it, ief.streamed); operators: one steady "
                   "step's dispatched aten operators (benchmarks/host_syncs.py)"
                   + (f"; 'before': ief at {before}, loaded from git, timed in the same rounds" if before else "")),
        harness.table(
        "GPT-2 full fine-tuning: a steady IEF step by phase (median ms; benchmarks/phases.py)",
        [("head", "s"), ("ief", "s"), *((phase, ".1f") for phase in phases.PHASES), ("operators", "d"),
         ("host round-trips", "d")],
        split, note="finite nests in its caller (per_sample before, update now), stream_gram and stream_combine (the "
                    "streamed weights' blocks) in gram and combine; other = step - per_sample - gram - solve - combine "
                    "- update; operators and round-trips: benchmarks/host_syncs.py, one steady step")]


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpt2_full", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_common_arguments(p, repeats=7, warmup=1)
    p.add_argument("--size", choices=tuple(SIZES), default="small", help="GPT-2 architecture (default small)")
    p.add_argument("--heads", default=",".join(HEADS), help=f"comma-separated subset of {','.join(HEADS)}")
    p.add_argument("--batch", type=int, default=8, help="M (default 8)")
    p.add_argument("--tokens", type=int, default=128, help="T (default 128)")
    p.add_argument("--profile-rows", type=int, default=12)
    p.add_argument("--before", default=None, help="git revision of an older ief whose IEF step is timed alongside "
                                                  "(loaded with git archive; default none)")
    p.add_argument("--memory-only", action="store_true",
                   help="only one steady step's memory, AdamW and IEF (no timing rounds; GPT-2 small on a CPU)")
    args = p.parse_args(argv)
    device = harness.check_common(p, args)
    heads = [h.strip() for h in args.heads.split(",") if h.strip()]
    bad = [h for h in heads if h not in HEADS]
    if bad or not heads:
        p.error(f"--heads takes a comma-separated subset of {','.join(HEADS)}, got {args.heads!r}")
    if args.memory_only and args.before:
        p.error(f"--memory-only measures the current package only; drop --before {args.before}")
    if args.batch < 2 or args.tokens < 2:
        p.error(f"--batch and --tokens must be >= 2, got {args.batch} and {args.tokens}")
    print(harness.machine_line(harness.machine(device)), flush=True)
    with tempfile.TemporaryDirectory() as folder:
        before = load_before(args.before, folder) if args.before else None
        if args.before and before is None:
            p.error(f"--before: git archive of {args.before!r} failed")
        results = [memory_head(args, head, device) if args.memory_only else run_head(args, head, device, before)
                   for head in heads]
    loads = [r["other_load_cores"] for r in results if r["other_load_cores"] is not None]
    doc = harness.record("gpt2_full", argv, device, args, None, results, summary_tables(results, args.before),
                         started)
    doc["other_load_cores"] = max(loads) if loads else None
    harness.finish(doc, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
