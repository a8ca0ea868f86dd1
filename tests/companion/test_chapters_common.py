"""companion.chapters.common's provenance lines: a record's own date, commit and command when it carries them, an honest
"made before records carried their date" when it does not, and the workflow's tables with the time they were written."""
from __future__ import annotations

import json
import os
import re

from companion.experiments.search import record_path
from companion.chapters.common import committed_at, record_made, record_note, regenerated_note, workflow_note


def test_a_record_that_carries_its_date_commit_and_command_is_described_by_them(tmp_path):
    path = tmp_path / "cpu-x.json"
    path.write_text(json.dumps({"created": "2026-11-24T09:40:00Z", "commit": "0123456789abcdef" * 2 + "01234567",
                                "command": "python -m companion search --setup x --scale cpu --seed 0"}))
    assert record_made(path) == ("made 2026-11-24T09:40:00Z at commit `0123456789ab` by "
                                 "`python -m companion search --setup x --scale cpu --seed 0`")
    path.write_text(json.dumps({"created": "2026-11-24T09:40:00Z", "commit": None}))
    assert record_made(path) == "made 2026-11-24T09:40:00Z outside a git checkout"
    line = record_note([path], "table")
    assert line.startswith("*Provenance: this table is read from the committed record `") and line.endswith("*")
    assert "made 2026-11-24T09:40:00Z" in line and "not recomputed by this build" in line


def test_a_record_without_a_date_says_so_and_never_invents_one(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"setup": "x"}))
    os.utime(path, (0, 0))
    made = record_made(path)
    assert made.startswith("made before records carried their date; ")
    assert made.endswith("file time 1970-01-01 00:00 UTC (not committed)")  # tmp_path is not in git
    assert committed_at(path) == "file time 1970-01-01 00:00 UTC (not committed)"
    csv = tmp_path / "paper.csv"  # not a record format that carries dates: only when it was committed or written
    csv.write_text("a,b\n")
    assert not record_made(csv).startswith("made before")


def test_a_committed_search_record_is_described_by_its_commit_or_its_own_date():
    made = record_made(record_path("digits-mlp", "cpu"))
    assert re.fullmatch(r"made before records carried their date; last committed \d{4}-\d\d-\d\d \d\d:\d\d UTC"
                        r"|made \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ (at commit `[0-9a-f]{12}`|outside a git checkout)"
                        r"( by `python -m companion search .+`)?", made), made


def test_workflow_and_regenerated_lines_name_the_scale_and_the_tables_read(tmp_path):
    table = tmp_path / "e2_runs.csv"
    table.write_text("x\n")
    os.utime(table, (86400, 86400))
    line = workflow_note([table], "smoke", "table")
    assert line.startswith("*Provenance: this table was computed by this build's workflow (scale `smoke`;")
    assert f"`{table}` (written 1970-01-02 00:00 UTC)" in line and line.endswith(".*")
    assert "tables" in workflow_note([table, table], "cpu") and regenerated_note("cpu", "table").endswith(".*")
