"""Helpers every chapter's figures share: one style, saving, the size of a figure's text as a reader sees it, bands on
log axes, and the provenance line under a figure or table."""
from __future__ import annotations

import datetime as _dt
from collections.abc import Sequence
from pathlib import Path

import numpy as np

# A figure this wide is shown at about its natural size in the book's column: 7.5 in x 90 dpi = 675 px against a
# content column of BOOK_CONTENT_PX (wider figures are scaled down, and their text with them).
PAGE_WIDTH_IN = 7.5
FIGURE_DPI = 90
# A lower bound of the book's content column: tests/book/test_book_browser.py checks it in a 1400 px and a 1000 px
# window (the smoke book of 2026-11-24 measured 784 and 736 px there).
BOOK_CONTENT_PX = 690
MIN_TEXT_PX = 9.0  # the smallest text a figure may show a reader (CSS px, after the page scales the image)
SCRIPT_SHRINK = 0.7  # matplotlib mathtext's sub/superscript scale (SHRINK_FACTOR)
TEXT_PX_KEY = "ief:min-text-px"  # the PNG text chunk recording a figure's smallest text, in px of the image
BOOK_RC = {"figure.dpi": FIGURE_DPI, "savefig.dpi": 150, "font.size": 10.5, "axes.titlesize": 10.5,
           "axes.labelsize": 10.5, "xtick.labelsize": 10, "ytick.labelsize": 10, "legend.fontsize": 10.5,
           "legend.title_fontsize": 10.5, "figure.titlesize": 11.5, "figure.constrained_layout.use": False}


def use_book_style() -> None:
    """Readable fonts at the page width (:data:`BOOK_RC`: no text under 10 pt, 90 dpi), seaborn's whitegrid theme,
    tables shown whole, and, in a notebook, inline figures written by :func:`render_png` (which records the smallest
    text of each figure in the PNG, for the book's browser test)."""
    import matplotlib.pyplot as plt
    import pandas as pd
    import seaborn as sns

    pd.set_option("display.max_colwidth", None)  # never cut a cell with "..."; the page wraps long text instead
    pd.set_option("display.max_rows", 500)  # every trial of the search, not a truncated view
    sns.set_theme(context="notebook", style="whitegrid")
    plt.rcParams.update(BOOK_RC)
    try:
        from IPython import get_ipython
    except ImportError:  # plain Python: nothing is displayed inline
        return
    shell = get_ipython()
    if shell is not None:
        import base64

        from matplotlib.figure import Figure

        try:  # the inline backend registers its own formatter when its module is first imported (matplotlib loads
            import matplotlib_inline.backend_inline  # noqa: F401  # it lazily, at the first figure): import it now
        except ImportError:  # another backend: the formatter below is the only one
            pass

        shell.display_formatter.formatters["image/png"].for_type(
            Figure, lambda fig: base64.b64encode(render_png(fig)).decode("ascii") if fig.axes else None)


def drawn_text_sizes(fig) -> list[tuple[float, str]]:
    """``(size in points, text)`` of every non-empty text the figure draws (tick labels, legends, titles,
    annotations), recorded from the renderer as the figure is drawn (so ticks outside the view, hidden axes and empty
    labels do not count). A mathtext string with a sub- or superscript counts at the size of its scripts
    (:data:`SCRIPT_SHRINK` times its font size)."""
    renderer = fig.canvas.get_renderer()
    seen: list[tuple[float, str]] = []
    original = renderer.draw_text

    def record(gc, x, y, s, prop, angle, ismath=False, mtext=None):
        if str(s).strip():
            scripts = ismath and any(c in str(s) for c in "_^")  # mathtext sets sub/superscripts 0.7 times smaller
            seen.append((float(prop.get_size_in_points()) * (SCRIPT_SHRINK if scripts else 1.0), str(s)))
        return original(gc, x, y, s, prop, angle, ismath=ismath, mtext=mtext)

    renderer.draw_text = record
    try:
        fig.draw(renderer)
    finally:
        del renderer.draw_text  # the instance attribute: the class's method again
    return seen


def min_text_px(fig) -> tuple[float, str]:
    """The smallest text the figure draws, in pixels of its image at ``fig.dpi``, and that text.

    Raises:
        ValueError: a figure that draws no text (nothing to measure).
    """
    sizes = drawn_text_sizes(fig)
    if not sizes:
        raise ValueError("the figure draws no text")
    size, text = min(sizes)
    return size * fig.dpi / 72, text


