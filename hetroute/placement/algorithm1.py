"""Algorithm 1: routing-cost-coupled offline expert placement (Section IV).

Stage 1 (lines 3-7) promotes replicas to GPU by g = pi_E p^route v / beta
(eq. 13), with p^route from simulating the online router on T_cal. Stage 2
(lines 8-15) inserts the replica (expert, server, precision) of largest
redundancy benefit b (eq. 14) until none is positive, memory is exhausted or
the cap is reached. Stage 3 (line 16) re-simulates, recomputes g and
re-assigns residency globally with the diminishing-returns guard.

Choices where the paper is silent (also in the README):
- Line 1's baseline deployment: one FP16 replica per expert, experts of each
  layer taken by decreasing pi_E and put on the server with the least
  accumulated pi per FLOP/s that has memory (spreads hot experts over fast
  servers).
- The memory budget ratio rho caps the bytes of all replicas at rho times one
  FP16 copy of all experts; rho = 1 leaves no room for Stage 2.
- Eq. (14)'s expectation is over the residing servers at which each expert
  was a target when simulating the router on T_cal, per calibration token;
  the static view has empty queues. Each activation also records the token's
  remaining budget, and a replica of precision c only counts where c would
  pass guard (18), so an INT4 copy is not credited for tokens whose budget is
  spent (the online guard of Algorithm 2 is part of "the online policy").
  As replicas are added tokens travel
  differently, so Stage 2 runs in ``stage2_rounds`` rounds, each adding up to
  an equal share of the replication memory, with a re-simulation between. A new replica is GPU-resident in b's evaluation iff it fits in
  the server's free GPU budget. Between re-simulations Stage 2 is a lazy
  greedy (b only decreases as replicas are added, so re-scoring a popped
  entry is exact). Like residency, replication under the memory ratio is a
  knapsack: insertions go by b per byte ("density", default) or by b
  ("value", the paper's literal argmax).
- Residency is a knapsack under (c.1): Stages 1 and 3 promote in decreasing
  g per byte ("density", default) rather than decreasing g ("value", the
  paper's literal order). They coincide when replicas have one size (Stage 1,
  all FP16); with mixed precisions after Stage 2, ordering by g alone spends
  scarce GPU memory on few large FP16 copies.
- After the paper's loop (which stops at g = 0), GPU memory still free is
  filled with the remaining replicas by raw frequency (``fill_gpu``): the
  calibration simulation never chooses some replicas, yet they are used online,
  and idle GPU memory saves nothing. With scarce memory the loop fills the
  GPU and this step does nothing.
- Stage 3's guard: a replica of an expert that already has a GPU copy is
  scored by its marginal saving over the existing GPU copies (same cost
  model, same residing distribution) and competes with first copies of
  not-yet-resident experts in one max-heap, so it is admitted only when its
  marginal g exceeds that of the best remaining distinct expert.
- CPU memory (c.2) is checked as if every replica were CPU-resident, so any
  later residency change keeps it.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable, Literal

import numpy as np

from ..cost import CostModel
from ..deployment import Deployment, MemoryBudget, Replica
from ..quality import QualityModel
from ..service import PaperService, ServiceModel
from ..system import FULL_PRECISION, Cluster, MoEShape, Precision
from .calibration import CalibrationTraffic, RouteFn, RoutingStats, simulate


@dataclass(frozen=True)
class Alg1Params:
    memory_ratio: float = 2.0  # section VI-A default
    precisions: tuple[Precision, ...] = (Precision.FP16, Precision.INT8, Precision.INT4)
    max_replicas_per_expert: int = 6  # bounds R-bar (Property 5)
    replication_cap: int | None = None  # K_rep: most replicas Stage 2 may add
    memory_price: float = 1e-13  # mu, seconds of per-token cost per byte
    lambda_q: float = 2.0  # seconds per unit of quality loss (eq. 9)
    residency: Literal["routing", "frequency"] = "routing"
    replicate: bool = True  # False: no Stage 2 (ablation)
    diminishing_returns: bool = True
    residency_order: Literal["density", "value"] = "density"
    replication_order: Literal["density", "value"] = "density"
    fill_gpu: bool = True  # spend GPU memory the g > 0 loop leaves idle (by raw frequency)
    stage2_rounds: int = 4  # Stage 2 re-simulates T_cal after each 1/rounds of its memory

    def __post_init__(self) -> None:
        if self.memory_ratio < 1.0:
            raise ValueError("memory_ratio must be >= 1.0 (one full-precision copy, c.4)")
        if FULL_PRECISION not in self.precisions:
            raise ValueError("precisions must include FP16")
        if self.max_replicas_per_expert < 1:
            raise ValueError("max_replicas_per_expert must be >= 1")
        if self.residency not in ("routing", "frequency"):
            raise ValueError("residency must be 'routing' or 'frequency'")
        if self.residency_order not in ("density", "value"):
            raise ValueError("residency_order must be 'density' or 'value'")
        if self.replication_order not in ("density", "value"):
            raise ValueError("replication_order must be 'density' or 'value'")
        if self.stage2_rounds < 1:
            raise ValueError("stage2_rounds must be >= 1")


@dataclass
class PlacementReport:
    """What each stage did; stored with the run for provenance."""

    stage1_promoted: int = 0
    stage2_added: int = 0
    stage2_by_precision: dict = field(default_factory=dict)
    stage2_rounds: int = 0
    stage3_gpu: int = 0
    stage3_guarded: int = 0  # GPU replicas chosen by the guarded greedy, before filling
    stage3_second_copies: int = 0
    calib_delay_stage1: float = 0.0
    calib_delay_final: float = 0.0


RouterFactory = Callable[[Deployment], RouteFn]


class _State:
    """Mutable placement under construction."""

    def __init__(self, shape: MoEShape, budget: MemoryBudget, n_servers: int) -> None:
        self.shape = shape
        self.budget = budget
        self.reps: list[Replica] = []
        self.gpu_used = [0.0] * n_servers
        self.all_used = [0.0] * n_servers  # both tiers: (c.2) worst case
        self.total = 0.0
        self.n_servers = n_servers
        self.where: set[tuple[int, int]] = set()
        self.count = [0] * shape.n_experts

    def v(self, c: Precision) -> float:
        return float(self.shape.expert_bytes[c])

    def add(self, e: int, n: int, c: Precision, gpu: bool = False) -> None:
        self.reps.append(Replica(e, n, c, gpu))
        self.where.add((e, n))
        self.count[e] += 1
        self.all_used[n] += self.v(c)
        self.total += self.v(c)
        if gpu:
            self.gpu_used[n] += self.v(c)

    def gpu_fits(self, n: int, c: Precision) -> bool:
        return self.gpu_used[n] + self.v(c) <= self.budget.gpu[n] * (1 + 1e-12)

    def deployment(self) -> Deployment:
        return Deployment(tuple(self.reps), self.shape.n_experts, self.n_servers)

    def set_gpu(self, flags: list[bool]) -> None:
        self.gpu_used = [0.0] * self.n_servers
        reps = []
        for r, g in zip(self.reps, flags):
            reps.append(Replica(r.expert, r.server, r.precision, bool(g)))
            if g:
                self.gpu_used[r.server] += self.v(r.precision)
        self.reps = reps


def baseline_deployment(cluster: Cluster, shape: MoEShape, budget: MemoryBudget,
                        popularity: np.ndarray, service: ServiceModel | None = None) -> _State:
    """Line 1: one FP16 replica of every expert, heat spread by speed (FLOP/s in the
    paper's belief: the accumulated popularity times one job's service time)."""
    svc = service if service is not None else PaperService(cluster, shape)
    job = [svc.expert_s(n, FULL_PRECISION, 1) for n in range(cluster.n)]
    st = _State(shape, budget, cluster.n)
    heat = [0.0] * cluster.n
    v = st.v(FULL_PRECISION)
    for layer in range(shape.n_layers):
        ids = [shape.expert_id(layer, j) for j in range(shape.experts_per_layer)]
        ids.sort(key=lambda e: (-popularity[e], e))
        for e in ids:
            best, best_score = -1, float("inf")
            for n in range(cluster.n):
                if st.all_used[n] + v > budget.cpu[n]:
                    continue
                score = (heat[n] + popularity[e] + 1e-9) * job[n]
                if score < best_score:
                    best, best_score = n, score
            if best < 0:
                raise ValueError("the cluster's memory cannot hold one full-precision copy (c.4)")
            st.add(e, best, FULL_PRECISION)
            heat[best] += popularity[e]
    return st


def _order_key(st: _State, g: np.ndarray, order: str) -> np.ndarray:
    if order == "value":
        return g
    return g / np.array([st.v(r.precision) for r in st.reps])


def _promote_stage1(st: _State, g: np.ndarray, order: str = "density",
                    fill: np.ndarray | None = None) -> int:
    """Lines 5-7: promote by decreasing g (or g per byte) while the GPU budget allows;
    then, with ``fill``, spend what GPU memory is left (see ``_fill``)."""
    flags = [False] * len(st.reps)
    st.gpu_used = [0.0] * st.n_servers
    promoted = 0
    key = _order_key(st, g, order)
    for i in sorted(range(len(st.reps)), key=lambda i: (-key[i], i)):
        if g[i] <= 0:
            break
        r = st.reps[i]
        if st.gpu_fits(r.server, r.precision):
            flags[i] = True
            st.gpu_used[r.server] += st.v(r.precision)
            promoted += 1
    if fill is not None:
        promoted += _fill(st, flags, fill, order)
    st.set_gpu(flags)
    return promoted


def _fill(st: _State, flags: list[bool], key: np.ndarray, order: str) -> int:
    """Promote replicas the loop left on CPU into GPU memory the loop left free,
    by ``key`` (raw activation frequency times load saved). The paper's loop
    stops at g = 0, i.e. at replicas the calibration simulation never chose,
    and would leave that memory idle although such replicas are used online
    whenever queues or budgets differ from the static view."""
    k = _order_key(st, key, order)
    added = 0
    for i in sorted(range(len(st.reps)), key=lambda i: (-k[i], i)):
        r = st.reps[i]
        if not flags[i] and st.gpu_fits(r.server, r.precision):
            flags[i] = True
            st.gpu_used[r.server] += st.v(r.precision)
            added += 1
    return added


def _static_costs(cm_trans: np.ndarray, svc: ServiceModel, quality: QualityModel,
                  lambda_q: float, gpu: bool, n: int, c: Precision, e: int) -> np.ndarray:
    """Eq. (9) with empty queues from every residing server theta to a replica (e, n, c)."""
    load = 0.0 if gpu else svc.load_s(n, c)
    return cm_trans[:, n] + load + svc.expert_s(n, c, 1) \
        + lambda_q * float(quality.q[e, c])


def algorithm1(cluster: Cluster, shape: MoEShape, quality: QualityModel,
               calib: CalibrationTraffic, budget: MemoryBudget, lam_max: float,
               make_router: RouterFactory, params: Alg1Params = Alg1Params(),
               service: ServiceModel | None = None) -> tuple[Deployment, PlacementReport]:
    """``service`` is the router's belief of service times (default: the paper's w/F)."""
    svc = service if service is not None else PaperService(cluster, shape)
    N, n_exp = cluster.n, shape.n_experts
    report = PlacementReport()
    pi = calib.popularity(n_exp)  # line 2
    st = baseline_deployment(cluster, shape, budget, pi, svc)  # line 1

    def run_sim() -> RoutingStats:
        dep = st.deployment()
        return simulate(make_router(dep), calib, len(dep.replicas), N, n_exp, lam_max, quality.q)

    def g_of(stats: RoutingStats | None) -> np.ndarray:
        out = np.zeros(len(st.reps))
        for i, r in enumerate(st.reps):
            saved = svc.load_s(r.server, r.precision)
            freq = pi[r.expert] if stats is None else stats.replica_uses[i]
            out[i] = freq * saved
        return out

    # Stage 1 (lines 3-7)
    stats = run_sim() if params.residency == "routing" else None
    fill = g_of(None) if params.fill_gpu else None
    report.stage1_promoted = _promote_stage1(st, g_of(stats), params.residency_order, fill)
    stats = run_sim()
    report.calib_delay_stage1 = stats.mean_delay

    # Stage 2 (lines 8-15)
    if params.replicate:
        _stage2(st, cluster, shape, quality, run_sim, stats, params, report, svc)

    # Stage 3 (line 16)
    stats = run_sim() if params.residency == "routing" else None
    g = g_of(stats)
    fill = g_of(None) if params.fill_gpu else None
    if params.diminishing_returns and params.residency == "routing":
        res_stats = stats if stats is not None else run_sim()
        _stage3_guarded(st, cluster, shape, quality, g, res_stats, params, report, fill, svc)
    else:
        report.stage3_gpu = _promote_stage1(st, g, params.residency_order, fill)
    dep = st.deployment()
    dep.check(shape, budget)
    report.calib_delay_final = simulate(make_router(dep), calib, len(dep.replicas), N, n_exp,
                                        lam_max, quality.q).mean_delay
    return dep, report


def _usable(c: Precision) -> int:
    """Number of budget classes (0, 1, 2) in which a replica of precision c passes (18)."""
    return {Precision.INT4: 1, Precision.INT8: 2, Precision.FP16: 3}[c]


def _trans_matrix(cluster: Cluster, shape: MoEShape) -> np.ndarray:
    # same table as CostModel.trans, without needing a deployment
    N = cluster.n
    t = np.zeros((N, N))
    for m in range(N):
        for n in range(N):
            if m != n:
                t[m, n] = shape.hidden_bytes / cluster.bandwidth[m][n] + cluster.delay[m][n]
    return t


def _stage2(st: _State, cluster: Cluster, shape: MoEShape, quality: QualityModel,
            run_sim: Callable[[], RoutingStats], stats: RoutingStats, params: Alg1Params,
            report: PlacementReport, svc: ServiceModel) -> None:
    """Lines 8-15, as rounds of lazy-greedy insertions between re-simulations."""
    N, n_exp = cluster.n, shape.n_experts
    trans = _trans_matrix(cluster, shape)
    cap_total = params.memory_ratio * n_exp * st.v(FULL_PRECISION)
    lam = params.lambda_q
    dens = params.replication_order == "density"
    min_v = min(st.v(c) for c in params.precisions)

    def old_cost(e: int) -> np.ndarray:
        """(N, 3): cheapest static cost from each theta among the replicas a token
        of each budget class may use (INT4 needs class 0, INT8 class <= 1)."""
        best = np.full((N, 3), np.inf)
        for r in st.reps:
            if r.expert == e:
                cost = _static_costs(trans, svc, quality, lam, r.gpu, r.server,
                                     r.precision, e)
                for b in range(_usable(r.precision)):
                    best[:, b] = np.minimum(best[:, b], cost)
        return best

    old = {e: old_cost(e) for e in range(n_exp)}
    added = 0
    spare = max(0.0, cap_total - st.total)
    for rnd in range(params.stage2_rounds):
        round_cap = min(cap_total, st.total + spare / params.stage2_rounds) \
            if rnd < params.stage2_rounds - 1 else cap_total
        resid = stats.residing  # (n_exp, N, 3): residing server x budget class per target

        def benefit(e: int, n: int, c: Precision) -> float:
            gpu = st.gpu_fits(n, c)
            new = _static_costs(trans, svc, quality, lam, gpu, n, c, e)
            u = _usable(c)
            gain = float(np.sum(resid[e, :, :u] * np.maximum(0.0, old[e][:, :u] - new[:, None])))
            return gain - params.memory_price * st.v(c)

        def key(b: float, c: Precision) -> float:
            return b / st.v(c) if dens else b

        heap: list[tuple[float, int, int, int]] = []
        for e in range(n_exp):
            if not resid[e].any() or st.count[e] >= params.max_replicas_per_expert:
                continue
            for n in range(N):
                if (e, n) in st.where:
                    continue
                for c in params.precisions:
                    if c.label not in cluster.precisions[n]:
                        continue  # no kernels for this format on n's GPU class
                    b = benefit(e, n, c)
                    if b > 0:
                        heap.append((-key(b, c), e, n, int(c)))
        heapq.heapify(heap)
        in_round = 0
        stop = False
        while heap:
            if params.replication_cap is not None and added >= params.replication_cap:
                stop = True
                break
            if st.total + min_v > round_cap:
                break
            nk, e, n, ci = heapq.heappop(heap)
            c = Precision(ci)
            if (e, n) in st.where or st.count[e] >= params.max_replicas_per_expert:
                continue
            v = st.v(c)
            if st.total + v > round_cap or st.all_used[n] + v > st.budget.cpu[n]:
                continue
            b = benefit(e, n, c)
            if b <= 0:
                continue
            k = key(b, c)
            if k < -nk - 1e-18:  # stale: re-queue with its current value (lazy greedy)
                heapq.heappush(heap, (-k, e, n, ci))
                continue
            st.add(e, n, c, st.gpu_fits(n, c))  # line 14
            added += 1
            in_round += 1
            report.stage2_by_precision[c.label] = report.stage2_by_precision.get(c.label, 0) + 1
            old[e] = old_cost(e)
        report.stage2_rounds += 1
        if stop or not heap or rnd == params.stage2_rounds - 1:
            break  # cap reached, or no insertion with positive benefit fits
        stats = run_sim()  # tokens now reside elsewhere: refresh eq. (14)'s expectation
    report.stage2_added = added


def _stage3_guarded(st: _State, cluster: Cluster, shape: MoEShape, quality: QualityModel,
                    g: np.ndarray, stats: RoutingStats, params: Alg1Params,
                    report: PlacementReport, fill: np.ndarray | None = None,
                    svc: ServiceModel | None = None) -> None:
    """Line 16: global re-assignment of Y under (c.1) with the diminishing-returns guard."""
    svc = svc if svc is not None else PaperService(cluster, shape)
    N = cluster.n
    trans = _trans_matrix(cluster, shape)
    lam = params.lambda_q
    resid = stats.residing
    flags = [False] * len(st.reps)
    st.gpu_used = [0.0] * N
    has_gpu: dict[int, list[int]] = {}
    by_expert: dict[int, list[int]] = {}
    for i, r in enumerate(st.reps):
        by_expert.setdefault(r.expert, []).append(i)

    def gpu_cost(i: int) -> np.ndarray:
        r = st.reps[i]
        return _static_costs(trans, svc, quality, lam, True, r.server,
                             r.precision, r.expert)

    def marginal(i: int) -> float:
        """Expected per-token saving of making replica i GPU-resident, given the
        expert's existing GPU copies, over the activations that may use it."""
        r_i = st.reps[i]
        e = r_i.expert
        u = _usable(r_i.precision)
        best = np.full((N, 3), np.inf)
        for j in by_expert[e]:
            r = st.reps[j]
            cost = gpu_cost(j) if flags[j] else _static_costs(
                trans, svc, quality, lam, False, r.server, r.precision, e)
            for b in range(_usable(r.precision)):
                best[:, b] = np.minimum(best[:, b], cost)
        gain = np.maximum(0.0, best[:, :u] - gpu_cost(i)[:, None])
        return float(np.sum(resid[e, :, :u] * gain))

    dens = params.residency_order == "density"

    def key(i: int, value: float) -> float:
        return value / st.v(st.reps[i].precision) if dens else value

    heap = [(-key(i, g[i]), i, 0) for i in range(len(st.reps)) if g[i] > 0]
    heapq.heapify(heap)
    version: dict[int, int] = {}
    while heap:
        neg, i, ver = heapq.heappop(heap)
        r = st.reps[i]
        if flags[i] or not st.gpu_fits(r.server, r.precision):
            continue
        e = r.expert
        if has_gpu.get(e):
            if ver != version[e]:
                # score a later copy by its marginal saving, capped by its own g
                m = min(g[i], marginal(i))
                if m > 0:
                    heapq.heappush(heap, (-key(i, m), i, version[e]))
                continue
            report.stage3_second_copies += 1
        flags[i] = True
        st.gpu_used[r.server] += st.v(r.precision)
        has_gpu.setdefault(e, []).append(i)
        version[e] = version.get(e, 0) + 1
    report.stage3_guarded = sum(flags)
    if fill is not None:
        _fill(st, flags, fill, params.residency_order)
    st.set_gpu(flags)
    report.stage3_gpu = sum(flags)
