"""TCP's congestion window on a long-lived connection: what a message waits beyond line rate.

The ideal link (``net.transport: ideal``) delivers a message of ``b`` bytes at
``start + b / (B * efficiency) + delay``: the sender always has a window as
large as the path's bandwidth-delay product. A real sender does not. It
starts a connection, and restarts it after an idle period, with a small
window, and a message larger than its window waits one round trip per
window-full (slow start). Under ``net.transport: tcp`` both backends add that
wait to the ideal arrival; nothing else changes (what the window does not
limit arrives exactly as on the ideal link).

The rules, per directed server pair (one connection, as the emulator's
workers hold one per peer), on data messages only:

- **Initial window** ``init_cwnd`` segments of ``mss`` payload bytes: 10
  (RFC 6928, Linux's default since 2.6.39).
- **Slow start** (RFC 5681 Sec. 3.1) over the byte stream (messages queued
  behind each other are one burst): a window-limited flight of ``w``
  segments takes one round trip plus a segment's transmission and grows the
  window by ``w`` (one segment per ACKed segment; Linux counts ACKed segments,
  so delayed ACKs do not slow it). Without losses ``ssthresh`` keeps its initial
  infinity (Linux's ``tcp_current_ssthresh`` takes the larger of it and 3/4 of
  the window on every reduction below), so every growth is slow start; the
  congestion-avoidance rule (CUBIC in Linux) never applies. A flight is
  window-limited while ``w`` segments take less than a round trip to send.
  The window grows only from messages that were window-limited or used at least
  half of it (Linux's ``tcp_is_cwnd_limited`` in slow start: the window is
  "limited" while it is under twice the most segments recently in flight).
- **Idle decay** (RFC 5681 Sec. 4.1; Linux ``tcp_cwnd_restart`` and
  ``tcp_cwnd_application_limited``, both on by the default
  ``net.ipv4.tcp_slow_start_after_idle = 1``): for every retransmission
  timeout the connection sent nothing, the window halves, never below the
  initial window, and it regrows by slow start. Linux's timeout for a steady path is the round
  trip plus ``rto_min`` (200 ms, ``TCP_RTO_MIN``), since its variance term
  is floored at ``rto_min``.

Two models of those rules (``net.tcp_model``). ``segments`` (``AckClock``, the
default since 2026-11-27 evening) keeps the ACK clock itself: every segment in flight
with the time its ACK returns (its last byte's departure plus the round trip);
a segment leaves when fewer than the window are in flight, and each ACK frees
its room and, in slow start, adds a segment to the window. A burst from a cold
window goes in flights of 10, 20, 40, ... one round trip apart, and the wait is
continuous in when a message comes. Its growth rule is Linux's
``tcp_is_cwnd_limited`` in slow start: an ACK grows the window if the window
held a segment back, or while it is under twice the most segments in flight,
both latched per round as ``tcp_cwnd_validate`` does (``_send``).
``bursts`` (``TcpWindow``, the default until 2026-11-27 evening, kept for comparison)
works in flights: a message queued behind the one before it continues that
burst's slow start; one that starts after the last byte left begins a new burst
with the grown window and nothing in flight, although that last flight's ACKs
come back up to a round trip later. So a message starting just after a burst
waits less than one starting just before its end (README, "Emulator against
simulator": asym5, 22.5 against 54.9 ms; ``tests/test_tcp.py``: 19 ms at a 20 ms
round trip).

Left out, and why: losses (the shaped links queue, they do not drop: the
emulator's ``fidelity`` checks zero drops), the receive window (Linux
autotunes it to the path, up to ``tcp_rmem``'s 6 MB), Nagle and delayed ACK
stalls (the workers write whole frames; small messages fit the initial
window), pacing, the wait of an ACK behind the reverse link's data (its link time is
charged, ``testbed/acks.py``, but the clock returns it one round trip after its segment:
a window that binds while the reverse link is busy waits less here than on a real path;
how much has not been measured),
and control frames (the emulator's per-window STATE
broadcasts are left out of the idle clock in both backends; under Linux they
turn an idle restart into the application-limited decay above, which halves
by the same rule).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from math import ceil

import numpy as np
from numba import njit

#: Linux's minimum retransmission timeout (include/net/tcp.h, TCP_RTO_MIN = HZ/5)
RTO_MIN_S = 0.2
#: RFC 6928's initial window, in segments
INIT_CWND = 10
#: TCP payload per segment on a 1500-byte Ethernet MTU with timestamps (1500 - 20 - 20 - 12)
MSS_BYTES = 1448


@dataclass(frozen=True)
class TcpParams:
    init_cwnd: int = INIT_CWND
    mss: int = MSS_BYTES
    rto_min_s: float = RTO_MIN_S
    idle_decay: bool = True
    model: str = "segments"  # ``AckClock``; or "bursts" (``TcpWindow``)


class TcpWindow:
    """One direction of one connection. ``wait`` is called in send order, with the
    time its message starts to leave (after the messages before it on the link).

    The window applies to the byte stream, not to messages: a message queued behind
    the one before it (``queued``: the connection was still sending, or waiting for
    ACKs, when it came) continues that burst's slow start, so 36 one-token messages
    written at once wait as one 36-token message would."""

    __slots__ = ("p", "rtt", "seg_s", "rto", "cwnd", "last_end", "limit", "w0", "pos")

    def __init__(self, params: TcpParams, rtt_s: float, bytes_per_s: float) -> None:
        self.p = params
        self.rtt = rtt_s
        self.seg_s = params.mss / bytes_per_s  # one segment's transmission time
        self.rto = rtt_s + params.rto_min_s
        self.cwnd = float(params.init_cwnd)
        self.last_end: float | None = None  # when the last data message's last byte left
        #: a flight of at least this many segments fills the pipe (no ACK wait)
        self.limit = (rtt_s + self.seg_s) / self.seg_s if self.seg_s > 0 else 0.0
        self.w0 = self.cwnd  # the window the current burst started with
        self.pos = 0  # segments of the current burst so far

    def wait(self, start_s: float, nbytes: int, tx_s: float, queued: bool = False) -> float:
        """Seconds a message of ``nbytes`` starting at ``start_s`` waits for ACKs beyond
        its ``tx_s`` of transmission; the window and the idle clock move on with it."""
        if not queued or self.last_end is None:  # the connection was idle: a new burst
            if self.last_end is not None:
                self.cwnd = _after_idle(self.p, self.cwnd, start_s - self.last_end, self.rto)
            self.w0, self.pos = self.cwnd, 0
        segs = ceil(nbytes / self.p.mss) if nbytes > 0 else 0
        before = self.pos
        self.pos += segs
        extra = self._waited(self.pos) - self._waited(before)
        self.cwnd = self._window(self.pos)
        self.last_end = start_s + tx_s + extra
        return extra

    def _waited(self, segs: int) -> float:
        """ACK waits before the burst's first ``segs`` segments have left: each
        window-limited flight takes a round trip plus a segment's transmission, of
        which its own segments' transmission is part of the line-rate time."""
        t, sent, w = 0.0, 0, self.w0
        while sent < segs and w < self.limit:
            f = int(w)
            if segs <= sent + f:  # in this flight: no ACK to wait for
                break
            sent += f
            t += self.rtt + self.seg_s - f * self.seg_s
            w += f  # slow start: a segment per segment ACKed
        return t

    def _window(self, segs: int) -> float:
        """The window once the burst's first ``segs`` segments are ACKed."""
        sent, w, waited = 0, self.w0, False
        while sent < segs:
            f = int(w)
            if w >= self.limit or segs <= sent + f:  # the pipe is full, or the last flight
                if w >= self.limit or waited or 2 * (segs - sent) >= w:
                    w += segs - sent
                break
            sent += f
            w += f
            waited = True
        return w