def render_png(fig) -> bytes:
    """The PNG a notebook shows for ``fig`` (as IPython's inline backend writes it: ``fig.dpi``, tight bounding box),
    with its smallest text in pixels recorded under :data:`TEXT_PX_KEY` (:func:`min_text_px`)."""
    from io import BytesIO

    px, text = min_text_px(fig)
    out = BytesIO()
    fig.canvas.print_figure(out, format="png", dpi=fig.dpi, bbox_inches="tight", facecolor=fig.get_facecolor(),
                            edgecolor=fig.get_edgecolor(), metadata={TEXT_PX_KEY: f"{px:.3f}",
                                                                     "ief:min-text": text[:80]})
    return out.getvalue()


def png_text_record(data: bytes) -> tuple[float | None, int]:
    """``(smallest text in px of the image or None where not recorded, natural width in px)`` of a PNG."""
    from io import BytesIO

    from PIL import Image

    with Image.open(BytesIO(data)) as image:
        value = getattr(image, "text", {}).get(TEXT_PX_KEY)
        return (float(value) if value is not None else None), image.size[0]


def shown_text_px(fig, content_px: float = BOOK_CONTENT_PX) -> float:
    """The smallest text of ``fig`` as a reader sees it in the book's column of ``content_px``: its size in the image
    times the image's scale on the page (1 where the image is narrower than the column)."""
    px, natural = png_text_record(render_png(fig))
    return px * min(1.0, content_px / natural)


def log_band(values: Sequence[float]) -> tuple[float, float, float]:
    """``(centre, low, high)`` of positive ``values`` for a logarithmic axis: the geometric mean and the band of
    +-1 sd of the log values (``exp(mean(log v) -+ sd(log v))``, population sd like :func:`numpy.std`), so that the
    band is symmetric on the axis and never reaches zero.

    Raises:
        ValueError: no values, or a value that is not positive and finite (it has no place on a log axis).
    """
    v = np.asarray(values, dtype=float)
    if v.size == 0 or not np.all(np.isfinite(v) & (v > 0)):
        raise ValueError(f"a log band needs positive finite values, got {v.tolist()!r}")
    logs = np.log(v)
    mean, sd = float(logs.mean()), float(logs.std())
    return float(np.exp(mean)), float(np.exp(mean - sd)), float(np.exp(mean + sd))


def plain_log_ticks(ax, axis: str = "y") -> None:
    """Label a logarithmic axis with plain numbers (``0.5``, ``2``, ``1e-05``), never ``1.35x10^0``: 1-2-5 ticks where
    three to fourteen of them fall in the shown range, powers of ten where more would, otherwise about five evenly
    spaced ones (a narrow log range, where matplotlib would label only minor ticks, in scientific notation). Call it
    after the data are drawn."""
    import math

    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

    target = ax.yaxis if axis == "y" else ax.xaxis
    lo, hi = sorted(ax.get_ylim() if axis == "y" else ax.get_xlim())
    decades = range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 1) if lo > 0 else range(0)
    one_two_five = [m * 10.0**d for d in decades for m in (1, 2, 5) if lo <= m * 10.0**d <= hi]
    if lo > 0 and len(one_two_five) < 3:
        target.set_major_locator(MaxNLocator(nbins=5, steps=[1, 2, 5, 10]))
    elif len(one_two_five) > 14:  # many decades: 1-2-5 labels would crowd the axis, powers of ten only (on an x
        target.set_major_locator(LogLocator(base=10, numticks=6 if axis == "x" else 12))  # axis, a few of them)
    else:
        target.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0), numticks=30))
    target.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    target.set_minor_formatter(NullFormatter())


def plain_log_axes(fig) -> None:
    """:func:`plain_log_ticks` on every logarithmic axis of ``fig``, and plain numbers on every symlog one: no tick
    label a reader must read as a superscript (mathtext sets it at 0.7 of the tick size). Call it last."""
    from matplotlib.ticker import FuncFormatter

    for ax in fig.axes:
        for axis in ("x", "y"):
            scale = ax.get_xscale() if axis == "x" else ax.get_yscale()
            if scale == "log":
                plain_log_ticks(ax, axis)
            elif scale == "symlog":
                (ax.xaxis if axis == "x" else ax.yaxis).set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))


