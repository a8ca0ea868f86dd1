"""peft DoRA (``LoraConfig(use_dora=True)``): per-sample gradients without the loop, exact against the float64 oracle.

DoRA's magnitude vectors are hooked by their rule (:mod:`ief.jacobian.rules.peft_dora`); its weight-norm calls of
``lora_A`` / ``lora_B`` on an identity matrix reach no loss, which the capture proves from the graph, so they neither
demote those layers nor enter K-FAC's factors (tests/ief/test_kfac.py). Models are built from small configs with
random weights; LoRA's ``B`` and the magnitudes are moved off their initial values so that the rows are generic.
"""
from __future__ import annotations

import copy
import types
import warnings

import pytest
import torch

import ief
import oracle
import route_models as rm
from ief.jacobian.capture import UNREACHED, PerSampleCapture
from ief.jacobian.errors import PerSampleGradientMismatch
from ief.jacobian.rules import peft_dora, rule_for
from ief.jacobian.rules.registry import _BY_NAME
from ief.model_call import forward_signature

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

DTYPES = {"float32": torch.float32, "float64": torch.float64}
RTOL = {torch.float32: 1e-5, torch.float64: 1e-12}  # relative to the oracle's largest entry


class FixedMask(torch.nn.Module):
    """A dropout whose mask is drawn once (``mask [T, in]``, kept entries scaled by ``1/(1-p)``) and applied to every
    sample: training-mode DoRA (peft recomputes the base result from the dropped input) as a fixed function of each
    sample, which the per-sample oracle replays. (Real ``nn.Dropout``, a mask per sample: compared with the loop.)"""

    def __init__(self, mask: torch.Tensor):
        super().__init__()
        self.mask = mask

    def forward(self, x):
        return x * self.mask.to(x)


def _generic(model: torch.nn.Module) -> None:
    """LoRA's ``B`` (zero at initialisation), DoRA's magnitudes (the weight norms) and the frozen base layers' biases
    (zero at initialisation: DoRA subtracts them from the base result) moved off their start."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif "lora_magnitude_vector" in name:
                p.mul_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif "base_layer.bias" in name:
                p.add_(0.5 * torch.randn(p.shape, generator=g))


def _bert_dora(m: int = 5, t: int = 6, dropout: float = 0.0, width: int = 16):
    """A tiny ``BertForSequenceClassification`` (no dropout of its own) with DoRA (r 4) on query/value, float32;
    its batch."""
    torch.manual_seed(0)
    base = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=40, hidden_size=width, num_hidden_layers=1, num_attention_heads=2, intermediate_size=2 * width,
        max_position_embeddings=32, num_labels=3, attn_implementation="eager", hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))
    model = peft.get_peft_model(base, peft.LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, lora_dropout=dropout,
                                                      target_modules=["query", "value"], use_dora=True))
    _generic(model)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 40, (m, t), generator=g)
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    return model, {"input_ids": ids, "attention_mask": mask}, torch.randint(0, 3, (m,), generator=g)


def _fixed_masks(model: torch.nn.Module, t: int, p: float = 0.3) -> list[FixedMask]:
    """Every DoRA layer's dropout replaced by a :class:`FixedMask` (seeded)."""
    g = torch.Generator().manual_seed(3)
    masks = []
    for module in model.modules():
        if hasattr(module, "lora_dropout") and "default" in module.lora_dropout:
            width = module.in_features
            drawn = (torch.rand(t, width, generator=g) > p).to(torch.float64) / (1 - p)
            module.lora_dropout["default"] = FixedMask(drawn)
            masks.append(module.lora_dropout["default"])
    return masks


def _oracle(model, inputs, targets) -> torch.Tensor:
    """The float64 per-sample loop (:mod:`oracle`) of a copy of ``model``."""
    return oracle.per_sample(copy.deepcopy(model).double(), inputs, targets)[1].detach().to(torch.float64)


