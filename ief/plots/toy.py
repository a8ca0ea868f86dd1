"""Figures and tables of the toy chapter (``notebooks/toy_problems.ipynb``: the paper's Figs. 1 and 4).

The studies (update fields and trajectories of the four methods) are computed by :mod:`ief.toy`; this module lays them
out for the page: one 2 x 2 grid per problem at the page width, so ticks and legends stay readable.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from .. import toy
from ..paper import cite
from ..style import METHOD_COLORS, SEQUENCE_COLORS
from .common import PAGE_WIDTH_IN


@dataclass
class Study:
    """One toy problem on a grid: the four methods' update fields and normalised trajectories from shared starts."""

    problem: toy.ToyProblem
    lim: tuple[float, float]
    thetas: torch.Tensor  # [G, 2] grid points
    fields: dict[str, torch.Tensor]  # method -> [G, 2] directions d
    trajectories: dict[str, list[torch.Tensor]]  # method -> one [T_k, 2] path per start
    starts: list[tuple[float, float]]


def study(problem: toy.ToyProblem, lim: tuple[float, float], resolution: int,
          starts: Sequence[tuple[float, float]], step_size: float, steps: int, stop_loss: float | None = None,
          box: tuple[float, float] | None = None) -> Study:
    """Fields on a ``resolution``^2 grid over ``lim``^2 and normalised trajectories from ``starts`` (stopping
    outside ``box``^2, default ``lim``)."""
    _, _, thetas = toy.grid(lim, lim, resolution)
    fields = {m: toy.update_field(problem, m, thetas) for m in toy.METHODS}
    box = box or lim
    trajectories = {m: [toy.trajectory(problem, m, s, step_size, steps, stop_loss=stop_loss, bounds=(box, box))
                        for s in starts] for m in toy.METHODS}
    return Study(problem, lim, thetas, fields, trajectories, list(starts))


def _background(ax, problem, xlim, ylim, star=False, levels=None):
    """Loss contours, the dashed lines, the star at the minimum; labelled axes."""
    g0, g1, thetas = toy.grid(xlim, ylim, 200)
    loss = problem.loss_at(thetas).reshape(g0.shape)
    ax.contour(g0, g1, loss, levels=levels if levels is not None else 12, colors="0.75", linewidths=0.7, zorder=0)
    t = np.linspace(*xlim, 2)
    for a, b, c, _ in problem.lines:
        if b == 0:
            ax.axvline(c / a, color="0.2", ls="--", lw=1.2, zorder=1)
        else:
            ax.plot(t, (c - a * t) / b, color="0.2", ls="--", lw=1.2, zorder=1)
    if star:
        ax.plot(0, 0, marker="*", ms=16, color="gold", mec="k", zorder=6)
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

    _arrows(axes[0], thetas, fields["SGD"], METHOD_COLORS["SGD"], False, width=0.0045, **fixed_scale(fields["SGD"]))
    _paths(axes[0], s.trajectories["SGD"], s.starts)
    axes[0].set_title("SGD")
    ngd_scale = fixed_scale(fields["NGD"], fields["iEF"])  # iEF (thin, blue) over NGD (wide, black): they coincide
    _arrows(axes[1], thetas, fields["NGD"], METHOD_COLORS["NGD"], False, width=0.008, headwidth=3, **ngd_scale)
    _arrows(axes[1], thetas, fields["iEF"], METHOD_COLORS["iEF"], False, width=0.0032, headwidth=3, **ngd_scale)
    _paths(axes[1], s.trajectories["NGD"], lw=3.2)
    _paths(axes[1], s.trajectories["iEF"], s.starts, ls=(0, (2, 2)), lw=1.4)
    axes[1].set_title("NGD / iEF")
    axes[1].legend(handles=[Line2D([], [], color=METHOD_COLORS["NGD"], lw=4, label="NGD field / path"),
                            Line2D([], [], color=METHOD_COLORS["iEF"], lw=1.4, ls=(0, (2, 2)),
                                   label="iEF field / path")], loc="lower left", framealpha=0.9)
    _arrows(axes[2], thetas, fields["EF"], METHOD_COLORS["EF"], True, width=0.005)
    _paths(axes[2], s.trajectories["EF"], s.starts)
    axes[2].add_patch(Rectangle((zoom.lim0[0], zoom.lim1[0]), 2 * zoom.half, 2 * zoom.half, fill=False, lw=1.5,
                                zorder=7))
    axes[2].annotate("zoom", (zoom.lim0[1], zoom.lim1[1]), xytext=(6, 4), textcoords="offset points")
    axes[2].set_title("EF (normalised)")
    ax = axes[3]
    _background(ax, lls, zoom.lim0, zoom.lim1, levels=levels)
    norms = zoom.field.norm(dim=1)
    _arrows(ax, zoom.thetas, zoom.field, METHOD_COLORS["EF"], False, width=0.006, scale_units="xy",
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
        _arrows(ax, s.thetas, s.fields[m], METHOD_COLORS[m], True, width=0.005)
        _paths(ax, s.trajectories[m], s.starts)
        ax.set_title(m)
    handles = [Line2D([], [], color="0.2", ls="--", label=r"decision boundary at $x=1$ ($\theta_0+\theta_1=0$)"),
               Line2D([], [], ls="", marker="8", ms=8, color="k", label="starting points")]
    _legend(fig, handles + _start_handles(s.starts))
    fig.suptitle(rf"Logistic regression, $x_0=0$ ($y_0=0$), $x_1=2$ ($y_1=1$); arrows normalised "
                 f"(the paper's {cite('fig:logistic-regression')})")
    fig.tight_layout(rect=(0, 0.09, 1, 1), h_pad=2.0)
    return fig


def first_hit(losses: torch.Tensor, threshold: float) -> int | None:
    hit = torch.nonzero(losses < threshold).flatten()
    return int(hit[0]) if len(hit) else None


def normalised_steps_table(s: Study, stop: float) -> pd.DataFrame:
    """Normalised steps of each trajectory until the loss is below ``stop`` (the figure's protocol)."""
    rows = []
    for k, start in enumerate(s.starts):
        row = {"start": str(start)}
        for m in toy.METHODS:
            loss = s.problem.loss_at(s.trajectories[m][k])
            n = first_hit(loss, stop)
            row[m] = str(n) if n is not None else f"> {len(loss) - 1} (L = {float(loss[-1]):.2g})"
        rows.append(row)
    return pd.DataFrame(rows).set_index("start")


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
