"""``ief.fisher_vp`` and ``ief.gamma`` against the dense float64 oracle.

Paper references: the indicator ``gamma(d) = sqrt(d^T F d) / |d^T grad L|`` (sec:eval_framework, alg:eval); the exact
Fisher as GGN, ``F = sum_n J_{z_n}^T H_n J_{z_n}`` computed matrix-free (sec:app-eval-complexity); for the squared
error the Fisher is the Gauss-Newton matrix (sec:app-lls, eqn:lls-F-equal).
"""
from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import ief
import oracle
from curvature_reference import directions, model_dtype, num_params, reference, rtol
from tiny_models import SquareNoJvp, mlp_case, mse_case, t5_lora_case

METHODS = ("forward", "double_backward")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().to(torch.float64), b.detach().to(torch.float64)
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _randn(case, k: int = 1, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(k, num_params(case), generator=gen, dtype=torch.float64).to(model_dtype(case))


# ----------------------------------------------------------------------------------------------- fisher_vp
@pytest.mark.parametrize("method", METHODS)
def test_fisher_vp_matches_dense_oracle(any_case, method):
    """sec:app-eval-complexity: the matrix-free product equals the explicit eqn:FIM sum times v, for random
    vectors, the gradient, and a vector in the null space of F (where the product must vanish)."""
    ref = reference(any_case.name)
    tol = rtol(any_case.name)
    vectors = list(_randn(any_case, 2)) + [ref.gradient.to(model_dtype(any_case))]
    for v in vectors:
        fv = ief.fisher_vp(any_case.model, any_case.inputs, any_case.targets, v, loss=any_case.loss, method=method)
        assert fv.shape == (num_params(any_case),)
        assert fv.dtype == model_dtype(any_case)
        assert _rel(fv, ref.fisher @ v.double()) < tol
    if ref.null_basis.shape[1]:
        null = ref.null_basis @ torch.ones(ref.null_basis.shape[1], dtype=torch.float64)
        fv = ief.fisher_vp(any_case.model, any_case.inputs, any_case.targets, null, loss=any_case.loss, method=method)
        scale = float(ref.fisher.norm(2)) * float(null.norm())
        assert float(fv.norm()) < 10 * tol * scale


def test_fisher_vp_methods_agree(any_case):
    """Forward-mode JVP and the double-backward trick of sec:app-eval-complexity compute the same product."""
    (v,) = _randn(any_case, 1, seed=7)
    a = ief.fisher_vp(any_case.model, any_case.inputs, any_case.targets, v, loss=any_case.loss, method="forward")
    b = ief.fisher_vp(any_case.model, any_case.inputs, any_case.targets, v, loss=any_case.loss,
                      method="double_backward")
    assert _rel(a, b) < rtol(any_case.name)


@pytest.mark.parametrize("method", METHODS)
def test_fisher_vp_linear_symmetric_psd(any_case, method):
    """F is a fixed symmetric PSD matrix: F(a u + b v) = a Fu + b Fv, u^T F v = v^T F u, v^T F v >= 0."""
    tol = rtol(any_case.name)
    u, v, w = _randn(any_case, 3, seed=3)

    def fvp(x):
        return ief.fisher_vp(any_case.model, any_case.inputs, any_case.targets, x, loss=any_case.loss,
                             method=method).double()

    fu, fv = fvp(u), fvp(v)
    a, b = 2.5, -0.75
    assert _rel(fvp(a * u + b * v), a * fu + b * fv) < tol
    lhs, rhs = float(u.double() @ fv), float(v.double() @ fu)
    assert abs(lhs - rhs) <= tol * float(u.double().norm() * fv.norm() + v.double().norm() * fu.norm())
    for x in (u, v, w, u - v):
        fx = fvp(x)
        assert float(x.double() @ fx) >= -tol * float(x.double().norm() * fx.norm())
    # strictly positive along the gradient, which lies in range(F)
    g = reference(any_case.name).gradient.to(model_dtype(any_case))
    assert float(g.double() @ fvp(g)) > 0


def test_fisher_vp_params_subset_is_principal_submatrix():
    """With ``params=`` (any order) the product is with the principal sub-block of F in that order."""
    case = mlp_case()
    ref = reference("mlp")
    head = case.model[2]
    n_w, n_b = head.weight.numel(), head.bias.numel()
    total = num_params(case)
    idx = torch.cat([torch.arange(total - n_b, total), torch.arange(total - n_b - n_w, total - n_b)])
    v = torch.randn(n_w + n_b, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    for method in METHODS:
        fv = ief.fisher_vp(case.model, case.inputs, case.targets, v, params=[head.bias, head.weight], method=method)
        assert _rel(fv, ref.fisher[idx][:, idx] @ v) < 1e-10


def test_fisher_vp_float32_model():
    """Results follow the model dtype (package conventions); a float32 model matches the float64 oracle to float32
    accuracy."""
    case = mlp_case()
    ref = reference("mlp")
    model32 = case.model.float()
    (v,) = _randn(case, 1, seed=11)
    for method in METHODS:
        fv = ief.fisher_vp(model32, case.inputs.float(), case.targets, v.float(), method=method)
        assert fv.dtype == torch.float32
        assert _rel(fv, ref.fisher @ v.double()) < 1e-5
    g32 = ief.gamma(model32, case.inputs.float(), case.targets, v.float())
    assert g32 == pytest.approx(ref.gamma(v), rel=1e-5)


def test_fisher_vp_mse_is_gauss_newton():
    """loss="mse": F v = J_z^T J_z v with J_z the full logit Jacobian (sec:app-lls), computed here with
    torch.func.jacrev independently of the oracle's Fisher."""
    case = mse_case()
    params = dict(case.model.named_parameters())
    names = list(params)

    def logits(*flat):
        return torch.func.functional_call(case.model, dict(zip(names, flat)), (case.inputs,)).reshape(-1)

    jz = torch.cat([j.reshape(j.shape[0], -1) for j in torch.func.jacrev(logits, argnums=tuple(range(len(names))))(
        *params.values())], dim=1)  # [M*K, P]
    assert jz.shape == (case.targets.numel(), num_params(case))
    for v in _randn(case, 3, seed=2):
        for method in METHODS:
            fv = ief.fisher_vp(case.model, case.inputs, case.targets, v, loss="mse", method=method)
            assert _rel(fv, jz.T @ (jz @ v)) < 1e-12


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor produced by any ATen op run under it."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_P_by_P_matrix_is_formed():
    """sec:app-eval-complexity / sec:app-eval-tradition: the products cost O(P) memory, never a P x P matrix.
    Every ATen op output is inspected; none may have more than a few P entries (P^2 = 23 million here)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 10)).double()
    x, y = torch.randn(8, 64, dtype=torch.float64), torch.randint(0, 10, (8,))
    p = sum(q.numel() for q in model.parameters())
    v = torch.randn(p, dtype=torch.float64)
    with _LargestTensor() as probe:  # the probe itself works: an outer product is seen
        torch.outer(v, v)
    assert probe.largest == p * p
    for method in METHODS:
        for call in (lambda: ief.fisher_vp(model, x, y, v, method=method),
                     lambda: ief.gamma(model, x, y, v, method=method),
                     lambda: ief.hessian_free(model, x, y, 3, method=method, return_gammas=True)):
            with _LargestTensor() as probe:
                call()
            assert 0 < probe.largest <= 2 * p


def test_fisher_vp_rejects_bad_input():
    case = mlp_case()
    p = num_params(case)
    for bad in (torch.zeros(p - 1, dtype=torch.float64), torch.zeros(1, p, dtype=torch.float64)):
        with pytest.raises(ValueError):
            ief.fisher_vp(case.model, case.inputs, case.targets, bad)
    with pytest.raises(ValueError):
        ief.fisher_vp(case.model, case.inputs, case.targets, torch.zeros(p, dtype=torch.float64), method="nope")


# ----------------------------------------------------------------------------------------------- gamma
@pytest.mark.parametrize("method", METHODS)
def test_gamma_matches_dense_oracle(any_case, method):
    """gamma(d) = sqrt(d^T F d)/|d^T grad L| (sec:eval_framework, alg:eval) for the directions the paper compares
    (SGD = gradient, iEF, EF, SF) and a random one, against the dense oracle F and gradient."""
    ref = reference(any_case.name)
    for name, d in directions(any_case).items():
        got = ief.gamma(any_case.model, any_case.inputs, any_case.targets, d, loss=any_case.loss, method=method)
        assert isinstance(got, float)
        assert got == pytest.approx(ref.gamma(d), rel=rtol(any_case.name)), name
        # the indicator can never beat the exact natural gradient (eqn:natural_gradient_alt)
        assert got >= ref.gamma_star * (1 - rtol(any_case.name)), name


def test_gamma_scale_and_sign_invariant(any_case):
    """gamma is invariant to the scale and sign of d (sec:eval_framework: it rates a direction only)."""
    for name, d in directions(any_case).items():
        base = ief.gamma(any_case.model, any_case.inputs, any_case.targets, d, loss=any_case.loss)
        scaled = ief.gamma(any_case.model, any_case.inputs, any_case.targets, -3.7 * d, loss=any_case.loss)
        assert scaled == pytest.approx(base, rel=max(rtol(any_case.name), 1e-12)), name


@pytest.mark.parametrize("method", METHODS)
def test_gamma_is_inf_for_a_direction_orthogonal_to_the_gradient(method):
    """d^T grad L = 0 with d^T F d > 0 gives gamma = inf. Construction (exact in floating point): squared error
    whose second output is fitted exactly (targets copied from the logits), d = the second output's bias. Then
    J_z d = (0, 1) for every sample, the slope sum_n (z_n1 - y_n1) is exactly 0 and d^T F d = M."""
    case = mse_case()
    with torch.no_grad():
        z = case.model(case.inputs)
    targets = case.targets.clone()
    targets[:, 1] = z[:, 1]
    d = torch.zeros(num_params(case), dtype=torch.float64)
    d[-1] = 1.0  # last parameter = bias of output 1
    fd = ief.fisher_vp(case.model, case.inputs, targets, d, loss="mse", method=method)
    assert float(d @ fd) == pytest.approx(case.targets.shape[0], rel=1e-12)
    assert ief.gamma(case.model, case.inputs, targets, d, loss="mse", method=method) == math.inf


def test_gamma_huge_for_numerically_orthogonal_direction(any_case):
    """Projecting the gradient out of a random direction makes d^T grad L vanish up to rounding: gamma blows up
    (or is inf), by many orders of magnitude above the gradient's own gamma."""
    ref = reference(any_case.name)
    g = ref.gradient
    (r,) = _randn(any_case, 1, seed=13)
    d = r.double() - (r.double() @ g) / (g @ g) * g
    assert float(d @ ref.fisher @ d) > 0
    got = ief.gamma(any_case.model, any_case.inputs, any_case.targets, d.to(model_dtype(any_case)), loss=any_case.loss)
    base = ref.gamma(g)
    assert got == math.inf or got > base / (1e3 * rtol(any_case.name))


def test_gamma_rejects_zero_and_wrong_length_directions():
    case = mlp_case()
    p = num_params(case)
    for zero in (torch.zeros(p, dtype=torch.float64), -torch.zeros(p, dtype=torch.float64)):
        with pytest.raises(ValueError):
            ief.gamma(case.model, case.inputs, case.targets, zero)
        with pytest.raises(ValueError):
            ief.gamma(case.model, case.inputs, case.targets, zero, method="double_backward")
    for bad in (torch.ones(p - 1, dtype=torch.float64), torch.ones(p + 1, dtype=torch.float64),
                torch.ones(1, p, dtype=torch.float64)):
        with pytest.raises(ValueError):
            ief.gamma(case.model, case.inputs, case.targets, bad)
    nan = torch.ones(p, dtype=torch.float64)
    nan[3] = float("nan")
    with pytest.raises(ValueError):
        ief.gamma(case.model, case.inputs, case.targets, nan)


def test_gamma_under_inference_mode_is_not_silently_inf():
    """``ief.gamma`` called under ``torch.inference_mode()`` (natural in an evaluation loop) must give the right value
    or raise, never a silent ``inf``: under inference mode forward-mode AD drops tangents, so the package switches
    inference mode off for its own passes."""
    case = mlp_case()
    ref = reference("mlp")
    expected = ref.gamma(ref.gradient)
    with torch.inference_mode():
        got = ief.gamma(case.model, case.inputs, case.targets, ref.gradient.clone())
    assert got == pytest.approx(expected, rel=1e-10), "gamma under inference_mode returned a wrong value"



# ----------------------------------------------------------------------------------------------- train mode
def _seeded(fn, seed: int = 1234):
    torch.manual_seed(seed)
    return fn()


def _plain_gradient(case) -> torch.Tensor:
    """grad L from an ordinary forward and backward (draws the dropout masks like a training step would)."""
    params = [p for p in case.model.parameters() if p.requires_grad]
    logits = case.model(**case.inputs).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), case.targets.reshape(-1),
                                             ignore_index=-100, reduction="sum")
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)])


