"""The RMS norm rule (:mod:`ief.jacobian.rules.rmsnorm`) and the scaled word embedding rule
(:mod:`ief.jacobian.rules.scaled_embedding`): exact per-sample gradients against the dense float64 per-sample autograd
oracle (and the exact per-sample loop), dense and factored forms, float32 and float64, eval and train mode; no slow
path left for full fine-tuning of Llama / Mistral / Qwen2 / Gemma with untied heads; T5's layer norms and
``nn.RMSNorm`` hooked; modules that cannot be verified stay on the loop."""
from __future__ import annotations

import copy
import types
import warnings

import pytest
import torch

import ief
import oracle
import route_models as rm
from ief.jacobian.rules import rmsnorm, rule_for
from tiny_models import Case

transformers = pytest.importorskip("transformers")

CONFIGS = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "gemma": ("GemmaConfig", {"head_dim": 4}),
}


def _case(kind: str, dtype: torch.dtype, train: bool, tie: bool = False) -> Case:
    cls, extra = CONFIGS[kind]
    config = rm._tiny_decoder_config(cls, tie_word_embeddings=tie, **extra)
    c = rm._causal_lm(kind, config, train=train)
    c.model.to(dtype)
    return c


def _oracle(c: Case) -> torch.Tensor:
    model64 = copy.deepcopy(c.model).to(torch.float64)
    return oracle.per_sample(model64, c.inputs, c.targets, c.loss)[1].to(torch.float64)


def _dense(result) -> torch.Tensor:
    jac = result.jacobian
    return (jac.materialize() if hasattr(jac, "materialize") else jac).to(torch.float64)


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).norm() / ref.norm())


