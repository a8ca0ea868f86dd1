"""The book shows what it cost: the committed record of the last cold build of each scale (written by ``python -m
tools.book record-cold-build`` from a build log, read by the timings page), each job's time from Snakemake's output,
each chapter's cost and the E2 training's, all against a synthetic build log."""
from __future__ import annotations

import json

import pytest

from companion.chapters import cost
from tools.book import cli, driver, job_clock, steps

SNAKEMAKE_OUTPUT = """[Sat Nov 28 02:37:51 2026]
localrule train:
    output: runs/cpu/digits-mlp/adam/seed-0/summary.json
    jobid: 5
    reason: Missing output files: runs/cpu/digits-mlp/adam/seed-0/summary.json
    wildcards: scale=cpu, setup=digits-mlp, optimizer=adam, seed=0
    priority: 3
[Sat Nov 28 02:37:51 2026]
localrule train:
    jobid: 6
    wildcards: scale=cpu, setup=digits-mlp, optimizer=ief-momentum, seed=0
[Sat Nov 28 02:37:57 2026]
Finished jobid: 5 (Rule: train)
[Sat Nov 28 02:37:57 2026]
localrule compression:
    jobid: 7
[Sat Nov 28 02:38:01 2026]
Finished jobid: 6 (Rule: train)
[Sat Nov 28 02:38:01 2026]
localrule execute_notebook:
    jobid: 8
    wildcards: name=compression
[Sat Nov 28 02:38:30 2026]
Finished jobid: 7 (Rule: compression)
[Sat Nov 28 02:38:40 2026]
Finished jobid: 8 (Rule: execute_notebook)
[Sat Nov 28 02:38:40 2026]
localrule all:
    jobid: 0
[Sat Nov 28 02:38:40 2026]
Finished jobid: 0 (Rule: all)
"""

JOB_TIMES = [
    {"rule": "train", "wildcards": {"scale": "cpu", "setup": "digits-mlp", "optimizer": "adam", "seed": "0"},
     "seconds": 6.0},
    {"rule": "train", "wildcards": {"scale": "cpu", "setup": "digits-mlp", "optimizer": "ief-momentum", "seed": "0"},
     "seconds": 10.0},
    {"rule": "train", "wildcards": {"scale": "cpu", "setup": "tweets-minilm-lora", "optimizer": "ief", "seed": "1"},
     "seconds": 100.0},
    {"rule": "evaluate_stage", "wildcards": {"setup": "digits-mlp", "stage": "050"}, "seconds": 20.0},
    {"rule": "evaluate", "wildcards": {"setup": "digits-mlp"}, "seconds": 2.0},
    {"rule": "compression", "wildcards": {}, "seconds": 33.0},
    {"rule": "aggregate_e2", "wildcards": {}, "seconds": 4.0},
    {"rule": "execute_notebook", "wildcards": {"name": "compression"}, "seconds": 39.0},
    {"rule": "execute_notebook", "wildcards": {"name": "optimisation"}, "seconds": 50.0},
    {"rule": "book", "wildcards": {}, "seconds": 60.0},
]


def _cold(scale="cpu", **extra):
    entry = {"scale": scale, "profile": "default", "kind": "cold", "returncode": 0, "wall_time_s": 4332.0,
             "jobs": {"train": 3, "evaluate_stage": 1, "evaluate": 1, "compression": 1, "aggregate_e2": 1,
                      "execute_notebook": 2, "book": 1},
             "job_seconds": {"train": 116.0, "evaluate_stage": 20.0, "evaluate": 2.0, "compression": 33.0,
                             "aggregate_e2": 4.0, "execute_notebook": 89.0, "book": 60.0},
             "cores": 2, "finished": "2026-11-28 03:44:10 UTC"}
    entry.update(extra)
    return entry


def _log(path, *entries):
    path.write_text("".join(json.dumps(e) + "\n" for e in entries))
    return path


def test_the_job_clock_keeps_each_jobs_rule_wildcards_and_time(tmp_path):
    log = tmp_path / "x.snakemake.log"
    log.write_text(SNAKEMAKE_OUTPUT)
    clock = job_clock.read_snakemake_log(log)
    assert clock.seconds() == {"compression": 33.0, "execute_notebook": 39.0, "train": 16.0}
    assert clock.jobs() == [
        {"rule": "train", "wildcards": {"scale": "cpu", "setup": "digits-mlp", "optimizer": "adam", "seed": "0"},
         "seconds": 6.0},
        {"rule": "train", "wildcards": {"scale": "cpu", "setup": "digits-mlp", "optimizer": "ief-momentum",
                                        "seed": "0"}, "seconds": 10.0},
        {"rule": "compression", "wildcards": {}, "seconds": 33.0},
        {"rule": "execute_notebook", "wildcards": {"name": "compression"}, "seconds": 39.0},
    ]


