"""The slow paths: per-sample J on the models people fine-tune today, against a plain backward.

Run from the repository root::

    OMP_NUM_THREADS=1 python -m benchmarks slow_paths                 # every case, one thread, CPU
    python -m benchmarks slow_paths --cases dora-m16 t5 --repeats 3 --json out.json

The work on the models people fine-tune today measured ``ief.per_sample`` over a plain backward
on these models and set the goal: at ``M = 16``, at most 2x a backward and no ``SlowPathWarning``. Cases (one
process, round-robin, ``benchmarks.harness``), every model from a small config with random weights (``transformers``
and ``peft``, no download; hidden 128, 2 layers, 4 heads, intermediate 512, vocabulary 1000, ``T = 32`` tokens,
float32, eval mode, dropout off):

- ``lora-m4/16/32``, ``dora-m4/16/32``: ``BertForSequenceClassification`` with peft LoRA, and LoRA with
  ``use_dora=True`` (DoRA), rank 8 on query / value, the classifier trainable (``task_type="SEQ_CLS"``);
- ``ia3``, ``adalora``, ``loha``, ``lokr``, ``vera``, ``lora-embedding``, ``p-tuning``: the same BERT with peft's
  other adapters (IA3 on key / value / output.dense with output.dense as the feedforward module; AdaLoRA, LoHa and
  LoKr at rank 8 on query / value; VeRA rank 8 on query / value; LoRA rank 8 on the word embeddings and query /
  value; p-tuning with 20 virtual tokens and an MLP prompt encoder, measured now after ``ief.per_sample_prompts``
  as the ``SlowPathWarning`` advises, which took prompt tuning only before the adapters' rules);
- ``llama``, ``mistral``, ``qwen2``, ``qwen2-tied``: full fine-tuning of ``*ForCausalLM`` (grouped-query attention,
  2 key/value heads; Qwen2 also with tied embeddings), next-token targets;
- ``gpt2-tied``, ``gpt2-untied``: full fine-tuning of ``GPT2LMHeadModel``, its head tied to the token table or not;
- ``roberta``: full fine-tuning of ``RobertaForSequenceClassification``; ``t5``: of ``T5ForConditionalGeneration``
  (tied table and head, ``T = 32`` input and label tokens, relative attention biases).

Per case: ``backward`` (forward, ``L = sum_n l_n``, backward: the reference of every ratio), ``ief.per_sample``
before the adapters' rules (``--before``, loaded from git as the package ``ief_before``, dense as the issue measured it)
and now, with ``form="auto"`` (the optimisers' form) and dense. Before timing, the forms' ``J`` are compared with
the dense one now (largest relative difference, a sanity check: the tests compare them with the float64 oracle) and
the parameter tensors that take the per-sample loop are listed from each version's ``SlowPathWarning`` (a fresh copy
of the model: the warning is given once per model). The last column is the measurement that set the goal (another run,
not side by side: context only).
"""
from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
import warnings

import torch

import ief
from benchmarks import harness
from benchmarks.hf_layers import load_before, looped

