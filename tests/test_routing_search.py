"""Algorithm 2's search decisions, judged from the outside.

Every check recomputes what the router chose from the chosen replicas and the
cost model's tables (eq. 10 by ``CostModel.layer_delay``, the quality
increments by ``QualityModel.increment``, eq. 11 by ``CostModel.aggregator``)
or, for ``beam_search`` on a hand-built ``LayerProblem``, from the problem's
raw fields; none trusts the router's ``dq``/``est_delay``/``objective``.
They go through public entry points only (``SetLevelRouter.route``,
``beam_search(problem, width)``, ``enumerate_plain``), so they hold across
rewrites of the search internals. ``tests/mutants.py`` lists the code
mutations each one is meant to catch.
"""

from __future__ import annotations

from itertools import product

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from hetroute.cost import CostModel
from hetroute.deployment import Deployment, Replica
from hetroute.quality import QualityModel
from hetroute.routing.algorithm2 import Alg2Params, SetLevelRouter
from hetroute.routing.search import Candidate, LayerProblem, beam_search, enumerate_plain
from hetroute.state import Mode, StateView, TokenView
from hetroute.system import Cluster, Precision

from . import factories as F
from .factories import engine  # noqa: F401 - the fixture below

pytestmark = pytest.mark.usefixtures("engine")  # every test on both implementations
from .factories import check_aggregator, recompute

SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
INF = float("inf")


# -- independent recomputation of a router's assignment -------------------------------

def candidates(cost: CostModel, e: int, view: StateView, slack: float, cap: float):
    """Exact-first admissible (replica, dq) of target e (lines 5-15), written apart."""
    dep, q = cost.deployment, cost.quality

    def ok(r, dq):
        return dq <= slack + 1e-12 and view.admitted[cost.rep_server[r]] + cost.service(r) <= cap
    exact = [(r, cost.rep_q[r]) for r in dep.by_expert[e] if ok(r, cost.rep_q[r])]
    if exact:
        return exact
    return [(r, cost.rep_q[r] + loss) for e_hat, loss in q.substitutes[e]
            for r in dep.by_expert[e_hat] if ok(r, cost.rep_q[r] + loss)]


def jointly_feasible(cost: CostModel, combo, view: StateView, slack: float, cap: float,
                     unguarded=()) -> bool:
    if sum(dq for _, dq in combo) > slack + 1e-12:
        return False
    load: dict[int, float] = {}
    for j, (r, _) in enumerate(combo):
        if j in unguarded:
            continue
        n = cost.rep_server[r]
        load[n] = load.get(n, 0.0) + cost.service(r)
    return all(view.admitted[n] + s <= cap for n, s in load.items())


def combo_objective(cost: CostModel, combo, tok: TokenView, view: StateView,
                    popularity=None) -> float:
    reps = tuple(r for r, _ in combo)
    servers = tuple(sorted({cost.rep_server[r] for r in reps}))
    if tok.layer == cost.shape.n_layers - 1:
        la = [cost.trans[n][tok.home] for n in range(cost.cluster.n)]
    else:
        la = cost.lookahead_table(popularity)[tok.layer + 1]
    agg = cost.aggregator(servers, la)
    return cost.layer_delay(tok.server, reps, view.backlog, agg) \
        + cost.lambda_q * sum(dq for _, dq in combo)


def brute_force(cost, tok, view, options, cap, unguarded=()):
    """min over the product of ``options`` of D + lambda_q * dq, or INF."""
    slack = tok.lam_max - tok.lam_acc
    best = INF
    for combo in product(*options):
        if jointly_feasible(cost, combo, view, slack, cap, unguarded):
            best = min(best, combo_objective(cost, combo, tok, view))
    return best


def assert_consistent_and_optimal(cost, tok, targets, a, view, best) -> None:
    dq, delay, obj = recompute(cost, tok, targets, a, view)
    assert a.dq == pytest.approx(dq, rel=1e-9, abs=1e-15)  # self-report matches the replicas
    assert a.est_delay == pytest.approx(delay, rel=1e-9, abs=1e-15)
    check_aggregator(cost, tok, a)
    assert obj == pytest.approx(best, rel=1e-9, abs=1e-15)


# -- the dominance fast path (Algorithm 2, lines 17-18) ----------------------------------

