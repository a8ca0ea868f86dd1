"""Property-based tests (Hypothesis): random small models, shapes, ``-100`` masks, dtypes and bad input.

- ``per_sample`` (``M`` from 1 to 8, sequence layers batch-first and time-major, ``T == M`` included) equals the
  explicit per-sample loop of ``tests/oracle.py``;
- the iEF / EF / SF directions equal their dense definitions (``eqn:iEF_lsq``, ``eqn:EF_lsq``, ``eqn:SF-smw``) and
  ``fisher_vp`` equals the explicit Fisher (``eqn:FIM``);
- every bad input raises its documented exception type with a message naming the value.

Deterministic for CI (``derandomize=True``), few examples, no deadline.
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ief
import oracle

IGNORE = -100
PROPERTY = settings(
    max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow], database=None
)


class TimeMajorTagger(torch.nn.Module):
    """Embedding -> LayerNorm -> Linear applied to ``[T, M, D]`` (time-major) -> head; logits ``[M, T, C]``."""

    def __init__(self, vocab: int, dim: int, classes: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.norm = torch.nn.LayerNorm(dim)
        self.mix = torch.nn.Linear(dim, dim)
        self.head = torch.nn.Linear(dim, classes)

    def forward(self, tokens):  # [M, T]
        h = self.norm(self.embed(tokens)).transpose(0, 1)  # [T, M, D]
        return self.head(torch.tanh(self.mix(h))).transpose(0, 1)


@st.composite
def problems(draw, max_m: int = 8):
    """(model, inputs, targets): an MLP classifier or a sequence tagger with ignored positions, random sizes/dtype."""
    m = draw(st.integers(1, max_m))
    classes = draw(st.integers(2, 4))
    dtype = draw(st.sampled_from([torch.float64, torch.float32]))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    if draw(st.booleans()):
        width = draw(st.integers(1, 5))
        model = torch.nn.Sequential(torch.nn.Linear(3, width), torch.nn.Tanh(), torch.nn.Linear(width, classes))
        inputs = torch.randn(m, 3, generator=g, dtype=dtype)
        targets = torch.randint(0, classes, (m,), generator=g)
    else:
        t = draw(st.sampled_from([1, 2, 3, m]))  # T == M included
        model = TimeMajorTagger(vocab=5, dim=3, classes=classes)
        inputs = torch.randint(0, 5, (m, t), generator=g)
        targets = torch.randint(0, classes, (m, t), generator=g)
        mask = torch.tensor(draw(st.lists(st.booleans(), min_size=m * t, max_size=m * t))).reshape(m, t)
        targets[mask] = IGNORE
    targets = targets.to(draw(st.sampled_from([torch.int64, torch.int32])))
    return model.to(dtype), inputs, targets


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _tol(model) -> float:
    return 1e-9 if next(model.parameters()).dtype == torch.float64 else 1e-4


def _oracle(model, inputs, targets):
    return oracle.per_sample(model, inputs, targets.long())


@PROPERTY
@given(problems())
def test_per_sample_equals_the_explicit_loop(problem):
    model, inputs, targets = problem
    with warnings.catch_warnings():
        warnings.simplefilter("error", ief.SlowPathWarning)  # every parameter here is hooked (time-major included)
        got = ief.per_sample(model, inputs, targets)
    losses, jac, sq = _oracle(model, inputs, targets)
    assert got.jacobian.shape == jac.shape and got.jacobian.dtype == next(model.parameters()).dtype
    assert _rel(got.jacobian, jac) < _tol(model)
    assert _rel(got.losses, losses) < _tol(model)
    assert _rel(got.logit_sqnorm, sq) < _tol(model)


@PROPERTY
@given(problems(), st.sampled_from([1e-6, 1e-2, 1.0]))
def test_directions_equal_their_dense_definitions(problem, damping):
    model, inputs, targets = problem
    _, jac, sq = _oracle(model, inputs, targets)
    j = jac.double()
    gram = j @ j.T + damping * torch.eye(j.shape[0], dtype=torch.float64)
    ief_dense = j.T @ torch.linalg.solve(gram, sq.double())
    ef_dense = j.T @ torch.linalg.solve(gram, torch.ones(j.shape[0], dtype=torch.float64))
    grad = j.sum(0)
    sf_dense = torch.linalg.solve(j.T @ j + damping * torch.eye(j.shape[1], dtype=torch.float64), grad)
    # directions in float64 from the oracle's J: the Woodbury forms against plain dense solves
    assert _rel(ief.ief_direction(j, sq.double(), damping), ief_dense) < 1e-7
    assert _rel(ief.ef_direction(j, damping), ef_dense) < 1e-7
    assert _rel(ief.sf_direction(j, grad, damping), sf_dense) < 1e-6
    # and from the package's own J in the model's dtype
    got = ief.per_sample(model, inputs, targets)
    assert _rel(ief.ief_direction(got.jacobian, got.logit_sqnorm, damping), ief_dense) < 1e3 * _tol(model)


@PROPERTY
@given(problems(max_m=4), st.sampled_from(["forward", "double_backward"]))
def test_fisher_vp_equals_the_explicit_fisher(problem, method):
    model, inputs, targets = problem
    dense = oracle.fisher(model, inputs, targets.long())
    v = torch.randn(dense.shape[0], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    fv = ief.fisher_vp(model, inputs, targets, v.to(next(model.parameters()).dtype), method=method)
    if float((dense @ v).norm()) < 1e-12:  # every position ignored: F = 0
        assert float(fv.norm()) < 1e-6
        return
    assert _rel(fv, dense @ v) < _tol(model)


# ---------------------------------------------------------------------------------------------------- bad input
def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3)).double()


X = torch.randn(4, 3, dtype=torch.float64)
Y = torch.tensor([0, 1, 2, 1])
P = 3 * 4 + 4 + 4 * 3 + 3


class NaNLogits(torch.nn.Module):
    def __init__(self, value: float):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3).double()
        self.value = value

    def forward(self, x):
        z = self.lin(x).clone()
        z[0, 0] = self.value
        return z


def _bad_damping(value):
    return ValueError, repr(value), lambda: ief.ief_direction(torch.ones(2, 3), torch.ones(2), value)


def _bad_class(value):
    return ValueError, str(value), lambda: ief.per_sample(_mlp(), X, torch.tensor([0, 1, value, 1]))


def _bad_check(value):
    return ValueError, repr(value), lambda: ief.per_sample(_mlp(), X, Y, check=value)


def _bad_loss(value):
    return ValueError, repr(value), lambda: ief.fisher_vp(_mlp(), X, Y, torch.ones(P, dtype=torch.float64), loss=value)


def _bad_method(value):
    return ValueError, repr(value), lambda: ief.gamma(_mlp(), X, Y, torch.ones(P, dtype=torch.float64), method=value)


def _bad_vector_length(value):
    return ValueError, f"[{P}]", lambda: ief.fisher_vp(_mlp(), X, Y, torch.ones(value, dtype=torch.float64))


def _bad_target_shape(value):
    return ValueError, str((4, value)), lambda: ief.per_sample(_mlp(), X, torch.zeros(4, value, dtype=torch.long))


V12 = torch.ones(12, dtype=torch.float64)


def _non_finite_logits(value):
    return FloatingPointError, str(value), lambda: ief.gamma(NaNLogits(value), X, Y, V12)


def _non_finite_logits_fvp(value):
    return FloatingPointError, str(value), lambda: ief.fisher_vp(NaNLogits(value), X, Y, V12)


def _float_targets(value):
    return ValueError, "float", lambda: ief.per_sample(_mlp(), X, Y.to(value))


BAD_INPUTS = st.one_of(
    st.sampled_from([-1.0, -1e-9, math.nan, math.inf, -math.inf]).map(_bad_damping),
    st.sampled_from([3, 4, 100, -1, -99, -101]).map(_bad_class),
    st.sampled_from(["always", "sum", 2, "EXACT"]).map(_bad_check),
    st.sampled_from(["ce", "nll", "MSE"]).map(_bad_loss),
    st.sampled_from(["jvp", "backward", "Forward"]).map(_bad_method),
    st.integers(1, 60).filter(lambda n: n != P).map(_bad_vector_length),
    st.integers(2, 5).map(_bad_target_shape),
    st.sampled_from([math.nan, math.inf]).map(_non_finite_logits),
    st.sampled_from([math.nan, math.inf]).map(_non_finite_logits_fvp),
    st.sampled_from([torch.float32, torch.float64, torch.float16]).map(_float_targets),
)


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(BAD_INPUTS)
def test_bad_input_raises_its_documented_type_naming_the_value(bad):
    kind, named, call = bad
    with pytest.raises(kind) as err:
        call()
    assert named in str(err.value), str(err.value)


@pytest.mark.parametrize(
    "call, kind, named",
    [
        (lambda: ief.per_sample(_mlp(), X[:0], Y[:0]), ValueError, "M = 0"),
        (lambda: ief.gamma(_mlp(), X[:0], Y[:0], torch.ones(P, dtype=torch.float64)), ValueError, "M = 0"),
        (lambda: ief.fisher_vp(_mlp(), X[:0], Y[:0], torch.ones(P, dtype=torch.float64)), ValueError, "M = 0"),
        (lambda: ief.per_sample(_mlp(), X, Y, params=[torch.nn.Parameter(torch.ones(2))]), ValueError,
         "not a parameter of the model"),
        (lambda: ief.per_sample(_mlp(), X, Y, params=[torch.nn.Parameter(torch.ones(2))], check=False), ValueError,
         "not a parameter of the model"),
        (lambda: ief.gamma(_mlp(), X, Y, torch.ones(2), params=[torch.nn.Parameter(torch.ones(2))]), ValueError,
         "not a parameter of the model"),
    ],
    ids=["M=0 per_sample", "M=0 gamma", "M=0 fisher_vp", "foreign param", "foreign param check=False",
         "foreign param gamma"],
)
def test_documented_errors(call, kind, named):
    with pytest.raises(kind, match=named):
        call()


class _Returns(torch.nn.Module):
    def __init__(self, output):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3).double()
        self.output = output

    def forward(self, x):
        self.lin(x)
        return self.output


@pytest.mark.parametrize("output", [(), []], ids=["tuple", "list"])
def test_forward_returning_nothing_is_a_value_error(output):
    with pytest.raises(ValueError, match="empty"):
        ief.per_sample(_Returns(output), X, Y)
    with pytest.raises(ValueError, match="empty"):
        ief.gamma(_Returns(output), X, Y, torch.ones(12, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.uint8])
def test_any_integer_target_dtype_is_a_class_index(dtype):
    model = _mlp()
    ref = ief.per_sample(model, X, Y)
    got = ief.per_sample(model, X, Y.to(dtype))
    assert torch.equal(got.jacobian, ref.jacobian) and torch.equal(got.logit_sqnorm, ref.logit_sqnorm)
    v = torch.randn(P, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert ief.gamma(model, X, Y.to(dtype), v) == ief.gamma(model, X, Y, v)
    assert torch.equal(ief.fisher_vp(model, X, Y.to(dtype), v), ief.fisher_vp(model, X, Y, v))
    g = torch.Generator().manual_seed(0)
    assert torch.equal(ief.sampled_jacobian(model, X, Y.to(dtype), g), ief.sampled_jacobian(
        model, X, Y, torch.Generator().manual_seed(0)))


# --------------------------------------------------------------------------------------- masked (-inf) logits
class Masked(torch.nn.Module):
    """Logits with class 2 masked to ``-inf`` (a constrained vocabulary)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3).double()

    def forward(self, x):
        return self.lin(x).masked_fill(torch.tensor([False, False, True]), -math.inf)


