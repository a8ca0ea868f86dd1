"""Figures and tables of the toy chapter (``notebooks/toy_problems.ipynb``: the paper's Figs. 1 and 4).

The studies (update fields and trajectories of the four methods) are computed by :mod:`companion.demos.toy`; this module
lays them out for the page: one 2 x 2 grid per problem at the page width, so ticks and legends stay readable.

Colours: a trajectory is coloured by its start (``SEQUENCE_COLORS``, the paper's "coloured curves"), a curve of the
convergence figure by its method (``METHOD_COLORS``), and the vector fields are drawn in the neutral greys of
:data:`FIELD_COLORS`, so that no trajectory shares a hue with the field it follows (``sec:app-toy-lls-2pt``).
"""
from __future__ import annotations

import colorsys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch

from ..demos import toy
from ..paper import cite
from .style import CONTOUR_COLOR, FIELD_COLORS, METHOD_COLORS, SEQUENCE_COLORS
from .common import PAGE_WIDTH_IN, plain_log_ticks


HUE_SEPARATION_DEG = 30.0  # two saturated colours closer in hue than this count as "the same hue"
MIN_SATURATION = 0.15  # HSV saturation below which a colour counts as grey (no hue)


def same_hue(color1, color2) -> bool:
    """Whether two colours (anything matplotlib reads) share a hue: both saturated (HSV saturation >=
    :data:`MIN_SATURATION`) and less than :data:`HUE_SEPARATION_DEG` apart on the hue circle. Greys share no hue."""
    from matplotlib.colors import to_rgb

    (h1, s1, _), (h2, s2, _) = (colorsys.rgb_to_hsv(*to_rgb(c)) for c in (color1, color2))
    if min(s1, s2) < MIN_SATURATION:
        return False
    gap = abs(h1 - h2) * 360.0
    return min(gap, 360.0 - gap) < HUE_SEPARATION_DEG


@dataclass
class Study:
    """One toy problem on a grid: the four methods' update fields and normalised trajectories from shared starts."""

    problem: toy.ToyProblem
    lim: tuple[float, float]
    thetas: torch.Tensor  # [G, 2] grid points
    fields: dict[str, torch.Tensor]  # method -> [G, 2] directions d
    trajectories: dict[str, list[torch.Tensor]]  # method -> one [T_k, 2] path per start
    starts: list[tuple[float, float]]
    steps: int = 0  # the cap on the number of steps of a trajectory
    seconds: dict[str, float] = field(default_factory=dict)  # method -> wall time of its trajectories


def study(problem: toy.ToyProblem, lim: tuple[float, float], resolution: int,
          starts: Sequence[tuple[float, float]], step_size: float, steps: int, stop_loss: float | None = None,
          box: tuple[float, float] | None = None) -> Study:
    """Fields on a ``resolution``^2 grid over ``lim``^2 and normalised trajectories from ``starts`` (at most ``steps``
    steps, stopping once ``L < stop_loss`` or outside ``box``^2, default ``lim``)."""
    _, _, thetas = toy.grid(lim, lim, resolution)
    fields = {m: toy.update_field(problem, m, thetas) for m in toy.METHODS}
    box = box or lim
    trajectories, seconds = {}, {}
    for m in toy.METHODS:
        t0 = time.perf_counter()
        trajectories[m] = [toy.trajectory(problem, m, s, step_size, steps, stop_loss=stop_loss, bounds=(box, box))
                           for s in starts]
        seconds[m] = time.perf_counter() - t0
    return Study(problem, lim, thetas, fields, trajectories, list(starts), steps, seconds)


def _background(ax, problem, xlim, ylim, star=False, levels=None):
    """Loss contours, the dashed lines, the star at the minimum; labelled axes, theta_0 horizontal
    (``fig:visual_tour``'s caption)."""
    g0, g1, thetas = toy.grid(xlim, ylim, 200)
    loss = problem.loss_at(thetas).reshape(g0.shape)
    ax.contour(g0, g1, loss, levels=levels if levels is not None else 12, colors=CONTOUR_COLOR, linewidths=0.7,
               zorder=0)
    t = np.linspace(*xlim, 2)
    for a, b, c, _ in problem.lines:
        if b == 0:
            ax.axvline(c / a, color="0.2", ls="--", lw=1.2, zorder=1)
        else:
            ax.plot(t, (c - a * t) / b, color="0.2", ls="--", lw=1.2, zorder=1)
    if star and problem.minimum is not None:
        ax.plot(*problem.minimum, marker="*", ms=16, color="gold", mec="k", zorder=6)
    ax.set(xlim=xlim, ylim=ylim, xlabel=r"$\theta_0$", ylabel=r"$\theta_1$", aspect="equal")
    ax.grid(False)


