"""An assets folder: every model, tokenizer and data set the full-scale setups load from the Hugging Face hub, saved
once where the hub is reachable (a cluster's login node) and read from there where it is not (its compute nodes).

Layout (``DIR`` = the folder; ``<repo>`` with ``/`` written ``--``)::

    DIR/manifest.json                        every item: name, revision, licence, its files (paths relative to
                                             DIR) with sha256 and bytes
    DIR/LICENCES.md                          each item's licence and where it is documented (companion.experiments.assets)
    DIR/models/<repo>/                       a hub model snapshot (config, weights, tokenizer / image processor,
                                             model card): what ``from_pretrained(DIR/models/<repo>)`` reads
    DIR/datasets/<repo>[--<config>]/         ``datasets.load_dataset(repo, config).save_to_disk(...)``: what
                                             ``datasets.load_from_disk`` reads
    DIR/cards/<repo>/README.md               a data set's card (its licence section)

With ``IEF_ASSETS=DIR`` set (``python -m companion --assets DIR ...``, or the workflow's ``assets`` config key),
:func:`companion.experiments.models.from_hub` and :func:`companion.experiments.data.load_hub_dataset` read only from ``DIR``,
with the hub's offline switches on, and a missing item is one :class:`MissingResource` naming
the item and the command that downloads it. ``python -m companion assets download`` writes the folder
(:func:`download`), ``python -m companion assets check`` verifies it against its manifest (:func:`check`).
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENV = "IEF_ASSETS"
MANIFEST = "manifest.json"
MODEL_FILES = ("*.json", "*.safetensors", "*.model", "*.txt", "LICENSE*", "README.md")  # no TF/Flax/ONNX copies
OFFLINE_SWITCHES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


class MissingResource(RuntimeError):
    """Weights or data that are neither cached nor downloadable; the message says what to get and where it goes."""


@dataclass(frozen=True)
class Item:
    """One thing a setup loads from the hub: a model repository, or a data set (repository + configuration)."""

    kind: str  # "model" | "dataset"
    repo: str  # e.g. "google-t5/t5-base", "nyu-mll/glue"
    config: str | None = None  # a data set's configuration (a GLUE task), None otherwise

    @property
    def name(self) -> str:
        return f"{self.kind} {self.repo}" + (f" ({self.config})" if self.config else "")

    @property
    def path(self) -> str:
        """The item's folder, relative to the assets folder."""
        flat = self.repo.replace("/", "--")
        if self.kind == "model":
            return f"models/{flat}"
        return f"datasets/{flat}" + (f"--{self.config}" if self.config else "")


def assets_dir() -> Path | None:
    """The assets folder named by ``IEF_ASSETS`` (None when unset or empty)."""
    value = os.environ.get(ENV, "").strip()
    return Path(value).expanduser().resolve() if value else None


def use_assets(folder: str | os.PathLike) -> Path:
    """Make every loader of this process (and of the processes it starts) read from ``folder`` only.

    Args:
        folder: the assets folder (``python -m companion assets download --to folder``).

    Returns:
        The folder as an absolute path.

    Raises:
        ValueError: ``folder`` is not a directory.
    """
    path = Path(folder).expanduser().resolve()
    if not path.is_dir():
        raise ValueError(f"assets folder {str(folder)!r} is not a directory; create it with `python -m companion assets "
                         f"download --scale full --to {folder}` on a machine with internet")
    os.environ[ENV] = str(path)
    go_offline()
    return path


def go_offline() -> None:
    """Set the hub's offline switches: read by ``huggingface_hub`` / ``datasets`` / ``transformers`` at import."""
    for name in OFFLINE_SWITCHES:
        os.environ[name] = "1"


def download_command(items: list[Item] | None = None, folder: Path | str = "DIR") -> str:
    """The command that fetches ``items`` (the setups that need them) into ``folder``."""
    setups = sorted({s for it in items or [] for s in setups_needing(it)})
    which = f" --setups {' '.join(setups)}" if setups else ""
    return f"python -m companion assets download --scale full{which} --to {folder}"


def local_item(item: Item) -> Path:
    """Where the assets folder holds ``item``; ``MissingResource`` naming it and the download command if absent."""
    folder = assets_dir()
    if folder is None:
        raise ValueError(f"{ENV} is not set: no assets folder to read {item.name} from")
    path = folder / item.path
    if not path.is_dir() or not any(path.iterdir()):
        raise MissingResource(
            f"the assets folder {folder} ({ENV}) has no {item.name} (expected at {path}). On a machine with "
            f"internet run `{download_command([item], folder)}`, then copy the folder here; "
            f"`python -m companion assets check --to {folder}` lists what it holds")
    return path