def test_masked_logits_are_accepted_the_same_everywhere():
    """IEF / EF (per_sample), SF (sampled labels), fisher_vp and gamma all accept -inf masked classes: masked classes
    have probability 0 and are never drawn; the results equal those of the model restricted to the kept classes."""
    torch.manual_seed(0)
    model = Masked()
    y = torch.tensor([0, 1, 1, 0])

    class Kept(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = model.lin

        def forward(self, x):
            return self.lin(x)[:, :2]

    kept = Kept()
    v = torch.randn(12, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert torch.allclose(ief.per_sample(model, X, y).jacobian, ief.per_sample(kept, X, y).jacobian)
    assert torch.allclose(ief.fisher_vp(model, X, y, v), ief.fisher_vp(kept, X, y, v))
    assert math.isclose(ief.gamma(model, X, y, v), ief.gamma(kept, X, y, v), rel_tol=1e-12)
    for seed in range(5):
        sampled = ief.sampled_jacobian(model, X, y, torch.Generator().manual_seed(seed))
        assert torch.isfinite(sampled).all()
    for opt in (ief.optim.IEF(model, lr=1e-3), ief.optim.EF(model), ief.optim.SF(model, damping=1e-3)):
        assert math.isfinite(float(opt.step(X, y)))


def test_a_position_with_every_class_masked_is_a_floating_point_error():
    class AllMasked(Masked):
        def forward(self, x):
            return self.lin(x).masked_fill(torch.tensor([True, True, True]), -math.inf)

    with pytest.raises(FloatingPointError, match="every class is -inf"):
        ief.sampled_jacobian(AllMasked(), X, Y)
    with pytest.raises(FloatingPointError, match="every class is -inf"):
        ief.fisher_vp(AllMasked(), X, Y, torch.ones(12, dtype=torch.float64))
