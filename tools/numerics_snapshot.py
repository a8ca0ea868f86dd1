"""A numerics snapshot of the ``ief`` library, to prove that a refactor moved no number.

Computes several hundred outputs of the public API on tiny seeded models (no downloads) and saves them as a dict
``name -> tensor | float | str`` with ``torch.save``; ``--compare A.pt B.pt`` reports, key by key, whether two
snapshots are bit-identical (``torch.equal``, NaN equal to NaN), the largest absolute difference otherwise, and exits 1
if any key is missing or differs::

    python -m tools.numerics_snapshot --out before.pt          # or: python tools/numerics_snapshot.py --out F
    python -m tools.numerics_snapshot --compare before.pt after.pt

Only names reachable as top-level attributes of ``ief``, ``ief.optim``, ``ief.woodfisher`` and ``ief.hf`` are used,
and the models are defined here (mirroring ``tests/tiny_models.py`` and ``tests/route_models.py``, not imported
from them), so the script runs unchanged on both sides of a refactor that moves modules. A computation that raises
is recorded as the string ``"error: Type: message"`` under ``<key>:error`` (a refactor that changes which calls fail
shows up as a difference too).

Covered: ``per_sample`` in every ``form`` (dense, auto, ghost, rows), ``sampled_jacobian``, the iEF / EF / SF
directions at dampings 0, 1e-6, 1e-3, 1 on dense and factored Jacobians, ``fisher_vp`` (each method), ``gamma`` /
``gammas`` (each method), ``kfac_direction`` (each kind, each approximation), ``hessian_free``, ``damping_sweep``,
``evaluate``, WoodFisher saliencies and pruning, and 5-step optimiser trajectories (IEF, EF, SF, KFAC kinds, with and
without momentum / weight decay / ``reduction="mean"`` / normalised decaying steps, ``loss="mse"``) and a short
``ief.hf.IEFTrainer`` run, on an MLP, an MSE MLP, a P < M linear model, a small CNN, a GRU, an embedding + attention
sequence model with ignored positions, a token-table model, a dropout MLP in train mode and, when ``transformers`` and
``peft`` are installed, tiny BERT-LoRA, GPT-2-LoRA, T5-LoRA and T5 prompt-tuning models; float32 and float64.

Single-threaded (``torch.set_num_threads(1)``) and seeded per section, so two runs on one machine and one torch
build give bit-identical files.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import io
import math
import os
import sys
import tempfile
import time
import warnings
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

if __name__ == "__main__" and not __package__:  # run as a file: its folder (tools/, with a kernels.py) is no
    _HERE = os.path.dirname(os.path.abspath(__file__))  # package root, so that it cannot shadow a dependency
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import torch  # noqa: E402

IGNORE = -100
DAMPINGS = (0.0, 1e-6, 1e-3, 1.0)
SF_DAMPINGS = (1e-6, 1e-3, 1.0)
FORMS = ("dense", "auto", "ghost", "rows")
KFAC_KINDS = ("kfac", "ekfac", "iekfac")
DTYPES = {"f32": torch.float32, "f64": torch.float64}


# ------------------------------------------------------------------------------------------------------ snapshot
def _frozen(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu").clone().contiguous()
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, str):  # plain str (torch.__version__ is a subclass torch.load refuses)
        return str(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, (list, tuple)) and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                for v in value):
        return torch.tensor([float(v) for v in value], dtype=torch.float64)
    raise TypeError(f"cannot store a {type(value).__name__}")


class Snapshot:
    def __init__(self, verbose: bool = False):
        self.values: dict[str, Any] = {}
        self.errors: list[str] = []
        self.verbose = verbose

    def put(self, key: str, value: Any) -> None:
        if key in self.values:
            raise KeyError(f"duplicate key {key!r}")
        self.values[key] = _frozen(value)

    def run(self, key: str, fn: Callable[[], Any]) -> Any:
        """``fn()``; if it raises, record ``key:error`` and return ``None``."""
        _seed(key)
        try:
            return fn()
        except Exception as err:  # recorded, so that a change in what fails is a difference too
            message = str(err).splitlines()[0] if str(err) else ""
            self.put(f"{key}:error", f"error: {type(err).__name__}: {message}")
            self.errors.append(key)
            if self.verbose:
                print(f"  {key}: {type(err).__name__}: {message}", file=sys.stderr)
            return None


def _seed(name: str) -> None:
    """Seed the global RNG from a section's name, so each section is independent of the ones before it."""
    torch.manual_seed(zlib.crc32(name.encode()))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------------- the models
@dataclass
class Case:
    name: str
    model: torch.nn.Module
    inputs: Any
    targets: torch.Tensor
    loss: str = "cross_entropy"
    kfac: tuple[str, ...] | str | None = "all"  # "all": every trainable parameter; names: those modules; None: none
    extra_batches: list | None = None  # (inputs, targets) for trajectories


