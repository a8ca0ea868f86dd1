"""ief.kfac: K-FAC / eK-FAC / ieK-FAC against a hand-derived dense float64 oracle and against curvlinops."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
from curvlinops import KFACLinearOperator

import ief
from ief.kfac import kronecker_factors
from tiny_models import mlp_case, t5_prompt_case


@pytest.fixture(autouse=True)
def _float64_default():
    """Tiny models built here are float64 (restored afterwards: other test modules rely on float32)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


# ------------------------------------------------------------------------------------------------- dense oracle
def _oracle_mlp_factors(model, x, y, kind, sampled=None):
    """Factors of ``Linear(5,7) -> tanh -> Linear(7,4)`` by explicit per-sample backprop written out by hand."""
    lin1, lin2 = model[0], model[2]
    W1, b1, W2, b2 = (t.detach() for t in (lin1.weight, lin1.bias, lin2.weight, lin2.bias))
    A1 = torch.zeros(6, 6)
    A2 = torch.zeros(8, 8)
    G1 = torch.zeros(7, 7)
    G2 = torch.zeros(4, 4)
    grads = [torch.zeros_like(W1), torch.zeros_like(b1), torch.zeros_like(W2), torch.zeros_like(b2)]
    m = x.shape[0]
    for n in range(m):
        a1 = x[n]
        h = torch.tanh(W1 @ a1 + b1)
        z = W2 @ h + b2
        p = torch.softmax(z, 0)
        e_true = p - torch.nn.functional.one_hot(y[n], 4).double()
        g2_true = e_true
        g1_true = (W2.T @ g2_true) * (1 - h**2)
        grads[0] += torch.outer(g1_true, a1)
        grads[1] += g1_true
        grads[2] += torch.outer(g2_true, h)
        grads[3] += g2_true
        label = y[n] if kind != "kfac" else sampled[n]
        e = p - torch.nn.functional.one_hot(label, 4).double()
        g2 = e
        g1 = (W2.T @ g2) * (1 - h**2)
        # s_n = (1 - p_y)^2 + sum_{c != y} p_c^2 with 1 - p_y summed from the other classes: a sample whose p_y
        # rounds to 1 (1 - p_y ~ 1e-26 in the hand loop's fourth batch) keeps its first term, which e_true @ e_true
        # loses, a factor 3 in its weight
        others = p.clone()
        others[y[n]] = 0.0
        w = 1.0 / float(others.sum() ** 2 + others @ others) if kind == "iekfac" else 1.0
        a1t, ht = torch.cat([a1, torch.ones(1)]), torch.cat([h, torch.ones(1)])
        A1 += torch.outer(a1t, a1t) / m
        A2 += torch.outer(ht, ht) / m
        G1 += w * torch.outer(g1, g1)
        G2 += w * torch.outer(g2, g2)
    return [(G1, A1, grads[0], grads[1]), (G2, A2, grads[2], grads[3])]


def _oracle_direction(blocks, damping):
    out = []
    for G, A, gW, gb in blocks:
        grad = torch.cat([gW, gb.unsqueeze(1)], 1)
        F = torch.kron(G, A)
        if damping > 0:
            d = torch.linalg.solve(F + damping * torch.eye(F.shape[0]), grad.reshape(-1))
        else:
            d = torch.linalg.pinv(F, hermitian=True) @ grad.reshape(-1)
        d = d.reshape(grad.shape)
        out += [d[:, :-1].reshape(-1), d[:, -1]]
    return torch.cat(out)


def test_undamped_is_the_pseudo_inverse():
    """M = 3 samples: rank-deficient G and A; lambda = 0 gives the minimum-norm (pseudo-inverse) direction."""
    case = mlp_case(m=3)
    d = ief.kfac_direction(case.model, case.inputs, case.targets, "ekfac", 0.0)
    expected = _oracle_direction(_oracle_mlp_factors(case.model, case.inputs, case.targets, "ekfac"), 0.0)
    torch.testing.assert_close(d, expected, rtol=1e-7, atol=1e-9)
    assert torch.isfinite(d).all()


def test_iekfac_reweights_only_the_gradient_factor():
    case = mlp_case(m=6)
    logits = case.model(case.inputs).detach()
    s = ief.losses.logit_sqnorm(ief.losses.get_loss("cross_entropy"), logits, case.targets)
    blocks_e, _, _ = kronecker_factors(case.model, case.inputs, case.targets, "ekfac")
    blocks_i, _, _ = kronecker_factors(case.model, case.inputs, case.targets, "iekfac")
    assert len(blocks_e) == len(blocks_i) == 2
    for be, bi in zip(blocks_e, blocks_i):
        torch.testing.assert_close(be.A, bi.A)
        assert not torch.allclose(be.G, bi.G)  # the s_n differ in this batch
    assert float(s.max() / s.min()) > 1.01


