"""workflow/Snakefile: the plan of the paper's grid through the SLURM profile (dry run), the same grid as
companion.experiments.setups defines, each rule depending on the code it runs (a plot-only change plans no training or
evaluation job), clear errors for a bad configuration, and a real run of a small grid: interrupted, resumed, then a
no-op rebuild that runs no job."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from companion.experiments import setups as registry

ROOT = Path(__file__).resolve().parents[2]
CONFIG = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
NOTEBOOKS = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
SNAKEMAKE = [sys.executable, "-m", "snakemake", "--snakefile", str(ROOT / "workflow" / "Snakefile")]
# a copy of the checkout for tests that edit code (tracked sources only: no environment, builds or results)
COPY_IGNORED = shutil.ignore_patterns(".git", ".venv", "_build", "runs", "results", ".snakemake", "__pycache__",
                                      "generated", ".pytest_cache", "*.egg-info")


def _snakemake(*args: str, directory: Path = ROOT, timeout: int = 300, checkout: Path = ROOT
               ) -> subprocess.CompletedProcess:
    """Snakemake on ``checkout``'s workflow (default this one), in ``directory``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(checkout), os.environ.get("PYTHONPATH")) if p)}
    snakemake = [sys.executable, "-m", "snakemake", "--snakefile", str(checkout / "workflow" / "Snakefile")]
    return subprocess.run([*snakemake, "--directory", str(directory), *args], cwd=checkout,
                          capture_output=True, text=True, timeout=timeout, env=env)


def _job_stats(output: str) -> dict[str, int]:
    """The 'Job stats' table Snakemake prints before running (or planning) anything."""
    stats, inside = {}, False
    for line in output.splitlines():
        if line.startswith("Job stats:"):
            inside = True
            continue
        if inside:
            match = re.match(r"^(\w+)\s+(\d+)$", line.strip())
            if match and match.group(1) != "job":
                stats[match.group(1)] = int(match.group(2))
            elif line.strip().startswith("total"):
                break
    return stats


def _train_runtimes(output: str) -> dict[str, int]:
    """{'setup/optimizer/seed-k': runtime minutes} from a dry run's job blocks."""
    out = {}
    for block in re.split(r"\n(?=(?:local)?rule \w+:)", output):
        if not block.startswith("rule train:"):
            continue
        run = re.search(r"output: runs/full/(\S+)/summary\.json", block).group(1)
        out[run] = int(re.search(r"runtime=(\d+)", block).group(1))
        assert re.search(r"\bgpu=1\b", block), f"{run}: the slurm profile asks one GPU per training job"
    return out


@pytest.fixture(scope="module")
def full_plan() -> subprocess.CompletedProcess:
    done = _snakemake("-n", "--profile", "workflow/profiles/slurm", "--config", "scale=full", "--", "all", "grid")
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def test_full_scale_dry_run_plans_the_paper_grid_through_slurm(full_plan):
    stats = _job_stats(full_plan.stdout + full_plan.stderr)
    assert stats["train"] == 16 * 5 * 3 == 240
    assert stats["evaluate"] == 16 and stats["aggregate_e2"] == 1
    assert stats["evaluate_stage"] == 16 * 5  # one job per stage checkpoint (0, 25, 50, 75, 100 %)
    assert stats["execute_notebook"] == stats["publish"] == len(NOTEBOOKS) and stats["book"] == 1


def test_default_target_plans_what_the_present_notebooks_read():
    """`make book SCALE=full PROFILE=slurm`: the results a notebook reads are planned only for notebooks present."""
    done = _snakemake("-n", "--profile", "workflow/profiles/slurm", "--config", "scale=full")
    assert done.returncode == 0, done.stdout + done.stderr
    stats = _job_stats(done.stdout + done.stderr)
    kinds = {k for name, ks in CONFIG["notebook_results"].items() if name in NOTEBOOKS for k in ks}
    expected_train = 240 if "e2" in kinds else 16 if "eval" in kinds else 0
    assert stats.get("train", 0) == expected_train
    assert stats.get("evaluate", 0) == (16 if "eval" in kinds else 0)
    assert stats.get("evaluate_stage", 0) == (16 * 5 if "eval" in kinds else 0)
    assert stats.get("aggregate_e2", 0) == (1 if "e2" in kinds else 0)
    assert stats["execute_notebook"] == len(NOTEBOOKS) and stats["book"] == 1


