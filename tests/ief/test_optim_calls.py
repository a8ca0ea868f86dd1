"""First-contact mistakes get a sentence naming the cause and the fix (:mod:`ief.optim.calls`, the damping's check).

``opt.step(**batch)`` and a batch dict still holding ``labels`` name the call that works; ``damping`` given as a
string or a bool is refused as ``kl_clip`` is (not read as ``0.001`` or ``1.0``), at construction and when written
into ``param_groups``.
"""
from __future__ import annotations

import pytest
import torch

import ief
from tiny_models import mlp_case

OPTIMIZERS = [ief.optim.IEF, ief.optim.EF, ief.optim.SF, lambda m, **k: ief.optim.KFAC(m, "ekfac", **k)]


@pytest.mark.parametrize("make", OPTIMIZERS)
def test_a_batch_spread_as_keywords_names_the_call_that_works(make):
    opt = make(mlp_case().model)
    with pytest.raises(TypeError) as err:
        opt.step(input_ids=torch.zeros(2, 3, dtype=torch.long), labels=torch.zeros(2, dtype=torch.long))
    said = str(err.value)
    assert ".step takes the batch as two arguments, opt.step(inputs, targets)" in said
    assert "'input_ids', 'labels'" in said and "ief.causal_lm_targets(labels)" in said
    assert opt.steps_taken == 0


def test_a_batch_still_holding_labels_is_named():
    opt = ief.optim.IEF(mlp_case().model)
    with pytest.raises(TypeError, match=r"one batch dict that still holds 'labels' and no targets.*batch.pop"):
        opt.step({"input_ids": torch.zeros(2, 3, dtype=torch.long), "labels": torch.zeros(2, dtype=torch.long)})
    with pytest.raises(TypeError, match="needs the batch"):  # no batch at all: the how-to-step sentence
        opt.step()


def test_the_right_calls_still_step():
    case = mlp_case()
    opt = ief.optim.IEF(case.model)
    opt.step(case.inputs, case.targets)
    opt.step(inputs=case.inputs, targets=case.targets)
    assert opt.steps_taken == 2


@pytest.mark.parametrize("make", OPTIMIZERS)
@pytest.mark.parametrize("bad, shown", [("1e-3", r"got '1e-3' of type str \(parse it first: damping=0.001\)"),
                                        (True, "got True of type bool"), ("small", "got 'small' of type str$"),
                                        (torch.tensor(1e-3), r"got tensor\(0.0010\) of type Tensor")])
def test_damping_must_be_a_number_not_a_string_or_a_bool(make, bad, shown):
    with pytest.raises(ValueError, match=r"damping must be a finite number >= 0 \(a float such as 1e-4\), " + shown
                       if make is not ief.optim.SF else "damping must be a finite number > 0.*" + shown):
        make(mlp_case().model, damping=bad)


def test_a_string_damping_written_into_param_groups_is_refused_before_the_step():
    case = mlp_case()
    opt = ief.optim.IEF(case.model)
    opt.param_groups[0]["damping"] = "1e-3"
    before = [p.detach().clone() for p in case.model.parameters()]
    with pytest.raises(ValueError, match=r"^step 0: param_groups\[0\]: damping must be .* got '1e-3'"):
        opt.step(case.inputs, case.targets)
    assert all(torch.equal(a, b) for a, b in zip(before, case.model.parameters()))


def test_numpy_and_integer_dampings_are_still_taken():
    np = pytest.importorskip("numpy")
    for value in (np.float64(1e-3), np.float32(1e-3), 1):
        ief.optim.IEF(mlp_case().model, damping=value)
