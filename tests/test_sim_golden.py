"""The simulator's records, bit for bit: a speed-up of the event loop must not move one.

A short HetRoute run on a generated 6-server topology under each physics; the
token-layer and request tables (every value, column order and dtype) are hashed and
compared with recorded digests. The tables without the request table's decode columns
must still give the digests recorded before the simulator was optimised (issue 16, item
2); with them, the digests recorded when those columns were added. Timings, decisions and records all feed the tables, so any change of event
order, of a kernel time or of a float operation's order shows up here.

The digests hold for this platform's floating point (x86-64, numpy 2.x); if a
deliberate change of the model moves them, print the new ones with
``python -m tests.test_sim_golden`` and say why in the commit.
"""

from __future__ import annotations

import dataclasses
import hashlib

import pandas as pd

from testbed.conformance import fresh
from testbed.records import RecordWriter
from testbed.setup import build_setup
from testbed.sim.backend import SimBackend
from testbed.spec import parse_spec

#: Recorded at commit 44af190, before the simulator speed-up (no decode columns then).
BEFORE_SPEEDUP = {
    "hardware": "fe0e6c6af8ab2a771a4ae7cd7a9a34a688274b865be45fd0d70a2403418978a6",
    "paper": "d74be6f7cfea100a9ef27c722d579836f90bf2ad61690283470491d20099a512",
}
DECODE_COLUMNS = ["first_s", "gen_done_s"]
#: Recorded when the request table gained its decode-timing columns.
GOLDEN = {
    "hardware": "d9b6f0e726753e8ac9786b777f011e06ef7537b9c9c152276c1c2bfc6efd46df",
    "paper": "7a08912aa413d37912fe118b47d65d40b6a5dc5fee52fbaaf66d8129fad59a07",
}

#: The digests above are of the per-token dispatch rule (``engine.dispatch: token``, the
#: default until 2026-11-26), which stays available; ``STEP`` is the step rule's; both on
#: ideal links (``net.transport: ideal``, the default until 2026-11-26). ``STEP_TCP`` is the
#: step rule's with TCP's window (``testbed/tcp.py``).
STEP = "94cab10c4e931cbb144436501add0770cbee42ec7f135b942448e1a19c792333"
STEP_TCP = "ce39323dde50f3e0320e27f558a6a6fe150d6df8029141d11399aff927e534de"
#: All of the above have every view read every backlog at its tick and every record reach
#: its decider at once (``net.control: instant``, the default until 2026-11-26); ``LINKS``
#: is the step rule's with TCP's window and views and feedback that cross the links
#: (``net.control: links``, the emulator's rule and now the default).
#: Since 2026-12-03 (commit 6f968a8) a view's broadcast and a record's FEEDBACK wait behind
#: the hidden states queued on their link (``SimBackend.send_control``), as the emulator's
#: do on their connection; ``LINKS``, ``FUSED`` and ``SEGMENTS`` were recorded again then.
LINKS = "238d5ebe36db261117f772c4d0d5f0ff452c171a1136ea8ff7c19683bb0ce7bd"
#: All of the above launch each replica's kernels (``engine.moe_kernels: per_expert``, the
#: default until 2026-11-27); ``FUSED`` is ``LINKS`` with one set of launches per precision
#: per step (``fused``, the default since): the step times and the published backlogs move.
FUSED = "3d7a345586b5af2fbc3c4767f0ae24c7df9c231f24fa7eb871e673275ca94eae"
#: All of the above keep TCP's window in flights (``net.tcp_model: bursts``, the default
#: until 2026-11-27 evening); ``SEGMENTS`` is ``FUSED`` with the ACK clock segment by segment
#: (``segments``, the default since): a message just after a burst finds its last flight
#: still in flight, and slow start grows by the round's latch.
SEGMENTS = "03b14106891591f1800ad1558b53ec0220631a19f84f9b979e898dee811a7d0d"
#: All of the above charge no link time for ACKs (``net.ack_every: 0``, the rule until
#: 2026-12-06); ``ACKS`` is ``SEGMENTS`` with a 66-byte ACK per two segments on the reverse
#: link (``ack_every: 2``, the default since, testbed/acks.py).
ACKS = "f06034e7cfa3066c3c1d9f4abb3ced82b0028d681d1e11094f5c2dc830e6e5da"
#: All of the above let a token attend wherever it resides (``engine.attention:
#: independent``, the hardware world's rule until 2026-12-08, pinned in ``SPEC``); ``CAUSAL``
#: is ``ACKS`` with the hardware world's default since: causal attention with the K/V news
#: from the request's home (testbed/kv.py).
CAUSAL = "a43b7fec1cbf70afef2558ea6f82f3fdb5875554731df99a600760bcb9b79e0e"

