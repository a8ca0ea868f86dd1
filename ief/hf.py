"""The ief optimisers inside ``transformers.Trainer``: :class:`IEFTrainer` (beyond the paper).

The exact iEF / EF / SF updates (Algorithm 1, Algorithm 2, Algorithm 3) and the K-FAC family
(Appendix D.2.2) need the batch: their ``step(inputs, targets)`` runs the forward and the per-sample
backward itself (:mod:`ief.optim.exact`). ``transformers.Trainer`` instead runs ``loss.backward()`` in
``training_step`` and then calls ``optimizer.step()`` without the batch. :class:`IEFTrainer` changes one thing:
its ``training_step`` hands the batch to the ief optimiser, which takes the whole update there; the Trainer loop's
own ``optimizer.step()`` that follows only checks that the update was taken. Everything else is the Trainer's:
data loading, evaluation, logging, callbacks, ``save_steps`` checkpoints, ``resume_from_checkpoint`` and
``lr_scheduler_type``. Quick start::

    args = TrainingArguments("out", learning_rate=1.0, max_grad_norm=0)
    IEFTrainer(model, args, train_dataset=ds, optimizer="ief").train()

**How each Trainer feature maps** (transformers 5.x):

- ``learning_rate`` is the optimiser's ``lr`` and the scheduler's base rate; the scheduler
  (``lr_scheduler_type``, warm-up included) writes ``param_groups[i]["lr"]`` before every step, as for AdamW.
  ``optimizer_kwargs={"lr": "auto"}`` (``"ief"``, ``"ef"``, ``"sf"``) adapts the rate every step instead
  (:mod:`ief.optim.auto_lr`): ``learning_rate`` and the scheduler are then not applied, and the logged
  ``learning_rate`` is the last step's rate.
  ``weight_decay`` is the optimisers' decoupled (AdamW) decay with the Trainer's groups: no decay for biases and
  normalisation weights (:mod:`ief.optim.momentum`). ``optimizer_kwargs`` takes every other argument of the
  optimiser (``damping``, ``momentum``, ``reduction``, ``factor_decay``, ...); ``lr`` and ``weight_decay`` there
  are refused (they are ``TrainingArguments``' and the scheduler's).
- **Targets.** The batch's ``labels`` become the optimiser's targets through :func:`split_batch`: a causal LM's
  labels (Hugging Face's, equal to ``input_ids``; the model shifts them in its own loss) are shifted by
  :func:`ief.causal_lm_targets` (position ``t`` predicts ``labels[t + 1]``), after prepending ``-100`` for the
  virtual tokens of peft prompt tuning (the logits have them, as peft's own loss does); an encoder-decoder model
  gets ``decoder_input_ids`` from its ``prepare_decoder_input_ids_from_labels`` (what it does with ``labels``) and
  the labels unshifted; a classifier's labels are its targets.
- **Logged loss.** ``loss`` in the logs is ``L / K`` of the update's batch *before* the update: ``L = sum_n l_n``
  (Eq. (1)) and ``K`` its counted targets (positions other than ``-100``), i.e. the mean cross-entropy
  per counted target, which is the model's own ``outputs.loss`` on that batch and the scale of ``eval_loss``
  (whatever the optimiser's ``reduction``). With ``loss="mse"`` it is ``2 L / K``, the mean squared error of the
  model's ``outputs.loss``: the update keeps the package's per-sample loss ``l_n = 1/2 ||z_n - y_n||^2``, only the
  reported value is doubled. ``grad_norm`` is not logged: there is no ``.grad``.
- **Regression.** A one-output head (``num_labels=1``) takes Hugging Face's float labels ``[M]``; they are
  reshaped to the logits' ``[M, 1]`` for ``loss="mse"`` (pass ``optimizer_kwargs={"loss": "mse"}``).
- **Gradient accumulation.** ``gradient_accumulation_steps = G > 1`` gives the exact direction of the union batch:
  the ``G`` micro-batches of one update are concatenated and the optimiser takes one step on them (so the
  per-sample machinery holds ``G`` times the batch: accumulation saves no memory here). Micro-batches whose tensors
  differ beyond the sample dimension (dynamic padding) cannot be joined and raise ``ValueError``.
- **Mixed precision.** ``bf16=True`` trains: accelerate wraps the model's ``forward`` in bfloat16 autocast when training
  starts, and the optimiser's own forward is that ``forward``, so the forward and the per-sample backward run in
  bfloat16 while the Gram system is accumulated and solved in float64 and float32 parameters are updated in float32 (the
  contract: :mod:`ief.precision`); the exact check runs in float32 (accelerate's autocast wrapper set aside for it), so
  it catches a sample mixing as in a float32 model. Resume and logging are as in float32. A bfloat16 model (or a float32
  adapter on a bfloat16 base) trains with or without it.
- **Several processes** (torchrun, ``accelerate launch``: DDP, one device per process): the optimiser takes the
  process group and steps exactly as one process on the union of the ranks' batches (:mod:`ief.distributed`); with
  sequential sampling, 2 processes at ``per_device_train_batch_size=4`` train as one process at 8. The logged loss is
  the union batch's; checkpoints resume on the same number of processes; SF's and ``kind="kfac"``'s labels are drawn
  per process (generator seeded ``seed + process_index``); K-FAC's factors are the union batch's
  (:class:`ief.optim.KFAC`).
- **FSDP2** (``IEF``, ``EF``, ``SF``; :mod:`ief.sharded`): shard the model yourself with
  ``torch.distributed.fsdp.fully_shard`` (inner blocks, then the root) after ``init_process_group`` and hand it to
  ``IEFTrainer``, launched by ``torchrun`` (one process per device, gloo on CPU). The Trainer leaves it unwrapped (no
  DDP), each rank updates its own shards and the step is the union batch's, as under DDP; ``save_model`` gathers the
  full weights (every rank takes part) and the main process writes them (``from_pretrained`` loads them); a checkpoint
  adds one ``ief_fsdp2_rank{r}_of_{R}.pt`` per rank (the rank's parameter shards and optimiser state: momentum
  buffers are shards) and resumes bit for bit on the same number of processes (another number is refused, on every
  rank). The Trainer's own ``fsdp=`` wrapping is refused (accelerate would shard the model and build the optimiser on
  its own terms; its FSDP plugin does not run on CPU), as are ``load_best_model_at_end`` and ``save_on_each_node``
  with an FSDP2 model (a whole checkpoint loaded into shards; the full weights are written by rank 0).
- **Refused** with ``ValueError`` at construction: ``fp16=True`` (float16's per-sample gradients underflow without
  a dynamic loss scale, which ief does not apply: :func:`ief.precision.refuse_float16`), several devices in one
  process (``DataParallel``), DeepSpeed (ZeRO partitions the parameters and runs its own backward and optimiser
  step, which the ief optimisers, running the forward and per-sample backward themselves, cannot drive), the
  Trainer's ``fsdp=`` wrapping (FSDP2 above), ``label_smoothing_factor``, ``compute_loss_func``, ``optimizers=`` /
  ``optimizer_cls_and_kwargs=`` and ``label_names`` other than ``["labels"]``.
- **Logged**: each step's certificate (:class:`ief.optim.report.StepReport`: the method, each parameter's route,
  the rows, the processes, the sharding) at INFO on the ``ief.hf`` logger, on the first step and whenever it changes.
- ``max_grad_norm`` (Trainer default 1.0) is **ignored with a warning**: the update is not a gradient step and no
  ``.grad`` exists to clip (clipping the direction instead would change the method). Pass ``max_grad_norm=0``.
- **Order within a step.** The update happens inside ``training_step``, so callbacks' ``on_pre_optimizer_step``
  already sees the updated parameters; the scheduler then steps as usual. The model is in train mode (dropout on,
  every pass of one ief step replaying the same masks). ``trainer.ief_optimizer`` is the optimiser itself
  (``trainer.optimizer`` is accelerate's wrapper once training has started).
- peft prompt tuning and p-tuning: the model is patched with :func:`ief.per_sample_prompts` (identical values, one
  backward).
- ``SF`` and ``kind="kfac"`` draw labels from a ``torch.Generator`` seeded with ``TrainingArguments.seed`` (unless
  ``optimizer_kwargs`` gives one), whose state is in the optimiser's ``state_dict``; a checkpoint therefore holds
  the step counter, momentum buffers, K-FAC running factors and eigendecompositions and the generator, and a
  resumed run equals the uninterrupted one. A checkpoint of another optimiser (another ``optimizer=`` or
  settings that change the method, or a plain ``transformers.Trainer``'s AdamW) is refused on resume with a
  ``ValueError`` naming both and how to start fresh, instead of running with the loaded values.
"""
from __future__ import annotations