# ------------------------------------------------------------------------------------------- what setups need
def items_of(cfg: Any) -> list[Item]:
    """The hub items a resolved setup loads (none below full scale: those ship in PyPI packages or are generated).

    Args:
        cfg: a :class:`~companion.experiments.setups.SetupConfig`.

    Returns:
        The model (T5, ViT) and the data set (GLUE task, CIFAR) of a full-scale setup, in that order.
    """
    if cfg.scale != "full":
        return []
    items = []
    if cfg.family in ("t5", "vit"):
        items.append(Item("model", cfg.model_source))
    prefix = "hub: "
    if not cfg.data_source.startswith(prefix):
        raise ValueError(f"{cfg.name}: data source {cfg.data_source!r} is not a hub data set")
    source = cfg.data_source[len(prefix):]
    if source.startswith("nyu-mll/glue/"):
        items.append(Item("dataset", "nyu-mll/glue", source.rsplit("/", 1)[1]))
    else:
        items.append(Item("dataset", source))
    return items


def setups_needing(item: Item) -> list[str]:
    """The full-scale setups that load ``item``."""
    from .setups import SETUPS, resolve, scales_of

    return [n for n in SETUPS if "full" in scales_of(n) and item in items_of(resolve(n, "full"))]


def plan(setups: list[str] | None = None, scale: str = "full") -> list[Item]:
    """Every item the chosen setups (default: all of the scale's) need, each once, in setup order.

    Raises:
        ValueError: an unknown setup or scale, or a setup without that scale.
    """
    from .setups import SETUPS, resolve, scales_of

    names = list(setups) if setups else [n for n in SETUPS if scale in scales_of(n)]
    out: list[Item] = []
    for name in names:
        for item in items_of(resolve(name, scale)):
            if item not in out:
                out.append(item)
    return out


# -------------------------------------------------------------------------------------------------- download
def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _files(folder: Path, under: str) -> list[dict[str, Any]]:
    """Every file under ``folder / under`` (huggingface_hub's ``.cache`` bookkeeping left out) with its sha256 and
    size, its path relative to ``folder``."""
    root = folder / under
    return [{"path": str(p.relative_to(folder)), "sha256": _sha256(p), "bytes": p.stat().st_size}
            for p in sorted(root.rglob("*")) if p.is_file() and ".cache" not in p.relative_to(root).parts]


def _licence(item: Item) -> dict[str, str]:
    from .assets import ASSETS

    key = {"google-t5/t5-base": "t5-base", "google/vit-base-patch16-224": "vit-b16", "nyu-mll/glue": "glue",
           "uoft-cs/cifar10": "cifar", "uoft-cs/cifar100": "cifar"}.get(item.repo)
    if key is None:
        raise KeyError(f"no licence entry for {item.name}: add it to companion.experiments.assets.ASSETS")
    return {"asset": key, "licence": ASSETS[key].licence, "documented in": ASSETS[key].licence_note}


def _fetch(item: Item, folder: Path) -> str:
    """Download ``item`` into ``folder`` at the hub's current revision; returns that revision."""
    import huggingface_hub

    dest = folder / item.path
    if item.kind == "model":
        revision = huggingface_hub.model_info(item.repo).sha
        huggingface_hub.snapshot_download(item.repo, revision=revision, local_dir=dest, allow_patterns=MODEL_FILES)
        return revision
    import datasets

    revision = huggingface_hub.dataset_info(item.repo).sha
    ds = datasets.load_dataset(item.repo, item.config, revision=revision)
    ds.save_to_disk(str(dest))
    card = folder / "cards" / item.repo.replace("/", "--")
    huggingface_hub.snapshot_download(item.repo, repo_type="dataset", revision=revision, local_dir=card,
                                      allow_patterns=["README.md"])
    return revision


def read_manifest(folder: str | os.PathLike) -> dict[str, Any]:
    """The folder's manifest (an empty one when there is none yet)."""
    path = Path(folder) / MANIFEST
    if not path.exists():
        return {"format": 1, "items": {}}
    return json.loads(path.read_text())


def download(folder: str | os.PathLike, setups: list[str] | None = None, scale: str = "full",
             log: Any = print) -> dict[str, Any]:
    """Save every hub item the setups need into ``folder``, with the manifest and the licences file.

    Items already in the manifest with the files it lists are kept (a second call downloads nothing).

    Args:
        folder: the assets folder (created if missing).
        setups: setup names (default: every setup of ``scale``).
        scale: ``full`` (the only scale that loads from the hub).
        log: called with one line per item.

    Returns:
        The manifest written to ``folder/manifest.json``.

    Raises:
        ValueError: an unknown setup or scale.
    """
    from .store import write_json, write_text

    if scale != "full":
        raise ValueError(f"scale {scale!r} loads nothing from the hub (its assets ship in PyPI packages or are "
                         f"generated); accepted: full")
    root = Path(folder).expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    manifest = read_manifest(root)
    for item in plan(setups, scale):
        held = manifest["items"].get(item.name)
        if held is not None and not _problems_of(root, held):
            log(f"kept {item.name} (revision {held['revision']})")
            continue
        revision = _fetch(item, root)
        files = _files(root, item.path)
        if item.kind == "dataset":  # the data set's card (its licence section), shared by a repo's configurations
            files += _files(root, f"cards/{item.repo.replace('/', '--')}")
        manifest["items"][item.name] = {"kind": item.kind, "repo": item.repo, "config": item.config,
                                        "path": item.path, "revision": revision, **_licence(item),
                                        "bytes": sum(f["bytes"] for f in files), "files": files,
                                        "downloaded": datetime.datetime.now(datetime.timezone.utc).isoformat(
                                            timespec="seconds")}
        write_json(root / MANIFEST, manifest)  # after each item: an interrupted download keeps what it finished
        log(f"saved {item.name} (revision {revision}, {manifest['items'][item.name]['bytes']:,} bytes)")
    write_json(root / MANIFEST, manifest)
    write_text(root / "LICENCES.md", licences_text(manifest))
    return manifest


