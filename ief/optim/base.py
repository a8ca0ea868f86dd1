"""The class every preconditioned optimiser derives from: it validates, gathers and reads once; the math is elsewhere.

A step of :class:`PreconditionedOptimizer`, top to bottom (:meth:`PreconditionedOptimizer.step`):

1. the values of ``param_groups`` it is about to use are checked (a scheduler, ``load_state_dict`` or the user may
   have written them), and with ``reduction="mean"`` converted for the batch's token count
   (:mod:`ief.optim.convention`);
2. the subclass's ``_direction`` runs the forward and the per-sample backward and solves for the direction, returning
   a :class:`Direction` record: the losses, the direction, the checks it left for the step to read, which solve
   made it, the rows the guard's deferred check is asked of, the gradient ``lr="auto"`` reads, and what to keep
   once the step succeeded (K-FAC's running factors);
3. with ``lr="auto"``, one forward without gradients measures the new batch's loss along the previous change
   (:mod:`ief.optim.auto_lr`);
4. :func:`ief.optim.update.preconditioned_update` reads every check and value of the step in one host round-trip
   (:class:`ief.optim.checks.StepChecks`), refuses a non-finite one before anything changes, and applies the update
   with the schedule, momentum and decoupled weight decay.

Nothing passes from one phase to the next through the instance: the record and the checks are local to the step.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..directions import unrepresentable
from ..distributed import (
    DistributedRows,
    agree,
    all_gather_rows,
    all_reduce,
    batch_sizes,
    check_replicas,
    collective_device,
    resolve_group,
)
from ..jacobian.guard import deferred_finiteness
from ..losses import check_damping, count_targets, get_loss
from ..model_call import Inputs, _cuda_devices, call_model
from ..rows import as_rows
from ..sharded import default_group, inspect, local_tensor, unsharded_group
from . import state as saved
from .auto_lr import AUTO, INITIAL, AutoRate, check_auto, replayed, rng_states
from .calls import explained_step
from .checks import StepChecks, raised_message
from .convention import to_sum_convention, to_token_mean_convention
from .defaults import per_target_group
from .momentum import (
    check_dampening,
    check_group_extras,
    check_momentum,
    check_shared,
    check_weight_decay,
    resolve_groups,
)
from .options import (
    DEFAULT_DAMPING,
    MISSING,
    Settings,
    check_positive,
    check_reduction,
    check_total_steps,
    how_to_step,
    looks_unshifted,
)
from .report import StepReport, step_report
from .stall import StallWatch
from .update import preconditioned_update

DIVERGENCE_FACTOR = 100.0  # the growth of the mean loss over its lowest at which a step warns (orders of magnitude)


@dataclass
class Direction:
    """What a subclass's ``_direction`` found on the batch, for the rest of the step.

    Attributes:
        losses: the per-sample losses ``[M]`` (the union batch's across processes).
        direction: the preconditioned direction ``[P]``, unchecked (the step reads its finiteness).
        checks: the direction's own checks, ``[(0-d bool tensor, message)]`` in the order met (SF's gradient,
            K-FAC's running factors between refreshes).
        deferred: the per-sample guard's finiteness checks of the losses and rows,
            ``[(function of the rows used, message)]`` (:func:`ief.jacobian.guard.deferred_finiteness`), asked of
            ``rows`` at the step's read. Only in one process: across processes the guard's check is read at once on
            every rank (:func:`ief.distributed.agree`), so nothing is deferred there.
        rows: the rows the solve used (one process only; ``None`` across processes or without rows).
        solved: ``(method, dtype)`` of a Woodbury solve that returned the direction unchecked (names what a
            non-finite direction means), or ``None``.
        gradient: for ``lr="auto"``, a function of no argument returning ``(the batch gradient, whether it is the
            union batch's already)``; called before anything reuses ``J``'s buffer.
        keep: what to keep once the update succeeded (K-FAC's running factors), a function of no argument.
        rate: the batch's rate when it was set after the forward (:meth:`PreconditionedOptimizer._batch_defaults`:
            iEF's per-batch default), else ``None`` (the rate of ``_settings_for``).
        local: ``direction`` is this rank's shards of the union's (an FSDP2 model, ``[P_local]``,
            :meth:`ief.sharded.ShardedModel.combine`), not the whole ``[P]``.
    """

    losses: torch.Tensor
    direction: torch.Tensor
    checks: list[tuple[torch.Tensor, Any]] = field(default_factory=list)
    deferred: list[tuple[Callable, Any]] = field(default_factory=list)
    rows: Any = None
    solved: tuple[str, torch.dtype] | None = None
    gradient: Callable[[], tuple[torch.Tensor, bool]] | None = None
    keep: Callable[[], None] = lambda: None
    rate: float | str | None = None
    local: bool = False

    def direction_message(self) -> Any:
        """What a non-finite direction means: the solve's overflow of the model's dtype, or non-finite gradients."""
        if self.solved is None:
            return "non-finite gradients or update"
        return lambda: unrepresentable(*self.solved)


class PreconditionedOptimizer(torch.optim.Optimizer):
    """Shared machinery of :class:`ief.optim.IEF`, ``EF``, ``SF`` and :class:`ief.optim.KFAC` (module docstring): a
    subclass provides ``_direction``.

    Args:
        model: the ``nn.Module`` whose forward the optimiser runs.
        lr: the rate (finite, > 0), or ``"auto"`` where the class offers it.
        damping: ``lambda``, or ``None`` for the reduction's default.
        settings: the shared settings (:class:`ief.optim.options.Settings`).
    """

    _needs_positive_damping = False
    _auto_lr = False  # whether lr="auto" (ief.optim.auto_lr) is offered
    _across_processes = True  # the step is exact over the union of the ranks' batches (ief.distributed)
    _fsdp2_refusal: str | None = None  # why the method cannot step on FSDP2 shards (None: it can, ief.sharded)
    method = ""  # "ief" / "ef" / "sf" / "kfac": the rule that converts a token-mean rate (reduction="mean")

    def __init__(self, model: torch.nn.Module, lr: float | str, damping: float | None, settings: Settings):
        self._constructed = False
        if not isinstance(model, torch.nn.Module):  # a ValueError, as every bad argument of the constructors
            raise ValueError(  # noqa: TRY004
                f"model must be a torch.nn.Module (the optimiser runs its forward), got {type(model).__name__}")
        group = settings.process_group
        if group is None:  # an FSDP2 model steps across the processes it is sharded over (ief.sharded)
            group = default_group(model, type(self).__name__)
        self._group = resolve_group(model, group, type(self).__name__)
        self._auto: AutoRate | None = None
        if check_auto(lr, type(self).__name__, self._auto_lr):  # the adapted rate (ief.optim.auto_lr)
            self._auto = AutoRate(INITIAL[self.method])
        else:
            lr = check_positive("lr", lr)
        self.last_lr: float | None = None  # the rate of the last step, in the reduction's convention
        if damping is None:  # the defaults of ief.optim.exact's docstring
            damping = DEFAULT_DAMPING[check_reduction(settings.reduction)]
        damping = check_damping(damping, allow_zero=not self._needs_positive_damping)
        total_steps = check_total_steps(settings.total_steps)
        momentum, dampening = check_momentum(settings.momentum), check_dampening(settings.dampening)
        weight_decay = check_weight_decay(settings.weight_decay)
        self.reduction = check_reduction(settings.reduction)
        groups = resolve_groups(model, settings.params)
        self._sharded = inspect(model, [p for g in groups for p in g["params"]], type(self).__name__,
                                supported=self._fsdp2_refusal, auto_lr=self._auto is not None,
                                process_group=settings.process_group)
        super().__init__(groups, {"lr": lr, "damping": damping, "normalize": bool(settings.normalize),
                                  "total_steps": total_steps, "momentum": momentum, "dampening": dampening,
                                  "weight_decay": weight_decay})
        for group in self.param_groups:
            check_group_extras(group)
        self.model = model
        self.loss = settings.loss
        self._last_update_norm: Any = None  # a float, or a function that reads it (see last_update_norm)
        self.last_losses: torch.Tensor | None = None
        self.last_tokens: int | None = None  # K of the last batch (reduction="mean")
        self._warned_unshifted = False
        self._lowest_loss: tuple[float, int] | None = None  # the divergence watch's lowest mean loss and its step
        self._warned_divergence = False
        self.stall_watch = StallWatch(type(self).__name__)  # warns once when the loss stays put (ief.optim.stall)
        self._per_target = getattr(self, "_per_target", (False, False))  # IEF's defaults (ief.optim.defaults)
        self.last_step_report: StepReport | None = None  # what the last step ran (ief.optim.report)
        self._reported: tuple = (None, None)  # this rank's rows and the union's (_union_rows), for the report
        self._replicas_agree = False  # compared across the group at the first step, and again after a load
        self.register_load_state_dict_post_hook(lambda opt: setattr(opt, "_replicas_agree", False))
        self._constructed = True

    def add_param_group(self, param_group: dict) -> None:
        """Refused after construction (``ValueError``): the update preconditions all parameters jointly, so the
        groups are fixed when the per-sample machinery is built (see :mod:`ief.optim.exact`).

        Args:
            param_group: the group torch's constructor adds (accepted only while constructing).
        """
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

    # ------------------------------------------------------------------------------------------------ the state
    def _identity(self) -> dict:
        """The class and the constructor settings that change the method, as :meth:`state_dict` records them
        (K-FAC adds its kind)."""
        loss = self.loss if isinstance(self.loss, str) else getattr(self.loss, "name", type(self.loss).__name__)
        return {"class": type(self).__name__, "normalize": bool(self.param_groups[0]["normalize"]), "loss": loss,
                "reduction": self.reduction}

    def state_dict(self) -> dict:
        """torch's optimiser state plus ``"ief_optimizer"`` (the class and the settings that change the method, so
        that another optimiser refuses it), with ``lr="auto"`` ``"auto_lr"`` (the rate and the last step's change,
        :mod:`ief.optim.auto_lr`) and, with ``generator=``, ``"generator_state"``.

        Returns:
            The state, for :meth:`load_state_dict`.
        """
        state = super().state_dict()
        state[saved.STATE_KEY] = self._identity()
        if self._auto is not None:
            state[saved.AUTO_KEY] = self._auto.state()
        return saved.store_generator(state, getattr(self, "generator", None))

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore :meth:`state_dict`'s output: the step counter, momentum buffers, ``param_groups`` values (and the
        generator's state, ``lr="auto"``'s rate and last change), after checking whose state it is.

        Args:
            state_dict: the output of this class's :meth:`state_dict` with the same settings, for the same
                parameters (or one saved before the class was recorded, whose ``normalize`` matches).

        Raises:
            ForeignStateError: (a ``ValueError``) the state is another method's or settings' (e.g. ``IEF``'s into
                ``EF``), a torch optimiser's (e.g. ``torch.optim.AdamW``'s), or another model's (a momentum buffer
                or ``lr="auto"`` change whose shape is not its parameter's, named); the message names both.
            ValueError: it holds a generator's state and this optimiser has no generator.
        """
        saved.check_origin(self._identity(), state_dict)
        # an FSDP2 model's state is this rank's: each momentum buffer is its parameter's local shard (ief.sharded)
        saved.check_tensors(state_dict, self._param_names(), [local_tensor(p) for p in self._all_params()],
                            saved.describe(self._identity()))
        state_dict = dict(state_dict)
        state_dict.pop(saved.STATE_KEY, None)
        generator = getattr(self, "generator", None)
        generator_state = saved.pop_generator_state(state_dict, generator, type(self).__name__)
        auto = state_dict.pop(saved.AUTO_KEY, None)
        if auto is not None:
            if not self._auto_lr:
                raise saved.ForeignStateError(f"this state_dict holds an adapted rate (lr={AUTO!r}), which "
                                              f"{type(self).__name__} does not take")
            restored = AutoRate(INITIAL[self.method])
            restored.load(auto)  # checked before anything loads
            if restored.delta is not None:  # the last step's change, on its parameter's device
                restored.delta = [d.to(p.device) for d, p in zip(restored.delta, self._all_params())]
        super().load_state_dict(state_dict)
        saved.restore_generator(generator, generator_state)
        if auto is not None:
            self._auto = restored

    def _param_names(self) -> list[str]:
        names = {id(p): name for name, p in self.model.named_parameters()}
        return [names.get(id(p), "?") for p in self._all_params()]

    def _all_params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    @property
    def steps_taken(self) -> int:
        """The number of steps taken (``state[p]["step"]`` of the first parameter)."""
        first = self.param_groups[0]["params"][0]
        return int(self.state[first].get("step", 0))

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

    def _check_replicas(self) -> None:
        """Every rank's model parameters, optimiser state and settings the same (:func:`ief.distributed.check_replicas`:
        :class:`ief.distributed.ReplicaMismatch` on every rank, naming the first that differs), at the first step
        and at the first step after ``load_state_dict``. An FSDP2 model's sharded tensors (``DTensor``: each rank
        holds its own shard by design) and their state (momentum buffers: local shards) are left out; its settings
        and unsharded tensors are compared."""
        from torch.distributed.tensor import DTensor

        named = [(name, p) for name, p in self.model.named_parameters() if not isinstance(p, DTensor)]
        index = {id(p): name for name, p in self.model.named_parameters()}
        state = [(f"{index.get(id(p), 'a parameter')}: {key}", value) for p in self._all_params()
                 if not isinstance(p, DTensor) for key, value in sorted(self.state.get(p, {}).items())
                 if isinstance(value, torch.Tensor) and not isinstance(value, DTensor)]
        settings = {"optimiser": self._identity(), "check": getattr(self, "check", None),
                    "form": getattr(self, "form", None), "step": self.steps_taken,
                    **{f"param_groups[{i}]['{key}']": value for i, g in enumerate(self.param_groups)
                       for key, value in sorted(g.items()) if key != "params"}}
        when = "before the first step" if self.steps_taken == 0 else f"at step {self.steps_taken}, after a load"
        check_replicas(self._group, collective_device(self._group), named + state, settings, when)
        self._replicas_agree = True

    # ------------------------------------------------------------------------------------------------- the step
    @explained_step  # opt.step(**batch) and a batch still holding 'labels' get their own sentence
    def step(self, inputs: Inputs = MISSING, targets: torch.Tensor = MISSING, *, closure: Any = None) -> torch.Tensor:
        """One update on the batch ``(inputs, targets)``: the forward, the per-sample backward and the update.

        Args:
            inputs: what the model takes: a tensor, a tuple, or a dict passed as ``model(**inputs)``.
            targets: class indices ``[M]`` / ``[M, T]`` with ``-100`` ignored (causal LMs:
                ``ief.causal_lm_targets(labels)``), or float targets with ``loss="mse"``.
            closure: refused (``TypeError``): the optimiser runs the forward and backward itself.

        Returns:
            The batch loss before the update, a 0-dim tensor: ``L = sum_n l_n``, or ``L / K`` with ``"mean"``.

        Raises:
            TypeError: no batch (``step()``, ``step(closure)``: how these optimisers are driven, in one sentence).
            ValueError: a bad value in ``param_groups`` (checked every step: ``lr = 0`` is a zero update), groups that
                disagree on more than ``weight_decay``, ``reduction="mean"`` with no counted target; nothing changed.
            FloatingPointError: a non-finite loss, gradient or update (``"step k: ...; parameters left unchanged"``).
            PerSampleGradientMismatch: the per-sample guard's refusal (see :func:`ief.per_sample`).
            ief.distributed.ReplicaMismatch: (a ``ValueError``, across processes) at the first step, and the first
                after ``load_state_dict``, on every rank, when the ranks' parameters, optimiser state or settings
                differ, naming the first that differs; nothing changed.

        Warns:
            UserWarning: once, for targets equal to ``inputs["input_ids"]`` (Hugging Face's unshifted labels).
            SlowPathWarning: once per model, naming parameters whose per-sample gradients take the per-sample loop.
        """
        if targets is MISSING or closure is not None:
            raise TypeError(how_to_step(type(self).__name__))
        if self._group is not None and not self._replicas_agree:
            self._check_replicas()
        given, batch, tokens = self._settings_for(inputs, targets)
        number, auto = self.steps_taken, given["lr"] == AUTO
        rng = self._rng_states() if auto else None  # the forward's, replayed by the probe after the update
        self._reported = (None, None)
        try:
            # (FSDP2: ief.sharded; the rows layer by layer except on a step of the exact check, whose extra forwards
            # and backwards are the same on every rank only with every module unsharded)
            with torch.enable_grad(), unsharded_group(self._sharded, batch,
                                                      layerwise=self._check_now() != "exact") as stepped:
                found = self._direction(inputs, targets, stepped)
        except FloatingPointError as err:
            raise FloatingPointError(f"step {number}: {err}; parameters left unchanged") from err
        checks = self._checks_of(found, number)
        if auto and self._auto.delta is not None:  # the new batch's loss along the previous step
            self._auto.pending = self._auto_probe(inputs, targets, found, rng)
        if found.rate is not None:  # set after the forward (_batch_defaults)
            batch = dict(batch, lr=found.rate)
        self._update(given, batch, found, tokens, checks)
        found.keep()  # (K-FAC's running factors: kept once the step succeeded)
        self.last_losses = found.losses
        self.last_step_report = self._report(number, found)
        return found.losses.sum() if tokens is None else found.losses.sum() / tokens

    def _settings_for(self, inputs: Inputs, targets: torch.Tensor) -> tuple[dict, dict, int | None]:
        """``(given, batch, K)``: ``given`` is ``param_groups[0]`` as the user (or a scheduler) set it, in the
        ``reduction``'s convention, checked; ``batch`` holds the same values with every group's parameters and, with
        ``reduction="mean"``, ``lr`` and ``damping`` converted to the sum convention for this batch's ``K`` tokens
        (``K``: ``None`` with ``reduction="sum"``)."""
        dampings = [self._check_group(index, g) for index, g in enumerate(self.param_groups)]
        try:
            check_shared(self.param_groups)
        except ValueError as err:
            raise ValueError(f"step {self.steps_taken}: {err}; parameters left unchanged") from None
        self._warn_unshifted(inputs, targets)
        given = self.param_groups[0]
        # one joint direction over every group's parameters, with the damping as checked (the groups agree on it)
        batch = dict(given, params=self._all_params(), damping=dampings[0])
        auto = given["lr"] == AUTO  # the rate is set after the step's read, from the previous steps (auto_lr)
        if auto and self._auto is None:  # "auto" written into param_groups of an optimiser built with a number
            self._auto = AutoRate(INITIAL[self.method])
        if self.reduction != "mean":
            return given, batch, None
        tokens = self.last_tokens = self._tokens(targets)  # the given (token-mean) rates as sum ones for this batch
        lr, damping = to_sum_convention(self.method, 1.0 if auto else batch["lr"], batch["damping"], tokens,
                                        normalized=batch["normalize"])
        if not math.isfinite(damping):  # the conversion's K^2 overflowed a checked (finite) damping
            raise ValueError(f"step {self.steps_taken}: damping {batch['damping']!r} for the token mean is "
                             f"{damping!r} for the sum over this batch's {tokens} tokens (x K^2): use a smaller "
                             f"damping; parameters left unchanged")
        return given, dict(batch, lr=AUTO if auto else lr, damping=damping), tokens

    def _checks_of(self, found: Direction, number: int) -> StepChecks:
        """The step's checks, in the order they were met: the per-sample guard's (naming the samples), the
        direction's own, the losses'; the update adds the direction's and the momentum buffers'."""
        if found.deferred and self._group is not None:  # the guard defers only in one process (Direction.deferred)
            raise RuntimeError("a deferred per-sample check across processes would be read on one rank only")
        checks = StepChecks(number)
        for flag, message in found.deferred:  # asked late, of the rows the solve used (a Gram's diagonal)
            checks.add(lambda flag=flag: flag(found.rows), message)
        for flag, message in found.checks:
            checks.add(flag, message)
        checks.add(torch.isfinite(found.losses).all(), lambda: f"non-finite loss {found.losses.tolist()}")
        return checks

    def _update(self, given: dict, batch: dict, found: Direction, tokens: int | None, checks: StepChecks) -> None:
        """Apply ``found.direction`` (:func:`ief.optim.update.preconditioned_update`) after the step's one host read.

        ``given``: ``param_groups[0]`` as the user set it (the decay and the momentum buffer's rate use it);
        ``batch``: its values for this batch (:meth:`_settings_for`; a momentum-free step's rate). Read with the
        checks: the batch's mean loss (the divergence watch) and, with ``lr="auto"``, the new batch's ``D`` and ``E``
        along the previous change, which set this step's rate (:mod:`.auto_lr`)."""
        auto = self._auto if given["lr"] == AUTO else None
        watched = checks.also_read(found.losses.mean().detach().to(torch.float64).reshape(()))
        probed = checks.also_read(*auto.pending.unbind()) if auto is not None and auto.pending is not None else None
        factor = 1.0  # c_t: the batch's own factor (the token-mean conversion of the rate)
        if tokens is not None:
            factor = to_sum_convention(self.method, 1.0, 1.0, tokens, normalized=given["normalize"])[0]

        def rates() -> tuple[float, float]:  # after the read: (the given rate, the batch's), settled with lr="auto"
            lr, batch_lr = given["lr"], batch["lr"]
            if auto is not None:
                rate = auto.settle(checks.values(probed) if probed is not None else None)
                lr, batch_lr = self._auto_rates(tokens, batch["normalize"], rate)
            self.last_lr = lr
            self._watch_divergence(checks.values(watched)[0], checks.number, lr)
            self.stall_watch.observe(checks.values(watched)[0], checks.number, batch_lr)
            return lr, batch_lr

        decays = [group["weight_decay"] for group in self.param_groups for _ in group["params"]]
        update = preconditioned_update(
            self._all_params(), found.direction, self.state, lr=rates, momentum=given["momentum"],
            dampening=given["dampening"], weight_decay=decays, normalize=batch["normalize"],
            total_steps=given["total_steps"], batch_factor=factor, checks=checks,
            direction_message=found.direction_message(), keep_change=auto is not None, sharded=self._sharded,
            local_direction=found.local)
        if auto is not None:
            auto.delta = update.change
        self.last_update_norm = update.norm

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
            check_total_steps(group.get("total_steps"))
            check_group_extras(group)
        except ValueError as err:
            raise ValueError(f"{where}: {err}; parameters left unchanged") from None
        return damping

    def _warn_unshifted(self, inputs: Inputs, targets: torch.Tensor) -> None:
        """On the first step only (reading the targets on the host every step would stall a GPU; the same pipeline
        feeds the later batches), warn when the targets look like Hugging Face's unshifted causal-LM labels."""
        if not self._warned_unshifted and self.steps_taken == 0 and looks_unshifted(inputs, targets):
            self._warned_unshifted = True
            warnings.warn(
                "the targets equal inputs['input_ids'] at every counted position: for a causal LM (GPT-2, Llama, "
                "...) these are Hugging Face's unshifted labels, and this step trains every position to predict its "
                "own input token; pass ief.causal_lm_targets(labels) (the next token at each position)",
                UserWarning, stacklevel=5)  # (torch.optim wraps step: 5 is the caller's line)

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

    # ------------------------------------------------------------------------------------------------ lr="auto"
    def _auto_rates(self, tokens: int | None, normalized: bool, rate: float) -> tuple[float, float]:
        """``(lr, batch_lr)``: the adapted ``rate`` (sum convention) in the ``reduction``'s convention and for this
        batch, kept where every group's decay factor ``1 - lr wd`` stays >= 1/2."""
        def convert(value: float, to_sum: bool) -> float:
            if tokens is None:
                return value
            return (to_sum_convention if to_sum else to_token_mean_convention)(
                self.method, value, 1.0, tokens, normalized=normalized)[0]

        lr = convert(rate, to_sum=False)
        decay = max(g["weight_decay"] for g in self.param_groups)
        if decay and lr * decay > 0.5:
            lr = 0.5 / decay
            rate = self._auto.rate = convert(lr, to_sum=True)
        return lr, rate

    def _rng_states(self) -> tuple[tuple, list[int]]:
        """The RNG states of the CPU and the model's CUDA devices, and those devices (before the step's forward)."""
        devices = _cuda_devices(self.model)
        return rng_states(devices), devices

    @torch.no_grad()
    def _auto_probe(self, inputs: Inputs, targets: torch.Tensor, found: Direction,
                    rng: tuple[tuple, list[int]]) -> torch.Tensor:
        """The new batch's loss along the previous step ``delta``: ``D = L(theta_t) - L(theta_{t+1})`` by one forward
        without gradients at ``theta_t = theta_{t+1} + delta`` (the step's RNG state: its dropout masks), and
        ``E = grad L(theta_{t+1}) . delta``, both of the union batch, as a ``[2]`` float64 tensor left on the device
        for the step's read."""
        gradient, union = found.gradient()
        params = self._all_params()
        g = torch.split(gradient.reshape(-1), [p.numel() for p in params])
        slope = sum(torch.dot(gk.to(torch.float64), d.reshape(-1).to(torch.float64))
                    for gk, d in zip(g, self._auto.delta))
        slope = slope if union else self._union_sum(slope)
        kept = [p.data for p in params]
        try:
            for p, d in zip(params, self._auto.delta):
                p.data = (p.data.to(d.dtype) + d).to(p.dtype)
            with replayed(*rng):
                logits = call_model(self.model, inputs)
        finally:
            for p, data in zip(params, kept):
                p.data = data
        torch.clear_autocast_cache()
        before = self._union_sum(get_loss(self.loss).per_sample(logits, targets).to(torch.float64).sum())
        achieved = before - found.losses.detach().to(torch.float64).sum()
        return torch.stack([achieved, slope.to(achieved.device)])

    def _watch_divergence(self, mean_loss: float, number: int, lr: float) -> None:
        """Warn once (``UserWarning``) when the mean per-sample loss has grown by :data:`DIVERGENCE_FACTOR` over the
        lowest this optimiser has seen: a rate too large for the method's linear model of the loss (iEF's first
        step asks each sample's loss to fall by ``lr * s_n``, more than the loss itself once ``lr`` is large). The
        loss is read with the step's checks, so the watch costs no host round-trip of its own."""
        if not math.isfinite(mean_loss):
            return
        lowest = self._lowest_loss
        if lowest is None or mean_loss < lowest[0]:
            self._lowest_loss = (mean_loss, number)
            return
        if not self._warned_divergence and mean_loss > DIVERGENCE_FACTOR * max(lowest[0], 1e-12):
            self._warned_divergence = True
            warnings.warn(
                f"{type(self).__name__}: the mean per-sample loss grew from {lowest[0]:.4g} (step {lowest[1]}) to "
                f"{mean_loss:.4g} (step {number}) with lr={lr:g}: the updates are overshooting; try a rate about 10x "
                f"smaller (lr={lr / 10:g}), a larger damping, or normalize=True with total_steps (said once)",
                UserWarning, stacklevel=7)

    # --------------------------------------------------------------------------------- the direction's helpers
    def _direction(self, inputs: Inputs, targets: torch.Tensor, batch: dict) -> Direction:
        """The batch's direction and what the step reads with it (a subclass's; ``batch``: :meth:`_settings_for`)."""
        raise NotImplementedError

    def _batch_defaults(self, batch: dict, targets: torch.Tensor, counted: int | None) -> dict:
        """``batch`` with the default rate and damping set for this batch's counted targets per sample (IEF's
        ``lr=None`` / ``damping=None``, :mod:`ief.optim.defaults`), after the forward and before the solve:
        ``counted`` is the ``K`` the loss's range check read (:attr:`ief.jacobian.PerSample.counted`), so the default
        costs no host read of its own. Unchanged when both were given."""
        if not any(self._per_target):
            return batch
        return per_target_group(batch, targets, *self._per_target, type(self).__name__, self.steps_taken,
                                self._group, counted=counted, stacklevel=7)

    def _check_now(self) -> bool | str:
        """The per-sample check of this step (:class:`ief.optim.IEF`'s ``check``; none here)."""
        return False

    def _local(self, compute: Callable[[], Any]) -> tuple[Any, list]:
        """This rank's own per-sample work: ``(compute(), deferred checks)``.

        In one process, on a step without the exact per-sample check, the guard's check of the losses and rows is
        deferred (:func:`ief.jacobian.guard.deferred_finiteness`: no host read of its own) and returned, to be read
        with the step's checks (:attr:`Direction.deferred`); on an exact-check step it is read at once, before the
        check compares rows. Across processes every check is read at once and :func:`ief.distributed.agree` makes a
        failure on any rank raise on every rank, before the collectives of the solve (no rank is left waiting in
        one): nothing is deferred there."""
        if self._group is not None:
            return agree(self._group, collective_device(self._group), compute), []
        if self._check_now() == "exact":
            return compute(), []
        with deferred_finiteness() as pending:
            out = compute()
        return out, [(flag, lambda refuse=refuse: raised_message(refuse)) for flag, refuse in pending]

    def _union_rows(self, jacobian: Any, shard: bool = False) -> tuple[Any, list[int] | None]:
        """``(rows, sizes)``: this process's rows (``sizes``: ``None``), or the union batch's across processes with
        the ranks' sample counts (exchanged here, once per step; :meth:`_union_vector` takes them). ``shard``: on
        an FSDP2 model, the rows' final combination is this rank's shards of the direction (``Direction.local``)."""
        rows = as_rows(jacobian)
        if self._group is None:
            self._reported = (jacobian, None)
            return rows, None
        sizes = batch_sizes(rows.shape[0], self._group, collective_device(self._group))
        union = DistributedRows(rows, self._group, sizes, self._sharded if shard else None)
        self._reported = (jacobian, union)
        return union, sizes

    def _report(self, number: int, found: Direction) -> StepReport:
        """The certificate of the step just taken (:mod:`ief.optim.report`)."""
        rows, union = self._reported
        method = found.solved[0] if found.solved is not None else type(self).__name__
        return step_report(number, method, rows, self._param_names(), union,
                           None if self._sharded is None else self._sharded.route)

    def _union_vector(self, local: torch.Tensor, sizes: list[int] | None) -> torch.Tensor:
        """A per-sample vector of this rank (losses, ``s``), or the union batch's (``sizes``: :meth:`_union_rows`'),
        concatenated in rank order."""
        if self._group is None:
            return local
        return all_gather_rows(local, sizes, self._group)

    def _union_sum(self, local: torch.Tensor) -> torch.Tensor:
        """A sum over this rank's samples (the batch gradient), or over the union batch's (summed in float64)."""
        if self._group is None:
            return local
        return all_reduce(local.to(torch.float64), self._group).to(local.dtype)


__all__ = ["Direction", "PreconditionedOptimizer"]
