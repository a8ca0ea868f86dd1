"""companion.chapters.coverage: which chapter regenerates each of the paper's 23 figures and tables, what it produces at
each scale (read from the chapters' own registries), in which category a reader counts it (as the paper ran it, on an
analogue setup, a configuration table, a redraw of another figure's data, not at this scale), what a build executed (its
provenance records), and the coverage page, introduction sentence and README block rendered from it."""
from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest

from companion.chapters.coverage import (CATEGORIES, CHAPTER_OF, CHAPTERS, README_EXECUTED, SCALES, book_state,
                                         category, chapter_caveats, counts, coverage_markdown, coverage_sentence,
                                         paper_figures_and_tables, paper_setups, produced, status)
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
    assert status("fig:damping_gamma_rte-t5-lora", scale, README_EXECUTED).same_as == "fig:damping_gamma_cola-t5-lora"
    assert status("fig:damping_gamma_mrpc-t5-pt", scale, README_EXECUTED).text == "same figure as Fig. 8 at this scale"
    assert status("fig:damping_gamma_cifar100-vit-lora", scale, README_EXECUTED).text == f"no {scale} analogue"


@pytest.mark.parametrize("scale", ["smoke", "cpu"])
def test_below_full_a_reader_counts_analogues_configuration_and_redraws_apart(scale):
    """The review's count: 20 "regenerated" of 23 counted analogues, the configuration tables and Figs. 6-7 (Fig. 2's
    curves again) as regenerated. Each is now its own category, and only the toy problems are the paper's own."""
    kinds = _kinds(scale, README_EXECUTED)
    assert {k for k, v in kinds.items() if v == "paper"} == {"Fig. 1", "Fig. 4"}
    assert {k for k, v in kinds.items() if v == "config"} == {"Table 2", "Table 3", "Table 4"}
    assert {k for k, v in kinds.items() if v == "redraw"} == {"Fig. 6", "Fig. 7"}
    assert sum(v == "analogue" for v in kinds.values()) == 13
    c = counts(scale, README_EXECUTED)
    assert list(c) == list(CATEGORIES)
    assert {k: len(v) for k, v in c.items()} == {"paper": 2, "analogue": 13, "config": 3, "redraw": 4, "absent": 1,
                                                  "wired": 0}
    assert sorted(sum(c.values(), [])) == sorted(paper_figures_and_tables())  # every label counted once
    assert status("fig:lora_gamma", scale, README_EXECUTED).same_as == "fig:sample_gamma"


def test_full_is_wired_not_executed_without_a_full_provenance():
    assert set(_kinds("full", README_EXECUTED).values()) == {"wired"}
    assert status("fig:visual_tour", "full", README_EXECUTED).text == "wired for full, not executed"
    everything = frozenset((scale, stem) for scale in SCALES for stem in CHAPTERS)
    kinds = _kinds("full", everything)
    # at full every result is the paper's own (Figs. 6-7 show 8 and 7 setups, not Fig. 2's 3); Tables 2-4 restated
    assert {k for k, v in kinds.items() if v == "config"} == {"Table 2", "Table 3", "Table 4"}
    assert {v for k, v in kinds.items() if k not in ("Table 2", "Table 3", "Table 4")} == {"paper"}
    assert status("fig:damping_gamma_rte-t5-lora", "full", everything).text == (
        "regenerated as the paper ran it (the paper's setups)")


def test_table_1_stands_for_the_papers_15_setups_not_16():
    """The paper's Table 1 averages 7 prompt-tuning, 7 LoRA and the ViT setup: 15 (its text: "Fifteen different
    setups"); the MLP of E2 is in Table 8 only. The chapter's row of the MLP analogue is named apart."""
    assert len(paper_setups("tab:sum-test")) == 15 and "cifar10-mlp" not in paper_setups("tab:sum-test")
    assert len(paper_setups("tab:test")) == 15 and paper_setups("tab:test-mlp") == ("cifar10-mlp",)
    text = status("tab:sum-test", "cpu", README_EXECUTED).text
    assert "tweets-minilm-lora, tweets-minilm-pt, standing for 2 of the paper's 15 setups" in text
    assert "digits-mlp, which the paper's Table 1 does not have (the chapter reads it against Table 8)" in text
    assert "16" not in text


