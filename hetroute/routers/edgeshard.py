"""EdgeShard: dense partitioning of whole layers over devices by a latency-optimal DP.

Source: M. Zhang et al., "EdgeShard: Efficient LLM Inference via Collaborative
Edge Computing", IEEE Internet of Things Journal (DOI 10.1109/JIOT.2024.3524255);
no official code. The latency DP follows the paper as summarised in
``shared/reference/baselines.md`` (and an unofficial re-implementation):
dp[i][j] = min_k dp[i-1][k] + t_comp(layer i on device j) + t_comm(k -> j),
each device's remaining memory carried in the state along the best path and a
layer skipped on a device without room; the first layer sits on the source
device and the final output returns to it. Online there is one fixed
pipeline: no caching, no per-token routing. For an MoE model a "layer" is the
whole layer, attention and all of its experts on one device.

Choices where the source is silent:

- One pipeline for all requests, rooted at the most frequent home server of
  the calibration traffic (ties: lowest index). EdgeShard plans for a single
  source device and deploys one copy of the model; a pipeline per home would
  need that many copies. Tokens of other homes travel to the pipeline and back
  (the backend returns every token home after the last layer).
- Memory: a layer takes E FP16 experts (the dense part is held by every server,
  ``MemoryBudget``); it goes to the device's GPU if the remaining GPU budget
  holds it, else to its CPU budget (then each use pays the GPU-CPU load), else
  the device is skipped for that layer.
- t_comp of a layer on device j, per token: dense part + k experts, plus
  k v / beta_j when the layer is CPU-resident (k activated experts loaded), in
  the router's belief (``cost_model``). EdgeShard's first stage profiles every
  layer on every device offline ("offline profiling", arXiv:2405.14371), so by
  default it believes what a profile would measure: the world's compute model
  (``hardware``: the roofline for one token). ``cost_model: paper`` gives the
  paper's (dense FLOPs + k w_E) / F_j.
  t_comm(k -> j) = d / B_kj plus the link's one-way delay, 0 when k = j.
- This is the latency-optimal DP; the paper's throughput-optimal variant is the
  router ``edgeshard-tp`` (``edgeshard_tp.py``).
- Backend note: the dense part of layer 0 runs at the token's home (the
  backend runs it where the token resides); EdgeShard would run it on the
  source device. Hops are the same; only that one dense step moves.
"""

from __future__ import annotations

from collections import Counter
from typing import Literal

from pydantic import Field

from ..deployment import ConstraintViolation, Deployment, Replica
from ..state import Assignment, Mode, StateView, TokenView, Unroutable
from ..system import FULL_PRECISION
from .base import Router, RouterParams

INF = float("inf")


class EdgeShardParams(RouterParams):
    # EdgeShard profiles each layer on each device offline, so it plans with measured
    # times: the world's compute model, not the paper's w/F.
    cost_model: Literal["paper", "hardware"] = "hardware"
    source: int | None = Field(None, ge=0, description="source device; None: most frequent home")


