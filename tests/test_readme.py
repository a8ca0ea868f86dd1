"""The README's Python example runs as written and does what it says (loss falls, gammas are finite)."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_example_is_the_shipped_example():
    """One example, shown in the README and included in the book's API page from examples/quickstart.py."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    shipped = (ROOT / "examples" / "quickstart.py").read_text().split("\n", 1)[1]
    assert blocks and blocks[0] == shipped


def test_readme_example_runs_and_trains():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "the README has no python example"
    out = subprocess.run(
        [sys.executable, "-c", blocks[0]], cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "2"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"L = ([0-9.]+)", out.stdout)]
    assert len(losses) == 3 and losses[-1] < losses[0], out.stdout
    gammas = dict(re.findall(r"gamma\((\w+)\) = ([0-9.eE+-]+)", out.stdout))
    assert set(gammas) == {"SGD", "EF", "iEF"}
    assert all(0 < float(v) < float("inf") for v in gammas.values())
