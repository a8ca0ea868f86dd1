"""The benchmark tables of benchmarks/README.md come from the committed JSON
(``python -m benchmarks.report benchmarks/README.md``).

No number in them is typed; the book's API page renders the same text at build time."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from benchmarks import harness, report

ROOT = Path(__file__).resolve().parents[2]


def _fixture(folder: Path, benchmark: str = "conv2d", load: float | None = 1.25) -> Path:
    """A small record as a benchmark writes it (machine and date fixed so that the text is known)."""
    doc = harness.record(benchmark, ["--repeats", "2"], "cpu", argparse.Namespace(repeats=2), None, {"raw": []}, [
        harness.table("Per-sample gradients", [("method", "s"), ("median ms", ".1f"), ("vs backward", ".2f"),
                                               ("peak MiB", ".1f")],
                      [["plain backward", 14.04, 1.0, 3.3], ["`a|b`", 63.66, 4.5871, None]], note="A note."),
    ])
    doc.update(date="2026-01-02T03:04:05Z", command="OMP_NUM_THREADS=1 python -m benchmarks.conv2d --repeats 2",
               other_load_cores=load, load_average=[2.5, 2.75] if load is not None else None,
               machine=dict(doc["machine"], cpu="AMD EPYC", cores=2, threads=1, torch="2.13.0+cpu", device="cpu"))
    return harness.write_json(folder / f"{benchmark}-cpu.json", doc)


def test_markdown_from_a_fixture(tmp_path):
    _fixture(tmp_path)
    docs = report.load(tmp_path)
    text = report.markdown(docs)
    assert text.splitlines()[0] == "#### Per-sample gradients of a CNN (`benchmarks/conv2d.py`)"
    assert "| method | median ms | vs backward | peak MiB |\n| --- | ---: | ---: | ---: |" in text
    assert "| plain backward | 14.0 | 1.00 | 3.3 |" in text
    assert "| `a\\|b` | 63.7 | 4.59 | n/a |" in text  # a pipe escaped, None as n/a
    assert "A note." in text
    assert ("Measured 2026-01-02 on AMD EPYC, 2 logical CPUs, 1 torch thread(s), torch 2.13.0+cpu, device cpu; "
            "during the run other processes kept 1.25 of its 2 CPU cores busy on average (1-min load average 2.50 "
            "at the start, 2.75 at the end). Command: `OMP_NUM_THREADS=1 python -m benchmarks.conv2d --repeats 2`."
            ) in text
    assert report.markdown(docs, level="###").startswith("### Per-sample")


def test_unmeasured_load_is_said(tmp_path):
    _fixture(tmp_path, load=None)
    assert "during the run not measured." in report.markdown(report.load(tmp_path))


def test_sections_follow_the_fixed_order(tmp_path):
    _fixture(tmp_path, "evaluation")
    _fixture(tmp_path, "step")
    _fixture(tmp_path, "zzz_new")
    assert [d["benchmark"] for d in report.load(tmp_path)] == ["step", "evaluation", "zzz_new"]


def test_records_of_one_benchmark_share_one_heading(tmp_path):
    first = _fixture(tmp_path, "evaluation")
    first.rename(tmp_path / "evaluation-a.json")
    _fixture(tmp_path, "evaluation").rename(tmp_path / "evaluation-b.json")
    text = report.markdown(report.load(tmp_path))
    assert text.count("#### The evaluation, per checkpoint") == 1
    assert text.count("Measured 2026-01-02") == 2


def test_no_results_is_said(tmp_path):
    assert report.markdown(report.load(tmp_path)) == "No benchmark results are committed (`benchmarks/results/*.json`)."


def test_a_bad_record_is_named(tmp_path):
    path = _fixture(tmp_path)
    doc = json.loads(path.read_text())
    del doc["command"]
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"conv2d-cpu\.json: benchmark record: 'command'"):
        report.load(tmp_path)


def test_block_round_trip(tmp_path):
    _fixture(tmp_path)
    docs = report.load(tmp_path)
    readme = tmp_path / "README.md"
    readme.write_text(f"# Title\n\nbefore\n\n{report.START}\nold typed numbers 1.23x\n{report.END}\n\nafter\n")
    assert report.update(readme, docs) is True
    text = readme.read_text()
    assert report.block(docs) in text and "old typed numbers" not in text
    assert text.startswith("# Title\n\nbefore\n\n") and text.endswith(f"{report.END}\n\nafter\n")
    assert report.update(readme, docs) is False  # idempotent
    assert readme.read_text() == text
    assert report.replace_block(text, report.block([]), "x").count(report.START) == 1


@pytest.mark.parametrize("text", ["no markers", f"{report.END}\n{report.START}", f"{report.START}\n{report.START}"
                                  f"\n{report.END}"])
def test_missing_or_broken_markers_are_refused(text, tmp_path):
    with pytest.raises(ValueError, match="benchmark markers once each"):
        report.replace_block(text, "x", "README.md")


def test_committed_results_are_valid_records():
    docs = report.load()
    assert docs, "benchmarks/results/ holds no committed benchmark record"
    for doc in docs:
        assert doc["machine"]["threads"] >= 1 and doc["command"].startswith(("OMP_NUM_THREADS", "python"))


def test_the_defaults_tables_come_from_their_results_and_fit_a_book_page():
    """The defaults record's tables (rendered on the book's page on choosing lr and damping) are its results' as
    ``benchmarks.defaults`` lays them out (``--retable`` rewrites them; nothing typed), each narrow enough for the
    book's content column: at most 6 columns, no cell over 24 characters (the 11-column layout was wider than the
    page and the browser test's screenshot cut its right columns off)."""
    from benchmarks import defaults

    doc = json.loads((ROOT / "benchmarks" / "results" / "defaults-cpu.json").read_text())
    assert doc["tables"] == defaults._tables(doc["results"]["tasks"], doc["args"]["steps"])
    for table in doc["tables"]:
        assert len(table["columns"]) <= 6, [c["header"] for c in table["columns"]]
        assert max(len(str(cell)) for row in table["rows"] for cell in row) <= 24