# ---------------------------------------------------------------------------------------------- curvlinops peer
class PositionwiseNet(torch.nn.Module):
    """Frozen embedding -> Linear -> ReLU -> Linear on every position: logits [M, T, C] (weight sharing)."""

    def __init__(self, vocab=9, dim=4, hidden=5, classes=3):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.embed.weight.requires_grad_(False)
        self.l1 = torch.nn.Linear(dim, hidden)
        self.l2 = torch.nn.Linear(hidden, classes)

    def forward(self, tokens):
        return self.l2(torch.relu(self.l1(self.embed(tokens))))


class ChannelsSecond(torch.nn.Module):
    """curvlinops' CrossEntropyLoss wants [B, C, T] logits."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net(x).transpose(1, 2)


def _dense_ours(blocks, params):
    """Our block-diagonal K-FAC matrix in the flat parameter order."""
    sizes = [p.numel() for p in params]
    offsets = torch.tensor([0, *sizes]).cumsum(0).tolist()
    P = offsets[-1]
    out = torch.zeros(P, P)
    for b in blocks:
        kron = torch.kron(b.G, b.A)
        o, k = b.G.shape[0], b.A.shape[0]
        cols = torch.zeros(o, k, dtype=torch.long)
        if "weight" in b.index:
            i = b.index["weight"]
            kin = params[i].shape[1]
            cols[:, :kin] = offsets[i] + torch.arange(o * kin).reshape(o, kin)
        if "bias" in b.index:
            i = b.index["bias"]
            cols[:, -1] = offsets[i] + torch.arange(o)
        idx = cols.reshape(-1)
        out[idx[:, None], idx[None, :]] = kron
    return out


def _curvlinops_dense(model, params, x, y, fisher_type, approx, seed=2147483647):
    op = KFACLinearOperator(model, torch.nn.CrossEntropyLoss(reduction="sum"), params, [(x, y)],
                            fisher_type=fisher_type, kfac_approx=approx, separate_weight_and_bias=False,
                            check_deterministic=False, seed=seed)
    return op @ torch.eye(sum(p.numel() for p in params))


@pytest.mark.parametrize("approx", ["expand", "reduce"])
@pytest.mark.parametrize("kind, fisher_type", [("ekfac", "empirical"), ("kfac", "mc")])
def test_matches_curvlinops_on_a_weight_shared_model(kind, fisher_type, approx):
    """eKFAC against curvlinops' empirical K-FAC; KFAC against its Monte-Carlo K-FAC, whose labels curvlinops draws
    from a generator seeded with ``seed``: ours, from the same labels, agree."""
    torch.manual_seed(2)
    net = PositionwiseNet()
    x = torch.randint(0, 9, (6, 3))
    y = torch.randint(0, 3, (6, 3))
    params = [p for p in net.parameters() if p.requires_grad]
    seed = 1234
    labels = None
    if kind == "kfac":
        with torch.no_grad():
            flat = net(x).reshape(-1, 3)
        labels = flat.softmax(1).multinomial(1, generator=torch.Generator().manual_seed(seed)).reshape(6, 3)
    blocks, _, _ = kronecker_factors(net, x, y, kind, approx=approx, sampled_targets=labels)
    ref = _curvlinops_dense(ChannelsSecond(net), params, x, y, fisher_type, approx, seed=seed)
    torch.testing.assert_close(_dense_ours(blocks, params), ref, rtol=1e-10, atol=1e-12)


def test_direction_is_the_damped_solve_of_the_curvlinops_matrix():
    torch.manual_seed(3)
    net = PositionwiseNet()
    x = torch.randint(0, 9, (4, 5))
    y = torch.randint(0, 3, (4, 5))
    params = [p for p in net.parameters() if p.requires_grad]
    ref = _curvlinops_dense(ChannelsSecond(net), params, x, y, "empirical", "expand")
    grad = torch.cat([g.reshape(-1) for g in torch.autograd.grad(
        torch.nn.functional.cross_entropy(net(x).reshape(-1, 3), y.reshape(-1), reduction="sum"), params)])
    d = ief.kfac_direction(net, x, y, "ekfac", 0.05)
    torch.testing.assert_close(d, torch.linalg.solve(ref + 0.05 * torch.eye(len(grad)), grad), rtol=1e-9, atol=1e-11)


def test_float32_model_gives_float32_direction_close_to_float64():
    case = mlp_case(m=8)
    d64 = ief.kfac_direction(case.model, case.inputs, case.targets, "iekfac", 1e-2)
    model32 = case.model.float()
    d32 = ief.kfac_direction(model32, case.inputs.float(), case.targets, "iekfac", 1e-2)
    assert d32.dtype == torch.float32
    torch.testing.assert_close(d32.double(), d64, rtol=1e-3, atol=1e-4)


# ------------------------------------------------------------------------------------------------- bad input
def test_non_linear_trainable_parameters_raise_naming_them():
    case = t5_prompt_case()
    with pytest.raises(ValueError, match="outside any nn.Linear"):
        ief.kfac_direction(case.model, case.inputs, case.targets, "ekfac", 1e-3)


def test_params_restricts_to_linear_layers():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))
    x, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
    with pytest.raises(ValueError, match="1.weight"):
        ief.kfac_direction(model, x, y, "ekfac", 1e-3)
    linear = [*model[0].parameters(), *model[2].parameters()]
    d = ief.kfac_direction(model, x, y, "ekfac", 1e-3, params=linear)
    assert d.shape == (sum(p.numel() for p in linear),)
    assert ief.gamma(model, x, y, d, params=linear) > 0


def test_bias_only_linear():
    """ViT-style bias='lora_only': a linear layer whose bias trains while its weight is frozen."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    x, y = torch.randn(7, 3), torch.randint(0, 2, (7,))
    params = [p for p in model.parameters() if p.requires_grad]
    blocks, _, _ = kronecker_factors(model, x, y, "ekfac")
    torch.testing.assert_close(blocks[0].A, torch.ones(1, 1))
    ref = _curvlinops_dense(model, params, x, y, "empirical", "expand")
    torch.testing.assert_close(_dense_ours(blocks, params), ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind, damping, approx, match", [
    ("eKFAC", 1e-3, "expand", "unknown kind"),
    ("ekfac", -1.0, "expand", "damping"),
    ("ekfac", float("nan"), "expand", "damping"),
    ("ekfac", 1e-3, "sum", "unknown approx"),
])
def test_bad_arguments(kind, damping, approx, match):
    case = mlp_case()
    with pytest.raises(ValueError, match=match):
        ief.kfac_direction(case.model, case.inputs, case.targets, kind, damping, approx=approx)


