"""The default guard of ``ief.per_sample`` (``check=True``): structural, through stand-in leaves (``ief.jacobian``).

While a hooked module runs, its parameters being differentiated are replaced by stand-ins, so autograd reaches a
parameter itself only through uses outside its hooked calls: that part is exactly what the hooked rows would miss.

- A Linear / Conv2d / Embedding weight also used outside its module (tied weights) is found in the forward's graph
  (its own gradient accumulator is there) and its module's parameters take the exact per-sample loop: rows equal to
  the float64 per-sample loop in every form of ``J``, float32 and float64, whatever the size of the outside use (also
  zero), with a ``SlowPathWarning`` naming it; nothing is refused and nothing suggests ``check=False``.
- The guard stays as a safety net behind that search: with the search switched off it names the parameter.
- No false alarm: models not designed here (torch's TransformerEncoderLayer, a CNN, an RNN with a Linear head), a
  zero outside contribution, hooked calls repeated or under ``torch.no_grad``.
- ``.gradient`` stays the batch gradient (``J^T 1``; autograd's for the loop's parameters), with every ``check``; the
  plain gradient of SF too.
- The stand-ins never outlive a call: parameters are restored after every forward, also one that raises; only the
  selected parameters are swapped; the exact check replays with the real parameters.
- What the sum check cannot see (a layer that mixes samples: its hooked rows still add up) is caught by
  ``check="exact"`` and by the optimisers' first step; batch norm with batch statistics is refused.
"""
from __future__ import annotations

import copy
import warnings

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, given, settings

import ief
import ief.jacobian as jac_mod
from ief.model_call import call_model
import oracle
from tiny_models import sequence_case, t5_lora_case, t5_prompt_case

FORMS = ["dense", "ghost", "rows", "auto"]


def _autograd_gradient(model, x, y, params=None) -> torch.Tensor:
    """The oracle: torch.autograd on ``L = sum_n l_n`` without any hook."""
    params = [p for p in model.parameters() if p.requires_grad] if params is None else params
    logits = call_model(model, x)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, -2), y.flatten(), reduction="sum")
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)])


def _assert_real_parameters(model):
    for module in model.modules():
        for name, p in module._parameters.items():
            assert p is None or isinstance(p, torch.nn.Parameter), f"{type(module).__name__}.{name} left a stand-in"


class _Tied(torch.nn.Module):
    """A Linear, a Conv2d and an Embedding whose weights may be used a second time outside their modules (scaled by
    ``leak``, which may be 0)."""

    def __init__(self, leak: float, tie: str):
        super().__init__()
        self.embed = torch.nn.Embedding(5, 8)
        self.conv = torch.nn.Conv2d(3, 3, 3, padding=1)
        self.lin = torch.nn.Linear(24 + 8, 24)
        self.head = torch.nn.Linear(24, 5)
        self.leak, self.tie = leak, tie

    def forward(self, x, tokens):  # [M, 3, 4, 2], [M]
        h = torch.tanh(self.conv(x))
        if self.tie == "conv":
            h = h + self.leak * torch.nn.functional.conv2d(h, self.conv.weight, padding=1)
        h = torch.tanh(self.lin(torch.cat([h.flatten(1), self.embed(tokens)], 1)))
        if self.tie == "lin":
            h = h + self.leak * torch.nn.functional.linear(h, self.lin.weight[:, :24])
        logits = self.head(h)
        if self.tie == "embed":  # an output layer tied to the input table, as in language models
            logits = logits + self.leak * torch.nn.functional.linear(h[:, :8], self.embed.weight)
        return logits


def _tied_batch(m, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, 3, 4, 2, generator=gen, dtype=dtype)
    return {"x": x, "tokens": torch.randint(0, 5, (m,), generator=gen)}, torch.randint(0, 5, (m,), generator=gen)


