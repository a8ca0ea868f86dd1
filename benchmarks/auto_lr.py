"""iEF's step size: the default rate, ``lr="auto"`` and a searched rate, trained side by side.

Run from the repository root (single-threaded)::

    OMP_NUM_THREADS=1 python -m benchmarks auto_lr --json benchmarks/results/auto_lr-cpu.json
    OMP_NUM_THREADS=1 python -m benchmarks auto_lr --cases digits-mlp,digits-cnn --steps 40

Every case trains ``ief.optim.IEF`` (sum convention, the case's damping) from the same initial model on the same
batches with each rate: ``default`` (``lr=None``: 1), ``auto`` (:mod:`ief.optim.auto_lr`) and ``searched``, and
reports the final training loss (the mean per-target loss of the last 10 % of the updates, the companion's
definition) and the test accuracy of the final parameters; a run that raises (a non-finite step) is ``diverged``.
Cases:

- ``digits-mlp``, ``tweets-minilm-lora``: the companion's cpu setups (``companion/experiments/setups.py``: data,
  model, batch size and iEF damping; batches in :func:`companion.experiments.runner.epoch_order`'s order; the
  searched rate is the setup's, from ``companion/experiments/lr_search``), the setup's epochs (20 and 2) unless
  ``--epochs`` says fewer;
- ``digits-cnn``: :class:`DigitsCNN` (two 3x3 convolutions, 8 and 16 channels, then a linear head: 3,818
  parameters) on the digits-mlp data and batches;
- ``gpt2-lora``: a GPT-2 from a small config (2 layers, width 64, vocabulary 32, random weights) with LoRA r=4 on
  ``c_attn`` and ``c_fc`` (peft; B drawn from N(0, 0.1^2), not 0, as after some training), ``--steps`` batches of 16
  sequences of 16 tokens of a fixed random Markov chain (each token has two likely successors); accuracy =
  next-token accuracy on 256 held-out sequences.

For the last two no search exists: ``searched`` is the best validation accuracy over lr in {0.1, 0.3, 1, 3} (the
companion's criterion), run in the same way. Not part of pass/fail.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import torch

import ief
from benchmarks import harness

CASES = ("digits-mlp", "tweets-minilm-lora", "digits-cnn", "gpt2-lora")
GRID = (0.1, 0.3, 1.0, 3.0)  # the search of the cases without a companion search


@dataclasses.dataclass
class Case:
    """A training problem: ``build()`` makes the initial model (the same each call), ``batches`` the training
    batches in order, ``score(model, split)`` the accuracy on ``"validation"`` or ``"test"``."""

    name: str
    build: Callable[[], torch.nn.Module]
    batches: list[tuple[Any, torch.Tensor]]
    score: Callable[[torch.nn.Module, str], float]
    damping: float
    searched: float | None  # the companion's searched rate (None: search GRID here)
    note: str


def _companion(setup: str, epochs: int | None, seed: int, model_of: Callable | None = None) -> Case:
    from companion.experiments.data import load_data
    from companion.experiments.models import build_model
    from companion.experiments.runner import epoch_order, evaluate, seed_everything
    from companion.experiments.setups import optimizer_config, resolve
    from companion.experiments.tasks import make_task

    cfg = resolve(setup, "cpu")
    data = load_data(cfg)
    epochs = cfg.epochs if epochs is None else epochs

    def build() -> torch.nn.Module:
        seed_everything(seed)
        model, pre = build_model(cfg, data)
        return (model if model_of is None else model_of(model)).train()

    seed_everything(seed)
    task = make_task(cfg, *build_model(cfg, data))
    n, bs = len(data.train), cfg.batch_size
    batches = []
    for epoch in range(epochs):
        order = epoch_order(seed, epoch, n)
        for b in range(math.ceil(n / bs)):
            batches.append(task.collate([data.train[int(i)] for i in order[b * bs:(b + 1) * bs]]))

    def score(model: torch.nn.Module, split: str) -> float:
        sets = data.validation if split == "validation" else data.test
        out = evaluate(model, task, sets, torch.device("cpu"), cfg.eval_batch_size)
        first = next(iter(out.values()))
        return float((first["pred"] == first["gold"]).float().mean())

    ocfg = optimizer_config(cfg, "ief")
    return Case(setup, build, batches, score, ocfg.damping, ocfg.lr if model_of is None else None,
                f"companion cpu setup, {epochs} epoch(s) of {cfg.epochs}, batch {bs}")


class DigitsCNN(torch.nn.Module):
    """Conv(1->8, 3x3, pad 1), ReLU, Conv(8->16, 3x3, stride 2, pad 1), ReLU, Linear(16*4*4 -> 10) on the 8x8
    digits (the digits-mlp inputs, flattened 64 pixels, viewed as one channel)."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.head = torch.nn.Linear(16 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv1(x.reshape(-1, 1, 8, 8)))
        return self.head(torch.relu(self.conv2(h)).flatten(1))


