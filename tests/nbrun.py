"""Execute a repository notebook with papermill (as ``make book`` does) and return the executed notebook."""
from __future__ import annotations

import sys
from pathlib import Path

from tools.book import kernel_config, single_threaded

ROOT = Path(__file__).resolve().parents[1]


def run_notebook(name: str, out_dir: Path, /, timeout: int = 600, **parameters):
    """Run ``notebooks/<name>`` with ``parameters`` into ``out_dir``; raises if a cell fails.

    ``name`` and ``out_dir`` are positional-only, so a notebook parameter may itself be called ``out_dir``.

    The kernel is this interpreter's (ipykernel), with the repository on ``PYTHONPATH``, one thread per library and
    local IPC sockets, as in the book's build (tools/book.py).
    """
    import papermill

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with single_threaded():
        return papermill.execute_notebook(
            str(ROOT / "notebooks" / name),
            str(out_dir / name),
            parameters=parameters,
            kernel_name="python3",
            cwd=str(ROOT),
            execution_timeout=timeout,
            progress_bar=False,
            stdout_file=sys.stdout,
            config=kernel_config(),
        )
