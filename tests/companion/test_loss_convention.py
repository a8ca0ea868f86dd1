"""One loss convention for the training curves: every optimiser a setup registers (``cfg.optimizers``: the grid's
E2 and practical optimisers, the ones ``python -m companion train --optimizer`` accepts), at every scale, reports from
``train_step`` the batch's mean cross-entropy per counted target token, ``L / K`` with ``K = ief.count_targets``:
Hugging Face's ``outputs.loss`` where the model has one, an explicit float64 computation for the MLPs.

The optimisers minimise either convention (``reduction="sum"``, ``"mean"`` for the paper's token-mean setups, torch's
mean for the first-order ones); the recorded loss must not depend on it (an ``ief-momentum`` run at full scale once
recorded ``L / K^2``: ``IEF(reduction="mean").step`` returns ``L / K`` and the loop divided by ``K`` again). Full-scale
setups are built offline from the rehearsal's stand-in assets (``tests/standin_hub.py``). One step per optimiser on
a batch of 4 examples, in ``eval()`` mode so that the reference forward sees the model the step saw.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from standin_hub import build_standin_hub, serve

import ief
from companion.experiments.data import load_data
from companion.experiments.models import build_model
from companion.experiments.optimizers import make_optimizer, train_step
from companion.experiments.setups import CPU_SETUPS, GRIDS, OPTIMIZERS, PAPER_SETUPS, resolve, scales_of
from companion.experiments.tasks import make_task

# every method (LoRA, prompt tuning, from scratch) and model family of each scale; the full MLP and ViT shrunk as in
# the rehearsal (their registered sizes cost minutes of CPU, and the convention does not depend on them)
FULL_SETUPS = ("cola-t5-lora", "rte-t5-pt", "cifar10-mlp", "cifar100-vit-lora")
SETUPS = {"smoke": (*CPU_SETUPS, *FULL_SETUPS), "cpu": CPU_SETUPS, "full": FULL_SETUPS}
FULL_OVERRIDES = {
    "cifar10-mlp": {"sizes": {"validation": 16}, "model_args": {
        "hidden": [16, 16], "image_shape": [16, 16, 3], "scale": 255.0, "mean": [0.4914, 0.4822, 0.4465],
        "std": [0.2470, 0.2435, 0.2616]}},
    "cifar100-vit-lora": {"sizes": {"validation": 16}},
}
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_ENDPOINT": "http://127.0.0.1:9", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
CASES = [(scale, name) for scale in ("smoke", "cpu", "full") for name in SETUPS[scale]]


@pytest.fixture(scope="module")
def full_assets(tmp_path_factory):
    """The stand-in assets of :data:`FULL_SETUPS` in the real layout (as the offline rehearsal writes them)."""
    from companion.experiments.asset_folder import download

    tmp = tmp_path_factory.mktemp("assets")
    hub = build_standin_hub(tmp / "hub", tasks=("cola", "rte"))
    with pytest.MonkeyPatch.context() as mp:
        serve(mp, hub)
        download(tmp / "assets", list(FULL_SETUPS), log=lambda line: None)
    return tmp / "assets"


def _setup(scale, name, request, monkeypatch):
    if scale == "full":
        monkeypatch.setenv("IEF_ASSETS", str(request.getfixturevalue("full_assets")))
        for key, value in OFFLINE.items():
            monkeypatch.setenv(key, value)
    cfg = resolve(name, scale, FULL_OVERRIDES.get(name) if scale == "full" else None)
    torch.manual_seed(0)
    data = load_data(cfg)
    model, preprocessor = build_model(cfg, data)
    task = make_task(cfg, model, preprocessor)
    inputs, targets = task.collate([data.train[i] for i in range(4)])
    return cfg, model.eval(), inputs, targets


def _reference(model, inputs, targets) -> float:
    """Hugging Face's ``outputs.loss`` for its models (labels as the companion's targets: T5's label words with
    ``-100``, a classifier's class); the MLPs: cross-entropy in float64, summed over the counted targets over ``K``."""
    with torch.no_grad():
        if isinstance(inputs, dict):
            return float(model(**inputs, labels=targets).loss)
        logits = ief.call_model(model, inputs).double()
        total = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                                  ignore_index=ief.IGNORE_INDEX, reduction="sum")
        return float(total) / ief.count_targets(targets)


def test_the_cases_cover_every_registered_optimiser_and_scale():
    """The setups below register, at each scale, every optimiser any setup of that scale registers, and both loss
    conventions of the exact optimisers are among them."""
    assert set(SETUPS) == set(GRIDS)
    for scale in SETUPS:
        registered = {o for n in (*PAPER_SETUPS, *CPU_SETUPS) if scale in scales_of(n)
                      for o in resolve(n, scale).optimizers}
        tested = {o for n in SETUPS[scale] for o in resolve(n, scale).optimizers}
        assert tested == registered, (scale, registered - tested)
    assert set(OPTIMIZERS) == {o for s in SETUPS for n in SETUPS[s] for o in resolve(n, s).optimizers}
    mean = {o for s in ("smoke", "full") for n in SETUPS[s] for o, c in resolve(n, s).optimizers.items()
            if c.options.get("convention") == "token-mean"}
    assert mean == {"ief", "ef", "sf", "ief-momentum"}


@pytest.mark.parametrize("scale,name", CASES, ids=[f"{s}-{n}" for s, n in CASES])
def test_train_step_reports_the_mean_cross_entropy_per_counted_target_token(scale, name, request, monkeypatch):
    cfg, model, inputs, targets = _setup(scale, name, request, monkeypatch)
    expected = _reference(model, inputs, targets)
    wrong = []
    for optimizer in cfg.optimizers:
        trained = copy.deepcopy(model)
        opt, _ = make_optimizer(trained, cfg.optimizers[optimizer], 10)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # slow-path and attention-batching notices
            loss = train_step(trained, opt, inputs, targets)
        if abs(loss - expected) > 1e-4 * abs(expected):
            wrong.append(f"{optimizer}: {loss!r}")
    assert not wrong, (f"{scale} {name}: train_step's loss is not the mean cross-entropy per counted target token "
                       f"{expected!r} (K = {ief.count_targets(targets)}) for " + ", ".join(wrong))
