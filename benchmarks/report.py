"""The benchmark tables of ``benchmarks/README.md`` and the book, generated from the committed JSON in
``benchmarks/results/``.

    python -m benchmarks.report benchmarks/README.md   # rewrite benchmarks/README.md's block between the markers
    python -m benchmarks.report                   # print the block

Every ``benchmarks/results/*.json`` (written by a benchmark's ``--json``, schema of :mod:`benchmarks.harness`)
becomes one section: its summary table(s) as they were recorded, then a caption naming the machine, the date, the load
other processes put on the machine during the run and the exact command. The book's API page shows the same text
(``{benchmark-tables}``, rendered at build time by ``book/_ext/paper_book.py``);
``tests/companion/test_benchmarks_report.py`` keeps ``benchmarks/README.md``'s block equal to what this module produces
from the committed JSON. No number is typed.
"""
from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness import machine_line, validate

RESULTS = Path(__file__).resolve().parent / "results"
ORDER = ("step", "fvp", "paper_mlp", "conv2d", "hf_layers", "slow_paths", "evaluation",
         "damping_sweep")  # sections in this order, then the rest
START = ("<!-- benchmarks: generated from benchmarks/results/*.json by python -m benchmarks.report "
         "benchmarks/README.md; tests/companion/test_benchmarks_report.py keeps it equal -->")
END = "<!-- /benchmarks -->"
HEADINGS = {
    "step": "The op-cost table",
    "fvp": "The Fisher-vector product against its floor",
    "hf_layers": "Full-parameter Hugging Face models: per-sample gradients and one IEF step",
    "slow_paths": "Slow paths: per-sample gradients on the models people fine-tune",
    "paper_mlp": "The paper's MLP, one optimiser step",
    "conv2d": "Per-sample gradients of a CNN",
    "evaluation": "The evaluation, per checkpoint",
    "damping_sweep": "The damping sweep",
    "distributed": "The exact iEF step across processes against DDP + AdamW",
    "auto_lr": "iEF's step size: the default, lr=\"auto\" and a searched rate",
    "defaults": "iEF's default rate across label counts, beside AdamW",
}


def load(folder: str | Path = RESULTS) -> list[dict[str, Any]]:
    """Every benchmark record in ``folder`` (validated), in :data:`ORDER`, then by file name."""
    docs = []
    for path in sorted(Path(folder).glob("*.json")):
        doc = json.loads(path.read_text())
        try:
            validate(doc)
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None
        docs.append(doc)
    rank = {name: i for i, name in enumerate(ORDER)}
    return sorted(docs, key=lambda d: rank.get(d["benchmark"], len(ORDER)))


def cell(value: Any, spec: str) -> str:
    """One table cell: ``None`` and NaN as "n/a", numbers through their format spec, text escaped for a table."""
    if value is None or (isinstance(value, float) and value != value):
        return "n/a"
    if spec == "s" or isinstance(value, str):
        return str(value).replace("|", "\\|")
    return format(value, spec)


def markdown_table(table: Mapping[str, Any]) -> str:
    cols = table["columns"]
    head = "| " + " | ".join(c["header"] for c in cols) + " |"
    rule = "| " + " | ".join("---" if c["format"] == "s" else "---:" for c in cols) + " |"
    body = ["| " + " | ".join(cell(v, c["format"]) for v, c in zip(row, cols)) + " |" for row in table["rows"]]
    return "\n".join([head, rule, *body])


def caption(doc: Mapping[str, Any]) -> str:
    """Machine, date, load and command of one run."""
    load = doc.get("other_load_cores")
    busy = ("not measured" if load is None else
            f"other processes kept {load:.2f} of its {doc['machine']['cores']} CPU cores busy on average")
    avg = doc.get("load_average")
    if avg:
        busy += f" (1-min load average {avg[0]:.2f} at the start, {avg[1]:.2f} at the end)"
    return (f"Measured {doc['date'][:10]} on {machine_line(doc['machine'])}; during the run {busy}. "
            f"Command: `{doc['command']}`.")


def section(doc: Mapping[str, Any], level: str = "####", heading: bool = True) -> str:
    """One record: its heading (left out for a further record of the same benchmark), tables, notes and caption."""
    parts = [f"{level} {HEADINGS.get(doc['benchmark'], doc['benchmark'])} (`benchmarks/{doc['benchmark']}.py`)"
             ] if heading else []
    for table in doc["tables"]:
        parts.append(f"*{table['title']}.*")
        parts.append(markdown_table(table))
        if table.get("note"):
            parts.append(table["note"])
    parts.append(caption(doc))
    return "\n\n".join(parts)


def markdown(docs: Sequence[Mapping[str, Any]], level: str = "####") -> str:
    """Every record's section, or a line saying there is none."""
    if not docs:
        return "No benchmark results are committed (`benchmarks/results/*.json`)."
    first = [i == 0 or d["benchmark"] != docs[i - 1]["benchmark"] for i, d in enumerate(docs)]
    return "\n\n".join(section(d, level, heading) for d, heading in zip(docs, first))


def block(docs: Sequence[Mapping[str, Any]]) -> str:
    """``benchmarks/README.md``'s block: the generated text between :data:`START` and :data:`END`."""
    return f"{START}\n{markdown(docs)}\n{END}"


def replace_block(text: str, new_block: str, where: str = "the text") -> str:
    """``text`` with its block between the markers replaced; a clear error when the markers are missing."""
    if text.count(START) != 1 or text.count(END) != 1 or text.index(START) > text.index(END):
        raise ValueError(f"{where} must hold the benchmark markers once each, in order:\n  {START}\n  {END}")
    start, end = text.index(START), text.index(END) + len(END)
    return text[:start] + new_block + text[end:]


def update(path: str | Path, docs: Iterable[Mapping[str, Any]] | None = None) -> bool:
    """Rewrite ``path``'s block from the records (default: the committed ones); ``True`` if the file changed."""
    path = Path(path)
    docs = load() if docs is None else list(docs)
    text = path.read_text()
    new = replace_block(text, block(docs), str(path))
    if new != text:
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(new)
        tmp.replace(path)
    return new != text


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if not argv:
        print(block(load()))
        return 0
    for path in argv:
        print(f"{path}: {'rewritten' if update(path) else 'up to date'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