class TinySequenceModel(torch.nn.Module):
    """Embedding -> multi-head self-attention -> LayerNorm -> linear head, per-position logits ``[M, T, C]``."""

    def __init__(self, vocab: int = 11, dim: int = 6, classes: int = 5):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim, padding_idx=0)
        self.attn = torch.nn.MultiheadAttention(dim, num_heads=2, batch_first=True)
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        a, _ = self.attn(h, h, h, key_padding_mask=tokens.eq(0), need_weights=False)
        return self.head(self.norm(h + a))


class TokenTableModel(torch.nn.Module):
    """A token table used only partly, a position table shared by every sample, tanh, a Linear head."""

    def __init__(self, vocab: int = 12, positions: int = 4, dim: int = 3, classes: int = 3, twice: bool = False):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim, padding_idx=0)
        self.positions = torch.nn.Embedding(positions, dim)
        self.head = torch.nn.Linear(dim, classes)
        self.twice = twice

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        where = torch.arange(tokens.shape[1]).unsqueeze(0)
        h = self.embed(tokens) + self.positions(where)
        if self.twice:
            h = h + self.embed((tokens * 3) % self.embed.num_embeddings)
        return self.head(torch.tanh(h))


class SmallCNN(torch.nn.Module):
    """Conv2d (zero padding: hooked) -> ReLU -> Conv2d (reflect: exact loop) -> ReLU -> Conv2d (stride 2) -> head."""

    def __init__(self, classes: int = 3):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(2, 3, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(3, 3, 3, padding=1, padding_mode="reflect")
        self.conv3 = torch.nn.Conv2d(3, 2, 3, stride=2)
        self.head = torch.nn.Linear(2 * 2 * 2, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return self.head(self.conv3(h).flatten(1))


class SmallGRU(torch.nn.Module):
    """Frozen embedding -> GRU (exact per-sample loop) -> Linear head, per-position logits ``[M, T, C]``."""

    def __init__(self, vocab: int = 7, dim: int = 3, hidden: int = 4, classes: int = 3):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.embed.weight.requires_grad_(False)
        self.gru = torch.nn.GRU(dim, hidden, batch_first=True)
        self.head = torch.nn.Linear(hidden, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(self.embed(tokens))
        return self.head(out)


def _batches(make: Callable[[torch.Generator], tuple], seed: int, n: int = 5) -> list:
    g = _gen(seed)
    return [make(g) for _ in range(n)]


def mlp() -> Case:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 4))
    make = lambda g: (torch.randn(8, 5, generator=g), torch.randint(0, 4, (8,), generator=g))  # noqa: E731
    x, y = make(_gen(100))
    return Case("mlp", model, x, y, extra_batches=_batches(make, 101))


def mse_mlp() -> Case:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    make = lambda g: (torch.randn(6, 3, generator=g), torch.randn(6, 2, generator=g))  # noqa: E731
    x, y = make(_gen(200))
    return Case("mse-mlp", model, x, y, loss="mse", extra_batches=_batches(make, 201))


def linear_p_lt_m() -> Case:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    x = torch.randn(32, 4)
    y = torch.randint(0, 3, (32,))
    return Case("linear-p15-m32", model, x, y)


def dropout_mlp() -> Case:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 9), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(9, 3))
    model.train()
    make = lambda g: (torch.randn(7, 5, generator=g), torch.randint(0, 3, (7,), generator=g))  # noqa: E731
    x, y = make(_gen(300))
    return Case("dropout-mlp", model, x, y, extra_batches=_batches(make, 301))


def cnn() -> Case:
    torch.manual_seed(0)
    model = SmallCNN()
    x = torch.randn(6, 2, 5, 5)
    y = torch.randint(0, 3, (6,))
    y[3] = IGNORE
    return Case("cnn", model, x, y, kfac=("head",))


def gru() -> Case:
    torch.manual_seed(0)
    model = SmallGRU()
    tokens = torch.randint(0, 7, (4, 3))
    y = torch.randint(0, 3, (4, 3))
    y[0, 2] = IGNORE
    y[2] = IGNORE
    return Case("gru", model, tokens, y, kfac=("head",))


