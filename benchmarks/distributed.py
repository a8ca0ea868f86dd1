"""The exact iEF step across processes against DDP + AdamW: time per step, and the bytes each process moves.

Run from the repository root::

    OMP_NUM_THREADS=1 python -m benchmarks distributed                  # 2 gloo processes on the CPU, one thread each
    python -m benchmarks distributed --device cuda --world 1           # the NCCL code path on one GPU

``--world`` processes are spawned (``torch.multiprocessing``, ``file://`` rendezvous in a temporary folder; gloo on
the CPU, NCCL with ``--device cuda``, rank ``r`` on ``cuda:r``). Every rank builds the same model (same seed) and its
own ``--batch`` samples (seed ``seed + 1 + rank``). Cases, timed round-robin on every rank in the same order
(:mod:`benchmarks.harness`); a round's time is the slowest rank's (a step ends for all ranks together):

- ``ief``: one ``ief.optim.IEF(model, process_group=WORLD)`` step: exactly one process's step on the union batch
  (:mod:`ief.distributed`: the Gram from the all-gathered factors of the Linear weights where they are smaller than
  their rows, and column chunks of the other rows; one all-reduce of the direction);
- ``ddp``: ``DistributedDataParallel`` + ``AdamW``: ``zero_grad``, forward, ``backward`` (with DDP's bucketed gradient
  all-reduce) and the AdamW step, on the same local batch, the loss the summed cross-entropy (as IEF's).
- ``ief_one``: one ``IEF`` step of one process on the union batch (every rank's batch concatenated; a group of one
  process, so no communication): the same update, what the exact step across processes costs beside it.

With ``--fsdp2`` (the ``mlp`` only), two more cases on a copy of the model sharded with FSDP2 (``fully_shard`` on each
``Linear``, then on the root), and their peak memory per rank (``torch.distributed._tools.mem_tracker.MemTracker``:
every tensor live on the rank during one step, the model's and the optimiser's included, at its peak):

- ``ief_fsdp2``: one ``ief.optim.IEF(model)`` step on the sharded model (:mod:`ief.sharded`: warmed, its rows taken
  under FSDP2's own per-module unshard, the replicated route's Gram, this rank's shards of the direction, the local
  shards updated);
- ``fsdp2_adamw``: FSDP2 + ``AdamW``: ``zero_grad``, forward, ``backward`` (FSDP2's all-gathers and gradient
  reduce-scatter) and the step, on the same local batch.

Models: ``mlp`` (``benchmarks.workloads``' 784-256-256-10 tanh MLP, every parameter trainable) and ``bert-lora`` (a
``BertForSequenceClassification`` from a config, hidden 128, 2 layers, 4 heads, vocabulary 1,000, ``--tokens``
tokens, random weights, with peft LoRA r=8 on query/value and the classifier trainable; eval mode, so dropout is off
in both cases).

Bytes: every ``torch.distributed`` collective a step calls through ``torch.distributed.<name>`` (``all_gather``,
``all_reduce``, ``all_gather_object``, ``broadcast``) is wrapped for one further step and its payload counted per rank:
``all_gather`` sends its input tensor and receives the gathered list (every rank's part, its own included, as the
formula of :mod:`ief.distributed` counts it); ``all_reduce`` sends and receives its tensor (the payload; a ring
all-reduce moves about ``2 (R - 1) / R`` of it each way); ``all_gather_object`` the pickled objects. DDP's gradient
all-reduce runs inside its C++ reducer, out of the wrappers' sight (FSDP2's collectives do not: ``all_gather_single``
counts its input sent and its output received, ``reduce_scatter_single`` its input sent and ``R`` times its output
received, every rank's contribution to this rank's part): its bytes are the size of its buckets, the sum of the
trainable gradients' bytes (``4 P`` in float32), sent and received (``broadcast_buffers=False``: the models'
buffers are constants). Beside them, :mod:`ief.distributed`'s formula: the Gram's all-gathers as the step's
:class:`ief.distributed.GramPlan` counts them, ``M_max R (P_dense + sum_l T_l (I_l + O_l)) b`` (``b = 4`` for float32
rows; the weights gathered as factors, and an embedding table kept as used rows counted as its union's ``U_union D``
columns in ``P_dense``, from the plan recorded from the step itself), plus ``8 P`` (the direction's float64
all-reduce).
"""
from __future__ import annotations

