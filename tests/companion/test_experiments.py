"""The setup registry (companion.experiments): names, scales, smoke training with every optimiser, the paper's parameter
counts from full-size random-weight builds, prompt tuning's prompts, metrics, fail-fast full-scale loaders, and run
files that a weights-only load reads (a crafted checkpoint runs no code)."""
from __future__ import annotations

import collections
import json
import pathlib
import random
import time

import numpy as np
import pytest
import torch

from companion.__main__ import main
from companion.experiments import (CPU_SETUPS, PAPER_SETUPS, SETUPS, MissingResource, describe, resolve, scales_of,
                             train)
from companion.experiments import data as data_mod
from companion.experiments import store
from companion.experiments.metrics import f1_binary, matthews, split_metrics, write_glue_predictions
from companion.experiments.models import build_model, from_hub
from companion.experiments.setups import GLUE_TASKS, OPTIMIZERS, optimizer_config
from companion.experiments.tasks import make_task


def test_registry_names_and_scales():
    assert len(PAPER_SETUPS) == 16 and len(SETUPS) == 19
    assert {f"{t}-t5-{m}" for t in GLUE_TASKS for m in ("lora", "pt")} < set(SETUPS)
    assert {"cifar100-vit-lora", "cifar10-mlp", "digits-mlp", "tweets-minilm-lora", "tweets-minilm-pt"} < set(SETUPS)
    for name in SETUPS:
        assert "smoke" in scales_of(name)
        assert resolve(name, "smoke").name == name
    assert all(scales_of(n) == ("full", "smoke") for n in PAPER_SETUPS)
    assert all(scales_of(n) == ("cpu", "smoke") for n in CPU_SETUPS)


def test_full_hyperparameters_are_the_papers():
    pt, lora, vit, mlp = (resolve(n, "full") for n in ("rte-t5-pt", "rte-t5-lora", "cifar100-vit-lora", "cifar10-mlp"))
    assert (pt.epochs, pt.eval_every, pt.batch_size) == (40, 30, 32)  # tab:train-epochs
    assert (resolve("qqp-t5-lora", "full").epochs, resolve("qqp-t5-lora", "full").eval_every) == (5, 1000)
    assert (vit.epochs, vit.eval_every) == (5, 1000)
    a = pt.optimizers["adafactor"]
    assert (a.lr, a.weight_decay, a.options["decay_rate"], a.options["scale_parameter"]) == (0.3, 1e-5, -0.8, False)
    assert (pt.optimizers["ief"].lr, pt.optimizers["ief"].damping, pt.optimizers["sgd"].lr) == (50.0, 1e-12, 100.0)
    assert (pt.optimizers["ef"].lr, pt.optimizers["ef"].schedule) == (1.0, "normalised-linear")
    for cfg in (lora, vit):
        o = cfg.optimizers
        assert (o["adamw"].lr, o["adamw"].weight_decay, o["sgd"].lr) == (1e-3, 1e-2, 0.1)
        assert (o["ief"].lr, o["ief"].damping, o["ief"].schedule) == (100.0, 1e-7, "constant")
        assert (o["sf"].lr, o["sf"].schedule) == (0.01, "normalised-linear")
    o = mlp.optimizers
    assert (mlp.epochs, mlp.batch_size) == (60, 64)
    assert (o["adam"].lr, o["adam"].milestones, o["sgd"].lr, o["ief"].lr, o["sf"].lr, o["ef"].lr) == (
        1e-4, (15,), 0.1, 50.0, 0.1, 1e-4)
    # cpu learning rates: the recorded search (tests/companion/test_search.py checks the values)
    for name in CPU_SETUPS:
        cfg = resolve(name, "cpu")
        assert not cfg.provisional and all("lr search" in o.source for o in cfg.optimizers.values())
    assert resolve("mnli-t5-pt", "full").model_args == resolve("cola-t5-pt", "full").model_args


