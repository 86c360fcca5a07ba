"""Peers: the window broadcast, sending with acknowledgement, and liveness.

Every window each worker sends its stream backlog to all reachable peers
(STATE), as of the tick's model instant and due then: the transport stamps it as
a data frame and its link's delay line hands it on at the model's arrival, behind
the data frames sent before it (the simulator's ``send_control``). At a tick a
view holds each peer's last broadcast whose arrival is no later than the tick's
instant, whatever order the loop ran the two in. A cut
link drops frames without an error, so each STATE also carries how many frames
its sender has received from each peer (a cumulative acknowledgement), and
every frame a token depends on is kept with a resolver until the peer
acknowledges it. A peer whose connection breaks, or that is silent for
``SILENT_WINDOWS`` windows, is lost (``faults``): heard as its bytes arrive
(``_heard``), not when the delay line hands a frame on, since a STATE may wait there
behind data held for its congestion window, as it would behind that data on one TCP
connection, while the data's own bytes keep coming.
"""

from __future__ import annotations

import contextlib
import time
import traceback
from collections import deque
from typing import Iterator

import torch

from ..wire import (KV_CONTROL, MAX_FINISHED, TENSOR_MESSAGES, Custody, Fail, Feedback, Frame,
                    Hidden, KvData, Partial, State, Token, patched, sized_frame, tensor_frame)

#: a peer silent this many windows is lost (it sends STATE every window). Over 8,288
#: healthy peer pairs of the emulated runs kept here (2026-11-26/27, 2-core host, T = 32-127)
#: the longest silence was 1.02 windows at the median, 1.45 at p99, 1.72 at p99.9 and 2.48
#: at most: a worker's loop, late by up to 0.74 s of wall time on a busy host, delays its
#: broadcast. Two windows failed healthy peers (HetRoute, Fig. 9 at 10 req/s: 3 of 5
#: requests "no reachable full-precision replica"; the same point run again reached 1.9-2.7
#: windows at every worker); three, as heartbeat timeouts of a few periods are, keeps that
#: tail out at one more window of detection time.
SILENT_WINDOWS = 3


