"""T5's relative attention biases in :func:`ief.per_sample` (:mod:`ief.jacobian.broadcast`): the bias table is an
``nn.Embedding`` fed ``[T, T]`` bucket ids with no sample axis, whose ``[T, T, H]`` output is permuted and unsqueezed
to ``[1, H, T, T]`` (links) and broadcast over the ``[M, H, T, T]`` scores of every layer (uses: an addition in eager
attention; SDPA's mask, through ``torch.where`` with a padding or causal mask). Its rows are pulled back through the
links. Checked against the dense float64 per-sample oracle (``tests/oracle.py``) for T5, T5's encoder alone, MT5 and
UMT5 (a bias table in every layer), eager and SDPA attention, with and without padding, eval and train mode, float32
and float64, with no SlowPathWarning; and on a hand-built model whose links include a shared ``where`` and a cast,
and whose unsupported uses keep the exact loop."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

import ief
import oracle
import route_models as rm
from ief.jacobian import broadcast
from tiny_models import IGNORE, _t5_config

transformers = pytest.importorskip("transformers")

F32_RTOL, F64_RTOL = 1e-5, 1e-12
KINDS = {  # config class, model class
    "t5": ("T5Config", "T5ForConditionalGeneration"),
    "t5-encoder": ("T5Config", "T5EncoderModel"),
    "mt5": ("MT5Config", "MT5ForConditionalGeneration"),
    "umt5": ("UMT5Config", "UMT5ForConditionalGeneration"),
}


class EncoderLogits(torch.nn.Module):
    """``T5EncoderModel``'s last hidden states as per-position logits (``d_model`` classes)."""

    def __init__(self, encoder: torch.nn.Module):
        super().__init__()
        self.encoder = encoder

    def forward(self, **inputs):
        return self.encoder(**inputs).last_hidden_state


def _model(kind: str, attn: str, dtype: torch.dtype, train: bool) -> torch.nn.Module:
    """A tiny model of ``kind`` (two layers each side, so that layer 1 reuses layer 0's bias), layer norms and bias
    tables moved off their initial values, every parameter trainable."""
    config_cls, model_cls = KINDS[kind]
    base = _t5_config(num_layers=2, num_decoder_layers=2, attn_implementation=attn).to_dict()
    config = getattr(transformers, config_cls)(**{k: v for k, v in base.items() if k != "model_type"})
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm" in name or "relative_attention_bias" in name:
                p.add_(0.2 * torch.randn_like(p))
    model = EncoderLogits(model) if kind == "t5-encoder" else model
    return model.to(dtype).train(train)


def _batch(kind: str, m: int, t: int, padded: bool, t_decoder: int = 4):
    """Ids (padding of 0, 1 or 2 positions if ``padded``, with the attention mask), targets with ignored positions and
    a sample whose every target is ignored."""
    g = torch.Generator().manual_seed(1)
    inputs = {"input_ids": torch.randint(2, 32, (m, t), generator=g)}
    if padded:
        mask = torch.ones(m, t, dtype=torch.long)
        for n in range(m):
            if n % 3:
                mask[n, -(n % 3):] = 0
                inputs["input_ids"][n, -(n % 3):] = 0
        inputs["attention_mask"] = mask
    if kind == "t5-encoder":
        targets = torch.randint(0, 8, (m, t), generator=g)
    else:
        targets = torch.randint(2, 32, (m, t_decoder), generator=g)
        inputs["decoder_input_ids"] = torch.cat([torch.zeros(m, 1, dtype=torch.long), targets[:, :-1]], dim=1)
    targets[1, -1] = IGNORE
    targets[2 % m] = IGNORE
    return inputs, targets


def _no_loop(model, inputs, targets, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error", ief.SlowPathWarning)
        return ief.per_sample(model, inputs, targets, **kwargs)


def _dense(result) -> torch.Tensor:
    jac = result.jacobian
    return (jac.materialize() if hasattr(jac, "materialize") else jac).to(torch.float64)


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).norm() / ref.norm())


def _bias_blocks(model: torch.nn.Module) -> list[tuple[str, slice]]:
    """The columns of every relative attention bias table in ``J``."""
    blocks, start = [], 0
    for name, p in model.named_parameters():
        if "relative_attention_bias" in name:
            blocks.append((name, slice(start, start + p.numel())))
        start += p.numel()
    return blocks


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_relative_attention_biases_are_exact_without_the_loop(kind, attn, padded, train, dtype):
    model = _model(kind, attn, dtype, train)
    inputs, targets = _batch(kind, m=4, t=6, padded=padded)
    result = _no_loop(model, inputs, targets, check="exact")
    ref = oracle.per_sample(copy.deepcopy(model).double(), inputs, targets)[1]
    got, tol = _dense(result), F32_RTOL if dtype == torch.float32 else F64_RTOL
    assert _rel(got, ref) < tol
    blocks = _bias_blocks(model)
    assert len(blocks) == {"t5-encoder": 1, "umt5": 4}.get(kind, 2)
    for name, cols in blocks:  # each table's own block, not only the whole
        assert _rel(got[:, cols], ref[:, cols]) < tol, name
    assert float(got[2 % 4].abs().max()) == 0.0  # the sample whose every target is ignored


@pytest.mark.parametrize("m", [3, 4, 6], ids=["M=T_decoder-1", "M=T_decoder", "M=T_encoder"])
@pytest.mark.parametrize("form", ["dense", "ghost", "rows", "auto"])
def test_every_form_and_a_batch_as_large_as_the_sequence(m, form):
    """``M`` equal to a sequence length (the ``[T, T]`` bucket ids then have a dimension of size ``M``, which is still
    not the samples: the probe says so), in every form of the Jacobian."""
    model = _model("t5", "sdpa", torch.float64, train=False)
    inputs, targets = _batch("t5", m=m, t=6, padded=True)
    result = _no_loop(model, inputs, targets, form=form)
    ref = oracle.per_sample(model, inputs, targets)[1]
    assert _rel(_dense(result), ref) < F64_RTOL