def _planned_runs(plan: str, scale: str) -> list[tuple[str, str, int]]:
    """(setup, optimizer, seed) of every run a dry run's jobs train (a train job's one, a train_seeds job's several),
    in the order planned."""
    run = rf"\S*runs/{scale}/([^/\s,]+)/([^/\s,]+)/seed-(\d+)/summary\.json"
    found = [m for line in re.findall(rf"^\s+output: ({run}(?:, {run})*)$", plan, flags=re.M)
             for m in re.findall(run, line[0])]
    return [(setup, opt, int(seed)) for setup, opt, seed in found]


def test_a_short_setups_seeds_are_one_job_per_optimiser(tmp_path):
    """config short_runs_together (default true): the MLP's runs below full scale (seconds each) are one train_seeds
    job per (setup, optimiser) that trains every seed of the grid in turn (``--seeds``), the transformer setups' one
    job per run; false plans one job per run again, the same runs."""
    together = _snakemake("-n", "-p", "--cores", "1", "--config", "scale=cpu", f"runs={tmp_path}/runs", "--", "runs")
    apart = _snakemake("-n", "--cores", "1", "--config", "scale=cpu", "short_runs_together=false",
                       f"runs={tmp_path}/runs", "--", "runs")
    assert together.returncode == apart.returncode == 0, together.stdout + together.stderr + apart.stderr
    assert sorted(_planned_runs(together.stdout, "cpu")) == sorted(_planned_runs(apart.stdout, "cpu"))
    optimizers = registry.grid_optimizers("digits-mlp", "cpu", registry.scale_grid("cpu"))
    seeds = registry.scale_grid("cpu").seeds_of("digits-mlp")
    stats = _job_stats(together.stdout)
    assert stats["train_seeds"] == len(optimizers) and len(seeds) > 3
    assert stats["train"] == len(registry.grid_runs("cpu")) - len(optimizers) * len(seeds)
    assert _job_stats(apart.stdout)["train"] == len(registry.grid_runs("cpu")) and "train_seeds" not in apart.stdout
    blocks = [b for b in re.split(r"\n(?=(?:local)?rule \w+:)", together.stdout) if b.startswith("rule train_seeds:")]
    for block in blocks:
        setup, optimizer = re.search(r"wildcards: scale=cpu, setup=(\S+), optimizer=(\S+)$", block, re.M).groups()
        assert setup == "digits-mlp" and optimizer in optimizers
        assert _planned_runs(block, "cpu") == [(setup, optimizer, seed) for seed in seeds]
        assert f"train --setup digits-mlp --optimizer {optimizer} --seeds {seeds[0]},{seeds[1]}," in block


def test_the_workflow_plans_the_grid_of_the_setup_registry(full_plan, tmp_path):
    """The grid is defined once (companion.experiments.setups): every scale's dry run plans exactly its runs, a seeds
    override replaces the seeds, and config/config.yaml keeps no copy of the grid."""
    assert sorted(_planned_runs(full_plan.stdout + full_plan.stderr, "full")) == sorted(registry.grid_runs("full"))
    for scale in ("cpu", "smoke"):
        done = _snakemake("-n", "--cores", "1", "--config", f"scale={scale}", f"runs={tmp_path}/runs", "--", "runs")
        assert done.returncode == 0, done.stdout + done.stderr
        assert sorted(_planned_runs(done.stdout, scale)) == sorted(registry.grid_runs(scale)), scale
    done = _snakemake("-n", "--cores", "1", "--config", "scale=cpu", "seeds=[4]", f"runs={tmp_path}/runs", "--", "runs")
    assert done.returncode == 0, done.stdout + done.stderr
    grid = registry.scale_grid("cpu", seeds=[4])
    assert sorted(_planned_runs(done.stdout, "cpu")) == sorted(registry.grid_runs("cpu", grid))
    assert not {"grid", "optimizers", "practical_optimizers", "baseline", "evaluation", "evaluation_seed"} & set(CONFIG)
    assert CONFIG["seeds"] is CONFIG["setups"] is CONFIG["practical"] is None  # overrides only


def test_dry_runs_print_no_exception(full_plan):
    """No output pattern matches another rule's files (wildcard constraints, workflow/rules/common.smk): planning
    the paper's grid used to print one InputFunctionException per stage checkpoint (80)."""
    assert "Exception" not in full_plan.stdout + full_plan.stderr


