"""The union batch across processes (ief.distributed), held to one process on the concatenated rows: 2 and 3 gloo
processes on this machine, uneven batches, float64, and a failure on one rank raised on every rank."""
from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ief.directions import ef_solve, ief_solve, sf_solve
from ief.distributed import DistributedRows, RankFailure, agree, all_gather_rows, batch_sizes
from ief.rows import DenseRows

P = 11


def _union_rows(sizes: list[int]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    return torch.randn(sum(sizes), P, generator=gen, dtype=torch.float64)


def _spawn(fn, world: int, tmp_path: Path, *args) -> list:
    """Run ``fn(rank, world, store, out, *args)`` on ``world`` gloo processes; each returns what it pickled."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    outs = [tmp_path / f"rank{r}.pkl" for r in range(world)]
    mp.spawn(_entry, args=(fn, world, str(tmp_path / "store"), [str(o) for o in outs], args), nprocs=world,
             join=True, start_method="spawn")
    return [pickle.loads(o.read_bytes()) for o in outs]


def _entry(rank: int, fn, world: int, store: str, outs: list[str], args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        Path(outs[rank]).write_bytes(pickle.dumps(fn(rank, *args)))
        dist.barrier()  # no rank leaves (closing its connections) while another still talks to it
    finally:
        dist.destroy_process_group()


def _rows_on_rank(rank: int, sizes: list[int]) -> dict:
    union = _union_rows(sizes)
    lo = sum(sizes[:rank])
    local = DenseRows(union[lo:lo + sizes[rank]])
    group = dist.group.WORLD
    assert batch_sizes(sizes[rank], group, torch.device("cpu")) == sizes
    rows = DistributedRows(local, group, sizes)
    gen = torch.Generator().manual_seed(3)
    s = torch.rand(sum(sizes), generator=gen, dtype=torch.float64) + 0.5
    v = torch.randn(P, generator=gen, dtype=torch.float64)
    return dict(
        gram=rows.gram(), gram_scaled=rows.gram(2.0), combine=rows.combine_rows(s), times=rows.times(v),
        max_abs=rows.max_abs(), finite=bool(rows.finite_flag()), row_sum=rows.row_sum(),
        ief=ief_solve(rows, s, 1e-3), ef=ef_solve(rows, 1e-3), sf=sf_solve(rows, v, 1e-2),
        gathered=all_gather_rows(local.matrix[:, :2], sizes, group),
    )


@pytest.mark.parametrize("sizes", [[3, 5], [4, 1, 6]], ids=["two-uneven", "three-uneven"])
def test_distributed_rows_equal_the_concatenated_rows_on_every_rank(sizes, tmp_path):
    """Every quantity the Gram solves use, and the iEF/EF/SF directions themselves, equal DenseRows of the union
    batch to float64 rounding (1e-12 relative), and are bit-identical across ranks."""
    results = _spawn(_rows_on_rank, len(sizes), tmp_path, sizes)
    union = DenseRows(_union_rows(sizes))
    gen = torch.Generator().manual_seed(3)
    s = torch.rand(sum(sizes), generator=gen, dtype=torch.float64) + 0.5
    v = torch.randn(P, generator=gen, dtype=torch.float64)
    expected = dict(gram=union.gram(), gram_scaled=union.gram(2.0), combine=union.combine_rows(s),
                    times=union.times(v), row_sum=union.row_sum(), ief=ief_solve(union, s, 1e-3),
                    ef=ef_solve(union, 1e-3), sf=sf_solve(union, v, 1e-2), gathered=union.matrix[:, :2])
    for key, want in expected.items():
        got = results[0][key]
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12 * float(want.abs().max())), key
        for other in results[1:]:
            assert torch.equal(other[key], got), f"{key} differs between ranks"
    assert all(r["max_abs"] == float(union.matrix.abs().max()) and r["finite"] for r in results)


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


def test_one_process_runs_the_work_itself():
    assert agree(None, torch.device("cpu"), lambda: 5) == 5
    with pytest.raises(KeyError):
        agree(None, torch.device("cpu"), lambda: {}["x"])
