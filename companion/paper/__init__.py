"""The paper as data: its label -> number map (``labels.json``, made by ``python -m tools.paper_labels`` from the LaTeX
source), and how its reader knows a label (:func:`cite`, :func:`cite_keys`).

A leaf of the package (``ARCHITECTURE.md``): it imports the standard library only, so every layer may cite the paper.
Which chapter regenerates each of the paper's figures and tables is the book's business:
:mod:`companion.chapters.coverage`.
"""
from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources


@lru_cache(maxsize=1)
def labels() -> dict[str, dict]:
    """Every ``\\label`` of the paper: ``{"eqn:iEF_lsq": {"kind": "equation", "number": "7", "text": "Eq. (7)"}}``."""
    return json.loads(resources.files(__name__).joinpath("labels.json").read_text(encoding="utf-8"))


def cite(label: str) -> str:
    """How the paper's reader knows ``label``: ``cite("eqn:iEF_lsq") == "Eq. (7)"``.

    ``KeyError`` names close labels when ``label`` is not in the paper."""
    known = labels()
    if label not in known:
        import difflib

        close = difflib.get_close_matches(label, known, n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise KeyError(f"{label!r} is not a label of the paper{hint}")
    return known[label]["text"]


_KEY = None


def cite_keys(text: str) -> str:
    """``text`` with every label key of the paper (bare or in double backquotes) replaced by how the paper's reader
    knows it: ``"paper: sec:app-optimiser"`` -> ``"paper: Appendix H.2"``. Unknown keys are left as they are."""
    import re

    global _KEY
    if _KEY is None:
        _KEY = re.compile(r"(?:``)?\b((?:eqn|fig|tab|sec|lemma|theorem|ass|alg):[A-Za-z0-9_\-]+)(?:``)?")
    known = labels()
    return _KEY.sub(lambda m: known[m.group(1)]["text"] if m.group(1) in known else m.group(0), text)
