"""The token-layer core both backends call: decide -> admit -> dispatch plan -> record.

Transport-free and clock-free: a backend hands it the decider, its view, the
token and the true state it may compare against, and gets back what to send
where and, once the layer is done, a typed record. The simulator and the
emulator therefore differ only in how time passes and how bytes move.

What a decider may know is enforced here, not in each backend: it sees its
own server's live expert-cache state, and for every other server only the
static tier of the deployment (a real server cannot read a peer's cache).
Admissions (line 27 of Algorithm 2) add the router's *belief* of a job's
stream time to its view; the world's time comes from the step scheduler.

Nothing a router reports is trusted for accounting: each layer's quality increment is
derived here from the quality model and the replicas executed (a router's own
``Assignment.dq`` that differs is counted in ``dq_misreported``, which the conformance
check turns into a failure), and the record handed back to the router
(``on_layer_done``) is what the backend measured, including the world's offload time
that eq. (21)'s feedback needs.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from hetroute.deployment import Deployment
from hetroute.quality import QualityModel
from hetroute.residency import Residency
from hetroute.routers.base import Router
from hetroute.service import PaperService, ServiceModel, make_service
from hetroute.system import Cluster, MoEShape
from hetroute.state import Assignment, ExecType, StateView, TokenView, Unroutable

from .records import TokenLayerRecord

DECISION_SAMPLES = 256  # token-layers timed at set-up for ``decision_s: calibrated``
DECISION_REPEATS = 5  # passes over them; each token-layer's fastest pass counts
PLAN_MEMO = 1 << 16  # assignments whose participants and increment are kept (then start over)
_thread_time = time.thread_time
#: builds a record without the named tuple's Python-level ``__new__`` (the fields are
#: passed in order, all of them, so the generated constructor would add nothing)
_new_record = tuple.__new__
assert TokenLayerRecord._fields[-1] == "window"


def with_window(rec: TokenLayerRecord, window: int) -> TokenLayerRecord:
    """``rec._replace(window=window)`` without the named tuple's generic ``_replace``
    (a dict of every field): the window is the last field."""
    return _new_record(TokenLayerRecord, (*rec[:-1], window))


@dataclass(slots=True)
class Routed:
    """A decision and what follows from it, before any byte moves."""

    assignment: Assignment
    per_server: dict[int, list[int]]  # participant -> positions in the assignment
    decision_s: float  # CPU seconds the decision took (measured)
    view_age_s: float
    backlog_err_s: float  # belief minus truth at the participant where they differ most
    dq: float = 0.0  # the layer's quality increment, derived by the backend (eq. 8 terms)


class TokenLayerCore:
    """Shared by both backends for one run (one per process in the emulator)."""

    def __init__(self, router: Router, deployment: Deployment, cluster: Cluster, shape: MoEShape,
                 physics: str, quality: QualityModel) -> None:
        dep = deployment
        self.router = router
        self.quality = quality
        self.deployment = dep
        self.world: ServiceModel = make_service(physics, cluster, shape)
        #: the router's belief; a router without one believes the paper's model
        self.belief: ServiceModel = getattr(router, "service", None) or PaperService(cluster, shape)
        self.rep_server = [r.server for r in dep.replicas]
        self.rep_expert = [r.expert for r in dep.replicas]
        self.rep_prec = [int(r.precision) for r in dep.replicas]
        self.static_gpu = [r.gpu for r in dep.replicas]
        self.exec_table = ExecType.table()
        b, w = self.belief, self.world
        #: the decider's belief of one job's stream time, by replica and tier
        self.admit_gpu = [b.expert_s(r.server, r.precision, 1) for r in dep.replicas]
        self.admit_cpu = [b.expert_s(r.server, r.precision, 1) + b.load_s(r.server, r.precision)
                          for r in dep.replicas]
        #: the world's GPU-CPU load of each replica (realized offload cost)
        self.world_load = [w.load_s(r.server, r.precision) for r in dep.replicas]
        #: (targets, replicas) -> (participant -> positions, quality increment): a run sees
        #: the same few assignments again and again, and both follow from the pair alone
        self._plans: dict[tuple, tuple[dict[int, list[int]], float]] = {}
        #: replicas -> (executed experts, servers, precisions) for the records
        self._rows: dict[tuple, tuple[tuple, tuple, tuple]] = {}
        #: token-layers whose router-reported ``Assignment.dq`` differs from the derived one
        self.dq_misreported = 0
        self.dq_misreport_first: tuple | None = None  # (request, token, layer, reported, derived)

    # -- decide and admit -------------------------------------------------------
    def decide(self, decider: Router, residency: Residency, view: StateView, tok: TokenView,
               targets: tuple[int, ...], true_backlog) -> Routed:
        """Route one token-layer at its residing server; raises ``Unroutable``.

        ``residency`` is the residing server's (``decider.residency(server)``): the
        decider's own server's tiers are read from it, every other server's from the
        deployment. ``true_backlog(n)`` is server n's real queue in stream seconds (the
        simulator's truth; the emulator's latest report), used only to measure
        the view's staleness."""
        t0 = _thread_time()  # CPU time: an emulation host's other workers do not inflate it
        a = decider.route(tok, targets, view)
        spent = _thread_time() - t0
        theta = tok.server
        rs = self.rep_server
        try:
            plan = self._plans.get((a.targets, a.replicas))
        except TypeError:  # a router that hands back lists: not memoised
            plan = None
        if plan is None:
            plan = self._plan(a.targets, a.replicas)
        per_server, dq = plan
        err = 0.0
        bl, adm, pend = view.backlog, view.admitted, view.pending
        item = bl.item  # Python floats: numpy scalar arithmetic costs more, same IEEE result
        for n in per_server:
            d = item(n) - true_backlog(n)
            if (d if d > 0 else -d) > (err if err > 0 else -err):
                err = d
        now = tok.now
        is_gpu, sg, ag, ac = residency.is_gpu, self.static_gpu, self.admit_gpu, self.admit_cpu
        for r in a.replicas:  # line 27 of Algorithm 2 (StateView.admit), in the decider's belief
            n = rs[r]
            b = item(n)
            until = now + b
            if until > pend.get(r, -1.0):
                pend[r] = until
            gpu = is_gpu(r) if n == theta else sg[r]
            w = ag[r] if gpu else ac[r]
            bl[n] = b + w
            adm[n] = adm.item(n) + w
        d = a.dq - dq
        if d > 1e-12 + 1e-9 * dq or d < -1e-12 - 1e-9 * dq:  # the router's belief is wrong
            self.dq_misreported += 1
            if self.dq_misreport_first is None:
                self.dq_misreport_first = (tok.request, tok.index, tok.layer, a.dq, dq)
        return Routed(a, per_server, spent, tok.now - view.opened_at, err, dq)

    def _plan(self, targets: tuple[int, ...], replicas: tuple[int, ...]
              ) -> tuple[dict[int, list[int]], float]:
        """Participants (server -> positions in the assignment) and the quality increment
        of an assignment, memoised: ``Routed.per_server`` is read, never changed, so
        decisions with the same assignment share it."""
        rs = self.rep_server
        per_server: dict[int, list[int]] = {}
        for j, r in enumerate(replicas):
            n = rs[r]
            lst = per_server.get(n)
            if lst is None:
                per_server[n] = [j]
            else:
                lst.append(j)
        plan = per_server, self.increment(targets, replicas)
        if isinstance(targets, tuple) and isinstance(replicas, tuple):
            if len(self._plans) >= PLAN_MEMO:
                self._plans.clear()
            self._plans[(targets, replicas)] = plan
        return plan

    def increment(self, targets: tuple[int, ...], replicas: tuple[int, ...]) -> float:
        """The quality increment of an assignment (the inner sums of eq. 8), from the run's
        quality model and the replicas actually executed: the backend accounts quality,
        so a router cannot under-report it (its own ``Assignment.dq`` is not read)."""
        q, re, rp = self.quality, self.rep_expert, self.rep_prec
        dq = 0.0
        for t, r in zip(targets, replicas):
            try:
                dq += q.increment(t, re[r], rp[r])
            except KeyError as err:
                raise RuntimeError(f"router {self.router.name}: replica {r} runs expert {re[r]} "
                                   f"for target {t}, which is neither it nor one of its "
                                   f"substitutes ({err.args[0]})") from None
        return dq

    # -- the layer is done ------------------------------------------------------
    def record(self, tok: TokenView, routed: Routed, gpus: list[bool], t_start: float,
               t_decided: float, t_dispatch: float, fan_out_end: float, compute_end: float,
               t_done: float, nbytes: int, participants: int, window: int) -> TokenLayerRecord:
        """The typed record of a finished token-layer; ``window`` is the backend's count of
        scheduling windows at completion (routers group their feedback by it)."""
        a = routed.assignment
        theta = tok.server
        et, reps = self.exec_table, a.replicas
        cols = self._rows.get(reps) if isinstance(reps, tuple) else None
        if cols is None:
            cols = self._record_columns(reps)
        experts, servers, precisions = cols
        types = [et[m][n == theta][g] for m, n, g in zip(a.modes, servers, gpus)]
        compute = compute_end - fan_out_end
        ce = compute_end if compute_end > fan_out_end else fan_out_end
        off = 0.0  # the world's load time of the slowest CPU-tier replica (realized offload)
        if not all(gpus):
            wl = self.world_load
            for r, g in zip(reps, gpus):
                if not g and wl[r] > off:
                    off = wl[r]
        return _new_record(TokenLayerRecord, (
            tok.request, tok.index, tok.layer, t_start, theta, a.next_server, participants,
            fan_out_end - t_dispatch, compute if compute > 0 else 0.0, t_done - ce,
            t_done - t_start, nbytes, routed.dq, a.est_delay, routed.view_age_s, routed.backlog_err_s,
            t_decided - t_start, t_dispatch - t_decided, a.targets, list(experts), reps,
            list(servers), list(precisions), gpus, types, off, window))

    def _record_columns(self, reps: tuple[int, ...]) -> tuple[tuple, tuple, tuple]:
        """Executed experts, servers and precisions of an assignment's replicas, memoised
        (records get their own list copies: a router may keep what it is handed)."""
        cols = (tuple(self.rep_expert[r] for r in reps), tuple(self.rep_server[r] for r in reps),
                tuple(self.rep_prec[r] for r in reps))
        if isinstance(reps, tuple):
            if len(self._rows) >= PLAN_MEMO:
                self._rows.clear()
            self._rows[reps] = cols
        return cols


