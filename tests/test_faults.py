"""Faults in the simulator: a killed worker and a cut link mid-run.

Every request ends in a record (ok or failed, with a reason) - none is lost -
and routers stop using what failed within one scheduling window.
"""

from __future__ import annotations

import numpy as np
import pytest

from testbed.records import flat
from testbed.runner import run_experiment
from testbed.setup import build_setup
from testbed.spec import parse_spec

BASE = {"topology": "small3", "workload": {"model": "switch", "duration_s": 1.2, "warmup_s": 0.1,
                                           "rate_per_s": 30, "calibration_tokens": 64,
                                           "gen_tokens": 0}}  # prompt only: short requests


def _run(faults, router="hetroute"):
    spec = parse_spec({**BASE, "router": {"name": router}, "faults": faults})
    res = run_experiment(spec, None, progress=False)
    tl, rq = res.frames
    n_requests = len(build_setup(spec).requests)
    return spec, tl, rq, n_requests


def test_killed_worker_no_request_lost_and_no_use_after_one_window():
    spec, tl, rq, n = _run([{"kind": "kill_worker", "at_s": 0.5, "server": "mid"}])
    assert len(rq) == n and rq.request.is_unique  # every request accounted for
    assert set(rq.status) <= {"ok", "failed"}
    failed = rq[rq.status == "failed"]
    assert (failed.reason.str.len() > 0).all()
    # requests homed at the dead server that arrive after the fault cannot finish
    assert (rq[(rq.home == 2) & (rq.arrival_s > 0.5)].status == "failed").all()
    # no expert runs on server 2 in layers that start after fault + one window
    late = tl[tl.t_start > 0.5 + spec.window_s + 1e-9]
    assert len(late) > 0
    assert not (flat(late.exec_server) == 2).any()
    # requests away from the dead server keep succeeding after it died
    ok_late = rq[(rq.home != 2) & (rq.arrival_s > 0.6) & (rq.status == "ok")]
    assert len(ok_late) > 0


def test_cut_link_is_avoided_and_nothing_lost():
    spec, tl, rq, n = _run([{"kind": "cut_link", "at_s": 0.4, "server": "edge", "peer": "hub"}])
    assert len(rq) == n
    late = tl[tl.t_start > 0.4 + spec.window_s + 1e-9]
    servers = flat(late.exec_server)
    theta = late.server.to_numpy()[:, None]
    crosses = ((theta == 0) & (servers == 1)) | ((theta == 1) & (servers == 0))
    assert not crosses.any()


def test_unknown_server_in_fault_is_reported():
    with pytest.raises(ValueError, match="unknown server"):
        _run([{"kind": "kill_worker", "at_s": 0.1, "server": "nope"}])


def test_no_fault_means_no_failure():
    _, _, rq, n = _run([])
    assert len(rq) == n and (rq.status == "ok").all()
    assert np.isfinite(rq.latency_s).all()
