"""Figures and tables of the convergence chapter (``notebooks/convergence.ipynb``): the lemma, the two theorems and
the assumption of the paper's convergence analysis, measured by :mod:`companion.demos.theory` on small networks."""
from __future__ import annotations

import pandas as pd

from .style import METHOD_COLORS, SEQUENCE_COLORS
from .common import PAGE_WIDTH_IN, plain_log_axes

GUIDE = "#bbbbbb"  # reference slopes: not a method

# Per scale: end time / largest step / tolerance of the two flows and the lemma's finite-difference steps
SETTINGS = {
    "smoke": dict(t_end=10.0, dt=0.5, rtol=1e-6, t_end_linear=1.5, dt_linear=0.05, rtol_linear=1e-5,
                  lemma_dts=[1e-1, 1e-2, 1e-3, 1e-4]),
    "cpu": dict(t_end=100.0, dt=0.5, rtol=1e-8, t_end_linear=6.0, dt_linear=0.05, rtol_linear=1e-6,
                lemma_dts=[1e-1, 3e-2, 1e-2, 3e-3, 1e-3, 3e-4, 1e-4]),
    "full": dict(t_end=1000.0, dt=2.0, rtol=1e-10, t_end_linear=8.0, dt_linear=0.05, rtol_linear=1e-8,
                 lemma_dts=[1e-1, 3e-2, 1e-2, 3e-3, 1e-3, 3e-4, 1e-4, 3e-5]),
}


def chapter_settings(scale: str, t_end: float | None = None, dt: float | None = None, rtol: float | None = None,
                     t_end_linear: float | None = None) -> dict:
    """The convergence chapter's settings at ``scale`` (:data:`SETTINGS`), with the notebook's overrides (``None``:
    the scale's value; ``rtol`` sets both flows' tolerance)."""
    if scale not in SETTINGS:
        raise ValueError(f"scale must be one of {sorted(SETTINGS)}, got {scale!r}")
    cfg = dict(SETTINGS[scale])
    cfg.update({k: v for k, v in dict(t_end=t_end, dt=dt, rtol=rtol, t_end_linear=t_end_linear).items()
                if v is not None})
    cfg["rtol_linear"] = rtol if rtol is not None else cfg["rtol_linear"]
    return cfg


def sample_color(n: int) -> str:
    return SEQUENCE_COLORS[n % len(SEQUENCE_COLORS)]