def _priorities(plan: str) -> list[tuple[str, str, int]]:
    """(rule, wildcards, priority) of every job of a dry run (Snakemake prints a priority only where it is not 0)."""
    jobs = []
    for block in re.split(r"\n(?=(?:local)?rule \w+:)", plan):
        rule = re.match(r"(?:local)?rule (\w+):", block)
        if rule:
            wildcards = re.search(r"^\s+wildcards: (.+)$", block, flags=re.M)
            priority = re.search(r"^\s+priority: (-?\d+)$", block, flags=re.M)
            jobs.append((rule.group(1), wildcards.group(1) if wildcards else "",
                         int(priority.group(1)) if priority else 0))
    return jobs


def test_jobs_that_unlock_the_evaluation_start_first_and_the_mlp_runs_fill_in_last(tmp_path):
    """The order of a local build (workflow/rules/common.smk, PRIORITY): the evaluated baseline runs and the
    evaluation's jobs before every other job, the MLP's runs (seconds each) after every other training run, and no
    job but the `all` target left at Snakemake's default 0 (which would hold it back until nothing else is ready)."""
    done = _snakemake("-n", "--cores", "2", "--config", "scale=cpu", f"runs={tmp_path}/runs",
                      f"results={tmp_path}/results")
    assert done.returncode == 0, done.stdout + done.stderr
    jobs = _priorities(done.stdout)
    first = {(r, w) for r, w, p in jobs if p == max(p for _, _, p in jobs)}
    evaluated = {("train", f"scale=cpu, setup={s}, optimizer={registry.baseline_optimizer(s, 'cpu')}, "
                           f"seed={registry.EVALUATION_SEED}") for s in registry.CPU_SETUPS if s != "digits-mlp"}
    evaluated.add(("train_seeds", "scale=cpu, setup=digits-mlp, "
                                  f"optimizer={registry.baseline_optimizer('digits-mlp')}"))
    assert first == evaluated | {(r, w) for r, w, _ in jobs if r in ("evaluate_stage", "evaluate")}
    train = {w: p for r, w, p in jobs if r.startswith("train") and (r, w) not in evaluated}
    mlp = {p for w, p in train.items() if "setup=digits-mlp" in w}
    assert len(train) == len({w for r, w, _ in jobs if r.startswith("train")}) - 3 and len(mlp) == 1
    assert max(mlp) < min(p for w, p in train.items() if "setup=digits-mlp" not in w)
    assert [r for r, _, p in jobs if p <= 0] == ["all"]


def test_the_practical_chapters_cost_table_is_a_job_of_its_own(tmp_path):
    """The chapter's seconds per update are measured by the step_costs job beside the training (it needs no run), to
    the file the chapter reads (companion.experiments.step_cost.STEP_COSTS_FILE); a scale without practical runs has
    none."""
    from companion.experiments.step_cost import STEP_COSTS_FILE

    done = _snakemake("-n", "--cores", "2", "--config", "scale=cpu", f"runs={tmp_path}/runs",
                      f"results={tmp_path}/results")
    assert done.returncode == 0, done.stdout + done.stderr
    (block,) = [b for b in re.split(r"\n(?=(?:local)?rule \w+:)", done.stdout) if b.startswith("rule step_costs:")]
    assert re.search(rf"output: {re.escape(str(tmp_path))}/results/cpu/{STEP_COSTS_FILE}$", block, flags=re.M)
    assert not re.search(r"input: .*summary\.json", block)  # no training run: it starts at once
    practical = [b for b in re.split(r"\n(?=(?:local)?rule \w+:)", done.stdout)
                 if b.startswith("rule execute_notebook:") and "wildcards: name=practical" in b]
    assert len(practical) == 1 and f"results/cpu/{STEP_COSTS_FILE}" in practical[0]
    full = _snakemake("-n", "--cores", "1", "--config", "scale=full", f"runs={tmp_path}/runs",
                      f"results={tmp_path}/results")
    assert full.returncode == 0 and "rule step_costs:" not in full.stdout


