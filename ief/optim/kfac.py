"""K-FAC-family optimisers: KFAC, eKFAC and ieKFAC as practical block-diagonal optimisers (the paper's Appendix D.2.2,
"Improving Empirical K-FAC with IEF").

The paper proposes ieKFAC "as a starting point for future work" and only evaluates its direction; :class:`KFAC`
makes the three block-diagonal directions of :func:`ief.kfac_direction` (``kind="kfac"``: sampled labels,
block-diagonal SF; ``"ekfac"``: true labels, block-diagonal EF; ``"iekfac"``: rows of sample ``n`` weighted by
``1/s_n``, block-diagonal iEF) into torch optimisers with the two devices every practical K-FAC uses:

- **Running factors.** Every trainable ``nn.Linear`` keeps exponential averages of its Kronecker factors across
  steps (``c``: ``factor_decay``)::

      A_1 = A(B_1),   A_t = c A_{t-1} + (1 - c) A(B_t)        (the same for G)

  with ``A(B)``, ``G(B)`` the batch's factors exactly as :func:`ief.kfac.kronecker_factors` forms them (float64).
  The first step takes the batch's factors undamped (no zero initial value to correct for, as the momentum buffer).
- **Occasional inverses.** The eigendecompositions of the running factors are recomputed on steps
  ``0, T, 2T, ...`` (``T``: ``inverse_every``) and reused in between; the damping is applied at every step through
  them, ``d_t = (G (x) A + lambda I)^{-1} grad L(B_t)`` with the eigendecompositions of the last refresh
  (:func:`ief.kfac_direction`'s Tikhonov damping on the whole Kronecker block, the same ``lambda`` axis as the
  exact directions), so a scheduled ``damping`` acts at once.

With ``factor_decay=0`` and ``inverse_every=1`` a step is ``theta <- theta - lr * kfac_direction(batch)``, exactly.
The step size, ``normalize``, ``total_steps``, ``momentum``, ``dampening`` and ``weight_decay`` are those of
:class:`ief.optim.IEF` (the same code: heavy-ball momentum on the preconditioned step, AdamW's decoupled decay;
derivation in :mod:`ief.optim.momentum`).

**Non-linear trainable parameters** (prompt embeddings, LayerNorm, raw ``Parameter`` attention weights) raise a
``ValueError`` naming them at construction; there is no first-order fallback. A fallback would have to choose a
rate and a preconditioner for those parameters that has nothing to do with K-FAC's (``lr`` here multiplies a natural
gradient step, whose scale a gradient step does not share), and the result would be neither the block-diagonal
method the paper evaluates nor a known optimiser. Pass ``params=`` with the linear layers' parameters (freezing or
separately optimising the rest); prompt tuning has no linear trainable parameter and is for :class:`ief.optim.IEF`.

Only ``reduction="sum"`` (``L = sum_n l_n``, the paper's Eq. (1)) is offered: the running factors average batches of
different token counts, for which the token-mean conversion of ``lr`` and ``damping`` per batch
(:mod:`ief.optim.convention`) has not been derived.

**Several processes** (data parallel: torchrun, accelerate, DDP): with ``process_group=`` (default: a
``DistributedDataParallel`` model's group, whose own module runs: DDP's gradient all-reduce never runs) a step is
exactly one process's on the union of the ranks' batches, concatenated in rank order. Each rank forms its batch's
``G_r``, ``A_r``, gradient and per-sample losses (its own forward and backward; a failure there raises on every rank,
:func:`ief.distributed.agree`); then one all-reduce of float64 numbers sums ``G`` (a sum over rows), ``M_r A_r``
(``A`` is a mean over samples: divided by the union's ``M`` after) and the gradient, and the losses are all-gathered.
ieKFAC's ``1/s_n`` weights the rows of sample ``n`` inside its own rank's ``G_r``, so nothing per sample crosses
ranks; this ``"ekfac"`` is the empirical K-FAC (no eigenbasis statistics). Every rank then holds the same bits of the
union's factors, running averages and eigendecompositions (computed on every rank from the same factors: a
replicated ``eigh``, as :mod:`ief.distributed`'s replicated Gram solve), and of the direction; momentum and weight
decay are replicated. ``kind="kfac"`` draws each rank's labels with that rank's ``generator`` (``IEFTrainer`` seeds it
``seed + process_index``): the step is the union batch's for labels drawn sample by sample with the generator of the
rank holding the sample, not one generator's draw over the union batch. Communication per step: the sample counts
and a checksum of the factors' layers and shapes (all-gathered, ``16 R`` bytes; ranks whose layers differ raise a
``ValueError`` on every rank), the losses (``R M_max`` values, each rank's padded to the largest ``M_r``), one
failure flag (:func:`ief.distributed.agree`), and one all-reduce of ``8 (P + sum(O^2 + k^2))`` bytes over the linear
layers (``O`` outputs, ``k`` inputs, ``+1`` with a bias): a ring all-reduce sends about twice that, against DDP's
``~2 x 4 P`` for float32 gradients. The gradient alone is 2x DDP's (float64); a layer's factors hold ``O^2 + k^2``
numbers against its weight's ``O k``: 2x for a square layer, ``d / r`` times for a LoRA pair of rank ``r`` on width
``d`` (each adapter's wide side is a ``d x d`` factor). The factors are reduced every step (the running average
needs each batch's), not only on refresh steps.

``state_dict()`` holds, besides torch's state (step counter, momentum buffers), the running factors, their last
eigendecompositions and, with ``generator=``, the generator's state: a run split by save and load equals the unsplit
run bit for bit. It records the kind and settings (``"ief_optimizer"``, as the exact optimisers'), and
``load_state_dict`` refuses another kind's, an exact optimiser's or a torch optimiser's state, naming both.
"""
from __future__ import annotations

