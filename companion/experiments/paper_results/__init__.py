"""The paper's reported E2 numbers, transcribed once as data (``sec:opt-exp``, ``sec:app-mlp-cifar10``).

``e2.csv`` holds every cell of tab:sum-test, tab:train, tab:validation, tab:test and tab:test-mlp, one row per
number: ``table`` (the paper's label), ``method`` (``prompt-tuning`` | ``lora`` | ``mlp``), ``optimizer`` (the
registry's names), ``task`` (``cola`` ... ``rte``, ``cifar100``, ``cifar10``; ``glue`` for tab:sum-test's GLUE
average), ``metric`` (the runner's metric names: ``accuracy``, ``matthews_correlation``, ``f1``,
``accuracy_matched`` / ``accuracy_mismatched``; ``final_train_loss``; ``score`` for tab:sum-test's average;
``val_accuracy`` / ``test_accuracy`` for tab:test-mlp), ``value`` and ``sd`` as printed (metrics x 100, losses as
they are; ``sd`` empty where the paper gives none) and ``bold`` (1 where the paper marks the best).

One correction (the book's "Paper errata" page, ``book/errata.md``): tab:validation's caption says its MRPC and QQP
cells give "F1-score and Accuracy (in order)", but its numbers are accuracy first, F1 second (its EF prompt-tuning
row would otherwise have a QQP accuracy of 0.11 % with an F1 of 62.2 %, which no classifier can reach on the
development set; its MRPC pair is exactly the constant "equivalent" predictor's accuracy and F1). ``e2.csv`` labels
those cells in the corrected order (:data:`CORRECTED`); tab:test's cells follow its caption (F1 first).

The paper's MNLI validation cell is the accuracy over the whole development set (matched and mismatched together);
its test cells are matched and mismatched accuracies. ``e2_tables.tex`` is the verbatim LaTeX of those five tables
(with their source line numbers), against which ``tests/companion/test_paper_results.py`` checks every cell.
"""
from __future__ import annotations

from importlib import resources

import pandas as pd

TABLES = ("tab:sum-test", "tab:train", "tab:validation", "tab:test", "tab:test-mlp")
# Tables whose transcription departs from the paper's caption, and how (shown beside the paper's numbers).
CORRECTED = {"tab:validation": "MRPC/QQP: accuracy, then F1; the caption's order is reversed (see Paper errata)"}


def paper_results(table: str | None = None) -> pd.DataFrame:
    """The transcribed cells (all tables, or one ``table`` label), with ``value`` and ``sd`` as floats."""
    with resources.files(__package__).joinpath("e2.csv").open() as f:
        df = pd.read_csv(f, dtype={"value": float, "sd": float, "bold": int})
    if table is not None:
        if table not in TABLES:
            raise ValueError(f"unknown table {table!r}; transcribed tables: {', '.join(TABLES)}")
        df = df[df["table"] == table].reset_index(drop=True)
    return df


def paper_source() -> str:
    """The verbatim LaTeX of the transcribed tables."""
    return resources.files(__package__).joinpath("e2_tables.tex").read_text()
