"""ief: exact empirical-Fisher-type natural-gradient tools for PyTorch.

Companion code for *An Improved Empirical Fisher Approximation for Natural Gradient Descent* (Wu, Yu, Zhang,
Woodland, NeurIPS 2024). Docstrings cite the paper's equations, algorithms and
appendices by their numbers in the paper (e.g. Eq. (8), Algorithm 1).

Conventions, followed by every function of the package:

- ``model(inputs)`` (or ``model(**inputs)`` when ``inputs`` is a dict, as with HuggingFace models) returns logits
  with the class dimension last, ``[M, C]`` or ``[M, T, C]``, or an object with ``.logits``. Input tensors have the
  sample dimension first (a one-sample slice of them locates the sample axis inside hooked layers; where that fails
  the per-sample gradients come from the exact, slower loop). ``torch.compile``d and ``nn.DataParallel`` models are
  run through their eager module.
- ``targets`` are class indices ``[M]`` or ``[M, T]`` (any integer dtype; ``M >= 1``); ``-100`` marks ignored
  positions. Position ``t``'s logits are scored against ``targets[:, t]``: for a causal LM pass
  ``causal_lm_targets(labels)`` (the next token), not Hugging Face's unshifted ``labels``.
- The per-sample loss ``l_n`` is the sum of the cross-entropies over sample ``n``'s non-ignored positions and the
  batch loss is ``L = sum_n l_n`` (Eq. (1)). ``z_n`` is all logits of sample ``n``, so
  ``||grad_{z_n} l_n||^2`` sums over its positions.
- The parameters are the model's trainable ones (``requires_grad=True``), flattened in ``model.parameters()``
  order, unless ``params=`` is given. Frozen weights (LoRA bases, a T5 body) are never differentiated.
- Every function that evaluates the model takes ``loss="cross_entropy"`` (default) or ``loss="mse"``
  (``l_n = 1/2 ||z_n - y_n||^2`` with float targets shaped like the logits; its Fisher is the Gauss-Newton matrix).
- Results follow the model's dtype (float32 or float64); Gram systems are solved in float64.
- A *direction* ``d`` is the preconditioned gradient; the update is ``theta <- theta - eta * d``.
- The model is used in the mode it is in (``train()`` / ``eval()``). Within one call, every forward pass replays the
  same random state, so dropout masks are identical across the passes a computation needs.
"""
from . import optim
from .curvature import DegenerateIndicator, FisherOperator, fisher_vp, gamma, gammas
from .directions import ef_direction, ief_direction, sf_direction
from .hessian_free import CGResult, hessian_free
from .damping_sweep import damping_sweep
from .evaluation import METHODS, batch_generator, evaluate, evaluate_batch, fresh_generator
from .kfac import check_linear_only, kfac_direction
from .logit_jvp import ForwardModeUnsupported
from .losses import IGNORE_INDEX, causal_lm_targets, count_targets, get_loss, logit_sqnorm
from .model_call import call_model
from .precision import refuse_float16
from .jacobian import (LayerRule, PerSample, PerSampleGradientMismatch, SlowPathWarning, per_sample,
                       per_sample_prompts, register_rule, sampled_jacobian, write_block)

__version__ = "0.1.0"

__all__ = [
    "per_sample",
    "PerSample",
    "PerSampleGradientMismatch",
    "SlowPathWarning",
    "per_sample_prompts",
    "register_rule",
    "LayerRule",
    "write_block",
    "sampled_jacobian",
    "ief_direction",
    "ef_direction",
    "sf_direction",
    "fisher_vp",
    "FisherOperator",
    "ForwardModeUnsupported",
    "gamma",
    "gammas",
    "DegenerateIndicator",
    "hessian_free",
    "CGResult",
    "optim",
    "kfac_direction",
    "check_linear_only",
    "evaluate",
    "evaluate_batch",
    "batch_generator",
    "fresh_generator",
    "METHODS",
    "damping_sweep",
    "causal_lm_targets",
    "count_targets",
    "IGNORE_INDEX",
    "call_model",
    "get_loss",
    "logit_sqnorm",
    "refuse_float16",
    "__version__",
]
