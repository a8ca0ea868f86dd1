"""A local stand-in of the Hugging Face hub for the full-scale setups, and the hub client calls patched to serve it.

:func:`build_standin_hub` writes, under one folder, what the hub serves for the full setups' repositories, at tiny
size: ``google-t5/t5-base`` (a T5 of the paper's architecture family, random weights, with a tokenizer trained here
with ``tokenizers``; both via ``save_pretrained``), ``google/vit-base-patch16-224`` (a tiny ViT with a 1000-way head
and its image processor), GLUE-shaped ``nyu-mll/glue`` configurations (the hub's column names, ``ClassLabel`` names
and ``-1`` test labels) and CIFAR-shaped ``uoft-cs/cifar10`` / ``uoft-cs/cifar100`` (RGB ``Image`` columns of 16x16
pixels, ``label`` / ``fine_label``). :func:`serve` patches ``huggingface_hub.model_info`` / ``dataset_info`` /
``snapshot_download`` and ``datasets.load_dataset`` to answer from it, recording every call, so that
``companion.experiments.asset_folder.download`` runs its real code against it.
"""
from __future__ import annotations

import fnmatch
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np

GLUE_CLASS_NAMES = {"cola": ["unacceptable", "acceptable"], "sst2": ["negative", "positive"],
                    "mrpc": ["not_equivalent", "equivalent"], "qqp": ["not_duplicate", "duplicate"],
                    "mnli": ["entailment", "neutral", "contradiction"], "qnli": ["entailment", "not_entailment"],
                    "rte": ["entailment", "not_entailment"]}  # nyu-mll/glue's ClassLabel names
SIZES = {"train": 48, "validation": 16, "test": 16}
# CIFAR's layout (an RGB Image column, ClassLabel label / fine_label + coarse_label) at 16x16 pixels, not 32x32: the
# MLP's block-diagonal evaluation eigendecomposes its first layer's (inputs+1)^2 factor three times per checkpoint,
# about 100 s of one CPU core at 3,073 inputs, well under one at 769 (the rehearsal's MLP overrides image_shape)
SIDE = 16
CIFAR_TRAIN = 112  # the full setups hold out 5,000 training images for validation: runs here override it to 16
REVISION = "0123456789abcdef0123456789abcdef01234567"


def _glue(task: str):
    import datasets

    from companion.experiments.data import _fixed_rng, _smoke_text
    from companion.experiments.setups import GLUE_FIELDS

    rng = _fixed_rng("standin-glue", task)
    features = datasets.Features({**{f: datasets.Value("string") for f in GLUE_FIELDS[task]},
                                  "label": datasets.ClassLabel(names=GLUE_CLASS_NAMES[task]),
                                  "idx": datasets.Value("int32")})
    names = {"train": "train", "validation": "validation", "test": "test"}
    if task == "mnli":  # the hub's MNLI splits
        names = {"train": "train", "validation_matched": "validation", "validation_mismatched": "validation",
                 "test_matched": "test", "test_mismatched": "test"}
    splits = {}
    for split, size in names.items():
        rows = _smoke_text(task, SIZES[size], rng)
        if size == "test":  # GLUE's test labels are private: -1 on the hub
            rows = [dict(r, label=-1) for r in rows]
        splits[split] = datasets.Dataset.from_list(rows, features=features)
    return datasets.DatasetDict(splits)


def _cifar(classes: int):
    import datasets

    rng = np.random.default_rng(classes)
    label = "label" if classes == 10 else "fine_label"
    columns = {"img": datasets.Image(), label: datasets.ClassLabel(names=[f"c{i}" for i in range(classes)])}
    if classes == 100:
        columns["coarse_label"] = datasets.ClassLabel(names=[f"g{i}" for i in range(20)])
    splits = {}
    for split, n in (("train", CIFAR_TRAIN), ("test", 16)):
        rows = []
        for _ in range(n):
            y = int(rng.integers(4))  # the smoke rule: the bright quadrant is the class
            img = rng.integers(0, 80, size=(SIDE, SIDE, 3))
            r, q = divmod(y, 2)
            h = SIDE // 2
            img[r * h:(r + 1) * h, q * h:(q + 1) * h] += 120
            row = {"img": img.astype(np.uint8), label: y}
            if classes == 100:
                row["coarse_label"] = 0
            rows.append(row)
        splits[split] = datasets.Dataset.from_list(rows, features=datasets.Features(columns))
    return datasets.DatasetDict(splits)


