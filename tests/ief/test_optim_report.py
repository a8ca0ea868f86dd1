"""The step's certificate (ief.optim.report): the method and each parameter's route, read from what the step ran."""
from __future__ import annotations

import warnings

import torch

import ief


class _Mixed(torch.nn.Module):
    """A table (its used rows), a linear layer (factored with form="ghost", its bias dense) and a bare scale used
    through exp (no hook: the per-sample loop)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.table = torch.nn.Embedding(10, 4).double()
        self.linear = torch.nn.Linear(4, 3).double()
        self.scale = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))

    def forward(self, tokens):
        return self.linear(self.table(tokens)) * self.scale.exp()


def test_the_report_names_the_method_and_every_parameters_route():
    tokens = torch.tensor([[1, 2, 3], [2, 5, 5]])
    targets = torch.tensor([[0, 1, -100], [2, 2, 1]])
    for cls, method in ((ief.optim.IEF, "iEF"), (ief.optim.EF, "EF"), (ief.optim.SF, "SF")):
        opt = cls(_Mixed(), form="ghost")
        assert opt.last_step_report is None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ief.SlowPathWarning)
            opt.step(tokens, targets)
            opt.step(tokens, targets)
        report = opt.last_step_report
        assert (report.step, report.method, report.rows, report.ranks, report.across_processes, report.sharding) \
            == (1, method, 2, 1, False, None)
        assert report.routes == {"table.weight": "used rows", "linear.weight": "factored", "linear.bias": "dense",
                                 "scale": "looped"}, report.routes
        assert report.summary() == (f"step 1: {method} over 2 rows on 1 process (1 dense, 1 factored, 1 looped, "
                                    f"1 used rows)")


def test_dense_rows_and_kfac_are_reported_as_what_they_are():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).double()
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0, 1])
    opt = ief.optim.IEF(model, form="dense")
    opt.step(x, y)
    assert set(opt.last_step_report.routes.values()) == {"dense"}
    kfac = ief.optim.KFAC(model, "kfac", lr=0.1, damping=1e-2)
    kfac.step(x, y)
    assert kfac.last_step_report.summary() == "step 0: KFAC on 1 process (no per-sample rows recorded)"
