"""GPU-minute prices of more seeds (companion.experiments.gpu_price) from the committed H200 benchmark records, beside
the core-minutes, in what an undecided verdict says would decide it."""
from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from companion.experiments import gpu_price
from companion.experiments import verdicts as V
from companion.experiments.verdicts.core import SeedPrice, _price


def test_the_bounds_are_the_records_rows():
    """A MiniLM update is priced at the H200 record's T5-base LoRA step (iEF's exact step for the exact kinds,
    AdamW's for the others); the digits MLP at the paper MLP's; a family without a record has no price."""
    record = json.loads((gpu_price.RECORDS / "step-h200.json").read_text())
    rows = {r["key"]: r["median_ms"] for m in record["results"]["models"] if m["model"] == "t5-lora" for r in m["rows"]}
    assert gpu_price.update_ms("bert", "ief") == rows["ief"] and gpu_price.update_ms("bert", "sf") == rows["ief"]
    assert gpu_price.update_ms("bert", "adamw") == gpu_price.update_ms("bert", "sgd") == rows["adamw"]
    mlp = {r["key"]: r["median_ms"] for r in json.loads((gpu_price.RECORDS / "paper_mlp-h200.json").read_text())
           ["results"]["rows"]}
    assert gpu_price.update_ms("mlp", "kfac") == mlp["ief-auto"] and gpu_price.update_ms("mlp", "adam") == mlp["adam"]
    assert gpu_price.update_ms("vit", "ief") is None and gpu_price.seed_gpu_minutes("vit", {"ief": 64}) is None
    want = (64 * rows["ief"] + 64 * rows["adamw"]) / 60_000
    assert gpu_price.seed_gpu_minutes("bert", {"ief": 64, "adamw": 64}) == pytest.approx(want)
    assert gpu_price.update_ms("bert", "ief", records=gpu_price.RECORDS / "absent") is None


def test_price_words():
    assert _price(3, 2.0) == ", about 6 core-minutes more"
    assert _price(3, SeedPrice(2.0, 0.01)) == ", about 6 core-minutes more (≤ 0.03 H200 GPU-minutes)"
    assert _price(3, SeedPrice(None, 0.01)) == ", ≤ 0.03 H200 GPU-minutes more"
    assert _price(0, SeedPrice(2.0, 0.01)) == _price(3, None) == _price(3, SeedPrice(None)) == ""


def test_an_undecided_pair_of_a_registered_setup_says_both_prices():
    table = pd.DataFrame([{"scale": "cpu", "setup": "tweets-minilm-lora", "optimizer": o, "seed": k, "steps": 64,
                           "final_train_loss": v * f[k], "test_score": math.nan, "wall_time_s": 60.0}
                          for o, v, f in (("ief", 0.1, (1.0, 1.3, 0.9)), ("sgd", 0.105, (1.2, 1.0, 1.1)))
                          for k in range(3)])
    (v,) = V.RULES["e2_ief_lowest"].evaluate(table, None, {"tweets-minilm-lora": ["sgd", "ief"]})
    assert v.verdict == V.INCONCLUSIVE
    seeds = int(v.needs.split()[1])
    gpu = gpu_price.seed_gpu_minutes("bert", {"ief": 64, "sgd": 64}) * (seeds - 3)
    assert f"about {2 * (seeds - 3)} core-minutes more (≤ {gpu:.2g} H200 GPU-minutes)" in v.needs
