"""Per-sample gradients of ``nn.Conv2d`` (unfold, rules.conv) and eval-mode ``nn.BatchNorm2d`` by hooks.

Checked on CNNs the rule was not written around (a torchvision-style ResNet basic block with eval-mode batch norm and
a strided 1x1 downsample, grouped / depthwise / dilated / ``"same"``-padded / bias-free convolutions), float64 and
float32, every form of ``J``:

- against the explicit per-sample float64 loop (``tests/oracle.py``), against ``torch.func`` (``vmap`` of ``grad``)
  and against BackPACK's ``BatchGrad``;
- EF / iEF / SF directions and the optimisers give the same result from the dense ``J`` and the factored one;
- what the rule cannot do exactly (reflect / circular padding, ``Conv1d``, transposed convolutions, batch norm in
  train mode) takes the exact loop with a ``SlowPathWarning`` naming it, or is refused: never silently wrong.

Tolerances: ``1e-10`` relative in float64 (rounding of different summation orders), ``1e-5`` in float32.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.func import functional_call, grad, vmap

import ief
import oracle

CLASSES = 4
FORMS = ["dense", "ghost", "rows", "auto"]


class BasicBlock(torch.nn.Module):
    """torchvision's ResNet ``BasicBlock`` (3x3 convs without bias, batch norm, strided 1x1 downsample), as a tiny
    classifier."""

    def __init__(self, c_in: int = 3, c_out: int = 6, stride: int = 2):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(c_out)
        self.conv2 = torch.nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(c_out)
        self.downsample = torch.nn.Sequential(
            torch.nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), torch.nn.BatchNorm2d(c_out)
        )
        self.fc = torch.nn.Linear(c_out, CLASSES)

    def forward(self, x):
        h = torch.relu(self.bn1(self.conv1(x)))
        h = torch.relu(self.bn2(self.conv2(h)) + self.downsample(x))
        return self.fc(torch.nn.functional.adaptive_avg_pool2d(h, 1).flatten(1))


def _exotic_convs(dropout: float = 0.0) -> torch.nn.Module:
    """Grouped, depthwise, dilated, "same"-padded, asymmetric, bias-free, strided convolutions in a row."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 6, (3, 2), stride=(2, 1), padding=(1, 2), dilation=(1, 2)),
        torch.nn.Tanh(),
        torch.nn.Conv2d(6, 6, 3, padding="same", groups=6, bias=False),  # depthwise
        torch.nn.Dropout(dropout),
        torch.nn.Conv2d(6, 4, (4, 2), padding="same", dilation=(1, 3), groups=2),  # "same" pads unevenly
        torch.nn.ReLU(),
        torch.nn.Conv2d(4, 4, 1, padding="valid", bias=False),
        torch.nn.AdaptiveAvgPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(16, CLASSES),
    )


def _randomise_batchnorm(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Running statistics and affine parameters away from their initial 0 / 1 (as after training)."""
    for mod in model.modules():
        if isinstance(mod, torch.nn.BatchNorm2d):
            with torch.no_grad():
                mod.running_mean.copy_(torch.randn(mod.num_features, generator=gen) * 0.3)
                mod.running_var.copy_(torch.rand(mod.num_features, generator=gen) + 0.5)
                mod.weight.copy_(torch.randn(mod.num_features, generator=gen))
                mod.bias.copy_(torch.randn(mod.num_features, generator=gen) * 0.1)


def _case(name: str, dtype: torch.dtype, mode: str = "eval", m: int = 5, seed: int = 0):
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = BasicBlock() if name == "resnet-block" else _exotic_convs()
    _randomise_batchnorm(model, gen)
    model = model.to(dtype).train(mode == "train")
    x = torch.randn(m, 3, 9, 8, generator=gen, dtype=dtype)
    y = torch.randint(0, CLASSES, (m,), generator=gen)
    return model, x, y


def _dense(jac):
    return jac.materialize() if isinstance(jac, ief.rows.FactoredJacobian) else jac


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _tol(dtype) -> float:
    return 1e-10 if dtype == torch.float64 else 1e-5


def _func_rows(model, x, y) -> torch.Tensor:
    """``torch.func``: ``vmap`` of ``grad`` of one sample's loss, ``[M, P]``."""
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}

    def loss(p, xi, yi):
        logits = functional_call(model, p, (xi[None],))
        return torch.nn.functional.cross_entropy(logits, yi[None], reduction="sum")

    rows = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    return torch.cat([rows[k].reshape(x.shape[0], -1) for k in params], dim=1)


CASES = [
    pytest.param(name, dtype, form, id=f"{name}-{str(dtype)[6:]}-{form}")
    for name in ("resnet-block", "exotic-convs")
    for dtype in (torch.float64, torch.float32)
    for form in FORMS
]


