"""Faults: lost peers, timeouts, and tokens that cannot continue.

When a peer is lost, whatever it has not acknowledged is resolved at once by
whoever holds the hidden state (``peers``): a hidden state or partial that did
not arrive makes its sender re-route the layer from where it is, as the
aggregator does when a participant's partial cannot come. A token that cannot
continue is reported to its home (FAIL, with the reason; relayed through
another peer when the home cannot be reached directly) and its request
recorded as failed there. Timeouts are armed only in runs that inject faults.
"""

from __future__ import annotations

import traceback
from collections import deque

from ..wire import Fail, Frame, Hidden, Token, fail


class Faults:
    def _check_timeouts(self) -> None:
        if not self.cfg.faults:
            return
        t = self.now()
        for key, g in list(self.gathers.items()):
            if self._stale(key):
                del self.gathers[key]
            elif g.msg is not None and t - g.opened > self.cfg.layer_timeout_s:
                self._reroute(g, "layer timed out")
        for rq in self.requests.values():
            if not rq.done and t - rq.arrival > self.cfg.request_timeout_s:
                self._request_failed(rq, "timeout")

    def _peer_lost(self, peer: int, why: str) -> None:
        if not self.reachable[peer]:
            return
        self.reachable[peer] = False
        self.view.alive[peer] = False
        self.view.faultless = False
        self._log(f"peer {peer} unreachable: {why}")
        if self.stopping:
            return
        pending, self.unacked[peer] = self.unacked[peer], deque()
        for _, resolve in pending:  # sent, never acknowledged: lost with the link
            self.stats["resolved_unacked"] += 1
            try:
                resolve(peer)
            except Exception:
                self._log("error resolving a lost frame:\n" + traceback.format_exc())
        for g in list(self.gathers.values()):
            if g.msg is not None and peer in self._participants(g.msg) and peer not in g.partials:
                self._reroute(g, f"participant {peer} lost")

    def _token_failed(self, tok: Token | Hidden, reason: str) -> None:
        self.stats["failed_tokens"] += 1
        home = tok.home
        if home == self.rank:
            rq = self.requests.get(tok.request)
            if rq is not None:
                self._request_failed(rq, reason)
            return
        frame = Frame(fail(self.rank, home, tok.request, tok.token, reason))
        if not (self.reachable[home] and self._send(home, frame, lambda _: self._relay_fail(frame))):
            self._relay_fail(frame)

    def _relay_fail(self, frame: Frame) -> None:
        """The home cannot be reached from here: hand the FAIL to a peer that forwards it."""
        home = frame.msg.home
        for peer in range(self.N):
            if peer not in (self.rank, home) and self.reachable[peer] and self._send(peer, frame):
                self.stats["fails_relayed"] += 1
                return
        self._log(f"FAIL of request {frame.msg.request} cannot reach its home {home}")

    def _on_fail(self, m: Fail) -> None:
        reason = m.reason or f"token failed at server {m.src}"
        if m.home != self.rank:  # relayed: forward to the home
            if m.src != self.rank and self.reachable[m.home]:
                self._send(m.home, Frame(fail(self.rank, m.home, m.request, m.token, reason)))
            return
        rq = self.requests.get(m.request)
        if rq is not None:
            self._request_failed(rq, reason)
