"""``ief.per_sample`` / ``ief.sampled_jacobian`` against dense per-sample loops (``tests/oracle.py``).

The objects under test are the paper's per-sample quantities (``eqn:prob_loss``): the losses ``l_n``, the Jacobian
``J = grad_theta l`` whose rows are the per-sample gradients, ``s_iEF = ||grad_{z_n} l_n||^2`` (``eqn:s_ief``) and,
for SF, the Jacobian of the per-sample losses at labels drawn from the model (``sec:app-sample-fisher``, ``alg:SF``).

Tolerances. Everything is float64 unless said otherwise. The package forms each row with one batched forward and
hooks, the oracle with one forward per sample: the two agree to rounding, so ``1e-10`` relative (a few hundred ulps
of headroom for the reductions over positions / batch). The T5 cases are the exception: ``T5LayerNorm`` computes its
variance in float32 internally whatever the model dtype, so batched and per-sample forwards can differ at float32
rounding, ``1e-6`` relative. Float32 models are compared with ``1e-5`` relative (about 100 float32 ulps).
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

import ief
import oracle
from tiny_models import IGNORE, mlp_case, mse_case, saturated_case, sequence_case, t5_lora_case, t5_prompt_case

F64_RTOL = 1e-10
T5_RTOL = 1e-6
F32_RTOL = 1e-5

# The forms of J (``per_sample(form=...)``): the [M, P] tensor, and the factored Jacobian with every nn.Linear weight
# as (A, G) factors ("ghost") or as materialised per-sample rows ("rows"); "auto" picks one of the two per layer.
FORMS = ["dense", "ghost", "rows"]


@pytest.fixture(params=FORMS)
def form(request):
    return request.param


def dense(jacobian):
    """The [M, P] tensor of either form."""
    return jacobian.materialize() if isinstance(jacobian, ief.rows.FactoredJacobian) else jacobian


def rtol_for(case) -> float:
    return T5_RTOL if case.name.startswith("t5") else F64_RTOL


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def assert_rel(actual: torch.Tensor, expected: torch.Tensor, rtol: float, what: str = "") -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    err = rel_err(actual, expected)
    assert err <= rtol, f"{what}: relative error {err:.3e} > {rtol:.1e}"


def batch_graph_rows(model, inputs, targets, params, loss="cross_entropy"):
    """``d l_n / d theta`` through ONE batched forward (the same graph, same dropout masks / batch statistics as the
    package's single forward, given the same RNG state), by a loop of backward passes: the exact per-sample rows."""
    z = oracle.logits_of(model, inputs)
    rows = []
    for n in range(targets.shape[0]):
        l_n = oracle.sample_loss(z[n : n + 1], targets[n : n + 1], loss)
        rows.append(oracle.flat_grad(l_n, params))
    return torch.stack(rows)


# --------------------------------------------------------------------------------------- per_sample vs the oracle
def test_per_sample_matches_oracle(any_case, form):
    """Losses, Jacobian rows, s_iEF and the batch gradient (``eqn:prob_loss``, ``eqn:s_ief``) on every tiny model."""
    c = any_case
    rtol = rtol_for(c)
    got = ief.per_sample(c.model, c.inputs, c.targets, loss=c.loss, form=form)
    got.jacobian = dense(got.jacobian)
    losses, jac, sq = oracle.per_sample(c.model, c.inputs, c.targets, c.loss)
    assert_rel(got.losses, losses, rtol, "losses")
    assert_rel(got.jacobian, jac, rtol, "jacobian")
    assert_rel(got.logit_sqnorm, sq, rtol, "logit_sqnorm")
    # .gradient is the autograd gradient of L = sum_n l_n, i.e. the column sums of J
    assert_rel(got.gradient, jac.sum(0), rtol, "gradient vs oracle J.sum(0)")
    assert_rel(got.gradient, got.jacobian.sum(0), rtol, "gradient vs own J.sum(0)")
    params = oracle.trainable(c.model)
    assert got.jacobian.shape == (c.targets.shape[0], sum(p.numel() for p in params))
    for t in (got.losses, got.jacobian, got.logit_sqnorm, got.gradient):
        assert t.dtype == torch.float64


def test_per_sample_gradient_is_autograd_batch_gradient():
    """``.gradient`` equals ``torch.autograd`` on the summed loss ``L`` (``eqn:prob_loss``), with ignored positions."""
    c = sequence_case()
    got = ief.per_sample(c.model, c.inputs, c.targets)
    z = c.model(c.inputs)
    total = torch.nn.functional.cross_entropy(
        z.reshape(-1, z.shape[-1]), c.targets.reshape(-1), ignore_index=IGNORE, reduction="sum"
    )
    params = oracle.trainable(c.model)
    expected = oracle.flat_grad(total, params)
    assert_rel(got.gradient, expected, F64_RTOL, "gradient")
    assert_rel(got.losses.sum(), total.detach(), F64_RTOL, "L")


def test_per_sample_float32_mlp(form):
    """A float32 model: results stay float32 and agree with the float64 oracle on the same weights to float32
    rounding (``1e-5`` relative)."""
    c = mlp_case(dtype=torch.float32)
    got = ief.per_sample(c.model, c.inputs, c.targets, form=form)
    assert got.jacobian.dtype == torch.float32
    got.jacobian = dense(got.jacobian)
    for t in (got.losses, got.jacobian, got.logit_sqnorm, got.gradient):
        assert t.dtype == torch.float32
    ref_model = mlp_case(dtype=torch.float32).model.double()  # same seed -> same float32 weights, widened
    losses, jac, sq = oracle.per_sample(ref_model, c.inputs.double(), c.targets)
    assert_rel(got.losses, losses, F32_RTOL, "losses")
    assert_rel(got.jacobian, jac, F32_RTOL, "jacobian")
    assert_rel(got.logit_sqnorm, sq, F32_RTOL, "logit_sqnorm")
    assert_rel(got.gradient, jac.sum(0), F32_RTOL, "gradient")


def test_zero_loss_sample_gives_exact_zero_row(form):
    """A sample whose logits saturate (margin ~1e4 >> 745, so softmax is exactly one-hot in float64) has
    ``l_n = 0``, ``grad l_n = 0`` and ``s_n = 0`` exactly; the other rows are unaffected."""
    model, x, y = saturated_case()  # sample 1 has exactly zero loss and gradient
    with torch.no_grad():
        z = model(x)
    assert float((z[1].max() - z[1].topk(2).values[1])) > 800  # the premise: exp(-margin) underflows
    got = ief.per_sample(model, x, y, form=form)
    got.jacobian = dense(got.jacobian)
    assert float(got.losses[1]) == 0.0
    assert float(got.logit_sqnorm[1]) == 0.0
    assert torch.count_nonzero(got.jacobian[1]) == 0
    losses, jac, sq = oracle.per_sample(model, x, y)
    assert torch.count_nonzero(jac[1]) == 0
    assert_rel(got.jacobian, jac, F64_RTOL, "jacobian")
    assert_rel(got.losses, losses, F64_RTOL, "losses")
    others = [0, 2, 3]
    assert (got.jacobian[others].norm(dim=1) > 0).all()


# ------------------------------------------------------------------------------------------------- params= subset
def _mlp_blocks(c):
    """The oracle Jacobian of the mlp case cut into its four column blocks (``model.parameters()`` order)."""
    _, full, _ = oracle.per_sample(c.model, c.inputs, c.targets)
    sizes = [p.numel() for p in c.model.parameters()]
    offsets = [0, *torch.tensor(sizes).cumsum(0).tolist()]
    return {name: full[:, offsets[i] : offsets[i + 1]] for i, name in enumerate(["w1", "b1", "w2", "b2"])}


def test_params_reordered_returns_columns_in_that_order(form):
    """``params=`` in an order other than ``model.parameters()`` (whole layers): the columns follow ``params``."""
    c = mlp_case()
    lin1, lin2 = c.model[0], c.model[2]
    got = ief.per_sample(c.model, c.inputs, c.targets, params=[lin2.bias, lin2.weight, lin1.weight, lin1.bias],
                         form=form)
    b = _mlp_blocks(c)
    expected = torch.cat([b["b2"], b["w2"], b["w1"], b["b1"]], dim=1)
    assert_rel(dense(got.jacobian), expected, F64_RTOL, "reordered jacobian")
    assert_rel(got.gradient, expected.sum(0), F64_RTOL, "reordered gradient")


@pytest.mark.parametrize(
    "names", [("w2", "b1"), ("b1",)], ids=["lin2.weight+lin1.bias", "lin1.bias"]
)
def test_params_subset_returns_only_those_columns_in_that_order(names, form):
    """``params=`` naming single tensors of layers whose other parameters are trainable too (e.g. a weight without
    its bias): exactly those column blocks, in that order."""
    c = mlp_case()
    lin1, lin2 = c.model[0], c.model[2]
    tensors = {"w1": lin1.weight, "b1": lin1.bias, "w2": lin2.weight, "b2": lin2.bias}
    got = ief.per_sample(c.model, c.inputs, c.targets, params=[tensors[n] for n in names], form=form)
    b = _mlp_blocks(c)
    expected = torch.cat([b[n] for n in names], dim=1)
    assert_rel(dense(got.jacobian), expected, F64_RTOL, "subset jacobian")
    assert_rel(got.gradient, expected.sum(0), F64_RTOL, "subset gradient")
    # s_iEF and the losses do not depend on which parameters are differentiated
    full = ief.per_sample(c.model, c.inputs, c.targets)
    assert torch.equal(got.logit_sqnorm, full.logit_sqnorm)
    assert torch.equal(got.losses, full.losses)


# ------------------------------------------------------------------------------------------------ sampled Jacobian
def _redraw_labels(model, inputs, targets, seed: int, loss: str) -> torch.Tensor:
    """The draw ``sampled_jacobian`` documents, re-made independently: one label per position from the float64
    softmax with ``torch.multinomial`` (cross-entropy; ignored positions stay ``-100``), or ``y = z + N(0, I)``
    (mse); same generator seed, same order of consumption."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        z = oracle.logits_of(model, inputs)
    if loss == "mse":
        noise = torch.randn(z.shape, generator=g, dtype=torch.float64)
        return (z.double() + noise).to(z.dtype)
    probs = torch.softmax(z.double(), dim=-1).reshape(-1, z.shape[-1])
    drawn = torch.multinomial(probs, 1, generator=g).reshape(targets.shape)
    return torch.where(targets == IGNORE, targets, drawn)


@pytest.mark.parametrize("factory", [mlp_case, mse_case, sequence_case, t5_lora_case], ids=lambda f: f.__name__)
def test_sampled_jacobian_rows_are_gradients_at_the_drawn_labels(factory, form):
    """Each row is the oracle per-sample gradient at the labels drawn with the given generator (``alg:SF``): the
    draw is reproduced exactly (same seed), ignored positions stay ignored (the oracle skips them), and the result
    depends on the seed only through the draw."""
    c = factory()
    seed = 1234
    sampled = dense(ief.sampled_jacobian(c.model, c.inputs, c.targets, torch.Generator().manual_seed(seed),
                                         loss=c.loss, form=form))
    labels = _redraw_labels(c.model, c.inputs, c.targets, seed, c.loss)
    if c.loss == "cross_entropy":
        assert torch.equal(labels == IGNORE, c.targets == IGNORE)
    _, expected, _ = oracle.per_sample(c.model, c.inputs, labels, c.loss)
    assert_rel(sampled, expected, rtol_for(c), "sampled rows vs oracle at the drawn labels")
    # same seed -> same draw -> identical result
    again = dense(ief.sampled_jacobian(c.model, c.inputs, c.targets, torch.Generator().manual_seed(seed),
                                       loss=c.loss, form=form))
    assert torch.equal(sampled, again)


def test_sampled_jacobian_different_seeds_differ_and_labels_are_not_the_targets():
    """The labels really are drawn: two seeds give different rows, and the rows are not the EF rows (the given
    targets), checked on a 4-class MLP with 6 samples where a collision has probability well below 1e-3."""
    c = mlp_case()
    a = ief.sampled_jacobian(c.model, c.inputs, c.targets, torch.Generator().manual_seed(1))
    b = ief.sampled_jacobian(c.model, c.inputs, c.targets, torch.Generator().manual_seed(2))
    ef_rows = ief.per_sample(c.model, c.inputs, c.targets).jacobian
    assert not torch.allclose(a, b)
    assert not torch.allclose(a, ef_rows)
    labels1 = _redraw_labels(c.model, c.inputs, c.targets, 1, "cross_entropy")
    labels2 = _redraw_labels(c.model, c.inputs, c.targets, 2, "cross_entropy")
    assert not torch.equal(labels1, labels2)


# ------------------------------------------------------------------------------------------------------ the guard
def _bn_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(5, 7), torch.nn.BatchNorm1d(7), torch.nn.Tanh(), torch.nn.Linear(7, 4)
    ).double()
    x = torch.randn(6, 5, dtype=torch.float64)
    y = torch.randint(0, 4, (6,))
    return model, x, y


def test_batchnorm_train_mode_raises_mismatch(form):
    """Batch norm in training mode mixes samples: ``l_n`` depends on every sample through the batch statistics, so
    the hooked rows ``(dL/dout_n) a_n^T`` are not ``d l_n / d theta``. The docstring of ``ief.jacobian``
    and the error text promise :class:`ief.PerSampleGradientMismatch` for exactly this case.

    Hooked rows always sum to the batch gradient, so the sum check cannot see the mixing: the guard refuses batch norm
    that normalises with batch statistics outright."""
    model, x, y = _bn_model()
    model.train()
    with pytest.raises(ief.PerSampleGradientMismatch):
        ief.per_sample(model, x, y, form=form)


def test_batchnorm_train_mode_check_false_does_not_raise():
    """``check=False`` skips the guard: the call returns, rows of the right shape that sum to the batch gradient."""
    model, x, y = _bn_model()
    model.train()
    got = ief.per_sample(model, x, y, check=False)
    assert got.jacobian.shape == (6, sum(p.numel() for p in model.parameters()))
    assert_rel(got.jacobian.sum(0), got.gradient, F64_RTOL, "rows sum")


def test_batchnorm_eval_mode_passes_and_matches_oracle(form):
    """In eval mode batch norm is a per-sample affine map: no error, and the rows (the BN affine parameters
    hooked as a per-channel affine map) match the oracle."""
    model, x, y = _bn_model()
    model.train()
    with torch.no_grad():
        model(x)  # non-trivial running statistics
    model.eval()
    got = ief.per_sample(model, x, y, form=form)
    losses, jac, sq = oracle.per_sample(model, x, y)
    assert_rel(dense(got.jacobian), jac, F64_RTOL, "jacobian")
    assert_rel(got.losses, losses, F64_RTOL, "losses")
    assert_rel(got.logit_sqnorm, sq, F64_RTOL, "logit_sqnorm")


class _TimeMajor(torch.nn.Module):
    """Applies its Linear to a ``[T, M, D]`` (time-major) view: the Linear's leading dimension is not the sample."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 4)

    def forward(self, x):  # x: [M, T, 3]
        return self.lin(x.transpose(0, 1)).transpose(0, 1)


@pytest.mark.parametrize("t", [3, 4], ids=["T==M", "T!=M"])
def test_hooked_layer_whose_leading_dim_is_not_the_sample(t, form):
    """A Linear fed a time-major tensor ``[T, M, D]``, so its leading dimension is not the sample.

    The probe forward of one sample establishes dimension 1 as the sample axis (``T`` stays, ``M`` shrinks to 1),
    whatever ``T`` is: with ``T == M`` a size match cannot tell, and the hooks once took time steps for samples (J
    wrong by 42-97 %, rows still adding up). Now every guard setting gives the oracle's rows, from the hooks (no
    slow-path warning)."""
    torch.manual_seed(0)
    model = _TimeMajor().double()
    x = torch.randn(3, t, 3, dtype=torch.float64)
    y = torch.randint(0, 4, (3, t))
    _, jac, _ = oracle.per_sample(model, x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ief.SlowPathWarning)
        for check in (True, "exact", False):
            got = ief.per_sample(model, x, y, check=check, form=form).jacobian
            assert_rel(dense(got), jac, F64_RTOL, f"jacobian check={check}")


def test_exact_check_passes_on_every_supported_case(any_case, form):
    """The exact guard accepts every real model of the suite (no false alarms), whatever the form of J."""
    c = any_case
    got = ief.per_sample(c.model, c.inputs, c.targets, loss=c.loss, check="exact", form=form)
    assert torch.isfinite(dense(got.jacobian)).all()


def test_unknown_check_value_is_refused():
    c = mlp_case()
    with pytest.raises(ValueError, match="'always'"):
        ief.per_sample(c.model, c.inputs, c.targets, check="always")


# ------------------------------------------------------------------------------------------- train mode, dropout
def test_train_mode_dropout_rows_are_exact_and_masks_advance():
    """t5-lora with LoRA dropout 0.1 in train mode. The package uses the model in the mode it is in: with the same
    RNG state its rows equal the exact per-sample gradients through one batched forward (same masks), they sum to
    the gradient (no mismatch), and a second call draws new masks (the RNG advances), so its rows differ."""
    c = t5_lora_case()
    c.model.train()
    params = oracle.trainable(c.model)
    torch.manual_seed(7)
    first = ief.per_sample(c.model, c.inputs, c.targets)
    second = ief.per_sample(c.model, c.inputs, c.targets)
    torch.manual_seed(7)
    exact = batch_graph_rows(c.model, c.inputs, c.targets, params)
    assert_rel(first.jacobian, exact, T5_RTOL, "train-mode rows vs exact rows with the same masks")
    assert_rel(first.jacobian.sum(0), first.gradient, T5_RTOL, "rows sum to gradient")
    assert_rel(second.jacobian.sum(0), second.gradient, T5_RTOL, "rows sum to gradient (2nd call)")
    assert rel_err(second.jacobian, first.jacobian) > 1e-3, "the second call reused the first call's dropout masks"
    c.model.eval()
    evaluated = ief.per_sample(c.model, c.inputs, c.targets)
    assert rel_err(evaluated.jacobian, first.jacobian) > 1e-3, "dropout was not active in train mode"


def test_per_sample_works_under_no_grad():
    """``per_sample`` / ``sampled_jacobian`` compute gradients, so like ``torch.autograd.functional.jacobian`` and
    ``torch.func`` (and like the package's own ``opt.step``, which wraps its call in ``torch.enable_grad()``, and
    ``ief.gamma``) they should give the same result when called inside ``torch.no_grad()``, e.g. in an evaluation
    loop."""
    c = mlp_case()
    expected = ief.per_sample(c.model, c.inputs, c.targets)
    sampled = ief.sampled_jacobian(c.model, c.inputs, c.targets, torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = ief.per_sample(c.model, c.inputs, c.targets)
        got_sampled = ief.sampled_jacobian(c.model, c.inputs, c.targets, torch.Generator().manual_seed(0))
    assert torch.equal(got.jacobian, expected.jacobian)
    assert torch.equal(got.logit_sqnorm, expected.logit_sqnorm)
    assert torch.equal(got_sampled, sampled)


# ---------------------------------------------------------------------------------------------------- bad input
def test_no_trainable_parameters():
    c = mlp_case()
    for p in c.model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        ief.per_sample(c.model, c.inputs, c.targets)
    with pytest.raises(ValueError, match="no trainable parameters"):
        ief.sampled_jacobian(c.model, c.inputs, c.targets)


def test_cross_entropy_targets_shape_mismatch():
    c = mlp_case()
    bad = torch.zeros(6, 2, dtype=torch.long)
    with pytest.raises(ValueError, match=r"\(6, 2\)"):
        ief.per_sample(c.model, c.inputs, bad)
    with pytest.raises(ValueError, match=r"\(5,\)"):
        ief.per_sample(c.model, c.inputs, c.targets[:5])


def test_class_index_out_of_range_names_the_index():
    c = mlp_case()  # 4 classes
    y = c.targets.clone()
    y[3] = 7
    with pytest.raises(ValueError, match="7") as info:
        ief.per_sample(c.model, c.inputs, y)
    assert "class index 7" in str(info.value)
    y[3] = -1  # negative indices other than -100 are out of range too
    with pytest.raises(ValueError, match="-1"):
        ief.per_sample(c.model, c.inputs, y)
    with pytest.raises(ValueError, match="7"):
        y[3] = 7
        ief.sampled_jacobian(c.model, c.inputs, y)


def test_float_targets_with_cross_entropy():
    c = mlp_case()
    with pytest.raises(ValueError, match="float64"):
        ief.per_sample(c.model, c.inputs, c.targets.double())


def test_unknown_loss_lists_accepted_names():
    c = mlp_case()
    with pytest.raises(ValueError, match="hinge") as info:
        ief.per_sample(c.model, c.inputs, c.targets, loss="hinge")
    assert "'cross_entropy'" in str(info.value) and "'mse'" in str(info.value)


def test_mse_shape_mismatch():
    c = mse_case()
    with pytest.raises(ValueError, match=r"\(5, 3\)"):
        ief.per_sample(c.model, c.inputs, torch.zeros(5, 3, dtype=torch.float64), loss="mse")
    with pytest.raises(ValueError, match="dtype"):
        ief.per_sample(c.model, c.inputs, torch.zeros(5, 2, dtype=torch.long), loss="mse")


class _TiedEmbedding(torch.nn.Module):
    """Input embedding whose weight is also the output projection (tied weights, as in many language models): the
    hooked ``nn.Embedding`` sees only its own use of the weight, not the ``F.linear`` one."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(7, 4)

    def forward(self, tokens):
        return torch.nn.functional.linear(torch.tanh(self.embed(tokens)), self.embed.weight)


@pytest.mark.filterwarnings("ignore::ief.SlowPathWarning")
@pytest.mark.parametrize("check", [True, False, "exact"])
def test_tied_weight_used_outside_its_module_takes_the_exact_loop(check):
    """Before: refused with a message offering check=False, whose rows miss the F.linear use. Now the tied table
    takes the per-sample loop: the oracle's rows with every check."""
    torch.manual_seed(0)
    model = _TiedEmbedding().double()
    tokens = torch.randint(0, 7, (5, 3))
    targets = torch.randint(0, 7, (5, 3))
    _, jac, _ = oracle.per_sample(model, tokens, targets)
    got = ief.per_sample(model, tokens, targets, check=check)
    assert_rel(got.jacobian, jac, F64_RTOL, "jacobian")
    assert_rel(got.gradient, jac.sum(0), F64_RTOL, "gradient")


def test_peft_prompt_tuning_uses_one_backward_after_per_sample_prompts():
    """peft embeds one prompt row and repeats it: without help the prompt embedding falls back to M backward passes
    (exact, slow) and says so with a SlowPathWarning; ief.per_sample_prompts makes the hooks see every sample."""
    import warnings

    c = t5_prompt_case()
    _, jac, _ = oracle.per_sample(c.model, c.inputs, c.targets)
    with pytest.warns(ief.SlowPathWarning, match="per_sample_prompts"):
        slow = ief.per_sample(c.model, c.inputs, c.targets)
    assert_rel(slow.jacobian, jac, T5_RTOL, "jacobian (loop fallback)")
    ief.per_sample_prompts(c.model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ief.SlowPathWarning)
        fast = ief.per_sample(c.model, c.inputs, c.targets)
    assert_rel(fast.jacobian, jac, T5_RTOL, "jacobian (hooked prompts)")
    with pytest.raises(ValueError, match="prompt-tuning"):
        ief.per_sample_prompts(t5_lora_case().model)


def test_sample_axis_probe_leaves_the_model_and_random_state_untouched():
    """The one-sample probe forward that establishes the sample axes restores the random state and the buffers (batch
    norm running statistics in train mode with check=False): per_sample changes them exactly as one forward does."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2)).double()
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randint(0, 2, (5,))
    reference = copy.deepcopy(model)
    torch.manual_seed(1)
    reference(x)
    after_forward = torch.rand(1)
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ief.SlowPathWarning)
        ief.per_sample(model, x, y, check=False)
    assert torch.equal(torch.rand(1), after_forward)
    for (name, b), b_ref in zip(model.named_buffers(), reference.buffers()):
        assert torch.equal(b, b_ref), name


# ---------------------------------------------------------------------------------------- the factored Jacobian
@pytest.mark.parametrize("factored", ["ghost", "rows", "auto"])
def test_factored_jacobian_products_equal_the_dense_ones(any_case, factored):
    """What the Gram solve and the guard use of a FactoredJacobian, against the same quantities of the dense J of
    the same backward: ``J J^T``, ``J^T c``, ``J v``, ``J^T 1``, per-parameter row norms, ``max|J|`` (an upper
    bound within a factor T). Rounding only: ``1e-12`` relative (float64)."""
    from ief.rows import DenseRows

    c = any_case
    torch.manual_seed(0)
    jac = ief.per_sample(c.model, c.inputs, c.targets, loss=c.loss).jacobian
    torch.manual_seed(0)
    fac = ief.per_sample(c.model, c.inputs, c.targets, loss=c.loss, form=factored).jacobian
    assert isinstance(fac, ief.rows.FactoredJacobian) and fac.shape == jac.shape and fac.dtype == jac.dtype
    gen = torch.Generator().manual_seed(0)
    coeff = torch.randn(jac.shape[0], generator=gen, dtype=torch.float64)
    v = torch.randn(jac.shape[1], generator=gen, dtype=torch.float64)
    assert_rel(fac.materialize(), jac, 1e-12, "materialize")
    for scale in (1.0, 3.0):
        assert_rel(fac.gram(scale), DenseRows(jac).gram(scale), 1e-12, "gram")
        assert_rel(fac.combine_rows(coeff, scale), DenseRows(jac).combine_rows(coeff, scale), 1e-12, "J^T c")
        assert_rel(fac.times(v, scale), jac.double() @ v / scale, 1e-12, "J v")
    assert_rel(fac.row_sum(), jac.sum(0), 1e-12, "J^T 1")
    sizes = [p.numel() for p in oracle.trainable(c.model)]
    blocks = torch.stack([b.square().sum(1) for b in jac.split(sizes, dim=1)], dim=1)
    assert_rel(fac.row_sqnorms(), blocks, 1e-12, "row norms per parameter")
    bound, truth = fac.max_abs(), float(jac.abs().max())
    assert truth * (1 - 1e-12) <= bound
    assert fac.is_finite()


def test_auto_form_keeps_mlp_weights_as_factors_and_long_sequences_as_rows():
    """``form="auto"`` (the optimisers' default) picks per Linear weight: factors for an MLP (T = 1: the ghost Gram
    costs M^2 (I + O), rows M I O), rows when T^2 is large against I O (a 4 -> 5 Linear over 40 positions)."""
    c = mlp_case()
    fac = ief.per_sample(c.model, c.inputs, c.targets, form="auto").jacobian
    weights = {i for i, p in enumerate(c.model.parameters()) if p.dim() == 2}
    assert {i for i, _, _ in fac.ghosts} == weights
    assert fac.dense.shape[1] == sum(p.numel() for p in c.model.parameters() if p.dim() == 1)  # biases only
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 5).double()
    x, y = torch.randn(3, 40, 4, dtype=torch.float64), torch.randint(0, 5, (3, 40))
    fac = ief.per_sample(model, x, y, form="auto").jacobian
    assert not fac.ghosts and fac.dense.shape[1] == 25
    assert ief.rows.prefer_ghost("auto", 64, 1, 3072, 2048)
    assert not ief.rows.prefer_ghost("auto", 64, 512, 768, 8)


class _TiedLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.nn.functional.linear(torch.tanh(self.lin(x)), self.lin.weight)


@pytest.mark.filterwarnings("ignore::ief.SlowPathWarning")
@pytest.mark.parametrize("factored", ["ghost", "rows"])
def test_factored_form_of_a_linear_weight_used_outside_its_module_takes_the_loop(factored):
    """``J^T 1`` from the factors would miss the weight's use outside its Linear: the weight takes the loop."""
    torch.manual_seed(0)
    model = _TiedLinear().double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 4, (5,))
    _, jac, _ = oracle.per_sample(model, x, y)
    got = ief.per_sample(model, x, y, form=factored).jacobian
    assert not got.ghosts
    assert_rel(got.materialize(), jac, F64_RTOL, "jacobian")


@pytest.mark.parametrize("factored", ["ghost", "rows", "auto"])
def test_factored_jacobian_at_a_subnormal_scale_gives_the_dense_and_oracle_direction(factored):
    """``max|J| ~ 1e-310`` (float64 subnormals): the Gram is formed from ``J / max|J|`` (``gram_scale``), so each
    factored layer's ``G`` is scaled by ``max|A| / max|J|``, a ratio that overflows unless it is formed without
    intermediates past float64's range. ``eqn:iEF_lsq`` at ``lambda = 0`` is invariant under ``(J, s) -> (cJ, cs)``
    (``d = J^T (J J^T)^{-1} s`` with ``M <= P`` and full row rank), so the iEF direction of the factors scaled by
    ``c = 1e-310`` with ``c s`` equals the float64 oracle's ``d`` of the unscaled per-sample loop, and the dense
    route's on ``c J``. Tolerance: subnormal entries keep ~13 significant digits."""
    c = mlp_case()
    _, j0, s0 = oracle.per_sample(c.model, c.inputs, c.targets)
    expected = j0.T @ torch.linalg.solve(j0 @ j0.T, s0)
    fac = ief.per_sample(c.model, c.inputs, c.targets, form=factored).jacobian
    tiny = 1e-310
    fac.ghosts = [(i, a, g * tiny) for i, a, g in fac.ghosts]
    fac.dense = fac.dense * tiny
    assert (fac.ghosts or factored == "rows") and 0.0 < fac.max_abs() < torch.finfo(torch.float64).tiny
    dense_j = fac.materialize()
    assert_rel(dense_j / tiny, j0, 1e-10, "the scaled factors are tiny * J")
    got = ief.ief_direction(fac, tiny * s0, 0.0)
    assert torch.isfinite(got).all()
    assert_rel(got, expected, 1e-8, "factored direction vs oracle")
    assert_rel(got, ief.ief_direction(dense_j, tiny * s0, 0.0), 1e-8, "factored vs dense route")


@pytest.mark.parametrize("bad", ["Dense", "factored", None, 1])
def test_unknown_form_is_refused(bad):
    c = mlp_case()
    with pytest.raises(ValueError, match="form must be one of 'dense', 'auto', 'ghost', 'rows'"):
        ief.per_sample(c.model, c.inputs, c.targets, form=bad)


def test_the_hooked_backward_skips_the_batch_weight_gradients(monkeypatch):
    """Stand-ins (``ief.jacobian.PerSampleCapture``): the backward of ``per_sample`` runs only the input-gradient
    matmuls of a 3-layer MLP (2), not its 3 batch weight-gradient matmuls; the SF path's plain gradient runs all 5."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountMatmuls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func.overloadpacket.__name__ in ("mm", "addmm", "bmm", "baddbmm")
            return func(*args, **(kwargs or {}))

    real, counts = torch.autograd.grad, []

    def counted(*args, **kwargs):
        with CountMatmuls() as mode:
            out = real(*args, **kwargs)
        counts.append(mode.count)
        return out

    monkeypatch.setattr(torch.autograd, "grad", counted)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 7), torch.nn.Tanh(),
                                torch.nn.Linear(7, 3)).double()
    x, y = torch.randn(4, 5, dtype=torch.float64), torch.randint(0, 3, (4,))
    got = ief.per_sample(model, x, y)
    assert counts == [2]
    counts.clear()
    _, grad, _ = ief.jacobian.gradient_and_sampled_jacobian(model, x, y)
    assert counts == [5, 2]
    monkeypatch.undo()
    expected = oracle.gradient(model, x, y)
    assert_rel(got.gradient, expected, F64_RTOL, "gradient from the rows")
    assert_rel(grad, expected, F64_RTOL, "plain gradient")


# ------------------------------------------------------------------------------------------------ non-finite input
@pytest.mark.parametrize("form", ["dense", "auto"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_samples_are_named_not_returned_as_nan_rows(form, bad):
    """Before: NaN rows came back without error. Now ``FloatingPointError`` names the non-finite samples (with
    ``check=False`` too); the optimisers' contract (``FloatingPointError`` naming the step) holds."""
    c = mlp_case()
    x = c.inputs.clone()
    x[1, 0] = bad
    x[3, 2] = bad
    for check in (True, False, "exact"):
        with pytest.raises(FloatingPointError, match=r"samples \[1, 3\] \(of 6\)"):
            ief.per_sample(c.model, x, c.targets, check=check, form=form)
    # the draw checks NaN logits
    with pytest.raises(FloatingPointError, match=r"samples \[1, 3\]|logits hold nan at index \(1, "):
        ief.sampled_jacobian(c.model, x, c.targets, form=form)
    with pytest.raises(FloatingPointError, match=r"step 0: .*samples \[1, 3\]"):
        ief.optim.IEF(c.model, lr=0.1, form=form).step(x, c.targets)


def test_a_non_finite_row_with_a_finite_loss_is_named(monkeypatch):
    """A row can overflow while its loss is finite: the rows are checked too."""
    c = mlp_case()
    real = ief.jacobian.assemble._backward_jacobian

    def overflowing(*args, **kwargs):
        jac, autograd = real(*args, **kwargs)
        jac[2, 0] = float("inf")
        return jac, autograd

    monkeypatch.setattr(ief.jacobian.assemble, "_backward_jacobian", overflowing)
    with pytest.raises(FloatingPointError, match=r"non-finite per-sample gradient for samples \[2\]"):
        ief.per_sample(c.model, c.inputs, c.targets)


# ------------------------------------------------------------------- the forms, SF's pair, the warning, the RNG
def test_forced_forms_keep_every_linear_weight_as_factors_or_as_rows():
    """``form="ghost"`` keeps every ``nn.Linear`` weight as ``(A, G)`` factors, ``"rows"`` none; both give the oracle's
    ``J``."""
    c = mlp_case()
    _, expected, _ = oracle.per_sample(c.model, c.inputs, c.targets)
    weights = {i for i, p in enumerate(c.model.parameters()) if p.dim() == 2}
    ghost = ief.per_sample(c.model, c.inputs, c.targets, form="ghost").jacobian
    rows = ief.per_sample(c.model, c.inputs, c.targets, form="rows").jacobian
    assert {i for i, _, _ in ghost.ghosts} == weights and not rows.ghosts
    assert rows.dense.shape == expected.shape
    for fac in (ghost, rows):
        assert_rel(fac.materialize(), expected, F64_RTOL, "J")


@pytest.mark.parametrize("t", [1, 2, 3])
def test_ghost_kernel_over_t_positions_is_the_dense_gram(t):
    """``(J J^T)_{nm} = sum_{t,s} <a_nt, a_ms> <g_nt, g_ms>`` for every ``T``
    (``T = 1`` takes ``(A A^T) * (G G^T)``)."""
    from ief.rows import DenseRows

    torch.manual_seed(t)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3)).double()
    x, y = torch.randn(5, t, 4, dtype=torch.float64), torch.randint(0, 3, (5, t))
    _, expected, _ = oracle.per_sample(model, x, y)
    fac = ief.per_sample(model, x, y, form="ghost").jacobian
    assert len(fac.ghosts) == 2 and all(a.shape[1] == t for _, a, _ in fac.ghosts)
    assert_rel(fac.gram(), DenseRows(expected).gram(), 1e-12, "gram")
    assert_rel(fac.materialize(), expected, F64_RTOL, "J")


