"""Make peft prompt tuning and p-tuning visible to the per-sample hooks.

peft's ``get_prompt`` (prompt tuning and p-tuning, training mode) embeds the virtual tokens of ONE sample (p-tuning:
through its prompt encoder, an embedding and an MLP or LSTM) and repeats the result across the batch. The prompt
``nn.Embedding`` then sees a batch of 1, its output gradient is already summed over the samples, and ``ief`` must
fall back to one backward pass per sample for the prompt parameters (exact, ~M times slower).
:func:`per_sample_prompts` makes the model embed the prompt tokens of every sample instead: the values are identical,
and the hooks get the per-sample gradients from the ordinary single backward.
"""
from __future__ import annotations

import types

import torch


def _embed_prompts_per_sample(self, batch_size: int, task_ids=None, max_cache_len=None) -> torch.Tensor:
    encoder = self.prompt_encoder[self.active_adapter]
    tokens = self.prompt_tokens[self.active_adapter].unsqueeze(0).expand(batch_size, -1)  # [M, virtual tokens]
    return encoder(tokens.to(encoder.embedding.weight.device))


def per_sample_prompts(model: torch.nn.Module) -> torch.nn.Module:
    """Patch a peft prompt-tuning or p-tuning model (in place) so that its prompts are embedded per sample; returns
    it.

    peft embeds the virtual tokens once and repeats them across the batch, which hides the prompt's per-sample
    gradients from the hooks: without this patch :func:`ief.per_sample` falls back to one backward per sample (exact,
    ``M`` times slower, with a :class:`SlowPathWarning`). After it the prompts are embedded per sample (identical
    values) and a step needs one backward (``sec:app-iEF-impl``). Call it once after ``peft.get_peft_model(...)``.
    P-tuning's prompt encoder then runs on every sample's tokens (``M`` times its one-sample cost, small beside the
    model's); its ``nn.Embedding`` and MLP layers are hooked (an LSTM encoder's ``nn.LSTM`` has no hook: the loop).

    Args:
        model: a peft model with ``PeftType.PROMPT_TUNING`` or ``PeftType.P_TUNING`` (LoRA needs nothing).

    Returns:
        The same ``model``, patched.

    Raises:
        ValueError: a model that is neither peft prompt tuning nor p-tuning, naming its type and ``peft_type``.
    """
    config = getattr(model, "active_peft_config", None)
    peft_type = str(getattr(config, "peft_type", ""))
    if config is None or peft_type.rsplit(".", 1)[-1] not in ("PROMPT_TUNING", "P_TUNING"):
        raise ValueError(
            f"per_sample_prompts needs a peft prompt-tuning or p-tuning model (PeftType.PROMPT_TUNING, P_TUNING), got "
            f"{type(model).__name__} with peft_type {peft_type or None!r}"
        )
    model.get_prompt = types.MethodType(_embed_prompts_per_sample, model)
    return model