import argparse
import copy
import functools
import importlib
import json
import pickle
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import ief
import ief.distributed
from benchmarks import harness
from benchmarks.workloads import _quiet_transformers, build_mlp, logits_of

MODELS = ("mlp", "bert-lora")
COUNTED = ("all_gather", "all_reduce", "all_gather_object", "broadcast", "all_gather_single", "reduce_scatter_single")
LABELS = {"ief": "`IEF(process_group=WORLD)` step", "ddp": "DDP + AdamW step",
          "ief_one": "`IEF` step, one process on the union batch", "ief_fsdp2": "`IEF` step, FSDP2 model",
          "fsdp2_adamw": "FSDP2 + AdamW step"}
REFERENCES = {"ief": "ddp", "ddp": None, "ief_one": "ddp", "ief_fsdp2": "fsdp2_adamw", "fsdp2_adamw": None}


# ------------------------------------------------------------------------------------------------------------ models
def build(name: str, batch: int, tokens: int, seed: int, rank: int, device: torch.device
          ) -> tuple[torch.nn.Module, Any, torch.Tensor, str]:
    """``(model, inputs, targets, description)``: the same model on every rank, the rank's own batch.

    Args:
        name: ``"mlp"`` or ``"bert-lora"``.
        batch: the rank's number of samples.
        tokens: tokens per sentence (``bert-lora``).
        seed: the model's seed; the rank's data use ``seed + 1 + rank``.
        rank: this process's rank.
        device: where the model and batch live.

    Returns:
        The float32 model, its inputs (a tensor or a dict of keyword arguments), class targets ``[batch]`` and one
        line describing it.

    Raises:
        ValueError: an unknown model name.
    """
    data = torch.Generator().manual_seed(seed + 1 + rank)
    if name == "mlp":
        w = build_mlp(1, device, seed)  # the model of seed ``seed``; the rank's batch below
        x = torch.randn(batch, 784, generator=data).to(device)
        return w.model, x, torch.randint(0, 10, (batch,), generator=data).to(device), w.description
    if name == "bert-lora":
        import peft
        import transformers as tf

        _quiet_transformers()
        torch.manual_seed(seed)
        config = tf.BertConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=512, max_position_embeddings=max(64, tokens), num_labels=2)
        model = peft.get_peft_model(tf.BertForSequenceClassification(config), peft.LoraConfig(
            task_type="SEQ_CLS", r=8, lora_alpha=16, target_modules=["query", "value"]))
        with torch.no_grad():  # LoRA B off its zero initialisation, as after some training
            for pname, p in model.named_parameters():
                if "lora_B" in pname:
                    p.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(seed + 2))
        ids = torch.randint(5, 1000, (batch, tokens), generator=data)
        inputs = {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device)}
        desc = (f"BERT from a config (hidden 128, 2 layers, 4 heads, vocab 1000, {tokens} tokens, random weights) "
                f"+ peft LoRA r=8 on query,value, classifier trainable; eval mode")
        return model.to(device).eval(), inputs, torch.randint(0, 2, (batch,), generator=data).to(device), desc
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


# ------------------------------------------------------------------------------------------------------------- bytes
def _nbytes(tensors: Any) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_nbytes(t) for t in tensors)


def _payload(name: str, args: tuple, kwargs: dict, world: int) -> tuple[int, int]:
    """``(sent, received)`` payload bytes of one collective call on this rank (see the module docstring)."""
    if name == "all_gather":
        output = args[0] if args else kwargs["tensor_list"]
        tensor = args[1] if len(args) > 1 else kwargs["tensor"]
        return _nbytes(tensor), _nbytes(output)
    if name == "all_reduce":
        tensor = args[0] if args else kwargs["tensor"]
        return _nbytes(tensor), _nbytes(tensor)
    if name == "broadcast":
        tensor = args[0] if args else kwargs["tensor"]
        return _nbytes(tensor), _nbytes(tensor)
    if name == "all_gather_single":
        return _nbytes(args[1] if len(args) > 1 else kwargs["input_tensor"]), _nbytes(
            args[0] if args else kwargs["output_tensor"])
    if name == "reduce_scatter_single":
        output = args[0] if args else kwargs["output"]
        return _nbytes(args[1] if len(args) > 1 else kwargs["input"]), world * _nbytes(output)
    if name == "all_gather_object":
        output = args[0] if args else kwargs["object_list"]
        obj = args[1] if len(args) > 1 else kwargs["obj"]
        return len(pickle.dumps(obj)), sum(len(pickle.dumps(o)) for o in output)
    raise ValueError(f"no payload rule for {name!r}")


