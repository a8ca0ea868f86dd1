"""Stochastic optimisers with the exact iEF, EF and SF updates (``alg:iEF``, ``alg:EF``, ``alg:SF``).

Unlike first-order optimisers, a step needs the per-sample gradients, so the optimiser runs the forward and backward
itself. The calling convention::

    opt = ief.optim.IEF(model)                             # model: any nn.Module, e.g. a peft model
    for inputs, targets in loader:
        loss = opt.step(inputs, targets)                  # forward, per-sample backward, update; returns L

``inputs`` is what the model takes (a tensor, a tuple, or a dict passed as ``model(**inputs)``), ``targets`` are
class indices with ``-100`` for ignored positions (or float targets with ``loss="mse"``). Causal LMs: the logits at
position ``t`` predict token ``t + 1``; pass ``ief.causal_lm_targets(labels)``, not Hugging Face's unshifted
``labels`` (a step warns when the targets equal ``inputs["input_ids"]``). There is no ``.grad`` to zero and no
closure: ``step()`` and ``step(closure)`` raise ``TypeError`` saying so. For the same reason
``transformers.Trainer(optimizers=(opt, None))`` is not supported: its loop runs its own forward and backward and
then calls ``optimizer.step()`` (overriding ``Trainer.training_step`` alone does not help, that call still follows),
so the batch never reaches the optimiser; write the loop above, or use :class:`ief.hf.IEFTrainer`, whose
``training_step`` hands the batch to the optimiser. ``lr`` and ``damping`` live in ``param_groups`` so
torch LR schedulers work, and ``state_dict()`` / ``load_state_dict()`` round-trip the step counter, the momentum
buffers (and SF's ``generator`` state). The state is the optimiser's: ``state_dict()["ief_optimizer"]`` records the
class and the settings that change the method (``normalize``, ``loss``, ``reduction``; K-FAC's kind), and
``load_state_dict`` refuses another method's state (e.g. IEF's into EF, which would run with IEF's saved
``normalize`` and ``damping``) or a torch optimiser's (``ForeignStateError``, a ``ValueError`` naming both); a state
saved before the class was recorded loads when its ``normalize`` matches.

Several processes (data parallel: torchrun, accelerate, DDP): ``IEF``, ``EF`` and ``SF`` take ``process_group=``
(default: the group of a ``torch.nn.parallel.DistributedDataParallel`` model, else one process) and then step exactly
as one process stepping on the union of the ranks' batches, concatenated in rank order (:mod:`ief.distributed`: the
union's Gram on every rank, one replicated float64 solve, one all-reduce of the direction; the token count of
``reduction="mean"`` and the returned loss are the union's; momentum and weight decay replicated). The model's own DDP
gradient all-reduce never runs (the optimiser runs the wrapped module). A failure on one rank (a non-finite loss, a
refused check) raises on every rank. SF draws each rank's labels with that rank's ``generator``: the union-batch
equivalence holds given the same labels (seed each rank's generator, e.g. ``seed + rank``, for reproducible runs).
Without a group, an initialised ``torch.distributed`` of world size > 1 is refused (each replica would solve its own
batch's Gram system and drift apart silently). ``KFAC`` takes ``process_group=`` too (the union batch's factors:
:mod:`ief.optim.kfac`).

Momentum and weight decay (``momentum``, ``dampening``, ``weight_decay``; all 0 by default, which is the paper's
exact update bit for bit): heavy-ball momentum on the batch's preconditioned step and AdamW's decoupled weight
decay, derived in :mod:`ief.optim.momentum` (the paper's ``sec:app-limitations`` leaves both to future work).

One joint direction: the update preconditions all the parameters jointly (one ``J``, one Gram system), so
``add_param_group`` after construction raises ``ValueError`` (a group added to a torch optimiser is expected to be
updated, and it would not be; per-group rates would scale blocks of the direction, which is then no longer iEF's).
Choose the parameters once, ``params=[...]`` (default: every trainable one); groups that differ only in
``weight_decay`` are given as ``params=[{"params": [...], "weight_decay": 0.0}, ...]``, and every other value in
``param_groups`` must agree across groups (checked at every step).

**Loss convention** (``reduction``, torch's word). ``"sum"`` (default): the optimiser minimises ``L = sum_n l_n``,
this package's convention, with ``l_n`` the sum over sample ``n``'s counted positions. ``"mean"``: ``lr`` and
``damping`` are values for the mean ``L / K`` over the batch's ``K`` counted target positions (tokens; entries of the
target for ``loss="mse"``), the convention of Hugging Face's ``outputs.loss`` and of the paper's released code, so
the paper's hyperparameters mean what the paper means; every step converts them for its batch's ``K``
(:func:`ief.optim.convention.to_sum_convention`, derivation in :mod:`companion.experiments.convention`: iEF's rate by
``1/K``, un-normalised EF/SF's by ``K``, normalised updates unchanged, the damping by ``K^2``), and ``step`` returns
``L / K``. ``param_groups`` keep the given values (a scheduler acts on them).

Bad values are refused before anything changes: the constructor checks ``lr`` (finite, > 0, or ``"auto"``), ``damping``
(finite, >= 0; > 0 for SF), ``total_steps``, ``momentum`` (in [0, 1)), ``dampening`` (in [0, 1]), ``weight_decay``
(finite, >= 0, ``lr * weight_decay < 1``) and ``check``; every ``step`` checks the values it is about to use again,
because a scheduler, ``load_state_dict`` or the user can write any value into ``param_groups``. There ``lr == 0`` is
accepted (a zero update: warm-up schedulers start at 0, as torch's optimisers allow), a negative or non-finite ``lr`` or
a bad ``damping`` raises ``ValueError`` naming the group, the key and the value, with the parameters and the step
counter untouched. A non-finite loss, gradient or update raises ``FloatingPointError`` ("step N: ...; parameters left
unchanged"), also before any parameter changes, in the step that met it (not a step later).

Host round-trips (what stalls a GPU): these checks are computed on the device and read together, so a steady step (after
step 0's exact per-sample check, which reads the guard's finiteness at once) reads the device twice: the targets' class
range (before the loss, which cannot take an index out of range), then once for every other check: the per-sample
guard's finiteness of the losses and rows, the direction's, SF's gradient's, the momentum buffers', K-FAC's running
factors' between refreshes, with, for a normalised update, the direction's norm; the first that fails is named.
``last_update_norm`` is kept on the device and read when asked; ``lr="auto"``'s two scalars are read with the checks (no
read of their own). (A float32 ``J``'s Gram solve is an ``eigh``, whose CUDA error check also waits for the device;
``benchmarks/host_syncs.py`` counts both kinds.)

Schedules: ``normalize=True`` rescales each update to norm ``lr`` ("normalised update"), and ``total_steps=T``
multiplies the step size by ``1 - t/T`` (linear decay to 0). The paper trains EF and SF with both
(``sec:app-optimiser``) because of EF's inversely-scaled update norms; iEF uses a constant learning rate.

**Defaults** depend on ``reduction`` (``sec:app-optimiser``). ``"mean"``: the paper's LoRA values, iEF ``lr=100``,
EF/SF ``lr=0.01`` (normalised update), damping ``1e-7`` (prompt tuning: damping ``1e-12``, iEF ``lr=50``, EF/SF
``lr=1``); the paper tuned them for batches of 32 samples of a few target tokens each. ``"sum"``: iEF ``lr=1``, EF/SF
``lr=0.01`` (a normalised rate is the same in both conventions) and damping ``1e-4``, about the paper's ``1e-7``
converted for a batch of ``K = 32`` target tokens (``K^2 lambda``). The paper's values taken literally in the sum
convention are unstable: iEF moves every sample's logits by ``-lr`` times its loss gradient to first order
(``eqn:iEF_lsq``: ``J d = s``), so ``lr=100`` moves them 100 times as far as ``lr=1`` does, and ``damping=1e-7``
leaves the Gram system's small eigenvalues unregularised (the sum convention's ``J J^T`` is ``K^2`` times the mean
convention's, so the same ``lambda`` damps ``K^2`` times less): on a tiny BERT-LoRA (random weights, 32 samples)
one step with ``lr=100, damping=1e-7`` takes the loss ``L`` from 22.2 to 58,192, ``lr=1, damping=1e-7`` to
78-2,549 (3 batches), ``lr=1, damping=1e-4`` to 12.0-12.9.
The cpu setups' learning-rate searches chose iEF ``lr=3`` (digits-mlp) and ``lr=0.3`` (tweets-minilm-lora) in the sum
convention. ``lr="auto"`` (an option, not the default; :mod:`ief.optim.auto_lr`) needs no search: starting at iEF's
``1`` (EF/SF: ``0.01``) in the sum convention, every step multiplies the rate by the minimiser of a quadratic fitted to
the new batch's loss along the previous step (achieved reduction by one extra forward without gradients, slope from the
step's own gradient), the factor kept in ``[1/2, 2]`` and the rate at most 10 times its first; the rate is the same in
both conventions (the sum convention's; ``last_lr`` reports it in the ``reduction``'s), ``state_dict`` carries it,
schedulers cannot drive it, and it makes no host round-trip of its own. ``benchmarks/results/auto_lr-cpu.json`` compares
it with the default and the searched rates.

Memory: ``form="auto"`` (default) never forms the ``[M, P]`` per-sample Jacobian: every ``nn.Linear`` weight's
Gram block and direction come from its layer's inputs and output gradients, or from its per-sample rows where those
are cheaper, and an embedding table keeps only the rows the batch uses (see ``ief.per_sample``'s ``form``);
``form="dense"`` forms ``J`` (reusing one buffer across steps), ``"ghost"`` / ``"rows"`` force one Linear form.

**Precision** (the contract: :mod:`ief.precision`): the step's forward and per-sample backward run in the model's
precision (bfloat16 weights, or ``torch.autocast(device, torch.bfloat16)`` around ``step``); the losses and ``s_iEF``
in float32 at least, the Gram matrix in float64, its solve in float64; float32 parameters (adapters on a bfloat16 base)
are updated in float32, a bfloat16 parameter's update is computed in float32 and rounded once. The exact check's
tolerance comes from the lowest format the forward ran in (``0.0625`` for bfloat16). float16 is refused
(``ValueError``: no loss scale).
"""
from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..arguments import suggest_keywords
from ..directions import ef_solve, ief_solve, sf_solve, unrepresentable
from ..distributed import (DistributedRows, agree, all_gather_rows, all_reduce, batch_sizes, check_replicas,
                           collective_device, resolve_group)