def _sequence_batch(g: torch.Generator, m: int = 4, t: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(1, 11, (m, t), generator=g)
    lengths = [t, t - 2, 3, t - 1][:m] + [t] * max(0, m - 4)
    for n, length in enumerate(lengths):
        tokens[n, length:] = 0
    targets = torch.randint(0, 5, (m, t), generator=g)
    targets[tokens.eq(0)] = IGNORE
    targets[0, 1] = IGNORE
    return tokens, targets


def sequence() -> Case:
    torch.manual_seed(0)
    model = TinySequenceModel()
    tokens, targets = _sequence_batch(_gen(400))
    return Case("sequence", model, tokens, targets, kfac=("head",), extra_batches=_batches(_sequence_batch, 401))


def token_table() -> Case:
    torch.manual_seed(0)
    model = TokenTableModel(twice=True)
    tokens = torch.randint(1, 7, (5, 4))
    tokens[0, 3] = 0
    tokens[4] = tokens[3]
    y = torch.randint(0, 3, (5, 4))
    y[4] = y[3]
    y[0, 3] = IGNORE
    y[1] = IGNORE
    return Case("token-table", model, tokens, y, kfac=("head",))


def _have_hf() -> bool:
    try:
        import peft  # noqa: F401
        import transformers  # noqa: F401
    except Exception:
        return False
    return True


def _move_lora_b(model: torch.nn.Module) -> None:
    """LoRA ``B`` starts at 0; move it (seeded per name) so that the Jacobian is generic."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3, generator=_gen(zlib.crc32(name.encode())))


def bert_lora() -> Case:
    import peft
    import transformers

    cfg = transformers.BertConfig(vocab_size=20, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=16, max_position_embeddings=16, num_labels=3,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, initializer_range=0.5)
    torch.manual_seed(0)
    model = peft.get_peft_model(transformers.BertForSequenceClassification(cfg),
                                peft.LoraConfig(task_type="SEQ_CLS", r=2, target_modules=["query", "value"]))
    _move_lora_b(model)
    model.eval()

    def make(g):
        ids = torch.randint(1, 20, (6, 6), generator=g)
        mask = torch.ones(6, 6, dtype=torch.long)
        for n in range(6):
            pad = n % 3
            if pad:
                ids[n, -pad:] = 0
                mask[n, -pad:] = 0
        return dict(input_ids=ids, attention_mask=mask), torch.randint(0, 3, (6,), generator=g)

    inputs, y = make(_gen(500))
    y[4] = IGNORE
    return Case("bert-lora", model, inputs, y, extra_batches=_batches(make, 501))


def gpt2_lora() -> Case:
    import ief
    import peft
    import transformers

    cfg = transformers.GPT2Config(vocab_size=20, n_positions=16, n_embd=8, n_layer=1, n_head=2, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = peft.get_peft_model(transformers.GPT2LMHeadModel(cfg),
                                peft.LoraConfig(task_type="CAUSAL_LM", r=2, target_modules=["c_attn"],
                                                fan_in_fan_out=True, lora_dropout=0.0))
    _move_lora_b(model)
    model.eval()

    def make(g):
        ids = torch.randint(3, 20, (4, 6), generator=g)
        mask = torch.ones(4, 6, dtype=torch.long)
        for n in range(4):
            pad = n % 3
            if pad:
                ids[n, -pad:] = 0
                mask[n, -pad:] = 0
        labels = ids.masked_fill(mask == 0, IGNORE)
        return dict(input_ids=ids, attention_mask=mask), ief.causal_lm_targets(labels)

    inputs, y = make(_gen(600))
    return Case("gpt2-lora", model, inputs, y, extra_batches=_batches(make, 601))


def _t5_config():
    from transformers import T5Config

    return T5Config(vocab_size=32, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_decoder_layers=1, num_heads=2,
                    relative_attention_num_buckets=4, relative_attention_max_distance=8, dropout_rate=0.0,
                    decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)


def _t5_batch(m: int, seed: int):
    g = _gen(seed)
    input_ids = torch.randint(2, 32, (m, 6), generator=g)
    attention_mask = torch.ones(m, 6, dtype=torch.long)
    for n in range(m):
        pad = n % 3
        if pad:
            input_ids[n, -pad:] = 0
            attention_mask[n, -pad:] = 0
    labels = torch.randint(2, 32, (m, 3), generator=g)
    labels[1 % m, 2] = IGNORE
    if m > 2:
        labels[2, 1:] = IGNORE
    decoder_input_ids = torch.cat([torch.zeros(m, 1, dtype=torch.long), labels[:, :-1].clamp_min(0)], dim=1)
    return dict(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids), labels


def t5_lora() -> Case:
    import peft
    from transformers import T5ForConditionalGeneration

    torch.manual_seed(0)
    base = T5ForConditionalGeneration(_t5_config())
    model = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q", "v"],
                                                      lora_dropout=0.1))
    _move_lora_b(model)
    model.eval()
    inputs, labels = _t5_batch(3, 0)
    labels[2] = IGNORE
    return Case("t5-lora", model, inputs, labels)


def t5_prompt() -> Case:
    import ief
    import peft
    from transformers import T5ForConditionalGeneration

    torch.manual_seed(0)
    base = T5ForConditionalGeneration(_t5_config())
    model = peft.get_peft_model(base, peft.PromptTuningConfig(task_type="SEQ_2_SEQ_LM", num_virtual_tokens=20))
    model.eval()
    ief.per_sample_prompts(model)
    inputs, labels = _t5_batch(3, 0)
    return Case("t5-prompt", model, inputs, labels, kfac=None)


def _cast(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, Mapping):
        return {k: _cast(v, dtype) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_cast(v, dtype) for v in x)
    if isinstance(x, torch.Tensor) and x.dtype.is_floating_point:
        return x.to(dtype)
    return x


def in_dtype(case: Case, dtype: torch.dtype) -> Case:
    """A copy of ``case`` in ``dtype`` (the float64 one holds exactly the float32 one's values)."""
    return Case(case.name, copy.deepcopy(case.model).to(dtype), _cast(case.inputs, dtype), _cast(case.targets, dtype),
                case.loss, case.kfac, _cast(case.extra_batches, dtype))


# ----------------------------------------------------------------------------------------------------- helpers
def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in trainable(model)]).clone()