def test_unknown_names_list_the_valid_ones(capsys):
    with pytest.raises(ValueError, match="valid setups: .*cola-t5-lora.*tweets-minilm-pt"):
        resolve("cola-t5-adapter", "smoke")
    with pytest.raises(ValueError, match="valid scales: full, cpu, smoke"):
        resolve("digits-mlp", "huge")
    with pytest.raises(ValueError, match="its scales: full, smoke"):
        resolve("cola-t5-lora", "cpu")
    with pytest.raises(ValueError, match="valid optimizers: adamw, adafactor, sgd, ef, sf, ief, adam"):
        optimizer_config(resolve("digits-mlp", "smoke"), "lbfgs")
    with pytest.raises(ValueError, match="valid optimizers: adamw, adafactor, sgd, ef, sf, ief, ief-momentum$"):
        optimizer_config(resolve("rte-t5-pt", "smoke"), "adam")
    assert main(["train", "--setup", "nope", "--optimizer", "ief", "--scale", "smoke"]) == 2
    assert "valid setups:" in capsys.readouterr().err
    assert main(["describe", "--setup", "digits-mlp", "--scale", "smoke", "--set", "nofield=1"]) == 2
    assert "valid fields:" in capsys.readouterr().err


def _expected_metrics(task: str) -> set[str]:
    return {"cola": {"matthews_correlation"}, "mrpc": {"f1", "accuracy"}, "qqp": {"f1", "accuracy"},
            "mnli": {"accuracy_matched", "accuracy_mismatched"}}.get(task, {"accuracy"})


@pytest.mark.parametrize("setup", SETUPS)
def test_smoke_trains_with_every_optimizer(setup, tmp_path):
    cfg = resolve(setup, "smoke")
    optimizers = [o for o in OPTIMIZERS if o in cfg.optimizers]
    assert set(optimizers) >= {"adamw", "adafactor", "sgd", "ef", "sf", "ief"}
    assert ("adam" in optimizers) == setup.endswith("-mlp")
    for opt in optimizers:
        s = train(setup, opt, 0, "smoke", tmp_path, progress=False, verbose=False)
        assert s["steps"] == cfg.epochs * s["steps_per_epoch"] and s["diverged"] is None
        assert s["final_train_loss"] is not None and s["final_train_loss"] > 0
        assert set(s["best_validation"]["metrics"]) == set(s["test"]) == _expected_metrics(cfg.task)
        if cfg.task in GLUE_TASKS:  # GLUE submission files
            assert len(s["test_predictions"]) == (2 if cfg.task == "mnli" else 1)
            lines = (tmp_path / "smoke" / setup / opt / "seed-0" / s["test_predictions"][0]).read_text().splitlines()
            assert lines[0] == "index\tprediction" and len(lines) == 1 + cfg.sizes["test"]


@pytest.fixture(scope="module")
def full_counts():
    """Each full-size architecture built once, from its config with random weights (no download)."""
    return {name: describe(name, "full", random_weights=True)
            for name in ("cola-t5-lora", "cola-t5-pt", "cifar100-vit-lora", "cifar10-mlp")}


def test_full_trainable_parameter_counts_equal_the_papers(full_counts):
    assert full_counts["cola-t5-pt"]["trainable_parameters"] == 15_360
    assert full_counts["cola-t5-pt"]["total_parameters"] == 222_918_912  # the paper's T5-base total (PT)
    assert full_counts["cola-t5-lora"]["trainable_parameters"] == 884_736
    assert full_counts["cifar10-mlp"]["trainable_parameters"] == 10_510_346
    vit = full_counts["cifar100-vit-lora"]  # the reconstruction explained in setups._vit
    assert (vit["trainable_parameters"], vit["total_parameters"]) == (313_344, 86_862_568)
    assert vit["difference_from_paper"] == 0 and any("313,344" in n for n in vit["notes"])
    for d in full_counts.values():
        assert d["sizes_source"] == "expected (not loaded)" and d["model_source"] == "config (random weights)"


