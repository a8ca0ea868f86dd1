"""Configuration, the grid and the inputs of every step (no rules here)."""
import importlib
import math
import re
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

from snakemake.exceptions import WorkflowError

ROOT = Path(workflow.basedir).parent
sys.path.insert(0, str(ROOT))  # tools.book and ief from this checkout

from tools.book import steps as BOOK  # noqa: E402  (the library of build steps)
from tools.book import record as RECORD  # noqa: E402  (the recorded chapters)

SCALE = str(config["scale"])
if SCALE not in BOOK.SCALES:
    raise WorkflowError(f"unknown scale {SCALE!r} (--config scale=...); accepted: {', '.join(BOOK.SCALES)}")
RUNS = str(config["runs"])
PYTHON = sys.executable  # jobs run with the interpreter that runs the workflow (the venv, or PYTHON=...)
RESULTS = f"{config['results']}/{SCALE}"

# One thread per job: every job (and every notebook kernel it starts) inherits this environment.
for _var in BOOK.THREAD_VARIABLES:
    os.environ[_var] = str(config["threads_per_job"])

# An assets folder (config assets=DIR; python -m companion assets download): every job and notebook kernel inherits
# IEF_ASSETS and the hub's offline switches, so the loaders read the folder and never the network. On SLURM each job
# parses this file again on its node, with the same --config, so the variables are set there too.
if config.get("assets"):
    _assets = Path(str(config["assets"])).expanduser().resolve()
    if not _assets.is_dir():
        raise WorkflowError(f"config assets={config['assets']!r} is not a directory; make it with "
                            f"`python -m companion assets download --scale full --to {config['assets']}`")
    os.environ["IEF_ASSETS"] = str(_assets)
    for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ[_var] = "1"


def _registry():
    """companion/experiments/setups.py and the standard-library modules it imports (optimizer_tables.py), loaded
    without the companion's package, whose __init__ imports torch: the grid is defined there, once."""
    name = "_ief_setups_registry"
    if name not in sys.modules:
        package = ModuleType(name)  # a bare package over companion/experiments: its __init__ does not run
        package.__path__ = [str(ROOT / "companion" / "experiments")]
        sys.modules[name] = package
    return importlib.import_module(f"{name}.setups")


REGISTRY = _registry()


def _override(key: str):
    """config ``key`` (None: not overridden) as YAML would read it: Snakemake passes the items of a --config list
    (``seeds=[0]``) and nested values as strings, so ``"0"`` is the number 0 and ``"false"`` the boolean."""

    def value_of(v):
        if isinstance(v, str) and v.lower() in ("true", "false"):
            return v.lower() == "true"
        return int(v) if isinstance(v, str) and v.isdigit() else v

    value = config.get(key)
    return [value_of(v) for v in value] if isinstance(value, list) else value_of(value)


def _grid():
    """The scale's grid (companion.experiments.setups.GRIDS) with config's overrides (setups, seeds, practical)."""
    try:
        grid = REGISTRY.scale_grid(SCALE, setups=_override("setups"), seeds=_override("seeds"),
                                   practical=_override("practical"))
        return grid, REGISTRY.grid_runs(SCALE, grid)
    except ValueError as err:
        raise WorkflowError(f"config (setups, seeds, practical; --config KEY=VALUE): {err}") from None


_GRID, GRID = _grid()
SETUPS, SEEDS = list(_GRID.setups), list(_GRID.seeds)
EVALUATION_SEED = REGISTRY.EVALUATION_SEED


def _one_of(names) -> str:
    """A regular expression matching exactly one of ``names`` (none: one that matches nothing)."""
    return "|".join(re.escape(str(n)) for n in sorted(names, key=len, reverse=True)) or "(?!)"


