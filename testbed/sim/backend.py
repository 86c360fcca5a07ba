"""Discrete-event backend: the same routers, with modeled time and transport.

Resources (as in SimPy's link-as-resource style, but without per-event cost):
- each directed link is a FIFO server: a message starts when the link is free,
  occupies it for size / (bandwidth * payload efficiency), and arrives one
  propagation delay later. Sends happen in event-time order, so the FIFO can
  be computed in closed form from the link's next-free time;
- each server has one FIFO GPU stream. When free it takes the oldest job and
  coalesces every queued job for the same replica into one batch, which pays
  the GPU-CPU load v/beta once (if the replica is CPU-resident) plus w/F per
  job. The emulated worker's stream has the same rule.

Per token-layer: the dense part runs at the residing server (a delay of
dense_flops / F); the decider there routes on its ``StateView``; the hidden
state fans out; jobs queue at the participants; each participant sends its
partial output to the aggregation server once all of the token's jobs there
are done; the layer ends when the last partial arrives. After the last layer
the token returns to its home server.

Views are refreshed from the true stream backlogs at every window boundary
(a snapshot), and between refreshes only by the decider's own admissions.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from hetroute.state import ExecType, StateView, TokenView, Unroutable

from ..progress import FINISHED, RequestProgress
from ..records import RecordWriter

if TYPE_CHECKING:
    from ..setup import RunSetup


@dataclass
class SimStats:
    events: int = 0
    token_layers: int = 0
    sim_time_s: float = 0.0
    batches: int = 0
    coalesced_jobs: int = 0
    failed_requests: int = 0


class _Token:
    __slots__ = ("req", "view", "targets", "t_layer", "t_dec", "assign", "pending",
                 "per_server", "fan_out_end", "compute_end", "fan_in_end", "bytes",
                 "view_age", "backlog_err", "decider", "jobs", "attempt", "retries")

    def __init__(self, req: "_Request", view: TokenView, targets: tuple) -> None:
        self.req = req
        self.view = view
        self.targets = targets  # per layer: tuple of global expert ids
        self.attempt = 0  # id of the current routing attempt, unique over the token's life
        self.retries = 0  # re-routes of the current layer forced by faults


class _Request(RequestProgress):
    __slots__ = ("rid", "user", "home", "arrival", "failed", "reason", "targets")

    def __init__(self, rid: int, user: int, home: int, arrival: float, prompt: int, gen: int):
        super().__init__(prompt, gen)
        self.rid, self.user, self.home, self.arrival = rid, user, home, arrival
        self.failed = False
        self.reason = ""


class SimBackend:
    """Runs one experiment on modeled time; ``run`` returns the stats."""

    def __init__(self, setup: RunSetup, writer: RecordWriter,
                 progress: Callable[[float], None] | None = None) -> None:
        self.s = setup
        self.w = writer
        self.progress = progress
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
        dep = setup.deployment
        self.rep_server = [r.server for r in dep.replicas]
        self.rep_expert = [r.expert for r in dep.replicas]
        self.rep_prec = [int(r.precision) for r in dep.replicas]
        self.rep_loadtime = [shape.expert_bytes[r.precision] / cl.pcie[r.server]
                             for r in dep.replicas]
        self.rep_comp = [shape.expert_flops / cl.flops[r.server] for r in dep.replicas]
        self.dense = [shape.dense_flops / f for f in cl.flops]
        # streams
        self.queue: list[OrderedDict] = [OrderedDict() for _ in range(N)]
        self.queued_work = [0.0] * N
        self.busy_until = [0.0] * N
        self.busy = [False] * N
        self.copy_free = [0.0] * N  # per-server PCIe copy engine for prefetches
        # state views and deciders
        self.window = spec.window_s
        self.views = [StateView(N) for _ in range(N)]
        self.snapshot = [0.0] * N
        self.snap_window = 0
        self.alive = [True] * N
        self.link_up: list[list[bool]] | None = None  # None until a link is cut
        self.max_retries = 2
        self.names = {name: i for i, name in enumerate(cl.names)}
        self.deciders = [setup.router.decider(n) for n in range(N)]
        self.dynamic = type(setup.router).dynamic_residency
        self.static_gpu = [r.gpu for r in dep.replicas]
        self.exec_table = ExecType.table()
        self.realized = [dict(tx=0.0, off=0.0, cq=0.0, q=0.0) for _ in range(N)]
        self.lambda_q = float(getattr(setup.router.params, "lambda_q", 0.0))
        # events
        self.heap: list = []
        self.seq = 0
        self.now = 0.0
        self.stats = SimStats()

    # -- event plumbing -------------------------------------------------------
    def at(self, t: float, fn, arg) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, fn, arg))

    def reachable(self, m: int, n: int) -> bool:
        """Whether a message m -> n gets through (truth, not a view)."""
        if not self.alive[n] or not self.alive[m]:
            return False
        lu = self.link_up
        return m == n or lu is None or lu[m][n]

    def send(self, m: int, n: int, t: float) -> float:
        """Arrival time at n of a hidden state sent from m at t (FIFO link)."""
        free = self.link_free[m]
        start = free[n] if free[n] > t else t
        end = start + self.tx[m][n]
        free[n] = end
        return end + self.delay[m][n]

    def true_backlog(self, n: int, t: float) -> float:
        rem = self.busy_until[n] - t
        return (rem if rem > 0 else 0.0) + self.queued_work[n]

    # -- run ------------------------------------------------------------------
    def run(self) -> SimStats:
        s = self.s
        spec = s.spec
        for rq in s.requests:
            req = _Request(rq.id, rq.user, rq.home, rq.arrival_s, rq.prompt_tokens, rq.gen_tokens)
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
        while heap:
            t, _, fn, arg = pop(heap)
            self.now = t
            events += 1
            fn(arg)
            if progress is not None and t - last_progress >= 0.1:
                last_progress = t
                progress(t)
        self.stats.events = events
        self.stats.sim_time_s = self.now
        return self.stats

    def _window(self, _) -> None:
        t = self.now
        snap = self.snapshot
        for n in range(self.N):
            snap[n] = self.true_backlog(n, t)
        self.snap_window += 1
        for n in range(self.N):
            r = self.realized[n]
            if r["tx"] or r["off"] or r["cq"] or r["q"]:
                self.deciders[n].on_window(dict(r))
                for key in r:
                    r[key] = 0.0
        if self.pending_requests > 0:
            self.at(t + self.window, self._window, None)

    def _refresh(self, v: StateView) -> None:
        lu = None if self.link_up is None else [list(row) for row in self.link_up]
        v.refresh(self.snap_window, self.snap_window * self.window, self.snapshot, self.alive, lu)

    # -- faults ---------------------------------------------------------------
    def _fault(self, f) -> None:
        """A worker dies or a link is cut. Routers learn it at the next window
        refresh, or at once when a send of theirs fails; work queued on a dead
        server is lost and its tokens are re-routed from where they reside."""
        n = self.names.get(f.server) if f.server else None
        if f.kind == "kill_worker":
            if n is None:
                raise ValueError(f"fault: unknown server {f.server!r}")
            self.alive[n] = False
            lost = [job for group in self.queue[n].values() for job in group]
            self.queue[n].clear()
            self.queued_work[n] = 0.0
            for job in lost:
                self._lost(job[0], job[3], n, f"server {f.server} died")
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
        """The token is ready at its residing server; the dense part runs, then it is routed."""
        t = self.now
        tok.t_layer = t
        self.seq += 1
        heapq.heappush(self.heap, (t + self.dense[tok.view.server], self.seq, self._decide, tok))

    def _decide(self, tok: _Token) -> None:
        tv = tok.view
        theta = tv.server
        t = self.now
        tv.now = t
        tok.t_dec = t
        tok.attempt += 1
        if not self.alive[theta]:
            self._fail(tok, f"server {self.s.cluster.names[theta]} died holding the token")
            return
        view = self.views[theta]
        if view.window != self.snap_window:
            self._refresh(view)
        try:
            a = self.deciders[theta].route(tv, tok.targets[tv.layer], view)
        except Unroutable as err:
            self._fail(tok, str(err))
            return
        tok.assign = a
        tok.decider = theta
        if a.prefetch:
            self._prefetch(a.prefetch)
        tok.view_age = t - view.opened_at
        rs = self.rep_server
        att = tok.attempt
        for r in a.replicas:  # a send to a dead server or over a cut link fails at once
            n = rs[r]
            if n != theta and not self.reachable(theta, n):
                self._lost(tok, att, n, f"cannot reach {self.s.cluster.names[n]}")
                return
        tok.jobs = jobs = [[tok, r, True, att] for r in a.replicas]
        per_server: dict[int, list] = {}
        for job in jobs:
            n = rs[job[1]]
            lst = per_server.get(n)
            if lst is None:
                per_server[n] = [job]
            else:
                lst.append(job)
        # staleness: what the decider believed about each participant vs the truth
        err = 0.0
        bu, qw, bl, adm = self.busy_until, self.queued_work, view.backlog, view.admitted
        for n in per_server:
            rem = bu[n] - t
            d = bl[n] - ((rem if rem > 0 else 0.0) + qw[n])
            if (d if d > 0 else -d) > (err if err > 0 else -err):
                err = d
        comp, lt = self.rep_comp, self.rep_loadtime
        dynamic, sg = self.dynamic, self.static_gpu
        for job in jobs:  # line 27 of Algorithm 2: the decider's own admissions
            r = job[1]
            n = rs[r]
            gpu = self.deciders[n].gpu_resident(r) if dynamic else sg[r]
            w = comp[r] if gpu else comp[r] + lt[r]
            bl[n] += w
            adm[n] += w
        tok.per_server = {n: len(js) for n, js in per_server.items()}
        tok.pending = len(per_server)
        tok.compute_end = t
        tok.fan_in_end = t
        fan_out_end = t
        nbytes = 0
        for n, sjobs in per_server.items():
            if n == theta:
                self._enqueue(n, sjobs)
            else:
                arr = self.send(theta, n, t)
                nbytes += self.msg_bytes
                if arr > fan_out_end:
                    fan_out_end = arr
                self.seq += 1
                heapq.heappush(self.heap, (arr, self.seq, self._jobs_arrive, (n, sjobs)))
        tok.fan_out_end = fan_out_end
        tok.bytes = nbytes
        tok.backlog_err = err

    def _gpu(self, n: int, r: int) -> bool:
        """Tier of replica r on server n right now."""
        return self.deciders[n].gpu_resident(r) if self.dynamic else self.static_gpu[r]

    def _prefetch(self, replicas: tuple[int, ...]) -> None:
        """Copy replicas to their server's GPU on a FIFO copy engine (v / beta each)."""
        for r in replicas:
            n = self.rep_server[r]
            start = max(self.now, self.copy_free[n])
            self.copy_free[n] = end = start + self.rep_loadtime[r]
            self.at(end, self._prefetched, r)

    def _prefetched(self, r: int) -> None:
        self.deciders[self.rep_server[r]].on_prefetched(r)

    def _jobs_arrive(self, arg) -> None:
        n, jobs = arg
        if not self.alive[n]:
            for job in jobs:
                self._lost(job[0], job[3], n, f"server {self.s.cluster.names[n]} died")
            return
        self._enqueue(n, jobs)

    def _enqueue(self, n: int, jobs: list) -> None:
        q = self.queue[n]
        comp = self.rep_comp
        work = 0.0
        for job in jobs:
            r = job[1]
            group = q.get(r)
            if group is None:
                q[r] = [job]
                work += comp[r] if self._gpu(n, r) else comp[r] + self.rep_loadtime[r]
            else:
                group.append(job)
                work += comp[r]
        self.queued_work[n] += work
        if not self.busy[n]:
            self._start_batch(n)

    def _start_batch(self, n: int) -> None:
        q = self.queue[n]
        r, jobs = q.popitem(last=False)
        gpu = self._gpu(n, r)
        load = 0.0 if gpu else self.rep_loadtime[r]
        if self.dynamic:
            self.deciders[n].on_execute(r, not gpu)
        dur = load + len(jobs) * self.rep_comp[r]
        if q:
            self.queued_work[n] -= dur
        else:
            self.queued_work[n] = 0.0  # no float drift
        end = self.now + dur
        self.busy[n] = True
        self.busy_until[n] = end
        st = self.stats
        st.batches += 1
        st.coalesced_jobs += len(jobs) - 1
        if not gpu:
            for job in jobs:
                job[2] = False
        self.seq += 1
        heapq.heappush(self.heap, (end, self.seq, self._batch_done, (n, jobs)))

    def _batch_done(self, arg) -> None:
        n, jobs = arg
        t = self.now
        self.busy[n] = False
        if not self.alive[n]:
            for job in jobs:
                self._lost(job[0], job[3], n, f"server {self.s.cluster.names[n]} died")
            return
        for job in jobs:
            tok = job[0]
            if job[3] != tok.attempt or tok.req.failed:
                continue  # a re-routed or failed token's stale work
            if t > tok.compute_end:
                tok.compute_end = t
            ps = tok.per_server
            left = ps[n] - 1
            ps[n] = left
            if left == 0:
                agg = tok.assign.next_server
                if n == agg:
                    arr = t
                elif not self.reachable(n, agg):
                    self._lost(tok, job[3], agg, f"partial output cannot reach {self.s.cluster.names[agg]}")
                    continue
                else:
                    arr = self.send(n, agg, t)
                    tok.bytes += self.msg_bytes
                if arr > tok.fan_in_end:
                    tok.fan_in_end = arr
                tok.pending -= 1
                if tok.pending == 0:
                    if tok.fan_in_end <= t:
                        self._layer_done(tok)
                    else:
                        self.seq += 1
                        heapq.heappush(self.heap, (tok.fan_in_end, self.seq, self._layer_done_at,
                                                   (tok, tok.attempt)))
        if self.queue[n]:
            self._start_batch(n)

    def _layer_done_at(self, arg) -> None:
        tok, attempt = arg
        if attempt == tok.attempt and not tok.req.failed:
            self._layer_done(tok)

    def _layer_done(self, tok: _Token) -> None:
        t = self.now
        tok.retries = 0
        a = tok.assign
        tv = tok.view
        reps = a.replicas
        rs, re, rp, lt = self.rep_server, self.rep_expert, self.rep_prec, self.rep_loadtime
        theta = tv.server
        et = self.exec_table
        servers, experts, precs, gpus, types = [], [], [], [], []
        off = 0.0
        for job, mode in zip(tok.jobs, a.modes):
            r, g = job[1], job[2]
            n = rs[r]
            servers.append(n)
            experts.append(re[r])
            precs.append(rp[r])
            gpus.append(g)
            types.append(et[mode][n == theta][g])
            if not g and lt[r] > off:
                off = lt[r]
        fanout = tok.fan_out_end - tok.t_dec
        compute = tok.compute_end - tok.fan_out_end
        if compute < 0:
            compute = 0.0
        ce = tok.compute_end if tok.compute_end > tok.fan_out_end else tok.fan_out_end
        fanin = t - ce
        if tv.layer == self.L - 1 and a.next_server != tv.home:
            tok.bytes += self.msg_bytes  # the final hop home, sent right after this layer
        self.w.token_layer(
            (tv.request, tv.index, tv.layer, tok.t_layer, theta, a.next_server,
             len(tok.per_server), fanout, compute, fanin, t - tok.t_layer, tok.bytes, a.dq,
             a.est_delay, tok.view_age, tok.backlog_err),
            (a.targets, experts, reps, servers, precs, gpus, types))
        self.stats.token_layers += 1
        rl = self.realized[tok.decider]
        rl["tx"] += fanout + fanin
        rl["off"] += off
        rl["cq"] += compute - off if compute > off else 0.0
        rl["q"] += self.lambda_q * a.dq
        tv.lam_acc += a.dq
        tv.server = a.next_server
        tv.layer += 1
        if tv.layer < self.L:
            self._begin_layer(tok)
            return
        home = tv.home
        if tv.server == home:
            self._token_done(tok)
        elif not self.reachable(tv.server, home):
            self._fail(tok, f"home {self.s.cluster.names[home]} unreachable")
        else:
            arr = self.send(tv.server, home, t)
            self.at(arr, self._token_done, tok)

    def _token_done(self, tok: _Token) -> None:
        req = tok.req
        if req.failed:
            return
        nxt = req.token_done(tok.view.index, tok.view.lam_acc)
        if nxt == FINISHED:
            self._request_done(req)
        elif nxt is not None:
            self._start_token(req, nxt)

    def _request_done(self, req: _Request) -> None:
        t = self.now
        self.w.request((req.rid, req.user, req.home, req.arrival, t, t - req.arrival,
                        req.prompt + req.gen, *req.lam_stats(),
                        "failed" if req.failed else "ok", req.reason))
        for d in {id(x): x for x in self.deciders}.values():
            d.on_request_done(req.rid)
        self.pending_requests -= 1

    def _fail(self, tok: _Token, reason: str) -> None:
        req = tok.req
        if req.failed:
            return
        req.failed = True
        req.reason = reason
        self.stats.failed_requests += 1
        self._request_done(req)
