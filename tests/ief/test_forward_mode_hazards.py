"""The exact check cannot crash the process: models that forward-mode AD cannot take go to double backward.

A module that re-casts itself inside its forward (``self.classifier = self.classifier.to(self.dtype)``, HF
SwitchTransformers' router) assigns its parameters' ``.data``; under the dual forward of the exact check that died
with a segmentation fault in ``torch.autograd.forward_ad.unpack_dual`` (a ``torch.func.jvp`` with an INTERNAL ASSERT).
:func:`ief.logit_jvp.forward_mode_hazard` finds it with one plain forward before any dual tensor exists. Each case runs
in a subprocess, so that a crash fails the test instead of killing pytest.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-W", "ignore", "-c", textwrap.dedent(code)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


RECASTING = """
import torch, ief
from ief.logit_jvp import ForwardModeUnsupported, forward_mode_hazard
from ief.model_call import ReplayableForward
from tests import oracle

class Router(torch.nn.Module):  # re-casts its classifier inside forward, as SwitchTransformers' router does
    def __init__(self):
        super().__init__()
        self.classifier = torch.nn.Linear(5, 5)
    def forward(self, x):
        self.classifier = self.classifier.to(torch.float64)
        return torch.tanh(self.classifier(x))

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 5), Router(), torch.nn.Linear(5, 3)).double()
model[1].classifier.requires_grad_(False)  # frozen, as the router of a model whose experts are fine-tuned
x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
assert "data" in forward_mode_hazard(ReplayableForward(model, x))
assert forward_mode_hazard(ReplayableForward(torch.nn.Linear(4, 3).double(), x)) is None
got = ief.per_sample(model, x, y, check="exact")
_, ref, _ = oracle.per_sample(model, x, y)
assert float((got.jacobian - ref).norm() / ref.norm()) < 1e-10
v = torch.randn(sum(p.numel() for p in model.parameters() if p.requires_grad), dtype=torch.float64)
try:
    ief.fisher_vp(model, x, y, v, method="forward")
    raise SystemExit("forward mode ran")
except ForwardModeUnsupported as err:
    assert ".data" in str(err), err
auto, db = ief.fisher_vp(model, x, y, v), ief.fisher_vp(model, x, y, v, method="double_backward")
assert torch.allclose(auto, db, rtol=1e-10, atol=0), (auto - db).abs().max()
ief.optim.IEF(model, lr=0.1).step(x, y)
print("ok")
"""


def test_a_module_recasting_itself_takes_double_backward():
    out = _run(RECASTING)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), (out.returncode, out.stderr[-3000:])


SWITCH = """
import time, torch, transformers, ief
from tests import oracle
torch.manual_seed(0)
cfg = transformers.SwitchTransformersConfig(
    vocab_size=32, d_model=16, d_kv=4, d_ff=24, num_layers=1, num_decoder_layers=1, num_heads=2, num_experts=4,
    encoder_sparse_step=1, decoder_sparse_step=1, expert_capacity=64, dropout_rate=0.0, router_jitter_noise=0.0,
    decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
model = transformers.SwitchTransformersForConditionalGeneration(cfg).eval()
for n, p in model.named_parameters():
    p.requires_grad_("expert" in n)  # the expert MLPs are trained
M = 4
gen = torch.Generator().manual_seed(0)
inputs = dict(input_ids=torch.randint(2, 32, (M, 5), generator=gen),
              decoder_input_ids=torch.randint(2, 32, (M, 3), generator=gen))
y = torch.randint(2, 32, (M, 3), generator=gen)
# this batch routes exactly M tokens to the encoder's expert_3, and sample 0 alone routes 1 to it
got = ief.per_sample(model, inputs, y, check=True)
_, ref, _ = oracle.per_sample(model, inputs, y)
err = float((got.jacobian - ref).norm() / ref.norm())
d, d_ref = (ief.ief_direction(j, got.logit_sqnorm, 1e-4) for j in (got.jacobian, ref))
err_d = float((d - d_ref).norm() / d_ref.norm())
assert err < 1e-5 and err_d < 1e-5, (err, err_d)
ief.per_sample(model, inputs, y, check="exact")
ief.optim.IEF(model, lr=0.1).step(inputs, y)
print("ok", err, err_d)
"""


def test_switch_transformers_exact_and_first_step():
    pytest.importorskip("transformers")
    out = _run(SWITCH)
    assert out.returncode == 0 and "ok" in out.stdout, (out.returncode, out.stderr[-3000:])
