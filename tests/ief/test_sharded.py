"""The exact step on FSDP2 (``fully_shard``) models (ief.sharded), held to one process on the union batch: 2 and 3
gloo processes, float64, uneven local batches and masked positions, momentum and weight decay, submodules sharded
separately; what cannot step on shards refused before any work, on every rank, in one sentence."""
from __future__ import annotations

import copy
import pickle
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ief.sharded import LAYERWISE_ROUTE, ROUTE
from test_distributed import OPTIMISERS, SPAWN_DEADLINE, _free_port, _join, _spawn, _start

pytestmark = pytest.mark.slow  # every test here starts gloo processes: the slow tier

STEPS = 3
CRYPTIC = "mixed torch.Tensor and DTensor"


# ------------------------------------------------------------------------------------------------------ the models
def _mlp() -> torch.nn.Module:
    """5-16-16-3 (tanh): over 4 positions the middle weight's factors are fewer entries than its rows."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 3)).double()


def _mlp_batch(m: int, gen: torch.Generator) -> tuple:
    x = torch.randn(m, 4, 5, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (m, 4), generator=gen)
    y[torch.rand(m, 4, generator=gen) < 0.3] = -100
    return x, y


def _gpt2() -> torch.nn.Module:
    """A tiny GPT-2 (two blocks, tied input and output embeddings), every parameter trained."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config).double().eval()


def _llama_lora() -> torch.nn.Module:
    """A tiny Llama (two layers, grouped-query attention) with peft LoRA (rank 2) on q_proj / v_proj: a frozen base,
    sharded with the adapters."""
    import peft
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=12, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
                                      attn_implementation="eager", pad_token_id=0, tie_word_embeddings=False)
    base = transformers.LlamaForCausalLM(config).double()
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                                                      lora_dropout=0.0))
    with torch.no_grad():  # LoRA B starts at 0: move it so that the rows are generic
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    return model.eval()


def _lm_batch(m: int, gen: torch.Generator) -> tuple:
    """Token sequences of 6 with right padding (masked in attention and targets)."""
    import ief

    ids = torch.randint(1, 16, (m, 6), generator=gen)
    mask = torch.ones(m, 6, dtype=torch.long)
    for n in range(m):
        pad = int(torch.randint(0, 3, (1,), generator=gen))
        if pad:
            ids[n, -pad:], mask[n, -pad:] = 0, 0
    labels = ids.masked_fill(mask == 0, -100)
    return dict(input_ids=ids, attention_mask=mask), ief.causal_lm_targets(labels)


MODELS = {"mlp": (_mlp, _mlp_batch), "gpt2": (_gpt2, _lm_batch), "llama-lora": (_llama_lora, _lm_batch)}


def _shard(name: str, model: torch.nn.Module) -> torch.nn.Module:
    """``fully_shard`` on the inner modules first (each its own parameter group), then on the root."""
    from torch.distributed.fsdp import fully_shard

    if name == "mlp":
        inner = [model[0], model[2]]
    elif name == "gpt2":
        inner = list(model.transformer.h)
    else:
        inner = list(model.base_model.model.model.layers)
    for module in inner:
        fully_shard(module)
    return fully_shard(model)


def _batches(name: str, sizes: list[int]) -> list[list[tuple]]:
    gen = torch.Generator().manual_seed(11)
    return [[MODELS[name][1](m, gen) for m in sizes] for _ in range(STEPS)]


def _concat(parts: list) -> object:
    if isinstance(parts[0], dict):
        return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    return torch.cat(parts)