def lemma_figure(lemma, lemma_over):
    """Finite-difference error of dl_n/dt = -||grad_z l_n||^2 against the step h (forward, central; N > P)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(PAGE_WIDTH_IN, 5.6))
    h = lemma.dts.numpy()
    ax.loglog(h, lemma.forward_error.numpy(), "o-", color=METHOD_COLORS["iEF"],
              label=f"forward difference (N = {lemma.n_samples} ≤ P = {lemma.n_params})")
    ax.loglog(h, lemma.central_error.numpy(), "s--", color=METHOD_COLORS["iEF"],
              label=f"central difference (N = {lemma.n_samples} ≤ P = {lemma.n_params})")
    ax.loglog(h, lemma_over.forward_error.numpy(), "^-", color=SEQUENCE_COLORS[3],
              label=f"forward difference (N = {lemma_over.n_samples} > P: full rank violated)")
    ax.axhline(lemma_over.identity_residual, color=SEQUENCE_COLORS[3], ls=":", lw=1.2, label="its limit h → 0 (N > P)")
    for order, err in ((1, lemma.forward_error), (2, lemma.central_error)):
        ref = 0.25 * float(err[0]) * (h / h[0]) ** order  # guide lines, drawn below the data
        ax.loglog(h, ref, color=GUIDE, lw=1.2, zorder=0)
        ax.annotate(f"slope {order}", (h[1], ref[1]), textcoords="offset points", xytext=(0, -12), color="#888888",
                    fontsize=9, ha="center")
    ax.set_xlabel("step size h")
    ax.set_ylabel(r"$\max_n |D_h l_n + \|\nabla_{z_n} l_n\|^2| \,/\, \|\nabla_{z_n} l_n\|^2$")
    ax.set_title(r"iEF flow: $dl_n/dt = -\|\nabla_{z_n} l_n\|^2$ by finite differences")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=1, frameon=False)
    plain_log_axes(fig)  # no superscript tick labels: they would be under 9 px on the page
    return fig


def sublinear_figure(flow_ce, sub):
    """p_n(t) and the bound 1 - 2/(t + C0 + 1) (top), and 1 - p_n(t) against 2/(t + C0 + 1) on log-log axes."""
    import matplotlib.pyplot as plt

    t = flow_ce.times.numpy()
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(PAGE_WIDTH_IN, 8.4))
    for n in range(flow_ce.n_samples):
        c = sample_color(n)
        ax.plot(t, flow_ce.target_prob[:, n].numpy(), color=c, lw=1.6, label=f"sample {n}")
        ax.plot(t, sub.bound[:, n].numpy(), color=c, lw=1.2, ls="--")
        keep = sub.valid[:, n].numpy() & (t > 0)
        ax2.loglog(t[t > 0], 1 - flow_ce.target_prob[t > 0, n].numpy(), color=c, lw=1.6)
        ax2.loglog(t[keep], 2 / (t[keep] + float(sub.c0[n]) + 1), color=c, lw=1.2, ls="--")
    ax.plot([], [], color="k", ls="--", lw=1.2, label="bound 1 − 2/(t + C₀ + 1)")
    ax.set(ylim=(0, 1.02), xlabel="flow time t", ylabel=r"target probability $\hat p_n(t)$",
           title=r"$\hat p_n(t) > 1 - 2/(t + C_0 + 1)$ (solid: flow, dashed: bound)")
    ax.legend(loc="lower right", ncol=2)
    ax2.set(xlabel="flow time t", ylabel=r"$1 - \hat p_n(t)$ (solid), $2/(t + C_0 + 1)$ (dashed)",
            title=r"Same, log-log: $1 - \hat p_n(t) < 2/(t + C_0 + 1)$")
    fig.suptitle(f"iEF flow, softmax + cross-entropy, tanh MLP (N={flow_ce.n_samples}, P={flow_ce.n_params})")
    plain_log_axes(fig)  # no superscript tick labels: they would be under 9 px on the page
    fig.tight_layout()
    return fig


def linear_figure(flow_mse, lin):
    """l_n(t) - l* against e^{-2mt}(l_n(0) - l*) (top) and the relative margin with the integration tolerance."""
    import matplotlib.pyplot as plt

    t = flow_mse.times.numpy()
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(PAGE_WIDTH_IN, 7.2), sharex=True,
                                  gridspec_kw={"height_ratios": [2.2, 1]})
    for n in range(flow_mse.n_samples):
        c = sample_color(n)
        ax.semilogy(t, lin.gap[:, n].numpy(), color=c, lw=2.2, alpha=0.8, label=f"sample {n}")
        ax.semilogy(t, lin.bound[:, n].numpy(), color="k", lw=0.8, ls="--")
        ax2.plot(t, lin.relative_margin[:, n].numpy(), color=c, lw=1.2)
    ax.plot([], [], color="k", ls="--", lw=0.8, label=r"bound $e^{-2t}(l_n(0) - l_n^\star)$")
    ax.set(ylabel=r"$l_n(t) - l_n^\star$", title=r"$l_n(t) - l_n^\star \leq e^{-2mt}(l_n(0) - l_n^\star)$, MSE, m = 1")
    ax.legend(loc="lower left", ncol=2)
    ax2.axhspan(-lin.tolerance, lin.tolerance, color=METHOD_COLORS["iEF"], alpha=0.15, lw=0,
                label="± integration-error tolerance")
    ax2.axhline(0, color="k", lw=0.8)
    ax2.set(xlabel="flow time t", ylabel="relative margin\n(bound − gap) / bound")
    ax2.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    ax2.legend(loc="lower left")
    fig.suptitle(f"iEF flow, squared error, tanh MLP (N={flow_mse.n_samples}, P={flow_mse.n_params}, 2 outputs)")
    plain_log_axes(fig)  # no superscript tick labels: they would be under 9 px on the page
    fig.tight_layout()
    return fig


def gram_figure(flow_ce, flow_mse):
    """Smallest eigenvalue of the Gram matrix along both flows: raw (top) and of unit per-sample gradients."""
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(PAGE_WIDTH_IN, 7.0))
    for flow, name, ls in ((flow_ce, "softmax + CE flow", "-"), (flow_mse, "squared-error flow", "--")):
        x = flow.times.numpy()
        ax.semilogy(x, flow.gram_min_eig.numpy(), color=METHOD_COLORS["iEF"], ls=ls, label=f"iEF, {name}")
        ax2.semilogy(x, flow.gram_min_eig_normalised.numpy(), color=METHOD_COLORS["iEF"], ls=ls, label=f"iEF, {name}")
    for a, what, title in ((ax, r"$\lambda_\min(\nabla_\theta l\, \nabla_\theta l^\top)$", "smallest eigenvalue"),
                           (ax2, r"$\lambda_\min$, unit per-sample gradients",
                            "same, per-sample gradients normalised to unit length")):
        a.set_xscale("symlog", linthresh=1.0)
        a.set(xlabel="flow time t (linear below 1, log above)", ylabel=what, title=title)
        a.legend()
    fig.suptitle("Full-rank Gram matrix along both flows")
    plain_log_axes(fig)  # no superscript tick labels: they would be under 9 px on the page
    fig.tight_layout()
    return fig


def equivalence_table(rows) -> pd.DataFrame:
    return pd.DataFrame([{"setting": r.setting, "A vs B": r.comparison, "‖A−B‖/‖B‖": r.rel_diff,
                          "min_a ‖aA−B‖/‖B‖": r.scale_free_diff, "expected": r.expected,
                          "as expected": r.as_expected} for r in rows])


def summary_table(lemma, sub, lin, flow_ce, flow_mse) -> pd.DataFrame:
    """The smallest margin of every check (a bound holds when its margin is >= 0)."""
    return pd.DataFrame([
        {"check": "lemma: forward-difference error at smallest h", "value": float(lemma.forward_error[-1]),
         "note": f"fitted order {lemma.forward_order:.2f} (expected 1)"},
        {"check": "lemma: central-difference error at smallest h", "value": float(lemma.central_error[-1]),
         "note": f"fitted order {lemma.central_order:.2f} (expected 2)"},
        {"check": "lemma: |J v + s| / s (exact, N <= P)", "value": lemma.identity_residual, "note": "rounding level"},
        {"check": "sub-linear: min p_n(t) - bound", "value": sub.min_margin,
         "note": f"at sample {sub.argmin[0]}, t = {sub.argmin[1]:g}; integration error < "
                 f"{sub.discretisation_error:.0e}"},
        {"check": "sub-linear: min relative margin", "value": sub.min_relative_margin,
         "note": "(p - bound) / (1 - bound)"},
        {"check": "sub-linear: min un-relaxed margin", "value": sub.min_tight_margin, "note": "Phi(p_n(t)) - C_0 - t"},
        {"check": "linear: min bound - gap", "value": lin.min_margin, "note": "absolute"},
        {"check": "linear: min relative margin", "value": lin.min_relative_margin,
         "note": f"tolerance {lin.tolerance:.1e} (bound attained)"},
        {"check": "Gram: min normalised eigenvalue (CE flow)", "value": float(flow_ce.gram_min_eig_normalised.min()),
         "note": "> 0: full rank"},
        {"check": "Gram: min normalised eigenvalue (MSE flow)", "value": float(flow_mse.gram_min_eig_normalised.min()),
         "note": "> 0: full rank"},
    ]).set_index("check")


def margins_record(scale, seed, n_samples, lemma, lemma_over, sub, lin, flow_ce, flow_mse, rows, timings) -> dict:
    """Everything the chapter measured, as plain data (written to ``margins.json``)."""
    return {
        "scale": scale, "seed": seed, "n_samples": n_samples,
        "lemma": {"dts": lemma.dts.tolist(), "forward_error": lemma.forward_error.tolist(),
                  "central_error": lemma.central_error.tolist(), "forward_order": lemma.forward_order,
                  "central_order": lemma.central_order, "identity_residual": lemma.identity_residual,
                  "over_parameter_limit_residual": lemma_over.identity_residual},
        "sublinear": {"min_margin": sub.min_margin, "min_relative_margin": sub.min_relative_margin,
                      "min_tight_margin": sub.min_tight_margin, "discretisation_error": sub.discretisation_error,
                      "t_end": float(flow_ce.times[-1]), "holds": sub.holds},
        "linear": {"min_margin": lin.min_margin, "min_relative_margin": lin.min_relative_margin,
                   "tolerance": lin.tolerance, "attained": lin.attained, "t_end": float(flow_mse.times[-1]),
                   "holds": lin.holds},
        "gram_min_eig_normalised": {"cross_entropy": float(flow_ce.gram_min_eig_normalised.min()),
                                    "mse": float(flow_mse.gram_min_eig_normalised.min())},
        "equivalence": [{"setting": r.setting, "comparison": r.comparison, "rel_diff": r.rel_diff,
                         "scale_free_diff": r.scale_free_diff, "expected": r.expected, "as_expected": r.as_expected}
                        for r in rows],
        "timings_s": timings,
    }


def sci(x: float) -> str:
    """A number for prose: 3 significant digits, scientific when small or large."""
    return f"{x:.2e}" if x != 0 and (abs(x) < 1e-2 or abs(x) >= 1e4) else f"{x:.3g}"