BEFORE_REV = "91cdaef"  # the last commit before the adapters' rules (peft adapters, DoRA, T5's biases)
VOCAB, HIDDEN, LAYERS, HEADS, INTERMEDIATE = 1000, 128, 2, 4, 512
ADAPTERS = ("lora", "dora", "ia3", "adalora", "loha", "lokr", "vera", "lora-embedding", "p-tuning")
FULL = ("llama", "mistral", "qwen2", "qwen2-tied", "gpt2-tied", "gpt2-untied", "roberta", "t5")
# case -> (model, M); the DoRA and LoRA rows also at M = 4 and 32
CASES = {f"{a}-m{m}": (a, m) for a in ("lora", "dora") for m in (4, 16, 32)}
CASES.update({a: (a, 16) for a in ADAPTERS[2:]})
CASES.update({f: (f, 16) for f in FULL})
# the measurements that set the goal (per-sample J / backward; another run, for context)
ISSUE = {
    "dora-m4": "x6.6", "dora-m16": "x12.7", "dora-m32": "x21.4", "lora-m4": "x1.5", "lora-m16": "x1.8",
    "lora-m32": "x2.0", **{a: "x3.4-x5.6 (M = 4)" for a in ADAPTERS[2:]}, "llama": "x5.1", "mistral": "x5.1",
    "qwen2": "x5.1", "qwen2-tied": "x9.1", "gpt2-tied": "x6.95", "gpt2-untied": "x2.34", "roberta": "x6.3",
    "t5": "x4.0",
}
LABELS = {"backward": "plain backward", "ief_before": "`ief.per_sample` before, dense",
          "ief_auto": "`ief.per_sample`, `form=\"auto\"`", "ief_dense": "`ief.per_sample`, dense"}


def _adapter_config(peft, kind: str):
    """The peft config of an adapter case (see the module docstring)."""
    qv = ["query", "value"]
    if kind in ("lora", "dora"):
        return peft.LoraConfig(task_type="SEQ_CLS", r=8, lora_alpha=16, target_modules=qv, use_dora=kind == "dora")
    if kind == "ia3":
        return peft.IA3Config(task_type="SEQ_CLS", target_modules=["key", "value", "output.dense"],
                              feedforward_modules=["output.dense"])
    if kind == "adalora":
        return peft.AdaLoraConfig(task_type="SEQ_CLS", init_r=8, target_r=4, total_step=100, target_modules=qv)
    if kind == "loha":
        return peft.LoHaConfig(task_type="SEQ_CLS", r=8, alpha=16, target_modules=qv)
    if kind == "lokr":
        return peft.LoKrConfig(task_type="SEQ_CLS", r=8, alpha=16, target_modules=qv)
    if kind == "vera":
        return peft.VeraConfig(task_type="SEQ_CLS", r=8, target_modules=qv)
    if kind == "lora-embedding":
        return peft.LoraConfig(task_type="SEQ_CLS", r=8, lora_alpha=16, target_modules=["word_embeddings", *qv])
    if kind == "p-tuning":
        return peft.PromptEncoderConfig(task_type="SEQ_CLS", num_virtual_tokens=20, encoder_hidden_size=HIDDEN)
    raise ValueError(f"unknown adapter {kind!r}")


def _lm_batch(m: int, t: int, gen: torch.Generator) -> tuple[dict, torch.Tensor]:
    ids = torch.randint(5, VOCAB, (m, t + 1), generator=gen)
    targets = ids[:, 1:].clone()
    targets[:, -1] = ief.IGNORE_INDEX
    return {"input_ids": ids[:, :-1], "attention_mask": torch.ones(m, t, dtype=torch.long)}, targets