# Every wildcard matches only what it names, so no rule's output pattern matches another rule's files: without
# these, `{setup}` of eval/{setup}.csv matched eval/digits-mlp.csv.parts/stage-000.csv, and every dry run or rerun
# after a results folder was deleted printed one InputFunctionException per stage checkpoint.
wildcard_constraints:
    setup=_one_of(REGISTRY.SETUPS),
    optimizer=_one_of(REGISTRY.OPTIMIZERS),
    seed=r"\d+",
    stage=r"\d{3}",


# Short runs (config short_runs_together, default true): an MLP setup below full scale trains in seconds, less than
# a job's own start, so one job per (setup, optimiser) trains its seeds one after another (rule train_seeds,
# workflow/rules/train.smk): {the seeds, sorted: [setups]}. Every other setup: one job per run (rule train).
def _short_runs() -> dict[tuple[int, ...], list[str]]:
    if not _override("short_runs_together") or SCALE == "full":
        return {}
    short = [name for name in SETUPS if REGISTRY.resolve(name, SCALE).family == "mlp"]
    groups: dict[tuple[int, ...], list[str]] = {}
    for name in short:
        groups.setdefault(tuple(sorted(_GRID.seeds_of(name))), []).append(name)
    return groups


SHORT_RUNS = _short_runs()
SHORT_SETUPS = [name for setups in SHORT_RUNS.values() for name in setups]
ONE_RUN_SETUPS = _one_of(n for n in REGISTRY.SETUPS if n not in SHORT_SETUPS)


def summary(setup, optimizer, seed):
    return f"{RUNS}/{SCALE}/{setup}/{optimizer}/seed-{seed}/summary.json"


def baseline(setup: str) -> str:
    return REGISTRY.baseline_optimizer(setup, SCALE)


def evaluation_flags(setup: str) -> str:
    """The evaluate job's knobs (companion.experiments.setups.EVALUATION_KNOBS) as command-line flags: the same values the
    library takes by default, stated so that a job's command line (and Snakemake's params trigger) shows them."""
    knobs = REGISTRY.evaluation_knobs(setup, SCALE)
    flags = [f"--batches {int(knobs['batches'])}", f"--cg-iterations {int(knobs['cg_iterations'])}",
             f"--sweep-dampings {int(knobs['sweep_dampings'])}"]
    if knobs["batch_size"]:
        flags.append(f"--batch-size {int(knobs['batch_size'])}")
    if not knobs["sweep"]:
        flags.append("--no-sweep")
    return " ".join(flags)


def eval_stages(setup: str) -> list[int]:
    """The stage checkpoints (percent of training) the runner writes for ``setup`` at this scale."""
    return sorted({round(100 * f) for f in REGISTRY.resolve(setup, SCALE).stage_fractions})


def eval_parts(setup: str) -> list[str]:
    """One evaluation part per stage checkpoint: the outputs of the per-checkpoint evaluate_stage jobs."""
    return [f"{RESULTS}/eval/{setup}.csv.parts/stage-{p:03d}.csv" for p in eval_stages(setup)]


