"""Torch optimisers with the exact iEF / EF / SF updates; see :mod:`ief.optim.exact` for the calling convention and
:mod:`ief.optim.momentum` for their momentum and weight decay; :class:`KFAC` (:mod:`ief.optim.kfac`): the K-FAC
family (KFAC, eKFAC, ieKFAC) as block-diagonal optimisers with running factors. Each validates its settings and
computes a direction; :func:`preconditioned_update` (:mod:`ief.optim.update`) applies it, and can be called alone."""
from .exact import EF, IEF, REDUCTIONS, SF
from .kfac import KFAC
from .state import ForeignStateError
from .update import preconditioned_update

__all__ = ["EF", "IEF", "KFAC", "REDUCTIONS", "SF", "ForeignStateError", "preconditioned_update"]
