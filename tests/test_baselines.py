"""The behaviour that defines each baseline, the ablations, and the example router's command."""

from __future__ import annotations

import dataclasses
import itertools
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from hetroute.deployment import Deployment, MemoryBudget, Replica
from hetroute.placement.calibration import CalibrationTraffic
from hetroute.quality import prior_quality
from hetroute.routers import Problem, get_router
from hetroute.routers.edgeshard import EdgeShard
from hetroute.routers.moe_infinity import MoEInfinity, _Collection
from hetroute.routers.petals import Petals
from hetroute.routers.prism import Prism
from hetroute.state import StateView, TokenView
from hetroute.system import FULL_PRECISION, Cluster, Precision
from testbed.records import RecordWriter, flat
from testbed.setup import build_setup
from testbed.spec import SpecError
from testbed.sim.backend import SimBackend

from . import factories as F
from .test_router_conformance import simulate, spec_for

ROOT = Path(__file__).resolve().parents[1]
INF = float("inf")
PAPER = {"cost_model": "paper"}  # hand-computed brute forces use the paper's w/F times


def setup_of(router: str, topology: str = "paper10", model: str = "mixtral-8x7b", params=None,
             **workload):
    # decisions cost no time here: these tests compare routing, and two routers'
    # calibrated decision times would shift their timelines apart
    spec = spec_for(router, topology, model, **workload).with_overrides({"engine.decision_s": 0.0})
    if params:
        spec = spec.with_overrides({f"router.params.{k}": v for k, v in params.items()})
    return build_setup(spec)


def tiny_problem(flops, gpu, cpu, delay, homes, targets, n_layers, experts, top_k=1,
                 bandwidth=1e9, d_model=1024) -> Problem:
    """A hand-built instance: ``delay[m][n]`` in seconds, budgets in bytes."""
    N = len(flops)
    sh = F.shape(n_layers=n_layers, experts=experts, top_k=top_k, d_model=d_model)
    cl = Cluster(names=tuple(f"s{i}" for i in range(N)), flops=tuple(flops),
                 pcie=(1e10,) * N, gpu_bytes=(1e11,) * N, cpu_bytes=(1e12,) * N,
                 bandwidth=tuple(tuple(INF if m == n else bandwidth for n in range(N))
                                 for m in range(N)),
                 delay=tuple(tuple(delay[m][n] for n in range(N)) for m in range(N)))
    calib = CalibrationTraffic(homes=np.asarray(homes), targets=np.asarray(targets))
    return Problem(cluster=cl, shape=sh, quality=prior_quality(sh), budget=MemoryBudget(
        gpu=tuple(gpu), cpu=tuple(cpu)), lam_max=0.02, calibration=calib)


