"""The practical optimisers beyond the paper: the grid's ief-momentum and K-FAC family runs,
their rules (decided over seeds, able to hold, fail and stay inconclusive), the cost measured side by side, and the
chapter notebooks/practical.ipynb at smoke scale."""
from __future__ import annotations

import subprocess
import sys

import pandas as pd
import pytest
import torch
from nbrun import glued_text, run_notebook, train_grid, unresolved_glue

from companion.experiments.aggregate import aggregate, collect
from companion.experiments.optimizers import make_optimizer
from companion.experiments.setups import (CPU_SETUPS, PRACTICAL_OPTIMIZERS, optimizer_config, practical_optimizers,
                                          resolve)
from companion.experiments.step_cost import MLP_REPEAT_FACTOR, STEP_COSTS_FILE, practical_step_costs, step_costs
from companion.experiments.verdicts import FAILS, HOLDS, INCONCLUSIVE, RULES
from ief.optim import IEF, KFAC
from companion.chapters.practical import NO_SEARCH_RECORD, no_search_table, results_table


def test_every_cpu_setup_defines_the_practical_optimisers_it_can_run():
    assert practical_optimizers("digits-mlp", "cpu") == ["adam", "ief", *PRACTICAL_OPTIMIZERS]
    assert practical_optimizers("tweets-minilm-lora", "cpu") == ["adamw", "ief", *PRACTICAL_OPTIMIZERS]
    assert practical_optimizers("tweets-minilm-pt", "cpu") == ["adafactor", "ief", "ief-momentum"]  # no nn.Linear
    for setup in CPU_SETUPS:
        cfg = resolve(setup, "cpu")
        for o in practical_optimizers(setup, "cpu"):
            assert "lr search" in cfg.optimizers[o].source, (setup, o)  # every rate searched, none provisional


def test_make_optimizer_builds_the_practical_optimisers_from_their_settings():
    cfg = resolve("digits-mlp", "smoke")
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    opt, _ = make_optimizer(model, optimizer_config(cfg, "ief-momentum"), 10)
    group = opt.param_groups[0]
    assert type(opt) is IEF and (group["momentum"], group["dampening"], group["weight_decay"]) == (0.9, 0.9, 1e-4)
    for kind in ("kfac", "ekfac", "iekfac"):
        opt, _ = make_optimizer(model, optimizer_config(cfg, kind), 10)
        assert isinstance(opt, KFAC) and opt.kind == kind and (opt.factor_decay, opt.inverse_every) == (0.95, 10)


def _table(diffs_loss: dict[str, list[float]], diffs_test: dict[str, list[float]]) -> pd.DataFrame:
    rows = []
    for o in ("adam", "ief", "ief-momentum", "kfac", "ekfac", "iekfac"):
        for k in range(3):
            rows.append({"setup": "s", "optimizer": o, "seed": k, "final_train_loss": diffs_loss[o][k],
                         "test_score": diffs_test[o][k]})
    return pd.DataFrame(rows)


@pytest.mark.parametrize("momentum_loss, expected", [([0.1, 0.1, 0.1], HOLDS), ([0.9, 0.9, 0.9], FAILS),
                                                     ([0.1, 0.9, 0.1], INCONCLUSIVE)])
def test_the_momentum_rule_holds_fails_and_stays_inconclusive(momentum_loss, expected):
    base = [0.5, 0.5, 0.5]
    loss = {"adam": base, "ief": base, "ief-momentum": momentum_loss, "kfac": base, "ekfac": base, "iekfac": base}
    test = {o: [0.8, 0.8, 0.8] for o in loss}
    opts = {"s": ["adam", "ief", "ief-momentum", "kfac", "ekfac", "iekfac"]}
    (v,) = RULES["practical_momentum_loss"].evaluate(_table(loss, test), None, opts)
    assert v.verdict == expected


