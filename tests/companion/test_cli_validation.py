"""The command line checks every number it takes when it parses (``python -m companion ...``): a bad value is the
usage line and one ``error:`` line naming the option, the value and what is accepted, exit status 2, no traceback,
and nothing created. Before: ``train --checkpoint-every nan`` ran without periodic checkpoints (0 or a negative value
wrote one per update), ``evaluate --cg-iterations 0`` ended in a 'saturated batch' traceback with ``OUT.parts`` left
behind, and ``aggregate --out <a file>`` in a FileExistsError traceback."""
from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from companion.__main__ import (SEED_LIMIT, folder, main, parser, percent, percents, positive_float, positive_int,
                                positive_seconds, run_seed, run_seeds, setting)


def _cli(cwd, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "companion", *args], cwd=cwd, env=dict(os.environ),
                          capture_output=True, text=True, timeout=120)


# ------------------------------------------------------------------------------- the reported cases, as run
@pytest.mark.parametrize("args,command,option,value,accepted", [
    (["train", "--setup", "digits-mlp", "--scale", "smoke", "--optimizer", "adam", "--checkpoint-every", "nan"],
     "train", "--checkpoint-every", "nan", "a finite number of seconds > 0 expected"),
    (["train", "--setup", "digits-mlp", "--scale", "smoke", "--optimizer", "adam", "--checkpoint-every", "0"],
     "train", "--checkpoint-every", "0", "a finite number of seconds > 0 expected"),
    (["evaluate", "--setup", "digits-mlp", "--scale", "smoke", "--out", "ev.csv", "--cg-iterations", "0"],
     "evaluate", "--cg-iterations", "0", "an integer >= 1 expected"),
    (["aggregate", "--scale", "smoke", "--runs", "runs", "--out", "afile"],
     "aggregate", "--out", "afile", "an existing file; a folder (existing or new) expected"),
], ids=["checkpoint-every-nan", "checkpoint-every-0", "cg-iterations-0", "aggregate-out-file"])
def test_reported_cases_are_parse_errors_that_leave_nothing(args, command, option, value, accepted, tmp_path):
    (tmp_path / "afile").write_text("a file, not a folder")
    before = sorted(tmp_path.rglob("*"))
    done = _cli(tmp_path, *args)
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    err = done.stderr
    assert err.startswith(f"usage: python -m companion {command} ")
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and f"error: argument {option}: invalid value {value!r}: {accepted}" in errors[0], err
    assert "Traceback" not in err
    assert sorted(tmp_path.rglob("*")) == before
    assert (tmp_path / "afile").read_text() == "a file, not a folder"


# ------------------------------------------------------------------------------- every numeric option, in process
_RUN = ["--setup", "digits-mlp", "--scale", "smoke"]
_SECONDS = "a finite number of seconds > 0"
_BAD = [
    ("train", [*_RUN, "--optimizer", "adam"], "--checkpoint-every", ["inf", "-1", "x"], _SECONDS),
    ("train", [*_RUN, "--optimizer", "adam"], "--log-every", ["nan", "0", "-inf"], _SECONDS),
    ("train", [*_RUN, "--optimizer", "adam"], "--lr", ["nan", "inf", "0", "-1e-3"], "a finite number > 0"),
    ("train", [*_RUN, "--optimizer", "adam"], "--seed", ["-1", "1.5", str(SEED_LIMIT)], "an integer from 0 to"),
    ("search", _RUN, "--seed", ["-2", "nan"], "an integer from 0 to"),
    ("evaluate", [*_RUN, "--out", "e.csv"], "--seed", ["-1"], "an integer from 0 to"),
    ("evaluate", [*_RUN, "--out", "e.csv"], "--batches", ["0", "-3", "2.0"], "an integer >= 1"),
    ("evaluate", [*_RUN, "--out", "e.csv"], "--batch-size", ["0", "nan"], "an integer >= 1"),
    ("evaluate", [*_RUN, "--out", "e.csv"], "--cg-iterations", ["-1", "inf"], "an integer >= 1"),
    ("evaluate", [*_RUN, "--out", "e.csv"], "--sweep-dampings", ["0"], "an integer >= 1"),
    ("evaluate", [*_RUN, "--out", "e.csv"], "--stages", ["fifty", "0,101", "-5", ","], "comma-separated integer"),
    ("step-costs", ["--scale", "smoke", "--out", "c.csv"], "--repeats", ["0", "1.5"], "an integer >= 1"),
    ("compression", ["--scale", "smoke", "--out", "w"], "--seed", ["-1"], "an integer from 0 to"),
    ("blockdiag-check", ["--scale", "smoke", "--results", "r", "--out", "b.csv"], "--seed", ["-1"],
     "an integer from 0 to"),
    ("blockdiag-check", ["--scale", "smoke", "--results", "r", "--out", "b.csv"], "--stage", ["101", "-1", "50.5"],
     "an integer percentage from 0 to 100"),
    ("describe", _RUN, "--set", ["lr=NaN", "stage_fractions=[0, Infinity]", "epochs"], "KEY=VALUE"),
]


