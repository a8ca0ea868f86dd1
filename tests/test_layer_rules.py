"""Per-sample hooks of the layers in :mod:`ief.layer_rules` against the dense float64 per-sample loop
(``tests/oracle.py``: one forward per sample), in the three forms of ``J`` (dense, ghost, rows), float32, masks with
an all-ignored sample, and ``torch.func`` vmap where it runs (``sec:app-iEF-impl``).

Tolerances as in ``tests/test_jacobian.py``: float64 ``1e-10`` relative (batched vs one-sample forwards agree to
rounding), float32 ``1e-5``.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import ief
import oracle

IGNORE = -100
F64_RTOL, F32_RTOL = 1e-10, 1e-5
FORMS = ["dense", "ghost", "rows"]


def _dense(jac):
    return jac.materialize() if isinstance(jac, ief.jacobian.FactoredJacobian) else jac


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _no_loop(model, inputs, targets, **kw):
    """``ief.per_sample`` with a SlowPathWarning turned into an error: every parameter must be hooked."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", ief.SlowPathWarning)
        return ief.per_sample(model, inputs, targets, **kw)


def _vmap_rows(model, x, y, params):
    """``torch.func`` per-sample gradients (vmap over ``grad``) of a model taking one tensor, cross-entropy summed
    over positions: the peer library's rows."""
    from torch.func import functional_call, grad, vmap

    names = [n for n, p in model.named_parameters() if any(p is q for q in params)]
    values = {n: p.detach() for n, p in model.named_parameters() if any(p is q for q in params)}

    def loss(v, xn, yn):
        z = functional_call(model, v, (xn.unsqueeze(0),))
        z = getattr(z, "logits", z)
        return torch.nn.functional.cross_entropy(z.reshape(-1, z.shape[-1]), yn.reshape(-1), reduction="sum",
                                                 ignore_index=IGNORE)

    g = vmap(grad(loss), in_dims=(None, 0, 0))(values, x, y)
    return torch.cat([g[n].reshape(x.shape[0], -1) for n in names], dim=1)


# ------------------------------------------------------------------------------------------------- HF Conv1D
class _Conv1DNet(torch.nn.Module):
    """Two HF ``Conv1D`` layers over ``[M, T, D]`` tokens, per-position logits."""

    def __init__(self):
        super().__init__()
        from transformers.pytorch_utils import Conv1D

        self.up, self.down = Conv1D(7, 4), Conv1D(3, 7)
        torch.nn.init.normal_(self.up.bias)
        torch.nn.init.normal_(self.down.bias)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


def _conv1d_case(dtype=torch.float64, m=5, t=3):
    torch.manual_seed(0)
    model = _Conv1DNet().to(dtype)
    x = torch.randn(m, t, 4, dtype=dtype)
    y = torch.randint(0, 3, (m, t))
    y[1] = IGNORE  # a sample whose every position is ignored: a zero row
    y[2, 0] = IGNORE
    return model, x, y


@pytest.mark.parametrize("form", FORMS)
def test_hf_conv1d_is_hooked_and_exact(form):
    model, x, y = _conv1d_case()
    got = _no_loop(model, x, y, form=form)
    _, expected, _ = oracle.per_sample(model, x, y)
    jac = _dense(got.jacobian)
    assert _rel(jac, expected) < F64_RTOL
    assert float(jac[1].abs().max()) == 0.0
    if form == "ghost":  # both weights kept as factors, in the [in, out] layout
        assert len(got.jacobian.ghosts) == 2
    assert _rel(got.gradient, expected.sum(0)) < F64_RTOL
    assert _rel(jac, _vmap_rows(model, x, y, list(model.parameters()))) < F64_RTOL


@pytest.mark.parametrize("form", ["dense", "auto"])
def test_hf_conv1d_float32(form):
    model, x, y = _conv1d_case(torch.float32)
    got = _dense(_no_loop(model, x, y, form=form).jacobian)
    model64 = _conv1d_case()[0]
    _, expected, _ = oracle.per_sample(model64, x.double(), y)
    assert got.dtype == torch.float32
    assert _rel(got, expected) < F32_RTOL


def test_hf_conv1d_factored_products_equal_the_dense_ones():
    model, x, y = _conv1d_case()
    dense = _no_loop(model, x, y).jacobian
    ghost = _no_loop(model, x, y, form="ghost").jacobian
    v = torch.randn(dense.shape[1], dtype=torch.float64)
    c = torch.randn(dense.shape[0], dtype=torch.float64)
    assert _rel(ghost.gram(), dense @ dense.T) < F64_RTOL
    assert _rel(ghost.times(v), dense @ v) < F64_RTOL
    assert _rel(ghost.combine_rows(c), dense.T @ c) < F64_RTOL
    assert _rel(ghost.row_sum(), dense.sum(0)) < F64_RTOL


def test_hf_conv1d_passes_the_exact_check():
    model, x, y = _conv1d_case()
    _no_loop(model, x, y, check="exact", form="ghost")
