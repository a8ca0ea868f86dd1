"""companion.chapters.coverage: which chapter regenerates each of the paper's 23 figures and tables, what it produces at each
scale (read from the chapters' own registries), what a build executed (its provenance records), and the coverage
page, introduction sentence and README block rendered from it."""
from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest

from companion.chapters.coverage import (CHAPTER_OF, CHAPTERS, README_EXECUTED, SCALES, book_state, chapter_caveats, counts,
                                   coverage_markdown, coverage_sentence, paper_figures_and_tables, produced,
                                   status)
from companion.paper import cite

ROOT = Path(__file__).resolve().parents[2]


def test_registry_lists_exactly_the_papers_23_figures_and_tables():
    paper = paper_figures_and_tables()
    assert len(paper) == 23
    assert set(CHAPTER_OF) == set(paper)
    assert set(CHAPTER_OF.values()) <= set(CHAPTERS)


def test_every_label_is_cited_in_a_heading_of_its_notebook():
    for label, stem in CHAPTER_OF.items():
        path = ROOT / "notebooks" / f"{stem}.ipynb"
        cells = nbformat.read(path, as_version=4).cells
        headings = [line for c in cells if c.cell_type == "markdown" for line in c.source.splitlines()
                    if line.startswith("#")]
        assert any(f"{{paper}}`{label}`" in h for h in headings), f"no heading of {path.name} cites {label}"


def _kinds(scale, executed):
    return {cite(label): status(label, scale, executed).kind for label in paper_figures_and_tables()}


@pytest.mark.parametrize("scale", ["smoke", "cpu"])
def test_below_full_two_labels_are_one_figure_and_the_vit_has_no_analogue(scale):
    kinds = _kinds(scale, README_EXECUTED)
    assert {k for k, v in kinds.items() if v == "same"} == {"Fig. 9", "Fig. 11"}
    assert {k for k, v in kinds.items() if v == "absent"} == {"Fig. 10"}
    assert sum(v == "regenerated" for v in kinds.values()) == 20
    assert status("fig:damping_gamma_rte-t5-lora", scale, README_EXECUTED).same_as == "fig:damping_gamma_cola-t5-lora"
    assert status("fig:damping_gamma_mrpc-t5-pt", scale, README_EXECUTED).text == "same figure as Fig. 8 at this scale"
    assert status("fig:damping_gamma_cifar100-vit-lora", scale, README_EXECUTED).text == f"no {scale} analogue"


def test_full_is_wired_not_executed_without_a_full_provenance():
    assert set(_kinds("full", README_EXECUTED).values()) == {"wired"}
    assert status("fig:visual_tour", "full", README_EXECUTED).text == "wired for full, not executed"
    everything = frozenset((scale, stem) for scale in SCALES for stem in CHAPTERS)
    kinds = _kinds("full", everything)
    assert set(kinds.values()) == {"regenerated"}  # 23 distinct figures and tables at full, Fig. 10 among them
    assert status("fig:damping_gamma_rte-t5-lora", "full", everything).text == "regenerated (the paper's setups)"


def test_a_chapter_without_provenance_is_wired_at_that_scale_only():
    executed = frozenset({("cpu", "evaluation")})
    assert status("fig:sample_gamma", "cpu", executed).kind == "regenerated"
    assert status("fig:sample_gamma", "smoke", executed).kind == "wired"
    assert status("tab:validation", "cpu", executed).kind == "wired"
    assert status("fig:damping_gamma_rte-t5-lora", "cpu", executed).kind == "same"  # one figure, run or not


def test_same_figure_and_no_analogue_are_read_from_the_chapters_registry(monkeypatch):
    """Give each E3 label its own cpu setup (and the ViT one): the statuses follow, nothing is hard-coded."""
    from companion.chapters import evaluation

    cpu = dict(evaluation.FIGURE_SETUPS["cpu"])
    cpu["damping"] = {f"setup-{i}": [label] for i, label in enumerate(
        ["fig:damping_gamma_cola-t5-lora", "fig:damping_gamma_rte-t5-lora", "fig:damping_gamma_sst2-t5-pt",
         "fig:damping_gamma_mrpc-t5-pt", "fig:damping_gamma_cifar100-vit-lora", "fig:damping_gamma_cifar10-mlp"])}
    monkeypatch.setitem(evaluation.FIGURE_SETUPS, "cpu", cpu)
    assert set(_kinds("cpu", README_EXECUTED).values()) == {"regenerated"}
    assert status("fig:damping_gamma_rte-t5-lora", "cpu", README_EXECUTED).text == (
        "regenerated (cpu analogue on setup-1 for the paper's rte-t5-lora)")