@contextmanager
def recording_plans() -> Iterator[list]:
    """Record the :class:`ief.distributed.GramPlan` of every Gram formed across processes inside the block.

    Yields:
        The list of plans, filled as the block runs.
    """
    plans, original = [], ief.distributed.DistributedRows.plan

    @functools.wraps(original)
    def recorded(rows):
        plans.append(original(rows))
        return plans[-1]

    ief.distributed.DistributedRows.plan = recorded
    try:
        yield plans
    finally:
        ief.distributed.DistributedRows.plan = original


@contextmanager
def counting_collectives(world: int) -> Iterator[dict[str, int]]:
    """Count the payload bytes of the collectives called as ``torch.distributed.<name>`` inside the block.

    Args:
        world: the number of processes.

    Yields:
        ``{"sent": bytes, "received": bytes, "calls": n}``, filled as the block runs (this rank's figures).
    """
    counts = {"sent": 0, "received": 0, "calls": 0}
    originals = {name: getattr(dist, name, None) for name in COUNTED}

    def wrap(name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            result = fn(*args, **kwargs)  # all_gather_object fills its list: count after the call
            sent, received = _payload(name, args, kwargs, world)
            counts["sent"] += sent
            counts["received"] += received
            counts["calls"] += 1
            return result
        return counted

    for name, fn in originals.items():
        if fn is not None:
            setattr(dist, name, wrap(name, fn))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            if fn is not None:
                setattr(dist, name, fn)


def formula_bytes(params: int, plan: Any, world: int) -> dict[str, int]:
    """:mod:`ief.distributed`'s communication per step and DDP's, per rank, in bytes.

    Args:
        params: trainable parameters ``P``.
        plan: the step's :class:`ief.distributed.GramPlan` (``None`` with one process).
        world: the number of processes ``R``.

    Returns:
        ``gram`` (the plan's ``received_bytes``, ``M_max R (P_dense + sum_l T_l (I_l + O_l)) b``), ``direction``
        (``8 P``), ``ief`` (their sum) and ``ddp`` (``4 P``); with one process ``IEF`` calls no collective (a group
        of one is no group), so its entries are 0.
    """
    gram, direction = (0, 0) if world == 1 or plan is None else (plan.received_bytes, 8 * params)
    return dict(gram=gram, direction=direction, ief=gram + direction, ddp=4 * params)


# ------------------------------------------------------------------------------------------------------------- ranks
def union_batch(name: str, args: argparse.Namespace, world: int, device: torch.device) -> tuple[Any, torch.Tensor]:
    """Every rank's batch concatenated in rank order: the batch one process would step on."""
    parts = [build(name, args.batch, args.tokens, args.seed, r, device)[1:3] for r in range(world)]
    targets = torch.cat([t for _, t in parts])
    if isinstance(parts[0][0], dict):
        return {k: torch.cat([x[k] for x, _ in parts]) for k in parts[0][0]}, targets
    return torch.cat([x for x, _ in parts]), targets


def cases_of(name: str, args: argparse.Namespace, rank: int, device: torch.device) -> tuple[dict, dict]:
    """The three cases of one model on this rank, and what describes it."""
    model, inputs, targets, desc = build(name, args.batch, args.tokens, args.seed, rank, device)
    ddp_model, one_model = copy.deepcopy(model), copy.deepcopy(model)
    opt = ief.optim.IEF(model, lr=args.lr, damping=args.damping, process_group=dist.group.WORLD)
    world = dist.get_world_size()
    alone = [dist.new_group([r]) for r in range(world)]  # every rank makes every group, in the same order
    one = ief.optim.IEF(one_model, lr=args.lr, damping=args.damping, process_group=alone[rank])  # a group of one
    union_inputs, union_targets = union_batch(name, args, world, device)
    with warnings.catch_warnings():  # broadcast_buffers=False: no sync of the (constant) buffers, at init or after
        warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
        ddp = torch.nn.parallel.DistributedDataParallel(
            ddp_model, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False)
    adamw = torch.optim.AdamW(trainable(ddp_model), lr=1e-4)

    def ddp_step():
        adamw.zero_grad(set_to_none=True)
        logits = logits_of(ddp, inputs)
        loss = F.cross_entropy(logits, targets, reduction="sum")
        loss.backward()
        adamw.step()
        return loss.detach()

    info = dict(model=name, description=desc, params=sum(p.numel() for p in trainable(model)))
    cases = {"ief": lambda: opt.step(inputs, targets), "ddp": ddp_step,
             "ief_one": lambda: one.step(union_inputs, union_targets)}
    if args.fsdp2 and name == "mlp":
        cases.update(fsdp2_cases(model, inputs, targets, args))
    return cases, info


def fsdp2_cases(model: torch.nn.Module, inputs: Any, targets: torch.Tensor, args: argparse.Namespace) -> dict:
    """``ief_fsdp2`` and ``fsdp2_adamw`` (module docstring) on two copies of ``model`` sharded with FSDP2, each
    case's callable carrying ``tracked``: what :func:`peak_bytes` counts from the start (model and optimiser)."""
    from torch.distributed.fsdp import fully_shard

    def sharded() -> torch.nn.Module:
        copy_ = copy.deepcopy(model)
        for layer in copy_:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        return fully_shard(copy_)

    ief_model, adamw_model = sharded(), sharded()
    opt = ief.optim.IEF(ief_model, lr=args.lr, damping=args.damping)
    adamw = torch.optim.AdamW(trainable(adamw_model), lr=1e-4)

    def ief_step():
        return opt.step(inputs, targets)

    def adamw_step():
        adamw.zero_grad(set_to_none=True)
        loss = F.cross_entropy(logits_of(adamw_model, inputs), targets, reduction="sum")
        loss.backward()
        adamw.step()
        return loss.detach()

    ief_step.tracked, adamw_step.tracked = (ief_model, opt), (adamw_model, adamw)
    return {"ief_fsdp2": ief_step, "fsdp2_adamw": adamw_step}


def peak_bytes(fn: Callable, device: torch.device) -> int:
    """The most bytes of tensors live on this rank during one ``fn()`` (``MemTracker``), the tensors of
    ``fn.tracked`` (the model and its optimiser) counted from the start."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(*fn.tracked)
    with tracker:
        fn()
    return int(tracker.get_tracker_snapshot("peak")[device]["Total"])


def run_rank(rank: int, args: argparse.Namespace, device: torch.device) -> list[dict]:
    """Every model's timings (per round, the slowest rank's) and this rank's bytes, on an initialised group."""
    world = dist.get_world_size()
    results = []
    for name in args.models:
        cases, info = cases_of(name, args, rank, device)
        with harness.OtherLoad() as load:
            times = harness.round_robin(cases, args.repeats, args.warmup, device=device)
        bytes_by_case, plan = {}, None
        for key, fn in cases.items():
            with counting_collectives(world) as counts, recording_plans() as plans:
                harness.time_call(fn, device)
            bytes_by_case[key] = dict(counts)
            if key == "ief":
                plan = plans[-1] if plans else None
        peaks = {key: peak_bytes(fn, device) for key, fn in cases.items() if hasattr(fn, "tracked")}
        every = [None] * world
        dist.all_gather_object(every, dict(times=times, bytes=bytes_by_case, load=load.cores, peaks=peaks))
        slowest = {k: [max(r["times"][k][i] for r in every) for i in range(args.repeats)] for k in cases}
        rows = harness.rows(slowest, {k: REFERENCES[k] for k in cases}, LABELS)
        results.append(dict(info, world=world, batch=args.batch, rows=rows,
                            bytes_per_rank=[r["bytes"] for r in every], peak_bytes_per_rank=[r["peaks"] for r in every],
                            other_load_cores=every[0]["load"],
                            formula=formula_bytes(info["params"], plan, world), plan=_plan_summary(plan)))
    return results


