"""The union batch across processes (ief.distributed), held to one process on the concatenated rows: 2 and 3 gloo
processes on this machine, uneven batches, float64, and a failure on one rank raised on every rank."""
from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ief.directions import ef_solve, ief_solve, sf_solve
from ief.distributed import (LAYOUT_FIELDS, DistributedRows, RankFailure, agree, all_gather_rows, batch_sizes,
                              gram_plan)
from ief.rows import DenseRows, FactoredJacobian
from ranks import DEADLINE, join, start

P = 11


def _union_rows(sizes: list[int]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    return torch.randn(sum(sizes), P, generator=gen, dtype=torch.float64)


SPAWN_DEADLINE = DEADLINE  # seconds a multi-process test may run before it fails as hung (every rank killed)
COLLECTIVE_TIMEOUT = 600.0  # seconds a gloo collective waits for the other ranks (a loaded machine is slow)
_start, _join = start, join  # the ranks forked from the session's fork server, under a deadline (tests/ranks.py)


def _spawn(fn, world: int, tmp_path: Path, *args, deadline: float = SPAWN_DEADLINE,
           collective_timeout: float = COLLECTIVE_TIMEOUT) -> list:
    """Run ``fn(rank, *args)`` on ``world`` gloo processes; each returns what it pickled. A collective waits at most
    ``collective_timeout`` seconds and the processes together run at most ``deadline`` seconds (:func:`_join`)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    outs = [tmp_path / f"rank{r}.pkl" for r in range(world)]
    context = _start(_entry, (fn, world, str(tmp_path / "store"), [str(o) for o in outs], args, collective_timeout),
                     world)
    _join(context, world, deadline)
    return [pickle.loads(o.read_bytes()) for o in outs]


def _entry(rank: int, fn, world: int, store: str, outs: list[str], args: tuple,
           collective_timeout: float = COLLECTIVE_TIMEOUT) -> None:
    from datetime import timedelta

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=collective_timeout))
    try:
        Path(outs[rank]).write_bytes(pickle.dumps(fn(rank, *args)))
        dist.barrier()  # no rank leaves (closing its connections) while another still talks to it
    finally:
        dist.destroy_process_group()


def _factored(rank: int, m: int) -> FactoredJacobian:
    """Rank ``rank``'s ``m`` rows as a FactoredJacobian of six parameters: weight 0 (``[6, 5]``, ``T = 1``) and weight
    2 (``[8, 8]``, ``T = 3`` on rank 0 and 2 elsewhere: padded) as factors on every rank, cheaper than their rows;
    weight 3 (``[3, 2]``, ``T = 2``) as factors whose rows are cheaper; weight 4 (``[5, 6]``) as factors on every
    rank but rank 1, which holds its rows; a bias (parameter 1) and a ``[10, 3]`` table of which each rank keeps its
    own used rows (parameter 5) in ``dense``."""
    gen = torch.Generator().manual_seed(100 + rank)

    def r(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    positions = 3 if rank == 0 else 2
    ghosts = [(0, r(m, 1, 5), r(m, 1, 6)), (2, r(m, positions, 8), r(m, positions, 8)), (3, r(m, 2, 2), r(m, 2, 3))]
    ids = torch.randperm(10, generator=gen)[:3 + rank].sort().values
    blocks = {1: r(m, 6), 5: r(m, ids.numel() * 3)}
    if rank == 1:
        blocks[4] = r(m, 30)
    else:
        ghosts.append((4, r(m, 2, 6), r(m, 2, 5)))
    dense_index, lo = {}, 0
    for i, block in blocks.items():
        dense_index[i], lo = lo, lo + block.shape[1]
    return FactoredJacobian(m, [30, 6, 64, 6, 30, 30], torch.empty(0, dtype=torch.float64), ghosts,
                            torch.cat(list(blocks.values()), dim=1), dense_index, used_rows={5: (ids, 3)})


def _local_rows(rank: int, sizes: list[int], kind: str):
    if kind == "factored":
        return _factored(rank, sizes[rank])
    union = _union_rows(sizes)
    lo = sum(sizes[:rank])
    return DenseRows(union[lo:lo + sizes[rank]])


def _union_of(sizes: list[int], kind: str) -> DenseRows:
    if kind == "factored":
        return DenseRows(torch.cat([_factored(r, m).materialize() for r, m in enumerate(sizes)]))
    return DenseRows(_union_rows(sizes))


def _rows_on_rank(rank: int, sizes: list[int], kind: str) -> dict:
    local = _local_rows(rank, sizes, kind)
    group = dist.group.WORLD
    assert batch_sizes(sizes[rank], group, torch.device("cpu")) == sizes
    rows = DistributedRows(local, group, sizes)
    gen = torch.Generator().manual_seed(3)
    s = torch.rand(sum(sizes), generator=gen, dtype=torch.float64) + 0.5
    v = torch.randn(rows.shape[1], generator=gen, dtype=torch.float64)
    return dict(
        gram=rows.gram(), gram_scaled=rows.gram(2.0), combine=rows.combine_rows(s), times=rows.times(v),
        max_abs=rows.max_abs(), finite=bool(rows.finite_flag()), row_sum=rows.row_sum(),
        ief=ief_solve(rows, s, 1e-3), ef=ef_solve(rows, 1e-3), sf=sf_solve(rows, v, 1e-2),
        gathered=all_gather_rows(local.materialize()[:, :2], sizes, group), plan=rows.plan(),
    )


@pytest.mark.slow  # starts processes
@pytest.mark.parametrize("kind", ["dense", "factored"])
@pytest.mark.parametrize("sizes", [[3, 5], [4, 1, 6]], ids=["two-uneven", "three-uneven"])
def test_distributed_rows_equal_the_concatenated_rows_on_every_rank(sizes, kind, tmp_path):
    """Every quantity the Gram solves use, and the iEF/EF/SF directions themselves, equal DenseRows of the union
    batch to float64 rounding (1e-12 relative), and are bit-identical across ranks: rows given dense, and factored
    rows (:func:`_factored`) whose Gram is formed from the gathered factors of the weights every rank keeps as
    factors and that are cheaper to send than their rows (``T_max (I + O) <= I O``, positions padded to the most of
    any rank), and from dense columns for the rest (a weight whose rows are cheaper, one that a rank holds as rows,
    a bias, a table whose used rows differ between ranks)."""
    results = _spawn(_rows_on_rank, len(sizes), tmp_path, sizes, kind)
    union = _union_of(sizes, kind)
    gen = torch.Generator().manual_seed(3)
    s = torch.rand(sum(sizes), generator=gen, dtype=torch.float64) + 0.5
    v = torch.randn(union.shape[1], generator=gen, dtype=torch.float64)
    expected = dict(gram=union.gram(), gram_scaled=union.gram(2.0), combine=union.combine_rows(s),
                    times=union.times(v), row_sum=union.row_sum(), ief=ief_solve(union, s, 1e-3),
                    ef=ef_solve(union, 1e-3), sf=sf_solve(union, v, 1e-2), gathered=union.matrix[:, :2])
    for key, want in expected.items():
        got = results[0][key]
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12 * float(want.abs().max())), key
        for other in results[1:]:
            assert torch.equal(other[key], got), f"{key} differs between ranks"
    true_max = float(union.matrix.abs().max())
    if kind == "dense":
        assert all(r["max_abs"] == true_max and r["finite"] for r in results)
        assert results[0]["plan"].factors is None and results[0]["plan"].dense_width == P
    else:  # FactoredJacobian.max_abs is a bound of max|J|: the largest of the ranks' bounds, on every rank
        bound = max(_factored(r, m).max_abs() for r, m in enumerate(sizes))
        assert all(r["max_abs"] == bound and r["finite"] for r in results) and true_max <= bound
        assert results[0]["plan"].factors == ((0, 1, 5, 6), (2, 3, 8, 8))
        # the [10, 3] table as the union of the ranks' used rows (3 + rank each), not its 10 rows
        union = torch.unique(torch.cat([_factored(r, m).used_rows[5][0] for r, m in enumerate(sizes)]))
        assert results[0]["plan"].tables == ((5, union.numel(), 3),) and union.numel() < 10
        assert all(torch.equal(r["plan"].union_ids[5], union) for r in results)
        assert results[0]["plan"].dense == (1, 3, 4, 5)
        assert results[0]["plan"].dense_width == 6 + 6 + 30 + 3 * union.numel()
    assert all(r["plan"] == results[0]["plan"] for r in results)
    width = results[0]["plan"].dense_width + results[0]["plan"].factor_width
    assert results[0]["plan"].received_bytes == len(sizes) * max(sizes) * width * 8


def _layouts(*ranks: list[tuple[int, ...]]) -> torch.Tensor:
    """Every rank's layout, ``(factored, T, I, O, size)`` per parameter, with ``(kept as used rows, U, D)`` appended
    (zeros when not given)."""
    return torch.tensor([[(*f, *(0,) * (LAYOUT_FIELDS - len(f))) for f in rank] for rank in ranks], dtype=torch.int64)


def test_the_gram_plan_sends_factors_only_where_every_rank_has_them_and_they_are_smaller():
    """The rule, from the ranks' layouts (factored, T, I, O, size): factors iff every rank keeps the weight as factors
    and ``T_max (I + O) <= I O`` (equality included); anything else dense; rows that are not factored on some rank
    are gathered whole; ranks that hold different models are refused with the values."""
    plan = gram_plan(_layouts([(1, 4, 8, 8, 64), (1, 1, 4, 4, 16), (0, 0, 0, 0, 3)],
                              [(1, 2, 8, 8, 64), (1, 1, 4, 4, 16), (0, 0, 0, 0, 3)]), [5, 2], 83, 4)
    assert plan.factors == ((0, 4, 8, 8), (1, 1, 4, 4)) and plan.dense == (2,)
    assert (plan.factor_width, plan.dense_width, plan.received_bytes) == (64 + 8, 3, 2 * 5 * (64 + 8 + 3) * 4)
    plan = gram_plan(_layouts([(1, 5, 8, 8, 64), (1, 1, 4, 4, 16)], [(1, 1, 8, 8, 64), (0, 0, 0, 0, 16)]),
                     [3, 3], 80, 8)
    assert plan.factors == () and plan.dense == (0, 1) and plan.dense_width == 80  # T_max 5: 80 > 64; rows on rank 1
    whole = gram_plan(None, [3, 1], 80, 4)
    assert whole.factors is None and whole.dense_width == 80 and whole.received_bytes == 2 * 3 * 80 * 4
    with pytest.raises(ValueError, match=r"parameter 0 has \[64, 63\] entries"):
        gram_plan(_layouts([(1, 1, 8, 8, 64)], [(1, 1, 9, 7, 63)]), [1, 1], 64, 4)
    with pytest.raises(ValueError, match=r"parameter 0's factors have inputs \[8, 4\] and outputs \[8, 16\]"):
        gram_plan(_layouts([(1, 1, 8, 8, 64)], [(1, 1, 4, 16, 64)]), [1, 1], 64, 4)


def test_the_gram_plan_gathers_a_table_as_the_union_of_the_ranks_used_rows():
    """A ``[10, 3]`` table kept as used rows on every rank goes as the sorted union of the ranks' ids (read from each
    rank's part of the padded ids, after its earlier tables' ids), ``U_union D`` columns in ``dense_width`` and the
    bytes; one that some rank keeps whole (it used every row) goes as its 30 columns; rows of other widths, or no
    ids, are refused."""
    ranks = ([(0, 0, 0, 0, 12, 1, 2, 2), (0, 0, 0, 0, 30, 1, 3, 3)],  # a [6, 2] table, then the [10, 3] table
             [(0, 0, 0, 0, 12, 1, 1, 2), (0, 0, 0, 0, 30, 1, 2, 3)])
    ids = torch.tensor([[4, 5, 0, 7, 9], [1, 7, 8, 0, 0]])  # rank 0: {4, 5}, {0, 7, 9}; rank 1: {1}, {7, 8}; padded
    plan = gram_plan(_layouts(*ranks), [2, 5], 42, 8, ids)
    assert plan.tables == ((0, 3, 2), (1, 4, 3)) and plan.dense == (0, 1) and plan.factors == ()
    assert torch.equal(plan.union_ids[0], torch.tensor([1, 4, 5]))
    assert torch.equal(plan.union_ids[1], torch.tensor([0, 7, 8, 9]))
    assert (plan.dense_width, plan.received_bytes) == (3 * 2 + 4 * 3, 2 * 5 * (6 + 12) * 8)
    whole = gram_plan(_layouts(ranks[0], [(0, 0, 0, 0, 12, 1, 1, 2), (0, 0, 0, 0, 30)]), [2, 5], 42, 8, ids)
    assert whole.tables == ((0, 3, 2),) and whole.dense_width == 6 + 30 and set(whole.union_ids) == {0}
    with pytest.raises(ValueError, match=r"parameter 1's table has rows of \[3, 5\] entries"):
        gram_plan(_layouts(ranks[0], [(0, 0, 0, 0, 12, 1, 1, 2), (0, 0, 0, 0, 30, 1, 2, 5)]), [2, 5], 42, 8, ids)
    with pytest.raises(ValueError, match=r"parameter 0 is a table kept as used rows on every rank but no ids"):
        gram_plan(_layouts(*ranks), [2, 5], 42, 8)


def _fail_on_rank_one(rank: int) -> dict:
    def work():
        if rank == 1:
            raise FloatingPointError("non-finite loss [nan] of sample 0")
        return rank

    try:
        agree(dist.group.WORLD, torch.device("cpu"), work)
    except Exception as err:  # noqa: BLE001 - what each rank saw
        out = dict(kind=type(err).__name__, message=str(err))
    else:
        out = dict(kind=None, message=None)
    # a collective after the failure still pairs up: no rank was left behind
    t = torch.ones(1)
    dist.all_reduce(t)
    out["after"] = float(t)
    return out


def _raise_other_on_rank_two(rank: int) -> dict:
    def work():
        if rank == 2:
            raise KeyError("a model that breaks")
        return rank

    try:
        agree(dist.group.WORLD, torch.device("cpu"), work)
    except Exception as err:  # noqa: BLE001
        return dict(kind=type(err).__name__, message=str(err))
    return dict(kind=None)


@pytest.mark.slow  # starts processes
def test_a_failure_on_one_rank_is_raised_on_every_rank(tmp_path):
    results = _spawn(_fail_on_rank_one, 2, tmp_path)
    assert [r["kind"] for r in results] == ["FloatingPointError", "FloatingPointError"]
    assert results[1]["message"] == "non-finite loss [nan] of sample 0"
    assert results[0]["message"] == "rank 1 failed (FloatingPointError): non-finite loss [nan] of sample 0"
    assert all(r["after"] == 2.0 for r in results)
    results = _spawn(_raise_other_on_rank_two, 3, tmp_path / "three")
    assert [r["kind"] for r in results] == ["RankFailure", "RankFailure", "KeyError"]
    assert results[0]["message"] == "rank 2 failed (KeyError): 'a model that breaks'"
    assert issubclass(RankFailure, RuntimeError)


def _sleep_on_rank_one(rank: int, pids: str) -> int:
    """Rank 1 never reaches the collective that rank 0 waits in (the barrier after the work): a hang."""
    import os
    import time

    Path(pids).joinpath(f"rank{rank}.pid").write_text(str(os.getpid()))
    if rank == 1:
        time.sleep(3600.0)
    return rank


@pytest.mark.slow  # starts processes
def test_ranks_that_wait_on_each_other_fail_the_test_as_hung_past_the_deadline(tmp_path):
    """A hang fails its test past the deadline, every rank killed, instead of hanging the suite (the collective
    timeout, here far longer, is not what ends it)."""
    import os
    import time

    pids = tmp_path / "pids"
    pids.mkdir()
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match=r"hung: ranks \[0, 1\] of 2 still running after 10 s \(killed\)"):
        _spawn(_sleep_on_rank_one, 2, tmp_path, str(pids), deadline=10.0)
    assert time.monotonic() - start < 600.0
    for path in pids.iterdir():  # the ranks that started are gone
        with pytest.raises(ProcessLookupError):
            os.kill(int(path.read_text()), 0)


def test_one_process_runs_the_work_itself():
    assert agree(None, torch.device("cpu"), lambda: 5) == 5
    with pytest.raises(KeyError):
        agree(None, torch.device("cpu"), lambda: {}["x"])


def test_a_test_that_starts_processes_must_be_in_the_slow_tier(request):
    """tests/conftest.py refuses to start processes from a test of this tier without the ``slow`` marker (the tier
    ``make test-lib`` leaves out), naming the test; this test has no marker, so both entry points refuse."""
    for entry in (mp.spawn, mp.start_processes):
        with pytest.raises(RuntimeError, match=rf"{re.escape(request.node.nodeid)} starts processes: mark it "
                                               r"@pytest.mark.slow"):
            entry(print, nprocs=1)


# ------------------------------------------------------------------ the optimisers over a data-parallel batch
class _ArgmaxSampled(__import__("ief").losses.CrossEntropy):
    """Cross-entropy whose SF labels are the logits' argmax: a draw that does not depend on which process holds the
    sample, so that SF's union-batch equivalence tests the algebra (the labels of the RNG are per rank)."""

    def sample_targets(self, logits, targets, generator=None):
        out = logits.argmax(-1)
        return torch.where(targets == -100, targets, out) if targets.dtype == out.dtype else out


