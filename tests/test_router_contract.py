"""The router contract is honest: a router cannot misreport the quality it spends.

A test router that claims dq = 0 whenever it executes a quantised (or substitute)
replica runs exactly as the honest router (its decisions are HetRoute's): the backend
derives every layer's increment from the quality model, so the records, each request's
accumulated quality and the budget metrics are the honest run's, and the conformance
checker names the broken rule.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd

from hetroute.routers import get_router
from hetroute.system import FULL_PRECISION
from testbed.conformance import check_router, run_sim, spec_for
from testbed.setup import build_setup

CASE = ("paper10", "mixtral-8x7b")  # HetRoute places INT8/INT4 replicas there


class HidesQuantisation(get_router("hetroute")):
    """HetRoute's decisions, but dq = 0 reported for any layer that runs a quantised or
    substitute replica (the misreport the budget must not trust)."""

    def route(self, tok, targets, view):
        a = super().route(tok, targets, view)
        reps = self.deployment.replicas
        lossy = any(reps[r].precision != FULL_PRECISION or reps[r].expert != t
                    for t, r in zip(a.targets, a.replicas))
        return dataclasses.replace(a, dq=0.0) if lossy else a


def test_a_router_reporting_dq_zero_for_quantised_replicas_cannot_escape_the_budget():
    honest = build_setup(spec_for("hetroute", *CASE))
    lying = build_setup(spec_for(f"{__name__}:HidesQuantisation", *CASE))
    tl_h, rq_h, st_h = run_sim(honest)
    tl_l, rq_l, st_l = run_sim(lying)
    assert (tl_h.dq > 0).any(), "the honest run executed nothing lossy: the test proves nothing"
    # the recorded quality follows the quality model: per layer, and per request (budget)
    np.testing.assert_array_equal(tl_l.dq.to_numpy(), tl_h.dq.to_numpy())
    pd.testing.assert_frame_equal(rq_l, rq_h)
    q, dep = lying.quality, lying.deployment
    derived = [sum(q.increment(int(t), dep.replicas[int(r)].expert, int(dep.replicas[int(r)].precision))
                   for t, r in zip(ts, rs)) for ts, rs in zip(tl_l.target, tl_l.replica)]
    np.testing.assert_allclose(tl_l.dq.to_numpy(), derived, rtol=1e-12, atol=0)
    assert bool((rq_l.lam_max <= honest.problem.lam_max + 1e-12).all())
    # the backend counted every misreported layer, and none of the honest router's
    lossy = int((tl_l.dq > 0).sum())
    assert st_h.dq_misreported == 0
    assert st_l.dq_misreported == lossy > 0


def test_the_checker_names_the_quality_rule():
    report = check_router(f"{__name__}:HidesQuantisation", topologies=(CASE[0],), models=(CASE[1],))
    assert not report.ok
    assert [f.check for f in report.failures] == ["quality"]
    assert "dq" in report.failures[0].message and "quality model" in report.failures[0].message
    assert "quality" in report.format()
    honest = check_router("hetroute", topologies=(CASE[0],), models=(CASE[1],))
    assert honest.ok, honest.format()