def test_the_compression_study_and_the_early_spike_are_jobs_the_chapters_read(tmp_path):
    """The chapters only read: the compression study (on the grid's digits-mlp Adam run) and iEF's first update
    redone (on the aggregated E2 runs) are jobs of their own, and their tables inputs of the chapters that show them."""
    done = _snakemake("-n", "--cores", "2", "--config", "scale=smoke", f"runs={tmp_path}/runs",
                      f"results={tmp_path}/results")
    assert done.returncode == 0, done.stdout + done.stderr
    blocks = re.split(r"\n(?=(?:local)?rule \w+:)", done.stdout)
    (compression,) = [b for b in blocks if b.startswith("rule compression:")]
    assert "runs/smoke/digits-mlp/adam/seed-0/summary.json" in compression
    assert "results/smoke/compression/study.json" in compression
    (spike,) = [b for b in blocks if b.startswith("rule early_spike:")]
    assert "results/smoke/e2_runs.csv" in spike and "results/smoke/early_spike.csv" in spike
    for name, table in (("compression", "compression/pruning_results.csv"), ("optimisation", "early_spike.csv")):
        (chapter,) = [b for b in blocks if b.startswith("rule execute_notebook:") and f"wildcards: name={name}" in b]
        assert f"results/smoke/{table}" in chapter, name


def test_the_evaluation_chapters_dense_check_is_a_job_the_chapter_reads(tmp_path):
    """The evaluation chapter only reads: its dense float64 check of the block-diagonal study is the blockdiag_check
    job, on the evaluation tables and baseline runs of the block-diagonal figure's setups
    (companion.experiments.setups.BLOCKDIAG_SETUPS), and its table an input of the chapter; at full scale (no MLP
    among those setups) there is no check and no job."""
    from companion.experiments.setups import BLOCKDIAG_SETUPS, baseline_optimizer

    done = _snakemake("-n", "--cores", "2", "--config", "scale=smoke", f"runs={tmp_path}/runs",
                      f"results={tmp_path}/results")
    assert done.returncode == 0, done.stdout + done.stderr
    blocks = re.split(r"\n(?=(?:local)?rule \w+:)", done.stdout)
    (check,) = [b for b in blocks if b.startswith("rule blockdiag_check:")]
    for setup in BLOCKDIAG_SETUPS["smoke"]:
        assert f"results/smoke/eval/{setup}.csv" in check, setup
        assert f"runs/smoke/{setup}/{baseline_optimizer(setup, 'smoke')}/seed-0/summary.json" in check, setup
    assert "results/smoke/blockdiag_check.csv" in check and "results/smoke/blockdiag_check.json" in check
    (chapter,) = [b for b in blocks if b.startswith("rule execute_notebook:") and "wildcards: name=evaluation" in b]
    assert "results/smoke/blockdiag_check.csv" in chapter and "results/smoke/blockdiag_check.json" in chapter
    full = _snakemake("-n", "--cores", "1", "--config", "scale=full", f"runs={tmp_path}/runs",
                      f"results={tmp_path}/results")
    assert full.returncode == 0 and "rule blockdiag_check:" not in full.stdout


def _outputs(plan: str) -> list[Path]:
    """Every output file of a dry run's jobs."""
    return [Path(f.strip()) for line in re.findall(r"^\s+output: (.+)$", plan, flags=re.M) for f in line.split(",")]