# -- MoE-Infinity ----------------------------------------------------------------
def test_moe_infinity_serves_every_token_at_home_with_a_bounded_cache():
    s = setup_of("moe-infinity", prompt_tokens=8)
    run = dataclasses.replace(s, router=MoEInfinity(s.problem, s.router.params))
    run.router.bind(s.deployment)
    writer = RecordWriter(None, s.shape.top_k)
    backend = SimBackend(run, writer)
    backend.run()
    writer.close()
    tl, rq = writer.frames()
    home = tl.request.map(rq.set_index("request").home)
    assert tl["bytes"].sum() == 0
    assert (tl.server == home).all() and (tl.next_server == home).all()
    assert (flat(tl.exec_server) == home.to_numpy()[:, None]).all()
    gpu = flat(tl.gpu)
    assert gpu.any() and not gpu.all()  # a real cache: hits and misses
    for n, d in enumerate(backend.deciders):
        assert d.resident.sum() <= d.cap == int(s.problem.budget.gpu[n] // s.shape.expert_bytes[0])
        assert not d.requests  # per-request state went with on_request_done


def test_moe_infinity_prefetching_cuts_cpu_offload():
    def offload(prefetch: bool) -> float:
        tl, _ = simulate(setup_of("moe-infinity", params={"prefetch": prefetch}, prompt_tokens=8))
        return 1 - flat(tl.gpu).mean()
    assert offload(True) < offload(False)


def test_moe_infinity_rejects_a_server_whose_cpu_cannot_hold_the_model():
    spec = spec_for("moe-infinity", "small3", "mixtral-8x7b").with_overrides(
        {"memory.cpu_share": 0.1})
    with pytest.raises(SpecError, match="moe-infinity cannot place this model here: .*server edge"):
        build_setup(spec)


def test_eamc_fills_empty_slots_then_replaces_least_accessed_non_persistent():
    c = _Collection(capacity=3, L=2, E=2)
    eam = np.ones((2, 2))
    assert c.add(eam) == 0
    c.persistent = 1
    assert (c.add(2 * eam), c.add(3 * eam)) == (1, 2)
    c.access[:] = [0, 5, 2]  # slot 0 is persistent although least accessed
    assert c.add(4 * eam) == 2 and c.access[2] == 1 and (c.raw[2] == 4).all()
    np.testing.assert_allclose(np.linalg.norm(c.unit[2], axis=1), 1.0)


def test_moe_infinity_prefetches_the_most_similar_trace_by_layer_decayed_counts():
    # 3 layers x 4 experts, one server whose cache holds 2 experts.
    v = F.shape(n_layers=3, experts=4).expert_bytes[Precision.FP16]
    p = tiny_problem([1e12], [2.5 * v], [1e12], [[0.0]], homes=[0], targets=[[[0], [4], [8]]],
                     n_layers=3, experts=4)
    r = MoEInfinity(p, {"warm_tokens_per_eam": 0, "max_inflight_prefetch": 3})
    r.bind(r.place())
    d = r.decider(0)
    # two stored traces: A starts with expert 0 and then favours 5, 6, 10; B starts with 1
    a = np.array([[4, 0, 0, 0], [0, 3, 1, 0], [0, 0, 2, 0]], float)
    b = np.array([[0, 4, 0, 0], [0, 0, 0, 4], [0, 0, 0, 4]], float)
    d.eamc.add(a)
    d.eamc.add(b)
    d.resident[:] = False
    tok = TokenView(request=7, index=0, home=0, lam_max=0.02)
    out = d.route(tok, (0,), StateView(1))
    rep = r.rep_of[0]
    # most similar to A; layer 0's 0 is the target itself; then 5 (3 x 1), 10 (2 x 2/4 decay) ...
    # scores: (1,5): 3 * (1 - 1/4) = 2.25, (2,10): 2 * (1 - 2/4) = 1.0, (1,6): 1 * 0.75
    assert out.prefetch == (rep[5], rep[10], rep[6])
    assert d.eamc.access[0] == 2 and d.eamc.access[1] == 1


def test_moe_infinity_cache_evicts_by_priority_and_protects_prefetched_experts():
    v = F.shape(n_layers=3, experts=4).expert_bytes[Precision.FP16]
    p = tiny_problem([1e12], [2.5 * v], [1e12], [[0.0]], homes=[0], targets=[[[0], [4], [8]]],
                     n_layers=3, experts=4)
    r = MoEInfinity(p, {"warm_tokens_per_eam": 0})
    r.bind(r.place())
    d, rep = r.decider(0), r.rep_of[0]
    cache = d.residency(0)  # the backend inserts and evicts through the residency strategy

    def cached():
        return set(np.flatnonzero(d.resident).tolist())

    assert cached() == {0, 4}  # warm start: the most popular experts
    d.eamc.add(np.array([[4, 0, 0, 0], [0, 3, 1, 0], [0, 0, 2, 0]], float))
    d.route(TokenView(request=7, index=0, home=0, lam_max=0.02), (0,), StateView(1))
    assert d.inflight == {5, 6, 10}
    cache.on_execute(rep[0], False)  # a hit: expert 0 now has a visit
    cache.on_prefetched(rep[5])  # 4 (never visited) goes, 5 arrives protected
    assert cached() == {0, 5} and d.fresh[5]
    cache.on_execute(rep[8], True)  # a miss: 0 goes although 5 has no visit yet
    assert cached() == {5, 8}
    d.on_request_done(7)  # 5's protection ends with its request
    cache.on_execute(rep[9], True)
    assert cached() == {8, 9}


# -- EdgeShard -------------------------------------------------------------------
def test_edgeshard_runs_each_layer_with_all_its_experts_on_one_server():
    s = setup_of("edgeshard", prompt_tokens=8)
    pipeline = s.router.placement_report["pipeline"]
    E = s.shape.experts_per_layer
    for r in s.deployment.replicas:
        assert r.server == pipeline[r.expert // E]
    assert len(s.deployment.replicas) == s.shape.n_experts
    assert len(set(pipeline)) > 1  # Mixtral does not fit one server here
    tl, rq = simulate(s)
    expect = np.array(pipeline)[tl.layer.to_numpy()]
    assert (flat(tl.exec_server) == expect[:, None]).all() and (tl.participants == 1).all()
    later = tl[tl.layer > 0]
    assert (later.server.to_numpy() == np.array(pipeline)[later.layer.to_numpy()]).all()
    src = s.router.source()
    assert pipeline[0] == src == np.bincount(s.problem.calibration.homes).argmax()


def _es_problem(gpu_layers=None):
    flops = [2e11, 4e12, 1e12, 3e12]
    delay = [[0, 0.004, 0.001, 0.009], [0.004, 0, 0.002, 0.003],
             [0.001, 0.002, 0, 0.006], [0.009, 0.003, 0.006, 0]]
    sh = F.shape(n_layers=5, experts=4, d_model=4096)
    layer = 4 * sh.expert_bytes[Precision.FP16]
    gpu = [10 * layer] * 4 if gpu_layers is None else [g * layer for g in gpu_layers]
    return tiny_problem(flops, gpu, [10 * layer] * 4, delay, homes=[0, 0, 1],
                        targets=[[[0], [4], [8], [12], [16]]] * 3, n_layers=5, experts=4,
                        d_model=4096, bandwidth=5e8), layer


def test_edgeshard_latency_dp_matches_brute_force():
    p, _ = _es_problem()
    r = EdgeShard(p, PAPER)
    servers, tiers, total = r.pipeline()
    sh, cl = p.shape, p.cluster
    N, L = cl.n, sh.n_layers
    comp = [(sh.dense_flops + sh.top_k * sh.expert_flops) / f for f in cl.flops]

    def comm(a, b):
        return 0.0 if a == b else sh.hidden_bytes / cl.bandwidth[a][b] + cl.delay[a][b]

    best = min((sum(comp[j] for j in path) + sum(comm(a, b) for a, b in zip(path, path[1:]))
                + comm(path[-1], 0), path)
               for path in ((0,) + rest for rest in itertools.product(range(N), repeat=L - 1)))
    assert servers[0] == 0 and all(tiers)
    assert total == pytest.approx(best[0]) and tuple(servers) == best[1]
    assert len(set(servers)) > 1  # the instance is not trivial


def test_edgeshard_tracks_memory_gpu_first():
    p, layer = _es_problem(gpu_layers=[1, 2, 0, 0])
    r = EdgeShard(p, PAPER)
    dep = r.place()
    dep.check(p.shape, p.budget)
    servers, tiers, _ = r.pipeline()
    for n in range(p.cluster.n):
        assert sum(t for s, t in zip(servers, tiers) if s == n) <= [1, 2, 0, 0][n]
    assert not all(tiers)  # 5 layers, GPU room for 3


def _tp_brute_force(p, gpu_rooms, cpu_rooms):
    """Smallest bottleneck over every chain of distinct servers from server 0."""
    sh, cl = p.shape, p.cluster
    N, L = cl.n, sh.n_layers
    gpu_t = [(sh.dense_flops + sh.top_k * sh.expert_flops) / f for f in cl.flops]
    load = sh.top_k * sh.expert_bytes[Precision.FP16] / cl.pcie[0]

    def stage(j, n):
        if n > gpu_rooms[j] + cpu_rooms[j]:
            return INF
        g = min(n, gpu_rooms[j])
        return g * gpu_t[j] + (n - g) * (gpu_t[j] + load)

    def xfer(a, b):
        return 0.0 if a == b else sh.hidden_bytes / cl.bandwidth[a][b]

    best = INF
    for m in range(1, N + 1):
        for rest in itertools.permutations(range(1, N), m - 1):
            chain = (0,) + rest
            for cuts in itertools.combinations(range(1, L), m - 1):
                sizes = [b - a for a, b in zip((0,) + cuts, cuts + (L,))]
                worst = max([stage(j, n) for j, n in zip(chain, sizes)]
                            + [xfer(a, b) for a, b in zip(chain, chain[1:])] + [xfer(chain[-1], 0)])
                best = min(best, worst)
    return best


@pytest.mark.parametrize("gpu_layers", [None, [1, 2, 0, 1], [2, 1, 1, 0]])
def test_edgeshard_throughput_dp_matches_brute_force(gpu_layers):
    p, _ = _es_problem(gpu_layers=gpu_layers)
    rooms = gpu_layers or [10] * 4
    r = get_router("edgeshard-tp")(p, PAPER)
    servers, tiers, bottleneck = r.pipeline()
    assert bottleneck == pytest.approx(_tp_brute_force(p, rooms, [10] * 4))
    assert servers[0] == 0 and len(servers) == p.shape.n_layers
    runs = [s for i, s in enumerate(servers) if i == 0 or servers[i - 1] != s]
    assert len(runs) == len(set(runs))  # each server holds one contiguous stage
    for n in range(p.cluster.n):
        assert sum(t for s, t in zip(servers, tiers) if s == n) <= rooms[n]
    dep = r.place()
    dep.check(p.shape, p.budget)
    assert r.placement_report["planned_tokens_per_s"] == pytest.approx(1 / bottleneck)


def test_edgeshard_throughput_variant_has_no_slower_bottleneck_than_latency_variant():
    p, _ = _es_problem()
    lat, _, _ = EdgeShard(p, PAPER).pipeline()
    tp = get_router("edgeshard-tp")(p, PAPER)
    _, _, bottleneck = tp.pipeline()
    sh, cl = p.shape, p.cluster
    per_layer = [(sh.dense_flops + sh.top_k * sh.expert_flops) / f for f in cl.flops]
    lat_stage = max(lat.count(j) * per_layer[j] for j in set(lat))
    assert bottleneck <= lat_stage + 1e-15
    assert bottleneck < per_layer[0] * p.shape.n_layers  # better than the source alone


# -- Petals ------------------------------------------------------------------------
def _petals_instance(spans, delay=None, overhead_s=0.018):
    """Petals bound to a hand-made deployment: spans[n] = list of (start, end, gpu)."""
    L, E, N = 6, 2, len(spans)
    delay = delay or [[0, 0.010, 0.030, 0.004], [0.012, 0, 0.002, 0.020],
                      [0.030, 0.003, 0, 0.006], [0.004, 0.018, 0.005, 0]]
    p = tiny_problem([2e12, 8e12, 1e12, 4e12][:N], [1e12] * N, [1e12] * N, delay,
                     homes=[0], targets=[[[2 * l] for l in range(L)]], n_layers=L, experts=E,
                     d_model=2048)
    reps = [Replica(l * E + j, n, FULL_PRECISION, gpu)
            for n, ss in enumerate(spans) for a, b, gpu in ss for l in range(a, b) for j in range(E)]
    r = Petals(p, {"overhead_s": overhead_s})
    r.bind(Deployment(tuple(reps), L * E, N))
    return r


def _random_petals(seed: int) -> Petals:
    """4 servers, 6 blocks: random spans (some CPU-resident), delays and overhead."""
    rng = np.random.default_rng(seed)
    spans = []
    for n in range(4):
        a = int(rng.integers(0, 5))
        b = int(rng.integers(a + 1, 7))
        spans.append([(a, b, bool(rng.random() < 0.7))])
        if b < 5 and rng.random() < 0.5:
            spans[-1].append((b + 1, 6, True))
    covered = {l for ss in spans for a, b, _ in ss for l in range(a, b)}
    if len(covered) < 6:  # the slowest server also keeps every missing block in CPU memory
        spans[2] += [(l, l + 1, False) for l in range(6) if l not in covered]
    d = rng.uniform(0.0005, 0.02, (4, 4))
    return _petals_instance(spans, [[0.0 if m == n else float(d[m, n]) for n in range(4)]
                                    for m in range(4)], float(rng.choice([0.0, 0.002, 0.018])))


def _brute_force_chain(r: Petals, client: int) -> float:
    """Cheapest valid chain by enumerating every one: a block runs on a server
    that holds it, and a chain changes server only where that server's run of
    blocks ends. Costs are Petals' edges, written out again in ``_chain_cost``."""
    L, N = r.problem.shape.n_layers, r.problem.cluster.n
    host = [[l in r.block_gpu[n] for l in range(L)] for n in range(N)]

    def chains(prefix):
        l = len(prefix)
        if l == L:
            yield prefix
            return
        if prefix and host[prefix[-1]][l]:
            yield from chains(prefix + (prefix[-1],))
            return
        for n in range(N):
            if host[n][l] and (not prefix or n != prefix[-1]):
                yield from chains(prefix + (n,))

    return min(_chain_cost(r, client, c) for c in chains(()))


def _chain_cost(r: Petals, client: int, chain) -> float:
    p = r.problem
    d, ov = p.cluster.delay, r.params.overhead_s

    def net(m, n):
        return 0.0 if m == n else (d[m][n] + d[n][m]) / 2
    return (net(client, chain[0]) + (ov if chain[0] != client else 0.0)
            + sum(r.compute[n][l] for l, n in enumerate(chain))
            + sum(net(a, b) + ov for a, b in zip(chain, chain[1:]) if a != b)
            + net(chain[-1], client))


def test_petals_chain_is_a_shortest_path_under_its_cost():
    chains = set()
    for seed in range(30):
        r = _random_petals(seed)
        for client in range(r.problem.cluster.n):
            chain = r.chain(client)
            assert all(l in r.block_gpu[n] for l, n in enumerate(chain))
            assert _chain_cost(r, client, chain) == pytest.approx(_brute_force_chain(r, client))
            chains.add((seed, chain))
    assert len(chains) > 40  # chains depend on the instance and the client


def test_petals_run_keeps_one_chain_per_request_and_whole_layers():
    s = setup_of("petals", prompt_tokens=8)
    spans = s.router.placement_report["gpu_spans"]
    assert spans and not s.router.placement_report["cpu_spans"]
    tl, rq = simulate(s)
    assert (tl.participants == 1).all()
    ex = flat(tl.exec_server)[:, 0]
    per_layer = pd.DataFrame({"request": tl.request, "layer": tl.layer, "server": ex})
    assert (per_layer.groupby(["request", "layer"]).server.nunique() == 1).all()
    for req, g in per_layer.groupby("request"):
        home = int(rq.loc[rq.request == req, "home"].iloc[0])
        chain = s.router.chain(home)
        assert (g.server.to_numpy() == np.array(chain)[g.layer.to_numpy()]).all()


def test_petals_reroutes_around_a_cut_link():
    spec = spec_for("petals", "paper10", "mixtral-8x7b", duration_s=0.8, prompt_tokens=8)
    cut = spec.with_overrides({"faults": [{"kind": "cut_link", "at_s": 0.3, "server": "s2",
                                           "peer": "s1"}]})
    tl, _ = simulate(build_setup(spec))
    hops = set(zip(tl.server, tl.next_server))
    assert (1, 2) in hops or (2, 1) in hops  # the chains use that link
    tl, rq = simulate(build_setup(cut))
    assert (rq.status == "ok").all()
    late = tl[tl.t_start > 0.3 + 2 * spec.window_s]
    assert not ({(1, 2), (2, 1)} & set(zip(late.server, late.next_server)))


def test_petals_covers_missing_blocks_from_cpu_memory():
    s = setup_of("petals", topology="small3")  # the GPUs hold 24 of Mixtral's 32 blocks
    rep = s.router.placement_report
    gpu_blocks = sum(b - a for a, b in rep["gpu_spans"].values())
    assert gpu_blocks < s.shape.n_layers and rep["cpu_spans"]
    assert any(not r.gpu for r in s.deployment.replicas)


# -- Prism -------------------------------------------------------------------------
def test_prism_keeps_each_servers_most_activated_experts_on_it():
    # 3 homes, 2 layers x 4 experts, top-1; home n mostly activates expert n at layer 0
    # and expert 4 + (n + 1) % 4 at layer 1; globally expert 0 is the most popular.
    homes, targets = [], []
    for n, count in ((0, 12), (1, 8), (2, 6)):
        for i in range(count):
            main = i % 4 != 3
            homes.append(n)
            targets.append([[n if main else 3], [4 + (n + 1) % 4 if main else 7]])
    v = F.shape(n_layers=2, experts=4).expert_bytes[Precision.FP16]
    p = tiny_problem([1e12] * 3, [3 * v] * 3, [0.0] * 3, [[0, 1e-3, 2e-3], [1e-3, 0, 1e-3],
                                                          [2e-3, 1e-3, 0]],
                     homes=homes, targets=targets, n_layers=2, experts=4)
    r = Prism(p, {"memory_ratio": 1.125})  # 9 slots for 8 experts
    dep = r.place()
    dep.check(p.shape, p.budget)
    for n in range(3):
        assert dep.replica_of(n, n) is not None, f"server {n} lacks its top layer-0 expert"
        assert dep.replica_of(4 + (n + 1) % 4, n) is not None
    assert all(dep.by_expert[e] for e in range(8))


def test_prism_placement_beats_random_on_its_objective_and_routes_local_first():
    s = setup_of("prism", prompt_tokens=8)
    p, dep = s.problem, s.deployment
    N, n_exp, E = p.cluster.n, p.shape.n_experts, p.shape.experts_per_layer
    f = p.calibration.per_home_popularity(N, n_exp)
    hosted = np.zeros((N, n_exp), bool)
    for r in dep.replicas:
        hosted[r.server, r.expert] = True
    objective = (f * ~hosted).sum()
    rng = np.random.default_rng(0)
    counts = [[int(hosted[n, l * E:(l + 1) * E].sum()) for l in range(p.shape.n_layers)]
              for n in range(N)]
    for _ in range(20):  # same slots per server and layer, experts at random
        rnd = np.zeros_like(hosted)
        for n in range(N):
            for l, c in enumerate(counts[n]):
                rnd[n, l * E + rng.choice(E, size=c, replace=False)] = True
        assert objective < (f * ~rnd).sum()
    tl, _ = simulate(s)
    lat = s.router.latency
    for theta, tgt, srv in zip(tl.server, flat(tl.target), flat(tl.exec_server)):
        for e, n in zip(tgt, srv):
            hosts = [dep.replicas[r].server for r in dep.by_expert[e]]
            expect = theta if theta in hosts else min(hosts, key=lambda m: (lat[theta][m], m))
            assert n == expect
    assert (tl.next_server == tl.server).all()


def test_prism_majority_residing_follows_most_targets():
    tl, _ = simulate(setup_of("prism", params={"residing": "majority"}))
    for theta, srv, nxt in zip(tl.server, flat(tl.exec_server), tl.next_server):
        counts = {n: list(srv).count(n) for n in srv}
        assert counts[nxt] == max(counts.values())
        assert nxt == theta or theta not in counts or counts[theta] < counts[nxt]
    assert (tl.next_server != tl.server).any()


# -- Greedy --------------------------------------------------------------------------
@pytest.mark.parametrize("topology, model", [("small3", "switch-base-8"),
                                             ("paper10", "switch-base-8"),
                                             ({"servers": 1}, "mixtral-8x7b")])
def test_greedy_equals_hetroute_when_one_server_takes_part(topology, model):
    runs = []
    for name in ("greedy", "hetroute"):
        s = setup_of(name, topology, model, prompt_tokens=8)
        runs.append((s.deployment, *simulate(s)))
    assert runs[0][0] == runs[1][0]
    assert (runs[0][1].participants == 1).all()
    pd.testing.assert_frame_equal(runs[0][1], runs[1][1])
    pd.testing.assert_frame_equal(runs[0][2], runs[1][2])


def test_greedy_shares_hetroute_placement_but_routes_differently_when_servers_interact():
    g, h = setup_of("greedy", prompt_tokens=8), setup_of("hetroute", prompt_tokens=8)
    assert g.deployment == h.deployment
    tg, th = simulate(g)[0], simulate(h)[0]
    assert not np.array_equal(flat(tg.replica), flat(th.replica))


def test_greedy_without_set_level_placement_is_the_no_setlevel_ablation():
    g = setup_of("greedy", "small3", params={"set_level": False}, prompt_tokens=8)
    a = setup_of("hetroute-no-setlevel", "small3", prompt_tokens=8)
    assert g.deployment == a.deployment
    pd.testing.assert_frame_equal(simulate(g)[0], simulate(a)[0])


# -- Ablations -------------------------------------------------------------------------
def test_ablations_change_what_they_name():
    h = setup_of("hetroute", "small3")
    nq = setup_of("hetroute-no-quality", "small3")
    nr = setup_of("hetroute-no-replication", "small3")
    nres = setup_of("hetroute-no-residency", "small3")
    assert any(r.precision != FULL_PRECISION for r in h.deployment.replicas)
    assert all(r.precision == FULL_PRECISION for r in nq.deployment.replicas)
    assert max(len(x) for x in h.deployment.by_expert) > 1
    assert all(len(x) == 1 for x in nr.deployment.by_expert)
    assert {(r.expert, r.server) for r in nres.deployment.replicas if r.gpu} != \
        {(r.expert, r.server) for r in h.deployment.replicas if r.gpu}
    tl, _ = simulate(setup_of("hetroute-no-setlevel", "small3", prompt_tokens=8))
    assert tl.participants.max() <= 2


# -- The example router and its documented command ---------------------------------------
@pytest.mark.slow
def test_documented_example_matches_the_file_and_its_command_runs(tmp_path):
    doc = (ROOT / "docs" / "adding-a-router.md").read_text()
    source = (ROOT / "examples" / "nearest_replica.py").read_text()
    for block in re.findall(r"```python\n(.*?)```", doc, re.S):
        assert block in source, f"docs/adding-a-router.md is out of date:\n{block}"
    assert len(source.splitlines()) <= 60
    cmd = re.search(r"^python -m testbed run .*$", doc, re.M).group(0)
    args = shlex.split(cmd)[1:] + ["--quiet", "--out", str(tmp_path / "run")]
    r = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "examples.nearest_replica:NearestReplica" in r.stdout and "mean ms" in r.stdout
    assert (tmp_path / "run" / "metrics.json").exists()


def test_unknown_out_of_tree_router_is_a_one_line_error():
    with pytest.raises(KeyError, match="cannot load router"):
        get_router("examples.nearest_replica:Nope")
