"""What a per-sample forward proves once, a steady call reuses; a change it rests on proves again.

:func:`ief.per_sample` proves each hooked call's sample axis (a one-sample probe forward and reverse-order proof
forwards), records the floating formats the forward ran in (a global module hook on every module call) and, for the
forward-mode users, watches once for parameters rebound inside the forward. A steady call (same model, hooks, dtypes,
shapes) must run none of them again: they cost forwards and slow every module call. The key is
:func:`ief.model_call.forward_signature`; these tests hold that a steady call proves nothing, and that a changed shape,
dtype, module, hook, mode or autocast state proves again, with a case for each cache that gives a wrong answer when the
cache is stale (a hook that gathers rows across the batch; a hook that runs a layer in bfloat16; a module that
re-casts itself).
"""
from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ief
from ief.jacobian.capture import PerSampleCapture
from ief.logit_jvp import forward_mode_hazard
from ief.model_call import ReplayableForward
from ief.precision import rounding_dtype

M, T, D, H, C = 4, 3, 5, 6, 3


class Up(torch.nn.Module):
    """Back to float32 after a layer run in bfloat16."""

    def forward(self, x):
        return x.float() if x.dtype == torch.bfloat16 else x


class TokenNet(torch.nn.Module):
    """``[M, T, D]`` tokens: a Linear, a free slot (``nn.Identity``), back to float32, a Linear, the mean over
    tokens."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(D, H)
        self.slot = torch.nn.Identity()
        self.up = Up()
        self.out = torch.nn.Linear(H, C)

    def forward(self, x):
        return self.out(self.up(self.slot(torch.tanh(self.inp(x))))).mean(dim=1)


def _setup(dtype=torch.float32, t=T):
    torch.manual_seed(0)
    model = TokenNet().to(dtype)
    x = torch.randn(M, t, D, dtype=dtype)
    return model, x, torch.randint(0, C, (M,))


def _counting(monkeypatch) -> collections.Counter:
    """Counts of the proofs' forwards: the one-sample probe, the reverse-order proof, the precision watch."""
    counts: collections.Counter = collections.Counter()
    probe, prove = PerSampleCapture.probe_shapes, PerSampleCapture.prove_axes
    register = torch.nn.modules.module.register_module_forward_hook

    def counted(key, fn):
        def wrapper(*args, **kwargs):
            counts[key] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(PerSampleCapture, "probe_shapes", counted("probe", probe))
    monkeypatch.setattr(PerSampleCapture, "prove_axes", counted("prove", prove))
    monkeypatch.setattr(torch.nn.modules.module, "register_module_forward_hook", counted("watch", register))
    return counts


def _reference(model, x, y) -> torch.Tensor:
    """Row ``n``: the gradient of sample ``n``'s loss in the batch forward, by ``M`` backward passes (the definition,
    whatever the model does across samples)."""
    params = [p for p in model.parameters() if p.requires_grad]
    losses = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
    rows = [torch.autograd.grad(losses[n], params, retain_graph=True) for n in range(M)]
    return torch.stack([torch.cat([g.reshape(-1) for g in row]) for row in rows])


def test_a_steady_call_runs_no_proof(monkeypatch):
    model, x, y = _setup()
    counts = _counting(monkeypatch)
    first = ief.per_sample(model, x, y).jacobian
    proven = dict(counts)
    assert proven == {"probe": 1, "prove": 1, "watch": 1}
    for form in ("dense", "dense", "auto"):
        ief.per_sample(model, x, y, form=form)
    assert dict(counts) == proven  # three steady calls: no probe, no proof forward, no watched forward
    assert torch.equal(ief.per_sample(model, x, y).jacobian, first)


def _new_shape(model, x):
    return model, torch.cat([x, x[:, :1]], dim=1)


def _new_dtype(model, x):
    return model.double(), x.double()


def _new_module(model, x):
    model.slot = torch.nn.Identity()
    return model, x


def _module_hook(model, x):
    model.slot.register_forward_hook(lambda module, args, output: output)
    return model, x


def _global_hook(model, x):
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, output: output)
    _global_hook.handles.append(handle)
    return model, x


_global_hook.handles = []


def _eval_mode(model, x):  # a fresh module is in training mode
    return model.eval(), x


@pytest.mark.parametrize("change", [_new_shape, _new_dtype, _new_module, _module_hook, _global_hook, _eval_mode])
def test_a_change_the_proofs_rest_on_proves_again(monkeypatch, change):
    model, x, y = _setup()
    ief.per_sample(model, x, y)
    counts = _counting(monkeypatch)
    try:
        model, x = change(model, x)
        ief.per_sample(model, x, y)
        assert counts["probe"] == 1 and counts["prove"] == 1, dict(counts)
        assert counts["watch"] >= 1, dict(counts)
        ief.per_sample(model, x, y)
        assert counts["probe"] == 1 and counts["prove"] == 1, dict(counts)  # and the new proof is reused
    finally:
        while _global_hook.handles:
            _global_hook.handles.pop().remove()


def test_a_step_measured_under_a_memory_tracker_reuses_its_proofs(monkeypatch):
    """torch's MemTracker registers global hooks that only observe (ModTracker's): a warmed call measured under it
    proves nothing again (a probe forward there would be refused, and the call fall back to the per-sample loop),
    while a global hook of the user's still proves again (above)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    model, x, y = _setup()
    first = ief.per_sample(model, x, y).jacobian
    counts = _counting(monkeypatch)
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        tracked = ief.per_sample(model, x, y).jacobian
    assert counts["probe"] == 0 and counts["prove"] == 0, dict(counts)
    assert torch.equal(tracked, first)


def test_autocast_is_watched_again():
    model, x, y = _setup()
    ief.per_sample(model, x, y)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        jac = ief.per_sample(model, x, y).jacobian
    assert rounding_dtype(jac) == torch.bfloat16  # a precision record kept from the float32 call would say float32
    assert rounding_dtype(ief.per_sample(model, x, y).jacobian) == torch.float32


def test_a_hook_that_runs_a_layer_in_bfloat16_is_recorded():
    """The formats are those of this forward: a hook added after the first call (the slot's input cast to bfloat16)
    must mark J with bfloat16's rounding, as a first call would."""
    model, x, y = _setup()
    assert rounding_dtype(ief.per_sample(model, x, y).jacobian) == torch.float32
    model.slot.register_forward_pre_hook(lambda module, args: (args[0].bfloat16(),))
    assert rounding_dtype(ief.per_sample(model, x, y).jacobian) == torch.bfloat16


def test_a_hook_that_gathers_rows_across_the_batch_is_not_trusted_on_the_old_proof():
    """A pre-hook that rolls the first Linear's input by one token over the flattened batch keeps every shape (the
    old proof's key) but leaves that call without a sample axis: the rows must be those of the batch forward (its
    module takes the exact loop), not the hooked rows the cached axis would give."""
    model, x, y = _setup(torch.float64)
    ief.per_sample(model, x, y)  # proven and cached without the hook
    model.inp.register_forward_pre_hook(lambda module, args: (args[0].reshape(-1, D).roll(1, 0).view(args[0].shape),))
    with pytest.warns(ief.jacobian.SlowPathWarning):
        jac = ief.per_sample(model, x, y).jacobian
    ref = _reference(model, x, y)
    assert float((jac - ref).norm() / ref.norm()) < 1e-12


class Recast(torch.nn.Module):
    """Re-casts its Linear inside its forward (``.data`` assigned), as SwitchTransformers' router does."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(H, H)

    def forward(self, x):
        self.inner = self.inner.to(x.dtype)
        return self.inner(x)


def test_the_forward_mode_hazard_is_watched_again_after_a_module_changes():
    model, x, _ = _setup()
    assert forward_mode_hazard(ReplayableForward(model, x)) is None
    assert forward_mode_hazard(ReplayableForward(model, x)) is None  # kept
    model.slot = Recast()  # a verdict kept per model alone would let forward mode run on it
    assert ".data" in forward_mode_hazard(ReplayableForward(model, x))


class _Operators(TorchDispatchMode):
    """The number of aten operators dispatched while active (forward and backward: after autograd)."""

    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.total += 1
        return func(*args, **(kwargs or {}))


def _operators(call) -> int:
    with _Operators() as counter:
        call()
    return counter.total


def _tiny_gpt2():
    """A full-parameter GPT-2 (HF ``Conv1D`` layers, the position table fed ``[1, T]`` ids, its tied token table
    frozen) on ``[M, T]`` tokens with next-token targets."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=2, n_head=2, n_inner=32, bos_token_id=0,
                     eos_token_id=0)
    model = GPT2LMHeadModel(cfg).eval()
    model.transformer.wte.weight.requires_grad_(False)
    ids = torch.randint(1, 40, (M, 9))
    targets = ids[:, 1:].clone()
    targets[:, -1] = ief.IGNORE_INDEX
    return model, {"input_ids": ids[:, :-1]}, targets


# what a steady call with the default check may dispatch beyond the same call with every check off
STEADY_CHECK_OPERATORS = 0


@pytest.mark.parametrize("build", [_setup, _tiny_gpt2], ids=["tokens", "gpt2"])
@pytest.mark.parametrize("form", ["dense", "auto"])
def test_a_steady_call_dispatches_what_an_unchecked_call_does(build, form):
    """Operators are the device-independent cost of a call (each a kernel launch on a GPU): a steady call with the
    default check (its proofs, precision record and guard already settled for this signature) dispatches no more of
    them than the same call with ``check=False``. The first call's proofs are visible to the count (its probe and
    proof forwards), so a proof or a pass over ``J`` that came back to every call would fail this test (as the
    column-block finiteness pass that once cost full-parameter BERT ~20 % of a backward would)."""
    model, x, y = build()
    first = _operators(lambda: ief.per_sample(model, x, y, form=form))
    ief.per_sample(model, x, y, form=form)
    steady = _operators(lambda: ief.per_sample(model, x, y, form=form))
    ief.per_sample(model, x, y, check=False, form=form)
    unchecked = _operators(lambda: ief.per_sample(model, x, y, check=False, form=form))
    assert steady <= unchecked + STEADY_CHECK_OPERATORS, (steady, unchecked)
    assert first > steady + 20, (first, steady)  # the proofs' forwards, counted


def _mlp(width: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(D, width), torch.nn.Tanh(), torch.nn.Linear(width, width),
                                torch.nn.Tanh(), torch.nn.Linear(width, C))
    return model, torch.randn(M, D), torch.randint(0, C, (M,))


@pytest.mark.parametrize("form", ["dense", "auto"])
def test_a_steady_call_dispatches_as_many_operators_whatever_the_parameter_count(form):
    """The operators of a steady call do not grow with ``P``: the same layers 8 and 600 wide (``P`` 147 and 366k,
    six column blocks of ``ief.model_call.COLUMN_CHUNK``) dispatch the same number. A pass over ``J`` by column blocks
    (a finiteness flag per block, as full-parameter BERT's steady call once paid at ~20 % of a backward) grows with
    ``P`` and fails this test."""
    counts = []
    for width in (8, 600):
        model, x, y = _mlp(width)
        for _ in range(2):
            ief.per_sample(model, x, y, form=form)
        counts.append(_operators(lambda: ief.per_sample(model, x, y, form=form)))
    assert counts[0] == counts[1], counts