def _arrows(ax, thetas, d, color, normalise, **kw):
    """The update field -d at thetas (unit length when normalise)."""
    u = -d / d.norm(dim=1, keepdim=True).clamp_min(1e-300) if normalise else -d
    ax.quiver(thetas[:, 0], thetas[:, 1], u[:, 0], u[:, 1], color=color, angles="xy", zorder=2, **kw)


def _paths(ax, trajectories, starts=None, ls="-", lw=1.6):
    for k, tr in enumerate(trajectories):
        ax.plot(tr[:, 0], tr[:, 1], color=SEQUENCE_COLORS[k], ls=ls, lw=lw, zorder=4)
    if starts is not None:
        s = np.asarray(starts)
        ax.plot(s[:, 0], s[:, 1], ls="", marker="8", ms=8, color="k", zorder=5)


def _legend(fig, handles, ncol=2):
    fig.legend(handles=handles, loc="lower center", ncol=ncol, frameon=False, bbox_to_anchor=(0.5, -0.01))


def _start_handles(starts):
    from matplotlib.lines import Line2D

    return [Line2D([], [], color=c, label=f"start {s}") for s, c in zip(starts, SEQUENCE_COLORS)]


@dataclass
class Zoom:
    """The box of the EF zoom panel, on the dashed line theta_0 = 0, and the EF field inside it."""

    centre: tuple[float, float]
    half: float
    thetas: torch.Tensor
    field: torch.Tensor

    @property
    def lim0(self):
        return (self.centre[0] - self.half, self.centre[0] + self.half)

    @property
    def lim1(self):
        return (self.centre[1] - self.half, self.centre[1] + self.half)


def ef_zoom(s: Study, half: float = 0.05) -> Zoom:
    """A box centred where the EF trajectories run along the dashed line theta_0 = 0 (un-normalised EF field)."""
    near = torch.cat([t[(t[:, 0].abs() < 0.02) & (t[:, 1].abs() > 2 * half)] for t in s.trajectories["EF"]])
    centre = (0.0, float(near[:, 1].median()) if len(near) else -0.6)
    _, _, thetas = toy.grid((centre[0] - half, centre[0] + half), (centre[1] - half, centre[1] + half), 8)
    return Zoom(centre, half, thetas, toy.update_field(s.problem, "EF", thetas))