class EncoderClassifier(torch.nn.Module):
    """torch's own TransformerEncoderLayer (dropout on, in eval mode) + a mean-pooled linear head: one loss per
    sequence, where K-FAC "reduce" is the natural approximation and "expand" the default."""

    def __init__(self, dim=8, classes=3):
        super().__init__()
        self.layer = torch.nn.TransformerEncoderLayer(dim, nhead=2, dim_feedforward=12, batch_first=True)
        self.head = torch.nn.Linear(dim, classes)

    def forward(self, x):
        return self.head(self.layer(x).mean(dim=1))


@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_torch_transformer_layer_against_curvlinops(approx):
    """The attention's raw in_proj_weight is not a linear layer's: params= restricts K-FAC to the nn.Linear ones
    (feed-forward and head); curvlinops agrees on those blocks."""
    torch.manual_seed(4)
    model = EncoderClassifier().eval()
    x, y = torch.randn(5, 4, 8), torch.randint(0, 3, (5,))
    with pytest.raises(ValueError, match="in_proj_weight"):
        ief.kfac_direction(model, x, y, "ekfac", 1e-3)
    params = [*model.layer.linear1.parameters(), *model.layer.linear2.parameters(), *model.head.parameters()]
    blocks, _, _ = kronecker_factors(model, x, y, "iekfac", params, approx=approx)
    blocks_e, _, _ = kronecker_factors(model, x, y, "ekfac", params, approx=approx)
    ref = _curvlinops_dense(model, params, x, y, "empirical", approx)
    torch.testing.assert_close(_dense_ours(blocks_e, params), ref, rtol=1e-10, atol=1e-12)
    assert [b.name for b in blocks] == ["layer.linear1", "layer.linear2", "head"]


@settings(max_examples=15, deadline=None)
@given(m=st.integers(1, 7), hidden=st.integers(1, 6), damping=st.sampled_from([0.0, 1e-6, 1e-2, 10.0]),
       kind=st.sampled_from(["ekfac", "iekfac"]), bias=st.booleans())
