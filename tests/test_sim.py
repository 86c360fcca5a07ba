"""The discrete-event backend on hand-built scenarios with hand-computed timings."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest

from hetroute.deployment import Deployment, Replica
from hetroute.routers.base import Router
from hetroute.state import Assignment, Mode
from hetroute.system import Cluster, Precision
from testbed.records import RecordWriter
from testbed.setup import build_setup
from testbed.sim.backend import SimBackend
from testbed.spec import parse_spec

from . import factories as F

INF = float("inf")


class Fixed(Router):
    """Sends target e to the replica chosen by ``choice[e]``; aggregates at ``agg``."""

    def __init__(self, choice: dict, agg: int | None = None):
        self.choice, self.agg, self.deployment = choice, agg, None
        self.params = None
        self.problem = None

    def place(self):  # pragma: no cover - not used
        raise NotImplementedError

    def route(self, tok, targets, view):
        reps = tuple(self.choice[e] for e in targets)
        agg = self.agg if self.agg is not None else self.deployment.replicas[reps[0]].server
        return Assignment(tuple(targets), reps, (Mode.EXACT,) * len(reps), agg)


@dataclass
class Req:
    id: int
    arrival_s: float
    home: int = 0
    user: int = 0
    prompt_tokens: int = 1
    gen_tokens: int = 0


@dataclass
class FakeSetup:
    cluster: Cluster
    shape: object
    deployment: Deployment
    router: Router
    requests: list
    targets: dict  # rid -> per token, per layer tuple
    spec: object = field(default_factory=lambda: parse_spec(
        {"window_s": 0.01, "sim": {"payload_efficiency": 1.0, "header_bytes": 0},
         "physics": "paper", "engine": {"decision_s": 0.0}}))
    decision_s: float = 0.0

    def request_targets(self, rid, n):
        return self.targets[rid]

    @property
    def quality(self):  # these tests run exact FP16 replicas: every increment is 0
        from hetroute.quality import prior_quality
        return prior_quality(self.shape)


def _cluster(B=1e9, delay=1e-3, flops=(1e12, 2e12), pcie=(1e10, 1e10)):
    return Cluster(names=("a", "b"), flops=flops, pcie=pcie, gpu_bytes=(1e10,) * 2,
                   cpu_bytes=(1e11,) * 2, bandwidth=((INF, B), (B, INF)),
                   delay=((0, delay), (delay, 0)))


def _run(setup):
    w = RecordWriter(None, setup.shape.top_k)
    setup.router.bind(setup.deployment)
    st = SimBackend(setup, w).run()
    w.close()
    tl, rq = w.frames()
    return st, tl, rq


def test_remote_layer_timing_is_fanout_compute_fanin():
    sh = F.shape(n_layers=1, experts=1, top_k=1, d_model=1000)  # hidden 2000 B
    cl = _cluster()
    dep = Deployment((Replica(0, 1, Precision.FP16, True),), 1, 2)
    setup = FakeSetup(cl, sh, dep, Fixed({0: 0}, agg=1), [Req(0, 0.0)], {0: [((0,),)]})
    st, tl, rq = _run(setup)
    dense = sh.dense_flops / 1e12
    tx = 2000 / 1e9 + 1e-3
    comp = sh.expert_flops / 2e12
    row = tl.iloc[0]
    assert row.fanout_s == pytest.approx(tx)
    assert row.compute_s == pytest.approx(comp)
    assert row.fanin_s == pytest.approx(0.0)  # aggregated where it ran
    # then the token returns home (server a): one more hop
    assert rq.latency_s[0] == pytest.approx(dense + tx + comp + tx)
    assert row["bytes"] == 4000  # fan-out + final hop home


def test_link_is_fifo():
    sh = F.shape(n_layers=1, experts=1, top_k=1, d_model=500_000)  # 1 MB hidden state
    cl = _cluster(B=1e9, delay=0.0)
    dep = Deployment((Replica(0, 1, Precision.FP16, True),), 1, 2)
    reqs = [Req(0, 0.0), Req(1, 0.0)]
    setup = FakeSetup(cl, sh, dep, Fixed({0: 0}, agg=1), reqs, {0: [((0,),)], 1: [((0,),)]})
    _, tl, _ = _run(setup)
    fo = sorted(tl.fanout_s)
    assert fo[0] == pytest.approx(1e-3) and fo[1] == pytest.approx(2e-3)  # second waits


def test_same_replica_jobs_coalesce_and_pay_one_load():
    sh = F.shape(n_layers=1, experts=1, top_k=1)
    cl = _cluster()
    dep = Deployment((Replica(0, 0, Precision.FP16, False),), 1, 2)  # CPU-resident, local
    reqs = [Req(i, 0.0) for i in range(3)]
    setup = FakeSetup(cl, sh, dep, Fixed({0: 0}, agg=0), reqs, {i: [((0,),)] for i in range(3)})
    st, tl, rq = _run(setup)
    load = sh.expert_bytes[Precision.FP16] / 1e10
    comp = sh.expert_flops / 1e12
    # first token starts alone (stream idle); the other two coalesce in the next batch
    assert st.batches == 2 and st.coalesced_jobs == 1
    lat = sorted(rq.latency_s)
    dense = sh.dense_flops / 1e12
    assert lat[0] == pytest.approx(dense + load + comp)
    assert lat[2] == pytest.approx(dense + 2 * (load + comp) + comp)
    assert not tl.gpu.apply(lambda g: g[0]).any()


def test_two_branches_fan_in_to_aggregator_and_records_are_complete():
    sh = F.shape(n_layers=2, experts=2, top_k=2, d_model=1000)
    cl = _cluster()
    reps = tuple(Replica(e, e % 2, Precision.FP16, True) for e in range(4))
    dep = Deployment(reps, 4, 2)
    route = {0: 0, 1: 1, 2: 2, 3: 3}
    setup = FakeSetup(cl, sh, dep, Fixed(route, agg=0), [Req(0, 0.0, prompt_tokens=2, gen_tokens=1)],
                      {0: [((0, 1), (2, 3))] * 3})
    st, tl, rq = _run(setup)
    assert len(tl) == 3 * 2 and st.token_layers == 6
    assert (tl.participants == 2).all()
    tx = 2000 / 1e9 + 1e-3
    assert tl.fanout_s.iloc[0] == pytest.approx(tx)
    assert tl.fanin_s.max() == pytest.approx(tx, rel=1e-6)
    assert rq.status[0] == "ok" and rq.tokens[0] == 3
    # the decode token starts after both prompt tokens finished
    first_decode = tl[tl.token == 2].t_start.min()
    assert first_decode >= tl[tl.token < 2].t_start.max()
    # the request's decode times: the prompt home before the decode token starts, which is
    # home at the request's end (aggregator 0 is the home: no final hop)
    end = (tl.t_start + tl.total_s).groupby(tl.token).max()
    assert rq.first_s[0] == pytest.approx(end[:2].max()) and rq.first_s[0] <= first_decode
    assert list(rq.gen_done_s[0]) == pytest.approx([end[2]]) and rq.done_s[0] == pytest.approx(end[2])


# -- the hardware world (issue 12) ----------------------------------------------------------
def _hw_setup(requests, targets, dep, route, agg):
    sh = F.shape(n_layers=1, experts=2, top_k=1, d_model=1000)
    cl = _cluster()
    spec = parse_spec({"window_s": 0.01, "sim": {"payload_efficiency": 1.0, "header_bytes": 0},
                       "physics": "hardware", "engine": {"decision_s": 0.0}})
    return FakeSetup(cl, sh, dep, Fixed(route, agg=agg), requests, targets, spec=spec), sh, cl


def test_step_dispatch_sends_a_steps_tokens_as_one_message_that_runs_as_one_step():
    """Three prompt tokens of one request on expert 0 at server b (``engine.dispatch: step``,
    the default): one dense step at home a, the three decided and sent together as one
    message (three hidden states' bytes, one arrival), one step at b reading the weights once."""
    from hetroute.service import HardwareService
    dep = Deployment((Replica(0, 1, Precision.FP16, True), Replica(1, 1, Precision.FP16, True)), 2, 2)
    setup, sh, cl = _hw_setup([Req(0, 0.0, prompt_tokens=3)], {0: [((0,),)] * 3}, dep, {0: 0}, agg=1)
    assert setup.spec.engine.dispatch == "step"
    st, tl, rq = _run(setup)
    hw = HardwareService(cl, sh)
    assert st.batches == 2
    assert tl.compute_s.tolist() == pytest.approx([hw.expert_s(1, Precision.FP16, 3)] * 3)
    assert tl.fanout_s.tolist() == pytest.approx([3 * 2000 / 1e9 + 1e-3] * 3)  # one arrival
    assert len(set(rq.done_s)) == 1
    # the same bytes as three messages would carry: the rule changes when, not what, is sent
    tok = dataclasses.replace(setup, spec=setup.spec.with_overrides({"engine.dispatch": "token"}))
    assert _run(tok)[1]["bytes"].tolist() == tl["bytes"].tolist()


def test_step_dispatch_moves_a_pipelines_prompt_as_one_micro_batch():
    """EdgeShard on paper10 at low load: under the step rule every token of a request starts
    every layer at the same instant and each layer is two steps (dense, experts) per request;
    under the per-token rule the first token runs ahead and the stages split the prompt."""
    from testbed.records import RecordWriter as W
    from testbed.setup import build_setup

    out = {}
    for rule in ("step", "token"):
        spec = parse_spec({"topology": "paper10", "router": {"name": "edgeshard"},
                           "engine": {"decision_s": 5e-6, "dispatch": rule},
                           "workload": {"rate_per_s": 2, "duration_s": 2, "warmup_s": 0, "gen_tokens": 0,
                                        "calibration_tokens": 64}})
        setup = build_setup(spec)
        w = W(None, setup.shape.top_k)
        st = SimBackend(setup, w).run()
        w.close()
        tl, rq = w.frames()
        spread = tl.groupby(["request", "layer"]).t_start.agg(lambda x: x.max() - x.min()).max()
        out[rule] = (st.batches, spread, len(rq), setup.shape.n_layers)
    steps, spread, n_req, L = out["step"]
    assert n_req >= 2 and spread == 0.0 and steps == n_req * L * 2
    assert out["token"][1] > 1e-3 and out["token"][0] > steps


def test_token_dispatch_runs_a_request_in_steps_that_read_each_expert_once():
    """The per-token rule (``engine.dispatch: token``): three prompt tokens of one request on
    expert 0 at server b, one dense step at home a for all three, then steps at b whose
    expert reads its weights once for the tokens that arrived by their start."""
    from hetroute.service import HardwareService
    dep = Deployment((Replica(0, 1, Precision.FP16, True), Replica(1, 1, Precision.FP16, True)), 2, 2)
    setup, sh, cl = _hw_setup([Req(0, 0.0, prompt_tokens=3)], {0: [((0,),)] * 3}, dep, {0: 0}, agg=1)
    setup.spec = setup.spec.with_overrides({"engine.dispatch": "token"})
    st, tl, rq = _run(setup)
    hw = HardwareService(cl, sh)
    fp16 = Precision.FP16
    dense = hw.dense_s(0, 3, 1 + 2 + 3, 3)  # positions 0..2 attend 1..3; the request's KV once
    assert tl.dense_s.tolist() == pytest.approx([dense] * 3)  # released together: one step
    # the sends to b are FIFO on the link (2 us each): the first token's step starts alone
    # and the two that arrive during it share the next one, reading the weights once
    assert st.batches == 3
    one, two = hw.expert_s(1, fp16, 1), hw.expert_s(1, fp16, 2)
    assert sorted(tl.compute_s) == pytest.approx([one, one + two - 4e-6, one + two - 2e-6])
    assert two < 1.1 * one  # memory-bound: two tokens cost about one


def test_paper_world_charges_per_token_and_dense_outside_the_stream():
    dep = Deployment((Replica(0, 1, Precision.FP16, True), Replica(1, 1, Precision.FP16, True)), 2, 2)
    setup, sh, cl = _hw_setup([Req(0, 0.0, prompt_tokens=3)], {0: [((0,),)] * 3}, dep, {0: 0}, agg=1)
    setup.spec = setup.spec.with_overrides({"physics": "paper"})
    st, tl, rq = _run(setup)
    comp = sh.expert_flops / cl.flops[1]
    assert tl.dense_s.tolist() == pytest.approx([sh.dense_flops / cl.flops[0]] * 3)  # a delay
    # the first arrival runs alone, the other two (2 and 4 us later over the FIFO link) batch
    assert sorted(tl.compute_s) == pytest.approx([comp, 3 * comp - 4e-6, 3 * comp - 2e-6])


def test_a_control_frame_waits_behind_the_data_on_its_link_and_holds_up_none():
    """``send_control``: a STATE or FEEDBACK frame crosses its link at the header's time
    plus the delay, after the hidden states already queued there (the emulator's control
    frames share their connection), without moving the link's next data message."""
    setup, sim = _asym5("links")
    m, n = 1, 0  # s1 -> s0: 0.8 Gbit/s, 20 ms
    ctrl = sim.control_s[m][n]
    assert ctrl == pytest.approx(setup.spec.sim.header_bytes
                                 / (setup.cluster.bandwidth[m][n] * setup.spec.sim.payload_efficiency))
    assert sim.send_control(m, n, 1.0) == pytest.approx(1.0 + ctrl + 0.020, abs=1e-12)
    busy_to = sim.send(m, n, 2.0, count=4) - sim.delay[m][n]  # four states on the link
    assert busy_to > 2.0
    assert sim.send_control(m, n, 2.0) == pytest.approx(busy_to + ctrl + 0.020, abs=1e-12)
    assert sim.link_free[m][n] == busy_to  # the frame held up no later message


def _lags(sim, queued: list[list[float]] | None = None) -> list[list[int]]:
    """``[n][m]``: windows old peer n's backlog is in m's view at a tick, for broadcasts
    that leave at their ticks behind ``queued[n][m]`` seconds of data."""
    N, w = sim.N, sim.window
    q = queued or [[0.0] * N for _ in range(N)]
    return [[0 if n == m else int((q[n][m] + sim.control_s[n][m] + sim.delay[n][m]) // w) + 1
             for m in range(N)] for n in range(N)]


def _asym5(control: str):
    setup = build_setup(parse_spec({
        "name": "control", "topology": "asym5", "backend": "sim", "net": {"control": control},
        "workload": {"rate_per_s": 10, "duration_s": 0.5, "warmup_s": 0.0, "gen_tokens": 0,
                     "calibration_tokens": 16}}))
    return setup, SimBackend(setup, RecordWriter(None, setup.shape.top_k))


def test_views_over_links_show_each_peer_as_its_last_broadcast_arrived():
    """Server m's view at window k holds peer n's backlog of window k - lag[n][m] and its
    own of window k; ``net.control: instant`` (the paper's rule) holds every server's of k."""
    from hetroute.state import StateView
    for control in ("links", "instant"):
        setup, sim = _asym5(control)
        N, w = setup.cluster.n, sim.window
        sim.pending_requests = 0  # no next window scheduled: the test ticks by hand
        for n in range(N):  # server n's backlog at window j is 10 j + n
            sim.sched[n].backlog = lambda t, n=n: 10 * round(t / w) + n
        for k in range(1, 5):
            sim.now = k * w
            sim._window(None)
        assert sim.snap_window == 4
        lags = _lags(sim) if control == "links" else None
        for m in range(N):
            v = StateView(N)
            sim._refresh(v, m)
            if control == "instant":
                assert list(v.backlog) == [40 + n for n in range(N)]
                continue
            want = [10 * (4 - lags[n][m]) + n for n in range(N)]
            assert list(v.backlog) == want and v.backlog[m] == 40 + m
        if control == "links":  # no peer is seen as it is now; 20 ms links lag two windows
            assert min(lags[n][m] for n in range(N) for m in range(N) if n != m) >= 1
            assert lags[1][0] == 2 and lags[0][1] == 1


def test_a_broadcast_behind_data_on_its_link_reaches_a_later_tick():
    """s3 -> s1 (0.8 Gbit/s, 19 ms) carries s3's broadcast inside one window when idle;
    with 2 ms of hidden states queued at every tick it lands after s1's next tick, so s1
    sees s3 two windows old, as the emulator's STATE behind its data frames would be."""
    from hetroute.state import StateView
    setup, sim = _asym5("links")
    N, w = setup.cluster.n, sim.window
    sim.pending_requests = 0
    for n in range(N):
        sim.sched[n].backlog = lambda t, n=n: 10 * round(t / w) + n
    assert _lags(sim)[3][1] == 1
    for k in range(1, 5):
        sim.now = k * w
        sim.link_free[3][1] = k * w + 0.002  # data queued on s3 -> s1 at the tick
        sim._window(None)
    v = StateView(N)
    sim._refresh(v, 1)
    queued = [[0.0] * N for _ in range(N)]
    queued[3][1] = 0.002
    lags = _lags(sim, queued)
    assert lags[3][1] == 2
    # every tick's broadcast to each of the 4 peers of 5 servers; only s3 -> s1 waited, 2 ms
    assert sim.stats.control_frames == 4 * N * (N - 1) and sim.stats.control_waits == 4
    assert sim.stats.control_wait_s == pytest.approx(0.008)
    assert list(v.backlog) == [10 * (4 - lags[n][1]) + n for n in range(N)]


def test_feedback_over_links_reaches_the_decider_a_link_later():
    """HetRoute's deciders get each record when the aggregator's FEEDBACK would arrive: at
    once where the decider aggregated, else the link's delay and the frame's time later, in
    the decider's window then; with ``instant`` every record at once."""
    for control in ("links", "instant"):
        setup, sim = _asym5(control)
        got = []
        for n, d in enumerate(sim.deciders):
            def spy(rec, n=n, inner=d.on_layer_done):
                got.append((n, rec, sim.now, sim.snap_window))
                inner(rec)
            d.on_layer_done = spy
        sim.run()
        assert len(got) == sim.stats.token_layers > 0
        moved = exact = 0
        for n, rec, now, window in got:
            done = rec.t_start + rec.total_s
            assert rec.server == n and rec.window == window
            if control == "instant" or rec.next_server == n:
                assert now == pytest.approx(done, abs=1e-12)
                continue
            moved += 1
            bound = done + setup.cluster.delay[rec.next_server][n] + sim.control_s[rec.next_server][n]
            assert now >= bound - 1e-12  # at the earliest a link's delay and the frame's time later
            exact += now == pytest.approx(bound, abs=1e-12)  # else behind data on that link
        assert (moved > 0) == (control == "links")
        assert exact >= moved / 2


def test_a_record_with_its_window_equals_the_named_tuples_replace():
    from testbed.core import with_window
    from hetroute.state import TokenLayerRecord
    rec = TokenLayerRecord(*range(len(TokenLayerRecord._fields)))
    got = with_window(rec, 77)
    assert type(got) is TokenLayerRecord and got == rec._replace(window=77)

