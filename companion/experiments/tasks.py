"""From examples to model inputs and targets, and from model outputs to predicted classes.

Two kinds of task, used at every scale:

- :class:`LabelWordTask` (T5 on GLUE, ``sec:app-exp-setup``): the input is the task's prompt of tab:glue-details
  with the sentence(s) filled in; the target is the label word's tokens followed by ``</s>`` (``-100`` padding), so
  the loss is the cross-entropy of the LM head over the whole vocabulary, as in the paper. Prediction: one decoder
  step, argmax of the logits restricted to the label words' first tokens (which must differ).
- :class:`ClassifierTask` (ViT, MLP, MiniLM): the model's logits, of which the first ``num_classes`` are the
  classes (for ViT at full scale the 1000-way ImageNet head, of which CIFAR100 uses outputs 0..99).

``collate(examples) -> (inputs, targets)`` gives what ``model(**inputs)`` (or ``model(inputs)``) takes and class
indices; ``predict(model, examples)`` gives predicted class indices ``[M]``.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ief import IGNORE_INDEX
from .setups import GLUE_FIELDS, GLUE_LABEL_WORDS, GLUE_PROMPTS, SetupConfig

def glue_text(task: str, example: dict) -> str:
    """The model input of a GLUE example: the task's prompt (tab:glue-details) with its sentence(s) filled in."""
    return GLUE_PROMPTS[task].format(**{f"S{i + 1}": example[f] for i, f in enumerate(GLUE_FIELDS[task])})


def to_device(inputs: Any, device: torch.device | str) -> Any:
    if isinstance(inputs, dict):
        return {k: v.to(device) for k, v in inputs.items()}
    return inputs.to(device)


class LabelWordTask:
    """GLUE with T5: prompt -> label word (tab:glue-details)."""

    def __init__(self, task: str, tokenizer: Any, max_length: int | None, decoder_start_token_id: int):
        self.task, self.tokenizer, self.max_length = task, tokenizer, max_length
        self.start = int(decoder_start_token_id)
        self.pad = int(tokenizer.pad_token_id)
        self.label_ids = [tokenizer(w)["input_ids"] for w in GLUE_LABEL_WORDS[task]]  # word tokens + </s>
        self.first_tokens = [ids[0] for ids in self.label_ids]
        if len(set(self.first_tokens)) != len(self.first_tokens):
            raise ValueError(f"{task}: label words {GLUE_LABEL_WORDS[task]} share a first token {self.first_tokens}")

    def _encode(self, examples: Sequence[dict]) -> dict[str, torch.Tensor]:
        enc = self.tokenizer([glue_text(self.task, e) for e in examples], max_length=self.max_length, truncation=True,
                             padding=True, return_tensors="pt")
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}

    def collate(self, examples: Sequence[dict]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        inputs = self._encode(examples)
        words = [self.label_ids[int(e["label"])] for e in examples]
        targets = torch.full((len(words), max(map(len, words))), IGNORE_INDEX, dtype=torch.long)
        for n, ids in enumerate(words):
            targets[n, : len(ids)] = torch.tensor(ids)
        shifted = targets[:, :-1].masked_fill(targets[:, :-1] == IGNORE_INDEX, self.pad)  # teacher forcing
        inputs["decoder_input_ids"] = torch.cat([torch.full((len(words), 1), self.start), shifted], dim=1)
        return inputs, targets

    @torch.no_grad()
    def predict(self, model: torch.nn.Module, examples: Sequence[dict], device: torch.device | str) -> torch.Tensor:
        inputs = self._encode(examples)
        inputs["decoder_input_ids"] = torch.full((len(examples), 1), self.start, dtype=torch.long)
        logits = model(**to_device(inputs, device)).logits[:, 0]
        return logits[:, self.first_tokens].argmax(-1).cpu()


class ClassifierTask:
    """Classification from a model's logits; ``encode(examples)`` makes the inputs (pixels, features or tokens)."""

    def __init__(self, num_classes: int, encode: Any):
        self.num_classes, self.encode = num_classes, encode

    def collate(self, examples: Sequence[dict]) -> tuple[Any, torch.Tensor]:
        return self.encode(examples), torch.tensor([int(e["label"]) for e in examples], dtype=torch.long)

    @torch.no_grad()
    def predict(self, model: torch.nn.Module, examples: Sequence[dict], device: torch.device | str) -> torch.Tensor:
        inputs = to_device(self.encode(examples), device)
        out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
        logits = out.logits if hasattr(out, "logits") else out
        return logits[:, : self.num_classes].argmax(-1).cpu()


def text_encoder(tokenizer: Any, max_length: int | None):
    def encode(examples: Sequence[dict]) -> dict[str, torch.Tensor]:
        enc = tokenizer([e["text"] for e in examples], max_length=max_length, truncation=True, padding=True,
                        return_tensors="pt")
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}

    return encode


def image_encoder(processor: Any):
    def encode(examples: Sequence[dict]) -> dict[str, torch.Tensor]:
        return {"pixel_values": processor(images=[e["img"] for e in examples], return_tensors="pt")["pixel_values"]}

    return encode


def pixel_encoder(scale: float, mean: Sequence[float], std: Sequence[float]):
    """Pixels (HWC) -> /scale -> per-channel standardisation -> flattened in CHW order (``sec:app-mlp-cifar10``)."""
    mean_a, std_a = np.asarray(mean, dtype=np.float32), np.asarray(std, dtype=np.float32)

    def encode(examples: Sequence[dict]) -> torch.Tensor:
        x = np.stack([np.asarray(e["img"], dtype=np.float32) for e in examples]) / scale
        if x.ndim == 3:
            x = x[..., None]
        x = (x - mean_a) / std_a
        return torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2))).reshape(len(examples), -1)

    return encode


def make_task(cfg: SetupConfig, model: torch.nn.Module, preprocessor: Any) -> LabelWordTask | ClassifierTask:
    """The task of a setup, given its model and tokenizer / image processor (None for the MLP)."""
    if cfg.family == "t5":
        start = model.get_base_model().config.decoder_start_token_id if hasattr(model, "get_base_model") else 0
        return LabelWordTask(cfg.task, preprocessor, cfg.max_length, start)
    if cfg.family == "vit":
        return ClassifierTask(cfg.num_classes, image_encoder(preprocessor))
    if cfg.family == "bert":
        return ClassifierTask(cfg.num_classes, text_encoder(preprocessor, cfg.max_length))
    a = cfg.model_args
    return ClassifierTask(cfg.num_classes, pixel_encoder(a["scale"], a["mean"], a["std"]))
