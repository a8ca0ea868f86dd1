"""Models the package was not designed around, checked against explicit loops and a peer library.

A CNN, a GRU classifier, an LSTM tagger with ``-100`` positions, a residual MLP with LayerNorm and torch's own
``nn.TransformerEncoderLayer`` (``batch_first`` True and False, ``T == M`` and ``T != M``), each in train and eval
mode, float64 and float32:

- ``per_sample`` (``J``, losses, ``s_iEF``; ``check="exact"``) against the explicit per-sample float64 loop of
  ``tests/oracle.py``;
- ``fisher_vp`` (both methods) and ``gamma`` against curvlinops' ``GGNLinearOperator`` (the Fisher is the GGN for
  softmax cross-entropy, ``sec:app-eval-complexity``), built on the positions that are not ignored;
- the iEF direction (``eqn:iEF_lsq``) against the one formed from the oracle's ``J``.

Plus cases once silently wrong: ``T == M`` and ``T != M`` on consecutive calls and optimiser steps (the sample axis of a
sequence-first layer is established per call, never guessed), the transformer fast path, float32 ``nn.LSTM``
(oneDNN), ``torch.compile`` and ``nn.DataParallel`` under forward-mode AD, and one ``SlowPathWarning`` per model.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from curvlinops import GGNLinearOperator
from torch.nn.attention import SDPBackend, sdpa_kernel

import ief
import oracle
from tiny_models import SquareNoJvp

IGNORE = -100
CLASSES = 3


class CNN(torch.nn.Module):
    def __init__(self, padding_mode: str = "zeros"):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 2, 3, padding=1 if padding_mode != "zeros" else 0, padding_mode=padding_mode)
        self.head = torch.nn.Linear(2 * 3 * 3, CLASSES)

    def forward(self, x):  # [M, 1, 5, 5]
        h = torch.relu(self.conv(x))
        return self.head(h[..., 1:-1, 1:-1].flatten(1) if self.conv.padding_mode != "zeros" else h.flatten(1))


class GRUClassifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gru = torch.nn.GRU(3, 4, batch_first=True)
        self.head = torch.nn.Linear(4, CLASSES)

    def forward(self, x):  # [M, T, 3]
        return self.head(self.gru(x)[0][:, -1])


class LSTMTagger(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(7, 3)
        self.lstm = torch.nn.LSTM(3, 4, batch_first=True)
        self.head = torch.nn.Linear(4, CLASSES)

    def forward(self, tokens):  # [M, T]
        return self.head(self.lstm(self.embed(tokens))[0])


class ResidualMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(4, 5)
        self.block = torch.nn.Sequential(torch.nn.LayerNorm(5), torch.nn.Linear(5, 5), torch.nn.GELU())
        self.norm = torch.nn.LayerNorm(5)
        self.head = torch.nn.Linear(5, CLASSES)

    def forward(self, x):  # [M, 4]
        h = self.inp(x)
        return self.head(self.norm(h + self.block(h)))


class Encoder(torch.nn.Module):
    """torch's TransformerEncoderLayer as a tagger; inputs and logits batch-first, the layer either way."""

    def __init__(self, batch_first: bool):
        super().__init__()
        self.batch_first = batch_first
        self.layer = torch.nn.TransformerEncoderLayer(4, 2, 6, dropout=0.0, batch_first=batch_first)
        self.head = torch.nn.Linear(4, CLASSES)

    def forward(self, x):  # [M, T, 4]
        h = self.layer(x if self.batch_first else x.transpose(0, 1))
        return self.head(h if self.batch_first else h.transpose(0, 1))


