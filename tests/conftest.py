import pytest
import torch

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
