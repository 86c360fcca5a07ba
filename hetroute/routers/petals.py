"""Petals: contiguous spans of whole blocks per server, client-side Dijkstra chains.

Source: A. Borzunov et al., "Petals: Collaborative Inference and Fine-tuning of
Large Models", ACL 2023 (demo track); code: github.com/bigscience-workshop/petals
(read at commit 22afba6: ``server/block_selection.py``, ``server/server.py``,
``server/throughput.py``, ``client/routing/sequence_manager.py``). Rules taken
from the code, re-implemented here:

- Block count: floor(usable GPU memory / bytes per block), at most L
  (``Server._choose_num_blocks``); a server that cannot hold one block does
  not join.
- Span choice: a joining server takes the window of its length whose sorted
  per-block swarm throughputs are lexicographically smallest
  (``_choose_best_start``), i.e. it covers the weakest-served blocks.
  Rebalancing as ``should_choose_other_blocks``: a server moves when
  re-placing everyone would raise the minimum block throughput so that
  old/new < balance_quality (0.75 in code).
- A server's announced throughput is min(forward_rps / ((blocks + 1) / 2),
  network_rps) (``get_server_throughput``).
- Min-latency routing (``_build_inference_graph``): Dijkstra from "start" to
  "end" over (server, block) nodes. Client -> first server and server ->
  server edges cost rtt/2 plus a fixed 18 ms serialisation overhead; the last
  server -> client edge costs rtt/2; a compute edge costs 1 / inference_rps
  of the server per block; a chain only switches servers at the end of a
  span. The client computes the chain once per inference session (request),
  so every token of a request uses the servers that hold its attention cache.

Choices where the source is silent or the setting differs:

- The client is the request's home server. A hop that stays on one server
  costs nothing (no rtt, no serialisation overhead): client and server are
  one machine here.
- rtt between m and n is delay[m][n] + delay[n][m] (what a ping measures;
  pings are small, so bandwidth does not enter, as in Petals).
- Bytes per block: the E FP16 experts of a layer; the dense part is held by
  every server and the attention cache comes out of the GPU share that
  ``MemoryBudget`` leaves for KV cache, so the cache-room penalty (alloc_delay)
  never applies. Per-block times are in the router's belief (``cost_model``):
  Petals measures them by running a block on the device
  (``server/throughput.py``, ``measure_compute_rps``), so by default it believes
  the world's compute model (``hardware``: one token through the block's
  dense part and k experts on the roofline). With ``cost_model: paper`` the
  formulas are those of the paper's model: forward_rps = F_n / (dense + k w_E) per block,
  network_rps = min(mean outgoing, mean incoming bandwidth) / d (a speed test
  to "the internet"), 1 / inference_rps = (dense + k w_E) / F_n per block,
  plus k v / beta_n for a CPU-resident block.
- Join order: server index order (a real swarm's order is arbitrary); then
  deterministic rebalancing rounds (servers in index order instead of Petals'
  random shuffle) until no server moves or ``max_rebalance_rounds``.
- Coverage: if the GPU spans leave blocks unserved (Petals would raise
  MissingBlocksError), each maximal unserved run becomes a CPU-resident span
  (Petals allows CPU servers with an explicit block count) on the server
  whose CPU budget holds most of it (then the lowest per-block inference
  time); a run no server holds whole is split.
  A server's GPU and CPU spans, when adjacent, form one span for routing.
- Fault handling: when a hop of the rest of the chain (including the return
  to the client) fails in the residing server's view, Dijkstra re-runs for
  the remaining blocks from where the hidden state is, without the failed
  servers and links (Petals bans the peer and reroutes); replaying the
  attention cache is not modelled.
- Backend note: the dense part of layer 0 runs at the home (the backend runs it
  where the token resides) rather than on the first chain server; hop count
  and bytes are unchanged.
"""

from __future__ import annotations

import heapq
from typing import Callable, Literal

from pydantic import Field