def test_the_driver_measures_the_load_of_other_processes():
    load = driver.OtherLoad()
    measured = load.stop()
    assert set(measured) == {"other_cores", "load_average"}
    assert measured["other_cores"] is None or measured["other_cores"] >= 0


def test_record_writes_the_last_cold_build_atomically_and_replaces_only_its_scale(tmp_path):
    record = tmp_path / "cold-builds.json"
    log = _log(tmp_path / "build-log.jsonl", _cold("smoke", wall_time_s=300.0),
               _cold(wall_time_s=1.0, returncode=1),  # a failed build is never recorded
               {**_cold(), "kind": "no-op"}, _cold(), {**_cold(), "kind": "partial"})
    entry = steps.record_cold_build(log, "loaded", note="other sessions' tests ran beside it", other_cores=0.83,
                                    machine="AMD EPYC", total_wall_s=4400.0, record=record)
    assert entry["scale"] == "cpu" and entry["wall_time_s"] == 4332.0 and entry["load"] == "loaded"
    assert entry["other_cores"] == 0.83 and entry["machine"] == "AMD EPYC" and entry["total_wall_time_s"] == 4400.0
    assert "kind" not in entry and "returncode" not in entry
    steps.record_cold_build(log, "idle", scale="smoke", record=record)
    builds = cost.read_record(record)
    assert list(builds) == ["smoke", "cpu"] and builds["smoke"]["wall_time_s"] == 300.0
    assert builds["cpu"] == entry
    steps.record_cold_build(_log(tmp_path / "b.jsonl", _cold(wall_time_s=2000.0, other_cores=0.05)), "idle",
                            other_cores=1.5, record=record)
    builds = cost.read_record(record)
    assert builds["cpu"]["wall_time_s"] == 2000.0 and builds["cpu"]["load"] == "idle"
    assert builds["cpu"]["other_cores"] == 0.05  # the log's own measurement wins
    assert builds["smoke"]["wall_time_s"] == 300.0
    assert not list(tmp_path.glob(".cold-builds.json.tmp-*"))  # written through a temporary, replaced


def test_record_refuses_what_is_not_a_successful_cold_build(tmp_path):
    log = _log(tmp_path / "build-log.jsonl", {**_cold(), "kind": "partial"}, _cold(returncode=1))
    with pytest.raises(ValueError, match="no successful cold build in the log; it has: cpu partial"):
        steps.record_cold_build(log, "idle", record=tmp_path / "r.json")
    with pytest.raises(ValueError, match="load must be one of idle, loaded"):
        cost.record_cold_build(_cold(), "busy", path=tmp_path / "r.json")
    with pytest.raises(OSError, match="no build log"):
        steps.record_cold_build(tmp_path / "absent.jsonl", "idle", record=tmp_path / "r.json")
    assert not (tmp_path / "r.json").exists()
    (tmp_path / "bad.json").write_text('{"builds": {"gpu": {}}}')
    with pytest.raises(ValueError, match="bad entry 'gpu'"):
        cost.read_record(tmp_path / "bad.json")
    assert cost.read_record(tmp_path / "none.json") == {}


def test_the_command_records_with_job_times_from_snakemakes_log(tmp_path, capsys):
    log = _log(tmp_path / "build-log.jsonl", _cold())
    snakelog = tmp_path / "run.snakemake.log"
    snakelog.write_text(SNAKEMAKE_OUTPUT)
    record = tmp_path / "cold-builds.json"
    assert cli.main(["record-cold-build", "--log", str(log), "--load", "loaded", "--note", "tests beside it",
                     "--snakemake-log", str(snakelog), "--record", str(record)]) == 0
    assert "recorded the cold cpu build of 2026-11-28 03:44:10 UTC (1 h 12 min, loaded)" in capsys.readouterr().out
    entry = cost.read_record(record)["cpu"]
    assert [j["rule"] for j in entry["job_times"]] == ["train", "train", "compression", "execute_notebook"]
    assert entry["note"] == "tests beside it"
    assert cli.main(["record-cold-build", "--log", str(tmp_path / "none.jsonl"), "--load", "idle",
                     "--record", str(record)]) == 1
    assert "FAILED: no build log" in capsys.readouterr().out


