"""The experiment runner on a CUDA device: the paper's families train and resume at smoke scale.

Needs a CUDA device and is skipped where the machine has none (CI runs on CPU-only machines). The library's own
GPU numerics (float32 on the GPU against the float64 CPU oracle) are in ``tests/ief/test_gpu.py``.
"""
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; this machine has none"),
]


@pytest.mark.parametrize("setup", ["rte-t5-pt", "mrpc-t5-lora", "cifar100-vit-lora", "cifar10-mlp"])
def test_cuda_runner_trains_every_optimizer_and_resumes(setup, tmp_path):
    """The experiment runner on the GPU (the paper's families at smoke scale): every optimiser trains to a summary,
    and a run that crashes right after its first resume checkpoint resumes (CUDA RNG state included: LoRA dropout
    draws from it) to the losses of an uninterrupted run, up to GPU reduction-order noise."""
    from companion.experiments import resolve, run_dir, runner, train
    from companion.experiments.store import read_run

    for optimizer in resolve(setup, "smoke").optimizers:
        s = train(setup, optimizer, 0, "smoke", tmp_path, device="cuda", progress=False, verbose=False)
        run = read_run(run_dir(tmp_path, "smoke", setup, optimizer, 0))
        assert run["config"]["device"].startswith("cuda") and s["steps"] == len(run["losses"]) > 0
        assert s["best_validation"]["metrics"] and (s["test"] is None or s["test"])  # GLUE test labels are private
    original_save = runner.store.write_torch
    calls = {"n": 0}

    def stop_after_first_resume(path, obj):  # a crash right after the first periodic resume checkpoint
        original_save(path, obj)
        if path.name == "resume.pt":
            calls["n"] += 1
            if calls["n"] == 1:
                raise KeyboardInterrupt("simulated crash")

    reference = train(setup, "sgd", 1, "smoke", tmp_path / "ref", device="cuda", progress=False, verbose=False)
    runner.store.write_torch = stop_after_first_resume
    try:
        with pytest.raises(KeyboardInterrupt):
            train(setup, "sgd", 1, "smoke", tmp_path / "res", device="cuda", progress=False, verbose=False,
                  checkpoint_every_s=0.0)
    finally:
        runner.store.write_torch = original_save
    assert calls["n"] == 1
    resumed = train(setup, "sgd", 1, "smoke", tmp_path / "res", device="cuda", progress=False, verbose=False)
    assert resumed["steps"] == reference["steps"]
    ref_losses = read_run(run_dir(tmp_path / "ref", "smoke", setup, "sgd", 1))["losses"]
    res_losses = read_run(run_dir(tmp_path / "res", "smoke", setup, "sgd", 1))["losses"]
    assert res_losses == pytest.approx(ref_losses, rel=1e-4, abs=1e-6)
    assert not (run_dir(tmp_path / "res", "smoke", setup, "sgd", 1) / "resume.pt").exists()
