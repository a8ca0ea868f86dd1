"""How the optimisers' ``step`` is called wrong on first contact, and the sentence each mistake gets.

A first-order optimiser's ``step()`` takes nothing; these take the batch, ``opt.step(inputs, targets)``, because they
run the forward and the per-sample backward themselves. Two habits from Hugging Face code miss that and, without this
module, meet Python's or the generic message:

- ``opt.step(**batch)``: the batch dict spread as keywords (``"step() got an unexpected keyword argument
  'input_ids'"``);
- ``opt.step(batch)`` with a batch that still holds ``"labels"``: the targets are in the dict, where the model would
  read them, not where the optimiser does.

:func:`explained_step` wraps ``step`` so that both raise ``TypeError`` naming the mistake and the call that works.
"""
from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

_FIX = ("labels = batch.pop('labels'); opt.step(batch, ief.causal_lm_targets(labels)) for a causal LM (Hugging "
        "Face's labels are unshifted), or opt.step(batch, labels) for a classifier or a seq2seq model")


def batch_as_keywords_message(name: str, keywords: list[str]) -> str:
    """The sentence for ``opt.step(**batch)``: which keywords came, and the call that works."""
    shown = ", ".join(map(repr, keywords[:6])) + (", ..." if len(keywords) > 6 else "")
    return (f"{name}.step takes the batch as two arguments, opt.step(inputs, targets), not spread as keywords (got "
            f"{shown}): it runs the model's forward itself, model(**inputs), and fits the targets; with a Hugging "
            f"Face batch dict: {_FIX}")


def labels_in_inputs_message(name: str) -> str:
    """The sentence for ``opt.step(batch)`` whose dict still holds ``"labels"`` and no targets were given."""
    return (f"{name}.step got one batch dict that still holds 'labels' and no targets: the optimiser fits the targets "
            f"given as its second argument (the model's own loss from 'labels' is not used); take them out: {_FIX}")


def explained_step(step: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap an optimiser's ``step(self, inputs, targets, *, closure)`` so that the mistakes of the module docstring
    raise ``TypeError`` with their sentence; every other call goes through unchanged (``inspect.signature`` and
    ``help`` still show ``step``'s own)."""
    signature = inspect.signature(step)

    @functools.wraps(step)
    def wrapper(self, *args: Any, **kwargs: Any) -> Any:
        name = type(self).__name__
        unknown = [key for key in kwargs if key not in signature.parameters]
        if unknown:
            raise TypeError(batch_as_keywords_message(name, unknown))
        targets_given = len(args) >= 2 or "targets" in kwargs
        inputs = args[0] if args else kwargs.get("inputs")
        if not targets_given and isinstance(inputs, Mapping) and "labels" in inputs:
            raise TypeError(labels_in_inputs_message(name))
        return step(self, *args, **kwargs)

    return wrapper