def _per_sample(model, inputs, targets, **kwargs):
    """``ief.per_sample`` and the SlowPathWarnings it issued."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always", ief.SlowPathWarning)
        out = ief.per_sample(model, inputs, targets, **kwargs)
    return out, [str(w.message) for w in record if issubclass(w.category, ief.SlowPathWarning)]


def _dense(jac) -> torch.Tensor:
    return (jac.materialize() if hasattr(jac, "materialize") else jac).to(torch.float64)


def _rel(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).abs().max() / expected.abs().max())


@pytest.mark.parametrize("form", ["dense", "auto"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train-masked"])
def test_dora_is_exact_without_the_loop(train, dtype, form):
    """Eval mode (peft passes the base result) and training mode with a dropout (peft recomputes the base result
    from the dropped input): every row equals the float64 per-sample loop; no parameter takes the loop."""
    model, inputs, targets = _bert_dora()
    if train:
        _fixed_masks(model, 6)
    model.train(train)
    expected = _oracle(model, inputs, targets)
    model = model.to(DTYPES[dtype])
    out, slow = _per_sample(model, inputs, targets, form=form)
    assert not slow, slow
    assert _rel(_dense(out.jacobian), expected) < RTOL[DTYPES[dtype]]
    names = rm.trainable_names(rm.Case("dora", model, inputs, targets))
    assert sum("lora_magnitude_vector" in n for n in names) == 2  # the magnitudes are among the rows checked


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_train_mode_with_dropout_equals_the_loop_and_passes_the_exact_check(dtype):
    """Real ``nn.Dropout`` on the adapters in training mode: the hooked rows equal the per-sample loop's over the
    same (replayed) masks, and the exact check (per-sample directional derivatives) passes."""
    model, inputs, targets = _bert_dora(dropout=0.3)
    model = model.to(DTYPES[dtype]).train()
    torch.manual_seed(11)
    hooked, slow = _per_sample(model, inputs, targets, check="exact")
    assert not slow, slow
    rule = _BY_NAME.pop(peft_dora.DORA_LINEAR)
    try:
        torch.manual_seed(11)
        looped, slow = _per_sample(model, inputs, targets)
    finally:
        _BY_NAME[peft_dora.DORA_LINEAR] = rule
    assert slow and "lora_magnitude_vector" in slow[0]
    assert _rel(hooked.jacobian.double(), looped.jacobian.double()) < 10 * RTOL[DTYPES[dtype]]
    assert not torch.equal(hooked.jacobian, torch.zeros_like(hooked.jacobian))


def test_gpt2_fan_in_fan_out_is_exact():
    """GPT-2's ``Conv1D`` (peft's ``fan_in_fan_out``: the base weight ``[in, out]``), DoRA on ``c_attn``, eval and
    training mode with a fixed mask, float64."""
    torch.manual_seed(0)
    base = transformers.GPT2ForSequenceClassification(transformers.GPT2Config(
        vocab_size=30, n_embd=8, n_layer=1, n_head=2, n_positions=16, num_labels=3, pad_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft: fan_in_fan_out set to True for Conv1D
        model = peft.get_peft_model(base, peft.LoraConfig(task_type="SEQ_CLS", r=2, lora_alpha=4, use_dora=True,
                                                          target_modules=["c_attn"], fan_in_fan_out=True))
    _generic(model)
    model = model.double()
    ids = torch.randint(1, 30, (4, 5), generator=torch.Generator().manual_seed(2))
    inputs, targets = {"input_ids": ids}, torch.tensor([0, 2, 1, 1])
    dora = [mod for mod in model.modules() if type(mod).__name__ == "DoraLinearLayer"]
    assert dora and all(mod.fan_in_fan_out for mod in dora)
    for train in (False, True):
        if train:
            _fixed_masks(model, 5)
        model.train(train)
        out, slow = _per_sample(model, inputs, targets)
        assert not slow, slow
        assert _rel(out.jacobian, _oracle(model, inputs, targets)) < RTOL[torch.float64]


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_the_route_matrix_llama_dora_takes_no_loop(dtype):
    """The route matrix's DoRA Llama (``route_models.llama_dora``): no SlowPathWarning, rows equal the oracle's."""
    c = rm.case("llama-dora", DTYPES[dtype])
    out, slow = _per_sample(copy.deepcopy(c.model), c.inputs, c.targets)
    assert not slow, slow
    assert _rel(out.jacobian.double(), rm.dense_oracle("llama-dora").jacobian) < 10 * RTOL[DTYPES[dtype]]


def test_what_cannot_be_verified_stays_on_the_loop():
    """A forward replaced on the instance, a subclass, a class of the same name elsewhere, or a forward whose source
    is not the verified one: no rule (the magnitude takes the exact loop, still exact)."""
    model, inputs, targets = _bert_dora()
    dora = next(mod for mod in model.modules() if type(mod).__name__ == "DoraLinearLayer")
    assert isinstance(rule_for(dora), peft_dora.DoraMagnitudeRule)
    cls = type(dora)
    assert rule_for(type("DoraLinearLayer", (cls,), {})(False)) is None  # a subclass
    assert rule_for(type("DoraLinearLayer", (torch.nn.Module,), {"forward": cls.forward})()) is None  # elsewhere
    other = type("DoraLinearLayer", (cls,), {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                             "forward": lambda self, x, **kw: x})(False)
    other.weight = torch.nn.Parameter(torch.ones(3))
    assert rule_for(other) is None  # the listed name, another forward
    patched = copy.deepcopy(dora)
    patched.forward = types.MethodType(cls.forward, patched)
    assert rule_for(patched) is None
    # on a model: a patched forward sends that magnitude to the loop, the rows stay exact
    model = model.double()
    target = next(mod for mod in model.modules() if type(mod).__name__ == "DoraLinearLayer")
    target.forward = types.MethodType(cls.forward, target)
    out, slow = _per_sample(model, inputs, targets)
    assert len(slow) == 1 and "lora_magnitude_vector" in slow[0]
    assert _rel(out.jacobian, _oracle(model, inputs, targets)) < RTOL[torch.float64]


class SideCall(torch.nn.Module):
    """A hooked ``Linear`` also called on a ``[width, width]`` identity whose result is used detached (a norm, as
    DoRA's), so that with ``M = width`` the side call's input has a dimension of size ``M``."""

    def __init__(self, width: int = 4):
        super().__init__()
        self.lin = torch.nn.Linear(width, width)
        self.head = torch.nn.Linear(width, 3)

    def forward(self, x):
        side = self.lin(torch.eye(self.lin.in_features, dtype=x.dtype))
        scale = side.detach().norm(dim=0)
        return self.head(torch.tanh(self.lin(x)) / scale)


def test_a_call_that_reaches_no_loss_needs_no_sample_axis():
    """The side call is proven unreached from the graph: no loop, rows exact, whatever its shape (M = width)."""
    torch.manual_seed(0)
    model = SideCall().double()
    x, y = torch.randn(4, 4, dtype=torch.float64), torch.tensor([0, 1, 2, 1])
    out, slow = _per_sample(model, x, y)
    assert not slow, slow
    _, expected, _ = oracle.per_sample(model, x, y)
    assert _rel(out.jacobian, expected) < RTOL[torch.float64]


def test_a_gradient_into_a_call_found_unreached_is_refused():
    """Were a call proven unreached (here: against a root that does not reach it) to receive a gradient, its rows are
    refused, never left out."""
    torch.manual_seed(0)
    model = SideCall().double()
    x = torch.randn(4, 4, dtype=torch.float64)
    params = list(model.parameters())
    capture = PerSampleCapture(model, params, stand_ins=True)
    capture.batch_size = 4
    with capture, torch.enable_grad():
        side = model.lin(torch.eye(4, dtype=torch.float64))  # reaches the loss below, not the logits
        logits = model(x)
    assert capture.unreached_calls(root=logits) == {(0, 0), (0, 1)}  # both side calls; the batch call reaches
    capture.establish_axes(4, model, forward_signature(model, x), lambda: capture.probe_shapes(
        lambda: (model.lin(torch.eye(4, dtype=torch.float64)), model(x[:1]))))
    assert [rec[2] for rec in capture.records[0]] == [UNREACHED, UNREACHED, 0]
    loss = logits.sum() + side.sum()
    torch.autograd.grad(loss, params + capture.output_edges(), allow_unused=True)
    with pytest.raises(PerSampleGradientMismatch, match="not to reach the loss"):
        list(capture.calls(0))


class SmallConvNet(torch.nn.Module):
    """Conv2d (zero padding) -> tanh -> flatten -> Linear head."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 3, 3, padding=1)
        self.head = torch.nn.Linear(3 * 4 * 4, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.conv(x)).flatten(1))


