"""The small problems the theory checks run on (tanh MLPs in float64) and the helpers that move their parameters.

:mod:`.theory` (the flow, the lemma and the theorems) and :mod:`.equivalence` (the iEF / GN / NGD relations) share
them; every check works on :func:`private_copy`, so the caller's model is never modified.
"""
from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

__all__ = ["Problem", "classification_problem", "regression_problem", "private_copy", "trainable_params",
           "get_vector", "set_vector"]


# ----------------------------------------------------------------------------------------------------- problems
@dataclass
class Problem:
    """A small supervised problem: ``model(inputs)`` gives logits / outputs, ``loss`` is a package loss name."""

    model: torch.nn.Module
    inputs: torch.Tensor
    targets: torch.Tensor
    loss: str

    @property
    def n_samples(self) -> int:
        return int(self.targets.shape[0])

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)


def tanh_mlp(sizes: Sequence[int]) -> torch.nn.Module:
    """A float64 MLP with tanh between its ``nn.Linear`` layers of widths ``sizes``."""
    layers: list[torch.nn.Module] = []
    for k in range(len(sizes) - 1):
        layers.append(torch.nn.Linear(sizes[k], sizes[k + 1]))
        if k < len(sizes) - 2:
            layers.append(torch.nn.Tanh())
    return torch.nn.Sequential(*layers).to(torch.float64)


def classification_problem(
    n_samples: int = 8, n_features: int = 4, hidden: int = 6, classes: int = 3, seed: int = 0
) -> Problem:
    """Softmax tanh MLP ``n_features -> hidden -> classes`` (``P = 51`` by default) with random inputs and labels."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = tanh_mlp([n_features, hidden, classes])
    x = torch.randn(n_samples, n_features, generator=gen, dtype=torch.float64)
    y = torch.randint(0, classes, (n_samples,), generator=gen)
    return Problem(model, x, y, "cross_entropy")


def regression_problem(
    n_samples: int = 8, n_features: int = 3, hidden: int = 8, outputs: int = 2, seed: int = 0
) -> Problem:
    """Non-convex regression: tanh MLP ``n_features -> hidden -> outputs`` (``P = 50`` by default), squared error
    ``l_n = 1/2 ||z_n - y_n||^2`` with random targets ``y_n ~ N(0, I)``. ``outputs=1`` gives a scalar-output model."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = tanh_mlp([n_features, hidden, outputs])
    x = torch.randn(n_samples, n_features, generator=gen, dtype=torch.float64)
    y = torch.randn(n_samples, outputs, generator=gen, dtype=torch.float64)
    return Problem(model, x, y, "mse")


# ------------------------------------------------------------------------------------------------------ helpers
def to_float64(x):
    """Floating tensors (also inside mappings and tuples) in float64; everything else as it is."""
    if isinstance(x, torch.Tensor):
        return x.to(torch.float64) if x.dtype.is_floating_point else x
    if isinstance(x, Mapping):
        return {k: to_float64(v) for k, v in x.items()}
    if isinstance(x, tuple):
        return tuple(to_float64(v) for v in x)
    return x


def private_copy(model: torch.nn.Module, inputs, targets):
    """A float64 deep copy of the model (the flow moves its parameters) and float64 inputs / float targets."""
    model = copy.deepcopy(model).to(torch.float64)
    return model, to_float64(inputs), to_float64(targets)


def trainable_params(model: torch.nn.Module) -> list[torch.Tensor]:
    """The parameters that require a gradient, in ``model.parameters()`` order."""
    return [p for p in model.parameters() if p.requires_grad]


def get_vector(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """The parameters flattened into one vector (detached)."""
    return torch.cat([p.detach().reshape(-1) for p in params])


def set_vector(params: Sequence[torch.Tensor], vector: torch.Tensor) -> None:
    """Copy ``vector`` (as :func:`get_vector` lays it out) into the parameters."""
    with torch.no_grad():
        offset = 0
        for p in params:
            p.copy_(vector[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
