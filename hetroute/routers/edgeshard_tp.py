"""EdgeShard, throughput-optimal variant: the pipeline whose slowest stage is fastest.

Source: M. Zhang et al., "EdgeShard: Efficient LLM Inference via Collaborative
Edge Computing", IEEE Internet of Things Journal (DOI 10.1109/JIOT.2024.3524255;
arXiv:2405.14371). Beside the latency DP (``edgeshard``) the paper optimises
throughput: with micro-batches in flight a pipeline delivers one result per
bottleneck time, so the objective is the largest stage time, max over stages of
(stage compute, stage communication), with every device used at most once
(``shared/reference/baselines.md``). The paper compares it in its throughput
experiments; HetRoute's Fig. 2(f) compares throughput, so both variants are here.

How the optimum is found (exact for this objective, not the paper's recursion):
layers of an MoE model are identical, so for a candidate bottleneck T each
device j can take at most c_j(T) consecutive layers (memory: GPU first, then
CPU, as ``edgeshard``; time: n_gpu t_gpu + n_cpu t_cpu <= T), and a link can
carry a stage boundary only if its transfer time fits T. reach[S][j], the most
layers a chain of the devices S ending at j can cover starting at the source,
is a DP over subsets (covering more never hurts when layers are identical); T is
feasible when some chain covers all L layers and its last device can send the
result home within T. Bisection over the finite set of candidate stage times
gives the smallest feasible T. Cost O(2^N N^2 log(N L)); above ``max_devices``
servers only the fastest ``max_devices`` (per-layer time, GPU tier) are
considered (a deviation; 10 servers take well under a second).

Choices where the source is silent (shared with ``edgeshard``):

- Source device: the most frequent home of the calibration traffic; layer 0 sits
  there and the result returns there (the return transfer is a stage too).
- Stage communication is the transfer of one token's hidden state over the link,
  d / B_kj: propagation delay adds latency but does not limit a pipeline's rate.
- Compute per token per layer in the router's belief (``cost_model``), as in the
  latency variant; among pipelines of equal bottleneck the DP keeps the first it
  finds (devices in index order), not the lowest latency.
- Online it is the same fixed pipeline as ``edgeshard``: no caching, no per-token
  routing; the world batches tokens per step like every other router's.
"""

from __future__ import annotations

from pydantic import Field

from ..deployment import ConstraintViolation
from ..system import FULL_PRECISION
from .edgeshard import EdgeShard, EdgeShardParams

INF = float("inf")


class EdgeShardTPParams(EdgeShardParams):
    max_devices: int = Field(14, ge=1, le=20, description="subset DP over at most this many "
                             "servers (the fastest); 2^N states")