import dataclasses
import difflib
import glob
import inspect
import logging
import os
import warnings
from typing import Any

import torch
import transformers

from .losses import IGNORE_INDEX, causal_lm_targets, count_targets
from .optim.auto_lr import AUTO
from .optim.exact import EF, IEF, MISSING, SF, ForeignStateError
from .optim.kfac import KFAC
from .jacobian import per_sample_prompts
from .sharded import is_fsdp2, load_local_state, local_state

LOGGER = logging.getLogger(__name__)  # the steps' certificates (ief.optim.report), at INFO

OPTIMIZERS = ("ief", "ef", "sf", "kfac", "ekfac", "iekfac")
KFAC_KINDS = ("kfac", "ekfac", "iekfac")
_CLASSES = {"ief": IEF, "ef": EF, "sf": SF}
_SAMPLING = ("sf", "kfac")  # the optimisers that draw labels from a generator
SHARDED_STATE = "ief_fsdp2_rank{rank}_of_{world}.pt"  # an FSDP2 checkpoint's state of one rank (module docstring)
_REFUSED_KWARGS = {
    "lr": "the rate is TrainingArguments(learning_rate=...), which the scheduler starts from (the one value taken "
          "here is lr='auto', the rate adapted every step: ief.optim.auto_lr)",
    "weight_decay": "the decay is TrainingArguments(weight_decay=...), applied with the Trainer's decay groups",
    "kind": "the K-FAC kind is the optimizer name ('kfac', 'ekfac' or 'iekfac')",
    "model": "the model is the Trainer's",
}


