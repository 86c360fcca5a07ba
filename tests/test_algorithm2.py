"""Algorithm 2 against the paper's Properties 1-5 on random instances, and Fig. 1."""

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
from hetroute.state import Mode, StateView, TokenView
from hetroute.system import Cluster, Precision

from . import factories as F
from .factories import engine  # noqa: F401 - the fixture below

pytestmark = pytest.mark.usefixtures("engine")  # every test on both implementations

SETTINGS = settings(max_examples=200, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
LAM_MAX = 0.02


def _instance(seed: int, n_max: int = 6):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, n_max + 1))
    E = int(rng.integers(2, 7))
    k = int(rng.integers(1, min(3, E) + 1))
    sh = F.shape(n_layers=3, experts=E, top_k=k)
    cl = F.cluster(n, rng)
    dep = F.random_deployment(sh, n, rng, max_replicas=int(rng.integers(1, 5)))
    q = F.quality_with_loss(sh, float(rng.choice([0.5, 5.0, 50.0])))  # guards bind at larger scales
    cost = CostModel(cl, sh, dep, q, lambda_q=0.5)
    window = float(rng.choice([0.001, 0.01, 0.05]))
    r = SetLevelRouter(cost, Alg2Params(window_s=window, enum_limit=64))
    view = StateView(n)
    view.backlog[:] = [float(x) for x in rng.exponential(window, n)]  # Q_n/F_n (eq. 9)
    view.admitted[:] = [float(x) for x in rng.exponential(window / 2, n)]  # W_n (guard 19)
    tok = TokenView(0, 0, home=int(rng.integers(n)), lam_max=LAM_MAX)
    tok.server = int(rng.integers(n))
    tok.layer = int(rng.integers(sh.n_layers))
    tok.lam_acc = float(rng.uniform(0, LAM_MAX))
    targets = tuple(int(x) + tok.layer * E for x in rng.choice(E, size=k, replace=False))
    return sh, cl, dep, q, cost, r, view, tok, targets


def _check_assignment(dep: Deployment, q: QualityModel, targets, a) -> None:
    assert len(a.replicas) == len(targets)
    for e, r, m in zip(targets, a.replicas, a.modes):
        rep = dep.replicas[r]
        if m == Mode.SUBSTITUTE:
            assert rep.expert in {x for x, _ in q.substitutes[e]}
        else:
            assert rep.expert == e
        if m == Mode.FALLBACK:
            assert rep.precision == Precision.FP16


def _admissible(cost: CostModel, q: QualityModel, dep: Deployment, e, theta, slack, view, cap):
    """Exact-first candidate construction, written independently of the router."""
    def ok(r, dq):
        n = dep.replicas[r].server
        return dq <= slack + 1e-12 and view.admitted[n] + cost.service(r) <= cap
    exact = [(r, cost.rep_q[r]) for r in dep.by_expert[e] if ok(r, cost.rep_q[r])]
    if exact:
        return exact
    subs = []
    for e_hat, loss in q.substitutes[e]:
        for r in dep.by_expert[e_hat]:
            if ok(r, cost.rep_q[r] + loss):
                subs.append((r, cost.rep_q[r] + loss))
    return subs


def _objective(cost: CostModel, combo, theta, view, layer, home, lam_q=0.5):
    reps = tuple(r for r, _ in combo)
    servers = tuple(sorted({cost.rep_server[r] for r in reps}))
    if layer == cost.shape.n_layers - 1:
        la = [cost.trans[n][home] for n in range(cost.cluster.n)]
    else:
        la = cost.lookahead_table(None)[layer + 1]
    agg = cost.aggregator(servers, la)
    return cost.layer_delay(theta, reps, view.backlog, agg) + lam_q * sum(dq for _, dq in combo)


def _feasible(cost: CostModel, combo, view, slack, cap) -> bool:
    if sum(dq for _, dq in combo) > slack + 1e-12:
        return False
    load: dict[int, float] = {}
    for r, _ in combo:
        n = cost.rep_server[r]
        load[n] = load.get(n, 0.0) + cost.service(r)
    return all(view.admitted[n] + s <= cap for n, s in load.items())


@SETTINGS
@given(st.integers(0, 10**9))
def test_property1_budget_and_completeness(seed):
    """Every target is routed and no token ever exceeds its quality budget."""
    sh, cl, dep, q, cost, r, view, tok, _ = _instance(seed)
    rng = np.random.default_rng(seed + 1)
    tok.layer, tok.lam_acc = 0, 0.0
    for layer in range(sh.n_layers):
        tok.layer = layer
        targets = tuple(int(x) + layer * sh.experts_per_layer
                        for x in rng.choice(sh.experts_per_layer, size=sh.top_k, replace=False))
        a = r.route(tok, targets, view)
        _check_assignment(dep, q, targets, a)
        # dq and D_{i,l} from the chosen replicas, not from the router's report
        dq, delay, _ = F.recompute(cost, tok, targets, a, view)
        assert tok.lam_acc + dq <= tok.lam_max + 1e-12
        assert a.dq == pytest.approx(dq, rel=1e-9, abs=1e-15)
        assert a.est_delay == pytest.approx(delay, rel=1e-9, abs=1e-15)
        assert len({dep.replicas[x].server for x in a.replicas}) <= sh.top_k  # Property 2
        F.check_aggregator(cost, tok, a)  # a participant, by eq. (11)
        tok.lam_acc += dq
        tok.server = a.next_server