def build(kind: str, m: int, t: int, seed: int) -> tuple[torch.nn.Module, dict, torch.Tensor]:
    """``(model, inputs, targets)`` of one model (see the module docstring), float32, eval mode; adapter weights
    moved off their initial zeros so that their gradients are generic."""
    import transformers as tf

    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    bert = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                intermediate_size=INTERMEDIATE, max_position_embeddings=64, num_labels=2)
    decoder = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                   num_key_value_heads=2, intermediate_size=INTERMEDIATE, max_position_embeddings=64)
    if kind in ADAPTERS:
        import peft

        model = peft.get_peft_model(tf.BertForSequenceClassification(tf.BertConfig(**bert)),
                                    _adapter_config(peft, kind))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.requires_grad and ("lora_B" in name or "lora_embedding_B" in name or "vera_lambda" in name
                                        or "hada_w2" in name or "lokr_w2" in name):
                    p.normal_(0, 0.02)
        ids = torch.randint(5, VOCAB, (m, t), generator=gen)
        x = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        return model.eval(), x, torch.randint(0, 2, (m,), generator=gen)
    if kind in ("llama", "mistral", "qwen2", "qwen2-tied"):
        cls = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen2-tied": "Qwen2"}[kind]
        config = getattr(tf, f"{cls}Config")(tie_word_embeddings=kind == "qwen2-tied", **decoder)
        model = getattr(tf, f"{cls}ForCausalLM")(config)
        return (model.eval(), *_lm_batch(m, t, gen))
    if kind in ("gpt2-tied", "gpt2-untied"):
        config = tf.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                               n_inner=INTERMEDIATE, tie_word_embeddings=kind == "gpt2-tied")
        return (tf.GPT2LMHeadModel(config).eval(), *_lm_batch(m, t, gen))
    if kind == "roberta":
        model = tf.RobertaForSequenceClassification(tf.RobertaConfig(**{**bert, "max_position_embeddings": 66},
                                                                     pad_token_id=1))
        ids = torch.randint(5, VOCAB, (m, t), generator=gen)
        return model.eval(), {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, torch.randint(
            0, 2, (m,), generator=gen)
    if kind == "t5":
        config = tf.T5Config(vocab_size=VOCAB, d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=INTERMEDIATE,
                             num_layers=LAYERS, num_heads=HEADS, decoder_start_token_id=0, pad_token_id=0)
        model = tf.T5ForConditionalGeneration(config)
        ids = torch.randint(5, VOCAB, (m, t), generator=gen)
        labels = torch.randint(5, VOCAB, (m, t), generator=gen)
        x = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
             "decoder_input_ids": torch.cat([torch.zeros(m, 1, dtype=torch.long), labels[:, :-1]], dim=1)}
        return model.eval(), x, labels
    raise ValueError(f"unknown model {kind!r}")


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum",
                                             ignore_index=ief.IGNORE_INDEX)


def methods(model, x: dict, y: torch.Tensor, before, now: torch.nn.Module | None = None) -> dict:
    """``{key: callable}``: the backward, per-sample J before (dense) and now in both forms (on ``now``: the model
    as the current package is given it, e.g. patched by ``ief.per_sample_prompts``; default ``model``)."""
    now = model if now is None else now
    params = [p for p in model.parameters() if p.requires_grad]

    def backward():
        model.zero_grad(set_to_none=True)
        _loss(model(**x).logits, y).backward()
        return [p.grad for p in params]

    cases = {"backward": backward}
    if before is not None:
        cases["ief_before"] = lambda: before.per_sample(model, x, y).jacobian
    return {**cases,
            "ief_auto": lambda: ief.per_sample(now, x, y, form="auto").jacobian,
            "ief_dense": lambda: ief.per_sample(now, x, y).jacobian}


def _dense(jac) -> torch.Tensor:
    return (jac.materialize() if hasattr(jac, "materialize") else jac).detach()


def run_case(case: str, args, before, device) -> dict:
    kind, m = CASES[case]
    model, x, y = build(kind, m, args.tokens, args.seed)
    tensors = sum(1 for p in model.parameters() if p.requires_grad)
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    now = ief.per_sample_prompts(copy.deepcopy(model)) if kind == "p-tuning" else model
    cases = methods(model, x, y, before, now)
    loops = {"ief": looped(lambda: ief.per_sample(copy.deepcopy(now), x, y, form="auto"))}
    if before is not None:
        loops["ief_before"] = looped(lambda: before.per_sample(copy.deepcopy(model), x, y))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dense = _dense(cases["ief_dense"]())
        diff = {k: float((_dense(cases[k]()) - dense).norm() / dense.norm()) for k in ("ief_before", "ief_auto")
                if k in cases}
    print(f"\n{case}: {tensors} tensors, P = {n_params:,}, M = {m}, T = {args.tokens}"
          + "".join(f"; {k} loops {len(v)}: {', '.join(v) if v else '-'}" for k, v in loops.items())
          + "; relative |J - J_dense|: " + ", ".join(f"{k} {v:.1e}" for k, v in diff.items()), flush=True)
    with harness.OtherLoad() as load, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        times = harness.round_robin(cases, args.repeats, args.warmup, device=device)
    rows = harness.rows(times, {k: None if k == "backward" else "backward" for k in cases}, LABELS)
    for r in rows:
        print(f"  {r['label']:<36} {r['median_ms']:>9.2f} ms  IQR {r['iqr_ms']:>7.2f}  {(r['ratio'] or 1.0):>6.2f}x")
    return dict(case=case, model=kind, batch=m, tensors=tensors, params=n_params, loops=loops, rows=rows,
                relative_diff_vs_dense=diff, other_load_cores=load.cores)


