"""Derive the paper's ``\\label`` -> printed number map from its LaTeX source, once, into
``companion/paper/labels.json``.

    python -m tools.paper_labels [--tex /work/shared/paper/ief-paper.tex] [--check]

The book cites the paper as its reader knows it ("Eq. (7)", "Fig. 3", "Appendix C.2", "Lemma C.1"), never by a raw
label key. This reproduces LaTeX's numbering for the constructs the paper uses (``article`` class, amsmath, amsthm):

- sections ``1, 2, ...``; after ``\\appendix`` lettered ``A, B, ...``; subsections ``A.1``, subsubsections ``A.1.1``;
  ``\\section*`` is unnumbered; ``\\subsection[short]{...}`` is numbered like any other;
- ``equation`` is numbered globally (no ``\\numberwithin``); ``equation*`` is not; amsmath's ``\\notag`` /
  ``\\nonumber`` inside ``equation`` un-steps the counter, so that equation has no number (``null`` here);
- ``theorem`` is numbered within sections (``\\newtheorem{theorem}{Theorem}[section]``) and ``lemma`` and
  ``assumption`` share its counter: Assumption 5.1, Theorem 5.3, Lemma C.1;
- ``figure``, ``table`` and ``algorithm`` are numbered globally, stepped by ``\\caption``;
- ``\\paragraph`` is unnumbered: its label is cited as the section holding it with the paragraph's short name
  ("Sec. 7 (E2)"); a label inside ``equation*`` or an un-numbered ``equation`` has number ``null`` and is
  cited as "the unnumbered equation after Eq. (n)";
- a ``\\label`` takes the number of the last counter stepped before it (LaTeX's ``\\@currentlabel``).

Comments (``%`` to the end of a line) are dropped first, so commented-out labels and floats do not count.
``--check`` fails when the committed JSON differs from what the source gives now.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def find_paper() -> Path:
    """The paper's LaTeX source: ``$IEF_PAPER_TEX``, else ``shared/paper/ief-paper.tex`` beside the repository (where
    the project's machines and CI keep it), else the project machine's ``/work/shared``."""
    import os

    candidates = [os.environ.get("IEF_PAPER_TEX"), ROOT.parent / "shared" / "paper" / "ief-paper.tex",
                  "/work/shared/paper/ief-paper.tex"]
    for candidate in candidates:
        if candidate and Path(candidate).exists():
            return Path(candidate)
    return Path(candidates[1])


TEX = find_paper()
OUTPUT = ROOT / "companion" / "paper" / "labels.json"

_TOKEN = re.compile(
    r"\\(?P<cmd>appendix|section|subsection|subsubsection|paragraph|caption|label|notag|nonumber|begin|end)\b"
    r"(?P<star>\*)?"
)
_THEOREM_LIKE = {"theorem": "Theorem", "lemma": "Lemma", "assumption": "Assumption"}
_FLOATS = {"figure": "Fig.", "table": "Table", "algorithm": "Algorithm"}


def strip_comments(tex: str) -> str:
    """Drop ``%`` comments (an escaped ``\\%`` stays)."""
    return "\n".join(re.sub(r"(?<!\\)%.*", "", line) for line in tex.splitlines())


def _braced(tex: str, start: int) -> tuple[str, int]:
    """The content of the ``{...}`` group starting at or after ``start`` (nested braces); and the index after it."""
    i = tex.index("{", start)
    depth = 0
    for j in range(i, len(tex)):
        if tex[j] == "{" and tex[j - 1] != "\\":
            depth += 1
        elif tex[j] == "}" and tex[j - 1] != "\\":
            depth -= 1
            if depth == 0:
                return tex[i + 1: j], j + 1
    raise ValueError(f"unbalanced braces from offset {i}")


def _alph(n: int) -> str:
    return chr(ord("A") + n - 1)


def parse(tex: str) -> dict[str, dict]:
    """Every ``\\label`` of the document body with its kind, printed number and how the book cites it."""
    tex = strip_comments(tex)
    body = tex[tex.index("\\begin{document}"):]
    appendix = False
    sec = sub = subsub = 0
    counters = {"equation": 0, "theorem": 0, "figure": 0, "table": 0, "algorithm": 0}
    current: tuple[str, str | None] = ("document", None)  # (kind, number) of the last stepped counter
    env_stack: list[str] = []
    in_equation: list[str] = []  # labels of the open equation (a later \notag un-numbers them)
    labels: dict[str, dict] = {}

    def section_number(*parts: int) -> str:
        head = _alph(parts[0]) if appendix else str(parts[0])
        return ".".join([head, *map(str, parts[1:])])

    for m in _TOKEN.finditer(body):
        cmd, star = m.group("cmd"), m.group("star")
        if cmd == "appendix":
            appendix, sec, sub, subsub = True, 0, 0, 0
        elif cmd in ("section", "subsection", "subsubsection"):
            if star:
                continue
            if cmd == "section":
                sec, sub, subsub = sec + 1, 0, 0
                counters["theorem"] = 0  # \newtheorem{theorem}{Theorem}[section]
                current = ("section", section_number(sec))
            elif cmd == "subsection":
                sub, subsub = sub + 1, 0
                current = ("section", section_number(sec, sub))
            else:
                subsub += 1
                current = ("section", section_number(sec, sub, subsub))
        elif cmd == "paragraph":  # unnumbered: cited as its section, with the paragraph's short name ("E2")
            title, _ = _braced(body, m.end())
            current = ("paragraph", f"{section_number(sec)} ({title.split(':')[0].strip()})")
        elif cmd == "begin":
            env, _ = _braced(body, m.end())
            env_stack.append(env)
            if env in ("equation", "equation*"):
                in_equation = []
            if env == "equation":
                counters["equation"] += 1
                current = ("equation", str(counters["equation"]))
            elif env == "equation*":
                current = ("equation*", str(counters["equation"]))
            elif env in _THEOREM_LIKE:
                counters["theorem"] += 1
                current = (env, f"{section_number(sec)}.{counters['theorem']}")
        elif cmd == "end":
            env, _ = _braced(body, m.end())
            if env_stack and env_stack[-1] == env:
                env_stack.pop()
        elif cmd in ("notag", "nonumber"):
            if "equation" in env_stack and current[0] == "equation":
                counters["equation"] -= 1  # amsmath's \nonumber: the equation has no number
                current = ("equation*", str(counters["equation"]))
                for key in in_equation:  # labels placed before the \notag
                    labels[key].update(kind="equation*", number=None, text=cite_text(*current, appendix))
        elif cmd == "caption":
            float_env = next((e for e in reversed(env_stack) if e in _FLOATS), None)
            if float_env is not None:
                counters[float_env] += 1
                current = (float_env, str(counters[float_env]))
        elif cmd == "label":
            key, _ = _braced(body, m.end())
            kind, number = current
            labels[key] = {"kind": kind, "number": number, "text": cite_text(kind, number, appendix)}
            if kind == "equation*":
                labels[key]["number"] = None
            if kind == "equation":
                in_equation.append(key)
    return labels


def cite_text(kind: str, number: str | None, in_appendix: bool) -> str | None:
    """How the paper's reader knows it: "Eq. (7)", "Fig. 3", "Table 2", "Sec. 4.1", "Appendix C.2", "Lemma C.1"."""
    if number is None:
        return None
    if kind == "equation":
        return f"Eq. ({number})"
    if kind == "equation*":  # ``number``: the last numbered equation before it
        return f"the unnumbered equation after Eq. ({number})"
    if kind in ("section", "paragraph"):
        return f"{'Appendix' if in_appendix else 'Sec.'} {number}"
    if kind in _FLOATS:
        return f"{_FLOATS[kind]} {number}"
    if kind in _THEOREM_LIKE:
        return f"{_THEOREM_LIKE[kind]} {number}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.paper_labels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tex", type=Path, default=TEX)
    parser.add_argument("--check", action="store_true", help="fail if the committed map is out of date")
    args = parser.parse_args(argv)
    labels = parse(args.tex.read_text(encoding="utf-8"))
    text = json.dumps(labels, indent=1, sort_keys=True) + "\n"
    if args.check:
        if OUTPUT.read_text() != text:
            print(f"{OUTPUT} is out of date: run python -m tools.paper_labels", file=sys.stderr)
            return 1
        return 0
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(text)
    print(f"{len(labels)} labels -> {OUTPUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