@pytest.mark.parametrize("command,args,option,values,accepted", _BAD, ids=[f"{c} {o}" for c, _, o, _, _ in _BAD])
def test_every_numeric_option_rejects_bad_values_at_parse_time(command, args, option, values, accepted, tmp_path,
                                                               capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for value in values:
        assert main([command, *args, f"{option}={value}"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"usage: python -m companion {command} ")
        errors = [line for line in err.splitlines() if "error:" in line]
        assert len(errors) == 1, err
        assert f"error: argument {option}: invalid value {value!r}: {accepted}" in errors[0], err
    assert not list(tmp_path.iterdir())


def test_compression_out_onto_a_file_or_under_one_is_an_error(tmp_path, capsys):
    (tmp_path / "f").write_text("")
    for out in (tmp_path / "f", tmp_path / "f" / "sub"):
        assert main(["compression", "--scale", "smoke", "--out", str(out)]) == 2
        assert f"error: argument --out: invalid value {str(out)!r}" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["f"]


def test_no_option_parses_with_a_bare_int_or_float():
    """A new numeric option gets a checking type too (plain ``int`` takes -1, ``float`` takes nan)."""
    def actions(p: argparse.ArgumentParser):
        for action in p._actions:
            yield p.prog, action
            if isinstance(action, argparse._SubParsersAction):
                for child in action.choices.values():
                    yield from actions(child)

    bare = [(prog, a.option_strings) for prog, a in actions(parser()) if a.type in (int, float)]
    assert bare == []
    typed = {(prog.split()[-1], a.option_strings[0]) for prog, a in actions(parser()) if a.option_strings and a.type}
    assert {("train", "--checkpoint-every"), ("evaluate", "--cg-iterations"), ("aggregate", "--out")} <= typed


# ------------------------------------------------------------------------------- the type functions
def _refused(function, text: str) -> bool:
    try:
        function(text)
    except argparse.ArgumentTypeError as err:
        assert repr(text) in str(err) and "expected" in str(err)
        return True
    return False


SPECIAL = st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0, -1.0, 5e-324, 1e308, 120.0])


@given(st.one_of(SPECIAL, st.floats(allow_nan=True, allow_infinity=True)))
def test_positive_floats_accept_exactly_finite_numbers_above_zero(x):
    for function in (positive_float, positive_seconds):
        for text in (repr(x), str(x)):
            if math.isfinite(x) and x > 0:
                assert function(text) == x
            else:
                assert _refused(function, text)


@pytest.mark.parametrize("text", ["", "x", "1,5", "0x10", "nan%", "Infinity1"])
def test_positive_floats_refuse_text(text):
    assert _refused(positive_float, text) and _refused(positive_seconds, text)


@given(st.one_of(st.integers(), st.sampled_from([-1, 0, 1, 100, 101, SEED_LIMIT - 1, SEED_LIMIT])))
def test_integers_accept_exactly_their_range(n):
    for function, ok in ((positive_int, n >= 1), (run_seed, 0 <= n < SEED_LIMIT), (percent, 0 <= n <= 100)):
        if ok:
            assert function(str(n)) == n
        else:
            assert _refused(function, str(n))


@given(st.one_of(SPECIAL, st.floats(allow_nan=True, allow_infinity=True)))
def test_integers_refuse_floats_nan_and_inf(x):
    for function in (positive_int, run_seed, percent):
        assert _refused(function, repr(x))


def test_stages_are_a_list_of_percentages():
    assert percents("0,50,100") == [0, 50, 100] and percents("50") == [50] and percents("0, 50,") == [0, 50]
    for bad in ("", ",", "fifty", "0,101", "-1", "50.0", "nan"):
        assert _refused(percents, bad)


def test_seed_lists_are_seeds_and_ranges_each_once():
    assert run_seeds("0-59") == list(range(60)) and run_seeds("3") == [3] and run_seeds("0,1,5-7") == [0, 1, 5, 6, 7]
    for bad in ("", ",", "0,0", "0-2,1", "5-3", "-1", "x", "1.5", f"0-{SEED_LIMIT}", "0,,1"):
        assert _refused(run_seeds, bad)


def test_seed_and_seeds_are_one_or_the_other(capsys):
    with pytest.raises(SystemExit) as stopped:
        parser().parse_args(["train", *_RUN, "--optimizer", "adam", "--seed", "1", "--seeds", "0-2"])
    assert stopped.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_folders_are_existing_folders_or_new_paths(tmp_path):
    (tmp_path / "file").write_text("")
    (tmp_path / "dir").mkdir()
    for ok in (tmp_path / "dir", tmp_path / "new", tmp_path / "dir" / "new" / "deeper"):
        assert folder(str(ok)) == str(ok)
    for bad in (tmp_path / "file", tmp_path / "file" / "sub"):
        assert _refused(folder, str(bad))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "file"]


def test_settings_refuse_non_finite_json_numbers():
    for ok in ("epochs=1", "lr=0.5", "schedule=constant", 'sizes={"train": 3}', "note=NaNny"):
        assert setting(ok) == ok
    for bad in ("lr=NaN", "lr=Infinity", "lr=-Infinity", "stage_fractions=[0.5, NaN]", "epochs", "=1", "lr=1e400"):
        assert _refused(setting, bad)