class _StepTakenInTrainingStep:
    """Mixin for the ief optimiser a :class:`IEFTrainer` holds: ``step(inputs, targets)`` (called by
    ``training_step``) takes the update; the Trainer loop's ``step()`` without a batch then only checks that it was
    taken (and raises ``RuntimeError`` if it was not)."""

    _update_taken = False

    def step(self, inputs: Any = MISSING, targets: Any = MISSING, *, closure: Any = None):  # type: ignore[override]
        if targets is MISSING and closure is None and (inputs is MISSING or inputs is None):
            if not self._update_taken:
                raise RuntimeError(
                    f"{type(self).__name__}.step() was called without a batch and no batch step preceded it: inside "
                    f"IEFTrainer the update is taken by training_step, which hands the batch to step(inputs, targets)")
            self._update_taken = False
            return None
        loss = super().step(inputs, targets, closure=closure)
        self._update_taken = True
        return loss


_DRIVEN: dict[type, type] = {}


def _driven(cls: type) -> type:
    """``cls`` with :class:`_StepTakenInTrainingStep` (same name, so error messages name the ief optimiser)."""
    if cls not in _DRIVEN:
        _DRIVEN[cls] = type(cls.__name__, (_StepTakenInTrainingStep, cls),
                            {"__module__": __name__, "__qualname__": f"IEFTrainer.{cls.__name__}"})
    return _DRIVEN[cls]