import math
import zlib
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from ..arguments import suggest_keywords
from ..distributed import all_gather_rows, all_reduce, collective_device, world_size
from ..kfac import (
    KINDS,
    KroneckerBlock,
    block_diagonal_direction,
    check_approx,
    check_kind,
    check_linear_only,
    data_parallel_module,
    kronecker_eigen,
    kronecker_factor_sets,
)
from ..losses import Loss
from .base import Direction, PreconditionedOptimizer
from .checks import finite
from .options import Settings, shared_args
from .state import ForeignStateError, check_origin, describe
from .update import scheduled_rate

NOT_TAKEN = {key: f"{key}= is an argument of the exact optimisers' per-sample Jacobian (IEF, EF, SF); KFAC takes none"
             for key in ("check", "form", "memory_budget")}
# The defaults (the class docstring says why): kfac-pytorch's damping and KL bound, under which a large step is
# scaled to the bound; a tiny BERT-LoRA classifier trained with each kind under them, where the former lr=0.01,
# damping=1 (the companion's cpu searches' choice) left its loss at log 3 after 100 steps.
DEFAULT_KIND = "kfac"
DEFAULT_LR = 0.1
DEFAULT_DAMPING = 1e-3
DEFAULT_KL_CLIP = 1e-3



def _check_factor_decay(value: Any) -> float:
    if isinstance(value, (bool, str)):  # a ValueError, as every bad argument of the constructors
        raise ValueError(  # noqa: TRY004
            f"factor_decay must be a number in [0, 1) (0: each batch's own factors), got {value!r}")
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"factor_decay must be a number in [0, 1) (0: each batch's own factors), got {value!r}") \
            from None
    if not (0.0 <= out < 1.0):  # also refuses NaN
        raise ValueError(f"factor_decay must be a number in [0, 1) (0: each batch's own factors; 1 would never "
                         f"update them), got {value!r}")
    return out


def _check_kl_clip(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, (bool, str)) or not isinstance(value, (int, float)) or not (0.0 < float(value) < math.inf):
        raise ValueError(f"kl_clip must be None (no clipping) or a finite number > 0 (kfac-pytorch's default: 1e-3), "
                         f"got {value!r}")
    return float(value)


