"""``tools/mutation/run.py`` (``make mutation``): the score, the equivalent list's format and its staleness check.

The mutation run itself takes tens of minutes and is not part of the tests; these check its bookkeeping.
"""
from __future__ import annotations

import json
import subprocess

import pytest

from tools.mutation import run


def test_committed_equivalent_list_parses_and_names_measured_modules():
    entries = run.read_equivalent()
    assert entries, "tools/mutation/equivalent.txt lists no mutant"
    prefixes = tuple(m.rstrip("/").removesuffix(".py").replace("/", ".") + "." for m in run.MODULES)
    for name, (line, reason) in entries.items():
        assert name.startswith(prefixes) and "__mutmut_" in name, name
        assert line and len(reason) > 15, name


def test_equivalent_entries_parse_and_bad_lines_are_refused(tmp_path):
    path = tmp_path / "equivalent.txt"
    path.write_text("# comment\n\nief.kfac.x_f__mutmut_1 | a = b | c | why it is the same\n")
    assert run.read_equivalent(path) == {"ief.kfac.x_f__mutmut_1": ("a = b | c", "why it is the same")}
    path.write_text("ief.kfac.x_f__mutmut_1 | no reason\n")
    with pytest.raises(ValueError, match=r"equivalent\.txt:1: expected"):
        run.read_equivalent(path)


def test_changed_line_and_score():
    diff = "--- a\n+++ b\n@@ -1,2 +1,2 @@\n-x = a + b\n+x = a - b\n y = 1\n"
    assert run.changed_line(diff) == "x = a - b"
    outcome = run.Outcome("ief/kfac.py", 10, {f"m{i}": s for i, s in enumerate(
        ["killed"] * 6 + ["timeout", "survived", "survived", "no tests"])}, {}, equivalent={"m7": "why"})
    assert outcome.score == pytest.approx(7 / 9)
    assert outcome.survivors == ["m8", "m9"]
    assert outcome.counts() == {"killed": 6, "timeout": 1, "survived": 2, "no tests": 1}


def test_a_stale_equivalent_entry_is_not_counted(tmp_path, monkeypatch):
    """An entry counts only while its mutant still changes the listed line (mutmut renumbers after edits)."""
    statuses = {"ief.kfac.x_f__mutmut_1": "survived", "ief.kfac.x_f__mutmut_2": "killed"}
    diffs = {"ief.kfac.x_f__mutmut_1": "-y = 1\n+y = 2\n"}
    answers = {"generate": " ".join(statuses), "results": json.dumps(statuses), "diffs": json.dumps(diffs)}
    monkeypatch.setattr(run, "prepare", lambda *a: None)
    monkeypatch.setattr(run, "query", lambda work, env, command, *names: answers[command])
    monkeypatch.setattr(run.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0))
    logged = []
    for listed, counted in (("y = 2", 1), ("y = 3", 0)):
        out = run.measure("ief/kfac.py", [], tmp_path, 10, 0, {}, {"ief.kfac.x_f__mutmut_1": (listed, "why")},
                          logged.append)
        assert len(out.equivalent) == counted and out.score == (1.0 if counted else 0.5)
    assert logged[-1].startswith("    stale equivalent entry ief.kfac.x_f__mutmut_1: listed 'y = 3'")
