"""Why ieKFAC can beat exact iEF: the block-diagonal study (``sec:app-iEF-eNGDopt``, ``fig:sample_blockdiag_gamma``)
re-computed densely in float64 at one checkpoint, with the references that say where the difference comes from.

The evaluation records (:mod:`.evaluate_runs`) compute every ``gamma`` (``sec:eval_framework``) with the package's
fast routes: the logit Jacobian (:mod:`ief.logit_space`) and the eigendecompositions of the Kronecker factors
(:mod:`ief.kfac`). :func:`dense_check` recomputes them for one batch of a model whose trainable parameters are the
weights and biases of ``nn.Linear`` layers called once on ``[M, in]`` inputs (an MLP: ``digits-mlp``), by explicit
float64 formulas that share nothing with those routes:

- per sample ``n`` and class ``c`` one backward for the logit Jacobian ``J_z``; the Fisher as its factor ``B``
  (rows ``H_n^{1/2} J_{z,n}``, ``H_n = diag(p_n) - p_n p_n^T``, ``eqn:FIM``), so ``gamma(d) = ||B d|| / |d^T g|``;
- iEF ``J^T (J J^T + lambda I)^{-1} s`` (``eqn:iEF_lsq``) and its block-diagonal version (the same formula with
  each layer's columns of ``J`` alone);
- the K-FAC factors of every layer from its inputs ``a_n`` and output gradients ``g_n`` read per sample (``A =
  (1/M) sum a a^T`` with the bias's 1, ``G = sum w_n g g^T``; ``w_n = 1/s_n`` for ieKFAC, labels drawn from the
  model for KFAC), and ``(G (x) A + lambda I)^{-1} vec(grad_W)`` solved as a dense Kronecker system on the span of
  the ``g_n`` and of the ``a_n`` (the gradient lies in it, and it is an invariant subspace of ``G (x) A``, so the
  restriction is exact; it keeps the system at most ``M^2`` unknowns instead of ``out * in``);
- two references: the natural gradient ``F^+ g`` (``eqn:natural_gradient_alt``: the minimiser of ``gamma``) and the
  best direction in the span of the per-sample gradients, ``argmin_{d = J^T c} gamma(d)``: the subspace that iEF (and
  EF) can never leave, whatever their damping.

:func:`blockdiag_check` runs it on the evaluation job's own batches (:func:`.evaluate_runs._evaluation_inputs`, the
same damping and label draws) at one stage checkpoint of the baseline run and sets the package's ``gamma`` beside the
dense one: of the model as evaluated (float32) and of its float64 copy (which must agree to rounding).
"""
from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from ief import batch_generator, evaluate_batch, fresh_generator, get_loss, logit_sqnorm
from . import store
from .evaluate_runs import _evaluation_inputs, findings, summary_rows
from .runner import run_dir
from .setups import BASELINE, EVALUATION_KNOBS, resolve

DENSE_METHODS = ("sgd", "ief", "blockdiag_ief", "kfac", "ekfac", "iekfac", "span_best", "ngd")
PACKAGE_METHODS = ("sgd", "ief", "kfac", "ekfac", "iekfac")  # the methods ief.evaluate computes among them


def _linear_layers(model: torch.nn.Module, params: list[torch.Tensor]) -> list[tuple[torch.nn.Linear, list[int]]]:
    """``[(layer, [index of its weight, index of its bias] in params)]``; ``ValueError`` when a trainable parameter
    is not an ``nn.Linear``'s (the dense K-FAC below is written for such models only)."""
    owner = {}
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            for p in (module.weight, module.bias):
                if p is not None:
                    owner[id(p)] = module
    others = [i for i, p in enumerate(params) if id(p) not in owner]
    if others:
        raise ValueError(f"dense_check needs a model whose trainable parameters are nn.Linear weights and biases (an "
                         f"MLP); parameters {others} (indices among the trainable ones) are not")
    layers: dict[int, tuple[torch.nn.Linear, list[int]]] = {}
    for i, p in enumerate(params):
        module = owner[id(p)]
        layers.setdefault(id(module), (module, []))[1].append(i)
    return list(layers.values())


