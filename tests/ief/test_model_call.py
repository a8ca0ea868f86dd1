"""``ief.model_call``'s memory helper: ``large_empty`` is ``torch.empty`` whose pages the kernel may back with
transparent huge pages (2 MiB), so that writing a fresh ``J`` does not fault once per 4 KiB page."""
from __future__ import annotations

import resource
import sys
from pathlib import Path

import pytest
import torch

from ief.model_call import HUGE_PAGE, large_empty

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    """The kernel's transparent huge page mode (the bracketed word), or None where there is none."""
    if sys.platform != "linux" or not THP.exists():
        return None
    text = THP.read_text()
    return text[text.index("[") + 1 : text.index("]")]


@pytest.mark.parametrize("shape", [(0,), (3, 5), (16, 550_018), (2, 3, 1 << 20)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_large_empty_is_an_ordinary_writable_tensor(shape, dtype):
    out = large_empty(shape, dtype, torch.device("cpu"))
    assert out.shape == shape and out.dtype == dtype and out.device.type == "cpu" and out.is_contiguous()
    out.fill_(1.5)
    assert bool((out == 1.5).all())


def test_writing_a_fresh_large_tensor_faults_once_per_huge_page_not_per_small_page():
    """The advice's effect, measured: writing a fresh 64 MiB tensor costs 16,384 minor page faults with 4 KiB pages;
    with the advice, about one per 2 MiB page (32), so well under 2,000."""
    mode = _thp_mode()
    if mode not in ("always", "madvise"):
        pytest.skip(f"this machine's kernel offers no transparent huge pages (mode {mode!r})")
    nbytes = 64 << 20
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    out = large_empty((nbytes // 4,), torch.float32, torch.device("cpu"))
    out.fill_(1.0)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < 2000, faults
    assert nbytes // HUGE_PAGE == 32


def test_column_blocks_are_cache_sized_on_a_cpu_and_launch_sized_on_a_device():
    """On a GPU every block costs kernel launches: GPT-2 small's [8, 124M] J took ~1,900 blocks of 65,536 columns
    (measured on an H200, 2026-11-28); a device's blocks hold ~2^24 entries instead, and blocks cover every column."""
    from ief.model_call import COLUMN_CHUNK, DEVICE_CHUNK_ENTRIES, column_chunk, column_chunks

    assert column_chunk(torch.empty(8, 10)) == COLUMN_CHUNK
    device_j = torch.empty(8, 124_000_000, device="meta")
    assert column_chunk(device_j) == DEVICE_CHUNK_ENTRIES // 8
    assert len(list(column_chunks(device_j))) == 60  # was 1,893
    assert column_chunk(torch.empty(10**6, 3, device="meta")) == COLUMN_CHUNK  # never narrower than on a CPU
    x = torch.arange(24.0).reshape(2, 12)
    assert torch.equal(torch.cat([b for _, b in column_chunks(x, 5)], dim=1), x)
    assert [lo for lo, _ in column_chunks(x, 5)] == [0, 5, 10]
