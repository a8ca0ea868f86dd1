"""companion.experiments.convention: the paper's (token-mean) EF/SF/iEF rates and dampings, given to ``ief.optim``
with ``reduction="mean"`` (how the experiments build them), reproduce, on a tiny T5, the update computed the way the
authors' released code computes it (per-sample gradients of Hugging Face's mean loss over the batch's target tokens,
s from that loss's logit gradient), to float64 precision, batch by batch."""
from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import t5_lora_case, t5_prompt_case

import ief
from ief.directions import sf_direction
from companion.experiments.optimizers import make_optimizer
from companion.experiments.setups import GLUE_LABEL_WORDS, optimizer_config, resolve
from ief import count_targets
from ief.optim import EF, IEF
from ief.optim.convention import to_sum_convention  # the library's arithmetic (tests may reach inside ief)

CASES = {"t5-lora": t5_lora_case, "t5-prompt": t5_prompt_case}


@pytest.fixture(autouse=True)
def t5_layer_norm_in_float64(monkeypatch):
    """Hugging Face's T5LayerNorm computes its variance in float32 whatever the input's dtype, so two mathematically
    equal float64 computations that scale the backward differently (1/K) differ at ~1e-8; here the variance keeps
    the input's precision (float64), as a float32 input would keep float32."""
    from transformers.models.t5 import modeling_t5

    def forward(self, hidden_states):
        work = torch.promote_types(hidden_states.dtype, torch.float32)
        variance = hidden_states.to(work).pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    monkeypatch.setattr(modeling_t5.T5LayerNorm, "forward", forward)


def _trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in _trainable(model)])


def official_quantities(model, inputs, labels, sampled_labels=None):
    """As in iEFOptimizer_GP.py + example_glue_sst2_train.py: ``loss = outputs.loss`` (HF's token mean),
    ``CE_grad = autograd.grad(loss, logits)``, per-sample gradients of that loss (the hooks' error signals: one
    backward of the logits with the sample's rows of CE_grad), ``lgn = ||CE_grad[n]||``. Returns ``(J_p, lgn^2, g_p)``
    (and the sampled J of the same mean loss with ``sampled_labels`` as the last element if given)."""
    params = _trainable(model)
    out = model(**inputs, labels=labels)
    loss, logits = out.loss, out.logits

    def per_sample_rows(ce_grad):
        rows = []
        for n in range(logits.shape[0]):
            mask = torch.zeros_like(ce_grad)
            mask[n] = 1
            grads = torch.autograd.grad(logits, params, grad_outputs=ce_grad * mask, retain_graph=True)
            rows.append(torch.cat([g.reshape(-1) for g in grads]))
        return torch.stack(rows)

    ce_grad = torch.autograd.grad(loss, logits, retain_graph=True)[0]
    jac = per_sample_rows(ce_grad)
    lgn2 = ce_grad.reshape(ce_grad.shape[0], -1).norm(dim=1) ** 2
    grad = jac.sum(0)
    if sampled_labels is None:
        return jac, lgn2, grad
    sampled_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), sampled_labels.reshape(-1),
                                                     ignore_index=-100)  # CrossEntropyLoss(): the token mean again
    return jac, lgn2, grad, per_sample_rows(torch.autograd.grad(sampled_loss, logits, retain_graph=True)[0])


def official_ief_update(jac, lgn2, lr, damping):
    """``iEFlg2``: ``-lr J_p^T (J_p J_p^T + lambda I)^{-1} lgn^2``."""
    c = jac @ jac.T
    return -lr * (torch.linalg.solve(c + damping * torch.eye(len(c), dtype=c.dtype), lgn2) @ jac)


def official_ef_update(jac, lr, damping, normalized):
    """``iEF0`` (target_loss_reduction = ones), with ``norm_update`` when normalised."""
    c = jac @ jac.T
    u = torch.linalg.solve(c + damping * torch.eye(len(c), dtype=c.dtype), torch.ones(len(c), dtype=c.dtype)) @ jac
    return -lr * (u / u.norm() if normalized else u)


def _two_batches(name):
    """Two batches of the same tiny model with different numbers of target tokens K."""
    a = CASES[name](m=3, seed=0)
    b = CASES[name](m=4, seed=1)
    b.model = a.model
    if name == "t5-prompt":
        ief.per_sample_prompts(a.model)  # as the experiments do: one backward for every sample's prompt gradient
    assert count_targets(a.targets) != count_targets(b.targets)
    return a.model, [(a.inputs, a.targets), (b.inputs, b.targets)]


def _relative_damping(jac, fraction=0.3):
    """A damping that matters: a fraction of the mean diagonal of J_p J_p^T (the paper's 1e-7 would be invisible)."""
    return float(fraction * (jac * jac).sum(1).mean())


@pytest.mark.parametrize("name", sorted(CASES))
def test_converted_ief_equals_the_official_update_batch_by_batch(name):
    model, batches = _two_batches(name)
    lr = 50.0
    jac0, _, _ = official_quantities(model, *batches[0])
    damping = _relative_damping(jac0)
    ours = copy.deepcopy(model)
    opt = IEF(ours, lr=lr, damping=damping, reduction="mean")
    for inputs, labels in batches:  # the official update from the current parameters, then ours
        reference = copy.deepcopy(ours)
        jac, lgn2, _ = official_quantities(reference, inputs, labels)
        expected = official_ief_update(jac, lgn2, lr, damping)
        before = _flat(ours)
        opt.step(inputs, labels)
        assert opt.last_tokens == count_targets(labels)
        assert opt.param_groups[0]["lr"] == lr and opt.param_groups[0]["damping"] == damping  # the given values
        torch.testing.assert_close(_flat(ours) - before, expected, rtol=1e-9, atol=1e-12 * float(expected.abs().max()))


