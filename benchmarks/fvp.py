"""The Fisher-vector product against its floor: ``ief.fisher_vp`` now and before, beside the (F + 2B)/G bound.

Run from the repository root::

    OMP_NUM_THREADS=1 python -m benchmarks fvp                 # mlp (M = 32), t5-lora, minilm-lora; one thread
    python -m benchmarks fvp --models mlp --repeats 101         # the fixed per-call cost shows on the small model

Models: ``benchmarks.workloads`` (``mlp`` 784-256-256-10 at ``--batch`` 32, ``t5-lora`` tiny, ``minilm-lora`` where
its offline weights are installed), float32, ``model.train()``, one fixed batch and one fixed random ``v``.

Cases, timed round-robin in one process (rotated order, medians of within-round ratios, ``benchmarks.harness``):

- ``forward`` ``F``: the forward with its autograd graph (no backward);
- ``gradient`` ``G = F + B``: forward and ``torch.autograd.grad`` of ``L = sum_n l_n`` w.r.t. the trainable
  parameters (the reference; ``B = G - F``, per round);
- ``fisher_vp`` now and ``fisher_vp`` before (``ief`` at git revision ``--before``, extracted beside it), default
  ``method="auto"`` (forward mode on these models).

The bound ``(F + 2B) / G`` (``ief.fisher_vp``'s docstring: a dual forward costs a forward plus tangents ``T ~ B``, then
one backward) is computed per round from the same round's ``F`` and ``G``; ``gap`` is the measured ratio over the
bound.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch

import ief
from benchmarks import harness
from benchmarks.hf_layers import load_before
from benchmarks.workloads import build_minilm_lora, build_mlp, build_t5_lora, logits_of, summed_cross_entropy

MODELS = ("mlp", "t5-lora", "minilm-lora")
BEFORE = "ef74e9b"  # main before fisher_vp's fixed per-call cost was cut (the 'before' column)
LABELS = {"forward": "forward (graph) F", "gradient": "gradient G", "fvp": "`fisher_vp` now",
          "fvp_before": "`fisher_vp` before"}


def build(name: str, batch: int, seed: int):
    device = torch.device("cpu")
    if name == "mlp":
        return build_mlp(batch, device, seed)
    if name == "t5-lora":
        return build_t5_lora(batch, device, seed)
    return build_minilm_lora(batch, device, seed)


def cases_of(w, before, seed: int) -> dict:
    model, inputs, targets = w.model, w.inputs, w.targets
    params = [p for p in model.parameters() if p.requires_grad]
    v = torch.randn(sum(p.numel() for p in params), generator=torch.Generator().manual_seed(seed + 1))

    def forward():
        return logits_of(model, inputs)

    def gradient():
        return torch.autograd.grad(summed_cross_entropy(logits_of(model, inputs), targets), params)

    cases = {"forward": forward, "gradient": gradient, "fvp": lambda: ief.fisher_vp(model, inputs, targets, v)}
    if before is not None:
        cases["fvp_before"] = lambda: before.fisher_vp(model, inputs, targets, v)
    return cases


def run_model(name: str, args, before) -> dict | None:
    w = build(name, args.batch, args.seed)
    if w is None:
        print(f"\n{name}: skipped (its offline weights are not installed)", flush=True)
        return None
    cases = cases_of(w, before, args.seed)
    if before is not None:
        with torch.random.fork_rng():  # the same dropout masks for both
            torch.manual_seed(args.seed)
            now = cases["fvp"]()
            torch.manual_seed(args.seed)
            old = cases["fvp_before"]()
        assert torch.allclose(now, old, rtol=1e-4, atol=1e-6 * float(old.abs().max())), "fisher_vp changed its value"
    with harness.OtherLoad() as load:
        times = harness.round_robin(cases, args.repeats, args.warmup)
    refs = {k: None if k == "gradient" else "gradient" for k in cases}
    rows = harness.rows(times, refs, LABELS)
    bound = statistics.median((f + 2 * (g - f)) / g for f, g in zip(times["forward"], times["gradient"]))
    ratio = {r["key"]: r["ratio"] for r in rows}
    print(f"\n{name}: {w.description}; P = {sum(p.numel() for p in w.model.parameters() if p.requires_grad):,}",
          flush=True)
    print(f"{'case':<24} {'median ms':>10} {'IQR ms':>8} {'/ G':>7}")
    for r in rows:
        print(f"{r['label']:<24} {r['median_ms']:>10.3f} {r['iqr_ms']:>8.3f} {(r['ratio'] or 1.0):>6.2f}x")
    print(f"bound (F + 2B)/G {bound:.2f}x; now / bound {ratio['fvp'] / bound:.2f}"
          + (f", before / bound {ratio['fvp_before'] / bound:.2f}" if "fvp_before" in ratio else ""), flush=True)
    return dict(model=name, description=w.description, rows=rows, bound=bound, other_load_cores=load.cores)


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    p = argparse.ArgumentParser(prog="python -m benchmarks.fvp", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_common_arguments(p, repeats=51, warmup=3, device=False)
    p.add_argument("--batch", type=int, default=32, help="M (default 32)")
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--before", default=BEFORE, help=f"git revision of the 'before' package (default {BEFORE})")
    args = p.parse_args(argv)
    harness.check_common(p, args)
    if args.batch < 1:
        p.error(f"--batch must be >= 1, got {args.batch}")
    print(harness.machine_line(harness.machine("cpu")), flush=True)
    with tempfile.TemporaryDirectory() as folder, harness.OtherLoad() as load:
        before = load_before(args.before, folder)
        results = [r for r in (run_model(name, args, before) for name in args.models) if r is not None]
    body = []
    for res in results:
        ratio = {r["key"]: r["ratio"] for r in res["rows"]}
        before_ratio = ratio.get("fvp_before")
        body.append([res["model"], before_ratio, ratio["fvp"], res["bound"], ratio["fvp"] / res["bound"],
                     None if before_ratio is None else before_ratio / ratio["fvp"]])
    table = harness.table(
        "`ief.fisher_vp` against its floor (F + 2B)/G, one thread",
        [("model", "s"), ("before / G", ".2f"), ("now / G", ".2f"), ("bound (F + 2B)/G", ".2f"),
         ("now / bound", ".2f"), ("speed-up", ".2f")], body,
        note=f"G: forward + autograd.grad; F: the forward with its graph, B = G - F, per round. Ratios: medians of "
             f"within-round ratios, one process; 'before' is `ief` at {args.before}.")
    doc = harness.record("fvp", argv, "cpu", args, load, dict(models=results), [table], started)
    harness.finish(doc, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