def _base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a peft wrapper (``get_base_model``), or ``model``."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def is_causal_lm(model: torch.nn.Module) -> bool:
    """Whether ``model`` (or the model under its peft wrapper) is a transformers ``*ForCausalLM``, by the test
    ``transformers.Trainer.compute_loss`` uses (its class name in ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``).

    Args:
        model: a ``torch.nn.Module``, possibly a peft model.

    Returns:
        ``True`` for a causal LM (whose labels must be shifted), else ``False``.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return type(_base_model(model)).__name__ in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def _virtual_tokens(model: torch.nn.Module) -> int:
    """How many positions a peft prompt-learning causal LM prepends to the logits (0 for every other model)."""
    config = getattr(model, "active_peft_config", None)
    if config is None or not getattr(config, "is_prompt_learning", False):
        return 0
    kind = str(getattr(config, "peft_type", "")).rsplit(".", 1)[-1]
    if kind in ("PREFIX_TUNING", "CARTRIDGE"):  # past key values: no extra logits
        return 0
    if kind == "CPT":
        raise ValueError("peft CPT models compute their own weighted loss, which the ief optimisers cannot take "
                         "over; use prompt tuning, p-tuning, prefix tuning or LoRA")
    return int(config.num_virtual_tokens)


def split_batch(model: torch.nn.Module, batch: dict[str, Any], *,
                causal_lm: bool | None = None) -> tuple[dict[str, Any], torch.Tensor]:
    """A Hugging Face training batch (model inputs plus ``labels``) as the ief optimiser's ``(inputs, targets)``.

    The targets are scored position by position against the logits the model returns without labels
    (Eq. (1)), so that ``sum_n l_n / K`` equals the model's own ``outputs.loss`` on the batch:

    - causal LM: ``causal_lm_targets(labels)`` (``targets[:, t] = labels[:, t + 1]``), with ``-100`` for the
      ``V`` virtual tokens of a peft prompt-learning model prepended first (its logits have ``V + T`` positions and
      the last virtual token predicts ``labels[:, 0]``, as in peft's loss);
    - encoder-decoder: ``labels`` as they are, and ``decoder_input_ids`` (unless given) from the model's
      ``prepare_decoder_input_ids_from_labels``, as the model does when it receives ``labels``;
    - any other model: ``labels`` as they are.

    Args:
        model: the model the optimiser runs (possibly a peft model).
        batch: a dict with ``labels`` and the model's inputs.
        causal_lm: force (``True``) or disable (``False``) the causal-LM shift; ``None``: :func:`is_causal_lm`.

    Returns:
        ``(inputs, targets)``: ``inputs`` without ``labels`` (to be called as ``model(**inputs)``).

    Raises:
        ValueError: the batch is not a dict with ``labels``, or an encoder-decoder model gives no way to build its
            decoder inputs.
    """
    if not isinstance(batch, dict) or "labels" not in batch:
        keys = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
        raise ValueError(f"the ief optimisers need the batch's targets under 'labels' (a dict batch with a 'labels' "
                         f"tensor), got {keys}")
    labels = batch["labels"]
    inputs = {key: value for key, value in batch.items() if key != "labels"}
    base = _base_model(model)
    if getattr(getattr(base, "config", None), "is_encoder_decoder", False):
        if "decoder_input_ids" not in inputs and "decoder_inputs_embeds" not in inputs:
            prepare = getattr(base, "prepare_decoder_input_ids_from_labels", None)
            if not callable(prepare):
                raise ValueError(f"{type(base).__name__} is an encoder-decoder model without "
                                 f"prepare_decoder_input_ids_from_labels: put decoder_input_ids in the batch")
            inputs["decoder_input_ids"] = prepare(labels=labels)
        return inputs, labels
    if is_causal_lm(model) if causal_lm is None else causal_lm:
        virtual = _virtual_tokens(model)
        if virtual:
            labels = torch.cat([labels.new_full((labels.shape[0], virtual), IGNORE_INDEX), labels], dim=1)
        return inputs, causal_lm_targets(labels)
    return inputs, labels


def _join(batches: list[dict[str, Any]]) -> dict[str, Any]:
    """The union of one update's micro-batches (``gradient_accumulation_steps > 1``), concatenated on dim 0."""
    if len(batches) == 1:
        return batches[0]
    keys = list(batches[0])
    if any(list(b) != keys for b in batches[1:]):
        raise ValueError(f"gradient_accumulation_steps={len(batches)}: the micro-batches of one update have different "
                         f"keys ({[sorted(b) for b in batches]}), so they cannot be joined into the union batch")
    out = {}
    for key in keys:
        values = [b[key] for b in batches]
        if not isinstance(values[0], torch.Tensor):
            if any(v != values[0] for v in values[1:]):
                raise ValueError(f"gradient_accumulation_steps={len(batches)}: the non-tensor entry {key!r} differs "
                                 f"between the micro-batches of one update")
            out[key] = values[0]
            continue
        shapes = [tuple(v.shape) for v in values]
        if any(s[1:] != shapes[0][1:] for s in shapes[1:]):
            raise ValueError(
                f"gradient_accumulation_steps={len(batches)}: IEFTrainer takes the exact step of the union of one "
                f"update's micro-batches, but {key!r} has shapes {shapes}; pad every batch to one length (e.g. the "
                f"tokenizer's padding='max_length') or use gradient_accumulation_steps=1 with a larger batch")
        out[key] = torch.cat(values, dim=0)
    return out


def _default_learning_rate() -> float:
    return next(f.default for f in dataclasses.fields(transformers.TrainingArguments) if f.name == "learning_rate")


def _optimizer_name(optimizer: Any) -> str:
    """``optimizer`` as one of :data:`OPTIMIZERS`, in any case (``"IEF"`` is ``"ief"``); ``ValueError`` naming the
    accepted ones, and the closest, otherwise."""
    name = optimizer.lower() if isinstance(optimizer, str) else optimizer
    if isinstance(name, str) and name in OPTIMIZERS:
        return name
    close = difflib.get_close_matches(name, OPTIMIZERS, n=1, cutoff=0.5) if isinstance(name, str) else []
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(f"optimizer must be one of {', '.join(map(repr, OPTIMIZERS))} (any case), got {optimizer!r}"
                     f"{hint}")


class _AdaptedRate:
    """The Trainer's scheduler under ``lr="auto"``: the optimiser sets its own rate every step, so nothing is
    scheduled; the logged ``learning_rate`` is the rate of the last step (``last_lr``)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    def step(self, *args: Any, **kwargs: Any) -> None:
        return None

    def get_last_lr(self) -> list[float]:
        inner = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate's wrapper
        last = getattr(inner, "last_lr", None)
        return [float("nan") if last is None else float(last)]

    def state_dict(self) -> dict:
        return {}  # the adapted rate lives in the optimiser's state_dict

    def load_state_dict(self, state: dict) -> None:
        return None


def _check_args(args: transformers.TrainingArguments, auto_lr: bool = False) -> None:
    """The ``TrainingArguments`` IEFTrainer refuses (``ValueError``) or ignores (warning)."""
    if args.fp16:
        raise ValueError(
            "IEFTrainer refuses fp16=True: float16 per-sample gradients underflow (below 6e-8) without a dynamic loss "
            "scale, which the ief optimisers do not apply (their update is not a .grad that GradScaler could unscale); "
            "use bf16=True (bfloat16 autocast, float32's range) or float32")
    if args.label_smoothing_factor:
        raise ValueError(f"IEFTrainer trains with the optimiser's own loss (cross-entropy by default), so "
                         f"label_smoothing_factor={args.label_smoothing_factor} would change only the evaluation loss; "
                         f"set it to 0")
    if args.label_names is not None and list(args.label_names) != ["labels"]:
        raise ValueError(f"IEFTrainer hands the batch's 'labels' to the optimiser as its targets; label_names="
                         f"{args.label_names!r} is not supported (accepted: None or ['labels'])")
    if args.max_grad_norm and args.max_grad_norm > 0:
        warnings.warn(
            f"TrainingArguments.max_grad_norm={args.max_grad_norm} is ignored by IEFTrainer: the ief optimisers' "
            f"update is a preconditioned step computed from per-sample gradients, no .grad exists to clip, and "
            f"clipping the update instead would change the method; pass max_grad_norm=0 to silence this warning",
            UserWarning, stacklevel=3)
    if auto_lr:
        schedule = getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)
        if schedule != "constant" or args.warmup_steps:
            warnings.warn(
                f"optimizer_kwargs={{'lr': 'auto'}}: the optimiser sets its rate every step, so learning_rate and "
                f"lr_scheduler_type={schedule!r} (and any warm-up) are not applied",
                UserWarning, stacklevel=3)
    elif args.learning_rate == _default_learning_rate():
        warnings.warn(
            f"learning_rate is TrainingArguments' default {args.learning_rate:g}, an AdamW rate: it is the ief "
            f"optimiser's lr here (iEF, sum convention: about 0.3 for one label per sample, 0.3 / T for T target "
            f"tokens per sample, e.g. 0.03 for a causal LM of 10; or optimizer_kwargs={{'lr': 'auto'}}; "
            f"ief.optim.defaults)", UserWarning, stacklevel=3)


class IEFTrainer(transformers.Trainer):
    """A ``transformers.Trainer`` whose update is taken by an ief optimiser on the batch (module docstring).

    Args:
        *args: ``transformers.Trainer``'s positional arguments (``model``, ``args``, ...).
        optimizer: one of ``"ief"``, ``"ef"``, ``"sf"`` (any case) (:class:`ief.optim.IEF`, ``EF``, ``SF``: Algorithm 1,
            Algorithm 2, Algorithm 3) or ``"kfac"``, ``"ekfac"``, ``"iekfac"`` (:class:`ief.optim.KFAC` of that kind,
            Appendix D.2.2; ``damping`` and ``kl_clip`` default to KFAC's, ``1e-3`` each).
        optimizer_kwargs: further keyword arguments of the optimiser (not ``weight_decay``, ``kind`` or ``model``,
            and ``lr`` only as ``"auto"``: see the module docstring; ``{"lr": "auto"}``: the rate adapted every step,
            :mod:`ief.optim.auto_lr`, for ``"ief"``, ``"ef"`` and ``"sf"``; no scheduler then). ``generator``
            defaults, for ``"sf"`` and ``"kfac"``, to a ``torch.Generator`` on the training device seeded with
            ``TrainingArguments.seed``.
        causal_lm: force (``True``) or disable (``False``) the causal-LM label shift; ``None``: detected as
            ``transformers.Trainer`` does (:func:`is_causal_lm`).
        **kwargs: ``transformers.Trainer``'s keyword arguments.

    Raises:
        ValueError: an unknown ``optimizer`` (naming the accepted ones), a refused ``optimizer_kwargs`` key or
            Trainer setting (module docstring), or the optimiser's own refusal of a value.

    Attributes:
        ief_optimizer: the ief optimiser (``trainer.optimizer`` is it, or accelerate's wrapper around it once
            training has started).
    """

    _fsdp2 = False  # a model sharded with fully_shard (set at construction)

    def __init__(self, *args: Any, optimizer: str = "ief", optimizer_kwargs: dict[str, Any] | None = None,
                 causal_lm: bool | None = None, **kwargs: Any):
        optimizer = _optimizer_name(optimizer)
        optimizer_kwargs = dict(optimizer_kwargs or {})
        self.auto_lr = optimizer_kwargs.get("lr") == AUTO
        if self.auto_lr and optimizer in KFAC_KINDS:
            raise ValueError(f"optimizer_kwargs={{'lr': 'auto'}} is offered for 'ief', 'ef' and 'sf', not "
                             f"{optimizer!r}: KFAC has no adapted rate (its kl_clip bounds each step instead)")
        for key, why in _REFUSED_KWARGS.items():
            if key in optimizer_kwargs and not (key == "lr" and self.auto_lr):
                raise ValueError(f"optimizer_kwargs may not contain {key!r}: {why}")
        given = inspect.signature(transformers.Trainer.__init__).bind(self, *args, **kwargs).arguments
        optimizers = given.get("optimizers", (None, None))
        if optimizers is not None and any(o is not None for o in optimizers):
            raise ValueError("IEFTrainer builds its optimiser itself: pass optimizer='ief' (etc.) and "
                             "optimizer_kwargs={...}, not optimizers=(optimizer, scheduler); the scheduler comes from "
                             "TrainingArguments(lr_scheduler_type=...)")
        for key in ("optimizer_cls_and_kwargs", "compute_loss_func"):
            if given.get(key) is not None:
                raise ValueError(f"IEFTrainer does not take {key}: the ief optimiser chosen by optimizer= computes "
                                 f"the training loss and the update itself")
        if given.get("args") is not None:
            _check_args(given["args"], self.auto_lr)
        self.optimizer_name = optimizer
        self.optimizer_kwargs = optimizer_kwargs
        self.causal_lm = causal_lm
        self.ief_optimizer: torch.optim.Optimizer | None = None
        self._micro_batches: list[dict[str, Any]] = []
        super().__init__(*args, **kwargs)
        if given.get("args") is None:
            _check_args(self.args, self.auto_lr)
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ValueError(
                f"IEFTrainer does not run under {'DeepSpeed' if self.is_deepspeed_enabled else 'FSDP'}: "
                + ("DeepSpeed's ZeRO partitions the parameters and runs its own backward and optimiser step, which "
                   "the ief optimisers (they run the forward and per-sample backward themselves) cannot drive; use "
                   "data parallelism (torchrun / accelerate with DDP) or FSDP2 (a model you shard with fully_shard)"
                   if self.is_deepspeed_enabled else
                   "the Trainer's fsdp= wrapping shards the model and builds the optimiser on accelerate's terms; "
                   "shard the model yourself with torch.distributed.fsdp.fully_shard, launch with torchrun and pass "
                   "no fsdp=, and IEFTrainer steps it exactly across processes"))
        self._fsdp2 = self.model is not None and is_fsdp2(self.model)
        if self._fsdp2:
            self._leave_fsdp2_unwrapped()
        if self.args.n_gpu > 1:
            raise ValueError(
                f"IEFTrainer runs one device per process (n_gpu={self.args.n_gpu}: torch.nn.DataParallel in one "
                f"process); launch one process per GPU instead (torchrun --nproc_per_node N or accelerate launch), "
                f"which IEFTrainer steps exactly across processes")
        if self.model is not None and self.model_init is None:
            self.create_optimizer()  # bad optimizer_kwargs fail here, not at train()

    def _leave_fsdp2_unwrapped(self) -> None:
        """A model sharded with ``fully_shard``: the Trainer must neither wrap it in DDP nor load whole checkpoints
        into it (module docstring)."""
        for flag, why in (("load_best_model_at_end", "loads a whole checkpoint into every rank's model"),
                          ("save_on_each_node", "writes the gathered weights on each node's first process")):
            if getattr(self.args, flag):
                raise ValueError(f"IEFTrainer on an FSDP2 model does not take {flag}=True: the Trainer {why}, and "
                                 f"each rank holds only its shards (the full weights are gathered and written by rank "
                                 f"0); set {flag}=False")
        if not hasattr(self, "is_distributed_loading_by_transformers"):  # transformers' own switch, since 5.x
            raise ValueError(f"IEFTrainer trains an FSDP2 model with a transformers whose Trainer can leave a sharded "
                             f"model unwrapped; transformers {transformers.__version__} would wrap it in "
                             f"DistributedDataParallel")
        # the model owns its placement and gradient reduction: accelerate neither wraps it in DDP nor shards it again
        self.is_distributed_loading_by_transformers = True

    def _sharded_state(self, checkpoint: str, part: str) -> dict:
        """``part`` (``"model"`` or ``"optimizer"``) of this rank's :data:`SHARDED_STATE` of ``checkpoint``, refused on
        every rank alike (the listing decides) unless every rank of this run has its file. The file is read once per
        resume: the part not yet asked for is kept until it is (the Trainer loads the model, then the optimiser), and
        a part once handed out is not kept."""
        kept = self.__dict__.pop("_sharded_kept", None)
        state = kept[1] if kept is not None and kept[0] == checkpoint else self._read_sharded_state(checkpoint)
        value = state.pop(part)
        if state:
            self._sharded_kept = (checkpoint, state)
        return value

    def _read_sharded_state(self, checkpoint: str) -> dict:
        world = self.args.world_size
        paths = [os.path.join(checkpoint, SHARDED_STATE.format(rank=r, world=world)) for r in range(world)]
        if not all(os.path.isfile(p) for p in paths):
            found = sorted(os.path.basename(p) for p in glob.glob(os.path.join(checkpoint, "ief_fsdp2_rank*.pt")))
            raise ValueError(f"checkpoint {checkpoint} holds no FSDP2 state for {world} processes (found "
                             f"{found or 'none'}): resume an FSDP2 model from a checkpoint IEFTrainer wrote, on the "
                             f"number of processes that wrote it")
        return torch.load(paths[self.args.process_index], map_location="cpu", weights_only=True)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """``transformers.Trainer.save_model``; an FSDP2 model's full weights are gathered (every rank must call
        this) and written by the main process, as ``from_pretrained`` loads them.

        Args:
            output_dir: the folder (default ``TrainingArguments.output_dir``).
            _internal_call: the Trainer's own call (a checkpoint).

        Returns:
            None (the weights are in ``output_dir``).
        """
        if not self._fsdp2:
            return super().save_model(output_dir, _internal_call)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.args.should_save:
            self._save(self.args.output_dir if output_dir is None else output_dir, state_dict=full)
        torch.distributed.barrier()  # the folder is written before any rank reads or removes it
        return None

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The Trainer's; an FSDP2 model's checkpoint holds each rank's shards and optimiser state
        (:data:`SHARDED_STATE`, written atomically) and the main process's scheduler."""
        if not self._fsdp2:
            return super()._save_optimizer_and_scheduler(output_dir)
        from transformers.trainer import SCHEDULER_NAME

        os.makedirs(output_dir, exist_ok=True)
        path = os.path.join(output_dir, SHARDED_STATE.format(rank=self.args.process_index,
                                                             world=self.args.world_size))
        torch.save({"model": local_state(self.model), "optimizer": self.ief_optimizer.state_dict()}, path + ".tmp")
        os.replace(path + ".tmp", path)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
        return None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        """The Trainer's; an FSDP2 model takes this rank's shards from :data:`SHARDED_STATE`.

        Args:
            resume_from_checkpoint: the checkpoint folder.
            model: the model to load into (default: the Trainer's).

        Raises:
            ValueError: (FSDP2) a checkpoint without every rank's state, or another model's or sharding's.
        """
        if not self._fsdp2:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        load_local_state(self.model if model is None else model,
                         self._sharded_state(resume_from_checkpoint, "model"), resume_from_checkpoint)
        return None

    def _log_report(self, report: Any) -> None:
        """Log the step's certificate (:class:`ief.optim.report.StepReport`: the method, the routes, the rows, the
        processes) at INFO on the ``ief.hf`` logger, on the first step and whenever what ran changes."""
        if report is None:
            return
        what = report.summary().split(": ", 1)[-1]
        if what != getattr(self, "_logged_route", None):
            self._logged_route = what
            LOGGER.info("IEFTrainer %s", report.summary())

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        """Build the ief optimiser (once; ``self.optimizer`` and ``self.ief_optimizer``) on the Trainer's model.

        Args:
            model: the model to optimise (default: ``self.model``).

        Returns:
            The optimiser.

        Raises:
            ValueError: the optimiser refuses a value, or (K-FAC) a trainable parameter outside any ``nn.Linear``.
        """
        if self.optimizer is not None:
            return self.optimizer
        model = self.model if model is None else model
        config = getattr(model, "active_peft_config", None)
        if str(getattr(config, "peft_type", "")).rsplit(".", 1)[-1] in ("PROMPT_TUNING", "P_TUNING"):
            per_sample_prompts(model)  # identical values; the hooks see every sample's prompt gradient
        kwargs = dict(self.optimizer_kwargs)
        if self.optimizer_name in _SAMPLING and "generator" not in kwargs:  # each process its own draws
            seed = self.args.seed + (self.args.process_index if self.args.world_size > 1 else 0)
            kwargs["generator"] = torch.Generator(device=self.args.device).manual_seed(seed)
        if self.args.world_size > 1 and "process_group" not in kwargs:  # the exact step over every rank's batch
            kwargs["process_group"] = torch.distributed.group.WORLD
        if "params" not in kwargs and self.args.weight_decay:
            decayed = set(self.get_decay_parameter_names(model))
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            groups = [{"params": [p for n, p in named if n in decayed], "weight_decay": self.args.weight_decay},
                      {"params": [p for n, p in named if n not in decayed], "weight_decay": 0.0}]
            kwargs["params"] = [g for g in groups if g["params"]]
        else:
            kwargs["weight_decay"] = self.args.weight_decay
        lr = kwargs.pop("lr") if self.auto_lr else self.args.learning_rate
        if self.optimizer_name in KFAC_KINDS:
            optimizer = _driven(KFAC)(model, self.optimizer_name, lr, **kwargs)
        else:
            optimizer = _driven(_CLASSES[self.optimizer_name])(model, lr, **kwargs)
        self.optimizer = self.ief_optimizer = optimizer
        return optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None):
        """``transformers.Trainer``'s scheduler, or under ``lr="auto"`` one that schedules nothing (the optimiser
        sets its rate every step) and reports the last step's rate to the logs.

        Args:
            num_training_steps: the run's optimiser steps (the Trainer's schedule spans them).
            optimizer: the optimiser to schedule (default: the Trainer's).

        Returns:
            The scheduler (``self.lr_scheduler``).
        """
        if self.auto_lr and self.lr_scheduler is None:
            self.lr_scheduler = _AdaptedRate(self.optimizer if optimizer is None else optimizer)
            return self.lr_scheduler
        return super().create_scheduler(num_training_steps, optimizer)

    def train(self, *args: Any, **kwargs: Any):
        """``transformers.Trainer.train`` (micro-batches left by an interrupted call are dropped first).

        Args:
            *args: as ``transformers.Trainer.train`` (e.g. ``resume_from_checkpoint``).
            **kwargs: as ``transformers.Trainer.train``.

        Returns:
            ``transformers.Trainer.train``'s ``TrainOutput`` (global step, mean training loss, metrics).
        """
        self._micro_batches = []
        return super().train(*args, **kwargs)

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: Any = None) -> torch.Tensor:
        """Hand the batch to the ief optimiser, which takes the update (no ``loss.backward()``).

        With ``gradient_accumulation_steps > 1`` the micro-batches are kept until the last of the update, then the
        optimiser steps on their union.

        Args:
            model: the model (as the Trainer prepared it; the optimiser runs its own reference to the same model).
            inputs: the batch: the model's inputs and ``labels``.
            num_items_in_batch: unused (the optimiser counts the targets itself).

        Returns:
            The value the Trainer accumulates for its ``loss`` log: ``L / K`` of the update's (union) batch before
            the update on the update's last micro-batch (``2 L / K`` with ``loss="mse"``: the model's mean squared
            error), ``0`` on the others.

        Raises:
            ValueError: no ``labels``, micro-batches that cannot be joined, or a bad value the optimiser refuses.
            FloatingPointError: a non-finite loss or update (the optimiser leaves the parameters unchanged).
        """
        model.train()
        self._micro_batches.append(self._prepare_inputs(inputs))
        if not self.accelerator.sync_gradients:
            return torch.zeros((), device=self.args.device)
        batch = _join(self._micro_batches)
        self._micro_batches = []
        step_inputs, targets = split_batch(self.ief_optimizer.model, batch, causal_lm=self.causal_lm)
        targets = self._regression_targets(targets)
        loss = self.ief_optimizer.step(step_inputs, targets)
        self._log_report(getattr(self.ief_optimizer, "last_step_report", None))
        if self.ief_optimizer.reduction == "sum":  # the union batch's loss over the union batch's count
            counted = count_targets(targets)
            if self.args.world_size > 1:
                total = torch.tensor([counted], dtype=torch.int64, device=loss.device)
                torch.distributed.all_reduce(total)
                counted = int(total)
            loss = loss / counted if counted else torch.zeros_like(loss)
        if self._loss_name() == "mse":  # l_n = 1/2 ||z - y||^2 (the update's); the model's loss: the mean of (z - y)^2
            loss = loss * 2
        return loss.detach().to(self.args.device)

    def _loss_name(self) -> str | None:
        loss = self.ief_optimizer.loss
        return loss if isinstance(loss, str) else getattr(loss, "name", None)

    def _regression_targets(self, targets: torch.Tensor) -> torch.Tensor:
        """Hugging Face's regression labels ``[M]`` of a one-output head (``num_labels=1``) as ``[M, 1]``, the shape
        of its logits, which ``loss="mse"`` takes (the model's own loss squeezes both)."""
        config = getattr(_base_model(self.ief_optimizer.model), "config", None)
        if (self._loss_name() == "mse" and isinstance(targets, torch.Tensor) and targets.dim() == 1
                and targets.is_floating_point() and getattr(config, "num_labels", None) == 1):
            return targets.unsqueeze(-1)
        return targets

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """``transformers.Trainer``'s loading of ``optimizer.pt`` and ``scheduler.pt``, with a checkpoint of another
        optimiser (another ief method or settings, or a plain ``Trainer``'s AdamW) refused in one sentence.

        Args:
            checkpoint: the checkpoint folder (``None``: nothing to load).

        Raises:
            ValueError: the checkpoint's ``optimizer.pt`` holds another optimiser's state; the message names both and
                how to start this optimiser fresh.
        """
        try:
            if self._fsdp2 and checkpoint is not None:  # this rank's shards of the state, and the scheduler
                from transformers.trainer import SCHEDULER_NAME

                self.ief_optimizer.load_state_dict(self._sharded_state(checkpoint, "optimizer"))
                self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME),
                                                             weights_only=True))
            else:
                super()._load_optimizer_and_scheduler(checkpoint)
        except ForeignStateError as err:
            raise ValueError(
                f"checkpoint {checkpoint} holds another optimiser's state, not this IEFTrainer's "
                f"optimizer={self.optimizer_name!r} ({err}); to start {self.optimizer_name!r} fresh from the "
                f"checkpoint's weights, load the model from the checkpoint and call train() without "
                f"resume_from_checkpoint (or delete its optimizer.pt to keep its step count)") \
                from None

    def _clip_grad_norm(self, model: torch.nn.Module) -> None:
        """No clipping (there is no ``.grad``; ``max_grad_norm`` is ignored with a warning at construction)."""
        return None

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> None:
        """No gradient norm to log (there is no ``.grad``)."""
        return None


__all__ = ["IEFTrainer", "OPTIMIZERS", "split_batch", "is_causal_lm"]