def test_the_timings_page_shows_the_committed_cold_builds_and_this_checkouts(tmp_path):
    record = tmp_path / "cold-builds.json"
    cost.record_cold_build(_cold(job_times=JOB_TIMES, other_cores=0.91, machine="AMD EPYC"), "loaded",
                           path=record, note="measured while other work ran", total_wall_s=4400.0)
    log = _log(tmp_path / "build-log.jsonl", _cold("smoke", wall_time_s=150.2))
    text = steps.timings_table(executed_root=tmp_path / "none", build_log=log, record=record)
    assert text.index("### The last cold build of each scale") < text.index("### This checkout's builds")
    assert ("| `cpu` | 2026-11-28 03:44:10 UTC | AMD EPYC, 2 cores | loaded: other processes kept 0.91 of its 2 "
            "cores busy on average (measured while other work ran) | 1 h 12 min (the whole command, environment "
            "included: 1 h 13 min) | 5 min 24 s |") in text
    assert "| `smoke` | no cold build recorded |" in text and "| `full` | no cold build recorded |" in text
    assert ("- `cpu`: train 116 s (3 jobs), evaluate 22 s (2 jobs), notebooks 89 s (2 jobs), book 60 s (1 job), "
            "compression 33 s (1 job), aggregate_e2 4 s (1 job).") in text
    assert "| `compression.ipynb` | 78 s | train 6 s (1), notebooks 39 s (1), compression 33 s (1) |" in text
    assert "| `smoke` | cold build (every notebook executed, book built) | 2 min 30 s |" in text  # this checkout


def test_chapter_cost_sums_what_the_chapter_reads_and_its_notebook():
    record = {"cpu": {**_cold(job_times=JOB_TIMES), "load": "loaded"}}
    c = cost.chapter_cost("compression.ipynb", "cpu", record=record)
    # the study, its baseline run (digits-mlp adam seed 0) and the notebook; not the other runs
    assert c.by_rule == {"train": (1, 6.0), "notebooks": (1, 39.0), "compression": (1, 33.0)}
    assert c.seconds == 78.0 and c.runs == 1
    e2 = cost.chapter_cost("optimisation", "cpu", record=record)
    assert e2.by_rule["train"] == (3, 116.0) and e2.by_rule["aggregate_e2"] == (1, 4.0)
    assert e2.by_rule["notebooks"] == (1, 50.0)
    assert cost.chapter_cost("toy_problems", "cpu", record=record).seconds == 0.0
    assert cost.chapter_cost("compression", "smoke", record=record) is None  # not recorded
    assert cost.chapter_cost("compression", "cpu", record={"cpu": _cold()}) is None  # no per-job times
    sentence = cost.cost_sentence(c)
    assert sentence == ("In the last cold cpu build (finished 2026-11-28 03:44:10 UTC, 2 cores, loaded), this chapter "
                        "took 78 s of job time: train 6 s (1 job), notebooks 39 s (1 job), compression 33 s (1 job).")
    assert "not stated" in cost.cost_sentence(None)
    with pytest.raises(ValueError, match="accepted: smoke, cpu, full"):
        cost.chapter_cost("compression", "gpu", record=record)


def test_e2_training_cost_leaves_the_practical_runs_out():
    record = {"cpu": {**_cold(job_times=JOB_TIMES), "load": "idle"}}
    c = cost.e2_training_cost("cpu", record=record)
    assert (c.runs, c.seconds) == (2, 106.0)  # digits-mlp adam and tweets ief; not ief-momentum
    assert c.when() == "the last cold cpu build (finished 2026-11-28 03:44:10 UTC, 2 cores, idle)"
    assert cost.e2_training_cost("full", record=record) is None


def test_every_result_kind_a_notebook_reads_has_its_jobs():
    kinds = {k for v in cost.notebook_results().values() for k in v}
    assert kinds and kinds <= set(cost.KIND_JOBS), kinds - set(cost.KIND_JOBS)


def test_durations_read_as_a_reader_reads_them():
    assert [cost.format_duration(s) for s in (42, 150.2, 3599, 4332, 7200)] == [
        "42 s", "2 min 30 s", "59 min 59 s", "1 h 12 min", "2 h 00 min"]
    assert steps.format_minutes(220) == "3 min 40 s"


def test_the_committed_record_reads_and_renders():
    """The committed record is well formed, and each entry states its load and its machine's cores."""
    builds = cost.read_record()
    for scale, entry in builds.items():
        assert entry["scale"] == scale and entry["load"] in cost.LOADS and entry["cores"]
    assert "| scale | finished | machine | load |" in cost.cold_builds_markdown(builds)


def test_the_readme_states_the_recorded_cold_build():
    """The README's cost sentence is the record's, as printed (python -m companion.chapters.cost README.md)."""
    readme = (steps.ROOT / "README.md").read_text()
    assert cost.readme_block() in readme, "run python -m companion.chapters.cost README.md"
    record = {"cpu": {**_cold(job_times=JOB_TIMES, other_cores=0.74, machine="Intel Xeon"), "load": "loaded",
                      "total_wall_time_s": 3575.0}}
    assert cost.readme_sentence(record) == (
        "Measured on a 2-core Intel Xeon on 2026-11-28, with other work loading the machine (other processes kept "
        "0.74 of its 2 cores busy on average): the last cold `make book` recorded (`book/cold-builds.json`) took "
        "59 min 35 s from a fresh clone (the workflow 1 h 12 min); its jobs took 5 min 24 s in all: train 116 s "
        "(3 jobs), evaluate 22 s (2 jobs), notebooks 89 s (2 jobs), the other 3 jobs 97 s.")
    assert cost.readme_sentence({}) == "No cold `cpu` build is recorded yet (`book/cold-builds.json`)."


