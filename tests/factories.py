"""Small random problem instances for unit and property tests (no workloads needed)."""

from __future__ import annotations

import numpy as np
import pytest

from hetroute.cost import CostModel
from hetroute.deployment import Deployment, Replica
from hetroute.quality import QualityModel, prior_quality
from hetroute.routing.algorithm2 import Alg2Params, SetLevelRouter
from hetroute.state import StateView, TokenView
from hetroute.system import Cluster, MoEShape, Precision

MB = 1e6


@pytest.fixture(params=["compiled", "reference"])
def engine(request, monkeypatch):
    """Run a test module's routing tests on both implementations of Algorithm 2: the numba
    kernel every run uses and the Python reference it ports (``route_reference``). Use as
    ``pytestmark = pytest.mark.usefixtures("engine")`` with ``from .factories import engine``."""
    if request.param == "reference":
        monkeypatch.setattr(SetLevelRouter, "route", SetLevelRouter.route_reference)
    return request.param


def shape(n_layers: int = 2, experts: int = 4, top_k: int = 2, d_model: int = 1024) -> MoEShape:
    params = 3 * d_model * 4 * d_model
    return MoEShape(name="toy", n_layers=n_layers, experts_per_layer=experts, top_k=top_k,
                    d_model=d_model, expert_flops=2.0 * params,
                    expert_bytes={Precision.FP16: 2 * params, Precision.INT8: params,
                                  Precision.INT4: params // 2},
                    hidden_bytes=2 * d_model, dense_flops=1e6, dense_bytes=0)


def cluster(n: int, rng: np.random.Generator) -> Cluster:
    bw = [[float("inf") if i == j else float(rng.uniform(0.8, 10) * 1e9 / 8) for j in range(n)]
          for i in range(n)]
    dl = [[0.0 if i == j else float(rng.uniform(0.3, 22) * 1e-3) for j in range(n)] for i in range(n)]
    return Cluster(names=tuple(f"s{i}" for i in range(n)),
                   flops=tuple(float(x) for x in rng.uniform(18, 120, n) * 1e12),
                   pcie=tuple(float(x) for x in rng.uniform(12, 64, n) * 1e9),
                   gpu_bytes=tuple(float(x) for x in rng.uniform(12, 48, n) * 1e9),
                   cpu_bytes=tuple(float(x) for x in rng.uniform(96, 512, n) * 1e9),
                   bandwidth=tuple(tuple(r) for r in bw), delay=tuple(tuple(r) for r in dl))


def random_deployment(sh: MoEShape, n_servers: int, rng: np.random.Generator,
                      max_replicas: int = 3) -> Deployment:
    """Every expert gets one FP16 replica (c.4) plus up to max_replicas-1 others."""
    reps = []
    for e in range(sh.n_experts):
        k = int(rng.integers(1, max_replicas + 1))
        servers = rng.choice(n_servers, size=min(k, n_servers), replace=False)
        for i, n in enumerate(servers):
            prec = Precision.FP16 if i == 0 else Precision(int(rng.integers(0, 3)))
            reps.append(Replica(e, int(n), prec, bool(rng.random() < 0.5)))
    return Deployment(tuple(reps), sh.n_experts, n_servers)


def router(sh: MoEShape, cl: Cluster, dep: Deployment, quality: QualityModel | None = None,
           **params) -> SetLevelRouter:
    q = quality or prior_quality(sh, seed=1)
    cost = CostModel(cl, sh, dep, q, lambda_q=0.5)
    return SetLevelRouter(cost, Alg2Params(**params))


def quality_with_loss(sh: MoEShape, scale: float) -> QualityModel:
    base = prior_quality(sh, seed=3)
    return QualityModel(q=base.q * scale,
                        substitutes=tuple(tuple((e, l * scale) for e, l in g) for g in base.substitutes))


# -- what a router chose, recomputed from the chosen replicas (not its self-report) --------

def recompute(cost: CostModel, tok: TokenView, targets, a, view: StateView,
              lam_q: float | None = None):
    """(dq, D_{i,l}, D + lambda_q * dq) of assignment ``a`` from its replicas alone:
    dq by ``QualityModel.increment`` per target (exact, substitute or fallback alike),
    D_{i,l} by eq. (10) (``CostModel.layer_delay``) to the aggregator the router
    named, at unit costs alpha = 1 (the routers here keep the default weights)."""
    q = cost.quality
    dq = 0.0
    for e, r in zip(targets, a.replicas):
        rep = cost.deployment.replicas[r]
        dq += q.increment(e, rep.expert, rep.precision)
    delay = cost.layer_delay(tok.server, tuple(a.replicas), view.backlog, a.next_server)
    lam = cost.lambda_q if lam_q is None else lam_q
    return dq, delay, delay + lam * dq


def check_aggregator(cost: CostModel, tok: TokenView, a, popularity=None) -> None:
    """next_server is a participant minimising eq. (11) (gather + lookahead)."""
    servers = tuple(sorted({cost.rep_server[r] for r in a.replicas}))
    assert a.next_server in servers
    if tok.layer == cost.shape.n_layers - 1:
        la = [cost.trans[n][tok.home] for n in range(cost.cluster.n)]
    else:
        la = cost.lookahead_table(popularity)[tok.layer + 1]

    def eq11(n):
        return sum(cost.trans[m][n] for m in servers if m != n) + la[n]
    assert eq11(a.next_server) <= min(eq11(n) for n in servers) + 1e-12