def test_a_chapter_without_provenance_is_wired_at_that_scale_only():
    executed = frozenset({("cpu", "evaluation")})
    assert status("fig:sample_gamma", "cpu", executed).kind == "analogue"
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
    e3 = [k for k in paper_figures_and_tables() if k.startswith("fig:damping_gamma")]
    assert {status(k, "cpu", README_EXECUTED).kind for k in e3} == {"analogue"}
    assert status("fig:damping_gamma_rte-t5-lora", "cpu", README_EXECUTED).text == (
        "regenerated on a cpu analogue: setup-1 for the paper's rte-t5-lora")


def test_an_analogue_for_fewer_setups_says_for_how_many_of_the_papers():
    lora = status("fig:lora_gamma", "cpu", README_EXECUTED).text
    assert "tweets-minilm-lora, standing for 1 of the paper's 8 setups" in lora
    assert lora.startswith("redraws Fig. 2's data") and "are those of Fig. 2 for that setup" in lora
    assert "standing for 1 of the paper's 7 setups" in status("fig:pt_gamma", "cpu", README_EXECUTED).text
    assert "standing for 1 of the paper's 7 setups" in status("fig:curves-pt", "smoke", README_EXECUTED).text
    assert status("fig:visual_tour", "cpu", README_EXECUTED).text == (
        "regenerated as the paper ran it (the paper's own problem, the same at every scale)")
    assert status("tab:license", "cpu", README_EXECUTED).text == (
        "a configuration table restated (the paper's, the same at every scale)")


def test_the_count_is_by_category_at_the_scale_built():
    text = coverage_sentence("cpu", README_EXECUTED, "the default")
    assert text.startswith("Of the paper's 23 labelled figures and tables, at the cpu scale (the default): 2 "
                           "regenerated as the paper ran them: Fig. 1, Fig. 4, the paper's own problems; 13 "
                           "regenerated on analogue setups (other models and data): Fig. 2, ")
    assert "; 3 configuration tables restated: Table 2, Table 3, Table 4;" in text
    assert ("4 figures that redraw another figure's data: Fig. 6 and Fig. 7 redraw Fig. 2's data, Fig. 9 is drawn "
            "as Fig. 8, Fig. 11 is drawn as Fig. 3; 1 not at this scale: Fig. 10.") in text
    assert "at full, 23 wired, but their chapters were not executed." in text
    assert "regenerated" not in coverage_sentence("full", README_EXECUTED).split("Other scales")[0]
    assert "none of the paper's 23" in coverage_sentence(None, frozenset())
    assert category("same") == "redraw" and category("analogue") == "analogue"


def test_the_readme_prints_the_computed_counts():
    """Every number the README's coverage paragraph prints before a category equals the registry's count at cpu."""
    import re

    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index("<!-- coverage:"):readme.index("<!-- /coverage -->")]
    paragraph = block.splitlines()[1]
    head = paragraph.split(" Other scales:")[0]
    c = counts("cpu", README_EXECUTED)
    printed = {}
    for part in head.split(": ", 1)[1].split("; "):
        n, words = re.match(r"(\d+) (.*?):", part).groups()
        printed[words] = int(n)
    expected = {}
    from companion.chapters.coverage import _number

    for k, labels in c.items():
        if labels:
            expected[_number(len(labels), k).split(" ", 1)[1]] = len(labels)
    assert printed == expected
    assert sum(printed.values()) == len(paper_figures_and_tables()) == 23


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
    assert status("fig:visual_tour", "full", executed).kind == "paper"
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
    assert "| Table 2 | {doc}`The experimental setups, their data and licences </book/generated/setups>` | a " \
           "configuration table restated" in text