def kfac_params(case: Case) -> list[torch.nn.Parameter] | None:
    if case.kfac == "all":
        return None
    return [p for n, p in case.model.named_parameters() if p.requires_grad and set(n.split(".")) & set(case.kfac)]


def dense(jacobian: Any) -> torch.Tensor:
    return jacobian if isinstance(jacobian, torch.Tensor) else jacobian.materialize()


# ------------------------------------------------------------------------------------------------- the sections
def point_quantities(snap: Snapshot, case: Case, tag: str, full: bool = True) -> None:
    """Everything computed at one point of one model."""
    import ief

    model, x, y, loss = case.model, case.inputs, case.targets, case.loss
    k = f"{case.name}/{tag}"
    results = {}
    for form in FORMS:
        r = snap.run(f"{k}/per_sample/{form}", lambda: ief.per_sample(model, x, y, loss=loss, form=form))
        if r is None:
            continue
        results[form] = r
        snap.put(f"{k}/per_sample/{form}/losses", r.losses)
        snap.put(f"{k}/per_sample/{form}/jacobian", dense(r.jacobian))
        snap.put(f"{k}/per_sample/{form}/logit_sqnorm", r.logit_sqnorm)
        snap.put(f"{k}/per_sample/{form}/gradient", r.gradient)
    if "dense" not in results:
        return
    r = results["dense"]
    factored = results.get("auto")

    sampled = snap.run(f"{k}/sampled_jacobian/dense",
                       lambda: ief.sampled_jacobian(model, x, y, _gen(1), loss=loss))
    if sampled is not None:
        snap.put(f"{k}/sampled_jacobian/dense", sampled)
    sampled_auto = snap.run(f"{k}/sampled_jacobian/auto",
                            lambda: ief.sampled_jacobian(model, x, y, _gen(1), loss=loss, form="auto"))
    if sampled_auto is not None:
        snap.put(f"{k}/sampled_jacobian/auto", dense(sampled_auto))

    dirs = {}
    for lam in DAMPINGS:
        for src, res in (("dense", r), ("auto", factored)):
            if res is None or (src == "auto" and not full and lam not in (0.0, 1e-3)):
                continue
            d = snap.run(f"{k}/ief_direction/{src}/{lam!r}",
                         lambda: ief.ief_direction(res.jacobian, res.logit_sqnorm, lam))
            if d is not None:
                snap.put(f"{k}/ief_direction/{src}/{lam!r}", d)
                dirs.setdefault(f"ief/{lam!r}", d)
            d = snap.run(f"{k}/ef_direction/{src}/{lam!r}", lambda: ief.ef_direction(res.jacobian, lam))
            if d is not None:
                snap.put(f"{k}/ef_direction/{src}/{lam!r}", d)
                dirs.setdefault(f"ef/{lam!r}", d)
    for lam in SF_DAMPINGS:
        for src, a in (("dense", sampled), ("auto", sampled_auto)):
            if a is None:
                continue
            d = snap.run(f"{k}/sf_direction/{src}/{lam!r}", lambda: ief.sf_direction(a, r.gradient, lam))
            if d is not None:
                snap.put(f"{k}/sf_direction/{src}/{lam!r}", d)
                dirs.setdefault(f"sf/{lam!r}", d)

    v = torch.randn(r.gradient.shape[0], generator=_gen(7), dtype=torch.float64).to(r.gradient.dtype)
    for method in ("auto", "forward", "double_backward"):
        fv = snap.run(f"{k}/fisher_vp/{method}", lambda: ief.fisher_vp(model, x, y, v, loss=loss, method=method))
        if fv is not None:
            snap.put(f"{k}/fisher_vp/{method}", fv)

    d_ief = dirs.get("ief/0.001")
    if d_ief is not None:
        for method in ("forward", "double_backward"):
            g = snap.run(f"{k}/gamma/ief/{method}", lambda: ief.gamma(model, x, y, d_ief, loss=loss, method=method))
            if g is not None:
                snap.put(f"{k}/gamma/ief/{method}", float(g))
    stack = [r.gradient] + [dirs[key] for key in ("ief/0.001", "ef/0.001", "sf/0.001", "ief/0.0") if key in dirs]
    stack = torch.stack([s for s in stack if bool(s.any())])
    for method in ("forward", "double_backward"):
        gs = snap.run(f"{k}/gammas/{method}", lambda: ief.gammas(model, x, y, stack, loss=loss, method=method))
        if gs is not None:
            snap.put(f"{k}/gammas/{method}", gs)

    if case.kfac is not None:
        params = kfac_params(case)
        for kind in KFAC_KINDS:
            for approx in (("expand", "reduce") if full else ("expand",)):
                for lam in ((1e-3, 0.0) if full else (1e-3,)):
                    key = f"{k}/kfac_direction/{kind}/{approx}/{lam!r}"
                    d = snap.run(key, lambda: ief.kfac_direction(model, x, y, kind, lam, params, _gen(3), loss=loss,
                                                                 approx=approx))
                    if d is not None:
                        snap.put(key, d)

    res = snap.run(f"{k}/hessian_free", lambda: ief.hessian_free(model, x, y, 5, loss=loss, return_gammas=True))
    if res is not None:
        snap.put(f"{k}/hessian_free/solution", res.solution)
        snap.put(f"{k}/hessian_free/gammas", res.gammas)
        snap.put(f"{k}/hessian_free/residual_norms", res.residual_norms)
    if full:
        d = snap.run(f"{k}/hessian_free/forward", lambda: ief.hessian_free(model, x, y, 3, loss=loss,
                                                                           method="forward"))
        if d is not None:
            snap.put(f"{k}/hessian_free/forward", d)