from ..deployment import ConstraintViolation, Deployment, Replica
from ..state import Assignment, Mode, StateView, TokenView, Unroutable
from ..system import FULL_PRECISION
from .base import Router, RouterParams


class PetalsParams(RouterParams):
    # Petals benchmarks its block on the device (server/throughput.py, measure_compute_rps),
    # so it plans with measured times: the world's compute model, not the paper's w/F.
    cost_model: Literal["paper", "hardware"] = "hardware"
    overhead_s: float = Field(0.018, ge=0, description="serialisation overhead per hop (code: 18 ms)")
    balance_quality: float = Field(0.75, gt=0, description="rebalance when old/new min throughput < this")
    max_rebalance_rounds: int = Field(20, ge=0)


def best_start(tput: list[float], length: int) -> int:
    """Petals' ``_choose_best_start``: the window with the lexicographically
    smallest sorted throughputs (ties: leftmost)."""
    return min((sorted(tput[i:i + length]), i) for i in range(len(tput) - length + 1))[1]


def swarm_throughput(spans: dict[int, tuple[int, int]], speed: dict[int, float], L: int) -> list[float]:
    tput = [0.0] * L
    for n in sorted(spans):
        a, b = spans[n]
        for i in range(a, b):
            tput[i] += speed[n]
    return tput


def should_move(me: int, spans: dict[int, tuple[int, int]], speed: dict[int, float], L: int,
                quality: float) -> bool:
    """Petals' ``should_choose_other_blocks``, with servers visited in index order."""
    eps = 1e-3
    spans = dict(spans)
    tput = swarm_throughput(spans, speed, L)
    initial = min(tput)
    a, b = spans[me]
    for i in range(a, b):
        tput[i] -= speed[me] * (1 + eps)
    if initial > eps and min(tput) <= 0:
        return False  # moving would disconnect the swarm
    new = best_start(tput, b - a)
    if new == a:
        return False
    for i in range(a, b):
        tput[i] += speed[me] * eps
    spans[me] = (new, new + b - a)
    for i in range(new, new + b - a):
        tput[i] += speed[me]
    moved, passes = True, 0
    while moved and passes < 100:  # Petals loops until stable; bounded here
        moved, passes = False, passes + 1
        for n in sorted(spans):
            a, b = spans[n]
            for i in range(a, b):
                tput[i] -= speed[n] * (1 + eps)
            s = best_start(tput, b - a)
            for i in range(a, b):
                tput[i] += speed[n] * eps
            if s != a:
                spans[n] = (s, s + b - a)
                moved = True
            a, b = spans[n]
            for i in range(a, b):
                tput[i] += speed[n]
    final = min(tput)
    if final < initial or final < eps:
        return False
    return initial / final < quality - eps