def licences_text(manifest: dict[str, Any]) -> str:
    """``LICENCES.md``: one line per item held, with its licence (``tab:license``) and where it is documented."""
    lines = ["# Licences of the items in this assets folder", "",
             "| item | revision | licence | documented in |", "| --- | --- | --- | --- |"]
    for name, it in sorted(manifest["items"].items()):
        lines.append(f"| {name} | {it['revision']} | {it['licence']} | {it['documented in']} |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------------- check
def _problems_of(root: Path, held: dict[str, Any]) -> list[str]:
    problems = []
    for f in held["files"]:
        path = root / f["path"]
        if not path.is_file():
            problems.append(f"{f['path']}: missing")
        elif path.stat().st_size != f["bytes"]:
            problems.append(f"{f['path']}: {path.stat().st_size} bytes, manifest {f['bytes']}")
        elif _sha256(path) != f["sha256"]:
            problems.append(f"{f['path']}: sha256 differs from the manifest")
    return problems


def check(folder: str | os.PathLike, setups: list[str] | None = None, scale: str = "full") -> list[str]:
    """What is wrong with an assets folder: items the setups need that it lacks, and files that are missing or
    differ (size, sha256) from its manifest.

    Args:
        folder: the assets folder.
        setups: the setups it should serve (default: every setup of ``scale``).
        scale: ``full``.

    Returns:
        One line per problem; empty when the folder is complete and intact.
    """
    root = Path(folder).expanduser().resolve()
    if not (root / MANIFEST).is_file():
        return [f"{root} has no {MANIFEST}: run `{download_command(None, root)}`"]
    manifest = read_manifest(root)
    problems = []
    needed = plan(setups, scale)
    for item in needed:
        if item.name not in manifest["items"]:
            problems.append(f"missing {item.name}: run `{download_command([item], root)}`")
    for name, held in sorted(manifest["items"].items()):
        problems += [f"{name}: {p}" for p in _problems_of(root, held)]
    return problems


def held(folder: str | os.PathLike | None = None) -> dict[str, list[dict[str, Any]]]:
    """Asset key (:data:`companion.experiments.assets.ASSETS`) -> the manifest entries of the folder's items of that asset
    (``folder`` default: ``IEF_ASSETS``; empty when there is no folder or no manifest)."""
    root = Path(folder) if folder is not None else assets_dir()
    if root is None or not (root / MANIFEST).is_file():
        return {}
    out: dict[str, list[dict[str, Any]]] = {}
    for name, it in sorted(read_manifest(root)["items"].items()):
        out.setdefault(it["asset"], []).append(dict(it, name=name))
    return out


# ------------------------------------------------------------------------------------------- command line
def add_parser(sub: Any) -> None:
    """``python -m companion assets download|check``."""
    a = sub.add_parser("assets", help="an assets folder for offline full-scale runs: download (where the hub is "
                       "reachable) or check it; use it with IEF_ASSETS=DIR or python -m companion --assets DIR")
    what = a.add_subparsers(dest="action", required=True)
    for name, text in (("download", "save every model, tokenizer and data set the setups load, with licences and "
                        "a manifest (sha256, bytes)"), ("check", "verify a folder against its manifest and the "
                        "setups' needs (exit 1 on a problem)")):
        q = what.add_parser(name, help=text)
        q.add_argument("--scale", default="full", metavar="X", help="full (the only scale that uses the hub)")
        q.add_argument("--setups", nargs="+", default=None, metavar="S", help="default: every setup of the scale")
        q.add_argument("--to", required=True, metavar="DIR", help="the assets folder")


def run_command(args: Any) -> int:
    """Run ``python -m companion assets ...``; returns the exit code (0 done, 1 a problem in the folder, 2 bad input)."""
    import sys

    try:
        if args.action == "download":
            download(args.to, args.setups, args.scale)
            problems = check(args.to, args.setups, args.scale)
        else:
            if args.scale != "full":
                raise ValueError(f"scale {args.scale!r} loads nothing from the hub; accepted: full")
            problems = check(args.to, args.setups, args.scale)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for line in problems:
        print(f"problem: {line}", file=sys.stderr)
    if not problems:
        manifest = read_manifest(args.to)
        total = sum(it["bytes"] for it in manifest["items"].values())
        print(f"{args.to}: {len(manifest['items'])} items, {total:,} bytes, every file as in {MANIFEST}")
    return 1 if problems else 0