def _dense(jac):
    return jac if isinstance(jac, torch.Tensor) else jac.materialize()


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("tie", ["lin", "conv", "embed"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("leak", [1e-4, 1.0])
def test_a_weight_used_outside_its_module_takes_the_exact_loop(form, tie, dtype, leak):
    """Before: refused (PerSampleGradientMismatch suggesting check=False, whose rows were 44 % wrong on GPT-2). Now:
    the rows of the tied module's parameters come from the per-sample loop, equal to the float64 oracle; every other
    parameter keeps its hook; the warning names the tied weight and why."""
    torch.manual_seed(0)
    model = _Tied(leak, tie).double()
    inputs, y = _tied_batch(12, torch.float64)
    _, expected, _ = oracle.per_sample(model, inputs, y)
    model = model.to(dtype)
    inputs = {"x": inputs["x"].to(dtype), "tokens": inputs["tokens"]}
    jac_mod.loop._WARNED.clear()
    for check in (True, "exact", False):
        with pytest.warns(ief.SlowPathWarning, match=rf"{tie}\.weight.*also used outside") as caught:
            got = ief.per_sample(model, inputs, y, form=form, check=check)
        assert "head" not in str(caught[0].message)
        jac_mod.loop._WARNED.clear()
        tol = 1e-12 if dtype == torch.float64 else 1e-5
        assert _rel(_dense(got.jacobian), expected) < tol
        torch.testing.assert_close(got.gradient.double(), expected.sum(0), rtol=10 * tol, atol=10 * tol)
    _assert_real_parameters(model)


@pytest.mark.parametrize("form", FORMS)
def test_the_guard_is_a_safety_net_behind_the_search_and_suggests_no_check_false(monkeypatch, form):
    """With the graph search switched off, the tied weight's hooked rows miss its outside use: the guard names it
    and says why and what to do (and no message offers check=False, which would return those wrong rows)."""
    torch.manual_seed(0)
    model = _Tied(1.0, "embed").double()
    inputs, y = _tied_batch(6, torch.float64)
    monkeypatch.setattr(jac_mod.PerSampleCapture, "demote_outside_uses", lambda self, reached, names: None)
    with pytest.raises(ief.PerSampleGradientMismatch, match=r"embed\.weight \(relative error") as err:
        ief.per_sample(model, inputs, y, form=form)
    assert "check=False" not in str(err.value)
    assert str(err.value).endswith(
        ". A parameter is used outside the module that owns it where the per-sample hooks cannot see it (a weight "
        "tied to an unhooked use is found before the backward and takes the exact per-sample loop: this use escaped "
        "that search); pass params= to leave it out.")
    _assert_real_parameters(model)


@pytest.mark.parametrize("form", FORMS)
def test_a_zero_outside_contribution_passes_and_the_gradient_is_autograd(form):
    torch.manual_seed(0)
    for tie in ("lin", "conv", "embed"):
        model = _Tied(0.0, tie).double()
        inputs, y = _tied_batch(7, torch.float64)
        got = ief.per_sample(model, inputs, y, form=form, check="exact")
        torch.testing.assert_close(got.gradient, _autograd_gradient(model, inputs, y), rtol=1e-10, atol=1e-12)
        jac = got.jacobian if form == "dense" else got.jacobian.materialize()
        torch.testing.assert_close(jac.sum(0), got.gradient, rtol=1e-10, atol=1e-12)


class _Chain(torch.nn.Module):
    """Linears ``lins[k]``, and for every ``k`` in ``reuse`` a second use of ``lins[k].weight`` outside its module,
    scaled by ``leaks[k]``."""

    def __init__(self, width: int, depth: int, leaks: dict[int, float]):
        super().__init__()
        self.lins = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 3)
        self.leaks = leaks

    def forward(self, x):
        for k, lin in enumerate(self.lins):
            x = torch.tanh(lin(x))
            if k in self.leaks:
                x = x + self.leaks[k] * torch.nn.functional.linear(x, lin.weight)
        return self.head(x)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    width=st.integers(2, 6), depth=st.integers(1, 3), m=st.integers(1, 9), seed=st.integers(0, 2**16),
    leaks=st.dictionaries(st.integers(0, 2), st.sampled_from([0.0, 1e-3, 1.0]), max_size=3),
    form=st.sampled_from(FORMS),
)
def test_property_a_weight_used_outside_takes_the_loop_and_is_named(width, depth, m, seed, leaks, form):
    """Any set of re-used weights (a zero leak is still a use): rows equal to the float64 loop, the warning names
    exactly the re-used Linears."""
    torch.manual_seed(seed)
    leaks = {k: v for k, v in leaks.items() if k < depth}
    model = _Chain(width, depth, leaks).double()
    x, y = torch.randn(m, width, dtype=torch.float64), torch.randint(0, 3, (m,))
    _, expected, _ = oracle.per_sample(model, x, y)
    jac_mod.loop._WARNED.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = ief.per_sample(model, x, y, form=form)
    assert _rel(_dense(got.jacobian), expected) < 1e-12
    torch.testing.assert_close(got.gradient, _autograd_gradient(model, x, y), rtol=1e-10, atol=1e-12)
    text = " ".join(str(w.message) for w in caught if issubclass(w.category, ief.SlowPathWarning))
    named = {k for k in range(depth) if f"lins.{k}.weight" in text}
    assert named == (set(leaks) if m > 1 else set())  # M = 1: the loop is one backward, no warning
    _assert_real_parameters(model)


