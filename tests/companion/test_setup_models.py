"""``ief`` on the companion's setups' models: what only a real setup's architecture shows (the models built by
``companion.experiments.models.build_model`` from their configs, random weights, no download)."""
import torch

import ief


def test_per_sample_keeps_nothing_of_the_call_alive():
    """Nothing of a call outlives its result. The recorded calls' gradient edges once sat in the records that their
    own gradient hooks reach, a cycle through autograd's C++ nodes that Python's collector does not break on a LoRA
    BERT: every call leaked its records (the layers' inputs) and stand-ins, and a cpu MiniLM-LoRA run grew by ~100 MB
    per update until the OOM killer stopped it. The model: MiniLM's architecture with LoRA, random weights from its
    config (no download)."""
    import gc

    from companion.experiments.models import build_model
    from companion.experiments.setups import resolve

    torch.manual_seed(0)
    model, _ = build_model(resolve("tweets-minilm-lora", "cpu"), None, random_weights=True)
    model.train()
    live = []
    for i in range(4):
        ids = torch.randint(5, 100, (4, 8), generator=torch.Generator().manual_seed(i))
        result = ief.per_sample(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                                torch.tensor([0, 1, 2, 1]))
        assert torch.isfinite(result.jacobian).all()
        del result
        gc.collect()
        live.append(sum(1 for o in gc.get_objects() if torch.is_tensor(o)))
    # from the second call on, the same count: a leak grows with every call (the first call may build caches,
    # or let go of what earlier tests left in them, so it is the baseline only for "no more than")
    assert live[2:] == live[1:2] * 2 and live[1] <= live[0], f"tensors alive after each call: {live}"
