"""companion.experiments.setups as the one definition of the grid: setups, seeds and optimisers per scale, baselines,
the evaluation seed and knobs; its overrides refused by name; loadable without torch (the workflow's parse time)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from companion.experiments import search
from companion.experiments import setups as S

ROOT = Path(__file__).resolve().parents[2]


def test_the_grid_per_scale_is_the_papers_and_its_siblings():
    """full: the paper's 16 setups x its five optimisers per method x 3 seeds (tab:train, tab:test, tab:test-mlp);
    cpu and smoke: the CPU siblings, with the practical optimisers (beyond the paper) beside the E2 ones; at cpu the
    digits MLP, whose runs cost seconds, gets 60 seeds (its closest loss pair needs them)."""
    assert S.GRIDS["full"] == S.ScaleGrid(S.PAPER_SETUPS, (0, 1, 2), practical=False)
    assert S.GRIDS["cpu"] == S.ScaleGrid(S.CPU_SETUPS, (0, 1, 2), practical=True,
                                         setup_seeds={"digits-mlp": tuple(range(60))})
    assert S.GRIDS["cpu"].seeds_of("digits-mlp") == tuple(range(60))
    assert S.GRIDS["cpu"].seeds_of("tweets-minilm-pt") == (0, 1, 2)
    assert S.GRIDS["smoke"] == S.ScaleGrid(S.CPU_SETUPS, (0, 1), practical=True)
    assert len(S.grid_runs("full")) == 16 * 5 * 3
    assert S.grid_optimizers("rte-t5-pt", "full") == ("adafactor", "sgd", "ef", "sf", "ief")
    assert S.grid_optimizers("cifar10-mlp", "full") == ("adam", "sgd", "ef", "sf", "ief")
    # prompt embeddings are no nn.Linear: iEF + momentum only; LoRA and the MLP: the K-FAC family too
    assert S.grid_optimizers("tweets-minilm-pt", "cpu") == ("adafactor", "sgd", "ef", "sf", "ief", "ief-momentum")
    assert S.grid_optimizers("digits-mlp", "cpu") == ("adam", "sgd", "ef", "sf", "ief", *S.PRACTICAL_OPTIMIZERS)
    assert len(S.grid_runs("cpu")) == 9 * 60 + (9 + 6) * 3 and len(S.grid_runs("smoke")) == (9 + 9 + 6) * 2
    # an override of the seeds applies to every setup, digits included
    assert S.scale_grid("cpu", seeds=[0]).seeds_of("digits-mlp") == (0,)
    assert S.grid_runs("smoke")[0] == ("digits-mlp", "adam", 0)  # setup, then optimiser, then seed
    assert all(o in S.resolve(s, sc).optimizers for sc in S.SCALES for s, o, _ in S.grid_runs(sc))
    assert S.e2_setups("cpu") == S.CPU_SETUPS and S.e2_setups("full") == S.PAPER_SETUPS


def test_one_name_per_method_and_the_baselines():
    """The methods are SetupConfig.method everywhere (the MLP's is ``scratch``): the E2 table, the baselines and the
    learning-rate search's grids are keyed by them."""
    methods = {S.method_of(s) for s in S.SETUPS}
    assert methods == set(S.E2_OPTIMIZERS) == set(S.BASELINE) == set(search.GRIDS) == {"pt", "lora", "scratch"}
    assert S.BASELINE == {"pt": "adafactor", "lora": "adamw", "scratch": "adam"}  # sec:eval_exp
    assert S.baseline_optimizer("cifar10-mlp") == S.baseline_optimizer("digits-mlp", "smoke") == "adam"
    assert S.baseline_optimizer("sst2-t5-pt", "full") == "adafactor"
    with pytest.raises(ValueError, match="setup 'rte-t5-lora' has no 'cpu' scale"):
        S.baseline_optimizer("rte-t5-lora", "cpu")


def test_evaluation_knobs_per_scale():
    """The evaluation framework's knobs (sec:eval_framework): the paper's 100 batches of M = 160 and E3 on its six E3
    setups at full scale; every setup swept at cpu and smoke."""
    assert S.EVALUATION_SEED == 0
    full = S.evaluation_knobs("cola-t5-lora", "full")
    assert full == {"batches": 100, "batch_size": 160, "cg_iterations": 50, "sweep_dampings": 13, "sweep": True}
    assert not S.evaluation_knobs("qqp-t5-lora", "full")["sweep"]
    assert {s for s in S.PAPER_SETUPS if S.evaluation_knobs(s, "full")["sweep"]} == {
        "cola-t5-lora", "sst2-t5-pt", "mrpc-t5-pt", "cifar100-vit-lora", "rte-t5-lora", "cifar10-mlp"}
    assert all(S.evaluation_knobs(s, sc)["sweep"] for sc in ("cpu", "smoke") for s in S.e2_setups(sc))
    assert S.evaluation_knobs("digits-mlp", "cpu")["batch_size"] is None  # the run's training batch size
    assert set(S.EVALUATION_KNOBS) == set(S.SCALES)


def test_overrides_narrow_the_grid_and_bad_ones_are_refused_by_name():
    grid = S.scale_grid("smoke", setups=["digits-mlp"], seeds=[0], practical=False)
    assert S.grid_runs("smoke", grid) == [("digits-mlp", o, 0) for o in ("adam", "sgd", "ef", "sf", "ief")]
    with pytest.raises(ValueError, match="unknown setup 'no-such-setup'; valid setups: cola-t5-lora"):
        S.scale_grid("smoke", setups=["no-such-setup"])
    with pytest.raises(ValueError, match=r"setup 'rte-t5-lora' has no 'cpu' scale.*setups at cpu: digits-mlp"):
        S.scale_grid("cpu", setups=["rte-t5-lora"])
    with pytest.raises(ValueError, match=r"seeds must be a non-empty list of non-negative integers, got \['0'\]"):
        S.scale_grid("cpu", seeds=["0"])
    with pytest.raises(ValueError, match="practical must be true or false, got 'maybe'"):
        S.scale_grid("cpu", practical="maybe")
    with pytest.raises(ValueError, match="unknown scale 'huge'; valid scales: full, cpu, smoke"):
        S.scale_grid("huge")


def test_loads_without_torch():
    """workflow/rules/common.smk loads setups.py (and the standard-library modules it imports) without the companion's
    package, whose __init__ imports torch, at parse time, where torch may be absent."""
    code = ("import importlib, sys, types; sys.modules['torch'] = None; "
            "package = types.ModuleType('reg'); "
            f"package.__path__ = [{str(ROOT / 'companion/experiments')!r}]; sys.modules['reg'] = package; "
            "m = importlib.import_module('reg.setups'); "
            "print(len(m.grid_runs('full')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "240", done.stderr