def _two_tier_cluster(n: int, flops, delay_s: float, gbps: float = 100.0) -> Cluster:
    bw = gbps * 1e9 / 8
    return Cluster(names=tuple(f"s{i}" for i in range(n)), flops=tuple(flops),
                   pcie=(32e9,) * n, gpu_bytes=(48e9,) * n, cpu_bytes=(512e9,) * n,
                   bandwidth=tuple(tuple(INF if i == j else bw for j in range(n))
                                   for i in range(n)),
                   delay=tuple(tuple(0.0 if i == j else delay_s for j in range(n))
                               for i in range(n)))


def test_fast_path_does_not_keep_a_local_set_that_a_remote_one_beats():
    """Both targets are GPU-resident and exact on the residing server (the fast path's
    precondition) but that server is 100x slower than two remotes a 10 us link away:
    the remote set wins and the router must find it."""
    sh = F.shape(n_layers=1, experts=2, top_k=2, d_model=4096)
    cl = _two_tier_cluster(3, (1e12, 100e12, 100e12), delay_s=10e-6)
    reps = (Replica(0, 0, Precision.FP16, True), Replica(1, 0, Precision.FP16, True),
            Replica(0, 1, Precision.FP16, True), Replica(1, 2, Precision.FP16, True))
    dep = Deployment(reps, 2, 3)
    r = F.router(sh, cl, dep, window_s=1.0)
    cost = r.cost
    view = StateView(3)
    tok = TokenView(0, 0, home=0, lam_max=0.02)
    a = r.route(tok, (0, 1), view)
    opts = [candidates(cost, e, view, 0.02, 1.0) for e in (0, 1)]
    best = brute_force(cost, tok, view, opts, 1.0)
    assert_consistent_and_optimal(cost, tok, (0, 1), a, view, best)
    assert {cost.rep_server[x] for x in a.replicas} == {1, 2}
    local = cost.layer_delay(0, (0, 1), view.backlog, 0)
    assert best < 0.2 * local  # the instance is not a near tie


def test_fast_path_keeps_the_local_set_when_it_is_best():
    sh = F.shape(n_layers=1, experts=2, top_k=2, d_model=4096)
    cl = _two_tier_cluster(3, (100e12, 100e12, 100e12), delay_s=5e-3)
    reps = (Replica(0, 0, Precision.FP16, True), Replica(1, 0, Precision.FP16, True),
            Replica(0, 1, Precision.FP16, True), Replica(1, 2, Precision.FP16, True))
    dep = Deployment(reps, 2, 3)
    r = F.router(sh, cl, dep, window_s=1.0)
    view = StateView(3)
    tok = TokenView(0, 0, home=0, lam_max=0.02)
    a = r.route(tok, (0, 1), view)
    assert a.replicas == (0, 1) and a.next_server == 0 and a.modes == (Mode.EXACT, Mode.EXACT)
    opts = [candidates(r.cost, e, view, 0.02, 1.0) for e in (0, 1)]
    assert_consistent_and_optimal(r.cost, tok, (0, 1), a, view,
                                  brute_force(r.cost, tok, view, opts, 1.0))


