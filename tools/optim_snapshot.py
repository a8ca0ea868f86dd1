"""A numerics snapshot of ``ief.optim``, to prove that a refactor of the optimisers moved no number.

Runs short optimiser trajectories on tiny seeded models and saves every loss, parameter vector, update norm, rate and
state tensor as a dict ``name -> tensor | float | str`` (``torch.save``); ``--compare A.pt B.pt`` reports key by key
whether two snapshots are bit-identical (``torch.equal``, NaN equal to NaN) and exits 1 if any key differs::

    python -m tools.optim_snapshot --out before.pt
    python -m tools.optim_snapshot --compare before.pt after.pt

The grid: IEF / EF / SF and the three KFAC kinds; every ``form`` (auto, dense, ghost, rows); float32, float64 and
bfloat16 weights (and bfloat16 autocast); dampings 0, 1e-6, 1e-3, 1; ``momentum``, ``dampening``, ``weight_decay``
(with per-group decay), ``normalize``, ``total_steps``, ``reduction`` sum and mean, ``lr="auto"``, a scheduler, a
``state_dict`` round trip (a run split by save and load against the unsplit run), refusals (what raises and with which
message), and the same trajectories across 2 gloo processes (each rank's half of the union batch). It uses only the
public names of ``ief.optim`` and the models of :mod:`tools.numerics_snapshot`, so it runs unchanged on both sides of
a refactor. Single-threaded and seeded per trajectory: two runs on one machine and one torch build give identical files.
"""
from __future__ import annotations

import argparse
import copy
import os
import pickle
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tools.numerics_snapshot import Snapshot, _gen, _seed, compare, in_dtype, mlp, mse_mlp, sequence, token_table

STEPS = 4


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).to(torch.float64) for p in model.parameters() if p.requires_grad])


def _state_tensors(opt: Any) -> dict[str, Any]:
    """Every tensor of ``opt.state_dict()`` (momentum buffers, auto-lr delta, K-FAC factors), by a path name."""
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            out[prefix] = value
        elif isinstance(value, dict):
            for k in sorted(value, key=str):
                walk(f"{prefix}.{k}", value[k])
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{prefix}[{i}]", v)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[prefix] = float(value)
        elif isinstance(value, (str, bool)) or value is None:
            out[prefix] = str(value)
    walk("state", opt.state_dict())
    return out


def run_trajectory(case, make_opt: Callable, steps: int = STEPS, autocast: bool = False, split_at: int | None = None,
                   schedule: bool = False) -> dict[str, Any]:
    """``steps`` steps of ``make_opt(model)`` on ``case``'s batches; with ``split_at``, a save / load into a fresh
    optimiser (and model copy) before step ``split_at``. Returns the recorded values."""
    model = copy.deepcopy(case.model)
    opt = make_opt(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1 + t)) if schedule else None
    out: dict[str, Any] = {}
    for i in range(steps):
        if split_at is not None and i == split_at:
            saved = copy.deepcopy(opt.state_dict())
            fresh = copy.deepcopy(model)
            opt = make_opt(fresh)
            opt.load_state_dict(saved)
            model = fresh
        x, y = case.extra_batches[i % len(case.extra_batches)]
        if autocast:
            with torch.autocast("cpu", torch.bfloat16):
                loss = opt.step(x, y)
        else:
            loss = opt.step(x, y)
        if sched is not None:
            sched.step()
        out[f"{i}/loss"] = loss.detach().reshape(()).to(torch.float64)
        out[f"{i}/params"] = _flat(model)
        norm = opt.last_update_norm
        out[f"{i}/update_norm"] = float("nan") if norm is None else float(norm)
        out[f"{i}/last_lr"] = float("nan") if getattr(opt, "last_lr", None) is None else float(opt.last_lr)
        out[f"{i}/last_losses"] = opt.last_losses.detach().to(torch.float64)
    for key, value in _state_tensors(opt).items():
        out[f"final/{key}"] = value
    return out


def record(snap: Snapshot, key: str, fn: Callable[[], dict]) -> None:
    values = snap.run(key, fn)
    if values is not None:
        for k, v in values.items():
            snap.put(f"{key}/{k}", v)


