import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing

from tiny_models import ALL_CASES


@pytest.fixture(autouse=True, scope="session")
def _single_thread():
    """The suite's models are tiny: single-threaded BLAS is faster for them and avoids OpenMP stalls when another
    process holds one of a small machine's cores. Restored at the end of the session."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture(params=sorted(ALL_CASES))
def any_case(request):
    """Every tiny model: mlp, mse-mlp, sequence (ignored positions), t5-lora, t5-prompt, vit-lora."""
    return ALL_CASES[request.param]()


@pytest.fixture(scope="session")
def run_cache(tmp_path_factory) -> Path:
    """A folder of training runs shared by the whole test session, its xdist workers included (their base temporary
    folders are siblings): ``nbrun.train_grid(..., cache=run_cache)`` trains each smoke run once per session, where
    several chapters' tests read the same grid."""
    root = tmp_path_factory.getbasetemp()
    return (root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root) / "run-cache"


LIBRARY_TIER = Path(__file__).resolve().parent / "ief"


@pytest.fixture(autouse=True)
def _processes_are_the_slow_tier(request, monkeypatch):
    """A test of the library's tier (tests/ief) that starts processes (``torch.multiprocessing.spawn`` or
    ``start_processes``) must be marked ``slow``, the tier ``make test`` runs and ``make test-lib`` leaves out: without
    the marker the start fails, naming the test, so the fast loop cannot silently grow a multi-process test."""
    if request.node.get_closest_marker("slow") is not None or not Path(str(request.node.path)).is_relative_to(
            LIBRARY_TIER):
        return

    def refuse(*args, **kwargs):
        raise RuntimeError(f"{request.node.nodeid} starts processes: mark it @pytest.mark.slow (the tier make test "
                           "runs and make test-lib leaves out)")

    monkeypatch.setattr(torch.multiprocessing, "spawn", refuse)
    monkeypatch.setattr(torch.multiprocessing, "start_processes", refuse)