def _transformer():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
    model = torch.nn.Sequential(layer, torch.nn.Linear(8, 3)).double()
    return model, torch.randn(4, 5, 8, dtype=torch.float64), torch.randint(0, 3, (4, 5))


def _cnn():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(inplace=True),
        torch.nn.Conv2d(4, 4, 3, stride=2, groups=2), torch.nn.ReLU(), torch.nn.Flatten(),
        torch.nn.Linear(4 * 3 * 3, 6), torch.nn.LayerNorm(6), torch.nn.Linear(6, 3),
    ).double().eval()
    return model, torch.randn(5, 3, 8, 8, dtype=torch.float64), torch.randint(0, 3, (5,))


class _RNNHead(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = torch.nn.GRU(4, 6, batch_first=True)
        self.head = torch.nn.Linear(6, 3)

    def forward(self, x):
        return self.head(self.rnn(x)[0])


def _rnn():
    torch.manual_seed(0)
    return _RNNHead().double(), torch.randn(4, 5, 4, dtype=torch.float64), torch.randint(0, 3, (4, 5))


@pytest.mark.filterwarnings("ignore::ief.SlowPathWarning")
@pytest.mark.parametrize("build", [_transformer, _cnn, _rnn], ids=["transformer", "cnn", "rnn"])
@pytest.mark.parametrize("form", ["dense", "auto"])
def test_no_false_alarm_on_models_not_designed_here(build, form):
    """Also the exact check (its forward-mode replay runs with the real parameters) and the SF path's plain
    gradient; the hooked parameters' batch gradients are left to the rows (autograd gives them nothing)."""
    model, x, y = build()
    expected = _autograd_gradient(model, x, y)
    for check in (True, "exact"):
        got = ief.per_sample(model, x, y, form=form, check=check)
        torch.testing.assert_close(got.gradient, expected, rtol=1e-10, atol=1e-12)
    _assert_real_parameters(model)
    _, grad, _ = ief.jacobian.gradient_and_sampled_jacobian(model, x, y, form=form)
    torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-12)
    fwd = jac_mod.api._HookedForward(model, x, y, None, "cross_entropy", False)
    with torch.enable_grad():
        _, autograd = jac_mod.assemble._backward_jacobian(fwd.capture, fwd.loss.per_sample(fwd.logits, y), fwd.params,
                                                          False)
    assert fwd.capture.hooked and all(autograd[i] is None for i in fwd.capture.hooked)