def _configs(O: Any, loss: str, kfac_params: Callable) -> dict[str, Callable]:
    """name -> make_opt(model)."""
    c: dict[str, Callable] = {}
    for damping in (0.0, 1e-6, 1e-3, 1.0):
        c[f"ief-d{damping:g}"] = lambda m, d=damping: O.IEF(m, lr=0.5, damping=d, loss=loss)
        c[f"ef-d{damping:g}"] = lambda m, d=damping: O.EF(m, lr=0.05, damping=d, loss=loss)
        if damping > 0:
            c[f"sf-d{damping:g}"] = lambda m, d=damping: O.SF(m, lr=0.05, damping=d, generator=_gen(3), loss=loss)
    for form in ("auto", "dense", "ghost", "rows"):
        c[f"ief-{form}"] = lambda m, f=form: O.IEF(m, form=f, loss=loss)
        c[f"ef-{form}"] = lambda m, f=form: O.EF(m, form=f, normalize=False, lr=0.01, loss=loss)
        c[f"sf-{form}"] = lambda m, f=form: O.SF(m, form=f, generator=_gen(4), loss=loss)
    for check in (False, "exact", 2):
        c[f"ief-check{check}"] = lambda m, k=check: O.IEF(m, check=k, loss=loss)
    c.update({
        "ief-mom": lambda m: O.IEF(m, lr=0.5, momentum=0.9, loss=loss),
        "ief-mom-damp": lambda m: O.IEF(m, lr=0.5, momentum=0.9, dampening=0.9, loss=loss),
        "ief-wd": lambda m: O.IEF(m, lr=0.5, weight_decay=0.1, loss=loss),
        "ief-mom-wd-T": lambda m: O.IEF(m, lr=0.5, momentum=0.5, dampening=0.2, weight_decay=0.05, total_steps=6,
                                        loss=loss),
        "ief-norm": lambda m: O.IEF(m, lr=0.1, normalize=True, loss=loss),
        "ief-norm-T": lambda m: O.IEF(m, lr=0.1, normalize=True, total_steps=5, loss=loss),
        "ief-norm-mom-wd": lambda m: O.IEF(m, lr=0.1, normalize=True, momentum=0.9, weight_decay=0.1, loss=loss),
        "ief-mean": lambda m: O.IEF(m, reduction="mean", lr=3.0, loss=loss),
        "ief-mean-default": lambda m: O.IEF(m, reduction="mean", loss=loss),
        "ief-mean-mom-wd": lambda m: O.IEF(m, reduction="mean", lr=3.0, momentum=0.9, weight_decay=0.01, loss=loss),
        "ief-mean-norm": lambda m: O.IEF(m, reduction="mean", lr=0.1, normalize=True, momentum=0.5, loss=loss),
        "ief-auto": lambda m: O.IEF(m, lr="auto", loss=loss),
        "ief-auto-mom-wd": lambda m: O.IEF(m, lr="auto", momentum=0.9, weight_decay=0.1, loss=loss),
        "ief-auto-mean": lambda m: O.IEF(m, lr="auto", reduction="mean", loss=loss),
        "ief-auto-norm-T": lambda m: O.IEF(m, lr="auto", normalize=True, total_steps=6, loss=loss),
        "ef-default": lambda m: O.EF(m, loss=loss),
        "ef-T": lambda m: O.EF(m, total_steps=5, loss=loss),
        "ef-mom-wd": lambda m: O.EF(m, momentum=0.5, dampening=0.1, weight_decay=0.1, loss=loss),
        "ef-mean": lambda m: O.EF(m, reduction="mean", normalize=False, lr=1e-3, loss=loss),
        "ef-mean-norm-mom": lambda m: O.EF(m, reduction="mean", momentum=0.9, loss=loss),
        "ef-auto": lambda m: O.EF(m, lr="auto", loss=loss),
        "ef-auto-raw": lambda m: O.EF(m, lr="auto", normalize=False, loss=loss),
        "sf-default": lambda m: O.SF(m, generator=_gen(5), loss=loss),
        "sf-mom-wd-T": lambda m: O.SF(m, generator=_gen(6), momentum=0.9, weight_decay=0.01, total_steps=5, loss=loss),
        "sf-mean": lambda m: O.SF(m, generator=_gen(7), reduction="mean", loss=loss),
        "sf-auto": lambda m: O.SF(m, generator=_gen(8), lr="auto", loss=loss),
        "sf-global": lambda m: O.SF(m, lr=0.02, loss=loss),
    })
    for kind in ("kfac", "ekfac", "iekfac"):
        gen = (lambda: _gen(9)) if kind == "kfac" else (lambda: None)
        c[f"kfac-{kind}"] = lambda m, k=kind, g=gen: O.KFAC(m, k, lr=0.05, damping=1.0, inverse_every=2, generator=g(),
                                                             params=kfac_params(m), loss=loss)
        c[f"kfac-{kind}-mom-wd-norm"] = lambda m, k=kind, g=gen: O.KFAC(
            m, k, lr=0.05, damping=0.1, factor_decay=0.5, inverse_every=3, momentum=0.9, dampening=0.1,
            weight_decay=0.01, normalize=True, total_steps=6, generator=g(), params=kfac_params(m), loss=loss)
        c[f"kfac-{kind}-clip"] = lambda m, k=kind, g=gen: O.KFAC(m, k, lr=0.5, damping=1e-2, kl_clip=1e-3,
                                                                  generator=g(), params=kfac_params(m), loss=loss)
        c[f"kfac-{kind}-reduce"] = lambda m, k=kind, g=gen: O.KFAC(m, k, damping=0.5, approx="reduce",
                                                                    generator=g(), params=kfac_params(m), loss=loss)
    return c