@pytest.mark.parametrize("kind", list(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("form", ["dense", "ghost", "rows", "auto"])
def test_full_fine_tuning_is_exact_without_the_loop(kind, dtype, train, form):
    c = _case(kind, dtype, train)
    norms = [m for m in c.model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert norms and all(rule_for(m) is not None for m in norms)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ief.SlowPathWarning)  # every parameter hooked: the norms by their rule
        result = ief.per_sample(c.model, c.inputs, c.targets, check="exact", form=form)
    ref = _oracle(c)
    # float64 models' norms compute in float32 (their upcast) in the oracle and the rule alike
    assert _rel(_dense(result), ref) < (1e-5 if dtype == torch.float32 else 1e-10)
    names = [n for n, p in c.model.named_parameters() if p.requires_grad]
    sizes = [p.numel() for p in c.model.parameters() if p.requires_grad]
    cols = torch.tensor([0, *sizes]).cumsum(0).tolist()
    got = _dense(result)
    for i, name in enumerate(names):
        if "norm" in name:  # the norms' blocks alone, each against the oracle
            block, want = got[:, cols[i]:cols[i + 1]], ref[:, cols[i]:cols[i + 1]]
            assert _rel(block, want) < (1e-5 if dtype == torch.float32 else 1e-10), name


def test_the_rule_equals_the_per_sample_loop_bit_for_bit_in_float64():
    """The rule against the library's own per-sample loop (the rule unregistered) on the same model."""
    c = _case("llama", torch.float64, train=False)
    fast = ief.per_sample(c.model, c.inputs, c.targets, check=False).jacobian
    saved = dict(ief.jacobian.rules.registry._BY_NAME)
    try:
        for key in [k for k in saved if k.endswith("RMSNorm")]:
            del ief.jacobian.rules.registry._BY_NAME[key]
        with pytest.warns(ief.SlowPathWarning, match="norm"):
            slow = ief.per_sample(copy.deepcopy(c.model), c.inputs, c.targets, check=False).jacobian
    finally:
        ief.jacobian.rules.registry._BY_NAME.clear()
        ief.jacobian.rules.registry._BY_NAME.update(saved)
    assert _rel(fast, slow) < 1e-12


def test_a_low_precision_model_casts_as_the_module_does():
    """bfloat16 weights and input: ``x_hat`` in float32, cast to bfloat16, times the weight (Llama); Gemma's product in
    float32 cast back; nn.RMSNorm in float32 inside; T5's x_hat in float32 cast to the weight's bfloat16. The rule's
    rows equal autograd's per-sample gradients of the very module (to bfloat16's rounding)."""
    torch.manual_seed(0)
    for kind in ("llama", "gemma", "torch", "t5"):
        if kind == "torch":
            module = torch.nn.RMSNorm(8).to(torch.bfloat16)
        elif kind == "t5":
            from transformers.models.t5.modeling_t5 import T5LayerNorm

            module = T5LayerNorm(8).to(torch.bfloat16)
        else:
            module = _case(kind, torch.float32, train=False).model.model.norm.to(torch.bfloat16)
        with torch.no_grad():
            module.weight.add_(0.1 * torch.randn_like(module.weight))
        x = torch.randn(3, 5, 8, dtype=torch.bfloat16)
        g = torch.randn(3, 5, 8, dtype=torch.bfloat16)
        want = torch.stack([torch.autograd.grad(module(x[n:n + 1]), module.weight, g[n:n + 1])[0] for n in range(3)])
        dest = torch.empty(3, 8, dtype=torch.bfloat16)
        rule_for(module).grads(module, x, g, {"weight": dest}, accumulate=False)
        assert _rel(dest.double(), want.double()) < 1e-2, kind  # bfloat16 sums in another order


@pytest.mark.parametrize("form", ["dense", "ghost", "rows", "auto"])
def test_tied_embeddings_take_no_loop(form):
    """Qwen2 with tied input/output embeddings: the norms are hooked, and the tied table / head too (its rows the sum
    of the embedding's and the head's rows); no SlowPathWarning, exact."""
    c = _case("qwen2", torch.float64, train=False, tie=True)
    assert c.model.lm_head.weight is c.model.model.embed_tokens.weight
    with warnings.catch_warnings():
        warnings.simplefilter("error", ief.SlowPathWarning)
        result = ief.per_sample(c.model, c.inputs, c.targets, check="exact", form=form)
    assert _rel(_dense(result), _oracle(c)) < 1e-10


def _llama_norm():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return LlamaRMSNorm(8, eps=1e-6)


def test_what_cannot_be_verified_stays_on_the_loop():
    norm = _llama_norm()
    assert rule_for(norm) is not None
    # a subclass (its forward may differ) is not its registered type
    sub = type("MyRMSNorm", (type(norm),), {})(8)
    assert rule_for(sub) is None
    # a forward replaced on the instance (a hub kernel, a patch)
    patched = _llama_norm()
    patched.forward = types.MethodType(lambda self, x: self.weight * x, patched)
    assert rule_for(patched) is None
    # a class of the same name outside transformers' modelling module
    fake = type("LlamaRMSNorm", (torch.nn.Module,), {"forward": type(norm).forward, "__module__": "mine"})
    assert rule_for(fake()) is None
    # a class of a listed name whose forward reads otherwise (another transformers release): not verified
    assert rmsnorm._FORWARDS.get("0" * 16) is None
    other = type("LlamaRMSNorm", (torch.nn.Module,), {
        "__module__": "transformers.models.llama.modeling_llama",
        "forward": lambda self, x: self.weight * x,
    })
    module = other()
    module.weight = torch.nn.Parameter(torch.ones(8))
    module.variance_epsilon = 1e-6
    assert rule_for(module) is None
    # no epsilon attribute, or a weight that is not a vector
    no_eps = _llama_norm()
    del no_eps.variance_epsilon
    assert rule_for(no_eps) is None
    wide = _llama_norm()
    wide.weight = torch.nn.Parameter(torch.ones(2, 4))
    assert rule_for(wide) is None


def test_every_listed_class_is_verified_or_absent():
    """The listed classes of this transformers release all carry one of the verified forwards (a listed name whose
    forward changed would silently fall to the loop: this says so)."""
    import importlib

    for name, family in {**rmsnorm._LLAMA_STYLE, **rmsnorm._GEMMA_STYLE, **rmsnorm._T5_STYLE}.items():
        try:
            cls = getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), name)
        except (ImportError, AttributeError):
            continue
        form = rmsnorm._FORWARDS.get(rmsnorm._fingerprint(cls))
        assert form is not None, name
        assert form[0] == rmsnorm._STYLE[name], name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("form", ["dense", "auto"])
def test_t5_layer_norms_are_hooked_and_exact(dtype, train, form):
    """Full fine-tuning of a tiny T5: its T5LayerNorms (variance in float32, x_hat in the promoted dtype) take the
    rule, and the shared table tied to the encoder's and decoder's embeddings and the LM head is hooked in all three;
    the relative attention biases take their broadcast uses (``tests/ief/test_t5_bias.py``): nothing takes the loop."""
    from tiny_models import _t5_batch, _t5_config

    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(_t5_config()).to(dtype).train(train)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    norms = [m for m in model.modules() if type(m).__name__ == "T5LayerNorm"]
    assert norms and all(rule_for(m) is not None for m in norms)
    inputs, targets = _t5_batch(3, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ief.SlowPathWarning)
        result = ief.per_sample(model, inputs, targets, check="exact", form=form)
    ref = oracle.per_sample(copy.deepcopy(model).double(), inputs, targets)[1].to(torch.float64)
    assert _rel(_dense(result), ref) < (1e-5 if dtype == torch.float32 else 1e-12)


