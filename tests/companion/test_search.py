"""The learning-rate search (companion.experiments.search): the paper's grids, the choice rule, the CLI, and the
recorded cpu-scale searches that the registry's cpu learning rates must equal."""
from __future__ import annotations

import json

import pytest

from companion.__main__ import main
from companion.experiments import CPU_SETUPS, resolve
from companion.experiments import search as S
from companion.experiments import store
from companion.experiments.runner import run_dir
from companion.experiments.setups import OPTIMIZERS, PRACTICAL_OPTIMIZERS
from companion.experiments.summaries import final_train_loss


def test_grids_are_the_papers():
    """sec:app-optimiser (PEFT) and sec:app-mlp-cifar10 (MLP), value for value; 'ours' only where the paper ran no
    search for that optimiser and method; rates beyond the paper's only where the cpu search chose an edge of its
    grid, each saying so."""
    pt, lora, mlp = S.GRIDS["pt"], S.GRIDS["lora"], S.GRIDS["scratch"]
    for g in (pt, lora):
        assert g["sgd"].paper == (0.1, 1, 10, 20, 50, 100) and g["ief"].paper == (1, 10, 50, 100)
    assert pt["ef"].paper == pt["sf"].paper == (1e-3, 5e-3, 1e-2, 1e-1, 1, 10)
    assert lora["ef"].paper == lora["sf"].paper == (1e-3, 5e-3, 1e-2, 1e-1, 1)
    assert sorted(lora["adamw"].paper) == [1e-4, 5e-4, 1e-3]
    assert (mlp["adam"].paper, mlp["sgd"].paper, mlp["ief"].paper, mlp["sf"].paper) == (
        (5e-5, 1e-4, 5e-4), (0.01, 0.1, 0.5), (10, 50, 100), (0.01, 0.1, 0.5))
    assert mlp["ef"].paper == (1e-5, 1e-4, 1e-3, 1e-2, 1e-1)
    ours = {(k, o) for k, grids in S.GRIDS.items() for o, g in grids.items() if g.source.startswith("ours")}
    practical = {(k, o) for k in ("pt", "lora", "scratch") for o in PRACTICAL_OPTIMIZERS
                 if k != "pt" or o == "ief-momentum"}
    assert ours == {("pt", "adafactor"), ("pt", "adamw"), ("lora", "adafactor"), ("scratch", "adamw"),
                    ("scratch", "adafactor")} | practical  # beyond the paper: grids of ours, each saying so
    assert all(S.GRIDS[k][o].source.startswith("ours: beyond the paper") for k, o in practical)
    for grids in S.GRIDS.values():
        for g in grids.values():
            assert g.values == tuple(sorted(set(g.paper) | set(g.extended)))
            assert bool(g.extended) == bool(g.extension_source)
            assert not g.extended or g.extension_source.startswith("ours, added because the cpu search chose")
    for name in CPU_SETUPS:  # every registered optimiser of a cpu setup has a grid
        cfg = resolve(name, "cpu")
        assert all(S.grid(cfg, o).values for o in cfg.optimizers)
    with pytest.raises(ValueError, match="valid optimizers: adamw, adafactor, sgd, ef, sf, ief, ief-momentum, kfac, "
                                         "ekfac, iekfac$"):
        S.grid(resolve("tweets-minilm-lora", "cpu"), "adam")


@pytest.mark.parametrize("name", CPU_SETUPS)
def test_every_cpu_search_brackets_its_choice(name):
    """A rate at the edge of its grid says nothing about whether a better one lies beyond it, so every
    committed cpu search chose a rate with a tried rate on each side."""
    record = S.load_record(name, "cpu")
    edges = {opt: S.edge(o) for opt, o in record["optimizers"].items()}
    assert {opt: e for opt, e in edges.items() if e} == {}


def test_edge_names_the_edge():
    assert S.edge({"grid": [1, 10, 100], "chosen_lr": 10}) is None
    assert S.edge({"grid": [1, 10, 100], "chosen_lr": 1}) == (
        "chose the smallest rate of its grid (1): the optimum is not bracketed")
    assert "largest rate of its grid (100)" in S.edge({"grid": [100, 1, 10], "chosen_lr": 100})
    assert S.edge({"grid": [1, 10], "chosen_lr": None}) == "every rate diverged"


