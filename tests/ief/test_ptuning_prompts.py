"""peft p-tuning and :func:`ief.per_sample_prompts`: peft runs the prompt encoder (an ``nn.Embedding`` and an MLP, or
an LSTM then an MLP) on one sample's virtual tokens and repeats its output over the batch, so every encoder parameter
takes the per-sample loop; patched, the encoder runs on every sample's tokens (identical values) and its layers are
hooked. Checked against the dense float64 per-sample oracle (``tests/oracle.py``, on the unpatched model), float32
and float64, eval and train mode (no dropout in the encoder's MLP: peft's has none)."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

import ief
import oracle

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def _ptuning(encoder: str, dtype: torch.dtype, train: bool):
    """A tiny BERT classifier with peft p-tuning (5 virtual tokens), the classifier and the prompt encoder trainable;
    a batch of 4 with an attention mask and one padded sample."""
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=40, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=16, max_position_embeddings=32, num_labels=3,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = peft.get_peft_model(transformers.BertForSequenceClassification(config), peft.PromptEncoderConfig(
        task_type="SEQ_CLS", num_virtual_tokens=5, encoder_hidden_size=8, encoder_reparameterization_type=encoder))
    model = model.to(dtype).train(train)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 40, (4, 6), generator=g)
    mask = torch.ones(4, 6, dtype=torch.long)
    mask[1, -2:] = 0
    return model, {"input_ids": ids, "attention_mask": mask}, torch.randint(0, 3, (4,), generator=g)


def _rel(got, ref) -> float:
    got = got.materialize() if hasattr(got, "materialize") else got
    return float((got.to(torch.float64) - ref).norm() / ref.norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("form", ["dense", "auto"])
def test_patched_p_tuning_takes_no_loop_and_is_exact(dtype, train, form):
    model, x, y = _ptuning("MLP", dtype, train)
    ref = oracle.per_sample(copy.deepcopy(model).double(), x, y)[1]
    with pytest.warns(ief.SlowPathWarning, match=r"prompt_encoder\.default\.mlp_head\.0\.weight"):
        slow = ief.per_sample(copy.deepcopy(model), x, y, form=form)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    assert _rel(slow.jacobian, ref) < tol
    assert ief.per_sample_prompts(model) is model
    with warnings.catch_warnings():
        warnings.simplefilter("error", ief.SlowPathWarning)
        fast = ief.per_sample(model, x, y, form=form, check="exact")
    assert _rel(fast.jacobian, ref) < tol


def test_an_lstm_encoder_keeps_only_its_lstm_on_the_loop():
    model, x, y = _ptuning("LSTM", torch.float64, False)
    ref = oracle.per_sample(copy.deepcopy(model), x, y)[1]
    ief.per_sample_prompts(model)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always", ief.SlowPathWarning)
        got = ief.per_sample(model, x, y)
    (message,) = [str(w.message) for w in record if issubclass(w.category, ief.SlowPathWarning)]
    listed = message.split(". Hooked layers")[0]
    assert "lstm_head" in listed and "mlp_head" not in listed and "embedding.weight" not in listed, listed
    assert _rel(got.jacobian, ref) < 1e-12


def test_other_adapters_are_refused_by_name():
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=40, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=16, num_labels=3)
    lora = peft.get_peft_model(transformers.BertForSequenceClassification(config),
                               peft.LoraConfig(task_type="SEQ_CLS", r=2, target_modules=["query"]))
    with pytest.raises(ValueError, match="prompt-tuning or p-tuning.*LORA"):
        ief.per_sample_prompts(lora)
