"""The default guard of :mod:`ief.jacobian` for weights, at a small fraction of a backward: ``sum_n J_n`` against the
autograd batch gradient ``g``, both seen through a random sketch ``W [fan_in, k]``.

For a layer whose weight (viewed ``[O, I]``) has the per-sample gradients ``J_n = G_n^T A_n`` (``nn.Linear``;
``nn.Conv2d``, per group, ``A_n`` its unfolded input), ``J_n W = G_n^T (A_n W)``: the layer's input through ``k``
random output units (``x W`` for a Linear, a ``k``-channel convolution for a Conv2d: no unfold), contracted with the
output gradient. Cost ``M T k (I + O)`` for the rows and ``k P`` for ``g W``, against ``~ 3 M T I O`` for the layer's
part of a forward and backward; :func:`ief.jacobian.check_rows_sum_to_gradient_sketched` takes it only where it is
cheaper than reading the weight's columns of ``J``. The full check (``check="exact"``) forms ``sum_n J_n`` itself.

What the sketch keeps of the full check: with ``W`` standard normal, ``E ||D W||_F^2 = k ||D||_F^2`` for every
``D [O, I]``, so ``||(sum_n J_n - g) W||`` against ``sqrt(M) (sum_n ||J_n W||^2)^(1/2)`` is the full check's
``||sum_n J_n - g||`` against ``sqrt(M) ||J||_F`` in expectation. A mismatch ``c`` times the tolerance escapes one call
only if ``||D W||^2 / k`` falls below ``||D||^2 / c^2``; for the worst case (``D`` of rank one) that is
``P(chi2_k < k / c^2)``: with ``k = 8``, 1e-3 for ``c = 3``, 1e-7 for ``c = 10``, nil for the gross mismatch of a
tied weight (``c`` ~ 1 / tolerance: 60 in float32, 1e6 in float64); the denominator is a sketch too (it
concentrates alike). The sketch is drawn afresh for every
call from a private generator (the caller's random state is untouched), so a structural mismatch (a weight also used
outside its layer) that escapes one call is caught at the next. With ``fan_in <= k`` the sketch is the identity: exact.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812

from .conv_rules import _explicit_padding

SKETCH_COLUMNS = 8


def _fan_in(module: torch.nn.Module) -> tuple[int, int]:
    """``(groups, fan-in of a group)`` of a Linear / Conv2d weight."""
    weight = module.weight
    return getattr(module, "groups", 1), (weight[0].numel() if weight.dim() > 2 else weight.shape[1])


def sketch_flops(module: torch.nn.Module, calls: list, k: int) -> int:
    """Multiply-adds of the sketch of one module's weight: ``k P`` for ``g W``, ``M T k (I + O)`` per call (a Conv2d:
    ``T`` output positions, ``I`` its patch size)."""
    groups, fan_in = _fan_in(module)
    total = k * module.weight.numel()
    for _, grad in calls:
        positions = grad[0].numel() // (grad.shape[-1] if isinstance(module, torch.nn.Linear) else grad.shape[1])
        total += grad.shape[0] * positions * k * groups * (fan_in + module.weight.shape[0] // groups)
    return total


def sketch_matrices(modules: list[torch.nn.Module], k: int, generator: torch.Generator) -> list[torch.Tensor]:
    """Per module the transposed sketch ``W^T [groups, k', I_g]``: standard normal (``k' = k``; all drawn in one go),
    or the identity (``k' = I_g``) when the fan-in ``I_g <= k``; in the weight's dtype and device. (Kept transposed:
    CPU BLAS multiplies ``[k, I] @ [I, O]`` several times faster than ``[O, I] @ [I, k]`` for small ``k``.)"""
    if not modules:
        return []
    shapes = [_fan_in(mod) for mod in modules]
    weight = modules[0].weight
    dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
    draws = torch.randn(sum(g * i * k for g, i in shapes), generator=generator, dtype=dtype)
    draws = draws.to(dtype=weight.dtype, device=weight.device).split([g * i * k for g, i in shapes])
    out = []
    for mod, (groups, fan_in), w in zip(modules, shapes, draws):
        if fan_in <= k:
            out.append(torch.eye(fan_in, dtype=mod.weight.dtype, device=mod.weight.device).expand(groups, -1, -1))
        else:
            out.append(w.view(groups, k, fan_in).to(mod.weight.dtype))
    return out


def _call_rows(module: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
    """``(J_n W)^T`` of one call, ``[M, k', O]`` (``O`` the weight's rows, groups stacked as in the weight); ``x`` and
    ``grad`` with the sample axis first."""
    m, dtype = x.shape[0], wt.dtype
    if isinstance(module, torch.nn.Linear):
        a = x.reshape(m, -1, x.shape[-1]).to(dtype)  # [M, T, I]
        g = grad.reshape(m, -1, grad.shape[-1]).to(dtype)  # [M, T, O]
        return (a @ wt[0].T).transpose(1, 2) @ g  # [M, k', O]
    groups, k, fan_in = wt.shape
    kernel = wt.reshape(groups * k, -1, *module.kernel_size)  # [groups k', C_in / groups, kh, kw]
    pad = _explicit_padding(module)
    x = F.pad(x.to(dtype), pad) if any(pad) else x.to(dtype)
    aw = F.conv2d(x, kernel, stride=module.stride, dilation=module.dilation, groups=groups)  # [M, groups k', Ho, Wo]
    aw = aw.reshape(m, groups, k, -1)  # [M, groups, k', L]
    g = grad.to(dtype).reshape(m, groups, grad.shape[1] // groups, -1)  # [M, groups, O_g, L]
    return (aw @ g.transpose(2, 3)).transpose(1, 2).flatten(2)  # [M, k', groups O_g]


def sketched_rows(module: torch.nn.Module, calls: list, wt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``((sum_n J_n W)^T [k', O], sum_n ||J_n W||_F^2)`` over a module's calls ``[(x, grad), ...]``."""
    if len(calls) == 1 and isinstance(module, torch.nn.Linear) and calls[0][0].dim() == 2:  # one position: J_n W
        x, grad = calls[0]  # is the outer product g_n (a_n W)^T, never formed
        awt, g = wt[0] @ x.to(wt.dtype).T, grad.to(wt.dtype)  # [k', M], [M, O]
        return awt @ g, (awt.square().sum(0) @ g.square().sum(1))
    rows = _call_rows(module, *calls[0], wt)
    for x, grad in calls[1:]:
        rows += _call_rows(module, x, grad, wt)
    return rows.sum(0), rows.square().sum()


def sketched_gradient(gradient: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
    """``(g W)^T`` of a weight's batch gradient ``g`` (flat, the weight's layout), ``[k', O]``."""
    groups, _, fan_in = wt.shape
    if groups == 1:
        return wt[0] @ gradient.view(-1, fan_in).T
    return (wt @ gradient.view(groups, -1, fan_in).transpose(1, 2)).transpose(0, 1).flatten(1)