class TorchRMSNormModel(torch.nn.Module):
    """Linear -> nn.RMSNorm over the last dimension (eps None: the dtype's) -> Linear -> nn.RMSNorm over the last two
    (reshaped [.., 2, 3]) -> head, per-position logits."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(4, 6)
        self.norm1 = torch.nn.RMSNorm(6)
        self.mid = torch.nn.Linear(6, 6)
        self.norm2 = torch.nn.RMSNorm((2, 3), eps=1e-5)
        self.head = torch.nn.Linear(6, 3)

    def forward(self, x):
        h = self.norm1(self.inp(x))
        h = self.norm2(torch.tanh(self.mid(h)).unflatten(-1, (2, 3))).flatten(-2)
        return self.head(h)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("form", ["dense", "ghost", "rows", "auto"])
def test_torch_rmsnorm_is_exact_without_the_loop(dtype, train, form):
    torch.manual_seed(0)
    model = TorchRMSNormModel().to(dtype).train(train)
    with torch.no_grad():
        for m in (model.norm1, model.norm2):
            m.weight.add_(0.3 * torch.randn_like(m.weight))
    x = torch.randn(5, 3, 4, dtype=dtype)
    y = torch.randint(0, 3, (5, 3))
    y[1] = -100  # every position of sample 1 ignored
    y[0, 2] = -100
    with warnings.catch_warnings():
        warnings.simplefilter("error", ief.SlowPathWarning)
        result = ief.per_sample(model, x, y, check="exact", form=form)
    ref = oracle.per_sample(copy.deepcopy(model).double(), x.double(), y)[1].to(torch.float64)
    assert _rel(_dense(result), ref) < (1e-5 if dtype == torch.float32 else 1e-12)


def test_torch_rmsnorm_without_weight_or_of_a_subclass_is_not_hooked():
    assert rule_for(torch.nn.RMSNorm(4)) is not None
    assert rule_for(torch.nn.RMSNorm(4, elementwise_affine=False)) is None
    assert rule_for(type("MyNorm", (torch.nn.RMSNorm,), {})(4)) is None


# ------------------------------------------------------------------------------------ HF scaled word embeddings
# (ief.jacobian.rules.scaled_embedding: Gemma's and BART's tables times a fixed scale)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("form", ["dense", "ghost", "rows", "auto"])
def test_gemma_untied_full_fine_tuning_has_no_loop(dtype, form):
    """Gemma (untied head) with its scaled embedding trainable: table rows times sqrt(hidden), norms (1 + weight);
    every parameter hooked, exact against the float64 oracle (the factored forms keep the table's used rows)."""
    from ief.jacobian.rules.scaled_embedding import ScaledEmbeddingRule

    c = _case("gemma", dtype, train=False)
    embed = c.model.model.embed_tokens
    assert isinstance(rule_for(embed), ScaledEmbeddingRule) and float(embed.embed_scale) != 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("error", ief.SlowPathWarning)
        result = ief.per_sample(c.model, c.inputs, c.targets, check="exact", form=form)
    assert _rel(_dense(result), _oracle(c)) < (1e-5 if dtype == torch.float32 else 1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_bart_scaled_embedding_rows_equal_autograds(dtype):
    """BART's ScaledWordEmbedding (a number as scale, padding row): the rule's rows against autograd per sample."""
    from transformers.models.bart.modeling_bart import BartScaledWordEmbedding

    torch.manual_seed(0)
    module = BartScaledWordEmbedding(11, 4, padding_idx=1, embed_scale=2.0).to(dtype)
    assert rule_for(module) is not None
    ids = torch.randint(0, 11, (3, 5))
    ids[0, -1] = 1
    g = torch.randn(3, 5, 4, dtype=dtype)
    want = torch.stack([torch.autograd.grad(module(ids[n:n + 1]), module.weight, g[n:n + 1])[0] for n in range(3)])
    dest = torch.empty(3, 44, dtype=dtype)
    rule_for(module).grads(module, ids, g, {"weight": dest}, accumulate=False)
    assert torch.equal(dest, want.reshape(3, -1))


def test_scaled_embeddings_that_cannot_be_verified_stay_on_the_loop():
    from transformers.models.bart.modeling_bart import BartScaledWordEmbedding

    from ief.jacobian.rules import scaled_embedding

    module = BartScaledWordEmbedding(11, 4, padding_idx=1, embed_scale=2.0)
    assert rule_for(module) is not None
    patched = BartScaledWordEmbedding(11, 4, padding_idx=1, embed_scale=2.0)
    patched.forward = types.MethodType(lambda self, ids: torch.nn.Embedding.forward(self, ids), patched)
    assert rule_for(patched) is None
    tensor_scale = BartScaledWordEmbedding(11, 4, padding_idx=1)
    tensor_scale.embed_scale = torch.tensor(2.0)  # not the number this form multiplies by
    assert rule_for(tensor_scale) is None
    max_norm = BartScaledWordEmbedding(11, 4, padding_idx=1)
    max_norm.max_norm = 1.0
    assert rule_for(max_norm) is None
    assert rule_for(type("BartScaledWordEmbedding", (torch.nn.Embedding,), {
        "__module__": "transformers.models.bart.modeling_bart",
        "forward": lambda self, ids: 3 * torch.nn.Embedding.forward(self, ids)})(11, 4)) is None
    import importlib

    for name, family in scaled_embedding._CLASSES.items():
        try:
            cls = getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), name)
        except (ImportError, AttributeError):
            continue
        assert scaled_embedding._FORWARDS.get(rmsnorm._fingerprint(cls)) is not None, name
