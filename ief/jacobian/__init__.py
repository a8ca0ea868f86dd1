"""Per-sample gradients ``J = grad_theta l`` (``[M, P]``), logit-gradient norms ``s_iEF`` and sampled Jacobians (SF).

How: module hooks, as in the paper (``sec:app-iEF-impl``). One forward and one backward of ``L = sum_n l_n``;
forward hooks keep each hooked module's input and a tensor hook on its output keeps the gradient flowing back.
Because sample ``n``'s output only reaches ``l_n``, the per-sample weight gradient of a linear layer is
``g_n^T a_n`` summed over that sample's positions, formed with one batched matmul.

Why hooks rather than ``torch.func.vmap``: vmapping a transformers 5.x forward that takes an ``attention_mask``
fails on a data-dependent check in ``transformers.masking_utils``, whereas hooks only see ordinary module calls,
work with every attention implementation (SDPA included) and add little to a plain backward for LoRA and prompt
parameters. Layers with hooks: ``nn.Linear`` (LoRA A/B, heads, MLPs), HF ``Conv1D`` (GPT-2),
``nn.Embedding`` (prompt tuning),
``nn.LayerNorm``, ``nn.GroupNorm``, ``nn.Conv2d`` / ``nn.Conv1d`` with zero padding (unfolded: a linear layer over
the output positions, see :mod:`~ief.jacobian.rules.conv`) and ``nn.BatchNorm1d`` / ``nn.BatchNorm2d`` in eval mode
(running statistics: a per-channel affine map). Bare
parameters and embedding calls that every sample shares (ViT's ``cls_token`` and ``position_embeddings``, position
embeddings fed ``[1, T]`` ids, T5's relative attention biases fed ``[T, T]`` bucket ids) have rows too when their
only uses add them to, expand them over, or mask them onto the batch (an attention mask), directly or after views,
casts and shared masks (:mod:`ief.jacobian.broadcast`).

The sample axis of every hooked call is established, never guessed from a size: a probe forward of the batch's first
sample alone (every input tensor cut to one sample along its leading dimension; hooks that only record shapes; the
random state and the model's buffers untouched) shows which dimension of each call's input shrinks from ``M`` to 1
while every other dimension stays put. That dimension is the call's sample axis (dimension 1 for a sequence-first
``[T, M, E]`` layer, whatever ``T``); a call without exactly one such dimension (a batch of one prompt shared by all
samples, inputs flattened across samples, a call the probe does not repeat) has no established axis. The probe's
verdict is cached per model and per shape signature (every hooked call's input shape and the inputs' shapes), so a
training loop with fixed shapes pays for it once; any new shape, ``T == M`` included, is probed afresh. With
``M = 1`` every call belongs to the one sample and no probe is needed.

``J`` comes in two forms (``form=``): the ``[M, P]`` tensor (``"dense"``), or a :class:`~ief.rows.FactoredJacobian`
(``"auto"``, the optimisers' default; ``"ghost"``, ``"rows"``) that keeps each ``nn.Linear`` / HF ``Conv1D`` weight
(and each one-group ``nn.Conv2d`` / ``nn.Conv1d`` weight, its input unfolded) as its layer's hooked inputs and output
gradients and gives ``J J^T``, ``J^T c``, ``J v``, ``J^T 1`` and the row norms from them (the Gram solve, the batch
gradient, the guard and the exact check need nothing else), so that exact EF / iEF / SF never form ``[M, P]``.

Every trainable parameter that is not in a hooked module (a convolution with reflect / circular padding, an RNN, an
``nn.MultiheadAttention`` with dropout in training, a bare ``nn.Parameter`` used otherwise than broadcast), whose
module had a call without an established sample axis, or that is also used outside its hooked modules (a weight tied
to an unhooked use, see below) falls back to an exact per-sample loop of backward passes (``M`` backward passes: exact, slower); a
:class:`SlowPathWarning` names those parameters once per model.

The hooks assume what per-sample gradients presuppose: sample ``n``'s slice of a hooked input depends on sample ``n``
alone (no layer mixes or reorders samples along the sample axis), and that a hooked parameter is used only by its
module's calls. The latter is made structural: while a hooked module runs its forward, each of its parameters being
differentiated is replaced by a *stand-in* (``p.detach().requires_grad_()``: a fresh leaf on ``p``'s storage, no
copy), so autograd reaches ``p`` itself only through uses outside its hooked calls (a weight tied to an unhooked use:
an ``nn.Embedding`` table reused by an ``F.linear`` head; a table tied to an ``nn.Linear`` head, as GPT-2's
``lm_head``, is hooked in both and its rows summed). One walk over the forward's graph
(:func:`ief.model_call.scan_graph`) finds such a ``p`` (its gradient accumulator is in the graph) before the
backward, and its module's parameters take the loop, whose backward passes differentiate ``p`` and its stand-ins
together: the rows are then exact whatever ``check``. The guard, on by default, reads what the batch backward gives
the remaining hooked parameters, ``o = g - sum_n J_n``: ``None`` (by construction, cost ~0) unless a use escaped that
search, when :class:`PerSampleGradientMismatch` names the parameter. It also refuses batch norm with batch
statistics. A side effect is a cheaper backward: autograd never computes the hooked layers' batch weight gradients
(the stand-ins are not asked for); the batch gradient, when wanted, is ``J^T 1`` (:attr:`PerSample.gradient`,
computed on first access). A custom layer that mixes or reorders samples (its hooked rows still add up) is what
``check="exact"`` is for (:func:`~ief.jacobian.guard.check_directional_derivatives`: every row against ``K = 8`` exact per-sample
directional derivatives, relative to their own size, so that a 1 % error in any row is caught whatever ``P`` and
the dtype); the optimisers run that exact check on their first step. Non-finite losses or rows raise
``FloatingPointError`` naming the samples.

Activation checkpointing (``torch.utils.checkpoint``): the non-reentrant kind is exact (the backward runs in the
forward's kernel context, so its recomputation saves what the forward saved); HuggingFace layers checkpointed
reentrantly are run non-reentrantly, and any other reentrant checkpoint raises (:mod:`ief.model_call`).

The package, one concern per module: :mod:`~ief.jacobian.api` (the public entries and :class:`PerSample`),
:mod:`~ief.jacobian.capture` (the hooks, the stand-ins, the sample axes), :mod:`~ief.jacobian.assemble` (the
backward and the rows as a tensor or :class:`~ief.rows.FactoredJacobian`), :mod:`~ief.jacobian.loop` (the exact
per-sample loop for what no hook covers), :mod:`~ief.jacobian.guard` (the guard and the exact check),
:mod:`~ief.jacobian.broadcast` (the rows of tensors used broadcast over the batch, no module of their own),
:mod:`~ief.jacobian.prompts` (peft prompt tuning made visible to the hooks), :mod:`~ief.jacobian.errors`, and
:mod:`~ief.jacobian.rules`: one file per layer family and the registry from module type to :class:`LayerRule`. A layer type of one's own gets its rule with :func:`register_rule` (one subclass of
:class:`LayerRule`, one registration); without one its parameters take the loop.
"""
from .api import PerSample, gradient_and_sampled_jacobian, per_sample, sampled_jacobian
from .capture import PerSampleCapture
from .errors import PerSampleGradientMismatch, SlowPathWarning
from .guard import CHECKS, check_no_outside_use, exact_check_tolerance
from .prompts import per_sample_prompts
from .rules import BATCH_FIRST, LayerRule, register_rule, rule_for, unregister_rule, write_block

__all__ = [
    "per_sample",
    "sampled_jacobian",
    "gradient_and_sampled_jacobian",
    "PerSample",
    "PerSampleGradientMismatch",
    "SlowPathWarning",
    "PerSampleCapture",
    "CHECKS",
    "check_no_outside_use",
    "exact_check_tolerance",
    "LayerRule",
    "BATCH_FIRST",
    "register_rule",
    "unregister_rule",
    "rule_for",
    "write_block",
    "per_sample_prompts",
]