@pytest.mark.filterwarnings("ignore::ief.SlowPathWarning")
@pytest.mark.parametrize("factory", [t5_lora_case, t5_prompt_case, sequence_case], ids=["t5-lora", "t5-prompt", "seq"])
def test_gradient_of_foreign_models_with_loop_and_demoted_parameters(factory):
    """peft LoRA (hooked), peft prompt tuning (an Embedding called without a sample axis: demoted to the loop, whose
    backward passes ask for its stand-ins too), nn.MultiheadAttention (replayed per sample)."""
    c = factory()
    got = ief.per_sample(c.model, c.inputs, c.targets, form="auto")
    params = [p for p in c.model.parameters() if p.requires_grad]
    expected = _autograd_gradient(c.model, c.inputs, c.targets, params)
    torch.testing.assert_close(got.gradient, expected, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(got.jacobian.materialize().sum(0), expected, rtol=1e-9, atol=1e-12)
    _assert_real_parameters(c.model)


class _Repeated(torch.nn.Module):
    """A Linear called three times (one call under no_grad), its bias left out of ``params`` in one test."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 3)

    def forward(self, x):  # [M, T, 4]
        h = torch.tanh(self.lin(x)).mean(1) + self.lin(x.mean(1))
        with torch.no_grad():
            frozen = self.lin(x[:, 0])
        return self.head(h + frozen)


def test_a_module_called_several_times_and_under_no_grad():
    torch.manual_seed(0)
    model = _Repeated().double()
    x, y = torch.randn(5, 3, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    fwd = jac_mod.api._HookedForward(model, x, y, None, "cross_entropy", True)
    assert len(fwd.capture.stand_ins[0]) == 2  # lin.weight: the two calls with gradients on
    _assert_real_parameters(model)
    for form in FORMS:
        got = ief.per_sample(model, x, y, form=form)
        torch.testing.assert_close(got.gradient, _autograd_gradient(model, x, y), rtol=1e-10, atol=1e-12)


def test_only_the_selected_parameters_are_swapped(monkeypatch):
    torch.manual_seed(0)
    model = _Repeated().double()
    x, y = torch.randn(5, 3, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    seen = []
    real, lin_weight, lin_bias = torch.nn.functional.linear, model.lin.weight, model.lin.bias

    def spy(inp, weight, bias=None):
        seen.append((weight is lin_weight, bias is lin_bias, type(weight) is torch.nn.Parameter))
        return real(inp, weight, bias)

    monkeypatch.setattr(torch.nn.modules.linear.F, "linear", spy)
    params = [model.lin.weight, model.head.bias]
    got = ief.per_sample(model, x, y, params)
    monkeypatch.undo()
    # the batch forward's two lin calls with gradients: the weight a stand-in, the unselected bias the real one;
    # lin under no_grad and every call of the probe forward: the real parameters
    lin_calls = [s for s in seen if s[1]]
    assert lin_calls[:2] == [(False, True, False)] * 2
    assert all(s == (True, True, True) for s in lin_calls[2:])
    expected = _autograd_gradient(model, x, y, params)
    torch.testing.assert_close(got.gradient, expected, rtol=1e-10, atol=1e-12)
    _assert_real_parameters(model)


class _Raises(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x[:, :3])  # wrong width: the Linear's forward raises


def test_parameters_are_restored_when_the_forward_raises():
    model = _Raises()
    weight, bias = model.lin.weight, model.lin.bias
    with pytest.raises(RuntimeError):
        ief.per_sample(model, torch.randn(3, 4), torch.zeros(3, dtype=torch.long))
    assert model.lin.weight is weight and model.lin.bias is bias
    capture = jac_mod.PerSampleCapture(model, [weight, bias], stand_ins=True)
    with pytest.raises(RuntimeError), capture:
        model(torch.randn(3, 4))
    assert model.lin.weight is weight and model.lin.bias is bias and not capture._originals


def test_kfac_capture_keeps_the_real_parameters():
    """K-FAC's capture (no stand-ins) takes the gradient from autograd."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).double()
    capture = jac_mod.PerSampleCapture(model, list(model.parameters()))
    with capture:
        out = model(torch.randn(5, 3, dtype=torch.float64)).sum()
    grads = torch.autograd.grad(out, list(model.parameters()))
    assert all(g is not None for g in grads) and not capture.stand_ins


class _MixesSamples(torch.nn.Module):
    """Centres each feature over the batch between two Linears: every l_n depends on every sample."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(4, 6)
        self.head = torch.nn.Linear(6, 3)

    def forward(self, x):
        h = self.inp(x)
        return self.head(torch.tanh(h - h.mean(0, keepdim=True)))


def test_a_layer_that_mixes_samples_is_caught_by_the_exact_check_and_the_first_optimiser_step():
    """Its hooked rows still sum to the batch gradient (the sum check cannot see it, as documented), so the exact
    check (directional derivatives) is what catches it; the optimisers run that check on their first step."""
    torch.manual_seed(0)
    model = _MixesSamples().double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    ief.per_sample(model, x, y)  # documented: the sum check passes
    with pytest.raises(ief.PerSampleGradientMismatch, match="directional derivative"):
        ief.per_sample(model, x, y, check="exact")
    for form in ("dense", "auto"):
        with pytest.raises(ief.PerSampleGradientMismatch, match="directional derivative"):
            ief.optim.IEF(model, lr=1e-3, form=form).step(x, y)
    _assert_real_parameters(model)


@pytest.mark.parametrize("form", FORMS)
def test_batchnorm_with_batch_statistics_is_refused_by_the_default_guard(form):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 3)).double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    with pytest.raises(ief.PerSampleGradientMismatch, match="batch statistics"):
        ief.per_sample(model, x, y, form=form)


def test_per_sample_gradient_is_computed_on_first_access_and_survives_pickling():
    import copy
    import pickle

    torch.manual_seed(0)
    model = _Repeated().double()
    x, y = torch.randn(5, 3, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    expected = _autograd_gradient(model, x, y)
    got = ief.per_sample(model, x, y, form="auto")
    assert isinstance(got._gradient, jac_mod.api._Deferred)  # nobody asked yet: not computed
    for copied in (pickle.loads(pickle.dumps(got)), copy.deepcopy(got)):
        torch.testing.assert_close(copied.gradient, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got.gradient, expected, rtol=1e-10, atol=1e-12)
    given = ief.PerSample(got.losses, got.jacobian, got.logit_sqnorm, expected)  # the public constructor
    assert given.gradient is expected


# ------------------------------------------------------------------------------ the exact check, whatever P and dtype
class _FlipMix(torch.nn.Module):
    """``Linear(D, D) -> tanh -> h + mix * h.flip(0) -> Linear(D, 3)`` (samples mixed): with ``mix != 0`` every l_n
    depends on sample ``M - 1 - n``; the hooked rows still add up. ``P = D^2 + 4 D + 3`` (4 355 for D = 64, 66 563
    for D = 256)."""

    def __init__(self, d: int, mix: float):
        super().__init__()
        self.lin, self.head, self.mix = torch.nn.Linear(d, d), torch.nn.Linear(d, 3), mix

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        return self.head(h + self.mix * h.flip(0))


def _flip_mix(d: int, mix: float, dtype: torch.dtype, m: int = 6, seed: int = 0):
    torch.manual_seed(seed)
    model = _FlipMix(d, mix).double()
    gen = torch.Generator().manual_seed(seed + 1)
    x, y = torch.randn(m, d, generator=gen, dtype=torch.float64), torch.randint(0, 3, (m,), generator=gen)
    return model.to(dtype), x.to(dtype), y


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("d", [64, 256])
def test_exact_check_catches_sample_mixing_whatever_p_and_dtype(d, dtype):
    """Before: float32 passed J 46-48 % wrong (the old bound, 50 sqrt(eps) of ||J_n|| ||v||, lost sensitivity like
    1/sqrt(P)). Now caught in both dtypes, by per_sample and the optimisers' first step (parameters untouched);
    without the mixing the same model passes and its rows are the oracle's."""
    model, x, y = _flip_mix(d, 0.5, dtype)
    with pytest.raises(ief.PerSampleGradientMismatch, match="directional derivatives"):
        ief.per_sample(model, x, y, check="exact")
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ief.PerSampleGradientMismatch, match="directional derivatives"):
        ief.optim.IEF(model, lr=0.1).step(x, y)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    clean, x, y = _flip_mix(d, 0.0, dtype)
    _, expected, _ = oracle.per_sample(copy.deepcopy(clean).double(), x.double(), y)
    got = ief.per_sample(clean, x, y, check="exact")
    assert _rel(got.jacobian, expected) < (1e-12 if dtype == torch.float64 else 1e-5)