def _trained(model: torch.nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


# ----------------------------------------------------------------------------------------- the union-batch equality
def _train_sharded(rank: int, name: str, methods: list[str], sizes: list[int]) -> dict:
    out = {}
    for method in methods:
        model = _shard(name, MODELS[name][0]())
        opt = OPTIMISERS[method](model)  # no process_group: FSDP2's
        losses = []
        for per_rank in _batches(name, sizes):
            x, y = per_rank[rank]
            losses.append(float(opt.step(x, y)))
        params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
        shards = {n: p.to_local().detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        buffers = [type(b).__name__ for s in opt.state.values() for k, b in s.items() if k == "momentum_buffer"]
        out[method] = dict(params=params, losses=losses, shards=shards, buffers=buffers, report=opt.last_step_report)
    return out


def _train_union(name: str, method: str, sizes: list[int]) -> dict:
    model = MODELS[name][0]()
    opt = OPTIMISERS[method](model)
    losses = []
    for per_rank in _batches(name, sizes):
        losses.append(float(opt.step(_concat([b[0] for b in per_rank]), _concat([b[1] for b in per_rank]))))
    return dict(params={n: p.detach().clone() for n, p in model.named_parameters()}, losses=losses)


@pytest.mark.parametrize("name, methods, sizes", [
    ("mlp", ["ief-mean-momentum-wd", "ef", "sf"], [3, 5]),
    ("mlp", ["ief-ghost", "ief-mean-momentum-wd", "ef", "sf"], [4, 1, 6]),
    ("gpt2", ["ief-mean-momentum-wd"], [3, 2]),
    ("gpt2", ["ief-mean-momentum-wd"], [2, 1, 3]),
    ("llama-lora", ["ief-mean-momentum-wd"], [3, 2]),
    ("llama-lora", ["ief-mean-momentum-wd"], [2, 3, 1]),
], ids=["mlp-2", "mlp-3", "gpt2-2", "gpt2-3", "llama-lora-2", "llama-lora-3"])
def test_a_step_on_an_fsdp2_model_is_one_process_on_the_union_batch(name, methods, sizes, tmp_path):
    """Three steps on R gloo processes of a model whose submodules are sharded separately (and a frozen base under
    LoRA) give every rank the same losses and, gathered, the same parameters, equal to one process stepping on the
    ranks' batches concatenated in rank order (1e-12 relative, float64); each rank's shard is its slice of them and
    the momentum buffers are local shards (plain tensors)."""
    results = _spawn(_train_sharded, len(sizes), tmp_path, name, methods, sizes)
    for method in methods:
        union = _train_union(name, method, sizes)
        first = results[0][method]
        for other in results[1:]:
            assert other[method]["losses"] == first["losses"]
            assert all(torch.equal(other[method]["params"][n], p) for n, p in first["params"].items())
        assert first["losses"] == pytest.approx(union["losses"], rel=1e-12)
        for n, want in union["params"].items():
            got = first["params"][n]
            assert torch.allclose(got, want, rtol=1e-12, atol=1e-12 * float(want.abs().max())), (method, n)
        moved = sum(float((union["params"][n] - p.detach()).abs().sum())
                    for n, p in MODELS[name][0]().named_parameters() if p.requires_grad)
        assert moved > 1e-3, "the steps must move the parameters for the comparison to mean anything"
        for rank, result in enumerate(results):  # each rank's shard: torch.chunk's slice of the whole
            for n, shard in result[method]["shards"].items():
                whole = first["params"][n]
                assert torch.equal(shard, torch.chunk(whole, len(sizes))[rank] if rank < len(
                    torch.chunk(whole, len(sizes))) else whole[:0]), (method, n, rank)
            assert set(result[method]["buffers"]) <= {"Tensor"}
            report = result[method]["report"]  # the certificate: the method, not a fallback, over the union's rows
            # the last step's batches are of the shapes proven at the step before: rows under FSDP2's per-module
            # unshard, no rank probing
            assert (report.step, report.rows, report.ranks, report.across_processes, report.sharding) == (
                STEPS - 1, sum(sizes), len(sizes), True, LAYERWISE_ROUTE)
            assert report.method == {"ief": "iEF", "ef": "EF", "sf": "SF"}[method.split("-")[0]]
            assert sorted(report.routes) == sorted(n for n in union["params"] if n in first["shards"])
            looped = {n for n, route in report.routes.items() if route == "looped"}
            assert looped <= {"transformer.wpe.weight"}, report.routes  # GPT-2's [1, T] positions: as one process


# ------------------------------------------------------------------------- the same collectives on every rank
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object",
               "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "broadcast",
               "broadcast_object_list", "barrier", "all_to_all_single", "gather", "scatter")
# per step, per rank: a first-seen shape, a seen one, one sample; the last step none probes (rows layer by layer)
PROBING_SIZES = [[2, 1, 3], [2, 3, 1], [3, 3, 1], [3, 3, 1]]
# the route each step takes: the exact check's step, then steps where some rank probes, then one where none does
PROBING_ROUTES = [ROUTE, ROUTE, ROUTE, LAYERWISE_ROUTE]


def _probing_batches(rank: int) -> list[tuple]:
    gen = torch.Generator().manual_seed(13)
    return [_lm_batch(sizes[rank], gen) for sizes in PROBING_SIZES]


def _probing_optimiser(model: torch.nn.Module):
    import ief

    return ief.optim.IEF(model, lr=0.3, damping=1e-4, reduction="mean", momentum=0.9)


def _collectives_on_rank(rank: int) -> dict:
    """Three GPT-2 steps whose local batches make the ranks' per-sample machinery decide differently (rank 0: a new
    shape, the same, a new one; rank 1: one sample, a new shape, the same; rank 2: a new shape, one sample twice), each
    step's torch.distributed calls recorded (name and first tensor's shape)."""
    model = _shard("gpt2", _gpt2())
    opt = _probing_optimiser(model)
    calls: list = []
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def recorder(name, original):
        def recorded(*args, **kwargs):
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            calls.append((name, None if first is None else tuple(first.shape)))
            return original(*args, **kwargs)
        return recorded

    steps, routes = [], []
    for batch in _probing_batches(rank):
        for name, original in originals.items():
            setattr(dist, name, recorder(name, original))
        try:
            opt.step(*batch)
        finally:
            for name, original in originals.items():
                setattr(dist, name, original)
        steps.append(list(calls))
        routes.append(opt.last_step_report.sharding)
        calls.clear()
    return dict(steps=steps, routes=routes, params={n: p.full_tensor() for n, p in model.named_parameters()})


def test_every_rank_calls_the_same_collectives_whatever_its_local_probing(tmp_path):
    """Every forward and backward of an FSDP2 module is a collective, so a step must call the same collectives in
    the same order on every rank although each rank's per-sample machinery decides for itself whether to probe its
    batch's sample axis (a shape it has not proven; none for one sample) or to take a kept proof: these extra
    forwards would each all-gather under FSDP2's own hooks. The ranks agree after the forward whether any of them
    probes (ief.sharded.RowAgreement): then every rank unshards every module for the rest of the step, and the
    ranks that probe do so without a collective; on the last step no rank probes and the rows are taken layer by
    layer. Each step's recorded torch.distributed calls (FSDP2's all-gathers among them) are the same on 3 ranks,
    and the four steps equal one process's on the union batches. (Rows taken under FSDP2's per-layer hooks without
    the agreement made the ranks' all-gathers differ, and the step hung.)"""
    results = _spawn(_collectives_on_rank, 3, tmp_path)
    for step in range(len(PROBING_SIZES)):
        first = results[0]["steps"][step]
        assert any(name == "all_gather_single" for name, _ in first), first  # FSDP2's all-gathers are recorded
        for rank, result in enumerate(results[1:], 1):
            assert result["steps"][step] == first, (step, rank)
    assert all(r["routes"] == PROBING_ROUTES for r in results), [r["routes"] for r in results]
    assert all(torch.equal(results[0]["params"][n], r["params"][n]) for r in results[1:] for n in results[0]["params"])
    model = _gpt2()
    opt = _probing_optimiser(model)
    for per_rank in zip(*(_probing_batches(rank) for rank in range(3))):
        opt.step(_concat([b[0] for b in per_rank]), _concat([b[1] for b in per_rank]))
    for n, want in model.named_parameters():
        got = results[0]["params"][n]
        assert torch.allclose(got, want.detach(), rtol=1e-12, atol=1e-12 * float(want.abs().max())), n


# --------------------------------------------------------------------- the optimiser's state, one file a rank
def _state_round_trip_on_rank(rank: int) -> dict:
    """Two IEF steps with momentum on the sharded MLP, its state saved per rank (model shards and optimiser state),
    loaded into a fresh sharded model and optimiser, one more step; beside three uninterrupted steps."""
    import ief
    from ief.sharded import load_local_state, local_state

    def build():
        model = _shard("mlp", _mlp())
        return model, ief.optim.IEF(model, lr=0.3, damping=1e-3, momentum=0.9, weight_decay=0.01)

    batches = [b[rank] for b in _batches("mlp", [3, 5])]
    model, opt = build()
    for x, y in batches[:2]:
        opt.step(x, y)
    saved = copy.deepcopy((local_state(model), opt.state_dict()))
    opt.step(*batches[2])
    straight = {n: p.full_tensor() for n, p in model.named_parameters()}
    model, opt = build()
    load_local_state(model, saved[0], "the saved state")
    opt.load_state_dict(saved[1])
    opt.step(*batches[2])
    resumed = {n: p.full_tensor() for n, p in model.named_parameters()}
    buffers = [tuple(b.shape) for s in opt.state.values() for k, b in s.items() if k == "momentum_buffer"]
    return dict(equal=all(torch.equal(straight[n], resumed[n]) for n in straight), buffers=buffers)


def test_an_fsdp2_optimiser_state_saved_per_rank_resumes_bit_for_bit(tmp_path):
    """An optimiser on an FSDP2 model keeps its momentum buffers as local shards: its state_dict, saved on each rank
    with the model's shards (ief.sharded.local_state), loads into a fresh sharded model and optimiser (each buffer
    checked against its parameter's local shard, the ranks' differing shards not held to be replicas) and the next
    step equals the uninterrupted one bit for bit."""
    results = _spawn(_state_round_trip_on_rank, 2, tmp_path)
    assert all(r["equal"] for r in results)
    assert results[0]["buffers"] and all(shape[0] == 8 for shape in results[0]["buffers"][:2])  # shards of 16 rows


# ------------------------------------------------------------------------------------------------ a NaN on one rank
def _nan_on_rank_one(rank: int, world: int) -> dict:
    import ief

    model = _shard("mlp", _mlp())
    opt = ief.optim.IEF(model, lr=0.5, damping=1e-3)
    gen = torch.Generator().manual_seed(3)
    x, y = _mlp_batch(3, gen)
    if rank == 1:
        x[1, 0, 0] = float("nan")
    before = [p.full_tensor().clone() for p in model.parameters()]
    try:
        opt.step(x, y)
    except Exception as err:  # noqa: BLE001
        kind, message = type(err).__name__, str(err)
    else:
        kind = message = None
    unchanged = all(torch.equal(a, p.full_tensor()) for a, p in zip(before, model.parameters()))
    x, y = _mlp_batch(2, gen)  # the model and the optimiser still step afterwards
    after = float(opt.step(x, y))
    return dict(kind=kind, message=message, unchanged=unchanged, after=after)


@pytest.mark.parametrize("world", [2, 3])
def test_a_nan_on_one_rank_ends_every_rank_with_the_same_error(world, tmp_path):
    results = _spawn(_nan_on_rank_one, world, tmp_path, world)
    assert [r["kind"] for r in results] == ["FloatingPointError"] * world, results
    for rank, result in enumerate(results):
        if rank != 1:
            assert result["message"].startswith("step 0: rank 1 failed (FloatingPointError): "), result["message"]
    assert all(r["unchanged"] for r in results)
    assert len({r["after"] for r in results}) == 1


def _bad_target_on_rank_one(rank: int) -> dict:
    import ief

    model = _shard("mlp", _mlp())
    opt = ief.optim.IEF(model, lr=0.5, damping=1e-3)
    gen = torch.Generator().manual_seed(3)
    batch = _mlp_batch(3, gen)
    for _ in range(3):  # the exact check's step, the unchecked forward's proof, then rows layer by layer
        opt.step(*batch)
    routes = [opt.last_step_report.sharding]
    x, y = batch[0], batch[1].clone()
    if rank == 1:
        y[0, 0] = 7  # the model has 3 classes: refused after this rank's forward, before its backward
    try:
        opt.step(x, y)
    except Exception as err:  # noqa: BLE001
        kind, message = type(err).__name__, str(err)
    else:
        kind = message = None
    opt.step(*batch)  # every rank steps on afterwards, layer by layer
    routes.append(opt.last_step_report.sharding)
    return dict(kind=kind, message=message, routes=routes)


@pytest.mark.parametrize("world", [2, 3])
def test_a_bad_target_on_one_rank_in_a_layerwise_step_ends_every_rank_with_its_error(world, tmp_path):
    """A class index out of range on rank 1, in a step taking its rows layer by layer, is refused there after the
    forward; the ranks' agreement before the backward's collectives ends every rank with a ValueError naming rank 1's
    sentence (none waits in FSDP2's backward all-gathers), and the next step runs on every rank."""
    results = _spawn(_bad_target_on_rank_one, world, tmp_path)
    assert [r["kind"] for r in results] == ["ValueError"] * world, results
    for rank, result in enumerate(results):
        assert "7" in result["message"]
        if rank != 1:
            assert result["message"].startswith("rank 1 failed (ValueError): "), result["message"]
        assert result["routes"] == [LAYERWISE_ROUTE, LAYERWISE_ROUTE], result["routes"]


# -------------------------------------------------------------------------------------------------------- refusals
def _refusals_on_rank(rank: int) -> dict:
    import ief
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    def partly():
        model = _mlp()
        fully_shard(model[2])
        return ief.optim.IEF(model)

    def tensor_parallel():
        model = _mlp()
        mesh = init_device_mesh("cpu", (2,))
        model[2].weight = torch.nn.Parameter(distribute_tensor(model[2].weight.detach(), mesh, [Shard(1)]))
        return ief.optim.IEF(model)

    def hsdp():
        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard"))
        return ief.optim.IEF(fully_shard(_mlp(), mesh=mesh))

    def other_group():
        group = dist.new_group([0])
        return ief.optim.IEF(fully_shard(_mlp()), process_group=group if rank == 0 else dist.group.WORLD)

    def functional_update():
        model = fully_shard(_mlp())
        params = list(model.parameters())
        ief.optim.preconditioned_update(params, torch.zeros(sum(p.numel() for p in params), dtype=torch.float64), {},
                                        lr=0.1)

    cases = {
        "functional-update": functional_update,
        "kfac": lambda: ief.optim.KFAC(fully_shard(_mlp()), "kfac", lr=0.1, damping=1e-2),
        "auto": lambda: ief.optim.IEF(fully_shard(_mlp()), lr="auto"),
        "partly": partly,
        "tensor-parallel": tensor_parallel,
        "hsdp": hsdp,
        "offload": lambda: ief.optim.IEF(fully_shard(_mlp(), offload_policy=CPUOffloadPolicy(pin_memory=False))),
        "mixed-precision": lambda: ief.optim.IEF(fully_shard(
            _mlp().float(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16))),
        "other-group": other_group,
    }
    out = {}
    for name, build in cases.items():
        try:
            build()
        except Exception as err:  # noqa: BLE001
            out[name] = (type(err).__name__, str(err))
        else:
            out[name] = ("constructed", "")
    return out


def test_what_cannot_step_on_fsdp2_shards_is_refused_before_any_work_in_one_sentence(tmp_path):
    results = _spawn(_refusals_on_rank, 2, tmp_path)
    expected = {"kfac": "KFAC's Kronecker factors", "auto": "lr='auto'", "partly": "partly FSDP2",
                "tensor-parallel": "no fully_shard manages", "hsdp": "2-dimensional device mesh",
                "offload": "CPUOffloadPolicy", "mixed-precision": "computes in float16",
                "other-group": "pass no process_group"}
    for result in results:
        kind, message = result["functional-update"]
        assert kind == "ValueError" and "DTensor parameters" in message and CRYPTIC not in message, message
    for rank, result in enumerate(results):
        for name, needle in expected.items():
            kind, message = result[name]
            if name == "other-group" and rank == 1:
                assert kind == "constructed"  # the WORLD group is FSDP2's own
                continue
            assert kind == "ValueError", (name, kind, message)
            assert "cannot step on this FSDP2 model" in message and needle in message, (name, message)
            assert not re.search(r"[a-z)]\. [A-Z]", message) and CRYPTIC not in message, message  # one sentence


# ------------------------------------------------------------------------------------ memory and all-gathers per rank
def _peak_and_gathered(step, tracked) -> tuple[int, int]:
    """The most bytes live on this rank during ``step()`` (MemTracker, ``tracked`` counted from the start) and the
    bytes FSDP2's all-gathers received in it."""
    from torch.distributed._tools.mem_tracker import MemTracker

    gathered, original = [0], dist.all_gather_single

    def counted(output, *args, **kwargs):
        gathered[0] += output.numel() * output.element_size()
        return original(output, *args, **kwargs)

    tracker = MemTracker()
    tracker.track_external(*tracked)
    dist.all_gather_single = counted
    try:
        with tracker:
            step()
    finally:
        dist.all_gather_single = original
    return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]), gathered[0]


