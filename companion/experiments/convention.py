r"""Learning rates and dampings of EF, SF and iEF between the paper's loss convention and ``ief``'s.

``ief.optim`` minimises the *sum* ``L = \sum_n l_n``; the paper's released code (``example_glue_sst2_train.py``,
``iEFOptimizer_GP.py`` of ``HANDSOMEJACKANDY/improved-empirical-fisher``) builds everything from Hugging Face's
``outputs.loss``, the *mean* over the batch's ``K`` target tokens (labels = the label word's tokens + ``</s>``,
``-100`` elsewhere; ``K = M`` for one-label classifiers such as ViT), and its ``iEFlg2`` is the squared norm of
``torch.autograd.grad(loss, logits)`` over the sample's tokens. The derivation of the conversion is the library's
(:mod:`ief.optim.convention`): the damping always scales by ``K^2`` and the rate by ``1/K`` (iEF), ``K``
(un-normalised EF/SF, ``iEF0`` in that code) or 1 (normalised EF/SF). First-order baselines (AdamW, Adafactor, SGD)
already minimise the token mean here (the runner's loss), so they need nothing. ``K`` varies from batch to batch
(label words of several tokens, MNLI's "maybe"), so the experiments build ``ief.optim.IEF`` / ``EF`` / ``SF`` with
``reduction="mean"`` (:func:`companion.experiments.optimizers.make_optimizer`), which converts the given values for
every batch's ``K = ief.count_targets(targets)``; ``tests/companion/test_convention.py`` checks those updates against
the official computation on a tiny T5 to float64 precision.

One difference that is not a convention: the released SF draws a label for the *first* target position only and
keeps the true ``</s>``; ``ief``'s SF draws every target position from the model (the exact sampled Fisher).
"""
from __future__ import annotations

# the values of an optimiser's ``options["convention"]`` (companion.experiments.setups) and the ``reduction`` of
# ief.optim each one is run with
CONVENTIONS = ("sum", "token-mean")
REDUCTION = {"sum": "sum", "token-mean": "mean"}
