"""Full-parameter BERT, GPT-2 and ViT: ``ief.per_sample`` and an ``IEF`` step against a backward and an AdamW step.

Run from the repository root::

    OMP_NUM_THREADS=1 python -m benchmarks hf_layers                  # M = 16, T = 32, one thread, CPU
    python -m benchmarks hf_layers --models gpt2 --repeats 3 --json out.json

Models (``transformers``, random weights from configs, no download; hidden 128, 2 layers, 4 heads, intermediate 512,
dropout off (eval mode), float32), every parameter trainable:

- BERT: ``BertForSequenceClassification``, vocabulary 1000, ``T = 32`` tokens, 2 classes (41 tensors: its position
  embeddings are fed ``[1, T]`` ids shared by all samples);
- GPT-2: ``GPT2LMHeadModel``, vocabulary 1000, ``T = 32``, next-token targets (last position ignored); its token table
  ``wte`` is frozen, being tied to the LM head ("without the tied matrix": 27 tensors, HF ``Conv1D`` layers and the
  position table ``wpe`` fed ``[1, T]`` ids);
- ViT: ``ViTForImageClassification``, 24x24 images in 4x4 patches (``T = 37`` tokens with the class token), 10
  classes (40 tensors: ``cls_token`` expanded and ``position_embeddings`` added to every sample).

Cases, one process, round-robin (``benchmarks.harness``): ``backward`` (forward, ``L = sum_n l_n``, backward: the
reference of every ratio); ``ief.per_sample`` before these layers had hooks (``--before``, loaded from git as the
package ``ief_before``; its parameters with no hook take the loop of ``M`` backward passes) and now, both dense;
``ief.per_sample(form="auto")`` (the optimisers' form); ``torch.func`` ``vmap(grad)`` and BackPACK ``BatchGrad`` where
they run (the reason is recorded where not); one ``ief.optim.IEF`` step before and now, against one
``torch.optim.AdamW`` step (forward, backward, update). Before timing, each method's ``J`` is compared with ``ief``'s
current one (largest relative difference: a sanity check, not a test), and the tensors that take the loop are listed
from each version's ``SlowPathWarning``.
"""
from __future__ import annotations

import argparse
import copy
import importlib
import io
import subprocess
import sys
import tarfile
import tempfile
import time
import warnings
from pathlib import Path

import torch

import ief
from benchmarks import harness

ROOT = Path(__file__).resolve().parents[1]
BEFORE = "89adfa7"  # the last commit before the layer rules for HF Conv1D, position embeddings and broadcast tensors
MODELS = ("bert", "gpt2", "vit")
LABELS = {
    "backward": "plain backward",
    "ief_before": "`ief.per_sample` before (dense)",
    "ief": "`ief.per_sample` now (dense)",
    "ief_auto": "`ief.per_sample` now, `form=\"auto\"`",
    "vmap": "`torch.func` `vmap(grad)`",
    "backpack": "BackPACK `BatchGrad`",
    "adamw_step": "AdamW step",
    "ief_step_before": "`IEF` step before",
    "ief_step": "`IEF` step now",
}
PER_SAMPLE = ("ief_before", "ief", "ief_auto", "vmap", "backpack")
STEPS = ("ief_step_before", "ief_step")


def load_before(rev: str, folder: str) -> object | None:
    """The package ``ief`` as of git revision ``rev``, importable as ``ief_before`` (extracted into ``folder``);
    ``None`` if git cannot give it."""
    try:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "ief"], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(folder, filter="data")
    Path(folder, "ief").rename(Path(folder, "ief_before"))
    sys.path.insert(0, folder)
    return importlib.import_module("ief_before")


def build(name: str, m: int, t: int, seed: int) -> tuple[torch.nn.Module, dict, torch.Tensor]:
    """``(model, inputs, targets)`` of one model (see the module docstring), float32, eval mode."""
    import transformers as tf

    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    common = dict(num_hidden_layers=2, num_attention_heads=4, intermediate_size=512, hidden_size=128)
    if name == "bert":
        cfg = tf.BertConfig(vocab_size=1000, max_position_embeddings=64, num_labels=2, **common)
        model = tf.BertForSequenceClassification(cfg)
        ids = torch.randint(5, 1000, (m, t), generator=gen)
        return model.eval(), {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, torch.randint(0, 2, (m,),
                                                                                                       generator=gen)
    if name == "gpt2":
        cfg = tf.GPT2Config(vocab_size=1000, n_positions=64, n_embd=128, n_layer=2, n_head=4, n_inner=512,
                            bos_token_id=0, eos_token_id=0)
        model = tf.GPT2LMHeadModel(cfg)
        model.transformer.wte.weight.requires_grad_(False)  # tied to lm_head
        ids = torch.randint(5, 1000, (m, t + 1), generator=gen)
        targets = ids[:, 1:].clone()
        targets[:, -1] = ief.IGNORE_INDEX
        return model.eval(), {"input_ids": ids[:, :-1]}, targets
    if name == "vit":
        cfg = tf.ViTConfig(image_size=24, patch_size=4, num_channels=3, num_labels=10, **common)
        model = tf.ViTForImageClassification(cfg)
        pixels = torch.randn(m, 3, 24, 24, generator=gen)
        return model.eval(), {"pixel_values": pixels}, torch.randint(0, 10, (m,), generator=gen)
    raise ValueError(f"model must be one of {MODELS}, got {name!r}")


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum",
                                             ignore_index=ief.IGNORE_INDEX)


