"""The benchmark harness's pure parts: rotated round-robin order, quartiles, within-round ratios, the JSON record.

The benchmarks themselves are measurements, not pass/fail; what is tested here is the arithmetic and bookkeeping
every table rests on, and that the documented command lines name modules that exist.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ief
from benchmarks import __main__ as entry
from benchmarks import harness

ROOT = Path(__file__).resolve().parents[2]
positive = st.floats(min_value=1e-6, max_value=1e3, allow_nan=False)


def test_rotations_put_every_case_in_every_position():
    order = harness.rotations(["a", "b", "c"], 6)
    assert order[:3] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert order[3:] == order[:3]
    for position in range(3):
        assert {o[position] for o in order[:3]} == {"a", "b", "c"}
    assert harness.rotations([], 3) == []


def test_round_robin_times_every_case_once_per_round_in_rotated_order():
    calls, resets = [], []
    cases = {k: (lambda k=k: calls.append(k)) for k in ("x", "y", "z")}
    times = harness.round_robin(cases, rounds=4, warmup=1, before_each=lambda: resets.append(1))
    assert {k: len(v) for k, v in times.items()} == {"x": 4, "y": 4, "z": 4}
    assert calls[:3] == ["x", "y", "z"]  # warm-up, then the rotated rounds
    assert calls[3:] == ["x", "y", "z", "y", "z", "x", "z", "x", "y", "x", "y", "z"]
    assert len(resets) == len(calls)
    assert all(t >= 0 for v in times.values() for t in v)
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        harness.round_robin(cases, rounds=0)


def test_quartiles_and_summary():
    assert harness.quartiles([3.0]) == (3.0, 3.0, 3.0)
    assert harness.quartiles([4.0, 1.0, 3.0, 2.0, 5.0]) == (2.0, 3.0, 4.0)
    s = harness.summary([0.001, 0.002, 0.003, 0.004, 0.005])
    assert s["median_ms"] == pytest.approx(3.0) and s["iqr_ms"] == pytest.approx(2.0)
    assert s["min_ms"] == pytest.approx(1.0) and s["q1_ms"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="no values"):
        harness.quartiles([])


def test_within_round_ratio_is_robust_to_a_slow_round():
    reference = [1.0, 1.0, 10.0, 1.0, 1.0]  # round 3: the machine was slow for both calls
    times = [2.0, 2.0, 20.0, 2.0, 2.0]
    assert harness.within_round_ratio(times, reference) == 2.0
    # the ratio of medians agrees here; a slow phase that hits only some rounds of one case does not move the ratio
    assert harness.ratio_of_medians(times, reference) == 2.0
    with pytest.raises(ValueError, match="one time per round"):
        harness.within_round_ratio([1.0, 2.0], [1.0])


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(positive, positive), min_size=1, max_size=30), positive)
def test_within_round_ratio_properties(pairs, scale):
    times, reference = [a for a, _ in pairs], [b for _, b in pairs]
    ratio = harness.within_round_ratio(times, reference)
    per_round = [a / b for a, b in pairs]
    assert min(per_round) <= ratio <= max(per_round)
    # invariant to a slow-down that hits both calls of every round alike
    assert harness.within_round_ratio([scale * a for a in times], [scale * b for b in reference]) == \
        pytest.approx(ratio, rel=1e-9)
    assert harness.within_round_ratio(reference, times) == pytest.approx(
        statistics.median(b / a for a, b in pairs), rel=1e-12)


def test_rows_refer_to_their_reference():
    times = {"ref": [1.0, 2.0, 3.0], "op": [2.0, 4.0, 9.0]}
    rows = harness.rows(times, {"ref": None, "op": "ref"}, {"op": "the op"})
    by = {r["key"]: r for r in rows}
    assert by["ref"]["ratio"] is None and by["ref"]["label"] == "ref"
    assert by["op"]["ratio"] == 2.0 and by["op"]["label"] == "the op"
    assert by["op"]["ratio_of_medians"] == 2.0 and by["op"]["times_ms"] == [2000.0, 4000.0, 9000.0]


def test_running_peak():
    assert harness.running_peak([]) == 0
    assert harness.running_peak([100, 50, -120, 200, -230]) == 230
    assert harness.running_peak([-10, 5]) == 0  # frees of blocks allocated before the start


def test_cpu_tensor_peak_sees_a_temporary_tensor():
    def make():
        x = torch.empty(2**20, dtype=torch.float32)  # 4 MiB, freed before the call returns
        x.fill_(1.0)
        return float(x[0])

    peak = harness.cpu_tensor_peak_mib(make)
    if peak is None:
        pytest.skip("this torch's profiler exposes no memory events (harness reports None, as documented)")
    assert 4.0 <= peak < 5.0


def test_other_load_and_warning():
    with harness.OtherLoad() as load:
        sum(range(10000))
    assert load.cores is None or load.cores >= 0.0
    cpus = __import__("os").cpu_count() or 1
    assert harness.load_warning(None, 1) is None
    assert harness.load_warning(0.0, 1, "cuda") is None
    assert "WARNING" in harness.load_warning(float(cpus), 1)


def test_table_rejects_ragged_rows():
    t = harness.table("T", [("a", "s"), ("b", ".2f")], [["x", 1.0]])
    assert t["columns"][1] == {"header": "b", "format": ".2f"}
    with pytest.raises(ValueError, match="2 columns"):
        harness.table("T", [("a", "s"), ("b", ".2f")], [["x"]])


def _doc(**changes):
    args = argparse.Namespace(repeats=3, json="out.json", _device=torch.device("cpu"))
    with harness.OtherLoad() as load:
        pass
    doc = harness.record("step", ["--repeats", "3"], "cpu", args, load, {"raw": [1, 2]},
                         [harness.table("T", [("a", "s"), ("b", ".2f")], [["x", 1.0]])], started=0.0)
    doc.update(changes)
    return doc


def test_record_schema_and_atomic_write(tmp_path):
    doc = _doc()
    assert doc["schema"] == harness.SCHEMA and doc["benchmark"] == "step"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", doc["date"])
    assert doc["command"].endswith("python -m benchmarks.step --repeats 3")
    assert set(harness.MACHINE_KEYS) <= set(doc["machine"]) and doc["machine"]["torch"] == torch.__version__
    assert "_device" not in doc["args"] and doc["args"]["repeats"] == 3
    path = harness.write_json(tmp_path / "sub" / "r.json", doc)
    assert json.loads(path.read_text()) == json.loads(json.dumps(doc))
    assert [p.name for p in path.parent.iterdir()] == ["r.json"]  # no temporary file left behind


@pytest.mark.parametrize("change, message", [
    (dict(schema=99), "schema 99"),
    (dict(command=None), "'command' must be a str"),
    (dict(machine={"cpu": "x"}), "machine lacks"),
    (dict(tables=[{"title": "T", "columns": [{"header": "a", "format": "s"}], "rows": [["x", 1]]}]),
     "does not match its columns"),
])
def test_validate_names_what_is_wrong(change, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        harness.write_json(tmp_path / "bad.json", _doc(**change))
    assert not (tmp_path / "bad.json").exists()


def test_command_line_records_thread_variables(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    assert harness.command_line("benchmarks.conv2d", ["--batch", "a b"]) == \
        "OMP_NUM_THREADS=1 python -m benchmarks.conv2d --batch 'a b'"


def test_entry_point_lists_and_rejects(capsys):
    assert entry.main([]) == 0
    listed = capsys.readouterr().out
    for name in entry.COMMANDS:
        assert name in listed
        assert (ROOT / "benchmarks" / f"{name}.py").exists()
    assert entry.main(["nonsense"]) == 2
    assert "unknown benchmark 'nonsense'" in capsys.readouterr().err


@pytest.mark.parametrize("module, argv, message", [
    ("step", ["--models", "mlp,resnet"], "unknown"),
    ("step", ["--repeats", "0"], "--repeats >= 1"),
    ("conv2d", ["--threads", "0"], "--threads >= 1"),
    ("damping_sweep", ["--m", "32,x"], "comma-separated integers"),
    ("evaluation", ["--setups", "cifar10-mlp"], "choose from"),
    ("paper_mlp", ["--cases", "ief-auto"], "no 'adam'"),
    ("fvp", ["--batch", "0"], "--batch must be >= 1"),
    ("fvp", ["--models", "resnet"], "invalid choice"),
])
def test_bad_arguments_are_refused_by_name(module, argv, message, capsys):
    import importlib

    with pytest.raises(SystemExit) as exc:
        importlib.import_module(f"benchmarks.{module}").main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_evaluation_benchmark_builds_its_workload_and_cases():
    """The evaluation benchmark reads the evaluation jobs' knobs from the package (an import of a renamed constant
    broke it once, unnoticed, since benchmarks are not run by the tests)."""
    from benchmarks import evaluation
    from companion.experiments.setups import EVALUATION_KNOBS as DEFAULTS

    s = evaluation.build("digits-mlp", None, 0)
    assert s["cg"] == DEFAULTS["cpu"]["cg_iterations"] and len(s["sweep"]) == DEFAULTS["cpu"]["sweep_dampings"]
    assert {"sgd", "ief", "all methods", "damping sweep"} <= set(evaluation.cases(s))


def test_fvp_benchmark_times_what_it_says():
    """``python -m benchmarks fvp``'s cases on the MLP: the gradient is ``autograd.grad`` of the summed loss, and both
    Fisher-vector products (here the package twice, as the 'before' one) give ``ief.fisher_vp``'s value."""
    from benchmarks import fvp, workloads

    w = fvp.build("mlp", 4, 0)
    cases = fvp.cases_of(w, ief, 0)
    assert set(cases) == {"forward", "gradient", "fvp", "fvp_before"}
    params = [p for p in w.model.parameters() if p.requires_grad]
    loss = workloads.summed_cross_entropy(w.model(w.inputs), w.targets)
    for a, b in zip(cases["gradient"](), torch.autograd.grad(loss, params)):
        assert torch.allclose(a, b)
    assert torch.equal(cases["fvp"](), cases["fvp_before"]())


