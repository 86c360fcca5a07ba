"""Algorithm 1: constraints (c.1)-(c.4) always hold, and each stage does its job."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetroute.cost import CostModel
from hetroute.deployment import MemoryBudget
from hetroute.placement.algorithm1 import Alg1Params, algorithm1
from hetroute.placement.calibration import CalibrationTraffic
from hetroute.quality import QualityModel, prior_quality
from hetroute.routing.algorithm2 import Alg2Params, SetLevelRouter
from hetroute.state import Assignment, Mode
from hetroute.system import Cluster, Precision

from . import factories as F


def _calib(sh, n, rng, T=96):
    pop = rng.dirichlet(np.ones(sh.experts_per_layer) * 0.5, size=sh.n_layers)
    tg = np.zeros((T, sh.n_layers, sh.top_k), dtype=int)
    for l in range(sh.n_layers):
        for i in range(T):
            tg[i, l] = rng.choice(sh.experts_per_layer, size=sh.top_k, replace=False, p=pop[l]) \
                + l * sh.experts_per_layer
    return CalibrationTraffic(rng.integers(0, n, size=T), tg)


def _place(seed, **kw):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 6))
    sh = F.shape(n_layers=3, experts=int(rng.integers(2, 7)), top_k=2)
    cl = F.cluster(n, rng)
    q = prior_quality(sh)
    budget = MemoryBudget.of(cl, sh, gpu_share=float(rng.uniform(0.005, 0.05)))
    calib = _calib(sh, n, rng)

    def mk(dep):
        return SetLevelRouter(CostModel(cl, sh, dep, q), Alg2Params()).route
    params = Alg1Params(**{"memory_ratio": float(rng.uniform(1.0, 3.0)), **kw})
    dep, rep = algorithm1(cl, sh, q, calib, budget, 0.02, mk, params)
    return sh, cl, budget, params, dep, rep


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10**9))
def test_constraints_always_hold(seed):
    sh, cl, budget, params, dep, rep = _place(seed)
    dep.check(sh, budget)  # (c.1), (c.2), (c.4)
    assert dep.total_bytes(sh) <= params.memory_ratio * sh.n_experts * sh.expert_bytes[Precision.FP16] + 1
    counts = np.bincount([r.expert for r in dep.replicas], minlength=sh.n_experts)
    assert counts.max() <= params.max_replicas_per_expert
    assert rep.stage3_gpu == sum(r.gpu for r in dep.replicas)


def test_ratio_one_leaves_no_room_for_replication():
    sh, _, _, _, dep, rep = _place(3, memory_ratio=1.0)
    assert rep.stage2_added == 0
    assert len(dep.replicas) == sh.n_experts


def test_replication_lowers_expected_cost_and_no_stage2_ablation():
    _, _, _, _, dep, rep = _place(5, memory_ratio=2.5)
    assert rep.stage2_added > 0
    assert rep.calib_delay_final < rep.calib_delay_stage1
    _, _, _, _, dep2, rep2 = _place(5, memory_ratio=2.5, replicate=False)
    assert rep2.stage2_added == 0 and len(dep2.replicas) < len(dep.replicas)


def test_full_precision_only_ablation():
    _, _, _, _, dep, _ = _place(11, memory_ratio=2.5, precisions=(Precision.FP16,))
    assert {r.precision for r in dep.replicas} == {Precision.FP16}


def test_rejects_ratio_below_one():
    with pytest.raises(ValueError):
        Alg1Params(memory_ratio=0.9)


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 10**9))
def test_no_gpu_memory_left_idle_while_a_cpu_replica_fits(seed):
    sh, cl, budget, params, dep, rep = _place(seed)
    gpu_used, _ = dep.usage(sh)
    for r in dep.replicas:
        if not r.gpu:
            assert gpu_used[r.server] + sh.expert_bytes[r.precision] > budget.gpu[r.server] * (1 + 1e-12)


def test_without_fill_the_paper_loop_can_leave_memory_idle():
    """The paper's loop alone stops at g = 0 (documents why fill_gpu exists)."""
    idle = 0
    for seed in range(6):
        sh, cl, budget, params, dep, rep = _place(seed, fill_gpu=False)
        gpu_used, _ = dep.usage(sh)
        idle += sum(1 for r in dep.replicas if not r.gpu and
                    gpu_used[r.server] + sh.expert_bytes[r.precision] <= budget.gpu[r.server])
    assert idle > 0


# -- eq. (13), eq. (14) and Stage 3's guard on instances small enough to do by hand ------
#
# The router is a stub (Algorithm 1 takes any router factory): it serves each target
# by the rule given and leaves the token where it is, so p^route and the residing
# distribution of eq. (14) are known exactly.

INF = float("inf")
ALL_PRECISIONS = ("fp16", "int8", "int4")


