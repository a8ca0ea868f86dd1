"""ief.losses: s_iEF (``||grad_z l_n||^2``) against a float64 autograd oracle, in chunks, and the memory it takes."""
from __future__ import annotations

import pytest
import torch

import ief
from ief import losses
from tests import oracle
from tests.memory import peak_added_bytes


def _oracle_sqnorm(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``||grad_{z_n} l_n||^2`` per sample by autograd through each sample's float64 loss (tests/oracle.py)."""
    out = []
    for n in range(logits.shape[0]):
        z = logits[n : n + 1].detach().to(torch.float64).requires_grad_(True)
        (g,) = torch.autograd.grad(oracle.sample_loss(z, targets[n : n + 1], "cross_entropy"), z, allow_unused=True)
        out.append(torch.zeros((), dtype=torch.float64) if g is None else (g * g).sum())
    return torch.stack(out)


def _batch(m=3, t=5, c=11, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(m, t, c, generator=gen, dtype=torch.float64)).to(dtype)
    targets = torch.randint(0, c, (m, t), generator=gen)
    targets[0, :2] = oracle.IGNORE  # ignored positions add nothing
    targets[2] = oracle.IGNORE  # a sample with no kept position: s = 0
    return logits, targets


@pytest.mark.parametrize("chunk", [None, 11, 3 * 11, 5 * 11, 2 * 5 * 11])
def test_cross_entropy_sqnorm_matches_the_oracle_in_any_chunking(monkeypatch, chunk):
    """Chunks of one position, of a few positions within a sample, of one sample and of two samples: the same
    numbers as the float64 autograd oracle."""
    if chunk is not None:
        monkeypatch.setitem(losses.SQNORM_CHUNK_ENTRIES, "cpu", chunk)
    logits, targets = _batch(dtype=torch.float64)
    got = ief.logit_sqnorm(ief.get_loss("cross_entropy"), logits, targets)
    want = _oracle_sqnorm(logits, targets)
    assert got.dtype == torch.float64 and got.shape == (3,)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    assert float(got[2]) == 0.0


def test_a_classifier_and_masked_classes():
    """``[M, C]`` logits, and ``-inf`` (masked) classes, which have probability 0."""
    logits, targets = _batch(dtype=torch.float64)
    z, y = logits[:, 0].clone(), targets[:, 1].clone()
    z[1, (int(y[1]) + 1) % 11] = float("-inf")
    torch.testing.assert_close(ief.logit_sqnorm(ief.get_loss("cross_entropy"), z, y), _oracle_sqnorm(z, y),
                               rtol=1e-12, atol=0)


def test_positions_over_several_axes():
    """``[M, H, W, C]`` logits (a segmentation map): every position of a sample is summed, as over ``[M, T, C]``."""
    logits, targets = _batch(t=6, dtype=torch.float64)
    got = ief.logit_sqnorm(ief.get_loss("cross_entropy"), logits.reshape(3, 2, 3, 11), targets.reshape(3, 2, 3))
    torch.testing.assert_close(got, _oracle_sqnorm(logits, targets), rtol=1e-12, atol=0)


def test_a_confident_prediction_keeps_its_digits_in_float32():
    """Near ``p_y = 1`` the gradient is ``1 - p_y`` in size: summed from the other classes' probabilities it keeps
    float32's relative accuracy, where ``p_y - 1`` in float32 would keep only ``p_y``'s rounding (~6e-8 of 1e-6,
    6 %)."""
    c = 50
    logits = torch.zeros(4, 1, c)
    targets = torch.tensor([[0], [1], [2], [3]])
    for n, margin in enumerate((12.0, 15.0, 18.0, 20.0)):  # 1 - p_y from 3e-4 down to 1e-7
        logits[n, 0, n] = margin
    got = ief.logit_sqnorm(ief.get_loss("cross_entropy"), logits, targets)
    want = _oracle_sqnorm(logits, targets)
    assert got.dtype == torch.float32 and float(want.min()) < 1e-12
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=0)


def test_16_bit_logits_are_read_in_float32():
    logits, targets = _batch(t=7, c=13)
    narrow = logits.to(torch.bfloat16)
    got = ief.logit_sqnorm(ief.get_loss("cross_entropy"), narrow, targets)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _oracle_sqnorm(narrow, targets), rtol=1e-5, atol=1e-7)


def test_mse_is_the_squared_residual():
    gen = torch.Generator().manual_seed(1)
    z, y = torch.randn(3, 4, generator=gen, dtype=torch.float64), torch.randn(3, 4, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(ief.logit_sqnorm(ief.get_loss("mse"), z, y), ((z - y) ** 2).sum(dim=1))


def test_a_causal_lms_logits_cost_one_chunk_not_their_size():
    """``[8, 64, 16384]`` float32 logits (32 MiB, a small causal LM's): the peak of new tensors is about one chunk's
    probabilities (16 MiB), where the softmax, one-hot and difference of the whole logits took ~4x the logits."""
    logits = torch.randn(8, 64, 16384)
    targets = torch.randint(0, 16384, (8, 64))
    peak = peak_added_bytes(lambda: ief.logit_sqnorm(ief.get_loss("cross_entropy"), logits, targets))
    chunk = losses.SQNORM_CHUNK_ENTRIES["cpu"] * 4
    assert peak <= 1.25 * chunk, f"peak {peak / 2**20:.1f} MiB for {logits.numel() * 4 / 2**20:.0f} MiB of logits"
