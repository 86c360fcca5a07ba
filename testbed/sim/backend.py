"""Discrete-event backend: the same routers, with modeled time and transport.

Resources (as in SimPy's link-as-resource style, but without per-event cost):
- each directed link is a FIFO server: a message starts when the link is free,
  occupies it for size / (bandwidth * payload efficiency), and arrives one
  propagation delay later. Sends happen in event-time order, so the FIFO can
  be computed in closed form from the link's next-free time. Under
  ``net.transport: tcp`` (hardware world) a message larger than its
  connection's congestion window also waits a round trip per window
  (``testbed/tcp.py``), and the link's next-free time includes the wait;
- each server has one GPU stream run by the step scheduler
  (``testbed/steps.py``, the same rule the emulated workers follow);
- each server has one CPU that makes routing decisions one at a time; a
  decision costs the engine's ``decision_s`` (``testbed/core.py``).

Per token-layer (the decision logic itself is ``testbed/core.py``): the dense
part runs at the residing server (a job in its stream under
``physics: hardware``, a delay under ``physics: paper``); the decider there
routes on its ``StateView``; after the decision's CPU time the hidden state
fans out; jobs queue at the participants; each participant sends its partial
output to the aggregation server once all of the token's jobs there are done;
the layer ends when the last partial arrives. After the last layer the token
returns to its home server.

Views are refreshed from the true stream backlogs at every window boundary
(a snapshot), and between refreshes only by the decider's own admissions.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tqdm import tqdm

from hetroute.residency import Residency
from hetroute.state import StateView, TokenView, Unroutable

from ..acks import AckLine
from ..collector import quiet_collector
from ..core import Routed, TokenLayerCore, with_window
from ..kv import RequestKv
from ..kv_spill import server_room, spill_stats
from ..progress import FINISHED, RequestProgress
from ..records import RecordWriter
from ..steps import DENSE, Copy, Job, StepScheduler, step_row
from ..tcp import windows as tcp_windows

if TYPE_CHECKING:
    from ..setup import RunSetup


@dataclass
class SimStats:
    events: int = 0
    token_layers: int = 0
    sim_time_s: float = 0.0
    batches: int = 0  # steps
    coalesced_jobs: int = 0  # jobs that shared a replica's weight read with another
    failed_requests: int = 0
    decisions: int = 0
    decision_cpu_s: float = 0.0  # measured CPU time of all decisions
    decision_charged_s: float = 0.0  # what the simulated servers were charged
    dq_misreported: int = 0  # token-layers whose router-reported dq was not the quality model's
    dq_misreport_first: tuple | None = None  # (request, token, layer, reported, derived)
    tcp_waits: int = 0  # messages that waited for their congestion window (net.transport: tcp)
    tcp_wait_s: float = 0.0  # summed over them
    control_frames: int = 0  # STATE broadcasts and FEEDBACK sent over links (net.control: links)
    control_waits: int = 0  # of them, those that waited behind hidden states on their link
    control_wait_s: float = 0.0  # summed over them
    #: ``engine.attention: causal``: times a token parked for an earlier position that had not
    #: reached its layer (it parks again each time it is checked while one is still missing),
    #: K/V fetches (one per token-layer and holding server) and their bytes
    kv_waits: int = 0
    kv_fetches: int = 0
    kv_bytes: int = 0
    #: ``engine.kv_news: home``: asks a token's server sent the home, and the home's notices
    #: (one per step and home other than the step's server)
    kv_asks: int = 0
    kv_notices: int = 0
    #: ``engine.kv_overflow: spill``: positions written to the servers' K/V ledgers (own and
    #: fetched copies), the largest ledger in MB, steps that copied spilled K/V in from host memory, the bytes and
    #: stream seconds they copied, and the servers that spilled at all
    kv_written: int = 0
    kv_ledger_peak_mb: float = 0.0
    kv_spill_steps: int = 0
    kv_spill_bytes: int = 0
    kv_spill_s: float = 0.0
    kv_spill_servers: int = 0


def control_seconds(bandwidth, efficiency: float, header_bytes: int) -> list[list[float]]:
    """``[m][n]``: seconds a control frame (a header's bytes: the emulator's STATE or
    FEEDBACK) occupies link m -> n at its rate (``net.control: links``); it crosses the link
    in its FIFO order with the hidden states (``SimBackend.send_control``)."""
    N = len(bandwidth)
    return [[0.0 if m == n else header_bytes / (bandwidth[m][n] * efficiency)
             for n in range(N)] for m in range(N)]


def _on_execute(residency: Residency):
    """A residency's ``on_execute``, or None where it is the base class's no-op (static
    tiers): the step scheduler then skips a call per replica per step."""
    if type(residency).on_execute is Residency.on_execute:
        return None
    return residency.on_execute


class _Token:
    __slots__ = ("req", "view", "targets", "t_layer", "t_dec", "t_disp", "routed", "pending",
                 "per_server", "fan_out_end", "compute_end", "fan_in_end", "bytes", "decider",
                 "gpus", "attempt", "retries", "kv_pending", "kv_ask", "kv_sent")

    def __init__(self, req: "_Request", view: TokenView, targets: tuple) -> None:
        self.req = req
        self.view = view
        self.targets = targets  # per layer: tuple of global expert ids
        self.attempt = 0  # id of the current routing attempt, unique over the token's life
        self.retries = 0  # re-routes of the current layer forced by faults
        self.kv_pending = 0  # ``engine.attention: causal``: its fetches out, K/V not in yet
        self.kv_ask = None  # ``kv_news: home``: (attempt, layer) of the ask out for this layer
        self.kv_sent = False  # its dense part of the current layer is in its server's stream


class _Request(RequestProgress):
    __slots__ = ("rid", "user", "home", "arrival", "failed", "reason", "targets", "kv")

    def __init__(self, rid: int, user: int, home: int, arrival: float, prompt: int, gen: int,
                 kv: bool = False):
        super().__init__(prompt, gen)
        self.rid, self.user, self.home, self.arrival = rid, user, home, arrival
        self.failed = False
        self.reason = ""
        self.kv = RequestKv() if kv else None  # ``engine.attention: causal``


class _ClockBar:
    """Progress in simulated seconds of arrivals (the drain after them shows as 100%)."""

    def __init__(self, spec) -> None:
        self.total = spec.workload.duration_s
        self.bar = tqdm(total=self.total, unit="s", desc=f"{spec.name} [sim]",
                        bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.1f}/{total:.1f} sim-s "
                                   "[{elapsed}<{remaining}]")

    def __call__(self, t: float) -> None:
        self.bar.n = min(t, self.total)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.n = self.total
        self.bar.close()


class SimBackend:
    """Runs one experiment on modeled time; ``run`` returns the stats."""

    def __init__(self, setup: RunSetup, writer: RecordWriter,
                 progress: bool = False) -> None:
        self.s = setup
        self.w = writer
        self.progress = _ClockBar(setup.spec) if progress else None
        spec = setup.spec
        cl = setup.cluster
        shape = setup.shape
        N = cl.n
        self.N = N
        self.L = shape.n_layers
        self.k = shape.top_k
        eff = spec.sim.payload_efficiency
        msg = shape.hidden_bytes + spec.sim.header_bytes
        self.msg_bytes = shape.hidden_bytes
        # seconds a hidden-state message occupies link m->n, and its propagation delay
        self.tx = [[0.0 if m == n else msg / (cl.bandwidth[m][n] * eff) for n in range(N)]
                   for m in range(N)]
        self.delay = [list(row) for row in cl.delay]
        self.link_free = [[0.0] * N for _ in range(N)]
        #: ``net.ack_every``: seconds of pure ACKs link n->m carries per byte of data m sends
        #: n (``ack_s[n][m]``), and the ACK blocks waiting to take each link (testbed/acks.py)
        ack = spec.ack_bytes_per_byte
        self.ack_s = ([[0.0 if m == n else ack / cl.bandwidth[n][m] for m in range(N)]
                       for n in range(N)] if ack > 0 else None)
        self.ack_lines = [[AckLine() for _ in range(N)] for _ in range(N)] if ack > 0 else None
        #: ``net.transport: tcp``: each directed pair's congestion window (testbed/tcp.py)
        self.tcp = (tcp_windows(spec.net.params(), cl.bandwidth, cl.delay, eff)
                    if spec.tcp_windows else None)
        self.msg_wire = msg
        self.core = core = TokenLayerCore(setup.router, setup.deployment, cl, shape, spec.physics,
                                          setup.quality)
        self.rep_server = core.rep_server
        dep = setup.deployment
        eng = spec.engine
        self.hardware = spec.physics == "hardware"
        self.deciders = [setup.router.decider(n) for n in range(N)]
        #: each server's GPU tiers (static, or the router's online cache), asked the same way
        self.residency = [d.residency(n) for n, d in enumerate(self.deciders)]
        prec = [r.precision for r in dep.replicas]
        #: ``engine.kv_overflow: spill``: each server's K/V cache held to its room (kv_spill.py)
        self.kv_room = ([server_room(cl, shape, spec.memory.gpu_share, n) for n in range(N)]
                        if self.hardware and eng.kv_overflow == "spill" else None)
        #: requests finished at each home since its last window broadcast (which tells the
        #: other servers to free their K/V), with ``spill`` over links only
        self.kv_done: list[list[int]] | None = ([[] for _ in range(N)] if self.kv_room is not None
                                                and spec.control_over_links else None)
        self.sched = [StepScheduler(core.world, n, prec.__getitem__, self.residency[n].is_gpu,
                                    scope="layer" if self.hardware else "replica",
                                    max_batch_tokens=eng.max_batch_tokens, hold_s=eng.hold_s,
                                    on_execute=_on_execute(self.residency[n]),
                                    moe_kernels=eng.moe_kernels, load_overlap=eng.load_overlap,
                                    prefetch_link=eng.prefetch_link,
                                    kv=self.kv_room[n] if self.kv_room is not None else None)
                      for n in range(N)]
        for sc in self.sched:  # a prefetch a step's load moved lands when it now ends
            sc.copy.notify = self._landing
        #: ``run --trace-steps``: each step's composition to the writer's step table
        self.trace = writer.step if writer.st is not None else None
        self.wake_at = [-1.0] * N  # a pending hold wake-up per stream
        self.kick_pending = [False] * N  # a step start queued at the current instant
        self.dense_delay = [core.world.dense_s(n, 1) for n in range(N)]  # paper physics only
        self.cpu_free = [0.0] * N  # per-server CPU that makes decisions
        self.measured_decisions = eng.decision_s == "measured"
        self.decision_s = float(getattr(setup, "decision_s", 0.0))
        #: ``engine.dispatch: step``: a step's tokens leave together, one message per destination
        self.step_dispatch = self.hardware and eng.dispatch == "step"
        #: ``engine.attention: causal``: a token attends once its request's earlier K/V are
        #: at its server (testbed/kv.py); a fetch's answer is sized as so many hidden states
        self.causal = self.hardware and eng.attention == "causal"
        self.kv_home = self.causal and eng.kv_news == "home"
        self.kv_bytes = shape.kv_bytes_per_token
        jit = spec.sim.hop_jitter_s
        draw = spec.sim.hop_jitter_draw  # 0: the run's seed alone, as before the field
        self.jitter = (random.Random(spec.seed if not draw else f"{spec.seed}:{draw}").expovariate
                       if jit > 0 else None)
        self.jitter_rate = 1.0 / jit if jit > 0 else 0.0
        # state views and deciders
        self.window = spec.window_s
        self.views = [StateView(N) for _ in range(N)]
        self.snapshot = [0.0] * N
        self.snap_window = 0
        self.snap_t = 0.0  # when the current window's tick ran
        #: ``net.control: links``: each window's broadcast and each record's FEEDBACK cross
        #: their link as a header-sized frame behind the hidden states queued on it
        #: (``send_control``); ``heard[n][m]``: (arrival, backlog) of n's broadcasts on their
        #: way to m, and ``held[m][n]``: n's backlog as m last heard it at a tick (0 before)
        self.control_s = (control_seconds(cl.bandwidth, eff, spec.sim.header_bytes)
                          if spec.control_over_links else None)
        self.heard = [[deque() for _ in range(N)] for _ in range(N)]
        self.held = [[0.0] * N for _ in range(N)]
        self.alive = [True] * N
        self.intact = True  # no fault yet: every message gets through (``reachable``'s fast path)
        self.link_up: list[list[bool]] | None = None  # None until a link is cut
        self.max_retries = 2
        self.names = {name: i for i, name in enumerate(cl.names)}
        # events
        self.heap: list = []
        #: tie-breaker of events at one instant: the order they were scheduled in
        self.next_seq = itertools.count(1).__next__
        self.now = 0.0
        self.stats = SimStats()

    # -- event plumbing -------------------------------------------------------
    def at(self, t: float, fn, arg) -> None:
        heapq.heappush(self.heap, (t, self.next_seq(), fn, arg))

    def reachable(self, m: int, n: int) -> bool:
        """Whether a message m -> n gets through (truth, not a view)."""
        if self.intact:
            return True
        if not self.alive[n] or not self.alive[m]:
            return False
        lu = self.link_up
        return m == n or lu is None or lu[m][n]

    def send(self, m: int, n: int, t: float, count: int = 1) -> float:
        """Arrival time at n of ``count`` hidden states sent from m at t as one message
        (FIFO link, behind the ACKs of n's data that left n by t), plus
        ``sim.hop_jitter_s``'s draw where it is set; n's ACKs of it then wait to take n->m."""
        free = self.link_free[m]
        queued = free[n] > t
        if self.ack_lines is not None and self.ack_lines[m][n].q:  # n's ACKs that left by t
            free[n] = self.ack_lines[m][n].absorb(free[n], t)
        start = free[n] if free[n] > t else t
        tx = self.tx[m][n] * count
        end = start + tx
        if self.tcp is not None:
            w = self.tcp[m][n]
            wait = w.wait(start, self.msg_wire * count, tx, queued)
            if wait:
                end += wait
                self.stats.tcp_wait_s += wait
                self.stats.tcp_waits += 1
        free[n] = end
        if self.ack_s is not None:  # n acknowledges the message as it arrives
            self.ack_lines[n][m].add(end + self.delay[m][n],
                                     self.msg_wire * count * self.ack_s[n][m])
        if self.jitter is None:
            return end + self.delay[m][n]
        return end + self.delay[m][n] + self.jitter(self.jitter_rate)

    def send_control(self, m: int, n: int, t: float) -> float:
        """Arrival at n of a control frame m sends at t: it waits behind the hidden states
        sent on the link before it, as the emulator's STATE and FEEDBACK frames share their
        connection's shaped link with the data frames. It does not hold up later ones (its
        tens of bytes are under a microsecond of any link here), so the data's timing and
        its congestion window (``net.transport: tcp``) are those of the data alone."""
        free = self.link_free[m][n]
        if self.ack_lines is not None and self.ack_lines[m][n].q:
            free = self.link_free[m][n] = self.ack_lines[m][n].absorb(free, t)
        st = self.stats
        st.control_frames += 1
        if free > t:
            st.control_waits += 1
            st.control_wait_s += free - t
            t = free
        return t + self.control_s[m][n] + self.delay[m][n]

    def true_backlog(self, n: int) -> float:
        return self.sched[n].backlog(self.now)

    # -- run ------------------------------------------------------------------
    def run(self) -> SimStats:
        s = self.s
        spec = s.spec
        for rq in s.requests:
            req = _Request(rq.id, rq.user, rq.home, rq.arrival_s, rq.prompt_tokens, rq.gen_tokens,
                           self.causal)
            self.at(rq.arrival_s, self._arrive, req)
        self.at(self.window, self._window, None)
        for f in spec.faults:
            self.at(f.at_s, self._fault, f)
        self.pending_requests = len(s.requests)
        last_progress = 0.0
        heap = self.heap
        pop = heapq.heappop
        progress = self.progress
        events = 0
        with quiet_collector():  # the loop's objects die by reference count
            while heap:
                t, _, fn, arg = pop(heap)
                self.now = t
                events += 1
                fn(arg)
                if progress is not None and t - last_progress >= 0.1:
                    last_progress = t
                    progress(t)
        if progress is not None:
            progress.close()
        st = self.stats
        st.events = events
        st.sim_time_s = self.now
        st.batches = sum(sc.steps for sc in self.sched)
        if self.kv_room is not None:
            for key, v in spill_stats(self.kv_room).items():
                setattr(st, key, v)
        st.dq_misreported = self.core.dq_misreported
        st.dq_misreport_first = self.core.dq_misreport_first
        return st

    def _window(self, _) -> None:
        t = self.now
        snap = self.snapshot
        for n in range(self.N):
            snap[n] = self.sched[n].backlog(t)
        self.snap_window += 1
        self.snap_t = t
        if self.control_s is not None:  # each server's broadcast to every peer it reaches
            done = self.kv_done
            for n in range(self.N):
                b = snap[n]
                rids = done[n] if done is not None else None
                for m in range(self.N):
                    if m != n and (self.intact or self.reachable(n, m)):
                        arr = self.send_control(n, m, t)
                        self.heard[n][m].append((arr, b))
                        if rids:  # the requests home here finished since the last broadcast
                            self.at(arr, self._kv_free, (m, rids))
                if rids:
                    done[n] = []
        if self.pending_requests > 0:
            self.at(t + self.window, self._window, None)

    def _refresh(self, v: StateView, m: int) -> None:
        """Server m's view at the current window: every server's backlog at the tick, or
        with control over links each peer's in its last broadcast that had reached m by the
        tick (its own current)."""
        lu = None if self.link_up is None else [list(row) for row in self.link_up]
        snap = self.snapshot
        if self.control_s is not None:
            tick, held = self.snap_t, self.held[m]
            for n in range(self.N):
                q = self.heard[n][m]
                while q and q[0][0] <= tick:
                    held[n] = q.popleft()[1]
            snap = list(held)
            snap[m] = self.snapshot[m]
        v.refresh(self.snap_window, self.snap_window * self.window, snap, self.alive, lu)

    # -- faults ---------------------------------------------------------------
    def _fault(self, f) -> None:
        """A worker dies or a link is cut. Routers learn it at the next window
        refresh, or at once when a send of theirs fails; work queued on a dead
        server is lost and its tokens are re-routed from where they reside."""
        n = self.names.get(f.server) if f.server else None
        self.intact = False
        if f.kind == "kill_worker":
            if n is None:
                raise ValueError(f"fault: unknown server {f.server!r}")
            self.alive[n] = False
            sc = self.sched[n]
            lost = [job for group in sc.queue.values() for job in group]
            sc.queue.clear()
            sc.queued_s = 0.0
            for job in lost:
                self._lost(job.owner[0], job.owner[1], n, f"server {f.server} died")
        elif f.kind == "cut_link":
            m = self.names.get(f.peer) if f.peer else None
            if n is None or m is None:
                raise ValueError(f"fault: cut_link needs known server and peer, got {f.server}, {f.peer}")
            if self.link_up is None:
                self.link_up = [[True] * self.N for _ in range(self.N)]
            self.link_up[n][m] = self.link_up[m][n] = False

    def _lost(self, tok: _Token, attempt: int, n: int, reason: str) -> None:
        """A job or partial of ``tok`` at/for server n will never arrive: the
        residing server notices (after one window, its failure detector) and
        re-routes the layer, up to ``max_retries`` times."""
        if attempt != tok.attempt or tok.req.failed:
            return
        tok.attempt += 1  # whatever is still in flight for the old attempt is now stale
        tok.retries += 1
        theta = tok.view.server
        if tok.retries > self.max_retries or not self.alive[theta]:
            self._fail(tok, reason)
            return
        v = self.views[theta]
        if not self.alive[n]:
            v.alive[n] = False
            v.faultless = False
        elif self.link_up is not None:
            v.link_up = [list(row) for row in self.link_up] if v.link_up is None else v.link_up
            v.link_up[theta][n] = v.link_up[n][theta] = False
            v.faultless = False
        self.at(self.now + self.window, self._decide, tok)

    # -- requests and tokens --------------------------------------------------
    def _arrive(self, req: _Request) -> None:
        req.targets = self.s.request_targets(req.rid, req.prompt + req.gen)
        for i in range(req.prompt):
            self._start_token(req, i)

    def _start_token(self, req: _Request, index: int) -> None:
        s = self.s
        tv = TokenView(req.rid, index, req.home, s.spec.quality.budget, now=self.now)
        tok = _Token(req, tv, req.targets[index])
        self._begin_layer(tok)

    def _begin_layer(self, tok: _Token) -> None:
        """The token is ready at its residing server: the dense part, then the decision."""
        t = self.now
        tok.t_layer = t
        theta = tok.view.server
        if not self.hardware:  # the paper's world: a per-token delay outside the stream
            heapq.heappush(self.heap, (t + self.dense_delay[theta], self.next_seq(), self._decide, tok))
            return
        if self.causal:
            tok.kv_sent = False
            tok.kv_pending = 0
            self._attend(tok)
            return
        self._submit_dense(tok, theta, t)

    def _submit_dense(self, tok: _Token, theta: int, t: float) -> None:
        """The token's dense part joins server theta's stream at t."""
        tv = tok.view
        self.sched[theta].submit(Job(tv.layer, DENSE, tok, tv.request, tv.index, t,
                                     (tok, tok.attempt), tok.req.arrival))
        self._kick(theta)

    # -- engine.attention: causal (testbed/kv.py) ---------------------------------------
    def _attend(self, tok: _Token) -> None:
        """Queue the token's dense part once its request's earlier K/V of this layer are
        at its server; else park it, or fetch what other servers hold first."""
        req = tok.req
        if req.failed or tok.kv_sent:
            return
        tv = tok.view
        layer, theta = tv.layer, tv.server
        kv = req.kv
        if self.kv_home:
            self._attend_home(tok, kv, layer, theta)
            return
        need = kv.needs(layer, tv.index, theta)
        if need is None:
            kv.park(layer, (tok, tok.attempt))
            self.stats.kv_waits += 1
            return
        if need:
            tok.kv_pending = len(need)
            att = tok.attempt
            for src, positions in need.items():  # a request to each holder, answered at once
                self.at(self._control(theta, src), self._kv_answer, (tok, att, src, positions))
            return
        self._kv_submit(tok, kv, layer, theta)

    def _kv_submit(self, tok: _Token, kv, layer: int, theta: int) -> None:
        tok.kv_sent = True
        kv.submitted(layer, tok.view.index, theta)
        self._submit_dense(tok, theta, self.now)
        self._kv_wake(tok.req, layer)

    def _kv_wake(self, req: _Request, layer: int) -> None:
        """Check again the tokens parked on ``layer`` of ``req`` (some may park again)."""
        for tok, att in req.kv.take_waiting(layer):
            if att == tok.attempt and tok.view.layer == layer:
                self._attend(tok)

    # -- engine.kv_news: home (a directory at the request's home) ------------------------
    def _attend_home(self, tok: _Token, kv, layer: int, theta: int) -> None:
        """Attend if this server sees every earlier position; else park (its own stream may
        bring them) and ask the home where the others are, once per layer and attempt."""
        if kv.sees_all(layer, tok.view.index, theta):
            self._kv_submit(tok, kv, layer, theta)
            return
        att = tok.attempt
        kv.park(layer, (tok, att))
        self.stats.kv_waits += 1
        if tok.kv_ask == (att, layer) or tok.kv_pending:  # asked, or fetching what it was told
            return
        missing = kv.local_missing(layer, tok.view.index, theta)
        tok.kv_ask = (att, layer)
        home = tok.req.home
        self.stats.kv_asks += 1
        at = self.now if home == theta else self._control(theta, home)
        self.at(at, self._kv_ask_in, (tok, att, layer, missing))

    def _control(self, m: int, n: int) -> float:
        """Arrival at n of a control frame m sends now (over the links, or their delay)."""
        if self.control_s is not None:
            return self.send_control(m, n, self.now)
        return self.now + self.delay[m][n]

    def _kv_ask_in(self, ask) -> None:
        """An ask reaches the home: answered now if it has heard of every position it names,
        else held until it has."""
        tok, att, layer, missing = ask
        if att != tok.attempt or tok.req.failed:
            return
        kv = tok.req.kv
        where = kv.located(layer, missing)
        if where is None:
            kv.asks.setdefault(layer, []).append(ask)
            return
        self._kv_tell(tok, att, layer, where)

    def _kv_tell(self, tok: _Token, att: int, layer: int, where: dict) -> None:
        home, theta = tok.req.home, tok.view.server
        at = self.now if home == theta else self._control(home, theta)
        self.at(at, self._kv_where, (tok, att, layer, where))

    def _kv_notices_in(self, arg) -> None:
        """A step's notices reach the home (or it computed them itself): held asks that
        every position they name is now known for are answered."""
        src, items = arg
        touched: dict = {}  # (request, layer) in the order heard: a set's order would vary by run
        for req, layer, position in items:
            if req.failed:
                continue
            kv = req.kv
            kv.notice(layer, position, src)
            if kv.asks.get(layer):
                touched[req, layer] = None
        for req, layer in touched:
            kv = req.kv
            held = kv.asks.pop(layer)
            for ask in held:
                tok, att, _, missing = ask
                if att != tok.attempt:
                    continue
                where = kv.located(layer, missing)
                if where is None:
                    kv.asks.setdefault(layer, []).append(ask)
                else:
                    self._kv_tell(tok, att, layer, where)

    def _kv_where(self, arg) -> None:
        """The home's answer reaches the token's server: fetch what it does not hold yet."""
        tok, att, layer, where = arg
        if att != tok.attempt or tok.req.failed or tok.kv_sent or tok.view.layer != layer:
            return
        theta = tok.view.server
        held = tok.req.kv.held.get((layer, theta), ())
        need = {}
        for src, positions in where.items():
            if src != theta:
                rest = [j for j in positions if j not in held]
                if rest:
                    need[src] = rest
        tok.kv_ask = None  # answered: what is still missing after the fetches is asked again
        if not need:
            self._attend(tok)
            return
        tok.kv_pending = len(need)
        for src, positions in need.items():
            self.at(self._control(theta, src), self._kv_answer, (tok, att, src, positions))

    def _kv_answer(self, arg) -> None:
        """A holder sends the K/V asked for (their bytes, over its link to the asker)."""
        tok, att, src, positions = arg
        if att != tok.attempt or tok.req.failed:
            return
        theta = tok.view.server
        nbytes = len(positions) * self.kv_bytes
        arr = self.send(src, theta, self.now, nbytes / self.msg_wire)
        st = self.stats
        st.kv_fetches += 1
        st.kv_bytes += nbytes
        self.at(arr, self._kv_in, arg)

    def _kv_in(self, arg) -> None:
        tok, att, src, positions = arg
        if att != tok.attempt or tok.req.failed:
            return
        tok.req.kv.fetched(tok.view.layer, tok.view.server, positions)
        if self.kv_room is not None:  # the copies take room at the fetching server
            self.kv_room[tok.view.server].write(tok.req.rid, tok.req.arrival, len(positions))
        tok.kv_pending -= 1
        if tok.kv_pending == 0:
            self._attend(tok)  # nothing is missing now: it queues

    def _decide(self, tok: _Token) -> None:
        end = self._route(tok)
        if end is None:
            return
        if end > self.now:
            heapq.heappush(self.heap, (end, self.next_seq(), self._dispatch, (tok, tok.attempt)))
        else:
            self._dispatch((tok, tok.attempt))

    def _decide_step(self, toks: list[_Token]) -> None:
        """``engine.dispatch: step``: decide a dense step's tokens one after another on the
        server's CPU, then send them all when the last decision is done."""
        last = self.now
        items = []
        for tok in toks:
            end = self._route(tok)
            if end is not None:
                items.append((tok, tok.attempt))
                if end > last:
                    last = end
        if items:
            heapq.heappush(self.heap, (last, self.next_seq(), self._dispatch_step, items))

    def _dispatch_step(self, items: list) -> None:
        out: dict[int, list] = {}
        theta = -1
        for arg in items:
            tok, att = arg
            if att == tok.attempt and not tok.req.failed:
                theta = tok.view.server
                self._dispatch(arg, out)
        t = self.now
        for n, sent in out.items():
            arr = self.send(theta, n, t, len(sent))
            jobs = []
            for tok, tjobs in sent:
                if arr > tok.fan_out_end:
                    tok.fan_out_end = arr
                jobs.extend(tjobs)
            heapq.heappush(self.heap, (arr, self.next_seq(), self._jobs_arrive, (n, jobs)))

    def _route(self, tok: _Token) -> float | None:
        """Decide the token's layer; returns when its decision is done (None: failed)."""
        tv = tok.view
        theta = tv.server
        t = self.now
        tv.now = t
        tok.t_dec = t
        tok.attempt += 1
        if not self.alive[theta]:
            self._fail(tok, f"server {self.s.cluster.names[theta]} died holding the token")
            return None
        view = self.views[theta]
        if view.window != self.snap_window:
            self._refresh(view, theta)
        try:
            routed = self.core.decide(self.deciders[theta], self.residency[theta], view, tv,
                                      tok.targets[tv.layer], self.true_backlog)
        except Unroutable as err:
            self._fail(tok, str(err))
            return None
        tok.routed = routed
        tok.decider = theta
        st = self.stats
        st.decisions += 1
        st.decision_cpu_s += routed.decision_s
        cost = routed.decision_s if self.measured_decisions else self.decision_s
        if cost > 0:  # decisions at one server queue for its CPU
            start = self.cpu_free[theta] if self.cpu_free[theta] > t else t
            self.cpu_free[theta] = end = start + cost
            st.decision_charged_s += end - t
            return end
        return t

    def _dispatch(self, arg, out: dict | None = None) -> None:
        """Send the token's hidden state to its layer's participants; with ``out`` (step
        dispatch) the remote sends are collected there, per destination, for one message."""
        tok, att = arg
        if att != tok.attempt or tok.req.failed:
            return
        t = self.now
        tok.t_disp = t
        routed: Routed = tok.routed
        a = routed.assignment
        tv = tok.view
        theta = tv.server
        if a.prefetch:
            self._prefetch(a.prefetch)
        per_server = routed.per_server
        if not self.intact:
            for n in per_server:  # a send to a dead server or over a cut link fails at once
                if n != theta and not self.reachable(theta, n):
                    self._lost(tok, att, n, f"cannot reach {self.s.cluster.names[n]}")
                    return
        reps = a.replicas
        tok.gpus = [True] * len(reps)
        tok.per_server = {n: len(js) for n, js in per_server.items()}
        tok.pending = len(per_server)
        tok.compute_end = t
        tok.fan_in_end = t
        fan_out_end = t
        nbytes = 0
        layer, request, index, prio = tv.layer, tv.request, tv.index, tok.req.arrival
        for n, positions in per_server.items():
            jobs = [Job(layer, reps[j], tok, request, index, 0.0, (tok, att, j), prio)
                    for j in positions]
            if n == theta:
                self._enqueue(n, jobs)
            elif out is not None:
                out.setdefault(n, []).append((tok, jobs))
                nbytes += self.msg_bytes
            else:
                arr = self.send(theta, n, t)
                nbytes += self.msg_bytes
                if arr > fan_out_end:
                    fan_out_end = arr
                heapq.heappush(self.heap, (arr, self.next_seq(), self._jobs_arrive, (n, jobs)))
        tok.fan_out_end = fan_out_end
        tok.bytes = nbytes

    def _prefetch(self, replicas: tuple[int, ...]) -> None:
        """Copy replicas to their server's GPU on its FIFO copy engine (v / beta each; the
        step scheduler's, which a step's loads share under ``load_overlap: copy_engine``)."""
        w = self.core.world
        for r in replicas:
            n = self.rep_server[r]
            c = self.sched[n].copy.prefetch(r, self.now,
                                            w.load_s(n, self.s.deployment.replicas[r].precision))
            self._landing(c)

    def _landing(self, c: Copy) -> None:
        """Schedule a prefetch's landing (again, when a step's load moved it)."""
        self.at(c.end, self._prefetched, (c, c.version))

    def _prefetched(self, arg: tuple[Copy, int]) -> None:
        c, version = arg
        if version == c.version:  # not moved since this landing was scheduled
            self.residency[self.rep_server[c.replica]].on_prefetched(c.replica)

    def _jobs_arrive(self, arg) -> None:
        n, jobs = arg
        if not self.alive[n]:
            for job in jobs:
                self._lost(job.owner[0], job.owner[1], n, f"server {self.s.cluster.names[n]} died")
            return
        self._enqueue(n, jobs)

    def _enqueue(self, n: int, jobs: list[Job]) -> None:
        sc = self.sched[n]
        t = self.now
        for job in jobs:
            job.arrival = t
            sc.submit(job)
        self._kick(n)

    def _kick(self, n: int) -> None:
        """Start n's next step once everything submitted at this instant is queued (a step
        takes what is queued when it starts, so tokens released together batch together).
        The paper's world starts at once, as the testbed did before the hardware model."""
        if not self.hardware:
            self._start_step(n)
        elif not self.kick_pending[n] and not self.sched[n].busy:
            self.kick_pending[n] = True
            heapq.heappush(self.heap, (self.now, self.next_seq(), self._start_step, n))

    def _start_step(self, n: int) -> None:
        """Start the next step on n's stream if it is free and has work."""
        self.kick_pending[n] = False
        sc = self.sched[n]
        if sc.busy or not sc.queue:
            return
        t = self.now
        ready = sc.ready_at(t) if sc.hold else t  # (without a hold, a step may start now)
        if ready > t:
            if self.wake_at[n] != ready:
                self.wake_at[n] = ready
                self.at(ready, self._wake, n)
            return
        step = sc.take(t)
        self.stats.coalesced_jobs += step.expert_jobs - step.replicas
        if self.trace is not None:
            self.trace(step_row(n, step, sc.precision_of))
        heapq.heappush(self.heap, (t + step.duration, self.next_seq(), self._step_done, (n, step.jobs)))

    def _wake(self, n: int) -> None:
        self.wake_at[n] = -1.0
        self._start_step(n)

    def _step_done(self, arg) -> None:
        n, jobs = arg
        t = self.now
        self.sched[n].finish()
        if not self.alive[n]:
            for job in jobs:
                self._lost(job.owner[0], job.owner[1], n, f"server {self.s.cluster.names[n]} died")
            return
        step = self.step_dispatch
        cohort: list[_Token] = []
        fan_in: dict[int, list] = {}
        notices: dict[int, list] | None = {} if self.kv_home else None  # home -> what it computed
        for job in jobs:
            owner = job.owner
            tok = owner[0]
            att = owner[1]
            if att != tok.attempt or tok.req.failed:
                continue  # a re-routed or failed token's stale work
            if job.replica == DENSE:
                if self.causal:  # its K/V exist here now
                    tok.req.kv.done(job.layer, job.position, n)
                    if self.kv_home:
                        notices.setdefault(tok.req.home, []).append((tok.req, job.layer,
                                                                     job.position))
                    self._kv_wake(tok.req, job.layer)
                if step:
                    cohort.append(tok)
                else:
                    self._decide(tok)
                continue
            tok.gpus[owner[2]] = job.gpu
            if t > tok.compute_end:
                tok.compute_end = t
            ps = tok.per_server
            left = ps[n] - 1
            ps[n] = left
            if left == 0:
                agg = tok.routed.assignment.next_server
                if n == agg:
                    arr = t
                elif not self.intact and not self.reachable(n, agg):
                    self._lost(tok, att, agg, f"partial output cannot reach {self.s.cluster.names[agg]}")
                    continue
                elif step:
                    fan_in.setdefault(agg, []).append((tok, att))
                    continue
                else:
                    arr = self.send(n, agg, t)
                    tok.bytes += self.msg_bytes
                self._partial_in(tok, arr, t)
        for agg, toks in fan_in.items():  # step dispatch: one message per aggregator
            arr = self.send(n, agg, t, len(toks))
            for tok, att in toks:
                tok.bytes += self.msg_bytes
                if att == tok.attempt and not tok.req.failed:
                    self._partial_in(tok, arr, t)
        for home, items in (notices.items() if notices else ()):  # one message per home
            if home == n:  # its own, at once
                self._kv_notices_in((n, items))
            else:
                self.stats.kv_notices += 1
                self.at(self._control(n, home), self._kv_notices_in, (n, items))
        if cohort:
            self._decide_step(cohort)
        self._kick(n)

    def _partial_in(self, tok: _Token, arr: float, t: float) -> None:
        """A participant's partial reaches the aggregator at ``arr``."""
        if arr > tok.fan_in_end:
            tok.fan_in_end = arr
        tok.pending -= 1
        if tok.pending == 0:
            if tok.fan_in_end <= t:
                self._layer_done(tok)
            else:
                heapq.heappush(self.heap, (tok.fan_in_end, self.next_seq(), self._layer_done_at,
                                           (tok, tok.attempt)))

    def _feedback_in(self, arg) -> None:
        """A record reaches the decider that routed it, in the decider's current window (as
        the emulator hands a FEEDBACK frame over: a decider's windows never go back)."""
        dec, rec = arg
        self.deciders[dec].on_layer_done(with_window(rec, self.snap_window))

    def _layer_done_at(self, arg) -> None:
        tok, attempt = arg
        if attempt == tok.attempt and not tok.req.failed:
            self._layer_done(tok)

    def _layer_done(self, tok: _Token) -> None:
        t = self.now
        tok.retries = 0
        tv = tok.view
        a = tok.routed.assignment
        if tv.layer == self.L - 1 and a.next_server != tv.home:
            tok.bytes += self.msg_bytes  # the final hop home, sent right after this layer
        rec = self.core.record(tv, tok.routed, tok.gpus, tok.t_layer, tok.t_dec, tok.t_disp,
                               tok.fan_out_end, tok.compute_end, t, tok.bytes, len(tok.per_server),
                               self.snap_window)
        self.w.token_layer(rec)
        self.stats.token_layers += 1
        dec = tok.decider
        if self.control_s is None or a.next_server == dec:
            self.deciders[dec].on_layer_done(rec)
        else:  # the aggregator's FEEDBACK crosses the link to the decider
            self.at(self.send_control(a.next_server, dec, t), self._feedback_in, (dec, rec))
        tv.lam_acc += tok.routed.dq
        tv.server = a.next_server
        tv.layer += 1
        if tv.layer < self.L:
            self._begin_layer(tok)
            return
        home = tv.home
        if tv.server == home:
            self._token_done(tok)
        elif not self.intact and not self.reachable(tv.server, home):
            self._fail(tok, f"home {self.s.cluster.names[home]} unreachable")
        else:
            arr = self.send(tv.server, home, t)
            self.at(arr, self._token_done, tok)

    def _token_done(self, tok: _Token) -> None:
        req = tok.req
        if req.failed:
            return
        nxt = req.token_done(tok.view.index, tok.view.lam_acc, self.now)
        if nxt == FINISHED:
            self._request_done(req)
        elif nxt is not None:
            self._start_token(req, nxt)

    def _request_done(self, req: _Request) -> None:
        t = self.now
        if self.kv_room is not None:  # its K/V leave its home now, the others as they hear
            self._kv_finished(req)
        self.w.request(req.row(req.rid, req.user, req.home, req.arrival, t,
                               "failed" if req.failed else "ok", req.reason))
        for d in {id(x): x for x in self.deciders}.values():
            d.on_request_done(req.rid)
        self.pending_requests -= 1

    def _kv_finished(self, req: _Request) -> None:
        """``engine.kv_overflow: spill``: the request's home frees its K/V at once; every other
        server when it hears, in the home's next window broadcast (``net.control: links``,
        as the emulator's STATE carries it), or at once with instant control."""
        if self.control_s is None:
            for k in self.kv_room:
                k.free(req.rid)
            return
        self.kv_room[req.home].free(req.rid)
        self.kv_done[req.home].append(req.rid)

    def _kv_free(self, arg: tuple[int, list[int]]) -> None:
        m, rids = arg
        k = self.kv_room[m]
        for r in rids:
            k.free(r)

    def _fail(self, tok: _Token, reason: str) -> None:
        req = tok.req
        if req.failed:
            return
        req.failed = True
        req.reason = reason
        self.stats.failed_requests += 1
        self._request_done(req)
