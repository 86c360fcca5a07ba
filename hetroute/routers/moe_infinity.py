"""MoE-Infinity: single-server serving with an activation-aware GPU expert cache.

Source: L. Xue et al., "MoE-Infinity: Offloading-Efficient MoE Model Serving"
(arXiv:2401.14361); code: github.com/EfficientMoE/MoE-Infinity (read at
d617801: ``memory/expert_tracer.py``, ``expert_predictor.py``,
``expert_priority_score.py``, ``expert_cache.py``, ``expert_prefetcher.py``).
The open-source system serves on one host: all experts in host memory, a GPU
expert cache filled over PCIe. Taken from the paper and code:

- Tracing: per request an Expert Activation Matrix (EAM, layers x experts)
  counts the tokens routed to each expert. A finished EAM enters the bounded
  collection (EAMC, capacity 1000): the first empty slot, else the
  least-accessed non-persistent entry; a new entry has access count 1.
- Prediction: the stored EAM most similar to the request's partial EAM
  (cosine similarity of per-layer rows, averaged over layers; its access
  count += 1) scores future rows l' >= l by count * (1 - (l' - l) / (L + 1));
  experts with a nonzero score are prefetched in descending order.
- Eviction ("priority", the default): score = layer term x the request's
  row-normalised EAM entry x visit frequency, each normalised plus 1e-6; the
  lowest-scoring expert not protected (on demand, prefetched) goes; if all are
  protected, the lowest except the on-demand one.
  ``eviction="lfu"`` evicts by visit count (what the current code does with
  its predictor commented out).

Choices where the source is silent or the setting differs:

- Every server is an independent MoE-Infinity host serving its own users (no
  cross-server collaboration): all experts FP16 in its CPU memory (a server
  whose CPU budget cannot hold the model is an error naming it), a GPU cache
  of floor(budget.gpu / v) experts, warm-started with the most popular experts
  of the calibration traffic (the static tier in the deployment). Tokens never
  leave home, so the home's decider routes every token and owns the cache.
- The code's similarity masks the opposite rows (it blanks the stored rows of
  past layers and compares them with the zero future rows of the partial EAM,
  which makes every entry equally similar); the paper's description is
  followed: the rows the request has reached are compared.
- Many requests share one server here (the paper batches <= 16 requests). The
  "request's EAM" of the eviction score is the sum of the row-normalised EAMs
  of the requests in flight at the server (unreached rows uniform, as in code).
  The layer term is the code's decay from the first layer, 1 - l / (L + 1),
  without its dependence on one request's current layer: initial layers are
  kept because prefetching cannot hide their misses.
- Visits count batch executions (``on_execute``), since the insertion into the
  cache, as the code counts per forward pass.
- The EAMC is warm-started with persistent EAMs of the calibration traffic,
  cut into consecutive groups of ``warm_tokens_per_eam`` tokens (the code loads
  offline traces as persistent entries); 0 starts it empty.
- Prefetching: predictions run at every token-layer of a request (the EAM
  changes per token). Copies go on the backend's FIFO copy engine, which can
  neither reorder nor cancel, so at most ``max_inflight_prefetch`` copies are
  queued per server (the head of MoE-Infinity's reprioritised queue); the
  current token's own targets are left to the on-demand load. A prefetched
  expert stays protected until it is used or the request it was predicted for
  completes (the code protects the experts predicted for the current request).
- A batch that starts while its expert's prefetch is still in flight pays the
  full load v / beta (the backend has no partial-copy state); SSD offload and
  the 4x-GPU CPU cache are not modelled (the whole model is in CPU memory).
- Its own regime: MoE-Infinity targets serving on one host at small batch,
  where decode steps dominate and the activation matrix of a request predicts
  its later tokens. The experiment runs it at the paper's 40 req/s of
  prompt-only requests instead; ``own_regime`` (32 generated tokens after the
  36-token prompt, 0.5 req/s over the cluster, i.e. about one request in flight
  at a time) is where ``testbed compare`` also runs it, as a reference row.
  The 32 tokens and the rate are our choice, not the source's.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field

from ..deployment import ConstraintViolation, Deployment, Replica
from ..residency import OnlineCache
from ..state import Assignment, Mode, StateView, TokenView
from ..system import FULL_PRECISION
from .base import Router, RouterParams


class MoEInfinityParams(RouterParams):
    eamc_capacity: int = Field(1000, ge=1, description="EAMs kept per server (code default 1000)")
    warm_tokens_per_eam: int = Field(36, ge=0, description="calibration tokens per warm EAM; 0: none")
    prefetch: bool = True
    max_inflight_prefetch: int = Field(4, ge=0, description="queued prefetch copies per server")
    eviction: Literal["priority", "lfu"] = "priority"


def _unit_rows(counts: np.ndarray) -> np.ndarray:
    """Rows scaled to unit L2 norm (zero rows stay zero): cosine per layer is a dot."""
    norm = np.linalg.norm(counts, axis=-1, keepdims=True)
    return np.divide(counts, norm, out=np.zeros_like(counts), where=norm > 0)


def _prob_rows(counts: np.ndarray) -> np.ndarray:
    """Rows normalised to sum 1, unreached (zero) rows uniform."""
    s = counts.sum(axis=-1, keepdims=True)
    E = counts.shape[-1]
    return np.where(s > 0, counts / np.where(s > 0, s, 1.0), 1.0 / E)


class _Request:
    """Per-request tracing state at its home server."""

    __slots__ = ("counts", "unit", "sim")

    def __init__(self, L: int, E: int, capacity: int) -> None:
        self.counts = np.zeros((L, E))
        self.unit = np.zeros((L, E))
        self.sim = np.zeros(capacity)  # sum over layers of cosine with each EAMC entry


class _Collection:
    """The EAMC: finished EAMs (raw counts and unit rows) with access counts."""

    def __init__(self, capacity: int, L: int, E: int) -> None:
        self.capacity = capacity
        self.raw = np.zeros((0, L, E))
        self.unit = np.zeros((0, L, E))
        self.access = np.zeros(capacity)
        self.size = 0
        self.persistent = 0

    def copy(self) -> "_Collection":
        c = _Collection(self.capacity, *self.raw.shape[1:])
        c.raw, c.unit, c.access = self.raw.copy(), self.unit.copy(), self.access.copy()
        c.size, c.persistent = self.size, self.persistent
        return c

    def add(self, counts: np.ndarray) -> int | None:
        """Store an EAM: first empty slot, else the least-accessed non-persistent one."""
        if self.size < self.capacity:
            slot = self.size
            self.size += 1
            if slot >= len(self.raw):  # grow by doubling, up to capacity
                grow = min(self.capacity, max(16, 2 * len(self.raw))) - len(self.raw)
                pad = np.zeros((grow,) + self.raw.shape[1:])
                self.raw = np.concatenate([self.raw, pad])
                self.unit = np.concatenate([self.unit, pad])
        elif self.persistent < self.capacity:
            slot = self.persistent + int(np.argmin(self.access[self.persistent:self.size]))
        else:
            return None
        self.raw[slot] = counts
        self.unit[slot] = _unit_rows(counts)
        self.access[slot] = 1
        return slot


class MoEInfinity(Router):
    """MoE-Infinity: each home serves alone from an EAM-guided GPU expert cache."""

    name = "moe-infinity"
    memory_note = ("every server is its own host by design: the whole model in its CPU "
                   "memory, its GPU budget as an expert cache")
    own_regime = {"workload.gen_tokens": 32, "workload.rate_per_s": 0.02,
                  "workload.duration_s": 1500.0, "workload.warmup_s": 50.0}
    Params = MoEInfinityParams
    params: MoEInfinityParams
    # per-server state, set by ``decider``
    server: int
    cache: "ExpertCache"  # the server's GPU expert cache (its ``residency``)
    cap: int  # GPU cache size, experts
    resident: np.ndarray  # (n_experts,) bool: in the GPU cache now
    visits: np.ndarray  # batch executions since the expert entered the cache
    fresh: np.ndarray  # prefetched and not used yet (protected from eviction)
    owner: dict[int, int]  # expert prefetched or in flight -> the request it was predicted for
    inflight: set[int]  # experts with a prefetch copy queued
    eamc: _Collection
    requests: dict[int, _Request]
    agg: np.ndarray  # (L, E) sum of in-flight requests' row-normalised EAMs
    plans: dict[int, dict[int, tuple[int, ...]]]  # EAMC slot -> layer -> prefetch order
    predicts: bool

    # -- offline ---------------------------------------------------------------
    def place(self) -> Deployment:
        pr = self.problem
        sh, cl = pr.shape, pr.cluster
        v = float(sh.expert_bytes[FULL_PRECISION])
        model = v * sh.n_experts
        reps = []
        order = sorted(range(sh.n_experts), key=lambda e: (-pr.popularity[e], e))
        for n in range(cl.n):
            if pr.budget.cpu[n] < model:
                raise ConstraintViolation(
                    f"moe-infinity: server {cl.names[n]} has {pr.budget.cpu[n] / 1e9:.1f} GB of CPU "
                    f"budget, less than the {model / 1e9:.1f} GB of experts it must hold")
            warm = set(order[:self.cache_size(n)])
            reps += [Replica(e, n, FULL_PRECISION, e in warm) for e in range(sh.n_experts)]
        self.placement_report = {"cache_experts": [self.cache_size(n) for n in range(cl.n)]}
        return Deployment(tuple(reps), sh.n_experts, cl.n)

    def cache_size(self, n: int) -> int:
        v = float(self.problem.shape.expert_bytes[FULL_PRECISION])
        return min(self.problem.shape.n_experts, int(self.problem.budget.gpu[n] // v))

    # -- shared tables ---------------------------------------------------------
    def bind(self, deployment: Deployment) -> None:
        super().bind(deployment)
        sh, N = self.problem.shape, self.problem.cluster.n
        L, E = sh.n_layers, sh.experts_per_layer
        self.rep_expert = [r.expert for r in deployment.replicas]
        self.rep_of = []
        for n in range(N):
            row = [-1] * sh.n_experts
            for r in deployment.by_server[n]:
                row[deployment.replicas[r].expert] = r
            if min(row) < 0:
                raise ConstraintViolation(f"moe-infinity: server {n} does not hold every expert")
            self.rep_of.append(row)
        layer = np.repeat(np.arange(L), E)
        topo = 1.0 - layer / (L + 1)
        self.topo = topo / topo.sum() + 1e-6
        warm = _Collection(self.params.eamc_capacity, L, E)
        g = self.params.warm_tokens_per_eam
        if g:
            t = self.problem.calibration.targets
            for i in range(0, min(t.shape[0], g * warm.capacity), g):
                counts = np.bincount(t[i:i + g].ravel(), minlength=sh.n_experts).astype(float)
                warm.add(counts.reshape(L, E))
            warm.persistent = warm.size
        self.warm = warm

    def decider(self, server: int) -> "MoEInfinity":
        d = self.clone()
        n_exp = self.problem.shape.n_experts
        d.server = server
        d.cap = self.cache_size(server)
        reps = self.deployment.replicas
        d.resident = np.array([reps[self.rep_of[server][e]].gpu for e in range(n_exp)])
        d.visits = np.zeros(n_exp)
        d.fresh = np.zeros(n_exp, dtype=bool)
        d.owner = {}
        d.inflight = set()
        d.eamc = self.warm.copy()
        d.requests = {}
        d.agg = np.zeros((self.problem.shape.n_layers, self.problem.shape.experts_per_layer))
        d.plans = {}
        d.predicts = self.params.prefetch and 0 < d.cap < n_exp and self.params.max_inflight_prefetch > 0
        d.cache = ExpertCache(d)
        return d

    def residency(self, server: int) -> "ExpertCache":
        """The server's GPU expert cache, shared with this decider's routing state."""
        assert server == self.server, "asked of another server's decider"
        return self.cache

    # -- online ----------------------------------------------------------------
    def route(self, tok: TokenView, targets: tuple[int, ...], view: StateView) -> Assignment:
        E = self.problem.shape.experts_per_layer
        layer = tok.layer
        req = self.requests.get(tok.request)
        if req is None:
            req = self.requests[tok.request] = _Request(*self.agg.shape, self.eamc.capacity)
            self.agg += 1.0 / E
        row = req.counts[layer]
        self.agg[layer] -= _prob_rows(row)
        for e in targets:
            row[e - layer * E] += 1
        self.agg[layer] += _prob_rows(row)
        prefetch: tuple[int, ...] = ()
        if self.predicts:
            old = req.unit[layer].copy()
            req.unit[layer] = _unit_rows(row)
            size = self.eamc.size
            if size:
                req.sim[:size] += self.eamc.unit[:size, layer] @ (req.unit[layer] - old)
                prefetch = self._prefetch(tok.request, int(np.argmax(req.sim[:size])), layer,
                                          targets)
        rep = self.rep_of[self.server]
        reps = tuple(rep[e] for e in targets)
        return Assignment(targets=tuple(targets), replicas=reps, modes=(Mode.EXACT,) * len(reps),
                          next_server=tok.server, prefetch=prefetch)

    def _prefetch(self, request: int, slot: int, layer: int, targets: tuple[int, ...]
                  ) -> tuple[int, ...]:
        self.eamc.access[slot] += 1
        room = self.params.max_inflight_prefetch - len(self.inflight)
        if room <= 0:
            return ()
        plans = self.plans.setdefault(slot, {})
        plan = plans.get(layer)
        if plan is None:
            L, E = self.agg.shape
            decay = 1.0 - (np.arange(layer, L) - layer) / (L + 1)
            score = (self.eamc.raw[slot, layer:] * decay[:, None]).ravel()
            nz = np.flatnonzero(score > 0)
            nz = nz[np.argsort(-score[nz], kind="stable")]
            plan = plans[layer] = tuple(int(i) + layer * E for i in nz)
        out = []
        for e in plan:
            if not self.resident[e] and e not in self.inflight and e not in targets:
                self.inflight.add(e)
                self.owner[e] = request
                out.append(self.rep_of[self.server][e])
                if len(out) == room:
                    break
        return tuple(out)

    def on_request_done(self, request: int) -> None:
        req = self.requests.pop(request, None)
        if req is None:
            return
        for e in [e for e, q in self.owner.items() if q == request]:
            del self.owner[e]
            self.fresh[e] = False
        self.agg -= _prob_rows(req.counts)
        if not self.requests:
            self.agg[:] = 0.0  # no drift carried over
        if not req.counts.any():
            return
        slot = self.eamc.add(req.counts)
        if slot is None:
            return
        self.plans.pop(slot, None)
        if self.predicts:
            u = self.eamc.unit[slot]
            for other in self.requests.values():
                other.sim[slot] = float((u * other.unit).sum())


class ExpertCache(OnlineCache):
    """One server's GPU expert cache (the residency strategy of MoE-Infinity).

    Its arrays and sets are the decider's own (``resident``, ``visits``, ``fresh``,
    ``owner``, ``inflight``, ``agg``): the decider reads them to predict and prefetch,
    the backend inserts and evicts through this object."""

    def __init__(self, d: MoEInfinity) -> None:
        self.cap, self.rep_expert, self.topo, self.eviction = d.cap, d.rep_expert, d.topo, d.params.eviction
        self.resident, self.visits, self.fresh = d.resident, d.visits, d.fresh
        self.owner, self.inflight, self.agg = d.owner, d.inflight, d.agg

    def is_gpu(self, replica: int) -> bool:
        return bool(self.resident[self.rep_expert[replica]])

    def on_execute(self, replica: int, loaded: bool) -> None:
        e = self.rep_expert[replica]
        if loaded and not self.resident[e]:
            self._insert(e)
        self.visits[e] += 1
        self.fresh[e] = False
        self.owner.pop(e, None)

    def on_prefetched(self, replica: int) -> None:
        e = self.rep_expert[replica]
        self.inflight.discard(e)
        if not self.resident[e]:
            self._insert(e)
            self.fresh[e] = self.resident[e] and e in self.owner

    def _insert(self, e: int) -> None:
        if self.cap == 0:
            return
        if int(self.resident.sum()) >= self.cap:
            victim = self._victim(e)
            self.resident[victim] = False
            self.fresh[victim] = False
            self.owner.pop(victim, None)
        self.resident[e] = True
        self.visits[e] = 0.0

    def _victim(self, incoming: int) -> int:
        """The resident expert to evict (never ``incoming``)."""
        res = self.resident
        if self.eviction == "lfu":
            score = self.visits.copy()
        else:
            total = self.visits[res].sum()
            freq = self.visits / total + 1e-6 if total > 0 else np.ones_like(self.visits)
            act = np.maximum(self.agg.ravel(), 0.0)
            s = act.sum()
            act = act / s + 1e-6 if s > 1e-9 else np.ones_like(act)
            score = self.topo * act * freq
        for allowed in (res & ~self.fresh, res):
            allowed = allowed.copy()
            allowed[incoming] = False
            if allowed.any():
                return int(np.flatnonzero(allowed)[np.argmin(score[allowed])])
        raise AssertionError("a full cache of capacity >= 1 has an evictable entry")