SPEC = {"name": "golden", "topology": {"servers": 6, "seed": 1},
        "engine": {"decision_s": 0, "dispatch": "token", "moe_kernels": "per_expert",
                   "attention": "independent"},
        "workload": {"rate_per_s": 40, "duration_s": 0.25, "warmup_s": 0.0,
                     "gen_tokens": 0, "calibration_tokens": 64}}  # the digests are prompt-only


def digest(*frames: pd.DataFrame) -> str:
    """SHA-256 of tables' columns, dtypes and values in row order (floats exactly)."""
    h = hashlib.sha256()
    for frame in frames:
        for name in frame.columns:
            col = frame[name]
            h.update(f"{name}:{col.dtype}:{len(col)}".encode())
            for v in col.to_numpy():
                h.update(repr(v.tolist() if hasattr(v, "tolist") else v).encode())
    return h.hexdigest()


def run_digests(drop: list[str] | None = None, dispatch: str = "token",
                transport: str = "ideal", control: str = "instant",
                moe_kernels: str = "per_expert", tcp_model: str = "bursts",
                ack_every: int = 0, attention: str = "independent") -> dict[str, str]:
    """Both physics on one placement (the world's physics does not enter the placement);
    ``drop``: request-table columns left out of the digest. The paper's world always runs
    per token (``attention`` is the hardware world's)."""
    base = build_setup(parse_spec({**SPEC, "physics": "hardware"}))
    out = {}
    for physics in ("hardware", "paper"):
        _, tl, rq = run_records(base, {
            "physics": physics, "engine.dispatch": dispatch, "net.transport": transport,
            "net.control": control, "engine.moe_kernels": moe_kernels, "net.tcp_model": tcp_model,
            "net.ack_every": ack_every,
            "engine.attention": attention if physics == "hardware" else "independent"})
        assert len(tl) > 0 and len(rq) > 0
        out[physics] = digest(tl, rq.drop(columns=drop or []))
    return out


def run_records(base, overrides: dict):
    """One simulated run of ``base`` (a built setup) under ``overrides``: its stats and
    token-layer and request tables."""
    setup = fresh(dataclasses.replace(base, spec=base.spec.with_overrides(overrides)))
    writer = RecordWriter(None, setup.shape.top_k)
    st = SimBackend(setup, writer).run()
    writer.close()
    return (st, *writer.frames())


def test_sim_records_match_the_recorded_digests():
    got = run_digests()
    assert got == GOLDEN, f"the simulator's records changed: {got}"
    assert run_digests(DECODE_COLUMNS) == BEFORE_SPEEDUP


def test_step_dispatch_records_match_theirs_and_leave_the_papers_world_alone():
    got = run_digests(dispatch="step")
    assert got["paper"] == GOLDEN["paper"], "the paper's world is per token whatever the rule"
    assert got["hardware"] == STEP, f"the step rule's records changed: {got['hardware']}"


def test_tcp_windows_change_the_hardware_world_only():
    got = run_digests(dispatch="step", transport="tcp")
    assert got["paper"] == GOLDEN["paper"], "the paper's links are ideal whatever the transport"
    assert got["hardware"] != STEP, "the window never bound: the test's load does not probe it"
    assert got["hardware"] == STEP_TCP, f"the TCP world's records changed: {got['hardware']}"


def test_control_over_links_changes_the_hardware_world_only():
    got = run_digests(dispatch="step", transport="tcp", control="links")
    assert got["paper"] == GOLDEN["paper"], "the paper's views are instant whatever the rule"
    assert got["hardware"] != STEP_TCP, "the views' lag never moved a decision here"
    assert got["hardware"] == LINKS, f"the records over links changed: {got['hardware']}"


def test_fused_launches_change_the_hardware_world_only():
    got = run_digests(dispatch="step", transport="tcp", control="links", moe_kernels="fused")
    assert got["paper"] == GOLDEN["paper"], "the paper's world runs a replica per step"
    assert got["hardware"] != LINKS, "no step held two replicas of a precision here"
    assert got["hardware"] == FUSED, f"the fused world's records changed: {got['hardware']}"


def test_the_ack_clock_changes_the_hardware_world_only():
    got = run_digests(dispatch="step", transport="tcp", control="links", moe_kernels="fused",
                      tcp_model="segments")
    assert got["paper"] == GOLDEN["paper"], "the paper's links are ideal whatever the model"
    assert got["hardware"] != FUSED, "no message here met its last flight still in flight"
    assert got["hardware"] == SEGMENTS, f"the ACK clock's records changed: {got['hardware']}"