def _model(seed: int = 0, wide: bool = False) -> torch.nn.Module:
    """5-7-3 (tanh), or 5-16-16-3 (``wide``): over 4 positions only the middle ``[16, 16]`` weight's factors are fewer
    entries than its rows (``4 (16 + 16) <= 256``; ``4 (5 + 16) > 80``, ``4 (16 + 3) > 48``)."""
    torch.manual_seed(seed)
    if wide:
        return torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                   torch.nn.Linear(16, 3)).double()
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).double()


def _batches(sizes: list[int], steps: int, ignored_rank: int | None) -> list[list[tuple]]:
    """Per step, per rank: (inputs [M_r, 4, 5], targets [M_r, 4] with -100 masks; a rank whose targets are all
    ignored where asked)."""
    gen = torch.Generator().manual_seed(11)
    out = []
    for _ in range(steps):
        per_rank = []
        for r, m in enumerate(sizes):
            x = torch.randn(m, 4, 5, generator=gen, dtype=torch.float64)
            y = torch.randint(0, 3, (m, 4), generator=gen)
            y[torch.rand(m, 4, generator=gen) < 0.3] = -100
            if r == ignored_rank:
                y[:] = -100
            per_rank.append((x, y))
        out.append(per_rank)
    return out


OPTIMISERS = {
    "ief": lambda model, **kw: __import__("ief").optim.IEF(model, lr=0.5, damping=1e-3, **kw),
    "ief-mean-momentum-wd": lambda model, **kw: __import__("ief").optim.IEF(
        model, lr=0.3, damping=1e-4, reduction="mean", momentum=0.9, weight_decay=0.01, **kw),
    "ief-ghost": lambda model, **kw: __import__("ief").optim.IEF(model, lr=0.5, damping=1e-3, form="ghost", **kw),
    "ief-streamed": lambda model, **kw: __import__("ief").optim.IEF(model, lr=0.5, damping=1e-3, form="streamed",
                                                                    **kw),
    "sf-streamed": lambda model, **kw: __import__("ief").optim.SF(model, lr=0.05, damping=1e-2, form="streamed",
                                                                  loss=_ArgmaxSampled(), **kw),
    "ef": lambda model, **kw: __import__("ief").optim.EF(model, lr=0.05, damping=1e-3, momentum=0.5, **kw),
    "sf": lambda model, **kw: __import__("ief").optim.SF(model, lr=0.05, damping=1e-2, loss=_ArgmaxSampled(),
                                                        weight_decay=0.1, **kw),
    # lr="auto": the new batch's loss and slope along the last change are the union batch's (ief.optim.auto_lr)
    "ief-auto-mean-momentum-wd": lambda model, **kw: __import__("ief").optim.IEF(
        model, lr="auto", damping=1e-4, reduction="mean", momentum=0.9, weight_decay=0.01, **kw),
    "sf-auto": lambda model, **kw: __import__("ief").optim.SF(model, lr="auto", damping=1e-2, loss=_ArgmaxSampled(),
                                                             **kw),
}


