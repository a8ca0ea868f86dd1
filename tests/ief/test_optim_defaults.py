"""iEF's default rate and damping set per batch (:mod:`ief.optim.defaults`): ``lr = RATE / T``,
``damping = DAMPING T^2`` with ``T`` the batch's counted targets per sample.

The default step equals an explicit ``IEF(lr=RATE / T, damping=DAMPING T^2)`` step bit for bit (classifier: ``T = 1``;
causal LM with ``-100`` padding); an explicit ``lr`` or ``damping`` is used as given; a batch whose every target is
``-100`` is said; and on a causal LM with padding (a tiny Llama with LoRA on every linear layer) the default trains
like AdamW at its usual rate where the sum convention's former default (``lr=1, damping=1e-4``) blows the trainable
parameters' norm up ~1000-fold in 10 steps while the loss stays put.
"""
from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch

import ief
from ief.optim import defaults
from tiny_models import mlp_case


def _llama_lora():
    import peft
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   pad_token_id=0, attn_implementation="eager", tie_word_embeddings=False)
    return peft.get_peft_model(transformers.LlamaForCausalLM(cfg), peft.LoraConfig(r=8, lora_alpha=16,
                                                                                   target_modules="all-linear"))


def _lm_batch(n: int, seed: int, length: int = 16):
    """Sequences of a Markov chain (two likely successors per token), 6-16 tokens, right-padded with ``-100``
    labels: Hugging Face's causal-LM batch, shifted by :func:`ief.causal_lm_targets`."""
    g = torch.Generator().manual_seed(1234)
    successors = torch.stack([1 + torch.randperm(63, generator=g)[:2] for _ in range(64)])
    g.manual_seed(seed)
    ids = torch.empty(n, length, dtype=torch.long)
    ids[:, 0] = torch.randint(1, 64, (n,), generator=g)
    for t in range(1, length):
        pick = successors[ids[:, t - 1], torch.randint(0, 2, (n,), generator=g)]
        ids[:, t] = torch.where(torch.rand(n, generator=g) < 0.8, pick, torch.randint(1, 64, (n,), generator=g))
    mask, labels = torch.ones_like(ids), ids.clone()
    for i, keep in enumerate(torch.randint(6, length + 1, (n,), generator=g).tolist()):
        ids[i, keep:], mask[i, keep:], labels[i, keep:] = 0, 0, -100
    return {"input_ids": ids, "attention_mask": mask}, ief.causal_lm_targets(labels)


def _params(model):
    return [p.detach().clone() for p in model.parameters() if p.requires_grad]


def test_targets_per_sample_counts_what_the_loss_counts():
    assert defaults.targets_per_sample(torch.tensor([0, 2, 1, 1])) == 1.0
    assert defaults.targets_per_sample(torch.tensor([[1, 2, -100], [3, -100, -100]])) == 1.5
    assert defaults.targets_per_sample(torch.full((2, 3), -100)) == 0.0
    assert defaults.targets_per_sample(torch.zeros(4, 2)) == 2.0  # float targets: every entry
    assert defaults.per_target(0.3, 1e-4, 4.0) == (0.075, 1.6e-3)
    with pytest.raises(ValueError, match="targets per sample"):
        defaults.per_target(0.3, 1e-4, 0.0)


def test_the_defaults_recorded_in_param_groups():
    opt = ief.optim.IEF(mlp_case().model)
    assert (opt.param_groups[0]["lr"], opt.param_groups[0]["damping"]) == (defaults.RATE, defaults.DAMPING)


@pytest.mark.parametrize("lm", [False, True])
def test_the_default_step_is_the_explicit_step_at_the_per_target_values(lm):
    if lm:
        model, (inputs, targets) = _llama_lora(), _lm_batch(6, seed=3)
    else:
        case = mlp_case(m=8)
        model, inputs, targets = case.model, case.inputs, case.targets
    per_sample = ief.count_targets(targets) / targets.shape[0]
    assert (per_sample > 5) == lm
    explicit = copy.deepcopy(model)
    ief.optim.IEF(model).step(inputs, targets)
    lr, damping = defaults.RATE / per_sample, defaults.DAMPING * per_sample ** 2
    ief.optim.IEF(explicit, lr=lr, damping=damping).step(inputs, targets)
    for a, b in zip(_params(model), _params(explicit)):
        assert torch.equal(a, b)


def test_an_explicit_rate_or_damping_is_used_as_given():
    model, (inputs, targets) = _llama_lora(), _lm_batch(6, seed=3)
    per_sample = ief.count_targets(targets) / targets.shape[0]
    for kwargs, explicit in [(dict(lr=0.05), dict(lr=0.05, damping=defaults.DAMPING * per_sample ** 2)),
                             (dict(damping=1e-3), dict(lr=defaults.RATE / per_sample, damping=1e-3))]:
        a, b = copy.deepcopy(model), copy.deepcopy(model)
        ief.optim.IEF(a, **kwargs).step(inputs, targets)
        ief.optim.IEF(b, **explicit).step(inputs, targets)
        assert all(torch.equal(x, y) for x, y in zip(_params(a), _params(b)))


def test_a_batch_without_a_counted_target_is_said_and_moves_nothing():
    model, (inputs, targets) = _llama_lora(), _lm_batch(4, seed=3)
    before = _params(model)
    said = r"every target of this batch is -100 \(ignored\).*no update was taken"
    with pytest.warns(UserWarning, match=said) as seen:
        loss = ief.optim.IEF(model).step(inputs, torch.full_like(targets, -100))
    assert {w.filename for w in seen} == {__file__}  # the warning names the caller's line
    assert float(loss) == 0.0
    assert all(torch.equal(a, b) for a, b in zip(before, _params(model)))


def _norm(model) -> float:
    return math.sqrt(sum(float(p.detach().pow(2).sum()) for p in model.parameters() if p.requires_grad))


@torch.no_grad()
def _held_out_loss(model) -> float:
    inputs, targets = _lm_batch(128, seed=2)
    logits = model(**inputs).logits
    return float(torch.nn.functional.cross_entropy(logits.reshape(-1, 64), targets.reshape(-1), ignore_index=-100))


def _train(make_opt, steps: int = 10):
    model = _llama_lora()
    start_norm, start_loss = _norm(model), _held_out_loss(model)
    opt = make_opt(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the former default's stall and overshoot warnings
        for step in range(steps):
            inputs, targets = _lm_batch(32, seed=10_000 + step)
            if isinstance(opt, torch.optim.AdamW):
                logits = model(**inputs).logits
                torch.nn.functional.cross_entropy(logits.reshape(-1, 64), targets.reshape(-1),
                                                  ignore_index=-100).backward()
                opt.step()
                opt.zero_grad()
            else:
                opt.step(inputs, targets)
    return _norm(model) / start_norm, _held_out_loss(model), start_loss


def test_the_default_trains_a_padded_causal_lm_like_adamw():
    """The default's held-out loss after 10 steps is at most AdamW's (lr 1e-3) and below its start, the trainable
    norm nearly unchanged; the former default (lr 1, damping 1e-4) grows it over 10-fold for no gain."""
    growth, loss, start = _train(lambda m: ief.optim.IEF(m))
    _, adamw, _ = _train(lambda m: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3))
    assert loss < start and loss <= 1.01 * adamw and growth < 1.5
    growth, loss, _ = _train(lambda m: ief.optim.IEF(m, lr=1.0, damping=1e-4))
    assert growth > 10