def _local_instance(seed: int):
    """A random instance where the fast path's precondition holds: every expert has a
    GPU-resident exact replica on server 0, the token resides there with a backlog
    under tau_loc."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 6))
    E = int(rng.integers(2, 6))
    k = int(rng.integers(1, min(3, E) + 1))
    sh = F.shape(n_layers=2, experts=E, top_k=k, d_model=int(rng.choice([1024, 4096])))
    cl = F.cluster(n, rng)
    reps = []
    for e in range(sh.n_experts):
        reps.append(Replica(e, 0, Precision(int(rng.integers(0, 3))), True))
        others = rng.choice(np.arange(1, n), size=int(rng.integers(1, n)), replace=False)
        for i, m in enumerate(others):
            prec = Precision.FP16 if i == 0 else Precision(int(rng.integers(0, 3)))
            reps.append(Replica(e, int(m), prec, bool(rng.random() < 0.7)))
    dep = Deployment(tuple(reps), sh.n_experts, n)
    q = F.quality_with_loss(sh, float(rng.choice([0.5, 5.0])))
    cost = CostModel(cl, sh, dep, q, lambda_q=float(rng.choice([0.5, 2.0, 20.0])))
    window = 0.05
    r = SetLevelRouter(cost, Alg2Params(window_s=window, enum_limit=10**6))
    view = StateView(n)
    view.backlog[:] = [float(x) for x in rng.exponential(0.003, n)]
    view.backlog[0] = float(rng.uniform(0, 0.002))  # tau_loc of the fast path
    view.admitted[:] = [float(x) for x in rng.exponential(window / 4, n)]
    view.admitted[0] = 0.0
    tok = TokenView(0, 0, home=int(rng.integers(n)), lam_max=0.02, server=0,
                    layer=int(rng.integers(sh.n_layers)), lam_acc=float(rng.uniform(0, 0.02)))
    targets = tuple(int(x) + tok.layer * E for x in rng.choice(E, size=k, replace=False))
    return cost, r, view, tok, targets, window


@SETTINGS
@given(st.integers(0, 10**9))
def test_fast_path_result_is_the_brute_force_optimum(seed):
    """Whatever the fast path returns, it is the optimum of D + lambda_q * dq over the
    admissible product (the search behind it is exact here: enum_limit is huge), and
    its reported dq and D_{i,l} are those of the replicas it chose."""
    cost, r, view, tok, targets, cap = _local_instance(seed)
    slack = tok.lam_max - tok.lam_acc
    opts = [candidates(cost, e, view, slack, cap) for e in targets]
    assume(all(opts))
    best = brute_force(cost, tok, view, opts, cap)
    assume(best < INF)
    a = r.route(tok, targets, view)
    assert Mode.FALLBACK not in a.modes
    assert_consistent_and_optimal(cost, tok, targets, a, view, best)


# -- beam search: width and selection ------------------------------------------------

def _problem(cands, n_servers, trans=None, queue=None, backlog=None, capacity=10.0, slack=1.0,
             lam=1.0, agg=None, theta=0):
    z = [[0.0] * n_servers for _ in range(n_servers)]
    return LayerProblem(theta=theta, cands=cands, trans=trans or z,
                        queue=queue or [0.0] * n_servers, backlog=backlog or [0.0] * n_servers,
                        capacity=capacity, slack=slack, lambda_q=lam,
                        aggregator=agg or (lambda servers: servers[0]))


def objective_of(p: LayerProblem, chosen) -> tuple[float, float]:
    """(D + lambda * dq, D) of a complete assignment from the problem's raw fields,
    INF if it breaks (18) or (19)."""
    dq = sum(c.dq for c in chosen)
    load: dict[int, float] = {}
    branch: dict[int, float] = {}
    for c in chosen:
        if c.guarded:
            load[c.server] = load.get(c.server, 0.0) + c.svc
        branch[c.server] = branch.get(c.server, p.queue[c.server]) \
            + p.w_off * c.load + p.w_cq * c.comp
    if dq > p.slack + 1e-12 or any(p.backlog[n] + s > p.capacity for n, s in load.items()):
        return INF, INF
    servers = tuple(sorted(branch))
    agg = p.aggregator(servers)
    fan_out = max((p.trans[p.theta][n] for n in servers if n != p.theta), default=0.0)
    fan_in = max((p.trans[n][agg] for n in servers if n != agg), default=0.0)
    delay = fan_out + max(branch.values()) + fan_in
    return delay + p.lambda_q * dq, delay


def _c(replica, server, job, dq=0.0, svc=None):
    return Candidate(replica, server, dq, int(Mode.EXACT), 0.0, job, job if svc is None else svc)


def _trap(decoys: bool):
    """Two targets, each with a cheap lossy candidate (job 1, dq 0.5) and a dearer
    exact one (job 1.8). Alone the lossy one is cheaper (1.5 < 1.8), so a greedy
    (width-1) expansion takes it whichever target goes first, and ends at
    1 + 0.5 + 0.5 = 2.0; the optimum is both exact, max(1.8, 1.8) = 1.8. The
    decoys (job 5, listed first) make "keep the first `width` children" and "keep
    the worst" lose too."""
    x = [_c(0, 1, 1.0, 0.5), _c(1, 2, 1.8)]
    y = [_c(2, 3, 1.0, 0.5), _c(3, 4, 1.8)]
    if decoys:
        x.insert(0, _c(4, 5, 5.0))
        y.insert(0, _c(5, 6, 5.0))
    return _problem([x, y], 7)


@pytest.mark.parametrize("decoys", [False, True])
def test_beam_of_width_two_escapes_the_greedy_trap(decoys):
    p = _trap(decoys)
    ref = enumerate_plain(_trap(decoys))
    assert ref is not None and objective_of(p, ref[0])[0] == pytest.approx(1.8)
    greedy = beam_search(_trap(decoys), 1)
    assert objective_of(p, greedy[0])[0] == pytest.approx(2.0)  # the trap is real
    for width in (2, 3, 8):
        found = beam_search(_trap(decoys), width)
        assert found is not None
        obj, delay = objective_of(p, found[0])
        assert obj == pytest.approx(1.8), width
        assert found[1].objective == pytest.approx(obj) and found[1].delay == pytest.approx(delay)


