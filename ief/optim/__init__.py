"""Torch optimisers with the exact iEF / EF / SF updates; see :mod:`ief.optim.exact` for the calling convention and
:mod:`ief.optim.momentum` for their momentum and weight decay; :class:`KFAC` (:mod:`ief.optim.kfac`): the K-FAC
family (KFAC, eKFAC, ieKFAC) as block-diagonal optimisers with running factors."""
from .exact import EF, IEF, REDUCTIONS, SF, ForeignStateError
from .kfac import KFAC

__all__ = ["IEF", "EF", "SF", "KFAC", "REDUCTIONS", "ForeignStateError"]