def kl_clip_factor(direction: torch.Tensor, gradient: torch.Tensor, lr: float, kl_clip: float) -> torch.Tensor:
    """The factor ``nu = min(1, sqrt(kl_clip / (lr^2 |d . g|)))`` that bounds a preconditioned step's predicted
    change of the model's output distribution (KL clipping: Ba, Grosse and Martens 2017, as kfac-pytorch applies it).

    With ``d = (G (x) A + lambda I)^{-1} g``, ``lr^2 d^T F d ~ lr^2 d . g`` is the step's second-order KL divergence
    between the model's predictions before and after the step under the Fisher ``F`` K-FAC approximates; scaling the
    step by ``nu`` keeps it at most ``kl_clip``. Computed on the device (no host round-trip).

    Args:
        direction: the preconditioned direction ``d`` ``[P]``.
        gradient: the loss gradient ``g`` ``[P]`` (the union batch's across processes).
        lr: the step's rate (scheduled, before ``normalize``).
        kl_clip: the bound (> 0).

    Returns:
        A 0-d tensor ``nu`` in ``(0, 1]`` (1 where ``lr = 0`` or ``d . g = 0``).
    """
    dg = torch.dot(direction.reshape(-1).to(torch.float64), gradient.reshape(-1).to(torch.float64)).abs()
    bound = torch.tensor(kl_clip, dtype=torch.float64, device=dg.device)
    nu = torch.where(dg * lr * lr > bound, torch.sqrt(bound / (dg * lr * lr)), torch.ones_like(dg))
    return nu.to(direction.dtype)


def _check_inverse_every(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"inverse_every must be a positive integer (1: refresh the eigendecompositions every step), "
                         f"got {value!r}")
    return value