E2_TABLES = [f"{RESULTS}/e2_runs.csv", f"{RESULTS}/e2_curves.csv"]
EVAL_TABLES = [f"{RESULTS}/eval/{setup}.csv" for setup in SETUPS]
# "chapter_run": the grid's run that chapter "Training runs" shows (companion.experiments.setups.TRAIN_CHAPTER_RUN); the
# chapter reads it from the runs folder instead of training it again.
CHAPTER_RUN = [summary(*REGISTRY.TRAIN_CHAPTER_RUN[SCALE])]
# "costs": the practical comparison's seconds per update (python -m companion step-costs; companion.experiments.step_cost
# STEP_COSTS_FILE), measured by a job of its own beside the training runs; a scale without the practical runs has none.
STEP_COSTS = [f"{RESULTS}/step_costs.csv"] if _GRID.practical else []
# "early_spike": iEF's first update on the MLP from scratch redone for the E2 runs (python -m companion early-spike;
# companion.experiments.early_spike), read by chapter E2. "compression": the compression study, one-shot pruning of
# the digits-mlp baseline (python -m companion compression; companion.experiments.compression), read by its chapter.
EARLY_SPIKE = [f"{RESULTS}/early_spike.csv"]
COMPRESSION = [f"{RESULTS}/compression/{name}" for name in ("pruning_results.csv", "pruning_costs.csv", "study.json")]
# the study's baseline run: the grid's digits-mlp Adam run where the book's scale has it (smoke, cpu); a full build
# prunes the cpu baseline, which the compression job trains itself (the train rule makes this scale's runs only)
COMPRESSION_BASELINE = [summary("digits-mlp", "adam", 0)] if SCALE in ("smoke", "cpu") else []
# "blockdiag_check": the evaluation chapter's dense float64 check of the block-diagonal study at one stage checkpoint
# (python -m companion blockdiag-check; companion.experiments.blockdiag_check CHECK_FILES), on the block-diagonal
# figure's setups (companion.experiments.setups.BLOCKDIAG_SETUPS): their evaluation tables and baseline runs. A scale
# without an MLP among them (full: the paper's T5 setups) has no check and no job.
BLOCKDIAG_SETUPS = list(REGISTRY.blockdiag_setups(SCALE))
BLOCKDIAG_CHECK_FILES = [f"{RESULTS}/blockdiag_check.csv", f"{RESULTS}/blockdiag_check.json"]
BLOCKDIAG_CHECK = BLOCKDIAG_CHECK_FILES if REGISTRY.blockdiag_check_setup(SCALE) is not None else []
VERDICTS = [f"{RESULTS}/verdicts.csv", f"{RESULTS}/verdict_pairs.csv"]  # every verdict the book prints, as data
RESULT_FILES = {"e2": E2_TABLES, "eval": EVAL_TABLES, "chapter_run": CHAPTER_RUN, "costs": STEP_COSTS,
                "early_spike": EARLY_SPIKE, "compression": COMPRESSION, "blockdiag_check": BLOCKDIAG_CHECK,
                "verdicts": VERDICTS}
GRID_RUNS = [summary(*run) for run in GRID]
GRID_RESULTS = GRID_RUNS + E2_TABLES + EVAL_TABLES + STEP_COSTS + VERDICTS

# The code a job runs. Training and evaluation run the library (ief/) and the companion's code below its chapters
# (and read the recorded data shipped inside the companion: lr_search/*.json, ...), never the chapters' back-ends
# (plotting, styles, colours: the companion/chapters package), so a plot-only change reruns no training or evaluation
# job. A notebook runs both.
CHAPTER_PACKAGE = ("companion", "chapters")


def _package_files() -> list[Path]:
    return sorted(p for package in ("ief", "companion") for p in (ROOT / package).rglob("*")
                  if p.suffix in (".py", ".json") and p.is_file() and "__pycache__" not in p.parts)


def is_chapter_code(path: Path) -> bool:
    """A file of the chapters' back-ends (companion/chapters: plots, styles, glued sentences)."""
    return path.relative_to(ROOT).parts[:2] == CHAPTER_PACKAGE


# Each rule depends on one digest file of the sources it runs (tools.book.steps.code_digest: rewritten when their
# contents change), not on the ~100 sources themselves, which the scheduler would stat for every pending job on every
# pass. Absolute: a workflow run in another --directory (a test's tmp folder) still finds them.
_DIGESTS = ROOT / ".snakemake" / "code-digests"
_SOURCES = _package_files()
IEF_CODE = str(BOOK.code_digest(_SOURCES, _DIGESTS / "all.sha256"))
CORE_CODE = str(BOOK.code_digest([p for p in _SOURCES if not is_chapter_code(p)], _DIGESTS / "core.sha256"))


# ------------------------------------------------------------------------------------------------ notebooks
NOTEBOOKS = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
for _name in config.get("notebook_results") or {}:
    if _name.removesuffix(".ipynb") not in NOTEBOOKS:
        print(f"[workflow] {_name} is not in notebooks/ (yet): skipped", file=sys.stderr)