def _memory_on_rank(rank: int) -> dict:
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard

    import ief

    def sharded() -> torch.nn.Module:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256),
                                    torch.nn.Tanh(), torch.nn.Linear(256, 10))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        return fully_shard(model)

    gen = torch.Generator().manual_seed(5 + rank)
    x, y = torch.randn(16, 784, generator=gen), torch.randint(0, 10, (16,), generator=gen)
    ief_model, adamw_model = sharded(), sharded()
    opt = ief.optim.IEF(ief_model, lr=0.1, damping=1e-3, momentum=0.9)
    adamw = torch.optim.AdamW(adamw_model.parameters(), lr=1e-3)

    def adamw_step():
        adamw.zero_grad(set_to_none=True)
        F.cross_entropy(adamw_model(x), y, reduction="sum").backward()
        adamw.step()

    for _ in range(2):  # warmed (the first IEF step runs the exact per-sample check)
        opt.step(x, y)
        adamw_step()
    out = {}
    out["ief"] = _peak_and_gathered(lambda: opt.step(x, y), (ief_model, opt))
    out["adamw"] = _peak_and_gathered(adamw_step, (adamw_model, adamw))
    out["sharded_after"] = all(p.to_local().numel() < p.numel() for p in ief_model.parameters())
    return out


def test_an_fsdp2_step_peaks_within_fsdp2_adamw_memory_with_a_shard_sized_direction(tmp_path):
    """The benchmark's MLP (784-256-256-10, float32, every Linear sharded, then the root; 16 samples a rank): the
    peak memory per rank of an IEF step with momentum is within 1.2 x FSDP2 + AdamW's on the same model and batch
    (both counted by MemTracker from their model and optimiser), and its all-gathers receive no more than FSDP2's own
    forward and backward do. The direction is formed at the size of this rank's shards (with a whole ``[P]`` float64
    direction on every rank the benchmark's step, without momentum, peaked at 1.45 x)."""
    results = _spawn(_memory_on_rank, 2, tmp_path)
    for result in results:
        (ief_peak, ief_gathered), (adamw_peak, adamw_gathered) = result["ief"], result["adamw"]
        assert ief_peak <= 1.2 * adamw_peak, (ief_peak, adamw_peak)
        assert 0 < ief_gathered <= adamw_gathered, (ief_gathered, adamw_gathered)
        assert result["sharded_after"]  # every parameter back to its shard