def test_fisher_vp_train_mode_dropout():
    """t5-lora in train() mode: LoRA dropout (p=0.1) is active.

    Observed and documented (ief.model_call.ReplayableForward): each *call* draws fresh dropout masks from the
    global RNG, as an ordinary forward would, so two successive ``fisher_vp`` calls at the same point differ (they
    are products with two different Fishers). Within one call the masks are consistent: under the same RNG state
    the product is reproducible bit for bit, identical for both methods (the dual forward draws the same mask as a
    plain forward), and symmetric (it is the product with one well-defined F)."""
    case = t5_lora_case()
    case.model.train()
    u, v = _randn(case, 2, seed=17)

    def fvp(x, method="forward"):
        return ief.fisher_vp(case.model, case.inputs, case.targets, x, method=method)

    first, second = fvp(v), fvp(v)
    assert _rel(first, second) > 1e-3  # new masks per call
    a, b = _seeded(lambda: fvp(v)), _seeded(lambda: fvp(v))
    assert torch.equal(a, b)
    assert _rel(_seeded(lambda: fvp(v, "double_backward")), a) < 1e-6
    fu = _seeded(lambda: fvp(u))
    assert abs(float(u @ a) - float(v @ fu)) <= 1e-6 * float(u.norm() * a.norm() + v.norm() * fu.norm())
    # the eval-mode product is a different matrix (dropout off)
    case.model.eval()
    assert _rel(fvp(v), a) > 1e-3