def _batch(name: str, m: int, t: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    if name.startswith("cnn"):
        return torch.randn(m, 1, 5, 5, generator=g, dtype=dtype), torch.randint(0, CLASSES, (m,), generator=g)
    if name == "gru":
        return torch.randn(m, t, 3, generator=g, dtype=dtype), torch.randint(0, CLASSES, (m,), generator=g)
    if name == "residual-mlp":
        return torch.randn(m, 4, generator=g, dtype=dtype), torch.randint(0, CLASSES, (m,), generator=g)
    targets = torch.randint(0, CLASSES, (m, t), generator=g)
    targets[0, -1] = IGNORE  # ignored positions, one sample with a single kept position
    targets[-1, 1:] = IGNORE
    if name == "lstm-tagger":
        return torch.randint(0, 7, (m, t), generator=g), targets
    return torch.randn(m, t, 4, generator=g, dtype=dtype), targets


MODELS = {
    "cnn": CNN,  # hooked (unfold, ief.jacobian.rules.conv)
    "cnn-reflect": lambda: CNN("reflect"),  # reflect padding: the per-sample loop
    "gru": GRUClassifier,
    "lstm-tagger": LSTMTagger,
    "residual-mlp": ResidualMLP,
    "encoder-batch-first": lambda: Encoder(True),
    "encoder-seq-first": lambda: Encoder(False),
}


def _case(name: str, mode: str, dtype: torch.dtype, m: int = 4, t: int = 5, seed: int = 0):
    torch.manual_seed(seed)
    model = MODELS[name]().to(dtype)
    model.train(mode == "train")
    inputs, targets = _batch(name, m, t, dtype, seed)
    return model, inputs, targets


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _tol(dtype: torch.dtype) -> float:
    return 1e-10 if dtype == torch.float64 else 2e-4


def _oracle64(model, inputs, targets):
    """The explicit per-sample loop on a float64 copy of the model."""
    ref = _copy(model, torch.float64)
    x = inputs.double() if inputs.dtype.is_floating_point else inputs
    return oracle.per_sample(ref, x, targets)


def _copy(model, dtype):
    return copy.deepcopy(model).to(dtype)


class _KeptLogits(torch.nn.Module):
    """The model's logits at the kept positions, ``[K, C]``: the GGN sums over positions, whatever the samples."""

    def __init__(self, model: torch.nn.Module, keep: torch.Tensor):
        super().__init__()
        self.model = model
        self.keep = keep

    def forward(self, x):
        z = self.model(x)
        return z.reshape(-1, z.shape[-1])[self.keep]


def _ggn(model, inputs, targets) -> torch.Tensor:
    """curvlinops' dense GGN of the summed cross-entropy over the kept positions, ``[P, P]`` (float64 copy)."""
    ref = _copy(model, torch.float64)
    x = inputs.double() if inputs.dtype.is_floating_point else inputs
    keep = targets.reshape(-1) != IGNORE
    params = [p for p in ref.parameters() if p.requires_grad]

    ggn = GGNLinearOperator(
        _KeptLogits(ref, keep), torch.nn.CrossEntropyLoss(reduction="sum"), params, [(x, targets.reshape(-1)[keep])],
        check_deterministic=False,
    )
    size = sum(p.numel() for p in params)
    # curvlinops differentiates in forward mode too: the reference kernels (plain torch switches, not ief's)
    fastpath, mkldnn = torch.backends.mha.get_fastpath_enabled(), torch.backends.mkldnn.enabled
    torch.backends.mha.set_fastpath_enabled(False)
    torch.backends.mkldnn.enabled = False
    try:
        with sdpa_kernel(SDPBackend.MATH):
            return ggn @ torch.eye(size, dtype=torch.float64)
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
        torch.backends.mkldnn.enabled = mkldnn


FOREIGN = [
    pytest.param(name, mode, dtype, id=f"{name}-{mode}-{str(dtype)[6:]}")
    for name in MODELS
    for mode in ("train", "eval")
    for dtype in (torch.float64, torch.float32)
]


@pytest.mark.parametrize("name, mode, dtype", FOREIGN)
def test_foreign_model_matches_loop_and_curvlinops(name, mode, dtype):
    """J, losses, s_iEF, the iEF direction, F v (both methods) and gamma of a foreign model agree with explicit
    per-sample loops (float64) and with curvlinops' GGN."""
    model, inputs, targets = _case(name, mode, dtype)
    tol = _tol(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ief.SlowPathWarning)  # conv / RNN / attention projections take the loop
        got = ief.per_sample(model, inputs, targets, check="exact")
    losses, jac, sq = _oracle64(model, inputs, targets)
    assert got.jacobian.dtype == dtype
    assert _rel(got.jacobian, jac) < tol
    assert _rel(got.losses, losses) < tol
    assert _rel(got.logit_sqnorm, sq) < tol
    assert _rel(ief.ief_direction(got.jacobian, got.logit_sqnorm, 1e-6), ief.ief_direction(jac, sq, 1e-6)) < 50 * tol

    fisher = _ggn(model, inputs, targets)
    gen = torch.Generator().manual_seed(1)
    v = torch.randn(fisher.shape[0], generator=gen, dtype=torch.float64)
    for method in ("forward", "double_backward"):
        fv = ief.fisher_vp(model, inputs, targets, v.to(dtype), method=method)
        assert _rel(fv, fisher @ v) < tol, method
    expected = float(v @ fisher @ v) ** 0.5 / abs(float(v @ jac.sum(0)))
    assert abs(ief.gamma(model, inputs, targets, v.to(dtype)) - expected) < tol * expected


# ----------------------------------------------------- a sequence-first layer: the sample axis established per call
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_sequence_first_layer_with_t_equal_and_unequal_to_m_on_consecutive_calls(mode):
    """A sequence-first TransformerEncoderLayer sees ``[T, M, E]``. Its sample axis is established per call (a
    one-sample probe), not guessed from sizes: ``T == M`` and ``T != M`` in any order give the oracle's rows, and the
    layer's Linear / LayerNorm parameters use the hooks (only the attention projections take the loop)."""
    model, _, _ = _case("encoder-seq-first", mode, torch.float64, m=4, t=4)
    for t in (6, 4, 4, 3, 4, 5):
        inputs, targets = _batch("encoder-seq-first", 4, t, torch.float64, seed=t)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = ief.per_sample(model, inputs, targets)
        _, jac, _ = _oracle64(model, inputs, targets)
        assert _rel(got.jacobian, jac) < 1e-10, f"T={t}"
        for w in caught:
            if issubclass(w.category, ief.SlowPathWarning):
                assert "linear1" not in str(w.message) and "norm1" not in str(w.message)


def _exact_ief_direction(model, inputs, targets, damping):
    _, jac, sq = oracle.per_sample(model, inputs, targets)
    return ief.ief_direction(jac, sq, damping)


@pytest.mark.parametrize("steps", [(6, 4, 4), (4, 6, 4)], ids=["T!=M-first", "T==M-first"])
def test_optimiser_steps_alternating_t_equal_and_unequal_to_m(steps):
    """Through ``ief.optim.IEF``: whichever of ``T == M`` / ``T != M`` comes first (the optimiser's exact check runs
    on step 0 only), every update is the exact iEF update of the explicit per-sample loop."""
    model, _, _ = _case("encoder-seq-first", "train", torch.float64, m=4)
    lr, damping = 1e-3, 1e-7
    opt = ief.optim.IEF(model, lr=lr, damping=damping)
    for k, t in enumerate(steps):
        inputs, targets = _batch("encoder-seq-first", 4, t, torch.float64, seed=10 + k)
        expected = _exact_ief_direction(model, inputs, targets, damping)
        before = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ief.SlowPathWarning)
            opt.step(inputs, targets)
        after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        assert _rel((before - after) / lr, expected) < 1e-8, f"step {k} (T={t})"