def test_an_analogue_for_fewer_setups_says_for_how_many_of_the_papers():
    lora = status("fig:lora_gamma", "cpu", README_EXECUTED).text
    assert "tweets-minilm-lora, standing for 1 of the paper's 8 setups" in lora
    assert "its curves are those of Fig. 2 for that setup" in lora
    assert "standing for 1 of the paper's 7 setups" in status("fig:pt_gamma", "cpu", README_EXECUTED).text
    assert "standing for 1 of the paper's 7 setups" in status("fig:curves-pt", "smoke", README_EXECUTED).text
    assert status("fig:visual_tour", "cpu", README_EXECUTED).text == (
        "regenerated (the paper's own problem or table, the same at every scale)")


def test_the_count_is_of_distinct_figures_and_tables_at_the_scale_built():
    c = counts("cpu", README_EXECUTED)
    assert (len(c["regenerated"]), len(c["same"]), len(c["absent"]), len(c["wired"])) == (20, 2, 1, 0)
    text = coverage_sentence("cpu", README_EXECUTED, "the default")
    assert text.startswith("At the cpu scale (the default), 20 of the paper's 23 labelled figures and tables")
    assert "2 are the same figure as another at this scale (Fig. 9, Fig. 11)" in text
    assert "1 has no cpu analogue (Fig. 10)" in text
    assert "full: 0 regenerated, 23 wired but not executed" in text
    assert "0 of the paper's 23" in coverage_sentence("full", README_EXECUTED)
    assert "none of the paper's 23" in coverage_sentence(None, frozenset())


def _provenance(root, scale, stem, recorded=None):
    path = root / "_build" / "executed" / scale / f"{stem}.provenance.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"scale": recorded or scale, "wall_time_s": 1.0}))


def _published(root, stem, scale):
    nb = nbformat.v4.new_notebook(metadata={"papermill": {"parameters": {"scale": scale}}})
    path = root / "book" / "generated" / f"{stem}.ipynb"
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)


def test_build_state_reads_the_published_scale_and_the_provenance_records(tmp_path):
    assert book_state(tmp_path) == (None, frozenset())
    _provenance(tmp_path, "cpu", "evaluation")
    _provenance(tmp_path, "full", "toy_problems")
    _provenance(tmp_path, "full", "optimisation", recorded="cpu")  # a record that disagrees with its folder: ignored
    for stem in CHAPTERS:
        _published(tmp_path, stem, "cpu")
    assert book_state(tmp_path) == ("cpu", frozenset({("cpu", "evaluation"), ("full", "toy_problems")}))
    _, executed = book_state(tmp_path)
    assert status("fig:visual_tour", "full", executed).kind == "regenerated"
    assert status("tab:sum-test", "full", executed).kind == "wired"
    _published(tmp_path, "setups", "smoke")
    with pytest.raises(ValueError, match="different scales"):
        book_state(tmp_path)


def test_chapter_caveats_name_what_a_heading_cites_without_its_own_figure():
    assert chapter_caveats("evaluation", "cpu") == (
        "At the cpu scale Fig. 9 is the same figure as Fig. 8 and Fig. 11 as Fig. 3; Fig. 10 has no cpu analogue.")
    assert chapter_caveats("evaluation", "full") == ""
    assert chapter_caveats("optimisation", "smoke") == ""
    with pytest.raises(ValueError, match="accepted: toy_problems"):
        chapter_caveats("nope", "cpu")


def test_bad_scale_and_label_are_named():
    with pytest.raises(ValueError, match="accepted: smoke, cpu, full"):
        status("fig:sample_gamma", "gpu", README_EXECUTED)
    with pytest.raises(KeyError, match="fig:nope"):
        produced("fig:nope", "cpu")


def test_the_coverage_page_renders_as_one_table_row_per_label():
    from markdown_it import MarkdownIt

    text = coverage_markdown(README_EXECUTED, links=True)
    tokens = MarkdownIt("commonmark").enable("table").parse(text)
    rows = [t for t in tokens if t.type == "tr_open"]
    cells = [t for t in tokens if t.type in ("th_open", "td_open")]
    assert len(rows) == 24 and len(cells) == 24 * 5
    assert ("| Fig. 11 | {doc}`Approximation quality of EF, SF and iEF </book/generated/evaluation>` | same figure as "
            "Fig. 3 at this scale | same figure as Fig. 3 at this scale | wired for full, not executed |") in text
    assert "| Fig. 10 | {doc}`" in text and "| no smoke analogue | no cpu analogue | wired for full" in text