def test_hessian_free_train_mode_replays_one_mask():
    """In train mode hessian_free's products all replay one dropout mask (the one its gradient saw), so CG works on
    one fixed F: its gammas never increase (sec:app-CG-gamma), its first iterate is the exact line search along
    the plain-forward gradient of that mask, and the reported gamma of the final iterate is what ``ief.gamma``
    computes from the same RNG state."""
    case = t5_lora_case()
    case.model.train()
    res = _seeded(lambda: ief.hessian_free(case.model, case.inputs, case.targets, 12, return_gammas=True))
    gammas = res.gammas
    assert len(gammas) == 12
    assert all(b <= a * (1 + 1e-6) for a, b in zip(gammas, gammas[1:])), gammas
    assert gammas[-1] < 0.8 * gammas[0]
    g = _seeded(lambda: _plain_gradient(case))
    fg = _seeded(lambda: ief.fisher_vp(case.model, case.inputs, case.targets, g))
    assert gammas[0] == pytest.approx(math.sqrt(float(g @ fg)) / float(g @ g), rel=1e-6)
    one = _seeded(lambda: ief.hessian_free(case.model, case.inputs, case.targets, 1))
    assert _rel(one, float(g @ g) / float(g @ fg) * g) < 1e-6
    again = _seeded(lambda: ief.gamma(case.model, case.inputs, case.targets, res.solution))
    assert again == pytest.approx(gammas[-1], rel=1e-6)


