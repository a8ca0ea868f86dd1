"""Per-sample hooks of the layers in :mod:`ief.jacobian.rules` against the dense float64 per-sample loop
(``tests/oracle.py``: one forward per sample), in the three forms of ``J`` (dense, ghost, rows), float32, masks with
an all-ignored sample, and ``torch.func`` vmap where it runs (``sec:app-iEF-impl``).

Tolerances as in ``tests/ief/test_jacobian.py``: float64 ``1e-10`` relative (batched vs one-sample forwards agree to
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
    return jac.materialize() if isinstance(jac, ief.rows.FactoredJacobian) else jac


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


# ------------------------------------------------------------------------- tensors broadcast over the batch
def _bert(dtype=torch.float64, m=4, t=6):
    from transformers import BertConfig, BertForTokenClassification

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                     max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                     num_labels=3)
    model = BertForTokenClassification(cfg).to(dtype).eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 50, (m, t), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    y = torch.randint(0, 3, (m, t), generator=gen)
    y[mask == 0] = IGNORE
    y[2] = IGNORE  # a sample whose every position is ignored
    return model, {"input_ids": ids, "attention_mask": mask}, y


def _gpt2(dtype=torch.float64, m=4, t=6):
    from transformers import GPT2Config, GPT2ForTokenClassification

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0, num_labels=3, pad_token_id=0, bos_token_id=1, eos_token_id=1)
    model = GPT2ForTokenClassification(cfg).to(dtype).eval()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 50, (m, t), generator=gen)
    y = torch.randint(0, 3, (m, t), generator=gen)
    y[0] = IGNORE
    y[3, :2] = IGNORE
    return model, {"input_ids": ids}, y


def _vit(dtype=torch.float64, m=4):
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    cfg = ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=1,
                    num_attention_heads=2, intermediate_size=32, num_labels=3, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0)
    model = ViTForImageClassification(cfg).to(dtype).eval()
    gen = torch.Generator().manual_seed(2)
    pixels = torch.randn(m, 3, 8, 8, generator=gen, dtype=torch.float64).to(dtype)  # the same pixels in every dtype
    return model, {"pixel_values": pixels}, torch.randint(0, 3, (m,), generator=gen)


HF = {"bert": _bert, "gpt2": _gpt2, "vit": _vit}
BROADCAST = {"bert": ["bert.embeddings.position_embeddings.weight"], "gpt2": ["transformer.wpe.weight"],
             "vit": ["vit.embeddings.cls_token", "vit.embeddings.position_embeddings"]}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", sorted(HF))
def test_full_parameter_hf_models_take_no_loop_and_are_exact(name, form):
    """BERT (position embeddings fed [1, T] ids), GPT-2 (HF Conv1D, wpe) and ViT (cls_token, position_embeddings
    added to every sample), every parameter trainable: hooked, no SlowPathWarning, the float64 loop's rows."""
    model, x, y = HF[name]()
    got = _no_loop(model, x, y, form=form)
    losses, expected, _ = oracle.per_sample(model, x, y)
    jac = _dense(got.jacobian)
    assert _rel(jac, expected) < F64_RTOL
    assert _rel(got.gradient, expected.sum(0)) < F64_RTOL
    assert _rel(got.losses, losses) < F64_RTOL
    names = [n for n, _ in model.named_parameters()]
    offsets = [0, *torch.tensor([p.numel() for p in model.parameters()]).cumsum(0).tolist()]
    for b in BROADCAST[name]:  # the broadcast tensors' own blocks, not only the whole
        i = names.index(b)
        assert _rel(jac[:, offsets[i] : offsets[i + 1]], expected[:, offsets[i] : offsets[i + 1]]) < F64_RTOL
    for n in range(y.shape[0]):  # an all-ignored sample: an exact zero row
        if bool((y[n] == IGNORE).all()):
            assert float(jac[n].abs().max()) == 0.0


@pytest.mark.parametrize("name", sorted(HF))
def test_full_parameter_hf_models_pass_the_exact_check_in_float32(name):
    model, x, y = HF[name](torch.float32)
    got = _dense(_no_loop(model, x, y, form="auto", check="exact").jacobian)
    model64, x64, _ = HF[name]()
    _, expected, _ = oracle.per_sample(model64, x64, y)
    assert got.dtype == torch.float32
    assert _rel(got, expected) < F32_RTOL


def test_vit_rows_equal_torch_func_vmap():
    model, x, y = _vit()
    params = list(model.parameters())
    got = _no_loop(model, x, y).jacobian
    assert _rel(got, _vmap_rows(model, x["pixel_values"], y, params)) < F64_RTOL


