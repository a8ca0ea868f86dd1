import pytest
import torch

from tiny_models import ALL_CASES


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture(params=sorted(ALL_CASES))
def any_case(request):
    """Every tiny model: mlp, mse-mlp, sequence (ignored positions), t5-lora, t5-prompt, vit-lora."""
    return ALL_CASES[request.param]()