class EdgeShard(Router):
    """EdgeShard: whole layers pipelined over servers by the latency DP."""

    name = "edgeshard"
    memory_note = "one copy of the model by design: a pipeline holds each layer once"
    Params = EdgeShardParams
    params: EdgeShardParams

    def source(self) -> int:
        if self.params.source is not None:
            if self.params.source >= self.problem.cluster.n:
                raise ValueError(f"edgeshard: source {self.params.source} is not a server")
            return self.params.source
        counts = Counter(int(h) for h in self.problem.calibration.homes)
        return min(counts, key=lambda n: (-counts[n], n))

    def pipeline(self) -> tuple[list[int], list[bool], float]:
        """(server per layer, GPU tier per layer, planned latency) by the latency DP."""
        pr = self.problem
        cl, sh, bud = pr.cluster, pr.shape, pr.budget
        N, L, k = cl.n, sh.n_layers, sh.top_k
        v = float(sh.expert_bytes[FULL_PRECISION])
        size = sh.experts_per_layer * v
        comm = [[0.0 if a == b else sh.hidden_bytes / cl.bandwidth[a][b] + cl.delay[a][b]
                 for b in range(N)] for a in range(N)]
        svc = self.service  # the router's belief: (dense + k w)/F_j under the paper's model
        gpu_t = [svc.dense_s(j, 1) + k * svc.expert_s(j, FULL_PRECISION, 1) for j in range(N)]
        cpu_t = [gpu_t[j] + k * svc.load_s(j, FULL_PRECISION) for j in range(N)]

        def put(mem, j):
            """(tier is GPU, memory after placing one layer on j) or None without room."""
            gpu, cpu = mem
            if gpu[j] >= size:
                return True, (gpu[:j] + (gpu[j] - size,) + gpu[j + 1:], cpu)
            if cpu[j] >= size:
                return False, (gpu, cpu[:j] + (cpu[j] - size,) + cpu[j + 1:])
            return None

        src = self.source()
        start = put((tuple(bud.gpu), tuple(bud.cpu)), src)
        if start is None:
            raise ConstraintViolation(f"edgeshard: source server {cl.names[src]} cannot hold layer 0")
        # state per device: (cost, memory, parent device, tier)
        layers = [{src: (gpu_t[src] if start[0] else cpu_t[src], start[1], -1, start[0])}]
        for i in range(1, L):
            cur = {}
            for j in range(N):
                best = None
                for kk, (cost, mem, _, _) in sorted(layers[-1].items()):
                    placed = put(mem, j)
                    if placed is None:
                        continue
                    c = cost + comm[kk][j] + (gpu_t[j] if placed[0] else cpu_t[j])
                    if best is None or c < best[0]:
                        best = (c, placed[1], kk, placed[0])
                if best is not None:
                    cur[j] = best
            if not cur:
                raise ConstraintViolation(f"edgeshard: no server has room for layer {i}")
            layers.append(cur)
        last = min(layers[-1], key=lambda j: (layers[-1][j][0] + comm[j][src], j))
        total = layers[-1][last][0] + comm[last][src]
        servers, tiers = [0] * L, [False] * L
        j = last
        for i in range(L - 1, -1, -1):
            servers[i], tiers[i] = j, layers[i][j][3]
            j = layers[i][j][2]
        return servers, tiers, total

    def place(self) -> Deployment:
        sh = self.problem.shape
        servers, tiers, total = self.pipeline()
        E = sh.experts_per_layer
        reps = tuple(Replica(l * E + j, servers[l], FULL_PRECISION, tiers[l])
                     for l in range(sh.n_layers) for j in range(E))
        self.placement_report = {"pipeline": servers, "gpu_layers": sum(tiers),
                                 "planned_latency_s": total}
        return Deployment(reps, sh.n_experts, self.problem.cluster.n)

    def bind(self, deployment: Deployment) -> None:
        super().bind(deployment)
        E = self.problem.shape.experts_per_layer
        layer_server = []
        for l in range(self.problem.shape.n_layers):
            hosts = {deployment.replicas[r].server for j in range(E)
                     for r in deployment.by_expert[l * E + j]}
            if len(hosts) != 1:
                raise ConstraintViolation(f"edgeshard: layer {l} is not on exactly one server")
            layer_server.append(hosts.pop())
        self.layer_server = layer_server
        self.replica = [deployment.by_expert[e][0] for e in range(deployment.n_experts)]

    def route(self, tok: TokenView, targets: tuple[int, ...], view: StateView) -> Assignment:
        layer = tok.layer
        s = self.layer_server[layer]
        if not view.faultless and not view.reachable(tok.server, s):
            raise Unroutable(f"edgeshard: layer {layer}'s server {s} is unreachable")
        nxt = self.layer_server[layer + 1] if layer + 1 < len(self.layer_server) else s
        reps = tuple(self.replica[e] for e in targets)
        return Assignment(targets=tuple(targets), replicas=reps, modes=(Mode.EXACT,) * len(reps),
                          next_server=nxt)