def test_hf_layers_tables_split_per_sample_and_step_results():
    """``benchmarks.hf_layers.tables``: per-sample ratios (against a backward) in one table, the step ratios
    (against AdamW) with AdamW's time in another, each model's own numbers in its row, a missing method as ``None``."""
    from benchmarks import hf_layers

    def result(name, base):
        keys = ("backward", "ief_before", "ief", "ief_auto", "vmap", "adamw_step", "ief_step_before", "ief_step")
        rows = [dict(key=k, ratio=None if k == "backward" else base + i, median_ms=10.0 * (i + 1))
                for i, k in enumerate(keys)]
        return dict(model=name, tensors=5, loops=dict(ief_before=["a"], ief=[]), rows=rows)

    per_sample, step = hf_layers.tables([result("bert", 1.0), result("vit", 2.0)], 16, 32, "abc1234")
    headers = [c["header"] for c in per_sample["columns"]]
    assert headers[:3] == ["model", "tensors looped before", "looped now"] and len(headers) == 3 + 5
    assert per_sample["rows"][0][:3] == ["bert", "1 of 5", "0 of 5"]
    assert per_sample["rows"][1][3:] == [3.0, 4.0, 5.0, 6.0, None]  # before, now, auto, vmap, no BackPACK
    assert "abc1234" in per_sample["note"] and "M = 16, T = 32" in per_sample["title"]
    assert [c["header"] for c in step["columns"]][:2] == ["model", "AdamW step ms"]
    assert step["rows"] == [["bert", 60.0, 7.0, 8.0], ["vit", 60.0, 8.0, 9.0]]