def calibrate_decision_s(router: Router, samples: int = DECISION_SAMPLES,
                         repeats: int = DECISION_REPEATS, clock=time.thread_time) -> float:
    """CPU seconds of one decision of this router on its calibration tokens (a fresh
    instance bound to the same deployment, empty views), rounded to a microsecond: the
    constant the simulator charges per decision under ``decision_s: calibrated``.

    Each token-layer is decided ``repeats`` times; its cost is the fastest of them, and
    the constant is the median over token-layers. A decision's CPU time grows when other
    processes share the cores (caches, memory bandwidth, a busy hyperthread sibling): with
    one pass, a sweep's constants rose by up to 2x beside another job. The fastest of
    several passes is what the decision costs the machine alone, and the first pass's
    warm-up (caches, a JIT's first call) drops out too."""
    r = type(router)(router.problem, router.params)
    r.bind(router.deployment)
    pr = r.problem
    N, L = pr.cluster.n, pr.shape.n_layers
    cal = pr.calibration
    deciders = [r.decider(n) for n in range(N)]
    views = [StateView(N) for _ in range(N)]
    best: dict[int, float] = {}
    for _ in range(max(1, repeats)):
        for i in range(min(samples, len(cal.homes) * L)):
            tok, layer = i // L, i % L
            home = int(cal.homes[tok])
            tv = TokenView(-1 - tok, 0, home, pr.lam_max, layer=layer)
            try:
                t0 = clock()
                deciders[home].route(tv, tuple(int(e) for e in cal.targets[tok, layer]), views[home])
                spent = clock() - t0
            except Unroutable:
                continue
            best[i] = min(spent, best.get(i, spent))
    return round(statistics.median(best.values()), 6) if best else 0.0