def test_property_direction_is_damped_solve_of_the_blocks(m, hidden, damping, kind, bias):
    """Any batch size (rank-deficient factors included), width, damping and bias setting: the direction is
    (G (x) A + lambda I)^+ grad per block, finite, in parameter order."""
    gen = torch.Generator().manual_seed(m * 100 + hidden)
    model = torch.nn.Sequential(torch.nn.Linear(3, hidden, bias=bias), torch.nn.Tanh(), torch.nn.Linear(hidden, 2))
    model = model.double()
    x = torch.randn(m, 3, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 2, (m,), generator=gen)
    params = list(model.parameters())
    d = ief.kfac_direction(model, x, y, kind, damping)
    assert d.shape == (sum(p.numel() for p in params),) and torch.isfinite(d).all()
    blocks, grad, _ = kronecker_factors(model, x, y, kind)
    dense = _dense_ours(blocks, params)
    if damping > 0:
        expected = torch.linalg.solve(dense + damping * torch.eye(len(grad)), grad)
        torch.testing.assert_close(d, expected, rtol=1e-6, atol=1e-9)
    else:  # pseudo-inverse: d solves the normal equations on the range of the block matrix
        torch.testing.assert_close(dense @ d, dense @ torch.linalg.pinv(dense, hermitian=True) @ grad,
                                   rtol=1e-5, atol=1e-8)


def test_one_pass_for_several_kinds_equals_one_call_per_kind():
    """ief.kfac.kfac_directions shares the forward, the true-label backward and each layer's A with its
    eigendecomposition: bit for bit the directions (and KFAC's labels from the same generator state) of
    kfac_direction per kind."""
    from ief.kfac import kfac_directions

    case = mlp_case(m=7)
    dampings = {"kfac": 1e-3, "ekfac": 0.0, "iekfac": 1e-6}
    together = kfac_directions(case.model, case.inputs, case.targets, dampings,
                               generator=torch.Generator().manual_seed(4))
    for kind, lam in dampings.items():
        alone = ief.kfac_direction(case.model, case.inputs, case.targets, kind, lam,
                                   generator=torch.Generator().manual_seed(4))
        assert torch.equal(together[kind], alone), kind
    with pytest.raises(ValueError, match="unknown kind"):
        kfac_directions(case.model, case.inputs, case.targets, {"kfac": 1e-3, "bogus": 1e-3})


# ------------------------------------------------------------------- layers called twice, unused, uncalled
class SharedTwice(torch.nn.Module):
    """``shared`` applied twice per forward (weight sharing across depth), then a head. ``discard_first``: the first
    call's output never reaches the loss (its output gradient is absent). ``spare``: a trainable Linear registered
    first and never called; ``idle``: one called on every forward whose output is discarded (both: no gradient)."""

    def __init__(self, discard_first=False):
        super().__init__()
        self.spare = torch.nn.Linear(3, 2)
        self.shared = torch.nn.Linear(3, 3)
        self.idle = torch.nn.Linear(3, 2)
        self.head = torch.nn.Linear(3, 4)
        self.discard_first = discard_first

    def forward(self, x):
        self.idle(x)
        h1 = self.shared(x)
        u = torch.tanh(h1) if not self.discard_first else torch.sin(x)
        h2 = self.shared(u)
        return self.head(torch.tanh(h2))

    def by_hand(self, x):
        """The same forward written out: ``(logits, [(call input, call output), ...] of shared, head input)``."""
        W, b = self.shared.weight, self.shared.bias
        h1 = x @ W.T + b
        u = torch.tanh(h1) if not self.discard_first else torch.sin(x)
        h2 = u @ W.T + b
        v = torch.tanh(h2)
        return v @ self.head.weight.T + self.head.bias, [(x, h1), (u, h2)], v


