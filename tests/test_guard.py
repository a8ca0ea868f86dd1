"""The default guard of ``ief.per_sample`` (``check=True``) made cheap (``ief.row_sum_sketch``), and still sure.

- The sketch is exact algebra: ``sum_n J_n W`` and ``sum_n ||J_n W||^2`` from the hooked inputs and output gradients
  equal those of the materialised ``J`` (Linear with one and several positions and calls, Conv2d with groups, stride,
  dilation, "same" padding), and ``g W`` that of the gradient.
- It catches what the full check catches: a Linear / Conv2d weight also used outside its module, in every form of
  ``J``, on every one of many calls (fresh sketches), also when the outside use is small (relative 1e-4 in float64).
- No false alarms: float32 models with many samples pass on many calls.
- What the sum check cannot see (a layer that mixes samples: its hooked rows still add up) is caught by
  ``check="exact"`` and by the optimisers' first step; batch norm with batch statistics is refused by the default
  guard.
"""
from __future__ import annotations

import pytest
import torch

import ief
import ief.jacobian as jac_mod
from ief.row_sum_sketch import sketch_matrices, sketched_gradient, sketched_rows

FORMS = ["dense", "ghost", "rows", "auto"]


def _hooked(model, x, y, form="dense"):
    """``(capture, J, gradient)`` of one backward, no guard."""
    fwd = jac_mod._HookedForward(model, x, y, None, "cross_entropy", False)
    with torch.enable_grad():
        losses = fwd.loss.per_sample(fwd.logits, y)
        jac, grad = jac_mod._backward_jacobian(fwd.capture, losses, fwd.params, False, None, form)
    return fwd.capture, jac, grad


class _TwoCalls(torch.nn.Module):
    """A Linear called twice (on a sequence and on its mean) and a grouped, strided, dilated conv."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 6, 3, stride=2, dilation=2, padding="valid", groups=2)
        self.same = torch.nn.Conv2d(6, 3, (2, 3), padding="same", bias=False)
        self.lin = torch.nn.Linear(12, 12)
        self.head = torch.nn.Linear(12, 3)

    def forward(self, x):  # [M, 4, 9, 12]
        h = self.same(torch.tanh(self.conv(x)))  # [M, 3, 3, 4]
        seq = h.flatten(1).unflatten(1, (3, 12))  # [M, 3, 12]
        h = torch.tanh(self.lin(seq)).mean(1) + self.lin(seq.mean(1))
        return self.head(h)


def test_sketch_equals_the_materialised_jacobian_times_w():
    torch.manual_seed(0)
    model = _TwoCalls().double()
    x, y = torch.randn(5, 4, 9, 12, dtype=torch.float64), torch.randint(0, 3, (5,))
    capture, jac, grad = _hooked(model, x, y)
    gen = torch.Generator().manual_seed(1)
    checked = 0
    for k, (module, _, _, owned) in enumerate(capture.modules):
        if "weight" not in owned or not isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)):
            continue
        i = owned["weight"]
        lo, hi = capture.offsets[i], capture.offsets[i + 1]
        wt = sketch_matrices([module], 2, gen)[0]  # [groups, k, I_g]
        groups, _, fan_in = wt.shape
        rows = jac[:, lo:hi].reshape(5, groups, -1, fan_in)  # J_n, [M, groups, O_g, I_g]
        expected_rows = (rows @ wt.transpose(1, 2)[None]).transpose(2, 3).transpose(1, 2).flatten(2)  # [M, k, O]
        total, sqnorm = sketched_rows(module, list(capture.calls(k)), wt)
        torch.testing.assert_close(total, expected_rows.sum(0), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(sqnorm, expected_rows.square().sum(), rtol=1e-12, atol=0)
        torch.testing.assert_close(sketched_gradient(grad[lo:hi], wt), expected_rows.sum(0), rtol=1e-10, atol=1e-12)
        checked += 1
    assert checked == 4


class _Tied(torch.nn.Module):
    """A Linear (fan-in 24 > the sketch's 8 columns) and a Conv2d whose weights are used a second time outside
    their modules, scaled by ``leak``."""

    def __init__(self, leak: float, tie: str):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 3, 3, padding=1)
        self.lin = torch.nn.Linear(24, 24)
        self.head = torch.nn.Linear(24, 4)
        self.leak, self.tie = leak, tie

    def forward(self, x):  # [M, 3, 4, 2]
        h = torch.tanh(self.conv(x))
        if self.tie == "conv":
            h = h + self.leak * torch.nn.functional.conv2d(h, self.conv.weight, padding=1)
        h = torch.tanh(self.lin(h.flatten(1)))
        if self.tie == "lin":
            h = h + self.leak * torch.nn.functional.linear(h, self.lin.weight)
        return self.head(h)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("tie", ["lin", "conv"])
@pytest.mark.parametrize("m", [4, 48], ids=["M=4", "M=48"])
def test_guard_catches_a_weight_used_outside_its_module_on_every_call(form, tie, m):
    """Small and large batches (the exact block check and the sketch), every form, 10 calls (10 fresh sketches);
    the outside use contributes about 1e-4 of the gradient."""
    torch.manual_seed(0)
    model = _Tied(1e-4, tie).double()
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(m, 3, 4, 2, generator=gen, dtype=torch.float64), torch.randint(0, 4, (m,), generator=gen)
    for _ in range(10):
        with pytest.raises(ief.PerSampleGradientMismatch, match=f"{tie}.weight"):
            ief.per_sample(model, x, y, form=form)


def test_guard_takes_the_sketch_for_large_batches_and_the_columns_for_small_ones(monkeypatch):
    """Which way each weight is checked (by cost): the sketch when ``k P + M T k (I + O) < 2 M P``."""
    sketched = []
    real = jac_mod.sketched_rows

    def spy(module, calls, wt):
        sketched.append(module)
        return real(module, calls, wt)

    monkeypatch.setattr(jac_mod, "sketched_rows", spy)
    torch.manual_seed(0)
    model = _Tied(0.0, "none").double()
    for m, expected in ((4, []), (48, [model.lin])):
        sketched.clear()
        x, y = torch.randn(m, 3, 4, 2, dtype=torch.float64), torch.randint(0, 4, (m,))
        ief.per_sample(model, x, y)
        assert sketched == expected
        sketched.clear()
        ief.per_sample(model, x, y, form="ghost")  # no columns of J for ghosted weights: always the sketch
        assert model.lin in sketched and model.head in sketched


@pytest.mark.parametrize("form", ["dense", "auto"])
def test_no_false_alarm_in_float32_on_many_calls(form):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3, stride=2, groups=2),
        torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(8 * 3 * 3, 64), torch.nn.Tanh(), torch.nn.Linear(64, 10),
    )
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        x = torch.randn(64, 3, 8, 8, generator=gen) * 10
        y = torch.randint(0, 10, (64,), generator=gen)
        ief.per_sample(model, x, y, form=form)


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


@pytest.mark.parametrize("form", FORMS)
def test_batchnorm_with_batch_statistics_is_refused_by_the_default_guard(form):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 3)).double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    with pytest.raises(ief.PerSampleGradientMismatch, match="batch statistics"):
        ief.per_sample(model, x, y, form=form)