def _train_on_rank(rank: int, name: str, sizes: list[int], steps: int, ignored_rank, ddp: bool,
                   wide: bool = False) -> dict:
    model = _model(wide=wide)
    kwargs = {} if ddp else dict(process_group=dist.group.WORLD)
    opt = OPTIMISERS[name](torch.nn.parallel.DistributedDataParallel(model) if ddp else model, **kwargs)
    plans, ghosts, plan = [], set(), DistributedRows.plan

    def recorded(rows):  # which path each Gram took, and what this rank held as factors (this process's class only)
        plans.append(plan(rows))
        ghosts.update(i for i, _, _ in getattr(rows.local, "ghosts", ()))
        return plans[-1]

    DistributedRows.plan = recorded
    losses = []
    for per_rank in _batches(sizes, steps, ignored_rank):
        x, y = per_rank[rank]
        losses.append(float(opt.step(x, y)))
    return dict(params=[p.detach().clone() for p in model.parameters()], losses=losses,
                factors={p.factors for p in plans}, ghosts=ghosts)


def _train_union(name: str, sizes: list[int], steps: int, ignored_rank, wide: bool = False) -> dict:
    model = _model(wide=wide)
    opt = OPTIMISERS[name](model)
    losses = []
    for per_rank in _batches(sizes, steps, ignored_rank):
        x = torch.cat([b[0] for b in per_rank])
        y = torch.cat([b[1] for b in per_rank])
        losses.append(float(opt.step(x, y)))
    return dict(params=[p.detach().clone() for p in model.parameters()], losses=losses)