def test_acks_on_the_reverse_link_change_the_hardware_world_only():
    got = run_digests(dispatch="step", transport="tcp", control="links", moe_kernels="fused",
                      tcp_model="segments", ack_every=2)
    assert got["paper"] == GOLDEN["paper"], "the paper's links carry no ACKs"
    assert got["hardware"] != SEGMENTS, "no message here queued behind its reverse link's ACKs"
    assert got["hardware"] == ACKS, f"the records with ACKs changed: {got['hardware']}"


def test_causal_attention_changes_the_hardware_world_only():
    """The hardware world's default since 2026-12-08 (causal attention, K/V news from the
    home) against ``ACKS`` (the same with independent attention); the paper's world, whose
    spec says nothing of attention, is still per token."""
    got = run_digests(dispatch="step", transport="tcp", control="links", moe_kernels="fused",
                      tcp_model="segments", ack_every=2, attention="causal")
    assert got["paper"] == GOLDEN["paper"]
    assert got["hardware"] != ACKS, "no token here attended away from its request's K/V"
    assert got["hardware"] == CAUSAL, f"the causal world's records changed: {got['hardware']}"
    engine = {k: v for k, v in SPEC["engine"].items() if k != "attention"}
    base = build_setup(parse_spec({**SPEC, "engine": engine, "physics": "paper"}))
    _, tl, rq = run_records(base, {})
    assert digest(tl, rq) == GOLDEN["paper"]
    assert base.spec.engine.attention == "independent"
    hw = parse_spec({**SPEC, "engine": engine})
    assert (hw.engine.attention, hw.engine.kv_news) == ("causal", "home")


def test_a_window_that_never_binds_leaves_the_records_of_ideal_links():
    """Under either TCP model, an initial window larger than any flight (``init_cwnd``
    100,000 segments) waits for nothing, so the records equal ``ideal``'s bit for bit."""
    base = build_setup(parse_spec({**SPEC, "physics": "hardware"}))
    got = {}
    for name, over in (("ideal", {"net.transport": "ideal"}),
                       ("bursts", {"net.tcp_model": "bursts", "net.init_cwnd": 100_000}),
                       ("segments", {"net.tcp_model": "segments", "net.init_cwnd": 100_000})):
        st, tl, rq = run_records(base, {"engine.dispatch": "step", "net.control": "links",
                                        "engine.moe_kernels": "fused", "net.ack_every": 0,
                                        **over})
        assert st.tcp_waits == 0, name
        got[name] = digest(tl, rq)
    assert got["bursts"] == got["ideal"] and got["segments"] == got["ideal"]
    assert got["ideal"] != SEGMENTS  # and the default window does bind in this run


def test_batched_request_routing_equals_routing_each_request_alone():
    """``route_many`` (the simulator's batches) against ``route`` request by request,
    with decode tokens and several tasks: the same experts and weights."""
    import numpy as np

    from testbed.setup import make_trace
    from workloads import get_model

    trace = make_trace(get_model("qwen"), "synthetic", None, seed=3,
                       tasks={"n_tasks": 3, "task_specificity": 0.5})
    rids, tasks = [5, 9, 11, 40], [0, 2, 1, 2]
    batch = trace.route_many(rids, 7, tasks=tasks)
    assert len(batch) == len(rids)
    for got, rid, task in zip(batch, rids, tasks):
        (alone,) = trace.route_many([rid], 7, tasks=[task])
        np.testing.assert_array_equal(got.experts, alone.experts)
        np.testing.assert_array_equal(got.weights, alone.weights)
        assert got.experts.shape == (7, 24, 4)


if __name__ == "__main__":  # pragma: no cover - prints the digests to record
    print(run_digests(), run_digests(dispatch="step")["hardware"],
          run_digests(dispatch="step", transport="tcp")["hardware"],
          run_digests(dispatch="step", transport="tcp", control="links")["hardware"],
          run_digests(dispatch="step", transport="tcp", control="links",
                      moe_kernels="fused")["hardware"],
          run_digests(dispatch="step", transport="tcp", control="links", moe_kernels="fused",
                      tcp_model="segments")["hardware"],
          run_digests(dispatch="step", transport="tcp", control="links", moe_kernels="fused",
                      tcp_model="segments", ack_every=2)["hardware"],
          run_digests(dispatch="step", transport="tcp", control="links", moe_kernels="fused",
                      tcp_model="segments", ack_every=2, attention="causal")["hardware"])