def least_squares_figure(s: Study, zoom: Zoom, resolution: int):
    """The paper's Fig. 1 (SGD; NGD / iEF; EF normalised) plus a zoom of the un-normalised EF updates, 2 x 2."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Rectangle

    lls, lim, thetas, fields = s.problem, s.lim, s.thetas, s.fields
    fig, axes = plt.subplots(2, 2, figsize=(PAGE_WIDTH_IN, PAGE_WIDTH_IN + 1.2))
    axes = axes.ravel()
    levels = np.geomspace(1e-3, float(lls.loss_at(thetas).max()), 12)
    for ax in axes[:3]:
        _background(ax, lls, lim, lim, star=True, levels=levels)
    spacing = (lim[1] - lim[0]) / (resolution - 1)

    def fixed_scale(*ds):  # one arrow scale for un-normalised fields: the longest arrow spans 1.4 grid spacings
        return dict(scale_units="xy", scale=max(float(d.norm(dim=1).max()) for d in ds) / (1.4 * spacing))

    _arrows(axes[0], thetas, fields["SGD"], FIELD_COLORS["SGD"], False, width=0.0045, **fixed_scale(fields["SGD"]))
    _paths(axes[0], s.trajectories["SGD"], s.starts)
    axes[0].set_title("SGD")
    ngd_scale = fixed_scale(fields["NGD"], fields["iEF"])  # iEF (thin, dark) over NGD (wide, pale): they coincide
    _arrows(axes[1], thetas, fields["NGD"], FIELD_COLORS["NGD"], False, width=0.008, headwidth=3, **ngd_scale)
    _arrows(axes[1], thetas, fields["iEF"], FIELD_COLORS["iEF"], False, width=0.0032, headwidth=3, **ngd_scale)
    _paths(axes[1], s.trajectories["NGD"], lw=3.2)
    _paths(axes[1], s.trajectories["iEF"], s.starts, ls=(0, (2, 2)), lw=1.4)
    axes[1].set_title("NGD / iEF")
    axes[1].legend(handles=[Line2D([], [], color=FIELD_COLORS["NGD"], lw=4, label="NGD field (wide)"),
                            Line2D([], [], color=FIELD_COLORS["iEF"], lw=1.4, label="iEF field (thin)"),
                            Line2D([], [], color="0.3", lw=3.2, alpha=0.5, label="NGD path (wide)"),
                            Line2D([], [], color="0.3", lw=1.4, ls=(0, (2, 2)), label="iEF path (dashed)")],
                   loc="lower left", framealpha=0.9, fontsize=8)
    _arrows(axes[2], thetas, fields["EF"], FIELD_COLORS["EF"], True, width=0.005)
    _paths(axes[2], s.trajectories["EF"], s.starts)
    axes[2].add_patch(Rectangle((zoom.lim0[0], zoom.lim1[0]), 2 * zoom.half, 2 * zoom.half, fill=False, lw=1.5,
                                zorder=7))
    axes[2].annotate("zoom", (zoom.lim0[1], zoom.lim1[1]), xytext=(6, 4), textcoords="offset points")
    axes[2].set_title("EF (normalised)")
    ax = axes[3]
    _background(ax, lls, zoom.lim0, zoom.lim1, levels=levels)
    norms = zoom.field.norm(dim=1)
    _arrows(ax, zoom.thetas, zoom.field, FIELD_COLORS["EF"], False, width=0.006, scale_units="xy",
            scale=float(norms.max()) / (0.6 * zoom.half))
    for k, tr in enumerate(s.trajectories["EF"]):  # every EF iterate inside the box: the oscillation across the line
        inside = tr[(tr[:, 0] - zoom.centre[0]).abs().le(zoom.half) & (tr[:, 1] - zoom.centre[1]).abs().le(zoom.half)]
        if len(inside):
            ax.plot(inside[:, 0], inside[:, 1], color=SEQUENCE_COLORS[k], lw=0.3, alpha=0.6, zorder=4)
            ax.plot(inside[:, 0], inside[:, 1], ls="", marker=".", ms=2.5, color=SEQUENCE_COLORS[k], zorder=4,
                    label=f"{len(inside)} EF iterates in the box")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper right", framealpha=0.9)
    ax.set_title("EF (un-normalised, zoom)")
    ax.text(0.02, 0.02, rf"$\|d_{{EF}}\|$ from {float(norms.min()):.3g} to {float(norms.max()):.3g}",
            transform=ax.transAxes, bbox=dict(fc="w", ec="0.7"))
    handles = [Line2D([], [], color="0.2", ls="--", label=r"per-sample optimum ($\theta_0=0$; $\theta_0+\theta_1=0$)"),
               Line2D([], [], ls="", marker="*", ms=14, color="gold", mec="k", label=r"global minimum $\theta^\star$"),
               Line2D([], [], ls="", marker="8", ms=8, color="k", label="starting points")]
    _legend(fig, handles + _start_handles(s.starts))
    fig.suptitle(f"Linear least squares, 2 parameters, 2 samples (the paper's {cite('fig:visual_tour')})")
    fig.tight_layout(rect=(0, 0.1, 1, 1), h_pad=2.0)
    return fig


def logistic_figure(s: Study):
    """The paper's Fig. 4: all four fields normalised for display, one panel per method, 2 x 2."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    fig, axes = plt.subplots(2, 2, figsize=(PAGE_WIDTH_IN, PAGE_WIDTH_IN + 1.6))
    levels = np.quantile(s.problem.loss_at(toy.grid(s.lim, s.lim, 60)[2]).numpy(), np.linspace(0.02, 0.98, 12))
    for ax, m in zip(axes.ravel(), toy.METHODS):
        _background(ax, s.problem, s.lim, s.lim, levels=levels)
        _arrows(ax, s.thetas, s.fields[m], FIELD_COLORS[m], True, width=0.005)
        _paths(ax, s.trajectories[m], s.starts)
        ax.set_title(m)
    handles = [Line2D([], [], color="0.2", ls="--", label=r"decision boundary at $x=1$ ($\theta_0+\theta_1=0$)"),
               Line2D([], [], ls="", marker="8", ms=8, color="k", label="starting points")]
    _legend(fig, handles + _start_handles(s.starts))
    (x0, x1), (y0, y1) = (f"{float(v):g}" for v in s.problem.x), (int(v) for v in s.problem.targets)
    fig.suptitle(rf"Logistic regression, $x_0={x0}$ ($y_0={y0}$), $x_1={x1}$ ($y_1={y1}$); arrows normalised "
                 f"(the paper's {cite('fig:logistic-regression')})")
    fig.tight_layout(rect=(0, 0.09, 1, 1), h_pad=2.0)
    return fig


