"""Per-sample gradients of a small CNN: ``ief.per_sample`` against ``torch.func`` and BackPACK, time and peak memory.

Run from the repository root::

    OMP_NUM_THREADS=1 python -m benchmarks.conv2d                      # batch 64, CPU, one thread
    python -m benchmarks.conv2d --batch 32 --repeats 5 --json out.json

Model (``benchmarks.workloads.build_cnn``): 3x32x32 inputs, ``Conv2d(3, 16, 3)`` - ReLU - max-pool -
``Conv2d(16, 32, 3)`` - ReLU - max-pool - ``Linear(2048, 10)`` (25,578 parameters), float32, random CIFAR-shaped
data, ``L = sum_n l_n`` (sum of cross-entropies). Every method gives the ``[M, P]`` per-sample Jacobian (BackPACK:
the per-parameter ``grad_batch`` blocks):

- ``plain backward`` (the reference): forward + ``loss.backward()`` (one gradient, not per sample);
- ``ief.per_sample``: the package's default (``check=True``: the structural guard, no hooked parameter used outside
  its hooked calls, read from the batch backward), on whatever path it takes for ``nn.Conv2d`` today (a per-sample loop
  with a ``SlowPathWarning`` where no hook path exists; the record says which: ``slow_path_warning``);
- ``ief.per_sample, check=False``: the same without the guard;
- ``torch.func vmap(grad)``: ``vmap`` over samples of ``grad`` of one sample's loss through ``functional_call``;
- ``BackPACK BatchGrad``: ``backpack.extend`` on a copy of the model and on ``CrossEntropyLoss(reduction="sum")``,
  one backward under ``with backpack(BatchGrad())``.

Timing and memory: ``benchmarks.harness`` (round-robin, rotated order, median/IQR, median of within-round ratios to
the plain backward; peak tensor memory in a separate pass). Before timing, every method's ``J`` is compared with
``torch.func``'s: the largest absolute difference is recorded (a sanity check, not a test).
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings

import torch

import ief
from benchmarks import harness
from benchmarks.workloads import build_cnn

LABELS = {
    "backward": "plain backward",
    "ief": "`ief.per_sample` (default guard)",
    "ief_nocheck": "`ief.per_sample`, `check=False`",
    "vmap": "`torch.func` `vmap(grad)`",
    "backpack": "BackPACK `BatchGrad`",
}


def methods(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    """``{key: callable returning J [M, P]}`` (the plain backward returns the gradient)."""
    from torch.func import functional_call, grad, vmap

    params = {k: p for k, p in model.named_parameters() if p.requires_grad}

    def backward():
        model.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y, reduction="sum")
        loss.backward()
        return torch.cat([p.grad.reshape(-1) for p in params.values()])

    def one_loss(p, xi, yi):
        out = functional_call(model, p, (xi.unsqueeze(0),))
        return torch.nn.functional.cross_entropy(out, yi.unsqueeze(0), reduction="sum")

    per_sample_grad = vmap(grad(one_loss), in_dims=(None, 0, 0))

    def with_vmap():
        g = per_sample_grad({k: p.detach() for k, p in params.items()}, x, y)
        return torch.cat([g[k].reshape(x.shape[0], -1) for k in params], dim=1)

    cases = {
        "backward": backward,
        "ief": lambda: ief.per_sample(model, x, y).jacobian,
        "ief_nocheck": lambda: ief.per_sample(model, x, y, check=False).jacobian,
        "vmap": with_vmap,
    }
    try:
        from backpack import backpack, extend
        from backpack.extensions import BatchGrad
    except ImportError:
        return cases
    bp_model = extend(copy.deepcopy(model))
    bp_loss = extend(torch.nn.CrossEntropyLoss(reduction="sum"))
    bp_params = [p for p in bp_model.parameters() if p.requires_grad]

    def with_backpack():
        bp_model.zero_grad(set_to_none=True)
        loss = bp_loss(bp_model(x), y)
        with backpack(BatchGrad()):
            loss.backward()
        return torch.cat([p.grad_batch.reshape(x.shape[0], -1) for p in bp_params], dim=1)

    cases["backpack"] = with_backpack
    return cases


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    p = argparse.ArgumentParser(prog="python -m benchmarks.conv2d", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_common_arguments(p, repeats=7, warmup=1)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory pass")
    args = p.parse_args(argv)
    device = harness.check_common(p, args)
    if args.batch < 1:
        p.error(f"--batch must be >= 1, got {args.batch}")
    w = build_cnn(args.batch, device, args.seed)
    model, x, y = w.model.train(), w.inputs, w.targets
    n_params = sum(q.numel() for q in model.parameters())
    cases = methods(model, x, y)
    skipped = [] if "backpack" in cases else [dict(method="backpack", reason="backpack-for-pytorch not installed")]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reference = cases["vmap"]().detach()
        check = {k: float((fn().detach() - reference).abs().max()) for k, fn in cases.items() if k != "backward"}
    slow = [str(c.message) for c in caught if type(c.message).__name__ == "SlowPathWarning"]
    print(f"CNN 3x32x32, P = {n_params:,}, batch {args.batch}; {harness.machine_line(harness.machine(device))}")
    print("max |J - J_vmap|: " + ", ".join(f"{k} {v:.1e}" for k, v in check.items()))
    path_taken = f"per-sample loop (SlowPathWarning: {slow[0][:120]})" if slow else "no SlowPathWarning"
    print(f"ief.per_sample on Conv2d: {path_taken}")
    with harness.OtherLoad() as load, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        times = harness.round_robin(cases, args.repeats, args.warmup, device=device)
        peaks = {k: (None if args.no_memory else harness.peak_memory_mib(fn, device)) for k, fn in cases.items()}
    rows = harness.rows(times, {k: (None if k == "backward" else "backward") for k in cases}, LABELS)
    for r in rows:
        r["peak_mib"] = peaks[r["key"]]
        r["max_abs_diff_vs_vmap"] = check.get(r["key"])
    print(f"{'method':<34} {'median ms':>10} {'IQR ms':>8} {'vs backward':>12} {'peak MiB':>9}")
    for r in rows:
        peak = "n/a" if r["peak_mib"] is None else f"{r['peak_mib']:.1f}"
        print(f"{r['label']:<34} {r['median_ms']:>10.2f} {r['iqr_ms']:>8.2f} {(r['ratio'] or 1.0):>11.2f}x {peak:>9}")
    path = "per-sample loop (SlowPathWarning)" if slow else "hooks (no SlowPathWarning)"
    table = harness.table(
        f"Per-sample gradients of a CNN (3x32x32, two Conv2d, P = {n_params:,}, batch {args.batch})",
        [("method", "s"), ("median ms", ".1f"), ("IQR ms", ".1f"), ("vs backward", ".2f"), ("peak MiB", ".1f")],
        [[r["label"], r["median_ms"], r["iqr_ms"], 1.0 if r["ratio"] is None else r["ratio"], r["peak_mib"]]
         for r in rows],
        note=f"`ief.per_sample` took its {path} path for `nn.Conv2d`; vs backward: median of within-round ratios; "
             f"peak MiB: tensor memory the call added at its peak.")
    doc = harness.record("conv2d", argv, device, args, load,
                         dict(params=n_params, batch=args.batch, rows=rows, slow_path_warning=slow[:1],
                              max_abs_diff_vs_vmap=check, skipped=skipped), [table], started)
    harness.finish(doc, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
