"""iEF's default rate and damping across label counts, beside AdamW at its usual rate, lr="auto" and a searched rate.

Run from the repository root (single-threaded)::

    OMP_NUM_THREADS=1 python -m benchmarks defaults --json benchmarks/results/defaults-cpu.json
    OMP_NUM_THREADS=1 python -m benchmarks defaults --tasks llama-lora-lm --steps 50
    python -m benchmarks defaults --retable benchmarks/results/defaults-cpu.json  # its tables from its results

**The rule, stated before the numbers.** A default passes a task when (1) its held-out loss after ``--steps``
updates is within 5 % of AdamW's at its usual rate (``1e-3``) after the same updates on the same batches (or below
it), and (2) it never raises the trainable parameters' norm 10-fold while the held-out loss stays within 5 % of its
initial value. The default was chosen on the four ``tuning`` tasks (a classifier, a causal LM with ``-100``
padding, a seq2seq task, an MLP) and is checked on three tasks held out from that choice (the ``held out`` kinds).

Every task (:mod:`benchmarks.default_tasks`: tiny random-weight models from small configs, synthetic learnable data,
batches of 32 samples) trains from the same initial model on the same batches with:

- ``adamw``: ``torch.optim.AdamW(lr=1e-3)`` (weight decay 0.01, torch's default), the mean per-target loss;
- ``default``: ``ief.optim.IEF(model)`` (:mod:`ief.optim.defaults`: ``lr = 0.3 / T``, ``damping = 1e-4 T^2`` per batch,
  ``T`` its counted targets per sample);
- ``former``: ``IEF(model, lr=1, damping=1e-4)``, the sum convention's default before the rate was set per batch;
- ``auto``: ``IEF(model, lr="auto")`` (:mod:`ief.optim.auto_lr`; damping as ``default``);
- ``searched``: the best held-out *validation* loss over ``lr`` in :data:`GRID` (sum convention, damping as
  ``default``), reported on the test set like the others.

Reported per run: the test set's mean per-target loss and accuracy (256 held-out samples, eval mode), the norm of the
trainable parameters after training over before, the seconds, and whether a step raised (``diverged``).
"""
from __future__ import annotations

import argparse
import math
import time
import warnings
from typing import Any

import torch

import ief
from benchmarks import harness
from benchmarks.default_tasks import Task, held_out, tasks

GRID = (0.03, 0.1, 0.3, 1.0)  # the searched rates (sum convention)
ADAMW_LR = 1e-3
WITHIN = 0.05  # the rule: the default's held-out loss at most 5 % above AdamW's
NORM_GROWTH = 10.0  # ... and never this growth of the trainable norm while the loss stays within 5 % of its start


def _norm(model: torch.nn.Module) -> float:
    return math.sqrt(sum(float(p.detach().double().pow(2).sum()) for p in model.parameters() if p.requires_grad))


def _adamw_step(model: torch.nn.Module, opt: torch.optim.Optimizer, inputs: Any, targets: torch.Tensor) -> None:
    from ief.model_call import call_model

    logits = call_model(model, inputs)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                                             ignore_index=-100)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def train(task: Task, method: str, steps: int, lr: Any = None) -> dict[str, Any]:
    """One run of ``method`` (``adamw``, ``default``, ``former``, ``auto`` or ``lr``: IEF at ``lr``) on ``task``."""
    model = task.build()
    initial_norm = _norm(model)
    initial_loss, _ = held_out(model, task.test)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if method == "adamw":
        opt = torch.optim.AdamW(trainable, lr=ADAMW_LR)
    elif method == "default":
        opt = ief.optim.IEF(model)
    elif method == "former":
        opt = ief.optim.IEF(model, lr=1.0, damping=1e-4)
    elif method == "auto":
        opt = ief.optim.IEF(model, lr="auto")
    else:
        opt = ief.optim.IEF(model, lr=lr)
    started, diverged = time.perf_counter(), None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            inputs, targets = task.batch(step)
            try:
                if method == "adamw":
                    _adamw_step(model, opt, inputs, targets)
                else:
                    opt.step(inputs, targets)
            except FloatingPointError as err:
                diverged = {"step": step, "reason": str(err)[:200]}
                break
    said = sorted({str(w.message).split(":")[0] + ": " + str(w.message).split(":")[1][:60] for w in caught
                   if "not fallen" in str(w.message) or "overshooting" in str(w.message)})
    seconds = time.perf_counter() - started
    loss, accuracy = held_out(model, task.test) if diverged is None else (math.inf, None)
    validation = held_out(model, task.validation)[0] if diverged is None else math.inf
    growth = _norm(model) / initial_norm if initial_norm > 0 else math.inf
    return dict(method=method, lr=lr, steps=steps, diverged=diverged, test_loss=loss, test_accuracy=accuracy,
                validation_loss=validation, initial_test_loss=initial_loss, norm_growth=growth, seconds=seconds,
                warnings=said)


