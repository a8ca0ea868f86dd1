"""The paper as data: the label -> number map (``companion/paper/labels.json``); the coverage registry is
tests/companion/test_chapters_coverage.py.

Known numbers were read off the LaTeX by hand: equations are numbered globally (``eqn:EF_dl`` carries a ``\\notag``
and has none, so ``eqn:kappa_EF`` is (6)); theorems, lemmas and assumptions share a per-section counter; appendix
sections are lettered (A relation iEF/GN/NGD, B toy, C convergence, ..., H experiment details).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tools import paper_labels

from companion.paper import cite, cite_keys, labels

ROOT = Path(__file__).resolve().parents[2]
TEX = paper_labels.TEX  # the paper beside the repository (tools.paper_labels.find_paper)


@pytest.mark.parametrize("label, text", [
    ("eqn:prob_loss", "Eq. (1)"),
    ("eqn:EF_lsq", "Eq. (5)"),
    ("eqn:kappa_EF", "Eq. (6)"),  # after the un-numbered eqn:EF_dl
    ("eqn:iEF_lsq", "Eq. (8)"),
    ("fig:visual_tour", "Fig. 1"),
    ("fig:logistic-regression", "Fig. 4"),  # the appendix B figure, after Figs. 2-3 of the main text
    ("tab:sum-test", "Table 1"),
    ("tab:license", "Table 4"),
    ("sec:iEF", "Sec. 5"),
    ("sec:app-toy-lls-2pt", "Appendix B"),
    ("sec:app-optimiser", "Appendix H.2"),
    ("sec:app-eval-complexity", "Appendix F.1.1"),
    ("sec:opt-exp", "Sec. 7 (E2)"),  # a \paragraph: cited by its section
    ("ass:full_batch_iEF", "Assumption 5.1"),
    ("theorem:sublinear-convergence", "Theorem 5.3"),
    ("theorem:linear-convergence", "Theorem 5.4"),
    ("lemma:dln_dt", "Lemma C.1"),
    ("ass:strong-convex-F", "Assumption C.2"),
    ("alg:iEF", "Algorithm 1"),
    ("alg:CG", "Algorithm 5"),
])
def test_known_labels_have_the_papers_numbers(label, text):
    assert cite(label) == text


def test_unnumbered_equations_are_cited_by_their_neighbour_and_unknown_labels_refused():
    assert cite("eqn:EF_dl") == "the unnumbered equation after Eq. (5)"  # its \notag un-steps the counter
    assert cite("eqn:s_ief") == "the unnumbered equation after Eq. (8)"  # equation*
    assert labels()["eqn:s_ief"]["number"] is None
    assert cite_keys("paper: sec:app-optimiser, ``eqn:iEF_lsq``, fig:nope") == "paper: Appendix H.2, Eq. (8), fig:nope"
    with pytest.raises(KeyError, match="did you mean eqn:iEF_lsq"):
        cite("eqn:iEF_lsqq")


@pytest.mark.skipif(not TEX.exists(), reason="the paper's LaTeX source is not on this machine")
def test_committed_map_is_what_the_latex_gives():
    from tools.paper_labels import parse, strip_comments

    tex = TEX.read_text(encoding="utf-8")
    assert parse(tex) == labels()
    assert set(re.findall(r"\\label\{([^}]+)\}", strip_comments(tex))) == set(labels())


def test_labels_json_is_package_data():
    text = (ROOT / "companion" / "pyproject.toml").read_text()
    assert '"companion.paper" = ["labels.json"]' in text
    json.loads((ROOT / "companion" / "paper" / "labels.json").read_text())