# ----------------------------------------------------------------------------------------------- FisherOperator
@pytest.mark.parametrize("method", METHODS)
def test_fisher_operator_gradient_matches_oracle(any_case, method):
    """``FisherOperator.gradient`` is grad L at the operator's point for both methods: with double backward it is
    ``J_z^T u`` at the probe ``u = dL/dz`` (the pass that builds the J_z v graph), with forward mode a lazy
    forward + backward; products made after reading it are unchanged (the probe's value does not enter J_z v)."""
    ref = reference(any_case.name)
    tol = rtol(any_case.name)
    op = ief.FisherOperator(any_case.model, any_case.inputs, any_case.targets, loss=any_case.loss, method=method)
    assert op.gradient.dtype == model_dtype(any_case)
    assert _rel(op.gradient, ref.gradient) < tol
    (v,) = _randn(any_case, 1, seed=19)
    assert _rel(op.matvec(v), ref.fisher @ v.double()) < tol
    assert _rel(op @ v, ref.fisher @ v.double()) < tol  # a second product on the same graphs


def test_fisher_vp_float32_sequence_with_masks_and_padding():
    """float32 sequence model with padding tokens and -100 targets: both methods match the float64 oracle to float32
    accuracy and agree with each other."""
    from tiny_models import sequence_case

    case = sequence_case()
    ref = reference("sequence")
    model32 = case.model.float()
    (v,) = _randn(case, 1, seed=23)
    got = {m: ief.fisher_vp(model32, case.inputs, case.targets, v.float(), method=m) for m in METHODS}
    for m, fv in got.items():
        assert fv.dtype == torch.float32
        assert _rel(fv, ref.fisher @ v.double()) < 1e-5, m
    assert _rel(got["forward"], got["double_backward"]) < 1e-5


# ----------------------------------------------------------------------------------------------- gammas (batched)
def _stack(case) -> torch.Tensor:
    """K = 7 directions: the paper's (SGD, iEF, EF, SF), a random one, a scaled-and-flipped copy, and a sparse one."""
    dirs = list(directions(case).values())
    sparse = torch.zeros_like(dirs[0])
    sparse[::3] = 1.0
    return torch.stack(dirs + [-2.5 * dirs[1], sparse])


@pytest.mark.parametrize("method", METHODS)
def test_gammas_equal_separate_gamma_calls(any_case, method):
    """``ief.gammas`` of K = 7 directions in one batched pass equals 7 separate ``ief.gamma`` calls to 1e-12 (float64),
    and the dense oracle (sec:eval_framework, alg:eval), on every tiny model: sequences with padding and -100
    positions, T5 / ViT LoRA, prompt tuning, the squared error."""
    ref = reference(any_case.name)
    stacked = _stack(any_case)
    got = ief.gammas(any_case.model, any_case.inputs, any_case.targets, stacked, loss=any_case.loss, method=method)
    assert isinstance(got, list) and len(got) == 7 and all(isinstance(g, float) for g in got)
    for k, d in enumerate(stacked):
        one = ief.gamma(any_case.model, any_case.inputs, any_case.targets, d, loss=any_case.loss, method=method)
        assert got[k] == pytest.approx(one, rel=1e-12), k
        assert got[k] == pytest.approx(ref.gamma(d), rel=rtol(any_case.name)), k


@pytest.mark.parametrize("method", METHODS)
def test_gammas_train_mode_replays_one_dropout_mask(method):
    """t5-lora in train() mode (LoRA dropout on): the batched pass draws the dropout masks exactly as one plain forward
    would, so from the same RNG state its K values equal K separate ``gamma`` calls, each started from that state."""
    case = t5_lora_case()
    case.model.train()
    stacked = _stack(case)
    got = _seeded(lambda: ief.gammas(case.model, case.inputs, case.targets, stacked, method=method))
    for k, d in enumerate(stacked):
        one = _seeded(lambda: ief.gamma(case.model, case.inputs, case.targets, d, method=method))
        assert got[k] == pytest.approx(one, rel=1e-12), k
    case.model.eval()  # a different function (dropout off): different values
    assert ief.gammas(case.model, case.inputs, case.targets, stacked)[1] != pytest.approx(got[1], rel=1e-6)


def test_gammas_float32_and_inference_mode():
    """float32 model: the batched values match the float64 oracle to float32 accuracy, also when called under
    ``torch.inference_mode()`` (which would drop forward-mode tangents if the package did not leave it)."""
    case = mlp_case()
    ref = reference("mlp")
    stacked = _stack(case)
    model32 = case.model.float()
    with torch.inference_mode():
        got = ief.gammas(model32, case.inputs.float(), case.targets, stacked.float())
    for k, d in enumerate(stacked):
        assert got[k] == pytest.approx(ref.gamma(d), rel=1e-5), k


def test_gammas_rejects_bad_directions():
    case = mlp_case()
    p = num_params(case)
    good = torch.ones(2, p, dtype=torch.float64)
    for bad in (torch.ones(p, dtype=torch.float64), torch.ones(2, p + 1, dtype=torch.float64),
                torch.ones(0, p, dtype=torch.float64), torch.ones(1, 2, p, dtype=torch.float64), [good]):
        with pytest.raises(ValueError, match=r"shape \[K, "):
            ief.gammas(case.model, case.inputs, case.targets, bad)
    nan = good.clone()
    nan[1, 3] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        ief.gammas(case.model, case.inputs, case.targets, nan)
    zero = good.clone()
    zero[1] = 0.0
    for method in METHODS:
        with pytest.raises(ValueError, match=r"directions\[1\] is zero"):
            ief.gammas(case.model, case.inputs, case.targets, zero, method=method)
    with pytest.raises(ValueError, match="unknown method"):
        ief.gammas(case.model, case.inputs, case.targets, good, method="nope")


