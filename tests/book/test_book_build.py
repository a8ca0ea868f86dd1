"""tools/book, the book's builder (steps, driver, command line): a notebook executes single-threaded with its
provenance, a failing one stops the build naming the notebook and the cell, the timings page shows builds measured by
the build itself, and a missing npm is reported before anything runs. (Up-to-dateness is Snakemake's:
tests/book/test_workflow.py.)"""
import json
import os

import nbformat
import pytest

from tools.book import cli, driver, job_clock, steps


def _notebook(path, body: str):
    nb = nbformat.v4.new_notebook()
    params = nbformat.v4.new_code_cell('scale = "cpu"\nout_dir = "x"')
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params, nbformat.v4.new_code_cell("x = 1"), nbformat.v4.new_code_cell(body)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


def test_execute_records_provenance_single_threaded_and_quietly(tmp_path, capfd, monkeypatch):
    """One thread per kernel, the result files read recorded with their hashes, a progress line per slow cell,
    and no "Kernel is running over TCP without encryption" (the kernel talks over local IPC sockets)."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    body = "import os, time\ntime.sleep(2.2)\nprint('threads', os.environ['OMP_NUM_THREADS'])"
    nb = _notebook(tmp_path / "ok.ipynb", body)
    table = tmp_path / "table.csv"
    table.write_text("a,b\n1,2\n")
    executed, record = steps.execute(nb, "smoke", executed_root=tmp_path / "exec", results=[table])
    assert executed.exists() and record["scale"] == "smoke" and record["parameters"]["scale"] == "smoke"
    assert {"git_commit", "packages", "wall_time_s", "finished"} <= set(record)
    assert list(record["results"].values()) == [steps._sha256(table)]
    assert json.loads((tmp_path / "exec" / "smoke" / "ok.provenance.json").read_text()) == record
    outputs = nbformat.read(executed, as_version=4).cells[-1].outputs
    assert "threads 1" in "".join(o.get("text", "") for o in outputs)
    console = capfd.readouterr()
    assert "without encryption" not in console.out + console.err
    assert "ok.ipynb: cell 4/4 took" in console.out  # the sleeping cell (after papermill's injected parameters)
    published = steps.publish(executed, record, generated=tmp_path / "generated")
    text = published.read_text()
    assert "## Provenance" in text and "table.csv" in text and steps._sha256(table) in text


def test_kernels_started_at_once_get_sockets_of_their_own():
    """Two notebooks started at once in separate processes each write their kernel's connection before either
    kernel binds its sockets; with a shared IPC prefix both chose ``kernel-ipc-1`` ... ``-5`` and one client read the
    other kernel's messages ("Invalid Signature", a failed start in CI). Each kernel's sockets are its own, and go
    with it."""
    from jupyter_client.manager import KernelManager

    names = ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")
    with steps.kernel_config() as first, steps.kernel_config() as second:
        managers = [KernelManager(kernel_name="python3", config=c) for c in (first, second)]
        for km in managers:
            km.write_connection_file()
        try:
            sockets = [{f"{km.ip}-{km.get_connection_info()[n]}" for n in names} for km in managers]
            assert all(km.transport == "ipc" and os.path.isabs(km.ip) for km in managers)
            assert not sockets[0] & sockets[1]
            folders = [os.path.dirname(km.ip) for km in managers]
        finally:
            for km in managers:
                km.cleanup_connection_file()
    assert not any(os.path.exists(f) for f in folders)


def test_timings_page_shows_the_builds_measured_by_the_build(tmp_path):
    log = tmp_path / "build-log.jsonl"
    entries = [
        {"scale": "smoke", "kind": "cold", "returncode": 0, "wall_time_s": 150.2, "jobs": {"book": 1},
         "finished": "2026-01-01 00:00:00 UTC"},
        {"scale": "smoke", "kind": "no-op", "returncode": 0, "wall_time_s": 9.1, "jobs": {},
         "finished": "2026-01-01 00:05:00 UTC"},
        {"scale": "smoke", "kind": "no-op", "returncode": 1, "wall_time_s": 1.0, "jobs": {},
         "finished": "2026-01-01 00:06:00 UTC"},  # failed builds are not shown
    ]
    log.write_text("\n".join(json.dumps(e) for e in entries) + "\n")
    text = steps.timings_table(executed_root=tmp_path / "none", build_log=log)
    assert "| `smoke` | cold build" in text and "2 min 30 s" in text
    assert "| `smoke` | no-op rebuild" in text and "| 9 s |" in text and "00:06:00" not in text
    assert "Where those cold builds' time went" not in text  # an entry from before job times were logged
    entries[0].update(job_seconds={"train": 200.0, "book": 20.0, "publish": 0.2}, cores=2)
    log.write_text("\n".join(json.dumps(e) for e in entries) + "\n")
    text = steps.timings_table(executed_root=tmp_path / "none", build_log=log)
    assert ("jobs took 3 min 40 s in all (train 3 min 20 s, book 20 s) in 2 min 30 s of wall time; 1.47 of its 2 "
            "cores busy on average.") in text


def test_job_clock_sums_each_rules_jobs_from_snakemakes_output():
    """Snakemake's start and finish lines, two jobs at once: each job's time summed by rule."""
    output = """[Wed Nov 25 00:15:36 2026]