def notebook_results(name: str) -> list[str]:
    kinds = (config.get("notebook_results") or {}).get(f"{name}.ipynb", [])
    unknown = [k for k in kinds if k not in RESULT_FILES]
    if unknown:
        raise WorkflowError(f"notebook_results of {name}.ipynb: unknown {unknown}; accepted: {', '.join(RESULT_FILES)}")
    return [f for k in kinds for f in RESULT_FILES[k]]


EXECUTED = f"_build/executed/{SCALE}"
# the recorded chapters (tools/book/record.py): the timings page states their commit and how far behind it is
_RECORD = RECORD.record_dir() / RECORD.MANIFEST
RECORD_MANIFEST = [str(_RECORD.relative_to(ROOT))] if _RECORD.exists() else []
RECORD_BEHIND = (str(RECORD.commits_behind(RECORD.read_manifest()["commit"])) if _RECORD.exists()
                 else "no record")
PUBLISHED = [f"book/generated/{name}.ipynb" for name in NOTEBOOKS]
BOOK_BASE = Path(config["book_output"]) if config.get("book_output") else Path(".")
BOOK_INDEX = str(BOOK_BASE / "_build" / "html" / "index.html")
BOOK_SOURCES = sorted({"_config.yml", "_toc.yml"}
                      | {str(p.relative_to(ROOT)) for p in (ROOT / "book").rglob("*")
                         if p.is_file() and "generated" not in p.relative_to(ROOT / "book").parts
                         and "__pycache__" not in p.parts}
                      # the API page's benchmark tables are rendered from these at build time (book/_ext)
                      | {"benchmarks/report.py", "benchmarks/harness.py"}
                      # the coverage page and the intro's count are rendered from the registry at build time
                      | {"companion/chapters/coverage.py", "companion/paper/labels.json"}
                      | {str(p.relative_to(ROOT)) for p in (ROOT / "benchmarks" / "results").glob("*.json")})


# ------------------------------------------------------------------------------------------------ job order
# Snakemake starts the ready jobs of highest priority first (unset: 0, last); priorities change no result, only the
# order, and so the build's wall time on a few cores. First the runs the evaluation framework reads and its jobs:
# those runs unlock the stage jobs (a minute or more each), which would otherwise all wait for the last training run.
# Then every other job, the transformer setups' runs (a minute or two each) and chapters among them, so that the
# MLP's runs (seconds each) fill the cores at the end, when little else is ready.
PRIORITY = {"first": 3, "normal": 2, "short": 1}


def train_priority(wildcards) -> int:
    """A training job's priority (:data:`PRIORITY`): the evaluated baseline runs, then transformer runs, then MLPs."""
    if wildcards.optimizer == baseline(wildcards.setup) and int(wildcards.seed) == EVALUATION_SEED:
        return PRIORITY["first"]
    return PRIORITY["normal"] if REGISTRY.resolve(wildcards.setup, SCALE).family != "mlp" else PRIORITY["short"]


def seeds_priority(seeds):
    """A train_seeds job's priority, for its seeds: as :func:`train_priority` gives the first run it trains that
    the evaluation reads, or else its setup's runs."""

    def priority(wildcards) -> int:
        first = [s for s in seeds if s == EVALUATION_SEED] or [seeds[0]]
        return train_priority(SimpleNamespace(setup=wildcards.setup, optimizer=wildcards.optimizer, seed=str(first[0])))

    return priority


# -------------------------------------------------------------------------------------------- several GPUs
def _gpus_per_train_job() -> int:
    """config gpus_per_train_job (default 1): the GPUs (and processes) of one training job, checked."""
    value = _override("gpus_per_train_job")
    value = 1 if value is None else value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise WorkflowError(f"gpus_per_train_job must be an integer >= 1, got {config.get('gpus_per_train_job')!r}")
    return value


