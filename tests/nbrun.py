"""Execute a repository notebook with papermill (as ``make book`` does) and return the executed notebook."""
from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_notebook(name: str, out_dir: Path, /, timeout: int = 600, **parameters):
    """Run ``notebooks/<name>`` with ``parameters`` into ``out_dir``; raises if a cell fails.

    ``name`` and ``out_dir`` are positional-only, so a notebook parameter may itself be called ``out_dir``.

    The kernel is this interpreter's (ipykernel), with the repository on ``PYTHONPATH``.
    """
    import papermill

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env_path) if p)
    return papermill.execute_notebook(
        str(ROOT / "notebooks" / name),
        str(out_dir / name),
        parameters=parameters,
        kernel_name="python3",
        cwd=str(ROOT),
        execution_timeout=timeout,
        progress_bar=False,
        stdout_file=sys.stdout,
    )