@pytest.mark.slow  # starts processes
@pytest.mark.parametrize("name, sizes, ignored_rank, ddp, wide, factors", [
    ("ief", [3, 5], None, False, False, ()),
    ("ief-mean-momentum-wd", [4, 1, 6], 1, False, False, ()),
    ("ef", [2, 6], None, True, False, ()),
    ("sf", [5, 3, 2], 2, False, False, ()),
    ("ief-ghost", [3, 5], 1, False, True, ((2, 4, 16, 16),)),
    ("ief", [2, 6], None, False, True, ()),
    ("ief-auto-mean-momentum-wd", [4, 1, 6], 1, False, False, ()),
    ("sf-auto", [3, 5], None, True, False, ()),
    ("ief-streamed", [3, 5], 1, False, True, ((0, 4, 5, 16), (2, 4, 16, 16), (4, 4, 16, 3))),
    ("sf-streamed", [4, 1, 6], 1, False, False, ((0, 4, 5, 7), (2, 4, 7, 3))),
], ids=["ief-2", "ief-mean-3-ignored-rank", "ef-2-ddp", "sf-3-ignored-rank", "ief-ghost-2-tokens-ignored-rank",
        "ief-2-forms-differ", "ief-auto-mean-3-ignored-rank", "sf-auto-2-ddp",
        "ief-streamed-2-tokens-ignored-rank", "sf-streamed-3-ignored-rank"])
def test_a_step_across_processes_is_one_process_on_the_union_batch(name, sizes, ignored_rank, ddp, wide, factors,
                                                                   tmp_path, request):
    """Three steps on R gloo processes (uneven batches, masked positions, a rank whose targets are all ignored, a DDP
    model whose group is taken) leave every rank's parameters bit-identical, and equal to one process stepping on
    the ranks' batches concatenated in rank order (1e-12 relative, float64); the returned losses are the union's.

    Which weights the Gram gathers as factors (the rest as dense columns) is asserted: none for the 5-7-3 model
    (``form="auto"`` keeps its rows), the middle weight of the 5-16-16-3 one over 4 tokens with ``form="ghost"``
    (its outer weights' rows are fewer entries than their factors), and none when the ranks' forms differ (at
    ``M_r = 2`` and ``6`` ``form="auto"`` factors the middle weight on rank 0 only: gathered as rows); with
    ``form="streamed"`` every weight, whose rows no rank forms whole (:mod:`ief.streamed`)."""
    results = _spawn(_train_on_rank, len(sizes), tmp_path, name, sizes, 3, ignored_rank, ddp, wide)
    union = _train_union(name, sizes, 3, ignored_rank, wide)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(other["params"], results[0]["params"]))
        assert other["losses"] == results[0]["losses"]
    assert all(r["factors"] == {factors} for r in results), [r["factors"] for r in results]
    if request.node.callspec.id == "ief-2-forms-differ":
        assert [r["ghosts"] for r in results] == [{2}, set()]
    for got, want in zip(results[0]["params"], union["params"]):
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12 * float(want.abs().max())), (got - want).abs().max()
    assert results[0]["losses"] == pytest.approx(union["losses"], rel=1e-12)
    moved = sum(float((p - q.detach()).abs().sum()) for p, q in zip(union["params"], _model(wide=wide).parameters()))
    assert moved > 1e-3, "the steps must move the parameters for the comparison to mean anything"


# the token pools of the ranks' batches: 3 and 4 on ranks 0 and 1, 2 on ranks 0 and 2; 1, 11 and 5, 6 on one rank each
TABLE_POOLS = ([1, 2, 3, 4], [3, 4, 11], [2, 5, 6, 0])


def _table_batches(sizes: list[int], steps: int) -> list[list[tuple]]:
    """Per step, per rank: tokens ``[M_r, 4]`` drawn from the rank's pool (its first sample holds the whole pool) and
    targets with -100 masks."""
    gen = torch.Generator().manual_seed(21)
    out = []
    for _ in range(steps):
        per_rank = []
        for r, m in enumerate(sizes):
            pool = torch.tensor(TABLE_POOLS[r])
            x = pool[torch.randint(0, len(pool), (m, 4), generator=gen)]
            x[0, :len(pool)] = pool[torch.randperm(len(pool), generator=gen)]
            y = torch.randint(0, 3, (m, 4), generator=gen)
            y[torch.rand(m, 4, generator=gen) < 0.3] = -100
            per_rank.append((x, y))
        out.append(per_rank)
    return out


