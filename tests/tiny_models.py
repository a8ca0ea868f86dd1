"""Small models for the tests, each returned as a :class:`Case`: model + inputs + targets (+ loss).

Every case is deterministic (seeded), float64 by default and small enough for dense oracles (P up to a few
thousand, a few hundred backward passes for the explicit Fisher).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

IGNORE = -100


@dataclasses.dataclass
class Case:
    name: str
    model: torch.nn.Module
    inputs: Any
    targets: torch.Tensor
    loss: str = "cross_entropy"


def mlp_case(m: int = 6, dtype=torch.float64, seed: int = 0) -> Case:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 4)).to(dtype)
    x = torch.randn(m, 5, dtype=dtype)
    y = torch.randint(0, 4, (m,))
    return Case("mlp", model, x, y)


def mse_case(m: int = 5, dtype=torch.float64, seed: int = 0) -> Case:
    """A non-convex (tanh) network with a 2-dimensional output and the squared error."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2)).to(dtype)
    x = torch.randn(m, 3, dtype=dtype)
    y = torch.randn(m, 2, dtype=dtype)
    return Case("mse-mlp", model, x, y, loss="mse")


class TinySequenceModel(torch.nn.Module):
    """Embedding -> multi-head self-attention (hooked: its calls replayed per sample, ief.jacobian.rules.attention)
    -> LayerNorm -> linear head, with per-position logits ``[M, T, C]``."""

    def __init__(self, vocab: int = 11, dim: int = 6, classes: int = 5):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim, padding_idx=0)
        self.attn = torch.nn.MultiheadAttention(dim, num_heads=2, batch_first=True)
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        a, _ = self.attn(h, h, h, key_padding_mask=tokens.eq(0), need_weights=False)
        return self.head(self.norm(h + a))


class TokenTableModel(torch.nn.Module):
    """A trainable token table (padding row 0) that a batch uses only partly, looked up once (or, ``twice``, also at
    ``3 id mod V``), a position table fed ``[1, T]`` ids shared by every sample, tanh and a Linear head:
    per-position logits ``[M, T, C]``. The factored forms of ``ief.per_sample`` keep the token table as the rows the
    batch uses (``ief.rows.FactoredJacobian.used_rows``)."""

    def __init__(self, vocab: int = 12, positions: int = 4, dim: int = 3, classes: int = 3, twice: bool = False):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim, padding_idx=0)
        self.positions = torch.nn.Embedding(positions, dim)
        self.head = torch.nn.Linear(dim, classes)
        self.twice = twice

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        where = torch.arange(tokens.shape[1]).unsqueeze(0)  # [1, T]
        h = self.embed(tokens) + self.positions(where)
        if self.twice:
            h = h + self.embed((tokens * 3) % self.embed.num_embeddings)
        return self.head(torch.tanh(h))


def sequence_case(m: int = 4, t: int = 5, dtype=torch.float64, seed: int = 0) -> Case:
    """Token sequences with padding (token 0) and ignored target positions (-100), one sample fully ignored but one."""
    torch.manual_seed(seed)
    model = TinySequenceModel().to(dtype)
    tokens = torch.randint(1, 11, (m, t))
    lengths = torch.tensor([t, t - 2, 3, t - 1][:m] + [t] * max(0, m - 4))
    for n, length in enumerate(lengths.tolist()):
        tokens[n, length:] = 0
    targets = torch.randint(0, 5, (m, t))
    targets[tokens.eq(0)] = IGNORE
    targets[0, 1] = IGNORE
    return Case("sequence", model, tokens, targets)


def _t5_config(**overrides):
    from transformers import T5Config

    cfg = dict(
        vocab_size=32, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_decoder_layers=1, num_heads=2,
        relative_attention_num_buckets=4, relative_attention_max_distance=8, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )
    cfg.update(overrides)
    return T5Config(**cfg)


def _t5_batch(m: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(2, 32, (m, 6), generator=g)
    attention_mask = torch.ones(m, 6, dtype=torch.long)
    for n in range(m):  # varied padding
        pad = n % 3
        if pad:
            input_ids[n, -pad:] = 0
            attention_mask[n, -pad:] = 0
    labels = torch.randint(2, 32, (m, 3), generator=g)
    labels[1 % m, 2] = IGNORE  # padded label sequence
    if m > 2:
        labels[2, 1:] = IGNORE
    decoder_input_ids = torch.cat([torch.zeros(m, 1, dtype=torch.long), labels[:, :-1].clamp_min(0)], dim=1)
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids)
    return inputs, labels


def t5_lora_case(m: int = 3, dtype=torch.float64, seed: int = 0) -> Case:
    """``T5ForConditionalGeneration`` (tiny config) with peft LoRA r=8 on q/v, attention mask and padded labels."""
    import peft
    from transformers import T5ForConditionalGeneration

    torch.manual_seed(seed)
    base = T5ForConditionalGeneration(_t5_config()).to(dtype)
    model = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q", "v"], lora_dropout=0.1))
    with torch.no_grad():  # LoRA B starts at 0; move it so the Jacobian is generic
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    model.eval()
    inputs, labels = _t5_batch(m, seed)
    return Case("t5-lora", model, inputs, labels)


def t5_prompt_case(m: int = 3, dtype=torch.float64, seed: int = 0) -> Case:
    """``T5ForConditionalGeneration`` (tiny config) with peft prompt tuning, 20 virtual tokens."""
    import peft
    from transformers import T5ForConditionalGeneration

    torch.manual_seed(seed)
    base = T5ForConditionalGeneration(_t5_config()).to(dtype)
    model = peft.get_peft_model(base, peft.PromptTuningConfig(task_type="SEQ_2_SEQ_LM", num_virtual_tokens=20))
    model = model.to(dtype)
    model.eval()
    inputs, labels = _t5_batch(m, seed)
    return Case("t5-prompt", model, inputs, labels)


def vit_lora_case(m: int = 4, dtype=torch.float64, seed: int = 0) -> Case:
    """``ViTForImageClassification`` (tiny config, default SDPA attention) with LoRA on q/v and a trainable head."""
    import peft
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(seed)
    cfg = ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=8, num_hidden_layers=1,
                    num_attention_heads=2, intermediate_size=16, num_labels=5)
    base = ViTForImageClassification(cfg).to(dtype)
    model = peft.get_peft_model(
        base, peft.LoraConfig(r=8, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["classifier"])
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    model.eval()
    pixel_values = torch.randn(m, 3, 8, 8, dtype=dtype)
    return Case("vit-lora", model, dict(pixel_values=pixel_values), torch.randint(0, 5, (m,)))


ALL_CASES = {
    "mlp": mlp_case,
    "mse-mlp": mse_case,
    "sequence": sequence_case,
    "t5-lora": t5_lora_case,
    "t5-prompt": t5_prompt_case,
    "vit-lora": vit_lora_case,
}


def saturated_case(seed: int = 0):
    """A linear classifier with huge weights: sample 1's predicted class wins by a margin of thousands, so its
    softmax is exactly one-hot in float64 and its loss, gradient and ``s_n`` are exactly zero; the other samples
    target their least likely class (huge loss, non-zero gradient). Returns ``(model, x, y)``."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 4).double()
    with torch.no_grad():
        model.weight.mul_(1e4)
    x = torch.randn(4, 3, dtype=torch.float64)
    with torch.no_grad():
        z = model(x)
    y = z.argmin(dim=1)
    y[1] = z[1].argmax()
    return model, x, y


class SquareNoJvp(torch.autograd.Function):
    """A custom op with a backward but no forward-mode rule (``jvp``) and no functorch support: the fallbacks' test."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad
