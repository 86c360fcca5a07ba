"""The congestion-window model (testbed/tcp.py) and its use by both backends."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from testbed.tcp import AckClock, HoldClock, TcpParams, TcpWindow, hold_clocks, windows

MSS = 1448
RATE = 125e6  # 1 Gbit/s in bytes/s
RTT = 0.02


def _window(**kw) -> TcpWindow:
    return TcpWindow(TcpParams(**kw), RTT, RATE)


def test_a_message_within_the_initial_window_waits_nothing():
    w = _window()
    assert w.wait(0.0, 10 * MSS, 10 * MSS / RATE) == 0.0


def test_slow_start_waits_one_round_trip_per_doubling_from_a_cold_window():
    """206 segments from a window of 10: flights of 10, 20, 40, 80, then the last 56;
    four round trips waited, each less the flight's own transmission."""
    w = _window()
    seg = MSS / RATE
    wait = w.wait(0.0, 206 * MSS, 206 * seg)
    expected = sum(RTT + seg - f * seg for f in (10, 20, 40, 80))
    assert wait == pytest.approx(expected)
    assert w.cwnd == pytest.approx(10 + 10 + 20 + 40 + 80 + 56)
    # warm now: the same message again right away goes in one flight
    assert w.wait(w.last_end, 206 * MSS, 206 * seg) == 0.0


def test_a_window_that_fills_the_pipe_is_the_ideal_link():
    """Above the bandwidth-delay product nothing waits, however large the message."""
    w = _window(init_cwnd=10_000)  # 14.5 MB > 1 Gbit/s x 20 ms
    assert w.wait(0.0, 50_000 * MSS, 50_000 * MSS / RATE) == 0.0


def test_idle_halves_the_window_per_timeout_never_below_the_initial_window():
    w = _window()
    seg = MSS / RATE
    w.wait(0.0, 400 * MSS, 400 * seg)
    warm = w.cwnd
    rto = RTT + 0.2
    w.wait(w.last_end + 2.5 * rto, 1, seg)  # two whole timeouts idle
    assert w.cwnd == pytest.approx(warm / 4)
    w.wait(w.last_end + 100 * rto, 1, seg)
    assert w.cwnd == 10


def test_messages_queued_behind_each_other_are_one_burst():
    """36 one-token messages written at once wait as one 36-token message: the window
    is the byte stream's, not each message's."""
    seg = MSS / RATE
    one = _window()
    whole = one.wait(0.0, 36 * 6 * MSS, 36 * 6 * seg)
    parts = _window()
    t, total = 0.0, 0.0
    for i in range(36):
        total += parts.wait(t, 6 * MSS, 6 * seg, queued=i > 0)
        t = parts.last_end
    assert whole > 0 and total == pytest.approx(whole)
    assert parts.cwnd == pytest.approx(one.cwnd)
    # each on an idle connection instead: every one fits the window and nothing waits
    alone = _window(idle_decay=False)
    assert sum(alone.wait(1.0 * i, 6 * MSS, 6 * seg) for i in range(36)) == 0.0


def test_without_idle_decay_a_warm_window_stays_warm():
    w = _window(idle_decay=False)
    seg = MSS / RATE
    w.wait(0.0, 400 * MSS, 400 * seg)
    assert w.wait(w.last_end + 60.0, 400 * MSS, 400 * seg) == 0.0


@pytest.mark.parametrize("model", ["bursts", "segments"])
@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 2.0), st.integers(1, 2000)), min_size=1, max_size=30),
       st.floats(1e-4, 0.05), st.floats(1e7, 2e9))
def test_waits_are_finite_non_negative_and_bounded_by_slow_start(model, msgs, rtt, rate):
    """Whatever the history, a message of s segments waits at most the round trips of
    slow start from the initial window (log2(s / 10) + 1 of them)."""
    w = windows(TcpParams(model=model), [[0, rate], [rate, 0]], [[0, rtt / 2], [rtt / 2, 0]],
                1.0)[0][1]
    t = 0.0
    for gap, segs in msgs:
        t = (w.last_end or 0.0) + gap
        tx = segs * MSS / rate
        wait = w.wait(t, segs * MSS, tx)
        assert math.isfinite(wait) and wait >= 0.0
        rounds = max(0, math.ceil(math.log2(segs / 10 + 1)))
        assert wait <= rounds * (rtt + MSS / rate) + 1e-12
        assert w.cwnd >= 10