class _TableModel(torch.nn.Module):
    """A ``[12, 3]`` token table (``nn.Embedding``, padding row 0), tanh and a ``[3, 3]`` head: per-position logits."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(12, 3, padding_idx=0)
        self.head = torch.nn.Linear(3, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(tokens)))


def _table_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return _TableModel().double()


def _table_on_rank(rank: int, sizes: list[int], steps: int) -> dict:
    import ief

    model, group = _table_model(), dist.group.WORLD
    batches = _table_batches(sizes, steps)
    local = ief.per_sample(model, *batches[0][rank], form="auto").jacobian
    rows = DistributedRows(local, group, sizes)
    gram, first = rows.gram(), rows.plan()
    opt = ief.optim.IEF(model, lr=0.5, damping=1e-3, process_group=group)
    plans, plan = [], DistributedRows.plan

    def recorded(rows):
        plans.append(plan(rows))
        return plans[-1]

    DistributedRows.plan = recorded
    losses = [float(opt.step(*per_rank[rank])) for per_rank in batches]
    return dict(gram=gram, plan=first, used=set(local.used_rows), plans=plans, losses=losses,
                params=[p.detach().clone() for p in model.parameters()])


@pytest.mark.slow  # starts processes
def test_a_table_whose_ranks_use_different_rows_goes_as_the_union_of_its_used_rows(tmp_path):
    """An nn.Embedding token table whose three ranks (uneven batches 4, 1, 3) use different ids, some shared, some
    used by one rank only, and ids no rank uses: every rank keeps it as its used rows, the Gram gathers it as the
    sorted union of their ids (``U_union D`` columns, not ``V D``), and the Gram and 3 IEF steps equal one process
    on the union batch (the Gram: the brute-force per-sample loop's ``J J^T``; 1e-12 relative, float64), bit-identical
    on every rank."""
    import ief
    import oracle

    sizes, steps = [4, 1, 3], 3
    results = _spawn(_table_on_rank, len(sizes), tmp_path, sizes, steps)
    batches = _table_batches(sizes, steps)
    model = _table_model()
    x, y = (torch.cat([b[k] for b in batches[0]]) for k in (0, 1))
    _, truth, _ = oracle.per_sample(model, x, y)
    want = truth @ truth.T
    assert torch.allclose(results[0]["gram"], want, rtol=1e-12, atol=1e-12 * float(want.abs().max()))
    opt = ief.optim.IEF(model, lr=0.5, damping=1e-3)
    losses = [float(opt.step(*(torch.cat([b[k] for b in per_rank]) for k in (0, 1)))) for per_rank in batches]
    for got, want in zip(results[0]["params"], model.parameters()):
        want = want.detach()
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12 * float(want.abs().max())), (got - want).abs().max()
    assert results[0]["losses"] == pytest.approx(losses, rel=1e-12)
    for other in results[1:]:
        assert torch.equal(other["gram"], results[0]["gram"]) and other["losses"] == results[0]["losses"]
        assert all(torch.equal(a, b) for a, b in zip(other["params"], results[0]["params"]))
        assert other["plans"] == results[0]["plans"] and other["plan"] == results[0]["plan"]
    assert all(r["used"] == {0} for r in results)  # the table kept as used rows on every rank
    assert len(results[0]["plans"]) == steps and results[0]["plans"][0] == results[0]["plan"]  # the same batch
    for k, per_rank in enumerate(batches):  # the token table: the union's rows (8 or 9 ids of 12)
        union = torch.unique(torch.cat([b[0].flatten() for b in per_rank]))
        assert union.numel() < 12 and set(union.tolist()) >= {1, 2, 3, 4, 5, 6, 11}
        plan = results[0]["plans"][k]
        assert plan.factors == () and plan.dense == (0, 1, 2) and plan.tables == ((0, union.numel(), 3),)
        assert all(torch.equal(r["plans"][k].union_ids[0], union) for r in results)
        assert plan.dense_width == 3 * union.numel() + 9 + 3
        assert plan.received_bytes == len(sizes) * max(sizes) * plan.dense_width * 8
    moved = sum(float((p - q.detach()).abs().sum()) for p, q in zip(results[0]["params"], _table_model().parameters()))
    assert moved > 1e-3, "the steps must move the parameters for the comparison to mean anything"


def _nan_on_rank_one(rank: int) -> dict:
    model = _model()
    opt = __import__("ief").optim.IEF(model, lr=0.5, damping=1e-3, process_group=dist.group.WORLD)
    x = torch.randn(3, 4, 5, dtype=torch.float64)
    if rank == 1:
        x[1, 0, 0] = float("nan")
    before = [p.detach().clone() for p in model.parameters()]
    try:
        opt.step(x, torch.zeros(3, 4, dtype=torch.long))
    except Exception as err:  # noqa: BLE001
        kind, message = type(err).__name__, str(err)
    else:
        kind = message = None
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return dict(kind=kind, message=message, unchanged=unchanged)


@pytest.mark.slow  # starts processes
def test_a_nan_on_one_rank_ends_every_rank_with_the_same_error(tmp_path):
    results = _spawn(_nan_on_rank_one, 2, tmp_path)
    assert [r["kind"] for r in results] == ["FloatingPointError", "FloatingPointError"], results
    assert results[0]["message"].startswith("step 0: rank 1 failed (FloatingPointError): ")
    assert "non-finite" in results[1]["message"]
    assert all(r["unchanged"] for r in results)


def _refusals_on_rank(rank: int) -> dict:
    import ief

    out = {}
    for name, build in (("plain", lambda: ief.optim.IEF(_model())),
                        ("kfac", lambda: ief.optim.KFAC(_model(), "kfac", lr=0.1, damping=1e-2,
                                                        process_group=dist.group.WORLD))):
        try:
            build()
        except ValueError as err:
            out[name] = str(err)
        else:
            out[name] = "constructed"
    return out


@pytest.mark.slow  # starts processes
def test_what_cannot_step_across_processes_is_refused_on_every_rank(tmp_path):
    results = _spawn(_refusals_on_rank, 2, tmp_path)
    assert results[0] == results[1]
    assert results[0]["plain"].startswith("IEF: torch.distributed is initialised with world size 2 but the optimiser "
                                          "was given no process group")
    assert "pass process_group=torch.distributed.group.WORLD" in results[0]["plain"]
    assert results[0]["kfac"] == "constructed"  # K-FAC steps across processes with a group (the union's factors)


# ------------------------------------------------------------------------------- IEFTrainer under two processes
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trainer_on_rank(rank: int, world: int, port: int, folder: str, steps: int, resume) -> dict:
    """An IEFTrainer run as torchrun would start it (the environment names the rank, world and address)."""
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    import datasets
    from transformers import TrainingArguments

    from ief.hf import IEFTrainer
    from test_hf import bert_lora, classification_rows

    args = TrainingArguments(output_dir=folder, learning_rate=0.5, max_grad_norm=0.0, per_device_train_batch_size=4,
                             logging_steps=1, report_to="none", use_cpu=True, disable_tqdm=True, seed=0,
                             train_sampling_strategy="sequential", max_steps=steps, ddp_backend="gloo",
                             save_strategy="steps", save_steps=2, lr_scheduler_type="linear")
    trainer = IEFTrainer(bert_lora(), args, train_dataset=datasets.Dataset.from_dict(classification_rows()),
                         optimizer="ief", optimizer_kwargs=dict(damping=1e-3, momentum=0.5))
    trainer.train(resume_from_checkpoint=resume)
    params = torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters() if p.requires_grad]).clone()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    out = dict(params=params, losses=losses, step=trainer.state.global_step)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return out


def _trainer_entry(rank: int, world: int, port: int, folder: str, out: str, steps, resume) -> None:
    torch.set_num_threads(1)
    result = _trainer_on_rank(rank, world, port, folder, steps, resume)
    Path(out).joinpath(f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
    if dist.is_initialized():
        dist.destroy_process_group()


def _run_trainer(world: int, tmp_path: Path, name: str, steps: int, resume=None) -> list[dict]:
    out = tmp_path / f"{name}-results"
    out.mkdir(parents=True)
    context = _start(_trainer_entry, (world, _free_port(), str(tmp_path / "run"), str(out), steps, resume), world)
    _join(context, world, SPAWN_DEADLINE)
    return [pickle.loads((out / f"rank{r}.pkl").read_bytes()) for r in range(world)]


@pytest.mark.slow  # starts processes
def test_the_trainer_on_two_processes_is_the_union_batch_and_resumes(tmp_path):
    """IEFTrainer under DDP (two gloo processes, sequential data: rank r takes every other batch of 4) takes the
    exact step of the union batch of 8: its parameters and logged losses equal a one-process run with batches of 8
    (float32 rounding), the ranks agree bit for bit, and resuming its step-2 checkpoint on two fresh processes gives
    the uninterrupted run."""
    import datasets
    from transformers import TrainingArguments

    from ief.hf import IEFTrainer
    from test_hf import bert_lora, classification_rows

    whole = _run_trainer(2, tmp_path / "whole", "whole", 4)
    assert torch.equal(whole[0]["params"], whole[1]["params"]) and whole[0]["losses"] == whole[1]["losses"]
    assert whole[0]["step"] == 4
    args = TrainingArguments(output_dir=str(tmp_path / "one"), learning_rate=0.5, max_grad_norm=0.0,
                             per_device_train_batch_size=8, logging_steps=1, report_to="none", use_cpu=True,
                             disable_tqdm=True, seed=0, train_sampling_strategy="sequential", max_steps=4,
                             save_strategy="no", lr_scheduler_type="linear")
    one = IEFTrainer(bert_lora(), args, train_dataset=datasets.Dataset.from_dict(classification_rows()),
                     optimizer="ief", optimizer_kwargs=dict(damping=1e-3, momentum=0.5))
    one.train()
    flat = torch.cat([p.detach().reshape(-1) for p in one.model.parameters() if p.requires_grad])
    assert float((whole[0]["params"] - flat).norm() / flat.norm()) < 1e-5
    losses = [h["loss"] for h in one.state.log_history if "loss" in h and "train_runtime" not in h]
    assert whole[0]["losses"] == pytest.approx(losses, rel=1e-4)
    # resumed on two fresh processes from the uninterrupted run's step-2 checkpoint (what a run stopped there holds)
    resumed = _run_trainer(2, tmp_path / "resumed", "resumed", 4,
                           resume=str(tmp_path / "whole" / "run" / "checkpoint-2"))
    assert resumed[0]["step"] == 4
    assert torch.equal(resumed[0]["params"], whole[0]["params"]) and torch.equal(resumed[1]["params"],
                                                                                 whole[1]["params"])


# ------------------------------------------------------------------------ K-FAC over a data-parallel batch
KFAC_OPTIMISERS = {
    "kfac-momentum-wd": lambda model, **kw: __import__("ief").optim.KFAC(
        model, "kfac", lr=0.05, damping=0.5, factor_decay=0.9, inverse_every=2, loss=_ArgmaxSampled(),
        momentum=0.5, weight_decay=0.01, **kw),
    "ekfac-momentum": lambda model, **kw: __import__("ief").optim.KFAC(
        model, "ekfac", lr=0.05, damping=0.5, factor_decay=0.8, inverse_every=2, momentum=0.9, dampening=0.5, **kw),
    "iekfac-wd": lambda model, **kw: __import__("ief").optim.KFAC(
        model, "iekfac", lr=0.05, damping=0.5, factor_decay=0.9, inverse_every=2, weight_decay=0.05, **kw),
    "iekfac-reduce-momentum": lambda model, **kw: __import__("ief").optim.KFAC(
        model, "iekfac", lr=0.05, damping=0.5, factor_decay=0.5, inverse_every=2, approx="reduce", momentum=0.5,
        **kw),
}
OPTIMISERS.update(KFAC_OPTIMISERS)


@pytest.mark.slow  # starts processes
@pytest.mark.parametrize("name, sizes, ignored_rank, ddp", [
    ("kfac-momentum-wd", [3, 5], None, False),
    ("kfac-momentum-wd", [4, 1, 6], 1, False),
    ("ekfac-momentum", [2, 6], 0, True),
    ("ekfac-momentum", [5, 3, 2], None, False),
    ("iekfac-wd", [3, 5], 1, False),
    ("iekfac-reduce-momentum", [5, 3, 2], 2, True),
], ids=["kfac-2", "kfac-3-ignored-rank", "ekfac-2-ddp-ignored-rank", "ekfac-3", "iekfac-2-ignored-rank",
        "iekfac-reduce-3-ddp-ignored-rank"])
def test_a_kfac_step_across_processes_is_one_process_on_the_union_batch(name, sizes, ignored_rank, ddp, tmp_path):
    """Four K-FAC steps (running factors, eigendecompositions refreshed on steps 0 and 2 and reused on 1 and 3) on R
    gloo processes (uneven batches, masked positions, a rank whose targets are all ignored, a DDP model whose group
    is taken) leave every rank's parameters and running factors bit-identical, and equal to one process stepping on
    the ranks' batches concatenated in rank order (1e-12 relative, float64); the returned losses are the union's."""
    results = _spawn(_train_kfac_on_rank, len(sizes), tmp_path, name, sizes, 4, ignored_rank, ddp)
    union = _train_kfac_union(name, sizes, 4, ignored_rank)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(other["params"], results[0]["params"]))
        assert other["losses"] == results[0]["losses"]
        for layer, factors in results[0]["factors"].items():
            assert all(torch.equal(a, b) for a, b in zip(other["factors"][layer], factors)), layer
    for got, want in zip(results[0]["params"], union["params"]):
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12 * float(want.abs().max())), (got - want).abs().max()
    assert results[0]["factors"].keys() == union["factors"].keys()
    for layer, factors in union["factors"].items():  # G and A of the union batch, and their eigenvalues
        for got, want in zip(results[0]["factors"][layer], factors):
            assert torch.allclose(got, want, rtol=1e-12, atol=1e-12 * float(want.abs().max())), layer
    assert results[0]["losses"] == pytest.approx(union["losses"], rel=1e-12)
    moved = sum(float((p - q.detach()).abs().sum()) for p, q in zip(union["params"], _model().parameters()))
    assert moved > 1e-3, "the steps must move the parameters for the comparison to mean anything"


def _factors(opt) -> dict:
    """Every layer's running ``(G, A, e_G, e_A)`` (the eigenvectors' signs are the solver's: compared through the
    parameters they give)."""
    return {name: (e["G"].clone(), e["A"].clone(), e["eigen"][0].clone(), e["eigen"][2].clone())
            for name, e in opt.factors.items()}


def _train_kfac_on_rank(rank: int, name: str, sizes: list[int], steps: int, ignored_rank, ddp: bool) -> dict:
    model = _model()
    kwargs = {} if ddp else dict(process_group=dist.group.WORLD)
    opt = OPTIMISERS[name](torch.nn.parallel.DistributedDataParallel(model) if ddp else model, **kwargs)
    losses = [float(opt.step(*per_rank[rank])) for per_rank in _batches(sizes, steps, ignored_rank)]
    return dict(params=[p.detach().clone() for p in model.parameters()], losses=losses, factors=_factors(opt))


def _train_kfac_union(name: str, sizes: list[int], steps: int, ignored_rank) -> dict:
    model = _model()
    opt = OPTIMISERS[name](model)
    losses = [float(opt.step(torch.cat([b[0] for b in per_rank]), torch.cat([b[1] for b in per_rank])))
              for per_rank in _batches(sizes, steps, ignored_rank)]
    return dict(params=[p.detach().clone() for p in model.parameters()], losses=losses, factors=_factors(opt))


class _RankDraws(__import__("ief").losses.CrossEntropy):
    """Cross-entropy whose sampled labels for the union batch are drawn as the ranks draw theirs: the first ``M_0``
    samples' with rank 0's generator, the next ``M_1`` with rank 1's, ... (each rank's own draw on its own batch)."""

    def __init__(self, sizes: list[int], generators: list[torch.Generator]):
        self.sizes, self.generators = sizes, generators

    def sample_targets(self, logits, targets, generator=None):
        parts = zip(logits.split(self.sizes), targets.split(self.sizes), self.generators)
        return torch.cat([super(_RankDraws, self).sample_targets(z, y, g) for z, y, g in parts])


def _kfac_seeded_on_rank(rank: int, sizes: list[int], steps: int) -> dict:
    import ief

    model = _model()
    opt = ief.optim.KFAC(model, "kfac", lr=0.05, damping=0.5, factor_decay=0.9, inverse_every=2,
                         generator=torch.Generator().manual_seed(100 + rank), process_group=dist.group.WORLD)
    for per_rank in _batches(sizes, steps, None):
        opt.step(*per_rank[rank])
    return dict(params=[p.detach().clone() for p in model.parameters()])


@pytest.mark.slow  # starts processes
def test_kfac_draws_each_ranks_labels_with_that_ranks_generator(tmp_path):
    """kind='kfac' with a real RNG: each rank draws its own samples' labels with its own generator (seeded
    100 + rank here), the factors are summed, so the replicas stay bit-identical and equal one process whose labels
    for each rank's samples come from that rank's generator (1e-12)."""
    import ief

    sizes = [3, 5]
    results = _spawn(_kfac_seeded_on_rank, 2, tmp_path, sizes, 3)
    assert all(torch.equal(a, b) for a, b in zip(results[0]["params"], results[1]["params"]))
    model = _model()
    draws = _RankDraws(sizes, [torch.Generator().manual_seed(100 + r) for r in range(2)])
    opt = ief.optim.KFAC(model, "kfac", lr=0.05, damping=0.5, factor_decay=0.9, inverse_every=2, loss=draws)
    for per_rank in _batches(sizes, 3, None):
        opt.step(torch.cat([b[0] for b in per_rank]), torch.cat([b[1] for b in per_rank]))
    for got, want in zip(results[0]["params"], model.parameters()):
        want = want.detach()
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12 * float(want.abs().max())), (got - want).abs().max()


def _kfac_failures_on_rank(rank: int) -> dict:
    import ief

    model = _model()
    opt = ief.optim.KFAC(model, "iekfac", lr=0.05, damping=0.5, inverse_every=2, process_group=dist.group.WORLD)
    gen = torch.Generator().manual_seed(5)
    batches = [(torch.randn(2 + rank, 4, 5, generator=gen, dtype=torch.float64),
                torch.randint(0, 3, (2 + rank, 4), generator=gen)) for _ in range(3)]
    before = [p.detach().clone() for p in model.parameters()]
    out = {}
    for what, broken in (("nan", 1), ("target", 0)):
        x, y = batches[0][0].clone(), batches[0][1].clone()
        if rank == broken and what == "nan":
            x[1, 0, 0] = float("nan")
        if rank == broken and what == "target":
            y[0, 0] = 7  # no class 7 among 3
        try:
            opt.step(x, y)
        except Exception as err:  # noqa: BLE001 - what each rank saw
            out[what] = (type(err).__name__, str(err))
    out["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and not opt.factors
    for x, y in batches[1:]:  # the ranks still step together: no collective was left unpaired
        opt.step(x, y)
    out["params"] = [p.detach().clone() for p in model.parameters()]
    return out


@pytest.mark.slow  # starts processes
def test_a_kfac_failure_on_one_rank_ends_every_rank_with_the_same_error(tmp_path):
    """A NaN input on rank 1 (non-finite union factors) and a target out of range on rank 0 (its own check, shared by
    agree) raise on both ranks before anything changes (parameters and running factors); later steps still pair up
    and keep the replicas bit-identical."""
    results = _spawn(_kfac_failures_on_rank, 2, tmp_path)
    assert [r["nan"][0] for r in results] == ["FloatingPointError", "FloatingPointError"], results
    assert results[0]["nan"] == results[1]["nan"] and "non-finite" in results[0]["nan"][1]
    assert results[0]["nan"][1].startswith("step 0: ")
    assert [r["target"][0] for r in results] == ["ValueError", "ValueError"], results
    assert results[1]["target"][1].startswith("rank 0 failed (ValueError): ")
    assert results[0]["target"][1] in results[1]["target"][1]
    assert all(r["unchanged"] for r in results)
    assert all(torch.equal(a, b) for a, b in zip(results[0]["params"], results[1]["params"]))


# ------------------------------------------------------------------------- IEFTrainer with K-FAC, two processes
KFAC_TRAINER = dict(learning_rate=0.05, optimizer="ekfac",
                    optimizer_kwargs=dict(damping=0.1, factor_decay=0.5, inverse_every=2, momentum=0.5))


def _kfac_trainer(folder: str, batch: int, steps: int, use_cpu_ddp: bool):
    import datasets
    from transformers import TrainingArguments

    from ief.hf import IEFTrainer
    from test_hf import bert_lora, classification_rows

    extra = dict(ddp_backend="gloo") if use_cpu_ddp else {}
    args = TrainingArguments(output_dir=folder, learning_rate=KFAC_TRAINER["learning_rate"], max_grad_norm=0.0,
                             per_device_train_batch_size=batch, logging_steps=1, report_to="none", use_cpu=True,
                             disable_tqdm=True, seed=0, train_sampling_strategy="sequential", max_steps=steps,
                             save_strategy="no", **extra)
    trainer = IEFTrainer(bert_lora(), args, train_dataset=datasets.Dataset.from_dict(classification_rows()),
                         optimizer=KFAC_TRAINER["optimizer"], optimizer_kwargs=KFAC_TRAINER["optimizer_kwargs"])
    trainer.train()
    params = torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters() if p.requires_grad]).clone()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    return params, losses


def _kfac_trainer_entry(rank: int, world: int, port: int, folder: str, out: str) -> None:
    import os

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    params, losses = _kfac_trainer(folder, 4, 3, use_cpu_ddp=True)
    Path(out).joinpath(f"rank{rank}.pkl").write_bytes(pickle.dumps(dict(params=params, losses=losses)))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


@pytest.mark.slow  # starts processes
def test_the_trainer_with_kfac_on_two_processes_is_the_union_batch(tmp_path):
    """IEFTrainer(optimizer='ekfac') under DDP (two gloo processes at 4 samples, sequential data) takes the union
    batch's K-FAC step: the ranks agree bit for bit, and parameters and logged losses equal one process at 8 samples
    (float32 rounding), over 3 steps that cross an eigendecomposition refresh."""
    out = tmp_path / "results"
    out.mkdir()
    _join(_start(_kfac_trainer_entry, (2, _free_port(), str(tmp_path / "run"), str(out)), 2), 2, SPAWN_DEADLINE)
    ranks = [pickle.loads((out / f"rank{r}.pkl").read_bytes()) for r in range(2)]
    assert torch.equal(ranks[0]["params"], ranks[1]["params"]) and ranks[0]["losses"] == ranks[1]["losses"]
    params, losses = _kfac_trainer(str(tmp_path / "one"), 8, 3, use_cpu_ddp=False)
    assert float((ranks[0]["params"] - params).norm() / params.norm()) < 1e-5
    assert ranks[0]["losses"] == pytest.approx(losses, rel=1e-4)
    assert len(losses) == 3 and losses[-1] != losses[0]


class _SkipsOnOddBatches(torch.nn.Module):
    """An MLP whose middle linear layer runs only on batches of an even number of samples: ranks with batches of
    other parities call different layers, so their K-FAC factors cannot be summed."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inner, self.middle, self.outer = (torch.nn.Linear(5, 7), torch.nn.Linear(7, 7), torch.nn.Linear(7, 3))

    def forward(self, x):
        h = torch.tanh(self.inner(x))
        return self.outer(torch.tanh(self.middle(h)) if x.shape[0] % 2 == 0 else h)