class _TwiceLinear(torch.nn.Module):
    """One ``nn.Linear`` called twice: its rows sum both calls (positions concatenated in the factored form)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.lin(torch.tanh(self.lin(x))))


@pytest.mark.parametrize("form", ["dense", "ghost", "rows"])
def test_a_linear_called_twice_sums_both_calls(form):
    from ief.rows import DenseRows

    torch.manual_seed(0)
    model = _TwiceLinear().double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    _, expected, _ = oracle.per_sample(model, x, y)
    got = ief.per_sample(model, x, y, form=form).jacobian
    assert_rel(dense(got), expected, F64_RTOL, "J")
    g = got.gram() if form != "dense" else DenseRows(got).gram()
    assert_rel(g, DenseRows(expected).gram(), 1e-12, "gram")


def test_float32_factored_combination_is_float64_unless_final():
    """``FactoredJacobian.combine_rows``: ``(J/scale)^T c`` in float64; only ``final=True`` writes the model's dtype."""
    c = mlp_case(dtype=torch.float32)
    fac = ief.per_sample(c.model, c.inputs, c.targets, form="ghost").jacobian
    coeff = torch.randn(fac.shape[0], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    expected = fac.materialize().double().T @ coeff
    for got in (fac.combine_rows(coeff), fac.combine_rows(coeff, 1.0, False)):
        assert got.dtype == torch.float64
        assert_rel(got, expected, F32_RTOL, "J^T c")  # (expected from J rounded to float32)
    final = fac.combine_rows(coeff, 1.0, True)
    assert final.dtype == torch.float32
    assert_rel(final, expected, F32_RTOL, "J^T c, final")


@pytest.mark.parametrize("form", ["dense", "ghost"])
def test_gradient_and_sampled_jacobian_against_the_oracle(form):
    """``alg:SF``'s pair: ``(losses, grad L, A)`` with ``A``'s rows the per-sample gradients at labels drawn from the
    model's predictive distribution, the same draws as ``ief.sampled_jacobian`` with the same generator."""
    c = mlp_case()
    losses, grad = oracle.per_sample(c.model, c.inputs, c.targets)[0], oracle.gradient(c.model, c.inputs, c.targets)
    got_losses, got_grad, sampled = ief.jacobian.gradient_and_sampled_jacobian(
        c.model, c.inputs, c.targets, generator=torch.Generator().manual_seed(3), form=form)
    assert_rel(got_losses, losses, F64_RTOL, "losses")
    assert_rel(got_grad, grad, F64_RTOL, "gradient")
    reference = ief.sampled_jacobian(c.model, c.inputs, c.targets, torch.Generator().manual_seed(3))
    assert_rel(dense(sampled), reference, F64_RTOL, "sampled J")
    drawn = _redraw_labels(c.model, c.inputs, c.targets, 3, c.loss)
    assert_rel(dense(sampled), oracle.per_sample(c.model, c.inputs, drawn)[1], F64_RTOL, "sampled J vs oracle")


class _TwoBare(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.p = torch.nn.Parameter(torch.randn(3))
        self.q = torch.nn.Parameter(torch.randn(3))

    def forward(self, x):  # neither p nor q is only added or expanded (ief.jacobian.broadcast): both take the loop
        return self.lin(x) * self.p + self.q.sin()


def test_slow_path_warning_once_per_model_and_set_of_loop_parameters():
    """One :class:`ief.SlowPathWarning` per model and set of parameters taking the loop: a second set warns again,
    a repeated set does not."""
    torch.manual_seed(0)
    model = _TwoBare().double()
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randint(0, 3, (4,))

    def warned(params):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ief.per_sample(model, x, y, params)
        return [str(w.message) for w in caught if issubclass(w.category, ief.SlowPathWarning)]

    first = warned([model.p])
    assert len(first) == 1 and "1 of 1 parameter tensors" in first[0] and ": p (" in first[0]
    second = warned([model.q])
    assert len(second) == 1 and ": q (" in second[0]
    assert warned([model.p]) == [] and warned([model.q]) == []


def test_an_embedding_is_hooked_not_looped():
    """A plain ``nn.Embedding`` (no ``max_norm``, no ``scale_grad_by_freq``) has a per-sample rule: no slow-path
    warning, the oracle's rows."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(7, 4), torch.nn.Linear(4, 3)).double()
    x, y = torch.randint(0, 7, (5, 3)), torch.randint(0, 3, (5, 3))
    _, expected, _ = oracle.per_sample(model, x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ief.SlowPathWarning)
        got = ief.per_sample(model, x, y).jacobian
    assert_rel(got, expected, F64_RTOL, "J")


@pytest.mark.parametrize("check", [True, "exact"])
def test_the_check_leaves_the_global_random_state_untouched(check):
    """The check's random tangents come from its own seeded generator, not torch's global RNG."""
    c = sequence_case()
    torch.manual_seed(123)
    state = torch.get_rng_state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ief.SlowPathWarning)
        ief.per_sample(c.model, c.inputs, c.targets, check=check)
    assert torch.equal(torch.get_rng_state(), state)


def test_the_non_finite_error_says_what_to_do():
    c = mlp_case()
    x = c.inputs.clone()
    x[2, 1] = float("nan")
    with pytest.raises(FloatingPointError) as err:
        ief.per_sample(c.model, x, c.targets)
    assert str(err.value) == (
        "non-finite loss for samples [2] (of 6): a NaN or inf in those samples' inputs, logits or targets, or in the "
        "parameters; per-sample gradients are refused rather than returned as non-finite rows (drop or fix those "
        "samples)")


@pytest.mark.parametrize("form", ["ghost", "auto"])
def test_a_factored_layer_with_all_zero_inputs_or_output_gradients(form):
    """A layer whose inputs ``A`` (or output gradients ``G``) are all zero has zero rows: its factors are not
    rescaled by ``max|A| = 0`` (which would make them NaN), and the Gram, ``J^T c`` and the direction are the
    oracle's."""
    from ief.rows import DenseRows

    c = mlp_case()
    x = torch.zeros_like(c.inputs)  # the first Linear's inputs: A = 0
    _, expected, s = oracle.per_sample(c.model, x, c.targets)
    got = ief.per_sample(c.model, x, c.targets, form=form).jacobian
    assert any(float(a.abs().max()) == 0.0 for _, a, _ in got.ghosts)
    for scale in (1.0, 1e-60):
        assert_rel(got.gram(scale), DenseRows(expected).gram(scale), 1e-12, f"gram at scale {scale}")
    coeff = torch.linspace(-1, 1, expected.shape[0], dtype=torch.float64)
    assert_rel(got.combine_rows(coeff), expected.T @ coeff, 1e-12, "J^T c")
    assert_rel(ief.ief_direction(got, s, 1e-3), ief.ief_direction(expected, s, 1e-3), 1e-10, "iEF direction")


class _TwiceConv(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 2, 3, padding=1)
        self.head = torch.nn.Linear(2 * 4 * 4, 3)

    def forward(self, x):
        return self.head(self.conv(torch.tanh(self.conv(x))).flatten(1))


@pytest.mark.parametrize("form", ["dense", "ghost", "rows"])
def test_a_conv2d_called_twice_sums_both_calls(form):
    torch.manual_seed(0)
    model = _TwiceConv().double()
    x, y = torch.randn(3, 2, 4, 4, dtype=torch.float64), torch.randint(0, 3, (3,))
    _, expected, _ = oracle.per_sample(model, x, y)
    assert_rel(dense(ief.per_sample(model, x, y, form=form).jacobian), expected, F64_RTOL, "J")


def test_a_tied_weight_is_named_with_the_reason_it_takes_the_loop():
    torch.manual_seed(0)
    model = _TiedLinear().double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 4, (5,))
    with pytest.warns(ief.SlowPathWarning, match=r"lin\.weight, lin\.bias \(lin\.weight also used outside its Linear "
                                                 r"\(e\.g\. tied weights\)\)"):
        ief.per_sample(model, x, y)


class _WideHead(torch.nn.Module):
    """Tokens to a 4096-word vocabulary through a 4-wide embedding: the ``[M, T, V]`` logits (8 MiB at M 8, T 64) are
    the step's largest tensor, as a causal LM's are, and the parameters are small."""

    def __init__(self, vocab: int = 4096, width: int = 4):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, ids):
        return self.head(torch.tanh(self.embed(ids)))