def _looped(res: dict, key: str) -> str | None:
    """``"k of n"`` and the kinds of the looped tensors (their names' last part that is not ``weight``, ``bias``,
    ``default`` or a number: ``lora_A``, ``relative_attention_bias``), ``None`` if that version did not run."""
    names = res["loops"].get(key)
    if names is None:
        return None
    kinds = dict.fromkeys(next((part for part in reversed(n.split(".")) if part not in ("weight", "bias", "default")
                                and not part.isdigit()), n) for n in names)
    return f"{len(names)} of {res['tensors']}" + (f" ({', '.join(kinds)})" if names else "")


def tables(results: list[dict], tokens: int, before: str) -> list[dict]:
    """One table: per case, the tensors looped before and now, the ratios to a backward before and now (both forms),
    the goal's figure."""
    columns = [("case", "s"), ("M", "d"), ("looped before", "s"), ("looped now", "s"), ("backward ms", ".1f"),
               ("before (dense) / backward", ".2f"), ("now `form=\"auto\"` / backward", ".2f"),
               ("now dense / backward", ".2f"), ("the goal's figure", "s")]
    body = []
    for res in results:
        by = {r["key"]: r for r in res["rows"]}
        body.append([res["case"], res["batch"], _looped(res, "ief_before"), _looped(res, "ief"),
                     by["backward"]["median_ms"], by.get("ief_before", {}).get("ratio"), by["ief_auto"]["ratio"],
                     by["ief_dense"]["ratio"], ISSUE.get(res["case"])])
    return [harness.table(
        f"Slow paths (hidden 128, 2 layers, T = {tokens}): per-sample J against a plain backward",
        columns, body,
        note=f"Ratios: medians of within-round ratios, one process, each case's calls round-robin; 'before' is `ief` "
             f"at {before} (before the adapters' rules). Goal: at M = 16, at most 2x a backward and no tensor looped "
             "(looped tensors: the SlowPathWarning's, by kind; their names in the JSON). \"the goal's "
             "figure\": the measurement that set the goal (another run; context, not side by side).")]


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    p = argparse.ArgumentParser(prog="python -m benchmarks.slow_paths", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_common_arguments(p, repeats=7, warmup=1, device=False)
    p.add_argument("--tokens", type=int, default=32, help="T (default 32)")
    p.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    p.add_argument("--before", default=BEFORE_REV, help=f"git revision of the 'before' package (default {BEFORE_REV})")
    args = p.parse_args(argv)
    device = harness.check_common(p, args)
    if args.tokens < 2:
        p.error(f"--tokens must be >= 2, got {args.tokens}")
    print(harness.machine_line(harness.machine(device)), flush=True)
    with tempfile.TemporaryDirectory() as folder, harness.OtherLoad() as load:
        before = load_before(args.before, folder)
        if before is None:
            print(f"git archive {args.before} failed: no 'before' cases", flush=True)
        results = [run_case(case, args, before, device) for case in args.cases]
    doc = harness.record("slow_paths", argv, device, args, load, dict(cases=results),
                         tables(results, args.tokens, args.before), started)
    harness.finish(doc, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