def _plan_summary(plan: Any) -> dict | None:
    """What the step's Gram gathered: the weights as factors ``[index, T, I, O]`` and the dense columns."""
    if plan is None:
        return None
    return dict(factors=None if plan.factors is None else [list(f) for f in plan.factors],
                dense_columns=plan.dense_width, factor_entries=plan.factor_width)


def _entry(rank: int, args: argparse.Namespace, store: str, out: str) -> None:
    """One spawned process: its group, its models, rank 0's results written to ``out`` as JSON (what the record
    holds: plain numbers, strings and lists; nothing a reader must trust to unpickle)."""
    torch.set_num_threads(args.threads)
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{store}", rank=rank,
                            world_size=args.world)
    try:
        results = run_rank(rank, args, device)
        if rank == 0:
            Path(out).write_text(json.dumps(results, default=float))  # numpy scalars as the record writes them
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn(args: argparse.Namespace) -> list[dict]:
    """Run :func:`run_rank` on ``args.world`` processes; rank 0's results."""
    entry = importlib.import_module("benchmarks.distributed")._entry  # importable by the children under any __main__
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "results.json")
        mp.spawn(entry, args=(args, str(Path(folder) / "store"), out), nprocs=args.world, join=True,
                 start_method="spawn")
        return json.loads(Path(out).read_text())


