"""``python -m benchmarks slow_paths`` (the slow paths' table): every case builds and runs, its two forms of ``J``
agree, the table carries each case's own numbers, and the T5 case (the relative attention biases) takes no loop."""
from __future__ import annotations

import warnings

import pytest
import torch

import ief
from benchmarks import slow_paths


@pytest.mark.parametrize("case", list(slow_paths.CASES))
def test_every_case_builds_and_its_forms_agree(case):
    kind, m = slow_paths.CASES[case]
    model, x, y = slow_paths.build(kind, 3, 6, 0)
    assert any(p.requires_grad for p in model.parameters())
    cases = slow_paths.methods(model, x, y, None)
    assert list(cases) == ["backward", "ief_auto", "ief_dense"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        grads = cases["backward"]()
        dense = slow_paths._dense(cases["ief_dense"]())
        auto = slow_paths._dense(cases["ief_auto"]())
    assert dense.shape[0] == 3 and torch.allclose(auto, dense, rtol=1e-4, atol=1e-6 * float(dense.abs().max()))
    batch = torch.cat([g.reshape(-1) for g in grads])
    assert torch.allclose(dense.sum(0), batch, rtol=1e-3, atol=1e-5 * float(batch.abs().max()))


def test_the_t5_case_takes_no_loop():
    model, x, y = slow_paths.build("t5", 3, 6, 0)
    assert slow_paths.looped(lambda: ief.per_sample(model, x, y, form="auto")) == []


def test_the_table_has_each_cases_own_numbers():
    def result(case, base, loops_before):
        keys = ("backward", "ief_before", "ief_auto", "ief_dense")
        rows = [dict(key=k, ratio=None if k == "backward" else base + i, median_ms=10.0 * (i + 1))
                for i, k in enumerate(keys)]
        names = [f"encoder.block.{i}.relative_attention_bias.weight" for i in range(loops_before)]
        return dict(case=case, batch=16, tensors=47, loops=dict(ief_before=names, ief=[]), rows=rows)

    (table,) = slow_paths.tables([result("t5", 1.0, 4), result("llama", 2.0, 0)], 32, "abc1234")
    assert [c["header"] for c in table["columns"]][:4] == ["case", "M", "looped before", "looped now"]
    assert table["rows"][0] == ["t5", 16, "4 of 47 (relative_attention_bias)", "0 of 47", 10.0, 2.0, 3.0, 4.0, "x4.0"]
    assert table["rows"][1][1:] == [16, "0 of 47", "0 of 47", 10.0, 3.0, 4.0, 5.0, "x5.1"]
    assert "abc1234" in table["note"] and "T = 32" in table["title"]


def test_looped_tensors_are_shown_by_kind():
    names = ["base_model.model.bert.encoder.layer.0.attention.self.query.lora_A.default.weight",
             "base_model.model.bert.encoder.layer.1.attention.self.query.lora_A.default.weight",
             "base_model.model.bert.encoder.layer.0.attention.self.query.lora_magnitude_vector.default.weight",
             "prompt_encoder.default.mlp_head.0.bias", "ia3_l"]
    res = dict(tensors=9, loops=dict(ief=names, ief_before=[]))
    assert slow_paths._looped(res, "ief") == "5 of 9 (lora_A, lora_magnitude_vector, mlp_head, ia3_l)"
    assert slow_paths._looped(res, "ief_before") == "0 of 9"
    assert slow_paths._looped(dict(tensors=9, loops={}), "ief_before") is None