def _wd_groups(m: torch.nn.Module) -> list[dict]:
    named = [(n, p) for n, p in m.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in named if "bias" not in n], "weight_decay": 0.05},
            {"params": [p for n, p in named if "bias" in n], "weight_decay": 0.0}]


def trajectories(snap: Snapshot, case, tag: str, grid: str = "full", autocast: bool = False) -> None:
    import ief

    O = ief.optim
    kp = (lambda m: None) if case.kfac == "all" else (
        lambda m: [p for n, p in m.named_parameters() if p.requires_grad and set(n.split(".")) & set(case.kfac)])
    configs = _configs(O, case.loss, kp)
    if grid == "short":
        keep = ("ief-d0.001", "ef-d0.001", "sf-d0.001", "ief-auto", "ief-mom-wd-T", "ef-mom-wd", "sf-mom-wd-T",
                "ief-mean", "ief-norm-mom-wd", "kfac-iekfac", "kfac-kfac-mom-wd-norm", "ief-dense", "ief-rows")
        configs = {k: v for k, v in configs.items() if k in keep}
    for name, make in configs.items():
        key = f"{case.name}/{tag}/{name}"
        _seed(key)
        record(snap, key, lambda make=make: run_trajectory(case, make, autocast=autocast))
    if grid != "full":
        return
    # groups, a scheduler, save/load splits (momentum, auto, SF's generator, K-FAC's factors)
    extra = {
        "ief-groups": (lambda m: O.IEF(m, lr=0.5, params=_wd_groups(m), momentum=0.5), {}),
        "ief-sched": (lambda m: O.IEF(m, lr=0.5, momentum=0.5, weight_decay=0.1), {"schedule": True}),
        "ef-sched-T": (lambda m: O.EF(m, total_steps=6), {"schedule": True}),
        "ief-split": (lambda m: O.IEF(m, lr=0.5, momentum=0.9, weight_decay=0.01), {"split_at": 2}),
        "ief-auto-split": (lambda m: O.IEF(m, lr="auto", momentum=0.5), {"split_at": 2}),
        "ef-mean-split": (lambda m: O.EF(m, reduction="mean", momentum=0.5), {"split_at": 2}),
        "sf-split": (lambda m: O.SF(m, generator=_gen(10), momentum=0.5), {"split_at": 3}),
        "kfac-split": (lambda m: O.KFAC(m, "kfac", lr=0.05, damping=1.0, inverse_every=3, generator=_gen(11),
                                        momentum=0.5, params=kp(m)), {"split_at": 2}),
    }
    for name, (make, kw) in extra.items():
        key = f"{case.name}/{tag}/{name}"
        _seed(key)
        record(snap, key, lambda make=make, kw=kw: run_trajectory(case, make, **kw))


