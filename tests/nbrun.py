"""Execute a repository notebook with papermill (as ``make book`` does) and return the executed notebook."""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from tools.book.steps import kernel_config, single_threaded

ROOT = Path(__file__).resolve().parents[1]


def run_notebook(name: str, out_dir: Path, /, timeout: int = 600, **parameters):
    """Run ``notebooks/<name>`` with ``parameters`` into ``out_dir``; raises if a cell fails.

    ``name`` and ``out_dir`` are positional-only, so a notebook parameter may itself be called ``out_dir``.

    The kernel is this interpreter's (ipykernel), with the repository on ``PYTHONPATH``, one thread per library and
    local IPC sockets in a directory of its own, as in the book's build (tools/book/steps.py).
    """
    import papermill

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with single_threaded(), kernel_config() as config:
        return papermill.execute_notebook(
            str(ROOT / "notebooks" / name),
            str(out_dir / name),
            parameters=parameters,
            kernel_name="python3",
            cwd=str(ROOT),
            execution_timeout=timeout,
            progress_bar=False,
            stdout_file=sys.stdout,
            config=config,
        )


def unresolved_glue(nb) -> set[str]:
    """The ``{glue:text}`` keys of an executed notebook's markdown that no cell glued (myst-nb's glue records each
    value as an output with ``metadata.scrapbook.name``): each would be an error in the book's build."""
    import re

    text = "".join(c.source for c in nb.cells if c.cell_type == "markdown")
    keys = set(re.findall(r"\{glue:text\}`([^`:]+)", text))
    glued = {o.get("metadata", {}).get("scrapbook", {}).get("name") for c in nb.cells for o in c.get("outputs", [])}
    return keys - glued


def glued_text(nb, key: str) -> str:
    """The plain-text value glued under ``key`` in an executed notebook."""
    import ast

    for c in nb.cells:
        for o in c.get("outputs", []):
            if o.get("metadata", {}).get("scrapbook", {}).get("name") == key:
                data = o.get("data", {})
                raw = data.get("text/plain") or data.get("application/papermill.record/text/plain")
                return ast.literal_eval(raw)
    raise KeyError(key)


def train_grid(runs: Path, scale: str, runs_of, cache: Path | None = None) -> list[tuple[str, str, int]]:
    """Train every ``(setup, optimizer, seed)`` of ``runs_of`` into ``runs`` (what the workflow's ``train`` jobs do
    before a chapter reads their tables; the chapters themselves never train).

    ``cache`` (the ``run_cache`` fixture: one folder per test session, shared by its xdist workers): each run is
    trained once per session, into ``cache``, and copied into ``runs``, so the chapters' tests that read the same grid
    do not train it again each. Where the environment names a runs folder the workflow has just made for this code
    (``IEF_TEST_RUNS``: ``make test`` names the smoke book's, built before the suite), its finished runs are copied
    instead of trained. Workers share the cache through each run folder's lock (the runner's): a worker trains the
    runs no other is training, starting at its own place in the list, then waits for the others' runs."""
    runs_of = list(dict.fromkeys(runs_of))
    if cache is None:
        from companion.experiments import train

        for setup, optimizer, seed in runs_of:
            train(setup, optimizer, seed, scale, runs, progress=False, verbose=False)
        return runs_of
    from companion.experiments import run_dir

    _trained_once(cache, scale, runs_of)
    for setup, optimizer, seed in runs_of:
        made = os.environ.get("IEF_TEST_RUNS") if _workflow_made(setup, optimizer, seed, scale) else cache
        shutil.copytree(run_dir(made, scale, setup, optimizer, seed), run_dir(runs, scale, setup, optimizer, seed),
                        ignore=shutil.ignore_patterns("run.lock"))
    return runs_of


def _workflow_made(setup: str, optimizer: str, seed: int, scale: str) -> bool:
    """Whether ``IEF_TEST_RUNS`` names a runs folder holding this run, finished."""
    from companion.experiments import run_dir

    source = os.environ.get("IEF_TEST_RUNS")
    return bool(source) and (run_dir(source, scale, setup, optimizer, seed) / "summary.json").exists()


def _trained_once(cache: Path, scale: str, runs_of: list) -> None:
    """Train into ``cache`` each run of ``runs_of`` that is not there yet (nor in ``IEF_TEST_RUNS``); xdist workers
    start at different places in the list and leave a run another worker holds (the runner's folder lock) for a second
    pass, which waits for it."""
    from companion.experiments import run_dir, train
    from companion.experiments.runner import RunLocked

    todo = [r for r in runs_of if not _workflow_made(*r, scale)
            and not (run_dir(cache, scale, *r) / "summary.json").exists()]
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    start = len(todo) * worker // max(workers, 1)
    held = []
    for setup, optimizer, seed in todo[start:] + todo[:start]:
        try:
            train(setup, optimizer, seed, scale, cache, progress=False, verbose=False)
        except RunLocked:
            held.append((setup, optimizer, seed))
    for setup, optimizer, seed in held:
        train(setup, optimizer, seed, scale, cache, progress=False, verbose=False, wait_lock=True)
