"""The streamed form of a factored weight's rows (:mod:`ief.streamed`): the cost model's choice, its accuracy where
the solve's coefficients cancel, its blocks, and that no buffer of a steady step grows with ``M x P``.

The route matrix (``tests/ief/test_routes.py``: ``forms`` with ``form="streamed"``, the ``streamed`` optimiser route),
the direction tests (``tests/ief/test_directions.py``'s ``as_j``) and the gloo equivalence tests
(``tests/ief/test_distributed.py``) hold it to the float64 oracle.
"""
from __future__ import annotations

import copy
import itertools

import pytest
import torch

import ief
from ief.streamed import ROWS_BYTES, STREAM_BYTES, StreamedRows, form_costs, layer_form


@pytest.mark.parametrize("shape, expected", [
    ((64, 1, 784, 256), "ghost"),  # the paper's MLP at M 64: one position, the kernel is M^2 (I + O)
    ((8, 64, 256, 768), "streamed"),  # mini GPT-2's attention input, M 8, T 64: rows of 6 MiB
    ((8, 128, 768, 50257), "streamed"),  # GPT-2 small's head: rows of 1.2 GiB
    ((32, 128, 768, 8), "rows"),  # a LoRA factor: rows of 0.75 MiB, kept
    ((16, 4, 64, 64), "ghost"),  # a small weight over few positions
    ((16, 4, 16, 16), "rows"),  # smaller still: its rows are fewer flops than the kernel
    ((4, 64, 64, 64), "rows"),  # rows of 64 KiB
])
def test_auto_chooses_each_layer_by_the_cost_model(shape, expected):
    """``form="auto"``'s choice on a few layer shapes ``(M, T, I, O)``, float32; a forced form is itself."""
    m, t, fan_in, fan_out = shape
    assert layer_form("auto", m, t, fan_in, fan_out, 4) == expected
    for forced in ("ghost", "rows", "streamed"):
        assert layer_form(forced, m, t, fan_in, fan_out, 4) == forced
    cost = form_costs(m, t, fan_in, fan_out, 4)
    # what the choice trades: the streamed form holds no rows and pays one batched product more than the rows
    assert cost["streamed"].held == 0 < cost["rows"].held == 4 * m * fan_in * fan_out
    assert cost["streamed"].flops - cost["rows"].flops == 2 * m * t * fan_in * fan_out
    assert cost["streamed"].transient <= STREAM_BYTES * 3 // 2
    if expected == "ghost":
        assert cost["ghost"].flops <= cost["rows"].flops
    if expected == "rows":
        assert cost["rows"].held <= ROWS_BYTES


def _rows_of(model, x, y, form):
    return ief.per_sample(model, x, y, form=form)


@pytest.mark.parametrize("noise", [0.0, 1e-3, 1e-2])
def test_float32_streamed_directions_keep_float32_accuracy_when_coefficients_cancel(noise):
    """Near-duplicate samples (8 pairs ``x``, ``x + noise``) make the solve's coefficients large and cancelling. The
    streamed rows are the float32 rows of the dense route (the same batched product), and every product of them is
    float64: the EF / iEF directions equal the float64 computation on the dense route's float32 ``J`` to float32's
    last rounding (``1e-6`` relative), at ``lambda = 1e-7`` and ``0``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Tanh(), torch.nn.Linear(30, 5))
    x = torch.randn(8, 3, 40)
    x = torch.cat([x, x + noise * torch.randn(8, 3, 40)])
    y = torch.randint(0, 5, (8, 3)).repeat(2, 1)
    r = _rows_of(model, x, y, "streamed")
    assert isinstance(r.jacobian, StreamedRows) and r.jacobian.streamed == {0, 2}
    dense = _rows_of(model, x, y, "dense")
    j64 = dense.jacobian.double()
    for damping in (1e-7, 0.0):
        for got, expected in ((ief.ief_direction(r.jacobian, r.logit_sqnorm, damping),
                               ief.ief_direction(j64, dense.logit_sqnorm.double(), damping)),
                              (ief.ef_direction(r.jacobian, damping), ief.ef_direction(j64, damping))):
            assert got.dtype == torch.float32
            err = float((got.double() - expected).norm() / expected.norm())
            assert err < 1e-6, (noise, damping, err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_blocks_of_any_size_give_the_whole_product(monkeypatch, dtype):
    """One output feature per block (``STREAM_BYTES`` = 1) gives the Gram, ``J^T c`` and ``J v`` of one block for
    all of them, and both equal the dense rows' (float64 sums in another order: ``1e-12`` relative)."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(6, 20), torch.nn.Tanh(), torch.nn.Linear(20, 5)).to(dtype)
    x, y = torch.randn(7, 3, 6, dtype=dtype), torch.randint(0, 5, (7, 3))
    rows = _rows_of(model, x, y, "streamed").jacobian
    dense = ief.rows.as_rows(_rows_of(model, x, y, "dense").jacobian)
    c = torch.randn(7, dtype=torch.float64)
    v = torch.randn(rows.shape[1], dtype=torch.float64)
    whole = (rows.gram(), rows.combine_rows(c), rows.times(v))
    monkeypatch.setattr(ief.streamed, "STREAM_BYTES", 1)
    for got, same, reference in zip((rows.gram(), rows.combine_rows(c), rows.times(v)), whole,
                                    (dense.gram(), dense.combine_rows(c), dense.times(v))):
        assert float((got - same).norm()) <= 1e-12 * float(same.norm())
        assert float((got - reference).norm()) <= 1e-12 * float(reference.norm())