@SETTINGS
@given(st.integers(0, 10**9))
def test_property3_enumeration_is_brute_force_optimum(seed):
    sh, cl, dep, q, cost, r, view, tok, targets = _instance(seed)
    slack = tok.lam_max - tok.lam_acc
    cap = r.params.window_s
    cands = [_admissible(cost, q, dep, e, tok.server, slack, view, cap) for e in targets]
    assume(all(cands) and np.prod([len(c) for c in cands]) <= r.params.enum_limit)
    feas = [c for c in product(*cands) if _feasible(cost, c, view, slack, cap)]
    assume(feas)
    best = min(_objective(cost, c, tok.server, view, tok.layer, tok.home) for c in feas)
    a = r.route(tok, targets, view)
    assert a.modes.count(Mode.FALLBACK) == 0
    _check_assignment(dep, q, targets, a)
    # the objective of the replicas it chose, recomputed (eq. 10 + lambda_q * dq)
    chosen = [(x, q.increment(e, dep.replicas[x].expert, dep.replicas[x].precision))
              for e, x in zip(targets, a.replicas)]
    assert _feasible(cost, chosen, view, slack, cap)
    F.check_aggregator(cost, tok, a)
    dq, delay, got = F.recompute(cost, tok, targets, a, view)
    assert got == pytest.approx(best, rel=1e-9, abs=1e-12)
    assert a.dq == pytest.approx(dq, rel=1e-9, abs=1e-15)
    assert a.est_delay == pytest.approx(delay, rel=1e-9, abs=1e-15)


@SETTINGS
@given(st.integers(0, 10**9))
def test_property4_one_exchange_is_locally_optimal(seed):
    sh, cl, dep, q, cost, _, view, tok, targets = _instance(seed)
    # width-1 beam = greedy expansion; the exchange step must then repair it
    r = SetLevelRouter(cost, Alg2Params(window_s=0.05, enum_limit=1, beam_width=1))
    slack = tok.lam_max - tok.lam_acc
    cap = r.params.window_s
    cands = [_admissible(cost, q, dep, e, tok.server, slack, view, cap) for e in targets]
    assume(all(cands))
    a = r.route(tok, targets, view)
    assume(Mode.FALLBACK not in a.modes)
    cur = []
    for j, rep in enumerate(a.replicas):
        cur.append(next(c for c in cands[j] if c[0] == rep))
    cur_obj = _objective(cost, cur, tok.server, view, tok.layer, tok.home)
    assert a.est_delay + 0.5 * a.dq == pytest.approx(cur_obj, rel=1e-9, abs=1e-12)
    for j, options in enumerate(cands):
        for c in options:
            trial = cur[:j] + [c] + cur[j + 1:]
            if _feasible(cost, trial, view, slack, cap):
                obj = _objective(cost, trial, tok.server, view, tok.layer, tok.home)
                assert obj >= cur_obj - 1e-12


def test_property5_work_independent_of_server_count():
    """Routing work depends on the replica count, not on N."""
    work = []
    for n_servers in (4, 60):
        rng = np.random.default_rng(7)
        base = F.cluster(4, rng)
        extra = F.cluster(n_servers, np.random.default_rng(8))
        cl = _merge(base, extra)
        sh = F.shape(n_layers=2, experts=6, top_k=2)
        reps = []
        for e in range(sh.n_experts):
            reps.append(Replica(e, e % 4, Precision.FP16, False))
            reps.append(Replica(e, (e + 1) % 4, Precision.INT4, True))
            reps.append(Replica(e, (e + 2) % 4, Precision.INT8, True))
        dep = Deployment(tuple(reps), sh.n_experts, cl.n)
        r = F.router(sh, cl, dep, window_s=1.0, fast_path=False)
        view = StateView(cl.n)
        tok = TokenView(0, 0, home=0, lam_max=LAM_MAX)
        for e1, e2 in [(0, 1), (2, 3), (4, 5), (1, 5)]:
            r.route(tok, (e1, e2), view)
        work.append(r.evaluations)
    assert work[0] == work[1] > 0