def _after_idle(p: TcpParams, cwnd: float, idle: float, rto: float) -> float:
    """The window after ``idle`` seconds without data (``tcp_cwnd_restart``): halved per
    retransmission timeout, never below the initial window; kept without idle decay."""
    if not p.idle_decay or idle <= rto:
        return cwnd
    return max(float(p.init_cwnd), cwnd / (2.0 ** min(int(idle / rto), 60)))


@njit(cache=True)
def _send(acks, head, count, cwnd, peak, limited, usage, una, t, nseg, seg,
          rtt):  # pragma: no cover
    """Send ``nseg`` segments from ``t`` over the ACK clock ``acks`` (a ring buffer of the
    in-flight segments' ACK times, ``count`` of them from ``head``; ``una`` segments ACKed
    so far): the seconds it stalled on the window, and the clock's new state.

    Slow start's growth follows Linux's ``tcp_is_cwnd_limited``: an ACK grows the window
    if the window held a segment back, or while it is under twice the most segments in
    flight, both as latched per round (``tcp_cwnd_validate``): a round ends when the
    segment that was next to send at its latch (``usage``) is ACKed, and the next send
    latches anew; a window-limited send latches at once, and a larger flight raises the
    peak while the round is not window-limited.
    Compiled: a message is a loop over its segments."""
    cap = acks.shape[0]
    sent = 0
    stalled = 0.0
    while True:
        while count > 0 and acks[head] <= t:  # ACKed by now: room, and slow start's growth
            head += 1
            if head == cap:
                head = 0
            count -= 1
            una += 1
            if limited or cwnd < 2 * peak:
                cwnd += 1
        if sent == nseg:
            break
        if count >= cwnd:  # the window is full: latch it, wait for the next ACK
            limited, peak, usage = True, count, una + count
            stalled += acks[head] - t
            t = acks[head]
            continue
        tail = head + count
        if tail >= cap:
            tail -= cap
        acks[tail] = t + seg + rtt
        count += 1
        t += seg
        sent += 1
        full = count >= cwnd
        if una >= usage or full or (not limited and count > peak):  # tcp_cwnd_validate
            limited, peak, usage = full, count, una + count
    return stalled, head, count, cwnd, peak, limited, usage, una