def _per_sample_quantities(model, params, layers, x, y, sampled):
    """Explicit loops over samples: ``J_z [M, C, P]``, ``J [M, P]`` (true labels), ``p [M, C]``, ``s [M]`` and per
    layer the inputs ``a [M, in]`` and the output gradients ``g`` for the true and the sampled labels."""
    m = y.shape[0]
    size = sum(p.numel() for p in params)
    jz, jac, probs, s = None, torch.zeros(m, size, dtype=torch.float64), None, torch.zeros(m, dtype=torch.float64)
    a = [[] for _ in layers]
    g_true, g_sampled = [[] for _ in layers], [[] for _ in layers]
    for n in range(m):
        seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer k -> (its input, its output)
        handles = [layer.register_forward_hook(lambda mod, i, o, k=k: seen.__setitem__(k, (i[0], o)))
                   for k, (layer, _) in enumerate(layers)]
        try:
            z = model(x[n : n + 1])
        finally:
            for h in handles:
                h.remove()
        if len(seen) != len(layers) or any(seen[k][0].shape[0] != 1 for k in seen):
            raise ValueError("dense_check needs every linear layer called once per forward on [M, in] inputs")
        z = getattr(z, "logits", z)[0]
        if z.dim() != 1:
            raise ValueError(f"dense_check needs logits [M, C], got a sample of shape {tuple(z.shape)}")
        c_count = z.shape[0]
        if jz is None:
            jz = torch.zeros(m, c_count, size, dtype=torch.float64)
            probs = torch.zeros(m, c_count, dtype=torch.float64)
        for c in range(c_count):
            jz[n, c] = torch.cat([t.reshape(-1) for t in torch.autograd.grad(z[c], params, retain_graph=True)])
        logp = torch.log_softmax(z, dim=-1)
        outs = [seen[k][1] for k in range(len(layers))]
        for labels, store_g in ((y, g_true), (sampled, g_sampled)):
            grads = torch.autograd.grad(-logp[int(labels[n])], params + outs, retain_graph=True)
            if labels is y:
                jac[n] = torch.cat([t.reshape(-1) for t in grads[: len(params)]])
            for k in range(len(layers)):
                store_g[k].append(grads[len(params) + k][0].detach())
        for k in range(len(layers)):
            a[k].append(seen[k][0][0].detach())
        probs[n] = logp.detach().exp()
        e = probs[n].clone()
        e[int(y[n])] -= 1.0
        s[n] = e @ e
    stack = lambda rows: [torch.stack(r) for r in rows]  # noqa: E731
    return jz, jac, probs, s, stack(a), stack(g_true), stack(g_sampled)


