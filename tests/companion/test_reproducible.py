"""tools/kernels.py: the smoke evaluation's records compared across CPU kernel sets (`make test` reruns the
evaluation under ATEN_CPU_CAPABILITY=default and compares). These tests pin the comparison's tolerances and its
verdicts on crafted records, and that the kernel set asked for is the one torch runs."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from tools import kernels


def _record(kind="e1", method="ief", damping=1e-7, gamma=0.3, ratio=0.9, imbalance=1.5, stage=0, batch=0):
    return {"setup": "digits-mlp", "stage": stage, "kind": kind, "batch": batch, "method": method,
            "damping": damping, "gamma": gamma, "ratio": ratio, "imbalance": imbalance if kind == "e1" else None}


def test_identical_runs_agree():
    records = [_record(), _record(method="ef"), _record("sweep", "sf", 1e-10, gamma=0.0, ratio=0.0),
               _record("sweep", "sgd", None, gamma=1.0, ratio=1.0)]
    assert kernels.compare(records, [dict(r) for r in records]) == []


@pytest.mark.parametrize("kind, damping, agree, differ", [
    ("e1", 1e-7, 0.3 * (1 + 4e-3), 0.3 * (1 + 6e-3)),           # E1: 5e-3 relative
    ("sweep", 1e-2, 0.3 * (1 + 9e-5), 0.3 * (1 + 2e-4)),         # well damped: 1e-4
    ("sweep", None, 0.3 * (1 + 9e-5), 0.3 * (1 + 2e-4)),         # SGD's sweep records (no damping): 1e-4
    ("sweep", 1e-6, 0.3 * (1 + 9e-4), 0.3 * (1 + 2e-3)),         # 1e-7 <= damping < 1e-4: 1e-3
    ("sweep", 1e-8, 0.3 * (1 + 4e-3), 0.3 * (1 + 6e-3)),         # below 1e-7: 5e-3
    ("sweep", 1e-10, 0.3 * (1 + 4e-3), 0.0),                     # a gamma of 0 in one run only is a difference
])
def test_tolerance_bands(kind, damping, agree, differ):
    first = [_record(kind, "ief", damping, gamma=0.3)]
    assert kernels.compare(first, [_record(kind, "ief", damping, gamma=agree)]) == []
    found = kernels.compare(first, [_record(kind, "ief", damping, gamma=differ)])
    assert len(found) == 1 and "gamma" in found[0] and "method=ief" in found[0]
    assert damping is None or f"damping={damping}" in found[0]


def test_missing_and_non_finite_records_are_differences():
    a = [_record(), _record(batch=1)]
    found = kernels.compare(a, [_record(), _record(batch=2)])
    assert any("only in the first run" in f and "'batch': 1" in f for f in found)
    assert any("only in the second run" in f and "'batch': 2" in f for f in found)
    found = kernels.compare([_record()], [_record(gamma=math.nan)])
    assert len(found) == 1 and "finite in one run only" in found[0]
    found = kernels.compare([_record()], [_record(imbalance=None)])
    assert len(found) == 1 and "imbalance" in found[0]


def test_bad_records_are_refused_by_name():
    with pytest.raises(ValueError, match="first run has two records"):
        kernels.compare([_record(), _record()], [_record()])
    with pytest.raises(ValueError, match="kind 'e2'.*'e1' and 'sweep'"):
        kernels.tolerance(_record(kind="e2"))


def test_the_rerun_runs_the_kernel_set_it_asks_for(tmp_path, monkeypatch):
    """A child started with ATEN_CPU_CAPABILITY=default runs ATen's default kernels; a rerun whose torch does not run
    the kernels asked for stops rather than compare two runs of the same kernels."""
    done = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                          env={**os.environ, "ATEN_CPU_CAPABILITY": "default"}, capture_output=True, text=True)
    assert done.stdout.strip() == "DEFAULT", done.stderr
    other = "default" if torch.backends.cpu.get_cpu_capability() != "DEFAULT" else "avx2"
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", other)
    with pytest.raises(RuntimeError, match=f"ATEN_CPU_CAPABILITY={other} asked, but torch runs"):
        kernels._rerun(tmp_path, tmp_path, tmp_path)


def test_no_tables_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no evaluation tables.*make book SCALE=smoke"):
        kernels.run(tmp_path / "results", tmp_path / "runs", tmp_path / "out")


def test_evaluation_params_come_from_the_stage_records(tmp_path):
    """The rerun takes each table's parameters from its stage records (the sweep from a stage that swept); a table
    without records is an error naming the folder, never a silent rerun of nothing."""
    parts = tmp_path / "eval" / "digits-mlp.csv.parts"
    parts.mkdir(parents=True)
    base = dict(setup="digits-mlp", scale="smoke", seed=0, batches=2, batch_size=8, damping=1e-7, cg=5)
    (parts / "stage-000.json").write_text(json.dumps({"job": {**base, "stage": 0, "sweep": False}}))
    (parts / "stage-050.json").write_text(json.dumps({"job": {**base, "stage": 50, "sweep": True,
                                                              "sweep_dampings": [1e-4, 1.0]}}))
    assert kernels.evaluation_params(tmp_path / "eval" / "digits-mlp.csv") == {
        **base, "sweep": True, "sweep_dampings": [1e-4, 1.0]}
    with pytest.raises(FileNotFoundError, match=r"tweets-minilm-pt\.csv\.parts"):
        kernels.evaluation_params(tmp_path / "eval" / "tweets-minilm-pt.csv")
