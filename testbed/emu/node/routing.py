"""Routing at the token's residing server: the dense part, the decision on this
server's own ``StateView``, and the fan-out of the hidden state (one HIDDEN frame
per participant and the aggregator, each carrying the whole assignment). Where
this server is the layer's only participant and another server sums it (a
pipeline's hand-off), the residual rides in this server's partial and the
aggregator's frame is the header alone: one hidden state crosses, as the
simulator charges and as an engine that folds the residual sends.

A hidden state that cannot be delivered, or a layer whose partial is lost, is
routed again from the server holding the state: at most two retries per layer,
as in the simulator; the third loss fails the token.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import replace

import numpy as np
import torch

from hetroute.state import TokenView, Unroutable

from ...core import Routed
from ...steps import DENSE, Job
from ..stream import Work
from ..wire import DType, Frame, Hidden, Pick, Token, patched, tensor_frame

ROUTING_CACHE = 4096  # requests whose trace routing is kept
DECISIONS_KEPT = 1 << 16  # decisions kept for their feedback (then the oldest go)
EMPTY = torch.empty(0)  # the payload of a folded layer's HIDDEN frame to its aggregator


class Routing:
    """Owns ``routing_cache``, ``cpu_free``, ``decision_cpu`` and ``relayered``."""

    def _init_routing(self) -> None:
        self.routing_cache: dict[int, tuple] = {}
        self.cpu_free = 0.0  # model time this server's CPU is free of routing decisions
        self.measured_decisions = self.spec.engine.decision_s == "measured"
        self.decision_cpu: list[float] = []  # measured CPU seconds per decision (wall, not dilated)
        self.relayered: set[tuple] = set()  # token-layer attempts already re-routed or failed here
        #: (request, token, layer, seq) -> (view, routed, t_layer, t_dec, t_disp) of the
        #: decisions made here, until the layer's FEEDBACK makes their record (aggregation.py)
        self.decided: OrderedDict[tuple, tuple] = OrderedDict()
        #: wall seconds the worker's own Python adds per hop (reported in w<rank>.json): from a
        #: frame's modeled send time to its write (dispatch after the decision; partial after
        #: its step's end) and from a frame's arrival to its jobs being queued
        self.hop_dispatch: list[float] = []
        self.hop_partial: list[float] = []
        self.hop_queue: list[float] = []

    def _routing(self, rid: int, n_tokens: int):
        """(global expert ids [token][layer][k], gate weights) of a request, from the trace."""
        got = self.routing_cache.get(rid)
        if got is None:
            r = self.setup.routing(rid, n_tokens)
            E = self.setup.shape.experts_per_layer
            glob = np.asarray(r.experts) + (np.arange(self.L) * E)[None, :, None]
            got = (glob.tolist(), np.asarray(r.weights, dtype=np.float32))
            self.routing_cache[rid] = got
            if len(self.routing_cache) > ROUTING_CACHE:
                del self.routing_cache[next(iter(self.routing_cache))]  # the oldest
        return got

    def _warm_routing(self) -> float:
        """Route every request of the run through the trace before the run starts (up to
        ``ROUTING_CACHE`` of them, in arrival order); returns the wall seconds it took.

        Left to a request's first decision here, this took about 15 ms of wall time per
        request (a 36-token Mixtral prompt through 32 layers of the synthetic trace, on
        the project's 2-core VM), on that decision's critical path: at T = 32 each
        request's first layer left its home 0.3-2 ms (emulated) later than on the
        simulator, which routes from the same trace in no simulated time; found by lining
        up both backends' steps (``python -m analysis compare-steps``; README, "Emulator
        against simulator")."""
        t0 = time.perf_counter()
        for rq in sorted(self.setup.requests, key=lambda r: r.arrival_s)[:ROUTING_CACHE]:
            self._routing(rq.id, rq.prompt_tokens + rq.gen_tokens)
        return time.perf_counter() - t0

    def _n_tokens(self, rid: int, tok: Token | Hidden) -> int:
        rq = self.setup.requests[rid] if rid < len(self.setup.requests) else None
        return rq.prompt_tokens + rq.gen_tokens if rq is not None else int(tok.token) + 1

    def _prio(self, rid: int) -> float:
        """The request's arrival: older requests first in every step (steps.py)."""
        rq = self.setup.requests[rid] if 0 <= rid < len(self.setup.requests) else None
        return rq.arrival_s if rq is not None else 0.0

    def _begin_layer(self, tok: Token, h: torch.Tensor, t_layer: float | None = None) -> None:
        """``t_layer``: the model time the token reached this server (its layer's start);
        now when not given."""
        t_layer = self.now() if t_layer is None else t_layer
        self.holding[(tok.request, tok.token)] = tok.home  # until its dispatch (faults.py)
        if self.inrun is not None:  # the layer's attention (and dense block) runs here
            h = self.inrun.attend(tok.request, tok.token, tok.layer, h)
        if not self.hardware:  # the paper's world: a per-token delay outside the stream
            self.loop.call_at(self.wall(t_layer + self.dense_s), self._decide, tok, h, t_layer, 0)
            return
        if self.causal:  # once its request's earlier K/V of the layer are here (kv.py)
            self._attend(tok, h, t_layer, t_layer)
            return
        self._submit_dense(tok, h, t_layer, t_layer)

    def _submit_dense(self, tok: Token, h: torch.Tensor, t_layer: float, t: float) -> None:
        """The token's dense part joins this server's stream at model time ``t``."""
        rid, index = tok.request, tok.token
        self.stream.submit(Job(tok.layer, DENSE, (rid, index), rid, index, t,
                               Work(owner=(tok, h, t_layer)), self._prio(rid)))

    def _decide(self, tok: Token, h: torch.Tensor, t_layer: float, retries: int,
                t_dec: float | None = None) -> None:
        """``t_dec``: the model time the decision may start (the dense step's end); now when
        not given (a re-route)."""
        if self.stopping:
            return
        got = self._route(tok, h, t_dec)
        if got is None:
            return
        tv, routed, t_dec, t_disp = got
        if self.wall(t_disp) > time.monotonic():  # its frames are built while it waits
            built = self._outgoing(tok, h, t_layer, retries, tv, routed, t_dec, t_disp)
            self.loop.call_at(self.wall(t_disp), self._dispatch, tok, h, t_layer, retries,
                              tv, routed, t_dec, t_disp, None, built)
        else:
            self._dispatch(tok, h, t_layer, retries, tv, routed, t_dec, t_disp)

    def _decide_step(self, cohort: list[tuple]) -> None:
        """``engine.dispatch: step``: the tokens whose dense part ended in one step are decided
        one after another on this server's CPU, then leave together when the last decision is
        done, each destination's frames as one group (the simulator's one message). Their
        frames are built while the decisions' charged time runs (``_outgoing``) and written
        together, one write per destination (``_together``)."""
        routed_all = []
        last = 0.0
        for tok, h, t_layer, t_end in cohort:
            got = self._route(tok, h, t_end)
            if got is not None:
                routed_all.append((tok, h, t_layer, got))
                last = max(last, got[3])
        if not routed_all:
            return
        oks, counts, held = self._grouping(routed_all)
        self._groups += 1
        group = (self._groups, counts, held)
        built = [self._outgoing(tok, h, t_layer, 0, tv, routed, t_dec, last, group if ok else None)
                 for ok, (tok, h, t_layer, (tv, routed, t_dec, _)) in zip(oks, routed_all)]
        if self.wall(last) > time.monotonic():
            self.loop.call_at(self.wall(last), self._dispatch_step, routed_all, last, oks, group, built)
        else:
            self._dispatch_step(routed_all, last, oks, group, built)

    def _grouping(self, routed_all: list[tuple]
                  ) -> tuple[list[bool], dict[int, int], dict[int, int]]:
        """Which decided tokens go in the step's dispatch group (all their destinations
        reachable), how many frames of it each destination gets, and how many of those the
        simulator sends (to a participant; an aggregator that runs none of a token's experts
        gets a frame the simulator does not send): the size of the one message whose
        congestion-window wait the group's frames share. Counted with every frame, a group
        waited for bytes the simulator's message does not hold: 24.8 us more than the
        simulator's fan-out, three hidden states at 8 Gbit/s, on asym5's first prompt
        (HetRoute, 10 req/s, ``python -m analysis first-fork``)."""
        counts: dict[int, int] = {}
        held: dict[int, int] = {}
        oks = []
        for *_, (tv, routed, t_dec, _) in routed_all:
            dests = set(routed.per_server) | {int(routed.assignment.next_server)}
            ok = all(n == self.rank or self.reachable[n] for n in dests)
            if ok:
                for n in dests:
                    counts[n] = counts.get(n, 0) + 1
                for n in routed.per_server:
                    held[n] = held.get(n, 0) + 1
            oks.append(ok)
        return oks, counts, held

    def _dispatch_step(self, routed_all: list[tuple], t_disp: float, oks: list[bool],
                       group: tuple[int, dict[int, int]], built: list) -> None:
        """A token with a destination already lost goes on its own (its dispatch fails and
        routes again), so that every group it would have joined still completes. Where a
        peer was lost since the frames were built, the group is formed and built again."""
        regrouped = self._grouping(routed_all)
        if regrouped[:2] != (oks, group[1]):
            oks, counts, held = regrouped
            self._groups += 1
            group = (self._groups, counts, held)
            built = [None] * len(routed_all)
        with self._together():  # one write per destination
            for ok, b, (tok, h, t_layer, (tv, routed, t_dec, _)) in zip(oks, built, routed_all):
                self._dispatch(tok, h, t_layer, 0, tv, routed, t_dec, t_disp, group if ok else None, b)

    def _route(self, tok: Token, h: torch.Tensor, t_dec: float | None):
        """Decide the token's layer and charge the decision to this server's CPU: (view,
        routed, decision start, dispatch time), or None where it failed."""
        t_dec = self.now() if t_dec is None else t_dec
        rid, index, layer = tok.request, tok.token, tok.layer
        n_tok = self._n_tokens(rid, tok)
        targets = tuple(self._routing(rid, n_tok)[0][index][layer])
        tv = TokenView(rid, index, tok.home, self.spec.quality.budget, server=self.rank,
                       layer=layer, lam_acc=float(tok.lam_acc), now=t_dec)
        tv.ctx = tuple(tok.router_ctx) if tok.router_ctx else None
        try:
            routed = self.core.decide(self.decider, self.residency, self.view, tv, targets,
                                      self._true_backlog)
        except Unroutable as err:
            self._token_failed(tok, str(err))
            return None
        # the decision's charge (``engine.decision_s``, as the simulator charges it: the
        # calibrated constant, a fixed number, or with ``measured`` its own CPU time) is
        # emulated time, not divided by T: the dispatch waits for it, behind earlier
        # decisions of this server's CPU. The measured time is kept for the fidelity report
        self.decision_cpu.append(routed.decision_s)
        cost = routed.decision_s if self.measured_decisions else self.setup.decision_s
        start = self.cpu_free if self.cpu_free > t_dec else t_dec
        self.cpu_free = t_disp = start + cost
        return tv, routed, t_dec, t_disp

    def _true_backlog(self, n: int) -> float:
        return self.stream.backlog() if n == self.rank else self.peer_backlog[n]

    def _outgoing(self, tok: Token, h: torch.Tensor, t_layer: float, retries: int,
                  tv: TokenView, routed: Routed, t_dec: float, t_disp: float,
                  group: tuple[int, dict[int, int], dict[int, int]] | None = None
                  ) -> tuple[Hidden, dict]:
        """The HIDDEN message of a decided token-layer and its frame per destination (the
        participants and the aggregator, in sending order), encoded. Built before the
        dispatch time, while the decision's charged time runs: built at that time they were
        on the hop's path, serially over a step's tokens (dispatch 2.2-6.1 ms of wall time
        late at the median per worker; asym5, Prism at 10 req/s, T = 32). Built ahead, a
        worker's first 36-token prompt took 8-15 ms of wall time to frame, 4.9-5.2 ms after
        the codec's warm-up (``wire.warm_codec``), inside the decisions' charged 7.8 ms: its
        dispatch now leaves 0.15-0.25 ms late (README, "Emulator against simulator")."""
        a = routed.assignment
        participants = sorted(routed.per_server)
        rid, index, layer = tv.request, tv.index, tv.layer
        out = Hidden(
            src=self.rank, request=rid, token=index, layer=layer, seq=tok.seq + 1 + retries,
            retries=retries, home=tok.home, aggregator=int(a.next_server),
            n_participants=len(participants), lam_acc=float(tok.lam_acc), t_layer=t_layer,
            t_dispatch=t_disp, view_age_us=int(round(routed.view_age_s * 1e6)),
            backlog_err_us=int(round(routed.backlog_err_s * 1e6)),
            decision_us=int(round((t_disp - t_dec) * 1e6)),
            assignment=tuple(Pick(int(e), int(r), int(m))
                             for e, r, m in zip(a.targets, a.replicas, a.modes)),
            router_ctx=tuple(tv.ctx) if tv.ctx else (), dtype=DType.FLOAT32, shape=(self.d,),
            est_delay_us=int(round(a.est_delay * 1e6)) if 0 <= a.est_delay < 1e6 else -1)
        agg = int(a.next_server)
        folded = self._folded(out)  # the same rule the receivers apply (compute.py)
        frames: dict[int, Frame] = {}
        state = None  # one encoding of the state; a group's count patched per destination
        dests = sorted(set(participants) | {agg})
        local = all(n == self.rank for n in dests if not (folded and n == agg))
        for n in dests:
            if folded and n == agg:  # the header: no state, no padding
                msg = out if group is None else replace(out, group=group[0], group_n=group[1][n])
                frames[n] = tensor_frame(msg, EMPTY)
                continue
            if state is None:  # the state only for this server itself: never on the wire
                state = self._hidden_frame(out, h, self.rank if local else None)
            frames[n] = state if group is None else patched(state, group=group[0],
                                                             group_n=group[1][n])
        return out, frames

    def _dispatch(self, tok: Token, h: torch.Tensor, t_layer: float, retries: int,
                  tv: TokenView, routed: Routed, t_dec: float, t_disp: float,
                  group: tuple[int, dict[int, int], dict[int, int]] | None = None,
                  built=None) -> None:
        """``group``: (id, frames per destination, modeled frames per destination) of a step's
        dispatch (``_dispatch_step``);
        ``built``: what ``_outgoing`` made of it ahead of this time (made now if None)."""
        if self.stopping:
            return
        a = routed.assignment
        if a.prefetch:  # queued at the modeled dispatch, as the simulator queues them
            self._prefetch(a.prefetch, t_disp)
        if built is None:
            built = self._outgoing(tok, h, t_layer, retries, tv, routed, t_dec, t_disp, group)
        out, frames = built
        rid, index, layer = tv.request, tv.index, tv.layer
        agg = int(a.next_server)
        key = (rid, index, layer, out.seq)
        self.decided[key] = (tv, routed, t_layer, t_dec, t_disp)
        if len(self.decided) > DECISIONS_KEPT:
            self.decided.popitem(last=False)

        def lost(peer: int) -> None:  # the state never reached ``peer``: route again from here
            self._relayer(key, out, h, f"server {self.setup.cluster.names[peer]} lost")
        # the aggregator needs the state even where it runs none of the targets (it sums the
        # partials into it), unless this server, the only participant, folds it in its partial
        self._hop(self.hop_dispatch, t_disp)
        for n, f in frames.items():
            acked = None
            if n == agg and tok.home == self.rank and self.cfg.faults:
                def acked(n=n) -> None:  # the aggregator holds it: this home's custody of it
                    self.hand_off_acked(n, rid, index, t_disp)
            if not self._send(n, f, lost, at=t_disp, modeled=n in routed.per_server, on_ack=acked,
                              hold_n=None if group is None else group[2].get(n, 0)):
                self.relayered.add(key)  # retried below; what was sent of it is stale
                self.view.alive[n] = False
                self.view.faultless = False
                if retries < 2:
                    self.stats["retries"] += 1
                    self.loop.call_at(self.wall(self.now() + self.window), self._decide, tok, h,
                                      t_layer, retries + 1)
                else:
                    self._token_failed(tok, f"cannot reach server {n}")
                return
        self.holding.pop((rid, index), None)  # its holder is now the aggregator

    def _participants(self, h: Hidden) -> set[int]:
        return {self.dep.replicas[p.replica].server for p in h.assignment}

    def _folded(self, h: Hidden) -> bool:
        """The residing server is the layer's only participant and another server sums it:
        its partial carries the residual, and the aggregator's HIDDEN frame only the header
        (``_dispatch``)."""
        return h.aggregator != h.src and self._participants(h) == {h.src}

    def _reroute(self, g, why: str) -> None:
        """A participant or partial is lost: route the layer again from here. A folded
        layer's state is held only by its residing server, the lost participant: the token
        fails, as the simulator fails a token whose residing server died. (Where that server
        lives on behind a cut link, it also routes the layer again; the home records the
        request once, failed.)"""
        self.gathers.pop(g.key, None)
        if g.msg is None:
            return
        if g.hidden is None:
            if g.key not in self.relayered:
                self.relayered.add(g.key)
                self._token_failed(g.msg, why)
            return
        self._relayer(g.key, g.msg, g.hidden, why)

    def _relayer(self, key: tuple, h: Hidden, hidden: torch.Tensor | None, why: str) -> None:
        """Route attempt ``key`` (sent as ``h``, with its state) again from this server, once;
        the third loss of one layer fails the token, as in the simulator."""
        if key in self.relayered or hidden is None or self.stopping:
            return
        self.relayered.add(key)
        self.gathers.pop(key, None)
        if h.retries >= 2:
            self._token_failed(h, why)
            return
        self.stats["retries"] += 1
        tok = Token(src=self.rank, request=h.request, token=h.token, layer=h.layer, seq=h.seq,
                    home=h.home, lam_acc=h.lam_acc, final=False, router_ctx=h.router_ctx)
        self.holding[(h.request, h.token)] = h.home
        self._decide(tok, hidden, h.t_layer, h.retries + 1)
