"""Execute a repository notebook with papermill (as ``make book`` does) and return the executed notebook."""
from __future__ import annotations

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


def train_grid(runs: Path, scale: str, runs_of) -> list[tuple[str, str, int]]:
    """Train every ``(setup, optimizer, seed)`` of ``runs_of`` into ``runs`` (what the workflow's ``train`` jobs do
    before a chapter reads their tables; the chapters themselves never train)."""
    from companion.experiments import train

    runs_of = list(runs_of)
    for setup, optimizer, seed in runs_of:
        train(setup, optimizer, seed, scale, runs, progress=False, verbose=False)
    return runs_of
