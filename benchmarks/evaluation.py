"""What one checkpoint of the evaluation costs: ``ief.evaluate`` per method per batch, time and peak memory.

Run from the repository root::

    OMP_NUM_THREADS=1 python -m benchmarks.evaluation                          # both cpu-scale LoRA/MLP setups
    python -m benchmarks.evaluation --setups digits-mlp --repeats 5 --json out.json
    python -m benchmarks.evaluation --setups tweets-minilm-lora --checkpoint RUN/checkpoints/stage-050.pt

``python -m companion evaluate`` (``companion.experiments.evaluate_runs``) calls, at every stage checkpoint of a setup's
baseline run and for each of its fixed batches, ``ief.evaluate(model, [batch], methods, damping, cg_iterations=...)``
with the E1 methods (sgd, ef, ief, sf, hf) plus the block-diagonal ones (kfac, ekfac, iekfac) when every trainable
parameter is in an ``nn.Linear``, and at three stages a damping sweep (``ief.damping_sweep``, 13 dampings). This
benchmark builds the setup's model at the ``cpu`` scale exactly as that job does (``eval()`` mode, the setup's batch
size, its iEF damping, the cpu scale's CG iterations), loads ``--checkpoint`` if given (a ``stage-PPP.pt`` of a run),
otherwise uses the initial model with LoRA ``B`` moved off zero (a stand-in for a trained checkpoint: same cost), and
times on one batch of the training set, round-robin:

- ``sgd``: ``ief.evaluate(model, [batch], ["sgd"])``: the per-sample backward, the gradient and one γ (the part
  every method shares: ``evaluate`` always evaluates sgd, the ratios need it);
- each method ``m``: ``ief.evaluate(model, [batch], [m])`` (so: sgd's part + ``m``'s direction + its γ);
- ``all methods``: one ``ief.evaluate`` with every method, what the job pays per batch (one per-sample backward
  shared by sgd/ef/ief/sf);
- ``damping sweep``: ``ief.damping_sweep`` at the job's 13 dampings (run at three stages only).

Ratios are to ``sgd`` (median of within-round ratios); peak memory is the tensor memory one call adds at its peak
(``benchmarks.harness``). The per-checkpoint cost is then ``batches x all methods`` (+ one sweep per batch at the
sweep stages); the cpu scale uses 4 batches per stage.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

import ief
from benchmarks import harness
from benchmarks.workloads import randomise_lora_b

SETUPS = ("tweets-minilm-lora", "digits-mlp", "tweets-minilm-pt")
# the paper's E1 at full scale without the hub: T5-base LoRA from its config (random weights), M = 160 (GPU)
FULL_T5 = "t5-base-lora-full"


def build_full_t5(device: torch.device, seed: int) -> dict:
    """The full scale's evaluation of a T5-base LoRA setup (``rte-t5-lora``'s iEF damping, the full scale's batch,
    CG steps and sweep) on a T5-base built from its config with random weights (no hub), LoRA ``B`` off zero."""
    from companion.experiments.evaluate_runs import BLOCK_METHODS, E1_METHODS, sweep_grid
    from companion.experiments.setups import EVALUATION_KNOBS, resolve
    from benchmarks.workloads import build_t5_lora

    knobs = EVALUATION_KNOBS["full"]
    w = build_t5_lora(knobs["batch_size"], device, seed, "t5-base-config")
    w.model.eval()
    return dict(model=w.model, inputs=w.inputs, targets=w.targets, methods=[*E1_METHODS, *BLOCK_METHODS],
                batch=knobs["batch_size"], source="T5-base (t5-base-config, random weights) + LoRA r=8 on q,v",
                damping=float(resolve("rte-t5-lora", "full").optimizers["ief"].damping), cg=knobs["cg_iterations"],
                sweep=list(sweep_grid(knobs["sweep_dampings"])),
                params=sum(p.numel() for p in w.model.parameters() if p.requires_grad), scale="full")


def build(setup: str, checkpoint: str | None, seed: int):
    """The model of ``setup`` at the cpu scale (as ``evaluate_run`` builds it), one batch, damping and CG steps."""
    from companion.experiments import store
    from companion.experiments.data import load_data
    from companion.experiments.evaluate_runs import BLOCK_METHODS, E1_METHODS, sweep_grid
    from companion.experiments.setups import EVALUATION_KNOBS as DEFAULTS
    from companion.experiments.models import build_model
    from companion.experiments.runner import seed_everything
    from companion.experiments.setups import resolve
    from companion.experiments.tasks import make_task
    from ief.kfac import check_linear_only

    cfg = resolve(setup, "cpu")
    seed_everything(seed)
    data = load_data(cfg)
    model, pre = build_model(cfg, data)
    if checkpoint:
        store.load_trainable(model, store.read_torch(checkpoint))
        source = f"checkpoint {checkpoint}"
    else:
        randomise_lora_b(model)
        source = "initial model" + (" with LoRA B ~ N(0, 0.02^2)" if cfg.method == "lora" else "")
    model.eval()
    m = min(cfg.batch_size, len(data.train))
    inputs, targets = make_task(cfg, model, pre).collate([data.train[i] for i in range(m)])
    methods = list(E1_METHODS)
    try:
        check_linear_only(model)
        methods += list(BLOCK_METHODS)
    except ValueError:
        pass
    return dict(model=model, inputs=inputs, targets=targets, methods=methods, batch=m, source=source,
                damping=float(cfg.optimizers["ief"].damping), cg=DEFAULTS["cpu"]["cg_iterations"],
                sweep=list(sweep_grid(DEFAULTS["cpu"]["sweep_dampings"])),
                params=sum(p.numel() for p in model.parameters() if p.requires_grad), scale="cpu")


def cases(s: dict) -> dict:
    from ief.evaluation import batch_generator

    model, x, y, lam, cg = s["model"], s["inputs"], s["targets"], s["damping"], s["cg"]

    def one(methods):
        return lambda: ief.evaluate(model, [(x, y)], methods, lam, cg_iterations=cg, seed=0)

    out = {"sgd": one(["sgd"])}
    out.update({m: one([m]) for m in s["methods"] if m != "sgd"})
    out["all methods"] = one(s["methods"])
    out["damping sweep"] = lambda: ief.damping_sweep(model, x, y, s["sweep"], generator=batch_generator(0, 0))
    return out


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    p = argparse.ArgumentParser(prog="python -m benchmarks.evaluation", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_common_arguments(p, repeats=3, warmup=1)
    p.add_argument("--setups", default="tweets-minilm-lora,digits-mlp",
                   help=f"comma-separated cpu-scale setups, from {', '.join(SETUPS)}; or {FULL_T5} (the full "
                        "scale's T5-base LoRA evaluation from the config, M = 160; meant for --device cuda)")
    p.add_argument("--checkpoint", default=None, help="a run's checkpoints/stage-PPP.pt (one setup only)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory pass")
    args = p.parse_args(argv)
    device = harness.check_common(p, args)
    setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    if not setups or any(s not in (*SETUPS, FULL_T5) for s in setups):
        p.error(f"--setups: {args.setups!r}; choose from {', '.join((*SETUPS, FULL_T5))}")
    if device.type != "cpu" and any(s in SETUPS for s in setups):
        p.error(f"--device {device}: the cpu-scale setups run on the CPU; on a GPU use --setups {FULL_T5}")
    if args.checkpoint and len(setups) != 1:
        p.error("--checkpoint needs exactly one setup in --setups")
    results, tables = [], []
    with harness.OtherLoad() as load:
        for setup in setups:
            t0 = time.perf_counter()
            s = build_full_t5(device, args.seed) if setup == FULL_T5 else build(setup, args.checkpoint, args.seed)
            fns = cases(s)
            times = harness.round_robin(fns, args.repeats, args.warmup, device=device)
            peaks = {k: (None if args.no_memory else harness.peak_memory_mib(fn, device)) for k, fn in fns.items()}
            rows = harness.rows(times, {k: (None if k == "sgd" else "sgd") for k in fns})
            for r in rows:
                r["peak_mib"] = peaks[r["key"]]
            info = {k: v for k, v in s.items() if k not in ("model", "inputs", "targets")}
            results.append(dict(setup=setup, **info, rows=rows, seconds=time.perf_counter() - t0))
            print(f"\n{setup} [{s['scale']}]: P = {s['params']:,} trainable, batch {s['batch']}, "
                  f"damping {s['damping']:g}, {s['cg']} CG steps, {s['source']}")
            print(f"{'case':<14} {'median s':>9} {'IQR s':>7} {'vs sgd':>7} {'peak MiB':>9}")
            for r in rows:
                peak = "n/a" if r["peak_mib"] is None else f"{r['peak_mib']:.1f}"
                print(f"{r['key']:<14} {r['median_ms'] / 1e3:>9.3f} {r['iqr_ms'] / 1e3:>7.3f} "
                      f"{(r['ratio'] or 1.0):>6.2f}x {peak:>9}", flush=True)
            tables.append(harness.table(
                f"`ief.evaluate` on one batch of {setup} ({s['scale']} scale: P = {s['params']:,} trainable, batch "
                f"{s['batch']}, {s['cg']} CG steps for hf)",
                [("method(s)", "s"), ("median s", ".3f"), ("IQR s", ".3f"), ("vs sgd", ".2f"), ("peak MiB", ".1f")],
                [[r["key"], r["median_ms"] / 1e3, r["iqr_ms"] / 1e3, 1.0 if r["ratio"] is None else r["ratio"],
                  r["peak_mib"]] for r in rows],
                note=f"Model: {s['source']}. A method's row is `ief.evaluate(model, [batch], [method])`, sgd's part "
                     f"(per-sample backward, gradient, one γ) included; `all methods` is one call with every "
                     f"method (what the job pays per batch); `damping sweep` is `ief.damping_sweep` at "
                     f"{len(s['sweep'])} dampings. vs sgd: median of within-round ratios."))
    doc = harness.record("evaluation", argv, device, args, load, dict(setups=results), tables, started)
    harness.finish(doc, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