def test_gammas_fall_back_to_double_backward_and_say_so():
    """A layer without a forward-mode rule: ``gammas`` warns once per model and returns the double-backward values
    (never a silently wrong tangent); ``fisher_vp(method="forward")`` still raises ForwardModeUnsupported."""

    model, x, y = _no_jvp_case()
    p = sum(q.numel() for q in model.parameters())
    stacked = torch.randn(3, p, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="double backward"):
        got = ief.gammas(model, x, y, stacked)
    expected = [ief.gamma(model, x, y, d, method="double_backward") for d in stacked]
    assert got == pytest.approx(expected, rel=1e-12)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ief.gammas(model, x, y, stacked) == pytest.approx(expected, rel=1e-12)  # no second warning
    with pytest.raises(ief.ForwardModeUnsupported):
        ief.fisher_vp(model, x, y, stacked[0], method="forward")


def test_fisher_vp_auto_takes_forward_mode_and_falls_back_without_changing_the_point():
    """``method="auto"`` (the default) is the forward-mode product where every layer has a forward rule (the very same
    numbers), and double backward where one has none: no error, the value of ``method="double_backward"`` from the
    same RNG state (the fallback replays the dropout masks the failed dual forward drew), remembered per model."""
    from ief.logit_jvp import NO_FORWARD_MODE

    case = mlp_case()
    v = torch.randn(num_params(case), generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    assert torch.equal(ief.fisher_vp(case.model, case.inputs, case.targets, v),
                       ief.fisher_vp(case.model, case.inputs, case.targets, v, method="forward"))
    assert case.model not in NO_FORWARD_MODE

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.drop, self.head = torch.nn.Linear(4, 5), torch.nn.Dropout(0.4), torch.nn.Linear(5, 3)

        def forward(self, x):
            return self.head(SquareNoJvp.apply(self.drop(self.inp(x))))

    torch.manual_seed(0)
    model = Model().double().train()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    d = torch.randn(sum(q.numel() for q in model.parameters()), generator=torch.Generator().manual_seed(4),
                    dtype=torch.float64)
    expected = _seeded(lambda: ief.fisher_vp(model, x, y, d, method="double_backward"))
    got = _seeded(lambda: ief.fisher_vp(model, x, y, d))
    torch.testing.assert_close(got, expected, rtol=1e-13, atol=1e-13)
    assert model in NO_FORWARD_MODE
    torch.testing.assert_close(_seeded(lambda: ief.fisher_vp(model, x, y, d)), expected, rtol=1e-13, atol=1e-13)
    with pytest.raises(ValueError, match="'auto', 'forward', 'double_backward'"):
        ief.fisher_vp(model, x, y, d, method="nope")


@pytest.mark.parametrize("value, reason", [(0.0, "underflowed to zero"), (-0.0, "underflowed to zero"),
                                           (math.inf, "d\\^T grad L rounded to zero"), (math.nan, "NaN"),
                                           (-1.0, "negative")])
def test_check_gamma_refuses_what_an_evaluation_must_never_record(value, reason):
    from ief.curvature import DegenerateIndicator, check_gamma

    with pytest.raises(DegenerateIndicator, match=rf"stage 50, batch 3: gamma of the sf direction is .*{reason}"):
        check_gamma(value, "sf", "stage 50, batch 3")
    assert issubclass(DegenerateIndicator, FloatingPointError)


def test_check_gamma_passes_finite_positive_values_through():
    from ief.curvature import check_gamma

    assert check_gamma(0.25, "ief") == 0.25
    assert check_gamma(5e-324, "ief") == 5e-324  # tiny but a measurement


# ------------------------------------------------------------------- one direction, params=, unused parameters
@pytest.mark.parametrize("method", METHODS)
def test_gammas_of_a_single_direction(method):
    """``K = 1`` is a valid batch: ``gammas`` of one direction is ``[gamma(d)]``, equal to the dense oracle."""
    case = mlp_case()
    ref = reference("mlp")
    d = _randn(case, 1, seed=3)
    got = ief.gammas(case.model, case.inputs, case.targets, d, method=method)
    assert isinstance(got, list) and len(got) == 1
    assert got[0] == pytest.approx(ref.gamma(d[0]), rel=1e-10)


@pytest.mark.parametrize("method", METHODS)
def test_gammas_on_a_parameter_subset(method):
    """``params=`` the first layer only: ``directions [K, P_1]`` rate as the full directions padded with zeros (the
    Fisher's principal block, the gradient's sub-vector), against the dense oracle."""
    case = mlp_case()
    ref = reference("mlp")
    first = list(case.model[0].parameters())
    p1 = sum(p.numel() for p in first)
    sub = torch.randn(2, p1, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    got = ief.gammas(case.model, case.inputs, case.targets, sub, params=first, method=method)
    padded = torch.zeros(2, num_params(case), dtype=torch.float64)
    padded[:, :p1] = sub
    assert got == pytest.approx([ref.gamma(d) for d in padded], rel=1e-10)


def test_gammas_error_messages_name_the_shape_and_the_accepted_values():
    case = mlp_case()
    p = num_params(case)
    with pytest.raises(ValueError, match=rf"^directions must have shape \[K, {p}\] \(K >= 1 rows, one entry per "
                                         r"trainable parameter\), got \(" + str(p) + r",\)$"):
        ief.gammas(case.model, case.inputs, case.targets, torch.ones(p, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"got list$"):
        ief.gammas(case.model, case.inputs, case.targets, [torch.ones(p, dtype=torch.float64)])
    nan = torch.ones(2, p, dtype=torch.float64)
    nan[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"^directions contain non-finite values$"):
        ief.gammas(case.model, case.inputs, case.targets, nan)
    with pytest.raises(ValueError, match=r"^unknown method 'nope'; accepted: 'forward', 'double_backward'$"):
        ief.gammas(case.model, case.inputs, case.targets, torch.ones(1, p, dtype=torch.float64), method="nope")


class _WithUnused(torch.nn.Module):
    """An MLP with a trainable layer that never reaches the logits (its Fisher rows and gradient are zero)."""

    def __init__(self):
        super().__init__()
        self.inp, self.unused, self.head = torch.nn.Linear(4, 5), torch.nn.Linear(2, 2), torch.nn.Linear(5, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.inp(x)))


@pytest.mark.parametrize("method", ("auto", *METHODS))
def test_fisher_vp_with_a_parameter_that_does_not_reach_the_logits(method):
    """``F v`` and ``grad L`` with an unused trainable parameter (zero rows and columns of ``F``) against the dense
    oracle, which sums explicitly over samples and classes."""
    torch.manual_seed(0)
    model = _WithUnused().double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    fisher = oracle.fisher(model, x, y)
    gradient = oracle.gradient(model, x, y)
    v = torch.randn(fisher.shape[0], generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    assert _rel(ief.fisher_vp(model, x, y, v, method=method), fisher @ v) < 1e-12
    if method != "auto":
        op = ief.FisherOperator(model, x, y, method=method)
        assert _rel(op.gradient, gradient) < 1e-12
        assert _rel(op @ v, fisher @ v) < 1e-12


def test_double_backward_operator_gets_the_gradient_without_another_forward():
    """``FisherOperator(method="double_backward")``: the graph-building backward yields ``grad L`` (its probe is
    ``dL/dz``), so reading ``.gradient`` runs no further forward; it equals the oracle's gradient."""
    case = mlp_case()
    calls = []
    handle = case.model.register_forward_hook(lambda *_: calls.append(1))
    try:
        op = ief.FisherOperator(case.model, case.inputs, case.targets, method="double_backward")
        assert len(calls) == 1
        assert _rel(op.gradient, reference("mlp").gradient) < 1e-12
        assert len(calls) == 1
    finally:
        handle.remove()


def test_gammas_fallback_warning_gives_the_reason():
    """The fallback's warning quotes the first line of the error that stopped the batched pass."""
    import warnings

    model, x, y = _no_jvp_case()
    p = sum(q.numel() for q in model.parameters())
    stacked = torch.randn(2, p, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    try:
        ief.logit_jvp.batched_jvps(ief.model_call.ReplayableForward(model, x), list(model.parameters()),
                                   ief.model_call.param_names(model, list(model.parameters())), stacked)
    except (RuntimeError, NotImplementedError) as err:
        reason = str(err).splitlines()[0]
    else:
        pytest.fail("the batched pass was expected to fail on a Function without a forward-mode rule")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ief.gammas(model, x, y, stacked)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert messages == [f"ief.gammas: the batched forward-mode pass is not available for this _NoJvpModel ({reason}); "
                        "using double backward (same values, one backward-type pass per direction)"]


def test_gamma_on_a_parameter_subset_and_its_error_messages():
    """``gamma(..., params=first layer)`` rates the zero-padded full direction (dense oracle); bad input names what
    is wrong and, for the method, the accepted values."""
    case = mlp_case()
    ref = reference("mlp")
    first = list(case.model[0].parameters())
    p1 = sum(p.numel() for p in first)
    d = torch.randn(p1, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    padded = torch.zeros(num_params(case), dtype=torch.float64)
    padded[:p1] = d
    for method in METHODS:
        got = ief.gamma(case.model, case.inputs, case.targets, d, params=first, method=method)
        assert got == pytest.approx(ref.gamma(padded), rel=1e-10), method
    with pytest.raises(ValueError, match=r"^gamma of a zero direction is undefined \(0/0\)$"):
        ief.gamma(case.model, case.inputs, case.targets, torch.zeros_like(padded))
    with pytest.raises(ValueError, match=r"^unknown method 'nope'; accepted: 'forward', 'double_backward'$"):
        ief.gamma(case.model, case.inputs, case.targets, padded, method="nope")


class _NoJvpModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.head = torch.nn.Linear(4, 5), torch.nn.Linear(5, 3)

    def forward(self, x):
        return self.head(SquareNoJvp.apply(self.inp(x)))


def _no_jvp_case():
    torch.manual_seed(0)
    model = _NoJvpModel().double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    return model, x, y


def test_gamma_forward_falls_back_where_a_layer_has_no_forward_rule():
    """``gamma``'s default ``method="forward"`` on a model with a custom Function without ``jvp``: the same value as
    double backward and as the dense oracle, not an error."""
    model, x, y = _no_jvp_case()
    fisher, gradient = oracle.fisher(model, x, y), oracle.gradient(model, x, y)
    d = torch.randn(fisher.shape[0], generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    expected = math.sqrt(float(d @ fisher @ d)) / abs(float(d @ gradient))
    assert ief.gamma(model, x, y, d) == pytest.approx(expected, rel=1e-10)
    assert ief.gamma(model, x, y, d, method="double_backward") == pytest.approx(expected, rel=1e-10)


def test_fisher_vp_auto_remembers_a_model_without_forward_rules():
    """``method="auto"`` tries forward mode once per model: after the first fallback, a product on the same model
    runs one forward (the double-backward one), not a failed dual forward first."""
    model, x, y = _no_jvp_case()
    v = torch.randn(sum(p.numel() for p in model.parameters()), dtype=torch.float64)
    first = ief.fisher_vp(model, x, y, v)
    calls = []
    handle = model.register_forward_pre_hook(lambda *_: calls.append(1))  # also counts a forward that fails midway
    try:
        again = ief.fisher_vp(model, x, y, v)
    finally:
        handle.remove()
    assert len(calls) == 1
    torch.testing.assert_close(again, first, rtol=1e-12, atol=0)


def test_gammas_fallback_warning_points_at_the_caller_and_names_a_silent_error():
    """The fallback warning is attributed to the caller's line (``stacklevel=2``), not to a line of ``ief``, and an
    error without a message is named by its type."""
    import os
    import warnings

    class Unbatchable(torch.nn.Module):
        """Raises a bare ``NotImplementedError`` under functorch transforms (an op without a batching rule)."""

        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 3)

        def forward(self, x):
            if torch._C._functorch.is_functorch_wrapped_tensor(x) or any(
                    torch._C._functorch.is_functorch_wrapped_tensor(p) for p in self.lin.parameters()):
                raise NotImplementedError
            return self.lin(x)

    torch.manual_seed(0)
    model = Unbatchable().double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    stacked = torch.randn(2, 15, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = ief.gammas(model, x, y, stacked)
    runtime = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(runtime) == 1
    package = os.path.dirname(os.path.abspath(ief.__file__)) + os.sep
    assert not os.path.abspath(runtime[0].filename).startswith(package)  # the caller's line, not ief's own
    assert "not available for this Unbatchable (NotImplementedError); using double backward" in str(runtime[0].message)
    assert got == pytest.approx([ief.gamma(model, x, y, d, method="double_backward") for d in stacked], rel=1e-12)


# ---------------------------------------------------------------------- logits checks, operator defaults
class _Masked(torch.nn.Module):
    """An MLP whose class 2 is masked with ``-inf`` (a constrained vocabulary), or, ``drop=True``, left out."""

    def __init__(self, drop=False):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 4)).double()
        self.drop = drop

    def forward(self, x):
        z = self.body(x)
        if self.drop:
            return z[:, [0, 1, 3]]
        return z.masked_fill(torch.tensor([False, False, True, False]), float("-inf"))


def test_gamma_accepts_masked_classes_and_equals_the_model_without_them():
    """``-inf`` on some classes gives them probability 0 (``check_finite`` accepts it): ``gamma`` equals the dense
    oracle of the same model with the masked class removed."""
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y = torch.tensor([0, 1, 3, 3, 0, 1])
    masked, dropped = _Masked(), _Masked(drop=True)
    d = torch.randn(sum(p.numel() for p in masked.parameters()), generator=torch.Generator().manual_seed(2),
                    dtype=torch.float64)
    y_dropped = torch.tensor([0, 1, 2, 2, 0, 1])  # class 3 is index 2 once class 2 is left out
    fisher, gradient = oracle.fisher(dropped, x, y_dropped), oracle.gradient(dropped, x, y_dropped)
    expected = math.sqrt(float(d @ fisher @ d)) / abs(float(d @ gradient))
    for method in METHODS:
        assert ief.gamma(masked, x, y, d, method=method) == pytest.approx(expected, rel=1e-10), method
        assert ief.gammas(masked, x, y, d[None], method=method)[0] == pytest.approx(expected, rel=1e-10), method


class _PlainCrossEntropy:
    """A user-defined loss (the :class:`ief.losses.Loss` protocol) without the optional ``check_finite``."""

    def __init__(self):
        self._inner = ief.losses.get_loss("cross_entropy")

    def __getattr__(self, name):
        if name == "check_finite":
            raise AttributeError(name)
        return getattr(self._inner, name)


def test_a_user_loss_without_check_finite_gets_the_plain_finiteness_check():
    """Without ``check_finite`` every non-finite logit is refused (``require_finite``); finite logits give the
    built-in loss's values."""
    case = mlp_case()
    d = _randn(case, 1, seed=3)[0]
    loss = _PlainCrossEntropy()
    assert ief.gamma(case.model, case.inputs, case.targets, d, loss=loss) == pytest.approx(
        reference("mlp").gamma(d), rel=1e-10)
    x = case.inputs.clone()
    x[2, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="^non-finite logits: nan at index"):
        ief.gamma(case.model, x, case.targets, d, loss=loss)
    with pytest.raises(FloatingPointError, match="^non-finite logits: nan at index"):
        ief.FisherOperator(case.model, x, case.targets, loss=loss)


def test_a_user_loss_check_finite_receives_the_targets():
    """A user loss's own ``check_finite(logits, targets)`` is called with the batch's targets (it may use them, e.g.
    to skip ignored positions)."""
    case = mlp_case()
    seen = []

    class Recording(_PlainCrossEntropy):
        def __getattr__(self, name):
            if name == "check_finite":
                return lambda logits, targets: seen.append(targets)
            return getattr(self._inner, name)

    ief.gamma(case.model, case.inputs, case.targets, _randn(case, 1, seed=3)[0], loss=Recording())
    assert len(seen) == 1 and seen[0] is case.targets


def test_fisher_operator_defaults_messages_and_checks():
    """``FisherOperator(model, x, y)``: cross-entropy and double backward by default (oracle ``F v``); an unknown
    method names the accepted ones; NaN logits are refused at the first forward (construction for double backward,
    the first product for forward mode)."""
    case = mlp_case()
    ref = reference("mlp")
    v = _randn(case, 1, seed=4)[0]
    op = ief.FisherOperator(case.model, case.inputs, case.targets)
    assert op.method == "double_backward"
    assert _rel(op @ v, ref.fisher @ v) < 1e-12
    with pytest.raises(ValueError, match=r"^unknown method 'nope'; accepted: 'forward', 'double_backward'$"):
        ief.FisherOperator(case.model, case.inputs, case.targets, method="nope")
    x = case.inputs.clone()
    x[1, 1] = float("nan")
    with pytest.raises(FloatingPointError, match="NaN"):
        ief.FisherOperator(case.model, x, case.targets)
    op = ief.FisherOperator(case.model, x, case.targets, method="forward")
    with pytest.raises(FloatingPointError, match="NaN"):
        op @ v


@pytest.mark.parametrize("method", METHODS)
def test_fisher_operator_on_parameters_that_do_not_reach_the_logits(method):
    """``params=`` a layer that does not reach the logits: its Fisher block is zero, so ``F v = 0``."""
    torch.manual_seed(0)
    model = _WithUnused().double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    params = list(model.unused.parameters())
    v = torch.randn(6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out = ief.FisherOperator(model, x, y, params, method=method) @ v
    assert out.shape == (6,) and torch.count_nonzero(out) == 0


def test_a_remembered_targets_check_is_redone_after_an_in_place_change():
    """``check_logits`` remembers a passed targets check per targets tensor (version counter, logits shape and dtype,
    loss): the fixed cost it saves on every Fisher-vector product must never let bad targets through. An in-place
    change to out-of-range classes, a wider or narrower logits shape, and a NaN logit all raise after a passing call,
    as on a first call."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    x, y = torch.randn(5, 4), torch.tensor([0, 1, 2, 1, 0])
    v = torch.randn(15)
    ief.fisher_vp(model, x, y, v)  # passes, and is remembered
    y[2] = 7  # in place: the version counter moves
    with pytest.raises(ValueError, match="class index 7 out of range"):
        ief.fisher_vp(model, x, y, v)
    y[2] = 2
    ief.fisher_vp(model, x, y, v)
    narrow = torch.nn.Linear(4, 2)  # the same targets against 2 classes: class 2 is out of range
    with pytest.raises(ValueError, match="class index 2 out of range"):
        ief.fisher_vp(narrow, x, y, torch.randn(10))
    with torch.no_grad():
        model.bias[0] = float("nan")
    with pytest.raises(FloatingPointError, match="nan"):
        ief.fisher_vp(model, x, y, v)
    with torch.inference_mode():  # an inference tensor has no version counter: checked every time, still checked
        bad = torch.tensor([0, 1, 5, 1, 0])
    with pytest.raises(ValueError, match="class index 5 out of range"):
        ief.fisher_vp(torch.nn.Linear(4, 3), x, bad, v)


# ------------------------------------------------------------------------------------------- non-finite input refused
NONFINITE = (r"for samples \[1\] \(of 5\): a NaN or inf in those samples' inputs, logits or targets, or in the "
             r"parameters; .*refused rather than returned")


def _saturated_inf_case():
    """An inf in sample 1's input behind a ``tanh``: the logits stay finite (the loss checks pass), every product
    through the first layer is ``0 * inf = NaN`` for that sample."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    x[1, 2] = float("inf")
    v = torch.randn(sum(p.numel() for p in model.parameters()), dtype=torch.float64)
    return model, x, torch.tensor([0, 1, 2, 0, 1]), v


@pytest.mark.parametrize("method", ["forward", "double_backward"])
def test_gamma_and_fisher_vp_refuse_an_inf_input_with_the_optimisers_message(method):
    model, x, y, v = _saturated_inf_case()
    assert bool(torch.isfinite(model(x)).all())  # nothing for the logits' check to see
    with pytest.raises(FloatingPointError, match=NONFINITE):
        ief.gamma(model, x, y, v, method=method)
    with pytest.raises(FloatingPointError, match=NONFINITE):
        ief.gammas(model, x, y, torch.stack([v, -2 * v]), method=method)
    with pytest.raises(FloatingPointError, match=NONFINITE):
        ief.fisher_vp(model, x, y, v, method=method)
    with pytest.raises(FloatingPointError, match=NONFINITE):  # the optimisers' own refusal of the same batch
        ief.optim.IEF(model).step(x, y)