def passes(default: dict[str, Any], adamw: dict[str, Any]) -> bool:
    """The rule of the module docstring."""
    if default["diverged"] is not None or not math.isfinite(default["test_loss"]):
        return False
    close = default["test_loss"] <= (1.0 + WITHIN) * adamw["test_loss"]
    stayed = default["test_loss"] >= (1.0 - WITHIN) * default["initial_test_loss"]
    return close and not (stayed and default["norm_growth"] >= NORM_GROWTH)


def _cell(run: dict[str, Any]) -> str:
    if run["diverged"] is not None:
        return "diverged"
    return f"{run['test_loss']:.3f} ({100 * run['test_accuracy']:.0f} %)"


def _growth(run: dict[str, Any]) -> str:
    """The trainable norm's growth, short enough for a narrow column (``x9.57``, ``x2,090``)."""
    growth = run["norm_growth"]
    return f"x{growth:.3g}" if growth < 1000 else f"x{growth:,.0f}"


def _rule_row(result: dict[str, Any]) -> list[str]:
    runs = result["runs"]
    return [result["task"], "tuning" if result["tuning"] else "held out", _cell(runs["adamw"]),
            f"{_cell(runs['default'])}, {_growth(runs['default'])}", f"{result['default_over_adamw']:.3f}",
            "yes" if result["default_passes"] else "no"]


def _others_row(result: dict[str, Any]) -> list[str]:
    runs = result["runs"]
    return [result["task"], f"{_cell(runs['former'])}, {_growth(runs['former'])}", _cell(runs["auto"]),
            f"{_cell(runs['searched'])} at {runs['searched']['lr']:g}"]


def _tables(results: list[dict[str, Any]], steps: int) -> list[dict]:
    """Two tables narrow enough for a book page: the rule (the default beside AdamW) and the other rates."""
    held = (f"held-out loss (accuracy): mean per-target cross-entropy on 256 test samples (accuracy over their "
            f"counted targets) after {steps} updates of 32 samples")
    norm = "xN: the trainable parameters' norm after training over before"
    return [
        harness.table(
            f"The rule, stated first: IEF()'s held-out loss at most {100 * WITHIN:.0f} % above AdamW's (lr "
            f"{ADAMW_LR:g}) after the same {steps} updates of 32 samples, and never x{NORM_GROWTH:g} trainable norm "
            f"while the loss stays within 5 % of its start",
            [("task", "s"), ("role", "s"), ("AdamW", "s"), ("IEF() default, norm", "s"), ("default / AdamW", "s"),
             ("rule met", "s")], [_rule_row(r) for r in results],
            note=f"{held}; {norm}; role: tuning (the default was chosen on it) or held out (checked only)."),
        harness.table(
            "The other rates on the same batches: the sum convention's former default (lr 1, damping 1e-4), "
            'lr="auto" and the best of a rate search',
            [("task", "s"), ("former default (lr 1), norm", "s"), ('lr="auto"', "s"), ("searched, at lr", "s")],
            [_others_row(r) for r in results],
            note=f"{held}; {norm}; searched: the best validation loss over lr in {list(GRID)} (sum convention), "
                 "reported on the test samples."),
    ]