def sweep_and_evaluate(snap: Snapshot, case: Case, tag: str) -> None:
    import ief

    model, x, y, loss = case.model, case.inputs, case.targets, case.loss
    k = f"{case.name}/{tag}"
    recs = snap.run(f"{k}/damping_sweep", lambda: ief.damping_sweep(model, x, y, (1e-6, 1e-3, 1.0), loss=loss,
                                                                    generator=_gen(5)))
    if recs is not None:
        snap.put(f"{k}/damping_sweep/gamma", [rec["gamma"] for rec in recs])
        snap.put(f"{k}/damping_sweep/ratio", [rec["ratio"] for rec in recs])
        snap.put(f"{k}/damping_sweep/labels", ";".join(f"{rec['method']}@{rec['damping']!r}" for rec in recs))
    batches = [(x, y)] + list((case.extra_batches or [])[:1])
    methods = list(ief.METHODS) if case.kfac == "all" else [m for m in ief.METHODS if "kfac" not in m]
    routes = (None, False, True) if case.targets.dim() == 1 else (None, False)  # True: refused for [M, T, C]
    for route in routes:
        key = f"{k}/evaluate/logit_space={route}"
        recs = snap.run(key, lambda: ief.evaluate(model, batches, methods, damping=1e-3, loss=loss, cg_iterations=5,
                                                  seed=2, logit_space=route))
        if recs is not None:
            snap.put(f"{key}/gamma", [rec["gamma"] for rec in recs])
            snap.put(f"{key}/ratio", [rec["ratio"] for rec in recs])
            snap.put(f"{key}/imbalance", [rec["imbalance"] for rec in recs])
            snap.put(f"{key}/labels", ";".join(f"{rec['batch']}:{rec['method']}" for rec in recs))


def trajectory(snap: Snapshot, key: str, case: Case, make_opt: Callable[[torch.nn.Module], Any],
               steps: int = 5) -> None:
    """``steps`` optimiser steps on a fresh copy of ``case.model``, one batch each: losses and parameters."""
    def go():
        model = copy.deepcopy(case.model)
        opt = make_opt(model)
        losses, params, norms = [], [], []
        for i in range(steps):
            x, y = case.extra_batches[i % len(case.extra_batches)]
            losses.append(opt.step(x, y).detach().reshape(()))
            params.append(flat(model))
            norms.append(float("nan") if opt.last_update_norm is None else float(opt.last_update_norm))
        return torch.stack(losses), torch.stack(params), norms

    out = snap.run(key, go)
    if out is not None:
        snap.put(f"{key}/losses", out[0])
        snap.put(f"{key}/params", out[1])
        snap.put(f"{key}/update_norms", out[2])


