"""Dense, brute-force float64 oracles: explicit per-sample loops and the Fisher summed explicitly over classes.

Nothing here uses the package: these are the definitions the package is checked against.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

IGNORE = -100


def take(inputs, n: int):
    """Sample ``n`` of a batch (tensor, tuple or dict of tensors), keeping a batch dimension of 1."""
    if isinstance(inputs, Mapping):
        return {k: take(v, n) for k, v in inputs.items()}
    if isinstance(inputs, tuple):
        return tuple(take(v, n) for v in inputs)
    if isinstance(inputs, torch.Tensor):
        return inputs[n : n + 1]
    return inputs


def logits_of(model, inputs) -> torch.Tensor:
    if isinstance(inputs, Mapping):
        out = model(**inputs)
    else:
        out = model(inputs)
    return getattr(out, "logits", out)


def trainable(model) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


def flat_grad(scalar: torch.Tensor, params) -> torch.Tensor:
    grads = torch.autograd.grad(scalar, params, retain_graph=True, allow_unused=True)
    return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for p, g in zip(params, grads)])


def sample_loss(logits: torch.Tensor, targets: torch.Tensor, loss: str) -> torch.Tensor:
    """``l_n`` for one sample: logits ``[1, ..., C]``."""
    if loss == "mse":
        return 0.5 * ((logits - targets) ** 2).sum()
    z = logits.reshape(-1, logits.shape[-1])
    y = targets.reshape(-1)
    total = (z * 0).sum()  # 0, attached to the graph (a sample whose every position is ignored has l_n = 0)
    for t in range(z.shape[0]):
        if int(y[t]) != IGNORE:
            total = total - torch.log_softmax(z[t], dim=-1)[int(y[t])]
    return total


def per_sample(model, inputs, targets, loss: str = "cross_entropy"):
    """``(losses [M], J [M, P], s [M])`` by running each sample on its own."""
    params = trainable(model)
    m = targets.shape[0]
    losses, rows, sq = [], [], []
    for n in range(m):
        z = logits_of(model, take(inputs, n))
        l_n = sample_loss(z, targets[n : n + 1], loss)
        losses.append(l_n.detach())
        rows.append(flat_grad(l_n, params))
        (gz,) = torch.autograd.grad(l_n, z, retain_graph=True)
        sq.append((gz**2).sum())
    return torch.stack(losses), torch.stack(rows), torch.stack(sq)


def fisher(model, inputs, targets, loss: str = "cross_entropy") -> torch.Tensor:
    """``F = sum_n sum_t sum_c p_ntc grad log p_ntc grad log p_ntc^T`` (``eqn:FIM``), ``[P, P]``.

    For ``mse`` the Gaussian-likelihood Fisher ``sum_n sum_k grad z_nk grad z_nk^T`` (the Gauss-Newton matrix).
    """
    params = trainable(model)
    size = sum(p.numel() for p in params)
    out = torch.zeros(size, size, dtype=torch.float64)
    for n in range(targets.shape[0]):
        z = logits_of(model, take(inputs, n))
        zf = z.reshape(-1, z.shape[-1])
        if loss == "mse":
            for t in range(zf.shape[0]):
                for k in range(zf.shape[1]):
                    g = flat_grad(zf[t, k], params).double()
                    out += torch.outer(g, g)
            continue
        y = targets[n].reshape(-1)
        for t in range(zf.shape[0]):
            if int(y[t]) == IGNORE:
                continue
            logp = torch.log_softmax(zf[t], dim=-1)
            for c in range(zf.shape[1]):
                g = flat_grad(logp[c], params).double()
                out += float(logp[c].detach().exp()) * torch.outer(g, g)
    return out


def gradient(model, inputs, targets, loss: str = "cross_entropy") -> torch.Tensor:
    _, jac, _ = per_sample(model, inputs, targets, loss)
    return jac.sum(0)
