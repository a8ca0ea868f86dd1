"""ief.plots.evaluation: the evaluation chapter's summary table (never a value split across lines) and log axes
labelled with plain numbers."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from ief.plots.common import plain_log_ticks  # noqa: E402
from ief.plots.evaluation import _plain, summary_table  # noqa: E402


def _rows():
    rows = []
    for setup, methods in (("digits-mlp", ("sgd", "ef", "ief", "kfac")), ("tweets-minilm-pt", ("sgd", "ief", "ef"))):
        for stage in (100, 0, 25):
            for k, method in enumerate(methods):
                rows.append({"setup": setup, "stage": stage, "method": method, "mean": 0.5 + 0.01 * k + stage / 1000,
                             "sd": 0.0123, "n": 2, "imbalance_mean": 46.123 + stage, "imbalance_sd": 12.4})
    return rows


def test_summary_table_has_a_row_per_method_and_a_column_per_stage_in_order():
    table = summary_table(_rows())
    data = table.data
    assert list(data.columns) == ["0%", "25%", "100%"]
    assert list(data.loc["digits-mlp"].index) == ["EF / SGD", "iEF / SGD", "KFAC / SGD", "imbalance"]
    assert list(data.loc["tweets-minilm-pt"].index) == ["EF / SGD", "iEF / SGD", "imbalance"]  # no K-FAC row
    assert data.loc[("digits-mlp", "iEF / SGD"), "25%"] == "0.545\u00a0±\u00a00.012"
    assert data.loc[("digits-mlp", "imbalance"), "100%"] == "146\u00a0±\u00a012"  # no "1e+01"


def test_summary_cells_never_wrap_inside_a_value():
    html = summary_table(_rows()).to_html()
    assert "white-space: nowrap" in html and 'class="dataframe"' in html


def test_summary_table_refuses_records_without_e1_rows():
    with pytest.raises(ValueError, match="no E1 records"):
        summary_table([])


@pytest.mark.parametrize("x, digits, text", [(46.1234, 3, "46.1"), (12.4, 2, "12"), (150.2, 2, "150"),
                                             (0.00234, 2, "0.0023"), (1.2e-8, 2, "1.2e-08"), (0.695, 3, "0.695")])
def test_plain_numbers_have_no_exponent_above_one(x, digits, text):
    assert _plain(x, digits) == text


@pytest.mark.parametrize("lo, hi", [(1.3, 1.45), (0.3, 0.7), (0.26, 1.05), (0.2, 30.0), (1e-3, 2.3)])
def test_log_axes_are_labelled_with_plain_numbers(lo, hi):
    """A narrow log range (E1's ratios around 1.35) is labelled "1.35", never with matplotlib's "1.35x10^0"."""
    fig, ax = plt.subplots()
    ax.plot([0, 1], [lo, hi])
    ax.set_yscale("log")
    plain_log_ticks(ax)
    fig.canvas.draw()
    y0, y1 = ax.get_ylim()
    labels = [t.get_text() for t in ax.get_yticklabels() if y0 <= t.get_position()[1] <= y1 and t.get_text()]
    minor = [t.get_text() for t in ax.get_yticklabels(minor=True) if t.get_text()]
    assert len(labels) >= 3 and not minor
    assert all("10^" not in s and "$" not in s and "times" not in s for s in labels), labels
    plt.close(fig)