class _Prompted(torch.nn.Module):
    """A bare ``[1, 1, D]`` prompt expanded to every sample and a ``[T, D]`` position table added to every sample,
    sequence-first or batch-first, with ``T`` possibly equal to ``M``."""

    def __init__(self, t: int, batch_first: bool):
        super().__init__()
        self.batch_first = batch_first
        self.prompt = torch.nn.Parameter(torch.randn(1, 1, 4))
        self.pos = torch.nn.Parameter(torch.randn(t, 4))
        self.head = torch.nn.Linear(4, 3)

    def forward(self, x):  # x [M, T, 4]
        h = torch.cat([self.prompt.expand(x.shape[0], -1, -1), x], dim=1)[:, 1:]
        if self.batch_first:
            h = h + self.pos
        else:  # [T, M, 4] + [T, 1, 4]: the sample axis is 1
            h = h.transpose(0, 1).add(self.pos.unsqueeze(1)).transpose(0, 1)
        return self.head(torch.tanh(h))


@pytest.mark.parametrize("t", [3, 4], ids=["T!=M", "T==M"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch-first", "sequence-first"])
def test_bare_parameters_broadcast_over_the_batch(t, batch_first):
    """The sample axis of each use is established by the probe, never guessed from a size (T == M included); a
    parameter viewed before its broadcast (``pos.unsqueeze(1)``: a link) has its rows pulled back through the view."""
    torch.manual_seed(0)
    model = _Prompted(t, batch_first).double()
    x, y = torch.randn(4, t, 4, dtype=torch.float64), torch.randint(0, 3, (4, t))
    y[1] = IGNORE
    _, expected, _ = oracle.per_sample(model, x, y)
    got = _no_loop(model, x, y).jacobian
    assert _rel(got, expected) < F64_RTOL


class _Scaled(torch.nn.Module):
    """Position embeddings fed [1, T] ids, used broadcast but also multiplied, or modified in place: not only
    added / expanded, so the embedding keeps the exact loop."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.tok, self.pos = torch.nn.Embedding(9, 4), torch.nn.Embedding(5, 4)
        self.head = torch.nn.Linear(4, 3)

    def forward(self, ids):
        p = self.pos(torch.arange(ids.shape[1])[None])
        if self.how == "multiplied":
            h = self.tok(ids) * p
        elif self.how == "in-place":
            p.mul_(2.0)
            h = self.tok(ids) + p
        else:  # added twice, once through a view
            h = self.tok(ids) + p + p[0]
        return self.head(torch.tanh(h))


@pytest.mark.parametrize("how", ["multiplied", "in-place", "viewed"])
def test_a_broadcast_embedding_with_another_use_keeps_the_loop(how):
    torch.manual_seed(0)
    model = _Scaled(how).double()
    ids, y = torch.randint(0, 9, (4, 5)), torch.randint(0, 3, (4, 5))
    _, expected, _ = oracle.per_sample(model, ids, y)
    with pytest.warns(ief.SlowPathWarning, match=r"pos\.weight \(Embedding input shapes \(1, 5\)"):
        got = ief.per_sample(model, ids, y).jacobian
    assert _rel(got, expected) < F64_RTOL


class _Hidden(torch.autograd.Function):
    """``x + p`` inside an autograd.Function: a use of ``p`` that no torch function call shows."""

    @staticmethod
    def forward(ctx, x, p):
        return x + p

    @staticmethod
    def backward(ctx, g):
        return g, g.sum(0)


class _HiddenUse(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.p = torch.nn.Parameter(torch.randn(4))
        self.head = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.tanh(_Hidden.apply(x, self.p) + self.p))


def test_a_use_the_tracker_cannot_see_raises_rather_than_being_missed():
    torch.manual_seed(0)
    model = _HiddenUse().double()
    x, y = torch.randn(4, 4, dtype=torch.float64), torch.randint(0, 3, (4,))
    with pytest.raises(ief.PerSampleGradientMismatch, match=r"\bp \(used broadcast"):
        ief.per_sample(model, x, y)


def test_broadcast_rows_keep_nothing_of_the_call_alive():
    """As ``test_per_sample_keeps_nothing_of_the_call_alive``: the uses' gradient hooks close no cycle."""
    import gc

    model, x, y = _vit()
    live = []
    for _ in range(4):
        result = _no_loop(model, x, y, form="auto")
        del result
        gc.collect()
        live.append(sum(1 for o in gc.get_objects() if torch.is_tensor(o)))
    # from the second call on, the same count: a leak grows with every call (the first call may build caches,
    # or let go of what earlier tests left in them, so it is the baseline only for "no more than")
    assert live[2:] == live[1:2] * 2 and live[1] <= live[0], f"tensors alive after each call: {live}"


def test_the_one_sample_batch_and_sampled_jacobians_of_a_broadcast_model():
    """M = 1 (no probe: the whole call is the sample's) and gradient_and_sampled_jacobian (two backward passes through
    the same uses: the second's rows are not the sum of both)."""
    model, x, y = _gpt2()
    one = {k: v[:1] for k, v in x.items()}
    _, expected, _ = oracle.per_sample(model, one, y[1:2])
    assert _rel(ief.per_sample(model, one, y[1:2]).jacobian, expected) < F64_RTOL
    gen = torch.Generator().manual_seed(3)
    losses, grad, sampled = ief.jacobian.gradient_and_sampled_jacobian(model, x, y, generator=gen)
    gen = torch.Generator().manual_seed(3)
    again = ief.sampled_jacobian(model, x, y, generator=gen)
    assert _rel(sampled, again) < F64_RTOL
    _, expected, _ = oracle.per_sample(model, x, y)
    assert _rel(grad, expected.sum(0)) < F64_RTOL


# ------------------------------------------------------------------------ Conv1d, GroupNorm, eval BatchNorm1d
class _Conv1dNet(torch.nn.Module):
    """Conv1d (zero padding, stride, dilation, groups) - GroupNorm - Conv1d ("same") - BatchNorm1d (eval) - head."""

    def __init__(self, groups: int, padding):
        super().__init__()
        self.conv1 = torch.nn.Conv1d(4, 6, 3, stride=2, dilation=1, padding=1, groups=groups)
        self.gn = torch.nn.GroupNorm(3, 6)
        self.conv2 = torch.nn.Conv1d(6, 4, 2, dilation=2, padding=padding)
        self.bn = torch.nn.BatchNorm1d(4)
        self.head = torch.nn.Linear(4, 3)
        with torch.no_grad():  # generic affine parameters and running statistics
            for p in (self.gn.weight, self.gn.bias, self.bn.weight, self.bn.bias, self.bn.running_mean):
                p.normal_()
            self.bn.running_var.uniform_(0.5, 2.0)

    def forward(self, x):  # [M, 4, L] -> per-position logits [M, L', 3]
        h = torch.tanh(self.gn(self.conv1(x)))
        h = self.bn(self.conv2(h))
        return self.head(torch.tanh(h).transpose(1, 2))


def _conv1d_net_case(dtype=torch.float64, groups=2, padding="same", m=5):
    torch.manual_seed(0)
    model = _Conv1dNet(groups, padding).to(dtype).eval()
    x = torch.randn(m, 4, 9, dtype=torch.float64).to(dtype)
    length = model(x).shape[1]
    y = torch.randint(0, 3, (m, length))
    y[2] = IGNORE
    y[0, 1] = IGNORE
    return model, x, y


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("groups, padding", [(1, "same"), (2, "same"), (1, 0), (2, 1)])
def test_conv1d_groupnorm_and_eval_batchnorm1d_are_hooked_and_exact(form, groups, padding):
    model, x, y = _conv1d_net_case(groups=groups, padding=padding)
    got = _no_loop(model, x, y, form=form)
    _, expected, _ = oracle.per_sample(model, x, y)
    jac = _dense(got.jacobian)
    assert _rel(jac, expected) < F64_RTOL
    assert float(jac[2].abs().max()) == 0.0
    assert _rel(jac, _vmap_rows(model, x, y, list(model.parameters()))) < F64_RTOL
    if form == "ghost":  # one-group convolution weights as factors
        assert len(got.jacobian.ghosts) == (2 if groups == 1 else 1) + 1


@pytest.mark.parametrize("form", ["dense", "auto"])
def test_conv1d_groupnorm_batchnorm1d_float32_and_the_exact_check(form):
    model, x, y = _conv1d_net_case(torch.float32)
    got = _dense(_no_loop(model, x, y, form=form, check="exact").jacobian)
    model64, x64, _ = _conv1d_net_case()
    _, expected, _ = oracle.per_sample(model64, x64, y)
    assert got.dtype == torch.float32 and _rel(got, expected) < F32_RTOL


def test_batchnorm1d_on_features_and_groupnorm_on_images():
    """``[M, C]`` batch norm and a 2-d group norm, M = 4 and M = 1, against the loop."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3, padding=1), torch.nn.GroupNorm(2, 4), torch.nn.Tanh(),
                                torch.nn.Flatten(), torch.nn.Linear(4 * 5 * 5, 6), torch.nn.BatchNorm1d(6),
                                torch.nn.Tanh(), torch.nn.Linear(6, 3)).double().eval()
    with torch.no_grad():
        model[5].running_mean.normal_()
        model[5].running_var.uniform_(0.5, 2.0)
        model[5].weight.normal_()
    x, y = torch.randn(4, 2, 5, 5, dtype=torch.float64), torch.randint(0, 3, (4,))
    got = _no_loop(model, x, y).jacobian
    _, expected, _ = oracle.per_sample(model, x, y)
    assert _rel(got, expected) < F64_RTOL
    one = _no_loop(model, x[:1], y[:1]).jacobian  # M = 1: the normalisations' batch dimension is the sample
    assert _rel(one, oracle.per_sample(model, x[:1], y[:1])[1]) < F64_RTOL


def test_a_groupnorm_fed_several_instances_per_sample_keeps_the_loop():
    """Samples folded into GroupNorm's batch dimension ([M * 2, C, L]): no dimension is the sample's, the loop."""

    class Folded(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gn = torch.nn.GroupNorm(2, 4)
            self.head = torch.nn.Linear(4 * 2 * 3, 3)

        def forward(self, x):  # [M, 8, 3]
            return self.head(torch.tanh(self.gn(x.reshape(-1, 4, 3))).reshape(x.shape[0], -1))

    torch.manual_seed(0)
    model = Folded().double()
    x, y = torch.randn(4, 8, 3, dtype=torch.float64), torch.randint(0, 3, (4,))
    with pytest.warns(ief.SlowPathWarning, match=r"gn\.weight, gn\.bias \(GroupNorm input shapes \(8, 4, 3\)"):
        got = ief.per_sample(model, x, y).jacobian
    assert _rel(got, oracle.per_sample(model, x, y)[1]) < F64_RTOL
    one = ief.per_sample(model, x[:1], y[:1]).jacobian  # M = 1: two instances of one sample, the loop of one
    assert _rel(one, oracle.per_sample(model, x[:1], y[:1])[1]) < F64_RTOL


@pytest.mark.parametrize("padding", [0, 1, 2])  # BackPACK refuses padding="same" (the loop and vmap cover it)
def test_conv1d_and_eval_batchnorm1d_match_backpack_batchgrad(padding):
    """BackPACK's BatchGrad covers ``Conv1d`` and eval-mode ``BatchNorm1d`` (not ``GroupNorm``): the same rows."""
    from backpack import backpack, extend
    from backpack.extensions import BatchGrad

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv1d(2, 4, 3, padding=padding, dilation=2 if padding == 2 else 1),
                                torch.nn.BatchNorm1d(4), torch.nn.Tanh(), torch.nn.Flatten(), torch.nn.LazyLinear(3))
    x, y = torch.randn(5, 2, 7, dtype=torch.float64), torch.randint(0, 3, (5,))
    model = model.double()
    model(x)  # materialise the lazy head
    model.eval()
    with torch.no_grad():
        model[1].running_mean.normal_()
        model[1].running_var.uniform_(0.5, 2.0)
        model[1].weight.normal_()
    got = _no_loop(model, x, y).jacobian
    extended = extend(model)
    loss = extend(torch.nn.CrossEntropyLoss(reduction="sum"))(extended(x), y)
    with backpack(BatchGrad()):
        loss.backward()
    expected = torch.cat([p.grad_batch.reshape(5, -1) for p in extended.parameters()], dim=1)
    assert _rel(got, expected) < F64_RTOL


# -------------------------------------------------------------------------------------- nn.MultiheadAttention
class _Attention(torch.nn.Module):
    """``nn.MultiheadAttention`` in the ways models call it: self-attention with a key padding mask, batch-first or
    sequence-first; cross-attention with other key / value widths (separate q/k/v projections) and bias_k / bias_v;
    a per-sample 3-d attention mask; attention weights that reach the loss."""

    def __init__(self, how: str, batch_first: bool = True):
        super().__init__()
        self.how, self.batch_first = how, batch_first
        kv = dict(kdim=3, vdim=5, add_bias_kv=True) if how == "cross" else {}
        self.attn = torch.nn.MultiheadAttention(4, 2, batch_first=batch_first, **kv)
        self.memory = torch.nn.Linear(4, 3) if how == "cross" else None
        self.value = torch.nn.Linear(4, 5) if how == "cross" else None
        self.head = torch.nn.Linear(4, 3)

    def forward(self, x):  # [M, T, 4] -> [M, T, 3]
        pad = x[..., 0] > 0.5  # each sample's own padding (from its data: the probe runs one sample alone)
        pad[:, 0] = False
        q = x if self.batch_first else x.transpose(0, 1)
        if self.how == "cross":
            k, v = torch.tanh(self.memory(x)), torch.tanh(self.value(x))
            k, v = (k, v) if self.batch_first else (k.transpose(0, 1), v.transpose(0, 1))
            out, _ = self.attn(q, k, v, key_padding_mask=pad, need_weights=False)
        elif self.how == "mask3d":  # sample n's own [heads, T, T] additive mask
            mask = 0.3 * torch.einsum("mti,msi->mts", x, x).repeat_interleave(2, dim=0)
            out, _ = self.attn(q, q, q, attn_mask=mask, need_weights=False)
        elif self.how == "weights":  # the averaged attention weights reach the loss too
            out, w = self.attn(q, q, q, key_padding_mask=pad)
            out = out + (w.sum(-1, keepdim=True) if self.batch_first else w.sum(-1, keepdim=True).transpose(0, 1))
        else:
            out, _ = self.attn(q, q, q, key_padding_mask=pad, need_weights=False)
        out = out if self.batch_first else out.transpose(0, 1)
        return self.head(torch.tanh(out + x))


def _attention_case(how, batch_first=True, dtype=torch.float64, m=4, t=5):
    torch.manual_seed(0)
    model = _Attention(how, batch_first).to(dtype).eval()
    x = torch.randn(m, t, 4, dtype=torch.float64).to(dtype)
    y = torch.randint(0, 3, (m, t))
    y[2] = IGNORE
    y[1, -2:] = IGNORE
    return model, x, y


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("how", ["self", "cross", "mask3d", "weights"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch-first", "sequence-first"])
def test_multihead_attention_is_hooked_and_exact(how, batch_first, form):
    model, x, y = _attention_case(how, batch_first)
    got = _no_loop(model, x, y, form=form)
    _, expected, _ = oracle.per_sample(model, x, y)
    jac = _dense(got.jacobian)
    assert _rel(jac, expected) < F64_RTOL
    assert float(jac[2].abs().max()) == 0.0
    assert _rel(got.gradient, expected.sum(0)) < F64_RTOL


def test_multihead_attention_matches_vmap_and_passes_the_exact_check_in_float32():
    model, x, y = _attention_case("cross")
    assert _rel(_no_loop(model, x, y).jacobian, _vmap_rows(model, x, y, list(model.parameters()))) < F64_RTOL
    model32, x32, _ = _attention_case("cross", dtype=torch.float32)
    got = _no_loop(model32, x32, y, check="exact", form="auto").jacobian.materialize()
    assert got.dtype == torch.float32 and _rel(got, oracle.per_sample(model, x, y)[1]) < F32_RTOL
    one = _no_loop(model, x[:1], y[:1]).jacobian  # M = 1
    assert _rel(one, oracle.per_sample(model, x[:1], y[:1])[1]) < F64_RTOL


def test_multihead_attention_with_dropout_in_training_keeps_the_loop():
    """A replay would redraw the attention dropout masks: the exact loop instead, with a SlowPathWarning."""
    model, x, y = _attention_case("self")
    model.attn.dropout = 0.3
    model.train()
    with pytest.warns(ief.SlowPathWarning, match=r"attn\.in_proj_weight, attn\.in_proj_bias \(MultiheadAttention"):
        ief.per_sample(model, x, y)


def test_multihead_attention_whose_batch_is_not_the_samples_keeps_the_loop():
    """[M, T, E] into a sequence-first layer: the layer attends across the samples; its rows are not per-call
    products, so the loop (exact whatever the layer does)."""

    class Across(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = torch.nn.MultiheadAttention(4, 2)  # sequence-first: dimension 0 is its sequence
            self.head = torch.nn.Linear(4, 3)

        def forward(self, x):
            return self.head(self.attn(x, x, x, need_weights=False)[0])

    torch.manual_seed(0)
    model = Across().double()
    x, y = torch.randn(4, 5, 4, dtype=torch.float64), torch.randint(0, 3, (4, 5))
    with pytest.warns(ief.SlowPathWarning, match=r"attn\.in_proj_weight"):
        got = ief.per_sample(model, x, y).jacobian
    z = model(x)  # the samples are mixed: the rows are gradients of each l_n through this batch's graph
    params = list(model.parameters())
    expected = torch.stack([oracle.flat_grad(oracle.sample_loss(z[n : n + 1], y[n : n + 1], "cross_entropy"), params)
                            for n in range(4)])
    assert _rel(got, expected) < F64_RTOL