def test_the_iekfac_rule_needs_both_pairs():
    loss = {o: [0.5, 0.5, 0.5] for o in ("adam", "ief", "ief-momentum", "kfac", "ekfac")}
    opts = {"s": ["adam", "ief", "ief-momentum", "kfac", "ekfac", "iekfac"]}
    test = {o: [0.8] * 3 for o in [*loss, "iekfac"]}
    below_both = RULES["practical_iekfac_loss"].evaluate(_table({**loss, "iekfac": [0.3] * 3}, test), None, opts)
    assert below_both[0].verdict == HOLDS  # x0.6: beyond the margin x1.26
    within = RULES["practical_iekfac_loss"].evaluate(_table({**loss, "iekfac": [0.45] * 3}, test), None, opts)
    assert within[0].verdict == FAILS  # x0.9 on every seed: a decided tie, not an improvement
    loss["ekfac"] = [0.2] * 3  # below K-FAC, above eKFAC on every seed
    one_fails = RULES["practical_iekfac_loss"].evaluate(_table({**loss, "iekfac": [0.3] * 3}, test), None, opts)
    assert one_fails[0].verdict == FAILS and "ieKFAC < eKFAC" in one_fails[0].failures[0]


def test_step_costs_times_every_optimiser_against_the_baseline_and_refuses_bad_input():
    costs = step_costs("digits-mlp", "smoke", ["ief", "iekfac"], "adam", repeats=2)
    assert list(costs.optimizer) == ["adam", "ief", "iekfac"] and (costs.updates == 2).all()
    assert costs.ratio.iloc[0] == 1.0 and (costs.median_s > 0).all()
    with pytest.raises(ValueError, match="repeats must be a positive integer"):
        step_costs("digits-mlp", "smoke", ["ief"], "adam", repeats=0)
    with pytest.raises(ValueError, match="not defined for setup 'tweets-minilm-pt'.*valid optimizers"):
        step_costs("tweets-minilm-pt", "smoke", ["kfac"], "adafactor", repeats=1)