class AckClock:
    """``net.tcp_model: segments``: one direction of one connection, segment by segment
    (module docstring). The same ``wait`` as ``TcpWindow``; ``queued`` is not needed (the
    clock knows what is in flight) and is accepted for the callers' sake."""

    __slots__ = ("p", "rtt", "seg_s", "rto", "cwnd", "last_end", "limit", "acks", "head",
                 "count", "peak", "limited", "usage", "una")

    def __init__(self, params: TcpParams, rtt_s: float, bytes_per_s: float) -> None:
        self.p = params
        self.rtt = rtt_s
        self.seg_s = params.mss / bytes_per_s
        self.rto = rtt_s + params.rto_min_s
        self.cwnd = int(params.init_cwnd)
        self.last_end: float | None = None
        #: at most this many segments are in flight: one leaves per segment time and the
        #: first ACK is back a round trip and a segment after it left
        self.limit = int((rtt_s + self.seg_s) / self.seg_s) + 2 if self.seg_s > 0 else 2
        self.acks = np.zeros(16)
        self.head = self.count = self.peak = 0
        self.limited = False  # the window held a segment back in this round (``_send``)
        self.usage = self.una = 0  # the round ends when segment ``usage`` is ACKed; ACKed so far

    def _room(self, more: int) -> None:
        """Grow the ring so that ``more`` segments fit beside those in flight."""
        need = min(self.count + more, self.limit) + 1
        cap = self.acks.shape[0]
        if need <= cap:
            return
        while cap < need:
            cap *= 2
        ring = np.zeros(cap)
        idx = (self.head + np.arange(self.count)) % self.acks.shape[0]
        ring[:self.count] = self.acks[idx]
        self.acks, self.head = ring, 0

    def _run(self, t: float, segs: int) -> float:
        """Seconds ``segs`` segments from ``t`` stall on the window."""
        (stalled, self.head, self.count, self.cwnd, self.peak, self.limited, self.usage,
         self.una) = _send(self.acks, self.head, self.count, self.cwnd, self.peak, self.limited,
                           self.usage, self.una, t, segs, self.seg_s, self.rtt)
        return stalled

    def wait(self, start_s: float, nbytes: int, tx_s: float, queued: bool = False) -> float:
        segs = ceil(nbytes / self.p.mss) if nbytes > 0 else 0
        if self.last_end is not None:
            self._run(start_s, 0)  # the ACKs back by now
            # past a timeout all is ACKed (rto > round trip); the round ended with the last
            # ACK, so the next send latches the growth rule anew
            self.cwnd = int(_after_idle(self.p, self.cwnd, start_s - self.last_end, self.rto))
        self._room(segs)
        extra = self._run(start_s, segs)
        self.last_end = start_s + tx_s + extra
        return extra


