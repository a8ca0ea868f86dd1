"""peft adapters beyond LoRA on linear layers (:mod:`ief.jacobian.rules.peft_ia3`, ``peft_adalora``, ``peft_loha``,
``peft_lokr``, ``peft_vera``, ``peft_lora_embedding``): their wrappers' rules give exact per-sample gradients (against
the dense float64 per-sample autograd oracle, dense and factored forms, float32 and float64, eval and train mode,
AdaLoRA's and VeRA's adapter dropout in training against the exact loop on the same masks) without the per-sample
loop; the configurations a rule does not cover (merged or disabled adapters, a trainable base layer, convolutions,
mixed-adapter batches, several active adapters with dropout) keep the exact loop."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

import ief
import oracle
import route_models as rm
from ief.jacobian.rules import registry, rule_for
from tiny_models import Case

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

# the wrapper type each adapter puts on the targeted layers, and whose rule must hook it
WRAPPERS = {
    "ia3": "peft.tuners.ia3.layer.Linear",
    "adalora": "peft.tuners.adalora.layer.SVDLinear",
    "loha": "peft.tuners.loha.layer.Linear",
    "lokr": "peft.tuners.lokr.layer.Linear",
    "vera": "peft.tuners.vera.layer.Linear",
    "lora-embedding": "peft.tuners.lora.layer.Embedding",
}


def adapter_config(kind: str, dropout: float = 0.0):
    """The peft config of ``kind`` on a tiny Llama's attention (and, for IA3, its feedforward ``down_proj``; for
    LoRA, its token embedding and ``q_proj``)."""
    attention = ["q_proj", "v_proj"]
    if kind == "ia3":
        return peft.IA3Config(target_modules=[*attention, "down_proj"], feedforward_modules=["down_proj"])
    if kind == "adalora":
        return peft.AdaLoraConfig(init_r=3, target_r=2, total_step=10, target_modules=attention, lora_alpha=4,
                                  lora_dropout=dropout)
    if kind == "loha":
        return peft.LoHaConfig(r=3, alpha=6, target_modules=attention)
    if kind == "lokr":  # r = 2 < 8 / 2 ... : w1 full, w2 a product (both forms of a factor)
        return peft.LoKrConfig(r=2, alpha=4, target_modules=attention, decompose_both=True)
    if kind == "vera":
        return peft.VeraConfig(r=4, target_modules=attention, vera_dropout=dropout)
    if kind == "lora-embedding":
        return peft.LoraConfig(r=3, lora_alpha=6, target_modules=["embed_tokens", "q_proj"], lora_dropout=dropout)
    raise ValueError(f"unknown adapter kind {kind!r}")


def adapter_model(kind: str, *, hidden: int = 32, layers: int = 2, vocab: int = 40, dropout: float = 0.0,
                  seed: int = 0) -> torch.nn.Module:
    """A tiny ``LlamaForCausalLM`` from a config (random weights, no dropout of its own) wrapped by peft with
    adapter ``kind``; every adapter tensor moved off its initial value (zeros, ones) so its Jacobian is generic."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, attn_implementation="eager", pad_token_id=0,
                                      tie_word_embeddings=False)
    model = peft.get_peft_model(transformers.LlamaForCausalLM(config), adapter_config(kind, dropout))
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.3 * torch.randn_like(p))
    return model


def adapter_case(kind: str, dtype: torch.dtype = torch.float32, train: bool = False, m: int = 4, t: int = 5,
                 dropout: float = 0.0, **sizes) -> Case:
    """``adapter_model(kind)`` in ``dtype`` and train / eval mode on a right-padded causal batch (per-position
    next-token targets, sample 2 every position ignored)."""
    model = adapter_model(kind, dropout=dropout, **sizes).to(dtype)
    model.train(train)
    inputs, targets = rm._causal_batch(m, t, model.config.vocab_size, seed=1)
    return Case(kind, model, inputs, targets)