def refusals(snap: Snapshot, case) -> None:
    """What raises, and with which message (a changed message is a difference too)."""
    import ief

    O = ief.optim
    x, y = case.extra_batches[0]
    calls = {
        "lr-neg": lambda: O.IEF(case.model, lr=-1.0),
        "lr-str": lambda: O.IEF(case.model, lr="fast"),
        "damping-neg": lambda: O.EF(case.model, damping=-1.0),
        "sf-damping-0": lambda: O.SF(case.model, damping=0.0),
        "momentum-1": lambda: O.IEF(case.model, momentum=1.0),
        "dampening-2": lambda: O.IEF(case.model, dampening=2.0),
        "wd-big": lambda: O.IEF(case.model, lr=2.0, weight_decay=0.5),
        "total-0": lambda: O.IEF(case.model, total_steps=0),
        "reduction": lambda: O.IEF(case.model, reduction="avg"),
        "check": lambda: O.IEF(case.model, check="fast"),
        "form": lambda: O.IEF(case.model, form="wide"),
        "misspelt": lambda: O.IEF(case.model, dampning=1e-3),
        "kfac-mean": lambda: O.KFAC(case.model, "kfac", reduction="mean"),
        "kfac-auto": lambda: O.KFAC(case.model, "kfac", lr="auto"),
        "kfac-check": lambda: O.KFAC(case.model, "kfac", check=False),
        "kfac-form": lambda: O.KFAC(case.model, "kfac", form="dense"),
        "kfac-misspelt": lambda: O.KFAC(case.model, "kfac", factor_decy=0.5),
        "step-no-batch": lambda: O.IEF(case.model).step(),
        "add-group": lambda: O.IEF(case.model).add_param_group({"params": []}),
        "load-ef-into-ief": lambda: O.IEF(case.model).load_state_dict(O.EF(case.model).state_dict()),
        "load-adamw": lambda: O.IEF(case.model).load_state_dict(
            torch.optim.AdamW(case.model.parameters()).state_dict()),
    }

    def bad_group(key, value):
        def go():
            opt = O.IEF(copy.deepcopy(case.model))
            opt.param_groups[0][key] = value
            opt.step(x, y)
        return go

    calls.update({"group-lr-nan": bad_group("lr", float("nan")), "group-damping-neg": bad_group("damping", -1.0),
                  "group-momentum": bad_group("momentum", 1.5)})
    for name, fn in calls.items():
        snap.run(f"{case.name}/refuse/{name}", fn)


# ---------------------------------------------------------------------------------------------- across processes
def _dist_cases() -> dict[str, Callable]:
    import ief

    O = ief.optim
    return {
        "ief": lambda m: O.IEF(m, lr=0.5, damping=1e-3, process_group=_world()),
        "ief-dense": lambda m: O.IEF(m, lr=0.5, damping=1e-3, form="dense", process_group=_world()),
        "ief-mom-wd-T": lambda m: O.IEF(m, lr=0.5, momentum=0.9, weight_decay=0.01, total_steps=6,
                                        process_group=_world()),
        "ief-mean": lambda m: O.IEF(m, reduction="mean", lr=3.0, process_group=_world()),
        "ief-auto": lambda m: O.IEF(m, lr="auto", momentum=0.5, process_group=_world()),
        "ief-norm": lambda m: O.IEF(m, lr=0.1, normalize=True, process_group=_world()),
        "ef": lambda m: O.EF(m, process_group=_world()),
        "ef-mean-mom": lambda m: O.EF(m, reduction="mean", momentum=0.5, weight_decay=0.1, process_group=_world()),
        "sf": lambda m: O.SF(m, generator=_gen(20), process_group=_world()),
        "sf-auto": lambda m: O.SF(m, generator=_gen(21), lr="auto", process_group=_world()),
        "kfac-iekfac": lambda m: O.KFAC(m, "iekfac", lr=0.05, damping=1.0, inverse_every=2, momentum=0.5,
                                        process_group=_world()),
        "kfac-kfac": lambda m: O.KFAC(m, "kfac", lr=0.05, damping=1.0, inverse_every=2, generator=_gen(22),
                                      process_group=_world()),
        "kfac-ekfac": lambda m: O.KFAC(m, "ekfac", lr=0.05, damping=1.0, factor_decay=0.0, process_group=_world()),
    }


