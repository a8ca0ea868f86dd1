"""Which of the paper's figures and tables the book regenerates, at each scale, counted as a reader counts them.

A label at a scale falls in one of the categories of :data:`CATEGORIES`: regenerated as the paper ran it (its own toy
problems at every scale, its setups at ``full``), regenerated on an analogue setup (other models and data, below
``full``), a configuration table restated (the setups chapter's Tables 2-4), a figure that redraws another figure's
data (an appendix figure whose setups at this scale are those of the figure it extends, or two labels drawn as one
image), not at this scale, or wired but not executed by this build.

:data:`CHAPTER_OF` names the chapter (``notebooks/<stem>.ipynb``) wired to regenerate each of the paper's 23 labelled
figures and tables. What that chapter *produces* for a label at a scale is not typed here: :func:`produced` reads it
from the chapter's own registries (:func:`companion.chapters.evaluation.figure_setups` for the evaluation chapter,
:func:`companion.experiments.setups.e2_setups` for E2), so two labels drawn as one image at a scale (Figs. 3 and 11 at
``cpu``) and a label with no analogue at a scale (Fig. 10 below ``full``) are found, not asserted. Whether a chapter
was *executed* at a scale comes from its provenance record (``_build/executed/<scale>/<stem>.provenance.json``,
written by ``tools.book execute``): :func:`status` is a pure function of the registry, the scale and those records.

The book's coverage page and the introduction's sentence are rendered from it at build time (``book/_ext``), for the
scale the book was built at (:func:`book_state`); the README's statement (``python -m companion.chapters.coverage
README.md``) is the same function at the default ``cpu`` scale, claiming execution only at the scales the repository's
own builds run (:data:`README_EXECUTED`), and ``tests/companion/test_chapters_coverage.py`` keeps it equal.
:func:`chapter_caveats` gives a chapter the sentence saying which labels its headings name are, at its scale, another
label's figure or have no analogue.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from companion.paper import cite, labels

SCALES = ("smoke", "cpu", "full")

# notebook stem (notebooks/<stem>.ipynb) -> chapter title, as in the book's navigation
CHAPTERS = {
    "toy_problems": "Toy problems: SGD, NGD, iEF and EF on two parameters",
    "convergence": "Convergence of the iEF flow, measured on small networks",
    "setups": "The experimental setups, their data and licences",
    "train": "Training runs and the learning-rate search",
    "evaluation": "Approximation quality of EF, SF and iEF",
    "optimisation": "Optimisation experiments (E2)",
}

CHAPTER_OF: dict[str, str] = {
    "fig:visual_tour": "toy_problems", "fig:logistic-regression": "toy_problems",
    "fig:sample_gamma": "evaluation", "fig:damping_gamma_cola-t5-lora": "evaluation",
    "fig:sample_blockdiag_gamma": "evaluation", "fig:lora_gamma": "evaluation", "fig:pt_gamma": "evaluation",
    "fig:damping_gamma_sst2-t5-pt": "evaluation", "fig:damping_gamma_mrpc-t5-pt": "evaluation",
    "fig:damping_gamma_cifar100-vit-lora": "evaluation", "fig:damping_gamma_rte-t5-lora": "evaluation",
    "fig:damping_gamma_cifar10-mlp": "evaluation",
    "fig:curves-pt": "optimisation", "fig:curves-lora": "optimisation", "fig:mlp-curves": "optimisation",
    "tab:sum-test": "optimisation", "tab:train": "optimisation", "tab:validation": "optimisation",
    "tab:test": "optimisation", "tab:test-mlp": "optimisation",
    "tab:glue-details": "setups", "tab:train-epochs": "setups", "tab:license": "setups",
}
# The evaluation chapter's figure keys (companion.chapters.evaluation.FIGURE_SETUPS) of the labels that are not E3
# figures.
_E1_KEYS = {"fig:sample_gamma": "sample_gamma", "fig:lora_gamma": "lora_gamma", "fig:pt_gamma": "pt_gamma",
            "fig:sample_blockdiag_gamma": "blockdiag"}
# E2 figures/tables drawn for one fine-tuning method's setups (the optimisation notebook's `figure_of`).
_E2_METHOD = {"fig:curves-pt": ("pt",), "fig:curves-lora": ("lora",), "fig:mlp-curves": ("scratch",),
              "tab:test-mlp": ("scratch",), "tab:train": ("pt", "lora"), "tab:validation": ("pt", "lora"),
              "tab:test": ("pt", "lora")}
# Appendix figures that re-plot another figure's measurement (E1) for more setups.
_SAME_DATA = {"fig:lora_gamma": "fig:sample_gamma", "fig:pt_gamma": "fig:sample_gamma"}
# The setups of the paper's own table, where the chapter shows more: the paper's Table 1 averages its 15 GLUE and
# CIFAR100 setups (prompt tuning and LoRA); the chapter's rows add its MLPs, read against the MLP's own table.
_PAPER_METHOD = {"tab:sum-test": ("pt", "lora")}
# Chapters that restate the paper's configuration (its setups, data and licences) rather than a result.
CONFIGURATION_CHAPTERS = ("setups",)
# A label's category at a scale (Status.kind -> the words a reader counts; "same" counts as a redraw).
CATEGORIES = {
    "paper": "regenerated as the paper ran it",
    "analogue": "regenerated on an analogue setup (other model and data)",
    "config": "a configuration table restated",
    "redraw": "a figure that redraws another figure's data",
    "absent": "not at this scale",
    "wired": "wired, but its chapter was not executed",
}
_CATEGORY_OF = {"paper": "paper", "analogue": "analogue", "config": "config", "redraw": "redraw", "same": "redraw",
                "absent": "absent", "wired": "wired"}
# The committed README claims execution only where the repository's own builds execute: CI builds smoke, `make book`
# builds cpu; a full build's provenance lives in _build/ and is never committed.
README_EXECUTED = frozenset((scale, stem) for scale in ("smoke", "cpu") for stem in CHAPTERS)


@dataclass(frozen=True)
class Output:
    """What a chapter writes for a label at a scale: ``key`` names the image or table (two labels with one key are
    one figure), ``setups`` the setups it shows (empty: the paper's own problem or table, the same at every scale)."""

    chapter: str
    key: str
    setups: tuple[str, ...]


@dataclass(frozen=True)
class Status:
    """A label at a scale: ``kind`` is ``paper`` (regenerated as the paper ran it), ``analogue`` (on other models and
    data), ``config`` (a configuration table restated), ``redraw`` (the data of ``same_as``, drawn again), ``same``
    (the same image as ``same_as``), ``absent`` (nothing at this scale) or ``wired`` (produced by the chapter at this
    scale, but no build's provenance says it ran); ``text`` the words of the coverage table's cell. Its category for
    the counts is :func:`category`."""

    kind: str
    chapter: str | None
    text: str
    same_as: str | None = None


def paper_figures_and_tables() -> list[str]:
    """Every ``fig:``/``tab:`` label of the paper, in the paper's order (figures, then tables)."""
    known = labels()
    keys = [k for k in known if k.startswith(("fig:", "tab:"))]
    return sorted(keys, key=lambda k: (k.startswith("tab:"), int(known[k]["number"])))


def _check_scale(scale: str) -> None:
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; accepted: {', '.join(SCALES)}")


def produced(label: str, scale: str) -> Output | None:
    """What :data:`CHAPTER_OF`'s chapter writes for ``label`` at ``scale`` (None: nothing, no analogue there).

    Raises:
        KeyError: ``label`` is not one of the paper's figures and tables.
        ValueError: unknown ``scale``.
    """
    _check_scale(scale)
    if label not in CHAPTER_OF:
        raise KeyError(f"{label!r} is not a figure or table of the paper; known: {', '.join(CHAPTER_OF)}")
    chapter = CHAPTER_OF[label]
    if chapter == "evaluation":
        from companion.chapters.evaluation import figure_setups

        fig, _ = figure_setups(scale)
        if label in _E1_KEYS:
            return Output(chapter, _E1_KEYS[label], tuple(fig[_E1_KEYS[label]])) if fig[_E1_KEYS[label]] else None
        shown = [setup for setup, cited in fig["damping"].items() if label in cited]
        return Output(chapter, f"damping_gamma_{shown[0]}", (shown[0],)) if shown else None
    if chapter == "optimisation":
        from companion.experiments.setups import e2_setups, resolve

        methods = _E2_METHOD.get(label)
        setups = tuple(s for s in e2_setups(scale) if methods is None or resolve(s, scale).method in methods)
        return Output(chapter, label, setups) if setups else None
    return Output(chapter, label, ())


def _method(setup: str, scale: str) -> str:
    from companion.experiments.setups import resolve

    return resolve(setup, scale).method


def paper_setups(label: str) -> tuple[str, ...]:
    """The setups the paper's own figure or table shows (empty: its own problem or table)."""
    setups = produced(label, "full").setups
    methods = _PAPER_METHOD.get(label)
    return tuple(s for s in setups if methods is None or _method(s, "full") in methods)


def _regenerated(label: str, out: Output, scale: str) -> tuple[str, str, str | None]:
    """``(kind, cell text, same_as)`` of a label its chapter ran at ``scale``: as the paper ran it, a configuration
    table, a redraw of another figure's data or an analogue (naming its setups and for how many of the paper's)."""
    if not out.setups:
        if out.chapter in CONFIGURATION_CHAPTERS:
            return "config", "a configuration table restated (the paper's, the same at every scale)", None
        return "paper", "regenerated as the paper ran it (the paper's own problem, the same at every scale)", None
    if scale == "full":
        return "paper", "regenerated as the paper ran it (the paper's setups)", None
    paper = paper_setups(label)
    methods = _PAPER_METHOD.get(label)
    standing = [s for s in out.setups if methods is None or _method(s, scale) in methods]
    extra = [s for s in out.setups if s not in standing]
    if len(standing) < len(paper):
        stands = f"{', '.join(standing)}, standing for {len(standing)} of the paper's {len(paper)} setups"
    else:
        stands = f"{', '.join(standing)} for the paper's {', '.join(paper)}"
    if extra:
        stands += (f"; and {', '.join(extra)}, which the paper's {cite(label)} does not have (the chapter reads "
                   f"{'it' if len(extra) == 1 else 'them'} against {cite('tab:test-mlp')})")
    base = _SAME_DATA.get(label)
    if base and set(out.setups) <= set(produced(base, scale).setups):
        one = "that setup" if len(out.setups) == 1 else "those setups"
        return ("redraw", f"redraws {cite(base)}'s data: its curves for {stands}, are those of {cite(base)} for "
                          f"{one}", base)
    return "analogue", f"regenerated on a {scale} analogue: {stands}", None


def status(label: str, scale: str, executed: frozenset[tuple[str, str]] | set[tuple[str, str]]) -> Status:
    """The coverage of ``label`` at ``scale``, given the ``(scale, chapter)`` pairs whose provenance exists.

    Args:
        label: a ``fig:``/``tab:`` label of the paper.
        scale: ``smoke``, ``cpu`` or ``full``.
        executed: the chapters executed at each scale (:func:`executed_chapters`, or :data:`README_EXECUTED`).

    Returns:
        ``absent`` when the chapter has nothing for it at ``scale``; ``same`` when an earlier label (paper order) is
        the same image or table at ``scale``; ``wired`` if the chapter did not run at ``scale``; else ``paper``,
        ``config``, ``redraw`` or ``analogue`` (:func:`_regenerated`).

    Raises:
        KeyError, ValueError: as :func:`produced`.
    """
    out = produced(label, scale)
    if out is None:
        return Status("absent", CHAPTER_OF[label], f"no {scale} analogue")
    for earlier in paper_figures_and_tables():
        if earlier == label:
            break
        other = produced(earlier, scale)
        if other is not None and (other.chapter, other.key) == (out.chapter, out.key):
            return Status("same", out.chapter, f"same figure as {cite(earlier)} at this scale", earlier)
    if (scale, out.chapter) not in executed:
        return Status("wired", out.chapter, f"wired for {scale}, not executed")
    kind, text, same_as = _regenerated(label, out, scale)
    return Status(kind, out.chapter, text, same_as)


def category(kind: str) -> str:
    """The category a status ``kind`` counts in (:data:`CATEGORIES`; ``same`` counts as ``redraw``)."""
    return _CATEGORY_OF[kind]


def executed_chapters(root: Path) -> frozenset[tuple[str, str]]:
    """``(scale, chapter)`` for every provenance record ``root/_build/executed/<scale>/<chapter>.provenance.json``
    whose own ``scale`` field agrees (``python -m tools.book execute`` writes them)."""
    found = set()
    for scale in SCALES:
        for stem in CHAPTERS:
            record = Path(root) / "_build" / "executed" / scale / f"{stem}.provenance.json"
            if record.exists() and json.loads(record.read_text()).get("scale") == scale:
                found.add((scale, stem))
    return frozenset(found)


def book_state(root: Path) -> tuple[str | None, frozenset[tuple[str, str]]]:
    """The scale the book in ``root`` was built at (the papermill ``scale`` of the published chapters in
    ``book/generated``; None when none is published) and :func:`executed_chapters`.

    Raises:
        ValueError: the published chapters were executed at different scales (a stale page would be misdescribed).
    """
    scales = {}
    for path in sorted((Path(root) / "book" / "generated").glob("*.ipynb")):
        meta = json.loads(path.read_text()).get("metadata", {}).get("papermill", {})
        scales[path.stem] = meta.get("parameters", {}).get("scale")
    found = set(scales.values())
    if len(found) > 1:
        raise ValueError(f"the published chapters were executed at different scales: {scales}; rebuild the book")
    return (found.pop() if found else None), executed_chapters(root)


def counts(scale: str, executed) -> dict[str, list[str]]:
    """The labels of each category of :data:`CATEGORIES` at ``scale``, in the paper's order (each label once)."""
    out: dict[str, list[str]] = {c: [] for c in CATEGORIES}
    for label in paper_figures_and_tables():
        out[category(status(label, scale, executed).kind)].append(label)
    return out


def chapter_caveats(chapter: str, scale: str) -> str:
    """One sentence for a chapter's page: which labels its headings name that are, at ``scale``, the same figure as
    another or have no analogue ("" when none), e.g. for the evaluation chapter at cpu: "At the cpu scale Fig. 9 is
    the same figure as Fig. 8 and Fig. 11 as Fig. 3; Fig. 10 has no cpu analogue."

    Raises:
        ValueError: unknown ``chapter`` or ``scale``.
    """
    if chapter not in CHAPTERS:
        raise ValueError(f"unknown chapter {chapter!r}; accepted: {', '.join(CHAPTERS)}")
    _check_scale(scale)
    mine = [label for label in paper_figures_and_tables() if CHAPTER_OF[label] == chapter]
    outs = [(label, produced(label, scale)) for label in mine]
    pairs = [(label, status(label, scale, frozenset()).same_as) for label, out in outs if out is not None]
    pairs = [(a, b) for a, b in pairs if b is not None]
    absent = [label for label, out in outs if out is None]
    parts = []
    if pairs:
        first, *rest = pairs
        parts.append(f"{cite(first[0])} is the same figure as {cite(first[1])}"
                     + "".join(f" and {cite(a)} as {cite(b)}" for a, b in rest))
    if absent:
        parts.append(f"{_cites(absent)} {'has' if len(absent) == 1 else 'have'} no {scale} analogue")
    return f"At the {scale} scale {'; '.join(parts)}." if parts else ""


def _cites(keys: list[str]) -> str:
    return ", ".join(cite(k) for k in keys)


def _redraws(scale: str, executed, labels: list[str]) -> str:
    """``Fig. 6 and Fig. 7 redraw Fig. 2's data; Fig. 9 is drawn as Fig. 8`` for the redraw category's labels."""
    by_base: dict[str, list[str]] = {}
    same = []
    for label in labels:
        s = status(label, scale, executed)
        if s.kind == "same":
            same.append(f"{cite(label)} is drawn as {cite(s.same_as)}")
        else:
            by_base.setdefault(s.same_as, []).append(label)
    parts = [f"{' and '.join(cite(x) for x in xs)} {'redraws' if len(xs) == 1 else 'redraw'} {cite(base)}'s data"
             for base, xs in by_base.items()] + same
    return ", ".join(parts)


def _number(n: int, category_: str) -> str:
    """``"2 regenerated as the paper ran them"``: a category's count and its words (plural where it reads so)."""
    words = {"paper": ("regenerated as the paper ran it", "regenerated as the paper ran them"),
             "analogue": ("regenerated on an analogue setup (other model and data)",
                          "regenerated on analogue setups (other models and data)"),
             "config": ("a configuration table restated", "configuration tables restated"),
             "redraw": ("a figure that redraws another figure's data", "figures that redraw another figure's data"),
             "absent": ("not at this scale", "not at this scale"),
             "wired": ("wired, but its chapter was not executed", "wired, but their chapters were not executed")}
    one, many = words[category_]
    return f"{n} {one if n == 1 else many}"


def coverage_sentence(scale: str | None, executed, where: str = "the scale this book was built at") -> str:
    """The introduction's and the README's count, as a reader counts: of the paper's labelled figures and tables,
    how many at ``scale`` (the scale built, described as ``where``; None: no chapter published) fall in each category
    of :data:`CATEGORIES`, naming them, then the other scales' counts."""
    total = len(paper_figures_and_tables())
    if scale is None:
        return f"No chapter of this book has been executed yet, so none of the paper's {total} labelled figures and " \
               "tables is regenerated here."
    c = counts(scale, executed)
    named = {"paper": lambda xs: _cites(xs) + (", the paper's own problems" if scale != "full" else ""),
             "analogue": _cites, "config": _cites, "redraw": lambda xs: _redraws(scale, executed, xs),
             "absent": _cites, "wired": lambda xs: "all" if len(xs) == total else _cites(xs)}
    parts = [f"{_number(len(xs), k)}: {named[k](xs)}" for k, xs in c.items() if xs]
    others = []
    for other in SCALES:
        if other != scale:
            o = counts(other, executed)
            others.append(f"at {other}, " + ", ".join(_number(len(xs), k) for k, xs in o.items() if xs))
    return (f"Of the paper's {total} labelled figures and tables, at the {scale} scale ({where}): "
            + "; ".join(parts) + ". Other scales: " + "; ".join(others) + ".")


def coverage_markdown(executed, links: bool = False) -> str:
    """A markdown table: one row per figure/table of the paper, its chapter, and per scale its :func:`status`
    (``links``: the chapter as a link of the book; otherwise the notebook's path, and the label's key)."""
    def chapter(stem: str) -> str:
        return f"{{doc}}`{CHAPTERS[stem]} </book/generated/{stem}>`" if links else f"`notebooks/{stem}.ipynb`"

    key = "" if links else " label |"  # the book cites the paper by its numbers only; the README also names the key
    rows = [f"| paper |{key} chapter | " + " | ".join(SCALES) + " |",
            "| --- |" + " --- |" * (len(SCALES) + 1 + (not links))]
    for label in paper_figures_and_tables():
        cells = [status(label, scale, executed).text for scale in SCALES]
        rows.append(f"| {cite(label)} |" + ("" if links else f" `{label}` |") + f" {chapter(CHAPTER_OF[label])} | "
                    + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


README_START = ("<!-- coverage: generated from companion/chapters/coverage.py; "
                "tests/companion/test_chapters_coverage.py keeps it equal to the registry -->")
README_END = "<!-- /coverage -->"


# where the README's map links each chapter: its executed notebook as the cpu build recorded it (tools/book/record.py),
# opened on the repository's web page with its figures (the source in notebooks/ holds no outputs)
RECORDED = "book/recorded/cpu"


def chapter_map(scale: str, executed) -> str:
    """The README's map: one row per chapter (linked to its recorded notebook, :data:`RECORDED`), the paper's figures
    and tables it regenerates in one column, a mark on each label that is, at ``scale``, another label's figure (1),
    has no analogue (2) or redraws another figure's data (3), and the footnote saying so (the per-scale table is the
    book's coverage page)."""
    rows = ["| chapter | the paper's figures and tables |", "| --- | --- |"]
    same, absent, redraw = [], [], []
    for stem in CHAPTERS:
        cells = []
        for label in (k for k in paper_figures_and_tables() if CHAPTER_OF[k] == stem):
            s = status(label, scale, executed)
            mark = ""
            if s.kind == "same":
                same.append(f"{cite(label)} is drawn as {cite(s.same_as)}")
                mark = "¹"
            elif s.kind == "absent":
                absent.append(cite(label))
                mark = "²"
            elif s.kind == "redraw":
                redraw.append(label)
                mark = "³"
            cells.append(cite(label) + mark)
        if cells:
            rows.append(f"| [{CHAPTERS[stem]}]({RECORDED}/{stem}.ipynb) | {', '.join(cells)} |")
    notes = []
    if same:
        notes.append(f"¹ At the {scale} scale " + ", ".join(same) + ".")
    if absent:
        notes.append(f"² No {scale} analogue: {', '.join(absent)}.")
    if redraw:
        notes.append(f"³ At the {scale} scale {_redraws(scale, executed, redraw)} (the same setup's curves).")
    return "\n".join(rows) + "\n\n" + " ".join(notes) + "\n"


def readme_block() -> str:
    """The README's coverage statement at the default cpu scale: the sentence and the chapter map, between the
    markers (the per-scale, per-label table is the book's coverage page)."""
    note = ("The README states what the repository's own builds execute (CI: smoke; `make book`: cpu); a full "
            "build's provenance is not committed, so full is stated as wired, not executed.")
    sentence = coverage_sentence("cpu", README_EXECUTED, "the default, built by `make book`")
    return f"{README_START}\n{sentence} {note}\n\n{chapter_map('cpu', README_EXECUTED)}{README_END}"


def update_readme(path) -> None:
    """Rewrite the README's coverage block from the registry (``python -m companion.chapters.coverage README.md``)."""
    text = Path(path).read_text()
    start, end = text.index(README_START), text.index(README_END) + len(README_END)
    Path(path).write_text(text[:start] + readme_block() + text[end:])


if __name__ == "__main__":
    import sys

    update_readme(sys.argv[1] if len(sys.argv) > 1 else "README.md")
