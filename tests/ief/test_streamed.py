"""The streamed form of a factored weight's rows (:mod:`ief.streamed`): the cost model's choice, its accuracy where
the solve's coefficients cancel, its blocks, and that no buffer of a steady step grows with ``M x P``.

The route matrix (``tests/ief/test_routes.py``: ``forms`` with ``form="streamed"``, the ``streamed`` optimiser route),
the direction tests (``tests/ief/test_directions.py``'s ``as_j``) and the gloo equivalence tests
(``tests/ief/test_distributed.py``) hold it to the float64 oracle.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch

import ief
from ief.streamed import STREAM_BYTES, StreamedRows, choose_forms, form_costs
from tests.memory import peak_added_bytes


@pytest.mark.parametrize("shape, expected", [
    ((64, 1, 784, 256), "ghost"),  # the paper's MLP at M 64: one position, the kernel is M^2 (I + O)
    ((8, 64, 256, 768), "rows"),  # mini GPT-2's attention input, M 8, T 64: rows of 6 MiB
    ((8, 128, 768, 50257), "rows"),  # GPT-2 small's head: rows of 1.2 GiB
    ((32, 128, 768, 8), "rows"),  # a LoRA factor: rows of 0.75 MiB
    ((16, 4, 64, 64), "ghost"),  # a small weight over few positions
    ((16, 4, 16, 16), "rows"),  # smaller still: its rows are fewer flops than the kernel
])
def test_auto_chooses_each_layer_by_the_cost_model(shape, expected):
    """``form="auto"``'s choice on a few layer shapes ``(M, T, I, O)``, float32: the ghost kernel where its flops are
    the fewest, whatever the budget; else the rows where they fit the budget (here exactly), streamed where they do
    not (one byte short, or rows already kept that fill it); a forced form is itself."""
    m, t, fan_in, fan_out = shape
    rows_bytes = 4 * m * fan_in * fan_out
    assert choose_forms("auto", [shape], 4, rows_bytes) == [expected]
    short = "ghost" if expected == "ghost" else "streamed"
    assert choose_forms("auto", [shape], 4, rows_bytes - 1) == [short]
    assert choose_forms("auto", [shape], 4, math.inf, kept=0) == [expected]
    assert choose_forms("auto", [shape], 4, 2 * rows_bytes, kept=rows_bytes + 1) == [short]
    for forced in ("ghost", "rows", "streamed"):
        assert choose_forms(forced, [shape], 4, 0) == [forced]
    cost = form_costs(m, t, fan_in, fan_out, 4)
    # what the choice trades: the streamed form holds no rows and pays one batched product more than the rows
    assert cost["streamed"].held == 0 < cost["rows"].held == rows_bytes
    assert cost["streamed"].flops - cost["rows"].flops == 2 * m * t * fan_in * fan_out
    assert cost["streamed"].transient <= STREAM_BYTES * 3 // 2
    if expected == "ghost":
        assert cost["ghost"].flops <= cost["rows"].flops


# mini GPT-2 (benchmarks/gpt2_full.py --size mini: 4 layers, width 256, vocabulary 8,192, untied head) at M 8, T 64:
# per layer c_attn, attn.c_proj, c_fc, mlp.c_proj, then the head
_MINI = [(8, 64, 256, 768), (8, 64, 256, 256), (8, 64, 256, 1024), (8, 64, 1024, 256)] * 4 + [(8, 64, 256, 8192)]
_MINI_PARAMS = 7_386_624  # its parameters, untied (the benchmark's docstring: 7.4M)


@pytest.mark.parametrize("budget, kept_rows", [
    (0, ()),  # nothing kept: every weight streamed
    (2 * 4 * _MINI_PARAMS, ("c_proj", "c_attn", "c_fc", "mlp_proj")),  # the default: twice the model's bytes
    ((18 << 20) - 1, ("c_proj",)),  # the four attention outputs' rows (2 MiB each), a byte short of a c_attn's 6
    (math.inf, ("c_proj", "c_attn", "c_fc", "mlp_proj", "head")),  # every weight's rows
])
def test_the_budget_keeps_the_smallest_rows_first_on_mini_gpt2(budget, kept_rows):
    """On mini GPT-2's Linear weights (none takes the ghost kernel at T 64) the rows are kept smallest first while
    the kept bytes, the 4 MiB of the parameters without factors (their ``[8, U D + ...]`` columns) first, stay
    within the budget; two weights of one size are kept in their order. The default budget (56.4 MiB) keeps the
    attention weights' rows and the first layer's MLP weights' (52 MiB in all), and streams the rest (the head's
    64 MiB among them)."""
    names = ["c_attn", "c_proj", "c_fc", "mlp_proj"] * 4 + ["head"]
    kept = 4 << 20
    forms = choose_forms("auto", _MINI, 4, budget, kept)
    rows = {name for name, form in zip(names, forms) if form == "rows"}
    assert rows == set(kept_rows), forms
    if budget == 2 * 4 * _MINI_PARAMS:
        for mlp in ("c_fc", "mlp_proj"):
            assert [f for n, f in zip(names, forms) if n == mlp] == ["rows", "streamed", "streamed", "streamed"]
    held = kept + sum(4 * m * i * o for (m, _, i, o), f in zip(_MINI, forms) if f == "rows")
    assert held <= max(budget, kept)
    assert all(form in ("rows", "streamed") for form in forms)


def _routes(model, m, **kwargs) -> dict:
    """The weights' routes of one ``IEF`` step on ``m`` samples of 16 positions of 64 features."""
    gen = torch.Generator().manual_seed(m)
    x, y = torch.randn(m, 16, 64, generator=gen), torch.randint(0, 4, (m, 16), generator=gen)
    opt = ief.optim.IEF(model, lr=1e-3, **kwargs)
    opt.step(x, y)
    return {k: v for k, v in opt.last_step_report.routes.items() if k.endswith("weight")}