@pytest.mark.parametrize("model", ["bursts", "segments"])
def test_the_emulators_hold_is_the_simulators_extra_delay(model):
    """The hold a sender attaches is what the simulator's windowed FIFO adds to the
    ideal FIFO's arrival, message by message, also when messages queue."""
    bw = [[0.0, RATE], [RATE, 0.0]]
    delay = [[0.0, RTT / 2], [RTT / 2, 0.0]]
    msg = 8192 + 64
    clock = hold_clocks(TcpParams(model=model), bw, delay, 1.0, 0, msg)[1]
    sim = windows(TcpParams(model=model), bw, delay, 1.0)[0][1]
    tx1 = msg / RATE
    free = ideal_free = 0.0
    lagged = 0
    for t, count in ((0.0, 36), (0.0001, 36), (0.3, 1), (0.9, 72), (0.9, 5)):
        tx = tx1 * count
        start = max(t, free)
        wait = sim.wait(start, msg * count, tx, queued=free > t)
        free = start + tx + wait
        istart = max(t, ideal_free)
        ideal_free = istart + tx
        assert clock.hold(t, count) == pytest.approx(free - ideal_free)
        # what the sender counts (tcp_waits, tcp_wait_s) is the message's own wait, as the
        # simulator counts it, not the lag earlier waits left (the second message's hold)
        assert clock.last_wait == pytest.approx(wait)
        lagged += free - ideal_free > wait + 1e-12
    assert lagged  # some message's hold is mostly an earlier one's wait


def _clock() -> AckClock:
    return AckClock(TcpParams(model="segments"), RTT, RATE)


def test_the_ack_clock_sends_a_cold_burst_in_the_flights_of_slow_start():
    """Segment by segment, a cold window still goes in flights of 10, 20, 40, 80 one round
    trip apart: the same wait as the bursts model, and queued messages are one burst."""
    seg = MSS / RATE
    w = _clock()
    assert w.wait(0.0, 10 * MSS, 10 * seg) == 0.0
    w = _clock()
    assert w.wait(0.0, 206 * MSS, 206 * seg) == pytest.approx(
        sum(RTT + seg - f * seg for f in (10, 20, 40, 80)))
    whole, parts = _clock().wait(0.0, 216 * MSS, 216 * seg), _clock()
    t, total = 0.0, 0.0
    for _ in range(36):
        total += parts.wait(t, 6 * MSS, 6 * seg, queued=t > 0)
        t = parts.last_end
    assert whole > 0 and total == pytest.approx(whole)
    big = AckClock(TcpParams(init_cwnd=10_000, model="segments"), RTT, RATE)
    assert big.wait(0.0, 50_000 * MSS, 50_000 * MSS / RATE) == 0.0  # the pipe is full


def _end(model: str, first: int, gap: float, then: int = 300) -> float:
    """When the last byte of a ``then``-segment message leaves, sent ``gap`` after the
    last byte of a ``first``-segment message from a cold window left."""
    seg = MSS / RATE
    w = windows(TcpParams(model=model), [[0, RATE], [RATE, 0]], [[0, RTT / 2], [RTT / 2, 0]],
                1.0)[0][1]
    w.wait(0.0, first * MSS, first * seg)
    start = w.last_end + gap
    return start + then * seg + w.wait(start, then * MSS, then * seg, queued=gap == 0)


@pytest.mark.parametrize("first", [5, 40, 150, 206, 1000])
def test_a_message_just_after_a_burst_finds_its_last_flight_still_in_flight(first):
    """The last flight's ACKs come back a round trip after its last byte left: a message
    that starts a nanosecond after that byte continues the burst exactly as one queued
    behind it. The bursts model gives it a fresh, grown window with nothing in flight,
    so it leaves up to 19 ms earlier than the queued one (the flaw ``segments`` removes).
    Past a round trip, with every ACK back, the two models agree."""
    queued = _end("segments", first, 0.0)
    assert queued == pytest.approx(_end("bursts", first, 0.0))  # queued: the same burst
    assert _end("segments", first, 1e-9) == pytest.approx(queued, abs=1e-8)
    if first in (40, 150, 1000):  # a burst that ended on the window's edge
        assert _end("bursts", first, 1e-9) < queued - 0.01
    if first >= 40:  # a burst that grew the window
        for g in (RTT * 1.01, RTT * 1.5):
            assert _end("segments", first, g) == pytest.approx(_end("bursts", first, g))