def save(fig, out_dir: str | Path, name: str) -> Path:
    """Write ``name.png`` and ``name.svg`` under ``out_dir`` (the figure is also shown inline); returns the PNG."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for ext in ("png", "svg"):
        fig.savefig(out / f"{name}.{ext}", bbox_inches="tight")
    return out / f"{name}.png"


def regenerated_note(scale: str, what: str = "figure") -> str:
    """The provenance line under a figure or table computed while this chapter ran."""
    return f"*Provenance: this {what} was regenerated by this build (scale `{scale}`).*"


def _shown(path: Path) -> str:
    """``path`` relative to the repository root where it lies under it."""
    root = Path(__file__).resolve().parents[2]
    path = Path(path).resolve()
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


def record_note(paths, what: str = "figure") -> str:
    """The provenance line under a figure or table read from committed records: which files, and for each when, at
    which commit and by which command it was made (:func:`record_made`)."""
    paths = [Path(p) for p in (paths if isinstance(paths, (list, tuple)) else [paths])]
    files = "; ".join(f"`{_shown(p)}` ({record_made(p)})" for p in paths)
    plural = "records" if len(paths) > 1 else "record"
    return f"*Provenance: this {what} is read from the committed {plural} {files}, not recomputed by this build.*"


def workflow_note(paths, scale: str, what: str = "figure") -> str:
    """The provenance line under a figure or table computed by this build's workflow (the runs and evaluations it
    made, or found up to date, at ``scale``) and read from the tables it wrote: which files, written when."""
    paths = [Path(p) for p in (paths if isinstance(paths, (list, tuple)) else [paths])]
    files = "; ".join(f"`{_shown(p)}` (written {file_time(p)})" for p in paths)
    return (f"*Provenance: this {what} was computed by this build's workflow (scale `{scale}`; a job whose inputs "
            f"had not changed since an earlier build is not rerun) and read from its "
            f"{'tables' if len(paths) > 1 else 'table'} {files}.*")


def provenance(tables, scale: str, what: str = "figure", paper=None) -> str:
    """The provenance line under a chapter's figure or table, the one helper every notebook uses: the workflow's
    ``tables`` it was read from (:func:`workflow_note`) and, with ``paper``, the committed record of the paper's
    numbers shown beside ours (:func:`record_note`). A chapter only reads and draws, so it has no other source to
    name: a missing table is an error (naming the job that makes it) before any line is drawn."""
    line = workflow_note(tables, scale, what)
    return line if paper is None else line + " " + record_note(paper, f"{what}'s part marked paper")


def require_tables(tables, scale: str, command: str) -> list[Path]:
    """``tables`` as paths when every one exists; else ``FileNotFoundError`` saying which are missing and which job
    makes them (``make book`` at ``scale``, or by hand ``command``): a chapter reads the workflow's tables and
    computes nothing itself."""
    tables = [Path(t) for t in tables]
    missing = [str(t) for t in tables if not t.is_file()]
    if missing:
        raise FileNotFoundError(
            f"this chapter reads the workflow's tables and computes nothing itself; missing: {', '.join(missing)}. "
            f"`make book SCALE={scale}` makes them (or `python -m tools.book build --scale {scale}`); by hand: "
            f"`{command}`")
    return tables


def record_made(path: str | Path) -> str:
    """When, at which commit and by which command a committed record was made: the ``created`` / ``commit`` /
    ``command`` fields a JSON record carries (``companion.experiments.search``; a benchmark record's ``date``), else
    "made before records carried their date" and when git last committed the file (:func:`committed_at`); never a
    guessed date."""
    import json

    path = Path(path)
    meta: dict = {}
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text())
            meta = data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            meta = {}
    created = meta.get("created") or meta.get("date")  # the searches' "created", the benchmarks' "date"
    if not created:
        prefix = "made before records carried their date; " if path.suffix == ".json" else ""
        return f"{prefix}{committed_at(path)}"
    commit = meta.get("commit")
    where = f" at commit `{commit[:12]}`" if commit else " outside a git checkout" if meta.get("created") else ""
    made = f"made {created}{where}"  # a benchmark record names its date and command, not its commit
    return made + (f" by `{meta['command']}`" if meta.get("command") else "")


def file_time(path: str | Path) -> str:
    """The modification time of ``path``, UTC to the minute."""
    stamp = _dt.datetime.fromtimestamp(Path(path).stat().st_mtime, _dt.timezone.utc)
    return stamp.strftime("%Y-%m-%d %H:%M UTC")


def committed_at(path: str | Path) -> str:
    """When ``path`` was last committed (git), else its file time; says which."""
    import subprocess

    path = Path(path).resolve()
    try:
        out = subprocess.run(["git", "log", "-1", "--format=%cd", "--date=format-local:%Y-%m-%d %H:%M UTC", "--",
                              path.name], cwd=path.parent, capture_output=True, text=True, check=True,
                             env={"TZ": "UTC", "PATH": "/usr/bin:/bin"}).stdout.strip()
        if out:
            return f"last committed {out}"
    except (OSError, subprocess.CalledProcessError):
        pass
    return f"file time {file_time(path)} (not committed)"


def note(text: str):
    """Show a provenance (or any markdown) line in the notebook and the book."""
    from IPython.display import Markdown, display

    display(Markdown(text))