class _MultipliedPositions(torch.nn.Module):
    """Position embeddings fed [1, T] ids and multiplied into the tokens' (not only added): ``pos.weight`` takes the
    exact loop, so the benchmark's reading of the SlowPathWarning has a name to find."""

    def __init__(self):
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(9, 4), torch.nn.Embedding(5, 4)
        self.head = torch.nn.Linear(4, 3)

    def forward(self, ids):
        return self.head(torch.tanh(self.tok(ids) * self.pos(torch.arange(ids.shape[1])[None])))


@pytest.mark.parametrize("name, tensors", [("bert", 41), ("gpt2", 27), ("vit", 40)])
def test_the_hf_layers_benchmark_models_take_no_loop(name, tensors):
    """``python -m benchmarks hf_layers`` builds full-parameter BERT / GPT-2 (wte tied, frozen) / ViT; none of their
    tensors takes the loop now, and the benchmark's own reading of a SlowPathWarning finds the looped names."""
    from benchmarks import hf_layers

    model, x, y = hf_layers.build(name, 2, 4, 0)
    assert sum(p.requires_grad for p in model.parameters()) == tensors
    assert hf_layers.looped(lambda: ief.per_sample(model, x, y)) == []
    assert hf_layers.looped(lambda: ief.per_sample(_MultipliedPositions().double(), torch.randint(0, 9, (4, 5)),
                                                   torch.randint(0, 3, (4, 5)))) == ["pos.weight"]