def test_prompt_tuning_prompts_reach_the_encoder_and_hooks_see_samples():
    from ief import jacobian

    torch.manual_seed(0)
    cfg = resolve("rte-t5-pt", "smoke")
    data = data_mod.load_data(cfg)
    model, tok = build_model(cfg, data)
    inputs, targets = make_task(cfg, model, tok).collate(list(data.train[:4]))
    table = model.prompt_encoder.default.embedding.weight
    assert tuple(table.shape) == (20, cfg.model_args["d_model"])  # num_transformer_submodules=1: 20 rows, not 40
    original = type(model).get_prompt(model, 4)  # peft's own: one row embedded, then repeated
    assert torch.equal(model.get_prompt(4), original)
    model.eval()
    logits = model(**inputs).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    loss.backward()
    assert bool((table.grad.abs().sum(1) > 0).all())  # every prompt row reaches the encoder and the loss
    params = [p for p in model.parameters() if p.requires_grad]
    capture = jacobian.PerSampleCapture(model, params)
    with capture:
        model(**inputs)
    assert [r[0].shape[0] for k in capture.records for r in capture.records[k]] == [4]  # hooked per sample


def test_describe_cpu_setups_and_cli_json(capsys):
    d = describe("digits-mlp", "cpu")
    assert d["sizes"] == {"train": 1077, "validation": 360, "test": 360} and d["trainable_parameters"] == 26_122
    assert not d["provisional_hyperparameters"] and "lr search" in d["optimizers"]["ief"]["source"]
    assert main(["describe", "--setup", "tweets-minilm-pt", "--scale", "cpu", "--random-weights", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["trainable_parameters"] == 20 * 384 + 384 * 3 + 3  # prompts + the new 3-class head
    assert info["sizes"] == {"train": 1024, "validation": 256, "test": 2048}
    lora = describe("tweets-minilm-lora", "cpu")  # the pretrained weights of the package
    assert lora["trainable_parameters"] == 6 * 2 * 2 * 8 * 384 + 384 * 3 + 3


def test_metrics_match_their_definitions():
    pred = torch.tensor([1, 1, 0, 0, 1, 0, 1, 1])
    gold = torch.tensor([1, 0, 0, 1, 1, 0, 1, 0])
    tp, fp, fn, tn = 3, 2, 1, 2
    assert f1_binary(pred, gold) == pytest.approx(2 * tp / (2 * tp + fp + fn))
    assert matthews(pred, gold) == pytest.approx((tp * tn - fp * fn) / ((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
                                                 ** 0.5)
    assert split_metrics("mnli", "validation_mismatched", pred, gold) == {"accuracy_mismatched": 5 / 8}
    assert set(split_metrics("qqp", "validation", pred, gold)) == {"f1", "accuracy"}


def test_glue_prediction_files(tmp_path):
    path = write_glue_predictions("mnli", "test_mismatched", [0, 1, 2], torch.tensor([2, 0, 1]), tmp_path)
    assert path.name == "MNLI-mm.tsv"
    assert path.read_text().splitlines() == ["index\tprediction", "0\tcontradiction", "1\tentailment", "2\tneutral"]
    assert write_glue_predictions("sst2", "test", [5], torch.tensor([1]), tmp_path).read_text().endswith("5\t1\n")


def test_full_scale_data_without_datasets_fails_at_once(monkeypatch):
    real = data_mod.importlib.util.find_spec
    monkeypatch.setattr(data_mod.importlib.util, "find_spec", lambda n, *a: None if n == "datasets" else real(n, *a))
    start = time.time()
    for name in ("cola-t5-lora", "cifar100-vit-lora", "cifar10-mlp"):
        with pytest.raises(MissingResource, match=r"pip install datasets.*HF_DATASETS_CACHE="):
            data_mod.load_data(resolve(name, "full"))
    assert time.time() - start < 1


def test_full_scale_weights_without_hub_fail_at_once(monkeypatch, tmp_path):
    from transformers import AutoTokenizer, T5ForConditionalGeneration

    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.time()
    with pytest.raises(MissingResource, match=f"google-t5/t5-base.*hf download.*HF_HOME={tmp_path}"):
        from_hub(T5ForConditionalGeneration, "google-t5/t5-base", cache_dir=str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there: unreachable at once
    assert not data_mod.use_hub()
    with pytest.raises(MissingResource, match="unreachable"):
        from_hub(AutoTokenizer, "google-t5/t5-base", cache_dir=str(tmp_path))
    assert time.time() - start < 10


def test_smoke_tokenizers_are_trained_deterministically():
    from companion.experiments.models import _smoke_corpus, train_tokenizer

    for name, kind in (("tweets-minilm-pt", "bert"), ("mnli-t5-lora", "t5")):
        cfg = resolve(name, "smoke")
        corpus = _smoke_corpus(cfg, data_mod.load_data(cfg))
        a, b = (train_tokenizer(corpus, cfg.model_args["vocab_size"], kind) for _ in range(2))
        assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()


class _FakeHubDataset:
    """The part of ``datasets.Dataset`` the loaders use."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]

    @property
    def column_names(self):
        return list(self.rows[0])

    def select(self, indices):
        return _FakeHubDataset([self.rows[int(i)] for i in indices])

    def rename_column(self, old, new):
        return _FakeHubDataset([{new if k == old else k: v for k, v in r.items()} for r in self.rows])



def test_validation_labels_are_the_one_validation_split_in_order():
    cfg = resolve("tweets-minilm-lora", "smoke")
    expected = [int(e["label"]) for e in data_mod.load_data(cfg).validation["validation"]]
    labels = data_mod.validation_labels(cfg)
    assert labels == expected and len(set(labels)) > 1 and all(type(label) is int for label in labels)
    with pytest.raises(ValueError, match=r"mnli-t5-pt has 2 validation splits \(validation_matched, "
                                         r"validation_mismatched\)"):
        data_mod.validation_labels(resolve("mnli-t5-pt", "smoke"))

def test_a_test_tail_enlarges_the_test_set_without_moving_validation_or_training():
    """The tweets' learning rates were searched with 512 test examples before the validation set: the examples added
    to the test set since come from the shuffled corpus's end, so validation and training are the same examples."""
    corpus = [{"label": i % 3, "i": i} for i in range(100)]
    before = data_mod._split(corpus, {"train": 40, "validation": 10, "test": 8}, "k")
    after = data_mod._split(corpus, {"train": 40, "validation": 10, "test": 20}, "k", test_head=8)
    ids = lambda split: [e["idx"] for e in split]  # noqa: E731
    assert ids(after.train) == ids(before.train)
    assert ids(after.validation["validation"]) == ids(before.validation["validation"])
    assert ids(after.test["test"])[:8] == ids(before.test["test"])
    assert ids(after.test["test"])[8:] == list(range(88, 100))
    assert not set(ids(after.test["test"])) & set(ids(after.train) + ids(after.validation["validation"]))
    plain = data_mod._split(corpus, {"train": 40, "validation": 10, "test": 20}, "k")
    assert ids(plain.test["test"]) == list(range(20)) and ids(plain.train) != ids(before.train)
    with pytest.raises(ValueError, match=r"k: 100 examples cannot hold 8 \+ 44 test, 10 validation and 40 training"):
        data_mod._split(corpus, {"train": 40, "validation": 10, "test": 52}, "k", test_head=8)


def test_full_scale_splits_from_hub_datasets(monkeypatch):
    from PIL import Image

    def fake(path, name=None):
        if path == "nyu-mll/glue":
            row = {"premise": "a b", "hypothesis": "a c", "label": 1, "idx": 0}
            splits = ["train", "validation_matched", "validation_mismatched", "test_matched", "test_mismatched"]
            return {s: _FakeHubDataset([dict(row, idx=i, label=-1 if "test" in s else 1) for i in range(6)])
                    for s in splits}
        img = Image.fromarray(torch.randint(0, 255, (32, 32, 3), dtype=torch.uint8).numpy())
        rows = [{"img": img, "fine_label": i % 100, "coarse_label": 0} for i in range(50)]
        return {"train": _FakeHubDataset(rows), "test": _FakeHubDataset(rows[:7])}

    monkeypatch.setattr(data_mod, "load_hub_dataset", fake)
    mnli = data_mod.load_data(resolve("mnli-t5-pt", "full"))
    assert set(mnli.validation) == {"validation_matched", "validation_mismatched"}
    assert set(mnli.test) == {"test_matched", "test_mismatched"} and mnli.test["test_matched"][0]["label"] == -1
    cifar = data_mod.load_data(resolve("cifar100-vit-lora", "full", {"sizes": {"validation": 5}}))
    assert (len(cifar.train), len(cifar.validation["validation"]), len(cifar.test["test"])) == (45, 5, 7)
    train_labels = {r["label"] for r in cifar.train}  # fine_label renamed; one label per row: disjoint rows
    assert not train_labels & {r["label"] for r in cifar.validation["validation"]}
    cfg = resolve("cifar100-vit-lora", "smoke")  # PIL images through the ViT task and the MLP's pixel encoder
    model, processor = build_model(cfg, None)
    x, y = make_task(cfg, model, processor).collate([cifar.train[0], cifar.train[1]])
    assert tuple(x["pixel_values"].shape) == (2, 3, 16, 16) and y.tolist() == [cifar.train[0]["label"],
                                                                                cifar.train[1]["label"]]
    mlp = resolve("cifar10-mlp", "full")
    x, _ = make_task(mlp, build_model(resolve("cifar10-mlp", "smoke"), None)[0], None).collate([cifar.train[0]])
    assert tuple(x.shape) == (1, 3072)


def test_schedule_override_gives_ef_without_a_schedule(tmp_path, capsys):
    """`--schedule constant`: EF with a constant, un-normalised rate (the 'EF without a schedule' baseline); other
    schedules are refused where they do not exist, naming the valid ones."""
    from companion.experiments.optimizers import make_optimizer

    cfg = resolve("digits-mlp", "smoke")
    ef = optimizer_config(cfg, "ef", lr=1e-3, schedule="constant")
    assert (ef.schedule, ef.lr, ef.damping) == ("constant", 1e-3, cfg.optimizers["ef"].damping)
    model = torch.nn.Linear(3, 2)
    opt, scheduler = make_optimizer(model, ef, total_steps=10)
    group = opt.param_groups[0]
    assert scheduler is None and group["normalize"] is False and group["total_steps"] is None
    opt, _ = make_optimizer(model, optimizer_config(cfg, "ief", schedule="normalised-linear"), total_steps=10)
    assert opt.param_groups[0]["normalize"] is True and opt.param_groups[0]["total_steps"] == 10
    with pytest.raises(ValueError, match="valid schedules: constant, normalised-linear, multistep"):
        optimizer_config(cfg, "ef", schedule="cosine")
    with pytest.raises(ValueError, match="ief, ef and sf only, not 'adamw'"):
        optimizer_config(cfg, "adamw", schedule="normalised-linear")
    with pytest.raises(ValueError, match="needs milestones"):
        optimizer_config(resolve("tweets-minilm-lora", "smoke"), "sgd", schedule="multistep")
    args = ["train", "--setup", "digits-mlp", "--optimizer", "ef", "--scale", "smoke", "--lr", "0.001",
            "--schedule", "constant", "--out", str(tmp_path), "--no-progress"]
    assert main(args) == 0
    config = json.loads((tmp_path / "smoke" / "digits-mlp" / "ef" / "seed-0" / "config.json").read_text())
    assert config["optimizer"]["schedule"] == "constant" and config["optimizer"]["lr"] == 0.001


# ---------------------------------------------------------------------------------------------- run files (store)
class _WritesAFile:
    """A pickle payload: unpickling it calls ``Path.write_text`` (any code could stand there)."""

    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return (pathlib.Path.write_text, (self.target, "code ran"))


@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy-pickle"])
def test_a_crafted_checkpoint_is_refused_and_runs_nothing(tmp_path, zipped):
    """A run folder someone else wrote: a resume.pt whose pickle would execute code."""
    target = tmp_path / "pwned"
    path = tmp_path / "resume.pt"
    torch.save({"model": {"w": torch.ones(2)}, "rng": _WritesAFile(target)}, path,
               _use_new_zipfile_serialization=zipped)
    with pytest.raises(store.CorruptFile, match="resume.pt") as err:
        store.read_torch(path)
    assert not target.exists(), "unpickling the checkpoint ran its code"
    # the message names what was refused (zip: every global, from a scan of the opcodes; a legacy pickle: the first
    # one the load met) and what to do
    assert isinstance(err.value, store.UnsafeCheckpoint)
    assert ("pathlib" if zipped else "getattr") in str(err.value)
    assert "could run code" in str(err.value) and "re-run" in str(err.value)
    with pytest.raises(store.CorruptFile, match="resume.pt"):
        store.read_trainable(path)
    assert not target.exists()


def test_rng_states_round_trip_through_a_weights_only_load(tmp_path):
    """resume.pt's RNG states (torch, python, numpy) are stored as tensors and plain types; restored, every generator
    continues exactly where it was. numpy scalars (metrics) come back as Python numbers."""
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
             "metric": np.float64(0.25), "steps": np.int64(3)}
    expected = (random.random(), np.random.rand(4), torch.rand(3))
    store.write_torch(tmp_path / "resume.pt", state)
    back = store.read_torch(tmp_path / "resume.pt")
    assert isinstance(back["numpy"][1], torch.Tensor) and back["numpy"][1].dtype == torch.uint32
    assert back["metric"] == 0.25 and type(back["metric"]) is float and type(back["steps"]) is int
    torch.set_rng_state(back["torch"])
    random.setstate(back["python"])
    np.random.set_state(back["numpy"])
    assert random.random() == expected[0]
    np.testing.assert_array_equal(np.random.rand(4), expected[1])
    assert torch.equal(torch.rand(3), expected[2])


@pytest.mark.parametrize("mapping", [collections.Counter({3: 2, 1: 1}), collections.OrderedDict([(2, "b"), (1, "a")]),
                                     {"milestones": collections.Counter({5: 1}), "gamma": np.float64(0.5)}])
def test_mappings_keep_their_type_and_items_through_a_resume_file(mapping, tmp_path):
    """A scheduler's state holds a Counter (MultiStepLR's milestones): it comes back as the same Counter, not as a
    Counter of its (key, count) pairs."""
    store.write_torch(tmp_path / "resume.pt", {"state": mapping})
    back = store.read_torch(tmp_path / "resume.pt")["state"]
    assert type(back) is type(mapping) and back == mapping and list(back) == list(mapping)


def test_a_resume_checkpoint_of_the_previous_format_still_loads(tmp_path):
    """Before checkpoints held tensors only, resume.pt held numpy's RNG state as an ndarray: allowed in the load
    (numpy arrays only), so an unfinished run of an older version resumes."""
    np.random.seed(7)
    old = {"numpy": np.random.get_state(), "python": random.getstate(), "torch": torch.get_rng_state()}
    expected = np.random.rand(3)
    torch.save(old, tmp_path / "resume.pt")
    back = store.read_torch(tmp_path / "resume.pt")
    np.random.set_state(back["numpy"])
    np.testing.assert_array_equal(np.random.rand(3), expected)


def test_writing_what_a_weights_only_load_refuses_fails_before_writing(tmp_path):
    target = tmp_path / "pwned"
    with pytest.raises(TypeError, match="not written.*pathlib"):
        store.write_torch(tmp_path / "x.pt", {"w": torch.ones(1), "bad": _WritesAFile(target)})
    assert not (tmp_path / "x.pt").exists() and not target.exists()
    assert not list(tmp_path.iterdir())  # no temporary left either
