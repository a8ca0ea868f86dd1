r"""The token-mean loss convention (Hugging Face's ``outputs.loss``, the paper's released code) as ``ief``'s sum
convention, per batch: what ``reduction="mean"`` of :mod:`ief.optim` does to ``lr`` and ``damping`` at every step.

**The two conventions.** ``ief.optim`` minimises the *sum* ``L = sum_n l_n``, with ``l_n`` a sample's summed
cross-entropy over its target tokens; its rows of ``J`` are ``grad_theta l_n`` and ``s_n = ||grad_{z_n} l_n||^2``
(the paper's ``s`` after Eq. (8), summed over the sample's positions). The paper's released code builds everything
from the *mean* over the batch's ``K`` counted target tokens (:func:`ief.count_targets`), ``loss_p = L / K``. Its
per-sample gradients are those of the mean loss's terms, so, per batch::

    J_p = J / K,    g_p = grad loss_p = J^T 1 / K,    s_p = ||grad_{z_n} loss_p||^2 = s / K^2

With the paper's ``lr`` and ``lambda``:

- **iEF** (the paper's Algorithm 1, constant rate)::

      -lr J_p^T (J_p J_p^T + lambda I)^{-1} s_p = -lr (1/K) K^2 J^T (J J^T + K^2 lambda I)^{-1} s / K^2
                                                = -(lr / K) J^T (J J^T + K^2 lambda I)^{-1} s

  that is ``ief.optim.IEF`` with ``lr_sum = lr / K`` and ``damping_sum = K^2 lambda``.
- **EF** (Algorithm 2: ``s`` replaced by ones): ``-lr J_p^T (J_p J_p^T + lambda I)^{-1} 1 = -lr K J^T (J J^T + K^2
  lambda I)^{-1} 1``: ``lr_sum = K lr`` and ``damping_sum = K^2 lambda``.
- **SF** (Algorithm 3, Eq. (49)): the sampled Jacobian is again one of a token mean, ``A_p = A / K`` (the sampled loss
  keeps the batch's ``-100`` mask, so the same ``K``), so ``-lr (A_p^T A_p + lambda I)^{-1} g_p = -lr K (A^T A + K^2
  lambda I)^{-1} grad L``: ``lr_sum = K lr``, ``damping_sum = K^2 lambda``.
- With the **normalised update** (EF and SF in the paper: each update rescaled to norm ``lr``), a positive factor on
  the direction cancels, so ``lr_sum = lr``; the damping still converts (``K^2 lambda``).

So the damping always scales by ``K^2`` and the rate by ``1/K`` (iEF), ``K`` (un-normalised EF/SF) or 1 (normalised).
``K`` varies from batch to batch (label words of several tokens), so the conversion happens **per batch**, the only
way to reproduce the paper's updates exactly; with momentum the rate's factor belongs to the batch and enters the
buffer (:mod:`ief.optim.momentum`). This module holds the arithmetic; the companion's
``tests/companion/test_convention.py`` checks the converted updates against the released code's computation.
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

    Args:
        method: ``"ief"``, ``"ef"`` or ``"sf"``.
        lr: the token-mean rate.
        damping: the token-mean damping.
        tokens: ``K``, the batch's counted target tokens (a positive integer).
        normalized: the update is rescaled to norm ``lr`` (the rate then does not convert).

    Returns:
        ``(lr_sum, damping_sum)``.

    Raises:
        ValueError: an unknown ``method`` or a ``tokens`` that is not a positive integer.
    """
    lr_f, d_f = _factors(method, tokens, normalized)
    return lr * lr_f, damping * d_f


def to_token_mean_convention(method: str, lr: float, damping: float, tokens: int, *,
                             normalized: bool = False) -> tuple[float, float]:
    """The inverse of :func:`to_sum_convention`: ``ief``'s (sum) values as the paper's (token-mean) ones.

    Args:
        method: ``"ief"``, ``"ef"`` or ``"sf"``.
        lr: the sum-convention rate.
        damping: the sum-convention damping.
        tokens: ``K``.
        normalized: the update is rescaled to norm ``lr``.

    Returns:
        ``(lr_mean, damping_mean)``.

    Raises:
        ValueError: as :func:`to_sum_convention`.
    """
    lr_f, d_f = _factors(method, tokens, normalized)
    return lr / lr_f, damping / d_f
