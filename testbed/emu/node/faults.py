"""Faults: lost peers, timeouts, and tokens that cannot continue.

When a peer is lost, whatever it has not acknowledged is resolved at once by
whoever holds the hidden state (``peers``): a hidden state or partial that did
not arrive makes its sender re-route the layer from where it is, as the
aggregator does when a participant's partial cannot come. A token that cannot
continue is reported to its home (FAIL, with the reason; relayed through
another peer when the home cannot be reached directly) and its request
recorded as failed there. Timeouts are armed only in runs that inject faults.

A token inside a server that dies (the server summing its layer, or routing its
next one) is known to nobody else: its frames were acknowledged. So in runs that
inject faults every server tells each home, every window, which of its tokens it
holds (CUSTODY), and a home keeps each token's latest holder. A home that hands a
token's layer on itself also takes the aggregator's acknowledgement of it as custody
(``hand_off_acked``): a server that dies less than a window after the hand-off has sent
no report of the token yet (a pipeline's first stage killed a few ms after a request
arrived at its home waited for the drain cap). When a lost peer is
heard by no peer either (dead, not behind a cut link), ``CUSTODY_GRACE`` windows
after the loss the home fails the requests whose tokens it last knew there, as
the simulator fails a token whose residing server died. (A cut link does not do
it: the server lives on and fails what it cannot send home itself.)
"""

from __future__ import annotations

import time
import traceback
from collections import deque

from ..wire import MAX_HELD, Custody, Fail, Frame, Held, Hidden, Token, fail

#: windows after a peer's loss before its tokens are given up: a token it handed on just
#: before dying is reported by its new holder within a window and its link's delay
CUSTODY_GRACE = 2


class Faults:
    """Owns ``holding``, ``custody``, ``lost_at`` and ``peer_alive``."""

    def _init_faults(self) -> None:
        #: (request, token) -> home of the tokens this server routes next (between a layer's
        #: start here and its dispatch); with the layers it sums (``gathers``) what it holds
        self.holding: dict[tuple[int, int], int] = {}
        #: at a home, request -> token -> (server, model time) of its latest holder reported
        self.custody: dict[int, dict[int, tuple[int, float]]] = {}
        self.lost_at: dict[int, float] = {}  # lost peer -> wall time of the loss
        self.peer_alive: dict[int, tuple[bool, ...]] = {}  # peer -> who it hears (its STATE)

    def _send_custody(self) -> None:
        """Each home the tokens of its requests held here (runs with faults only)."""
        per_home: dict[int, list[Held]] = {}
        for (rid, tok), home in self.holding.items():
            per_home.setdefault(home, []).append(Held(rid, tok))
        for g in self.gathers.values():
            if g.msg is not None:
                per_home.setdefault(g.msg.home, []).append(Held(g.key[0], g.key[1]))
        t = self.now()
        for home, held in per_home.items():
            if home == self.rank:
                self._on_custody(Custody(self.rank, t, tuple(held)))
            elif self.reachable[home]:
                for i in range(0, len(held), MAX_HELD):
                    self._send(home, Frame(Custody(self.rank, t, tuple(held[i:i + MAX_HELD]))))

    def _on_custody(self, m: Custody) -> None:
        for rid, tok in m.held:
            rq = self.requests.get(rid)
            if rq is None or rq.done:
                continue
            toks = self.custody.setdefault(rid, {})
            if tok not in toks or toks[tok][1] <= m.t_send:
                toks[tok] = (m.src, m.t_send)

    def hand_off_acked(self, holder: int, rid: int, tok: int, t_send: float) -> None:
        """At a home (runs with faults only): ``holder`` acknowledged the state of this home's
        token, sent at model time ``t_send``; it holds it now, until a later report says
        otherwise."""
        self._on_custody(Custody(holder, t_send, (Held(rid, tok),)))

    def _check_custody(self) -> None:
        """Fail the requests whose tokens were last held by a peer that nobody hears."""
        for rid in [r for r in self.custody if self.requests[r].done]:
            del self.custody[rid]
        grace = CUSTODY_GRACE * self.window * self.T
        now = time.monotonic()
        for p, since in list(self.lost_at.items()):
            if now - since < grace:
                continue
            if any(self.reachable[q] and self.peer_alive.get(q, ())[p:p + 1] == (True,)
                   for q in range(self.N) if q not in (self.rank, p)):
                continue  # heard by a peer: alive behind a cut link, failing what it must itself
            del self.lost_at[p]
            why = f"server {self.setup.cluster.names[p]} lost holding a token"
            for rid, toks in list(self.custody.items()):
                rq = self.requests[rid]
                if any(s == p and tok not in rq.finished for tok, (s, _) in toks.items()):
                    self.stats["custody_failed"] = self.stats.get("custody_failed", 0) + 1
                    self._request_failed(rq, why)

    def _fault_tick(self) -> None:
        """Each window, in runs that inject faults: custody reports and checks, timeouts."""
        if not self.cfg.faults:
            return
        self._send_custody()
        self._check_custody()
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
        self.lost_at[peer] = time.monotonic()
        self.view.alive[peer] = False
        self.view.faultless = False
        self._log(f"peer {peer} unreachable: {why}")
        if self.stopping:
            return
        pending, self.unacked[peer] = self.unacked[peer], deque()
        for _, resolve, _ in pending:  # sent, never acknowledged: lost with the link
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
        self.holding.pop((tok.request, tok.token), None)
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