@pytest.mark.parametrize("profile", ["default", "slurm"])
def test_deleting_a_results_folder_replans_it_without_exceptions(tmp_path, profile):
    """The smoke grid's files made (empty, all of one mtime) from a dry run's plan; then each results folder deleted
    in turn (the evaluation tables, their per-stage parts, all of results/smoke): the dry run plans exactly the
    deleted files' jobs again, and prints no exception (`rm -rf results/smoke/eval` once printed 15)."""
    args = ["-n", "--profile", f"workflow/profiles/{profile}", "--config", "scale=smoke", f"runs={tmp_path}/runs",
            f"results={tmp_path}/results", "--", "grid"]
    first = _snakemake(*args)
    plan = first.stdout + first.stderr
    assert first.returncode == 0 and "Exception" not in plan, plan[-3000:]
    planned = _job_stats(plan)
    outputs = _outputs(plan)
    jobs = sum(n for job, n in planned.items() if job not in ("grid", "total"))
    seeds_jobs = planned.get("train_seeds", 0)  # each trains every seed of its setup: one output per seed
    extra = seeds_jobs * (len(registry.scale_grid("smoke").seeds_of("digits-mlp")) - 1)
    assert len(outputs) == jobs + 2 + extra  # e2 and verdicts: 2 files each
    stamp = time.time()  # newer than the package code and its digest (the dry run above wrote it), the same for
    # every file: nothing out of date
    for path in outputs:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
        os.utime(path, (stamp, stamp))
    assert "Nothing to be done" in (lambda d: d.stdout + d.stderr)(_snakemake(*args))

    results = tmp_path / "results" / "smoke"
    evaluate_stage, evaluate = planned["evaluate_stage"], planned["evaluate"]
    cases = [
        # verdicts.csv reads the evaluation and E2 tables: it is planned again with either
        (list((results / "eval").glob("*.csv")), {"evaluate": evaluate, "verdicts": 1}),
        ([results / "eval"], {"evaluate_stage": evaluate_stage, "evaluate": evaluate, "verdicts": 1}),
        ([results], {"evaluate_stage": evaluate_stage, "evaluate": evaluate, "aggregate_e2": 1, "step_costs": 1,
                     "verdicts": 1}),
    ]
    for deleted, expected in cases if profile == "default" else cases[1:2]:  # slurm: the case seen (CI time)
        for path in deleted:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        again = _snakemake(*args)
        output = again.stdout + again.stderr
        assert again.returncode == 0, output[-3000:]
        assert "Exception" not in output, output[-3000:]
        stats = {k: v for k, v in _job_stats(output).items() if k not in ("grid", "total")}
        assert stats == expected, output[-3000:]


def _chapter_module(checkout: Path) -> Path:
    """A chapter back-end of the checkout (a module of companion/chapters)."""
    modules = sorted(m for m in (checkout / "companion" / "chapters").glob("*.py") if m.name != "__init__.py")
    assert modules, "no chapter back-end in companion/chapters"
    return modules[0]


def _edit(path: Path, stamp: float) -> None:
    """A change of ``path``'s content, newer than ``stamp``."""
    path.write_text(path.read_text() + "\n# an edit\n")
    os.utime(path, (stamp + 30, stamp + 30))


def _planned(done: subprocess.CompletedProcess) -> dict[str, int]:
    output = done.stdout + done.stderr
    assert done.returncode == 0 and "Exception" not in output, output[-3000:]
    return {k: v for k, v in _job_stats(output).items() if k != "total"}


def test_the_code_digest_follows_contents_not_touches(tmp_path):
    """The one file each rule depends on in place of the sources: first written with the sources' newest time (a
    build made from them stays up to date), unchanged by a touch, rewritten now by an edit or a deletion."""
    from tools.book.steps import code_digest

    sources = [tmp_path / "a.py", tmp_path / "b.py"]
    for k, source in enumerate(sources):
        source.write_text(f"x = {k}\n")
        os.utime(source, (1_000_000 + k, 1_000_000 + k))
    digest = code_digest(sources, tmp_path / "digests" / "core.sha256", root=tmp_path)
    first = digest.read_text()
    assert digest.stat().st_mtime == 1_000_001 and len(first.strip()) == 64
    os.utime(sources[0])
    assert code_digest(sources, digest, root=tmp_path).stat().st_mtime == 1_000_001 and digest.read_text() == first
    before = time.time() - 1
    sources[1].write_text("x = 2\n")
    os.utime(sources[1], (1_000_001, 1_000_001))  # an edit that keeps the old time still counts
    edited = code_digest(sources, digest, root=tmp_path).read_text()
    assert edited != first and digest.stat().st_mtime >= before
    os.utime(digest, (1_000_001, 1_000_001))
    assert code_digest(sources[1:], digest, root=tmp_path).read_text() not in (first, edited)
    assert digest.stat().st_mtime >= before