def _span_basis(rows: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis (columns) of the span of ``rows`` (singular values above ``1e-10`` of the largest)."""
    _, sv, vh = torch.linalg.svd(rows, full_matrices=False)
    if sv.numel() == 0 or float(sv[0]) == 0.0:
        return vh[:0].T
    return vh[: int((sv > sv[0] * 1e-10).sum())].T


def _kronecker_direction(g_rows, a_rows, weights, grad, damping):
    """``(G (x) A + lambda I)^{-1} vec(grad)`` (pseudo-inverse at ``lambda = 0``) for ``G = sum w g g^T`` and ``A =
    (1/M) sum a a^T``, in the bases of span(g) and span(a) (see the module docstring).

    ``grad``'s rows lie in span(a); its part on span(g) (x) span(a) is solved with the small restricted factors
    ``G_r``, ``A_r`` (``<= M x M``, eigendecomposed: ``(G_r (x) A_r + lambda)^{-1}`` divides by ``e_G e_A + lambda``);
    its part outside span(g) sees ``G = 0`` there, so the damped operator is ``lambda I`` on it: divided by
    ``lambda`` (KFAC's ``G`` comes from sampled labels, so the true gradient has such a part), dropped at 0.
    """
    m = a_rows.shape[0]
    qg, qa = _span_basis(g_rows), _span_basis(a_rows)
    if qa.shape[1] == 0:
        return torch.zeros_like(grad)
    outside = grad - qg @ (qg.T @ grad)
    solved = outside / damping if damping > 0 else torch.zeros_like(grad)
    if qg.shape[1] == 0:
        return solved
    gr = (qg.T @ g_rows.T * weights) @ (g_rows @ qg)
    ar = (qa.T @ a_rows.T) @ (a_rows @ qa) / m
    eg, ug = torch.linalg.eigh(0.5 * (gr + gr.T))
    ea, ua = torch.linalg.eigh(0.5 * (ar + ar.T))
    prod = eg.clamp_min(0)[:, None] * ea.clamp_min(0)[None, :]
    if damping > 0:
        inv = 1.0 / (prod + damping)
    else:
        inv = torch.where(prod > 1e-13 * prod.max(), 1.0 / prod.clamp_min(1e-300), torch.zeros_like(prod))
    core = ug.T @ (qg.T @ grad @ qa) @ ua
    return solved + qg @ (ug @ (core * inv) @ ua.T) @ qa.T


def dense_check(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, damping: float, *,
                generator: torch.Generator | None = None) -> dict[str, Any]:
    """Dense float64 ``gamma`` of the block-diagonal study's directions on one batch (``sec:app-iEF-eNGDopt``).

    Args:
        model: an MLP-like classifier (trainable parameters: ``nn.Linear`` weights/biases, logits ``[M, C]``); it is
            copied to float64, not changed.
        inputs, targets: the batch (``[M, in]``, class indices ``[M]``).
        damping: ``lambda >= 0`` of iEF, the block-diagonal iEF and the three K-FAC kinds, in the package's sum-loss
            convention (``0``: pseudo-inverses).
        generator: KFAC's label draw, from the state it has now, as :func:`ief.evaluate` draws it.

    Returns:
        ``{"gamma": {method: gamma}}`` for :data:`DENSE_METHODS` (``blockdiag_ief``: iEF per layer; ``span_best``:
        the best direction in the span of the per-sample gradients; ``ngd``: ``F^+ grad L``) with
        ``"outside_span"``: the share of each K-FAC direction's norm outside that span, and ``"s_spread"``: ``max_n
        s_n / min_n s_n`` of the batch (``s_n = ||grad_z l_n||^2``; at 1, ieKFAC is eKFAC rescaled: same ``gamma``).

    Raises:
        ValueError: a model outside the MLP family above, a bad damping, or targets that are not ``[M]`` indices.
    """
    if not (isinstance(damping, (int, float)) and math.isfinite(damping) and damping >= 0):
        raise ValueError(f"damping must be a finite number >= 0, got {damping!r}")
    if targets.dim() != 1 or targets.dtype.is_floating_point:
        raise ValueError(f"dense_check needs class-index targets [M], got {targets.dtype} {tuple(targets.shape)}")
    m64 = copy.deepcopy(model).to(torch.float64)
    params = [p for p in m64.parameters() if p.requires_grad]
    layers = _linear_layers(m64, params)
    x = inputs.to(torch.float64)
    with torch.no_grad():
        logits = m64(x)
    sampled = get_loss("cross_entropy").sample_targets(logits, targets, fresh_generator(generator)())
    jz, jac, probs, s, a_rows, g_true, g_sampled = _per_sample_quantities(m64, params, layers, x, targets, sampled)
    m = targets.shape[0]
    grad = jac.sum(0)
    factor = []
    for n in range(m):
        h = torch.diag(probs[n]) - torch.outer(probs[n], probs[n])
        ev, vec = torch.linalg.eigh(h)
        factor.append((vec * ev.clamp_min(0).sqrt()) @ vec.T @ jz[n])
    fisher_factor = torch.cat(factor)  # F = B^T B

    def gamma(d: torch.Tensor) -> float:
        return float((fisher_factor @ d).norm() / (d @ grad).abs())

    def ief_of(rows: torch.Tensor) -> torch.Tensor:
        gram = rows @ rows.T
        if damping > 0:
            return rows.T @ torch.linalg.solve(gram + damping * torch.eye(m, dtype=gram.dtype), s)
        return rows.T @ (torch.linalg.pinv(gram, hermitian=True) @ s)

    offsets = [0]
    for p in params:
        offsets.append(offsets[-1] + p.numel())
    columns = [torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in idx]) for _, idx in layers]
    dirs = {"sgd": grad, "ief": ief_of(jac)}
    block = torch.zeros_like(grad)
    for cols in columns:
        block[cols] = ief_of(jac[:, cols])
    dirs["blockdiag_ief"] = block
    weights = {"kfac": torch.ones(m, dtype=torch.float64), "ekfac": torch.ones(m, dtype=torch.float64),
               "iekfac": torch.where(s > 0, 1.0 / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(s))}
    for kind, w in weights.items():
        d = torch.zeros_like(grad)
        for k, (layer, idx) in enumerate(layers):
            rows = a_rows[k] if layer.weight.requires_grad else a_rows[k][:, :0]
            has_bias = layer.bias is not None and any(params[i] is layer.bias for i in idx)
            if has_bias:
                rows = torch.cat([rows, torch.ones(m, 1, dtype=torch.float64)], dim=1)
            g_rows = g_sampled[k] if kind == "kfac" else g_true[k]
            grad_w = g_true[k].T @ rows  # [out, in (+1)]: the batch gradient of the layer, from its rows
            solved = _kronecker_direction(g_rows, rows, w, grad_w, damping)
            for i in idx:
                if params[i] is layer.weight:
                    d[offsets[i] : offsets[i + 1]] = solved[:, : layer.in_features].reshape(-1)
                else:
                    d[offsets[i] : offsets[i + 1]] = solved[:, -1]
        dirs[kind] = d
    # the references: F^+ g (the minimiser of gamma) and the best direction in span(J)
    gram = fisher_factor @ fisher_factor.T
    inv = torch.linalg.pinv(gram, hermitian=True, rtol=1e-12)
    dirs["ngd"] = fisher_factor.T @ (inv @ (inv @ (fisher_factor @ grad)))
    coupled = fisher_factor @ jac.T  # [M C, M]
    coef = torch.linalg.lstsq(coupled.T @ coupled, jac @ grad).solution
    dirs["span_best"] = jac.T @ coef
    basis = _span_basis(jac)
    outside = {k: float((dirs[k] - basis @ (basis.T @ dirs[k])).norm() / dirs[k].norm())
               for k in ("kfac", "ekfac", "iekfac", "ngd")}
    return {"gamma": {k: gamma(dirs[k]) for k in DENSE_METHODS}, "outside_span": outside,
            "s_spread": float(s.max() / s.min()) if float(s.min()) > 0 else math.inf}



def _baseline_checkpoint(setup: str, scale: str, seed: int, stage: int, runs_dir: str | Path) -> tuple[Any, Path]:
    """``(resolved setup, path)`` of the baseline run's stage checkpoint; ``FileNotFoundError`` naming the command
    that trains the baseline when it is not there."""
    cfg = resolve(setup, scale)
    optimizer = BASELINE[cfg.method]
    path = run_dir(runs_dir, scale, setup, optimizer, seed) / "checkpoints" / f"stage-{stage:03d}.pt"
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint {path}; train the baseline first: python -m companion train "
                                f"--setup {setup} --scale {scale} --optimizer {optimizer} --seed {seed} "
                                f"--out {runs_dir}")
    return cfg, path

def blockdiag_check(runs_dir: str | Path, setup: str = "digits-mlp", scale: str = "cpu", *, seed: int = 0,
                    stage: int = 50, batches: int = 2, undamped: bool = True) -> pd.DataFrame:
    """The dense check of :func:`dense_check` on the evaluation job's first ``batches`` batches at ``stage``.

    Args:
        runs_dir: where the baseline run is (``python -m companion train --out``); its ``checkpoints/stage-PPP.pt``.
        setup, scale, seed: the run (its baseline optimiser, :data:`.setups.BASELINE`).
        stage: the stage checkpoint (percent of training).
        batches: how many of the evaluation job's fixed batches (its first ones, same label draws).
        undamped: add rows at ``damping = 0`` (pseudo-inverses) beside the setup's iEF damping.

    Returns:
        One row per (damping, batch, method): ``gamma`` (dense float64), ``ratio`` (to the dense SGD ``gamma``),
        ``package`` (``ief.evaluate``'s ``gamma`` of the model as evaluated, float32 for the cpu runs; only for
        :data:`PACKAGE_METHODS` at the setup's damping), ``package64`` (the same on the float64 copy),
        ``outside_span`` (K-FAC kinds and ``ngd``) and ``s_spread``.

    Raises:
        FileNotFoundError: no such checkpoint (train the baseline first: the message says how).
        ValueError: a setup whose model is not an MLP (see :func:`dense_check`) or ``batches < 1``.
    """
    if batches < 1:
        raise ValueError(f"batches must be >= 1, got {batches}")
    cfg, path = _baseline_checkpoint(setup, scale, seed, stage, runs_dir)
    knobs = EVALUATION_KNOBS[scale]
    m = knobs["batch_size"] or cfg.batch_size
    model, _, fixed, _ = _evaluation_inputs(cfg, setup, seed, m, max(batches, knobs["batches"]), False)
    store.load_trainable(model, store.read_torch(path))
    lam = float(cfg.optimizers["ief"].damping)
    rows = []
    for b, (x, y) in enumerate(fixed[:batches]):
        gen = batch_generator(seed * 7919 + b, 0)  # the evaluation job's generator of this batch
        package = {}
        for label, net in (("package", model), ("package64", copy.deepcopy(model).to(torch.float64))):
            xin = x.to(next(net.parameters()).dtype)
            recs, _ = evaluate_batch(net, xin, y, list(PACKAGE_METHODS), lam, generator=batch_generator(
                seed * 7919 + b, 0))
            package[label] = {r["method"]: r["gamma"] for r in recs}
        for lam_ in ([lam, 0.0] if undamped else [lam]):
            out = dense_check(model, x, y, lam_, generator=gen)
            for method, value in out["gamma"].items():
                at_lam = lam_ == lam
                rows.append({"stage": stage, "batch": b, "damping": lam_, "method": method, "gamma": value,
                             "ratio": value / out["gamma"]["sgd"],
                             "package": package["package"].get(method) if at_lam else None,
                             "package64": package["package64"].get(method) if at_lam else None,
                             "outside_span": out["outside_span"].get(method), "s_spread": out["s_spread"]})
    return pd.DataFrame(rows)


def check_summary(table: pd.DataFrame) -> dict[str, float]:
    """The numbers the chapter states, from :func:`blockdiag_check`'s table (means over its batches).

    Returns ``{"<method>": mean ratio to SGD}`` at the setup's damping, ``"<method>_undamped"`` at ``damping = 0``
    (when present), ``"iekfac_over_ief"``, ``"blockdiag_ief_over_ief"``, ``"iekfac_outside_span"`` (mean share),
    ``"s_spread"`` (mean), and ``"package_rel_err"`` / ``"package64_rel_err"``: the largest relative difference of
    the package's ``gamma`` from the dense one (float32 model as evaluated / float64 copy).
    """
    if table.empty:
        raise ValueError("the check's table is empty: nothing to summarise")
    lam = float(table["damping"].max())
    damped = table[table["damping"] == lam]
    means = damped.groupby("method")["ratio"].mean()
    out = {k: float(v) for k, v in means.items()}
    undamped = table[table["damping"] == 0.0]
    if lam > 0 and not undamped.empty:
        out.update({f"{k}_undamped": float(v) for k, v in undamped.groupby("method")["ratio"].mean().items()})
    out["iekfac_over_ief"] = out["iekfac"] / out["ief"]
    out["blockdiag_ief_over_ief"] = out["blockdiag_ief"] / out["ief"]
    out["iekfac_outside_span"] = float(damped.loc[damped["method"] == "iekfac", "outside_span"].mean())
    out["s_spread"] = float(damped.groupby("batch")["s_spread"].first().mean())
    for col in ("package", "package64"):
        pk = damped.dropna(subset=[col])
        out[f"{col}_rel_err"] = float(((pk[col] - pk["gamma"]).abs() / pk["gamma"]).max())
    return out


def s_spread(runs_dir: str | Path, setup: str, scale: str = "cpu", *, seed: int = 0, stage: int = 50) -> float:
    """Mean over the evaluation job's batches of ``max_n s_n / min_n s_n`` (``s_n = ||grad_z l_n||^2``,
    ``eqn:s_ief``) at a stage checkpoint of the baseline run: one forward per batch, any setup.

    At 1 every sample of a batch has the same ``s_n`` and ieKFAC is eKFAC rescaled (the same ``gamma``); the larger
    it is, the more the two can differ. ``inf`` when a sample has ``s_n = 0``.

    Raises:
        FileNotFoundError: no such checkpoint.
    """
    cfg, path = _baseline_checkpoint(setup, scale, seed, stage, runs_dir)
    knobs = EVALUATION_KNOBS[scale]
    model, _, fixed, _ = _evaluation_inputs(cfg, setup, seed, knobs["batch_size"] or cfg.batch_size, knobs["batches"],
                                            False)
    store.load_trainable(model, store.read_torch(path))
    spreads = []
    with torch.no_grad():
        for inputs, targets in fixed:
            out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
            s = logit_sqnorm(get_loss("cross_entropy"), getattr(out, "logits", out), targets).to(torch.float64)
            spreads.append(math.inf if float(s.min()) == 0 else float(s.max() / s.min()))
    return float(sum(spreads) / len(spreads))


def _pct(x: float) -> str:
    return f"{x:.1e}" if x < 1e-3 else f"{x:.2g}"


def check_glue(summary: dict[str, float], *, setup: str, stage: int, batches: int, records_ratio: float | None,
               spreads: dict[str, float], ekfac_over_iekfac: dict[str, float | None]) -> dict[str, str]:
    """The chapter's glued strings for the dense check (``kc_*`` keys), verdict words included: each is computed from
    the numbers, so a check that comes out otherwise says so.

    Args:
        summary: :func:`check_summary` of the check's table.
        setup, stage, batches: where the check ran.
        records_ratio: the evaluation records' median over stages of ieKFAC/iEF for ``setup`` (``None``: none).
        spreads: ``{setup: s_spread}`` (:func:`s_spread`) of the block-diagonal setups at ``stage``.
        ekfac_over_iekfac: ``{setup: eKFAC/ieKFAC}`` of the records' mean ratios at ``stage``.
    """
    f = lambda x: "n/a" if x is None or not math.isfinite(x) else f"{x:.3f}"  # noqa: E731
    agree = summary["package64_rel_err"] < 1e-6
    below = summary["iekfac"] < summary["ief"]
    undamped_below = summary.get("iekfac_undamped", summary["iekfac"]) < summary.get("ief_undamped", summary["ief"])
    block_close = abs(summary["blockdiag_ief_over_ief"] - 1.0) < 0.1
    return {
        "kc_setup": setup, "kc_stage": f"{stage}%", "kc_batches": str(batches),
        "kc_records_ratio": f(records_ratio),
        "kc_pkg64_err": _pct(summary["package64_rel_err"]), "kc_pkg_err": _pct(summary["package_rel_err"]),
        "kc_bug_verdict": ("they agree, so the records are not a bug of ief.kfac or ief.evaluation" if agree else
                           "they DISAGREE: a bug, to be found before the records are read"),
        **{f"kc_{k}": f(summary[k]) for k in ("ief", "iekfac", "ekfac", "kfac", "blockdiag_ief", "ngd", "span_best",
                                               "iekfac_over_ief")},
        "kc_ief_undamped": f(summary.get("ief_undamped")), "kc_iekfac_undamped": f(summary.get("iekfac_undamped")),
        "kc_real_verdict": "is below" if below else "is not below",
        "kc_damping_verdict": ("persists without damping" if undamped_below == below else
                               "changes sides without damping: the damping decides it"),
        "kc_blockdiag_verdict": ("within 10 % of full iEF: the block-diagonal restriction is not what helps"
                                 if block_close else "more than 10 % from full iEF: the restriction itself matters"),
        "kc_outside": f"{100 * summary['iekfac_outside_span']:.2f} %",
        "kc_s_spreads": ", ".join(f"{s}: ×{v:.3g}" for s, v in spreads.items()),
        "kc_ek_over_iek": ", ".join(f"{s}: {f(v)}" for s, v in ekfac_over_iekfac.items()),
    }


def not_computed_glue() -> dict[str, str]:
    """The check's glue where there is no check (no MLP among the block-diagonal setups: full scale)."""
    return {k: "not computed at this scale (no MLP setup)" for k in CHECK_KEYS}


CHECK_KEYS = ("kc_setup", "kc_stage", "kc_batches", "kc_records_ratio", "kc_pkg64_err", "kc_pkg_err", "kc_bug_verdict",
              "kc_ief", "kc_iekfac", "kc_ekfac", "kc_kfac", "kc_blockdiag_ief", "kc_ngd", "kc_span_best",
              "kc_iekfac_over_ief", "kc_ief_undamped", "kc_iekfac_undamped", "kc_real_verdict", "kc_damping_verdict",
              "kc_blockdiag_verdict", "kc_outside", "kc_s_spreads", "kc_ek_over_iek")


def chapter_check(records: list[dict[str, Any]], runs_dir: str | Path, setups: Sequence[str], scale: str, *,
                  seed: int = 0, stage: int = 50, batches: int = 2) -> tuple[dict[str, str], pd.DataFrame | None]:
    """``(glue, table)`` of the evaluation chapter's dense check: :func:`blockdiag_check` on the first MLP setup of
    ``setups`` (the block-diagonal figure's), :func:`s_spread` and the records' eKFAC/ieKFAC of every one of them at
    ``stage``. Without an MLP among ``setups`` (the paper's T5 setups at full scale: too large for a dense check)
    every key reads "not computed at this scale" and the table is ``None``."""
    mlp = [s for s in setups if resolve(s, scale).family == "mlp"]
    if not mlp:
        return not_computed_glue(), None
    table = blockdiag_check(runs_dir, mlp[0], scale, seed=seed, stage=stage, batches=batches)
    means = {(r["setup"], r["stage"], r["method"]): r["mean"] for r in summary_rows(records)}
    ratio = lambda s: (means[(s, stage, "ekfac")] / means[(s, stage, "iekfac")]  # noqa: E731
                       if (s, stage, "ekfac") in means and (s, stage, "iekfac") in means else None)
    glue = check_glue(check_summary(table), setup=mlp[0], stage=stage, batches=batches,
                      records_ratio=findings(records).get(mlp[0], {}).get("iekfac_over_ief"),
                      spreads={s: s_spread(runs_dir, s, scale, seed=seed, stage=stage) for s in setups},
                      ekfac_over_iekfac={s: ratio(s) for s in setups})
    return glue, table


CHECK_FILES = ("blockdiag_check.csv", "blockdiag_check.json")  # the workflow's table and glue, in results/<scale>/
CHECK_STAGE = 50  # the stage checkpoint (percent of training) the evaluation chapter's dense check reads


def write_chapter_check(scale: str, runs_dir: str | Path, results_dir: str | Path, out: str | Path, *,
                        seed: int | None = None, stage: int = CHECK_STAGE, batches: int = 2) -> list[Path]:
    """:func:`chapter_check` as the evaluation chapter ran it, on the block-diagonal figure's setups
    (:func:`.setups.blockdiag_setups`) and their evaluation records (``results_dir/eval/<setup>.csv``, the
    ``evaluate`` jobs' tables), written atomically: the table to ``out`` and ``{"scale", "setups", "seed", "stage",
    "batches", "glue"}`` to ``out`` with the suffix ``.json`` (last). The workflow's ``blockdiag_check`` job
    (``python -m companion blockdiag-check``).

    Raises:
        FileNotFoundError: an evaluation table or a baseline checkpoint is missing (the message names what makes it).
        ValueError: an unknown scale, or one whose block-diagonal setups hold no MLP (nothing to check: the chapter
            glues :func:`not_computed_glue` there).
    """
    from .evaluate_runs import read_records
    from .setups import EVALUATION_SEED, blockdiag_check_setup, blockdiag_setups

    seed = EVALUATION_SEED if seed is None else seed
    setups = list(blockdiag_setups(scale))
    if blockdiag_check_setup(scale) is None:
        raise ValueError(f"no MLP among the block-diagonal setups at {scale!r} ({', '.join(setups)}): no dense check")
    tables = [Path(results_dir) / "eval" / f"{s}.csv" for s in setups]
    missing = [str(t) for t in tables if not t.is_file()]
    if missing:
        raise FileNotFoundError(f"missing evaluation tables {', '.join(missing)}: the workflow's `evaluate` jobs "
                                f"make them (python -m companion evaluate --setup S --scale {scale} --seed {seed} "
                                f"--runs {runs_dir} --out {Path(results_dir) / 'eval'}/S.csv)")
    records = [r for t in tables for r in read_records(t)]
    glue, table = chapter_check(records, runs_dir, setups, scale, seed=seed, stage=stage, batches=batches)
    out = Path(out)
    meta = out.with_suffix(".json")
    store.write_text(out, table.to_csv(index=False))
    store.write_json(meta, dict(scale=scale, setups=setups, seed=seed, stage=stage, batches=batches, glue=glue))
    return [out, meta]


def read_chapter_check(path: str | Path, scale: str) -> tuple[dict[str, Any], pd.DataFrame]:
    """``(meta, table)`` that :func:`write_chapter_check` wrote to ``path`` (and its ``.json``; floats read back
    exactly); ``FileNotFoundError`` naming the job that makes them when one is missing."""
    import json

    path = Path(path)
    paths = [path, path.with_suffix(".json")]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(
            f"the dense check's table is missing ({', '.join(missing)}): the workflow's `blockdiag_check` job makes "
            f"it (`make book SCALE={scale}`); by hand, after the baseline runs and their evaluation: `python -m "
            f"companion blockdiag-check --scale {scale} --runs runs --results {path.parent} --out {path}`")
    # floats read back exactly: pandas 3 does so by default (and deprecates the option), pandas 2 with round_trip
    exact = {} if int(pd.__version__.split(".")[0]) >= 3 else dict(float_precision="round_trip")
    return json.loads(paths[1].read_text()), pd.read_csv(path, **exact)