def first_hit(losses: torch.Tensor, threshold: float) -> int | None:
    """The first index ``k`` with ``losses[k] < threshold``, or ``None``."""
    hit = torch.nonzero(losses < threshold).flatten()
    return int(hit[0]) if len(hit) else None


def distances(s: Study) -> dict[str, list[torch.Tensor]]:
    """``||theta_k - theta*||`` along every trajectory (method -> one ``[T_k]`` tensor per start).

    Raises:
        ValueError: the study's problem has no minimum (the logistic regression).
    """
    if s.problem.minimum is None:
        raise ValueError(f"problem {s.problem.name!r} has no minimum theta*; distances need one (the least squares)")
    star = torch.tensor(s.problem.minimum, dtype=toy.DTYPE)
    return {m: [(tr - star).norm(dim=1) for tr in paths] for m, paths in s.trajectories.items()}


def normalised_steps_table(s: Study, stop: float) -> pd.DataFrame:
    """Normalised steps of each trajectory until the loss is below ``stop`` (the figure's protocol); a trajectory that
    does not get there shows its number of steps and the distance of its last iterate to ``theta*``."""
    dist = distances(s)
    rows = []
    for k, start in enumerate(s.starts):
        row = {"start": str(start)}
        for m in toy.METHODS:
            loss = s.problem.loss_at(s.trajectories[m][k])
            n = first_hit(loss, stop)
            row[m] = (f"{n:,}" if n is not None else
                      f"not in {len(loss) - 1:,} (|θ − θ*| = {float(dist[m][k][-1]):.2g})")
        rows.append(row)
    return pd.DataFrame(rows).set_index("start")


def steps_to_stop(s: Study, method: str, stop: float) -> list[int | None]:
    """Per start, the first step of ``method``'s trajectory with ``L < stop`` (``None`` where it never gets there)."""
    return [first_hit(s.problem.loss_at(tr), stop) for tr in s.trajectories[method]]


def reach_summary(s: Study, method: str, stop: float) -> str:
    """One sentence, for the page, on whether ``method``'s trajectories reach ``L < stop``: how many, after how many
    normalised steps, and for those that do not, after how many steps and at what distance from ``theta*`` they end.

    Raises:
        ValueError: an unknown ``method`` (naming the study's) or a problem without a minimum.
    """
    if method not in s.trajectories:
        raise ValueError(f"unknown method {method!r}; expected one of {tuple(s.trajectories)}")
    dist = distances(s)[method]
    hits = steps_to_stop(s, method, stop)
    reached = [n for n in hits if n is not None]
    missed = [(len(d) - 1, float(d[-1])) for n, d in zip(hits, dist) if n is None]
    span = f"{min(reached):,}" if len(set(reached)) == 1 else f"{min(reached):,} to {max(reached):,}" if reached else ""
    total = len(hits)
    if not missed:
        return f"all {total} {method} trajectories reached L < {stop:g}, after {span} normalised steps"
    if len({n for n, _ in missed}) == 1:  # all stopped at the same step (the cap): say it once
        ends = f"after {missed[0][0]:,} steps, at distance " + ", ".join(f"{d:.2g}" for _, d in missed)
    else:
        ends = "at distance " + ", ".join(f"{d:.2g} (after {n:,} steps)" for n, d in missed)
    if not reached:
        return f"none of the {total} {method} trajectories reached L < {stop:g}: they end {ends} from θ*"
    return (f"{len(reached)} of {total} {method} trajectories reached L < {stop:g}, after {span} normalised steps; the "
            f"other {len(missed)} end {ends} from θ*")