class Petals(Router):
    """Petals: block spans by swarm balancing; per-request Dijkstra chains."""

    name = "petals"
    memory_note = ("spans fill each server's GPU budget by Petals' block-count rule, "
                   "not by the 2x replica rule")
    Params = PetalsParams
    params: PetalsParams

    # -- cost terms ------------------------------------------------------------
    def _block_time(self, n: int, gpu: bool) -> float:
        """1 / inference_rps: one token through one block on server n, in the router's
        belief (``cost_model``; by default the world's compute model, as Petals measures it)."""
        svc, k = self.service, self.problem.shape.top_k
        t = svc.dense_s(n, 1) + k * svc.expert_s(n, FULL_PRECISION, 1)
        return t if gpu else t + k * svc.load_s(n, FULL_PRECISION)

    def _net(self, m: int, n: int) -> float:
        """rtt/2 between m and n, 0 on one machine."""
        d = self.problem.cluster.delay
        return 0.0 if m == n else min((d[m][n] + d[n][m]) / 2, 5.0)

    # -- offline ---------------------------------------------------------------
    def spans(self) -> tuple[dict[int, tuple[int, int]], list[tuple[int, int, int]]]:
        """(GPU span [start, end) per joined server, CPU spans (server, start, end))."""
        pr = self.problem
        cl, sh, bud = pr.cluster, pr.shape, pr.budget
        N, L = cl.n, sh.n_layers
        block = sh.experts_per_layer * float(sh.expert_bytes[FULL_PRECISION])
        gpu: dict[int, tuple[int, int]] = {}
        speed: dict[int, float] = {}
        for n in range(N):  # join in index order
            count = min(L, int(bud.gpu[n] // block))
            if count < 1:
                continue
            out = sum(cl.bandwidth[n][m] for m in range(N) if m != n) / max(1, N - 1)
            inc = sum(cl.bandwidth[m][n] for m in range(N) if m != n) / max(1, N - 1)
            forward = 1.0 / self._block_time(n, True) / ((count + 1) / 2)
            speed[n] = min(forward, min(out, inc) / sh.hidden_bytes) if N > 1 else forward
            start = best_start(swarm_throughput(gpu, speed, L), count)
            gpu[n] = (start, start + count)
        for _ in range(self.params.max_rebalance_rounds):
            moved = False
            for n in sorted(gpu):
                if should_move(n, gpu, speed, L, self.params.balance_quality):
                    others = {m: s for m, s in gpu.items() if m != n}
                    a, b = gpu[n]
                    start = best_start(swarm_throughput(others, speed, L), b - a)
                    if start != a:
                        gpu[n] = (start, start + b - a)
                        moved = True
            if not moved:
                break
        cpu: list[tuple[int, int, int]] = []  # (server, start, end)
        cpu_left = [int(bud.cpu[n] // block) for n in range(N)]
        served = [False] * L
        for a, b in gpu.values():
            served[a:b] = [True] * (b - a)
        i = 0
        while i < L:
            if served[i]:
                i += 1
                continue
            j = i
            while j < L and not served[j]:
                j += 1
            # an unserved run overlaps no span; take the server holding the longest
            # prefix of it, then the fastest
            options = [(-min(j - i, cpu_left[n]), self._block_time(n, False), n)
                       for n in range(N) if cpu_left[n] > 0]
            if not options:
                raise ConstraintViolation(f"petals: no server can hold block {i} (c.4)")
            neg, _, n = min(options)
            fits = -neg
            cpu.append((n, i, i + fits))
            cpu_left[n] -= fits
            served[i:i + fits] = [True] * fits
            i += fits
        return gpu, cpu

    def place(self) -> Deployment:
        sh, N = self.problem.shape, self.problem.cluster.n
        E = sh.experts_per_layer
        gpu, cpu = self.spans()
        spans = [(n, a, b, True) for n, (a, b) in sorted(gpu.items())]
        spans += [(n, a, b, False) for n, a, b in cpu]
        reps = [Replica(l * E + j, n, FULL_PRECISION, tier)
                for n, a, b, tier in spans for l in range(a, b) for j in range(E)]
        self.placement_report = {"gpu_spans": {str(n): [a, b] for n, (a, b) in sorted(gpu.items())},
                                 "cpu_spans": [list(s) for s in cpu]}
        return Deployment(tuple(reps), sh.n_experts, N)

    # -- online ----------------------------------------------------------------
    def bind(self, deployment: Deployment) -> None:
        super().bind(deployment)
        sh, N = self.problem.shape, self.problem.cluster.n
        L, E = sh.n_layers, sh.experts_per_layer
        #: block_gpu[n][l]: block l is on n (all its experts); True if GPU-resident.
        self.block_gpu: list[dict[int, bool]] = [dict() for _ in range(N)]
        for l in range(L):
            for n in range(N):
                reps = [deployment.replica_of(l * E + j, n) for j in range(E)]
                if all(r is not None for r in reps):
                    self.block_gpu[n][l] = all(deployment.replicas[r].gpu for r in reps)
        #: span_end[n][l]: end of the contiguous run of blocks on n that contains l.
        self.span_end: list[dict[int, int]] = []
        for n in range(N):
            ends: dict[int, int] = {}
            for l in sorted(self.block_gpu[n], reverse=True):
                ends[l] = ends.get(l + 1, l + 1)
            self.span_end.append(ends)
        self.compute = [{l: self._block_time(n, g) for l, g in self.block_gpu[n].items()}
                        for n in range(N)]
        self.chains: dict[int, tuple[int, ...]] = {}

    def decider(self, server: int) -> "Petals":
        d = self.clone()
        d.chains = {}  # sessions this client opened
        return d

    def chain(self, client: int, start: int = 0, reach: Callable[[int, int], bool] | None = None,
              origin: int | None = None) -> tuple[int, ...]:
        """Servers for blocks start..L-1 by Dijkstra (Petals' min-latency route).

        Node (n, l): the hidden state is on server n before block l. ``origin``
        (default: the client) holds the input; ``client`` receives the output.
        ``reach(m, n)``: whether a message m -> n gets through (default: always);
        edges that fail it are left out, as Petals bans failed peers."""
        L, N = self.problem.shape.n_layers, self.problem.cluster.n
        origin = client if origin is None else origin
        ov = self.params.overhead_s
        ok = reach or (lambda m, n: True)
        hosts = [[n for n in range(N) if l in self.block_gpu[n]] for l in range(L)]

        def edges(node):
            if node == "start":
                return [((n, start), self._net(origin, n) + (ov if n != origin else 0.0))
                        for n in hosts[start] if ok(origin, n)]
            n, l = node
            if l == L:
                return [("end", self._net(n, client))] if ok(n, client) else []
            out = [((n, l + 1), self.compute[n][l])] if l in self.block_gpu[n] else []
            if l > start and self.span_end[n].get(l - 1) == l:  # n's span ends here: switch
                out += [((m, l), self._net(n, m) + ov) for m in hosts[l] if m != n and ok(n, m)]
            return out

        dist: dict = {"start": 0.0}
        prev: dict = {}
        heap: list = [(0.0, 0, "start")]
        seq = 0
        while heap:
            d, _, node = heapq.heappop(heap)
            if node == "end":
                break
            if d > dist[node]:
                continue
            for nxt, w in edges(node):
                nd = d + w
                if nd < dist.get(nxt, float("inf")):
                    dist[nxt], prev[nxt] = nd, node
                    seq += 1
                    heapq.heappush(heap, (nd, seq, nxt))
        if "end" not in prev:
            raise Unroutable(f"petals: no chain of live servers covers blocks {start}..{L - 1}")
        path = ["end"]
        while path[-1] != "start":
            path.append(prev[path[-1]])
        out = [-1] * (L - start)
        for a, b in zip(path[2:], path[1:]):  # compute edges (n, l) -> (n, l + 1)
            if a != "start" and b != "end" and a[0] == b[0] and b[1] == a[1] + 1:
                out[a[1] - start] = a[0]
        return tuple(out)

    def route(self, tok: TokenView, targets: tuple[int, ...], view: StateView) -> Assignment:
        layer, theta = tok.layer, tok.server
        reach = None if view.faultless else view.reachable
        if tok.ctx is None:  # first layer, at the client: open the session's chain
            chain = self.chains.get(tok.request)
            if chain is None:
                chain = self.chains[tok.request] = self.chain(tok.home, reach=reach)
            tok.ctx = chain
        rest = tok.ctx[layer:]
        if reach is not None and not (reach(theta, rest[0]) and reach(rest[-1], tok.home) and all(
                reach(a, b) for a, b in zip(rest, rest[1:]) if a != b)):
            # ban what failed and re-route the remaining blocks from here
            tok.ctx = tok.ctx[:layer] + self.chain(tok.home, layer, reach, origin=theta)
        s = tok.ctx[layer]
        nxt = tok.ctx[layer + 1] if layer + 1 < len(tok.ctx) else s
        dep = self.deployment
        reps = tuple(dep.replica_of(e, s) for e in targets)
        return Assignment(targets=tuple(targets), replicas=reps, modes=(Mode.EXACT,) * len(reps),
                          next_server=nxt)

    def on_request_done(self, request: int) -> None:
        self.chains.pop(request, None)