def _inject(monkeypatch, row: int, size: float, seed: int):
    """Make ``per_sample``'s rows wrong by ``size`` (relative) in row ``row``, in a random direction."""
    real = jac_mod.assemble._backward_jacobian

    def wrong(*args, **kwargs):
        jac, autograd = real(*args, **kwargs)
        gen = torch.Generator().manual_seed(seed)
        noise = torch.randn(jac.shape[1], generator=gen, dtype=torch.float64)
        jac[row] += (size * jac[row].double().norm() / noise.norm() * noise).to(jac.dtype)
        return jac, autograd

    monkeypatch.setattr(jac_mod.assemble, "_backward_jacobian", wrong)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("d", [3, 64, 256], ids=["P=24", "P=4355", "P=66563"])
def test_exact_check_catches_a_one_percent_error_in_any_row(monkeypatch, d, dtype):
    """A 1 % error (relative to ||J_n||, random direction) in one row is named, whatever P and the dtype (before: at
    P = 66 563 the old bound, 0.017 of ||J_n|| ||v|| in float32, needed an error of ~4 ||J_n||); no error, no
    alarm."""
    model, x, y = _flip_mix(d, 0.0, dtype)
    ief.per_sample(model, x, y, check="exact")
    for row in (0, 4):
        _inject(monkeypatch, row, 0.01, seed=row)
        with pytest.raises(ief.PerSampleGradientMismatch, match=rf"samples \[{row}\]"):
            ief.per_sample(model, x, y, check="exact")
        monkeypatch.undo()


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(d=st.integers(1, 40), m=st.integers(2, 8), seed=st.integers(0, 2**16), data=st.data(),
       dtype=st.sampled_from([torch.float32, torch.float64]), size=st.sampled_from([0.01, 0.05, 1.0]))