class EdgeShardThroughput(EdgeShard):
    """EdgeShard's throughput-optimal pipeline (minimum bottleneck stage)."""

    name = "edgeshard-tp"
    Params = EdgeShardTPParams
    params: EdgeShardTPParams

    def _stage_tables(self):
        """Per device: GPU-layer and CPU-layer room, per-layer times; link transfer times."""
        pr = self.problem
        cl, sh, bud = pr.cluster, pr.shape, pr.budget
        N, k = cl.n, sh.top_k
        v = float(sh.expert_bytes[FULL_PRECISION])
        size = sh.experts_per_layer * v
        svc = self.service
        gpu_t = [svc.dense_s(j, 1) + k * svc.expert_s(j, FULL_PRECISION, 1) for j in range(N)]
        cpu_t = [gpu_t[j] + k * svc.load_s(j, FULL_PRECISION) for j in range(N)]
        room_gpu = [int(bud.gpu[j] // size) for j in range(N)]
        room_cpu = [int(bud.cpu[j] // size) for j in range(N)]
        xfer = [[0.0 if a == b else sh.hidden_bytes / cl.bandwidth[a][b] for b in range(N)]
                for a in range(N)]
        return gpu_t, cpu_t, room_gpu, room_cpu, xfer

    @staticmethod
    def _stage_time(n: int, gpu_t: float, cpu_t: float, room_gpu: int) -> float:
        g = min(n, room_gpu)
        return g * gpu_t + (n - g) * cpu_t

    def pipeline(self) -> tuple[list[int], list[bool], float]:
        """(server per layer, GPU tier per layer, planned bottleneck seconds per token)."""
        L = self.problem.shape.n_layers
        N = self.problem.cluster.n
        gpu_t, cpu_t, room_gpu, room_cpu, xfer = self._stage_tables()
        src = self.source()
        if room_gpu[src] + room_cpu[src] < 1:
            raise ConstraintViolation(
                f"edgeshard-tp: source server {self.problem.cluster.names[src]} cannot hold layer 0")
        usable = [j for j in range(N) if room_gpu[j] + room_cpu[j] >= 1]
        if len(usable) > self.params.max_devices:
            others = sorted((j for j in usable if j != src), key=lambda j: (gpu_t[j], j))
            usable = sorted([src] + others[:self.params.max_devices - 1])
        cap_max = {j: min(L, room_gpu[j] + room_cpu[j]) for j in usable}
        if sum(cap_max.values()) < L:
            raise ConstraintViolation("edgeshard-tp: the servers cannot hold every layer once")
        times = {self._stage_time(n, gpu_t[j], cpu_t[j], room_gpu[j])
                 for j in usable for n in range(1, cap_max[j] + 1)}
        times |= {xfer[a][b] for a in usable for b in usable if a != b}
        cands = sorted(times)
        lo, hi = 0, len(cands) - 1
        if self._chain(cands[hi], usable, src, gpu_t, cpu_t, room_gpu, cap_max, xfer) is None:
            raise ConstraintViolation("edgeshard-tp: no chain of distinct servers holds the model")
        while lo < hi:
            mid = (lo + hi) // 2
            if self._chain(cands[mid], usable, src, gpu_t, cpu_t, room_gpu, cap_max, xfer) is None:
                lo = mid + 1
            else:
                hi = mid
        chain = self._chain(cands[lo], usable, src, gpu_t, cpu_t, room_gpu, cap_max, xfer)
        servers: list[int] = []
        tiers: list[bool] = []
        for j, n in chain:
            g = min(n, room_gpu[j])
            servers += [j] * n
            tiers += [True] * g + [False] * (n - g)
        return servers, tiers, cands[lo]

    def _chain(self, T, usable, src, gpu_t, cpu_t, room_gpu, cap_max, xfer):
        """[(device, layers)] covering all layers with every stage <= T, or None."""
        L = self.problem.shape.n_layers
        cap = {}
        for j in usable:
            n = 0
            while n < cap_max[j] and self._stage_time(n + 1, gpu_t[j], cpu_t[j], room_gpu[j]) <= T:
                n += 1
            if n:
                cap[j] = n
        if src not in cap:
            return None
        devs = sorted(cap)
        bit = {j: 1 << i for i, j in enumerate(devs)}
        # reach[(mask, j)] = (layers covered, parent state)
        start = (bit[src], src)
        reach = {start: (cap[src], None)}
        frontier = [start]
        best_end = None
        while frontier:
            nxt = []
            for state in frontier:
                mask, j = state
                covered = reach[state][0]
                if covered >= L and (j == src or xfer[j][src] <= T):
                    best_end = state
                    break
                if covered >= L:  # done, but the result cannot get home in time
                    continue
                for k in devs:
                    if mask & bit[k] or xfer[j][k] > T:
                        continue
                    s2 = (mask | bit[k], k)
                    c2 = min(L, covered + cap[k])
                    if s2 not in reach or reach[s2][0] < c2:
                        if s2 not in reach:
                            nxt.append(s2)
                        reach[s2] = (c2, state)
            if best_end is not None:
                break
            frontier = nxt
        if best_end is None:
            return None
        path = []
        state = best_end
        while state is not None:
            path.append(state[1])
            state = reach[state][1]
        path.reverse()
        chain, left = [], L
        for j in path:
            n = min(cap[j], left)
            chain.append((j, n))
            left -= n
        return chain

    def place(self):
        dep = super().place()
        servers = self.placement_report["pipeline"]
        bottleneck = self.placement_report.pop("planned_latency_s")
        self.placement_report.update(planned_bottleneck_s=bottleneck,
                                     planned_tokens_per_s=(1.0 / bottleneck if bottleneck > 0 else INF),
                                     stages=len(set(servers)))
        return dep