def reach_verdict(s: Study, method: str, stop: float) -> str:
    """The verdict on the paper's "all methods successfully reached the global minimum" (``sec:app-toy-lls-2pt``) for
    ``method``, by the rule stated on the page: every trajectory gets to ``L < stop`` within the study's cap."""
    hits = steps_to_stop(s, method, stop)
    missed = sum(n is None for n in hits)
    if not missed:
        return f"holds in this run: every {method} trajectory reached L < {stop:g}"
    return (f"is not confirmed in this run: {missed} of {len(hits)} {method} trajectories did not reach L < {stop:g} "
            f"(at most {s.steps:,} steps)")


def convergence_figure(s: Study, stop: float):
    """Distance to ``theta*`` against the normalised step, every trajectory of every method (log-log): where each
    method's trajectories reach ``L < stop`` (they stop there) and how far they are when they stop short."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fig, ax = plt.subplots(figsize=(PAGE_WIDTH_IN, 4.2))
    dist = distances(s)
    styles = {"SGD": "-", "NGD": "-", "iEF": (0, (3, 2)), "EF": "-"}
    for m in toy.METHODS:
        for d in dist[m]:
            ax.plot(torch.arange(1, len(d) + 1), d, color=METHOD_COLORS[m], ls=styles[m], lw=1.4, alpha=0.85)
            ax.plot([len(d)], [float(d[-1])], ls="", marker="o", ms=4, color=METHOD_COLORS[m])
    ax.set(xscale="log", yscale="log", xlabel="normalised step + 1 (step length = 0.01)",
           ylabel=r"$\|\theta - \theta^\star\|$")
    ax.xaxis.set_major_locator(LogLocator(base=10, numticks=12))  # decades: 1-2-5 labels collide up to 10^5
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    plain_log_ticks(ax, "y")
    handles = [Line2D([], [], color=METHOD_COLORS[m], ls=styles[m], lw=1.8, label=m) for m in toy.METHODS]
    handles.append(Line2D([], [], ls="", marker="o", ms=4, color="0.3", label=f"last iterate (L < {stop:g} or cap)"))
    ax.legend(handles=handles, loc="lower left", ncol=5, fontsize=9, framealpha=0.9)
    ax.set_title(f"Distance to the minimum along the {len(s.starts)} trajectories of each method "
                 f"(at most {s.steps:,} steps)")
    fig.tight_layout()
    return fig


def plain_steps_table(problem: toy.ToyProblem, starts, max_steps: int, threshold: float = 1e-6) -> pd.DataFrame:
    """Plain steps theta <- theta - eta d until L < threshold: SGD at eta = 1/lambda_max(F), NGD and iEF at 1, EF at
    the best of 1e-1, 1e-2, 1e-3."""
    lam_max = float(torch.linalg.eigvalsh(toy.fisher_matrix(problem, (0.0, 0.0))).max())
    lrs = {"SGD": [1 / lam_max], "NGD": [1.0], "iEF": [1.0], "EF": [1e-1, 1e-2, 1e-3]}
    rows = []
    for start in starts:
        row = {"start": str(start)}
        for m, etas in lrs.items():
            best, min_loss = None, float("inf")
            for eta in etas:
                loss = problem.loss_at(toy.trajectory(problem, m, start, eta, max_steps, normalise=False,
                                                      stop_loss=threshold))
                n = first_hit(loss, threshold)
                if n is not None and (best is None or n < best[0]):
                    best = (n, eta)
                min_loss = min(min_loss, float(loss.min()))
            name = f"{m} (eta={etas[0]:.3g})" if len(etas) == 1 else f"{m} (best eta)"
            row[name] = (f"{best[0]}" + (f" (eta={best[1]:g})" if len(etas) > 1 else "") if best
                         else f"not in {max_steps} (min L = {min_loss:.2g})")
        rows.append(row)
    return pd.DataFrame(rows).set_index("start")


def inverse_scaling_table(problem: toy.ToyProblem, probe: torch.Tensor) -> pd.DataFrame:
    """EF update norms near a converged sample (``eqn:kappa_EF`` predicts kappa_n |grad l_n| = 1)."""
    facts = toy.ef_inverse_scaling(problem, probe)
    table = {"theta": [f"({float(a):g}, {float(b):g})" for a, b in probe]}
    if "grad_norm_0" in facts:
        table.update({"|grad l_1|": facts["grad_norm_0"].numpy(), "|grad l_2|": facts["grad_norm_1"].numpy(),
                      "|d_EF|": facts["ef_norm"].numpy(),
                      "kappa_1 |grad l_1|": (facts["ef_kappa_0"] * facts["grad_norm_0"]).numpy(),
                      "kappa_2 |grad l_2|": (facts["ef_kappa_1"] * facts["grad_norm_1"]).numpy(),
                      "|d_NGD| = |d_iEF|": facts["ngd_norm"].numpy()})
    return pd.DataFrame(table).set_index("theta")


def logistic_growth_table(problem: toy.ToyProblem, probe: torch.Tensor) -> pd.DataFrame:
    """Along the dashed line towards lower loss: the update norms of EF, iEF and NGD."""
    facts = toy.ef_inverse_scaling(problem, probe)
    return pd.DataFrame({"theta": [f"({float(a):g}, {float(b):g})" for a, b in probe], "loss": facts["loss"].numpy(),
                         "|d_EF|": facts["ef_norm"].numpy(), "|d_iEF|": facts["ief_norm"].numpy(),
                         "|d_NGD|": facts["ngd_norm"].numpy()}).set_index("theta")


def angles_to_ngd(s: Study) -> pd.DataFrame:
    """Angle (degrees) between each method's direction and NGD's over the grid: median and max."""
    def angle(a, b):
        cos = (a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1))
        return torch.rad2deg(torch.arccos(cos.clamp(-1, 1)))

    ang = {m: angle(s.fields[m], s.fields["NGD"]) for m in ("SGD", "iEF", "EF")}
    return pd.DataFrame({m: [float(a.median()), float(a.max())] for m, a in ang.items()}, index=["median", "max"])


def lowest_point(problem: toy.ToyProblem, lim: tuple[float, float], resolution: int = 61) -> str:
    """Where the loss is lowest on a ``resolution``^2 grid over the square ``lim``^2, with where that lies on the figure
    (theta_0 horizontal, theta_1 vertical), e.g. ``"(3, -3), the bottom-right corner"``: the orientation of
    ``fig:logistic-regression`` ("lower loss when moving further down the bottom-right corner")."""
    _, _, thetas = toy.grid(lim, lim, resolution)
    tol = 1e-9 * (lim[1] - lim[0])
    t0, t1 = (0.0 if abs(float(v)) < tol else float(v) for v in thetas[problem.loss_at(thetas).argmin()])

    def side(v, low, high):
        return low if v <= lim[0] + tol else high if v >= lim[1] - tol else ""

    vertical, horizontal = side(t1, "bottom", "top"), side(t0, "left", "right")
    where = ("the " + "-".join(w for w in (vertical, horizontal) if w)
             + (" corner" if vertical and horizontal else " edge")) if vertical or horizontal else "inside the box"
    return f"({t0:g}, {t1:g}), {where}"


def logistic_endpoints(s: Study) -> pd.DataFrame:
    """Where each logistic trajectory ends: distance of the last iterate to the dashed line theta_0 + theta_1 = 0
    (the decision boundary x = 1, midway between the data), one row per start, one column per method."""
    rows = []
    for k, start in enumerate(s.starts):
        for m in toy.METHODS:
            end = s.trajectories[m][k][-1]
            rows.append({"start": str(start), "method": m, "distance": float((end[0] + end[1]).abs() / 2 ** 0.5)})
    table = pd.DataFrame(rows).pivot(index="start", columns="method", values="distance")
    return table.loc[[str(st) for st in s.starts], list(toy.METHODS)]