DEEP_LAYERS, DEEP_WIDTH = 8, 256


def _deep_memory_on_rank(rank: int) -> dict:
    """The same steady IEF step (momentum, 16 samples a rank) on a deep MLP of equal layers, each sharded, taken
    layer by layer and with every module unsharded at once (the route forced), beside FSDP2 + AdamW's step."""
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard

    import ief
    from ief.sharded import ShardedModel

    def sharded() -> torch.nn.Module:
        torch.manual_seed(0)
        layers = []
        for _ in range(DEEP_LAYERS):
            layers += [torch.nn.Linear(DEEP_WIDTH, DEEP_WIDTH), torch.nn.Tanh()]
        model = torch.nn.Sequential(*layers[:-1])
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        return fully_shard(model)

    gen = torch.Generator().manual_seed(5 + rank)
    x, y = torch.randn(16, DEEP_WIDTH, generator=gen), torch.randint(0, DEEP_WIDTH, (16,), generator=gen)
    models = {route: sharded() for route in ("layerwise", "whole", "adamw")}
    opts = {route: ief.optim.IEF(models[route], lr=0.1, damping=1e-3, momentum=0.9) for route in ("layerwise", "whole")}
    adamw = torch.optim.AdamW(models["adamw"].parameters(), lr=1e-3)

    def adamw_step():
        adamw.zero_grad(set_to_none=True)
        F.cross_entropy(models["adamw"](x), y, reduction="sum").backward()
        adamw.step()

    original = ShardedModel.can_go_layerwise
    out = {"gathered_at_once": sum((p.numel() - p.to_local().numel()) * p.element_size()
                                   for p in models["whole"].parameters())}
    for route, opt in opts.items():
        ShardedModel.can_go_layerwise = original if route == "layerwise" else lambda self: False
        try:
            for _ in range(2):  # warmed: the exact check's step, then the first proof of the unchecked forward
                opt.step(x, y)
            out[route] = _peak_and_gathered(lambda opt=opt: opt.step(x, y), (models[route], opt))
        finally:
            ShardedModel.can_go_layerwise = original
        out[f"{route}_route"] = opt.last_step_report.sharding
    for _ in range(2):
        adamw_step()
    out["adamw"] = _peak_and_gathered(adamw_step, (models["adamw"], adamw))
    out["equal"] = all(torch.equal(p.full_tensor(), q.full_tensor())
                       for p, q in zip(models["layerwise"].parameters(), models["whole"].parameters()))
    return out