def test_slow_start_counts_acks_under_the_rounds_latch_as_linux_does():
    """Linux (``tcp_cwnd_validate`` since 6.1, ``tcp_is_cwnd_limited``) grows the window
    on an ACK if the round was window-limited, or while the window is under twice the
    round's most segments in flight; a round's latch holds until its last segment is
    ACKed and the next send latches anew. A cold 40-segment message goes as flights of
    10, 20 (both window-limited) and 10 (not). Left alone, the last flight's ACKs come
    under the second flight's latch and grow the window from 40 to 50. One segment sent
    before they return starts a new round, not window-limited, 11 in flight: they grow
    nothing. (So a message that starts a little earlier may leave a round trip later
    than one that waits for those ACKs: this is the kernel's rule, not monotone in time.)"""
    seg = MSS / RATE
    quiet, busy = _clock(), _clock()
    for w in (quiet, busy):
        w.wait(0.0, 40 * MSS, 40 * seg)
    busy.wait(quiet.last_end + RTT / 2, MSS, seg)
    later = quiet.last_end + 2 * RTT  # every ACK back, well before an idle timeout
    for w in (quiet, busy):
        w.wait(later, 0, 0.0)
    assert (quiet.cwnd, busy.cwnd) == (50, 40)


@pytest.mark.parametrize("model", ["bursts", "segments"])
def test_the_simulator_adds_the_window_wait_to_a_cold_fan_out(model):
    """One 200 kB hidden state from a to b on a cold connection (1 GB/s, 1 ms each way):
    139 segments go as flights of 10, 20, 40, then 69; the fan-out waits three round
    trips less those flights' transmission. ``ideal`` leaves it at line rate."""
    from hetroute.deployment import Deployment, Replica
    from hetroute.system import Precision
    from testbed.spec import parse_spec

    from . import factories as F
    from .test_sim import FakeSetup, Fixed, Req, _cluster, _run

    sh = F.shape(n_layers=1, experts=1, top_k=1, d_model=100_000)  # 200 kB in FP16
    cl = _cluster(B=1e9, delay=1e-3)
    dep = Deployment((Replica(0, 1, Precision.FP16, True),), 1, 2)
    fan_out = {}
    for transport in ("ideal", "tcp"):
        spec = parse_spec({"window_s": 0.01, "sim": {"payload_efficiency": 1.0, "header_bytes": 0},
                           "physics": "hardware", "engine": {"decision_s": 0.0},
                           "net": {"transport": transport, "tcp_model": model}})
        setup = FakeSetup(cl, sh, dep, Fixed({0: 0}, agg=1), [Req(0, 0.0)], {0: [((0,),)]},
                          spec=spec)
        st, tl, _ = _run(setup)
        fan_out[transport] = tl.fanout_s.iloc[0]
        assert (st.tcp_waits > 0) == (transport == "tcp")
    seg = 1448 / 1e9
    assert fan_out["ideal"] == pytest.approx(200_000 / 1e9 + 1e-3)
    waits = sum(2e-3 + seg - f * seg for f in (10, 20, 40))
    assert fan_out["tcp"] == pytest.approx(fan_out["ideal"] + waits)
    # the paper's world keeps its ideal links whatever the transport says
    spec = parse_spec({"window_s": 0.01, "sim": {"payload_efficiency": 1.0, "header_bytes": 0},
                       "physics": "paper", "engine": {"decision_s": 0.0}, "net": {"transport": "tcp"}})
    st, tl, _ = _run(FakeSetup(cl, sh, dep, Fixed({0: 0}, agg=1), [Req(0, 0.0)], {0: [((0,),)]},
                               spec=spec))
    assert st.tcp_waits == 0


def test_warm_up_loads_the_ack_clocks_kernel_in_a_fresh_process() -> None:
    """An emulated worker calls ``warm_up`` before its run: the kernel's first call in a
    process (numba's start-up, its cache) cost 0.2-0.7 s and, paid at the first message,
    held every worker's first hand-off back (1.0-1.9 ms emulated at T = 127)."""
    import subprocess
    import sys
    code = ("from testbed.tcp import _send, warm_up, TcpParams\n"
            "n0 = len(_send.signatures)\n"
            "s = warm_up(TcpParams())\n"
            "print(n0, len(_send.signatures), s > 0)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["0", "1", "True"], out