def test_practical_step_costs_time_the_chapters_optimisers_on_every_setup(tmp_path):
    """The table the workflow's step_costs job writes (python -m companion step-costs): per setup the chapter's
    optimisers, the baseline first, an MLP's updates timed MLP_REPEAT_FACTOR times as often."""
    costs = practical_step_costs(["digits-mlp", "tweets-minilm-pt"], "smoke", repeats=1)
    assert list(zip(costs.setup, costs.optimizer)) == [(s, o) for s in ("digits-mlp", "tweets-minilm-pt")
                                                       for o in practical_optimizers(s, "smoke")]
    assert list(costs.updates) == [MLP_REPEAT_FACTOR] * 6 + [1] * 3
    out = tmp_path / "costs.csv"
    done = subprocess.run([sys.executable, "-m", "companion", "step-costs", "--scale", "smoke", "--setup", "digits-mlp",
                           "--repeats", "1", "--out", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert list(pd.read_csv(out).optimizer) == practical_optimizers("digits-mlp", "smoke")
    bad = subprocess.run([sys.executable, "-m", "companion", "step-costs", "--scale", "smoke", "--repeats", "0",
                          "--out", str(tmp_path / "bad.csv")], capture_output=True, text=True)
    assert bad.returncode == 2 and "argument --repeats: invalid value '0': an integer >= 1 expected" in bad.stderr
    assert not (tmp_path / "bad.csv").exists()


def test_practical_notebook_smoke(tmp_path, run_cache):
    """The chapter at smoke scale on what the workflow's jobs leave: the runs (E2's and the practical ones) aggregated,
    and a step_costs.csv (one ratio marked, to see that the cost table is the file's)."""
    from companion.experiments.setups import e2_optimizers

    figures, runs, results = tmp_path / "fig", tmp_path / "runs", tmp_path / "results"
    train_grid(runs, "smoke", dict.fromkeys((s, o, k) for s in CPU_SETUPS
                                            for o in [*e2_optimizers(s), *practical_optimizers(s, "smoke")]
                                            for k in (0, 1)), run_cache)
    aggregate(runs, "smoke", results)
    planted = practical_step_costs(CPU_SETUPS, "smoke", repeats=1)
    planted.loc[(planted.setup == "tweets-minilm-lora") & (planted.optimizer == "iekfac"), "ratio"] = 7.77
    planted.to_csv(results / STEP_COSTS_FILE, index=False)
    nb = run_notebook("practical.ipynb", tmp_path, scale="smoke", out_dir=str(figures), results_dir=str(results),
                      seeds=[0, 1])
    assert "ieKFAC 7.77×" in glued_text(nb, "cost_tweets-minilm-lora")
    assert pd.read_csv(figures / "costs.csv").equals(pd.read_csv(results / STEP_COSTS_FILE))
    table, _ = collect(runs, "smoke")
    opts = {s: practical_optimizers(s, "smoke") for s in CPU_SETUPS}
    shown_runs = pd.read_csv(figures / "results.csv", index_col=[0, 1])
    assert len(shown_runs) == sum(len(o) for o in opts.values())  # every chapter run read (two seeds each)
    shown = pd.read_csv(figures / "results.csv", index_col=[0, 1])
    assert shown.equals(pd.read_csv(_written(results_table(table, opts), tmp_path), index_col=[0, 1]))
    costs = pd.read_csv(figures / "costs.csv")
    assert set(zip(costs.setup, costs.optimizer)) == {(s, o) for s, os_ in opts.items() for o in os_}
    assert (costs[costs.optimizer == costs.baseline].ratio == 1.0).all()
    for name in ("curves_momentum.png", "curves_kfac.png"):
        assert (figures / name).stat().st_size > 10_000
    assert not unresolved_glue(nb)
    committed, committed_glue = no_search_table()  # the "no search" rows: read from the committed record
    written = pd.read_csv(figures / "no_search.csv", keep_default_na=False, dtype=str, index_col=[0, 1])
    assert written.equals(committed.astype(str))
    assert glued_text(nb, "ns_verdict") == committed_glue["ns_verdict"]
    # two seeds: an interval with one degree of freedom (t = 12.7) leaves a pair undecided unless both seeds agree
    # closely; the verdict then names the seeds that would decide it at this scale
    assert glued_text(nb, "v_practical_momentum_loss").startswith(("undecidable at smoke for ", "holds for ",
                                                                   "does not hold for "))
    assert "ieKFAC" in glued_text(nb, "cost_tweets-minilm-lora")
    # code folded but for the parameters cell and the cell that teaches the API; stored without outputs
    tags = [c.metadata.get("tags", []) for c in nb.cells if c.cell_type == "code"]
    assert sum(not ({"hide-input", "remove-input"} & set(t)) for t in tags) == 2  # injected parameters + the API
    import nbformat

    stored = nbformat.read("notebooks/practical.ipynb", 4)
    assert all(not c.get("outputs") for c in stored.cells if c.cell_type == "code")


def _written(frame: pd.DataFrame, tmp_path) -> str:
    path = tmp_path / "expected.csv"
    frame.to_csv(path)
    return str(path)


def _no_search_record(path, auto_losses):
    """A record shaped as ``python -m benchmarks auto_lr`` writes it: one case per ``auto`` loss, searched loss 1."""
    import json

    def run(lr, loss):
        return dict(lr=lr, diverged=None, final_train_loss=loss, test_accuracy=0.5, rate_min=0.1 if lr == "auto"
                    else lr, rate_max=2.0 if lr == "auto" else lr)

    cases = [dict(case=f"case{i}", note="a note", runs=dict(default=run(None, 3.0), auto=run("auto", loss),
                                                            searched=run(0.3, 1.0)),
                  auto_within_10_percent=loss <= 1.1) for i, loss in enumerate(auto_losses)]
    path.write_text(json.dumps(dict(date="2026-11-28T00:00:00Z", command="python -m benchmarks auto_lr",
                                    results=dict(cases=cases))))
    return path


def test_the_no_search_rows_and_their_verdict_follow_the_record(tmp_path):
    """Three rows per case (default, auto, searched) and a verdict that holds only when every case is within the
    margin; the committed record's says which case fails; a missing record names the command that makes it."""
    table, glue = no_search_table(_no_search_record(tmp_path / "pass.json", [1.05, 0.9]))
    rates = list(table.index.get_level_values("rate")[:3])
    assert len(table) == 6 and rates == ["default (no search)", "lr='auto' (no search)", "searched"]
    assert glue["ns_verdict"] == "it holds on every case (case0, case1)"
    _, glue = no_search_table(_no_search_record(tmp_path / "fail.json", [1.05, 2.5]))
    assert glue["ns_verdict"].startswith("it does not hold: lr='auto' is within the margin on case0 but not on "
                                         "case1 (2.5× the searched rate's loss)")
    with pytest.raises(FileNotFoundError, match="python -m benchmarks auto_lr"):
        no_search_table(tmp_path / "none.json")
    _, committed = no_search_table(NO_SEARCH_RECORD)
    assert committed["ns_rule"].startswith("lr='auto' earns the default when")