def test_rows_taken_layer_by_layer_never_hold_the_whole_model_unsharded(tmp_path):
    """A deep MLP (8 equal 256-wide layers, float32, each sharded, then the root; 16 samples a rank on 2 gloo
    processes): a steady IEF step takes its rows under FSDP2's per-module unshard, and its peak memory per rank
    (MemTracker, from the model and optimiser) is below the same step's with every module unsharded at once by at
    least half of what that gathers beyond the rank's shards; it all-gathers what FSDP2's forward and backward do
    (each module twice, as FSDP2 + AdamW's step), and steps bit for bit as the unsharded route. (Its peak is then
    the update's: the shards, the momentum buffers and the shard-sized direction, not the gathered parameters.)"""
    results = _spawn(_deep_memory_on_rank, 2, tmp_path)
    for result in results:
        assert (result["layerwise_route"], result["whole_route"]) == (LAYERWISE_ROUTE, ROUTE)
        (layer_peak, layer_gathered), (whole_peak, whole_gathered) = result["layerwise"], result["whole"]
        adamw_peak, adamw_gathered = result["adamw"]
        assert whole_peak - layer_peak >= 0.5 * result["gathered_at_once"], result
        assert layer_peak < whole_peak and adamw_gathered > 0, result
        assert layer_gathered == 2 * whole_gathered <= adamw_gathered, result
        assert result["equal"]