def test_missing_runs_only_the_rates_the_record_lacks(tmp_path, monkeypatch):
    """``--missing`` completes a grid extended after a search: the rates already in OUT's record (at this seed) are
    not run again, the new ones are, and the record holds both."""
    calls: list = []
    monkeypatch.setattr(S, "train", _fake_train(calls))
    S.search("digits-mlp", "smoke", tmp_path, optimizers=["sgd"], verbose=False)
    path = tmp_path / "lr-search" / "smoke-digits-mlp.json"
    record = json.loads(path.read_text())
    record["optimizers"]["sgd"]["trials"] = record["optimizers"]["sgd"]["trials"][:2]  # as before an extension
    path.write_text(json.dumps(record))
    calls.clear()
    record = S.search("digits-mlp", "smoke", tmp_path, optimizers=["sgd"], verbose=False, missing_only=True)
    assert [lr for _, lr, _ in calls] == list(S.GRIDS["scratch"]["sgd"].values[2:])
    assert [t["lr"] for t in record["optimizers"]["sgd"]["trials"]] == list(S.GRIDS["scratch"]["sgd"].values)
    assert record["command"].endswith("--seed 0 --missing")
    calls.clear()
    S.search("digits-mlp", "smoke", tmp_path, optimizers=["sgd"], seed=1, verbose=False, missing_only=True)
    assert len(calls) == len(S.GRIDS["scratch"]["sgd"].values)  # another seed: nothing of it is in the record


def _trial(lr, score, loss, diverged=None):
    return {"lr": lr, "validation_score": score, "final_train_loss": loss, "diverged": diverged}


def test_choice_rule():
    assert S.choose([_trial(1, 0.5, 0.3), _trial(10, 0.7, 0.9), _trial(100, 0.9, 0.1, diverged=40)]) == 10
    assert S.choose([_trial(1, 0.7, 0.3), _trial(10, 0.7, 0.2)]) == 10  # tie: lower final loss
    assert S.choose([_trial(50, 0.7, 0.2), _trial(1, 0.7, 0.2)]) == 1  # then the smaller rate
    assert S.choose([_trial(1, 0.7, None), _trial(10, 0.7, 0.5)]) == 10
    assert S.choose([_trial(1, 0.9, 0.1, diverged=3), _trial(10, 0.8, 0.1, diverged=5)]) is None


def test_search_cli_runs_every_rate_and_records_the_choice(tmp_path, capsys):
    record_file = tmp_path / "record.json"
    args = ["search", "--setup", "digits-mlp", "--scale", "smoke", "--optimizer", "sgd", "--optimizer", "ief",
            "--out", str(tmp_path / "runs"), "--record", str(record_file), "--no-progress"]
    assert main(args) == 0
    record = json.loads(record_file.read_text())
    assert record == json.loads((tmp_path / "runs" / "lr-search" / "smoke-digits-mlp.json").read_text())
    assert set(record["optimizers"]) == {"sgd", "ief"} and record["grid_kind"] == "scratch"
    for name, o in record["optimizers"].items():
        assert [t["lr"] for t in o["trials"]] == list(S.GRIDS["scratch"][name].values) == o["grid"]
        assert o["chosen_lr"] == S.choose(o["trials"])
        for t in o["trials"]:  # each trial is an ordinary run folder with the overridden rate
            run = S.trial_dir(tmp_path / "runs", t["lr"]) / "smoke" / "digits-mlp" / name / "seed-0"
            assert json.loads((run / "config.json").read_text())["optimizer"]["lr"] == t["lr"]
            assert json.loads((run / "summary.json").read_text())["best_validation"]["score"] == t["validation_score"]
    assert record["environment"]["torch_threads"] >= 1
    capsys.readouterr()
    assert main(args) == 0  # a second invocation skips every finished trial and gives the same record
    assert "skipped (finished)" in capsys.readouterr().out
    again = json.loads(record_file.read_text())
    assert again["optimizers"] == record["optimizers"]
    assert main(["search", "--setup", "digits-mlp", "--scale", "smoke", "--optimizer", "lbfgs",
                 "--out", str(tmp_path)]) == 2
    assert "optimizer 'lbfgs' on setup 'digits-mlp'; valid optimizers: adamw" in capsys.readouterr().err


@pytest.mark.parametrize("name", CPU_SETUPS)
def test_cpu_learning_rates_are_the_recorded_search(name):
    """The registry's cpu rates equal the committed search's choices; the other hyperparameters are the ones the
    search ran with; every registered optimiser was searched over its full grid with seed 0 on the cpu scale."""
    record = S.load_record(name, "cpu")
    assert record is not None, f"no recorded search {S.record_path(name, 'cpu')}"
    cfg = resolve(name, "cpu")
    assert not cfg.provisional
    assert record["setup"] == name and record["scale"] == "cpu" and record["seed"] == 0
    assert set(record["optimizers"]) == set(cfg.optimizers)
    for opt, rec in record["optimizers"].items():
        registered = cfg.optimizers[opt]
        assert rec["chosen_lr"] is not None, f"{name}/{opt}: every learning rate diverged"
        assert registered.lr == rec["chosen_lr"] and rec["chosen_lr"] == S.choose(rec["trials"])
        assert [t["lr"] for t in rec["trials"]] == rec["grid"] == list(S.grid(cfg, opt).values)
        fixed = rec["fixed"]
        assert (fixed["damping"], fixed["weight_decay"], fixed["schedule"], tuple(fixed["milestones"])) == (
            registered.damping, registered.weight_decay, registered.schedule, registered.milestones)
        assert "lr search" in registered.source and S.record_path(name, "cpu").name in registered.source
    # the smoke siblings train with the same (searched) values
    smoke = resolve(name, "smoke")
    assert {o: c.lr for o, c in smoke.optimizers.items()} == {o: c.lr for o, c in cfg.optimizers.items()}
    assert set(OPTIMIZERS) >= set(cfg.optimizers)


