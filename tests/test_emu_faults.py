"""A cut link on the emulator fails fast, as in the simulator (issue 14, item 3).

small3 with the edge-hub link cut mid-run: a cut link drops frames without an
error, so the workers find it by silence (two windows) and resolve at once what
the lost peer never acknowledged (retry from where the hidden state is, or fail
with a reason). Every request must end within a few windows of the cut, none
may be left to the runner's drain cap, and the requests that fail must be the
simulator's for the same spec. Needs root and Mininet (skipped otherwise).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_emu import _clean_machine, _why_not  # noqa: F401 - the fixture is used by name

pytestmark = [pytest.mark.emu, pytest.mark.skipif(_why_not() is not None, reason=str(_why_not()))]

CUT_S = 0.2
#: detection (<= 3 windows: silence of 2 counted at window ticks) + two re-routes
#: and the remaining layers at emulated speed; 10 windows of 20 ms
BOUND_WINDOWS = 10
SPEC = {"topology": "small3",
        "workload": {"model": "switch", "duration_s": 0.8, "warmup_s": 0.1, "rate_per_s": 20,
                     "calibration_tokens": 64},
        "faults": [{"kind": "cut_link", "at_s": CUT_S, "server": "edge", "peer": "hub"}]}


def _records(spec_dict: dict, out: Path):
    from testbed.records import read_records
    from testbed.runner import run_experiment
    from testbed.spec import parse_spec
    spec = parse_spec(spec_dict)
    res = run_experiment(spec, out, progress=False)
    return spec, res, read_records(out)[1]


def test_cut_link_ends_every_request_within_a_few_windows(tmp_path: Path) -> None:
    _, _, sim = _records({**SPEC, "backend": "sim"}, tmp_path / "sim")
    # a short drain cap: the test must not pass by waiting it out
    spec, res, rq = _records({**SPEC, "backend": "emu", "emu": {"dilation": "auto", "max_drain_s": 1.0}},
                             tmp_path / "emu")
    assert len(rq) == len(sim) and rq.request.is_unique
    assert set(rq.status) <= {"ok", "failed"}
    failed = rq[rq.status == "failed"]
    assert (failed.reason.str.len() > 0).all()
    st = res.info["stats"]
    assert st["requests_unrecorded"] == 0 and not st["timed_out"], failed.reason.tolist()
    assert not failed.reason.str.contains("no record|timeout").any(), failed.reason.tolist()
    # every request ends within BOUND_WINDOWS of the cut or of its arrival, whichever is later
    end = rq.arrival_s + rq.latency_s
    start = rq.arrival_s.clip(lower=CUT_S)
    late = rq[(end > CUT_S) & (end - start > BOUND_WINDOWS * spec.window_s)]
    assert late.empty, late[["request", "home", "arrival_s", "latency_s", "status", "reason"]]
    # the same requests fail as in the simulator, for the same reason: edge cannot reach
    # the only full-precision replica of an expert its requests need
    sim_failed = dict(zip(sim[sim.status == "failed"].request, sim[sim.status == "failed"].reason))
    assert sim_failed, "the spec must make the simulator fail some request"
    assert dict(zip(failed.request, failed.reason)) == sim_failed
    workers = json.loads((tmp_path / "emu" / "fidelity.json").read_text())["detail"]["workers"]
    assert sum(w["resolved_unacked"] for w in workers) > 0  # the lost frames were resolved