def _wrappers(model: torch.nn.Module, kind: str) -> list[torch.nn.Module]:
    return [mod for mod in model.modules() if f"{type(mod).__module__}.{type(mod).__qualname__}" == WRAPPERS[kind]]


def _dense(jac) -> torch.Tensor:
    return (jac.materialize() if hasattr(jac, "materialize") else jac).to(torch.float64)


def _per_sample(c: Case, **kwargs):
    """``ief.per_sample`` and the SlowPathWarnings it raised."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always", ief.SlowPathWarning)
        result = ief.per_sample(c.model, c.inputs, c.targets, **kwargs)
    return result, [str(w.message) for w in record if issubclass(w.category, ief.SlowPathWarning)]


def _oracle(c: Case) -> torch.Tensor:
    model64 = copy.deepcopy(c.model).to(torch.float64)
    return oracle.per_sample(model64, c.inputs, c.targets, c.loss)[1].to(torch.float64)


def _blocks(model: torch.nn.Module, jac: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each trainable parameter's column block of ``jac``, by name."""
    blocks, lo = {}, 0
    for name, p in model.named_parameters():
        if p.requires_grad:
            blocks[name], lo = jac[:, lo : lo + p.numel()], lo + p.numel()
    assert lo == jac.shape[1]
    return blocks


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).norm() / ref.norm())


TOL = {torch.float32: 2e-5, torch.float64: 1e-11}


