"""Torch optimisers with the exact iEF / EF / SF updates; see :mod:`ief.optim.exact` for the calling convention."""
from .exact import EF, IEF, REDUCTIONS, SF

__all__ = ["IEF", "EF", "SF", "REDUCTIONS"]
