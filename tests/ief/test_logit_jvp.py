"""``ief.logit_jvp``: forward-mode tangents of the bilinear operations (``LeanTangents``) and the batched JVPs.

``J_z v`` (sec:app-eval-complexity) from forward mode must be the same function as PyTorch's own forward-mode rules:
every case below compares against ``torch.autograd.forward_ad`` without the mode, in float64, for each subset of
operands that carry a tangent (an input without tangent: the first layer; a frozen weight: a LoRA base layer).
"""
from __future__ import annotations

import itertools

import pytest
import torch
from torch.autograd import forward_ad

from ief.logit_jvp import LeanTangents, _reference_kernels_set, batched_jvps, differentiable_kernels, dual_forward
from ief.model_call import ReplayableForward, param_names, split_vector
from tiny_models import sequence_case, t5_lora_case, vit_lora_case

F = torch.nn.functional


def _run(fn, operands, tangents, mode: bool):
    """``(primal, tangent)`` of ``fn(*operands)`` with the given tangents (``None``: no tangent)."""
    with forward_ad.dual_level():
        duals = [x if t is None else forward_ad.make_dual(x, t) for x, t in zip(operands, tangents)]
        if mode:
            with LeanTangents():
                out = fn(*duals)
        else:
            out = fn(*duals)
        primal, tangent = forward_ad.unpack_dual(out)
    return primal, tangent


