"""The stall watch (:mod:`ief.optim.stall`): a loss that has not fallen while updates are taken is said, once.

The rule on hand-written loss sequences (a stall, a fall, a fall that levels off, a warm-up at ``lr = 0``); the
optimiser's wiring on a stalled causal LM (a tiny Llama with LoRA whose iEF rate is far too small to move its loss)
and on an MLP that trains; the watch makes no host round-trip of its own.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import ief
from ief.optim.stall import STALL_WINDOW, StallWatch


def _said(watch: StallWatch, losses, lrs=None) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, loss in enumerate(losses):
            watch.observe(loss, step, 1.0 if lrs is None else lrs[step])
    return [str(w.message) for w in caught]


def test_a_loss_that_stays_put_is_said_once_after_two_windows():
    said = _said(StallWatch("IEF", window=4), [4.16, 4.15, 4.17, 4.16] * 5)  # no fall beyond the spread
    assert len(said) == 1
    assert "IEF: the loss has not fallen while updates were taken" in said[0]
    assert "steps 4-7" in said[0] and "lr='auto'" in said[0] and "said once" in said[0]


@pytest.mark.parametrize("losses", [
    [4.0 - 0.1 * t for t in range(12)],            # falls steadily
    [4.0, 3.0, 2.0, 1.0] + [0.5] * 8,              # falls, then levels off: not a stall
    [4.0 - 0.002 * t + 0.001 * (-1) ** t for t in range(12)],  # falls slowly, beyond the batches' spread
])
def test_a_loss_that_fell_is_not_a_stall(losses):
    assert _said(StallWatch("IEF", window=4), losses) == []


def test_steps_without_an_update_do_not_count():
    """A warm-up at ``lr = 0`` leaves the loss put by design; non-finite losses are the divergence checks'."""
    losses = [4.0] * 12 + [float("nan")] * 4
    assert _said(StallWatch("IEF", window=4), losses, [0.0] * 12 + [1.0] * 4) == []


def test_window_zero_turns_the_watch_off_and_bad_windows_are_refused():
    assert _said(StallWatch("IEF", window=0), [4.0] * 200) == []
    assert StallWatch("IEF").window == STALL_WINDOW
    for bad in (-1, 2.5, True, "5"):
        with pytest.raises(ValueError, match="stall window"):
            StallWatch("IEF", window=bad)


def _tiny_llama_lora():
    import peft
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
                                   pad_token_id=0, attn_implementation="eager")
    return peft.get_peft_model(transformers.LlamaForCausalLM(cfg), peft.LoraConfig(r=4, target_modules="all-linear"))


def _lm_batch(step: int):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(1, 8, (8, 10), generator=g)  # a learnable next token: 7 symbols out of 32
    labels = ids.clone()
    labels[::2, -3:] = -100  # padded samples
    return {"input_ids": ids}, ief.causal_lm_targets(labels)


def _mlp_batch(step: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 5, generator=g)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


def _train(lr: float, steps: int, window: int, lm: bool = True) -> tuple[list[str], list[float]]:
    torch.manual_seed(0)
    model = _tiny_llama_lora() if lm else torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(),
                                                                torch.nn.Linear(8, 3))
    opt = ief.optim.IEF(model, lr=lr, damping=1e-4)
    opt.stall_watch.window = window
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            losses.append(float(opt.step(*(_lm_batch if lm else _mlp_batch)(step))))
    return [str(w.message) for w in caught if "has not fallen" in str(w.message)], losses


def test_a_stalled_causal_lm_is_said():
    said, losses = _train(lr=1e-9, steps=8, window=3)
    assert abs(losses[-1] - losses[0]) < 0.01 * losses[0]
    assert len(said) == 1 and "lr=1e-09" in said[0]


def test_a_training_model_is_not_said():
    said, losses = _train(lr=1.0, steps=12, window=4, lm=False)
    assert sum(losses[-4:]) < 0.9 * sum(losses[:4]) and said == []


def test_the_watch_reads_nothing_from_the_device_of_its_own(monkeypatch):
    """It is given the float the step read with its checks: ``observe`` receives a Python float."""
    seen = []
    original = StallWatch.observe
    monkeypatch.setattr(StallWatch, "observe", lambda self, loss, *a, **k: (seen.append(type(loss)),
                                                                             original(self, loss, *a, **k))[1])
    _train(lr=1.0, steps=2, window=3, lm=False)
    assert seen == [float, float]