from ..jacobian import CHECKS, gradient_and_sampled_jacobian, per_sample
from ..jacobian.guard import deferred_finiteness
from ..losses import IGNORE_INDEX, Loss, check_damping, count_targets, get_loss
from ..model_call import Inputs, _cuda_devices, call_model
from ..rows import FactoredJacobian, as_rows, check_form
from .auto_lr import AUTO, INITIAL, AutoRate, check_auto, replayed, rng_states
from .convention import to_sum_convention, to_token_mean_convention
from .momentum import (check_dampening, check_group_extras, check_momentum, check_shared, check_weight_decay,
                       momentum_buffers, resolve_groups)

REDUCTIONS = ("sum", "mean")
DEFAULT_DAMPING = {"sum": 1e-4, "mean": 1e-7}  # see "Defaults" above
DIVERGENCE_FACTOR = 100.0  # the growth of the mean loss over its lowest at which a step warns (orders of magnitude)


class _NoBatch:
    """step()'s default batch: no batch given (``help(IEF.step)`` shows it as ``<required>``)."""

    def __repr__(self) -> str:
        return "<required>"


MISSING: Any = _NoBatch()  # step()'s default batch: no batch given (also ief.hf's)


def _how_to_step(name: str) -> str:
    return (f"{name}.step needs the batch: call opt.step(inputs, targets) in your own loop, which runs the forward "
            f"and the per-sample backward itself (no loss.backward() and no closure), so a loop that calls step() or "
            f"step(closure) after its own backward cannot drive it, and transformers.Trainer(optimizers=(opt, None)) "
            f"is not supported (its training loop calls step() without the batch; ief.hf.IEFTrainer(model, args, "
            f"optimizer='ief') is)")


def _check_positive(name: str, value: float) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a real number, got {value!r}") from None
    if not math.isfinite(out) or out <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return out


def _check_check(check) -> bool | str | int:
    """``check`` as the optimisers take it: :func:`ief.per_sample`'s ``True``, ``False`` or ``"exact"``, or a whole
    number ``N >= 1`` of steps: the exact check every ``N`` steps (steps 0, N, 2N, ...), the structural one between
    (refused at construction rather than at the first step)."""
    if check is True or check is False or (isinstance(check, str) and check == "exact"):
        return check
    if isinstance(check, int) and not isinstance(check, bool) and check >= 1:
        return int(check)
    raise ValueError(f"check must be one of {', '.join(map(repr, CHECKS))} or a whole number N >= 1 of steps (the "
                     f"exact check every N steps), got {check!r}")


def _check_total_steps(total_steps) -> int | None:
    if total_steps is not None and (isinstance(total_steps, bool) or not isinstance(total_steps, int)
                                    or total_steps < 1):
        raise ValueError(f"total_steps must be a positive integer or None (no decay), got {total_steps!r}")
    return total_steps


def _check_reduction(reduction) -> str:
    if not isinstance(reduction, str) or reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(map(repr, REDUCTIONS))} (the loss whose lr and damping "
                         f"these are: sum_n l_n, or its mean over the counted target positions), got {reduction!r}")
    return reduction


def _looks_unshifted(inputs: Inputs, targets: torch.Tensor) -> bool:
    """Whether ``targets`` equal ``inputs["input_ids"]`` at every counted position of a sequence (Hugging Face's
    causal-LM ``labels``, which the model shifts itself)."""
    ids = inputs.get("input_ids") if isinstance(inputs, dict) else None
    if not isinstance(ids, torch.Tensor) or targets.dtype.is_floating_point or targets.dim() < 2 \
            or tuple(ids.shape) != tuple(targets.shape) or targets.shape[-1] < 2:
        return False
    kept = targets != IGNORE_INDEX
    return bool(kept.any()) and bool((targets[kept] == ids.to(targets.device)[kept]).all())


def _raised_message(refuse) -> str:
    """The message of the ``FloatingPointError`` that ``refuse()`` raises (a deferred check's diagnosis)."""
    try:
        refuse()
    except FloatingPointError as err:
        return str(err)
    return "non-finite per-sample losses or gradients"


def _finite(*tensors: torch.Tensor) -> torch.Tensor:
    """Whether every entry of every tensor is finite, a 0-d bool tensor (no host round-trip: the step reads all
    its checks at once). One ``aminmax`` per tensor: NaN propagates into it, and an infinity is an extreme."""
    extremes = [x for t in tensors if t.numel() for x in torch.aminmax(t)]
    if not extremes:
        return torch.ones((), dtype=torch.bool, device=tensors[0].device if tensors else None)
    return torch.isfinite(torch.stack(extremes)).all()


STATE_KEY = "ief_optimizer"  # state_dict()'s record of the optimiser that saved it
AUTO_KEY = "auto_lr"  # state_dict()'s adapted rate (lr="auto")


class ForeignStateError(ValueError):
    """Another optimiser's state (another ief method or settings, or a torch optimiser's, e.g. AdamW's), refused
    before anything loads; the message names both. A ``ValueError``.

    Raised by ``load_state_dict`` of :class:`IEF`, :class:`EF`, :class:`SF` and :class:`ief.optim.KFAC`
    (:class:`ief.hf.IEFTrainer` turns it into a ``ValueError`` naming the checkpoint on resume)."""


def _describe(identity: dict) -> str:
    """``EF(normalize=True, loss='mse', reduction='sum')`` from a :meth:`PreconditionedOptimizer._identity`."""
    settings = ", ".join(f"{key}={value!r}" for key, value in identity.items() if key != "class")
    return f"{identity['class']}({settings})"


def _foreign_groups(groups: Any) -> str | None:
    """The keys of a state's ``param_groups`` that show it is not an ief optimiser's (``None`` when they are)."""
    if not isinstance(groups, list) or not groups or not all(isinstance(g, dict) for g in groups):
        return "no param_groups"
    missing = [key for key in ("damping", "normalize") if key not in groups[0]]
    if not missing:
        return None
    others = sorted(key for key in groups[0] if key not in ("params", "lr", "weight_decay", "initial_lr"))
    return f"param_groups without {' or '.join(map(repr, missing))}" + (
        f" but with {', '.join(map(repr, others[:6]))}" if others else "")