def _merge(base: Cluster, extra: Cluster) -> Cluster:
    """base's first servers, padded with extra's to extra.n servers (same first 4)."""
    n = max(base.n, extra.n)

    def pick(a, b):
        return tuple(a[i] if i < base.n else b[i] for i in range(n))

    def mat(a, b):
        return tuple(tuple(a[i][j] if i < base.n and j < base.n else b[i][j] for j in range(n))
                     for i in range(n))
    return Cluster(names=tuple(f"s{i}" for i in range(n)), flops=pick(base.flops, extra.flops),
                   pcie=pick(base.pcie, extra.pcie), gpu_bytes=pick(base.gpu_bytes, extra.gpu_bytes),
                   cpu_bytes=pick(base.cpu_bytes, extra.cpu_bytes),
                   bandwidth=mat(base.bandwidth, extra.bandwidth), delay=mat(base.delay, extra.delay))


def test_fallback_when_budget_exhausted():
    """With no budget left and only quantized/substitute candidates admissible,
    targets go to a full-precision exact replica (zero increment)."""
    sh = F.shape(n_layers=1, experts=2, top_k=1)
    rng = np.random.default_rng(0)
    cl = F.cluster(2, rng)
    reps = (Replica(0, 0, Precision.FP16, False), Replica(0, 1, Precision.INT4, True),
            Replica(1, 0, Precision.FP16, False))
    dep = Deployment(reps, sh.n_experts, 2)
    r = F.router(sh, cl, dep, window_s=1e-9)  # stability guard rejects everything
    tok = TokenView(0, 0, home=1, lam_max=LAM_MAX)
    tok.lam_acc = LAM_MAX
    a = r.route(tok, (0,), StateView(2))
    assert a.modes == (Mode.FALLBACK,)
    assert dep.replicas[a.replicas[0]].precision == Precision.FP16
    assert a.dq == 0.0


# -- Fig. 1: two targets cold on the residing server, hot on two fast remotes ----

def _fig1(delay_s: float, bandwidth_gbps: float):
    sh = F.shape(n_layers=1, experts=2, top_k=2, d_model=4096)
    bw = bandwidth_gbps * 1e9 / 8
    inf = float("inf")
    cl = Cluster(names=("home", "fast1", "fast2"), flops=(18e12, 120e12, 120e12),
                 pcie=(16e9, 64e9, 64e9), gpu_bytes=(12e9,) * 3, cpu_bytes=(128e9,) * 3,
                 bandwidth=((inf, bw, bw), (bw, inf, bw), (bw, bw, inf)),
                 delay=((0, delay_s, delay_s), (delay_s, 0, delay_s), (delay_s, delay_s, 0)))
    reps = (Replica(0, 0, Precision.FP16, False), Replica(1, 0, Precision.FP16, False),
            Replica(0, 1, Precision.FP16, True), Replica(1, 2, Precision.FP16, True))
    dep = Deployment(reps, sh.n_experts, 3)
    r = F.router(sh, cl, dep, window_s=10.0)
    tok = TokenView(0, 0, home=0, lam_max=LAM_MAX)
    a = r.route(tok, (0, 1), StateView(3))
    return {dep.replicas[x].server for x in a.replicas}, r.cost


def _break_even_delay() -> float:
    """One-way delay at which local (two cold loads queued on a weak GPU) and
    remote (fan-out + fast GPU-resident compute + fan-in) cost the same."""
    _, cost = _fig1(delay_s=0.0, bandwidth_gbps=10)
    local = sum(cost.rep_load[r] + cost.rep_comp[r] for r in (0, 1))
    remote = cost.trans[0][1] + max(cost.rep_comp[2], cost.rep_comp[3]) + cost.trans[1][0]
    return (local - remote) / 2


def test_fig1_goes_remote_when_numbers_favour_it():
    d = _break_even_delay()
    assert d > 0.005  # the cold loads are expensive enough for this to matter
    servers, _ = _fig1(delay_s=0.8 * d, bandwidth_gbps=10)
    assert servers == {1, 2}


def test_fig1_stays_local_when_links_are_slow():
    d = _break_even_delay()
    servers, _ = _fig1(delay_s=1.2 * d, bandwidth_gbps=10)
    assert servers == {0}


@SETTINGS
@given(st.integers(0, 10**9))
def test_fast_enumeration_equals_plain_product(seed):
    """The pruned depth-first (k >= 3) and inlined pair (k = 2) enumerations
    return exactly what evaluating every element of the product returns."""
    from hetroute.routing.search import enumerate_best, enumerate_plain
    sh, cl, dep, q, cost, r, view, tok, targets = _instance(seed)
    captured = {}
    orig = r._search

    def spy(problem):
        captured["p"] = problem
        return orig(problem)
    r._search = spy
    r.params = Alg2Params(window_s=r.params.window_s, enum_limit=10**6, fast_path=False,
                          compiled=False)  # spies on the Python reference's search
    r.route(tok, targets, view)
    p = captured.get("p")
    assume(p is not None)
    fast, plain = enumerate_best(p), enumerate_plain(p)
    assert (fast is None) == (plain is None)
    if fast is not None:
        assert fast[0] == plain[0]
        assert fast[1].objective == pytest.approx(plain[1].objective, rel=1e-12, abs=1e-15)
        assert fast[1].aggregator == plain[1].aggregator
