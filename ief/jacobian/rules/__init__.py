"""The layer rules, one file per layer family, and their registry (:mod:`ief.jacobian.rules.registry`).

Importing this package registers the built-in rules: ``linear`` (``nn.Linear``, HF ``Conv1D``), ``conv``
(``nn.Conv2d`` / ``nn.Conv1d``), ``embedding`` (``nn.Embedding``), ``scaled_embedding`` (Hugging Face's scaled word
embeddings, verified per class), ``norms`` (``nn.LayerNorm``, ``nn.GroupNorm``, eval-mode batch norm), ``rmsnorm``
(``nn.RMSNorm``, Hugging Face's RMS norms verified per class) and ``attention`` (``nn.MultiheadAttention``).
peft's adapters have theirs too (``peft_*``, sharing ``peft_common``). The rules import nothing of the capture above
them: what a rule may build on (:class:`LayerRule`, :func:`~ief.jacobian.rules.registry.write_block`,
:func:`~ief.jacobian.rules.registry.recording_hook`) lives in the registry. Adding a layer rule is one file (a :class:`LayerRule` subclass) plus one :func:`register_rule` call.
"""
from . import attention, conv, embedding, linear, norms, rmsnorm, scaled_embedding  # noqa: F401  (each registers)
from . import peft_adalora, peft_ia3, peft_loha, peft_lokr, peft_lora_embedding, peft_vera  # noqa: F401
from . import peft_dora  # noqa: F401  (peft DoRA's magnitude vector, registered by class name)
from .registry import BATCH_FIRST, LayerRule, register_rule, rule_for, unregister_rule, write_block

__all__ = ["BATCH_FIRST", "LayerRule", "register_rule", "rule_for", "unregister_rule", "write_block"]