# ------------------------------------------------------------------------------------------------- mixed precision
BF16_STEPS, BF16_LR, BF16_DAMPING = 3, 0.5, 1e-2  # the third step takes its rows layer by layer


def _bf16_batches(sizes: list[int]) -> list[list[tuple]]:
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(BF16_STEPS):
        steps = []
        for m in sizes:
            x, y = _mlp_batch(m, gen)
            steps.append((x.float(), y))
        out.append(steps)
    return out


def _bf16_on_rank(rank: int, sizes: list[int]) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import ief

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = _mlp().float()
    for layer in (model[0], model[2]):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    opt = ief.optim.IEF(model, lr=BF16_LR, damping=BF16_DAMPING)
    masters = []
    for per_rank in _bf16_batches(sizes):
        opt.step(*per_rank[rank])
        masters.append({n: p.full_tensor().detach().clone() for n, p in model.named_parameters()})
    return dict(masters=masters, dtypes={str(p.to_local().dtype) for p in model.parameters()},
                route=opt.last_step_report.sharding)


@pytest.mark.parametrize("sizes", [[3, 5], [3, 1, 4]], ids=["2", "3"])
def test_bf16_compute_with_float32_reduce_steps_as_bf16_weights_on_float32_masters(sizes, tmp_path):
    """MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) on 2 and 3 gloo processes: each step equals the
    one-process iEF direction of the union batch on the model's weights rounded to bfloat16 (the per-sample rows in
    bfloat16, the Gram and solve in float64, the direction in bfloat16: ief.precision's contract for bfloat16
    weights), applied to float32 masters (the shards stay float32). Tolerance from the format: the rows carry
    bfloat16's rounding (u = 2^-8) and the ranks' smaller forwards may round some activations differently from the
    union's, so the step may differ by a few u of its norm; 4 u is allowed (a float32 step, or a direction of the
    float32 weights, differs by far more)."""
    import ief

    results = _spawn(_bf16_on_rank, len(sizes), tmp_path, sizes)
    assert results[0]["dtypes"] == {"torch.float32"}
    assert all(r["route"] == LAYERWISE_ROUTE for r in results)
    for step in range(BF16_STEPS):
        for n in results[0]["masters"][step]:
            assert all(torch.equal(results[0]["masters"][step][n], r["masters"][step][n]) for r in results[1:])
    master = _mlp().float()
    u = 2.0 ** -8
    for step, per_rank in enumerate(_bf16_batches(sizes)):
        x, y = _concat([b[0] for b in per_rank]), _concat([b[1] for b in per_rank])
        low = copy.deepcopy(master).bfloat16()
        r = ief.per_sample(low, x.bfloat16(), y)
        d = ief.ief_direction(r.jacobian, r.logit_sqnorm, BF16_DAMPING)
        assert d.dtype == torch.bfloat16
        want = torch.cat([p.detach().reshape(-1) for p in master.parameters()]) - BF16_LR * d.float()
        got = torch.cat([p.reshape(-1) for p in results[0]["masters"][step].values()])
        before = torch.cat([p.detach().reshape(-1) for p in master.parameters()])
        change = (want - before).norm()
        assert float((got - want).norm()) <= 4 * u * float(change), (step, float((got - want).norm() / change))
        with torch.no_grad():  # the next reference step starts from the sharded run's masters
            for p, value in zip(master.parameters(), results[0]["masters"][step].values()):
                p.copy_(value)


