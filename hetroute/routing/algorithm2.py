"""Algorithm 2: online set-level collaborative Top-k routing.

``SetLevelRouter.route`` is lines 4-29 of Algorithm 2 for one token-layer:
exact-first candidates pruned by guards (18) and (19) (lines 5-15), the
dominance fast path (17-18), exact enumeration when the candidate product is
at most R or beam search plus 1-exchange otherwise (19-23), the emergency
fallback to a full-precision exact replica (24-28) and the aggregation server
by eq. (11) (29). ``set_level=False`` turns it into the per-expert rule of the
Remark after Property 4 (each target takes its cheapest candidate by eq. 9),
used by the greedy router and the "without set-level routing" ablation.

Line 27's backlog update is done by the backend through ``StateView.admit`` so
that every router, not just this one, keeps its view current between windows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..cost import CostModel, CostWeights
from ..state import Assignment, Mode, StateView, TokenView, Unroutable
from .compiled import route_kernel
from .search import INF, Candidate, LayerProblem, beam_search, enumerate_best, one_exchange


@dataclass(frozen=True)
class Alg2Params:
    """Knobs of Algorithm 2 with the defaults of Section VI-A where it gives them."""

    beam_width: int = 8  # B (W=8)
    enum_limit: int = 64  # R: enumerate when the candidate product is at most this
    window_s: float = 0.02  # Delta t, the scheduling window (not given by the paper)
    local_threshold_s: float = 0.002  # tau_loc of the dominance fast path
    set_level: bool = True  # False: per-expert greedy (Remark after Property 4)
    fast_path: bool = True
    exchange: bool = True
    lookahead_weight: float = 1.0  # scale of T^next in eq. (11); 0 = pure gather cost
    #: price a replica the decider has a job queued at (``StateView.pending``) at the
    #: marginal cost of one more token in that step (``cost_model: hardware``)
    marginal: bool = False
    #: run the numba kernel (``compiled.py``); False runs the Python reference below.
    #: Both return the same assignment bit for bit (tests/test_decision_equivalence.py).
    compiled: bool = True

    def __post_init__(self) -> None:
        if self.beam_width < 1 or self.enum_limit < 1:
            raise ValueError("beam_width and enum_limit must be >= 1")
        if self.window_s <= 0:
            raise ValueError("window_s must be > 0")


class SetLevelRouter:
    """Algorithm 2 over a fixed deployment and cost model."""

    def __init__(self, cost: CostModel, params: Alg2Params = Alg2Params(),
                 popularity: list[float] | None = None,
                 weights: CostWeights = CostWeights()) -> None:
        self.cost = cost
        self.params = params
        self.popularity = popularity
        self.evaluations = 0  # work counter (Property 5 is tested on it)
        self._build_candidates()
        self._build_tables()
        self.set_weights(weights)

    def spawn(self) -> "SetLevelRouter":
        """A router with its own unit costs and caches, sharing the immutable
        candidate tables (one per decider, cheap to create)."""
        other = object.__new__(SetLevelRouter)
        other.cost, other.params, other.popularity = self.cost, self.params, self.popularity
        other.evaluations = 0
        other._exact, other._subs, other._fallback = self._exact, self._subs, self._fallback
        other.weights = self.weights
        other._trans, other._lambda, other._cq = self._trans, self._lambda, self._cq
        other._lookahead = self._lookahead
        other._marg = self._marg
        other._agg_cache = [dict() for _ in range(self.cost.shape.n_layers)]
        other._agg_fns = {}
        other._cands, other._ctab, other._pools = self._cands, self._ctab, self._pools
        other._last, other._twin_off = self._last, self._twin_off
        other._tr_a, other._la_a, other._la_home = self._tr_a, self._la_a, self._la_home
        other._fp, other._ip, other._fp_of = self._fp, self._ip, self._fp_of
        other._use_kernel = self._use_kernel
        other._new_scratch()
        return other

    # -- tables that depend on the unit costs alpha (rebuilt by eq. 21) ---------
    def set_weights(self, w: CostWeights) -> None:
        """Re-price with new unit costs; cheap, as eq. (21) may call it every window."""
        self.weights = w
        c = self.cost
        self._trans = [[w.tx * x for x in row] for row in c.trans]
        self._lambda = w.q * c.lambda_q
        self._cq = w.cq
        la = c.lookahead_table(self.popularity, w)
        k = self.params.lookahead_weight
        self._lookahead = [[k * x for x in row] for row in la]
        self._agg_cache = [dict() for _ in range(c.shape.n_layers)]
        self._agg_fns: dict = {}
        # the compiled kernel's copies of the weighted tables
        N = c.cluster.n
        self._tr_a = np.array(self._trans, dtype=np.float64).reshape(N, N)
        home_rows = [[k * self._trans[n][h] for n in range(N)] for h in range(N)]
        self._la_home = len(self._lookahead)
        self._la_a = np.array(self._lookahead + home_rows, dtype=np.float64)
        self._kernel_params()

    def _kernel_params(self) -> None:
        """The kernel's knobs, rebuilt whenever ``params`` is replaced."""
        p, w = self.params, self.weights
        self._fp_of, self._use_kernel = p, p.compiled
        self._fp = np.array([0.0, p.window_s, self._lambda, w.off, w.cq, self._cq,
                             p.local_threshold_s], dtype=np.float64)
        self._ip = np.array([0, 0, p.enum_limit, p.beam_width, int(p.set_level),
                             int(p.fast_path), int(p.exchange), 0, self._twin_off], dtype=np.int64)

    def _build_tables(self) -> None:
        """Flat candidate tables for ``compiled.route_kernel`` (layout in its docstring)."""
        n_exp = len(self._exact)
        cands: list[Candidate] = []
        pools = np.zeros((n_exp, 3, 2), dtype=np.int64)
        for e in range(n_exp):
            for kind, group in enumerate((self._exact[e], self._subs[e], self._fallback[e])):
                pools[e, kind] = (len(cands), len(cands) + len(group))
                cands.extend(group)
        self._twin_off = -1
        if self._marg:
            self._twin_off = len(cands)
            cands = cands + [self._marg[id(x)] for x in cands]
        self._cands = cands
        gpu = self.cost.rep_gpu
        self._ctab = np.array([(x.server, x.replica, x.mode, float(x.guarded), x.load, x.comp,
                                x.svc, x.dq, float(gpu[x.replica])) for x in cands],
                              dtype=np.float64).reshape(-1, 9)
        self._pools = pools
        self._last = self.cost.shape.n_layers - 1
        self._new_scratch()

    def _new_scratch(self) -> None:
        """Per-decider buffers of the kernel (sized on first use per k)."""
        N = self.cost.cluster.n
        self._bufs: dict[tuple, tuple] = {}
        self._pending = np.zeros(len(self.cost.deployment.replicas), dtype=np.bool_)
        self._reach = np.ones((N + 1, N), dtype=np.bool_)

    def _build_candidates(self) -> None:
        """Candidate objects per expert; independent of the unit costs."""
        c, dep, q = self.cost, self.cost.deployment, self.cost.quality

        def cand(r: int, dq: float, mode: int, guarded: bool = True) -> Candidate:
            return Candidate(r, c.rep_server[r], dq, mode, c.rep_load[r], c.rep_comp[r],
                             c.service(r), guarded)

        n_exp = dep.n_experts
        exact = [tuple(cand(r, c.rep_q[r], Mode.EXACT) for r in dep.by_expert[e])
                 for e in range(n_exp)]
        subs = []
        for e in range(n_exp):
            group = []
            for e_hat, loss in q.substitutes[e]:
                for r in dep.by_expert[e_hat]:
                    group.append(cand(r, c.rep_q[r] + loss, Mode.SUBSTITUTE))
            subs.append(tuple(group))
        fallback = [tuple(cand(r, 0.0, Mode.FALLBACK, guarded=False)
                          for r in dep.full_precision(e)) for e in range(n_exp)]
        self._exact, self._subs, self._fallback = exact, subs, fallback
        #: each candidate's twin when its replica already has a queued job: one more token
        #: costs the marginal batched time and no second load (cost_model: hardware)
        self._marg: dict[int, Candidate] = {}
        if self.params.marginal:
            svc = c.belief
            for group in (*exact, *subs, *fallback):
                for x in group:
                    rep = dep.replicas[x.replica]
                    m = svc.marginal_s(rep.server, rep.precision, 1)
                    self._marg[id(x)] = Candidate(x.replica, x.server, x.dq, x.mode, 0.0, m, m,
                                                  x.guarded)

    # -- helpers ---------------------------------------------------------------
    def _aggregator_fn(self, layer: int, home: int):
        """(aggregator function, N x N pair cache) for this layer (and home, at the last)."""
        last = layer == self.cost.shape.n_layers - 1
        key = (layer, home) if last else layer
        fns = self._agg_fns.get(key)
        if fns is None:
            N = self.cost.cluster.n
            self._agg_fns[key] = fns = (self._make_aggregator(layer, home, last),
                                        [[-1] * N for _ in range(N)])
        return fns

    def _make_aggregator(self, layer: int, home: int, last: bool):
        tr = self._trans
        cache = self._agg_cache[layer]
        if last:
            k = self.params.lookahead_weight
            la = [k * tr[n][home] for n in range(len(tr))]
        else:
            la = self._lookahead[layer + 1]

        if last:
            cache = cache.setdefault(("home", home), {})

        def agg(servers: tuple[int, ...]) -> int:
            a = cache.get(servers)
            if a is None:
                best, best_c = servers[0], INF
                for n in servers:
                    cst = la[n]
                    for m in servers:
                        if m != n:
                            cst += tr[m][n]
                    if cst < best_c:
                        best, best_c = n, cst
                cache[servers] = a = best
            return a
        return agg

    def _admissible(self, pool, theta: int, slack: float, view: StateView, now: float,
                    admitted: list[float]) -> list[Candidate]:
        """Guards (18) and (19) and reachability, candidate by candidate."""
        bl, cap = admitted, self.params.window_s
        if self._marg and view.pending:
            pend, twin = view.pending, self._marg
            pool = [twin[id(c)] if pend.get(c.replica, -1.0) > now else c for c in pool]
        slack += 1e-12
        if view.faultless:
            return [c for c in pool if c.dq <= slack and bl[c.server] + c.svc <= cap]
        return [c for c in pool if c.dq <= slack and bl[c.server] + c.svc <= cap
                and view.reachable(theta, c.server)]

    # -- Algorithm 2, lines 4-29 -----------------------------------------------
    def route(self, tok: TokenView, targets: tuple[int, ...], view: StateView) -> Assignment:
        if self.params is not self._fp_of:
            self._kernel_params()
        if not self._use_kernel:
            return self.route_reference(tok, targets, view)
        k = len(targets)
        bufs = self._bufs.get(targets)
        if bufs is None:
            bufs = self._bufs[targets] = (np.array(targets, dtype=np.int64),
                                          np.zeros(3 * k + 3, dtype=np.int64))
        tgt, out = bufs
        layer = tok.layer
        la_row = layer + 1 if layer < self._last else self._la_home + tok.home
        reach = self._reach
        if not view.faultless:
            reach = np.ones_like(reach)
            reach[0] = view.alive
            if view.link_up is not None:
                reach[1:] = view.link_up
        pending = self._pending
        if self._twin_off >= 0:
            pending[:] = False
            now = tok.now
            for r, t in view.pending.items():
                if t > now:
                    pending[r] = True
        delay, dq = route_kernel(self._ctab, self._pools, self._tr_a, self._la_a, tgt,
                                 view.backlog, view.admitted, reach, pending, self._fp, self._ip,
                                 out, tok.server, la_row, tok.lam_max - tok.lam_acc,
                                 view.faultless)
        o = out.tolist()
        self.evaluations += o[2 * k + 1]
        if o[2 * k + 2]:
            if o[2 * k + 2] == 1:
                raise Unroutable(f"no reachable full-precision replica of expert {o[0]}")
            raise Unroutable("fallback assignment infeasible")  # pragma: no cover - Property 1
        return Assignment(tuple(targets), tuple(o[:k]), tuple(o[k:2 * k]), o[2 * k], dq, delay)

    def route_reference(self, tok: TokenView, targets: tuple[int, ...], view: StateView
                        ) -> Assignment:
        """The readable Python implementation the kernel is a port of."""
        theta = tok.server
        slack = tok.lam_max - tok.lam_acc
        bl, adm = view.backlog.tolist(), view.admitted.tolist()  # Python floats: faster here
        cands: list[list[Candidate]] = []
        missing = False
        for e in targets:  # lines 5-15: exact first, substitutes only if none admissible
            cl = self._admissible(self._exact[e], theta, slack, view, tok.now, adm)
            if not cl:
                cl = self._admissible(self._subs[e], theta, slack, view, tok.now, adm)
            if not cl:
                missing = True
            cands.append(cl)
        p = self.params
        if (not missing and p.fast_path and p.set_level
                and bl[theta] <= p.local_threshold_s):
            fast = self._dominance(cands, targets, theta, slack, bl, adm)
            if fast is not None:
                return fast
        cq = self._cq
        w = self.weights
        agg_fn, pair_agg = self._aggregator_fn(tok.layer, tok.home)
        problem = LayerProblem(theta=theta, cands=cands, trans=self._trans,
                               queue=bl if cq == 1.0 else [cq * x for x in bl],
                               backlog=adm,
                               capacity=p.window_s, slack=slack, lambda_q=self._lambda,
                               aggregator=agg_fn, w_off=w.off, w_cq=w.cq, pair_agg=pair_agg)
        best = None
        if not missing:
            best = self._search(problem)
        if best is None:  # lines 24-28: emergency fallback
            best = self._fallback_search(problem, targets, theta, view)
        chosen, ev = best
        self.evaluations += problem.evaluations
        reps = tuple(c.replica for c in chosen)
        dq = sum(c.dq for c in chosen)
        return Assignment(targets=tuple(targets), replicas=reps,
                          modes=tuple(c.mode for c in chosen), next_server=ev.aggregator,
                          dq=dq, est_delay=ev.delay)

    def _search(self, problem: LayerProblem):
        p = self.params
        if not p.set_level:
            return self._per_expert(problem)
        if problem.product_size() <= p.enum_limit:
            return enumerate_best(problem)
        found = beam_search(problem, p.beam_width)
        if found is not None and p.exchange:
            found = one_exchange(problem, *found)
        return found

    def _per_expert(self, problem: LayerProblem):
        """Each target independently takes its cheapest candidate by eq. (9)."""
        theta, tr, lam = problem.theta, problem.trans, problem.lambda_q
        chosen = []
        for options in problem.cands:
            best = min(options, key=lambda c: tr[theta][c.server] + problem.queue[c.server]
                       + problem.job_cost(c) + lam * c.dq)
            chosen.append(best)
        chosen_t = tuple(chosen)
        ev = problem.evaluate(chosen_t)
        if ev.objective == INF:
            return None
        return chosen_t, ev

    def _dominance(self, cands: list[list[Candidate]], targets, theta: int, slack: float,
                   bl: list[float], adm: list[float]) -> Assignment | None:
        """Lines 17-18: every target has an admissible GPU-resident exact replica on
        theta, and executing all of them there is provably no worse than any
        assignment that uses a remote server. Such an assignment pays fan-out to
        some remote n plus n's queue and job, and quality terms are >= 0, so
        that sum is a lower bound; the local set is one branch at theta with
        no transmission, aggregated at theta."""
        self.evaluations += 1
        gpu = self.cost.rep_gpu
        local = []
        for options in cands:
            for c in options:
                if c.server == theta and c.mode == Mode.EXACT and gpu[c.replica]:
                    local.append(c)
                    break
            else:
                return None
        w = self.weights
        wo, wc, cq = w.off, w.cq, self._cq
        dq = svc = 0.0
        delay = cq * bl[theta]
        for c in local:
            dq += c.dq
            svc += c.svc
            delay += wo * c.load + wc * c.comp
        if dq > slack + 1e-12 or adm[theta] + svc > self.params.window_s:
            return None
        objective = delay + self._lambda * dq
        row = self._trans[theta]
        for options in cands:
            for c in options:
                n = c.server
                if n != theta and row[n] + cq * bl[n] + wo * c.load + wc * c.comp < objective:
                    return None
        return Assignment(targets=tuple(targets), replicas=tuple(c.replica for c in local),
                          modes=(Mode.EXACT,) * len(local), next_server=theta, dq=dq,
                          est_delay=delay)

    def _fallback_search(self, problem: LayerProblem, targets, theta: int, view: StateView):
        """Targets without an admissible candidate go to a full-precision exact
        replica (zero quality increment, stability guard relaxed); the others
        are re-optimised around them. If even that is infeasible, all fall back."""
        fb = []
        for e in targets:
            options = [c for c in self._fallback[e] if view.reachable(theta, c.server)]
            if not options:
                raise Unroutable(f"no reachable full-precision replica of expert {e}")
            fb.append(options)
        if any(not c for c in problem.cands) and not all(not c for c in problem.cands):
            problem.cands = [c if c else fb[j] for j, c in enumerate(problem.cands)]
            found = self._search(problem)
            if found is not None:
                return found
        # Every target on a full-precision exact replica: zero quality increment
        # and exempt from (19), hence always feasible (Property 1).
        problem.cands = fb
        found = enumerate_best(problem) if problem.product_size() <= self.params.enum_limit \
            else beam_search(problem, self.params.beam_width)
        if found is None:  # pragma: no cover - excluded by Property 1
            raise Unroutable("fallback assignment infeasible")
        return found