@pytest.mark.parametrize("name, dtype, form", CASES)
def test_conv_rows_match_the_loop_and_torch_func(name, dtype, form):
    """Hooked (no SlowPathWarning: every parameter, batch norm included, is hooked), exact against the float64 loop
    and torch.func, with the default guard and the exact check both passing."""
    model, x, y = _case(name, dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ief.SlowPathWarning)
        got = ief.per_sample(model, x, y, form=form)
        exact = ief.per_sample(model, x, y, form=form, check="exact")
    ref64 = copy.deepcopy(model).double()
    losses, jac, sq = oracle.per_sample(ref64, x.double(), y)
    tol = _tol(dtype)
    assert _dense(got.jacobian).dtype == dtype
    assert _rel(_dense(got.jacobian), jac) < tol
    assert _rel(_dense(exact.jacobian), jac) < tol
    assert _rel(got.losses, losses) < tol and _rel(got.logit_sqnorm, sq) < tol
    assert _rel(got.gradient, jac.sum(0)) < tol
    assert _rel(_func_rows(ref64, x.double(), y), jac) < 1e-10  # the peer agrees with the oracle
    assert _rel(_dense(got.jacobian), _func_rows(model, x, y)) < tol


def test_resnet_block_auto_form_keeps_conv_weights_as_rows_or_factors_by_cost():
    """One-group conv weights are factored ([M, L, C kh kw] unfolded inputs) when the ghost Gram is cheaper: with
    few output positions (a 1x1 spatial map) they are; grouped convs are always rows."""
    model, x, y = _case("resnet-block", torch.float64)
    fac = ief.per_sample(model, x[..., :2, :2], y, form="auto").jacobian
    names = [n for n, _ in model.named_parameters()]
    ghosted = {names[i] for i, _, _ in fac.ghosts}
    assert {"conv1.weight", "conv2.weight", "downsample.0.weight", "fc.weight"} <= ghosted
    model, x, y = _case("exotic-convs", torch.float64)
    fac = ief.per_sample(model, x, y, form="ghost").jacobian
    names = [n for n, _ in model.named_parameters()]
    assert {names[i] for i, _, _ in fac.ghosts} == {"0.weight", "6.weight", "9.weight"}  # groups == 1 only


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_conv_rows_match_backpack_batchgrad(dtype):
    """BackPACK's BatchGrad (its own unfold-based Conv2d extension) on a Sequential CNN BackPACK supports."""
    from backpack import backpack, extend
    from backpack.extensions import BatchGrad

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 6, 3, stride=2, padding=1, dilation=1), torch.nn.ReLU(),
        torch.nn.Conv2d(6, 4, 3, padding=2, dilation=2, groups=2, bias=False), torch.nn.Sigmoid(),
        torch.nn.Flatten(), torch.nn.Linear(4 * 5 * 4, CLASSES),
    ).to(dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 3, 9, 8, generator=gen, dtype=dtype)
    y = torch.randint(0, CLASSES, (6,), generator=gen)
    got = ief.per_sample(model, x, y).jacobian
    bp_model = extend(copy.deepcopy(model))
    loss = extend(torch.nn.CrossEntropyLoss(reduction="sum"))(bp_model(x), y)
    with backpack(BatchGrad()):
        loss.backward()
    ref = torch.cat([p.grad_batch.reshape(6, -1) for p in bp_model.parameters()], dim=1)
    assert _rel(got, ref) < _tol(dtype)


def test_train_mode_dropout_rows_are_the_batch_graph_rows():
    """Train mode with dropout: the rows are ``d l_n / d theta`` through the one batched forward (same masks)."""
    model, x, y = _case("exotic-convs", torch.float64, mode="train")
    model[3].p = 0.3
    torch.manual_seed(7)
    got = ief.per_sample(model, x, y).jacobian
    torch.manual_seed(7)
    losses = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
    ref = torch.stack([oracle.flat_grad(losses[n], oracle.trainable(model)) for n in range(len(y))])
    assert _rel(got, ref) < 1e-10