def _markov(n: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    """``n`` sequences of a fixed random Markov chain (each token has two likely successors)."""
    g = torch.Generator().manual_seed(1234)
    logits = torch.full((vocab, vocab), -2.0)
    for a in range(vocab):
        logits[a, torch.randperm(vocab, generator=g)[:2]] = 2.0
    probs = torch.softmax(logits, -1)
    g.manual_seed(seed)
    seq = torch.empty(n, length, dtype=torch.long)
    seq[:, 0] = torch.randint(0, vocab, (n,), generator=g)
    for t in range(1, length):
        seq[:, t] = torch.multinomial(probs[seq[:, t - 1]], 1, generator=g).squeeze(1)
    return seq


def _gpt2_lora(steps: int, seed: int) -> Case:
    import peft
    import transformers

    vocab, length, batch = 32, 16, 16
    train, val, test = _markov(batch * steps, length, vocab, 1), _markov(256, length, vocab, 2), \
        _markov(256, length, vocab, 3)

    def build() -> torch.nn.Module:
        torch.manual_seed(seed)
        base = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=vocab, n_positions=length, n_embd=64, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0))
        cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"],
                              fan_in_fan_out=True, lora_dropout=0.0)
        model = peft.get_peft_model(base, cfg)
        with torch.no_grad():  # LoRA's B starts at 0: give it a generic start, as after some training
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.1)
        return model.train()

    def pair(seq: torch.Tensor) -> tuple[dict, torch.Tensor]:
        return {"input_ids": seq}, ief.causal_lm_targets(seq)

    batches = [pair(train[i * batch:(i + 1) * batch]) for i in range(steps)]

    @torch.no_grad()
    def score(model: torch.nn.Module, split: str) -> float:
        seq = val if split == "validation" else test
        pred = model(input_ids=seq).logits[:, :-1].argmax(-1)
        return float((pred == seq[:, 1:]).float().mean())

    return Case("gpt2-lora", build, batches, score, 1e-4, None,
                f"GPT-2 (2 layers, width 64, vocab 32) + LoRA r=4 on c_attn and c_fc, {steps} batches of {batch} x "
                f"{length} tokens")