def test_the_record_file_is_written_one_line_per_job(tmp_path):
    path = tmp_path / "r.json"
    cost.record_cold_build(_cold(job_times=JOB_TIMES), "idle", path=path)
    text = path.read_text()
    assert json.loads(text)["builds"]["cpu"]["job_times"] == JOB_TIMES
    assert sum('"rule":' in line for line in text.splitlines()) == len(JOB_TIMES)


def test_the_intro_states_the_full_runs_cost_in_plain_markdown(tmp_path):
    """The GPU rerun recipe's cost is text in the page (GitHub shows it, not a raw role), equal to what the code says
    (python -m companion.chapters.cost README.md book/intro.md), and the updater fills a stale block."""
    from companion.experiments.cost import cost_summary

    intro = (steps.ROOT / "book" / "intro.md").read_text()
    assert "{fullcost}" not in intro
    assert cost.fullcost_blocks(intro) == intro, "run python -m companion.chapters.cost README.md book/intro.md"
    assert f"sst2-t5-lora ief, by python -m companion.chapters.cost -->{cost_summary('sst2-t5-lora', 'ief')}" in intro
    page = tmp_path / "page.md"
    page.write_text("A <!-- fullcost: sst2-t5-lora ief, by python -m companion.chapters.cost -->old<!-- /fullcost -->.")
    cost.update_readme(page)
    assert page.read_text() == ("A <!-- fullcost: sst2-t5-lora ief, by python -m companion.chapters.cost -->"
                                f"{cost_summary('sst2-t5-lora', 'ief')}<!-- /fullcost -->.")


SEEDS_JOB = """[Wed Dec  2 17:30:00 2026]
localrule train_seeds:
    input: .snakemake/code-digests/core.sha256
    output: {outputs}
    log: runs/cpu/digits-mlp/adam/train-seeds-0-2.log
    jobid: 4
    wildcards: scale=cpu, setup=digits-mlp, optimizer=adam
    priority: 3
[Wed Dec  2 17:30:00 2026]
localrule train:
    output: runs/cpu/tweets-minilm-lora/ief/seed-0/summary.json
    jobid: 5
    wildcards: scale=cpu, setup=tweets-minilm-lora, optimizer=ief, seed=0
[Wed Dec  2 17:30:09 2026]
Finished jobid: 4 (Rule: train_seeds)
[Wed Dec  2 17:31:40 2026]
Finished jobid: 5 (Rule: train)
""".format(outputs=", ".join(f"runs/cpu/digits-mlp/adam/seed-{k}/summary.json" for k in range(3)))


def test_a_jobs_several_seeds_are_recorded_and_counted_as_runs(tmp_path):
    """A train_seeds job (an MLP's seeds, one job per optimiser): the clock keeps the seeds its output names; the
    costs show it under train, count its runs, and give it to the chapters reading any run it trained."""
    log = tmp_path / "x.snakemake.log"
    log.write_text(SEEDS_JOB)
    jobs = job_clock.read_snakemake_log(log).jobs()
    assert jobs[0] == {"rule": "train_seeds", "wildcards": {"scale": "cpu", "setup": "digits-mlp", "optimizer": "adam"},
                       "seconds": 9.0, "seeds": [0, 1, 2]}
    assert "seeds" not in jobs[1] and jobs[1]["seconds"] == 100.0
    assert cost.train_runs(jobs[0]) == [("digits-mlp", "adam", s) for s in (0, 1, 2)]
    assert cost.train_runs(jobs[1]) == [("tweets-minilm-lora", "ief", 0)]
    assert cost.train_runs({"rule": "compression", "wildcards": {}}) == []
    record = {"cpu": {**_cold(job_times=jobs), "load": "idle"}}
    e2 = cost.e2_training_cost("cpu", record=record)
    assert (e2.runs, e2.seconds, e2.by_rule) == (4, 109.0, {"train": (2, 109.0)})
    # the compression study reads the digits baseline (seed 0): the job that trained it
    assert cost.chapter_cost("compression", "cpu", record=record).by_rule == {"train": (1, 9.0)}
    assert cost.rule_group("train_seeds_1") == "train" and cost.rule_group("evaluate_stage") == "evaluate"