class _WithFrozen(torch.nn.Module):
    """An MLP beside a frozen 2048 x 2048 layer (16 MiB) its forward does not use: an adapter's case, little trained
    in a large model."""

    def __init__(self, mlp: torch.nn.Module):
        super().__init__()
        self.mlp, self.frozen = mlp, torch.nn.Linear(2048, 2048).requires_grad_(False)

    def forward(self, x):
        return self.mlp(x)


def test_the_optimisers_default_budget_is_twice_the_models_parameter_bytes_and_at_least_8_mib():
    """``IEF(model)`` keeps a weight's rows while the rows kept fit twice the model's parameter bytes, frozen ones
    counted, and at least 8 MiB (:data:`ief.streamed.FLOOR_BYTES`); a 64 -> 512 -> 4 MLP (138 KiB of parameters):

    - at M 32 its first weight's rows are 4 MiB: kept, within the floor (the former rule, rows within 1 MiB a
      weight, streamed them); at M 64, 8 MiB beside the head's and the biases' 0.6 MiB: streamed;
    - beside 16 MiB of frozen parameters (the budget 33.8 MB) they are kept at M 64 too;
    - ``memory_budget=`` sets it: ``math.inf`` keeps every weight's rows, ``0`` streams every weight."""
    torch.manual_seed(3)
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.Tanh(), torch.nn.Linear(512, 4))
    assert ief.streamed.model_bytes(mlp) == 4 * (64 * 512 + 512 + 512 * 4 + 4)
    assert ief.streamed.rows_budget(mlp, None) == 8 << 20 == ief.streamed.FLOOR_BYTES
    assert ief.streamed.rows_budget(_WithFrozen(mlp), None) == 2 * 4 * (2048 * 2049 + 64 * 512 + 512 + 512 * 4 + 4)
    assert _routes(copy.deepcopy(mlp), 32) == {"0.weight": "dense", "2.weight": "dense"}
    assert _routes(copy.deepcopy(mlp), 64) == {"0.weight": "streamed", "2.weight": "dense"}
    assert _routes(_WithFrozen(copy.deepcopy(mlp)), 64) == {"mlp.0.weight": "dense", "mlp.2.weight": "dense"}
    assert _routes(copy.deepcopy(mlp), 64, memory_budget=math.inf) == {"0.weight": "dense", "2.weight": "dense"}
    assert _routes(copy.deepcopy(mlp), 32, memory_budget=0) == {"0.weight": "streamed", "2.weight": "streamed"}