def _oracle_shared_twice(model, x, y, damping):
    """eKFAC factors and direction of :class:`SharedTwice` by an explicit loop over samples: for ``shared``,
    ``A = (1/M) sum_n sum_calls [a, 1][a, 1]^T`` and ``G = sum_n sum_calls g g^T`` over the calls whose output reaches
    the loss (``g = dl_n / d(call output)``; a call whose output reaches no loss is in neither factor); for ``head``
    the usual single-call factors; ``idle`` (its only call reaches no loss) and ``spare`` (never called): no block,
    zero direction (zero gradient)."""
    m = x.shape[0]
    one = torch.ones(1)
    A_s, G_s, A_h, G_h = torch.zeros(4, 4), torch.zeros(3, 3), torch.zeros(4, 4), torch.zeros(4, 4)
    params = [model.shared.weight, model.shared.bias, model.head.weight, model.head.bias]
    grads = [torch.zeros_like(p) for p in params]
    for n in range(m):
        z, calls, v = model.by_hand(x[n : n + 1])
        l_n = torch.nn.functional.cross_entropy(z, y[n : n + 1], reduction="sum")
        outs = [o for _, o in calls]
        *g_calls, g_head = torch.autograd.grad(l_n, [*outs, z], retain_graph=True, allow_unused=True)
        for k, g in enumerate(torch.autograd.grad(l_n, params)):
            grads[k] += g
        for (a, _), g in zip(calls, g_calls):
            if g is not None:
                at = torch.cat([a[0].detach(), one])
                A_s += torch.outer(at, at) / m
                G_s += torch.outer(g[0], g[0])
        vt = torch.cat([v[0].detach(), one])
        A_h += torch.outer(vt, vt) / m
        G_h += torch.outer(g_head[0], g_head[0])
    blocks = [(G_s, A_s, grads[0], grads[1]), (G_h, A_h, grads[2], grads[3])]
    shared, head = _oracle_direction([blocks[0]], damping), _oracle_direction([blocks[1]], damping)
    return blocks, torch.cat([torch.zeros(8), shared, torch.zeros(8), head])