def test_time_major_call_inside_a_batch_first_model_is_hooked_along_dim_1():
    """A Linear applied to ``x.transpose(0, 1)`` (``[T, M, D]``) with ``T == M``: hooked along dimension 1 and exact."""

    class TimeMajor(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, CLASSES)

        def forward(self, x):
            return self.lin(x.transpose(0, 1)).transpose(0, 1)

    torch.manual_seed(0)
    model = TimeMajor().double()
    for t in (3, 5, 3):
        x, y = torch.randn(3, t, 3, dtype=torch.float64), torch.randint(0, CLASSES, (3, t))
        with warnings.catch_warnings():
            warnings.simplefilter("error", ief.SlowPathWarning)  # the Linear is hooked, not looped
            got = ief.per_sample(model, x, y)
        assert _rel(got.jacobian, oracle.per_sample(model, x, y)[1]) < 1e-12


def test_call_without_a_sample_axis_takes_the_loop():
    """A Linear fed the batch flattened across samples ``[M*T, D]``: no dimension is the samples, so the layer
    takes the exact per-sample loop, with a SlowPathWarning naming it."""

    class Flattened(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, CLASSES)

        def forward(self, x):  # [M, T, 3]
            m, t, _ = x.shape
            return self.lin(x.reshape(m * t, 3)).reshape(m, t, CLASSES)

    torch.manual_seed(0)
    model = Flattened().double()
    x, y = torch.randn(3, 3, 3, dtype=torch.float64), torch.randint(0, CLASSES, (3, 3))
    with pytest.warns(ief.SlowPathWarning, match=r"lin\.weight, lin\.bias \(Linear input shapes \(9, 3\)"):
        got = ief.per_sample(model, x, y)
    assert _rel(got.jacobian, oracle.per_sample(model, x, y)[1]) < 1e-12


