"""Torch optimisers with the exact iEF / EF / SF updates; see :mod:`ief.optim.exact` for the calling convention and
:mod:`ief.optim.momentum` for their momentum and weight decay; :class:`KFAC` (:mod:`ief.optim.kfac`): the K-FAC
family (KFAC, eKFAC, ieKFAC) as block-diagonal optimisers with running factors. Each validates its settings and
computes a direction; :func:`preconditioned_update` (:mod:`ief.optim.update`) applies it, and can be called alone.
Every step's :class:`StepReport` (``opt.last_step_report``, :mod:`ief.optim.report`) says what it ran."""
from .exact import EF, IEF, REDUCTIONS, SF
from .kfac import KFAC
from .report import StepReport
from .state import ForeignStateError
from .update import preconditioned_update

__all__ = ["EF", "IEF", "KFAC", "REDUCTIONS", "SF", "ForeignStateError", "StepReport", "preconditioned_update"]
