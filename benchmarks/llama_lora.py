"""iEF against AdamW on a Llama-style decoder with LoRA, in bfloat16 autocast and in float32.

Run from the repository root::

    python -m benchmarks.llama_lora --device cuda --json benchmarks/results/llama-lora-h100.json   # the 100M case
    OMP_NUM_THREADS=1 python -m benchmarks.llama_lora --size tiny                                  # CPU, seconds

Model: ``transformers.LlamaForCausalLM`` from a ``LlamaConfig`` with random weights (no hub), peft LoRA r 16 on
``q_proj`` / ``v_proj`` (``lora_B`` drawn, so that the point is generic), ``model.train()`` (no dropout in Llama), one
fixed batch of ``M`` token sequences reused for every call, causal-LM targets (``ief.causal_lm_targets``).

- ``--size 100m``: hidden 768, 12 layers, 12 heads, intermediate 2048, vocab 32000 (~106M parameters, 0.6M trainable),
  ``M 16``, ``T 256``: the issue's GPU case; goal iEF bf16 <= 1.2x AdamW bf16 in time, <= 1.1x in peak memory.
- ``--size tiny``: hidden 32, 2 layers, 4 heads, intermediate 64, vocab 128, ``M 4``, ``T 16`` (tested on CPU).

Operations (each on the same batch and parameters, restored outside the timed region):

- ``AdamW step``: forward + ``L.backward()`` (``L = sum_n l_n``) + ``AdamW.step()`` + ``zero_grad``, float32.
- ``AdamW step (bf16 autocast)``: the same under ``torch.autocast(device, torch.bfloat16)``, what users compare with.
- ``iEF step``: ``ief.optim.IEF(model).step(inputs, targets)`` (defaults: ``form="auto"``), float32; vs AdamW step.
- ``iEF step (bf16 autocast)``: the same under bfloat16 autocast; vs AdamW step (bf16 autocast).

Each optimiser takes its first step (with the exact per-sample check) in the warm-up round. Timing: the round-robin of
``benchmarks.harness`` (median of within-round ratios); ``peak MiB``: the peak tensor memory one call adds above what
is resident before it (model, optimiser state); ``resident MiB`` (CUDA): what is allocated before the call.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

import ief
from benchmarks import harness
from benchmarks.workloads import logits_of, summed_cross_entropy

SIZES = {
    "100m": dict(config=dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12,
                             intermediate_size=2048, vocab_size=32000, max_position_embeddings=512), m=16, t=256),
    "tiny": dict(config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                             intermediate_size=64, vocab_size=128, max_position_embeddings=64), m=4, t=16),
}
LORA_RANK = 16


def build(size: str, device: torch.device, seed: int):
    """``(peft model, inputs, targets)`` of one size, float32 weights on ``device``."""
    import peft
    import transformers

    transformers.logging.set_verbosity_error()
    spec = SIZES[size]
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**spec["config"], pad_token_id=0, attn_implementation="sdpa")
    model = peft.get_peft_model(transformers.LlamaForCausalLM(config),
                                peft.LoraConfig(r=LORA_RANK, lora_alpha=32, target_modules=["q_proj", "v_proj"],
                                                lora_dropout=0.0)).to(device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    model.train()
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(1, config.vocab_size, (spec["m"], spec["t"]), generator=gen)
    inputs = {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device)}
    return model, inputs, ief.causal_lm_targets(ids).to(device)


def make_ops(model, inputs, targets, device: torch.device):
    """``({key: call}, {key: reference}, {key: label}, reset)`` of the four steps."""
    params = [p for p in model.parameters() if p.requires_grad]
    snapshot = [p.detach().clone() for p in params]
    adamw, adamw_bf16 = torch.optim.AdamW(params, lr=1e-4), torch.optim.AdamW(params, lr=1e-4)
    ief32, ief16 = ief.optim.IEF(model), ief.optim.IEF(model)

    def bf16():
        return torch.autocast(device.type, torch.bfloat16)

    def adamw_step(opt):
        loss = summed_cross_entropy(logits_of(model, inputs).float(), targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    def autocast_adamw():
        with bf16():
            return adamw_step(adamw_bf16)

    def autocast_ief():
        with bf16():
            return ief16.step(inputs, targets)

    def reset() -> None:
        with torch.no_grad():
            for p, s in zip(params, snapshot):
                p.copy_(s)
        model.zero_grad(set_to_none=True)

    calls = {"adamw": lambda: adamw_step(adamw), "adamw_bf16": autocast_adamw,
             "ief": lambda: ief32.step(inputs, targets), "ief_bf16": autocast_ief}
    references = {"adamw": None, "adamw_bf16": None, "ief": "adamw", "ief_bf16": "adamw_bf16"}
    labels = {"adamw": "AdamW step", "adamw_bf16": "AdamW step (bf16 autocast)", "ief": "iEF step",
              "ief_bf16": "iEF step (bf16 autocast)"}
    return calls, references, labels, reset


def measure(size: str, device: torch.device, repeats: int, warmup: int, seed: int) -> dict:
    """Time and peak memory of the four steps on one model (see the module docstring)."""
    model, inputs, targets = build(size, device, seed)
    calls, references, labels, reset = make_ops(model, inputs, targets, device)
    times = harness.round_robin(calls, repeats, max(1, warmup), before_each=reset, device=device)
    rows = harness.rows(times, references, labels)
    for row in rows:
        reset()
        if device.type == "cuda":
            row["resident_mib"] = torch.cuda.memory_allocated(device) / harness.MIB
        row["peak_mib"] = harness.peak_memory_mib(calls[row["key"]], device)
    reset()
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return dict(size=size, params=params, trainable_params=trainable, m=int(targets.shape[0]),
                t=int(targets.shape[1]), rows=rows)


def table(result: dict, device: torch.device) -> dict:
    """The summary table: each step's median, its ratio to its AdamW reference, its peak memory."""
    by_key = {r["key"]: r for r in result["rows"]}
    columns = [("step", "s"), ("median ms", ".2f"), ("ratio", ".2f"), ("vs", "s"), ("peak MiB", ".1f")]
    if device.type == "cuda":
        columns.append(("resident MiB", ".1f"))
    body = []
    for key in ("adamw", "adamw_bf16", "ief", "ief_bf16"):
        r = by_key[key]
        cells = [r["label"], r["median_ms"], 1.0 if r["reference"] is None else r["ratio"],
                 "-" if r["reference"] is None else by_key[r["reference"]]["label"], r.get("peak_mib")]
        if device.type == "cuda":
            cells.append(r.get("resident_mib"))
        body.append(cells)
    title = (f"Llama-LoRA ({result['size']}: {result['params']:,} parameters, {result['trainable_params']:,} "
             f"trainable, M {result['m']}, T {result['t']}): one step, iEF against AdamW")
    return harness.table(title, columns, body)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.llama_lora", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_common_arguments(p, repeats=9, warmup=1)
    p.add_argument("--size", choices=tuple(SIZES), default="100m", help="the model and batch (module docstring)")
    args = p.parse_args(argv)
    args._device = harness.check_common(p, args)
    return args


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    args = parse_args(argv)
    device = args._device
    print(f"## Llama-LoRA step benchmark\n\n- {harness.machine_line(harness.machine(device))}\n- size {args.size}; "
          f"{args.warmup} warm-up + {args.repeats} timed rounds (round-robin, rotated)", flush=True)
    with harness.OtherLoad() as load:
        result = measure(args.size, device, args.repeats, args.warmup, args.seed)
    summary = table(result, device)
    head = [c["header"] for c in summary["columns"]]
    print("\n| " + " | ".join(head) + " |\n|" + "|".join(["---"] * len(head)) + "|")
    for row in summary["rows"]:
        print("| " + " | ".join("n/a" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v)
                                for v in row) + " |")
    doc = harness.record("llama_lora", argv, device, args, load, result, [summary], started)
    harness.finish(doc, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
