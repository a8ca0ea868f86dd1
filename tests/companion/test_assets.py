"""The assets folder (companion.experiments.asset_folder): ``download`` against a local stand-in of the hub writes
exactly the layout the loaders read, ``check`` finds what is missing or altered, and a loader pointed at a folder that
lacks an item fails once, naming the item and the command that fetches it."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from standin_hub import REVISION, build_standin_hub, serve

from companion.__main__ import main
from companion.experiments import asset_folder
from companion.experiments.asset_folder import OFFLINE_SWITCHES, Item, check, download, plan
from companion.experiments.data import MissingResource, load_data
from companion.experiments.models import build_model
from companion.experiments.setups import resolve
from companion.chapters.setups import licences

ROOT = Path(__file__).resolve().parents[2]
SETUPS = ["cola-t5-lora", "rte-t5-pt", "cifar10-mlp"]


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    return build_standin_hub(tmp_path_factory.mktemp("hub"), tasks=("cola", "rte"), vit=False)


@pytest.fixture()
def folder(hub, tmp_path, monkeypatch):
    """An assets folder downloaded from the stand-in hub; the hub's offline switches restored after the test."""
    for name in OFFLINE_SWITCHES:
        monkeypatch.setenv(name, "0")
    monkeypatch.delenv(asset_folder.ENV, raising=False)
    calls = serve(monkeypatch, hub)
    download(tmp_path / "assets", SETUPS, log=lambda line: None)
    return tmp_path / "assets", calls


def test_plan_names_every_hub_item_of_the_setups():
    assert plan(SETUPS) == [Item("model", "google-t5/t5-base"), Item("dataset", "nyu-mll/glue", "cola"),
                            Item("dataset", "nyu-mll/glue", "rte"), Item("dataset", "uoft-cs/cifar10")]
    assert len(plan()) == 11  # T5, 7 GLUE tasks, ViT, CIFAR100, CIFAR10
    assert plan(["digits-mlp"], "cpu") == []  # cpu assets ship in PyPI packages
    with pytest.raises(ValueError, match="unknown setup 'nope'"):
        plan(["nope"])
    with pytest.raises(ValueError, match="accepted: full"):
        download("unused", scale="cpu")