def test_embedding_and_conv_dora_magnitudes_take_the_exact_loop():
    """DoRA's embedding and convolution variants (other classes, other forms) have no rule: their magnitudes take
    the exact per-sample loop, named in the warning, while a linear DoRA layer of the same model stays hooked."""
    c = rm._causal_lm("llama-dora-embedding", rm._tiny_decoder_config("LlamaConfig", tie_word_embeddings=False))
    model = peft.get_peft_model(c.model, peft.LoraConfig(r=2, lora_alpha=4, use_dora=True,
                                                         target_modules=["embed_tokens", "q_proj"]))
    _generic(model)
    model = model.double().eval()
    out, slow = _per_sample(model, c.inputs, c.targets)
    assert len(slow) == 1 and "embed_tokens.lora_magnitude_vector" in slow[0]
    assert "q_proj.lora_magnitude_vector" not in slow[0]
    assert _rel(out.jacobian, _oracle(model, c.inputs, c.targets)) < RTOL[torch.float64]

    torch.manual_seed(0)
    conv = peft.get_peft_model(SmallConvNet(), peft.LoraConfig(r=2, lora_alpha=4, use_dora=True,
                                                               target_modules=["conv"]))
    _generic(conv)
    conv = conv.double().eval()
    x, y = torch.randn(4, 2, 4, 4, dtype=torch.float64), torch.tensor([0, 2, 1, 1])
    out, slow = _per_sample(conv, x, y)
    assert len(slow) == 1 and "conv.lora_magnitude_vector" in slow[0]
    assert _rel(out.jacobian, _oracle(conv, x, y)) < RTOL[torch.float64]


class GatheredSide(torch.nn.Module):
    """A hooked ``Linear`` also called on rows gathered over the flattened batch (the first ``M`` of ``M T``: a
    candidate sample axis that the reversed-batch proof refutes) whose result is not used."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 3)

    def forward(self, x):  # [M, T, 4]
        self.lin(x.reshape(-1, 4)[: x.shape[0]])
        return self.head(torch.tanh(self.lin(x))).sum(dim=1)


def test_an_unreached_call_that_fails_the_proof_is_no_evidence_of_a_gather():
    """The gathered side call fails the sample-axis proof but reaches no loss: it does not mark its module as one
    that gathers rows, so the module stays hooked on later batches too (no loop), rows exact each time."""
    torch.manual_seed(0)
    model = GatheredSide().double()
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        x, y = torch.randn(4, 3, 4, dtype=torch.float64, generator=g), torch.randint(0, 3, (4,), generator=g)
        out, slow = _per_sample(model, x, y)
        assert not slow, slow
        assert _rel(out.jacobian, _oracle(model, x, y)) < RTOL[torch.float64]
