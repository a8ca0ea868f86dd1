"""``nn.Conv2d`` and ``nn.Conv1d`` as linear layers over positions, for the per-sample hooks of :mod:`ief.jacobian`.

A 2-d convolution is ``y[:, :, l] = W x_l`` for every output position ``l``, with ``x_l`` the input patch that position
sees (the columns of ``F.unfold``). Per group ``k`` of ``groups``, with ``A_n [L, C_in kh kw / groups]`` the unfolded
input of sample ``n`` and ``G_n [L, C_out / groups]`` the gradient flowing into its output, the per-sample weight
gradient is ``G_n^T A_n`` (``[C_out / groups, C_in kh kw / groups]``; the group's rows of the weight in its own layout
``[C_out, C_in / groups, kh, kw]``) and the bias gradient is ``G_n^T 1``: the same algebra as ``nn.Linear`` with the
``L`` positions as its positions (Appendix D.1; BackPACK's BatchGrad and Opacus do the same).

A ``Conv1d`` is the ``Conv2d`` of height 1 (``x [M, C, L]`` viewed ``[M, C, 1, L]``, kernel ``(1, k)``). Only
``padding_mode="zeros"`` is unfolded; reflect / replicate / circular padding (and ``Conv3d``, transposed convolutions)
keep the exact per-sample loop of :mod:`ief.jacobian`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812

from .registry import LayerRule, register_rule, write_block


def conv_is_unfoldable(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a plain ``nn.Conv2d`` or ``nn.Conv1d`` whose per-sample gradients the unfold rule gives
    exactly (zero padding)."""
    return type(module) in (torch.nn.Conv2d, torch.nn.Conv1d) and module.padding_mode == "zeros"


def _as_2d(module: torch.nn.Module) -> tuple[tuple, tuple, tuple, str | tuple]:
    """``(kernel, dilation, stride, padding)`` as 2-d pairs (a ``Conv1d`` is a ``Conv2d`` of height 1)."""
    if type(module) is torch.nn.Conv2d:
        return module.kernel_size, module.dilation, module.stride, module.padding
    padding = module.padding if isinstance(module.padding, str) else (0, module.padding[0])
    return (1, *module.kernel_size), (1, *module.dilation), (1, *module.stride), padding


def _explicit_padding(kernel: tuple, dilation: tuple, padding: str | tuple) -> tuple[int, int, int, int]:
    """``(left, right, top, bottom)`` zero padding of the input, as ``F.conv2d`` applies it (``"same"`` puts the odd
    pixel on the right / bottom, ``"valid"`` is none)."""
    if padding == "valid":
        return (0, 0, 0, 0)
    if padding == "same":
        pads = []
        for k, d in zip(reversed(kernel), reversed(dilation)):  # width first, as F.pad wants
            total = d * (k - 1)
            pads += [total // 2, total - total // 2]
        return tuple(pads)
    ph, pw = padding
    return (pw, pw, ph, ph)


def _unfold(x: torch.Tensor, kernel: tuple, dilation: tuple, stride: tuple) -> torch.Tensor:
    """``F.unfold(x, kernel, dilation=dilation, stride=stride)`` of a padded ``x [M, C, H, W]``, ``[M, C kh kw, L]``,
    as one strided copy (one pass over ``x``, where ``F.unfold``'s im2col on CPU takes several:
    ``benchmarks/README.md``)."""
    m, c, h, w = x.shape
    (kh, kw), (dh, dw), (sh, sw) = kernel, dilation, stride
    ho, wo = (h - dh * (kh - 1) - 1) // sh + 1, (w - dw * (kw - 1) - 1) // sw + 1
    s_m, s_c, s_h, s_w = x.stride()
    strides = (s_m, s_c, s_h * dh, s_w * dw, s_h * sh, s_w * sw)
    patches = x.as_strided((m, c, kh, kw, ho, wo), strides, x.storage_offset())  # a view: no copy yet
    return patches.reshape(m, c * kh * kw, ho * wo)


def conv_factors(module: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfolded input and the output gradient of one call, grouped: ``A [M, groups, L, I]`` and
    ``G [M, groups, L, O]`` with ``I = C_in kh kw / groups``, ``O = C_out / groups`` and ``L`` output positions;
    ``x [M, C_in, H, W]``, ``grad [M, C_out, H_out, W_out]`` (``[M, C, L]`` for a ``Conv1d``; the sample axis
    first)."""
    m, groups = x.shape[0], module.groups
    kernel, dilation, stride, padding = _as_2d(module)
    if x.dim() == 3:  # Conv1d: height 1
        x = x.unsqueeze(2)
    pad = _explicit_padding(kernel, dilation, padding)
    if any(pad):
        x = F.pad(x, pad)
    cols = _unfold(x, kernel, dilation, stride)  # [M, C_in kh kw, L]
    a = cols.unflatten(1, (groups, -1)).transpose(2, 3)  # [M, groups, L, I]
    g = grad.reshape(m, groups, grad.shape[1] // groups, -1).transpose(2, 3)  # [M, groups, L, O]
    if a.shape[2] != g.shape[2]:  # cannot happen for nn.Conv2d's own forward; a guard against silent misuse
        raise RuntimeError(f"unfolded {a.shape[2]} positions for a conv output with {g.shape[2]}")
    return a, g


def _conv_grads(module: torch.nn.Module, x: torch.Tensor, g: torch.Tensor, dests, accumulate: bool) -> None:
    dtype = next(iter(dests.values())).dtype
    a, g = conv_factors(module, x.to(dtype), g.to(dtype))  # [M, groups, L, I], [M, groups, L, O]
    m, groups = a.shape[:2]
    if "weight" in dests:  # per group sum_l g_l a_l^T; in place (no J-sized temporary) without groups
        block = dests["weight"].unflatten(1, (groups, g.shape[-1], a.shape[-1]))  # [M, groups, O, I]
        if groups == 1:
            block[:, 0].baddbmm_(g[:, 0].transpose(1, 2), a[:, 0], beta=1 if accumulate else 0)
        else:
            write_block(block, g.transpose(2, 3) @ a, accumulate)
    if "bias" in dests:
        write_block(dests["bias"], g.sum(dim=2), accumulate)


class ConvRule(LayerRule):
    """``nn.Conv2d`` / ``nn.Conv1d`` with zero padding, unfolded; one-group weights factored as ``(A, G)``."""

    batched = True  # [M, C, *] (or an unbatched [C, *] call)

    def applies(self, module):
        return conv_is_unfoldable(module)

    def feature_dims(self, module):
        return 3 if type(module) is torch.nn.Conv2d else 2

    def grads(self, module, x, g, dests, accumulate):
        _conv_grads(module, x, g, dests, accumulate)

    def factored(self, module):
        return module.groups == 1

    def factors(self, module, x, g):
        a, g = conv_factors(module, x, g)
        return a[:, 0], g[:, 0]

    def positions(self, module, g):
        return g[0].numel() // g.shape[1]


register_rule(torch.nn.Conv2d, ConvRule())
register_rule(torch.nn.Conv1d, ConvRule())