def _world() -> Any:
    import torch.distributed as dist
    return dist.group.WORLD


def _rank_half(case, rank: int):
    """The case with every batch cut to this rank's rows (uneven halves: rank 0 takes the first 3)."""
    cut = (slice(0, 3), slice(3, None))[rank]

    def half(batch):
        x, y = batch
        return x[cut], y[cut]
    out = copy.copy(case)
    out.extra_batches = [half(b) for b in case.extra_batches]
    return out


def _on_rank(rank: int, world: int, store: str, out: str) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        snap = Snapshot()
        for dtype_tag, dtype in (("f32", torch.float32), ("f64", torch.float64)):
            case = _rank_half(in_dtype(mlp(), dtype), rank)
            for name, make in _dist_cases().items():
                key = f"dist/mlp/{dtype_tag}/{name}/rank{rank}"
                _seed(f"dist/{dtype_tag}/{name}/rank{rank}")
                record(snap, key, lambda make=make, case=case: run_trajectory(case, make))
        Path(out).write_bytes(pickle.dumps(snap.values))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _entry(rank: int, world: int, store: str, outs: list[str]) -> None:
    _on_rank(rank, world, store, outs[rank])


def distributed(snap: Snapshot) -> None:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        outs = [os.path.join(folder, f"rank{r}.pkl") for r in range(2)]
        mp.spawn(_entry, args=(2, os.path.join(folder, "store"), outs), nprocs=2, join=True, start_method="spawn")
        for o in outs:
            for key, value in pickle.loads(Path(o).read_bytes()).items():
                snap.put(key, value)


# ---------------------------------------------------------------------------------------------------------- main
def snapshot(with_distributed: bool = True) -> Snapshot:
    snap = Snapshot()
    base = mlp()
    for tag, dtype in (("f32", torch.float32), ("f64", torch.float64)):
        trajectories(snap, in_dtype(base, dtype), tag, grid="full")
    trajectories(snap, in_dtype(base, torch.bfloat16), "bf16", grid="short")
    trajectories(snap, base, "f32-autocast-bf16", grid="short", autocast=True)
    trajectories(snap, in_dtype(mse_mlp(), torch.float64), "f64", grid="short")
    trajectories(snap, in_dtype(sequence(), torch.float64), "f64", grid="short")
    trajectories(snap, in_dtype(sequence(), torch.float32), "f32", grid="short")
    trajectories(snap, in_dtype(token_table_batches(), torch.float64), "f64", grid="short")
    refusals(snap, base)
    if with_distributed:
        distributed(snap)
    return snap


def token_table_batches():
    """:func:`tools.numerics_snapshot.token_table` with batches to step on (its own batch, and perturbed copies)."""
    case = token_table()
    x, y = case.inputs, case.targets
    case.extra_batches = [(x, y), (x.flip(0), y.flip(0)), (x.roll(1, 0), y.roll(1, 0))]
    return case


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.optim_snapshot", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", metavar="FILE.pt")
    p.add_argument("--compare", nargs=2, metavar=("A.pt", "B.pt"))
    p.add_argument("--only-differences", action="store_true")
    p.add_argument("--no-distributed", action="store_true")
    args = p.parse_args(argv)
    if bool(args.out) == bool(args.compare):
        p.error("give exactly one of --out FILE.pt or --compare A.pt B.pt")
    if args.compare:
        return compare(*args.compare, only_differences=args.only_differences)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    import ief

    t0 = time.perf_counter()
    snap = snapshot(not args.no_distributed)
    torch.save(snap.values, args.out)
    print(f"ief from {os.path.dirname(os.path.abspath(ief.__file__))}")
    print(f"wrote {len(snap.values)} keys to {args.out} in {time.perf_counter() - t0:.1f} s "
          f"({len(snap.errors)} computations recorded as errors: {', '.join(snap.errors[:40])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
