"""The participant's side, glued to the modeled GPU stream (``stream.py``).

A participant computes its experts' outputs at once (eagerly, in this thread)
and queues the jobs on its modeled stream: FIFO, every queued job of the same
replica coalesced into one batch, a CPU-resident replica paying its load once
per batch, times T. Results are released at the modeled batch end; once all of
a token-layer's jobs here are released, their gate-weighted sum goes to the
aggregator (PARTIAL). The dense part of a layer is a job in the same stream.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ...steps import DENSE, Copy, Job
from ..stream import Work
from ..wire import DType, Frame, Hidden, Partial, Ran, patched


@dataclass
class Participation:
    """This server's share of one token-layer attempt."""

    key: tuple  # (request, token, layer, seq)
    msg: Hidden
    jobs_left: int
    partial: torch.Tensor
    arrival: float  # model time the hidden state arrived
    hidden: torch.Tensor | None = None  # the state as received: re-routed from here if the partial is lost
    gpus: dict[int, bool] = field(default_factory=dict)  # assignment position -> ran on GPU
    frame: Frame | None = None  # the PARTIAL, built once the step that completes it has run


class Compute:
    """Owns ``parts`` (open participations)."""

    def _init_compute(self) -> None:
        self.parts: dict[tuple, Participation] = {}
        #: ``engine.dispatch: step``: what the step being released hands on, sent together
        #: by ``_flush_step`` (dense parts to decide; partials per aggregator)
        self._cohort: list[tuple] = []
        self._out_partials: dict[int, list[tuple[Participation, float]]] = {}
        self._groups = 0  # this server's dispatch groups so far (the wire's ``group``)

    def _on_hidden(self, frame: Frame, arrival: float) -> None:
        h = frame.msg
        key = (h.request, h.token, h.layer, h.seq)
        folded = self._folded(h)
        if folded and h.aggregator == self.rank:  # the header: the state comes in the partial
            g = self._gather(key)
            g.msg, g.hidden, g.opened = h, None, h.t_dispatch
            self._maybe_complete(g)
            return
        x = frame.tensor().clone()
        received = x
        if h.aggregator == self.rank:
            g = self._gather(key)
            g.msg, g.hidden, g.opened = h, x, h.t_dispatch
            self._maybe_complete(g)
        mine = [(j, p.replica) for j, p in enumerate(h.assignment)
                if self.dep.replicas[p.replica].server == self.rank]
        if not mine:
            return
        if self.inrun is not None:  # gate weights from the real state, routing fixed (as replay)
            x, w = self.inrun.expert_input(h.layer, x, [p.target for p in h.assignment])
        else:
            _, weights = self._routing(h.request, self._n_tokens(h.request, h))
            w = weights[h.token, h.layer]
        t_arr = (arrival - self.t0) / self.T
        if not folded:
            start = torch.zeros(self.d)
        elif self.inrun is not None:  # the residual and what the aggregator adds to it
            start = self.inrun.combine(h.layer, received, [])
        else:
            start = received.clone()
        p = Participation(key, h, len(mine), start, t_arr, hidden=received)
        self.parts[key] = p
        rid, index, prio = h.request, h.token, self._prio(h.request)
        for j, r in mine:
            self.stream.submit(Job(h.layer, r, (rid, index), rid, index, t_arr,
                                   Work(x, p, float(w[j]), j), prio))
        self.hop_queue.append(time.monotonic() - arrival)

    def _step_ran(self, jobs: list[Job], t_end: float) -> None:
        """A step's kernels have run (at its start): each participation's share is summed
        now and, where this step completes it, its PARTIAL built, inside the step's padded
        time rather than on the hop's path at its release (``_send_partial`` patches in the
        group). Measured before, with timers in the worker (asym5, Prism, 10 req/s, T = 32):
        from a step's modeled end to its partials' write took 0.6-1.5 ms of wall time at the
        median per server, of it 0.1-0.3 ms summing the released jobs and 0.2-0.8 ms
        building the frames."""
        for job in jobs:
            if job.replica == DENSE:
                continue
            work: Work = job.owner
            p = work.owner
            p.gpus[work.position] = job.gpu
            p.partial += work.gate * work.x  # the expert output by now
            p.jobs_left -= 1
            if not p.jobs_left:
                p.frame = self._partial_frame(p, t_end)

    def _job_done(self, job: Job) -> None:
        work: Work = job.owner
        # the model time the step ended (its jobs are released then), not the loop's now
        t_end = self.stream.released_at
        if t_end is None:
            t_end = self.now()
        if job.replica == DENSE:  # the dense part ran: route the layer
            tok, h, t_layer = work.owner
            if self.causal:  # its K/V exist here now (kv.py)
                self._kv_done(tok, t_end)
            if self.step_dispatch:
                self._cohort.append((tok, h, t_layer, t_end))
            else:
                self._decide(tok, h, t_layer, 0, t_end)
            return
        p = work.owner  # its share was summed when the step ran (``_step_ran``)
        if p.jobs_left or self.parts.pop(p.key, None) is None:  # more to run, or sent already
            return
        if self.step_dispatch:
            self._out_partials.setdefault(p.msg.aggregator, []).append((p, t_end))
        else:
            self._send_partial(p, t_end)

    def _flush_step(self) -> None:
        """A step's jobs are all released: its partials go to each aggregator as one group,
        then (causal attention) what it computed to each request's home, and its dense parts
        are decided and dispatched together (routing.py)."""
        outs, self._out_partials = self._out_partials, {}
        with self._together():  # one write per aggregator
            for parts in outs.values():
                self._groups += 1
                for p, t_end in parts:
                    self._send_partial(p, t_end, self._groups, len(parts))
            if self._kv_out:  # causal attention: the step's notices to each home (kv.py)
                self._kv_flush(self.stream.released_at)
        if self._cohort:
            cohort, self._cohort = self._cohort, []
            self._decide_step(cohort)

    def _partial_frame(self, p: Participation, t_end: float) -> Frame:
        h = p.msg
        out = Partial(src=self.rank, request=h.request, token=h.token, layer=h.layer, seq=h.seq,
                      t_arrived=p.arrival, t_computed=t_end,
                      ran=tuple(Ran(j, bool(g)) for j, g in sorted(p.gpus.items())),
                      dtype=DType.FLOAT32, shape=(self.d,))
        return self._hidden_frame(out, p.partial, h.aggregator)

    def _send_partial(self, p: Participation, t_end: float, group: int = 0, group_n: int = 1) -> None:
        h = p.msg
        frame = p.frame if p.frame is not None else self._partial_frame(p, t_end)
        if group:
            frame = patched(frame, group=group, group_n=group_n)
        agg = h.aggregator
        why = f"partial output cannot reach server {agg}"
        self._hop(self.hop_partial, t_end)
        if not self._send(agg, frame,
                          lambda _, p=p, why=why: self._relayer(p.key, p.msg, p.hidden, why),
                          at=t_end):
            self._relayer(p.key, h, p.hidden, why)  # re-route the layer from here

    def _prefetch(self, replicas, t: float) -> None:
        """Copies into this server's GPU on its copy engine (local replicas only), queued at
        model time ``t`` (the dispatch's): the step scheduler's engine, which a step's loads
        share; each copy lands at its model end x T."""
        copy = self.stream.sched.copy
        for r in replicas:
            if self.dep.replicas[r].server != self.rank:
                continue
            self._landing(copy.prefetch(r, t, self._load_of(r)))

    def _landing(self, c: Copy) -> None:
        """Schedule a prefetch's landing at its model end x T (again, when a step's load
        moved it: ``testbed.steps.CopyEngine``, as the simulator's ``_landing``)."""
        self.loop.call_at(self.wall(c.end), self._prefetched, c, c.version)

    def _prefetched(self, c: Copy, version: int) -> None:
        if version == c.version:  # not moved since this landing was scheduled
            self.residency.on_prefetched(c.replica)

    def _load_of(self, r: int) -> float:
        rep = self.dep.replicas[r]
        return self.core.world.load_s(rep.server, rep.precision)