# -------------------------------------------------------------------------------------------------------------- main
MIB = 2.0**20


def table(results: list[dict], args: argparse.Namespace, device: str) -> dict:
    """The summary table: time per step, and the bytes per rank beside the formula and DDP's."""
    body = []
    for res in results:
        by_key = {r["key"]: r for r in res["rows"]}
        worst = {k: max(b[k]["received"] for b in res["bytes_per_rank"]) for k in ("ief", "ddp", "ief_one")}
        sent = max(b["ief"]["sent"] for b in res["bytes_per_rank"])
        ddp = res["formula"]["ddp"] + worst["ddp"]  # the reducer's buckets, plus any collective seen (none expected)
        body.append([res["model"], res["params"], f"{res['world']} x {res['batch']}", by_key["ief"]["median_ms"],
                     by_key["ddp"]["median_ms"], by_key["ief"]["ratio"], by_key["ief_one"]["median_ms"],
                     sent / MIB, worst["ief"] / MIB,
                     res["formula"]["ief"] / MIB, ddp / MIB, worst["ief"] / ddp])
    tables = [harness.table(
        f"The exact iEF step across {args.world} processes against DDP + AdamW ({device}, one thread each)",
        [("model", "s"), ("P", ",d"), ("ranks x M_r", "s"), ("IEF ms", ".1f"), ("DDP + AdamW ms", ".1f"),
         ("IEF / DDP time", ".2f"), ("IEF, one process on the union batch, ms", ".1f"), ("IEF sent MiB", ".3f"),
         ("IEF received MiB", ".3f"), ("formula M_max R (P_dense + sum T(I+O)) b + 8P, MiB", ".3f"),
         ("DDP all-reduce MiB", ".3f"), ("IEF / DDP bytes", ".1f")], body,
        note="Per rank and step. Times: median over rounds of the slowest rank's; the ratio is the median of "
             "within-round ratios. 'One process on the union batch': every rank steps alone (a group of one) on "
             "the concatenated batches, the same update without communication, the ranks at once (one core "
             "each). IEF's bytes: the payload of the torch.distributed collectives its step calls "
             "(wrapped), received counting every rank's part of an all-gather (as the formula does); DDP's: its "
             "bucketed gradient all-reduce, the trainable gradients' bytes (4P), sent and received, which the "
             "wrappers cannot see inside the reducer. A ring all-reduce moves about 2(R-1)/R of its payload.")]
    sharded = [res for res in results if res.get("peak_bytes_per_rank") and res["peak_bytes_per_rank"][0]]
    if sharded:
        tables.append(fsdp2_table(sharded, args, device))
    return tables