def trajectories(snap: Snapshot, case: Case, tag: str, full: bool = True) -> None:
    import ief

    O = ief.optim  # noqa: N806, E741
    loss = case.loss
    k = f"{case.name}/{tag}/optim"

    def wd_groups(model):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        return [{"params": [p for n, p in named if "bias" not in n], "weight_decay": 0.05},
                {"params": [p for n, p in named if "bias" in n], "weight_decay": 0.0}]

    kp = (lambda m: None) if case.kfac == "all" else (
        lambda m: [p for n, p in m.named_parameters() if p.requires_grad and set(n.split(".")) & set(case.kfac)])
    configs: dict[str, Callable] = {
        "ief": lambda m: O.IEF(m, loss=loss),
        "ief-mom-wd": lambda m: O.IEF(m, lr=0.5, momentum=0.9, weight_decay=0.01, loss=loss),
        "ief-mean": lambda m: O.IEF(m, lr=2.0, reduction="mean", loss=loss),
        "ef": lambda m: O.EF(m, loss=loss),
        "ef-mom-wd": lambda m: O.EF(m, momentum=0.5, dampening=0.1, weight_decay=0.1, loss=loss),
        "sf": lambda m: O.SF(m, generator=_gen(11), loss=loss),
        "sf-mom-wd": lambda m: O.SF(m, generator=_gen(12), momentum=0.9, weight_decay=0.01, loss=loss),
        "kfac-iekfac": lambda m: O.KFAC(m, "iekfac", lr=0.1, damping=1.0, inverse_every=2, params=kp(m), loss=loss),
    }
    if full:
        configs.update({
            "ief-dense": lambda m: O.IEF(m, form="dense", loss=loss),
            "ief-ghost": lambda m: O.IEF(m, form="ghost", loss=loss),
            "ief-rows": lambda m: O.IEF(m, form="rows", damping=0.0, lr=0.5, loss=loss),
            "ief-norm-decay": lambda m: O.IEF(m, lr=0.1, damping=1e-3, normalize=True, total_steps=5, loss=loss),
            "ief-wd-groups": lambda m: O.IEF(m, lr=0.5, params=wd_groups(m), momentum=0.5, loss=loss),
            "ef-mean": lambda m: O.EF(m, lr=0.01, reduction="mean", normalize=False, loss=loss),
            "ef-decay": lambda m: O.EF(m, lr=0.05, total_steps=5, damping=1e-2, loss=loss),
            "sf-mean": lambda m: O.SF(m, generator=_gen(13), reduction="mean", loss=loss),
            "sf-global-rng": lambda m: O.SF(m, lr=0.02, loss=loss),
            "kfac-kfac": lambda m: O.KFAC(m, "kfac", lr=0.1, damping=1.0, inverse_every=2, generator=_gen(14),
                                          params=kp(m), loss=loss),
            "kfac-ekfac": lambda m: O.KFAC(m, "ekfac", lr=0.1, damping=1.0, inverse_every=2, params=kp(m), loss=loss),
            "kfac-kfac-mom-wd": lambda m: O.KFAC(m, "kfac", lr=0.05, damping=0.5, factor_decay=0.5, inverse_every=1,
                                                 generator=_gen(15), momentum=0.9, weight_decay=0.01, params=kp(m),
                                                 loss=loss),
            "kfac-ekfac-reduce-norm": lambda m: O.KFAC(m, "ekfac", lr=0.05, damping=0.1, approx="reduce",
                                                       normalize=True, total_steps=5, factor_decay=0.0, params=kp(m),
                                                       loss=loss),
            "kfac-iekfac-mom": lambda m: O.KFAC(m, "iekfac", lr=0.1, damping=1.0, momentum=0.5, dampening=0.5,
                                                params=kp(m), loss=loss),
        })
    for name, make in configs.items():
        trajectory(snap, f"{k}/{name}", case, make)


def woodfisher(snap: Snapshot, case: Case, tag: str) -> None:
    import ief.woodfisher as wf

    model, x, y, loss = case.model, case.inputs, case.targets, case.loss
    k = f"{case.name}/{tag}/woodfisher"
    batches = [(x, y)] + list(case.extra_batches[:2])
    for fisher in wf.METHODS:
        if fisher == "ggn" and loss != "cross_entropy":  # refused: the GGN blocks are cross-entropy's
            continue
        for block in (None, 8):
            key = f"{k}/saliency/{fisher}/block={block}"
            sal = snap.run(key, lambda: wf.obs_saliency(model, batches, fisher=fisher, damping=1e-3, block_size=block,
                                                        generator=_gen(21), loss=loss))
            if sal is not None:
                for name in sorted(sal):
                    snap.put(f"{key}/{name}", sal[name])
    for fisher in ("magnitude", "ief", "ef", "sf"):
        for update in (True, False):
            key = f"{k}/prune/{fisher}/update={update}"

            def go():
                m = copy.deepcopy(model)
                _, masks = wf.prune(m, batches, 0.4, fisher=fisher, damping=1e-3, update=update, generator=_gen(22),
                                    loss=loss)
                return m, masks
            out = snap.run(key, go)
            if out is not None:
                snap.put(f"{key}/params", flat(out[0]))
                snap.put(f"{key}/masks", torch.cat([out[1][n].reshape(-1) for n in sorted(out[1])]))


