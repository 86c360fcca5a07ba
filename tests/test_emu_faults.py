"""A cut link on the emulator fails fast, as in the simulator (issue 14, item 3).

small3 with the edge-hub link cut mid-run: a cut link drops frames without an
error, so the workers find it by silence (three windows) and resolve at once what
the lost peer never acknowledged (retry from where the hidden state is, or fail
with a reason). Every request must end within a few windows of the cut, none
may be left to the runner's drain cap, and the requests that fail must be the
simulator's for the same spec. Needs root and Mininet (skipped otherwise).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from testbed.emu.node.peers import SILENT_WINDOWS
from tests.test_emu import _clean_machine, _why_not  # noqa: F401 - the fixture is used by name

pytestmark = [pytest.mark.emu, pytest.mark.skipif(_why_not() is not None, reason=str(_why_not()))]

CUT_S = 0.2
#: a failed request ends within this many windows of the cut (or of its arrival, if
#: later): detection (silence of SILENT_WINDOWS = 3, seen at a window tick, so <= 4) then
#: the retries and the FAIL's way home; measured 8.8 windows on a saturated 2-core host
#: when detection took two windows
FAIL_WINDOWS = 11
#: any request: the ok ones finish their remaining layers at the emulator's pace, which
#: on a saturated host is several times the simulator's (11 windows measured)
END_WINDOWS = 20
SPEC = {"topology": "small3",
        "workload": {"model": "switch", "duration_s": 0.8, "warmup_s": 0.1, "rate_per_s": 20,
                     "calibration_tokens": 64, "gen_tokens": 0},  # prompt only: T and run time
        "faults": [{"kind": "cut_link", "at_s": CUT_S, "server": "edge", "peer": "hub"}],
        # per-token attention: the emulated workers do not recover a lost holder's K/V
        "engine": {"attention": "independent"}}


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
    # every request ends within a few windows of the cut or of its arrival, whichever is
    # later. A token whose home became unreachable fails at its last hop, when its layers
    # are done (the simulator's rule too), so it ends at the emulator's pace like the ok
    # ones (END_WINDOWS); a failure found by detection (a lost peer with tokens in
    # flight, no route) must come within FAIL_WINDOWS
    end = rq.arrival_s + rq.latency_s
    after = (end - rq.arrival_s.clip(lower=CUT_S)) / spec.window_s
    detected = (rq.status == "failed") & ~rq.reason.str.contains("unreachable", na=False)
    late = rq[(end > CUT_S) & ((after > END_WINDOWS) | (detected & (after > FAIL_WINDOWS)))]
    assert late.empty, late[["request", "home", "arrival_s", "latency_s", "status", "reason"]]
    # the simulator's failures fail here too, for the same reason (edge cannot reach the
    # only full-precision replica of an expert its requests need). The emulator may fail
    # more: its latencies are longer, so a request the simulator finished just before the
    # cut can still be in flight at it; such a one fails by the same rule (its tokens at
    # the hub cannot get home, or edge cannot route them)
    sim_failed = dict(zip(sim[sim.status == "failed"].request, sim[sim.status == "failed"].reason))
    assert sim_failed, "the spec must make the simulator fail some request"
    emu_failed = dict(zip(failed.request, failed.reason))
    assert {r: emu_failed.get(r) for r in sim_failed} == sim_failed
    home_of, arrival = dict(zip(rq.request, rq.home)), dict(zip(rq.request, rq.arrival_s))
    for r, why in emu_failed.items():
        if r not in sim_failed:
            assert home_of[r] == 0 and arrival[r] < CUT_S, (r, why)
            assert why == "home edge unreachable" or "no reachable" in why, (r, why)
    workers = json.loads((tmp_path / "emu" / "fidelity.json").read_text())["detail"]["workers"]
    # a peer is heard at least once a window (STATE), so SILENT_WINDOWS of silence is a loss
    assert max(max(g for i, g in enumerate(w["max_silence_windows"]) if i != w["rank"])
               for w in workers) < SILENT_WINDOWS


#: small3's links with 1 GB per GPU, so EdgeShard pipelines the model: hub runs layers 0-2
#: and 11, edge 3-10 (the same shape as ``test_emu.TIGHT3``)
PIPELINED = {"name": "tight3", "servers": [
    {"name": n, "gpu_tflops": f, "pcie_gb_s": 16, "mem_bw_gb_s": 600, "gpu_mem_gb": 1.0,
     "cpu_mem_gb": 0.05} for n, f in (("edge", 36), ("hub", 150), ("mid", 71))],
    "links": [{"src": a, "dst": b, "bandwidth_gbps": bw, "delay_ms": d, "symmetric": True}
              for a, b, bw, d in (("edge", "hub", 5.0, 2.0), ("edge", "mid", 0.8, 15.0),
                                  ("hub", "mid", 2.5, 6.0))]}
#: request 7 (home hub) arrives at 0.396 s and is inside edge's stage from about 2.5 to 9
#: ms after: killed at 0.402 s, edge takes its tokens with it (the simulator: "server
#: edge died", 5.9 ms after its arrival)
KILL_S = 0.402


def test_a_killed_pipeline_stage_ends_the_requests_inside_it_within_a_few_windows(
        tmp_path: Path) -> None:
    """The tokens inside a server that dies (their frames to it acknowledged, nothing of
    theirs in flight to another) are known only to their home's custody reports: the
    home fails them a grace after nobody hears the server, where they used to wait for
    the drain cap."""
    import yaml
    topo = tmp_path / "tight3.yaml"
    topo.write_text(yaml.safe_dump(PIPELINED))
    spec = {**SPEC, "topology": str(topo), "router": {"name": "edgeshard"},
            "workload": {**SPEC["workload"], "duration_s": 1.0},
            "faults": [{"kind": "kill_worker", "at_s": KILL_S, "server": "edge"}]}
    _, _, sim = _records({**spec, "backend": "sim"}, tmp_path / "sim")
    inside = sim[(sim.arrival_s < KILL_S) & (sim.reason == "server edge died")]
    assert len(inside) == 1, sim  # the spec must put a request inside edge at the kill
    spec, res, rq = _records({**spec, "backend": "emu",
                              "emu": {"dilation": "auto", "max_drain_s": 1.0}}, tmp_path / "emu")
    assert len(rq) == len(sim) and rq.request.is_unique
    st = res.info["stats"]
    failed = rq[rq.status == "failed"]
    assert (failed.reason.str.len() > 0).all()
    # the runner records the dead server's own requests (no home to record them), nothing else
    orphans = failed[failed.reason.str.contains("no record|timeout")]
    assert (orphans.home == 0).all() and st["requests_unrecorded"] == len(orphans), orphans
    assert not st["timed_out"]
    end = rq.arrival_s + rq.latency_s
    after = (end - rq.arrival_s.clip(lower=KILL_S)) / spec.window_s
    late = rq[(end > KILL_S) & (rq.status == "failed") & (after > FAIL_WINDOWS)]
    assert late.empty, late[["request", "home", "arrival_s", "latency_s", "status", "reason"]]
    r = rq.set_index("request").loc[int(inside.request.iloc[0])]
    assert r.status == "failed" and r.reason == "server edge lost holding a token", r