def test_beam_keeps_the_best_children_not_the_first():
    """Width 2 with three children per level: only keeping the two cheapest partial
    sets (not the first two generated, not the two dearest) reaches the optimum."""
    p = _trap(decoys=True)
    found = beam_search(p, 2)
    assert {c.replica for c in found[0]} == {1, 3}


def _random_problem(rng: np.random.Generator) -> LayerProblem:
    N = int(rng.integers(2, 6))
    k = int(rng.integers(1, 5))
    tr = [[0.0 if m == n else float(rng.uniform(0, 2)) for n in range(N)] for m in range(N)]
    score = [float(x) for x in rng.uniform(0, 1, N)]
    cands = []
    rep = 0
    for _ in range(k):
        opts = []
        for _ in range(int(rng.integers(1, 5))):
            load, comp = float(rng.choice([0.0, rng.uniform(0, 2)])), float(rng.uniform(0, 2))
            dq = float(rng.choice([0.0, rng.uniform(0, 1)]))
            opts.append(Candidate(rep, int(rng.integers(N)), dq, int(Mode.EXACT), load, comp,
                                  load + comp))
            rep += 1
        cands.append(opts)
    return LayerProblem(theta=int(rng.integers(N)), cands=cands, trans=tr,
                        queue=[float(x) for x in rng.uniform(0, 1, N)],
                        backlog=[float(x) for x in rng.uniform(0, 2, N)],
                        capacity=float(rng.uniform(2, 6)), slack=float(rng.uniform(0.3, 3)),
                        lambda_q=float(rng.uniform(0, 2)),
                        aggregator=lambda servers: min(servers, key=lambda n: (score[n], n)),
                        w_off=float(rng.uniform(0.5, 1.5)), w_cq=float(rng.uniform(0.5, 1.5)))


@SETTINGS
@given(st.integers(0, 10**9))
def test_beam_search_against_brute_force(seed):
    """A beam as wide as the product is exhaustive: it returns the optimum (None iff no
    assignment is feasible). Any width returns a feasible assignment whose reported
    objective and delay are its own, and never beats the optimum."""
    rng = np.random.default_rng(seed)
    p = _random_problem(rng)
    best = min(objective_of(p, combo)[0] for combo in product(*p.cands))
    full = beam_search(p, p.product_size())
    if best == INF:
        assert full is None
        return
    assert full is not None
    assert objective_of(p, full[0])[0] == pytest.approx(best, rel=1e-12, abs=1e-12)
    for width in (1, 2, 3):
        found = beam_search(p, width)
        if found is None:
            continue  # a narrow beam may lose every feasible completion
        obj, delay = objective_of(p, found[0])
        assert obj < INF and obj >= best - 1e-12
        assert found[1].objective == pytest.approx(obj, rel=1e-12, abs=1e-12)
        assert found[1].delay == pytest.approx(delay, rel=1e-12, abs=1e-12)


# -- the same trap through the router: enumeration below R, the configured width above it -

def _trap_router(**params):
    """Servers 1-4 hold targets X (INT4 on 1, FP16 on 2) and Y (INT4 on 3, FP16 on 4),
    all GPU-resident, every link alike; backlogs and lambda_q * q(INT4) = 0.5 ms make
    the same trap as ``_trap`` (in ms, plus fan-out and fan-in)."""
    sh = F.shape(n_layers=1, experts=2, top_k=2)
    cl = _two_tier_cluster(5, (50e12,) * 5, delay_s=1e-3)
    reps = (Replica(0, 1, Precision.INT4, True), Replica(0, 2, Precision.FP16, True),
            Replica(1, 3, Precision.INT4, True), Replica(1, 4, Precision.FP16, True))
    dep = Deployment(reps, 2, 5)
    qv = np.zeros((2, 3))
    qv[:, Precision.INT4] = 1e-3
    q = QualityModel(q=qv, substitutes=((), ()))
    cost = CostModel(cl, sh, dep, q, lambda_q=0.5)
    r = SetLevelRouter(cost, Alg2Params(window_s=1.0, **params))
    comp = cost.rep_comp[0]
    view = StateView(5)
    view.backlog[:] = [0.0, 1e-3 - comp, 1.8e-3 - comp, 1e-3 - comp, 1.8e-3 - comp]
    tok = TokenView(0, 0, home=0, lam_max=1.0)
    return r, view, tok