def fsdp2_table(results: list[dict], args: argparse.Namespace, device: str) -> dict:
    """The FSDP2 rows: the exact step on the sharded model beside FSDP2 + AdamW, time, bytes and peak memory."""
    body = []
    for res in results:
        by_key = {r["key"]: r for r in res["rows"]}
        received = {k: max(b[k]["received"] for b in res["bytes_per_rank"]) for k in ("ief_fsdp2", "fsdp2_adamw")}
        peak = {k: max(p[k] for p in res["peak_bytes_per_rank"]) for k in ("ief_fsdp2", "fsdp2_adamw")}
        body.append([res["model"], res["params"], f"{res['world']} x {res['batch']}", by_key["ief_fsdp2"]["median_ms"],
                     by_key["fsdp2_adamw"]["median_ms"], by_key["ief_fsdp2"]["ratio"], received["ief_fsdp2"] / MIB,
                     received["fsdp2_adamw"] / MIB, peak["ief_fsdp2"] / MIB, peak["fsdp2_adamw"] / MIB,
                     peak["ief_fsdp2"] / peak["fsdp2_adamw"]])
    return harness.table(
        f"The exact iEF step on an FSDP2 model across {args.world} processes against FSDP2 + AdamW ({device}, one "
        f"thread each)",
        [("model", "s"), ("P", ",d"), ("ranks x M_r", "s"), ("IEF FSDP2 ms", ".1f"), ("FSDP2 + AdamW ms", ".1f"),
         ("IEF / AdamW time", ".2f"), ("IEF received MiB", ".3f"), ("FSDP2 + AdamW received MiB", ".3f"),
         ("IEF peak MiB", ".2f"), ("FSDP2 + AdamW peak MiB", ".2f"), ("IEF / AdamW peak", ".2f")], body,
        note="Per rank and step; the worst rank's bytes and peak. Peak: every tensor live on the rank during one "
             "step (MemTracker), parameters, gradients, optimiser state, activations and communication buffers. "
             "The IEF step takes its rows under FSDP2's per-module unshard (its forward's and backward's "
             "all-gathers, no gradient reduce-scatter) and forms a direction of this rank's shards' size "
             "(ief.sharded).")


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    p = argparse.ArgumentParser(prog="python -m benchmarks.distributed", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_common_arguments(p, repeats=21, warmup=2)
    p.add_argument("--world", type=int, default=2, help="processes (default 2; with --device cuda, one GPU each)")
    p.add_argument("--batch", type=int, default=16, help="samples per process M_r (default 16)")
    p.add_argument("--tokens", type=int, default=32, help="tokens per sentence of bert-lora (default 32)")
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--lr", type=float, default=1e-3, help="IEF's learning rate (default 1e-3)")
    p.add_argument("--damping", type=float, default=1e-3, help="IEF's damping (default 1e-3)")
    p.add_argument("--fsdp2", action="store_true", help="also the mlp sharded with FSDP2: IEF against FSDP2 + AdamW, "
                                                        "with the peak memory per rank")
    args = p.parse_args(argv)
    device = harness.check_common(p, args)
    if args.world < 1 or args.batch < 1 or args.tokens < 1:
        p.error(f"--world, --batch and --tokens must be >= 1, got {args.world}, {args.batch}, {args.tokens}")
    if device.type == "cuda" and args.world > torch.cuda.device_count():
        p.error(f"--device cuda --world {args.world}: only {torch.cuda.device_count()} GPU(s) visible")
    print(harness.machine_line(harness.machine(device)), flush=True)
    with harness.OtherLoad() as load:
        results = spawn(args)
    for res in results:
        print(f"\n{res['model']}: {res['description']}; P = {res['params']:,}; {res['world']} x {res['batch']} "
              f"samples", flush=True)
        for r in res["rows"]:
            print(f"  {r['label']:<36} {r['median_ms']:>9.2f} ms (IQR {r['iqr_ms']:.2f})"
                  + (f"  {r['ratio']:.2f}x" if r["ratio"] else ""))
        for rank, b in enumerate(res["bytes_per_rank"]):
            print(f"  rank {rank}: IEF sent {b['ief']['sent']:,} B, received {b['ief']['received']:,} B in "
                  f"{b['ief']['calls']} collectives; DDP's collectives seen {b['ddp']['calls']}")
        f = res["formula"]
        print(f"  formula: Gram {f['gram']:,} B + direction {f['direction']:,} B = {f['ief']:,} B; "
              f"DDP all-reduce {f['ddp']:,} B; the Gram's plan {res['plan']}", flush=True)
    doc = harness.record("distributed", argv, device, args, load, dict(models=results),
                         table(results, args, device.type), started)
    harness.finish(doc, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