@pytest.mark.parametrize("discard_first", [False, True], ids=["both-calls-used", "first-call-discarded"])
@pytest.mark.parametrize("damping", [1e-3, 0.5])
def test_linear_called_twice_per_forward_against_a_per_sample_loop(discard_first, damping):
    """A Linear called twice per forward contributes both calls to ``A`` and both calls' output gradients to ``G``
    (a call whose output is discarded adds to neither); a trainable Linear that is never called, or whose only call
    reaches no loss, gets no block and a zero direction, and the layers after it are unaffected. Factors and
    direction against :func:`_oracle_shared_twice`."""
    torch.manual_seed(5)
    model = SharedTwice(discard_first)
    x, y = torch.randn(6, 3), torch.randint(0, 4, (6,))
    blocks_expected, d_expected = _oracle_shared_twice(model, x, y, damping)
    blocks, _, _ = kronecker_factors(model, x, y, "ekfac")
    assert [b.name for b in blocks] == ["shared", "head"]
    for block, (G, A, _, _) in zip(blocks, blocks_expected):
        torch.testing.assert_close(block.G, G, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(block.A, A, rtol=1e-12, atol=1e-14)
    d = ief.kfac_direction(model, x, y, "ekfac", damping)
    torch.testing.assert_close(d, d_expected, rtol=1e-9, atol=1e-12)
    assert torch.count_nonzero(d[:8]) == 0 and torch.count_nonzero(d[20:28]) == 0  # spare and idle


def test_float64_model_under_a_float32_default_dtype():
    """The factors and the solve are float64 whatever ``torch.get_default_dtype()`` is: a float64 model (with calls
    whose output is discarded, which enter no factor) under a float32 default matches the dense oracle to float64
    accuracy."""
    torch.manual_seed(5)
    model = SharedTwice(discard_first=True)
    x, y = torch.randn(6, 3), torch.randint(0, 4, (6,))
    _, expected = _oracle_shared_twice(model, x, y, 1e-3)
    torch.set_default_dtype(torch.float32)  # the autouse fixture restores the previous default
    d = ief.kfac_direction(model, x, y, "ekfac", 1e-3)
    assert d.dtype == torch.float64
    torch.testing.assert_close(d, expected, rtol=1e-9, atol=1e-12)


def test_linear_called_twice_matches_curvlinops():
    """The same accumulation over calls is curvlinops' (the conventions the module docstring names)."""
    torch.manual_seed(5)
    model = SharedTwice()
    x, y = torch.randn(6, 3), torch.randint(0, 4, (6,))
    params = [*model.shared.parameters(), *model.head.parameters()]
    blocks, _, _ = kronecker_factors(model, x, y, "ekfac", params)
    ref = _curvlinops_dense(model, params, x, y, "empirical", "expand")
    torch.testing.assert_close(_dense_ours(blocks, params), ref, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------- undamped at extreme scales
@pytest.mark.parametrize("scale", [1e-16, 1e-8, 1e8, 1e16], ids=["1e-16", "1e-8", "1e8", "1e16"])
def test_undamped_kronecker_solve_is_the_pseudo_inverse_at_any_scale(scale):
    """``lambda = 0`` with rank-deficient ``G`` (rank 2 of 4) and ``A`` (rank 3 of 5) whose eigenvalue products lie
    near ``scale``: the cut-off of negligible products is relative to the largest, so the result is
    ``pinv(G (x) A) vec(grad)`` at every scale (the oracle: a dense ``20 x 20`` pseudo-inverse, relative cut-off)."""
    from ief.kfac import _damped_kronecker_solve

    gen = torch.Generator().manual_seed(7)
    bg = torch.randn(4, 2, generator=gen)
    ba = torch.randn(5, 3, generator=gen)
    G, A = bg @ bg.T * scale**0.5, ba @ ba.T * scale**0.5
    grad = torch.randn(4, 5, generator=gen)
    got = _damped_kronecker_solve(G, A, grad, 0.0).reshape(-1)
    expected = torch.linalg.pinv(torch.kron(G, A), hermitian=True, rtol=1e-10) @ grad.reshape(-1)
    assert float((got - expected).norm() / expected.norm()) < 1e-8


@pytest.mark.parametrize("x_scale", [1e-6, 1e6], ids=["1e-6", "1e6"])
def test_undamped_direction_at_extreme_input_scales(x_scale):
    """End to end: a bias-free Linear, 3 samples of 5 features (``A`` of rank 3) scaled so ``A``'s eigenvalues sit
    near ``1e-12`` or ``1e12``; ``lambda = 0`` gives ``pinv(G (x) A) vec(grad)`` from factors written out by hand
    (``g_n = p_n - e_{y_n}``, ``A = (1/M) sum x x^T``)."""
    torch.manual_seed(6)
    model = torch.nn.Linear(5, 4, bias=False)
    x, y = torch.randn(3, 5) * x_scale, torch.tensor([0, 2, 3])
    with torch.no_grad():
        e = torch.softmax(model(x), 1) - torch.nn.functional.one_hot(y, 4).double()
    G, A, grad = e.T @ e, x.T @ x / 3, e.T @ x
    expected = torch.linalg.pinv(torch.kron(G, A), hermitian=True, rtol=1e-10) @ grad.reshape(-1)
    d = ief.kfac_direction(model, x, y, "ekfac", 0.0)
    assert float((d - expected).norm() / expected.norm()) < 1e-8


# ----------------------------------------------------------------------------- loss, dtype, labels, overflow
def test_mse_loss_reaches_the_factors():
    """``loss="mse"`` on a single Linear: ``g_n = z_n - y_n``, so ``G = sum_n e_n e_n^T``; direction against the dense
    damped solve of those hand-written factors."""
    torch.manual_seed(8)
    model = torch.nn.Linear(3, 2)
    x, y = torch.randn(7, 3), torch.randn(7, 2)
    with torch.no_grad():
        e = model(x) - y
    xt = torch.cat([x, torch.ones(7, 1)], 1)
    G, A, grad = e.T @ e, xt.T @ xt / 7, e.T @ xt
    expected = torch.linalg.solve(torch.kron(G, A) + 0.1 * torch.eye(8), grad.reshape(-1)).reshape(2, 4)
    d = ief.kfac_direction(model, x, y, "ekfac", 0.1, loss="mse")
    torch.testing.assert_close(d, torch.cat([expected[:, :3].reshape(-1), expected[:, 3]]), rtol=1e-10, atol=1e-12)


def test_kfac_labels_come_from_the_generator():
    """``kind="kfac"``: ``G`` is built from labels drawn with ``generator``; the same seed gives the factors of those
    labels (passed explicitly), another seed other labels."""
    case = mlp_case(m=9)
    with torch.no_grad():
        logits = case.model(case.inputs)
    loss = ief.losses.get_loss("cross_entropy")
    drawn = loss.sample_targets(logits, case.targets, torch.Generator().manual_seed(11))
    blocks, _, _ = kronecker_factors(case.model, case.inputs, case.targets, "kfac",
                                     generator=torch.Generator().manual_seed(11))
    expected, _, _ = kronecker_factors(case.model, case.inputs, case.targets, "kfac", sampled_targets=drawn)
    for b, e in zip(blocks, expected):
        torch.testing.assert_close(b.G, e.G, rtol=1e-13, atol=0)
    oracle = _oracle_mlp_factors(case.model, case.inputs, case.targets, "kfac", drawn)
    for b, (G, A, _, _) in zip(blocks, oracle):
        torch.testing.assert_close(b.G, G, rtol=1e-10, atol=1e-13)


def test_direction_beyond_float32_raises_naming_the_kind():
    """Never silently wrong: a float32 model whose exact direction (``~1e39``) exceeds float32's range raises
    ``FloatingPointError`` naming the kind and the dtype. One sample, ``Linear(1, 1)`` without bias, MSE:
    ``x = 1e-33``, residual ``e = 1e-6``: ``G = e^2``, ``A = x^2``, ``grad = e x``, so ``d = 1 / (e x) = 1e39``."""
    model = torch.nn.Linear(1, 1, bias=False).float()
    with torch.no_grad():
        model.weight.fill_(0.5)
    x = torch.tensor([[1e-33]], dtype=torch.float32)
    y = model(x).detach() - 1e-6
    d64 = ief.kfac_direction(model.double(), x.double(), y.double(), "ekfac", 0.0, loss="mse")
    assert 1e38 < float(d64) < 1e40  # the exact direction, representable in float64 only
    with pytest.raises(FloatingPointError, match=r"the ekfac direction is not representable in torch\.float32"):
        ief.kfac_direction(model.float(), x, y, "ekfac", 0.0, loss="mse")


# ------------------------------------------------------------------------------------------ error messages
def test_unknown_kind_and_approx_list_the_accepted_ones():
    case = mlp_case()
    with pytest.raises(ValueError, match=r"unknown kind 'KFAC'; accepted: 'kfac', 'ekfac', 'iekfac'$"):
        ief.kfac_direction(case.model, case.inputs, case.targets, "KFAC", 1e-3)
    with pytest.raises(ValueError, match=r"unknown approx 'sum'; accepted: 'expand', 'reduce'$"):
        ief.kfac_direction(case.model, case.inputs, case.targets, "ekfac", 1e-3, approx="sum")


def _norms_then_linear(norms: int) -> torch.nn.Module:
    return torch.nn.Sequential(*[torch.nn.LayerNorm(3) for _ in range(norms)], torch.nn.Linear(3, 2))


@pytest.mark.parametrize("norms, listed", [
    (1, "['0.weight', '0.bias']"),
    (3, "['0.weight', '0.bias', '1.weight', '1.bias', '2.weight'] ..."),
])
def test_check_linear_only_names_the_other_parameters(norms, listed):
    """:func:`ief.kfac.check_linear_only` raises up front what :func:`kfac_direction` would, naming at most five
    parameters (then `` ...``) and the kind(s); it passes for linear-only parameters."""
    from ief.kfac import check_linear_only, kfac_directions

    model = _norms_then_linear(norms)
    message = (f"K-FAC (kfac) is defined for nn.Linear weights and biases only; trainable parameters outside any "
               f"nn.Linear: {listed}. Pass params= with the linear layers' parameters only (and the same params= to "
               "ief.gamma)")
    with pytest.raises(ValueError) as info:
        check_linear_only(model)
    assert str(info.value) == message
    with pytest.raises(ValueError) as info:
        check_linear_only(model, kind="iekfac")
    assert str(info.value) == message.replace("(kfac)", "(iekfac)")
    x, y = torch.randn(4, 3), torch.randint(0, 2, (4,))
    with pytest.raises(ValueError) as info:
        kfac_directions(model, x, y, {"ekfac": 1e-3, "iekfac": 1e-3})
    assert str(info.value) == message.replace("(kfac)", "(ekfac/iekfac)")
    assert check_linear_only(model, params=list(model[-1].parameters())) is None
    assert check_linear_only(_norms_then_linear(0)) is None
    # five parameters exactly: all listed, no ellipsis
    five = torch.nn.Sequential(torch.nn.LayerNorm(3), torch.nn.LayerNorm(3), torch.nn.LayerNorm(3, bias=False),
                               torch.nn.Linear(3, 2))
    with pytest.raises(ValueError, match=r"'2\.weight'\]\. Pass"):
        check_linear_only(five)


class FlattenedPositions(torch.nn.Module):
    """A Linear fed ``[M * T, d]`` (positions folded into the batch): its rows are not per sample."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(3, 2)

    def forward(self, x):
        m, t, d = x.shape
        return self.proj(x.reshape(m * t, d)).reshape(m, t, 2).mean(1)


def test_linear_whose_rows_are_not_samples_raises():
    model = FlattenedPositions()
    x, y = torch.randn(4, 5, 3), torch.randint(0, 2, (4,))
    with pytest.raises(ValueError, match=r"^linear layer 'proj' was called with input shapes \[\(20, 3\)\], whose "
                                         r"first dimension is not the 4 samples: its K-FAC factors cannot be formed "
                                         r"per sample$"):
        ief.kfac_direction(model, x, y, "ekfac", 1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; this machine has none")
def test_cuda_direction_equals_the_cpu_one():
    """On CUDA every buffer (the bias column of ``A``, a zero ``G``, the direction) is made on the layer's device: a
    float64 CUDA model (shared, idle and spare layers) gives the CPU direction to float64 rounding."""
    torch.manual_seed(5)
    model = SharedTwice(discard_first=True)
    x, y = torch.randn(6, 3), torch.randint(0, 4, (6,))
    expected = ief.kfac_direction(model, x, y, "ekfac", 1e-3)
    d = ief.kfac_direction(model.cuda(), x.cuda(), y.cuda(), "ekfac", 1e-3)
    assert d.device.type == "cuda"
    torch.testing.assert_close(d.cpu(), expected, rtol=1e-9, atol=1e-12)


# ------------------------------------------------------------------------ peft DoRA: calls that reach no loss
def _dora_bert(m: int, width: int = 16):
    """A tiny BERT classifier with peft DoRA (r 4) on query/value, its batch (``m`` samples, 5 tokens)."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    base = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=30, hidden_size=width, num_hidden_layers=1, num_attention_heads=2, intermediate_size=2 * width,
        max_position_embeddings=16, num_labels=3, attn_implementation="eager", hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))
    model = peft.get_peft_model(base, peft.LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8,
                                                      target_modules=["query", "value"], use_dora=True)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 30, (m, 5), generator=g)
    return model, {"input_ids": ids}, torch.randint(0, 3, (m,), generator=g)