def _cluster(flops, pcie, delay_s, gbps=10.0):
    n = len(flops)
    bw = gbps * 1e9 / 8
    return Cluster(names=tuple(f"s{i}" for i in range(n)), flops=tuple(flops), pcie=tuple(pcie),
                   gpu_bytes=(48e9,) * n, cpu_bytes=(512e9,) * n,
                   bandwidth=tuple(tuple(INF if i == j else bw for j in range(n))
                                   for i in range(n)),
                   delay=tuple(tuple(0.0 if i == j else delay_s for j in range(n))
                               for i in range(n)),
                   precisions=(ALL_PRECISIONS,) * n)


def _tokens(rows):
    """rows: (home, target) per calibration token, one layer, top-1."""
    homes = np.array([h for h, _ in rows])
    return CalibrationTraffic(homes, np.array([[[e]] for _, e in rows]))


def _stub(rule):
    """Router factory: target e of token tok goes to replica rule(dep, tok, e)."""
    def make(dep):
        def route(tok, targets, view):
            reps = tuple(rule(dep, tok, e) for e in targets)
            modes = tuple(Mode.EXACT if dep.replicas[r].expert == e else Mode.SUBSTITUTE
                          for e, r in zip(targets, reps))
            return Assignment(targets=tuple(targets), replicas=reps, modes=modes,
                              next_server=tok.server, dq=0.0, est_delay=0.0)
        return route
    return make


def _round_robin(dep, tok, e):
    reps = dep.by_expert[e]
    return reps[tok.index % len(reps)]


def _gpu_set(dep):
    return {(r.expert, r.server, r.precision) for r in dep.replicas if r.gpu}


@pytest.mark.parametrize("slots", [1, 3])
def test_eq13_weights_residency_by_how_often_the_router_uses_a_replica(slots):
    """One server, three experts, pi = (0.5, 0.2, 0.3). The router serves every
    activation of expert 0 by expert 1's replica, so eq. (13) gives g = pi p^route v/beta
    = (0, 0.7, 0.3) v/beta: expert 1's replica first, then expert 2's, never expert 0's
    (g = 0; raw frequency would put the hottest expert first)."""
    sh = F.shape(n_layers=1, experts=3, top_k=1)
    cl = _cluster((50e12,), (16e9,), 0.0)
    v = float(sh.expert_bytes[Precision.FP16])
    budget = MemoryBudget(gpu=((slots + 0.5) * v,), cpu=(1e12,))
    calib = _tokens([(0, 0)] * 5 + [(0, 1)] * 2 + [(0, 2)] * 3)

    def rule(dep, tok, e):
        return dep.by_expert[1 if e == 0 else e][0]
    params = Alg1Params(memory_ratio=1.0, replicate=False, fill_gpu=False)
    dep, rep = algorithm1(cl, sh, prior_quality(sh), calib, budget, 0.02, _stub(rule), params)
    expect = {1: {(1, 0, Precision.FP16)},
              3: {(1, 0, Precision.FP16), (2, 0, Precision.FP16)}}[slots]
    assert _gpu_set(dep) == expect
    assert rep.stage1_promoted == len(expect)


def _eq14_instance():
    """Servers A = 0 (fast GPU, slow PCIe) and B = 1; experts H = 0 (pi 0.6) and
    D = 1 (pi 0.4); no GPU memory, so every cost below is a CPU-resident one.
    The baseline puts H on A and D on B. Tokens reside where they live."""
    sh = F.shape(n_layers=1, experts=2, top_k=1)
    cl = _cluster((100e12, 50e12), (16e9, 32e9), delay_s=2e-3)
    q = np.zeros((2, 3))
    q[:, Precision.INT8] = 1e-4
    q[:, Precision.INT4] = 5e-4
    quality = QualityModel(q=q, substitutes=((), ()))
    rows = [(0, 0)] * 2 + [(1, 0)] * 4 + [(0, 1)] * 3 + [(1, 1)] * 1
    budget = MemoryBudget(gpu=(0.0, 0.0), cpu=(1e12, 1e12))
    return sh, cl, quality, _tokens(rows), budget, rows


def _eq14_by_hand(sh, cl, quality, rows, lam=2.0):
    """Gain part of b_{E,n} (eq. 14, before the memory price) of every candidate
    insertion, from eq. (9) with empty queues written out: d/B + delay, v(c)/beta_n,
    w/F_n, lambda q."""
    T = len(rows)

    def trans(m, n):
        return 0.0 if m == n else sh.hidden_bytes / cl.bandwidth[m][n] + cl.delay[m][n]

    def cost(theta, e, n, c):
        return trans(theta, n) + sh.expert_bytes[c] / cl.pcie[n] + sh.expert_flops / cl.flops[n] \
            + lam * quality.q[e, c]
    where = {0: 0, 1: 1}  # baseline: H on A, D on B, both FP16
    gains = {}
    for e, n in ((0, 1), (1, 0)):
        for c in Precision:
            g = 0.0
            for home, target in rows:
                if target == e:
                    old = cost(home, e, where[e], Precision.FP16)
                    g += max(0.0, old - cost(home, e, n, c)) / T
            gains[(e, n, c)] = g
    return gains


def _added(dep):
    base = {(0, 0, Precision.FP16), (1, 1, Precision.FP16)}
    return {(r.expert, r.server, r.precision) for r in dep.replicas} - base


