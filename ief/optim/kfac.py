"""K-FAC-family optimisers: KFAC, eKFAC and ieKFAC as practical block-diagonal optimisers (``sec:app-iEF-eNGDopt``).

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

Only ``reduction="sum"`` (``L = sum_n l_n``, ``eqn:prob_loss``) is offered: the running factors average batches of
different token counts, for which the token-mean conversion of ``lr`` and ``damping`` per batch
(:mod:`ief.optim.convention`) has not been derived.

``state_dict()`` holds, besides torch's state (step counter, momentum buffers), the running factors, their last
eigendecompositions and, with ``generator=``, the generator's state: a run split by save and load equals the unsplit
run bit for bit. It records the kind and settings (``"ief_optimizer"``, as the exact optimisers'), and
``load_state_dict`` refuses another kind's, an exact optimiser's or a torch optimiser's state, naming both.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..kfac import (KINDS, block_diagonal_direction, check_approx, check_kind, check_linear_only, kronecker_eigen,
                    kronecker_factor_sets)
from ..losses import Loss
from .exact import ForeignStateError, PreconditionedOptimizer, _describe, _finite


def _check_factor_decay(value: Any) -> float:
    if isinstance(value, (bool, str)):
        raise ValueError(f"factor_decay must be a number in [0, 1) (0: each batch's own factors), got {value!r}")
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"factor_decay must be a number in [0, 1) (0: each batch's own factors), got {value!r}") \
            from None
    if not (0.0 <= out < 1.0):  # also refuses NaN
        raise ValueError(f"factor_decay must be a number in [0, 1) (0: each batch's own factors; 1 would never "
                         f"update them), got {value!r}")
    return out


def _check_inverse_every(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"inverse_every must be a positive integer (1: refresh the eigendecompositions every step), "
                         f"got {value!r}")
    return value


class KFAC(PreconditionedOptimizer):
    """Block-diagonal K-FAC optimiser: ``theta <- theta - lr * (G_t (x) A_t + lambda I)^{-1} grad L`` per linear
    layer, with running factors and occasional eigendecompositions (module docstring; ``sec:app-iEF-eNGDopt``).

    Args:
        model: the ``nn.Module`` whose forward the optimiser runs; every trainable parameter (or every one in
            ``params``) must be the weight or bias of an ``nn.Linear``.
        kind: ``"kfac"`` (labels sampled from the model with ``generator``), ``"ekfac"`` (true labels) or
            ``"iekfac"`` (true labels, rows of sample ``n`` weighted by ``1/s_n``), as :func:`ief.kfac_direction`.
        lr: the rate (finite, > 0). No default: none has been measured for these optimisers (on a tiny MLP with
            16 samples, ``lr=0.1`` diverges with ``damping=1e-2`` and descends with ``damping=1``).
        damping: ``lambda >= 0`` on the whole Kronecker block, :func:`ief.kfac_direction`'s axis (0: pseudo-inverse).
            No default, as ``lr``.
        factor_decay: ``c`` in ``[0, 1)`` of the factors' running average (default ``0.95``; 0: the batch's own
            factors).
        inverse_every: ``T >= 1``: the eigendecompositions are refreshed on steps ``0, T, 2T, ...`` (default ``10``).
        approx: ``"expand"`` (default) or ``"reduce"`` (sequence positions; :mod:`ief.kfac`).
        generator: the RNG of ``kind="kfac"``'s sampled labels (default ``None``: the global RNG).
        params: the parameters to train (default ``None``: every trainable one), or weight-decay groups, as
            :class:`ief.optim.IEF`.
        loss: ``"cross_entropy"`` (default) or ``"mse"``.
        reduction: ``"sum"`` only (the default); ``"mean"`` is refused.
        normalize: rescale each update to norm ``lr`` (default ``False``).
        total_steps: linear decay of the step size to 0 over ``T`` steps (default ``None``: constant).
        momentum: heavy-ball momentum in ``[0, 1)`` (default ``0.0``), as :class:`ief.optim.IEF`.
        dampening: in ``[0, 1]`` (default ``0.0``), as :class:`ief.optim.IEF`.
        weight_decay: decoupled weight decay ``>= 0`` (default ``0.0``), as :class:`ief.optim.IEF`.
        check: not taken (the exact optimisers' per-sample guard, default ``True`` there): a ``ValueError``.
        form: not taken (the exact optimisers' Jacobian form, default ``"auto"`` there): a ``ValueError``.
        process_group: not taken yet (default ``None``; the exact optimisers step across processes): a group of
            several processes is a ``ValueError``.

    Raises:
        ValueError: a bad argument (named with its value and the accepted values), ``reduction`` other than
            ``"sum"``, a trainable parameter outside any ``nn.Linear`` (named), or several processes (a
            ``process_group``, a ``DistributedDataParallel`` model or an initialised ``torch.distributed`` of world
            size > 1: its running factors would be each rank's own; the exact optimisers step across processes).
    """

    method = "kfac"
    _across_processes = False  # its running factors would be each rank's own (refused with a process group)

    def __init__(self, model: torch.nn.Module, kind: str, lr: float, damping: float, *,
                 factor_decay: float = 0.95, inverse_every: int = 10, approx: str = "expand",
                 generator: torch.Generator | None = None, params: Iterable | None = None,
                 loss: str | Loss = "cross_entropy", reduction: str = "sum", **kwargs: Any):
        check_kind(kind)
        check_approx(approx)
        if reduction != "sum":
            raise ValueError(f"KFAC supports reduction='sum' only (the loss sum_n l_n; the token-mean conversion of "
                             f"lr and damping with running factors is not derived), got {reduction!r}")
        for key in ("check", "form"):
            if key in kwargs:
                raise ValueError(f"KFAC takes no {key!r} (an argument of the exact optimisers' per-sample Jacobian)")
        self.kind = kind
        self.approx = approx
        self.factor_decay = _check_factor_decay(factor_decay)
        self.inverse_every = _check_inverse_every(inverse_every)
        self.generator = generator
        super().__init__(model, lr, damping, params=params, loss=loss, reduction="sum", check=False, **kwargs)
        check_linear_only(model, self._all_params(), kind)
        self.factors: dict[str, dict[str, Any]] = {}  # block name -> {"G", "A", "eigen"}
        self._pending: dict[str, dict[str, Any]] | None = None

    def _direction(self, inputs, targets, group):
        losses: list[torch.Tensor] = []
        blocks, gradient, params = kronecker_factor_sets(self.model, inputs, targets, [self.kind], group["params"],
                                                         generator=self.generator, loss=self.loss,
                                                         approx=self.approx, losses_out=losses)
        blocks = blocks[self.kind]
        refresh = self.steps_taken % self.inverse_every == 0
        c = self.factor_decay
        pending = {}
        for block in blocks:
            old = self.factors.get(block.name)
            if old is not None:  # the running average (new tensors: the stored ones stay until the step succeeds)
                block.G = old["G"] * c + block.G * (1.0 - c)
                block.A = old["A"] * c + block.A * (1.0 - c)
            finite = _finite(block.G, block.A)
            message = f"non-finite Kronecker factors of layer {block.name!r}"
            if refresh or old is None:  # read now: an eigendecomposition of a non-finite factor fails
                if not bool(finite):
                    raise FloatingPointError(message)
                eigen = kronecker_eigen(block.G, block.A)
            else:  # read with the step's other checks, before anything changes (no host round-trip here)
                self._checks.append((finite, message))
                eigen = old["eigen"]
            pending[block.name] = {"G": block.G, "A": block.A, "eigen": eigen}
        direction = block_diagonal_direction(blocks, gradient, params, group["damping"], self.kind,
                                             {name: entry["eigen"] for name, entry in pending.items()},
                                             check=False)  # the step reads it with its other checks
        self._pending = pending
        return losses[0], direction

    def _update(self, given, group, direction, tokens, **checks):
        """The update of :class:`ief.optim.IEF` (with the step's checks), then the new running factors are kept
        (only after it succeeded)."""
        super()._update(given, group, direction, tokens, **checks)
        self.factors.update(self._pending or {})
        self._pending = None

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
        self._check_origin(state_dict)
        state_dict = dict(state_dict)
        saved = state_dict.pop("kfac", None)
        if saved is None:
            raise ForeignStateError(f"this state_dict has no 'kfac' entry (running factors), so it is not a KFAC "
                                    f"optimiser's and cannot be loaded into {_describe(self._identity())}; start it "
                                    f"fresh")
        if saved["kind"] != self.kind or saved["approx"] != self.approx:
            raise ForeignStateError(f"this state_dict is a KFAC(kind={saved['kind']!r}, approx={saved['approx']!r})'s, "
                                    f"this optimiser is KFAC(kind={self.kind!r}, approx={self.approx!r}); construct "
                                    f"that kind to resume it, or start this one fresh")
        super().load_state_dict(state_dict)
        device = self._all_params()[0].device  # a state loaded with map_location="cpu" (transformers.Trainer does)
        self.factors = {name: {"G": e["G"].to(device, copy=True), "A": e["A"].to(device, copy=True),
                               "eigen": tuple(t.to(device, copy=True) for t in e["eigen"])}
                        for name, e in saved["factors"].items()}

__all__ = ["KFAC", "KINDS"]