def test_unconverted_rates_give_a_different_update():
    """The check can fail: the paper's numbers passed to ief.optim.IEF as they are (sum convention) do not match."""
    model, ((inputs, labels), _) = _two_batches("t5-lora")
    jac, lgn2, _ = official_quantities(model, inputs, labels)
    damping = _relative_damping(jac)
    expected = official_ief_update(jac, lgn2, 50.0, damping)
    plain = copy.deepcopy(model)
    before = _flat(plain)
    IEF(plain, lr=50.0, damping=damping).step(inputs, labels)
    assert not torch.allclose(_flat(plain) - before, expected, rtol=1e-3)


@pytest.mark.parametrize("normalized", [True, False])
def test_converted_ef_equals_the_official_update(normalized):
    model, batches = _two_batches("t5-lora")
    lr = 0.01
    jac0, _, _ = official_quantities(model, *batches[0])
    damping = _relative_damping(jac0)
    ours = copy.deepcopy(model)
    opt = EF(ours, lr=lr, damping=damping, normalize=normalized, reduction="mean")
    for inputs, labels in batches:
        jac, _, _ = official_quantities(copy.deepcopy(ours), inputs, labels)
        expected = official_ef_update(jac, lr, damping, normalized)
        before = _flat(ours)
        opt.step(inputs, labels)
        torch.testing.assert_close(_flat(ours) - before, expected, rtol=1e-9, atol=1e-12 * float(expected.abs().max()))


def test_converted_sf_direction_equals_the_official_formula():
    """SF (``SF1``, MC_TIME = 1): ``(1/lambda)(g - J^T (J J^T + lambda I)^{-1} J g)`` from the token-mean sampled
    Jacobian and gradient, against ief's sf_direction on the sum-convention ones with the converted rate/damping."""
    case = t5_lora_case(m=4, seed=2)
    g = torch.Generator().manual_seed(0)
    sampled = torch.where(case.targets == -100, case.targets, torch.randint(2, 32, case.targets.shape, generator=g))
    jac, _, grad, sjac = official_quantities(case.model, case.inputs, case.targets, sampled)
    k = count_targets(case.targets)
    lr, damping = 0.01, _relative_damping(sjac)
    c = sjac @ sjac.T + damping * torch.eye(len(sjac), dtype=sjac.dtype)
    official = -lr * (grad - sjac.T @ torch.linalg.solve(c, sjac @ grad)) / damping
    lr_sum, damping_sum = to_sum_convention("sf", lr, damping, k)
    ours = -lr_sum * sf_direction(sjac * k, grad * k, damping_sum)  # ief's rows: gradients of the summed loss
    torch.testing.assert_close(ours, official, rtol=1e-9, atol=1e-12 * float(official.abs().max()))


def test_registry_uses_the_token_mean_convention_for_the_paper_setups_only():
    full = resolve("sst2-t5-lora", "full")
    assert full.optimizers["ief"].options["convention"] == "token-mean" and full.optimizers["ief"].lr == 100.0
    assert resolve("rte-t5-pt", "smoke").optimizers["sf"].options["convention"] == "token-mean"
    assert resolve("cifar10-mlp", "full").optimizers["ef"].options["convention"] == "token-mean"
    assert "convention" not in resolve("sst2-t5-lora", "full").optimizers["adamw"].options
    for name in ("digits-mlp", "tweets-minilm-lora", "tweets-minilm-pt"):  # searched in ief's own convention
        assert all("convention" not in o.options for o in resolve(name, "cpu").optimizers.values())
    case = t5_lora_case()
    opt, _ = make_optimizer(case.model, optimizer_config(full, "ief"), 10)
    assert type(opt) is IEF and opt.reduction == "mean"
    assert opt.param_groups[0]["lr"] == 100.0 and opt.param_groups[0]["damping"] == 1e-7
    opt, _ = make_optimizer(case.model, optimizer_config(resolve("digits-mlp", "cpu"), "ief"), 10)
    assert type(opt) is IEF and opt.reduction == "sum"


def test_t5_targets_follow_the_official_label_format():
    """As the released code: labels = tokenizer(label word) (its tokens + </s>), -100 padded, and the decoder input
    is what Hugging Face's T5 makes of those labels (``_shift_right``), so outputs.loss counts the same K tokens."""
    from companion.experiments.data import load_data
    from companion.experiments.models import build_model
    from companion.experiments.tasks import make_task

    cfg = resolve("mnli-t5-lora", "smoke")
    data = load_data(cfg)
    model, tokenizer = build_model(cfg, data)
    task = make_task(cfg, model, tokenizer)
    batch = [data.train[i] for i in range(8)]
    inputs, targets = task.collate(batch)
    for e, row in zip(batch, targets.tolist()):
        word = tokenizer(GLUE_LABEL_WORDS["mnli"][e["label"]])["input_ids"]
        assert word[-1] == tokenizer.eos_token_id and row[:len(word)] == word and set(row[len(word):]) <= {-100}
    base = model.get_base_model()
    assert torch.equal(inputs["decoder_input_ids"], base._shift_right(targets))