def test_the_route_matrix_t5_takes_no_loop():
    """The route matrix's full fine-tuning T5 (``route_models.t5_full``), float32 and float64."""
    for dtype in (torch.float32, torch.float64):
        c = rm.case("t5-full", dtype)
        result = _no_loop(copy.deepcopy(c.model), c.inputs, c.targets, check="exact")
        ref = oracle.per_sample(copy.deepcopy(c.model).double(), c.inputs, c.targets)[1]
        assert _rel(_dense(result), ref) < (F32_RTOL if dtype == torch.float32 else F64_RTOL)


class RelativeBias(torch.nn.Module):
    """A hand-built attention-like model: a bias table fed ``[T, T]`` ids, led to ``[1, H, T, T]`` by the links
    ``how`` names, added to per-sample scores ``[M, H, T, T]``; a head reads the softmax-weighted inputs."""

    def __init__(self, how: str, t: int = 5, heads: int = 2):
        super().__init__()
        self.how, self.t = how, t
        self.bias = torch.nn.Embedding(7, heads)
        self.q = torch.nn.Linear(3, 3 * heads)
        self.head = torch.nn.Linear(3 * heads, 4)
        pos = torch.arange(t)
        self.register_buffer("buckets", (pos[None, :] - pos[:, None]).clamp(-3, 3) + 3)

    def forward(self, x):  # x [M, T, 3]
        m, t, _ = x.shape
        q = self.q(x).view(m, t, -1, 3).transpose(1, 2)  # [M, H, T, 3]
        scores = q @ q.transpose(-1, -2)  # [M, H, T, T]
        b = self.bias(self.buckets)  # [T, T, H]
        if self.how == "links":  # transpose, reshape, contiguous, a cast, a shared where, a shared addition
            b = b.permute(2, 1, 0).transpose(1, 2).reshape(1, -1, t, t).contiguous().to(torch.float64)
            causal = torch.ones(t, t, dtype=torch.bool).tril()[None, None]
            b = torch.where(causal, b, -1e4) + torch.zeros(1, 1, t, t, dtype=torch.float64)
            scores = scores.to(torch.float64) + b
        elif self.how == "multiplied":  # not linear in the table alone: the loop
            scores = scores * b.permute(2, 0, 1).unsqueeze(0)
        elif self.how == "sliced":  # a slice of a linked tensor: the loop
            scores = scores + b.permute(2, 0, 1)[None, :1]
        else:  # added twice in one call: the loop
            p = b.permute(2, 0, 1).unsqueeze(0)
            scores = scores + (p + p)
        weights = torch.softmax(scores, dim=-1).to(x.dtype)
        return self.head((weights @ x[:, None].expand(-1, weights.shape[1], -1, -1)).transpose(1, 2).reshape(m, t, -1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_links_of_every_kind_are_pulled_back(dtype):
    torch.manual_seed(0)
    model = RelativeBias("links").to(dtype)
    x, y = torch.randn(4, 5, 3, dtype=dtype), torch.randint(0, 4, (4, 5))
    y[1, :2] = IGNORE
    result = _no_loop(model, x, y, check="exact")
    ref = oracle.per_sample(copy.deepcopy(model).double(), x.double(), y)[1]
    assert _rel(_dense(result), ref) < (F32_RTOL if dtype == torch.float32 else F64_RTOL)


@pytest.mark.parametrize("how", ["multiplied", "sliced", "added-twice"])
def test_an_unsupported_use_keeps_the_exact_loop(how):
    torch.manual_seed(0)
    model = RelativeBias(how).double()
    x, y = torch.randn(4, 5, 3, dtype=torch.float64), torch.randint(0, 4, (4, 5))
    with pytest.warns(ief.SlowPathWarning, match=r"bias\.weight \(Embedding input shapes \(5, 5\)"):
        result = ief.per_sample(model, x, y)
    assert _rel(_dense(result), oracle.per_sample(model, x, y)[1]) < F64_RTOL


def test_the_probe_follows_the_batch_forwards_plan():
    """A link and a use look alike in a one-sample forward (``[1, H, T, T]`` either way): the probe's tracker takes
    the batch tracker's verdicts, and a use the batch did not see makes the two disagree."""
    scores = torch.randn(3, 2, 4, 4)
    table = torch.randn(4, 4, 2, requires_grad=True)
    batch = broadcast.UseTracker()
    batch.watch(table, "t")
    with batch:
        b = table.permute(2, 0, 1).unsqueeze(0)
        (scores + b).sum().backward()
    batch.release()
    assert [u.link for u in batch.uses["t"]] == [True, True, False]
    probe = broadcast.UseTracker(hooks=False)
    probe.watch(table, "t")
    with probe:
        b = table.permute(2, 0, 1).unsqueeze(0)
        _ = scores[:1] + b  # [1, H, T, T]: as large as b, yet a use, as in the batch
    probe.release()
    assert [u.link for u in probe.uses["t"]] == [True, True, False]
    shared = broadcast.establish(batch.uses, probe.uses, set(), m=3)
    rows = broadcast.per_sample_rows(shared["t"], 3, table.numel(), table.dtype, table.device)
    torch.testing.assert_close(rows, torch.ones(3, 1).expand(3, table.numel()), rtol=0, atol=0)
