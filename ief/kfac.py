"""Block-diagonal K-FAC directions: KFAC (sampled labels), eKFAC (empirical) and ieKFAC (iEF-rescaled), per
Appendix D.2.2.

For every trainable ``nn.Linear`` the Fisher block of its weight (and bias) is approximated by a Kronecker product
``F_W ~ G (x) A`` and the direction is ``d_W = (G (x) A + lambda I)^{-1} vec(grad_W L)``. Here, with ``a`` the
layer's input rows and ``g`` the gradients of the per-sample losses with respect to the layer's output rows:

- ``A = (1/R) sum_r a_r a_r^T`` (the mean over the ``R`` input rows; ``[a, 1]`` when the bias trains too),
- ``G = sum_r w_r g_r g_r^T``, summed (not averaged) because the package's loss is the sum ``L = sum_n l_n``
  (Eq. (1)), so that ``G (x) A`` has the scale of the Fisher block it approximates. ``g`` is computed
  for labels drawn from the model (``kind="kfac"``: block-diagonal SF, K-BFGS's "KFAC"), for the true labels
  (``"ekfac"``: the empirical K-FAC of Kunstner et al., block-diagonal EF; *not* the eigenvalue-corrected EKFAC),
  or for the true labels with every row of sample ``n`` weighted by ``w_r = 1/s_n``, ``s_n = ||grad_{z_n} l_n||^2``
  (``"iekfac"``: ``G* = E[g^T diag(s_iEF)^{-1} g]``, block-diagonal iEF). ``w_r = 1`` otherwise.

These are the conventions of curvlinops' ``KFACLinearOperator`` with a sum-reduced loss and
``separate_weight_and_bias=False``, against which the package is tested.

**Damping.** ``lambda`` is added to the whole Kronecker block, ``(G (x) A + lambda I)^{-1}``, and applied exactly
through the eigendecompositions of both factors (``G = U diag(e_G) U^T``, ``A = V diag(e_A) V^T``:
``d_W = U [(U^T Grad V) / (e_G e_A^T + lambda)] V^T``). This is the same Tikhonov damping that the exact EF / iEF /
SF directions add (``ief.ef_direction`` etc.), so one ``lambda`` axis serves all of them; it is *not* the factored
(pi-) damping ``(G + sqrt(lambda) I) (x) (A + sqrt(lambda) I)`` of Martens & Grosse. ``lambda = 0`` is allowed: the
pseudo-inverse is used (eigenvalue products at rounding level are dropped), as the paper's "un-damped" study needs.

**Sequence positions.** ``approx="expand"`` (default) treats every position a linear layer sees as a row of its own
(``R = M T``), the form the paper writes (``E[g^T g] (x) E[a^T a]`` over all rows), used by K-FAC implementations
for transformers and curvlinops' default. ``approx="reduce"`` (Eschenhagen et al., 2023) first averages ``a`` and
sums ``g`` over each sample's positions (``R = M``); it is exact for deep linear networks with one loss per
sequence, where expand is exact with one loss per position. Positions with ignored targets still enter ``A``
(the layer sees them); their ``g`` is zero when they do not reach the loss.

**Other trainable parameters.** K-FAC is defined here for ``nn.Linear`` only. A trainable parameter that is not the
weight or bias of an ``nn.Linear`` (prompt embeddings, LayerNorm, raw ``Parameter`` attention weights) raises a
``ValueError`` that names it: pass ``params=`` to restrict the direction (and then ``gamma``) to the linear layers.
There is no silent fallback, since a mixed preconditioner would not be the block-diagonal method the paper
evaluates. A linear layer whose leading input dimension is not the sample dimension raises too.

**Calls that reach no loss.** Only calls whose output the graph behind the logits reaches enter the factors (proven
from the graph: :meth:`ief.jacobian.PerSampleCapture.unreached_calls`). peft DoRA computes its weight norm by calling
``lora_A`` / ``lora_B`` on an ``[in, in]`` identity and uses the result detached: those calls are no rows of ``A``
(they would be when ``M`` equals the layer's width) and need no sample dimension.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from .jacobian import PerSampleCapture
from .losses import Loss, check_damping, get_loss, logit_sqnorm
from .model_call import Inputs, ReplayableForward, batch_size, param_names, resolve_params

KINDS = ("kfac", "ekfac", "iekfac")
APPROXIMATIONS = ("expand", "reduce")


@dataclass
class KroneckerBlock:
    """One linear layer's factors: ``F_block ~ G (x) A`` for the gradient matrix ``[grad_W, grad_b]``.

    Attributes:
        name: the layer's name in the model (``named_modules``).
        G: ``[out, out]``, float64: the output-gradient factor.
        A: ``[k, k]``, float64: the input factor; its ``k`` columns are the layer's inputs, then a constant 1 for the
            bias when the bias is preconditioned (the last column).
        index: ``{"weight": i}`` and, with a bias, ``{"bias": j}``: where each of the layer's parameters is in
            ``params``.
    """

    name: str
    G: torch.Tensor
    A: torch.Tensor
    index: dict[str, int]


def check_kind(kind: str) -> str:
    """``kind`` if it is one of :data:`KINDS`; ``ValueError`` naming it and the accepted ones otherwise."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; accepted: {', '.join(map(repr, KINDS))}")
    return kind


