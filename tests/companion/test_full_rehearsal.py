"""The full-scale rehearsal: every full-scale code path, end to end, on CPU, with the network off.

Stand-in assets in the real layout (``tests/standin_hub.py``: a tiny T5 of the paper's architecture family with random
weights and a tokenizer trained here, GLUE-shaped data for the 7 tasks, CIFAR-shaped image sets, a tiny ViT) are
written into an assets folder by ``companion.experiments.asset_folder.download`` against a patched hub client; then,
with ``IEF_ASSETS`` set, the hub's offline switches on and its endpoint and proxies pointed at a closed port:

- ``python -m companion train --scale full`` for ``cola-t5-lora`` (AdamW, iEF) and ``rte-t5-pt`` (Adafactor, iEF) as
  registered (the stand-in data are small enough), and for ``cifar10-mlp`` (Adam, iEF) with tiny overrides (2 epochs,
  batch 16, 16 validation images, 16x16 images, 64 hidden units: the registered 3072-2048-2048-10 MLP's block-diagonal
  evaluation takes ~100 s of one CPU core per checkpoint). ``cola-t5-lora`` iEF runs as its own process; the other
  five and the ``evaluate`` below run through the same entry point (``companion.__main__.main``, what ``python -m
  companion`` calls) one after another in one fresh process with the same environment, and so do ``aggregate`` and
  ``early-spike`` in a second one: each process start costs seconds of imports;
- ``python -m companion evaluate --scale full`` on ``cola-t5-lora`` (small knobs);
- the baseline run and the evaluation of every other paper setup, in process (the evaluation chapter shows all 16);
- ``python -m companion aggregate`` and ``early-spike --scale full``, then ``notebooks/evaluation.ipynb`` and
  ``notebooks/optimisation.ipynb`` at ``scale="full"`` on those results.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from nbrun import run_notebook, unresolved_glue
from standin_hub import build_standin_hub, serve

from companion.experiments.asset_folder import check, download
from companion.experiments.setups import GLUE_LABEL_WORDS, PAPER_SETUPS, resolve

ROOT = Path(__file__).resolve().parents[2]
DEAD = "http://127.0.0.1:9"  # nothing listens there: any request to the hub fails at once
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_ENDPOINT": DEAD,
           "HTTP_PROXY": DEAD, "HTTPS_PROXY": DEAD, "http_proxy": DEAD, "https_proxy": DEAD, "NO_PROXY": "",
           "no_proxy": "", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
MLP_SET = ["epochs=2", "batch_size=16", 'sizes={"validation": 16}',
           'model_args={"hidden": [64, 64], "image_shape": [16, 16, 3], "scale": 255.0, '
           '"mean": [0.4914, 0.4822, 0.4465], "std": [0.2470, 0.2435, 0.2616]}']
VIT_SET = {"epochs": 1, "batch_size": 16, "eval_batch_size": 16, "sizes": {"validation": 16}}
KNOBS = dict(batches=2, batch_size=16, cg_iterations=5, sweep_dampings=[1e-7, 1e-3, 1.0])


# Commands run one after another in one fresh process, each through the entry point of ``python -m companion``
# (``companion.__main__.main``), stopping at the first that fails: a process start costs seconds of imports.
BATCH = """import json, sys
from companion.__main__ import main
for argv in json.loads(sys.argv[1]):
    print("python -m companion " + " ".join(argv), file=sys.stderr, flush=True)
    if (code := main(argv)) != 0:
        sys.exit(code)