@pytest.mark.parametrize("kind", list(WRAPPERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_adapter_rows_are_exact_without_the_loop(kind, dtype, train):
    c = adapter_case(kind, dtype, train)
    wrappers = _wrappers(c.model, kind)
    assert wrappers and all(rule_for(w) is not None for w in wrappers)
    ref = _oracle(c)
    assert all(bool(block.any()) for block in _blocks(c.model, ref).values())  # generic: no all-zero tensor
    for form in ("dense", "auto"):
        result, slow = _per_sample(c, form=form, check=False)
        assert not slow, slow
        assert _rel(_dense(result.jacobian), ref) < TOL[dtype], form


@pytest.mark.parametrize("kind", list(WRAPPERS))
def test_every_adapter_column_is_exact(kind):
    """Each adapter tensor's own block (not only the whole J) equals the oracle's, float64."""
    c = adapter_case(kind, torch.float64)
    ref = _oracle(c)
    jac = _dense(ief.per_sample(c.model, c.inputs, c.targets, check="exact").jacobian)
    want = _blocks(c.model, ref)
    for name, block in _blocks(c.model, jac).items():
        scale = float(want[name].abs().max())
        assert scale > 0 and (block - want[name]).abs().max() <= 1e-11 * scale, name


# ------------------------------------------------------------------------------------ what keeps the exact loop
def _without_rule(kind: str, run):
    """``run()`` with the wrapper type of ``kind`` unregistered (its parameters take the exact loop)."""
    saved = registry._BY_NAME.pop(WRAPPERS[kind])
    try:
        return run()
    finally:
        registry._BY_NAME[WRAPPERS[kind]] = saved


@pytest.mark.parametrize("kind", ["adalora", "vera"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_adapter_dropout_in_training_is_recorded(kind, dtype):
    """Adapter dropout (p = 0.1) in training: the dropout's output is recorded for the rule, whose rows equal the
    exact loop's on the same masks (the oracle's separate forwards would draw other masks); in eval mode the rule
    against the oracle. Two active AdaLoRA adapters with dropout: the loop."""
    c = adapter_case(kind, dtype, train=True, dropout=0.1)
    assert all(rule_for(w) is not None for w in _wrappers(c.model, kind))

    def run(c=c):
        torch.manual_seed(7)
        return _per_sample(Case(kind, copy.deepcopy(c.model), c.inputs, c.targets), check=False)

    (fast, slow), (loop, slow_loop) = run(), _without_rule(kind, run)
    assert not slow and slow_loop
    assert _rel(_dense(fast.jacobian), _dense(loop.jacobian)) < (1e-6 if dtype == torch.float32 else 1e-13)
    dropped = _dense(fast.jacobian) - _dense(_per_sample(c, check=False)[0].jacobian)  # other masks: other rows
    assert float(dropped.norm()) > 1e-3 * float(_dense(fast.jacobian).norm())
    c.model.eval()
    result, slow = _per_sample(c, check=False)
    assert not slow and _rel(_dense(result.jacobian), _oracle(c)) < TOL[dtype]
    if kind == "adalora":  # AdaLoRA trains one adapter: the other one in inference mode
        c.model.train()
        c.model.add_adapter("other", peft.AdaLoraConfig(init_r=3, target_r=2, total_step=10, lora_dropout=0.1,
                                                        target_modules=["q_proj", "v_proj"], inference_mode=True))
        c.model.base_model.set_adapter(["default", "other"])
        assert all(rule_for(w) is None for w in _wrappers(c.model, kind))


@pytest.mark.parametrize("kind", list(WRAPPERS))
def test_merged_or_disabled_adapters_and_trainable_base_layers_keep_the_loop(kind):
    c = adapter_case(kind, torch.float64)
    wrappers = _wrappers(c.model, kind)
    with c.model.disable_adapter():
        assert all(rule_for(w) is None for w in wrappers)
    merged = copy.deepcopy(c.model)
    merged.merge_adapter()
    assert all(rule_for(w) is None for w in _wrappers(merged, kind))
    base = wrappers[0].get_base_layer()
    base.weight.requires_grad_(True)  # full fine-tuning of that layer too: its wrapper's parameters take the loop
    assert rule_for(wrappers[0]) is None and all(rule_for(w) is not None for w in wrappers[1:])
    result, slow = _per_sample(c, check=False)
    assert slow and _rel(_dense(result.jacobian), _oracle(c)) < TOL[torch.float64]


def _second_adapter(kind: str, model: torch.nn.Module) -> None:
    """Add adapter ``"other"`` of ``kind`` (moved off its initial values)."""
    model.add_adapter("other", adapter_config(kind))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".other" in name:
                p.add_(0.3 * torch.randn_like(p))


@pytest.mark.parametrize("kind", ["ia3", "loha", "lokr", "vera", "lora-embedding"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_several_active_adapters_and_trainable_inactive_ones(kind, dtype):
    """Two active adapters (IA3 multiplies their vectors, the others add their terms), then one active and the other
    inactive but trainable (its rows are zero): exact without the loop."""
    c = adapter_case(kind, dtype)
    _second_adapter(kind, c.model)
    c.model.base_model.set_adapter(["default", "other"])
    for p in c.model.parameters():
        p.requires_grad_(".default" in _name(c.model, p) or ".other" in _name(c.model, p))
    assert all(rule_for(w) is not None for w in _wrappers(c.model, kind))
    result, slow = _per_sample(c, check=False)
    assert not slow, slow
    assert _rel(_dense(result.jacobian), _oracle(c)) < TOL[dtype]
    c.model.base_model.set_adapter("default")
    for p in c.model.parameters():  # set_adapter froze "other": trainable again, unused by the forward
        p.requires_grad_(".default" in _name(c.model, p) or ".other" in _name(c.model, p))
    result, slow = _per_sample(c, check=False)
    ref = _oracle(c)
    assert not slow, slow
    other = [b for n, b in _blocks(c.model, ref).items() if ".other" in n]
    assert other and all(not b.any() for b in other)
    assert _rel(_dense(result.jacobian), ref) < TOL[dtype]


def _name(model: torch.nn.Module, p: torch.Tensor) -> str:
    return next(n for n, q in model.named_parameters() if q is p)


class _MixedBatch(torch.nn.Module):
    """A peft model called with ``adapter_names`` (peft's mixed-adapter batches), every sample on ``"default"``."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        names = ["default"] * input_ids.shape[0]
        return self.model(input_ids=input_ids, attention_mask=attention_mask, adapter_names=names).logits


def test_a_call_with_adapter_names_takes_the_loop():
    """LoRA on the embedding called with ``adapter_names`` (samples may be routed to different adapters): the wrapper's
    call is not trusted, its parameters take the loop (exact: equal to the rule's rows without ``adapter_names``)."""
    c = adapter_case("lora-embedding", torch.float64)
    plain, slow = _per_sample(c, check=False)
    assert not slow
    mixed = Case("mixed", _MixedBatch(c.model), c.inputs, c.targets)
    result, slow = _per_sample(mixed, check=False)
    assert slow and "lora_embedding_A" in slow[0]
    torch.testing.assert_close(result.jacobian, plain.jacobian, rtol=1e-12, atol=1e-14)


# ------------------------------------------------------------------------------ fan_in_fan_out (GPT-2's Conv1D)
@pytest.mark.parametrize("kind", ["ia3", "vera"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_gpt2_conv1d_base_layers(kind, dtype):
    """GPT-2's ``Conv1D`` base layers (``fan_in_fan_out=True``): IA3 recomputes their output / input gradient in their
    ``[in, out]`` layout; VeRA's term does not read the base layer."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=40, n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0)
    if kind == "ia3":
        adapter = peft.IA3Config(target_modules=["c_attn", "mlp.c_proj"], feedforward_modules=["mlp.c_proj"],
                                 fan_in_fan_out=True)
    else:
        adapter = peft.VeraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True)
    model = peft.get_peft_model(transformers.GPT2LMHeadModel(config), adapter)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.3 * torch.randn_like(p))
    model.to(dtype).eval()
    inputs, targets = rm._causal_batch(4, 5, 40, seed=1)
    c = Case(kind, model, inputs, targets)
    assert all(rule_for(w) is not None for w in _wrappers(model, kind))
    result, slow = _per_sample(c, form="auto", check=False)
    assert not slow, slow
    assert _rel(_dense(result.jacobian), _oracle(c)) < TOL[dtype]


@pytest.mark.parametrize("kind", ["adalora", "loha", "lokr"])
def test_a_subset_of_the_adapter_tensors(kind):
    """``params=`` one factor per wrapper (the rule fills only the blocks asked for): the oracle's columns of it."""
    c = adapter_case(kind, torch.float64)
    ref = _blocks(c.model, _oracle(c))
    wanted = {"adalora": "lora_E", "loha": "hada_w2_b", "lokr": "lokr_w2_a"}[kind]
    names = [n for n in ref if f".{wanted}." in n]
    params = [p for n, p in c.model.named_parameters() if n in names]
    assert names and len(params) == len(names)
    jac = _dense(ief.per_sample(c.model, c.inputs, c.targets, params=params, check=False).jacobian)
    assert _rel(jac, torch.cat([ref[n] for n in names], dim=1)) < TOL[torch.float64]


class _SmallCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 3, 3)
        self.head = torch.nn.Linear(12, 3)

    def forward(self, x):
        return self.head(self.conv(x).flatten(1))


@pytest.mark.parametrize("kind", ["ia3", "loha"])
def test_convolution_wrappers_keep_the_loop(kind):
    """Adapters on ``nn.Conv2d`` (``ia3.layer.Conv2d``, ``loha.layer.Conv2d``) have no rule: the loop, exact."""
    torch.manual_seed(0)
    adapter = (peft.IA3Config(target_modules=["conv"], feedforward_modules=[]) if kind == "ia3"
               else peft.LoHaConfig(r=2, alpha=4, target_modules=["conv"]))
    model = peft.get_peft_model(_SmallCNN(), adapter).double()
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.3 * torch.randn_like(p))
    c = Case(kind, model, torch.randn(4, 2, 4, 4, dtype=torch.float64), torch.tensor([0, 1, 2, 1]))
    assert rule_for(model.base_model.model.conv) is None
    result, slow = _per_sample(c, check=False)
    assert slow and ("ia3_l" if kind == "ia3" else "hada_w1_a") in slow[0]
    assert _rel(_dense(result.jacobian), _oracle(c)) < TOL[torch.float64]
