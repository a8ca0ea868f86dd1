"""``ief.logit_jvp``: forward-mode tangents of the bilinear operations (``BilinearTangents``) and the batched JVPs.

``J_z v`` (sec:app-eval-complexity) from forward mode must be the same function as PyTorch's own forward-mode rules:
every case below compares against ``torch.autograd.forward_ad`` without the mode, in float64, for each subset of
operands that carry a tangent (an input without tangent: the first layer; a frozen weight: a LoRA base layer).
"""
from __future__ import annotations

import itertools

import pytest
import torch
from torch.autograd import forward_ad

from ief.logit_jvp import BilinearTangents, differentiable_kernels, dual_forward
from ief.model_call import ReplayableForward, param_names, split_vector
from tiny_models import sequence_case

F = torch.nn.functional


def _run(fn, operands, tangents, mode: bool):
    """``(primal, tangent)`` of ``fn(*operands)`` with the given tangents (``None``: no tangent)."""
    with forward_ad.dual_level():
        duals = [x if t is None else forward_ad.make_dual(x, t) for x, t in zip(operands, tangents)]
        if mode:
            with BilinearTangents():
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
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bilinear_tangents_equal_pytorch_forward_mode(name):
    """Primal and tangent equal PyTorch's forward-mode rule for every subset of operands with a tangent."""
    fn, shapes = CASES[name]
    gen = torch.Generator().manual_seed(0)
    operands = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
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


def test_bilinear_tangents_keep_the_primal_graph_and_leave_the_tangent_out_of_it():
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