# ------------------------------------------------------------------------------ IEFTrainer on an FSDP2 model
TRAINER_ARGS = dict(learning_rate=0.5, max_grad_norm=0.0, logging_steps=1, report_to="none", use_cpu=True,
                    disable_tqdm=True, seed=0, train_sampling_strategy="sequential", lr_scheduler_type="linear",
                    weight_decay=0.01)
TRAINER_OPTIMISER = dict(optimizer="ief", optimizer_kwargs=dict(damping=1e-3, momentum=0.5))


def _fsdp2_trainer_on_rank(rank: int, world: int, port: int, folder: str, steps: int, resume, final) -> dict:
    """An IEFTrainer run as torchrun starts it, on the tiny BERT-LoRA classifier sharded with fully_shard (each
    encoder layer, then the root) before it is handed to the Trainer."""
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    import datasets
    from torch.distributed.fsdp import fully_shard
    from transformers import TrainingArguments

    from ief.hf import IEFTrainer
    from test_hf import bert_lora, classification_rows

    args = TrainingArguments(output_dir=folder, per_device_train_batch_size=4, max_steps=steps, ddp_backend="gloo",
                             save_strategy="steps", save_steps=2, **TRAINER_ARGS)
    assert args.device.type == "cpu" and args.world_size == world  # the arguments start the process group: shard
    model = bert_lora()
    for layer in model.base_model.model.bert.encoder.layer:
        fully_shard(layer)
    fully_shard(model)
    trainer = IEFTrainer(model, args, train_dataset=datasets.Dataset.from_dict(classification_rows()),
                         **TRAINER_OPTIMISER)
    trainer.train(resume_from_checkpoint=resume)
    if final is not None:
        trainer.save_model(final)
    params = torch.cat([p.full_tensor().detach().reshape(-1) for p in trainer.model.parameters() if p.requires_grad])
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    report = trainer.ief_optimizer.last_step_report
    return dict(params=params.clone(), losses=losses, step=trainer.state.global_step,
                wrapped=type(trainer.model_wrapped).__name__, sharding=report.sharding, ranks=report.ranks,
                shards=[p.to_local().numel() < p.numel() for p in trainer.model.parameters()])