def test_download_writes_what_the_loaders_read(folder, hub, monkeypatch):
    root, calls = folder
    manifest = json.loads((root / "manifest.json").read_text())
    assert sorted(manifest["items"]) == sorted(i.name for i in plan(SETUPS))
    for name, item in manifest["items"].items():
        assert item["revision"] == REVISION and item["bytes"] == sum(f["bytes"] for f in item["files"])
        for f in item["files"]:  # every file listed with its real size and sha256
            path = root / f["path"]
            assert f["path"].startswith((item["path"] + "/", "cards/"))
            assert path.stat().st_size == f["bytes"]
            assert asset_folder._sha256(path) == f["sha256"]
    t5 = root / "models" / "google-t5--t5-base"
    assert {p.name for p in t5.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json", "README.md"}
    assert not (t5 / "tf_model.h5").exists()  # only what torch needs (and the model card)
    assert "| model google-t5/t5-base | " + REVISION + " | Apache-2.0 |" in (root / "LICENCES.md").read_text()
    # the loaders, pointed at the folder, read exactly what the stand-in hub served
    monkeypatch.setenv(asset_folder.ENV, str(root))
    cfg = resolve("cola-t5-lora", "full")
    data = load_data(cfg)
    assert len(data.train) == 48 and data.test["test"][0]["label"] == -1
    model, tokenizer = build_model(cfg, data)
    from safetensors.torch import load_file

    saved = load_file(str(hub / "models" / "google-t5/t5-base" / "model.safetensors"))
    base = model.get_base_model()
    assert torch.equal(base.shared.weight, saved["shared.weight"])
    assert tokenizer("acceptable")["input_ids"][-1] == tokenizer.eos_token_id == 1
    mlp = resolve("cifar10-mlp", "full", {"sizes": {"validation": 16}})
    assert load_data(mlp).sizes() == {"train": 96, "validation": 16, "test": 16}
    # a second download keeps everything and asks the hub nothing
    before = len(calls)
    download(root, SETUPS, log=lambda line: None)
    assert len(calls) == before


def test_check_reports_missing_items_and_altered_files(folder):
    root, _ = folder
    assert check(root, SETUPS) == []
    missing = check(root, ["sst2-t5-pt"])
    assert missing == [f"missing dataset nyu-mll/glue (sst2): run `python -m companion assets download --scale full "
                       f"--setups sst2-t5-lora sst2-t5-pt --to {root}`"]
    weights = root / "models" / "google-t5--t5-base" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    (root / "models" / "google-t5--t5-base" / "tokenizer.json").unlink()
    problems = check(root, SETUPS)
    assert any("model.safetensors: sha256 differs" in p for p in problems)
    assert any("tokenizer.json: missing" in p for p in problems) and len(problems) == 2
    assert check(root.parent / "nothing") == [f"{(root.parent / 'nothing').resolve()} has no manifest.json: run "
                                              f"`python -m companion assets download --scale full --to "
                                              f"{(root.parent / 'nothing').resolve()}`"]


def test_a_missing_item_is_one_error_naming_it_and_the_download_command(folder, monkeypatch, tmp_path):
    root, _ = folder
    monkeypatch.setenv(asset_folder.ENV, str(root))
    with pytest.raises(MissingResource, match=r"has no dataset nyu-mll/glue \(sst2\).*python -m companion assets "
                                              r"download --scale full --setups sst2-t5-lora sst2-t5-pt --to"):
        load_data(resolve("sst2-t5-pt", "full"))
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv(asset_folder.ENV, str(empty))
    with pytest.raises(MissingResource, match=r"has no model google-t5/t5-base .*--setups cola-t5-lora cola-t5-pt"):
        build_model(resolve("cola-t5-lora", "full"))


def test_command_line(folder, capsys, tmp_path):
    root, _ = folder
    assert main(["assets", "check", "--setups", *SETUPS, "--to", str(root)]) == 0
    assert "4 items" in capsys.readouterr().out
    assert main(["assets", "check", "--setups", "sst2-t5-pt", "--to", str(root)]) == 1
    assert "problem: missing dataset nyu-mll/glue (sst2)" in capsys.readouterr().err
    assert main(["assets", "check", "--scale", "cpu", "--to", str(root)]) == 2
    assert main(["--assets", str(tmp_path / "absent"), "list"]) == 2
    assert "is not a directory" in capsys.readouterr().err
    # a training run at full scale with --assets on a folder lacking the data: exit 1, the item named
    done = subprocess.run([sys.executable, "-m", "companion", "--assets", str(root), "train", "--setup", "sst2-t5-lora",
                           "--scale", "full", "--optimizer", "adamw", "--out", str(tmp_path / "runs")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "has no dataset nyu-mll/glue (sst2)" in done.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("config.json"))


def test_the_licence_table_lists_what_the_folder_holds(folder):
    root, _ = folder
    table = licences("full", root)
    column = table["in the assets folder"]
    assert column["T5-base (model)"] == f"google-t5/t5-base @ {REVISION[:12]} " \
        f"({json.loads((root / 'manifest.json').read_text())['items']['model google-t5/t5-base']['bytes']:,} bytes)"
    assert column["ViT-B/16 (vit-base-patch16-224) (model)"].startswith("not held")
    assert column["GLUE (7 tasks) (data)"].count("nyu-mll/glue") == 2 and column["PyTorch (software)"] == "-"
    assert "in the assets folder" not in licences("cpu", root) and "in the assets folder" not in licences("full")


def test_workflow_config_key_assets(tmp_path):
    """``--config assets=DIR`` (make book CONFIG='assets=DIR'): a folder that is not there is refused by name; an
    existing one plans the grid (every job then inherits IEF_ASSETS from workflow/rules/common.smk)."""
    import os

    snakemake = [sys.executable, "-m", "snakemake", "--snakefile", str(ROOT / "workflow" / "Snakefile"),
                 "--directory", str(ROOT), "-n", "--cores", "1", "--config", "scale=full"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([*snakemake, f"assets={tmp_path / 'absent'}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode != 0 and "is not a directory" in done.stdout + done.stderr
    done = subprocess.run([*snakemake, f"assets={tmp_path}", "--", "grid"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