def methods(model, x: dict, y: torch.Tensor, before) -> tuple[dict, list[dict]]:
    """``{key: callable}`` and the skipped methods with their reasons."""
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    skipped = []

    def backward():
        model.zero_grad(set_to_none=True)
        _loss(model(**x).logits, y).backward()
        return torch.cat([p.grad.reshape(-1) for p in params.values()])

    cases = {"backward": backward}
    if before is not None:
        cases["ief_before"] = lambda: before.per_sample(model, x, y).jacobian
    cases["ief"] = lambda: ief.per_sample(model, x, y).jacobian
    cases["ief_auto"] = lambda: ief.per_sample(model, x, y, form="auto").jacobian  # factored: as the optimisers
    try:
        cases["vmap"] = _vmap(model, x, y, params)
        cases["vmap"]()
    except Exception as err:  # e.g. data-dependent control flow under vmap
        cases.pop("vmap")
        skipped.append(dict(method="vmap", reason=f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"))
    try:
        cases["backpack"] = _backpack(model, x, y)
        cases["backpack"]()
    except Exception as err:  # BackPACK supports only its own list of layers
        cases.pop("backpack", None)
        skipped.append(dict(method="backpack", reason=f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"))
    return cases, skipped


def _vmap(model, x: dict, y: torch.Tensor, params: dict):
    from torch.func import functional_call, grad, vmap

    def one_loss(p, xi, yi):
        out = functional_call(model, p, args=(), kwargs={k: v.unsqueeze(0) for k, v in xi.items()})
        return _loss(out.logits, yi.unsqueeze(0))

    per_sample_grad = vmap(grad(one_loss), in_dims=(None, 0, 0))

    def run():
        g = per_sample_grad({k: p.detach() for k, p in params.items()}, x, y)
        return torch.cat([g[k].reshape(y.shape[0], -1) for k in params], dim=1)

    return run


def _backpack(model, x: dict, y: torch.Tensor):
    from backpack import backpack, extend
    from backpack.extensions import BatchGrad

    bp_model = extend(copy.deepcopy(model), use_converter=True)
    bp_loss = extend(torch.nn.CrossEntropyLoss(reduction="sum"))
    bp_params = [p for p in bp_model.parameters() if p.requires_grad]

    def run():
        bp_model.zero_grad(set_to_none=True)
        out = bp_model(**x)
        logits = getattr(out, "logits", out)
        loss = bp_loss(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        with backpack(BatchGrad()):
            loss.backward()
        return torch.cat([p.grad_batch.reshape(y.shape[0], -1) for p in bp_params], dim=1)

    return run


def step_methods(model, x: dict, y: torch.Tensor, before) -> dict:
    """One optimiser step each, on its own copy of the model (the steps change the parameters)."""
    adam_model = copy.deepcopy(model)
    adam = torch.optim.AdamW([p for p in adam_model.parameters() if p.requires_grad], lr=1e-4)

    def adamw_step():
        adam.zero_grad(set_to_none=True)
        loss = _loss(adam_model(**x).logits, y)
        loss.backward()
        adam.step()
        return loss.detach()

    cases = {"adamw_step": adamw_step}
    for key, package in (("ief_step_before", before), ("ief_step", ief)):
        if package is not None:
            opt = package.optim.IEF(copy.deepcopy(model), lr=1e-4)
            cases[key] = lambda opt=opt: opt.step(x, y)
    return cases


def _dense(jac) -> torch.Tensor:
    return (jac.materialize() if isinstance(jac, ief.rows.FactoredJacobian) else jac).detach()


def looped(fn) -> list[str]:
    """The parameter names a call's ``SlowPathWarning`` lists (empty: none)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    for w in caught:
        if type(w.message).__name__ == "SlowPathWarning":
            text = str(w.message).split("): ", 1)[1].split(". Hooked layers")[0]
            return [name.strip() for part in text.split("; ") for name in part.split(" (")[0].split(",")]
    return []


def run_model(name: str, args, before, device) -> dict:
    model, x, y = build(name, args.batch, args.tokens, args.seed)
    tensors = sum(1 for p in model.parameters() if p.requires_grad)
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    cases, skipped = methods(model, x, y, before)
    if before is None:
        skipped.append(dict(method="ief_before", reason=f"git archive {args.before} failed"))
    # the loop's tensors, on fresh copies (a SlowPathWarning is given once per model)
    loops = {"ief": looped(lambda: ief.per_sample(copy.deepcopy(model), x, y))}
    if before is not None:
        loops["ief_before"] = looped(lambda: before.per_sample(copy.deepcopy(model), x, y))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = cases["ief"]().detach()
        check = {k: float((_dense(fn()) - reference).norm() / reference.norm())
                 for k, fn in cases.items() if k in PER_SAMPLE}
        cases.update(step_methods(model, x, y, before))
    t = next(iter(x.values())).shape[1] if name != "vit" else (24 // 4) ** 2 + 1
    print(f"\n{name}: {tensors} tensors, P = {n_params:,}, M = {args.batch}, T = {t}"
          + "".join(f"; {k} loops {len(v)}: {', '.join(v) if v else '-'}" for k, v in loops.items()), flush=True)
    print("relative |J - J_ief|: " + ", ".join(f"{k} {v:.1e}" for k, v in check.items()), flush=True)
    for s in skipped:
        print(f"skipped {s['method']}: {s['reason']}")
    with harness.OtherLoad() as load, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        times = harness.round_robin(cases, args.repeats, args.warmup, device=device)
    refs = {k: (None if k == "backward" else "adamw_step" if k in STEPS else "backward") for k in cases}
    rows = harness.rows(times, refs, LABELS)
    for r in rows:
        r["relative_diff_vs_ief"] = check.get(r["key"])
    print(f"{'method':<38} {'median ms':>10} {'IQR ms':>8} {'ratio':>8}  (steps vs AdamW, the rest vs backward)")
    for r in rows:
        print(f"{r['label']:<38} {r['median_ms']:>10.2f} {r['iqr_ms']:>8.2f} {(r['ratio'] or 1.0):>7.2f}x")
    return dict(model=name, tensors=tensors, params=n_params, loops=loops, rows=rows, skipped=skipped,
                relative_diff_vs_ief=check, other_load_cores=load.cores)


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    p = argparse.ArgumentParser(prog="python -m benchmarks.hf_layers", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_common_arguments(p, repeats=7, warmup=1, device=False)
    p.add_argument("--batch", type=int, default=16, help="M (default 16)")
    p.add_argument("--tokens", type=int, default=32, help="T of BERT and GPT-2 (default 32)")
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--before", default=BEFORE, help=f"git revision of the 'before' package (default {BEFORE})")
    args = p.parse_args(argv)
    device = harness.check_common(p, args)
    if args.batch < 2 or args.tokens < 2:
        p.error(f"--batch and --tokens must be >= 2, got {args.batch}, {args.tokens}")
    print(harness.machine_line(harness.machine(device)), flush=True)
    with tempfile.TemporaryDirectory() as folder, harness.OtherLoad() as load:
        before = load_before(args.before, folder)
        results = [run_model(name, args, before, device) for name in args.models]
    doc = harness.record("hf_layers", argv, device, args, load, dict(models=results),
                         tables(results, args.batch, args.tokens, args.before), started)
    harness.finish(doc, args.json)
    return 0


def tables(results: list[dict], batch: int, tokens: int, before: str) -> list[dict]:
    """The summary tables of :func:`run_model`'s ``results``: per-sample gradients against a backward, and one
    optimiser step against an AdamW step (two tables, so that each fits a page's width)."""
    shape = f"hidden 128, 2 layers, M = {batch}, T = {tokens}"
    ratios = [{r["key"]: r["ratio"] for r in res["rows"]} for res in results]
    medians = [{r["key"]: r["median_ms"] for r in res["rows"]} for res in results]
    columns = [("model", "s"), ("tensors looped before", "s"), ("looped now", "s")]
    columns += [(LABELS[k] + " / backward", ".2f") for k in PER_SAMPLE]
    body = []
    for res, ratio in zip(results, ratios):
        body.append([res["model"],
                     f"{len(res['loops'].get('ief_before', []))} of {res['tensors']}" if "ief_before" in res["loops"]
                     else None,
                     f"{len(res['loops']['ief'])} of {res['tensors']}" + (
                         f" ({', '.join(res['loops']['ief'])})" if res["loops"]["ief"] else ""),
                     *[ratio.get(k) for k in PER_SAMPLE]])
    per_sample = harness.table(
        f"Full-parameter BERT, GPT-2, ViT ({shape}): per-sample gradients against a backward", columns, body,
        note=f"Ratios: medians of within-round ratios, one process; 'before' is `ief` at {before}"
             f"{' (before the HF Conv1D and broadcast rules)' if before == BEFORE else ''}. n/a: the method does not "
             "run on that model (reasons in the JSON).")
    columns = [("model", "s"), ("AdamW step ms", ".1f"), *[(LABELS[k] + " / AdamW", ".2f") for k in STEPS]]
    body = [[res["model"], median.get("adamw_step"), *[ratio.get(k) for k in STEPS]]
            for res, ratio, median in zip(results, ratios, medians)]
    step = harness.table(
        f"Full-parameter BERT, GPT-2, ViT ({shape}): one `ief.optim.IEF` step (default `form=\"auto\"`, guard on) "
        "against one AdamW step (forward, backward, update)", columns, body,
        note="Ratios: medians of within-round ratios, in the same rounds as the table above.")
    return [per_sample, step]


if __name__ == "__main__":
    sys.exit(main())
