"""Aggregation: the server named in a token-layer's HIDDEN frames sums the
participants' partials into the residual, writes the token-layer record, feeds
the router back, and hands the token on: to itself for the next layer, or home
with the output after the last one (TOKEN, final).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hetroute.state import Assignment, TokenView

from ...core import Routed
from ..wire import DType, Feedback, Frame, Hidden, Ran, Token


@dataclass
class Gather:
    """The aggregator's view of one token-layer attempt."""

    key: tuple  # (request, token, layer, seq)
    msg: Hidden | None = None  # the attempt's HIDDEN message, once it arrived
    hidden: torch.Tensor | None = None
    #: participant -> (partial sum, t_arrived, t_computed, arrival here (model s), positions run)
    partials: dict[int, tuple[torch.Tensor, float, float, float, tuple[Ran, ...]]] = \
        field(default_factory=dict)
    opened: float = 0.0


class Aggregation:
    """Owns ``gathers``."""

    def _init_aggregation(self) -> None:
        self.gathers: dict[tuple, Gather] = {}
        #: (request, token, layer) -> seqs of its attempts opened here, until one completes:
        #: finds a layer's other attempts without a scan of every open gather per frame
        self.attempts: dict[tuple, set[int]] = {}

    def _gather(self, key: tuple) -> Gather:
        g = self.gathers.get(key)
        if g is None:
            g = self.gathers[key] = Gather(key, opened=self.now())
            self.attempts.setdefault(key[:3], set()).add(key[3])
        return g

    def _on_partial(self, frame: Frame, arrival: float) -> None:
        m = frame.msg
        key = (m.request, m.token, m.layer, m.seq)
        g = self.gathers.get(key)
        if g is None and self._stale(key):
            return
        g = self._gather(key)
        g.partials[m.src] = (frame.tensor().clone(), m.t_arrived, m.t_computed,
                             (arrival - self.t0) / self.T, m.ran)
        self._maybe_complete(g)

    def _on_feedback(self, m: Feedback) -> None:
        """A token-layer this server routed is done elsewhere."""
        self._feedback((m.request, m.token, m.layer, m.seq), m.fan_out_end, m.compute_end,
                       m.t_done, m.nbytes, m.participants, m.gpus)

    def _feedback(self, key: tuple, fan_out_end: float, compute_end: float, t_done: float,
                  nbytes: int, participants: int, gpus) -> None:
        """The decider that routed the attempt ``key`` gets its whole ``TokenLayerRecord``:
        built here, from the decision kept at dispatch and what the aggregator measured, by
        the core that built the aggregator's (the same fields). Its window is the one this
        server is in: the aggregator's may be another (the frame crossed a window boundary,
        or the peers' window timers differ by the loop's lag), and a decider's windows never
        go back, as in the simulator, whose records and decisions share one window counter."""
        kept = self.decided.pop(key, None)
        if kept is None:  # forgotten (over ``DECISIONS_KEPT``) or never decided here
            self.stats["feedback_unmatched"] += 1
            return
        tv, routed, t_layer, t_dec, t_disp = kept
        self.decider.on_layer_done(self.core.record(
            tv, routed, list(gpus), t_layer, t_dec, t_disp, fan_out_end, compute_end, t_done,
            nbytes, participants, self.view.window))

    def _stale(self, key: tuple) -> bool:
        """A later attempt of the same token-layer is open: this one was abandoned."""
        layer_key, seq = key[:3], key[3]
        return any(s > seq and (*layer_key, s) in self.gathers
                   for s in self.attempts.get(layer_key, ()))

    def _maybe_complete(self, g: Gather) -> None:
        h = g.msg
        if h is None or len(g.partials) < h.n_participants:
            return
        del self.gathers[g.key]
        layer_key, seq = g.key[:3], g.key[3]
        later = set()
        for s in self.attempts.pop(layer_key, ()):
            if s < seq:
                self.gathers.pop((*layer_key, s), None)  # an abandoned attempt of this layer
            elif s > seq and (*layer_key, s) in self.gathers:
                later.add(s)
        if later:
            self.attempts[layer_key] = later
        # the layer ends when its last partial arrived (model time, the simulator's fan-in end),
        # not when this loop got round to it
        t = max(h.t_dispatch, max(p[3] for p in g.partials.values()))
        picks = h.assignment
        if self.inrun is not None and g.hidden is not None:
            out = self.inrun.combine(h.layer, g.hidden, [p[0] for p in g.partials.values()])
        else:  # folded (no state here): the one partial carries the residual (compute.py)
            out = torch.zeros(self.d) if g.hidden is None else g.hidden.clone()
            for part in g.partials.values():
                out += part[0]
            if self.inrun is None:
                out = out / out.pow(2).mean().clamp_min(1e-12).sqrt()
        theta = h.src  # the residing server sent the state
        gpus = [True] * len(picks)
        for *_, ran in g.partials.values():
            for pos, on_gpu in ran:
                if pos < len(picks):
                    gpus[pos] = on_gpu
        fo_end = max(p[1] for p in g.partials.values())
        comp_end = max(p[2] for p in g.partials.values())
        t_disp = h.t_dispatch
        remote_parts = [n for n in g.partials if n != theta]
        n_bytes = self.hidden_bytes * (len(remote_parts) + sum(1 for n in g.partials if n != self.rank))
        last = h.layer == self.L - 1
        if last and h.home != self.rank:
            n_bytes += self.hidden_bytes
        decision_s = h.decision_us * 1e-6
        a = Assignment(tuple(p.target for p in picks), tuple(p.replica for p in picks),
                       tuple(p.mode for p in picks), self.rank,
                       est_delay=float("nan") if h.est_delay_us < 0 else h.est_delay_us * 1e-6)
        dq = self.core.increment(a.targets, a.replicas)  # derived here too, not read off the wire
        routed = Routed(a, {}, decision_s, h.view_age_us * 1e-6, h.backlog_err_us * 1e-6, dq)
        tv = TokenView(h.request, h.token, h.home, 0.0, server=theta, layer=h.layer)
        rec = self.core.record(tv, routed, gpus, h.t_layer, t_disp - decision_s, t_disp, fo_end,
                               comp_end, t, n_bytes, len(g.partials), self.view.window)
        self.writer.token_layer(rec)
        self.stats["token_layers"] += 1
        # recorded where the layer aggregates; fed back to the decider that routed it (the
        # simulator's rule): here, or at the residing server by a FEEDBACK frame
        if theta == self.rank:
            self._feedback(g.key, fo_end, comp_end, t, n_bytes, len(g.partials), gpus)
        else:
            self._send(theta, Frame(Feedback(self.rank, h.request, h.token, h.layer, h.seq,
                                             rec.window, fo_end, comp_end, t, n_bytes,
                                             len(g.partials), tuple(gpus))), at=t)
        lam = float(h.lam_acc) + dq
        if not last:
            self._begin_layer(Token(src=self.rank, request=h.request, token=h.token,
                                    layer=h.layer + 1, seq=h.seq, home=h.home, lam_acc=lam,
                                    final=False, router_ctx=h.router_ctx), out, t)
            return
        final = Token(src=self.rank, request=h.request, token=h.token, layer=self.L, seq=h.seq,
                      home=h.home, lam_acc=lam, final=True, dtype=DType.FLOAT32, shape=(self.d,))
        why = f"home {self.setup.cluster.names[h.home]} unreachable"
        if not self._send(h.home, self._hidden_frame(final, out, h.home),
                          lambda _, final=final, why=why: self._token_failed(final, why), at=t):
            self._token_failed(final, why)
