"""``torch.compile`` of the iEF step's solve on the paper's MLP (``sec:app-mlp-cifar10``: 3072-2048-2048-10 ReLU,
here with a batch of 16) on a CPU, against the eager solve (a capturable step, which a GPU can replay as a CUDA graph).

The solve is what an :class:`ief.optim.IEF` step does after its per-sample rows (``eqn:iEF_lsq``): the Gram matrix of
the factored rows, the damped solve, the combination ``J^T c`` into the direction (:func:`ief.directions.ief_solve`).

- float32 (the optimisers' dtype): it compiles as one graph (``fullgraph=True``: no graph break, so no host
  round-trip: the Gram's range needs no ``max|J|`` read below float64 and the rounding floor sends the solve to
  ``eigh`` as a tensor), which a CUDA graph could replay; its direction equals the eager one to float32 rounding.
- float64: ``max|J|`` (the Gram's range) and Cholesky's pivot test are read on the host, so it compiles with graph
  breaks; its direction equals the eager one to 1e-12.

Skipped only where inductor cannot compile (no C++ compiler).
"""
from __future__ import annotations

import os
import shutil

import pytest
import torch

import ief
from ief.directions import ief_solve

pytestmark = pytest.mark.slow  # inductor compiles C++: ~40-60 s per dtype on one shared CPU core


def _has_cxx() -> bool:
    return any(shutil.which(c) for c in (os.environ.get("CXX", ""), "c++", "g++", "clang++") if c)


def _paper_mlp_rows(dtype: torch.dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3072, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048),
                                torch.nn.ReLU(), torch.nn.Linear(2048, 10)).to(dtype)
    x, y = torch.randn(16, 3072, dtype=dtype), torch.randint(0, 10, (16,))
    result = ief.per_sample(model, x, y, form="auto")
    return result.jacobian, result.logit_sqnorm


@pytest.mark.skipif(not _has_cxx(), reason="inductor needs a C++ compiler")
@pytest.mark.parametrize("dtype, fullgraph, rtol", [(torch.float32, True, 1e-6), (torch.float64, False, 1e-12)],
                         ids=["float32-one-graph", "float64"])
def test_the_compiled_solve_of_the_paper_mlp_equals_the_eager_one(dtype, fullgraph, rtol, tmp_path, monkeypatch):
    # a cache of the test's own: inductor's shared cache (/tmp/torchinductor_$USER) is not keyed by
    # ATEN_CPU_CAPABILITY, so kernels compiled for AVX-512 by an earlier run fail to build (at::vec undeclared) in a
    # run with ATEN_CPU_CAPABILITY=default; with a fresh cache both pass
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    rows, s = _paper_mlp_rows(dtype)
    assert isinstance(rows, ief.rows.FactoredJacobian) and len(rows.ghosts) == 3  # every weight factored (T = 1)
    eager = ief_solve(rows, s, 1e-4, check=False)
    torch._dynamo.reset()
    compiled = torch.compile(lambda weights: ief_solve(rows, weights, 1e-4, check=False), fullgraph=fullgraph)
    got = compiled(s)
    assert got.dtype == eager.dtype == dtype and got.shape == eager.shape
    error = float((got.double() - eager.double()).norm() / eager.double().norm())
    assert error <= rtol, error