def test_the_hf_layers_benchmark_refuses_bad_arguments(capsys):
    from benchmarks import hf_layers

    with pytest.raises(SystemExit) as exc:
        hf_layers.main(["--batch", "1"])
    assert exc.value.code == 2 and "--batch and --tokens must be >= 2" in capsys.readouterr().err


def test_the_gpt2_full_benchmark_runs_tiny_and_records_both_heads(tmp_path, capsys):
    """``python -m benchmarks gpt2_full --size tiny`` (the GPU benchmark's code on a CPU) times both heads, takes no
    loop, names no host sync on a CPU (the debug mode is CUDA's) and writes a valid record with its tables: the
    ratios (with ``--before``, the older package's IEF step timed alongside) and the steady step by phase, whose
    top-level phases and "other" add up to the step, with its host round-trips and operators counted."""
    from benchmarks import gpt2_full, phases

    path = tmp_path / "g.json"
    assert gpt2_full.main(["--size", "tiny", "--batch", "2", "--tokens", "4", "--repeats", "1", "--warmup", "1",
                           "--profile-rows", "3", "--before", "HEAD", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    harness.validate(doc)
    assert [r["head"] for r in doc["results"]] == ["tied", "untied"]
    assert all(r["slow_path"] == [] and r["first_sync"] == "n/a" and len(r["profile"]) == 3 for r in doc["results"])
    table, split = doc["tables"]
    assert [row[0] for row in table["rows"]] == ["tied", "untied"]
    assert all(row[6] > 0 and row[7] > 0 for row in table["rows"])
    assert [row[:2] for row in split["rows"]] == [["tied", "now"], ["tied", "before"], ["untied", "now"],
                                                  ["untied", "before"]]
    for r in doc["results"]:
        for key, ms in r["phases_ms"].items():
            assert set(ms) == set(phases.PHASES) and ms["per_sample"] > 0 and ms["gram"] > 0
            # one step: exact
            assert sum(ms[k] for k in (*phases.TOP_LEVEL, "other")) == pytest.approx(ms["step"], rel=1e-9)
            assert r["counts"][key]["operators"] > 0 and r["counts"][key]["round_trips"] >= 1
    with pytest.raises(SystemExit) as exc:
        gpt2_full.main(["--heads", "tied,shared"])
    assert exc.value.code == 2 and "--heads takes a comma-separated subset of tied,untied" in capsys.readouterr().err


@pytest.mark.parametrize("form", ["streamed", "auto"])
def test_the_phases_time_the_streamed_weights_work_in_gram_and_combine(monkeypatch, form):
    """A streamed weight's Gram and ``J^T c`` blocks (:mod:`ief.streamed`) are timed as ``stream_gram`` and
    ``stream_combine``, nested in ``gram`` and ``combine``, never as ``other``, and counted once: with each slowed by
    30 ms, both nested phases take at least that, ``gram`` and ``combine`` each include it once (under 2 x 30 ms
    more than the stream's), and ``other`` stays under 30 ms. Under ``form="auto"`` with ``memory_budget=0`` the
    same weights are streamed."""
    import time

    from benchmarks import phases

    for name in ("streamed_gram", "streamed_combine"):
        original = getattr(ief.streamed, name)

        def slowed(*args, _original=original, **kwargs):
            time.sleep(0.03)
            return _original(*args, **kwargs)

        monkeypatch.setattr(ief.streamed, name, slowed)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    x, y = torch.randn(6, 5, 16), torch.randint(0, 4, (6, 5))
    opt = ief.optim.IEF(model, lr=1e-3, form=form, **(dict(memory_budget=0) if form == "auto" else {}))
    opt.step(x, y)  # the first step's exact check
    ms = phases.attribute(ief, lambda: opt.step(x, y), torch.device("cpu"), 1)
    assert set(opt.last_step_report.routes.values()) == {"streamed", "dense"}
    streamed = sum(route == "streamed" for route in opt.last_step_report.routes.values())  # calls of each a step
    for nested, caller in (("stream_gram", "gram"), ("stream_combine", "combine")):
        assert ms[nested] >= 30 * streamed, ms
        assert ms[nested] <= ms[caller] < ms[nested] + 60, ms
    assert ms["other"] < 30, ms
    assert sum(ms[k] for k in (*phases.TOP_LEVEL, "other")) == pytest.approx(ms["step"], rel=1e-9)


def _distributed_record(tmp_path, *argv: str) -> dict:
    from benchmarks import distributed

    path = tmp_path / "d.json"
    assert distributed.main([*argv, "--batch", "2", "--tokens", "4", "--repeats", "1", "--warmup", "1",
                             "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    harness.validate(doc)
    return doc


def test_the_distributed_benchmark_runs_one_gloo_process(tmp_path):
    """``python -m benchmarks distributed --world 1`` (the code path ``--device cuda --world 1`` runs with NCCL): both
    models timed, IEF calls no collective with one process (its formula 0), DDP's bytes are 4 P."""
    doc = _distributed_record(tmp_path, "--world", "1")
    assert [r["model"] for r in doc["results"]["models"]] == ["mlp", "bert-lora"]
    for res in doc["results"]["models"]:
        assert res["bytes_per_rank"] == [{k: {"sent": 0, "received": 0, "calls": 0} for k in ("ief", "ddp", "ief_one")}]
        assert res["formula"] == dict(gram=0, direction=0, ief=0, ddp=4 * res["params"])
        assert all(r["median_ms"] > 0 for r in res["rows"])
    (table,) = doc["tables"]
    assert [row[0] for row in table["rows"]] == ["mlp", "bert-lora"] and table["rows"][1][1] == 8450


def test_the_distributed_benchmark_counts_what_two_processes_send(tmp_path):
    """Two gloo processes: each rank's counted bytes are the module docstring's formula M_max R (P_dense +
    sum T (I + O)) b + 8 P (the MLP's three weights gathered as factors, T = 1, its biases dense) plus the few bytes
    of the layouts, the batch sizes, s and the losses (under 1 KiB), and the same on both ranks; DDP's reducer is
    not seen by the wrappers (its 4 P is the formula's)."""
    doc = _distributed_record(tmp_path, "--world", "2", "--models", "mlp")
    (res,) = doc["results"]["models"]
    params = 784 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10
    assert res["plan"] == dict(factors=[[0, 1, 784, 256], [2, 1, 256, 256], [4, 1, 256, 10]], dense_columns=522,
                               factor_entries=1040 + 512 + 266)
    width = 522 + 1040 + 512 + 266  # per sample, against P = 269,322 for the rows
    assert res["params"] == params and res["formula"]["ief"] == 2 * 2 * width * 4 + 8 * params
    first, second = res["bytes_per_rank"]
    assert first == second and first["ddp"]["calls"] == 0 == first["ief_one"]["calls"]  # a group of one: no traffic
    assert 0 <= first["ief"]["received"] - res["formula"]["ief"] < 1024
    assert first["ief"]["sent"] >= 2 * width * 4 + 8 * params  # its factors and columns, its part of the direction


def test_the_distributed_benchmark_counts_collective_payloads(tmp_path):
    """The wrappers count an all_gather's input as sent and its gathered list as received, an all_reduce's tensor
    both ways, and put the originals back."""
    from benchmarks import distributed

    dist = torch.distributed
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        original = dist.all_gather
        with distributed.counting_collectives(1) as counts:
            out = [torch.empty(3, 5)]
            dist.all_gather(out, torch.ones(3, 5))
            dist.all_reduce(torch.ones(7, dtype=torch.float64))
        assert counts == {"sent": 60 + 56, "received": 60 + 56, "calls": 2}
        assert dist.all_gather is original
    finally:
        dist.destroy_process_group()


def test_the_distributed_benchmark_has_an_fsdp2_row_with_peak_memory(tmp_path):
    """``--fsdp2``: the exact step on the MLP sharded with FSDP2 beside FSDP2 + AdamW on two gloo processes, their
    time, bytes received (FSDP2's all-gathers and reduce-scatters counted) and peak memory per rank."""
    doc = _distributed_record(tmp_path, "--world", "2", "--models", "mlp", "--fsdp2")
    (res,) = doc["results"]["models"]
    assert [r["key"] for r in res["rows"]] == ["ief", "ddp", "ief_one", "ief_fsdp2", "fsdp2_adamw"]
    for rank_bytes, peaks in zip(res["bytes_per_rank"], res["peak_bytes_per_rank"]):
        # FSDP2 + AdamW: a forward and a backward all-gather of the MLP's float32 parameters and the gradients'
        # reduce-scatter, each at least the parameters' bytes received
        assert rank_bytes["fsdp2_adamw"]["received"] >= 3 * 4 * res["params"]
        # IEF: one all-gather of the parameters, the Gram's factors and the direction's shards (reduce-scattered in
        # FSDP2's chunks, not all-reduced whole): at least the parameters' bytes, fewer than FSDP2 + AdamW's
        assert 4 * res["params"] <= rank_bytes["ief_fsdp2"]["received"] < rank_bytes["fsdp2_adamw"]["received"]
        assert peaks["ief_fsdp2"] > 4 * res["params"] and peaks["fsdp2_adamw"] > 0
    _, fsdp2 = doc["tables"]
    assert fsdp2["rows"][0][0] == "mlp" and fsdp2["rows"][0][-1] > 0


def test_the_gpt2_full_benchmark_measures_one_steady_steps_memory_alone(tmp_path, capsys):
    """``--memory-only`` (GPT-2 small on a CPU, where timing rounds would take hours): one steady AdamW step and one
    steady IEF step per head, their peaks and held state, in a valid record whose one table divides them."""
    from benchmarks import gpt2_full

    path = tmp_path / "m.json"
    assert gpt2_full.main(["--size", "tiny", "--batch", "2", "--tokens", "4", "--warmup", "1", "--memory-only",
                           "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    harness.validate(doc)
    (table,) = doc["tables"]
    assert [row[0] for row in table["rows"]] == ["tied", "untied"]
    for r, row in zip(doc["results"], table["rows"]):
        assert r["memory_only"] and set(r["peak_mib"]) == {"adamw_step", "ief_step"}
        assert all(v > 0 for v in r["peak_mib"].values()) and r["held_mib"]["adamw_step"] > 0
        assert row[4] == pytest.approx(r["peak_mib"]["ief_step"] / r["peak_mib"]["adamw_step"])
        assert "dense" in row[8] or "streamed" in row[8] or "factored" in row[8]
    with pytest.raises(SystemExit) as exc:
        gpt2_full.main(["--memory-only", "--before", "HEAD"])
    assert exc.value.code == 2 and "drop --before HEAD" in capsys.readouterr().err