"""


def _ief(env: dict, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "companion", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"python -m companion {' '.join(args)}\n{done.stdout}\n{done.stderr}"
    return done


def _ief_in_one_process(env: dict, *commands: list[str]) -> subprocess.CompletedProcess:
    """Each of ``commands`` as ``python -m companion`` would run it, in one fresh process with ``env``; all must exit
    with 0 (the output names the one that did not)."""
    done = subprocess.run([sys.executable, "-c", BATCH, json.dumps(commands)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    """Assets, runs, results and executed notebooks of the rehearsal; the process environment restored after."""
    tmp = tmp_path_factory.mktemp("rehearsal")
    saved = dict(os.environ)
    try:
        hub = build_standin_hub(tmp / "hub")
        with pytest.MonkeyPatch.context() as mp:
            serve(mp, hub)
            download(tmp / "assets", list(PAPER_SETUPS), log=lambda line: None)
        assert check(tmp / "assets") == []
        os.environ.update(OFFLINE, IEF_ASSETS=str(tmp / "assets"))
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        runs, results = tmp / "runs", tmp / "results" / "full"
        train = ["train", "--scale", "full", "--out", str(runs), "--no-progress"]
        _ief(env, *train, "--setup", "cola-t5-lora", "--optimizer", "ief")  # the command itself, once
        mlp = [a for s in MLP_SET for a in ("--set", s)]
        others = (("cola-t5-lora", "adamw"), ("rte-t5-pt", "adafactor"), ("rte-t5-pt", "ief"))
        _ief_in_one_process(
            env, *([*train, "--setup", setup, "--optimizer", optimizer] for setup, optimizer in others),
            *([*train, "--setup", "cifar10-mlp", "--optimizer", optimizer, *mlp] for optimizer in ("adam", "ief")),
            ["evaluate", "--setup", "cola-t5-lora", "--scale", "full", "--runs", str(runs), "--out",
             str(results / "eval" / "cola-t5-lora.csv"), "--batches", "2", "--batch-size", "16", "--cg-iterations", "5",
             "--sweep-dampings", "3"])

        from companion.experiments import train as train_run
        from companion.experiments.evaluate_runs import baseline_optimizer, evaluate_run

        torch.set_num_threads(1)
        for setup in PAPER_SETUPS:  # every other setup's baseline run and evaluation, as the workflow would
            if setup not in ("cola-t5-lora", "cifar10-mlp"):  # those two were trained above
                train_run(setup, baseline_optimizer(setup, "full"), 0, "full", runs, progress=False, verbose=False,
                          overrides=VIT_SET if setup == "cifar100-vit-lora" else None)
            if setup != "cola-t5-lora":  # evaluated above
                evaluate_run(setup, "full", 0, runs, results / "eval" / f"{setup}.csv", progress=False, **KNOBS)
        _ief_in_one_process(env, ["aggregate", "--scale", "full", "--runs", str(runs), "--out", str(results)],
                            ["early-spike", "--scale", "full", "--runs", str(runs), "--results", str(results), "--out",
                             str(results / "early_spike.csv")])
        notebooks = {
            "evaluation": run_notebook("evaluation.ipynb", tmp / "nb", scale="full", out_dir=str(tmp / "fig-eval"),
                                       runs_dir=str(runs), results_dir=str(results)),
            "optimisation": run_notebook("optimisation.ipynb", tmp / "nb", scale="full",
                                         out_dir=str(tmp / "fig-opt"), results_dir=str(results)),
        }
        yield {"tmp": tmp, "runs": runs, "results": results, "notebooks": notebooks, "assets": tmp / "assets"}
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _summary(runs: Path, setup: str, optimizer: str) -> dict:
    return json.loads((runs / "full" / setup / optimizer / "seed-0" / "summary.json").read_text())


def test_training_at_full_scale_reports_the_papers_metrics(rehearsal):
    runs = rehearsal["runs"]
    cola, rte = _summary(runs, "cola-t5-lora", "ief"), _summary(runs, "rte-t5-pt", "ief")
    assert set(cola["best_validation"]["metrics"]) == {"matthews_correlation"}  # CoLA: Matthews correlation
    assert set(rte["best_validation"]["metrics"]) == {"accuracy"}
    mrpc = _summary(runs, "mrpc-t5-lora", "adamw")
    assert set(mrpc["best_validation"]["metrics"]) == {"f1", "accuracy"}  # MRPC / QQP: F1 and accuracy
    mnli = _summary(runs, "mnli-t5-pt", "adafactor")
    assert set(mnli["best_validation"]["metrics"]) == {"accuracy_matched", "accuracy_mismatched"}
    for s in (cola, rte, mrpc, mnli):  # GLUE test labels are private: submission files, no test score
        assert s["test"] is None and s["test_predictions"]
        assert s["steps"] == resolve(s["setup"], "full").epochs * 2  # 48 examples, batch 32, as registered
    tsv = pd.read_csv(runs / "full/rte-t5-pt/ief/seed-0" / rte["test_predictions"][0], sep="\t")
    assert len(tsv) == 16 and set(tsv.prediction) <= {"entailment", "not_entailment"}
    mlp = _summary(runs, "cifar10-mlp", "ief")
    assert set(mlp["test"]) == {"accuracy"} and mlp["steps"] == 2 * 6  # 96 training images, batch 16
    assert mlp["trainable_parameters"] == 768 * 64 + 64 + 64 * 64 + 64 + 64 * 10 + 10
    config = json.loads((runs / "full/cola-t5-lora/ief/seed-0/config.json").read_text())
    assert config["optimizer"]["options"]["convention"] == "token-mean"


def test_label_words_end_with_eos_and_ief_runs_in_the_token_mean_convention(rehearsal):
    """The T5 read from the assets folder: targets are the label word's tokens + </s> (-100 padded), and iEF's
    paper rates are converted per batch: lr / K, damping * K^2 with K the batch's target tokens."""
    from companion.experiments.data import load_data
    from companion.experiments.models import build_model
    from companion.experiments.optimizers import make_optimizer, train_step
    from ief.optim import IEF
    from companion.experiments.tasks import make_task

    os.environ["IEF_ASSETS"] = str(rehearsal["assets"])
    cfg = resolve("cola-t5-lora", "full")
    data = load_data(cfg)
    model, tokenizer = build_model(cfg, data)
    task = make_task(cfg, model, tokenizer)
    inputs, targets = task.collate(list(data.train)[:8])
    for row, example in zip(targets, list(data.train)[:8]):
        word = tokenizer(GLUE_LABEL_WORDS["cola"][example["label"]])["input_ids"]
        kept = row[row != -100].tolist()
        assert kept == word and kept[-1] == tokenizer.eos_token_id == 1
    assert (inputs["decoder_input_ids"][:, 0] == 0).all()
    ocfg = cfg.optimizers["ief"]
    opt, _ = make_optimizer(model, ocfg, 10)
    assert type(opt) is IEF and opt.reduction == "mean"  # converts lr / K, damping * K^2 for every batch
    train_step(model, opt, inputs, targets)
    assert opt.last_tokens == int((targets != -100).sum())
    assert opt.param_groups[0]["lr"] == ocfg.lr and opt.param_groups[0]["damping"] == ocfg.damping


