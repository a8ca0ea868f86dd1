"""``benchmarks.llama_lora`` (low precision as users train) at its tiny size on a CPU, and the step benchmark's bf16
rows: the GPU benchmarks' own code runs here, times the four steps, and writes a valid record with its table."""
from __future__ import annotations

import json

import pytest
import torch

from benchmarks import harness, llama_lora, step
from benchmarks.workloads import build_mlp


def test_the_llama_lora_benchmark_runs_tiny_and_records_four_steps(tmp_path):
    path = tmp_path / "l.json"
    assert llama_lora.main(["--size", "tiny", "--repeats", "1", "--warmup", "1", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    harness.validate(doc)
    rows = {r["key"]: r for r in doc["results"]["rows"]}
    assert set(rows) == {"adamw", "adamw_bf16", "ief", "ief_bf16"}
    assert rows["ief_bf16"]["reference"] == "adamw_bf16" and rows["ief_bf16"]["ratio"] > 0
    assert all(r["peak_mib"] is not None and r["peak_mib"] > 0 for r in rows.values())
    (table,) = doc["tables"]
    assert [row[0] for row in table["rows"]] == ["AdamW step", "AdamW step (bf16 autocast)", "iEF step",
                                                 "iEF step (bf16 autocast)"]
    assert doc["results"]["trainable_params"] == 2 * 2 * 16 * (32 + 32)  # 2 layers, q and v, r 16, in + out


def test_the_llama_lora_model_steps_under_bf16_autocast_with_its_exact_check():
    """The benchmark's model and batch: iEF's first step under bfloat16 autocast (exact check on) changes only the
    LoRA parameters, by a finite amount."""
    model, inputs, targets = llama_lora.build("tiny", torch.device("cpu"), 0)
    frozen = [p.detach().clone() for p in model.parameters() if not p.requires_grad]
    before = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    with torch.autocast("cpu", torch.bfloat16):
        loss = llama_lora.ief.optim.IEF(model).step(inputs, targets)
    assert torch.isfinite(loss)
    after = [p.detach() for p in model.parameters() if p.requires_grad]
    assert all(torch.isfinite(a).all() for a in after) and any(not torch.equal(a, b) for a, b in zip(after, before))
    assert all(torch.equal(a, b) for a, b in zip(frozen, [p for p in model.parameters() if not p.requires_grad]))


def test_the_step_benchmark_has_bf16_rows_against_adamw_bf16():
    ops, reset, _ = step.make_ops(build_mlp(4, torch.device("cpu"), 0), 0)
    by_key = {op.key: op for op in ops}
    assert by_key["ief_bf16"].reference == "adamw_bf16" and by_key["adamw_bf16"].reference == "adamw"
    for key in ("adamw_bf16", "ief_bf16"):
        reset()
        assert torch.isfinite(by_key[key].fn())
    assert ("ief_bf16", "iEF bf16 / AdamW bf16") in step.RATIO_COLUMNS


@pytest.mark.parametrize("argv", [["--size", "huge"]])
def test_the_llama_lora_benchmark_refuses_an_unknown_size(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        llama_lora.main(argv)
    assert exc.value.code == 2 and "invalid choice: 'huge'" in capsys.readouterr().err
