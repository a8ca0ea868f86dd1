"""The paper's E2 numbers (ief.experiments.paper_results): every transcribed cell against the LaTeX rows."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tools import paper_labels

from ief.experiments.paper_results import TABLES, paper_results, paper_source

TASK_ORDER = ["glue", "cola", "sst2", "mrpc", "qqp", "mnli", "qnli", "rte", "cifar100", "cifar10"]
ROW_NAME = {"adamw": "AdamW", "adafactor": "Adafactor", "sgd": "SGD", "ef": "EF", "sf": "SF", "ief": "iEF",
            "adam": "Adam"}
PAPER = paper_labels.TEX  # the paper beside the repository (tools.paper_labels.find_paper)


def _blocks() -> dict[str, str]:
    parts = re.split(r"^% ---- (tab:[\w-]+): lines .*$", paper_source(), flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


def _numbers(line: str) -> list[float]:
    """Every number of a tabular row after its first cell (values and their \\pm sd, in reading order)."""
    body = line.split("&", 1)[1]
    return [float(x) for x in re.findall(r"-?\d+(?:\.\d+)?", body)]


def _row(block: str, name: str, section: str | None) -> str:
    """The tabular row starting with ``\\textbf{name}`` (in the Prompt Tuning / LoRA section, if given)."""
    if section is not None:
        sections = re.split(r"\\multicolumn\{9\}\{c\}\{(Prompt Tuning|LoRA)\}", block)
        block = sections[sections.index(section) + 1]
    (line,) = [x for x in block.splitlines() if re.match(rf"\s*\\textbf\{{{re.escape(name)}\}}\s*&", x)]
    return line


def test_every_cell_matches_the_latex_row():
    df = paper_results()
    blocks = _blocks()
    assert set(df["table"]) == set(TABLES) == set(blocks)
    checked = 0
    for (table, method, optimizer), cells in df.groupby(["table", "method", "optimizer"], sort=False):
        cells = cells.assign(order=cells["task"].map(TASK_ORDER.index)).sort_values("order", kind="stable")
        expected = []
        for _, c in cells.iterrows():
            expected += [c["value"]] + ([] if c["sd"] != c["sd"] else [c["sd"]])  # sd NaN: none printed
        if table == "tab:sum-test":
            header = [x for x in blocks[table].splitlines() if "\\textbf{AdamW}" in x][0]
            col = [re.search(r"\{(\w+)\}", h).group(1) for h in header.split("&")[1:]].index(ROW_NAME[optimizer])
            name = {("prompt-tuning", "glue"): "GLUE + T5 + Prompt Tuning", ("lora", "glue"): "GLUE + T5 + LoRA",
                    ("lora", "cifar100"): "CIFAR100 + ViT + LoRA"}
            got = [float(re.search(r"-?\d+(?:\.\d+)?", _row(blocks[table], name[(method, t)], None)
                                   .rstrip("\\ ").split("&")[1:][col]).group())
                   for t in cells["task"]]
        elif table == "tab:test-mlp":
            header = [x for x in blocks[table].splitlines() if "\\textbf{iEF}" in x][0]
            col = [re.search(r"\{(\w+)\}", h).group(1) for h in header.split("&")[1:]].index(ROW_NAME[optimizer])
            got = []
            for which in ("Validation Accuracy (\\%)", "Test Accuracy (\\%)"):
                cell = _row(blocks[table], which, None).rstrip("\\ ").split("&")[1:][col]
                got += [float(x) for x in re.findall(r"-?\d+(?:\.\d+)?", cell)]
        else:
            section = {"prompt-tuning": "Prompt Tuning", "lora": "LoRA"}[method]
            got = _numbers(_row(blocks[table], ROW_NAME[optimizer], section))
        assert got == expected, (table, method, optimizer)
        checked += len(cells)
    assert checked == len(df) == 310


@pytest.mark.parametrize("table, method, optimizer, task, metric, value, sd", [
    ("tab:train", "prompt-tuning", "ief", "cola", "final_train_loss", 0.01, 0.01),
    ("tab:train", "lora", "ef", "mrpc", "final_train_loss", 2.541, 0.78),  # printed with 3 decimals in the paper
    ("tab:train", "lora", "ief", "cifar100", "final_train_loss", 0.59, 0.30),
    ("tab:validation", "prompt-tuning", "sgd", "cola", "matthews_correlation", -0.1, 2.76),
    ("tab:validation", "lora", "adamw", "qqp", "accuracy", 86.8, 0.06),
    ("tab:test", "prompt-tuning", "ef", "cola", "matthews_correlation", -3.8, None),
    ("tab:test", "lora", "sgd", "mnli", "accuracy_mismatched", 83.8, None),
    ("tab:sum-test", "lora", "ef", "cifar100", "score", 31.0, None),
    ("tab:test-mlp", "mlp", "ief", "cifar10", "val_accuracy", 58.8, 0.87),
])
def test_hand_checked_cells(table, method, optimizer, task, metric, value, sd):
    df = paper_results(table)
    (row,) = df[(df.method == method) & (df.optimizer == optimizer) & (df.task == task) & (df.metric == metric)
                ].itertuples()
    assert row.value == value and (sd is None and row.sd != row.sd or row.sd == sd)


def test_unknown_table_is_named():
    with pytest.raises(ValueError, match="tab:sum-test"):
        paper_results("tab:nope")


def test_excerpt_is_verbatim_from_the_paper():
    """Each block of e2_tables.tex is the paper's source lines it names (only where the paper's source is present:
    it is not part of the repository)."""
    if not PAPER.exists():
        pytest.skip(f"the paper's LaTeX source is not on this machine ({PAPER})")
    paper = PAPER.read_text().split("\n")
    for m in re.finditer(r"^% ---- (tab:[\w-]+): lines (\d+)-(\d+)\n(.*?)(?=^% ---- |\Z)", paper_source(),
                         flags=re.M | re.S):
        lo, hi = int(m.group(2)), int(m.group(3))
        assert m.group(4).rstrip("\n").split("\n") == paper[lo - 1:hi], m.group(1)
