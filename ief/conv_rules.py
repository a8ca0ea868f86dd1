"""``nn.Conv2d`` and ``nn.Conv1d`` as linear layers over positions, for the per-sample hooks of :mod:`ief.jacobian`.

A 2-d convolution is ``y[:, :, l] = W x_l`` for every output position ``l``, with ``x_l`` the input patch that position
sees (the columns of ``F.unfold``). Per group ``k`` of ``groups``, with ``A_n [L, C_in kh kw / groups]`` the unfolded
input of sample ``n`` and ``G_n [L, C_out / groups]`` the gradient flowing into its output, the per-sample weight
gradient is ``G_n^T A_n`` (``[C_out / groups, C_in kh kw / groups]``; the group's rows of the weight in its own layout
``[C_out, C_in / groups, kh, kw]``) and the bias gradient is ``G_n^T 1``: the same algebra as ``nn.Linear`` with the
``L`` positions as its positions (``sec:app-iEF-impl``; BackPACK's BatchGrad and Opacus do the same).

A ``Conv1d`` is the ``Conv2d`` of height 1 (``x [M, C, L]`` viewed ``[M, C, 1, L]``, kernel ``(1, k)``). Only
``padding_mode="zeros"`` is unfolded; reflect / replicate / circular padding (and ``Conv3d``, transposed convolutions)
keep the exact per-sample loop of :mod:`ief.jacobian`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812


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
    as one strided copy (2-3x faster than ``F.unfold``'s im2col on CPU)."""
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