def _kfac_layers_differ_on_rank(rank: int) -> dict:
    import ief

    model = _SkipsOnOddBatches().double()
    opt = ief.optim.KFAC(model, "ekfac", lr=0.05, damping=0.5, process_group=dist.group.WORLD)
    x = torch.randn(2 + rank, 4, 5, dtype=torch.float64)
    try:
        opt.step(x, torch.zeros(2 + rank, 4, dtype=torch.long))
    except ValueError as err:
        return dict(kind="ValueError", message=str(err))
    return dict(kind=None)


@pytest.mark.slow  # starts processes
def test_ranks_whose_kfac_layers_differ_raise_on_every_rank(tmp_path):
    """Rank 0 (2 samples) calls the middle layer, rank 1 (3 samples) does not: every rank raises the ValueError
    naming its own layers instead of summing factors of different layers (or waiting in an all-reduce of another
    length)."""
    results = _spawn(_kfac_layers_differ_on_rank, 2, tmp_path)
    assert [r["kind"] for r in results] == ["ValueError", "ValueError"], results
    assert all(r["message"].startswith("the ranks' K-FAC factors differ in their layers or shapes") for r in results)
    assert "'middle'" in results[0]["message"] and "'middle'" not in results[1]["message"]


# ------------------------------------------------------------------------------------ replicas that must agree
REPLICA_CASES = ("weights", "lr", "loaded", "equal")