# N > 1: the runner under torchrun on N processes of one node (companion.experiments.processes: each process takes
# its part of every batch, IEF/EF/SF step exactly as one process on the union batch, rank 0 writes the run folder),
# and the job asks SLURM for N GPUs and N CPUs. --standalone: a rendezvous of its own on the node, so that two jobs
# that share a node do not meet.
GPUS_PER_TRAIN_JOB = _gpus_per_train_job()

# Warm jobs (tools/warm.py): on a local run every `python -m companion ...` job is forked from one server that
# imported torch, scikit-learn, the Hugging Face stack and the companion once (a digits run: ~2 s instead of ~9 s, ~7
# of them imports). The server is started by a local, real run only (onstart: the executor is not known when this
# file is parsed); a cluster's jobs, a dry run's and config warm_jobs=false's run each in its own process, as a job
# whose server is not there does. So the choice changes no result, only the time a job spends importing.
WARM_JOBS = bool(_override("warm_jobs"))
COMPANION = f"{PYTHON} -m tools.warm run --" if WARM_JOBS else f"{PYTHON} -m companion"
TRAIN_LAUNCHER = (COMPANION if GPUS_PER_TRAIN_JOB == 1 else
                  f"{PYTHON} -m torch.distributed.run --standalone --nproc_per_node {GPUS_PER_TRAIN_JOB} -m companion")


# -------------------------------------------------------------------------------------------- SLURM limits
def train_minutes(wildcards) -> int:
    """A training job's time limit (config slurm_time): estimated from the registry's update steps at full scale."""
    spec = config["slurm_time"]
    if SCALE != "full":
        return int(spec["fixed_minutes"][SCALE])
    from companion.experiments.data import FULL_SIZES  # full scale only: imports torch

    cfg = REGISTRY.resolve(wildcards.setup, SCALE)
    train = cfg.sizes["train"] or FULL_SIZES[cfg.task]["train"]
    steps = cfg.epochs * math.ceil(train / cfg.batch_size)
    seconds = steps * spec["seconds_per_step"][f"{cfg.family}-{cfg.method}".replace("bert-", "t5-")]
    if wildcards.optimizer == "sf":
        seconds *= spec["sf_factor"]
    return max(int(spec["min_minutes"]), math.ceil(seconds * spec["margin"] / 60))


_WARM_SERVER = None  # the warm-job server's process (subprocess.Popen), while it runs


def start_warm_jobs() -> None:
    """Before any job runs (a local, real run with warm_jobs): the warm-job server (tools/warm.py), its socket in
    IEF_WARM_SOCKET for every job; it ends with Snakemake (or stop_warm_jobs)."""
    if not WARM_JOBS or not workflow.local_exec or workflow.dryrun:
        return
    import tempfile
    import time

    from tools import warm

    path = os.path.join(tempfile.gettempdir(), f"ief-warm-{os.getuid()}-{os.getpid()}.sock")
    global _WARM_SERVER
    _WARM_SERVER = warm.start(path, os.getpid(), path[:-len(".sock")] + ".log")
    for _ in range(600):  # its imports: ~10 s here; a job that starts before it listens runs on its own
        if os.path.exists(path):
            break
        time.sleep(0.1)
    os.environ[warm.SOCKET_VARIABLE] = path


def stop_warm_jobs() -> None:
    """After the last job: the warm-job server told to stop (it would also stop when Snakemake has gone)."""
    path = os.environ.pop("IEF_WARM_SOCKET", None)
    if path:
        from tools import warm

        warm.stop(path)
        if _WARM_SERVER is not None:  # waited for, so that its jobs' CPU time is Snakemake's children's (the build's)
            _WARM_SERVER.wait(timeout=60)
        log = path[:-len(".sock")] + ".log"
        if os.path.exists(log) and not os.path.getsize(log):  # a log with nothing in it says nothing
            os.unlink(log)


def check_build_tools() -> None:
    """Before any job runs: the tools the book needs that pip does not install (npm, for MathJax, once)."""
    problem = BOOK.missing_build_tools()
    if problem:
        raise WorkflowError(problem)