def _t5(dest: Path) -> None:
    from transformers import T5Config, T5ForConditionalGeneration

    from companion.experiments.models import train_tokenizer
    from companion.experiments.setups import GLUE_LABEL_WORDS, GLUE_PROMPTS
    from companion.experiments.tasks import glue_text

    corpus = []
    for task in GLUE_CLASS_NAMES:
        corpus += [glue_text(task, e) for e in _glue(task)["train"]] + list(GLUE_LABEL_WORDS[task]) * 20
        corpus.append(GLUE_PROMPTS[task])
    tokenizer = train_tokenizer(corpus, 400, "t5")
    model = T5ForConditionalGeneration(T5Config(
        vocab_size=len(tokenizer), d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2,
        relative_attention_num_buckets=8, relative_attention_max_distance=32, dropout_rate=0.1,
        feed_forward_proj="relu", tie_word_embeddings=True, decoder_start_token_id=0, pad_token_id=0,
        eos_token_id=1))
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)


def _vit(dest: Path) -> None:
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    ViTForImageClassification(ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                        intermediate_size=32, image_size=32, patch_size=8, num_labels=1000)
                              ).save_pretrained(dest)
    ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(dest)


def build_standin_hub(root: Path, tasks: tuple[str, ...] = tuple(GLUE_CLASS_NAMES), vit: bool = True) -> Path:
    """Write the stand-in hub under ``root``: ``models/<repo>/`` (files as the hub serves them, plus junk a
    download must skip: a TF weights file) and ``datasets/<repo>/<config>/`` (``save_to_disk``) with a card each.

    Returns:
        ``root``.
    """
    import datasets
    import torch
    from transformers.utils import logging as hf_logging

    datasets.disable_progress_bars()
    hf_logging.disable_progress_bar()
    torch.manual_seed(0)
    t5 = root / "models" / "google-t5/t5-base"
    _t5(t5)
    (t5 / "README.md").write_text("---\nlicense: apache-2.0\n---\n# stand-in T5\n")
    (t5 / "tf_model.h5").write_bytes(b"not for torch")  # the hub repo has TF/Flax copies: not downloaded
    if vit:
        _vit(root / "models" / "google/vit-base-patch16-224")
        (root / "models" / "google/vit-base-patch16-224" / "README.md").write_text("---\nlicense: apache-2.0\n---\n")
    for task in tasks:
        _glue(task).save_to_disk(str(root / "datasets" / "nyu-mll/glue" / task))
    _cifar(10).save_to_disk(str(root / "datasets" / "uoft-cs/cifar10" / "default"))
    if vit:
        _cifar(100).save_to_disk(str(root / "datasets" / "uoft-cs/cifar100" / "default"))
    for repo in ("nyu-mll/glue", "uoft-cs/cifar10", "uoft-cs/cifar100"):
        (root / "cards" / repo).mkdir(parents=True, exist_ok=True)
        (root / "cards" / repo / "README.md").write_text(f"---\nlicense: unknown\n---\n# {repo} (stand-in)\n")
    return root


def serve(monkeypatch, root: Path) -> list[tuple]:
    """Patch the hub client calls to answer from the stand-in under ``root``; returns the list of calls made."""
    import datasets
    import huggingface_hub

    calls: list[tuple] = []

    def info(kind):
        def get(repo, **_):
            calls.append((f"{kind}_info", repo))
            return SimpleNamespace(sha=REVISION, id=repo)
        return get

    def snapshot_download(repo_id, *, revision=None, local_dir=None, allow_patterns=None, repo_type=None, **_):
        calls.append(("snapshot_download", repo_id, repo_type, revision))
        assert revision == REVISION, revision
        src = root / ("cards" if repo_type == "dataset" else "models") / repo_id
        if not src.is_dir():
            raise FileNotFoundError(f"stand-in hub: no repository {repo_id}")
        for path in src.rglob("*"):
            rel = str(path.relative_to(src))
            if path.is_file() and (allow_patterns is None or any(fnmatch.fnmatch(rel, p) for p in allow_patterns)):
                (Path(local_dir) / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, Path(local_dir) / rel)
        return str(local_dir)

    def load_dataset(path, name=None, *, revision=None, **_):
        calls.append(("load_dataset", path, name, revision))
        assert revision == REVISION, revision
        return datasets.load_from_disk(str(root / "datasets" / path / (name or "default")))

    monkeypatch.setattr(huggingface_hub, "model_info", info("model"))
    monkeypatch.setattr(huggingface_hub, "dataset_info", info("dataset"))
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls
