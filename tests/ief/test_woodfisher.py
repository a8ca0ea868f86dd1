"""ief.woodfisher against a dense float64 oracle: the explicit curvature F (per-sample loops, eqn:FIM summed over
classes), its explicit inverse, and the OBS formulas (saliency, single- and many-weight updates)."""
from __future__ import annotations

import copy
import math
import re
import warnings

import pytest
import torch

import ief.woodfisher as wf
import oracle
from tiny_models import mlp_case, mse_case

DAMPING = 1e-2
BLOCK = 10  # the tiny MLP's weights: 35 -> blocks 10, 10, 10, 5; 28 -> 10, 10, 8


def _weights_index(model) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Indices of the weight matrices (the pruned parameters) in the flat vector of every trainable parameter."""
    index, offset, weights = [], 0, []
    for p in oracle.trainable(model):
        if p.dim() >= 2:
            index.append(torch.arange(offset, offset + p.numel()))
            weights.append(p)
        offset += p.numel()
    return torch.cat(index), weights


def _split(case):
    """Two batches (4 + 2 samples): rows from several batches must be concatenated."""
    return [(case.inputs[:4], case.targets[:4]), (case.inputs[4:], case.targets[4:])]


def oracle_curvature(case, fisher: str, block_size, damping: float, batches) -> torch.Tensor:
    """``lambda I + (1/N) sum_n r_n r_n^T`` over the weights, dense, with only its diagonal blocks kept."""
    index, weights = _weights_index(case.model)
    n = sum(int(t.shape[0]) for _, t in batches)
    if fisher == "ggn":
        full = sum(oracle.fisher(case.model, x, y, case.loss) for x, y in batches)
        f = full[index][:, index] / n
    else:
        rows = []
        g = torch.Generator().manual_seed(7)
        for x, y in batches:
            if fisher == "sf":
                y = _sampled_labels_from(case.model, x, g)
            _, jac, sq = oracle.per_sample(case.model, x, y, case.loss)
            jac = jac.double()[:, index]
            if fisher == "ief":
                jac = jac / sq.double().sqrt().unsqueeze(1)
            rows.append(jac)
        r = torch.cat(rows)
        f = r.T @ r / n
    keep = torch.zeros_like(f, dtype=torch.bool)
    for lo, hi in _oracle_spans(weights, block_size):
        keep[lo:hi, lo:hi] = True
    return torch.where(keep, f, torch.zeros_like(f)) + damping * torch.eye(f.shape[0], dtype=torch.float64)


def _sampled_labels_from(model, inputs, g: torch.Generator) -> torch.Tensor:
    with torch.no_grad():
        probs = torch.softmax(model(inputs).to(torch.float64), dim=-1)
    return torch.multinomial(probs, 1, generator=g).reshape(-1)


def _oracle_spans(weights, block_size):
    total = sum(w.numel() for w in weights)
    if block_size is None:
        return [(0, total)]
    spans, offset = [], 0
    for w in weights:
        for lo in range(0, w.numel(), block_size):
            spans.append((offset + lo, offset + min(lo + block_size, w.numel())))
        offset += w.numel()
    return spans


def _flat_weights(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters() if p.dim() >= 2]).double()


@pytest.mark.parametrize("block_size", [None, BLOCK])
@pytest.mark.parametrize("fisher", wf.FISHERS)
def test_saliency_is_obs_of_the_dense_curvature(fisher, block_size):
    case = mlp_case()
    batches = _split(case)
    f = oracle_curvature(case, fisher, block_size, DAMPING, batches)
    inv = torch.linalg.inv(f)
    w = _flat_weights(case.model)
    expected = w.square() / (2 * inv.diagonal())
    got = wf.obs_saliency(case.model, batches, fisher=fisher, damping=DAMPING, block_size=block_size,
                          generator=torch.Generator().manual_seed(7))
    assert list(got) == ["0.weight", "2.weight"]
    assert got["0.weight"].shape == (7, 5) and got["2.weight"].shape == (4, 7)
    flat = torch.cat([v.reshape(-1) for v in got.values()])
    torch.testing.assert_close(flat, expected, rtol=1e-9, atol=0)


@pytest.mark.parametrize("update", [True, False])
@pytest.mark.parametrize("block_size", [None, BLOCK])
@pytest.mark.parametrize("fisher", wf.FISHERS)
def test_prune_applies_the_summed_obs_updates(fisher, block_size, update):
    case = mlp_case()
    batches = _split(case)
    f = oracle_curvature(case, fisher, block_size, DAMPING, batches)
    inv = torch.linalg.inv(f)  # block-diagonal, as f
    w = _flat_weights(case.model)
    rho = w.square() / (2 * inv.diagonal())
    k = round(0.6 * w.numel())
    removed = torch.zeros(w.numel(), dtype=torch.bool)
    removed[torch.argsort(rho)[:k]] = True
    c = torch.where(removed, w / inv.diagonal(), torch.zeros_like(w))
    expected = w - inv @ c if update else w.clone()
    expected[removed] = 0.0
    biases = [p.detach().clone() for p in case.model.parameters() if p.dim() < 2]

    model, masks = wf.prune(case.model, batches, 0.6, fisher=fisher, damping=DAMPING, block_size=block_size,
                            update=update, generator=torch.Generator().manual_seed(7))
    assert model is case.model
    torch.testing.assert_close(_flat_weights(model), expected, rtol=1e-9, atol=1e-12)
    kept = torch.cat([m.reshape(-1) for m in masks.values()])
    assert torch.equal(kept, ~removed)
    assert int((~kept).sum()) == k
    for before, p in zip(biases, [p for p in model.parameters() if p.dim() < 2]):
        assert torch.equal(before, p.detach())  # biases are not pruned


@pytest.mark.parametrize("fisher", wf.FISHERS)
def test_one_weight_is_exactly_obs(fisher):
    """Removing one weight: dw = -w_q F^{-1} e_q / [F^{-1}]_qq, and the quadratic loss increase 1/2 dw^T F dw
    equals its saliency (OBS's own identity)."""
    case = mlp_case()
    batches = _split(case)
    f = oracle_curvature(case, fisher, None, DAMPING, batches)
    inv = torch.linalg.inv(f)
    w = _flat_weights(case.model)
    rho = w.square() / (2 * inv.diagonal())
    q = int(torch.argmin(rho))
    dw = -w[q] * inv[:, q] / inv[q, q]
    assert float(0.5 * dw @ f @ dw) == pytest.approx(float(rho[q]), rel=1e-9)
    wf.prune(case.model, batches, 1 / w.numel(), fisher=fisher, damping=DAMPING,
             generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(_flat_weights(case.model), w + dw, rtol=1e-9, atol=1e-12)
    assert float(_flat_weights(case.model)[q]) == 0.0


def test_curvature_reused_across_dampings_and_small_damping():
    """One curvature serves any damping; at lambda = 1e-8 (F nearly singular: N = 6 rows, 63 weights) the Woodbury
    diagonal still matches the explicit inverse (its part outside the rows' span is 1/lambda)."""
    case = mlp_case()
    batches = _split(case)
    curvature = wf.obs_curvature(case.model, batches, fisher="ief", block_size=BLOCK)
    for damping in (1e-8, 1e-4, 1.0, 100.0):
        inv = torch.linalg.inv(oracle_curvature(case, "ief", BLOCK, damping, batches))
        torch.testing.assert_close(curvature.inverse_diagonal(damping), inv.diagonal(), rtol=1e-7, atol=0)
    assert curvature.samples == 6 and curvature.spans[:4] == [(0, 10), (10, 20), (20, 30), (30, 35)]
    undamped = oracle_curvature(case, "ief", BLOCK, 0.0, batches)
    assert curvature.trace() == pytest.approx(float(undamped.trace()), rel=1e-12)
    ggn = wf.obs_curvature(case.model, batches, fisher="ggn", block_size=BLOCK)
    assert ggn.trace() == pytest.approx(float(oracle_curvature(case, "ggn", BLOCK, 0.0, batches).trace()), rel=1e-12)


def test_ief_and_ef_with_the_squared_error():
    case = mse_case(m=6)
    batches = _split(case)
    for fisher in ("ef", "ief"):
        f = oracle_curvature(case, fisher, None, DAMPING, batches)
        w = _flat_weights(case.model)
        expected = w.square() / (2 * torch.linalg.inv(f).diagonal())
        got = wf.obs_saliency(case.model, batches, fisher=fisher, damping=DAMPING, loss="mse")
        torch.testing.assert_close(torch.cat([v.reshape(-1) for v in got.values()]), expected, rtol=1e-9, atol=0)


def test_magnitude_pruning():
    case = mlp_case()
    w = _flat_weights(case.model)
    k = round(0.5 * w.numel())
    expected = w.clone()
    expected[torch.argsort(w.abs())[:k]] = 0.0
    _, masks = wf.prune(case.model, None, 0.5, fisher="magnitude")
    assert torch.equal(_flat_weights(case.model), expected)
    assert int(sum((~m).sum() for m in masks.values())) == k
    sal = wf.obs_saliency(case.model, None, fisher="magnitude")
    assert torch.equal(torch.cat([v.reshape(-1) for v in sal.values()]), expected.square())


def test_float32_model_matches_float64():
    case64 = mlp_case()
    model32 = copy.deepcopy(case64.model).float()
    b64 = _split(case64)
    b32 = [(x.float(), y) for x, y in b64]
    s64 = wf.obs_saliency(case64.model, b64, fisher="ief", damping=DAMPING, block_size=BLOCK)
    s32 = wf.obs_saliency(model32, b32, fisher="ief", damping=DAMPING, block_size=BLOCK)
    for name in s64:
        torch.testing.assert_close(s32[name], s64[name], rtol=1e-4, atol=1e-9)


def test_params_selects_what_is_pruned():
    case = mlp_case()
    last = case.model[2].weight
    sal = wf.obs_saliency(case.model, _split(case), fisher="ef", damping=DAMPING, params=[last])
    assert list(sal) == ["2.weight"]
    first = case.model[0].weight.detach().clone()
    wf.prune(case.model, _split(case), 0.5, fisher="ef", damping=DAMPING, params=[last])
    assert torch.equal(first, case.model[0].weight.detach())
    assert int((case.model[2].weight == 0).sum()) == 14


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(fisher="kfac", damping=1.0), r"unknown fisher 'kfac'; accepted: 'magnitude', 'ef', 'ief', 'sf', 'ggn'"),
        (dict(fisher="ief"), r"needs a damping"),
        (dict(fisher="ief", damping=0.0), r"damping must be a finite number > 0"),
        (dict(fisher="ef", damping=-1.0), r"damping must be a finite number > 0"),
        (dict(fisher="ief", damping=1.0, block_size=0), r"block_size must be None .* or an integer >= 1"),
        (dict(fisher="ief", damping=1.0, block_size=2.5), r"block_size must be None"),
    ],
)
def test_bad_arguments(kwargs, match):
    case = mlp_case()
    with pytest.raises(ValueError, match=match):
        wf.obs_saliency(case.model, _split(case), **kwargs)
    with pytest.raises(ValueError, match=match):
        wf.prune(case.model, _split(case), 0.5, **kwargs)


def test_bad_sparsity_batches_and_ggn_limits(monkeypatch):
    case = mlp_case()
    for bad in (1.5, -0.1, "half"):
        with pytest.raises(ValueError, match=r"sparsity must be a number in \[0, 1\]"):
            wf.prune(case.model, _split(case), bad, fisher="ief", damping=1.0)
    with pytest.raises(ValueError, match=r"batches must hold at least one"):
        wf.prune(case.model, [], 0.5, fisher="ief", damping=1.0)
    with pytest.raises(ValueError, match=r"batches\[0\] is a tensor of shape \[6, 5\] \(for one batch \(x, y\)"):
        wf.prune(case.model, [case.inputs], 0.5, fisher="ief", damping=1.0)
    mse = mse_case(m=6)
    with pytest.raises(ValueError, match=r"loss='mse'; accepted: 'cross_entropy'"):
        wf.obs_saliency(mse.model, _split(mse), fisher="ggn", damping=1.0, loss="mse")
    monkeypatch.setattr(wf, "GGN_MAX_BLOCK", 20)
    with pytest.raises(ValueError, match=r"widest here has 63 entries, over the limit GGN_MAX_BLOCK=20"):
        wf.obs_saliency(case.model, _split(case), fisher="ggn", damping=1.0)
    wf.obs_saliency(case.model, _split(case), fisher="ggn", damping=1.0, block_size=20)  # within the limit
    with pytest.raises(ValueError, match=r"not a parameter of the model"):
        wf.obs_saliency(case.model, _split(case), fisher="ef", damping=1.0,
                        params=[torch.nn.Parameter(torch.zeros(2, 2))])


@pytest.mark.parametrize("fisher", ["ef", "ief", "sf"])
def test_rows_spanning_the_block_at_tiny_damping(fisher):
    """N = 6 rows over blocks of 4 weights: the rows span each block, so the part of e_q outside their span is 0 and
    must not come out as rounding divided by lambda (through the N x N Gram's small eigenpairs it came out ~1e-12,
    70 % of [F^{-1}]_qq at lambda = 1e-8 on the cpu digits-mlp)."""
    case = mlp_case()
    batches = _split(case)
    curvature = wf.obs_curvature(case.model, batches, fisher=fisher, block_size=4,
                                 generator=torch.Generator().manual_seed(7))
    for damping in (1e-8, 1e-12):
        inv = torch.linalg.inv(oracle_curvature(case, fisher, 4, damping, batches))
        torch.testing.assert_close(curvature.inverse_diagonal(damping), inv.diagonal(), rtol=1e-6, atol=0)


def _brute_validation_loss(model, batches) -> float:
    """Mean per-sample cross-entropy, an explicit loop over samples (the oracle of ``validation_loss``)."""
    total, n = 0.0, 0
    with torch.no_grad():
        for x, y in batches:
            for i in range(x.shape[0]):
                total += float(torch.nn.functional.cross_entropy(model(x[i:i + 1]).double(), y[i:i + 1],
                                                                 reduction="sum"))
                n += 1
    return total / n


@pytest.mark.parametrize("fisher", ["ief", "ef"])
def test_prune_searched_keeps_the_damping_with_the_lowest_held_out_loss(fisher):
    """Every candidate pruned from the same weights (brute force: a fresh copy and ``prune`` each), the held-out loss
    of each equal to the search's, and the model left as ``prune`` at the lowest one leaves it."""
    case = mlp_case()
    held_out = [(case.inputs[:3] * 0.5 + 0.1, case.targets[:3].flip(0))]
    dampings = (1e-6, 1e-2, 1.0, 1e2)
    expected = {}
    for d in dampings:
        copy_ = copy.deepcopy(case.model)
        wf.prune(copy_, _split(case), 0.6, fisher=fisher, damping=d, block_size=BLOCK)
        expected[d] = _brute_validation_loss(copy_, held_out)
    model = copy.deepcopy(case.model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a choice at the grid's edge is said (the next test)
        _, masks, best, losses = wf.prune_searched(model, _split(case), 0.6, fisher=fisher, validation=held_out,
                                                   dampings=dampings, block_size=BLOCK)
    assert set(losses) == set(dampings)
    for d in dampings:
        assert losses[d] == pytest.approx(expected[d], rel=1e-10)
    assert best == min(dampings, key=lambda d: (expected[d], d))
    reference = copy.deepcopy(case.model)
    _, ref_masks = wf.prune(reference, _split(case), 0.6, fisher=fisher, damping=best, block_size=BLOCK)
    assert all(torch.equal(masks[k], ref_masks[k]) for k in masks)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
    assert len(set(expected.values())) > 1, "the candidates must differ for the choice to mean anything"


def test_prune_searched_says_when_its_choice_is_at_the_grid_edge(monkeypatch):
    """The lowest validation loss at the smallest or the largest candidate is said, with the damping to extend to;
    a choice inside the grid is not. (The validation losses are set here: the rule, not a model, is tested.)"""
    case = mlp_case()
    for table, said in [({1e-4: 2.0, 1e-2: 1.0, 1.0: 3.0}, None),
                        ({1e-4: 1.0, 1e-2: 2.0, 1.0: 3.0}, r"chose damping=0\.0001, the smallest .* reaching 1e-06"),
                        ({1e-4: 3.0, 1e-2: 2.0, 1.0: 1.0}, r"chose damping=1, the largest .* reaching 100"),
                        ({1e-4: 1.0, 1e-2: 1.0, 1.0: 1.0},
                         r"the smallest .* equal at its neighbour: the loss is flat")]:
        order = iter(sorted(table))
        monkeypatch.setattr(wf, "validation_loss", lambda *a, **k: table[next(order)])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            wf.prune_searched(copy.deepcopy(case.model), _split(case), 0.5, fisher="ief", validation=_split(case),
                              dampings=tuple(table), block_size=BLOCK)
        messages = [str(w.message) for w in caught if "prune_searched chose" in str(w.message)]
        if said is None:
            assert messages == []
        else:
            assert len(messages) == 1 and re.search(said, messages[0]), messages


def test_prune_searched_refuses_what_has_no_damping_to_choose():
    case = mlp_case()
    with pytest.raises(ValueError, match=r"unknown fisher 'magnitude'; accepted: 'ef', 'ief', 'sf', 'ggn'"):
        wf.prune_searched(case.model, _split(case), 0.5, fisher="magnitude", validation=_split(case))
    with pytest.raises(ValueError, match=r"at least one candidate"):
        wf.prune_searched(case.model, _split(case), 0.5, fisher="ief", validation=_split(case), dampings=())
    with pytest.raises(ValueError, match=r"damping must be a finite number > 0"):
        wf.prune_searched(case.model, _split(case), 0.5, fisher="ief", validation=_split(case), dampings=(1.0, 0.0))
    with pytest.raises(ValueError, match=r"batches must hold at least one"):
        wf.prune_searched(case.model, _split(case), 0.5, fisher="ief", validation=[])
    with pytest.raises(ValueError, match=r"prune_searched"):
        wf.prune(case.model, _split(case), 0.5, fisher="ief")


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_woodfisher_refuses_a_non_finite_input_with_the_optimisers_message(bad):
    """Every curvature, the pruning and the validation loss: a NaN input (NaN losses) is refused naming its sample;
    an inf behind a ``tanh`` leaves the loss finite (a value, returned) and the rows NaN (refused)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    x[1, 2] = bad
    batches = [(x, torch.tensor([0, 1, 2, 0, 1]))]
    said = r"for samples \[1\] \(of 5\): a NaN or inf in those samples' inputs, logits or targets|logits hold nan at " \
           r"index \(1, 0\)"
    for fisher in wf.FISHERS:
        with pytest.raises(FloatingPointError, match=said):
            wf.obs_curvature(model, batches, fisher=fisher)
    with pytest.raises(FloatingPointError, match=said):
        wf.prune(copy.deepcopy(model), batches, 0.5, fisher="ief", damping=1e-3)
    if math.isnan(bad):
        with pytest.raises(FloatingPointError, match=r"batch 0: non-finite loss for samples \[1\] \(of 5\)"):
            wf.validation_loss(model, batches)
    else:
        assert torch.isfinite(torch.tensor(wf.validation_loss(model, batches)))
