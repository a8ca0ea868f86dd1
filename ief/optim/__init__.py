"""Torch optimisers with the exact iEF / EF / SF updates; see :mod:`ief.optim.exact` for the calling convention and
:mod:`ief.optim.momentum` for their momentum and weight decay."""
from .exact import EF, IEF, REDUCTIONS, SF

__all__ = ["IEF", "EF", "SF", "REDUCTIONS"]