def _fake_train(calls):
    """``train`` as search calls it, without training: the numbers are a function of (optimizer, lr, seed)."""
    def train(setup, name, seed, scale, out, *, lr, **kwargs):
        calls.append((name, lr, seed))
        score = 0.5 + 0.1 * seed + (0.3 if lr == S.GRIDS["scratch"][name].values[1] else 0.0)
        root = run_dir(out, scale, setup, name, seed)
        root.mkdir(parents=True, exist_ok=True)
        (root / "config.json").write_text("{}")
        (root / "train_loss.csv").write_text(store.loss_csv([3.0 - 0.1 * i - seed for i in range(20)], 10))
        summary = {"seed": seed, "final_train_loss": 1.0 / (1 + seed), "steps": 20, "diverged": None, "test": None,
                   "wall_time_s": 0.1, "best_validation": {"score": score, "metrics": {"accuracy": score}, "step": 8}}
        if not (root / "summary.json").exists():  # a finished run is skipped, as the runner does
            (root / "summary.json").write_text(json.dumps(summary))
        return summary
    return train


def test_search_merges_other_optimisers_and_seeds_into_the_record(tmp_path, monkeypatch):
    """A search of a subset of optimisers or of another seed adds its trials to the record (before: it replaced the
    whole record); a rate's seeds are averaged for the choice; a record from before per-trial seeds keeps its
    trials under its seed."""
    calls: list = []
    monkeypatch.setattr(S, "train", _fake_train(calls))
    path = tmp_path / "lr-search" / "smoke-digits-mlp.json"
    S.search("digits-mlp", "smoke", tmp_path, optimizers=["sgd"], verbose=False)
    S.search("digits-mlp", "smoke", tmp_path, optimizers=["ief"], verbose=False)
    record = json.loads(path.read_text())
    assert set(record["optimizers"]) == {"sgd", "ief"} and record["seeds"] == [0] and record["seed"] == 0
    S.search("digits-mlp", "smoke", tmp_path, optimizers=["sgd"], seed=1, verbose=False)
    record = json.loads(path.read_text())
    assert set(record["optimizers"]) == {"sgd", "ief"} and record["seeds"] == [0, 1] and record["seed"] is None
    sgd = record["optimizers"]["sgd"]
    assert [(t["lr"], t["seed"]) for t in sgd["trials"]] == [(lr, k) for lr in S.GRIDS["scratch"]["sgd"].values
                                                             for k in (0, 1)]
    assert sgd["chosen_lr"] == S.GRIDS["scratch"]["sgd"].values[1] == S.choose(sgd["trials"])
    n_ief = len(S.GRIDS["scratch"]["ief"].values)
    assert [t["seed"] for t in record["optimizers"]["ief"]["trials"]] == [0] * n_ief
    S.search("digits-mlp", "smoke", tmp_path, optimizers=["sgd"], seed=1, verbose=False)  # again: nothing doubled
    assert json.loads(path.read_text())["optimizers"] == record["optimizers"]

    old = json.loads(path.read_text())  # a record written before trials named their seed
    old["seed"] = 0
    for o in old["optimizers"].values():
        o["trials"] = [{k: v for k, v in t.items() if k != "seed"} for t in o["trials"] if t["seed"] == 0]
    path.write_text(json.dumps(old))
    S.search("digits-mlp", "smoke", tmp_path, optimizers=["ief"], seed=2, verbose=False)
    record = json.loads(path.read_text())
    assert [t["seed"] for t in record["optimizers"]["ief"]["trials"]] == [0, 2] * n_ief
    assert [t["seed"] for t in record["optimizers"]["sgd"]["trials"]] == [0] * len(S.GRIDS["scratch"]["sgd"].values)