class PreconditionedOptimizer(torch.optim.Optimizer):
    """Shared machinery of :class:`IEF`, :class:`EF`, :class:`SF` and :class:`ief.optim.KFAC`: validation,
    schedule, finite checks and the in-place update; a subclass provides ``_direction``."""

    _needs_positive_damping = False
    _auto_lr = False  # whether lr="auto" (ief.optim.auto_lr) is offered
    _across_processes = True  # the step is exact over the union of the ranks' batches (ief.distributed)
    method = ""  # "ief" / "ef" / "sf": the rule that converts a token-mean rate (reduction="mean")

    def __init__(
        self,
        model: torch.nn.Module,
        lr: float,
        damping: float | None,
        *,
        params: Iterable[torch.nn.Parameter] | None = None,
        loss: str | Loss = "cross_entropy",
        reduction: str = "sum",
        normalize: bool = False,
        total_steps: int | None = None,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        check: bool | str | int = True,
        form: str = "auto",
        process_group: Any = None,
    ):
        self._constructed = False
        if not isinstance(model, torch.nn.Module):
            raise ValueError(
                f"model must be a torch.nn.Module (the optimiser runs its forward), got {type(model).__name__}")
        try:
            self._group = resolve_group(model, process_group, type(self).__name__)
        except ValueError:
            if self._across_processes:
                raise
            self._group = "refused"
        if self._group is not None and not self._across_processes:
            raise ValueError(f"{type(self).__name__} does not step across processes yet (its running factors would be "
                             f"each rank's own, and the replicas would drift apart): run it in one process (world "
                             f"size 1), or use IEF, EF or SF, which take process_group=")
        self._auto: AutoRate | None = None
        if check_auto(lr, type(self).__name__, self._auto_lr):  # the adapted rate (ief.optim.auto_lr)
            self._auto = AutoRate(INITIAL[self.method])
        else:
            lr = _check_positive("lr", lr)
        self.last_lr: float | None = None  # the rate of the last step, in the reduction's convention
        self._auto_gradient: Any = None  # () -> (the batch gradient, whether the union's), for lr="auto"
        if damping is None:  # the defaults of the module docstring
            damping = DEFAULT_DAMPING[_check_reduction(reduction)]
        damping = check_damping(damping, allow_zero=not self._needs_positive_damping)
        total_steps = _check_total_steps(total_steps)
        momentum, dampening = check_momentum(momentum), check_dampening(dampening)
        weight_decay = check_weight_decay(weight_decay)
        check = _check_check(check)
        self.reduction = _check_reduction(reduction)
        self.form = check_form(form)
        groups = resolve_groups(model, params)
        super().__init__(groups, dict(lr=lr, damping=damping, normalize=bool(normalize), total_steps=total_steps,
                                      momentum=momentum, dampening=dampening, weight_decay=weight_decay))
        for group in self.param_groups:
            check_group_extras(group)
        self.model = model
        self.loss = loss
        self.check = check
        self._last_update_norm: Any = None  # a float, or a function that reads it (see last_update_norm)
        self._buffer: torch.Tensor | None = None
        self.last_losses: torch.Tensor | None = None
        self.last_tokens: int | None = None  # K of the last batch (reduction="mean")
        self._warned_unshifted = False
        self._replicas_agree = False  # compared across the group at the first step, and again after a load
        self.register_load_state_dict_post_hook(lambda opt: setattr(opt, "_replicas_agree", False))
        self._constructed = True

    def add_param_group(self, param_group: dict) -> None:
        """Refused after construction (``ValueError``): the update preconditions all parameters jointly, so the
        groups are fixed when the per-sample machinery is built (see the module docstring)."""
        if getattr(self, "_constructed", False):
            name = type(self).__name__
            raise ValueError(
                f"{name}'s parameter groups are fixed at construction: its update preconditions all parameters "
                f"jointly (one per-sample Jacobian, one Gram system), so a group added by add_param_group would never "
                f"be updated, and "
                f"per-group learning rates would no longer give the {name} direction; construct "
                f"{name}(model, params=[...every parameter to train...]) instead (groups that differ only in "
                f"weight_decay: params=[{{'params': [...], 'weight_decay': ...}}, ...])")
        super().add_param_group(param_group)

    def __setstate__(self, state: dict) -> None:
        """A ``state_dict`` saved before momentum and weight decay existed loads as ``0.0`` for both."""
        super().__setstate__(state)
        for group in self.param_groups:
            for key in ("momentum", "dampening", "weight_decay"):
                group.setdefault(key, 0.0)

    def _identity(self) -> dict:
        """The class and the constructor settings that change the method, as :meth:`state_dict` records them."""
        loss = self.loss if isinstance(self.loss, str) else getattr(self.loss, "name", type(self.loss).__name__)
        return {"class": type(self).__name__, "normalize": bool(self.param_groups[0]["normalize"]), "loss": loss,
                "reduction": self.reduction}

    def _check_origin(self, state_dict: Any) -> None:
        """Refuse (:class:`ForeignStateError`) a state saved by another method or settings, or by a torch optimiser.

        A state saved before the class was recorded (no ``"ief_optimizer"`` entry) loads when its ``param_groups``
        are an ief optimiser's with this one's ``normalize``, the settings it holds (IEF and EF(normalize=False)
        cannot be told apart there)."""
        mine = self._identity()
        if not isinstance(state_dict, dict):
            raise ForeignStateError(f"{_describe(mine)}.load_state_dict takes a dict from state_dict(), got "
                                    f"{type(state_dict).__name__}")
        saved = state_dict.get(STATE_KEY)
        if saved is None:
            foreign = _foreign_groups(state_dict.get("param_groups"))
            if foreign is not None:
                raise ForeignStateError(
                    f"this state_dict is not an ief optimiser's ({foreign}: e.g. torch.optim.AdamW(...).state_dict()) "
                    f"and cannot be loaded into {_describe(mine)}; start {mine['class']} fresh (do not load it)")
            saved_normalize = bool(state_dict["param_groups"][0]["normalize"])
            if saved_normalize != mine["normalize"]:
                raise ForeignStateError(
                    f"this state_dict records no optimiser class (saved before ief recorded it) and was saved with "
                    f"normalize={saved_normalize}, but this optimiser is {_describe(mine)}: load it into the "
                    f"optimiser that saved it (constructed with normalize={saved_normalize}), or start "
                    f"{mine['class']} fresh")
            return
        if dict(saved) != mine:
            raise ForeignStateError(f"this state_dict is {_describe(dict(saved))}'s and cannot be loaded into "
                                    f"{_describe(mine)} (another method or settings: loading it would run with the "
                                    f"saved lr, damping and normalize); construct {_describe(dict(saved))} to "
                                    f"resume it, or start {mine['class']} fresh")

    def state_dict(self) -> dict:
        """torch's optimiser state plus ``"ief_optimizer"`` (the class and the settings that change the method, so
        that another optimiser refuses it), with ``lr="auto"`` ``"auto_lr"`` (the rate and the last step's change,
        :mod:`ief.optim.auto_lr`) and, with ``generator=``, ``"generator_state"``.

        Returns:
            The state, for :meth:`load_state_dict`.
        """
        state = super().state_dict()
        state[STATE_KEY] = self._identity()
        if self._auto is not None:
            state[AUTO_KEY] = self._auto.state()
        return self._store_generator(state)

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore :meth:`state_dict`'s output: the step counter, momentum buffers, ``param_groups`` values (and the
        generator's state, ``lr="auto"``'s rate and last change).

        Args:
            state_dict: the output of this class's :meth:`state_dict` with the same settings (or one saved before
                the class was recorded, whose ``normalize`` matches).

        Raises:
            ForeignStateError: (a ``ValueError``) the state is another method's or settings' (e.g. ``IEF``'s into
                ``EF``), or a torch optimiser's (e.g. ``torch.optim.AdamW``'s); the message names both.
            ValueError: it holds a generator's state and this optimiser has no generator.
        """
        self._check_origin(state_dict)
        state_dict = dict(state_dict)
        state_dict.pop(STATE_KEY, None)
        generator_state = self._pop_generator_state(state_dict)
        auto = state_dict.pop(AUTO_KEY, None)
        if auto is not None:
            if not self._auto_lr:
                raise ForeignStateError(f"this state_dict holds an adapted rate (lr={AUTO!r}), which "
                                        f"{type(self).__name__} does not take")
            restored = AutoRate(INITIAL[self.method])
            restored.load(auto)  # checked before anything loads
            params = self._all_params()
            if restored.delta is not None:  # the last step's change, on its parameter's device
                if len(restored.delta) != len(params) or any(
                        tuple(d.shape) != tuple(p.shape) for d, p in zip(restored.delta, params)):
                    raise ValueError("the state_dict's auto_lr delta does not match the parameters' shapes (another "
                                     "model's state)")
                restored.delta = [d.to(p.device) for d, p in zip(restored.delta, params)]
        super().load_state_dict(state_dict)
        self._restore_generator(generator_state)
        if auto is not None:
            self._auto = restored

    def _store_generator(self, state: dict) -> dict:
        """``state`` with the label generator's state under ``"generator_state"`` (SF and KFAC with ``generator=``):
        a resumed run then draws the same labels as an uninterrupted one."""
        generator = getattr(self, "generator", None)
        if generator is not None:
            state["generator_state"] = generator.get_state()
        return state

    def _pop_generator_state(self, state_dict: dict) -> torch.Tensor | None:
        """Take ``"generator_state"`` out of ``state_dict`` (a copy the caller owns); ``ValueError`` if it holds one
        and this optimiser has no generator to restore it into."""
        generator_state = state_dict.pop("generator_state", None)
        if generator_state is not None and getattr(self, "generator", None) is None:
            raise ValueError(f"this state_dict holds the state of {type(self).__name__}'s generator, but this "
                             f"{type(self).__name__} has none (it would draw labels from the global RNG): construct "
                             "it with generator=torch.Generator() to resume")
        return generator_state

    def _restore_generator(self, generator_state: torch.Tensor | None) -> None:
        """Set the label generator's state. A generator's state is a CPU byte tensor whatever its device; a state
        dict moved to the GPU (accelerate's ``AcceleratedOptimizer`` does) comes back to the CPU here."""
        if generator_state is not None:
            self.generator.set_state(generator_state.to("cpu", torch.uint8))

    def _all_params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    @property
    def steps_taken(self) -> int:
        first = self.param_groups[0]["params"][0]
        return int(self.state[first].get("step", 0))

    def _direction(self, inputs: Inputs, targets: torch.Tensor, group: dict) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _check_group(self, index: int, group: dict) -> float:
        """The values of ``param_groups[index]`` that a step uses, checked before the step touches anything (a
        scheduler, ``load_state_dict`` or the user may have written them); returns the checked damping, the value the
        step passes on (the solves do not check it again)."""
        where = f"step {self.steps_taken}: param_groups[{index}]"
        lr = group.get("lr")
        try:
            value = float(lr)
        except (TypeError, ValueError):
            value = math.inf if lr == AUTO and self._auto_lr else math.nan
        if isinstance(lr, bool) or not (math.isfinite(value) or lr == AUTO) or value < 0:
            offered = f" or {AUTO!r}" if self._auto_lr else ""
            raise ValueError(f"{where}['lr'] must be a finite number >= 0{offered} (set by a scheduler, "
                             f"load_state_dict or by hand), got {lr!r}; parameters left unchanged")
        try:
            damping = check_damping(group.get("damping"), allow_zero=not self._needs_positive_damping)
            _check_total_steps(group.get("total_steps"))
            check_group_extras(group)
        except ValueError as err:
            raise ValueError(f"{where}: {err}; parameters left unchanged") from None
        return damping

    def _step_size(self, group: dict, direction_norm: float) -> float:
        size = group["lr"]
        if group["total_steps"] is not None:
            size *= max(0.0, 1.0 - self.steps_taken / group["total_steps"])
        if group["normalize"]:
            size = size / direction_norm if direction_norm > 0 else 0.0
        return size

    def _shrink(self, group: dict) -> float:
        """Decoupled weight decay's factor ``1 - eta_t wd`` with the given (scheduled) rate ``eta_t``."""
        return 1.0 - self._step_size(dict(group, normalize=False), 1.0) * group["weight_decay"]

    def _shrinks(self, lr: float) -> list[float]:
        """Every group's decay factor with the given rate ``lr`` (``param_groups``' own, or the adapted rate), taken
        before any step counter moves (the decay's ``1 - t/T`` reads it)."""
        return [self._shrink(dict(group, lr=lr)) if group["weight_decay"] else 1.0 for group in self.param_groups]

    @torch.no_grad()
    def _apply(self, steps: list[torch.Tensor], size: float, shrinks: list[float]) -> None:
        """``p <- shrink p - size * step`` for every parameter, group by group (a 16-bit parameter's in float32,
        rounded to its dtype once: :mod:`ief.precision`); ``shrinks``: :meth:`_shrinks`."""
        chunks = iter(steps)
        for group, shrink in zip(self.param_groups, shrinks):
            wide, wide_steps = [], []  # updated together: one foreach operator for the group, not one per tensor
            for p in group["params"]:
                step = next(chunks)
                if p.dtype.itemsize < 4:  # a 16-bit parameter: the update in float32, rounded once (ief.precision)
                    p.copy_(p.float().mul_(shrink).add_(step.view(p.shape).float(), alpha=-size))
                else:
                    wide.append(p)
                    wide_steps.append(step.view(p.shape))
                self.state[p]["step"] = self.state[p].get("step", 0) + 1
            if wide:
                if shrink != 1.0:
                    torch._foreach_mul_(wide, shrink)
                torch._foreach_add_(wide, wide_steps, alpha=-size)  # p.add_(step, alpha=-size), each p
        # autocast caches each parameter's bfloat16 cast until its outermost region exits: steps in a loop inside one
        # torch.autocast would otherwise run every later forward with the first step's weights (ief.precision)
        torch.clear_autocast_cache()

    @property
    def last_update_norm(self) -> float | None:
        """``eta_t ||b_t||`` of the last step (``None`` before the first): kept on the device by the step and read
        here, so that a step makes no host round-trip for it (:mod:`ief.optim.momentum`)."""
        value = self._last_update_norm
        if callable(value):
            value = self._last_update_norm = value()
        return value

    @last_update_norm.setter
    def last_update_norm(self, value: float | None) -> None:
        self._last_update_norm = value

    def _update(self, given: dict, group: dict, direction: torch.Tensor, tokens: int | None,
                checks: list[tuple[torch.Tensor | Callable, Any]] | None = None, number: int | None = None,
                watched: torch.Tensor | None = None) -> None:
        """Apply ``direction`` with the schedule, momentum and weight decay (:mod:`.momentum`), after the step's one
        host read: every finiteness check of the step (``checks``: ``[(0-d bool tensor, or a function returning one,
        message)]`` in the order they are named; ``direction``'s and the momentum buffers' are added here) and, for a normalised update, the
        direction's norm are read together (one round-trip), and the first failed check raises
        ``FloatingPointError`` ("step ``number``: ...; parameters left unchanged") before anything changes.
        ``given``: ``param_groups[0]``; ``group``: its values for this batch (converted with ``reduction="mean"``).
        With ``lr="auto"`` the new batch's ``D`` and ``E`` along the previous change (:meth:`_auto_probe`) are read
        with the checks and set this step's rate first, and the change applied is kept (:mod:`.auto_lr`)."""
        number = self.steps_taken if number is None else number
        params = self._all_params()
        chunks = list(torch.split(direction, [p.numel() for p in params]))
        norm_t = direction.norm()
        checks = [*(checks or []), (_finite(direction), self._unfinite_direction_message())]
        buffers = None
        if given["momentum"] != 0:
            factor = 1.0  # c_t: the batch's own factor, inside the buffer
            if tokens is not None:
                factor = to_sum_convention(self.method, 1.0, 1.0, tokens, normalized=given["normalize"])[0]
            if given["normalize"]:  # factor / ||d|| (0 when d = 0), on the device
                norm64 = norm_t.to(torch.float64)
                factor = torch.where(norm64 > 0, factor / norm64, torch.zeros_like(norm64))
            steps = [c.view(p.shape).mul(factor) for p, c in zip(params, chunks)]  # shaped as their parameter
            buffers = momentum_buffers(self.state, params, steps, given["momentum"], given["dampening"])
            checks.append((_finite(*buffers), "non-finite momentum buffer"))
        auto = self._auto if given["lr"] == AUTO else None
        # a deferred flag (ief.jacobian.guard.deferred_finiteness) is asked for now, of the rows the solve used
        read = [(flag(self._rows) if callable(flag) else flag).to(torch.float64) for flag, _ in checks]
        if watched is not None:  # the divergence watch: the batch's mean loss, read with the checks
            read.append(watched.detach().to(torch.float64).reshape(()))
        if given["momentum"] == 0 and group["normalize"]:
            read.append(norm_t.to(torch.float64))
        settled = len(read)  # the new batch's (D, E) along the previous change follow, with lr="auto"
        if auto is not None and auto.pending is not None:
            read.extend(auto.pending.unbind())
        values = torch.stack(read).tolist()  # the step's one host round-trip
        for ok, (_, message) in zip(values, checks):
            if not ok:
                raise FloatingPointError(f"step {number}: {message() if callable(message) else message}; "
                                         f"parameters left unchanged")
        if auto is not None:
            given, group = self._auto_rates(given, group, tokens,
                                            auto.settle(values[settled:] if auto.pending is not None else None))
        self.last_lr = given["lr"]
        if watched is not None:
            self._watch_divergence(values[len(checks)], number, given["lr"])
        shrinks = self._shrinks(given["lr"])
        if buffers is None:  # no buffer: today's update (plus the decay)
            norm = values[settled - 1] if group["normalize"] else None
            size = self._step_size(group, norm if norm is not None else 1.0)
            if auto is not None:
                self._auto_step(chunks, size, shrinks)
            self._apply(chunks, size, shrinks)
            self.last_update_norm = (abs(size) * norm if norm is not None else
                                     lambda: abs(size) * float(norm_t))  # read when asked
            return
        for p, b in zip(params, buffers):
            self.state[p]["momentum_buffer"] = b
        size = self._step_size(dict(given, normalize=False), 1.0)  # eta_t = lr_t (1 - t/T)
        if auto is not None:
            self._auto_step(buffers, size, shrinks)
        self._apply(buffers, size, shrinks)
        norms = torch.stack([b.norm() for b in buffers])
        self.last_update_norm = lambda: abs(size) * math.sqrt(sum(x ** 2 for x in norms.tolist()))

    def _auto_rates(self, given: dict, group: dict, tokens: int | None, rate: float) -> tuple[dict, dict]:
        """``given`` and ``group`` with the adapted ``rate`` (sum convention; ``given``'s in the ``reduction``'s),
        kept where every group's decay factor ``1 - lr wd`` stays >= 1/2."""
        def convert(value: float, to_sum: bool) -> float:
            if tokens is None:
                return value
            return (to_sum_convention if to_sum else to_token_mean_convention)(
                self.method, value, 1.0, tokens, normalized=group["normalize"])[0]

        lr = convert(rate, to_sum=False)
        decay = max(g["weight_decay"] for g in self.param_groups)
        if decay and lr * decay > 0.5:
            lr = 0.5 / decay
            rate = self._auto.rate = convert(lr, to_sum=True)
        return dict(given, lr=lr), dict(group, lr=rate)

    @torch.no_grad()
    def _auto_step(self, steps: list[torch.Tensor], size: float, shrinks: list[float]) -> None:
        """Keep the change about to be applied, ``theta_t - theta_{t+1} = size step + (1 - shrink) theta_t`` per
        parameter, for the next step's probe (:mod:`.auto_lr`)."""
        delta, chunks = [], iter(steps)
        for group, shrink in zip(self.param_groups, shrinks):
            for p in group["params"]:
                d = next(chunks).view(p.shape).to(torch.float32 if p.dtype.itemsize < 4 else p.dtype) * size
                if shrink != 1.0:
                    d.add_(p, alpha=1.0 - shrink)
                delta.append(d)
        self._auto.delta = delta

    @torch.no_grad()
    def _auto_probe(self, inputs: Inputs, targets: torch.Tensor, losses: torch.Tensor, rng: tuple,
                    devices: list[int]) -> None:
        """The new batch's loss along the previous step ``delta``: ``D = L(theta_t) - L(theta_{t+1})`` by one forward
        without gradients at ``theta_t = theta_{t+1} + delta`` (the step's RNG state: its dropout masks), and
        ``E = grad L(theta_{t+1}) . delta``, both of the union batch, left on the device for the step's read."""
        gradient, union = self._auto_gradient()
        params = self._all_params()
        g = torch.split(gradient.reshape(-1), [p.numel() for p in params])
        slope = sum(torch.dot(gk.to(torch.float64), d.reshape(-1).to(torch.float64))
                    for gk, d in zip(g, self._auto.delta))
        slope = slope if union else self._union_sum(slope)
        kept = [p.data for p in params]
        try:
            for p, d in zip(params, self._auto.delta):
                p.data = (p.data.to(d.dtype) + d).to(p.dtype)
            with replayed(rng, devices):
                logits = call_model(self.model, inputs)
        finally:
            for p, data in zip(params, kept):
                p.data = data
        torch.clear_autocast_cache()
        before = self._union_sum(get_loss(self.loss).per_sample(logits, targets).to(torch.float64).sum())
        achieved = before - losses.detach().to(torch.float64).sum()
        self._auto.pending = torch.stack([achieved, slope.to(achieved.device)])

    def _watch_divergence(self, mean_loss: float, number: int, lr: float) -> None:
        """Warn once (``UserWarning``) when the mean per-sample loss has grown by :data:`DIVERGENCE_FACTOR` over the
        lowest this optimiser has seen: a rate too large for the method's linear model of the loss (iEF's first
        step asks each sample's loss to fall by ``lr * s_n``, more than the loss itself once ``lr`` is large). The
        loss is read with the step's checks, so the watch costs no host round-trip of its own."""
        if not math.isfinite(mean_loss):
            return
        lowest = getattr(self, "_lowest_loss", None)
        if lowest is None or mean_loss < lowest[0]:
            self._lowest_loss = (mean_loss, number)
            return
        if not getattr(self, "_warned_divergence", False) and mean_loss > DIVERGENCE_FACTOR * max(lowest[0], 1e-12):
            self._warned_divergence = True
            warnings.warn(
                f"{type(self).__name__}: the mean per-sample loss grew from {lowest[0]:.4g} (step {lowest[1]}) to "
                f"{mean_loss:.4g} (step {number}) with lr={lr:g}: the updates are overshooting; try a rate about 10x "
                f"smaller (lr={lr / 10:g}), a larger damping, or normalize=True with total_steps (said once)",
                UserWarning, stacklevel=4)

    def _unfinite_direction_message(self):
        """What a non-finite direction means: the solve's overflow of the model's dtype (a direction from the
        Woodbury solves, which return it unchecked to the step) or, from any other ``_direction``, non-finite
        gradients."""
        what = getattr(self, "_solved", None)
        if what is None:
            return "non-finite gradients or update"
        return lambda: unrepresentable(*what)

    def _tokens(self, targets: torch.Tensor) -> int:
        """``K`` of :func:`ief.count_targets` (class indices other than ``-100``; every entry of a float target), of
        the union batch across processes (a rank whose targets are all ignored counts 0)."""
        k = count_targets(targets)
        if self._group is not None:
            counted = torch.tensor([k], dtype=torch.int64, device=collective_device(self._group))
            k = int(all_reduce(counted, self._group))
        if k < 1:
            raise ValueError("reduction='mean': the batch has no counted target (every target is -100), so the mean "
                             "loss is undefined; parameters left unchanged")
        return k

    def step(self, inputs: Inputs = MISSING, targets: torch.Tensor = MISSING, *,  # type: ignore[override]
             closure: Any = None) -> torch.Tensor:
        """One update on the batch ``(inputs, targets)``: the forward, the per-sample backward and the update.

        Every value it uses from ``param_groups`` is checked first (a scheduler, ``load_state_dict`` or the user may
        have written it); ``lr = 0`` is a zero update (warm-up schedules start at 0).

        Args:
            inputs: what the model takes: a tensor, a tuple, or a dict passed as ``model(**inputs)``.
            targets: class indices ``[M]`` / ``[M, T]`` with ``-100`` ignored (causal LMs:
                ``ief.causal_lm_targets(labels)``), or float targets with ``loss="mse"``.
            closure: refused (``TypeError``): the optimiser runs the forward and backward itself.

        Returns:
            The batch loss before the update, a 0-dim tensor: ``L = sum_n l_n``, or ``L / K`` with
            ``reduction="mean"``.

        Raises:
            TypeError: no batch (``step()``, ``step(closure)``: how these optimisers are driven, in one sentence).
            ValueError: a bad value in ``param_groups`` (``"step k: param_groups[0]['lr'] must be ..."``), groups
                that disagree on anything but ``weight_decay``, or ``reduction="mean"`` with no counted target;
                parameters and step counter untouched.
            FloatingPointError: the loss, the gradients or the update are not finite (``"step k: ...; parameters
                left unchanged"``), also before any parameter changes.
            PerSampleGradientMismatch: the per-sample guard's refusal (see :func:`ief.per_sample`).
            ief.distributed.ReplicaMismatch: (a ``ValueError``, across processes) at the first step, and the first
                after ``load_state_dict``, on every rank, when the ranks' parameters, optimiser state or settings
                differ, naming the first that differs; nothing changed.

        Warns:
            UserWarning: once, when the targets equal ``inputs["input_ids"]`` at every counted position (Hugging
                Face's unshifted causal-LM ``labels``; pass ``ief.causal_lm_targets(labels)``).
            SlowPathWarning: once per model, naming parameters whose per-sample gradients take the per-sample loop.
        """
        if targets is MISSING or closure is not None:
            raise TypeError(_how_to_step(type(self).__name__))
        if self._group is not None and not self._replicas_agree:
            self._check_replicas()
        dampings = [self._check_group(index, g) for index, g in enumerate(self.param_groups)]
        try:
            check_shared(self.param_groups)
        except ValueError as err:
            raise ValueError(f"step {self.steps_taken}: {err}; parameters left unchanged") from None
        # the first step only: reading the targets on the host every step would stall a GPU (the same pipeline
        # feeds the later batches)
        if not self._warned_unshifted and self.steps_taken == 0 and _looks_unshifted(inputs, targets):
            self._warned_unshifted = True
            warnings.warn(
                "the targets equal inputs['input_ids'] at every counted position: for a causal LM (GPT-2, Llama, "
                "...) these are Hugging Face's unshifted labels, and this step trains every position to predict its "
                "own input token; pass ief.causal_lm_targets(labels) (the next token at each position)",
                UserWarning, stacklevel=3)  # (torch.optim wraps step: 3 is the caller's line)
        given = self.param_groups[0]
        # one joint direction over every group's parameters, with the damping as checked (the groups agree on it)
        group = dict(given, params=self._all_params(), damping=dampings[0])
        auto = given["lr"] == AUTO  # the rate is set in _update, from the previous steps (ief.optim.auto_lr)
        if auto and self._auto is None:  # "auto" written into param_groups of an optimiser built with a number
            self._auto = AutoRate(INITIAL[self.method])
        tokens = None
        if self.reduction == "mean":  # the given (token-mean) rates as this package's (sum) ones for this batch
            tokens = self.last_tokens = self._tokens(targets)
            lr, damping = to_sum_convention(self.method, 1.0 if auto else group["lr"], group["damping"], tokens,
                                            normalized=group["normalize"])
            lr = AUTO if auto else lr
            if not math.isfinite(damping):  # the conversion's K^2 overflowed a checked (finite) damping
                raise ValueError(f"step {self.steps_taken}: damping {group['damping']!r} for the token mean is "
                                 f"{damping!r} for the sum over this batch's {tokens} tokens (x K^2): use a smaller "
                                 f"damping; parameters left unchanged")
            group = dict(group, lr=lr, damping=damping)
        number = self.steps_taken
        self._checks: list[tuple[torch.Tensor, Any]] = []  # the direction's own checks, read with the step's
        self._solved = None  # (method, dtype) of a direction a Woodbury solve returned unchecked
        self._rows = None  # the rows the solve used (_union_rows), which a deferred finiteness flag is asked of
        if auto:  # the forward's RNG state, replayed by the measuring forward after the update
            devices = _cuda_devices(self.model)
            rng = rng_states(devices)
        try:
            with torch.enable_grad():
                losses, direction = self._direction(inputs, targets, group)
        except FloatingPointError as err:
            raise FloatingPointError(f"step {number}: {err}; parameters left unchanged") from err
        # in the order they were met: the per-sample guard's (naming the samples), the direction's own, the losses
        checks = [*self._checks, (torch.isfinite(losses).all(), lambda: f"non-finite loss {losses.tolist()}")]
        if auto and self._auto.delta is not None:  # the new batch's loss along the previous step
            self._auto_probe(inputs, targets, losses, rng, devices)
        self._auto_gradient = None  # (holds the batch's per-sample results)
        self._update(given, group, direction, tokens, checks=checks, number=number, watched=losses.mean())
        self.last_losses = losses
        return losses.sum() if tokens is None else losses.sum() / tokens

    def _check_replicas(self) -> None:
        """Every rank's model parameters, optimiser state and settings the same (:func:`ief.distributed.check_replicas`:
        :class:`ief.distributed.ReplicaMismatch` on every rank, naming the first that differs), at the first step
        and at the first step after ``load_state_dict``."""
        named = list(self.model.named_parameters())
        index = {id(p): name for name, p in named}
        state = [(f"{index.get(id(p), 'a parameter')}: {key}", value) for p in self._all_params()
                 for key, value in sorted(self.state.get(p, {}).items()) if isinstance(value, torch.Tensor)]
        settings = {"optimiser": self._identity(), "check": self.check, "form": self.form,
                    "step": self.steps_taken, **{f"param_groups[{i}]['{key}']": value
                                                  for i, g in enumerate(self.param_groups)
                                                  for key, value in sorted(g.items()) if key != "params"}}
        when = "before the first step" if self.steps_taken == 0 else f"at step {self.steps_taken}, after a load"
        check_replicas(self._group, collective_device(self._group), named + state, settings, when)
        self._replicas_agree = True

    def _check_now(self):
        """The per-sample check of this step: ``True``: the exact one on the first step, the structural one after;
        ``"exact"``: exact on every step; ``N``: exact on steps 0, N, 2N, ..., structural between; ``False``: none."""
        if self.check is True:
            return "exact" if self.steps_taken == 0 else True
        if self.check is False or self.check == "exact":
            return self.check
        return "exact" if self.steps_taken % self.check == 0 else True

    def _guarded(self, compute):
        """``compute()`` (a call of the per-sample machinery) with its check of the losses and rows read with the
        step's checks (:func:`ief.jacobian.guard.deferred_finiteness`: no host read of its own) on a step without
        the exact per-sample check; on an exact-check step it is read at once, before the check compares rows."""
        if self._check_now() == "exact":
            return compute()
        with deferred_finiteness() as pending:
            out = compute()
        self._checks.extend((flag, functools.partial(_raised_message, refuse)) for flag, refuse in pending)
        return out

    def _local(self, compute):
        """This rank's own per-sample work (:meth:`_guarded` in one process). Across processes its checks are read
        at once and :func:`ief.distributed.agree` makes a failure on any rank raise on every rank, before the
        collectives of the solve (no rank is left waiting in one)."""
        if self._group is None:
            return self._guarded(compute)
        return agree(self._group, collective_device(self._group), compute)

    def _union_rows(self, jacobian: Any) -> Any:
        """The rows the solves take: this process's, or the union batch's across processes (the ranks' sizes are
        exchanged here, once per step, for :meth:`_union_vector`)."""
        rows = as_rows(jacobian)
        if self._group is None:
            self._rows = rows
            return rows
        self._sizes = batch_sizes(rows.shape[0], self._group, collective_device(self._group))
        return DistributedRows(rows, self._group, self._sizes)

    def _union_vector(self, local: torch.Tensor) -> torch.Tensor:
        """A per-sample vector of this rank (losses, ``s``), or the union batch's, concatenated in rank order."""
        if self._group is None:
            return local
        return all_gather_rows(local, self._sizes, self._group)

    def _union_sum(self, local: torch.Tensor) -> torch.Tensor:
        """A sum over this rank's samples (the batch gradient), or over the union batch's (summed in float64)."""
        if self._group is None:
            return local
        return all_reduce(local.to(torch.float64), self._group).to(local.dtype)

    def _per_sample(self, inputs: Inputs, targets: torch.Tensor, group: dict) -> Any:
        """The batch's :class:`ief.jacobian.PerSample`; :func:`ief.per_sample` refuses non-finite losses and rows
        (``FloatingPointError`` naming the samples; read with the step's other checks, :meth:`_guarded`), so the
        solves take them as checked."""
        result = self._local(lambda: per_sample(self.model, inputs, targets, group["params"], loss=self.loss,
                                                check=self._check_now(), out=self._buffer, form=self.form))
        # reused next step (same batch size): no fresh allocation of J (or of its materialised column blocks); a
        # factored J may use the first columns of a wider buffer (an embedding table's used rows vary by batch)
        factored = isinstance(result.jacobian, FactoredJacobian)
        written = result.jacobian.dense if factored else result.jacobian
        if self._buffer is None or written.data_ptr() != self._buffer.data_ptr():
            self._buffer = written
        return result


class IEF(PreconditionedOptimizer):
    """Exact iEF: ``theta <- theta - lr * J^T (J J^T + lambda I)^{-1} s_iEF`` (``alg:iEF``, ``eqn:iEF_lsq``).

    With momentum and weight decay (beyond the paper, whose ``sec:app-limitations`` says the exact iEF optimiser
    cannot use them; derivation in :mod:`ief.optim.momentum`): ``d_t`` is the exact iEF direction of batch ``t``
    and ``c_t`` its batch factor (``1/K_t`` with ``reduction="mean"``, else 1), then::

        b_t = c_t d_t  (first step),   b_t = momentum * b_{t-1} + (1 - dampening) * c_t d_t  (after)
        theta <- (1 - lr_t * weight_decay) * theta - lr_t * b_t

    Momentum averages exact iEF steps (the direction is a per-batch least-squares solution, not linear in the
    gradient, so the buffer holds preconditioned steps, as torch SGD's ``momentum_buffer`` holds gradients); the
    decay is AdamW's decoupled one (an L2 term has no row in ``J`` nor entry in ``s``, so it cannot enter
    ``eqn:iEF_lsq``). ``momentum=0`` keeps no buffer and is the exact update; with ``dampening=0`` the steady step is
    ``lr / (1 - momentum)`` times the momentum-free one, ``dampening=momentum`` keeps the momentum-free scale.

    Drive it with ``loss = opt.step(inputs, targets)`` in your own loop (no ``backward``, no closure). Cost of a
    step: one forward and one backward (per-sample rows by module hooks), an ``M x M`` Gram matrix and its float64
    solve; the guard's exact check adds one batched forward-mode pass on the first step. Precision: bfloat16 weights
    and bfloat16 autocast are supported, float16 refused (:mod:`ief.precision`).

    Args:
        model: the ``nn.Module`` whose forward the optimiser runs (a peft model, a Hugging Face model: the package's
            conventions, :mod:`ief`).
        lr: the rate; default ``None``: ``1.0`` with ``reduction="sum"`` (stable: see the module docstring), the
            paper's LoRA ``100.0`` with ``reduction="mean"`` (``sec:app-optimiser``; prompt tuning: ``50``);
            ``"auto"``: set every step from the new batch's loss along the previous step, starting at ``1`` (sum
            convention), one extra forward without gradients a step (:mod:`ief.optim.auto_lr`; ``last_lr``).
        damping: ``lambda >= 0`` in the ``reduction``'s convention; default ``None``: ``1e-4`` (``"sum"``) or the
            paper's ``1e-7`` (``"mean"``; prompt tuning: ``1e-12``).
        params: what to train (default ``None``: every trainable parameter of ``model``): an iterable of parameters,
            or groups ``[{"params": [...], "weight_decay": w}, ...]`` that differ in ``weight_decay`` only (the
            direction is joint; ``add_param_group`` later is a ``ValueError``).
        loss: ``"cross_entropy"`` (default; class-index targets, ``-100`` ignored) or ``"mse"`` (float targets shaped
            like the logits).
        reduction: ``"sum"`` (default: ``lr`` and ``damping`` for ``L = sum_n l_n``) or ``"mean"`` (values for the
            mean over the batch's ``K`` counted target tokens, Hugging Face's ``outputs.loss`` and the paper's code,
            converted every step; ``step`` then returns ``L / K``). See the module docstring.
        normalize: rescale each update to norm ``lr`` (default ``False``: iEF's steps are used as they are).
        total_steps: ``T``: multiply the step size by ``1 - t/T`` (the paper's linear decay to 0); default ``None``
            (constant).
        momentum: heavy-ball momentum in ``[0, 1)`` on the preconditioned step (default ``0.0``: no buffer, the
            exact update bit for bit).
        dampening: in ``[0, 1]``, the buffer's ``1 - dampening`` weight on the new step (default ``0.0``;
            ``dampening=momentum`` keeps the momentum-free step scale).
        weight_decay: AdamW's decoupled decay ``theta <- (1 - lr_t wd) theta``, ``>= 0`` with
            ``lr * weight_decay < 1`` (default ``0.0``).
        check: the per-sample guard of :func:`ief.per_sample`: ``True`` (default: the thorough ``"exact"`` check on
            the first step, the ~free structural one after), ``"exact"`` (every step), a whole number ``N >= 1``
            (exact every N steps, structural between: the guarantee throughout at 1/N of its cost) or ``False``
            (off).
        form: the per-sample Jacobian's form (:func:`ief.per_sample`): ``"auto"`` (default: never forms ``[M, P]``),
            ``"dense"``, ``"ghost"`` or ``"rows"``.
        process_group: step across the processes of this ``torch.distributed`` group, exactly as one process on the
            union batch (module docstring); default: a ``DistributedDataParallel`` model's group, else none.

    Raises:
        ValueError: a bad argument, named with its value and the accepted values: a ``model`` that is not an
            ``nn.Module``, no trainable parameters, a ``params`` tensor not in the model, ``lr`` neither
            ``"auto"`` nor finite and ``> 0``, a negative or non-finite ``damping``, ``momentum`` outside ``[0, 1)``,
            ``dampening`` outside ``[0, 1]``, a negative ``weight_decay`` or ``lr * weight_decay >= 1``,
            ``total_steps`` not a positive integer, an unknown ``reduction``, ``check`` or ``form``; an initialised
            ``torch.distributed`` of world size > 1 with neither ``process_group`` nor a
            ``DistributedDataParallel`` model.

    Example::

        opt = ief.optim.IEF(model, lr=1.0, damping=1e-4)
        for inputs, targets in loader:
            loss = opt.step(inputs, targets)
    """

    method = "ief"
    _auto_lr = True

    @suggest_keywords
    def __init__(
        self,
        model: torch.nn.Module,
        lr: float | None = None,
        damping: float | None = None,
        *,
        params: Iterable[torch.nn.Parameter] | None = None,
        loss: str | Loss = "cross_entropy",
        reduction: str = "sum",
        normalize: bool = False,
        total_steps: int | None = None,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        check: bool | str | int = True,
        form: str = "auto",
        process_group: Any = None,
    ):
        if lr is None:
            lr = 100.0 if reduction == "mean" else 1.0
        super().__init__(model, lr, damping, params=params, loss=loss, reduction=reduction, normalize=normalize,
                         total_steps=total_steps, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                         check=check, form=form, process_group=process_group)

    def _direction(self, inputs, targets, group):
        r = self._per_sample(inputs, targets, group)
        rows = self._union_rows(r.jacobian)
        self._solved = ("iEF", rows.dtype)
        self._auto_gradient = lambda: (r.gradient, False)  # this rank's (lr="auto": read before J is reused)
        direction = ief_solve(rows, self._union_vector(r.logit_sqnorm), group["damping"], check=False)
        return self._union_vector(r.losses), direction


class EF(PreconditionedOptimizer):
    """Exact EF: ``theta <- theta - lr * J^T (J J^T + lambda I)^{-1} 1`` (``alg:EF``, ``eqn:EF_lsq``).

    Defaults to the paper's normalised update; pass ``total_steps`` for its linear decay to 0. ``momentum``,
    ``dampening`` and ``weight_decay`` as :class:`IEF` (``sec:app-limitations``; :mod:`ief.optim.momentum`): with
    the normalised update the buffer averages unit steps ``d_t / ||d_t||`` (EF's raw norms vary by orders of
    magnitude, which is why the paper normalises), and ``lr_t = lr (1 - t/T)`` scales the buffer and the decay.
    Cost of a step: as :class:`IEF`.

    Args:
        model: the ``nn.Module`` whose forward the optimiser runs.
        lr: the rate (default ``0.01``, the paper's normalised LoRA rate; prompt tuning: ``1``); ``"auto"``: set
            every step from the new batch's loss along the previous step, starting at ``0.01`` (the update's norm
            with ``normalize=True``), one extra forward without gradients a step (:mod:`ief.optim.auto_lr`; not
            measured for EF/SF: ``benchmarks/auto_lr.py`` trains iEF).
        damping: ``lambda >= 0``; default ``None``: ``1e-4`` (``reduction="sum"``) or ``1e-7`` (``"mean"``).
        params: what to train (default ``None``: every trainable parameter of ``model``): an iterable of parameters,
            or groups ``[{"params": [...], "weight_decay": w}, ...]`` that differ in ``weight_decay`` only (the
            direction is joint; ``add_param_group`` later is a ``ValueError``).
        loss: ``"cross_entropy"`` (default; class-index targets, ``-100`` ignored) or ``"mse"`` (float targets shaped
            like the logits).
        reduction: ``"sum"`` (default: ``lr`` and ``damping`` for ``L = sum_n l_n``) or ``"mean"`` (values for the
            mean over the batch's ``K`` counted target tokens, Hugging Face's ``outputs.loss`` and the paper's code,
            converted every step; ``step`` then returns ``L / K``). See the module docstring.
        normalize: rescale each update to norm ``lr`` (default ``True``: the paper's normalised update, because
            EF's raw norms vary by orders of magnitude).
        total_steps: ``T``: multiply the step size by ``1 - t/T`` (the paper's linear decay to 0); default ``None``
            (constant).
        momentum: heavy-ball momentum in ``[0, 1)`` on the preconditioned step (default ``0.0``: no buffer, the
            exact update bit for bit).
        dampening: in ``[0, 1]``, the buffer's ``1 - dampening`` weight on the new step (default ``0.0``;
            ``dampening=momentum`` keeps the momentum-free step scale).
        weight_decay: AdamW's decoupled decay ``theta <- (1 - lr_t wd) theta``, ``>= 0`` with
            ``lr * weight_decay < 1`` (default ``0.0``).
        check: the per-sample guard of :func:`ief.per_sample`: ``True`` (default: the thorough ``"exact"`` check on
            the first step, the ~free structural one after), ``"exact"`` (every step), a whole number ``N >= 1``
            (exact every N steps, structural between: the guarantee throughout at 1/N of its cost) or ``False``
            (off).
        form: the per-sample Jacobian's form (:func:`ief.per_sample`): ``"auto"`` (default: never forms ``[M, P]``),
            ``"dense"``, ``"ghost"`` or ``"rows"``.
        process_group: step across the processes of this ``torch.distributed`` group, exactly as one process on the
            union batch (module docstring); default: a ``DistributedDataParallel`` model's group, else none.

    Raises:
        ValueError: a bad argument, named with its value and the accepted values: a ``model`` that is not an
            ``nn.Module``, no trainable parameters, a ``params`` tensor not in the model, ``lr`` neither
            ``"auto"`` nor finite and ``> 0``, a negative or non-finite ``damping``, ``momentum`` outside ``[0, 1)``,
            ``dampening`` outside ``[0, 1]``, a negative ``weight_decay`` or ``lr * weight_decay >= 1``,
            ``total_steps`` not a positive integer, an unknown ``reduction``, ``check`` or ``form``; an initialised
            ``torch.distributed`` of world size > 1 with neither ``process_group`` nor a
            ``DistributedDataParallel`` model.
    """

    method = "ef"
    _auto_lr = True

    @suggest_keywords
    def __init__(
        self,
        model: torch.nn.Module,
        lr: float = 0.01,
        damping: float | None = None,
        *,
        params: Iterable[torch.nn.Parameter] | None = None,
        loss: str | Loss = "cross_entropy",
        reduction: str = "sum",
        normalize: bool = True,
        total_steps: int | None = None,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        check: bool | str | int = True,
        form: str = "auto",
        process_group: Any = None,
    ):
        super().__init__(model, lr, damping, params=params, loss=loss, reduction=reduction, normalize=normalize,
                         total_steps=total_steps, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                         check=check, form=form, process_group=process_group)

    def _direction(self, inputs, targets, group):
        r = self._per_sample(inputs, targets, group)
        rows = self._union_rows(r.jacobian)
        self._solved = ("EF", rows.dtype)
        self._auto_gradient = lambda: (r.gradient, False)  # this rank's (lr="auto": read before J is reused)
        return self._union_vector(r.losses), ef_solve(rows, group["damping"], check=False)


class SF(PreconditionedOptimizer):
    """Exact SF: ``theta <- theta - lr * (A^T A + lambda I)^{-1} grad L`` with ``A`` sampled (``alg:SF``).

    Labels are drawn from the model's predictive distribution with ``generator`` (default: the global RNG). Costs one
    extra backward per step. Defaults to the paper's normalised update; pass ``total_steps`` for the linear decay.
    ``momentum``, ``dampening`` and ``weight_decay`` as :class:`EF` (``sec:app-limitations``;
    :mod:`ief.optim.momentum`). ``state_dict()`` carries ``generator``'s state and ``load_state_dict`` restores it,
    so a resumed run draws the same labels.

    Args:
        model: the ``nn.Module`` whose forward the optimiser runs.
        lr: the rate (default ``0.01``, the paper's normalised LoRA rate; prompt tuning: ``1``); ``"auto"``: set
            every step from the new batch's loss along the previous step, starting at ``0.01`` (the update's norm
            with ``normalize=True``), one extra forward without gradients a step (:mod:`ief.optim.auto_lr`; not
            measured for EF/SF: ``benchmarks/auto_lr.py`` trains iEF).
        damping: ``lambda > 0`` (``eqn:SF-smw`` divides by it); default ``None``: ``1e-4`` (``reduction="sum"``)
            or ``1e-7`` (``"mean"``).
        generator: the ``torch.Generator`` the labels are drawn with (default ``None``: the global RNG).
        params: what to train (default ``None``: every trainable parameter of ``model``): an iterable of parameters,
            or groups ``[{"params": [...], "weight_decay": w}, ...]`` that differ in ``weight_decay`` only (the
            direction is joint; ``add_param_group`` later is a ``ValueError``).
        loss: ``"cross_entropy"`` (default; class-index targets, ``-100`` ignored) or ``"mse"`` (float targets shaped
            like the logits).
        reduction: ``"sum"`` (default: ``lr`` and ``damping`` for ``L = sum_n l_n``) or ``"mean"`` (values for the
            mean over the batch's ``K`` counted target tokens, Hugging Face's ``outputs.loss`` and the paper's code,
            converted every step; ``step`` then returns ``L / K``). See the module docstring.
        normalize: rescale each update to norm ``lr`` (default ``True``: the paper's normalised update, because
            EF's raw norms vary by orders of magnitude).
        total_steps: ``T``: multiply the step size by ``1 - t/T`` (the paper's linear decay to 0); default ``None``
            (constant).
        momentum: heavy-ball momentum in ``[0, 1)`` on the preconditioned step (default ``0.0``: no buffer, the
            exact update bit for bit).
        dampening: in ``[0, 1]``, the buffer's ``1 - dampening`` weight on the new step (default ``0.0``;
            ``dampening=momentum`` keeps the momentum-free step scale).
        weight_decay: AdamW's decoupled decay ``theta <- (1 - lr_t wd) theta``, ``>= 0`` with
            ``lr * weight_decay < 1`` (default ``0.0``).
        check: the per-sample guard of :func:`ief.per_sample`: ``True`` (default: the thorough ``"exact"`` check on
            the first step, the ~free structural one after), ``"exact"`` (every step), a whole number ``N >= 1``
            (exact every N steps, structural between: the guarantee throughout at 1/N of its cost) or ``False``
            (off).
        form: the per-sample Jacobian's form (:func:`ief.per_sample`): ``"auto"`` (default: never forms ``[M, P]``),
            ``"dense"``, ``"ghost"`` or ``"rows"``.
        process_group: step across the processes of this ``torch.distributed`` group, exactly as one process on the
            union batch (module docstring); default: a ``DistributedDataParallel`` model's group, else none.

    Raises:
        ValueError: a bad argument, named with its value and the accepted values: a ``model`` that is not an
            ``nn.Module``, no trainable parameters, a ``params`` tensor not in the model, ``lr`` neither
            ``"auto"`` nor finite and ``> 0``, a negative or non-finite ``damping`` (SF: ``damping > 0``),
            ``momentum`` outside ``[0, 1)``, ``dampening`` outside ``[0, 1]``, a negative ``weight_decay`` or
            ``lr * weight_decay >= 1``, ``total_steps`` not a positive integer, an unknown ``reduction``, ``check``
            or ``form``; an initialised ``torch.distributed`` of world size > 1 with neither ``process_group`` nor a
            ``DistributedDataParallel`` model.
        ValueError: from ``load_state_dict``, a state holding a generator's state loaded into an ``SF`` without one,
            or another optimiser's state (``ForeignStateError``).
    """

    _needs_positive_damping = True
    method = "sf"
    _auto_lr = True

    @suggest_keywords
    def __init__(
        self,
        model: torch.nn.Module,
        lr: float = 0.01,
        damping: float | None = None,
        *,
        generator: torch.Generator | None = None,
        params: Iterable[torch.nn.Parameter] | None = None,
        loss: str | Loss = "cross_entropy",
        reduction: str = "sum",
        normalize: bool = True,
        total_steps: int | None = None,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        check: bool | str | int = True,
        form: str = "auto",
        process_group: Any = None,
    ):
        super().__init__(model, lr, damping, params=params, loss=loss, reduction=reduction, normalize=normalize,
                         total_steps=total_steps, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                         check=check, form=form, process_group=process_group)
        self.generator = generator

    def _direction(self, inputs, targets, group):
        losses, grad, sampled = self._local(lambda: gradient_and_sampled_jacobian(
            self.model, inputs, targets, group["params"], loss=self.loss, generator=self.generator,
            check=self._check_now(), form=self.form,
        ))
        # the losses and the sampled rows are refused there when not finite; the gradient's check is read with the
        # step's (a non-finite gradient makes a non-finite direction, which the step then refuses as this)
        grad = self._union_sum(grad)
        self._checks.append((_finite(grad), "non-finite gradient"))
        rows = self._union_rows(sampled)
        self._solved = ("SF", rows.dtype)
        self._auto_gradient = lambda: (grad, True)  # the union batch's already (lr="auto")
        return self._union_vector(losses), sf_solve(rows, grad, group["damping"], check=False)

