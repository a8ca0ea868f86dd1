"""A user's own layer type gets a per-sample rule with ``ief.register_rule``: one rule (the class below, a file's
worth of code) plus one registration, and ``per_sample`` is then exact for it, in the dense and the factored forms,
with no slow per-sample loop; bad registrations are refused with a message that says what was wrong.

Tolerance as in ``tests/ief/test_layer_rules.py``: float64 ``1e-10`` relative against the per-sample loop oracle.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import ief
import oracle

F64_RTOL = 1e-10


class ScaledLinear(torch.nn.Module):
    """``y = s (x W^T + b)`` with a fixed scale ``s``: a layer type the built-in rules do not know."""

    def __init__(self, fan_in: int, fan_out: int, scale: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(fan_out, fan_in) / fan_in**0.5)
        self.bias = torch.nn.Parameter(torch.randn(fan_out) * 0.1)
        self.scale = scale

    def forward(self, x):
        return self.scale * torch.nn.functional.linear(x, self.weight, self.bias)


# ---- the rule: all a new layer type needs (in the library it would be one file under ief/jacobian/rules/)
class ScaledLinearRule(ief.LayerRule):
    """Rows ``s G_n^T A_n`` (weight) and ``s G_n^T 1`` (bias), ``A`` the inputs and ``G`` the output gradients."""

    def grads(self, module, x, g, dests, accumulate):
        a, g = self.factors(module, x, g)
        if "weight" in dests:
            ief.write_block(dests["weight"], g.transpose(1, 2) @ a, accumulate)
        if "bias" in dests:
            ief.write_block(dests["bias"], g.sum(dim=1), accumulate)

    def factored(self, module):
        return True

    def factors(self, module, x, g):
        m = x.shape[0]
        return x.reshape(m, -1, x.shape[-1]), module.scale * g.reshape(m, -1, g.shape[-1])


@pytest.fixture
def registered():
    previous = ief.register_rule(ScaledLinear, ScaledLinearRule())
    yield
    if previous is None:
        ief.jacobian.unregister_rule(ScaledLinear)
    else:
        ief.register_rule(ScaledLinear, previous)


def _case(positions: bool):
    torch.manual_seed(0)
    layers = [ScaledLinear(5, 7, 0.5), torch.nn.Tanh(), ScaledLinear(7, 3, 2.0)]
    model = torch.nn.Sequential(*layers).double()
    shape = (4, 3, 5) if positions else (4, 5)
    x = torch.randn(*shape, dtype=torch.float64)
    y = torch.randint(0, 3, shape[:-1])
    return model, x, y


def _dense(jacobian):
    return jacobian.materialize() if isinstance(jacobian, ief.rows.Rows) else jacobian


@pytest.mark.parametrize("positions", [False, True], ids=["mlp", "positions"])
@pytest.mark.parametrize("form", ["dense", "auto", "ghost", "rows"])
def test_a_registered_rule_gives_the_exact_rows_without_the_loop(registered, form, positions):
    model, x, y = _case(positions)
    _, want, _ = oracle.per_sample(model, x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ief.SlowPathWarning)
        got = ief.per_sample(model, x, y, form=form, check="exact")
    rows = _dense(got.jacobian)
    assert float((rows - want).norm() / want.norm()) < F64_RTOL
    assert float((got.gradient - want.sum(0)).norm() / want.sum(0).norm()) < F64_RTOL
    if form == "ghost":  # every ScaledLinear weight kept as its factors
        assert len(got.jacobian.ghosts) == 2


def test_without_the_rule_the_layer_takes_the_slow_loop():
    model, x, y = _case(False)
    assert ief.jacobian.rule_for(model[0]) is None
    with pytest.warns(ief.SlowPathWarning, match="ScaledLinear"):
        got = ief.per_sample(model, x, y)
    _, want, _ = oracle.per_sample(model, x, y)
    assert float((got.jacobian - want).norm() / want.norm()) < F64_RTOL


def test_registering_a_type_again_replaces_and_returns_the_rule(registered):
    first = ief.jacobian.rule_for(ScaledLinear(2, 2, 1.0))
    assert isinstance(first, ScaledLinearRule)
    assert ief.register_rule(ScaledLinear, ScaledLinearRule()) is first


class NoGrads(ief.LayerRule):
    pass


class FactoredWithoutFactors(ief.LayerRule):
    def grads(self, module, x, g, dests, accumulate):
        pass

    def factored(self, module):
        return True


@pytest.mark.parametrize("layer_type,rule,message", [
    (ScaledLinear, lambda module, x, g, dests, accumulate: None, "instance of an ief.LayerRule subclass"),
    (ScaledLinear, ScaledLinearRule, r"got the class ScaledLinearRule \(call it"),
    (ScaledLinear, NoGrads(), "NoGrads does not override LayerRule.grads"),
    (ScaledLinear, FactoredWithoutFactors(), "overrides factored but not factors"),
    (int, ScaledLinearRule(), "torch.nn.Module subclass as layer_type, got <class 'int'>"),
    (ScaledLinear(2, 2, 1.0), ScaledLinearRule(), "torch.nn.Module subclass as layer_type"),
], ids=["function", "class", "no-grads", "no-factors", "not-a-module", "an-instance"])
def test_a_bad_registration_is_refused_with_a_clear_message(layer_type, rule, message):
    with pytest.raises(TypeError, match=message):
        ief.register_rule(layer_type, rule)
    assert ief.jacobian.rule_for(ScaledLinear(2, 2, 1.0)) is None  # nothing was registered


def test_a_bad_feature_count_is_refused():
    with pytest.raises(ValueError, match="features must be an integer >= 0"):
        ScaledLinearRule(features=-2)