CASES = {
    "linear": (lambda x, w, b: F.linear(x, w, b), [(5, 4), (3, 4), (3,)]),
    "linear-3d-input": (lambda x, w, b: F.linear(x, w, b), [(2, 5, 4), (3, 4), (3,)]),
    "linear-kwargs": (lambda x, w, b: F.linear(input=x, weight=w, bias=b), [(5, 4), (3, 4), (3,)]),
    "matmul-4d": (torch.matmul, [(2, 3, 5, 4), (2, 3, 4, 6)]),
    "matmul-broadcast": (torch.matmul, [(2, 3, 5, 4), (4, 6)]),
    "matmul-vector": (torch.matmul, [(5, 4), (4,)]),
    "operator": (lambda a, b: a @ b, [(5, 4), (4, 6)]),
    "tensor-matmul": (lambda a, b: a.matmul(b), [(5, 4), (4, 6)]),
    "mm": (torch.mm, [(5, 4), (4, 6)]),
    "bmm": (torch.bmm, [(3, 5, 4), (3, 4, 6)]),
    # elementwise arithmetic (the zero-tangent operand of a frozen weight, a mask, a scalar): broadcasting both ways
    "mul": (lambda a, b: a * b, [(5, 4), (4,)]),
    "mul-function": (torch.mul, [(5, 1), (1, 4)]),
    "mul-scalar": (lambda a: 2.5 * a, [(5, 4)]),
    "mul-0d": (lambda a, b: a * b, [(5, 4), ()]),
    "add": (lambda a, b: a + b, [(5, 1), (1, 4)]),
    "add-method": (lambda a, b: a.add(b), [(3, 5, 4), (5, 4)]),
    "add-scalar": (lambda a: 1.5 + a, [(5, 4)]),
    "sub": (lambda a, b: a - b, [(4,), (5, 4)]),
    "sub-function": (torch.sub, [(5, 4), (5, 4)]),
    "rsub-scalar": (lambda a: 1.5 - a, [(5, 4)]),
    "div": (lambda a, b: a / b, [(5, 4), (4,)]),
    "div-scalar": (lambda a: a / 3.0, [(5, 4)]),
    "div-function": (torch.div, [(1, 4), (5, 1)]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_lean_tangents_equal_pytorch_forward_mode(name):
    """Primal and tangent equal PyTorch's forward-mode rule for every subset of operands with a tangent."""
    fn, shapes = CASES[name]
    gen = torch.Generator().manual_seed(0)
    operands = [torch.randn(s, generator=gen, dtype=torch.float64) + 3.0 for s in shapes]  # divisors away from 0
    tangents = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    for mask in itertools.product((False, True), repeat=len(shapes)):
        ts = [t if on else None for t, on in zip(tangents, mask)]
        p_ref, t_ref = _run(fn, operands, ts, mode=False)
        p_got, t_got = _run(fn, operands, ts, mode=True)
        assert torch.equal(p_got, p_ref), mask
        if not any(mask):
            assert t_got is None and t_ref is None
            continue
        assert t_got is not None, mask
        torch.testing.assert_close(t_got, t_ref, rtol=1e-13, atol=1e-13)


def test_lean_tangents_keep_the_primal_graph_and_leave_the_tangent_out_of_it():
    """Under grad mode the primal is still differentiable in reverse mode (same gradient as a plain forward); the
    tangent of the intercepted product is computed outside the autograd graph (PyTorch's rule records it)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 4, generator=gen, dtype=torch.float64)
    w = torch.randn(3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    dw = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    cot = torch.randn(5, 3, generator=gen, dtype=torch.float64)
    (plain,) = torch.autograd.grad(F.linear(x, w), w, cot)
    for mode in (False, True):
        primal, tangent = _run(lambda a, b: F.linear(a, b), [x, w], [None, dw], mode=mode)
        (got,) = torch.autograd.grad(primal, w, cot)
        assert torch.equal(got, plain)
        assert tangent.requires_grad is (not mode)


def test_dual_forward_of_attention_model_equals_pytorch_rule():
    """A model with nn.MultiheadAttention (in_proj via linear, attention products via bmm/baddbmm), padding and
    LayerNorm: the model's J_z v with the mode equals PyTorch's forward mode without it."""
    case = sequence_case()
    model = case.model
    params = [p for p in model.parameters() if p.requires_grad]
    names = param_names(model, params)
    v = torch.randn(sum(p.numel() for p in params), generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    tangents = split_vector(v, params)
    with torch.no_grad(), differentiable_kernels():  # MATH attention: the fused CPU kernel has no forward rule
        z, jv = dual_forward(ReplayableForward(model, case.inputs), params, names, tangents)
        with forward_ad.dual_level():
            duals = {n: forward_ad.make_dual(p, t) for n, p, t in zip(names, params, tangents)}
            ref = forward_ad.unpack_dual(torch.func.functional_call(model, duals, (case.inputs,)))
    torch.testing.assert_close(z, ref.primal, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(jv, ref.tangent, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("p, training, inplace", [(0.1, True, False), (0.5, True, False), (0.0, True, False),
                                                  (1.0, True, False), (0.3, False, False), (0.3, True, True)])
def test_dropout_tangent_equals_pytorch_rule_with_the_same_mask(p, training, inplace):
    """CPU dropout under the mode draws the same mask from the same generator as ATen's dropout (primal bit-equal to
    PyTorch's forward mode after the same seed) and its tangent is ``dx * noise``; the edge cases (``p`` 0 or 1, eval,
    in place) keep PyTorch's rule."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 6, 5, generator=gen, dtype=torch.float64)
    t = torch.randn(4, 6, 5, generator=gen, dtype=torch.float64)

    def fn(a):
        return F.dropout(a.clone() if inplace else a, p, training, inplace)

    torch.manual_seed(11)
    p_ref, t_ref = _run(fn, [x], [t], mode=False)
    torch.manual_seed(11)
    p_got, t_got = _run(fn, [x], [t], mode=True)
    assert torch.equal(p_got, p_ref)
    torch.testing.assert_close(t_got, t_ref, rtol=1e-15, atol=0)
    torch.manual_seed(11)
    assert torch.equal(fn(x), p_ref)  # the mask a plain forward draws
    if training and 0 < p < 1:
        assert bool((p_got == 0).any()) and bool((p_got != 0).any())  # the case really drops something


def test_dropout_under_the_mode_keeps_the_primal_graph():
    """The primal of the intercepted dropout is still differentiable in reverse mode (the gradient of a plain dropout
    with the same mask) and its tangent stays out of the autograd graph."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(5, 7, generator=gen, dtype=torch.float64, requires_grad=True)
    dx = torch.randn(5, 7, generator=gen, dtype=torch.float64)
    cot = torch.randn(5, 7, generator=gen, dtype=torch.float64)
    torch.manual_seed(5)
    (plain,) = torch.autograd.grad(F.dropout(x, 0.4, True), x, cot)
    torch.manual_seed(5)
    primal, tangent = _run(lambda a: F.dropout(a, 0.4, True), [x], [dx], mode=True)
    (got,) = torch.autograd.grad(primal, x, cot)
    assert torch.equal(got, plain)
    assert not tangent.requires_grad


def test_dual_forward_of_a_model_with_dropout_in_train_mode_equals_pytorch_rule():
    """nn.Dropout inside a model in train mode (the T5 / BERT case): J_z v with the mode equals PyTorch's forward mode
    after the same seed, and the logits equal a plain forward's (same masks)."""
    torch.manual_seed(6)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Dropout(0.3), torch.nn.Tanh(), torch.nn.Linear(8, 8),
                                torch.nn.Dropout(0.2), torch.nn.Linear(8, 3)).double().train()
    x = torch.randn(10, 6, dtype=torch.float64)
    params = list(model.parameters())
    names = param_names(model, params)
    v = torch.randn(sum(p.numel() for p in params), generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    tangents = split_vector(v, params)
    with torch.no_grad():
        torch.manual_seed(8)
        z, jv = dual_forward(ReplayableForward(model, x), params, names, tangents)
        torch.manual_seed(8)
        with forward_ad.dual_level():
            duals = {n: forward_ad.make_dual(p, t) for n, p, t in zip(names, params, tangents)}
            ref = forward_ad.unpack_dual(torch.func.functional_call(model, duals, (x,)))
        torch.manual_seed(8)
        plain = model(x)
    assert torch.equal(z, ref.primal) and torch.equal(z, plain)
    torch.testing.assert_close(jv, ref.tangent, rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("make_case", [t5_lora_case, vit_lora_case, sequence_case])
def test_batched_jvps_stay_batched_on_transformers_in_train_mode(make_case):
    """The lean tangents work under ``torch.func.vmap`` (no in-place write of a batched tangent into an unbatched
    tensor, which would make ``ief.gammas`` fall back to double backward): K = 2 tangents of LoRA / attention models
    in train mode (dropout on) in one batched pass equal two dual forwards from the same RNG state."""
    case = make_case()
    model = case.model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    names = param_names(model, params)
    gen = torch.Generator().manual_seed(9)
    directions = torch.randn(2, sum(p.numel() for p in params), generator=gen, dtype=torch.float64)
    torch.manual_seed(10)
    z, jvs = batched_jvps(ReplayableForward(model, case.inputs), params, names, directions)
    for k in range(2):
        torch.manual_seed(10)
        with torch.no_grad(), differentiable_kernels():
            tangents = split_vector(directions[k], params)
            z1, jv1 = dual_forward(ReplayableForward(model, case.inputs), params, names, tangents)
        torch.testing.assert_close(z, z1, rtol=1e-13, atol=1e-13)
        torch.testing.assert_close(jvs[k], jv1, rtol=1e-10, atol=1e-12)
    model.eval()


class _NoJvp(torch.nn.Module):
    """A Linear, a custom op without forward-mode rule, a head: batched forward mode fails, double backward works."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 5), torch.nn.Linear(5, 3)

    def forward(self, x):
        from tiny_models import SquareNoJvp

        return self.b(SquareNoJvp.apply(torch.tanh(self.a(x))))


@pytest.mark.parametrize("build", ["sequence", "no-jvp"])
def test_jvps_any_mode_equals_one_double_backward_product_per_tangent(build):
    """The exact check's ``K`` products (:func:`ief.logit_jvp.jvps_any_mode`, tangents given per parameter) equal
    the products of the reverse-mode definition, one tangent at a time; a model without forward-mode rule falls back
    to double backward (the same values) and is remembered."""
    from ief.logit_jvp import NO_BATCHED_JVP, NO_FORWARD_MODE, double_backward_jvps, jvps_any_mode

    if build == "sequence":
        c = sequence_case()
        model, inputs = c.model, c.inputs
    else:
        torch.manual_seed(0)
        model, inputs = _NoJvp().double(), torch.randn(6, 4, dtype=torch.float64)
    params = [p for p in model.parameters() if p.requires_grad]
    names = param_names(model, params)
    gen = torch.Generator().manual_seed(0)
    tangents = [torch.randn(3, *p.shape, generator=gen, dtype=torch.float64).to(p) for p in params]
    if build == "sequence":  # the padding row: forward mode differentiates it, the backward's convention gives it 0
        tangents[names.index("embed.weight")][:, 0] = 0
    forward = ReplayableForward(model, inputs)
    _, jvs = jvps_any_mode(forward, params, names, tangents)
    with torch.enable_grad(), differentiable_kernels():  # the fused CPU attention has no double backward
        expected = double_backward_jvps(forward(), params, [[t[k] for t in tangents] for k in range(3)])
    for k in range(3):
        torch.testing.assert_close(jvs[k], expected[k], rtol=1e-10, atol=1e-12)
    assert (model in NO_BATCHED_JVP or model in NO_FORWARD_MODE) == (build == "no-jvp")


def test_nested_differentiable_kernels_keep_and_restore_the_settings():
    """A ``differentiable_kernels`` block inside another (a Fisher-vector product enters several) leaves the reference
    kernels on and changes nothing on exit; the outer block restores the caller's settings; a nested block entered
    after the model changed a setting sets it again."""
    before = (torch.backends.mkldnn.enabled, torch.backends.mha.get_fastpath_enabled(),
              torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled())
    with differentiable_kernels():
        assert _reference_kernels_set()
        with differentiable_kernels():
            assert _reference_kernels_set()
        assert _reference_kernels_set()
        torch.backends.mkldnn.enabled = True  # something inside switched oneDNN back on
        with differentiable_kernels():
            assert not torch.backends.mkldnn.enabled and _reference_kernels_set()
        assert torch.backends.mkldnn.enabled  # restored to what it was when that block was entered
    assert (torch.backends.mkldnn.enabled, torch.backends.mha.get_fastpath_enabled(),
            torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled()) == before


class _TiedHead(torch.nn.Module):
    """An embedding table that is also the output layer's weight (held by both modules), and a parametrised Linear."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(7, 4)
        self.mid = torch.nn.Linear(4, 4)
        torch.nn.utils.parametrize.register_parametrization(self.mid, "weight", _Doubled())
        self.head = torch.nn.Linear(4, 7, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mid(self.embed(ids))))


class _Doubled(torch.nn.Module):
    def forward(self, w):
        return 2 * w


def test_the_dual_forward_substitutes_a_tied_and_a_parametrised_weight_everywhere_and_puts_them_back():
    """The dual parameters stand in every module holding them for the one call (the tied table in the embedding and
    the head, the parametrisation's original): J_z v equals the double-backward one, and the modules hold their own
    parameters again after the call and after a call that raises."""
    torch.manual_seed(0)
    model = _TiedHead().double()
    ids = torch.randint(0, 7, (3, 5))
    params = [p for p in model.parameters() if p.requires_grad]
    names = param_names(model, params)
    tangents = split_vector(torch.randn(sum(p.numel() for p in params), dtype=torch.float64), params)
    held = [(module, key, p) for module in model.modules() for key, p in module._parameters.items()]
    _, jv = dual_forward(ReplayableForward(model, ids), params, names, tangents)
    logits = model(ids)
    probe = torch.zeros_like(logits, requires_grad=True)
    vjp = torch.autograd.grad(logits, params, probe, create_graph=True)
    (expected,) = torch.autograd.grad(vjp, probe, tangents)
    assert torch.allclose(jv, expected, rtol=1e-12, atol=1e-12)
    assert all(module._parameters[key] is p for module, key, p in held)
    with pytest.raises(IndexError):  # ids outside the table: the embedding raises inside the substituted call
        dual_forward(ReplayableForward(model, ids + 100), params, names, tangents)
    assert all(module._parameters[key] is p for module, key, p in held)