localrule train:
    output: runs/a/summary.json
    jobid: 10
    wildcards: setup=a
[Wed Nov 25 00:15:36 2026]
rule train:
    jobid: 24
[Wed Nov 25 00:15:41 2026]
Finished jobid: 10 (Rule: train)
[Wed Nov 25 00:15:41 2026]
localrule evaluate_stage:
    jobid: 13
[Wed Nov 25 00:15:50 2026]
Finished jobid: 24 (Rule: train)
[Wed Nov 25 00:16:02 2026]
Finished jobid: 13 (Rule: evaluate_stage)
[Wed Nov 25 00:16:02 2026]
localrule all:
    jobid: 0
[Wed Nov 25 00:16:02 2026]
Finished jobid: 0 (Rule: all)
"""
    clock = job_clock.JobClock()
    for line in output.splitlines(keepends=True):
        clock.line(line)
    assert clock.seconds() == {"evaluate_stage": 21.0, "train": 19.0}


def test_missing_npm_is_reported_before_anything_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(steps, "MATHJAX_ENTRY", tmp_path / "absent.js")
    monkeypatch.setenv("PATH", str(tmp_path))  # no npm on PATH
    assert "apt-get install npm" in steps.missing_build_tools()
    assert driver.build("smoke", log=tmp_path / "log.jsonl") == 1
    assert "FAILED before running anything" in capsys.readouterr().out
    assert not (tmp_path / "log.jsonl").exists()


def test_failing_notebook_names_notebook_and_cell(tmp_path):
    nb = _notebook(tmp_path / "broken.ipynb", "raise RuntimeError('deliberate failure')")
    with pytest.raises(steps.NotebookFailed) as err:
        steps.execute(nb, "smoke", executed_root=tmp_path / "exec")
    message = str(err.value)
    assert "broken.ipynb" in message and "cell index 2" in message and "deliberate failure" in message
    assert not (tmp_path / "exec" / "smoke" / "broken.ipynb").exists()  # no executed copy of a failed run


def test_unknown_scale_is_refused(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--scale", "huge"])
    assert "smoke, cpu, full" in capsys.readouterr().err


def test_every_notebook_has_a_chapter_and_stays_output_free():
    """One chapter per notebook (the book renders its executed copy), and sources are stored without outputs."""
    import yaml

    toc = yaml.safe_load((steps.ROOT / "_toc.yml").read_text())
    chapters = {c["file"] for part in toc.get("parts", []) for c in part.get("chapters", [])}
    for path in sorted(steps.NOTEBOOKS.glob("*.ipynb")):
        assert f"book/generated/{path.stem}" in chapters, f"{path.name} has no chapter in _toc.yml"
        nb = nbformat.read(path, as_version=4)
        dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
        assert not dirty, f"{path.name} is stored with outputs in cells {dirty}"
        tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
        assert len(tagged) == 1 and "scale" in tagged[0].source, f"{path.name}: one 'parameters' cell with scale"


def test_readme_states_build_times_as_dated_measurements():
    """Build times come from the build (book/generated/timings.md, _build/build-log.jsonl); the README's are stated
    with the machine and the date they were measured on, so a stale one reads as what it is."""
    readme = (steps.ROOT / "README.md").read_text()
    start = readme.index("## Two commands")
    section = readme[start:readme.index("\n## ", start + 1)]
    import re

    typed = re.findall(r"\b\d+(?:\.\d+)?\s*(?:min|minutes|s|seconds)\b", section)
    assert not typed or re.search(r"Measured on .*? on \d{4}-\d\d-\d\d", section, flags=re.S), typed
    assert "book/generated/timings.md" in section and "_build/build-log.jsonl" in section


def test_console_shows_one_line_per_job_and_errors_in_full(capsys):
    console = driver._Console()
    for line in ["Building DAG of jobs...\n", "[Mon Nov 23 02:12:02 2026]\n", "rule train:\n",
                 "    output: runs/smoke/a/sgd/seed-0/summary.json\n", "    jobid: 3\n",
                 "    wildcards: scale=smoke, setup=a, optimizer=sgd, seed=0\n", "    resources: tmpdir=/tmp\n",
                 "1 of 2 steps (50%) done\n", "Error in rule train:\n", "    jobid: 3\n"]:
        console.line(line)
    out = capsys.readouterr().out.splitlines()
    assert out == ["[workflow] train (scale=smoke, setup=a, optimizer=sgd, seed=0)", "1 of 2 steps (50%) done",
                   "Error in rule train:", "    jobid: 3"]
