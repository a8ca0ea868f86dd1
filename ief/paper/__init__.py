"""The paper as data: its label -> number map (``labels.json``, made by ``python -m tools.paper_labels`` from the LaTeX
source) and the registry of which chapter regenerates each of its figures and tables (:mod:`ief.paper.coverage`)."""
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

    ``KeyError`` names close labels when ``label`` is not in the paper; ``ValueError`` for an unnumbered one."""
    known = labels()
    if label not in known:
        import difflib

        close = difflib.get_close_matches(label, known, n=3, cutoff=0.5)
        raise KeyError(f"{label!r} is not a label of the paper" + (f"; did you mean {', '.join(close)}?" if close else ""))
    text = known[label]["text"]
    if text is None:
        raise ValueError(f"{label!r} labels an unnumbered {known[label]['kind']} of the paper: cite a neighbour")
    return text