def check_approx(approx: str) -> str:
    """``approx`` if it is one of :data:`APPROXIMATIONS`; ``ValueError`` naming it and the accepted ones otherwise."""
    if approx not in APPROXIMATIONS:
        raise ValueError(f"unknown approx {approx!r}; accepted: {', '.join(map(repr, APPROXIMATIONS))}")
    return approx


def _rows(x: torch.Tensor, m: int, approx: str, reduce_op: str) -> torch.Tensor:
    """``[M, ..., d] -> [R, d]`` float64: every position a row (expand) or one row per sample (reduce)."""
    x = x.reshape(m, -1, x.shape[-1]).to(torch.float64)
    if approx == "expand":
        return x.reshape(-1, x.shape[-1])
    return x.mean(dim=1) if reduce_op == "mean" else x.sum(dim=1)


class _LinearHooks(PerSampleCapture):
    """The per-sample capture's hooks (:class:`ief.jacobian.PerSampleCapture`: every call's input and the gradient
    flowing back into its output), restricted to the ``nn.Linear`` layers owning ``params``: K-FAC needs their raw rows,
    not per-sample products or sample axes. ``records[k]``: ``[[input, output grad, _], ...]`` per call; ``modules[k]``:
    ``(module, rule, features, {"weight"/"bias": index in params})``. Any other trainable parameter: ``ValueError``."""

    def __init__(self, model: torch.nn.Module, params: list[torch.Tensor], names: list[str], kind: str):
        super().__init__(model, params)
        self.modules = [entry for entry in self.modules if type(entry[0]) is torch.nn.Linear]
        covered = {i for *_, owned in self.modules for i in owned.values()}
        others = [names[i] for i in range(len(params)) if i not in covered]
        if others:
            raise ValueError(
                f"K-FAC ({kind}) is defined for nn.Linear weights and biases only; trainable parameters outside any "
                f"nn.Linear: {others[:5]}{' ...' if len(others) > 5 else ''}. Pass params= with the linear layers' "
                "parameters only (and the same params= to ief.gamma)"
            )