def run_task(task: Task, steps: int) -> dict[str, Any]:
    """Every run of one task and its verdict (the record's entry)."""
    runs = {method: train(task, method, steps) for method in ("adamw", "default", "former", "auto")}
    grid = {lr: train(task, "lr", steps, lr) for lr in GRID}
    runs["searched"] = grid[min(GRID, key=lambda lr: grid[lr]["validation_loss"])]
    for method, run in runs.items():
        print(f"{task.name:22s} {method:9s} {_cell(run):>16s} norm x{run['norm_growth']:9.3g} "
              f"{run['seconds']:6.1f}s {'; '.join(run['warnings'])}", flush=True)
    return dict(task=task.name, kind=task.kind, tuning=task.tuning, note=task.note, runs=runs,
                search=[dict(lr=lr, validation_loss=grid[lr]["validation_loss"], test_loss=grid[lr]["test_loss"])
                        for lr in GRID],
                default_over_adamw=runs["default"]["test_loss"] / runs["adamw"]["test_loss"],
                default_passes=passes(runs["default"], runs["adamw"]))


def main(argv=None) -> None:
    started = time.perf_counter()
    p = argparse.ArgumentParser(prog="python -m benchmarks.defaults", description=__doc__.splitlines()[0])
    harness.add_common_arguments(p, repeats=1, warmup=0, device=False)
    everything = tasks()
    p.add_argument("--tasks", default=",".join(everything), help=f"comma-separated subset of {','.join(everything)}")
    p.add_argument("--steps", type=int, default=200, help="updates per run (default 200)")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="instead of running: join the tasks of these records (runs of disjoint --tasks, same --steps, "
                        "e.g. two processes side by side) into one record")
    p.add_argument("--retable", default=None, metavar="JSON",
                   help="instead of running: rewrite this record's tables from its results (the tables' layout "
                        "changed; nothing is measured again, the record's command and date are kept)")
    args = p.parse_args(argv)
    if args.retable:
        import json

        doc = json.loads(open(args.retable).read())
        doc["tables"] = _tables(doc["results"]["tasks"], doc["args"]["steps"])
        print(f"wrote {harness.write_json(args.retable, doc)}")
        return
    harness.check_common(p, args)
    chosen = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not chosen or any(t not in everything for t in chosen):
        p.error(f"--tasks: {args.tasks!r}; choose from {', '.join(everything)}")
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    if args.merge:
        import json

        parts = [json.loads(open(path).read()) for path in args.merge]
        if len({part["args"]["steps"] for part in parts}) != 1:
            p.error("--merge: the records differ in --steps")
        results = [r for part in parts for r in part["results"]["tasks"]]
        order = list(everything)
        results.sort(key=lambda r: order.index(r["task"]))
        steps = parts[0]["args"]["steps"]
        doc = dict(parts[0], results=dict(tasks=results, merged=[dict(command=part["command"], date=part["date"],
                                                                        other_load_cores=part["other_load_cores"],
                                                                        seconds=part["seconds"]) for part in parts]),
                   tables=_tables(results, steps), seconds=sum(part["seconds"] or 0 for part in parts),
                   other_load_cores=max(part["other_load_cores"] or 0 for part in parts),
                   command=" & ".join(part["command"] for part in parts) + " ; "
                   + harness.command_line("benchmarks.defaults", argv))
        harness.finish(doc, args.json)
        return
    results = []
    with harness.OtherLoad() as load:
        for name in chosen:
            results.append(run_task(everything[name], args.steps))
    doc = harness.record("defaults", argv, "cpu", args, load, dict(tasks=results), _tables(results, args.steps),
                         started)
    harness.finish(doc, args.json)


if __name__ == "__main__":
    main()