def test_property_exact_check_names_exactly_the_wrong_row(monkeypatch, d, m, seed, data, dtype, size):
    model, x, y = _flip_mix(d, 0.0, dtype, m=m, seed=seed)
    row = data.draw(st.integers(0, m - 1))
    ief.per_sample(model, x, y, check="exact")  # no false alarm
    _inject(monkeypatch, row, size, seed)
    try:
        with pytest.raises(ief.PerSampleGradientMismatch, match=rf"samples \[{row}\]"):
            ief.per_sample(model, x, y, check="exact")
    finally:
        monkeypatch.undo()


class _MeanPooled(torch.nn.Module):
    """Embedding with ``padding_idx`` mean-pooled over every position, padding included (no mask): the logits depend on
    the padding row, whose gradient autograd defines as 0."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(7, 4, padding_idx=0), torch.nn.Linear(4, 3)

    def forward(self, tokens):
        return self.head(torch.tanh(self.embed(tokens)).mean(1))


def test_exact_check_gives_the_padding_row_no_tangent():
    """No false alarm where forward mode would differentiate the padding row that autograd (and the hooks) leave at
    zero; the rows are the oracle's."""
    torch.manual_seed(0)
    model = _MeanPooled().double()
    tokens = torch.randint(1, 7, (5, 4))
    tokens[:, -1] = 0
    y = torch.randint(0, 3, (5,))
    _, expected, _ = oracle.per_sample(model, tokens, y)
    assert _rel(ief.per_sample(model, tokens, y, check="exact").jacobian, expected) < 1e-12
