"""The models of the differential route tests (``tests/ief/test_routes.py``), each in float32 and float64 with the very
same parameter values and inputs, and their dense float64 oracles, cached per model.

Models (every one small enough for an explicit ``[P, P]`` Fisher; every one but the P < M example has a sample whose
every target position is ignored, so its per-sample gradient is zero and ``J J^T`` is singular):

- ``digits-mlp``, ``minilm-lora``, ``minilm-pt``: the cpu setups' architectures at smoke size, built by
  :func:`companion.experiments.models.build_model` from their smoke configs on the smoke data (eval mode; LoRA ``B``
  moved off zero so that the Jacobian is generic);
- ``linear-p15-m32``: ``Linear(4, 3)`` on 32 samples, P = 15 < M = 32 (``J J^T`` singular by construction);
- ``t5-prompt``: a prompt-only model (tiny T5, prompt tuning made per-sample as the setups do it);
- ``t5-lora``: tiny T5 with LoRA, per-position vocabulary logits and padded labels;
- ``cnn``: two zero-padded ``Conv2d`` (hooked, unfolded) and a reflect-padded one (exact per-sample loop), a head;
- ``gru``: an ``nn.GRU`` (exact per-sample loop) with per-position logits and ignored positions;
- ``token-table``: a trainable ``nn.Embedding`` the batch uses only partly (the factored forms keep its used rows),
  a position table shared by every sample, a repeated sample and per-position logits.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import math
from collections.abc import Callable, Mapping

import torch

import oracle
from tiny_models import IGNORE, Case, TokenTableModel, t5_lora_case, t5_prompt_case


@dataclasses.dataclass(frozen=True)
class RouteModel:
    """A model of the matrix: its float32 builder and which routes apply to it.

    ``classifier``: one logit vector per sample (the logit-space route applies); ``kfac_params``: the names of the
    ``nn.Linear`` parameters K-FAC preconditions (all trainable ones, or a head; ``()``: K-FAC does not apply).
    """

    name: str
    build: Callable[[], Case]
    classifier: bool
    kfac_params: tuple[str, ...] | str = "all"


def _smoke_setup(setup: str, m: int, ignored: int) -> Case:
    from companion.experiments import data as data_mod
    from companion.experiments.models import build_model
    from companion.experiments.setups import resolve
    from companion.experiments.tasks import make_task

    cfg = resolve(setup, "smoke")
    torch.manual_seed(0)
    data = data_mod.load_data(cfg)
    model, preprocessor = build_model(cfg, data)
    model.eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    inputs, targets = make_task(cfg, model, preprocessor).collate(list(data.train[:m]))
    targets[ignored] = IGNORE
    return Case(setup, model, inputs, targets)


def digits_mlp() -> Case:
    return _smoke_setup("digits-mlp", 8, 5)


def minilm_lora() -> Case:
    return _smoke_setup("tweets-minilm-lora", 6, 1)


def minilm_pt() -> Case:
    return _smoke_setup("tweets-minilm-pt", 6, 1)


def linear_p_lt_m() -> Case:
    """``Linear(4, 3)`` on 32 samples: P = 15 < M = 32 (the sweep's known singular case)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    x = torch.randn(32, 4)
    y = torch.randint(0, 3, (32,))
    return Case("linear-p15-m32", model, x, y)


def _all_ignored(case: Case, n: int) -> Case:
    case.targets[n] = IGNORE
    return case


def t5_prompt() -> Case:
    from ief import per_sample_prompts

    case = t5_prompt_case(m=3, dtype=torch.float32)
    per_sample_prompts(case.model)
    return _all_ignored(case, 2)


def t5_lora() -> Case:
    return _all_ignored(t5_lora_case(m=3, dtype=torch.float32), 2)


class SmallCNN(torch.nn.Module):
    """Conv2d (zero padding: hooked) -> ReLU -> Conv2d (reflect padding: exact per-sample loop) -> ReLU -> Conv2d
    (no padding, stride 2: hooked) -> flatten -> Linear head."""

    def __init__(self, classes: int = 3):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(2, 3, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(3, 3, 3, padding=1, padding_mode="reflect")
        self.conv3 = torch.nn.Conv2d(3, 2, 3, stride=2)
        self.head = torch.nn.Linear(2 * 2 * 2, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return self.head(self.conv3(h).flatten(1))


def cnn() -> Case:
    torch.manual_seed(0)
    model = SmallCNN()
    x = torch.randn(6, 2, 5, 5)
    y = torch.randint(0, 3, (6,))
    y[3] = IGNORE
    return Case("cnn", model, x, y)


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


def gru() -> Case:
    torch.manual_seed(0)
    model = SmallGRU()
    tokens = torch.randint(0, 7, (4, 3))
    y = torch.randint(0, 3, (4, 3))
    y[0, 2] = IGNORE
    y[2] = IGNORE  # every position of sample 2 ignored
    return Case("gru", model, tokens, y)


def token_table() -> Case:
    torch.manual_seed(0)
    model = TokenTableModel()
    tokens = torch.randint(1, 7, (5, 4))  # rows 7..11 of the table unused
    tokens[0, 3] = 0  # padding
    tokens[4] = tokens[3]  # a repeated sample
    y = torch.randint(0, 3, (5, 4))
    y[4] = y[3]
    y[0, 3] = IGNORE
    y[1] = IGNORE  # every position of sample 1 ignored
    return Case("token-table", model, tokens, y)


MODELS = {
    m.name: m
    for m in (
        RouteModel("digits-mlp", digits_mlp, classifier=True),
        RouteModel("minilm-lora", minilm_lora, classifier=True),
        RouteModel("minilm-pt", minilm_pt, classifier=True, kfac_params=("classifier",)),
        RouteModel("linear-p15-m32", linear_p_lt_m, classifier=True),
        RouteModel("t5-prompt", t5_prompt, classifier=False, kfac_params=()),
        RouteModel("t5-lora", t5_lora, classifier=False),
        RouteModel("cnn", cnn, classifier=True, kfac_params=("head",)),
        RouteModel("gru", gru, classifier=False, kfac_params=("head",)),
        RouteModel("token-table", token_table, classifier=False, kfac_params=("head",)),
    )
}


# ------------------------------------------------------------------------------------------------------ cases
def _cast(x, dtype: torch.dtype):
    if isinstance(x, Mapping):
        return {k: _cast(v, dtype) for k, v in x.items()}
    if isinstance(x, torch.Tensor) and x.dtype.is_floating_point:
        return x.to(dtype)
    return x


@functools.lru_cache(maxsize=None)
def _float32(name: str) -> Case:
    case = MODELS[name].build()
    case.model.float()
    case.inputs = _cast(case.inputs, torch.float32)
    return case


@functools.lru_cache(maxsize=None)
def case(name: str, dtype: torch.dtype) -> Case:
    """The model ``name`` in ``dtype``: the float64 one holds exactly the float32 one's parameters and inputs."""
    base = _float32(name)
    if dtype == torch.float32:
        return base
    return Case(base.name, copy.deepcopy(base.model).to(dtype), _cast(base.inputs, dtype), base.targets.clone(),
                base.loss)


def trainable_names(case_: Case) -> list[str]:
    return [n for n, p in case_.model.named_parameters() if p.requires_grad]


def kfac_params(name: str, case_: Case) -> list[torch.nn.Parameter] | None:
    """The parameters K-FAC preconditions on this model (``None``: all trainable ones)."""
    wanted = MODELS[name].kfac_params
    if wanted == "all":
        return None
    return [p for n, p in case_.model.named_parameters() if p.requires_grad and set(n.split(".")) & set(wanted)]


# ------------------------------------------------------------------------------------------------------ oracles
@dataclasses.dataclass(frozen=True)
class Oracle:
    """Dense float64 quantities of one model at its (float32-representable) point, by explicit per-sample loops."""

    losses: torch.Tensor  # [M]
    jacobian: torch.Tensor  # [M, P]
    logit_sqnorm: torch.Tensor  # [M]
    gradient: torch.Tensor  # [P]
    fisher: torch.Tensor  # [P, P] (eqn:FIM)

    def gamma(self, d: torch.Tensor) -> float:
        """``sqrt(d^T F d) / |d^T g|`` (``sec:eval_framework``)."""
        d = d.to(torch.float64)
        return float((d @ self.fisher @ d).clamp_min(0).sqrt() / (d @ self.gradient).abs())


@functools.lru_cache(maxsize=None)
def dense_oracle(name: str) -> Oracle:
    c = case(name, torch.float64)
    losses, jac, sq = oracle.per_sample(c.model, c.inputs, c.targets, c.loss)
    fisher = oracle.fisher(c.model, c.inputs, c.targets, c.loss)
    jac = jac.detach().to(torch.float64)
    return Oracle(losses.to(torch.float64), jac, sq.detach().to(torch.float64), jac.sum(0), fisher)


def batch_logits(c: Case) -> torch.Tensor:
    with torch.no_grad():
        return oracle.logits_of(c.model, c.inputs)


def draw_labels(c: Case, seed: int) -> torch.Tensor:
    """The labels the package draws for SF / K-FAC from a generator seeded with ``seed``: one multinomial draw per
    kept position from the float64 softmax of the batch's logits (the model's own dtype), ignored positions kept."""
    logits = batch_logits(c)
    probs = torch.softmax(logits.to(torch.float64), dim=-1).reshape(-1, logits.shape[-1])
    drawn = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(seed)).reshape(c.targets.shape)
    return torch.where(c.targets == IGNORE, c.targets, drawn.to(c.targets.dtype))


@functools.lru_cache(maxsize=None)
def sampled_oracle(name: str, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """``A [M, P]``: the dense per-sample gradients for the labels the package draws in ``dtype`` with ``seed``."""
    labels = draw_labels(case(name, dtype), seed)
    c = case(name, torch.float64)
    _, jac, _ = oracle.per_sample(c.model, c.inputs, labels, c.loss)
    return jac.detach().to(torch.float64)


# ------------------------------------------------------------------------------------------- K-FAC block oracle
def _linear_modules(model: torch.nn.Module, params: list[torch.Tensor]) -> list[tuple[torch.nn.Linear, list[str]]]:
    """The ``nn.Linear`` modules owning ``params`` and which of their ``weight`` / ``bias`` are among them."""
    ids = {id(p) for p in params}
    out = []
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            owned = [k for k in ("weight", "bias") if getattr(module, k) is not None and id(getattr(module, k)) in ids]
            if owned:
                out.append((module, owned))
    return out


@functools.lru_cache(maxsize=None)
def kfac_blocks(name: str, dtype: torch.dtype, kind: str, seed: int) -> list[tuple]:
    """Every preconditioned layer's ``(g [R, out], a [R', k], grad [out, k], where)`` with ``G = g^T g`` and
    ``A = a^T a``, by explicit per-sample passes (``sec:app-iEF-eNGDopt``, expand):
    ``A = 1/M sum_n 1/T sum_t a a^T`` (``[a, 1]`` with a trained bias), ``G = sum_n w_n sum_t g g^T`` with ``g`` the
    gradient of ``l_n`` (true labels, or for ``"kfac"`` the labels the package draws in ``dtype`` with ``seed``)
    w.r.t. the layer's output at position ``t``; ``w_n = 1 / s_n`` for ``"iekfac"`` (0 where ``s_n = 0``), else 1.
    ``grad = [grad_W, grad_b]`` from the dense oracle, so that its row-major ``vec`` matches ``G (x) A``; ``where``:
    ``[("weight" | "bias", index in the parameters)]``. The rows are kept, not only ``G`` and ``A``, so that a
    sensitivity check can round them as a float32 computation does (which breaks ``sum_c g_c = 0`` at ``eps``)."""
    c = case(name, torch.float64)
    model = c.model
    params = kfac_params(name, c) or oracle.trainable(model)
    modules = _linear_modules(model, params)
    labels = draw_labels(case(name, dtype), seed) if kind == "kfac" else c.targets
    dense = dense_oracle(name)
    weights = torch.ones(c.targets.shape[0], dtype=torch.float64)
    if kind == "iekfac":
        s = dense.logit_sqnorm
        weights = torch.where(s > 0, 1.0 / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(s))
    m = c.targets.shape[0]
    a_rows: list[list[torch.Tensor]] = [[] for _ in modules]  # rows scaled so that A = sum a a^T
    g_rows: list[list[torch.Tensor]] = [[] for _ in modules]  # rows scaled so that G = sum g g^T
    for n in range(m):
        calls: list[list] = [[] for _ in modules]
        hooks = [mod.register_forward_hook(lambda mod_, args, out, k=k: calls[k].append((args[0], out)))
                 for k, (mod, _) in enumerate(modules)]
        try:
            z = oracle.logits_of(model, oracle.take(c.inputs, n))
        finally:
            for h in hooks:
                h.remove()
        l_n = oracle.sample_loss(z, labels[n : n + 1], c.loss)
        outputs = [out for k in range(len(modules)) for _, out in calls[k]]
        grads = iter(torch.autograd.grad(l_n, outputs, allow_unused=True))
        for k, (mod, owned) in enumerate(modules):
            for x, out in calls[k]:
                g = next(grads)
                a = x.detach().reshape(-1, x.shape[-1]).to(torch.float64)
                if "bias" in owned:
                    a = torch.cat([a, torch.ones(a.shape[0], 1, dtype=torch.float64)], dim=1)
                if "weight" not in owned:
                    a = a[:, -1:]
                a_rows[k].append(a / math.sqrt(a.shape[0] * m))
                if g is not None:
                    g_rows[k].append(weights[n].sqrt() * g.detach().reshape(-1, g.shape[-1]).to(torch.float64))
    index = {id(p): i for i, p in enumerate(params)}
    offsets, at = {}, 0
    for p in oracle.trainable(model):
        offsets[id(p)] = (at, at + p.numel())
        at += p.numel()
    out = []
    for (mod, owned), a_list, g_list in zip(modules, a_rows, g_rows):
        g_mat = torch.cat(g_list) if g_list else torch.zeros(0, mod.out_features, dtype=torch.float64)
        parts, where = [], []
        if "weight" in owned:
            lo, hi = offsets[id(mod.weight)]
            parts.append(dense.gradient[lo:hi].reshape(mod.weight.shape))
            where.append(("weight", index[id(mod.weight)]))
        if "bias" in owned:
            lo, hi = offsets[id(mod.bias)]
            parts.append(dense.gradient[lo:hi].reshape(-1, 1))
            where.append(("bias", index[id(mod.bias)]))
        out.append((g_mat, torch.cat(a_list), torch.cat(parts, dim=1), where))
    return out


def kronecker_solve(g_factor: torch.Tensor, a_factor: torch.Tensor, grad: torch.Tensor, damping: float
                    ) -> torch.Tensor:
    """``(G (x) A + lambda I)^{-1} vec(grad)`` through the eigendecompositions of ``G`` and ``A`` (the eigenvalues of
    ``G (x) A`` are the products ``e_G e_A``; a dense ``eigh`` of the Kronecker block would err by ``eps max`` on each,
    too much for the small products these models have). ``lambda = 0``: the pseudo-inverse, products below
    ``1e3 k eps`` of the largest dropped (``k`` the block's side: below that a product's own rounding error exceeds
    ~0.1% and the pseudo-inverse is not determined in float64)."""
    eg, u = torch.linalg.eigh(g_factor)
    ea, v = torch.linalg.eigh(a_factor)
    prod = eg.clamp_min(0).unsqueeze(1) * ea.clamp_min(0).unsqueeze(0)
    if damping == 0:
        keep = prod > 1e3 * max(prod.shape) * torch.finfo(torch.float64).eps * prod.max()
        inv = torch.where(keep, 1.0 / torch.where(keep, prod, torch.ones_like(prod)), torch.zeros_like(prod))
    else:
        inv = 1.0 / (prod + damping)
    return u @ ((u.T @ grad @ v) * inv) @ v.T


def kfac_oracle_direction(name: str, dtype: torch.dtype, kind: str, seed: int, damping: float,
                          perturb: Callable[[torch.Tensor, int], torch.Tensor] | None = None) -> torch.Tensor:
    """The K-FAC direction from the dense factors of :func:`kfac_blocks` (:func:`kronecker_solve` per layer), in the
    order of :func:`kfac_params`, float64. ``perturb(tensor, salt)``: applied to the rows of ``G`` and ``A`` and to
    the gradient first (a rounding model, for the sensitivity of the solve)."""
    c = case(name, torch.float64)
    params = kfac_params(name, c) or oracle.trainable(c.model)
    sizes = [p.numel() for p in params]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    direction = torch.zeros(sum(sizes), dtype=torch.float64)
    for layer, (g_rows, a_rows, grad, where) in enumerate(kfac_blocks(name, dtype, kind, seed)):
        if perturb is not None:
            g_rows, a_rows, grad = (perturb(t, 3 * layer + i) for i, t in enumerate((g_rows, a_rows, grad)))
        solved = kronecker_solve(g_rows.T @ g_rows, a_rows.T @ a_rows, grad, damping)
        for part, i in where:
            piece = solved[:, :-1] if part == "weight" and len(where) == 2 else solved
            piece = solved[:, -1] if part == "bias" else piece
            direction[starts[i] : starts[i] + sizes[i]] = piece.reshape(-1)
    return direction


def kfac_dense_direction(name: str, dtype: torch.dtype, kind: str, seed: int, damping: float) -> torch.Tensor:
    """As :func:`kfac_oracle_direction` (``damping > 0``), by a dense solve of ``G (x) A + lambda I`` per layer: the
    definition itself, accurate where the block is well conditioned (``damping`` not far below its largest
    eigenvalue)."""
    c = case(name, torch.float64)
    params = kfac_params(name, c) or oracle.trainable(c.model)
    sizes = [p.numel() for p in params]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    direction = torch.zeros(sum(sizes), dtype=torch.float64)
    for g_rows, a_rows, grad, where in kfac_blocks(name, dtype, kind, seed):
        block = torch.kron(g_rows.T @ g_rows, a_rows.T @ a_rows)
        eye = torch.eye(block.shape[0], dtype=torch.float64)
        solved = torch.linalg.solve(block + damping * eye, grad.reshape(-1)).reshape(grad.shape)
        for part, i in where:
            piece = solved[:, :-1] if part == "weight" and len(where) == 2 else solved
            piece = solved[:, -1] if part == "bias" else piece
            direction[starts[i] : starts[i] + sizes[i]] = piece.reshape(-1)
    return direction
