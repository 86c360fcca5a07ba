"""Unified heterogeneous cost model: eq. (9), the layer delay (10) and the aggregator rule (11).

Tables are flat Python lists indexed by replica or server so that the online
router can evaluate thousands of assignments per millisecond without numpy
call overhead on tiny arrays.

Modelling choices (documented in the README):
- The transmission term of eq. (9) is d/B. The paper's links also have 0.3-22 ms
  of propagation-plus-queueing latency, which eq. (9) leaves out; with
  ``include_propagation`` (default) the one-way delay is added to every
  transmission, otherwise a 22 ms link would be priced like a 0.3 ms one.
- Q_n(t)/F_n is carried in seconds (``backlog``), which equals the paper's
  FLOP backlog divided by F_n and also covers pending GPU-CPU loads.
- The four components carry the adaptive unit costs alpha_j of eq. (21) as
  multipliers ``CostWeights`` (mean 1, so equal alphas leave eq. (9) unchanged).

What is optimised, and two parts of the paper's formulation that are not implemented
(also in the README, "Modelling choices where the paper is silent"):
- Algorithm 2 minimises, per token-layer, D_{i,l} of eq. (10) plus lambda_q times the
  layer's quality increment sum(dq): the per-layer share of P0's objective
  D_i^tot + lambda Lambda_i (the paper's P_{i,l} writes only D_{i,l}; its eq. (9) and P0
  carry the quality price). Algorithm 1's benefits are expectations of the same cost.
- P1's weighted utility U of eq. (12) (omega_T, omega_Lambda, D_i^ref) is not
  implemented: neither algorithm uses it and the paper does not evaluate it. For one
  token with fixed D_i^ref and Lambda_i^max, minimising
  omega_T D_i^tot / D_i^ref + omega_Lambda Lambda_i / Lambda_i^max is minimising
  D_i^tot + lambda_i Lambda_i with lambda_i = (omega_Lambda / omega_T) D_i^ref / Lambda_i^max,
  i.e. P1 is P0 with a per-token quality price; the testbed uses one price, lambda_q.
  D_i^ref, the delay of the token under pure home-server full-precision execution, would
  need a second, counterfactual run of every token.
- Constraint (c.10), the per-window bound on the work admitted to a server summed over
  all tokens, is said to be "enforced at the placement stage", but Algorithm 1 has no
  step for it and a placement does not know the arrival rate. Only its online form is
  enforced: guard (19) in Algorithm 2, per decider, on the seconds of stream time
  (offload + compute) the decider admitted to the server in the current window; other
  deciders' admissions show up as backlog at the next refresh, and the emergency
  fallback relaxes the guard as the paper says. Overload then shows as queueing delay
  (Q_n/F_n), not as infeasibility.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .deployment import Deployment
from .quality import QualityModel
from .service import PaperService, ServiceModel
from .system import Cluster, MoEShape

COMPONENTS = ("tx", "off", "cq", "q")


@dataclass(frozen=True)
class CostWeights:
    """alpha_j of eq. (21) scaled so that their mean is 1."""

    tx: float = 1.0
    off: float = 1.0
    cq: float = 1.0
    q: float = 1.0

    @classmethod
    def from_simplex(cls, alphas: tuple[float, float, float, float]) -> "CostWeights":
        s = sum(alphas)
        k = len(COMPONENTS) / s if s > 0 else 1.0
        return cls(*(a * k for a in alphas))



class CostModel:
    """Per-replica and per-link cost tables for one (cluster, model, deployment)."""

    def __init__(self, cluster: Cluster, shape: MoEShape, deployment: Deployment,
                 quality: QualityModel, lambda_q: float = 0.5,
                 include_propagation: bool = True, service: ServiceModel | None = None) -> None:
        self.cluster = cluster
        self.shape = shape
        self.deployment = deployment
        self.quality = quality
        self.lambda_q = float(lambda_q)
        self.include_propagation = include_propagation
        #: whose service times these are: the router's belief (default the paper's w/F)
        self.belief = svc = service if service is not None else PaperService(cluster, shape)
        N = cluster.n
        d = shape.hidden_bytes
        #: seconds to move one hidden state m -> n (d/B [+ delay]); 0 on the diagonal.
        self.trans = [[0.0 if m == n else d / cluster.bandwidth[m][n]
                       + (cluster.delay[m][n] if include_propagation else 0.0)
                       for n in range(N)] for m in range(N)]
        reps = deployment.replicas
        self.rep_server = [r.server for r in reps]
        self.rep_expert = [r.expert for r in reps]
        self.rep_gpu = [r.gpu for r in reps]
        self.rep_prec = [int(r.precision) for r in reps]
        #: (1 - y) v / beta_n, seconds.
        self.rep_load = [0.0 if r.gpu else svc.load_s(r.server, r.precision) for r in reps]
        #: w / F_n (paper belief) or one token's roofline time (hardware belief), seconds.
        self.rep_comp = [svc.expert_s(r.server, r.precision, 1) for r in reps]
        #: q_{E,n} of the replica when it serves its own expert.
        self.rep_q = [float(quality.q[r.expert, r.precision]) for r in reps]
        #: dense part of a layer at the residing server, seconds.
        self.dense = [svc.dense_s(n, 1) for n in range(N)]
        self._la_static: tuple | None = None

    # -- eq. (9) ---------------------------------------------------------------
    def service(self, r: int) -> float:
        """Offload plus compute of replica r, seconds (what a job adds to a stream)."""
        return self.rep_load[r] + self.rep_comp[r]

    def unit_cost(self, theta: int, r: int, dq: float, backlog: list[float],
                  w: CostWeights = CostWeights()) -> float:
        """C_{i,l}(E, E^, n) of eq. (9) for replica r with quality increment dq."""
        n = self.rep_server[r]
        return (w.tx * self.trans[theta][n] + w.off * self.rep_load[r]
                + w.cq * (self.rep_comp[r] + backlog[n]) + w.q * self.lambda_q * dq)

    # -- eq. (10) --------------------------------------------------------------
    def layer_delay(self, theta: int, reps: tuple[int, ...], backlog: list[float],
                    next_server: int, w: CostWeights = CostWeights()) -> float:
        """D_{i,l} of eq. (10): fan-out + slowest compute branch + fan-in to theta_{l+1}.

        Targets placed on the same server share its branch and queue behind
        each other, so a branch is the server's backlog plus the sum of its jobs.
        """
        branch: dict[int, float] = {}
        for r in reps:
            n = self.rep_server[r]
            branch[n] = branch.get(n, w.cq * backlog[n]) + w.off * self.rep_load[r] + w.cq * self.rep_comp[r]
        tr = self.trans
        fan_out = max((tr[theta][n] for n in branch if n != theta), default=0.0)
        fan_in = max((tr[n][next_server] for n in branch if n != next_server), default=0.0)
        return w.tx * (fan_out + fan_in) + max(branch.values())

    # -- eq. (11) --------------------------------------------------------------
    def aggregator(self, participants: tuple[int, ...], lookahead: list[float],
                   w: CostWeights = CostWeights()) -> int:
        """theta_{i,l+1}: the participant minimising gather cost plus lookahead."""
        tr = self.trans
        best, best_cost = participants[0], float("inf")
        for n in participants:
            c = w.tx * sum(tr[m][n] for m in participants if m != n) + lookahead[n]
            if c < best_cost:
                best, best_cost = n, c
        return best

    def lookahead_table(self, popularity: list[float] | None,
                        w: CostWeights = CostWeights()) -> list[list[float]]:
        """T^next estimates: ``table[l][n]`` is the expected cost of serving one
        target of layer l from residing server n by its cheapest exact replica
        (static state, eq. 9 without quality). Row L is 0: the return hop to the
        home server is added per token by the router."""
        shape, dep = self.shape, self.deployment
        N = self.cluster.n
        if self._la_static is None:
            order = sorted(range(len(dep.replicas)), key=lambda r: self.rep_expert[r])
            srv = np.array([self.rep_server[r] for r in order])
            exp = np.array([self.rep_expert[r] for r in order])
            starts = np.flatnonzero(np.r_[True, exp[1:] != exp[:-1]])
            self._la_static = (
                np.array(self.trans)[:, srv],  # (N, R) transmission from each theta
                np.array([self.rep_load[r] for r in order]),
                np.array([self.rep_comp[r] for r in order]),
                starts, exp[starts])
        tr, load, comp, starts, experts = self._la_static
        cost = w.tx * tr + (w.off * load + w.cq * comp)[None, :]
        best = np.minimum.reduceat(cost, starts, axis=1)  # (N, experts with replicas)
        pop = np.ones(shape.n_experts) if popularity is None else np.asarray(popularity, float)
        per_expert = np.zeros((N, shape.n_experts))
        per_expert[:, experts] = best
        E = shape.experts_per_layer
        pw = pop.reshape(shape.n_layers, E)
        tot = pw.sum(axis=1)
        tot[tot == 0] = 1.0
        table = (per_expert.reshape(N, shape.n_layers, E) * pw[None]).sum(axis=2) / tot[None]
        return table.T.tolist() + [[0.0] * N]