@shared_args
class KFAC(PreconditionedOptimizer):
    """Block-diagonal K-FAC optimiser: ``theta <- theta - lr * (G_t (x) A_t + lambda I)^{-1} grad L`` per linear
    layer, with running factors and occasional eigendecompositions (module docstring; the paper's Appendix D.2.2).

    Args:
        model: the ``nn.Module`` whose forward the optimiser runs; every trainable parameter (or every one in
            ``params``) must be the weight or bias of an ``nn.Linear``.
        kind: ``"kfac"`` (default: labels sampled from the model with ``generator``), ``"ekfac"`` (true labels) or
            ``"iekfac"`` (true labels, rows of sample ``n`` weighted by ``1/s_n``), as :func:`ief.kfac_direction`.
            The default is K-FAC as Martens and Grosse define it and kfac-pytorch runs it: its factors approximate
            the Fisher with labels drawn from the model, where true labels give the empirical Fisher's block-diagonal
            form (``"ekfac"``), whose inversely-scaled updates the paper analyses; ``"iekfac"`` is the paper's
            proposal, offered "as a starting point for future work" and not run there as an optimiser. (One run
            each, 100 steps on the BERT-LoRA keyword task of ``benchmarks/default_tasks.py`` under the defaults
            below: held-out loss 1.099 to 0.024 (kfac), 0.021 (ekfac), 0.036 (iekfac); not a recorded benchmark.)
        lr: the rate (finite, > 0); default ``None``: ``0.1`` (:data:`DEFAULT_LR`). With the default ``kl_clip``
            a large step is scaled down to the bound whatever the rate, so the rate matters where steps are small.
            The former default ``0.01`` with ``damping=1`` (the companion's cpu searches' choice on digits-mlp)
            left a tiny BERT-LoRA classifier's loss at ``log 3`` after 100 steps: that damping swamps the factors
            of a LoRA adapter (their scale is the adapter's activations and gradients, far below 1).
        damping: ``lambda >= 0`` on the whole Kronecker block, :func:`ief.kfac_direction`'s axis (0: pseudo-inverse);
            default ``None``: ``1e-3`` (:data:`DEFAULT_DAMPING`, kfac-pytorch's default; a damping this small lets
            the small eigenvalues of ``G (x) A`` blow up the step without ``kl_clip``, which the default clip
            prevents).
        factor_decay: ``c`` in ``[0, 1)`` of the factors' running average (default ``0.95``; 0: the batch's own
            factors).
        inverse_every: ``T >= 1``: the eigendecompositions are refreshed on steps ``0, T, 2T, ...`` (default ``10``).
        approx: ``"expand"`` (default) or ``"reduce"`` (sequence positions; :mod:`ief.kfac`).
        kl_clip: a bound ``> 0`` on each step's predicted KL divergence (default ``1e-3``, kfac-pytorch's) or
            ``None`` (no clipping), ``lr^2 |d . g|`` (:func:`kl_clip_factor`; kfac-pytorch's ``kl_clip``): the
            direction is scaled by ``min(1, sqrt(kl_clip / (lr^2 |d . g|)))`` before momentum, so a small damping
            or a large rate cannot take an arbitrarily long step. No effect with ``normalize=True``.
        generator: the RNG of ``kind="kfac"``'s sampled labels (default ``None``: the global RNG).
        {shared args: params loss}
        reduction: ``"sum"`` only (the default); ``"mean"`` is refused.
        normalize: rescale each update to norm ``lr`` (default ``False``).
        {shared args: total_steps momentum dampening weight_decay}
        process_group: step across the processes of this ``torch.distributed`` group, exactly as one process on the
            union batch (the factors, gradient and losses of every rank's batch; module docstring); default: a
            ``DistributedDataParallel`` model's group, else none.

    Raises:
        TypeError: an unknown keyword (the message names the closest accepted one; ``check=`` and ``form=``, the
            exact optimisers' arguments, are refused saying so).
        ValueError: a bad argument (named with its value and the accepted values), ``reduction`` other than
            ``"sum"``, a trainable parameter outside any ``nn.Linear`` (named), or an initialised
            ``torch.distributed`` of world size > 1 with neither ``process_group`` nor a ``DistributedDataParallel``
            model (each rank's running factors would be its own batch's and the replicas would drift apart).
            From ``step`` across processes, on every rank: one rank's local failure (:func:`ief.distributed.agree`:
            that rank's own error there, the same type naming the rank elsewhere), or ranks whose linear layers or
            factor shapes differ.
    """

    method = "kfac"
    _fsdp2_refusal = ("KFAC's Kronecker factors precondition each layer's whole gradient (G^-1 dW A^-1), which no "
                      "rank holds on FSDP2 shards; use IEF, EF or SF, or KFAC on a replicated (DDP) model")

    @suggest_keywords(notes=NOT_TAKEN)
    def __init__(
        self,
        model: torch.nn.Module,
        kind: str = DEFAULT_KIND,
        lr: float | None = None,
        damping: float | None = None,
        *,
        factor_decay: float = 0.95,
        inverse_every: int = 10,
        approx: str = "expand",
        kl_clip: float | None = DEFAULT_KL_CLIP,
        generator: torch.Generator | None = None,
        params: Iterable | None = None,
        loss: str | Loss = "cross_entropy",
        reduction: str = "sum",
        normalize: bool = False,
        total_steps: int | None = None,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        process_group: Any = None,
    ):
        check_kind(kind)
        check_approx(approx)
        if reduction != "sum":
            raise ValueError(f"KFAC supports reduction='sum' only (the loss sum_n l_n; the token-mean conversion of "
                             f"lr and damping with running factors is not derived), got {reduction!r}")
        self.kl_clip = _check_kl_clip(kl_clip)
        self.kind = kind
        self.approx = approx
        self.factor_decay = _check_factor_decay(factor_decay)
        self.inverse_every = _check_inverse_every(inverse_every)
        self.generator = generator
        settings = Settings(params=params, loss=loss, reduction="sum", normalize=normalize, total_steps=total_steps,
                            momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                            process_group=process_group)
        super().__init__(model, DEFAULT_LR if lr is None else lr, DEFAULT_DAMPING if damping is None else damping,
                         settings)
        check_linear_only(model, self._all_params(), kind)
        self.factors: dict[str, dict[str, Any]] = {}  # block name -> {"G", "A", "eigen"}

    def _direction(self, inputs, targets, batch):
        losses: list[torch.Tensor] = []
        (blocks, gradient, params), deferred = self._local(lambda: kronecker_factor_sets(
            self.model, inputs, targets, [self.kind], batch["params"], generator=self.generator, loss=self.loss,
            approx=self.approx, losses_out=losses))
        blocks, gradient, batch_losses = self._union_factors(blocks[self.kind], gradient, losses[0])
        refresh = self.steps_taken % self.inverse_every == 0
        c = self.factor_decay
        pending, checks = {}, []
        for block in blocks:
            old = self.factors.get(block.name)
            if old is not None:  # the running average (new tensors: the stored ones stay until the step succeeds)
                block.G = old["G"] * c + block.G * (1.0 - c)
                block.A = old["A"] * c + block.A * (1.0 - c)
            factors_finite = finite(block.G, block.A)
            message = f"non-finite Kronecker factors of layer {block.name!r}"
            if refresh or old is None:  # read now: an eigendecomposition of a non-finite factor fails
                if not bool(factors_finite):
                    raise FloatingPointError(message)
                eigen = kronecker_eigen(block.G, block.A)
            else:  # read with the step's other checks, before anything changes (no host round-trip here)
                checks.append((factors_finite, message))
                eigen = old["eigen"]
            pending[block.name] = {"G": block.G, "A": block.A, "eigen": eigen}
        direction = block_diagonal_direction(blocks, gradient, params, batch["damping"], self.kind,
                                             {name: entry["eigen"] for name, entry in pending.items()},
                                             check=False)  # the step reads it with its other checks
        if self.kl_clip is not None:
            rate = scheduled_rate(batch["lr"], self.steps_taken, batch["total_steps"])
            direction = direction * kl_clip_factor(direction, gradient, rate, self.kl_clip)
        return Direction(batch_losses, direction, checks=checks, deferred=deferred,
                         keep=lambda: self.factors.update(pending))  # the running factors, once the step succeeded

    def _union_factors(self, blocks: list[KroneckerBlock], gradient: torch.Tensor, losses: torch.Tensor,
                       ) -> tuple[list[KroneckerBlock], torch.Tensor, torch.Tensor]:
        """This rank's factors, gradient and per-sample losses, or the union batch's across processes (module
        docstring): one all-gather of every rank's sample count and factor layout, one all-reduce (float64) of the
        gradient, every ``G`` and every ``M_r A_r``, ``A`` divided by the union's ``M``, the losses all-gathered;
        the same bits on every rank.

        Args:
            blocks: this rank's blocks (:func:`ief.kfac.kronecker_factor_sets`), ``A`` the mean over its samples.
            gradient: this rank's ``grad L [P]``.
            losses: this rank's per-sample losses ``[M_r]``.

        Returns:
            ``(blocks, gradient, losses)`` of the union batch (this rank's own in one process).

        Raises:
            ValueError: on every rank, when the ranks' linear layers or factor shapes differ (a layer called on one
                rank's batch and not on another's): their factors cannot be summed.
        """
        if self._group is None:
            return blocks, gradient, losses
        device = collective_device(self._group)
        layout = [(block.name, tuple(block.G.shape), tuple(block.A.shape)) for block in blocks]
        mine = torch.tensor([[losses.shape[0], zlib.crc32(repr(layout).encode())]], dtype=torch.int64, device=device)
        table = all_gather_rows(mine, [1] * world_size(self._group), self._group).tolist()
        sizes = [m for m, _ in table]
        if len({signature for _, signature in table}) > 1:  # the same table on every rank: every rank raises
            raise ValueError(f"the ranks' K-FAC factors differ in their layers or shapes (a linear layer called on "
                             f"one rank's batch and not on another's, or inputs of other widths); this rank's: "
                             f"{layout}")
        m = sizes[dist.get_rank(self._group)]
        parts = [gradient.to(torch.float64).reshape(-1)]
        for block in blocks:
            parts += [block.G.reshape(-1), (block.A * m).reshape(-1)]  # A is the mean over this rank's samples
        union = all_reduce(torch.cat(parts).to(device), self._group).to(gradient.device)
        pieces = iter(torch.split(union, [part.numel() for part in parts]))
        union_gradient = next(pieces).to(gradient.dtype)
        total = sum(sizes)
        summed = []
        for block in blocks:
            G, A = next(pieces).view(block.G.shape), next(pieces).view(block.A.shape) / total
            summed.append(KroneckerBlock(block.name, G, A, block.index))
        return summed, union_gradient, all_gather_rows(losses.to(device), sizes, self._group).to(losses.device)

    def _identity(self) -> dict:
        """The exact optimisers' record plus the kind and the approximation (:meth:`state_dict`)."""
        return dict(super()._identity(), kind=self.kind, approx=self.approx)

    def state_dict(self) -> dict:
        """torch's state plus ``"ief_optimizer"`` (the class, kind, approximation and settings that change the
        method), ``"kfac"`` (the kind, the running factors and their eigendecompositions) and, with ``generator=``,
        ``"generator_state"``.

        Returns:
            The state, for :meth:`load_state_dict`.
        """
        state = super().state_dict()
        state["kfac"] = {"kind": self.kind, "approx": self.approx,
                         "factors": {name: {"G": e["G"].clone(), "A": e["A"].clone(),
                                            "eigen": tuple(t.clone() for t in e["eigen"])}
                                     for name, e in self.factors.items()}}
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore :meth:`state_dict`'s output.

        Args:
            state_dict: the output of :meth:`state_dict` of a KFAC of the same kind and settings (one saved before
                the class was recorded is checked by its ``"kfac"`` entry).

        Raises:
            ForeignStateError: (a ``ValueError``) another optimiser's state (an exact ief optimiser's, another
                kind's or settings', a torch optimiser's); the message names both.
            ValueError: it holds a generator's state and this KFAC has no generator.
        """
        check_origin(self._identity(), state_dict)
        state_dict = dict(state_dict)
        saved = state_dict.pop("kfac", None)
        if saved is None:
            raise ForeignStateError(f"this state_dict has no 'kfac' entry (running factors), so it is not a KFAC "
                                    f"optimiser's and cannot be loaded into {describe(self._identity())}; start it "
                                    f"fresh")
        if saved["kind"] != self.kind or saved["approx"] != self.approx:
            raise ForeignStateError(f"this state_dict is a KFAC(kind={saved['kind']!r}, approx={saved['approx']!r})'s, "
                                    f"this optimiser is KFAC(kind={self.kind!r}, approx={self.approx!r}); construct "
                                    f"that kind to resume it, or start this one fresh")
        self._check_factors(saved["factors"])
        super().load_state_dict(state_dict)
        device = self._all_params()[0].device  # a state loaded with map_location="cpu" (transformers.Trainer does)
        self.factors = {name: {"G": e["G"].to(device, copy=True), "A": e["A"].to(device, copy=True),
                               "eigen": tuple(t.to(device, copy=True) for t in e["eigen"])}
                        for name, e in saved["factors"].items()}

    def _check_factors(self, factors: dict) -> None:
        """Refuse running factors that are not this model's (:class:`ForeignStateError` naming the layer): each must
        belong to an ``nn.Linear`` whose parameters this optimiser trains, with ``G`` of its outputs' width and ``A``
        of its inputs' (plus one for a trained bias; one alone for a trained bias without its weight)."""
        modules = dict(data_parallel_module(self.model).named_modules())
        trained = {id(p) for p in self._all_params()}
        for name, entry in factors.items():
            module = modules.get(name)
            weight = isinstance(module, torch.nn.Linear) and id(module.weight) in trained
            bias = isinstance(module, torch.nn.Linear) and module.bias is not None and id(module.bias) in trained
            if not (weight or bias):
                raise ForeignStateError(f"this state_dict holds running factors of layer {name!r}, which is no linear "
                                        f"layer this {describe(self._identity())} trains (the state of another "
                                        f"model's optimiser); start it fresh")
            width = (module.in_features if weight else 0) + (1 if bias else 0)
            want = {"G": (module.out_features, module.out_features), "A": (width, width)}
            for key, shape in want.items():
                got = tuple(entry[key].shape) if isinstance(entry.get(key), torch.Tensor) else None
                if got != shape:
                    raise ForeignStateError(f"this state_dict's running factor {key} of layer {name!r} has shape {got} "
                                            f"where the layer's is {shape} (the state of another model's optimiser): "
                                            f"it cannot be loaded into {describe(self._identity())}; start it fresh")


__all__ = ["KFAC", "KINDS"]
