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
from hetroute.routing.algorithm2 import SetLevelRouter
from hetroute.system import FULL_PRECISION
from testbed.conformance import check_router, run_sim, spec_for
from testbed.records import RecordWriter
from testbed.setup import build_setup
from testbed.sim.backend import SimBackend

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


# -- feedback from records keeps the backend-driven window semantics -----------------------
class TickFed(get_router("hetroute")):
    """HetRoute fed as before the contract change: the backend sums each decider's realized
    costs and applies them at every window tick (``TickBackend``)."""

    def route(self, tok, targets, view):
        return self.engine.route(tok, targets, view)  # no window bookkeeping of its own

    def on_layer_done(self, record):
        super().on_layer_done(record._replace(window=self._fb_window))  # only accumulate


class TickBackend(SimBackend):
    def _window(self, arg) -> None:
        super()._window(arg)
        for d in {id(x): x for x in self.deciders}.values():
            d._close_feedback_window(d._fb_window)  # at the tick, as the backend used to


def test_feedback_from_records_decides_as_feedback_at_window_ticks(monkeypatch):
    updates = []
    set_weights = SetLevelRouter.set_weights
    monkeypatch.setattr(SetLevelRouter, "set_weights",
                        lambda self, w: (updates.append(w), set_weights(self, w))[1])
    runs = []
    for name, backend in (("hetroute", SimBackend), (f"{__name__}:TickFed", TickBackend)):
        s = build_setup(spec_for(name, "small3", "mixtral-8x7b", duration_s=1.0, rate_per_s=40))
        writer = RecordWriter(None, s.shape.top_k)
        backend(s, writer).run()
        writer.close()
        runs.append((writer.frames(), len(updates)))
        updates.clear()
    (new, n_new), (old, n_old) = runs
    assert n_new > 0, "the feedback never re-priced: the test proves nothing"
    pd.testing.assert_frame_equal(new[0], old[0])
    pd.testing.assert_frame_equal(new[1], old[1])
    # a window is applied when the decider next decides or records, so the last window of
    # each decider (3 servers), which no decision follows, may stay unapplied
    assert 0 <= n_old - n_new <= 3