def _oracle_lora_factors(model, inputs, targets, layers):
    """eKFAC factors of the ``layers`` (name -> nn.Linear, no bias) by explicit per-sample passes: every call of a
    layer on sample ``n`` alone whose output reaches ``l_n`` adds ``a^T a / (T M)`` to ``A`` and ``g^T g`` to ``G``
    (``g = dl_n / d(call output)``); a call whose output reaches no loss adds to neither."""
    m = targets.shape[0]
    factors = {name: [0.0, 0.0] for name in layers}
    for n in range(m):
        calls = []
        hooks = [mod.register_forward_hook(lambda mod_, args, out, name=name: calls.append((name, args[0], out)))
                 for name, mod in layers.items()]
        try:
            z = model(**{k: v[n : n + 1] for k, v in inputs.items()}).logits
        finally:
            for h in hooks:
                h.remove()
        l_n = torch.nn.functional.cross_entropy(z, targets[n : n + 1], reduction="sum")
        grads = torch.autograd.grad(l_n, [out for _, _, out in calls], allow_unused=True)
        for (name, x, _), g in zip(calls, grads):
            if g is None:
                continue
            a, g = x.detach().reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
            factors[name][0] = factors[name][0] + a.T @ a / (a.shape[0] * m)
            factors[name][1] = factors[name][1] + g.T @ g
    return factors


@pytest.mark.parametrize("m", [16, 5], ids=["M=width", "M!=width"])
def test_dora_identity_calls_enter_no_factor(m):
    """peft DoRA calls ``lora_A`` / ``lora_B`` on an ``[in, in]`` identity for its weight norm and uses the result
    detached: those calls reach no loss, so they are in neither factor, also when ``M`` equals the layer's width
    (where their input looks like a batch); with another ``M`` they are no reason to refuse the layer. Factors
    against :func:`_oracle_lora_factors`."""
    model, inputs, targets = _dora_bert(m)
    layers = {name: mod for name, mod in model.named_modules()
              if type(mod) is torch.nn.Linear and (".lora_A." in name or ".lora_B." in name)}
    params = [mod.weight for mod in layers.values()]
    expected = _oracle_lora_factors(model, inputs, targets, layers)
    blocks, _, _ = kronecker_factors(model, inputs, targets, "ekfac", params)
    assert [b.name for b in blocks] == list(layers)
    for block in blocks:
        a_expected, g_expected = expected[block.name]
        torch.testing.assert_close(block.A, a_expected, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(block.G, g_expected, rtol=1e-10, atol=1e-12)