@pytest.mark.parametrize("order", ["value", "density"])
def test_eq14_picks_the_insertion_of_largest_benefit(order):
    sh, cl, quality, calib, budget, rows = _eq14_instance()
    gains = _eq14_by_hand(sh, cl, quality, rows)
    v = {c: float(sh.expert_bytes[c]) for c in Precision}
    key = (lambda k: gains[k]) if order == "value" else (lambda k: gains[k] / v[k[2]])
    expect = max(gains, key=key)
    assert max(gains, key=lambda k: gains[k]) != max(gains, key=lambda k: gains[k] / v[k[2]])
    params = Alg1Params(memory_ratio=2.0, memory_price=0.0, replication_cap=1, stage2_rounds=1,
                        fill_gpu=False, replication_order=order)
    dep, rep = algorithm1(cl, sh, quality, calib, budget, 1.0, _stub(_round_robin), params)
    assert [(r.expert, r.server) for r in dep.replicas[:2]] == [(0, 0), (1, 1)]  # baseline
    assert rep.stage2_added == 1
    assert _added(dep) == {expect}


@pytest.mark.parametrize("side", [-1, 1])
def test_eq14_memory_price_sets_the_break_even(side):
    """b = gain - mu v > 0 exactly when mu < gain / v: just above the largest gain / v
    nothing is inserted, just below only that insertion is."""
    sh, cl, quality, calib, budget, rows = _eq14_instance()
    gains = _eq14_by_hand(sh, cl, quality, rows)
    ratio = {k: g / float(sh.expert_bytes[k[2]]) for k, g in gains.items()}
    best = max(ratio, key=ratio.get)
    mu = ratio[best] * (1 + side * 1e-6)
    params = Alg1Params(memory_ratio=2.0, memory_price=mu, stage2_rounds=1, fill_gpu=False,
                        replication_order="value")
    dep, rep = algorithm1(cl, sh, quality, calib, budget, 1.0, _stub(_round_robin), params)
    assert _added(dep) == (set() if side > 0 else {best})


def _stage3_instance(h_tokens: int, h_at_b: int, d_at_b: int):
    """Servers A = 0 and B = 1, 50 ms apart, each with GPU room for one FP16 replica.
    Experts H = 0 and D = 1, 20 calibration tokens: H's first (h_at_b of them living
    on B), then D's. The baseline puts H on A and D on B; Stage 1 makes both
    GPU-resident; Stage 2 adds one FP16 copy of H on B (CPU: B is full), for H's
    tokens on B. The router sends H's odd-numbered tokens to that copy, so p^route
    of H on B is 1/2 while only h_at_b / h_tokens of H's activations reside on B.
    Stage 3 then decides who gets B's GPU slot: D's only replica, or H's second copy."""
    T = 20
    rows = [(1 if i < h_at_b else 0, 0) for i in range(h_tokens)]
    rows += [(1 if i < d_at_b else 0, 1) for i in range(T - h_tokens)]
    sh = F.shape(n_layers=1, experts=2, top_k=1)
    cl = _cluster((100e12, 50e12), (12e9, 16e9), delay_s=50e-3)
    v = float(sh.expert_bytes[Precision.FP16])
    budget = MemoryBudget(gpu=(1.5 * v, 1.5 * v), cpu=(1e12, 1e12))
    params = Alg1Params(memory_ratio=2.0, precisions=(Precision.FP16,), replication_cap=1,
                        stage2_rounds=1, fill_gpu=False)
    dep, rep = algorithm1(cl, sh, prior_quality(sh), _tokens(rows), budget, 0.02,
                          _stub(_round_robin), params)
    assert {(r.expert, r.server) for r in dep.replicas} == {(0, 0), (1, 1), (0, 1)}
    return dep, rep, sh, cl


def test_stage3_guard_keeps_a_second_copy_from_displacing_a_distinct_expert():
    """On B: H's copy has g = 0.35 v/beta_B (7 of 20 tokens use it), D's only replica
    0.3 v/beta_B; but H's copy saves an offload only for the 5 H tokens living on B
    (the others have H's GPU copy on A), marginal 0.25 v/beta_B < 0.3: D keeps the slot."""
    dep, rep, sh, cl = _stage3_instance(h_tokens=14, h_at_b=5, d_at_b=2)
    F16 = Precision.FP16
    assert _gpu_set(dep) == {(0, 0, F16), (1, 1, F16)}
    assert rep.stage3_second_copies == 0


def test_stage3_guard_admits_a_second_copy_worth_more_than_the_distinct_expert():
    """As above with D rarer (4 tokens, g = 0.2 v/beta_B): H's marginal saving on B,
    0.25 v/beta_B, now beats it and the second copy takes the slot."""
    dep, rep, sh, cl = _stage3_instance(h_tokens=16, h_at_b=5, d_at_b=1)
    F16 = Precision.FP16
    assert _gpu_set(dep) == {(0, 0, F16), (0, 1, F16)}
    assert rep.stage3_second_copies == 1
