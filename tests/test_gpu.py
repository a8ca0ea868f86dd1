"""The same numerics on a CUDA device: float32 on the GPU against the float64 CPU oracle.

These tests need a CUDA device and are skipped where the machine has none (CI runs on CPU-only machines).
"""
import pytest
import torch

import ief
import oracle
from tiny_models import mlp_case, t5_lora_case, vit_lora_case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; this machine has none"),
]

CASES = {"mlp": mlp_case, "t5-lora": t5_lora_case, "vit-lora": vit_lora_case}


def _to(obj, **kw):
    if isinstance(obj, dict):
        return {k: _to(v, **kw) for k, v in obj.items()}
    if isinstance(obj, torch.Tensor):
        return obj.to(**kw) if obj.is_floating_point() else obj.to(device=kw.get("device"))
    return obj


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("name", sorted(CASES))
def test_cuda_float32_matches_cpu_float64_oracle(name):
    case = CASES[name]()
    loss_ref, jac_ref, s_ref = oracle.per_sample(case.model, case.inputs, case.targets, case.loss)
    v = torch.randn(jac_ref.shape[1], dtype=torch.float64)
    fisher = oracle.fisher(case.model, case.inputs, case.targets, case.loss)

    model = case.model.to(device="cuda", dtype=torch.float32)
    inputs = _to(case.inputs, device="cuda", dtype=torch.float32)
    targets = case.targets.cuda()
    result = ief.per_sample(model, inputs, targets, loss=case.loss)
    assert result.jacobian.device.type == "cuda" and result.jacobian.dtype == torch.float32
    assert _rel(result.jacobian, jac_ref) < 1e-4
    assert _rel(result.logit_sqnorm, s_ref) < 1e-4
    for method in ("forward", "double_backward"):
        fv = ief.fisher_vp(model, inputs, targets, v.float().cuda(), loss=case.loss, method=method)
        assert _rel(fv, fisher @ v) < 1e-4, method
    d = ief.ief_direction(result.jacobian, result.logit_sqnorm, 0.0)
    d64 = d.double().cpu()
    expected = float(torch.sqrt(d64 @ fisher @ d64) / (d64 @ jac_ref.sum(0)).abs())
    assert ief.gamma(model, inputs, targets, d, loss=case.loss) == pytest.approx(expected, rel=1e-3)


def test_cuda_iEF_training_reduces_loss_in_train_mode():
    case = t5_lora_case(m=8)
    model = case.model.to(device="cuda", dtype=torch.float32).train()
    inputs = _to(case.inputs, device="cuda", dtype=torch.float32)
    targets = case.targets.cuda()
    opt = ief.optim.IEF(model, lr=0.5, damping=1e-7)
    first = float(opt.step(inputs, targets))
    for _ in range(15):
        last = float(opt.step(inputs, targets))
    assert last < first