def warm_up(params: TcpParams) -> float:
    """Load the ACK clock's compiled kernel (``_send``) with a throwaway connection;
    returns the wall seconds it took. Its first call in a process costs 0.2-0.7 s
    (numba's start-up and its cache; measured here), which an emulated worker must pay
    before its run: paid inside it, it held each worker's first data message back by
    that much wall time, 1.0-1.9 ms emulated at T = 127 (README, "Emulator against
    simulator")."""
    t0 = time.perf_counter()
    AckClock(params, 1e-3, 1e9).wait(0.0, 4 * params.mss, 1e-5)
    return time.perf_counter() - t0


def window(params: TcpParams, bandwidth, delay, efficiency: float, m: int, n: int):
    """The window of the connection m -> n (``TcpWindow``, or ``AckClock`` under
    ``model="segments"``): round trip ``delay[m][n] + delay[n][m]``, segments at
    ``bandwidth[m][n] * efficiency``."""
    cls = AckClock if params.model == "segments" else TcpWindow
    return cls(params, delay[m][n] + delay[n][m], bandwidth[m][n] * efficiency)


def windows(params: TcpParams, bandwidth, delay, efficiency: float) -> list[list]:
    """A window per directed pair of a cluster (``None`` on the diagonal)."""
    N = len(bandwidth)
    return [[None if m == n else window(params, bandwidth, delay, efficiency, m, n)
             for n in range(N)] for m in range(N)]


class HoldClock:
    """The emulator's sender side of one connection. Its link (HTB at B/T) already
    queues messages at line rate; what it lacks is the window. So the sender keeps two
    FIFO clocks in emulated time, the ideal link's and the windowed one's, and a
    message's hold is how much later its last byte leaves on the second: the
    simulator's arrival, reached by adding the hold to the real one."""

    __slots__ = ("window", "msg_bytes", "tx_s", "free", "ideal_free", "last_wait")

    def __init__(self, window: TcpWindow, msg_bytes: int, tx_s: float) -> None:
        self.window = window
        self.msg_bytes = msg_bytes  # wire bytes of one hidden state (payload + framing)
        self.tx_s = tx_s  # its transmission time at line rate
        self.free = 0.0
        self.ideal_free = 0.0
        #: the last message's own window wait (the simulator's ``tcp_wait_s`` counts these;
        #: a hold also carries the lag earlier waits left on the connection)
        self.last_wait = 0.0

    def hold(self, t: float, count: int = 1) -> float:
        """Emulated seconds to add to the arrival of ``count`` hidden states sent at ``t``
        as one message."""
        tx = self.tx_s * count
        start = self.ideal_free if self.ideal_free > t else t
        self.ideal_free = start + tx
        queued = self.free > t
        start = self.free if queued else t
        self.last_wait = self.window.wait(start, self.msg_bytes * count, tx, queued)
        self.free = start + tx + self.last_wait
        return max(0.0, self.free - self.ideal_free)


def hold_clocks(params: TcpParams, bandwidth, delay, efficiency: float, src: int,
                msg_bytes: int) -> dict[int, HoldClock]:
    """Server ``src``'s sender side towards every peer, with the simulator's windows
    (``window``: same round trips, same segment times)."""
    return {n: HoldClock(window(params, bandwidth, delay, efficiency, src, n), msg_bytes,
                         msg_bytes / (bandwidth[src][n] * efficiency))
            for n in range(len(bandwidth)) if n != src}