def test_a_steady_call_lets_the_logits_go_before_its_backward():
    """A first-order step drops the logits once its loss is formed; so does a steady ``per_sample``: s_iEF is taken
    before the backward, a chunk of positions at a time, and nothing keeps the logits through the backward. Its peak
    then stays within a fraction of the logits of a plain backward's (keeping them, or the whole-logits s_iEF, added
    one to four logits' worth)."""
    from tests.memory import peak_added_bytes

    torch.manual_seed(0)
    model = _WideHead()
    ids = torch.randint(0, 4096, (8, 64))
    targets = torch.randint(0, 4096, (8, 64))
    logits_bytes = 8 * 64 * 4096 * 4

    def backward():
        model.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(ids).reshape(-1, 4096), targets.reshape(-1), reduction="sum")
        loss.backward()  # the logits are not held here: only what the loss's backward saved

    def steady():
        ief.per_sample(model, ids, targets, form="auto")

    for _ in range(2):  # the first call proves the sample axis
        backward(), steady()
    plain, ours = peak_added_bytes(backward), peak_added_bytes(steady)
    assert ours - plain < 0.5 * logits_bytes, f"per_sample's peak {ours / 2**20:.1f} MiB, a backward's " \
        f"{plain / 2**20:.1f} MiB, the logits {logits_bytes / 2**20:.0f} MiB"