def _fsdp2_trainer_entry(rank: int, world: int, port: int, folder: str, out: str, steps, resume, final) -> None:
    torch.set_num_threads(1)
    result = _fsdp2_trainer_on_rank(rank, world, port, folder, steps, resume, final)
    Path(out).joinpath(f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _run_fsdp2_trainer(tmp_path: Path, name: str, steps: int, resume=None, final=None) -> list[dict]:
    out = tmp_path / f"{name}-results"
    out.mkdir(parents=True)
    context = _start(_fsdp2_trainer_entry, (2, _free_port(), str(tmp_path / "run"), str(out), steps, resume, final),
                     2)
    _join(context, 2, SPAWN_DEADLINE)
    return [pickle.loads((out / f"rank{r}.pkl").read_bytes()) for r in range(2)]


def test_the_trainer_trains_an_fsdp2_model_as_one_process_on_the_union_batch_and_resumes_bit_for_bit(tmp_path):
    """IEFTrainer on a model the user sharded with fully_shard, launched as torchrun would (two gloo processes,
    sequential data: rank r takes every other batch of 4), is left unwrapped (no DDP), steps iEF on the FSDP2 route
    with momentum and the Trainer's weight-decay groups, and equals one process at the union batch of 8 (float64);
    resumed on two fresh processes from its step-2 checkpoint it ends bit for bit where the uninterrupted run does;
    save_model writes the full weights, which a fresh model loads."""
    import datasets
    import safetensors.torch
    from transformers import TrainingArguments

    from ief.hf import IEFTrainer
    from test_hf import bert_lora, classification_rows

    final = tmp_path / "final"
    whole = _run_fsdp2_trainer(tmp_path / "whole", "whole", 4, final=str(final))
    for result in whole:
        assert (result["step"], result["wrapped"], result["sharding"], result["ranks"]) == (4, whole[0]["wrapped"],
                                                                                           LAYERWISE_ROUTE, 2)
        assert "DistributedDataParallel" not in result["wrapped"] and any(result["shards"])
    assert torch.equal(whole[0]["params"], whole[1]["params"]) and whole[0]["losses"] == whole[1]["losses"]
    args = TrainingArguments(output_dir=str(tmp_path / "one"), per_device_train_batch_size=8, max_steps=4,
                             save_strategy="no", **TRAINER_ARGS)
    one = IEFTrainer(bert_lora(), args, train_dataset=datasets.Dataset.from_dict(classification_rows()),
                     **TRAINER_OPTIMISER)
    one.train()
    flat = torch.cat([p.detach().reshape(-1) for p in one.model.parameters() if p.requires_grad])
    moved = torch.cat([p.detach().reshape(-1) for p in bert_lora().parameters() if p.requires_grad])
    assert float((flat - moved).norm()) > 1e-3  # the steps moved the parameters: the comparison means something
    assert float((whole[0]["params"] - flat).norm() / flat.norm()) < 1e-10
    losses = [h["loss"] for h in one.state.log_history if "loss" in h and "train_runtime" not in h]
    assert whole[0]["losses"] == pytest.approx(losses, rel=1e-4)  # (the Trainer logs 4 significant digits)
    loaded = bert_lora()  # the saved adapter and classifier, loaded into a fresh model, are the trained ones
    import peft

    peft.set_peft_model_state_dict(loaded, safetensors.torch.load_file(str(final / "adapter_model.safetensors")))
    reloaded = torch.cat([p.detach().reshape(-1) for p in loaded.parameters() if p.requires_grad])
    assert torch.equal(reloaded, whole[0]["params"])
    # resumed on two fresh processes from the uninterrupted run's step-2 checkpoint (what a run stopped there holds)
    resumed = _run_fsdp2_trainer(tmp_path / "resumed", "resumed", 4,
                                 resume=str(tmp_path / "whole" / "run" / "checkpoint-2"))
    assert resumed[0]["step"] == 4
    for rank in range(2):
        assert torch.equal(resumed[rank]["params"], whole[rank]["params"])