def test_evaluation_at_full_scale(rehearsal):
    results = rehearsal["results"]
    table = pd.read_csv(results / "eval" / "cola-t5-lora.csv")
    assert set(table.scale) == {"full"} and set(table.stage) == {0, 25, 50, 75, 100}
    assert {"sgd", "ef", "ief", "sf"} <= set(table.method)
    assert table[table.kind == "e1"].gamma.notna().all()
    assert set(pd.read_csv(results / "e2_runs.csv").setup) == set(PAPER_SETUPS)


def test_notebooks_at_full_scale(rehearsal):
    tmp, nbs = rehearsal["tmp"], rehearsal["notebooks"]
    assert not unresolved_glue(nbs["evaluation"]) and not unresolved_glue(nbs["optimisation"])
    for name in ("sample_gamma", "lora_gamma", "pt_gamma", "sample_blockdiag_gamma", "damping_gamma_cola-t5-lora",
                 "damping_gamma_cifar10-mlp"):
        assert (tmp / "fig-eval" / f"{name}.png").stat().st_size > 10_000, name
    for name in ("curves-pt", "curves-lora", "mlp-curves"):
        assert (tmp / "fig-opt" / f"{name}.png").stat().st_size > 10_000, name
    first = pd.read_csv(tmp / "fig-opt" / "ief_first_step.csv")  # iEF's first step redone on the run as trained
    assert set(first.seed) == {0} and first["loss"].notna().all()