@pytest.mark.parametrize("params", [
    dict(beam_width=1, enum_limit=64),   # product 4 <= R: enumerate, whatever the width
    dict(beam_width=2, enum_limit=1),    # beam of the configured width
    dict(enum_limit=1),                  # the default width B = 8
])
def test_router_escapes_the_greedy_trap(params):
    r, view, tok = _trap_router(**params)
    a = r.route(tok, (0, 1), view)
    opts = [candidates(r.cost, e, view, 1.0, 1.0) for e in (0, 1)]
    best = brute_force(r.cost, tok, view, opts, 1.0)
    assert_consistent_and_optimal(r.cost, tok, (0, 1), a, view, best)
    assert a.replicas == (1, 3)


def test_the_router_trap_defeats_a_width_one_beam_and_the_exchange():
    """Sanity of the instance above: greedy expansion plus 1-exchange stays 0.2 ms
    above the optimum, so the tests above can tell a width-1 beam from the rest."""
    r, view, tok = _trap_router(beam_width=1, enum_limit=1)
    a = r.route(tok, (0, 1), view)
    assert a.replicas == (0, 2)
    opts = [candidates(r.cost, e, view, 1.0, 1.0) for e in (0, 1)]
    best = brute_force(r.cost, tok, view, opts, 1.0)
    _, _, obj = recompute(r.cost, tok, (0, 1), a, view)
    assert obj == pytest.approx(best + 0.2e-3, rel=1e-6)


# -- emergency fallback (lines 24-28) ---------------------------------------------------

def _fallback_instance():
    """X's only replica (FP16 on server 1) fails guard (19): server 1's window is full.
    Y has an admissible INT4 copy on idle server 3 and an FP16 one on busy server 2."""
    sh = F.shape(n_layers=1, experts=3, top_k=2)
    cl = _two_tier_cluster(4, (50e12,) * 4, delay_s=1e-3)
    reps = (Replica(0, 1, Precision.FP16, True), Replica(1, 2, Precision.FP16, True),
            Replica(1, 3, Precision.INT4, True), Replica(2, 3, Precision.INT4, True),
            Replica(2, 0, Precision.FP16, True))
    dep = Deployment(reps, 3, 4)
    qv = np.zeros((3, 3))
    qv[:, Precision.INT4] = 1e-3
    q = QualityModel(q=qv, substitutes=((), (), ()))
    cost = CostModel(cl, sh, dep, q, lambda_q=0.5)
    window = 0.02
    r = SetLevelRouter(cost, Alg2Params(window_s=window))
    view = StateView(4)
    view.backlog[:] = [0.0, 0.0, 0.010, 0.0]
    view.admitted[1] = window
    return cost, r, view, window


def test_only_the_target_without_a_candidate_falls_back():
    cost, r, view, cap = _fallback_instance()
    tok = TokenView(0, 0, home=0, lam_max=0.02)
    a = r.route(tok, (0, 1), view)
    assert a.modes == (Mode.FALLBACK, Mode.EXACT)
    assert a.replicas == (0, 2)  # Y keeps its cheap INT4 copy
    fb_x = [(0, 0.0)]  # X's full-precision replica, exempt from (19)
    opts = [fb_x, candidates(cost, 1, view, 0.02, cap)]
    best = brute_force(cost, tok, view, opts, cap, unguarded=(0,))
    assert_consistent_and_optimal(cost, tok, (0, 1), a, view, best)


def test_all_targets_fall_back_when_the_rest_cannot_be_completed():
    """Y and Z are left with INT4 copies that each fit the budget alone, not together:
    re-optimising around X's fallback is infeasible, so every target goes to full
    precision (dq = 0)."""
    cost, r, view, cap = _fallback_instance()
    view.admitted[0] = view.admitted[2] = cap  # Y and Z are left with their INT4 copies
    tok = TokenView(0, 0, home=0, lam_max=0.02, lam_acc=0.02 - 1.5e-3)
    a = r.route(tok, (0, 1, 2), view)
    assert a.modes == (Mode.FALLBACK,) * 3
    assert [cost.deployment.replicas[x].precision for x in a.replicas] == [Precision.FP16] * 3
    dq, delay, _ = recompute(cost, tok, (0, 1, 2), a, view)
    assert dq == 0.0 and a.dq == 0.0
    assert a.est_delay == pytest.approx(delay, rel=1e-9)