def _train(case: Case, lr: Any) -> dict[str, Any]:
    model = case.build()
    opt = ief.optim.IEF(model, lr=lr, damping=case.damping)
    losses, rates, started = [], [], time.perf_counter()
    diverged = None
    for step, (inputs, targets) in enumerate(case.batches):
        try:
            total = float(opt.step(inputs, targets))
        except FloatingPointError as err:
            diverged = {"step": step, "reason": str(err)[:200]}
            break
        losses.append(total / ief.count_targets(targets))
        rates.append(opt.last_lr)
    tail = losses[-max(1, len(case.batches) // 10):]
    final = math.inf if diverged is not None or not losses else sum(tail) / len(tail)
    out = dict(lr=lr, steps=len(losses), diverged=diverged, final_train_loss=final,
               first_loss=losses[0] if losses else None, seconds=time.perf_counter() - started,
               rate_first=rates[0] if rates else None, rate_last=rates[-1] if rates else None,
               rate_min=min(rates) if rates else None, rate_max=max(rates) if rates else None)
    if diverged is None and math.isfinite(final):
        out["validation_accuracy"] = case.score(model, "validation")
        out["test_accuracy"] = case.score(model, "test")
    else:
        out["validation_accuracy"] = out["test_accuracy"] = None
    return out


def _case(name: str, args: argparse.Namespace) -> Case:
    if name == "digits-mlp":
        return _companion("digits-mlp", args.epochs, args.seed)
    if name == "tweets-minilm-lora":
        return _companion("tweets-minilm-lora", args.epochs, args.seed)
    if name == "digits-cnn":
        case = _companion("digits-mlp", args.epochs, args.seed, model_of=lambda _: DigitsCNN())
        return dataclasses.replace(case, name="digits-cnn", damping=1e-4,
                                   note=f"DigitsCNN on the digits-mlp data, {case.note.split(', ', 1)[1]}")
    return _gpt2_lora(args.steps or 60, args.seed)


def main(argv=None) -> None:
    started = time.perf_counter()
    p = argparse.ArgumentParser(prog="python -m benchmarks.auto_lr", description=__doc__.splitlines()[0])
    harness.add_common_arguments(p, repeats=1, warmup=0, device=False)
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    p.add_argument("--epochs", type=int, default=None, help="epochs of the companion cases (default: the setup's)")
    p.add_argument("--steps", type=int, default=None, help="gpt2-lora's steps (default 60)")
    args = p.parse_args(argv)
    harness.check_common(p, args)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    if not cases or any(c not in CASES for c in cases):
        p.error(f"--cases: {args.cases!r}; choose from {', '.join(CASES)}")
    print(f"{'case':20s} {'rate':>9s} {'lr':>6s} {'final loss':>11s} {'test acc':>9s} {'auto lr range':>17s} "
          f"{'s':>6s}", flush=True)
    results, body = [], []
    with harness.OtherLoad() as load:
        for name in cases:
            case = _case(name, args)
            runs = {"default": _train(case, None), "auto": _train(case, "auto")}
            if case.searched is not None:
                runs["searched"] = _train(case, case.searched)
                search = None
            else:
                grid = {lr: (runs["default"] if lr == 1.0 else _train(case, lr)) for lr in GRID}
                best = max(GRID, key=lambda lr: grid[lr]["validation_accuracy"] or -1.0)
                runs["searched"] = grid[best]
                search = [dict(lr=lr, validation_accuracy=grid[lr]["validation_accuracy"],
                               final_train_loss=grid[lr]["final_train_loss"]) for lr in GRID]
            for label, r in runs.items():
                lr = r["lr"]
                shown = "1" if lr is None else ("auto" if lr == "auto" else f"{lr:g}")
                acc = r["test_accuracy"]
                span = f"{r['rate_min']:.3g}-{r['rate_max']:.3g}" if lr == "auto" and r["rate_min"] else ""
                print(f"{name:20s} {label:>9s} {shown:>6s} {r['final_train_loss']:11.4f} "
                      f"{'diverged' if acc is None else f'{acc:.3f}':>9s} {span:>17s} {r['seconds']:6.1f}",
                      flush=True)
                body.append([name, label, shown, r["final_train_loss"], acc, span])
            searched_loss = runs["searched"]["final_train_loss"]
            within = runs["auto"]["final_train_loss"] <= 1.1 * searched_loss and runs["auto"]["diverged"] is None
            results.append(dict(case=name, note=case.note, steps=len(case.batches), damping=case.damping,
                                runs=runs, search=search, auto_within_10_percent=within))
    table = harness.table(
        "iEF (sum convention) with the default rate, lr='auto' and a searched rate: same initial model and batches",
        [("case", "s"), ("rate", "s"), ("lr", "s"), ("final training loss", ".4f"), ("test accuracy", ".3f"),
         ("auto: rate range (sum conv.)", "s")], body,
        note="final training loss: mean per-target loss of the last 10 % of the updates; searched: the companion's "
             "lr search (digits-mlp, tweets-minilm-lora) or the best validation accuracy over lr in "
             f"{list(GRID)} (digits-cnn, gpt2-lora).")
    doc = harness.record("auto_lr", argv, "cpu", args, load, dict(cases=results), [table], started)
    harness.finish(doc, args.json)


if __name__ == "__main__":
    main()