def data_parallel_module(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside ``torch.nn.DataParallel`` / ``DistributedDataParallel`` wrappers (``model`` itself
    otherwise): K-FAC runs its forward and backward, since DDP's own forward would arm a gradient all-reduce that
    the factors' ``autograd.grad`` never triggers (:class:`ief.optim.KFAC` reduces the factors itself).

    Args:
        model: the model as given.

    Returns:
        The innermost data-parallel wrapper's ``.module``, or ``model``.
    """
    while isinstance(model, (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)):
        model = model.module
    return model


def check_linear_only(model: torch.nn.Module, params: Iterable[torch.nn.Parameter] | None = None,
                      kind: str = "kfac") -> None:
    """Raise the ``ValueError`` of :func:`kfac_direction` up front if a parameter is not an ``nn.Linear``'s.

    K-FAC's factors (Martens and Grosse's; the paper's appendix section "Improving Empirical K-FAC with IEF") exist
    for ``nn.Linear`` weights and biases only; this checks a model before a long run instead of at its first K-FAC
    direction.

    Args:
        model: the model whose parameters K-FAC would precondition.
        params: the parameters (default: the model's trainable ones, as everywhere in ``ief``).
        kind: ``"kfac"``, ``"ekfac"`` or ``"iekfac"`` (named in the message).

    Returns:
        ``None`` when every parameter belongs to an ``nn.Linear``.

    Raises:
        ValueError: a parameter that is not an ``nn.Linear``'s weight or bias (named), or an unknown ``kind``.
    """
    model = data_parallel_module(model)
    params = resolve_params(model, params)
    _LinearHooks(model, params, param_names(model, params), kind)


def kronecker_factors(
    model: torch.nn.Module,
    inputs: Inputs,
    targets: torch.Tensor,
    kind: str,
    params: Iterable[torch.nn.Parameter] | None = None,
    *,
    generator: torch.Generator | None = None,
    loss: str | Loss = "cross_entropy",
    approx: str = "expand",
    sampled_targets: torch.Tensor | None = None,
) -> tuple[list[KroneckerBlock], torch.Tensor, list[torch.Tensor]]:
    """``(blocks, grad [P], params)``: the Kronecker factors of every trainable linear layer and the batch gradient.

    One forward; one backward for ``"ekfac"`` / ``"iekfac"``, two for ``"kfac"`` (true labels for the gradient,
    labels drawn with ``generator`` for ``G``). ``sampled_targets`` replaces the draw (tests use it to reproduce a
    peer's labels).
    """
    blocks, gradient, params = kronecker_factor_sets(model, inputs, targets, [check_kind(kind)], params,
                                                     generator=generator, loss=loss, approx=check_approx(approx),
                                                     sampled_targets=sampled_targets)
    return blocks[kind], gradient, params


def kronecker_factor_sets(model: torch.nn.Module, inputs: Inputs, targets: torch.Tensor, kinds: list[str],
                          params: Iterable[torch.nn.Parameter] | None, *, generator: torch.Generator | None,
                          loss: str | Loss, approx: str, sampled_targets: torch.Tensor | None = None,
                          losses_out: list | None = None,
                          ) -> tuple[dict[str, list[KroneckerBlock]], torch.Tensor, list[torch.Tensor]]:
    """``({kind: blocks}, grad [P], params)`` for several kinds from one forward: ``A`` and the true-label backward
    are shared by eKFAC and ieKFAC; KFAC adds one backward for the sampled labels.

    Args:
        model: returns logits, as :func:`kronecker_factors` (a ``DistributedDataParallel`` model: its module,
            :func:`data_parallel_module`; the layers are named as in that module).
        inputs: the batch's inputs.
        targets: its targets.
        kinds: checked kinds (:func:`check_kind`), each at most once.
        params: the parameters (``None``: the model's trainable ones).
        generator: ``"kfac"``'s label draws (``None``: the global RNG).
        loss: ``"cross_entropy"`` or ``"mse"``.
        sampled_targets: replaces ``"kfac"``'s draw (as :func:`kronecker_factors`).
        approx: a checked approximation (:func:`check_approx`).
        losses_out: when given, receives the per-sample losses ``[M]`` of the true labels (detached;
            :class:`ief.optim.KFAC` returns them).

    Returns:
        Every kind's blocks, the batch gradient and the resolved parameters.

    Raises:
        ValueError: a parameter outside an ``nn.Linear`` or a bad batch, named.
    """
    loss_fn = get_loss(loss)
    model = data_parallel_module(model)
    params = resolve_params(model, params)
    names = param_names(model, params)
    capture = _LinearHooks(model, params, names, "/".join(kinds))
    forward = ReplayableForward(model, inputs)
    with capture, torch.enable_grad():
        logits = forward()
    loss_fn.check(logits, targets)
    m = batch_size(logits)
    module_names = {id(mod): n for n, mod in model.named_modules()}
    unreached = capture.unreached_calls(root=logits)  # e.g. DoRA's identity-matrix calls: in no factor

    def reaching(k: int) -> list:
        """Layer ``k``'s records of the calls whose output reaches the loss."""
        return [rec for j, rec in enumerate(capture.records[k]) if (k, j) not in unreached]

    for k, (module, *_) in enumerate(capture.modules):
        shapes = {tuple(rec[0].shape) for rec in reaching(k)}
        if any(len(s) < 2 or s[0] != m for s in shapes):
            raise ValueError(
                f"linear layer {module_names.get(id(module))!r} was called with input shapes {sorted(shapes)}, whose "
                f"first dimension is not the {m} samples: its K-FAC factors cannot be formed per sample"
            )

    def backward(y: torch.Tensor, retain: bool) -> list[torch.Tensor | None]:
        capture.clear_grads()
        with torch.enable_grad():
            per_sample = loss_fn.per_sample(logits, y)
            if y is targets and losses_out is not None:
                losses_out.append(per_sample.detach())
            return list(torch.autograd.grad(per_sample.sum(), params, retain_graph=retain, allow_unused=True))

    a_factors: dict[int, torch.Tensor | None] = {}  # layer k -> A / m: one forward, so one A for every kind

    def input_factor(k: int, owned: dict) -> torch.Tensor | None:
        """Layer ``k``'s ``A`` (``None``: never called), computed once and shared by every kind's blocks."""
        if k not in a_factors:
            a_sum = None
            for x, _, _ in reaching(k):
                a = _rows(x, m, approx, "mean")
                if "bias" in owned:
                    a = torch.cat([a, torch.ones(a.shape[0], 1, dtype=a.dtype, device=a.device)], dim=1)
                if "weight" not in owned:
                    a = a[:, -1:]
                positions = a.shape[0] // m
                a_cov = a.T @ a / positions  # curvlinops: each call's input covariance / (N * positions)
                a_sum = a_cov if a_sum is None else a_sum + a_cov
            a_factors[k] = None if a_sum is None else a_sum / m
        return a_factors[k]

    def blocks(weights: torch.Tensor | None) -> list[KroneckerBlock]:
        """Every layer's ``(G, A)`` from the gradients of the last backward (rows of sample n weighted by w_n)."""
        out = []
        for k, (module, *_, owned) in enumerate(capture.modules):
            a_factor, g_sum = input_factor(k, owned), None
            for j, (_, g, _) in enumerate(capture.records[k]):
                if (k, j) in unreached and g is not None:  # the graph said otherwise: no factor is guessed
                    raise RuntimeError(f"a call of linear layer {module_names.get(id(module))!r} found not to reach "
                                       "the loss received a gradient")
                if g is None:  # this call's output did not reach the loss
                    continue
                gr = _rows(g, m, approx, "sum")
                if weights is not None:
                    gr = gr * weights.repeat_interleave(gr.shape[0] // m).sqrt().unsqueeze(1)
                g_cov = gr.T @ gr
                g_sum = g_cov if g_sum is None else g_sum + g_cov
            if a_factor is None:
                continue
            if g_sum is None:
                g_sum = torch.zeros(module.out_features, module.out_features, dtype=torch.float64,
                                    device=a_factor.device)
            out.append(KroneckerBlock(module_names.get(id(module), ""), g_sum, a_factor, dict(owned)))
        return out

    result: dict[str, list[KroneckerBlock]] = {}
    grads = backward(targets, retain="kfac" in kinds)
    if "ekfac" in kinds:
        result["ekfac"] = blocks(None)
    if "iekfac" in kinds:
        s = logit_sqnorm(loss_fn, logits, targets).to(torch.float64)  # [M]
        result["iekfac"] = blocks(torch.where(s > 0, 1.0 / torch.where(s > 0, s, torch.ones_like(s)),
                                              torch.zeros_like(s)))
    if "kfac" in kinds:
        if sampled_targets is None:
            sampled_targets = loss_fn.sample_targets(logits, targets, generator)
        backward(sampled_targets, retain=False)
        result["kfac"] = blocks(None)
    gradient = torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in zip(grads, params)])
    return result, gradient.detach(), params


def kronecker_eigen(G: torch.Tensor, A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(e_G, U, e_A, V)``: the eigendecompositions of both (symmetrised) factors, from which
    :func:`_eigen_solve` applies ``(G (x) A + lambda I)^{-1}`` for any ``lambda`` (:class:`ief.optim.KFAC` keeps them
    between refreshes)."""
    return (*symmetric_eigh(G), *symmetric_eigh(A))


def symmetric_eigh(factor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(eigenvalues, eigenvectors)`` of a Kronecker factor, symmetrised first (rounding leaves it almost so)."""
    return torch.linalg.eigh(0.5 * (factor + factor.T))


def _damped_kronecker_solve(G: torch.Tensor, A: torch.Tensor, grad: torch.Tensor, damping: float) -> torch.Tensor:
    """``(G (x) A + lambda I)^{-1} vec(grad)`` for ``grad [out, k]`` (row-major vec), pseudo-inverse where singular."""
    return _eigen_solve(kronecker_eigen(G, A), grad, damping)


def _eigen_solve(eigen: tuple[torch.Tensor, ...], grad: torch.Tensor, damping: float) -> torch.Tensor:
    """:func:`_damped_kronecker_solve` from the factors' eigendecompositions ``(e_G, U, e_A, V)``."""
    eg, U, ea, V = eigen
    prod = eg.clamp_min(0).unsqueeze(1) * ea.clamp_min(0).unsqueeze(0)  # [out, k]
    shifted = prod + damping
    if not prod.numel():
        return U @ (U.T @ grad @ V) @ V.T  # an empty block: nothing to solve
    # on the device: no host read of the largest product
    tiny = max(prod.shape) * torch.finfo(torch.float64).eps * prod.amax().clamp_min(1e-300)
    keep = shifted > 1e3 * tiny
    inv = torch.where(keep, 1.0 / torch.where(keep, shifted, torch.ones_like(shifted)), torch.zeros_like(shifted))
    return U @ ((U.T @ grad @ V) * inv) @ V.T


def kfac_direction(
    model: torch.nn.Module,
    inputs: Inputs,
    targets: torch.Tensor,
    kind: str,
    damping: float,
    params: Iterable[torch.nn.Parameter] | None = None,
    generator: torch.Generator | None = None,
    *,
    loss: str | Loss = "cross_entropy",
    approx: str = "expand",
) -> torch.Tensor:
    """Block-diagonal K-FAC direction ``[P]`` (parameter order of ``params``), Appendix D.2.2.

    Per ``nn.Linear``: ``(G (x) A + lambda I)^{-1} grad``, with ``A`` the layer inputs' and ``G`` the output
    gradients' second moments; solved through the eigendecompositions of ``A`` (``I x I``) and ``G`` (``O x O``),
    never forming the ``IO x IO`` block. Cost: one forward and one backward (two for ``"kfac"``'s sampled labels)
    plus ``O(I^3 + O^3)`` per layer.

    Args:
        model: returns logits ``[M, C]`` / ``[M, T, C]`` (the package's conventions, :mod:`ief`).
        inputs: tensor, tuple, or dict of keyword arguments for ``model``.
        targets: class indices ``[M]`` / ``[M, T]`` with ``-100`` ignored, or float targets (``loss="mse"``).
        kind: ``"kfac"`` (labels sampled from the model with ``generator``: block-diagonal SF), ``"ekfac"`` (true
            labels: block-diagonal EF) or ``"iekfac"`` (true labels, rows of sample ``n`` weighted by ``1/s_n``:
            block-diagonal iEF).
        damping: ``lambda >= 0`` added to every Kronecker block, ``(G (x) A + lambda I)^{-1} grad`` (see the
            module docstring); ``0`` gives the pseudo-inverse.
        params: the parameters to precondition (default: all trainable ones); each must be the weight or bias of an
            ``nn.Linear``, otherwise ``ValueError``.
        generator: ``"kfac"``'s label draws (default ``None``: the global RNG).
        loss: ``"cross_entropy"`` (default) or ``"mse"``.
        approx: ``"expand"`` (default: every sequence position a row) or ``"reduce"`` (one row per sample).

    Returns:
        The direction ``[P]`` in the parameters' dtype, in the order of ``params``.

    Raises:
        ValueError: an unknown ``kind``, ``approx`` or ``loss``, a negative or non-finite ``damping``, or a
            parameter outside an ``nn.Linear`` (named).
    """
    return kfac_directions(model, inputs, targets, {kind: damping}, params, generator, loss=loss, approx=approx)[kind]


def kfac_directions(
    model: torch.nn.Module,
    inputs: Inputs,
    targets: torch.Tensor,
    dampings: dict[str, float],
    params: Iterable[torch.nn.Parameter] | None = None,
    generator: torch.Generator | None = None,
    *,
    loss: str | Loss = "cross_entropy",
    approx: str = "expand",
) -> dict[str, torch.Tensor]:
    """``{kind: direction [P]}`` for several kinds (``{kind: damping}``) from one forward and one or two backward
    passes: equal to :func:`kfac_direction` per kind (same labels for ``"kfac"`` from ``generator``)."""
    dampings = {check_kind(kind): check_damping(lam) for kind, lam in dampings.items()}
    all_blocks, gradient, params = kronecker_factor_sets(model, inputs, targets, list(dampings), params,
                                                         generator=generator, loss=loss, approx=check_approx(approx))
    input_eigens: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # the kinds share each layer's A (one tensor)

    def eigens(blocks: list[KroneckerBlock]) -> dict[str, tuple[torch.Tensor, ...]]:
        for block in blocks:
            if id(block.A) not in input_eigens:
                input_eigens[id(block.A)] = symmetric_eigh(block.A)
        return {block.name: (*symmetric_eigh(block.G), *input_eigens[id(block.A)]) for block in blocks}

    return {kind: block_diagonal_direction(all_blocks[kind], gradient, params, dampings[kind], kind,
                                           eigens(all_blocks[kind]))
            for kind in dampings}


def block_diagonal_direction(blocks: list[KroneckerBlock], gradient: torch.Tensor, params: list[torch.Tensor],
                             damping: float, kind: str,
                             eigens: dict[str, tuple[torch.Tensor, ...]] | None = None,
                             check: bool = True) -> torch.Tensor:
    """The damped block-diagonal solve ``(G (x) A + lambda I)^{-1} grad`` of every layer, back in the parameter
    order of ``params`` (Appendix D.2.2).

    Args:
        blocks: the layers' factors (:func:`kronecker_factor_sets`).
        gradient: ``[P]`` the batch gradient, in the order of ``params``.
        params: the parameters.
        damping: a checked ``lambda >= 0`` (:func:`ief.losses.check_damping`).
        kind: the kind, for the error message.
        eigens: ``{block name: kronecker_eigen(...)}``, replacing the blocks' own eigendecompositions where given.
        check: raise when the direction is not finite in ``gradient``'s dtype (default); ``False`` leaves that to
            the caller (:class:`ief.optim.KFAC` reads it with the step's other checks: no host round-trip here).

    Returns:
        The direction ``[P]`` in ``gradient``'s dtype.

    Raises:
        FloatingPointError: (``check``) the direction is not representable in that dtype.
    """
    offsets = [0]
    for p in params:
        offsets.append(offsets[-1] + p.numel())
    direction = torch.zeros(offsets[-1], dtype=torch.float64, device=gradient.device)
    grad64 = gradient.to(torch.float64)
    for block in blocks:
        parts = []
        if "weight" in block.index:
            i = block.index["weight"]
            parts.append(grad64[offsets[i] : offsets[i + 1]].reshape(params[i].shape))
        if "bias" in block.index:
            i = block.index["bias"]
            parts.append(grad64[offsets[i] : offsets[i + 1]].reshape(-1, 1))
        eigen = eigens[block.name] if eigens is not None and block.name in eigens else kronecker_eigen(block.G, block.A)
        solved = _eigen_solve(eigen, torch.cat(parts, dim=1), damping)
        if "weight" in block.index:
            i = block.index["weight"]
            direction[offsets[i] : offsets[i + 1]] = solved[:, : params[i].shape[1]].reshape(-1)
        if "bias" in block.index:
            i = block.index["bias"]
            direction[offsets[i] : offsets[i + 1]] = solved[:, -1]
    out = direction.to(gradient.dtype)
    if check and not torch.isfinite(out).all():
        raise FloatingPointError(
            f"the {kind} direction is not representable in {gradient.dtype}; use a larger damping"
        )
    return out