def test_each_rule_depends_on_the_code_it_runs(tmp_path):
    """Training and evaluation depend on the core and experiments code only, the notebooks on the chapter back-ends
    too: on a copy of the checkout with the smoke book made (every output newer than every source), a
    plot-only edit (a chapter module, the style module) plans the notebooks and the book and no training or evaluation
    job; a core edit plans the whole grid again."""
    checkout = tmp_path / "checkout"
    shutil.copytree(ROOT, checkout, ignore=COPY_IGNORED)
    stamp = time.time() - 600
    for path in checkout.rglob("*"):
        os.utime(path, (stamp - 60, stamp - 60), follow_symlinks=False)
    args = ["-n", "--profile", "workflow/profiles/default", "--config", "scale=smoke", "--", "all"]
    first = _snakemake(*args, directory=checkout, checkout=checkout)
    plan = _planned(first)
    notebooks = len(list((checkout / "notebooks").glob("*.ipynb")))
    # every job that computes (the chapters only read its tables): the grid's runs and tables, the early spike's
    # first updates, the compression study and the evaluation chapter's dense check
    short = len(registry.grid_optimizers("digits-mlp", "smoke"))  # the MLP's runs: one train_seeds job per optimiser
    seeds = len(registry.scale_grid("smoke").seeds_of("digits-mlp"))
    grid = {"train": len(registry.grid_runs("smoke")) - short * seeds, "train_seeds": short, "aggregate_e2": 1,
            "evaluate_stage": 3 * 5, "evaluate": 3,
            "step_costs": 1, "early_spike": 1, "compression": 1, "blockdiag_check": 1, "verdicts": 1}
    book = {"execute_notebook": notebooks, "publish": notebooks, "timings": 1, "book": 1, "all": 1}
    assert plan == {**grid, **book, "mathjax": 1}, first.stdout[-3000:]
    for path in _outputs(first.stdout + first.stderr):
        path = checkout / path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
        os.utime(path, (stamp, stamp))
    assert "Nothing to be done" in (lambda d: d.stdout + d.stderr)(_snakemake(*args, directory=checkout,
                                                                               checkout=checkout))

    chapter = _chapter_module(checkout)
    style = next((checkout / "companion").rglob("style.py"))
    for edited in (chapter, style):
        before = edited.read_text()
        _edit(edited, stamp)
        after_plot_edit = _snakemake(*args, directory=checkout, checkout=checkout)
        assert _planned(after_plot_edit) == book, (edited, after_plot_edit.stdout[-3000:])
        edited.write_text(before)
        os.utime(edited, (stamp - 60, stamp - 60))
    _edit(checkout / "ief" / "curvature.py", stamp)
    after_core_edit = _snakemake(*args, directory=checkout, checkout=checkout)
    assert _planned(after_core_edit) == {**grid, **book}, after_core_edit.stdout[-3000:]


def test_slurm_time_limits_follow_the_registry(full_plan):
    runtimes = _train_runtimes(full_plan.stdout + full_plan.stderr)
    assert len(runtimes) == 240
    spec = CONFIG["slurm_time"]
    assert min(runtimes.values()) >= spec["min_minutes"]
    # more update steps -> a longer limit (qqp: 363,846 examples x 5 epochs; rte: 2,490 x 40), SF slower than iEF
    assert runtimes["qqp-t5-lora/ief/seed-0"] > runtimes["rte-t5-lora/ief/seed-0"]
    assert runtimes["qqp-t5-lora/sf/seed-0"] > runtimes["qqp-t5-lora/ief/seed-0"]
    assert runtimes["qqp-t5-lora/ief/seed-0"] == runtimes["qqp-t5-lora/ief/seed-2"]
    # the paper's own figure: QQP + LoRA took 20 hours on an A100 (sec:app-exp-details); the limit leaves a margin
    assert 20 * 60 <= runtimes["qqp-t5-lora/adamw/seed-0"] <= 20 * 60 * 2


@pytest.mark.parametrize("config, message", [
    (["scale=huge"], "unknown scale 'huge'"),
    (["scale=smoke", "setups=[no-such-setup]"], "unknown setup 'no-such-setup'"),
    (["scale=cpu", "setups=[rte-t5-lora]"], "setup 'rte-t5-lora' has no 'cpu' scale"),
    (["scale=smoke", "practical=maybe"], "practical must be true or false, got 'maybe'"),
    (["scale=smoke", "seeds=[-1]"], "seeds must be a non-empty list of non-negative integers, got ['-1']"),
])
def test_bad_configuration_is_refused_by_name(config, message):
    done = _snakemake("-n", "--cores", "1", "--config", *config)
    assert done.returncode != 0
    assert message in done.stdout + done.stderr


def _summaries(runs: Path) -> dict[Path, float]:
    return {p: p.stat().st_mtime for p in runs.rglob("summary.json")}