class Peers:
    """Owns ``peer_backlog``, ``last_heard``, ``reachable``, ``max_gap``, ``unacked`` and
    ``kv_finished``."""

    #: per peer, the sender's congestion-window clock (``testbed.tcp.HoldClock``); set by
    #: the worker under ``net.transport: tcp`` with the transport delay line
    holds: dict | None = None
    #: the server's K/V ledger (``testbed.kv_spill.KvSpill``); set by the worker under
    #: ``engine.kv_overflow: spill``, whose STATE frames free the peers' K/V
    kv_room = None

    def _init_peers(self) -> None:
        n = self.N
        #: requests home here that finished since the last STATE (``engine.kv_overflow: spill``)
        self.kv_finished: list[int] = []
        self.peer_backlog = [0.0] * n
        #: per peer: (arrival, wall s; backlog) of broadcasts not yet taken into a view
        self.heard: list[deque] = [deque() for _ in range(n)]
        self._tick_wall = float("-inf")  # the instant (wall s) of the last tick run
        self.last_heard = [0.0] * n
        self.reachable = [True] * n
        self.max_gap = [0.0] * n  # longest silence heard from each peer (wall s, ``_heard``)
        #: per peer: (frame number, resolver) of sent frames it has not acknowledged yet
        self.unacked: dict[int, deque] = {p: deque() for p in range(n) if p != self.rank}
        #: (sender, group) -> frames of a dispatch group received so far, with their arrivals
        self.grouped: dict[tuple[int, int], list[tuple[Frame, float]]] = {}
        #: (destination, kind, group) -> (its congestion-window wait, frames still to send)
        self._group_holds: dict[tuple, tuple[float, int]] = {}
        #: (hop list, wall time the frame was due) of frames written when ``_together`` ends
        self._hops_due: list[tuple[list, float]] = []

    @contextlib.contextmanager
    def _together(self) -> Iterator[None]:
        """Frames sent inside leave together when the outermost block ends (one write per
        peer, ``Transport.corked``); their hops (``_hop``) are timed then."""
        with self.net.corked():
            yield
        if not self.net.is_corked and self._hops_due:
            now = time.monotonic()
            for into, due in self._hops_due:
                into.append(now - due)
            self._hops_due.clear()

    def _hop(self, into: list, t: float) -> None:
        """How late, in wall seconds, a frame due at model time ``t`` is written (the
        worker's own Python per hop: ``hop_dispatch_ms``, ``hop_partial_ms``)."""
        if self.net.is_corked:
            self._hops_due.append((into, self.wall(t)))
        else:
            into.append(time.monotonic() - self.wall(t))

    def _tick(self, window: int) -> None:
        if self.stopping:
            return
        now_wall = time.monotonic()
        t_tick = window * self.window
        backlog = self.stream.sched.backlog(t_tick)  # as of the tick, however late it runs
        got = self.net.received_frames
        done = self.kv_finished[:MAX_FINISHED]  # (``engine.kv_overflow: spill``)
        del self.kv_finished[:MAX_FINISHED]
        frame = Frame(State(self.rank, window, t_tick, self.now(), float(backlog),
                            tuple(self.reachable), tuple(got.get(p, 0) for p in range(self.N)),
                            finished=tuple(done)))
        for peer in range(self.N):
            if peer != self.rank and self.reachable[peer]:
                self._send(peer, frame, at=t_tick)
        tick_wall = self.wall(t_tick)
        self._tick_wall = tick_wall
        for peer, q in enumerate(self.heard):
            while q and q[0][0] <= tick_wall:
                self.peer_backlog[peer] = q.popleft()[1]
        silent = SILENT_WINDOWS * self.window * self.T
        for peer in range(self.N):
            if peer != self.rank and self.reachable[peer] and now_wall - self.last_heard[peer] > silent:
                self._peer_lost(peer, f"silent for {SILENT_WINDOWS} windows")
        snap = list(self.peer_backlog)
        snap[self.rank] = backlog
        self.view.refresh(window, window * self.window, snap, list(self.reachable))
        self._fault_tick()
        self.loop.call_at(self.wall((window + 1) * self.window), self._tick, window + 1)

    def _send(self, dst: int, frame: Frame, resolve=None, at: float | None = None,
              modeled: bool = True, on_ack=None, hold_n: int | None = None) -> bool:
        """Send ``frame``; ``resolve(dst)`` runs if ``dst`` is lost before acknowledging it,
        ``on_ack()`` (with ``resolve`` only) when it acknowledges it.
        ``at`` is the model time the frame is sent: a frame to this server itself arrives
        then (no link to cross), not when the event loop got round to sending it, so the
        worker's own Python time does not move its jobs' arrival (as in the simulator).
        To a peer, ``at`` is also when the frame was due to leave: the transport stamps how
        much later it left its link than the model's departure (``write_late_s``), which the
        receiver's delay line absorbs.
        ``modeled=False``: a frame the simulator does not send (the HIDDEN frame for an
        aggregator that runs none of the layer's experts: the header alone where the one
        participant folds the residual into its partial, else the state, which a real
        participant would fold): it takes no part in the congestion window. ``hold_n``: how
        many of a dispatch group's frames to ``dst`` are modeled (its ``group_n`` counts them
        all), the message size of its window wait."""
        if dst == self.rank:
            self.loop.call_soon(self._on_frame, frame,
                                time.monotonic() if at is None else self.wall(at))
            return True
        if not self.reachable[dst]:  # lost: a cut link would swallow the frame without an error
            return False
        if (self.holds is not None and at is not None and modeled
                and isinstance(frame.msg, TENSOR_MESSAGES)):
            frame = self._held(dst, frame, at, hold_n)
        ok = self.net.send(dst, frame, None if at is None else self.wall(at), modeled)
        if ok:
            self.stats["frames_out"] += 1
            if resolve is not None:
                self.unacked[dst].append((self.net.sent_frames[dst], resolve, on_ack))
        return ok

    def _held(self, dst: int, frame: Frame, at: float, hold_n: int | None = None) -> Frame:
        """``frame`` with its congestion-window wait (``net.transport: tcp``): a dispatch
        group is one message, as in the simulator, so its frames share the wait of the
        whole group (its ``hold_n`` modeled frames, else all ``group_n``), computed at its
        first frame."""
        m = frame.msg
        n = hold_n if hold_n is not None else getattr(m, "group_n", 1)
        got = None
        clock = self.holds[dst]
        if isinstance(m, KvData):  # one message of its bytes (``hold_n``: in hidden states)
            hold = clock.hold(at, n)
        elif n > 1:
            key = (dst, type(m), m.group)
            got = self._group_holds.pop(key, None)
            hold, left = got if got is not None else (clock.hold(at, n), n)
            if left > 1:
                self._group_holds[key] = (hold, left - 1)
        else:
            hold = clock.hold(at)
        if got is None and clock.last_wait > 0.0:  # a message's own window wait, counted once
            self.stats["tcp_waits"] = self.stats.get("tcp_waits", 0) + 1  # (the simulator's count)
            self.stats["tcp_wait_s"] = self.stats.get("tcp_wait_s", 0.0) + clock.last_wait
        if hold <= 0.0:
            return frame
        return patched(frame, hold_s=hold)

    def _acked(self, src: int, received: tuple[int, ...]) -> None:
        n = received[self.rank] if self.rank < len(received) else 0
        q = self.unacked.get(src)
        while q and q[0][0] <= n:
            on_ack = q.popleft()[2]
            if on_ack is not None:
                on_ack()

    def _on_grouped(self, frame: Frame, arrival: float) -> None:
        """A frame of a step's dispatch group (``engine.dispatch: step``): the group is taken
        when its last frame is in, every frame at that arrival, as the simulator's one
        message. A group a lost peer never completes stays here; its sender routes those
        layers again, and the late attempts make these stale."""
        m = frame.msg
        key = (m.src, m.group)
        got = self.grouped.setdefault(key, [])
        got.append((frame, arrival))
        if len(got) < m.group_n:
            return
        del self.grouped[key]
        last = max(a for _, a in got)
        for f, _ in got:  # each on its own: a frame that fails must not drop the rest
            self._handle(f, last)

    def _hidden_frame(self, msg: Hidden | Partial | Token, t: torch.Tensor,
                      dst: int | None = None) -> Frame:
        """Callers build ``msg`` with dtype FLOAT32 and shape (d,) so no copy of it is made.
        The frame is padded so that all of it on the wire (envelope, message fields, payload,
        padding) is the simulator's message, the real model's hidden state plus
        ``sim.header_bytes``; the emulator's own fields (137 bytes and up) take the place
        of that much padding, where they used to come on top of a padded hidden state.
        ``dst`` this server itself: the frame never meets the wire (``_send`` hands it to
        ``_on_frame``), so its head is not encoded. A pipeline stage hands most layers to
        itself: on fastbehindslow4's Petals at 80 req/s worker 0 framed 81,924 states, 79,596
        of them for itself, at about 60 us of wall time each (cProfile; README, "Emulator
        against simulator")."""
        if dst == self.rank:
            return tensor_frame(msg, t)
        return sized_frame(msg, t, self.wire_bytes)

    def _heard(self, src: int, arrival: float) -> None:
        """A peer's bytes came at ``arrival`` (the transport's ``on_heard``): it is alive."""
        if 0 <= src < self.N and arrival > self.last_heard[src]:
            gap = arrival - self.last_heard[src]
            if gap > self.max_gap[src]:
                self.max_gap[src] = gap
            self.last_heard[src] = arrival

    def _on_frame(self, frame: Frame, arrival: float) -> None:
        if self.stopping:
            return
        m = frame.msg
        if isinstance(m, (Hidden, Partial)) and m.group_n > 1:
            self._on_grouped(frame, arrival)
        else:
            self._handle(frame, arrival)

    def _handle(self, frame: Frame, arrival: float) -> None:
        """One frame's handler. An exception there is an emulator bug that loses the token
        (a request then fails at the drain cap): it is counted (``handler_errors``, a
        fidelity flag of the run) and logged with its traceback, and the server goes on."""
        m = frame.msg
        try:
            if isinstance(m, Hidden):
                self._on_hidden(frame, arrival)
            elif isinstance(m, Partial):
                self._on_partial(frame, arrival)
            elif isinstance(m, Token):
                self._on_token(frame, arrival)
            elif isinstance(m, State):
                if arrival <= self._tick_wall:  # due by a tick the loop ran before it
                    self.stats["state_after_tick"] = self.stats.get("state_after_tick", 0) + 1
                    self.peer_backlog[m.src] = m.backlog_s
                else:
                    self.heard[m.src].append((arrival, m.backlog_s))
                self.peer_alive[m.src] = m.alive
                if m.finished and self.kv_room is not None:  # their K/V leave this cache
                    for r in m.finished:
                        self.kv_room.free(r)
                    self.stats["kv_state_frees"] = self.stats.get("kv_state_frees", 0) + len(m.finished)
                if m.received:
                    self._acked(m.src, m.received)
            elif isinstance(m, Feedback):
                self._on_feedback(m)
            elif isinstance(m, Fail):
                self._on_fail(m)
            elif isinstance(m, Custody):
                self._on_custody(m)
            elif isinstance(m, (*KV_CONTROL, KvData)):
                self._on_kv(m, arrival)
        except Exception:  # one bad token must not take the server down
            self.stats["handler_errors"] = self.stats.get("handler_errors", 0) + 1
            self._log(f"error handling a {type(m).__name__} frame:\n" + traceback.format_exc())
