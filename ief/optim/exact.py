"""Stochastic optimisers with the exact iEF, EF and SF updates (the paper's Algorithms 1, 2 and 3).

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
buffers (and SF's ``generator`` state). The state is the optimiser's (:mod:`ief.optim.state`):
``load_state_dict`` refuses another method's or settings' state, a torch optimiser's, or another model's
(``ForeignStateError``, a ``ValueError`` naming both).

How a step is built: :mod:`ief.optim.base` (the class validates, gathers and reads the device once;
:class:`ief.optim.checks.StepChecks`), :func:`ief.optim.update.preconditioned_update` (the update as a function).

Several processes (data parallel: torchrun, accelerate, DDP): ``IEF``, ``EF`` and ``SF`` take ``process_group=``
(default: the group of a ``torch.nn.parallel.DistributedDataParallel`` model, else one process) and then step exactly
as one process stepping on the union of the ranks' batches, concatenated in rank order (:mod:`ief.distributed`: the
union's Gram on every rank, one replicated float64 solve, one all-reduce of the direction; the token count of
``reduction="mean"`` and the returned loss are the union's; momentum and weight decay replicated). The model's own DDP
gradient all-reduce never runs (the optimiser runs the wrapped module). A failure on one rank (a non-finite loss, a
refused check) raises on every rank. SF draws each rank's labels with that rank's ``generator``: the union-batch
equivalence holds given the same labels (seed each rank's generator, e.g. ``seed + rank``, for reproducible runs).
A model sharded with FSDP2 (``fully_shard``) steps the same way over FSDP2's group, each rank updating its shards
(:mod:`ief.sharded`, which also names what is refused there); ``last_step_report`` says what every step ran
(:mod:`ief.optim.report`). Without a group, an initialised ``torch.distributed`` of world size > 1 is refused (each
replica would solve its own batch's Gram system and drift apart silently). ``KFAC`` takes ``process_group=`` too (the
union batch's factors: :mod:`ief.optim.kfac`).

Momentum and weight decay (``momentum``, ``dampening``, ``weight_decay``; all 0 by default, which is the paper's
exact update bit for bit): heavy-ball momentum on the batch's preconditioned step and AdamW's decoupled weight
decay, derived in :mod:`ief.optim.momentum` (the paper's Appendix G, "Limitations", leaves both to future work).

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
(:mod:`ief.optim.convention`, which derives the conversion: iEF's rate by ``1/K``, un-normalised EF/SF's by ``K``,
normalised updates unchanged, the damping by ``K^2``), and ``step`` returns ``L / K``. ``param_groups`` keep the
given values (a scheduler acts on them).

Bad values are refused before anything changes: the constructor checks ``lr`` (finite, > 0, or ``"auto"``), ``damping``
(finite, >= 0; > 0 for SF), ``total_steps``, ``momentum`` (in [0, 1)), ``dampening`` (in [0, 1]), ``weight_decay``
(finite, >= 0, ``lr * weight_decay < 1``) and ``check``; every ``step`` checks the values it is about to use again,
because a scheduler, ``load_state_dict`` or the user can write any value into ``param_groups``. There ``lr == 0`` is
accepted (a zero update: warm-up schedulers start at 0, as torch's optimisers allow), a negative or non-finite ``lr`` or
a bad ``damping`` raises ``ValueError`` naming the group, the key and the value, with the parameters and the step
counter untouched. A non-finite loss, gradient or update raises ``FloatingPointError`` ("step N: ...; parameters left
unchanged"), also before any parameter changes, in the step that met it (not a step later).

Host round-trips (what stalls a GPU): these checks are computed on the device and read together
(:class:`ief.optim.checks.StepChecks`), so a steady step (after step 0's exact per-sample check, which reads the
guard's finiteness at once) reads the device twice: the targets' class range (before the loss, which cannot take an
index out of range), then once for every other check: the per-sample guard's finiteness of the losses and rows, the
direction's, SF's gradient's, the momentum buffers', K-FAC's running factors' between refreshes, with, for a
normalised update, the direction's norm; the first that fails is named. ``last_update_norm`` is kept on the device and
read when asked; ``lr="auto"``'s two scalars are read with the checks (no read of their own). IEF's default rate and
damping (``lr=None`` or ``damping=None`` with ``reduction="sum"``) take the batch's target count from the range
check's read (no read of their own); ``reduction="mean"`` reads it once more (:func:`ief.count_targets`). (A float32
``J``'s Gram
solve is an ``eigh``, whose CUDA error check also waits for the device; ``benchmarks/host_syncs.py`` counts both
kinds.)

Schedules: ``normalize=True`` rescales each update to norm ``lr`` ("normalised update"), and ``total_steps=T``
multiplies the step size by ``1 - t/T`` (linear decay to 0). The paper trains EF and SF with both (Appendix H.2,
"Optimisation Experimental Setup") because of EF's inversely-scaled update norms; iEF uses a constant learning rate.

**Defaults** depend on ``reduction`` (Appendix H.2). ``"mean"``: the paper's LoRA values, iEF ``lr=100``,
EF/SF ``lr=0.01`` (normalised update), damping ``1e-7`` (prompt tuning: damping ``1e-12``, iEF ``lr=50``, EF/SF
``lr=1``); the paper tuned them for batches of 32 samples of a few target tokens each. ``"sum"``: iEF ``lr = 0.3 / T``
and damping ``1e-4 T^2`` set for each batch from its counted targets per sample ``T`` (:mod:`ief.optim.defaults`: the
step of a sum over ``T`` tokens is ``T`` times a one-label sample's, so no fixed rate suits both; chosen on a
classifier, a padded causal LM, a seq2seq task and an MLP, checked on held-out tasks by ``benchmarks/defaults.py``),
EF/SF ``lr=0.01`` (a normalised rate is the same in both conventions) and damping ``1e-4``, about the paper's ``1e-7``
converted for a batch of ``K = 32`` target tokens (``K^2 lambda``). The paper's values taken literally in the sum
convention are unstable: iEF moves every sample's logits by ``-lr`` times its loss gradient to first order (the
paper's Eq. (8), ``J d = s``), so ``lr=100`` moves them 100 times as far as ``lr=1`` does, and ``damping=1e-7``
leaves the Gram system's small eigenvalues unregularised (the sum convention's ``J J^T`` is ``K^2`` times the mean
convention's, so the same ``lambda`` damps ``K^2`` times less). The measurements behind these defaults, and the
companion's searched rates, are kept with the benchmarks (``benchmarks/README.md``, "The optimisers' defaults").
``lr="auto"`` (an option, not the default; :mod:`ief.optim.auto_lr`) needs no search: starting at iEF's
``1`` (EF/SF: ``0.01``) in the sum convention, every step multiplies the rate by the minimiser of a quadratic fitted to
the new batch's loss along the previous step (achieved reduction by one extra forward without gradients, slope from the
step's own gradient), the factor kept in ``[1/2, 2]`` and the rate at most 10 times its first; the rate is the same in
both conventions (the sum convention's; ``last_lr`` reports it in the ``reduction``'s), ``state_dict`` carries it,
schedulers cannot drive it, and it makes no host round-trip of its own.

Memory: ``form="auto"`` (default) never forms the ``[M, P]`` per-sample Jacobian: every ``nn.Linear`` weight's Gram
block and direction come from its layer's inputs and output gradients (the ghost kernel where that is the fewest
flops), or from its per-sample rows, kept while the rows the step keeps fit ``memory_budget`` (default: twice the
model's parameter bytes, what AdamW's moments would hold, at least 8 MiB), else from its rows formed a block at a time
and dropped (:mod:`ief.streamed`: the rule and the cost model), and an embedding table keeps only the rows the batch
uses (see ``ief.per_sample``'s ``form``); ``form="dense"`` forms ``J`` (reusing one buffer across steps), ``"ghost"``
/ ``"rows"`` / ``"streamed"`` force one Linear form.

**Precision** (the contract: :mod:`ief.precision`): the step's forward and per-sample backward run in the model's
precision (bfloat16 weights, or ``torch.autocast(device, torch.bfloat16)`` around ``step``); the losses and ``s_iEF``
in float32 at least, the Gram matrix in float64, its solve in float64; float32 parameters (adapters on a bfloat16 base)
are updated in float32, a bfloat16 parameter's update is computed in float32 and rounded once. The exact check's
tolerance comes from the lowest format the forward ran in (``0.0625`` for bfloat16). float16 is refused
(``ValueError``: no loss scale).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..arguments import suggest_keywords
from ..directions import ef_solve, ief_solve, sf_solve
from ..jacobian import gradient_and_sampled_jacobian, per_sample
from ..losses import Loss
from ..model_call import Inputs
from ..rows import FactoredJacobian, check_form
from ..streamed import check_memory_budget
from . import defaults
from .base import Direction, PreconditionedOptimizer
from .checks import finite
from .options import MISSING, REDUCTIONS, Settings, check_check, shared_args
from .state import ForeignStateError


class ExactOptimizer(PreconditionedOptimizer):
    """The exact optimisers' per-sample machinery: the guard's ``check`` and the Jacobian's ``form``.

    Args:
        model: the ``nn.Module`` whose forward the optimiser runs.
        lr: the rate, or ``"auto"``.
        damping: ``lambda``, or ``None`` for the reduction's default.
        settings: the shared settings (:class:`ief.optim.options.Settings`).
        check: the per-sample guard (see :class:`IEF`).
        form: the per-sample Jacobian's form (see :class:`IEF`).
        memory_budget: the bytes of per-sample rows ``form="auto"`` may keep (see :class:`IEF`).
    """

    _auto_lr = True

    def __init__(self, model: torch.nn.Module, lr: float | str, damping: float | None, settings: Settings, *,
                 check: bool | str | int, form: str, memory_budget: float | None = None):
        super().__init__(model, lr, damping, settings)
        self.check = check_check(check)
        self.form = check_form(form)
        self.memory_budget = check_memory_budget(memory_budget, self.form)
        self._buffer: torch.Tensor | None = None  # J's storage, reused from step to step (form="dense")

    def _check_now(self) -> bool | str:
        """The per-sample check of this step: ``True``: the exact one on the first step, the structural one after;
        ``"exact"``: exact on every step; ``N``: exact on steps 0, N, 2N, ..., structural between; ``False``: none."""
        if self.check is True:
            return "exact" if self.steps_taken == 0 else True
        if self.check is False or self.check == "exact":
            return self.check
        return "exact" if self.steps_taken % self.check == 0 else True

    def _shards(self, rows: Any) -> bool:
        """Whether ``rows``' direction is this rank's shards only (an FSDP2 model across processes)."""
        return getattr(rows, "shard", None) is not None

    def _per_sample(self, inputs: Inputs, targets: torch.Tensor, batch: dict) -> tuple[Any, list]:
        """The batch's :class:`ief.jacobian.PerSample` and the guard's deferred checks (:meth:`_local`):
        :func:`ief.per_sample` refuses non-finite losses and rows (``FloatingPointError`` naming the samples), so
        the solves take them as checked."""
        result, deferred = self._local(lambda: per_sample(self.model, inputs, targets, batch["params"], loss=self.loss,
                                                          check=self._check_now(), out=self._buffer, form=self.form,
                                                          memory_budget=self.memory_budget))
        # reused next step (same batch size): no fresh allocation of J (or of its materialised column blocks); a
        # factored J may use the first columns of a wider buffer (an embedding table's used rows vary by batch)
        factored = isinstance(result.jacobian, FactoredJacobian)
        written = result.jacobian.dense if factored else result.jacobian
        if self._buffer is None or written.data_ptr() != self._buffer.data_ptr():
            self._buffer = written
        return result, deferred


@shared_args
class IEF(ExactOptimizer):
    """Exact iEF: ``theta <- theta - lr * J^T (J J^T + lambda I)^{-1} s_iEF`` (the paper's Algorithm 1, Eq. (8)).

    With momentum and weight decay (beyond the paper, whose Appendix G, "Limitations", says the exact iEF optimiser
    cannot use them; derivation in :mod:`ief.optim.momentum`, the update
    :func:`ief.optim.update.preconditioned_update`): ``d_t`` is the exact iEF direction of batch ``t`` and ``c_t``
    its batch factor (``1/K_t`` with ``reduction="mean"``, else 1), then::

        b_t = c_t d_t  (first step),   b_t = momentum * b_{t-1} + (1 - dampening) * c_t d_t  (after)
        theta <- (1 - lr_t * weight_decay) * theta - lr_t * b_t

    Momentum averages exact iEF steps (the direction is a per-batch least-squares solution, not linear in the
    gradient, so the buffer holds preconditioned steps, as torch SGD's ``momentum_buffer`` holds gradients); the
    decay is AdamW's decoupled one (an L2 term has no row in ``J`` nor entry in ``s``, so it cannot enter the
    paper's Eq. (8)). ``momentum=0`` keeps no buffer and is the exact update; with ``dampening=0`` the steady step is
    ``lr / (1 - momentum)`` times the momentum-free one, ``dampening=momentum`` keeps the momentum-free scale.

    Drive it with ``loss = opt.step(inputs, targets)`` in your own loop (no ``backward``, no closure). Cost of a
    step: one forward and one backward (per-sample rows by module hooks), an ``M x M`` Gram matrix and its float64
    solve; the guard's exact check adds one batched forward-mode pass on the first step. Precision: bfloat16 weights
    and bfloat16 autocast are supported, float16 refused (:mod:`ief.precision`).

    Args:
        model: the ``nn.Module`` whose forward the optimiser runs (a peft model, a Hugging Face model: the package's
            conventions, :mod:`ief`).
        lr: the rate; default ``None``: with ``reduction="sum"``, ``0.3 / T`` for each batch, ``T`` its counted
            targets per sample (``param_groups`` hold ``0.3``, which a scheduler scales; :mod:`ief.optim.defaults`
            says why one number cannot suit one label and many tokens per sample alike), the paper's LoRA ``100.0``
            with ``reduction="mean"`` (Appendix H.2; prompt tuning: ``50``); ``"auto"``: set
            every step from the new batch's loss along the previous step, starting at ``1`` (sum convention), one
            extra forward without gradients a step (:mod:`ief.optim.auto_lr`; ``last_lr``).
        damping: ``lambda >= 0`` in the ``reduction``'s convention; default ``None``: ``1e-4 T^2`` for each batch
            (``"sum"``; :mod:`ief.optim.defaults`) or the paper's ``1e-7`` (``"mean"``; prompt tuning: ``1e-12``).
        {shared args: params loss reduction}
        normalize: rescale each update to norm ``lr`` (default ``False``: iEF's steps are used as they are).
        {shared args: total_steps momentum dampening weight_decay check form memory_budget process_group}

    Raises:
        {shared raises:}

    Example::

        opt = ief.optim.IEF(model, lr=1.0, damping=1e-4)
        for inputs, targets in loader:
            loss = opt.step(inputs, targets)
    """

    method = "ief"

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
        memory_budget: float | None = None,
        process_group: Any = None,
    ):
        # reduction="sum": the defaults are set per batch from its targets per sample (ief.optim.defaults)
        self._per_target = (reduction == "sum" and lr is None, reduction == "sum" and damping is None)
        if lr is None:
            lr = 100.0 if reduction == "mean" else defaults.RATE
        if damping is None and reduction == "sum":
            damping = defaults.DAMPING
        settings = Settings(params=params, loss=loss, reduction=reduction, normalize=normalize,
                            total_steps=total_steps, momentum=momentum, dampening=dampening,
                            weight_decay=weight_decay, process_group=process_group)
        super().__init__(model, lr, damping, settings, check=check, form=form, memory_budget=memory_budget)

    def _direction(self, inputs, targets, batch):
        r, deferred = self._per_sample(inputs, targets, batch)
        batch = self._batch_defaults(batch, targets, r.counted)  # the default rate and damping for this batch
        rows, sizes = self._union_rows(r.jacobian, shard=True)
        direction = ief_solve(rows, self._union_vector(r.logit_sqnorm, sizes), batch["damping"], check=False)
        return Direction(self._union_vector(r.losses, sizes), direction, deferred=deferred,
                         rows=rows if sizes is None else None, solved=("iEF", rows.dtype), local=self._shards(rows),
                         gradient=lambda: (r.gradient, False),  # this rank's (lr="auto": read before J is reused)
                         rate=batch["lr"] if self._per_target[0] else None)


@shared_args
class EF(ExactOptimizer):
    """Exact EF: ``theta <- theta - lr * J^T (J J^T + lambda I)^{-1} 1`` (the paper's Algorithm 2, Eq. (5)).

    Defaults to the paper's normalised update; pass ``total_steps`` for its linear decay to 0. ``momentum``,
    ``dampening`` and ``weight_decay`` as :class:`IEF` (:mod:`ief.optim.momentum`): with the normalised update the
    buffer averages unit steps ``d_t / ||d_t||`` (EF's raw norms vary by orders of magnitude, which is why the paper
    normalises), and ``lr_t = lr (1 - t/T)`` scales the buffer and the decay. Cost of a step: as :class:`IEF`.

    Args:
        model: the ``nn.Module`` whose forward the optimiser runs.
        lr: the rate (default ``0.01``, the paper's normalised LoRA rate; prompt tuning: ``1``); ``"auto"``: set
            every step from the new batch's loss along the previous step, starting at ``0.01`` (the update's norm
            with ``normalize=True``), one extra forward without gradients a step (:mod:`ief.optim.auto_lr`).
        damping: ``lambda >= 0``; default ``None``: ``1e-4`` (``reduction="sum"``) or ``1e-7`` (``"mean"``).
        {shared args: params loss reduction}
        normalize: rescale each update to norm ``lr`` (default ``True``: the paper's normalised update, because
            EF's raw norms vary by orders of magnitude).
        {shared args: total_steps momentum dampening weight_decay check form memory_budget process_group}

    Raises:
        {shared raises:}
    """

    method = "ef"

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
        memory_budget: float | None = None,
        process_group: Any = None,
    ):
        settings = Settings(params=params, loss=loss, reduction=reduction, normalize=normalize,
                            total_steps=total_steps, momentum=momentum, dampening=dampening,
                            weight_decay=weight_decay, process_group=process_group)
        super().__init__(model, lr, damping, settings, check=check, form=form, memory_budget=memory_budget)

    def _direction(self, inputs, targets, batch):
        r, deferred = self._per_sample(inputs, targets, batch)
        rows, sizes = self._union_rows(r.jacobian, shard=True)
        return Direction(self._union_vector(r.losses, sizes), ef_solve(rows, batch["damping"], check=False),
                         deferred=deferred, rows=rows if sizes is None else None, solved=("EF", rows.dtype),
                         local=self._shards(rows),
                         gradient=lambda: (r.gradient, False))  # this rank's (lr="auto": read before J is reused)


@shared_args
class SF(ExactOptimizer):
    """Exact SF: ``theta <- theta - lr * (A^T A + lambda I)^{-1} grad L`` with ``A`` sampled (the paper's
    Algorithm 3).

    Labels are drawn from the model's predictive distribution with ``generator`` (default: the global RNG). Costs one
    extra backward per step. Defaults to the paper's normalised update; pass ``total_steps`` for the linear decay.
    ``momentum``, ``dampening`` and ``weight_decay`` as :class:`EF` (:mod:`ief.optim.momentum`). ``state_dict()``
    carries ``generator``'s state and ``load_state_dict`` restores it, so a resumed run draws the same labels.

    Args:
        model: the ``nn.Module`` whose forward the optimiser runs.
        lr: the rate (default ``0.01``, the paper's normalised LoRA rate; prompt tuning: ``1``); ``"auto"``: set
            every step from the new batch's loss along the previous step, starting at ``0.01`` (the update's norm
            with ``normalize=True``), one extra forward without gradients a step (:mod:`ief.optim.auto_lr`).
        damping: ``lambda > 0`` (the paper's Eq. (49) divides by it); default ``None``: ``1e-4``
            (``reduction="sum"``) or ``1e-7`` (``"mean"``).
        {shared args: generator params loss reduction}
        normalize: rescale each update to norm ``lr`` (default ``True``: the paper's normalised update, because
            EF's raw norms vary by orders of magnitude).
        {shared args: total_steps momentum dampening weight_decay check form memory_budget process_group}

    Raises:
        {shared raises:}
        ValueError: from ``load_state_dict``, a state holding a generator's state loaded into an ``SF`` without one,
            or another optimiser's state (``ForeignStateError``); ``damping`` not ``> 0``.
    """

    _needs_positive_damping = True
    method = "sf"

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
        memory_budget: float | None = None,
        process_group: Any = None,
    ):
        settings = Settings(params=params, loss=loss, reduction=reduction, normalize=normalize,
                            total_steps=total_steps, momentum=momentum, dampening=dampening,
                            weight_decay=weight_decay, process_group=process_group)
        super().__init__(model, lr, damping, settings, check=check, form=form, memory_budget=memory_budget)
        self.generator = generator

    def _direction(self, inputs, targets, batch):
        (losses, grad, sampled), deferred = self._local(lambda: gradient_and_sampled_jacobian(
            self.model, inputs, targets, batch["params"], loss=self.loss, generator=self.generator,
            check=self._check_now(), form=self.form, memory_budget=self.memory_budget,
        ))
        # the losses and the sampled rows are refused there when not finite; the gradient's check is read with the
        # step's (a non-finite gradient makes a non-finite direction, which the step then refuses as this)
        grad = self._union_sum(grad)
        rows, sizes = self._union_rows(sampled)
        return Direction(self._union_vector(losses, sizes), sf_solve(rows, grad, batch["damping"], check=False),
                         checks=[(finite(grad), "non-finite gradient")], deferred=deferred,
                         rows=rows if sizes is None else None, solved=("SF", rows.dtype),
                         gradient=lambda: (grad, True))  # the union batch's already (lr="auto")


__all__ = ["EF", "IEF", "MISSING", "REDUCTIONS", "SF", "ExactOptimizer", "ForeignStateError",
           "PreconditionedOptimizer"]
