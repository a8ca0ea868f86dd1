"""The token-mean loss convention (the paper's released code) as ``ief``'s sum convention, per batch.

:mod:`companion.experiments.convention` derives the conversion (``lr`` by ``1/K`` for iEF, by ``K`` for un-normalised EF
and SF, by 1 with the normalised update; ``damping`` by ``K^2``, with ``K`` the batch's counted target tokens); this
module holds the arithmetic, used by ``ief.optim``'s ``reduction="mean"`` (``K``: :func:`ief.count_targets`).
"""
from __future__ import annotations

METHODS = ("ief", "ef", "sf")


def _factors(method: str, tokens: int, normalized: bool) -> tuple[float, float]:
    """``(lr_sum / lr_paper, damping_sum / damping_paper)`` for a batch of ``tokens`` target tokens."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; the conversion exists for: {', '.join(METHODS)}")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens (K, target tokens in the batch) must be a positive integer, got {tokens!r}")
    k = float(tokens)
    if normalized:
        lr_factor = 1.0
    else:
        lr_factor = 1.0 / k if method == "ief" else k
    return lr_factor, k * k


def to_sum_convention(method: str, lr: float, damping: float, tokens: int, *,
                      normalized: bool = False) -> tuple[float, float]:
    """The paper's (token-mean) ``(lr, damping)`` of ``method`` as ``ief``'s (sum) values for a batch of ``tokens``.

    iEF: ``(lr / K, damping K^2)``; EF, SF: ``(lr K, damping K^2)``, or ``(lr, damping K^2)`` with the normalised
    update (``normalized=True``). See the module docstring for the derivation.
    """
    lr_f, d_f = _factors(method, tokens, normalized)
    return lr * lr_f, damping * d_f


def to_token_mean_convention(method: str, lr: float, damping: float, tokens: int, *,
                             normalized: bool = False) -> tuple[float, float]:
    """The inverse of :func:`to_sum_convention`: ``ief``'s (sum) values as the paper's (token-mean) ones."""
    lr_f, d_f = _factors(method, tokens, normalized)
    return lr / lr_f, damping / d_f