def hf_trainer(snap: Snapshot, case: Case) -> None:
    """Three ``ief.hf.IEFTrainer`` steps per optimiser on the BERT-LoRA case (float64)."""
    try:
        import datasets
        import ief.hf
        import transformers
    except Exception as err:
        print(f"  (skipping ief.hf: {type(err).__name__}: {err})", file=sys.stderr)
        return
    transformers.logging.set_verbosity_error()
    rows: dict[str, list] = {"input_ids": [], "attention_mask": [], "labels": []}
    for inputs, y in case.extra_batches[:3]:
        rows["input_ids"] += inputs["input_ids"].tolist()
        rows["attention_mask"] += inputs["attention_mask"].tolist()
        rows["labels"] += y.tolist()
    rows["labels"] = [max(v, 0) for v in rows["labels"]]
    for name, kwargs in (("ief", {}), ("sf", {}), ("ekfac", {"damping": 1.0})):
        key = f"{case.name}/f64/hf/IEFTrainer/{name}"

        def go():
            model = copy.deepcopy(case.model)
            with tempfile.TemporaryDirectory() as tmp:
                args = transformers.TrainingArguments(
                    output_dir=os.path.join(tmp, "out"), learning_rate=0.5, max_grad_norm=0.0,
                    per_device_train_batch_size=6, logging_steps=1, report_to="none", use_cpu=True,
                    disable_tqdm=True, save_strategy="no", train_sampling_strategy="sequential", seed=0, max_steps=3,
                    lr_scheduler_type="linear")
                trainer = ief.hf.IEFTrainer(model, args, train_dataset=datasets.Dataset.from_dict(rows),
                                            optimizer=name, optimizer_kwargs=kwargs)
                with contextlib.redirect_stdout(io.StringIO()):  # the Trainer prints its log lines
                    trainer.train()
                logged = [h["loss"] for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
            return flat(model), logged
        out = snap.run(key, go)
        if out is not None:
            snap.put(f"{key}/params", out[0])
            snap.put(f"{key}/logged_losses", out[1])
    key = f"{case.name}/f64/hf/split_batch"
    out = snap.run(key, lambda: ief.hf.split_batch(case.model, {**case.inputs, "labels": case.targets}))
    if out is not None:
        snap.put(f"{key}/targets", out[1])


def per_sample_extras(snap: Snapshot, case: Case, tag: str) -> None:
    """``params=`` subsets, ``out=`` buffers and the exact check on one model."""
    import ief

    model, x, y, loss = case.model, case.inputs, case.targets, case.loss
    k = f"{case.name}/{tag}/per_sample_extras"
    head = [trainable(model)[-2], trainable(model)[-1]]
    for form in FORMS:
        r = snap.run(f"{k}/params=head/{form}", lambda: ief.per_sample(model, x, y, head, loss=loss, form=form))
        if r is not None:
            snap.put(f"{k}/params=head/{form}/jacobian", dense(r.jacobian))
            snap.put(f"{k}/params=head/{form}/gradient", r.gradient)
    p = sum(t.numel() for t in trainable(model))
    buf = torch.full((y.shape[0], p), float("nan"), dtype=trainable(model)[0].dtype)
    r = snap.run(f"{k}/out", lambda: ief.per_sample(model, x, y, loss=loss, out=buf))
    if r is not None:
        snap.put(f"{k}/out/jacobian", r.jacobian)
    r = snap.run(f"{k}/check=exact", lambda: ief.per_sample(model, x, y, loss=loss, check="exact"))
    if r is not None:
        snap.put(f"{k}/check=exact/jacobian", r.jacobian)
    r = snap.run(f"{k}/check=False", lambda: ief.per_sample(model, x, y, loss=loss, check=False, form="auto"))
    if r is not None:
        snap.put(f"{k}/check=False/jacobian", dense(r.jacobian))


# ---------------------------------------------------------------------------------------------------------- main
def snapshot(verbose: bool = False) -> Snapshot:
    import ief

    snap = Snapshot(verbose)
    snap.put("meta/torch", torch.__version__)
    hf = _have_hf()
    snap.put("meta/hf_models", hf)
    builders: list[tuple[Callable[[], Case], dict]] = [
        (mlp, dict(full=True, sweep=True, train=True, woodfisher=True, extras=True)),
        (mse_mlp, dict(full=True, sweep=True, train=True, woodfisher=True)),
        (linear_p_lt_m, dict(full=True, sweep=True)),
        (dropout_mlp, dict(full=False, train="short")),
        (cnn, dict(full=True, extras=True)),
        (gru, dict(full=False)),
        (sequence, dict(full=True, sweep=True, train=True)),
        (token_table, dict(full=True)),
    ]
    if hf:
        builders += [
            (bert_lora, dict(full=False, sweep=True, train="short", hf_trainer=True)),
            (gpt2_lora, dict(full=False, train="short")),
            (t5_lora, dict(full=False)),
            (t5_prompt, dict(full=False)),
        ]
    for build, what in builders:
        t0 = time.perf_counter()
        _seed(build.__name__)
        base = build()
        for tag, dtype in DTYPES.items():
            case = in_dtype(base, dtype)
            _seed(f"{case.name}/{tag}")
            point_quantities(snap, case, tag, full=what.get("full", False))
            if what.get("sweep"):
                sweep_and_evaluate(snap, case, tag)
            if what.get("extras"):
                per_sample_extras(snap, case, tag)
            if what.get("train") and (what["train"] is True or tag == "f64"):
                trajectories(snap, case, tag, full=what["train"] is True)
            if what.get("woodfisher") and tag == "f64":
                woodfisher(snap, case, tag)
            if what.get("hf_trainer") and tag == "f64":
                hf_trainer(snap, case)
        if verbose:
            print(f"  {base.name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    snap.put("meta/ief_methods", ",".join(ief.METHODS))
    return snap


def _identical(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if torch.equal(a, b):
            return True
        if a.dtype.is_floating_point or a.dtype.is_complex:
            both_nan = torch.isnan(a) & torch.isnan(b)
            return bool(((a == b) | both_nan).all())
        return False
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return type(a) is type(b) and a == b


def _difference(a: Any, b: Any) -> str:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape:
            return f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
        note = "" if a.dtype == b.dtype else f" (dtype {a.dtype} vs {b.dtype})"
        if a.numel() == 0:
            return "differs" + note
        if a.dtype == torch.bool or b.dtype == torch.bool:
            return f"{int((a != b).sum())} of {a.numel()} entries differ" + note
        diff = (a.to(torch.float64) - b.to(torch.float64)).abs()
        nan_mismatch = int((torch.isnan(a.to(torch.float64)) != torch.isnan(b.to(torch.float64))).sum())
        scale = float(b.to(torch.float64).abs().nan_to_num(0.0).max())
        extra = f", NaN pattern differs at {nan_mismatch}" if nan_mismatch else ""
        return f"max abs diff {float(diff.nan_to_num(0.0).max()):.3e} (max |B| {scale:.3e}){extra}{note}"
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return f"abs diff {abs(a - b):.3e} ({a!r} vs {b!r})"
    return f"{a!r} vs {b!r}"


def compare(path_a: str, path_b: str, only_differences: bool = False) -> int:
    a = torch.load(path_a, weights_only=True)
    b = torch.load(path_b, weights_only=True)
    keys = list(dict.fromkeys([*a, *b]))
    identical = 0
    bad = 0
    for key in keys:
        if key not in a:
            print(f"MISSING in A  {key}")
            bad += 1
        elif key not in b:
            print(f"MISSING in B  {key}")
            bad += 1
        elif _identical(a[key], b[key]):
            identical += 1
            if not only_differences:
                print(f"identical     {key}")
        else:
            print(f"DIFFERS       {key}: {_difference(a[key], b[key])}")
            bad += 1
    print(f"{identical} of {len(keys)} identical ({len(a)} keys in A, {len(b)} in B)")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.numerics_snapshot", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", metavar="FILE.pt", help="compute the snapshot and save it here")
    p.add_argument("--compare", nargs=2, metavar=("A.pt", "B.pt"), help="compare two snapshots (exit 1 if any "
                   "key is missing or differs)")
    p.add_argument("--only-differences", action="store_true", help="with --compare, print only the keys that differ")
    p.add_argument("--verbose", action="store_true", help="print per-model timings and recorded errors")
    args = p.parse_args(argv)
    if bool(args.out) == bool(args.compare):
        p.error("give exactly one of --out FILE.pt or --compare A.pt B.pt")
    if args.compare:
        return compare(*args.compare, only_differences=args.only_differences)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    import ief

    t0 = time.perf_counter()
    snap = snapshot(args.verbose)
    elapsed = time.perf_counter() - t0
    torch.save(snap.values, args.out)
    print(f"ief from {os.path.dirname(os.path.abspath(ief.__file__))}")
    print(f"wrote {len(snap.values)} keys to {args.out} in {elapsed:.1f} s "
          f"({len(snap.errors)} computations recorded as errors)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
