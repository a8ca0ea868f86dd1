"""The README stays short and true: every command in it runs here (offline, in seconds), its Python example trains,
its links and its figure exist, and what it says of the Hugging Face Trainer holds.

Commands in ```bash blocks are matched against :data:`CHECKS`; a command with no check fails the test, so a new one
comes with its check. ``make book`` and ``make test`` run as Snakemake dry runs of the recipes ``make -n`` prints
(planning the whole grid, running nothing); ``make env TORCH_INDEX=...`` as ``make -n``; the pip line is resolved by
``tests/book/test_install.py`` (``pip install --dry-run`` against a stand-in torch), which reads it from here.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
MAX_LINES = 150


def _bash_commands() -> list[str]:
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README, flags=re.S):
        for line in block.splitlines():
            line = line.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


def pip_target() -> str:
    """The package spec of the README's ``pip install -e ...`` line (``tests/book/test_install.py`` resolves it)."""
    [line] = [c for c in _bash_commands() if c.startswith("pip install")]
    return shlex.split(line)[-1]


def _make_recipe(target: str, *args: str, own_python: bool = True) -> list[str]:
    """What ``make -n target`` would run (with this interpreter as ``PYTHON``, so no venv is built; ``own_python=False``
    for the venv's own recipe)."""
    python = [f"PYTHON={sys.executable}", "CHROMIUM=/bin/sh"] if own_python else []
    # a child of `make test` inherits MAKELEVEL/MAKEFLAGS and would print "Entering directory" lines: run it on its own
    # (and `make test PYTHON=...` exports PYTHON, which would skip the venv's recipe)
    env = {k: v for k, v in os.environ.items()
           if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES", "PYTHON")}
    done = subprocess.run(["make", "--no-print-directory", "-n", target, *python, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    return [line.strip() for line in done.stdout.splitlines() if line.strip()]


def _dry_run_book(recipe_line: str) -> str:
    """A ``python -m tools.book build ...`` recipe line run as a Snakemake dry run: the workflow parses and plans."""
    argv = shlex.split(recipe_line)
    assert argv[1:4] == ["-m", "tools.book", "build"], recipe_line
    with tempfile.TemporaryDirectory() as home:
        done = subprocess.run([*argv, "--", "-n"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                              env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "OMP_NUM_THREADS": "1",
                                   "HOME": home, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    # a plan, or nothing to do where the build is already there (as in CI: `make test` has just built the smoke book)
    assert "This was a dry-run" in done.stdout or "Nothing to be done" in done.stdout, done.stdout[-2000:]
    return done.stdout


def _check_make_book(command: str) -> None:
    assert command == "make book"
    [line] = _make_recipe("book")
    assert "--scale cpu" in line  # the README says cpu is the default
    out = _dry_run_book(line)
    # a fresh checkout plans the training runs; one whose runs are all made plans the rest of the book, or nothing
    assert re.search(r"^(train|book)\s+\d+", out, flags=re.M) or "Nothing to be done" in out, out[-2000:]


def _check_make_test(command: str) -> None:
    assert command == "make test"
    lines = _make_recipe("test")
    assert any(re.search(r"-m pytest .*\btests$", line) for line in lines), lines  # the whole suite
    [book] = [line for line in lines if "tools.book build" in line]
    assert "--scale smoke" in book  # "the smoke-scale book through the same workflow"
    _dry_run_book(book)


def _check_make_env(command: str) -> None:
    argv = shlex.split(command)
    assert argv[:2] == ["make", "env"] and argv[2].startswith("TORCH_INDEX=https://")
    url = argv[2].split("=", 1)[1]
    lines = _make_recipe("env", "VENV=/nonexistent/ief-venv", argv[2], own_python=False)
    assert any("pip install" in line and f"--extra-index-url {url}" in line for line in lines), lines
    assert any("-r requirements/ci.lock" in line for line in lines), lines


def _check_pip(command: str) -> None:
    extras = re.fullmatch(r"\.\[(.*)\]", pip_target()).group(1).split(",")
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(extras) <= set(declared), set(extras) - set(declared)
    import test_install  # the resolution itself: test_install.test_pip_keeps_the_torch_you_installed_first

    assert test_install.TARGET == pip_target()


CHECKS = {
    r"make book": _check_make_book,
    r"make test": _check_make_test,
    r"make env TORCH_INDEX=\S+": _check_make_env,
    r"pip install -e \S+": _check_pip,
}


def test_the_readme_is_short():
    lines = README.count("\n")
    assert lines <= MAX_LINES, f"README.md has {lines} lines (at most {MAX_LINES}): move detail where its reader looks"


@pytest.mark.parametrize("command", _bash_commands())
def test_every_readme_command_runs(command):
    matched = [check for pattern, check in CHECKS.items() if re.fullmatch(pattern, command)]
    assert matched, f"the README's command {command!r} has no check in tests/book/test_readme.py: add one"
    matched[0](command)


def test_the_two_commands_come_first_with_their_measured_times():
    section = README[README.index("## Two commands"):README.index("\n## ", README.index("## Two commands") + 1)]
    assert _bash_commands()[:2] == ["make book", "make test"]
    assert re.search(r"Measured on .* on \d{4}-\d\d-\d\d", section), "times are stated with where and when measured"
    assert "_build/build-log.jsonl" in section and "book/generated/timings.md" in section


def test_links_and_the_figure_exist():
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    assert "book/_static/visual-tour.png" in targets
    missing = [t for t in targets if not t.startswith("http") and not (ROOT / t).exists()]
    assert not missing, missing
    toc = (ROOT / "_toc.yml").read_text()
    for page in re.findall(r"\]\((book/\w+)\.md", README):
        assert f"file: {page}\n" in toc or page == "book/intro", f"{page} is linked but not in the book (_toc.yml)"


def test_what_the_readme_says_of_the_trainer_holds():
    """The Trainer paragraph is true: either it names ``ief.hf.IEFTrainer`` (then that class is exported and every
    ``optimizer="..."`` it shows is accepted), or it says the Trainer cannot drive the optimisers (then ``step()``
    without the batch, what ``Trainer`` calls, refuses, naming the Trainer)."""
    import torch

    import ief

    start = README.index("**With Hugging Face's `Trainer`")
    paragraph = README[start:README.index("\n\n", start)]
    if "ief.hf.IEFTrainer" in paragraph:
        import ief.hf

        assert "IEFTrainer" in ief.hf.__all__
        shown = re.findall(r'optimizer="(\w+)"', paragraph)
        assert shown and set(shown) <= set(ief.hf.OPTIMIZERS), shown
        return
    assert "cannot drive these optimisers" in paragraph, paragraph
    opt = ief.optim.IEF(torch.nn.Linear(3, 2))
    with pytest.raises(TypeError, match="transformers.Trainer"):
        opt.step()


def test_readme_example_is_the_shipped_example():
    """One example, shown in the README and included in the book's API page from examples/quickstart.py."""
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    shipped = (ROOT / "examples" / "quickstart.py").read_text().split("\n", 1)[1]
    assert blocks and blocks[0] == shipped
    assert len(shipped.strip().splitlines()) <= 22, "the quick start stays about 20 lines"


def test_readme_example_runs_and_trains():
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    assert blocks, "the README has no python example"
    out = subprocess.run(
        [sys.executable, "-c", blocks[0]], cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "2"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"L = ([0-9.]+)", out.stdout)]
    assert len(losses) == 3 and losses[-1] < losses[0], out.stdout
    gammas = dict(re.findall(r"gamma\((\w+)\) = ([0-9.eE+-]+)", out.stdout))
    assert set(gammas) == {"SGD", "iEF"}
    assert all(0 < float(v) < float("inf") for v in gammas.values())


def test_readme_trainer_example_continues_the_quick_start_and_trains(tmp_path):
    """The README's second example (the Trainer) runs after the first, as the text says, and its logged loss falls."""
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    assert len(blocks) == 3 and "IEFTrainer(" in blocks[1], "the README shows the quick start, then the Trainer"
    out = subprocess.run(
        [sys.executable, "-c", blocks[0] + "\n" + blocks[1]], cwd=tmp_path, capture_output=True, text=True,
        timeout=600, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1",
                          "OMP_NUM_THREADS": "2", "HOME": str(tmp_path)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    logged = [float(x) for x in re.findall(r"'loss': '([0-9.]+)'", out.stdout + out.stderr)]
    assert len(logged) == 3 and logged[-1] < logged[0], (out.stdout + out.stderr)[-2000:]


def test_readme_pruning_example_runs_after_the_quick_start_and_prunes_at_a_chosen_damping(tmp_path):
    """The README's third example (pruning, damping chosen on held-out data) runs after the quick start as printed,
    prunes half of the LoRA weights and names a damping from the grid it searched."""
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    assert len(blocks) == 3 and "prune_searched(" in blocks[2], "the README's third example is the pruning call"
    check = ("\nimport ief.woodfisher as _wf\n"
             "_kept = sum(int(m.sum()) for m in masks.values()); _all = sum(m.numel() for m in masks.values())\n"
             "assert _kept == _all - round(0.5 * _all), (_kept, _all)\n"
             "assert damping in _wf.DAMPING_GRID, damping\n")
    out = subprocess.run(
        [sys.executable, "-c", blocks[0] + "\n" + blocks[2] + check], cwd=tmp_path, capture_output=True, text=True,
        timeout=600, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1",
                          "OMP_NUM_THREADS": "2", "HOME": str(tmp_path)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"half of the LoRA weights pruned, at the damping held-out data chose: [0-9.e+-]+", out.stdout)


def test_the_chapter_map_marks_what_the_cpu_scale_draws_differently():
    """One column per chapter; the footnotes carry the scale differences (tests/companion/test_chapters_coverage.py
    keeps the block equal to companion/chapters/coverage.py)."""
    block = README[README.index("<!-- coverage:"):README.index("<!-- /coverage -->")]
    assert "| chapter | the paper's figures and tables |" in block and "| smoke |" not in block
    assert "Fig. 9¹" in block and "Fig. 11¹" in block and "Fig. 10²" in block
    assert "Fig. 9 is drawn as Fig. 8" in block and "No cpu analogue: Fig. 10." in block
    assert "Fig. 6³" in block and "Fig. 7³" in block and "Fig. 6 and Fig. 7 redraw Fig. 2's data" in block


def test_readme_torchrun_example_runs_as_printed_and_the_replicas_agree(tmp_path):
    """The README's several-processes line runs as printed (torchrun is torch's ``torch.distributed.run``), on two CPU
    processes: the union batch's loss falls and the replicas end bit-identical."""
    command = re.search(r"`(torchrun --nproc_per_node 2 examples/distributed\.py)`", README)
    assert command, "the README names the torchrun example"
    argv = shlex.split(command.group(1))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", *argv[1:]], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin",
                                                      "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)})
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    losses = [float(x) for x in re.findall(r"L = ([0-9.]+) over 32 samples on 2 processes", done.stdout)]
    assert len(losses) == 5 and losses[-1] < losses[0], done.stdout
    assert "replicas identical: True" in done.stdout