@pytest.mark.parametrize("kwargs, match", [
    (dict(memory_budget=-1), "memory_budget must be a number of bytes >= 0"),
    (dict(memory_budget=float("nan")), "got nan"),
    (dict(memory_budget="1GB"), "got '1GB'"),
    (dict(memory_budget=True), "got True"),
    (dict(form="rows", memory_budget=1 << 20), "read by form='auto' only"),
])
def test_a_bad_memory_budget_is_refused_in_words(kwargs, match):
    """A budget that is not a number of bytes ``>= 0``, or one given with a forced form, is refused by the
    optimisers and ``ief.per_sample`` before anything runs, naming the value."""
    model = torch.nn.Linear(4, 3)
    with pytest.raises(ValueError, match=match):
        ief.optim.IEF(model, **kwargs)
    with pytest.raises(ValueError, match=match):
        ief.per_sample(model, torch.randn(2, 4), torch.tensor([0, 1]), **{"form": "auto", **kwargs})


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


T_WIDE = 16  # positions per sample of the memory test's batches


def _wide_mlp() -> torch.nn.Module:
    """Wide Linear weights over 16 positions: under ``form="auto"`` the first (64 -> 1024) keeps its rows (2 MiB at
    M 8, 4 at M 16: fewer flops than its kernel, within the default budget of twice the model's 4.3 MiB), the middle
    (1024 -> 1024) takes the ghost kernel and the head (1024 -> 4) keeps its rows, at M 8 and 16 alike."""
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
    peak = peak_added_bytes(lambda: opt.step(x, y))
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
    grows with ``M``, plus 1 MiB (:func:`_cost_model_bytes`: the factors and the kernel's float64 copies of them,
    the kernel's ``M^2 T^2``, the ``M x M`` Gram; a block and the direction ``[P]`` do not grow), and for the
    streamed form that is under a quarter of ``8 P`` float32 entries: no buffer grows like ``M x P``; the default
    grows by the rows it keeps within its budget (twice the model's bytes, at M 16 too) and beside them by as
    little. The rows form, which keeps every weight's rows in ``J``'s buffer, grows by more than ``8 P_weights``
    float32 entries, and its cost model says so too."""
    model = _wide_mlp()
    p = sum(q.numel() for q in model.parameters())
    weights = sum(q.numel() for name, q in model.named_parameters() if name.endswith("weight"))
    (small, routes), (large, same) = (_steady_step_bytes(model, m, form) for m in (8, 16))
    assert routes == same, (routes, same)
    weight_routes = {name: route for name, route in routes.items() if name.endswith("weight")}
    expected = {"auto": {"0.weight": "dense", "2.weight": "factored", "4.weight": "dense"},
                "streamed": dict.fromkeys(weight_routes, "streamed"), "rows": dict.fromkeys(weight_routes, "dense")}
    assert weight_routes == expected[form], weight_routes
    growth = large - small
    modelled = _cost_model_bytes(model, 16, routes) - _cost_model_bytes(model, 8, routes)
    assert growth <= 1.5 * modelled + (1 << 20), (form, growth, modelled)
    by_m_p = 8 * p * 4
    # the default keeps the rows its budget allows: J's columns but the middle weight's, within twice the model's
    # bytes at M 16 too; beside them it grows as the streamed form does
    kept = p - weights if form == "streamed" else p - 1024 * 1024
    assert form != "auto" or 4 * 16 * kept <= 2 * 4 * p
    if form == "rows":
        assert growth > 8 * weights * 4 and modelled > 8 * weights * 4, (growth, modelled, 8 * weights * 4)
    else:
        rows = 4 * 8 * kept  # what the rows J keeps add from M 8 to 16
        assert growth - rows < by_m_p / 4 and modelled - rows < by_m_p / 4, (form, growth, modelled, rows, by_m_p)