def test_a_record_carries_when_at_which_commit_and_by_which_command_it_was_made(tmp_path, monkeypatch):
    """Each write of a record stamps its UTC creation time, the repository's HEAD (None outside git) and the command
    that repeats the call; a later write of the same record stamps its own."""
    import datetime
    import subprocess
    from pathlib import Path

    monkeypatch.setattr(S, "train", _fake_train([]))
    before = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    record = S.search("digits-mlp", "smoke", tmp_path, optimizers=["sgd", "ief"], seed=1, verbose=False)
    created = datetime.datetime.strptime(record["created"], "%Y-%m-%dT%H:%M:%SZ").replace(
        tzinfo=datetime.timezone.utc)
    assert before <= created <= datetime.datetime.now(datetime.timezone.utc)
    root = Path(S.__file__).resolve().parents[2]
    if (root / ".git").exists():  # a checkout: the record names its HEAD
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
        assert record["commit"] == head and len(head) == 40
    assert record["command"] == ("python -m companion search --setup digits-mlp --scale smoke --optimizer sgd "
                                 "--optimizer ief --seed 1")
    assert json.loads((tmp_path / "lr-search" / "smoke-digits-mlp.json").read_text())["created"] == record["created"]
    assert S.search_command("digits-mlp", "cpu", None, 0) == (
        "python -m companion search --setup digits-mlp --scale cpu --seed 0")
    assert S.git_commit(tmp_path) is None  # not a checkout: no commit is invented
    trials = record["optimizers"]["sgd"]["trials"]  # each trial: when its run finished, the code that ran it
    for t in trials:
        made = datetime.datetime.strptime(t["created"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.timezone.utc)
        assert before - datetime.timedelta(seconds=1) <= made <= datetime.datetime.now(datetime.timezone.utc)
        assert t["commit"] == record["commit"]
    again = S.search("digits-mlp", "smoke", tmp_path, optimizers=["sgd"], seed=1, verbose=False)  # runs found
    assert again["optimizers"]["sgd"]["trials"] == trials  # on disk keep their date and the commit known for them


def test_choice_averages_the_seeds_of_a_rate():
    t = lambda lr, seed, score, loss=0.1, div=None: {**_trial(lr, score, loss, div), "seed": seed}  # noqa: E731
    assert S.choose([t(1, 0, 0.9), t(1, 1, 0.5), t(10, 0, 0.8), t(10, 1, 0.8)]) == 10  # mean 0.7 < 0.8
    assert S.choose([t(1, 0, 0.9), t(1, 1, 0.9, div=3), t(10, 0, 0.5)]) == 10  # a diverged seed rules a rate out


def test_search_record_that_is_not_one_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(S, "train", _fake_train([]))
    path = tmp_path / "lr-search" / "smoke-digits-mlp.json"
    path.parent.mkdir(parents=True)
    path.write_text('{"setup": "cola-t5-lora"')
    with pytest.raises(ValueError, match=f"{path} is truncated or not JSON"):
        S.search("digits-mlp", "smoke", tmp_path, optimizers=["sgd"], verbose=False)


def test_a_trial_keeps_its_losses_and_the_books_final_loss(tmp_path, monkeypatch):
    """A trial's ``final_train_loss`` is the book's one definition (the last 10 % of the updates, computed from the
    per-update losses the record keeps), not the runner's 100-update mean."""
    monkeypatch.setattr(S, "train", _fake_train([]))
    record = S.search("digits-mlp", "smoke", tmp_path, optimizers=["sgd"], verbose=False)
    for t in record["optimizers"]["sgd"]["trials"]:
        assert t["train_losses"] == [3.0 - 0.1 * i for i in range(20)]
        assert t["final_train_loss_updates"] == 2 and t["final_train_loss"] == pytest.approx(3.0 - 0.1 * 18.5)
        assert t["final_train_loss"] == final_train_loss(t["train_losses"]) != 1.0  # not the fake runner's summary
        assert S.final_loss_definition(t) == "mean of the last 2 of 20 updates (last 10 %)"
        assert S.search_table(record)[0]["final_train_loss_definition"] == S.final_loss_definition(t)
    old = {"steps": 64, "final_train_loss": 1.0}  # a trial recorded before the losses were kept
    assert S.final_loss_definition(old) == "mean of the last 64 of 64 updates (all of them)"
    assert S.final_loss_definition({**old, "steps": 340}) == "mean of the last 100 of 340 updates"


@pytest.mark.parametrize("name", CPU_SETUPS)
def test_recorded_final_losses_are_recomputable_from_the_record(name):
    """Where a committed record keeps per-update losses, its final losses are exactly the book's definition of
    them; where it does not, the book's tables say so (companion.chapters.train.loss_caption)."""
    from companion.chapters.train import loss_caption

    record = S.load_record(name, "cpu")
    trials = [t for o in record["optimizers"].values() for t in o["trials"]]
    kept = [t for t in trials if "train_losses" in t]
    for t in kept:
        assert len(t["train_losses"]) == t["steps"]
        assert t["final_train_loss"] == final_train_loss(t["train_losses"])
    caption = loss_caption({name: record})
    if len(kept) == len(trials):
        assert "the book's final loss (last " in caption and "runner" not in caption
    else:
        assert "runner's last-100 mean" in caption and name in caption
