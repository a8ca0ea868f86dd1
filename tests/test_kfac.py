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
        w = 1.0 / float(e_true @ e_true) if kind == "iekfac" else 1.0
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


@pytest.mark.parametrize("kind", ["ekfac", "iekfac", "kfac"])
@pytest.mark.parametrize("damping", [1e-3, 0.3])
def test_direction_matches_dense_oracle(kind, damping):
    case = mlp_case(m=9)
    gen = torch.Generator().manual_seed(3)
    d = ief.kfac_direction(case.model, case.inputs, case.targets, kind, damping, generator=gen)
    with torch.no_grad():
        logits = case.model(case.inputs)
    sampled = ief.losses.get_loss("cross_entropy").sample_targets(logits, case.targets,
                                                                   torch.Generator().manual_seed(3))
    expected = _oracle_direction(_oracle_mlp_factors(case.model, case.inputs, case.targets, kind, sampled), damping)
    torch.testing.assert_close(d, expected, rtol=1e-9, atol=1e-12)


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
    """ief.kfac.kfac_directions shares the forward and the true-label backward: the same directions (and KFAC's
    labels from the same generator state) as kfac_direction per kind."""
    from ief.kfac import kfac_directions

    case = mlp_case(m=7)
    dampings = {"kfac": 1e-3, "ekfac": 0.0, "iekfac": 1e-6}
    together = kfac_directions(case.model, case.inputs, case.targets, dampings,
                               generator=torch.Generator().manual_seed(4))
    for kind, lam in dampings.items():
        alone = ief.kfac_direction(case.model, case.inputs, case.targets, kind, lam,
                                   generator=torch.Generator().manual_seed(4))
        torch.testing.assert_close(together[kind], alone, rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="unknown kind"):
        kfac_directions(case.model, case.inputs, case.targets, {"kfac": 1e-3, "bogus": 1e-3})