def _peak_added_bytes(fn) -> int:
    """The peak of live CPU tensor memory above the start while ``fn()`` runs (the profiler's memory events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
                     and e.device_type() == torch.autograd.DeviceType.CPU), key=lambda e: e.start_ns())
    return max(0, max(itertools.accumulate(e.nbytes() for e in events), default=0))


T_WIDE = 16  # positions per sample of the memory test's batches


def _wide_mlp() -> torch.nn.Module:
    """Wide Linear weights over 16 positions: under ``form="auto"`` the first (64 -> 1024) is streamed (its rows,
    2 MiB at M 8, cost fewer flops than its kernel), the middle (1024 -> 1024) takes the ghost kernel and the head
    (1024 -> 4) keeps its rows (under 1 MiB), at M 8 and 16 alike."""
    torch.manual_seed(2)
    return torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 1024),
                               torch.nn.Tanh(), torch.nn.Linear(1024, 4))


def _steady_step_bytes(model: torch.nn.Module, m: int, form: str) -> tuple[int, dict]:
    """What a steady ``IEF`` step on ``M = m`` samples holds and allocates: the optimiser's ``J`` buffer (kept from
    step to step) plus the step's peak of new tensors, in bytes; and the step's routes."""
    gen = torch.Generator().manual_seed(m)
    x, y = torch.randn(m, T_WIDE, 64, generator=gen), torch.randint(0, 4, (m, T_WIDE), generator=gen)
    opt = ief.optim.IEF(copy.deepcopy(model), lr=1e-3, form=form)
    opt.step(x, y)  # step 0's exact check and the proofs a steady step keeps
    peak = _peak_added_bytes(lambda: opt.step(x, y))
    return opt._buffer.numel() * opt._buffer.element_size() + peak, opt.last_step_report.routes


_COST_FORM = {"streamed": "streamed", "factored": "ghost", "dense": "rows"}  # a weight's route -> its cost model row


def _cost_model_bytes(model: torch.nn.Module, m: int, routes: dict) -> int:
    """The terms of a float32 step's memory that grow with ``M`` (:mod:`ief.streamed`'s cost model), ``M`` and
    ``T`` as the memory test's: per Linear weight the factors ``A``, ``G`` (``4 M T (I + O)``; the backward's
    activations and output gradients are as large and live beside them: counted twice) and its form's held and
    transient bytes (:func:`ief.streamed.form_costs`: the rows form holds ``4 M I O``), a bias's ``[M, O]`` rows,
    and the ``M x M`` float64 Gram with its solve's copies (16 of them)."""
    total = 16 * 8 * m * m
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            fan_in, fan_out = module.in_features, module.out_features
            cost = form_costs(m, T_WIDE, fan_in, fan_out, 4)[_COST_FORM[routes[f"{name}.weight"]]]
            total += 2 * 4 * m * T_WIDE * (fan_in + fan_out) + cost.held + cost.transient + 4 * m * fan_out
    return total


@pytest.mark.parametrize("form", ["auto", "streamed", "rows"])
def test_no_buffer_of_a_steady_step_grows_with_m_times_p(form):
    """From ``M = 8`` to ``16`` samples (the same model, :func:`_wide_mlp`), what a steady ``IEF`` step holds and
    allocates (its ``J`` buffer plus its peak of new tensors) grows by at most 1.5 times what the cost model says
    grows with ``M``, plus 1 MiB (:func:`_cost_model_bytes`: the factors and the kernel's float64 copies of them, the
    kernel's ``M^2 T^2``, the ``M x M`` Gram; a block and the direction ``[P]`` do not grow), and for the default and
    streamed forms that is under a quarter of ``8 P`` float32 entries: no buffer grows like ``M x P``. The rows form,
    which keeps every weight's rows in ``J``'s buffer, grows by more than ``8 P_weights`` float32 entries, and its
    cost model says so too."""
    model = _wide_mlp()
    p = sum(q.numel() for q in model.parameters())
    weights = sum(q.numel() for name, q in model.named_parameters() if name.endswith("weight"))
    (small, routes), (large, same) = (_steady_step_bytes(model, m, form) for m in (8, 16))
    assert routes == same, (routes, same)
    weight_routes = {name: route for name, route in routes.items() if name.endswith("weight")}
    expected = {"auto": {"0.weight": "streamed", "2.weight": "factored", "4.weight": "dense"},
                "streamed": dict.fromkeys(weight_routes, "streamed"), "rows": dict.fromkeys(weight_routes, "dense")}
    assert weight_routes == expected[form], weight_routes
    growth = large - small
    modelled = _cost_model_bytes(model, 16, routes) - _cost_model_bytes(model, 8, routes)
    assert growth <= 1.5 * modelled + (1 << 20), (form, growth, modelled)
    by_m_p = 8 * p * 4
    if form == "rows":
        assert growth > 8 * weights * 4 and modelled > 8 * weights * 4, (growth, modelled, 8 * weights * 4)
    else:
        assert growth < by_m_p / 4 and modelled < by_m_p / 4, (form, growth, modelled, by_m_p)