@pytest.mark.parametrize("form", ["dense", "ghost", "rows"])
def test_directions_and_optimisers_agree_on_both_gram_paths(form):
    """EF / iEF / SF directions and IEF / EF / SF optimiser steps from the factored J equal the dense ones."""
    model, x, y = _case("resnet-block", torch.float64, m=4)
    ref = ief.per_sample(model, x, y)
    got = ief.per_sample(model, x, y, form=form)
    assert _rel(ief.ief_direction(got.jacobian, got.logit_sqnorm, 1e-6),
                ief.ief_direction(ref.jacobian, ref.logit_sqnorm, 1e-6)) < 1e-9
    assert _rel(ief.ef_direction(got.jacobian, 1e-6), ief.ef_direction(ref.jacobian, 1e-6)) < 1e-9
    sampled = {f: ief.sampled_jacobian(model, x, y, torch.Generator().manual_seed(3), form=f) for f in ("dense", form)}
    assert _rel(ief.sf_direction(sampled[form], ref.gradient, 1e-3),
                ief.sf_direction(sampled["dense"], ref.gradient, 1e-3)) < 1e-9
    for opt_cls in (ief.optim.IEF, ief.optim.EF, ief.optim.SF):
        after = {}
        for f in ("dense", form):
            net = copy.deepcopy(model)
            opt = opt_cls(net, lr=1e-2, damping=1e-3, form=f)
            for _ in range(2):
                if opt_cls is ief.optim.SF:
                    torch.manual_seed(5)
                opt.step(x, y)
            after[f] = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
        assert _rel(after[form], after["dense"]) < 1e-9, opt_cls.__name__


@pytest.mark.parametrize(
    "layer, looped",
    [
        (lambda: torch.nn.Conv2d(3, 3, 3, padding=1, padding_mode="reflect"), "Conv2d"),
        (lambda: torch.nn.Conv2d(3, 3, 3, padding=1, padding_mode="circular"), "Conv2d"),
        (lambda: torch.nn.ConvTranspose2d(3, 3, 3, stride=1, padding=1), "ConvTranspose2d"),
    ],
    ids=["reflect", "circular", "transposed"],
)
def test_unhandled_conv_takes_the_exact_loop_and_says_so(layer, looped):
    torch.manual_seed(0)
    model = torch.nn.Sequential(layer(), torch.nn.Tanh(), torch.nn.Flatten(), torch.nn.Linear(3 * 6 * 5, CLASSES))
    model = model.double()
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 3, 6, 5, generator=gen, dtype=torch.float64), torch.randint(0, CLASSES, (4,), generator=gen)
    with pytest.warns(ief.SlowPathWarning, match=rf"0\.weight, 0\.bias \({looped}: no per-sample hook") as record:
        got = ief.per_sample(model, x, y).jacobian
    assert "1.weight" not in str(record[0].message).split("Hooked layers")[0].split("):")[0]
    assert _rel(got, oracle.per_sample(model, x, y)[1]) < 1e-10


def test_a_reflect_padded_conv1d_takes_the_exact_loop_and_says_so():
    """nn.Conv1d is hooked (as a Conv2d of height 1, tests/ief/test_layer_rules.py); reflect padding is not."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv1d(2, 3, 3, padding=1, padding_mode="reflect"), torch.nn.Flatten(),
                                torch.nn.Linear(18, CLASSES)).double()
    x, y = torch.randn(4, 2, 6, dtype=torch.float64), torch.randint(0, CLASSES, (4,))
    with pytest.warns(ief.SlowPathWarning, match=r"0\.weight, 0\.bias \(Conv1d: no per-sample hook"):
        got = ief.per_sample(model, x, y).jacobian
    assert _rel(got, oracle.per_sample(model, x, y)[1]) < 1e-10


def test_batchnorm_train_mode_in_a_cnn_is_refused_or_looped():
    """Train-mode batch norm mixes samples: the default guard refuses; with check=False its parameters take the
    loop (no eval-mode rule applies) and the conv rows are those of the batch graph."""
    model, x, y = _case("resnet-block", torch.float64, mode="train")
    with pytest.raises(ief.PerSampleGradientMismatch, match="bn1"):
        ief.per_sample(model, x, y)
    with pytest.warns(ief.SlowPathWarning, match="bn1.weight"):
        ief.per_sample(model, x, y, check=False)


class _TiedConv(torch.nn.Module):
    """A conv weight used a second time outside its module (``F.conv2d``): the hooks see only the module's use."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 2, 3, padding=1)
        self.head = torch.nn.Linear(2 * 5 * 5, CLASSES)

    def forward(self, x):
        h = torch.tanh(self.conv(x))
        return self.head(torch.nn.functional.conv2d(h, self.conv.weight, padding=1).flatten(1))


@pytest.mark.parametrize("form", ["dense", "ghost", "rows"])
def test_a_conv_weight_used_outside_its_module_takes_the_loop(form):
    """Found in the forward's graph: its rows come from the exact per-sample loop, not refused."""
    torch.manual_seed(0)
    model = _TiedConv().double()
    x, y = torch.randn(4, 2, 5, 5, dtype=torch.float64), torch.randint(0, CLASSES, (4,))
    _, expected, _ = oracle.per_sample(model, x, y)
    with pytest.warns(ief.SlowPathWarning, match="conv.weight"):
        got = ief.per_sample(model, x, y, form=form).jacobian
    got = got if isinstance(got, torch.Tensor) else got.materialize()
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
