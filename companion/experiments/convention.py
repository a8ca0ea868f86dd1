r"""Learning rates and dampings of EF, SF and iEF between the paper's loss convention and ``ief``'s.

**The two conventions.** ``ief.optim`` minimises the *sum* ``L = \sum_n l_n``, with ``l_n`` a sample's summed
cross-entropy over its target tokens; its rows of ``J`` are ``\nabla_\theta l_n`` and ``s_n = \|\nabla_{z_n} l_n\|^2``
(``eqn:s_ief``, summed over the sample's positions). The paper's released code (``example_glue_sst2_train.py``,
``iEFOptimizer_GP.py`` of ``HANDSOMEJACKANDY/improved-empirical-fisher``) builds everything from Hugging Face's
``outputs.loss``, the *mean* over the batch's ``K`` target tokens (labels = the label word's tokens + ``</s>``,
``-100`` elsewhere; ``K = M`` for one-label classifiers such as ViT): ``loss_p = L / K``. Its per-sample gradients
are those of the mean loss's terms, so, per batch,

    ``J_p = J / K``,  ``g_p = \nabla loss_p = J^T 1 / K``,  ``s_p = \|\nabla_{z_n} loss_p\|^2 = s / K^2``

(``s_p``: ``iEFlg2``, the squared norm of ``torch.autograd.grad(loss, logits)`` over the sample's tokens). With the
paper's ``lr`` and ``\lambda``:

- **iEF** (``alg:iEF``, constant rate): ``-lr J_p^T (J_p J_p^T + \lambda I)^{-1} s_p
  = -lr (1/K) K^2 J^T (J J^T + K^2 \lambda I)^{-1} s / K^2 = -(lr/K) J^T (J J^T + K^2\lambda I)^{-1} s``:
  ``ief.optim.IEF`` with ``lr_sum = lr / K`` and ``damping_sum = K^2 \lambda``.
- **EF** (``alg:EF``, ``iEF0`` in that code: ``s`` replaced by ones): ``-lr J_p^T (J_p J_p^T + \lambda I)^{-1} 1
  = -lr K J^T (J J^T + K^2 \lambda I)^{-1} 1``: ``lr_sum = K lr`` and ``damping_sum = K^2 \lambda``.
- **SF** (``alg:SF``, ``eqn:SF-smw``): the sampled Jacobian is again one of a token mean, ``\hat J_p = \hat J / K``
  (the sampled loss keeps the batch's ``-100`` mask, so the same ``K``), so ``-lr (\hat J_p^T \hat J_p + \lambda
  I)^{-1} g_p = -lr K (\hat J^T \hat J + K^2 \lambda I)^{-1} \nabla L``: ``lr_sum = K lr``, ``damping_sum = K^2
  \lambda``.
- With the paper's **normalised update** (EF and SF: each update rescaled to norm ``lr``, decaying linearly), a
  positive factor on the direction cancels, so ``lr_sum = lr``; the damping still converts (``K^2 \lambda``).

So the damping always scales by ``K^2`` and the rate by ``1/K`` (iEF), ``K`` (un-normalised EF/SF) or 1 (normalised
EF/SF). First-order baselines (AdamW, Adafactor, SGD) already minimise the token mean here (the runner's loss), so
they need nothing. ``K`` varies from batch to batch (label words of several tokens, MNLI's "maybe"), so the
conversion happens **per batch**, the only way to reproduce the paper's updates exactly: the experiments build
``ief.optim.IEF`` / ``EF`` / ``SF`` with ``reduction="mean"`` (:func:`companion.experiments.optimizers.make_optimizer`),
which converts the given values with the rules above for every batch's ``K = ief.count_targets(targets)``;
``tests/companion/test_convention.py`` checks those updates against the official computation on a tiny T5 to float64
precision.

One difference that is not a convention: the released SF draws a label for the *first* target position only and
keeps the true ``</s>``; ``ief``'s SF draws every target position from the model (the exact sampled Fisher).
"""
from __future__ import annotations

# the values of an optimiser's ``options["convention"]`` (companion.experiments.setups) and the ``reduction`` of
# ief.optim each one is run with
CONVENTIONS = ("sum", "token-mean")
REDUCTION = {"sum": "sum", "token-mean": "mean"}