# --------------------------------------------- forward-mode AD through fast paths, torch.compile and DataParallel
def _all_forward_mode_paths(model, inputs, targets):
    """gamma (forward mode), fisher_vp(method="forward"), per_sample(check="exact") and an optimiser's first step."""
    params = [p for p in model.parameters() if p.requires_grad]
    v = torch.randn(sum(p.numel() for p in params), generator=torch.Generator().manual_seed(3)).to(params[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ief.SlowPathWarning)
        g = ief.gamma(model, inputs, targets, v)
        fv = ief.fisher_vp(model, inputs, targets, v, method="forward")
        fv_db = ief.fisher_vp(model, inputs, targets, v, method="double_backward")
        ief.per_sample(model, inputs, targets, check="exact")
        ief.optim.IEF(model, lr=1e-4).step(inputs, targets)
    return g, fv, fv_db


@pytest.mark.parametrize("module", ["encoder-layer", "multihead-attention"])
def test_eval_mode_attention_fast_path_is_turned_off(module):
    """In eval mode torch routes attention through fused kernels without forward-mode rules; ief switches the fast
    path off inside its computations (and restores the user's setting)."""
    torch.manual_seed(0)
    if module == "encoder-layer":
        model = Encoder(True).float().eval()
    else:

        class MHA(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.attn = torch.nn.MultiheadAttention(4, 2, batch_first=True)
                self.head = torch.nn.Linear(4, CLASSES)

            def forward(self, x):
                return self.head(self.attn(x, x, x, need_weights=False)[0])

        model = MHA().float().eval()
    x, y = _batch("encoder-batch-first", 3, 5, torch.float32)
    g, fv, fv_db = _all_forward_mode_paths(model, x, y)
    assert _rel(fv, fv_db) < 1e-4 and g > 0
    assert torch.backends.mha.get_fastpath_enabled()


def test_float32_lstm_runs_without_onednn_under_forward_mode():
    model, x, y = _case("lstm-tagger", "train", torch.float32)
    g, fv, fv_db = _all_forward_mode_paths(model, x, y)
    assert _rel(fv, fv_db) < 1e-4 and g > 0
    assert torch.backends.mkldnn.enabled  # the user's setting is restored


@pytest.mark.parametrize("wrapper", ["compile", "data-parallel"])
def test_compiled_and_data_parallel_models_are_run_through_their_module(wrapper):
    """``torch.compile`` and ``nn.DataParallel`` wrap the same parameters: ief runs the eager module inside, with the
    same numbers as on the plain model (DataParallel used to fail: "stateless API can't be used")."""
    model, x, y = _case("residual-mlp", "train", torch.float64)
    wrapped = torch.compile(model) if wrapper == "compile" else torch.nn.DataParallel(model)
    plain = ief.per_sample(model, x, y)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = ief.per_sample(wrapped, x, y, check="exact")
        ief.per_sample(wrapped, x, y)
    said = [str(w.message) for w in caught if "torch.compile'd" in str(w.message)]
    assert len(said) == (1 if wrapper == "compile" else 0), said  # said once per model, and only for compile
    assert not said or "runs its eager module (model._orig_mod)" in said[0]
    assert torch.equal(got.jacobian, plain.jacobian)
    v = torch.randn(plain.jacobian.shape[1], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert ief.gamma(wrapped, x, y, v) == ief.gamma(model, x, y, v)
    forward = ief.fisher_vp(model, x, y, v, method="forward")
    assert torch.equal(ief.fisher_vp(wrapped, x, y, v, method="forward"), forward)
    ief.optim.IEF(wrapped, lr=1e-3).step(x, y)


# ---------------------------------------------------------------- one SlowPathWarning per model, naming the tensors
@pytest.mark.parametrize(
    "name, looped",
    [
        ("cnn-reflect", ["conv.weight", "conv.bias"]),
        ("gru", ["gru.weight_ih_l0", "gru.weight_hh_l0", "gru.bias_ih_l0", "gru.bias_hh_l0"]),
        ("lstm-tagger", ["lstm.weight_ih_l0", "lstm.weight_hh_l0"]),  # attention is hooked
    ],
)
def test_slow_path_warns_once_per_model_naming_the_parameters(name, looped):
    model, x, y = _case(name, "train", torch.float64)
    with pytest.warns(ief.SlowPathWarning) as record:
        ief.per_sample(model, x, y)
    message = str(record[0].message)
    assert all(n in message for n in looped), message
    assert "head.weight" not in message  # hooked parameters are not listed
    with warnings.catch_warnings():
        warnings.simplefilter("error", ief.SlowPathWarning)
        ief.per_sample(model, x, y)  # the same model: no second warning
        ief.optim.IEF(model, lr=1e-4).step(x, y)


def test_bare_parameter_warns():
    class Bare(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, CLASSES, dtype=torch.float64))

        def forward(self, x):
            return x @ self.w

    x, y = torch.randn(3, 4, dtype=torch.float64), torch.tensor([0, 1, 2])
    with pytest.warns(ief.SlowPathWarning, match=r"\bw \(a bare parameter of Bare"):
        ief.per_sample(Bare(), x, y)


class _SquareLayer(torch.nn.Module):
    def forward(self, x):
        return SquareNoJvp.apply(x)


class _CustomOpModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(4, 5)
        self.square = _SquareLayer()
        self.head = torch.nn.Linear(5, CLASSES)

    def forward(self, x):
        return self.head(self.square(self.inp(x)))


def test_layer_without_forward_mode_rule_falls_back_or_names_the_module():
    """A custom ``autograd.Function`` without ``jvp``: gamma and the exact check switch to double backward (same
    values); an explicit ``fisher_vp(method="forward")`` raises one clear error naming the module and the way out."""
    torch.manual_seed(0)
    model = _CustomOpModel().double()
    x, y = _batch("residual-mlp", 4, 1, torch.float64)
    v = torch.randn(sum(p.numel() for p in model.parameters()), generator=torch.Generator().manual_seed(0),
                    dtype=torch.float64)
    got = ief.per_sample(model, x, y, check="exact")
    assert _rel(got.jacobian, oracle.per_sample(model, x, y)[1]) < 1e-12
    assert ief.gamma(model, x, y, v) == pytest.approx(ief.gamma(model, x, y, v, method="double_backward"), rel=1e-12)
    with pytest.raises(ief.ForwardModeUnsupported, match=r"module 'square' \(_SquareLayer\).*double_backward"):
        ief.fisher_vp(model, x, y, v, method="forward")
    ief.optim.IEF(model, lr=1e-3).step(x, y)  # the first step runs the exact check


@pytest.mark.filterwarnings("ignore::ief.SlowPathWarning")
def test_gpt2_with_its_lm_head_tied_to_the_token_table_is_exact():
    """GPT-2's ``lm_head`` is ``wte``'s table (tied): before, refused with a message offering ``check=False``, whose
    rows were 44 % wrong; then ``wte`` took the per-sample loop. Now the table is hooked in ``wte`` and ``lm_head``
    both (its rows the sum of theirs): the oracle's rows with every check, and the exact iEF direction."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    config = GPT2Config(vocab_size=30, n_positions=8, n_embd=8, n_layer=1, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=1)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).double().train()
    assert model.lm_head.weight is model.transformer.wte.weight
    gen = torch.Generator().manual_seed(1)
    inputs = {"input_ids": torch.randint(0, 30, (3, 5), generator=gen)}
    targets = torch.randint(0, 30, (3, 5), generator=gen)
    _, jac, sq = oracle.per_sample(model, inputs, targets)
    for check in (True, False, "exact"):
        got = ief.per_sample(model, inputs, targets, check=check)
        assert _rel(got.jacobian, jac) < 1e-10, check
    direction = ief.ief_direction(ief.per_sample(model, inputs, targets, form="auto").jacobian, sq, 1e-3)
    assert _rel(direction, _exact_ief_direction(model, inputs, targets, 1e-3)) < 1e-8
