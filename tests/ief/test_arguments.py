"""Explicit signatures and misspelled keywords (ief.arguments): what ``help()`` and an IDE show is every argument, and
a misspelled keyword names the closest valid ones instead of Python's bare "unexpected keyword argument"."""
from __future__ import annotations

import inspect

import pytest
import torch

import ief
from ief.arguments import edit_distance, suggest_keywords, unknown_keyword_message

EXPLICIT = ("params", "loss", "reduction", "normalize", "total_steps", "momentum", "dampening", "weight_decay",
            "check", "form", "process_group")


@pytest.mark.parametrize("cls", [ief.optim.IEF, ief.optim.EF, ief.optim.SF])
def test_the_optimisers_signatures_show_every_argument(cls):
    params = inspect.signature(cls).parameters
    assert not any(p.kind == p.VAR_KEYWORD for p in params.values()), "no **kwargs hiding arguments"
    assert set(EXPLICIT) <= set(params)
    assert repr(inspect.signature(cls.step).parameters["inputs"].default) == "<required>"


@pytest.mark.parametrize("cls, given, suggestion", [
    (ief.optim.IEF, "dampning", "(did you mean 'damping' or 'dampening'?)"),
    (ief.optim.EF, "normalise", "(did you mean 'normalize'?)"),
    (ief.optim.SF, "weightdecay", "(did you mean 'weight_decay'?)"),
    (ief.optim.IEF, "lr_rate", "; it takes: model, lr, damping, params"),
])
def test_a_misspelled_keyword_names_the_closest_valid_ones(cls, given, suggestion):
    with pytest.raises(TypeError) as err:
        cls(torch.nn.Linear(3, 2), **{given: 1e-3})
    text = str(err.value)
    assert text.startswith(f"{cls.__name__} got an unexpected keyword argument {given!r}")
    assert suggestion in text and "process_group" in text


def test_the_helper_keeps_the_function_and_its_signature():
    @suggest_keywords
    def fit(model, *, rate: float = 1.0, decay: float = 0.0):
        """Fit."""
        return model, rate, decay

    assert fit("m", rate=2.0) == ("m", 2.0, 0.0)
    shown = inspect.signature(fit).parameters
    assert [(n, p.default) for n, p in shown.items()] == [("model", inspect.Parameter.empty), ("rate", 1.0),
                                                          ("decay", 0.0)] and fit.__doc__ == "Fit."
    with pytest.raises(TypeError, match=r"^fit got an unexpected keyword argument 'rte' \(did you mean 'rate'\?\); "
                                        r"it takes: model, rate, decay$"):
        fit("m", rte=2.0)
    assert edit_distance("dampning", "damping") == edit_distance("dampning", "dampening") == 1
    assert edit_distance("", "abc") == 3 and edit_distance("kitten", "sitting") == 3
    assert "did you mean" not in unknown_keyword_message("f", inspect.signature(fit), "zzzzzz")