def _replica_case(rank: int, case: str) -> dict:
    """Replicas of :func:`_model` stepping together; ``case`` makes rank 1 differ: ``"weights"`` (its model from
    another seed), ``"lr"`` (another rate), ``"loaded"`` (equal at step 0, then rank 1 loads a state whose momentum
    buffer differs), ``"equal"`` (nothing differs; every rank loads its own state again)."""
    import ief
    from ief.distributed import ReplicaMismatch

    model = _model(seed=1 if case == "weights" and rank == 1 else 0)
    lr = 0.25 if case == "lr" and rank == 1 else 0.5
    opt = ief.optim.IEF(model, lr=lr, damping=1e-3, momentum=0.9, process_group=dist.group.WORLD)
    x, y = _batches([3] * dist.get_world_size(), 1, None)[0][rank]
    out = {}
    before = [p.detach().clone() for p in model.parameters()]
    try:
        opt.step(x, y)
        if case in ("loaded", "equal"):
            saved = opt.state_dict()
            if case == "loaded" and rank == 1:
                saved = __import__("copy").deepcopy(saved)
                next(iter(saved["state"].values()))["momentum_buffer"] += 1.0
            opt.load_state_dict(saved)
            before = [p.detach().clone() for p in model.parameters()]
            opt.step(x, y)
    except ReplicaMismatch as err:
        out["error"] = str(err)
    out["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    out["params"] = [p.detach().clone() for p in model.parameters()]
    return out


def _replicas_on_rank(rank: int) -> dict:
    return {case: _replica_case(rank, case) for case in REPLICA_CASES}


@pytest.mark.slow  # starts processes
def test_replicas_that_differ_raise_on_every_rank_naming_the_first_difference(tmp_path):
    """Three ranks. Replicas started from different weights (or rates) raise before their first step, on every rank,
    naming the first tensor (or setting) that differs and the rank; a state loaded differently on one rank is caught
    at the first step after the load, before it changes anything; equal replicas (and an equal load) step as one
    process on the union batch does."""
    results = _spawn(_replicas_on_rank, 3, tmp_path)
    named = {"weights": "parameter or state '0.weight' differs between rank 0 and rank 1 (",
             "lr": "setting \"param_groups[0]['lr']\" differs between rank 0 and rank 1 (",
             "loaded": "parameter or state '0.weight: momentum_buffer' differs between rank 0 and rank 1 ("}
    for case, what in named.items():
        messages = [r[case].get("error") for r in results]
        assert all(m is not None and m == messages[0] for m in messages), (case, messages)
        when = "at step 1, after a load" if case == "loaded" else "before the first step"
        assert messages[0].startswith(f"the processes' replicas differ {when}: {what}"), messages[0]
        assert "the replicas must start equal" in messages[0]
        assert all(r[case]["unchanged"] for r in results), case  # refused before anything changed
    equal = [r["equal"] for r in results]
    assert all("error" not in r and not r["unchanged"] for r in equal)
    assert all(torch.equal(a, b) for r in equal[1:] for a, b in zip(equal[0]["params"], r["params"]))
