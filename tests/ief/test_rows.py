"""``ief.rows``: one interface for ``J [M, P]`` in every form (the dense adaptor and the factored Jacobian).

Every form answers the Gram solves' questions as the ``[M, P]`` matrix itself does: ``gram`` = ``(J/s)(J/s)^T``,
``combine_rows`` = ``(J/s)^T c``, ``times`` = ``(J/s) v``, ``max_abs`` = ``max|J|`` (exact for the dense adaptor, an
upper bound within a factor ``T`` for factors), in float32 and float64 models alike.
"""
from __future__ import annotations

import math

import pytest
import torch

import ief
from ief.rows import FORMS, DenseRows, FactoredJacobian, Rows, as_rows, check_form, prefer_ghost
from tiny_models import TokenTableModel, mlp_case, sequence_case

# float64: rounding only; float32: the dense J is rounded to float32 entry by entry, the factored forms keep the
# float32 factors and form their products in float64, so they agree to float32 rounding of J
RTOL = {torch.float64: 1e-12, torch.float32: 1e-5}


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-300))


def _case(name: str, dtype: torch.dtype):
    return mlp_case(dtype=dtype) if name == "mlp" else sequence_case(dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("case", ["mlp", "sequence"])
@pytest.mark.parametrize("form", ["dense-adaptor", "ghost", "rows", "auto"])
def test_every_form_answers_as_the_dense_matrix(form, case, dtype):
    """``gram``, ``combine_rows`` (float64; ``final=True`` may be the model's dtype), ``times`` and ``max_abs`` of each
    form against the products of the ``[M, P]`` matrix of the same backward, at scales 1 and 3."""
    c = _case(case, dtype)
    torch.manual_seed(0)
    matrix = ief.per_sample(c.model, c.inputs, c.targets, loss=c.loss, form="dense").jacobian
    torch.manual_seed(0)
    rows = DenseRows(matrix) if form == "dense-adaptor" else \
        ief.per_sample(c.model, c.inputs, c.targets, loss=c.loss, form=form).jacobian
    assert isinstance(rows, Rows) and rows.shape == matrix.shape and rows.dtype == dtype
    j = matrix.double()
    gen = torch.Generator().manual_seed(0)
    coeff = torch.randn(j.shape[0], generator=gen, dtype=torch.float64)
    v = torch.randn(j.shape[1], generator=gen, dtype=torch.float64)
    rtol = RTOL[dtype]
    for scale in (1.0, 3.0):
        gram = rows.gram(scale)
        assert gram.dtype == torch.float64 and torch.equal(gram, gram.T)
        assert rel_err(gram, (j / scale) @ (j / scale).T) <= rtol, ("gram", scale)
        combined = rows.combine_rows(coeff, scale)
        assert combined.dtype == torch.float64
        assert rel_err(combined, (j / scale).T @ coeff) <= rtol, ("combine_rows", scale)
        final = rows.combine_rows(coeff, scale, final=True)
        assert final.dtype in (torch.float64, dtype)
        assert rel_err(final, (j / scale).T @ coeff) <= max(rtol, 1e-6 if dtype == torch.float32 else 0), "final"
        product = rows.times(v, scale)
        assert product.dtype == torch.float64
        assert rel_err(product, (j / scale) @ v) <= rtol, ("times", scale)
    truth = float(j.abs().max())
    if form == "dense-adaptor":
        assert rows.max_abs() == truth
    else:  # an upper bound (it only keeps the float64 Gram clear of overflow)
        assert truth * (1 - rtol) <= rows.max_abs() < math.inf
    if form == "ghost":
        assert rows.ghosts  # the factors' own products are under test
    assert rows.is_finite()
    assert rows.gram_scale() == 1.0  # an ordinary magnitude


def test_dense_rows_against_dense_products():
    """``gram = J J^T``, ``combine_rows(c) = J^T c`` (default scale 1), ``max_abs`` the largest magnitude whatever its
    sign, and ``gram_scale`` 1 inside ``[1e-100, 1e100]``, ``max|J|`` outside."""
    j = torch.randn(5, 12, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    c = torch.rand(5, generator=torch.Generator().manual_seed(1), dtype=torch.float64) + 0.1
    rows = DenseRows(j)
    assert rel_err(rows.gram(), j @ j.T) <= 1e-14
    assert rel_err(rows.combine_rows(c), j.T @ c) <= 1e-14
    assert rel_err(rows.times(torch.ones(12, dtype=torch.float64)), j.sum(1)) <= 1e-14
    assert rows.materialize() is j
    negative = -j.abs() - 0.5
    negative[2, 3] = -7.0
    assert DenseRows(negative).max_abs() == 7.0 and rows.max_abs() == float(j.abs().max())
    for scale, expected in ((1.0, 1.0), (1e-50, 1.0), (1e80, 1.0), (1e-120, 7e-120), (1e150, 7e150)):
        assert DenseRows(negative * scale).gram_scale() == pytest.approx(expected, rel=1e-15), scale
    assert DenseRows(torch.zeros(3, 0, dtype=torch.float64)).max_abs() == 0.0


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_non_finite_entries_are_seen_by_every_form(bad):
    j = torch.randn(4, 6, dtype=torch.float64)
    j[1, 2] = bad
    assert not DenseRows(j).is_finite()
    a = torch.ones(4, 1, 2, dtype=torch.float64)
    g = torch.ones(4, 1, 3, dtype=torch.float64)
    g[3, 0, 1] = bad
    factored = FactoredJacobian(4, [6, 2], a, [(0, a, g)], torch.ones(4, 2, dtype=torch.float64), {1: 0})
    assert not factored.is_finite()
    fine = FactoredJacobian(4, [6, 2], a, [(0, a, torch.ones_like(g))], torch.ones(4, 2, dtype=torch.float64), {1: 0})
    assert fine.is_finite()


def test_as_rows_wraps_a_tensor_once_and_names_what_it_refuses():
    j = torch.randn(3, 4, dtype=torch.float64)
    rows = as_rows(j)
    assert isinstance(rows, DenseRows) and rows.materialize() is j and as_rows(rows) is rows
    with pytest.raises(ValueError, match=r"^jacobian must be a \[M, P\] tensor, got \(12,\)$"):
        as_rows(j.flatten())
    with pytest.raises(ValueError, match=r"^sampled_jacobian must be a \[M, P\] tensor, got list$"):
        as_rows([[1.0]], "sampled_jacobian")
    with pytest.raises(ValueError, match=r"^jacobian must be floating point, got torch.int64$"):
        as_rows(torch.ones(2, 2, dtype=torch.long))
    with pytest.raises(TypeError):
        Rows()  # the interface itself has no products


def test_check_form_names_the_accepted_forms():
    for form in FORMS:
        assert check_form(form) == form
    accepted = "'dense', 'auto', 'ghost', 'rows', 'streamed'"
    with pytest.raises(ValueError, match=rf"^form must be one of {accepted}, got 'sparse'$"):
        check_form("sparse")
    with pytest.raises(ValueError, match=r"got None$"):
        check_form(None)


def test_auto_form_weighs_t_squared_in_both_the_flops_and_the_memory():
    """``prefer_ghost``'s docstring: ghost kernels cost ``M^2 T^2 (I + O)`` flops and ``M^2 T^2`` memory, rows
    ``M T I O + M^2 I O`` and ``M I O``. Cases where dropping a ``T^2`` factor would flip the choice."""
    # M=2, T=4, I=O=8: ghost flops 1024 > rows 768 (memory 64 <= 128): rows
    assert not prefer_ghost("auto", 2, 4, 8, 8)
    # M=100, T=2, I=O=16: flops 102400 <= 2611200 but memory 40000 > 25600: rows
    assert not prefer_ghost("auto", 100, 2, 16, 16)
    assert prefer_ghost("auto", 100, 1, 16, 16)  # T=1: both within
    assert prefer_ghost("ghost", 100, 2, 16, 16) and not prefer_ghost("rows", 2, 1, 8, 8)
    assert prefer_ghost("auto", 64, 1, 3072, 2048)
    assert not prefer_ghost("auto", 64, 512, 768, 8)


@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_dense_products_over_column_blocks_equal_a_float64_copy_of_each_block(scale):
    """A float32 ``J`` wider than two column blocks (the last one partial) is read through one reused float64
    buffer; every product equals, bit for bit, the same block products of ``block.to(float64)`` (the fresh copies it
    replaces), so the buffer changes speed, never a number."""
    from ief.model_call import COLUMN_CHUNK, column_chunks

    gen = torch.Generator().manual_seed(4)
    j = torch.randn(3, 2 * COLUMN_CHUNK + 77, generator=gen)
    coeff = torch.randn(3, generator=gen, dtype=torch.float64)
    v = torch.randn(j.shape[1], generator=gen, dtype=torch.float64)
    blocks = [(lo, b.to(torch.float64) / scale) for lo, b in column_chunks(j)]
    assert len(blocks) == 3 and blocks[-1][1].shape[1] == 77
    gram = torch.zeros(3, 3, dtype=torch.float64)
    for _, b in blocks:
        gram += b @ b.T
    rows = DenseRows(j)
    assert torch.equal(rows.gram(scale), 0.5 * (gram + gram.T))
    assert torch.equal(rows.combine_rows(coeff, scale), torch.cat([coeff @ b for _, b in blocks]))
    product = torch.zeros(3, dtype=torch.float64)
    for lo, b in blocks:
        product += b @ v[lo : lo + b.shape[1]]
    assert torch.equal(rows.times(v, scale), product)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_narrow_rows_are_in_float64_range_without_a_pass_over_them(dtype, monkeypatch):
    """Entries of a float32/float16/bfloat16 ``J`` lie within ``[1e-100, 1e100]`` or are 0, so ``gram_scale`` is 1 and
    ``max|J|`` is never computed (one pass over ``J`` less per step); an all-zero ``J`` still gives the zero direction
    (through the solve), at zero damping and with damping."""
    def refuse(self):
        raise AssertionError("max_abs was computed")

    monkeypatch.setattr(DenseRows, "max_abs", refuse)
    tiny = torch.full((2, 5), float(torch.finfo(dtype).tiny) / 4, dtype=dtype)  # subnormal where the dtype has them
    assert DenseRows(tiny).gram_scale() == 1.0
    monkeypatch.undo()
    zeros = torch.zeros(3, 7, dtype=dtype)
    s = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    for lam in (0.0, 1e-3):
        d = ief.ief_direction(zeros, s, lam)
        assert d.dtype == dtype and d.shape == (7,) and not d.any()
    assert DenseRows(torch.full((2, 2), 1e-120, dtype=torch.float64)).gram_scale() == pytest.approx(1e-120)


def _table_batch(m: int, t: int, low: int, high: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(low, high, (m, t), generator=gen)
    ids[0, -2:] = 0  # padding
    targets = torch.randint(0, 4, (m, t), generator=gen)
    targets[ids.eq(0)] = -100
    return ids, targets


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("form", ["auto", "ghost", "rows"])
def test_an_embedding_table_keeps_only_its_used_rows_and_answers_as_the_per_sample_loop(form, dtype):
    """The token table's block holds only the rows the batch uses (fewer columns than ``V D``); the rows of ``J``
    equal the brute-force per-sample loop, every product equals the dense matrix's, the batch gradient is
    ``J^T 1`` with zeros on the unused rows, and the exact check (directional derivatives) passes."""
    import oracle

    torch.manual_seed(0)
    model = TokenTableModel(vocab=40, positions=8, dim=3, classes=4, twice=True).to(dtype)
    ids, targets = _table_batch(5, 6, 1, 9, seed=1)
    result = ief.per_sample(model, ids, targets, form=form, check="exact")
    rows = result.jacobian
    table = 0  # the token table is the first parameter (looked up twice: tokens and 3 id mod 40)
    assert isinstance(rows, FactoredJacobian) and table in rows.used_rows
    used, dim = rows.used_rows[table]
    expected = torch.unique(torch.cat([ids.flatten(), ((ids * 3) % 40).flatten()]))
    assert torch.equal(used, expected) and dim == 3 and rows.dense_width(table) == used.numel() * 3 < 40 * 3
    _, truth, _ = oracle.per_sample(model.double(), ids, targets)
    model.to(dtype)
    matrix = rows.materialize()
    assert rel_err(matrix, truth) <= RTOL[dtype]
    j = matrix.double()
    gen = torch.Generator().manual_seed(2)
    coeff = torch.randn(j.shape[0], generator=gen, dtype=torch.float64)
    v = torch.randn(j.shape[1], generator=gen, dtype=torch.float64)
    for scale in (1.0, 3.0):
        assert rel_err(rows.gram(scale), (j / scale) @ (j / scale).T) <= RTOL[dtype]
        assert rel_err(rows.combine_rows(coeff, scale), (j / scale).T @ coeff) <= RTOL[dtype]
        assert rel_err(rows.combine_rows(coeff, scale, final=True), (j / scale).T @ coeff) <= RTOL[dtype]
        assert rel_err(rows.times(v, scale), (j / scale) @ v) <= RTOL[dtype]
    assert torch.equal(rows.row_sum(), matrix.sum(0)) or rel_err(rows.row_sum(), matrix.sum(0)) <= RTOL[dtype]
    assert rel_err(result.gradient, truth.sum(0)) <= RTOL[dtype]
    norms = torch.stack([j[:, lo:hi].square().sum(1) for lo, hi in zip(rows.offsets[:-1], rows.offsets[1:])], 1)
    assert rel_err(rows.row_sqnorms(), norms) <= RTOL[dtype]
    assert float(j.abs().max()) * (1 - RTOL[dtype]) <= rows.max_abs() < math.inf and rows.is_finite()  # a bound


def test_the_optimiser_reuses_its_buffer_when_the_used_rows_change_from_batch_to_batch():
    """``IEF(form="auto")`` on batches that use 8, then 30, then 5 table rows: each step equals the dense form's
    step (float64), though the factored ``J`` is written into the first columns of the buffer of a wider batch."""
    torch.manual_seed(0)
    model = TokenTableModel(vocab=40, positions=8, dim=3, classes=4, twice=True).double()
    twin = TokenTableModel(vocab=40, positions=8, dim=3, classes=4, twice=True).double()
    twin.load_state_dict(model.state_dict())
    auto = ief.optim.IEF(model, lr=0.1, form="auto")
    dense = ief.optim.IEF(twin, lr=0.1, form="dense")
    widths = []
    for seed, high in ((3, 9), (4, 31), (5, 6)):
        ids, targets = _table_batch(5, 6, 1, high, seed)
        auto.step(ids, targets)
        dense.step(ids, targets)
        widths.append(auto._buffer.shape[1])
        for p, q in zip(model.parameters(), twin.parameters()):
            assert rel_err(p.detach(), q.detach()) <= 1e-12
    assert widths[1] > widths[0] and widths[2] == widths[1]  # grown once, then reused


@pytest.mark.parametrize("noise", [0.0, 1e-3, 1e-2])
def test_float32_factored_directions_keep_float32_accuracy_when_coefficients_cancel(noise):
    """Near-duplicate samples (8 pairs ``x``, ``x + noise``) make the solve's coefficients large and cancelling; each
    Linear weight's block ``(cG)^T A`` is still formed in float32 to a few ulps of the float64 computation on the
    same ``J`` (``1e-6`` relative), through the whitened inputs of :func:`ief.rows._whitened_factors` (no QR over the
    input features). A plain float32 product of ``(cG)^T`` and ``A`` is 2e-5 off at ``noise = 1e-3`` (checked
    below), so this test fails if that accuracy is lost."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Tanh(), torch.nn.Linear(30, 5))
    x = torch.randn(8, 40)
    x = torch.cat([x, x + noise * torch.randn(8, 40)])
    y = torch.randint(0, 5, (8,)).repeat(2)
    r = ief.per_sample(model, x, y, form="auto")
    fac = r.jacobian
    assert len(fac.ghosts) == 2 and fac.dtype == torch.float32  # both weights on the whitened float32 path
    widened = [(i, a.double(), g.double()) for i, a, g in fac.ghosts]
    exact = FactoredJacobian(fac.shape[0], fac.sizes, fac.dense.double(), widened, fac.dense.double(),
                             fac.dense_index)
    for damping in (1e-7, 0.0):
        for got, expected in ((ief.ief_direction(fac, r.logit_sqnorm, damping),
                               ief.ief_direction(exact, r.logit_sqnorm.double(), damping)),
                              (ief.ef_direction(fac, damping), ief.ef_direction(exact, damping))):
            assert got.dtype == torch.float32
            err = float((got.double() - expected).norm() / expected.norm())
            assert err < 1e-6, (noise, damping, err)
    if noise == 1e-3:  # what the whitening buys: the plain float32 product of the same coefficients
        coeff = ief.directions._solve_gram(exact.gram(), torch.ones(16, dtype=torch.float64), 1e-7, 0.0)
        i, a, g = fac.ghosts[0]
        plain = ((g.double() * coeff[:, None, None]).flatten(0, 1).T.float() @ a.flatten(0, 1))
        truth = (g.double() * coeff[:, None, None]).flatten(0, 1).T @ a.flatten(0, 1).double()
        assert float((plain.double() - truth).norm() / truth.norm()) > 1e-6


def test_float32_factored_direction_blocks_over_output_rows_are_the_whole_product(monkeypatch):
    """A Linear weight with more positions than input features (``M T > I``) forms its float32 block of the
    direction from float64 products a bounded block of output rows at a time: one row per block gives the very
    values of one block for all of them."""
    c = sequence_case(m=4, t=5, dtype=torch.float32)
    r = ief.per_sample(c.model, c.inputs, c.targets, form="ghost")
    fac = r.jacobian
    assert any(a.shape[0] * a.shape[1] > a.shape[2] for _, a, _ in fac.ghosts)  # the M T > I branch is taken
    whole = ief.ief_direction(fac, r.logit_sqnorm, 1e-3)
    monkeypatch.setattr(ief.rows, "COLUMN_BYTES", 1)
    assert torch.equal(ief.ief_direction(fac, r.logit_sqnorm, 1e-3), whole)


def _with_bad_entry(rows_kind: str, dtype: torch.dtype, bad: float | None):
    """A :class:`Rows` of 4 samples in ``dtype``: dense, or factored (one ghost weight with T = 3 positions and one
    dense block), with ``bad`` (if given) in sample 2's dense entries, its ghost input or its ghost output gradient."""
    gen = torch.Generator().manual_seed(7)
    dense = torch.randn(4, 9, generator=gen).to(dtype)
    a, g = torch.randn(4, 3, 5, generator=gen).to(dtype), torch.randn(4, 3, 2, generator=gen).to(dtype)
    where = rows_kind.split("-")[-1]
    if bad is not None:
        {"dense": dense, "a": a, "g": g}[where].view(4, -1)[2, 1] = bad
    if rows_kind == "dense-adaptor-dense":
        return DenseRows(dense)
    return FactoredJacobian(4, [10, 9], dense, [(0, a, g)], dense, {1: 0})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("bad", [None, math.inf, -math.inf, math.nan], ids=str)
@pytest.mark.parametrize("kind", ["dense-adaptor-dense", "factored-dense", "factored-a", "factored-g"])
def test_finiteness_read_off_the_gram_diagonal_equals_the_pass_over_j(kind, bad, dtype):
    """After ``gram()``, ``finite_flag`` of a ``J`` narrower than float64 comes from the Gram's diagonal, with no pass
    over ``J`` (the steady optimiser step asks for it after its solve); it equals the reference pass
    (``_finite_flag`` over the entries, or over the factors) for every kind of non-finite entry in every place, and a
    float64 ``J`` still takes the pass."""
    rows = _with_bad_entry(kind, dtype, bad)
    reference = bool(ief.rows._finite_flag([rows.matrix] if isinstance(rows, DenseRows) else
                                           [rows.dense, *(t for _, a, g in rows.ghosts for t in (a, g))], rows.device))
    assert reference == (bad is None)
    rows.gram()
    from_gram = rows._gram_finite
    assert (from_gram is None) == (dtype == torch.float64)
    if from_gram is not None:
        assert bool(from_gram) == reference
    assert bool(rows.finite_flag()) == reference


def test_finiteness_from_the_gram_is_only_taken_where_the_gram_cannot_overflow():
    """A finite float64 ``J`` with entries near 1e200 has an infinite Gram diagonal: its finiteness is not read off
    the Gram (it would say "not finite"), nor from a Gram at a scale other than 1."""
    big = torch.full((2, 3), 1e200, dtype=torch.float64)
    rows = DenseRows(big)
    assert not bool(torch.isfinite(rows.gram()).all())
    assert rows._gram_finite is None and bool(rows.finite_flag())
    narrow = DenseRows(torch.ones(2, 3))
    narrow.gram(3.0)
    assert narrow._gram_finite is None
    narrow.gram(1.0)
    assert narrow._gram_finite is not None and bool(narrow.finite_flag())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_a_final_dense_combination_is_the_float64_one_rounded_once(dtype):
    """``combine_rows(final=True)`` of a narrower dense ``J`` is written block by block in its dtype, bit for bit the
    float64 combination ``.to(dtype)`` (no ``[P]`` float64 temporary); float64 is unchanged. Wider than two column
    blocks, the last one partial; against the float64 oracle ``J^T c``."""
    from ief.model_call import COLUMN_CHUNK

    gen = torch.Generator().manual_seed(5)
    j = torch.randn(3, 2 * COLUMN_CHUNK + 77, generator=gen).to(dtype)
    coeff = torch.randn(3, generator=gen, dtype=torch.float64)
    rows = DenseRows(j)
    wide = rows.combine_rows(coeff)
    final = rows.combine_rows(coeff, final=True)
    assert wide.dtype == torch.float64 and final.dtype == dtype
    assert torch.equal(final, wide.to(dtype))
    assert rel_err(wide, j.double().T @ coeff) <= 1e-14


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_factored_dense_blocks_are_combined_by_runs_and_tables_by_their_used_rows(dtype):
    """:class:`FactoredJacobian`'s dense blocks are combined in runs of adjacent blocks, a table through its used
    rows, a ghost weight from its factors: the whole ``J^T c`` (final and not) equals the materialised ``J``'s."""
    gen = torch.Generator().manual_seed(6)
    m = 3
    a, g = torch.randn(m, 2, 4, generator=gen).to(dtype), torch.randn(m, 2, 3, generator=gen).to(dtype)
    ids = torch.tensor([0, 2])  # a [3, 2] table whose rows 0 and 2 the batch uses
    # J's columns: ghost weight [3, 4] (12), bias (3), table (6; 4 in dense), LayerNorm weight (5), bias (5)
    sizes = [12, 3, 6, 5, 5]
    dense = torch.randn(m, 3 + 4 + 5 + 5, generator=gen).to(dtype)
    rows = FactoredJacobian(m, sizes, dense, [(0, a, g)], dense, {1: 0, 2: 3, 3: 7, 4: 12}, {2: (ids, 2)})
    assert list(rows._dense_runs()) == [(12, 0, 3), (21, 7, 10)]
    coeff = torch.randn(m, generator=gen, dtype=torch.float64)
    expected = rows.materialize().double().T @ coeff
    assert rel_err(rows.combine_rows(coeff), expected) <= RTOL[dtype]  # float32: the materialised ghost block rounds
    final = rows.combine_rows(coeff, final=True)
    assert final.dtype == dtype and rel_err(final, expected) <= RTOL[dtype]
    # one run (the table first, the factored weight last): combined straight into J's columns, the table apart
    one = FactoredJacobian(m, [6, 3, 5, 5, 12], dense, [(4, a, g)], dense, {0: 0, 1: 4, 2: 7, 3: 12}, {0: (ids, 2)})
    assert list(one._dense_runs()) == [(6, 4, 13)]
    assert rel_err(one.combine_rows(coeff), one.materialize().double().T @ coeff) <= RTOL[dtype]


@pytest.mark.parametrize("block, passes", [(5, [5, 6, 2]), (6, [6, 5, 2]), (7, [13])])
def test_wide_dense_runs_are_combined_straight_into_the_direction(block, passes, monkeypatch):
    """Runs of dense blocks at least a column block wide (a tied GPT-2: the token table, then the blocks after the
    position table's used rows) each go straight into the direction, with no ``[P_dense]`` float64 part, the table
    apart; runs narrower than a block beside them (biases between streamed weights) take one pass of their own;
    where every run is narrower (an MLP's biases) one pass over the whole ``dense`` serves every run and the table.
    Each equals the materialised ``J``'s ``J^T c``."""
    import ief.rows as rows_module

    gen = torch.Generator().manual_seed(8)
    m = 2
    monkeypatch.setattr(rows_module, "column_chunk", lambda matrix: block)
    a, g = torch.randn(m, 1, 2, generator=gen), torch.randn(m, 1, 2, generator=gen)
    dense = torch.randn(m, 5 + 2 + 6, generator=gen)
    # J: a block of 5, a [2, 2] table (its row 1 used: 2 columns in dense), a block of 6, a factored [2, 2] weight
    rows = FactoredJacobian(m, [5, 4, 6, 4], dense, [(3, a, g)], dense, {0: 0, 1: 5, 2: 7},
                            {1: (torch.tensor([1]), 2)})
    assert list(rows._dense_runs()) == [(0, 0, 5), (9, 7, 6)]
    calls = []
    real = rows_module._matrix_combine
    monkeypatch.setattr(rows_module, "_matrix_combine",
                        lambda matrix, *args, **kw: calls.append(matrix.shape[1]) or real(matrix, *args, **kw))
    coeff = torch.randn(m, generator=gen, dtype=torch.float64)
    expected = rows.materialize().double().T @ coeff
    assert rel_err(rows.combine_rows(coeff, final=True), expected) <= RTOL[torch.float32]
    assert calls == passes


def test_a_combination_beside_wide_runs_holds_no_float64_copy_of_them():
    """A wide dense run (a transformer's weights kept as rows) beside a narrow one (a bias between two streamed
    weights): the final ``J^T c`` adds its own ``[P]`` and at most one float64 column block, not a float64 copy of
    the wide run's columns (what one pass over all of ``dense`` made: 2x the direction's bytes in float32). Against
    the materialised ``J``."""
    from ief.rows import COLUMN_BYTES
    from tests.memory import peak_added_bytes

    gen = torch.Generator().manual_seed(9)
    m, width = 4, 3_000_000
    a, g = torch.randn(m, 1, 2, generator=gen), torch.randn(m, 1, 2, generator=gen)
    dense = torch.randn(m, width + 10, generator=gen)
    # J: a wide block, a factored [2, 2] weight, a bias of 10, a factored [2, 2] weight
    rows = FactoredJacobian(m, [width, 4, 10, 4], dense, [(1, a, g), (3, a.clone(), g.clone())], dense,
                            {0: 0, 2: width})
    assert [w for _, _, w in rows._dense_runs()] == [width, 10]
    coeff = torch.randn(m, generator=gen, dtype=torch.float64)
    direction_bytes = 4 * (width + 18)
    peak = peak_added_bytes(lambda: rows.combine_rows(coeff, final=True))
    assert peak <= direction_bytes + COLUMN_BYTES + (1 << 20), (peak, direction_bytes)
    expected = rows.materialize().double().T @ coeff
    assert rel_err(rows.combine_rows(coeff, final=True), expected) <= RTOL[torch.float32]