@pytest.mark.slow
def test_interrupted_grid_resumes_and_a_rebuild_runs_nothing(tmp_path):
    """A small real grid (digits-mlp at smoke scale, 5 optimisers): SIGINT after the first run finished, then the
    same command runs only the unfinished runs, then a third invocation runs 0 jobs within 30 s."""
    # the five E2 optimisers, a job per run (the MLP's seeds are otherwise one job per optimiser)
    grid = ["setups=[digits-mlp]", "seeds=[0]", "practical=false", "short_runs_together=false"]
    args = ["--profile", str(ROOT / "workflow" / "profiles" / "default"), "--cores", "1", "--config", "scale=smoke",
            *grid, "--", "runs"]
    runs = tmp_path / "runs"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # SIGINT back to its default in the child: a test run started in the background by a non-interactive shell
    # (`cmd &`, as some CI runners do) inherits SIGINT ignored, and Python then never installs its Ctrl-C handler
    proc = subprocess.Popen([*SNAKEMAKE, "--directory", str(tmp_path), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines = []
    for line in proc.stdout:  # Ctrl-C once Snakemake has registered the first finished run
        lines.append(line)
        if re.match(r"Finished jobid: \d+ \(Rule: train\)", line):
            break
    # Ctrl-C, pressed again every 2 s until Snakemake stops, as a user would: Snakemake can miss a SIGINT that
    # arrives while it selects the next jobs, and a smoke run takes a few seconds (seen: all five finished after one)
    for _ in range(90):
        proc.send_signal(signal.SIGINT)
        try:
            lines.append(proc.communicate(timeout=2)[0])
            break
        except subprocess.TimeoutExpired:
            continue
    else:
        proc.kill()
        lines.append(proc.communicate(timeout=60)[0])
    first_output = "".join(lines)
    registered = len(re.findall(r"Finished jobid: \d+ \(Rule: train\)", first_output))
    finished = _summaries(runs)
    assert 1 <= registered <= len(finished) < 5, first_output[-3000:]
    assert proc.returncode != 0

    resumed = _snakemake(*args, directory=tmp_path)
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output[-3000:]
    assert _job_stats(output).get("train") == 5 - registered, output[-3000:]
    after = _summaries(runs)
    assert len(after) == 5
    kept = [p for p, m in finished.items() if after[p] == m]
    assert len(kept) == registered, "a run Snakemake had registered as finished was recomputed"

    start = time.time()
    again = _snakemake(*args, directory=tmp_path)
    took = time.time() - start
    assert again.returncode == 0
    assert "Nothing to be done" in again.stdout + again.stderr
    assert _summaries(runs) == after
    assert took <= 30, f"a no-op rebuild took {took:.0f} s"


def test_a_training_job_can_have_several_gpus_through_torchrun(tmp_path):
    """config gpus_per_train_job=N: the train rule runs the runner under torchrun on N processes of one node and the
    SLURM profile asks for N GPUs and N CPUs; the default is the plain command with one GPU; a bad N is refused."""
    def plan(*config: str) -> list[str]:
        done = _snakemake("-n", "-p", "--profile", "workflow/profiles/slurm", "--config", "scale=smoke",
                          "setups=[digits-mlp]", "seeds=[0]", f"runs={tmp_path}/runs", *config, "--", "runs")
        assert done.returncode == 0, done.stdout + done.stderr
        blocks = [b for b in re.split(r"\n(?=(?:local)?rule \w+:)", done.stdout)
                  if re.match(r"rule train(?:_seeds)?:", b)]  # a run's job, or an MLP's seeds' job
        assert blocks, done.stdout
        return blocks

    for block in plan():
        assert re.search(r"\bgpu=1\b", block) and re.search(r"\bcpus_per_task=1\b", block), block
        # one process: the companion's command, through the warm-job client (tools/warm.py: a cluster's job finds no
        # server and runs the command itself)
        assert re.search(r"\S+python\S* -m (?:companion|tools\.warm run --) train ", block), block
        assert "torch.distributed.run" not in block, block
    for block in plan("gpus_per_train_job=4"):
        assert re.search(r"\bgpu=4\b", block) and re.search(r"\bcpus_per_task=4\b", block), block
        assert " -m torch.distributed.run --standalone --nproc_per_node 4 -m companion train --setup digits-mlp " \
            in block, block
    done = _snakemake("-n", "--cores", "1", "--config", "scale=smoke", "gpus_per_train_job=0")
    assert done.returncode != 0 and "gpus_per_train_job must be an integer >= 1, got 0" in done.stdout + done.stderr
