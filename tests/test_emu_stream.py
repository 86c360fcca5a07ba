"""The emulated GPU stream: the shared step rule in wall time, loads, dilation, lateness, kernels."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest
import torch

from hetroute.deployment import Replica
from hetroute.service import ServiceModel
from hetroute.system import Precision
from testbed.emu.experts import ExpertBank, ExpertSpec
from testbed.emu.stream import ModeledStream, Work
from testbed.emu.transport import precise_loop
from testbed.steps import DENSE, Job, StepScheduler

#: wall-clock releases: `make test` runs these alone, not beside other tests
pytestmark = pytest.mark.serial

T = 50.0
COMP = 2e-4  # model seconds per job: 10 ms wall at T = 50
LOAD = 1e-3


class Linear(ServiceModel):
    """The paper's additive costs with round numbers."""

    def __init__(self) -> None:
        pass

    def expert_s(self, server, precision, tokens=1):
        return tokens * COMP

    def dense_s(self, server, tokens=1, attn_positions=0, kv_positions=0):
        return tokens * COMP

    def load_s(self, server, precision):
        return LOAD


def _stream(loop, done, resident=lambda r: True, kernel=None, scope="replica", t0=None):
    t0 = time.monotonic() if t0 is None else t0
    sched = StepScheduler(Linear(), 0, lambda r: Precision.FP16, resident, scope=scope)
    return ModeledStream(loop, T, sched, kernel or (lambda r, x: x), done,
                         now=lambda: (time.monotonic() - t0) / T, wall=lambda t: t0 + t * T), t0


def _job(r, now, i, layer=0, x=None):
    return Job(layer, r, i, i, 0, now, Work(torch.full((4,), float(i)) if x is None else x, i))


def _run(jobs_at, resident=lambda r: True, kernel=None, horizon=1.0, scope="replica"):
    """Submit (delay_s, replica) jobs and return the stream and release log."""
    loop = precise_loop()
    done = []
    t0 = time.monotonic() + 0.02
    s, _ = _stream(loop, lambda j: done.append((time.monotonic(), j)), resident, kernel, scope, t0)

    def submit(r, i):
        s.submit(_job(r, s.now(), i))
    for i, (delay, r) in enumerate(jobs_at):
        loop.call_at(t0 + delay, submit, r, i)
    loop.run_until_complete(asyncio.sleep(horizon))
    loop.close()
    return s, [(t - t0, j) for t, j in done]


def test_single_job_is_released_at_its_dilated_service_time():
    # the second of two lone jobs: the first pays the cold code paths (4 ms once, after
    # the page cache was dropped)
    s, done = _run([(0.0, 0), (0.05, 0)], horizon=0.2)
    assert len(done) == 2
    t, j = done[1]
    # from the job's own arrival (the loop may wake late to submit it), 10 ms wall,
    # a few ms of host jitter
    assert t - j.arrival * T == pytest.approx(COMP * T, abs=3e-3)
    assert s.stats.late[1] < 3e-3


def test_queued_jobs_of_a_cpu_replica_coalesce_and_pay_one_load():
    # a blocker on replica 1 keeps the stream busy while three jobs of replica 0 queue
    s, done = _run([(0.0, 1), (0.001, 0), (0.002, 0), (0.003, 0)],
                   resident=lambda r: r == 1, horizon=0.4)
    assert s.stats.batches == 2 and s.stats.jobs == 4
    t_last = max(t for t, j in done)
    expected = COMP * T + (LOAD + 3 * COMP) * T  # one load, three computes
    assert t_last == pytest.approx(expected, abs=5e-3)
    assert all(not j.gpu for _, j in done if j.replica == 0)


def test_fifo_across_replicas_and_late_arrivals_wait_for_the_next_batch():
    s, done = _run([(0.0, 0), (0.001, 1), (0.002, 2), (0.012, 0)], horizon=0.3)
    order = [j.owner.owner for _, j in done]
    assert order == [0, 1, 2, 3]  # job 3 arrived after replica 0's batch started
    assert s.stats.batches == 4


def test_a_layer_step_serves_every_replica_of_the_layer_at_once():
    # hardware scope: one step for the three replicas queued behind a blocker of layer 1
    loop = precise_loop()
    done = []
    s, t0 = _stream(loop, lambda j: done.append((time.monotonic(), j)), scope="layer")
    now = s.now()
    s.submit(Job(1, 9, 99, 99, 0, now, Work(torch.zeros(4), 99)))  # blocker, other layer
    for i, r in enumerate((0, 1, 2)):
        s.submit(_job(r, now, i, layer=0))
    s.submit(Job(0, DENSE, 7, 7, 3, now, Work(None, 7)))
    loop.run_until_complete(asyncio.sleep(0.4))
    loop.close()
    assert s.stats.batches == 2 and s.stats.jobs == 5
    t_last = max(t for t, _ in done) - t0
    assert t_last == pytest.approx((COMP + 3 * COMP + COMP) * T, abs=5e-3)


def test_backlog_counts_running_queued_and_one_load_per_cold_replica():
    loop = precise_loop()
    s, t0 = _stream(loop, lambda j: None, resident=lambda r: r != 2)
    sc = s.sched
    now = s.now()
    sc.busy, sc.free_at = True, now + 0.0004  # 0.4 ms of model time left on a running step
    for r in (0, 2, 2):
        sc.submit(_job(r, now, 0))
    b = sc.backlog(now)
    assert b == pytest.approx(0.0004 + COMP + LOAD + 2 * COMP, rel=1e-3)
    loop.close()


def test_real_expert_kernels_batched_equal_row_by_row():
    spec = ExpertSpec(d_model=16, d_ff=48)
    bank = ExpertBank(spec, {0: Replica(0, 0, Precision.INT4, True)}, device="cpu")
    x = torch.randn(3, 16)
    loop = precise_loop()
    done = []
    s, _ = _stream(loop, lambda j: done.append(j), kernel=bank.run)
    s.sched.busy = True  # queue all three before the stream starts
    now = s.now()
    for i in range(3):
        s.submit(_job(0, now, i, x=x[i].clone()))
    s.sched.busy = False
    s._start()
    loop.run_until_complete(asyncio.sleep(0.2))
    assert s.stats.batches == 1
    for j in done:
        assert torch.allclose(j.owner.x, bank.run(0, x[j.owner.owner][None])[0], atol=1e-5)


def test_a_failing_kernel_fails_its_jobs_and_the_stream_keeps_serving():
    def kernel(r, x):
        if r == 1:
            raise RuntimeError("boom")
        return x
    s, done = _run([(0.0, 1), (0.03, 0)], kernel=kernel, horizon=0.3)
    assert s.stats.kernel_errors == 1
    errs = {j.owner.owner: j.owner.error for _, j in done}
    assert "boom" in errs[0] and errs[1] == ""


def test_each_steps_real_kernel_time_is_recorded_beside_its_modeled_time():
    def slow(r, x):  # 15 ms of real compute in a step padded to T x 2e-4 s = 10 ms
        time.sleep(0.015)
        return x
    s, done = _run([(0.0, 0), (0.1, 1)], kernel=slow, horizon=0.3)
    assert len(done) == 2 and len(s.stats.kernel) == 2
    for modeled, wall in s.stats.kernel:
        assert modeled == pytest.approx(COMP) and 0.015 <= wall < 0.05
    # the worker's compute outlasted its padding: the flag's input
    assert all(wall > modeled * T for modeled, wall in s.stats.kernel)


def test_late_releases_are_measured_not_hidden():
    loop = precise_loop()
    done = []
    s, _ = _stream(loop, lambda j: done.append(j))
    s.submit(_job(0, s.now(), 0))
    time.sleep(0.05)  # the loop is blocked past the 10 ms release
    loop.run_until_complete(asyncio.sleep(0.05))
    assert s.stats.late[0] > 0.03


# -- model-time arrivals (issue 14 item 6): the simulator's step rule, whatever the loop's lag --

def test_an_idle_step_takes_only_what_had_arrived_at_its_start_as_in_the_simulator():
    # two tokens released 0.1 ms (model) apart, both queued by the loop before the stream's
    # start callback ran (the loop lags behind model time): the simulator starts a step at
    # the first arrival with that job alone (testbed/sim/backend.py ``_kick``), and so must
    # the emulator; taking everything queued by the loop's ``now`` batched them together
    loop = precise_loop()
    done = []
    s, _ = _stream(loop, lambda j: done.append(j), scope="layer", t0=time.monotonic() - 1.0)
    now = s.now()  # 20 ms of model time into the run
    s.submit(_job(0, now - 2e-4, 0))
    s.submit(_job(0, now - 1e-4, 1))
    loop.run_until_complete(asyncio.sleep(0.1))
    loop.close()
    assert s.stats.batches == 2
    assert [j.owner.owner for j in done] == [0, 1]


def test_jobs_are_released_with_their_steps_modeled_end_even_when_the_loop_is_late():
    loop = precise_loop()
    seen = []
    s, _ = _stream(loop, lambda j: seen.append((s.released_at, s.now())), scope="layer")
    t = s.now()
    s.submit(_job(0, t, 0))
    loop.run_until_complete(asyncio.sleep(0))  # the step starts at t
    time.sleep(0.05)  # the loop is blocked past the 10 ms (wall) release
    loop.run_until_complete(asyncio.sleep(0.02))
    loop.close()
    (released, now), = seen
    assert released == pytest.approx(t + COMP, abs=1e-9)  # what the worker stamps downstream
    assert now > released + 0.03 / T  # the loop's clock had moved on
    assert s.released_at is None


def test_a_frame_to_the_worker_itself_arrives_at_its_modeled_send_time():
    from testbed.emu.node.peers import Peers
    from testbed.emu.wire import Frame, Pong

    class Node(Peers):
        N, rank, T, t0, stopping = 2, 0, T, time.monotonic(), False

        def wall(self, t):
            return self.t0 + t * self.T

        def _on_pong(self, frame, arrival):
            got.append(arrival)

    got = []
    loop = precise_loop()
    node = Node()
    node.loop = loop
    node._on_frame = node._on_pong
    node._init_peers()
    time.sleep(0.01)  # the worker's own Python time between the modeled send and the send
    assert node._send(0, Frame(Pong(0, 0, 0.0)), at=1e-5)
    assert node._send(0, Frame(Pong(0, 0, 0.0)))  # no model time: the loop's clock
    loop.run_until_complete(asyncio.sleep(0))
    loop.close()
    assert got[0] == pytest.approx(node.wall(1e-5), abs=1e-9)
    assert got[1] > node.t0 + 0.01


def test_a_layers_feedback_gives_the_deciding_server_the_whole_record():
    # the simulator hands each record to the decider that made the decision; in the
    # emulator the record is made where the layer aggregates, and a FEEDBACK frame carries
    # what was measured there to the residing server, which kept its decision and builds
    # the same TokenLayerRecord (a router reading replicas or tiers sees them in both backends)
    from types import SimpleNamespace

    from hetroute.state import StateView, TokenLayerRecord, TokenView
    from testbed.core import TokenLayerCore
    from testbed.emu.node.aggregation import Aggregation
    from testbed.emu.node.peers import Peers
    from testbed.emu.wire import Feedback, Frame, decode, encode
    from testbed.setup import build_setup
    from testbed.spec import parse_spec

    setup = build_setup(parse_spec({"topology": "small3", "workload": {
        "rate_per_s": 4, "duration_s": 0.5, "warmup_s": 0.1, "gen_tokens": 0,
        "calibration_tokens": 64}}))
    core = TokenLayerCore(setup.router, setup.deployment, setup.cluster, setup.shape,
                          "hardware", setup.quality)
    decider = setup.router.decider(0)
    tv = TokenView(0, 0, 0, 0.02, server=0, layer=3)
    routed = core.decide(decider, decider.residency(0), StateView(setup.cluster.n), tv,
                         tuple(setup.request_targets(0, 36)[0][3]), lambda n: 0.0)
    got = []

    class Decider:
        def on_layer_done(self, rec):
            got.append(rec)

    class Node(Peers, Aggregation):
        N, rank, T, t0, stopping = 3, 0, T, time.monotonic(), False

    node = Node()
    node._init_peers()
    node.core, node.decider, node.view = core, Decider(), SimpleNamespace(window=11)
    node.stats = {"feedback_unmatched": 0}
    node.decided = {(7, 0, 3, 2): (tv, routed, 0.010, 0.0101, 0.0102)}
    k = len(routed.assignment.replicas)
    gpus = (True,) * (k - 1) + (False,)
    # made in the aggregator's window 10, arriving in this server's window 11: the decider's
    # windows never go back (its decisions already closed window 10)
    fb = Feedback(2, 7, 0, 3, 2, 10, 0.0112, 0.0150, 0.0163, 24576, k, gpus)
    node._on_frame(decode(encode(Frame(fb))), time.monotonic())
    (rec,) = got
    want = core.record(tv, routed, list(gpus), 0.010, 0.0101, 0.0102, 0.0112, 0.0150, 0.0163,
                       24576, k, 11)
    assert isinstance(rec, TokenLayerRecord) and repr(rec) == repr(want)
    assert rec.replicas == routed.assignment.replicas and rec.gpus == list(gpus)
    assert rec.window == 11 and rec.fanin_s == pytest.approx(0.0163 - 0.0150)
    # a layer this server never routed (or whose decision it forgot): nothing to build
    node._on_frame(decode(encode(Frame(fb))), time.monotonic())
    assert len(got) == 1 and node.stats["feedback_unmatched"] == 1


@pytest.mark.parametrize("charge, expected", [("calibrated", 5e-6), ("measured", 0.25), (2e-5, 2e-5)])
def test_a_decision_is_charged_as_the_simulator_charges_it(charge, expected):
    # the emulator charged each decision's CPU time measured in the worker (5-30x the
    # calibrated constant on a shared host, plus a first call's JIT); it now charges
    # ``engine.decision_s`` as the simulator does: the setup's constant, or with
    # ``measured`` the decision's own time
    from types import SimpleNamespace

    from hetroute.state import Assignment
    from testbed.core import Routed
    from testbed.emu.node.routing import Routing
    from testbed.emu.wire import Token

    dispatched = []

    class Node(Routing):
        rank, T, t0, stopping = 0, T, time.monotonic(), False
        spec = SimpleNamespace(engine=SimpleNamespace(decision_s=charge),
                               quality=SimpleNamespace(budget=0.02))
        setup = SimpleNamespace(decision_s=5e-6 if charge == "calibrated" else (
            charge if isinstance(charge, float) else 0.0))
        core = SimpleNamespace(decide=lambda *a: Routed(Assignment((0,), (0,), (0,), 0), {0: [0]},
                                                        0.25, 0.0, 0.0))
        decider = residency = view = None

        def _n_tokens(self, rid, tok):
            return 1

        def _routing(self, rid, n):
            return [[[0]]], None

        def wall(self, t):
            return self.t0 + t * self.T

        def _outgoing(self, *a):  # the frames, built while the decision's charge runs
            return "frames"

        def _dispatch(self, *a):
            dispatched.append(a[7])  # t_disp

    node = Node()
    node.loop = precise_loop()
    node._init_routing()
    node._decide(Token(0, 0, 0, 0, 0, 0, 0.0, False), torch.zeros(4), 0.0, 0, t_dec=0.0)
    node.loop.close()
    assert node.cpu_free == pytest.approx(expected)
    assert node.decision_cpu == [0.25]  # the measured time is still reported


def test_a_dispatch_group_is_taken_when_complete_each_frame_at_its_last_arrival():
    # engine.dispatch: step -- what a sender released together to one destination (one
    # message in the simulator) is handed on together, at the last frame's arrival
    from testbed.emu.node.peers import Peers
    from testbed.emu.wire import Hidden, Partial, Pick, Ran, decode, encode, tensor_frame

    got = []

    class Node(Peers):
        N, rank, T, t0, stopping = 3, 0, T, time.monotonic(), False

        def _on_hidden(self, frame, arrival):
            got.append(("hidden", frame.msg.src, frame.msg.token, arrival))

        def _on_partial(self, frame, arrival):
            got.append(("partial", frame.msg.src, frame.msg.token, arrival))

    def hidden(src, token, group, n):
        m = Hidden(src, 9, token, 4, 1, 0, 1, 0, 1, 0.0, 0.0, 0.0, 0, 0, 0, (Pick(3, 5, 0),), (),
                   group=group, group_n=n)
        return decode(encode(tensor_frame(m, torch.zeros(4))))

    node = Node()
    node._init_peers()
    node._on_frame(hidden(1, 0, 7, 3), 1.0)
    node._on_frame(hidden(2, 0, 7, 2), 1.05)  # another sender's group 7: not the same group
    node._on_frame(hidden(1, 1, 7, 3), 1.2)
    single = Partial(1, 9, 5, 4, 1, 0.0, 0.0, (Ran(0, True),), group=8, group_n=1)
    node._on_frame(decode(encode(tensor_frame(single, torch.zeros(4)))), 1.25)  # on its own
    assert got == [("partial", 1, 5, 1.25)]
    node._on_frame(hidden(1, 2, 7, 3), 1.1)  # the last one in, though sent earlier
    assert got[1:] == [("hidden", 1, t, 1.2) for t in (0, 1, 2)]
    node._on_frame(hidden(2, 1, 7, 2), 1.3)
    assert got[4:] == [("hidden", 2, 0, 1.3), ("hidden", 2, 1, 1.3)]
    assert node.grouped == {}


def test_a_step_hands_on_what_it_released_after_its_last_job():
    loop = precise_loop()
    log = []
    s, _ = _stream(loop, lambda j: log.append(("job", j.token)), scope="layer")
    s.on_step_done = lambda: log.append(("step", s.released_at is not None))
    t = s.now()
    for i in range(3):
        s.submit(_job(0, t, i))
    loop.run_until_complete(asyncio.sleep(0.05))
    loop.close()
    assert log == [("job", 0), ("job", 1), ("job", 2), ("step", True)]


def test_a_step_hands_its_kernels_outputs_and_modeled_end_over_at_its_start():
    """What a release sends on is made while the step runs (``on_step_ran``): the hook
    sees every job of the step with the kernel's output and the step's modeled end,
    before the first job is released."""
    loop = precise_loop()
    log = []
    s, _ = _stream(loop, lambda j: log.append(("job", j.token, s.now())), scope="layer",
                   kernel=lambda r, x: 2 * x)
    s.on_step_ran = lambda jobs, end: log.append(
        ("ran", [(j.token, j.owner.x[0].item()) for j in jobs], end, s.now()))
    t = s.now()
    for i in range(3):
        s.submit(_job(i % 2, t, i + 1))
    loop.run_until_complete(asyncio.sleep(0.05))
    loop.close()
    (kind, seen, end, at), *released = log
    assert kind == "ran" and seen == [(1, 2.0), (2, 4.0), (3, 6.0)]
    assert end == pytest.approx(t + 3 * COMP, abs=1e-9)  # replica 0 with two tokens, 1 with one
    assert at < t + COMP  # called at the step's start, not at its end
    assert [e[:2] for e in released] == [("job", 1), ("job", 2), ("job", 3)]
    assert all(e[2] >= end for e in released)


def test_a_step_does_not_wait_for_an_older_requests_job_still_on_its_way():
    # the simulator's stream, free at t, takes what is queued at t; a job of an older
    # request that arrives later (model time) waits for the next step. The emulator may hold
    # that job already (its loop ran late and the sender's frame was queued early): it must
    # not idle the stream for it
    loop = precise_loop()
    done = []
    s, _ = _stream(loop, lambda j: done.append((j.token, s.released_at)), scope="layer")
    t = s.now()
    s.submit(Job(0, 0, "older", 0, 0, t + 2 * COMP, Work(torch.zeros(4)), prio=0.0))
    s.submit(Job(1, 0, "newer", 1, 0, t, Work(torch.zeros(4)), prio=1.0))
    loop.run_until_complete(asyncio.sleep(0.2))
    loop.close()
    assert [tok for tok, _ in done] == ["newer", "older"]
    assert done[0][1] == pytest.approx(t + COMP, abs=1e-9)
    assert done[1][1] == pytest.approx(t + 3 * COMP, abs=1e-9)


def _windowed_sender(bw, delay, msg):
    """Server 0's peer side under ``net.transport: tcp`` (its window clocks towards server
    1), writing into a list: (node, the frames it sent)."""
    from types import SimpleNamespace as NS

    from testbed.emu.node.peers import Peers
    from testbed.tcp import TcpParams, hold_clocks
    sent = []

    class Node(Peers):
        N, rank, T, t0, stopping = 2, 0, T, time.monotonic(), False
        net = NS(sent_frames={1: 0}, send=lambda dst, f, due=None, modeled=True:
                 sent.append(f) or True)
        reachable = [True, True]

        def wall(self, t):
            return self.t0 + self.T * t

    node = Node()
    node.stats = {"frames_out": 0}
    node._init_peers()
    node.holds = hold_clocks(TcpParams(), bw, delay, 1.0, 0, msg)
    return node, sent


def test_a_senders_frames_carry_the_simulators_window_wait_and_the_receiver_adds_it():
    # net.transport: tcp with the transport delay line: the kernel's own TCP sees no round
    # trip, so the sender models its window as the simulator does and each data frame
    # carries the wait (hold_s); a dispatch group is one message whose frames share it
    from testbed.emu.transport import Transport
    from testbed.emu.wire import Frame, Hidden, Pick, Pong, decode, encode, tensor_frame
    from testbed.tcp import TcpParams, windows

    bw = [[0.0, 1e9], [1e9, 0.0]]
    delay = [[0.0, 5e-3], [5e-3, 0.0]]
    msg = 100_000  # one hidden state's wire bytes: 70 segments, past the initial window
    node, sent = _windowed_sender(bw, delay, msg)

    def hidden(token, group, n):
        m = Hidden(0, 9, token, 4, 1, 0, 1, 1, 1, 0.0, 0.0, 0.0, 0, 0, 0, (Pick(3, 5, 0),), (),
                   group=group, group_n=n)
        return tensor_frame(m, torch.zeros(4))

    for token in range(3):  # one group of three frames sent at t = 0
        assert node._send(1, hidden(token, 7, 3), at=0.0)
    assert node._send(1, hidden(3, 0, 1), at=0.001)  # then one frame on its own
    assert node._send(1, tensor_frame(hidden(4, 0, 1).msg, torch.zeros(4)))  # no model time
    # the simulator's window for the same link and messages
    w = windows(TcpParams(), bw, delay, 1.0)[0][1]
    tx = msg / 1e9
    wait = w.wait(0.0, 3 * msg, 3 * tx)
    assert wait > 0
    assert [f.msg.hold_s for f in sent[:3]] == pytest.approx([wait] * 3)
    later = w.wait(3 * tx + wait, msg, tx)  # queued behind the group on the windowed link
    # its last byte leaves at 3 tx + wait + tx + later there, at 0.001 + tx on the ideal link
    assert sent[3].msg.hold_s == pytest.approx(3 * tx + wait + later - 0.001)
    assert sent[4].msg.hold_s == 0.0  # without a model time nothing is modeled
    # counted as the simulator counts: each message's own window wait, the group's once
    assert node.stats["tcp_waits"] == 1 + (later > 0)
    assert node.stats["tcp_wait_s"] == pytest.approx(wait + later)
    assert decode(encode(sent[0])).msg.hold_s == sent[0].msg.hold_s  # it survives the wire

    # the receiver's delay line adds T x hold to the link's delay; a PING has no hold
    got = []
    loop = precise_loop()
    net = Transport(1, 0, {}, [0.002, 0.0], lambda f, a: got.append((f.msg, a)),
                    lambda p, why: None, b"s" * 16, hold_scale=T)

    async def go():
        t = time.monotonic()
        net.deliver(sent[0], 0, t)
        net.deliver(Frame(Pong(0, 0, 0.0)), 0, t)
        await asyncio.sleep(0.002 + T * sent[0].msg.hold_s + 0.05)
        return t
    t = loop.run_until_complete(go())
    loop.close()
    arrivals = {type(m).__name__: a for m, a in got}
    assert arrivals["Pong"] == pytest.approx(t + 0.002)
    assert arrivals["Hidden"] == pytest.approx(t + 0.002 + T * sent[0].msg.hold_s)


def test_a_data_frame_never_goes_before_one_its_peer_sent_ahead_of_it():
    """One connection delivers in order, as the simulator's link queues a message behind the
    earlier ones: a frame whose own due time (arrival + delay + T x hold) is earlier waits
    for the frame sent before it; a control frame keeps its own delay (the simulator's
    control messages do not queue behind data)."""
    from testbed.emu.transport import Transport
    from testbed.emu.wire import Frame, Hidden, Pick, Pong, tensor_frame

    def hidden(token, hold):
        m = Hidden(0, 9, token, 4, 1, 0, 1, 1, 1, 0.0, 0.0, 0.0, 0, 0, 0, (Pick(3, 5, 0),), (),
                   hold_s=hold)
        return tensor_frame(m, torch.zeros(4))

    got = []
    loop = precise_loop()
    net = Transport(1, 0, {}, [0.002, 0.0], lambda f, a: got.append((f.msg, a)),
                    lambda p, why: None, b"s" * 16, hold_scale=1.0)

    async def go():
        t = time.monotonic()
        net.deliver(hidden(0, 0.030), 0, t)  # a held group's frame: due at t + 32 ms
        net.deliver(hidden(1, 0.0), 0, t + 0.001)  # sent behind it, due at t + 3 ms alone
        net.deliver(Frame(Pong(0, 0, 0.0)), 0, t + 0.001)  # control: t + 3 ms
        net.deliver(hidden(2, 0.0), 0, t + 0.040)  # after both were handed on
        await asyncio.sleep(0.06)
        return t
    t = loop.run_until_complete(go())
    loop.close()
    order = [(type(m).__name__, getattr(m, "token", None)) for m, _ in got]
    assert order == [("Pong", None), ("Hidden", 0), ("Hidden", 1), ("Hidden", 2)]
    at = [a - t for _, a in got]
    assert at[0] == pytest.approx(0.003) and at[1] == pytest.approx(0.032)
    assert at[2] == pytest.approx(0.032)  # as soon as the frame ahead of it, not before
    assert at[3] == pytest.approx(0.042)


def test_a_job_delivered_after_the_step_it_had_arrived_for_started_is_counted():
    """Job 1 arrives (model time) with job 0 but reaches the stream 1 ms of wall time later
    (a sender running late): job 0's step has started, so job 1 waits for the next step
    (the simulator would have run it in job 0's) and is counted as missed. Job 2, which
    arrives later in model time too, waits as it would in the simulator: not counted."""
    loop = precise_loop()
    done = []
    t0 = time.monotonic() + 0.02
    s, _ = _stream(loop, lambda j: done.append((time.monotonic(), j)), scope="layer", t0=t0)

    def late():  # runs after job 0's step has started (queued after the stream's start)
        s.submit(_job(0, 0.0, 1))  # delivered late, arrived with job 0
        s.submit(_job(0, s.now(), 2))  # arrived later in model time too

    def first():
        s.submit(_job(0, 0.0, 0))
        loop.call_soon(late)
    loop.call_at(t0, first)
    loop.run_until_complete(asyncio.sleep(0.3))
    loop.close()
    assert s.stats.batches == 2 and s.stats.missed == 1
    assert 0 <= s.stats.missed_late[0] < 5e-3
    first = min(t for t, _ in done) - t0
    assert [j.owner.owner for t, j in done if t - t0 < first + 1e-3] == [0]
    assert first == pytest.approx(COMP * T, abs=3e-3)


def test_an_older_requests_job_delivered_late_for_another_layer_is_counted():
    """First come, first served: a job of an older request (prio) that had arrived by a
    running step's start would have made the simulator serve its own layer first."""
    loop = precise_loop()
    t0 = time.monotonic() + 0.02
    s, _ = _stream(loop, lambda j: None, scope="layer", t0=t0)

    def job(layer, prio):
        return Job(layer, 0, prio, prio, 0, 0.0, Work(torch.zeros(4), prio), prio=prio)

    def late():  # after the step of job 0 started; both arrived with it in model time
        s.submit(job(1, 1.0))  # an older request's, layer 1: counted
        s.submit(job(2, 9.0))  # a newer request's, layer 2: not counted

    def first():
        s.submit(job(0, 5.0))  # a newer request's job of layer 0 starts a step
        loop.call_soon(late)
    loop.call_at(t0, first)
    loop.run_until_complete(asyncio.sleep(0.1))
    loop.close()
    assert s.stats.missed == 1


def test_a_same_requests_earlier_arrival_delivered_late_for_another_layer_is_counted():
    """Between one request's jobs the earlier arrival goes first (steps.py): a job of the
    running step's request that had arrived before the step's first job, delivered after the
    step started, would have been served first by the simulator."""
    loop = precise_loop()
    t0 = time.monotonic() + 0.02
    s, _ = _stream(loop, lambda j: None, scope="layer", t0=t0)

    def job(layer, arrival):
        return Job(layer, 0, layer, 7, 0, arrival, Work(torch.zeros(4), layer), prio=1.0)

    def late():  # after the step of layer 5 started
        s.submit(job(4, 0.0))  # arrived before the step's first job: counted
        s.submit(job(6, 2e-5))  # arrived after it: not counted

    def first():
        s.submit(job(5, 1e-5))
        loop.call_soon(late)
    loop.call_at(t0 + 1e-5 * T, first)
    loop.run_until_complete(asyncio.sleep(0.1))
    loop.close()
    assert s.stats.missed == 1


class _Wire:
    """An asyncio transport's write side: what a sender wrote, in order."""

    def __init__(self):
        self.data = bytearray()

    def write(self, b):
        self.data += b

    def is_closing(self):
        return False


def _hidden():
    from testbed.emu.wire import Hidden, Pick
    return Hidden(0, 9, 1, 4, 1, 0, 1, 1, 1, 0.0, 0.0, 0.0, 0, 0, 0, (Pick(3, 5, 0),), ())


_HIDDEN = _hidden()


def _sender(link_s_per_byte=None):
    """Worker 0's transport with a written-to connection to worker 1."""
    from testbed.emu.transport import Transport
    sender = Transport(0, 0, {1: ("h", 1)}, [0.0, 0.0], lambda f, a: None, lambda p, why: None,
                       b"s" * 16, link_s_per_byte=link_s_per_byte)
    wire = sender.out[1] = _Wire()
    return sender, wire


def test_a_late_write_is_stamped_and_the_receivers_delay_line_absorbs_it():
    """The sender stamps how late it wrote a data frame after its model send time (at the
    corked block's end, where the bytes leave); the receiver's delay line starts at the
    due time as far as the link's delay covers it (``emu.late_writes: absorbed``), and at
    the arrival with ``exposed``. Control frames carry no stamp."""
    from testbed.emu.transport import Transport
    from testbed.emu.wire import FrameDecoder, tensor_frame

    m = _HIDDEN
    sender, wire = _sender()
    now = time.monotonic()
    with sender.corked():
        assert sender.send(1, tensor_frame(m, torch.zeros(4)), due=now - 0.004)
        assert sender.send(1, tensor_frame(m, torch.zeros(4)), due=now + 60.0)  # not late
        assert sender.send(1, tensor_frame(m, torch.zeros(4)))  # no model time: no stamp
        time.sleep(0.003)  # the bytes leave when the block ends
    dec = FrameDecoder()
    late = [f.msg.write_late_s for f in dec.feed(bytes(wire.data))]
    assert 0.007 <= late[0] < 0.5 and late[1:] == [0.0, 0.0]
    assert sender.late_written == pytest.approx(late[:2])

    def arrivals(absorb: bool, stamp: float):
        got = []
        loop = precise_loop()
        net = Transport(1, 0, {}, [0.020, 0.0], lambda f, a: got.append(a),
                        lambda p, why: None, b"s" * 16, absorb_late=absorb)

        async def go():
            t = time.monotonic()
            net.deliver(tensor_frame(replace(m, write_late_s=stamp), torch.zeros(4)), 0, t)
            await asyncio.sleep(0.04)
            return t
        t = loop.run_until_complete(go())
        loop.close()
        return got[0] - t, net

    at, net = arrivals(True, 0.008)  # written 8 ms late on a 20 ms line: due 12 ms on
    assert at == pytest.approx(0.012, abs=1e-3)
    assert net.late_absorbed == pytest.approx(0.008) and net.late_exposed == 0.0
    at, net = arrivals(True, 0.030)  # later than the line covers: handed on at once
    assert at == pytest.approx(0.0, abs=1e-3)
    assert net.late_absorbed == pytest.approx(0.020) and net.late_exposed == pytest.approx(0.010)
    at, net = arrivals(False, 0.008)  # exposed: the line starts at the arrival
    assert at == pytest.approx(0.020, abs=1e-3) and net.late_exposed == pytest.approx(0.008)


def test_a_late_frame_onto_a_busy_link_is_stamped_with_its_departures_lateness_alone():
    """Only the difference between the frame's start on the real link (behind what was
    written before it, at the shaped rate) and its start on the model's link (behind the
    modeled frames before it) is late: a frame written 25 ms late behind one written 30 ms
    late leaves 30 ms late; one the simulator does not send takes real link time only; one
    written early waits behind the real queue. Stamped from the write alone (885b7ee), the
    second would read 25 ms and be handed on 5 ms early."""
    from testbed.emu.wire import FrameDecoder, tensor_frame

    m = _HIDDEN
    probe, _ = _sender()
    probe.send(1, tensor_frame(m, torch.zeros(4)))
    nbytes = probe.sent_bytes  # one frame's bytes: it takes 10 ms on the link below
    sender, wire = _sender({1: 0.010 / nbytes})
    t = time.monotonic()
    with sender.corked():
        sender.send(1, tensor_frame(m, torch.zeros(4)), due=t - 0.030)  # A: idle link
        sender.send(1, tensor_frame(m, torch.zeros(4)), due=t - 0.025)  # B: behind A
        sender.send(1, tensor_frame(m, torch.zeros(4)), due=t, modeled=False)  # not the model's
        sender.send(1, tensor_frame(m, torch.zeros(4)), due=t + 0.005)  # D: due after the write
    late = [f.msg.write_late_s for f in FrameDecoder().feed(bytes(wire.data))]
    # every real start moves with how long after t the block ended; the model's do not
    assert late[0] >= 0.030
    assert late[1] - late[0] == pytest.approx(0.0, abs=1e-9)  # B leaves at A's real end
    # the unmodeled frame starts 20 ms after A on the real link, its model start is t
    assert late[2] - late[0] == pytest.approx(-0.010, abs=1e-9)
    # D: 30 ms of real queue ahead of it, model start t + 5 ms (B's model end is t - 10 ms)
    assert late[3] - late[0] == pytest.approx(-0.005, abs=1e-9)
    assert sender.late_written == pytest.approx(late)
    # against their write lateness (the block ended e after t; A's lateness is 30 ms + e):
    # B +5 ms, the unmodeled frame +20 ms, D 25 ms + e less what it was written late
    e = late[0] - 0.030
    assert sender.late_vs_write == pytest.approx(0.005 + 0.020 + 0.025 + e - max(0.0, e - 0.005),
                                                 abs=1e-9)


def test_a_dispatch_groups_window_wait_counts_only_the_frames_the_simulator_sends():
    """A step's dispatch group to a server holds a frame per token that has it as participant
    or as aggregator; the simulator's message to it holds only the participants' hidden
    states, so the group's frames wait for the window of those alone (``hold_n``). Counted
    with every frame, asym5's first prompt reached a participant 24.8 us after the
    simulator's (three more hidden states at 8 Gbit/s)."""
    from types import SimpleNamespace as NS

    from testbed.emu.node.routing import Routing
    from testbed.emu.wire import Hidden, Pick, tensor_frame
    from testbed.tcp import TcpParams, windows

    def routed(participants, agg):
        return (None, None, 0.0, (None, NS(per_server={n: [0] for n in participants},
                                           assignment=NS(next_server=agg)), 0.0, 0.0))
    node = NS(rank=0, reachable=[True, True, True, False])
    cohort = [routed([1], 1), routed([0], 1), routed([1, 2], 2), routed([3], 1)]
    oks, counts, held = Routing._grouping(node, cohort)
    # server 1 gets three frames (participant twice, aggregator only once), two modeled
    assert oks == [True, True, True, False]
    assert counts == {0: 1, 1: 3, 2: 1} and held == {0: 1, 1: 2, 2: 1}

    bw, delay, msg = [[0.0, 1e9], [1e9, 0.0]], [[0.0, 5e-3], [5e-3, 0.0]], 100_000
    node, sent = _windowed_sender(bw, delay, msg)
    frames = [tensor_frame(Hidden(0, 9, k, 4, 1, 0, 1, 1, 1, 0.0, 0.0, 0.0, 0, 0, 0,
                                  (Pick(3, 5, 0),), (), group=7, group_n=3), torch.zeros(4))
              for k in range(3)]
    assert node._send(1, frames[0], at=0.0, hold_n=2)
    assert node._send(1, frames[1], at=0.0, modeled=False, hold_n=2)  # the aggregator's only
    assert node._send(1, frames[2], at=0.0, hold_n=2)
    w = windows(TcpParams(), bw, delay, 1.0)[0][1]
    two = w.wait(0.0, 2 * msg, 2 * msg / 1e9)
    three = windows(TcpParams(), bw, delay, 1.0)[0][1].wait(0.0, 3 * msg, 3 * msg / 1e9)
    assert 0 < two < three
    assert [f.msg.hold_s for f in sent] == pytest.approx([two, 0.0, two])
    assert node.stats["tcp_waits"] == 1 and not node._group_holds  # the group's wait, used up


def test_a_frame_whose_bytes_come_early_is_held_to_the_models_instant():
    """The sender stamps when the model's link is done sending a data frame (``due_end_s``,
    its model start plus its bytes at the link's rate); the receiver hands it on no earlier
    than that plus the link's delay, however early its bytes came. An HTB class lets its
    bucket's burst (1 ms of traffic) through at once after an idle spell, so a lone hidden
    state came up to 1 ms of wall time early: 31 us emulated at T = 32 on asym5's fan-outs
    (README, "A shaper's burst")."""
    from testbed.emu.transport import Transport
    from testbed.emu.wire import FrameDecoder, tensor_frame

    m = _HIDDEN
    probe, _ = _sender()
    probe.send(1, tensor_frame(m, torch.zeros(4)))
    nbytes = probe.sent_bytes
    sender, wire = _sender({1: 0.010 / nbytes})  # 10 ms on the link
    t = time.monotonic() + 0.5
    assert sender.send(1, tensor_frame(m, torch.zeros(4)), due=t)
    assert sender.send(1, tensor_frame(m, torch.zeros(4)), due=t)  # behind it on the model's link
    assert sender.send(1, tensor_frame(m, torch.zeros(4)))  # no model time: no stamp
    ends = [f.msg.due_end_s for f in FrameDecoder().feed(bytes(wire.data))]
    assert ends[0] == pytest.approx(t + 0.010, abs=1e-9)
    assert ends[1] == pytest.approx(t + 0.020, abs=1e-9) and ends[2] == 0.0

    def handed(due_end: float, late: float = 0.0):
        got = []
        loop = precise_loop()
        net = Transport(1, 0, {}, [0.020, 0.0], lambda f, a: got.append(a),
                        lambda p, why: None, b"s" * 16)

        async def go():
            now = time.monotonic()
            end = now + due_end if due_end else 0.0
            net.deliver(tensor_frame(replace(m, due_end_s=end, write_late_s=late), torch.zeros(4)),
                        0, now)
            await asyncio.sleep(0.05)
            return now
        now = loop.run_until_complete(go())
        loop.close()
        return got[0] - now, net

    at, net = handed(0.006)  # its bytes came 6 ms before the model's link had sent them
    assert at == pytest.approx(0.026, abs=1e-3)
    assert net.early_held == 1 and net.early_held_s == pytest.approx(0.006, abs=1e-6)
    at, net = handed(-0.004)  # the model's link was done 4 ms before the bytes came: on time
    assert at == pytest.approx(0.020, abs=1e-3) and net.early_held == 0
    at, net = handed(0.0)  # no stamp: the arrival decides, as before
    assert at == pytest.approx(0.020, abs=1e-3) and net.early_held == 0
    # written 8 ms late and its bytes 3 ms early of the model's end: the model's instant
    at, net = handed(0.003 - 0.008, late=0.008)
    assert at == pytest.approx(0.015, abs=1e-3) and net.early_held == 1


def test_a_control_frame_is_stamped_behind_the_data_and_holds_up_none():
    """A STATE or FEEDBACK sent with a due time is stamped as a data frame, at the
    simulator's header bytes (``control_bytes``) on the model's link behind the data sent
    before it, without moving the data after it (``SimBackend.send_control``); the
    receiver's delay line keeps it behind the data frames its peer sent ahead of it."""
    from testbed.emu.transport import Transport
    from testbed.emu.wire import Frame, FrameDecoder, State, tensor_frame

    m = _HIDDEN
    probe, _ = _sender()
    probe.send(1, tensor_frame(m, torch.zeros(4)))
    spb = 0.010 / probe.sent_bytes  # a data frame: 10 ms on the link
    sender, wire = _sender({1: spb})
    t = time.monotonic() + 0.5
    state = Frame(State(0, 3, 0.06, 0.06, 0.001, (True, True), (0, 0)))
    assert sender.send(1, tensor_frame(m, torch.zeros(4)), due=t)
    assert sender.send(1, state, due=t)
    assert sender.send(1, tensor_frame(m, torch.zeros(4)), due=t)
    assert sender.send(1, state)  # no due time: unstamped, as before
    got = FrameDecoder().feed(bytes(wire.data))
    ends = [f.msg.due_end_s for f in got]
    assert ends[0] == pytest.approx(t + 0.010, abs=1e-9)
    assert ends[1] == pytest.approx(t + 0.010 + 64 * spb, abs=1e-9)  # behind it, 64 bytes' time
    assert ends[2] == pytest.approx(t + 0.020, abs=1e-9)  # not held up by the STATE
    assert ends[3] == 0.0 and got[1].msg.backlog_s == 0.001

    handed, heard = [], []
    loop = precise_loop()
    net = Transport(1, 0, {}, [0.020, 0.0], lambda f, a: handed.append((type(f.msg), a)),
                    lambda p, why: None, b"s" * 16, on_heard=lambda src, a: heard.append((src, a)))

    async def go():
        now = time.monotonic()
        net.deliver(tensor_frame(replace(m, due_end_s=now + 0.006), torch.zeros(4)), 0, now)
        net.deliver(Frame(replace(state.msg, due_end_s=now + 0.001)), 0, now)  # due before it
        net.deliver(Frame(state.msg), 0, now)  # unstamped: its own delay, as before
        await asyncio.sleep(0.05)
        return now
    now = loop.run_until_complete(go())
    loop.close()
    kinds = [k.__name__ for k, _ in handed]
    at = {i: a - now for i, (_, a) in enumerate(handed)}
    assert kinds == ["State", "Hidden", "State"]
    assert at[0] == pytest.approx(0.020, abs=2e-3)  # the unstamped one: arrival + delay
    assert at[1] == pytest.approx(0.026, abs=2e-3) and at[2] == at[1]  # held behind the data
    # the peer is heard as its bytes come (liveness), not when the line hands a frame on
    assert heard == [(0, now)] * 3


def test_a_tick_publishes_its_instants_backlog_and_sees_what_arrived_by_it():
    """``Peers._tick`` broadcasts the stream's backlog as of the tick's model instant (not
    of when the loop ran it), due then; its view takes each peer's last STATE whose
    arrival is no later than the tick's instant, even one the loop handed on first."""
    from types import SimpleNamespace

    from testbed.emu.node.peers import Peers
    from testbed.emu.wire import Frame, State

    T = 10.0
    sent, refreshed = [], []

    class Node(Peers):
        N, rank, window, stopping = 3, 0, 0.02, False

        def wall(self, t):
            return self.t0 + t * T

        def now(self):
            return (time.monotonic() - self.t0) / T

        def _send(self, dst, frame, resolve=None, at=None, **kw):
            sent.append((dst, frame.msg.backlog_s, at))
            return True

        def _fault_tick(self):
            pass

        def _log(self, text):
            raise AssertionError(text)

    node = Node()
    node.T = T
    node.peer_alive = [True] * 3
    node.t0 = time.monotonic() - 0.45  # the tick of window 2 (0.4 s of wall time) runs late
    node._init_peers()
    node.stats = {}
    node.last_heard = [time.monotonic()] * 3
    node.net = SimpleNamespace(received_frames={})
    node.stream = SimpleNamespace(sched=SimpleNamespace(backlog=lambda t: 1.0 - t))
    node.view = SimpleNamespace(refresh=lambda w, at, snap, alive: refreshed.append(list(snap)))
    node.loop = SimpleNamespace(call_at=lambda *a: None)
    w2 = node.wall(0.04)
    st = lambda src, b: Frame(State(src, 1, 0.02, 0.02, b, (True,) * 3, ()))  # noqa: E731
    node._handle(st(1, 0.5), w2 - 0.01)  # arrived before the tick's instant
    node._handle(st(2, 0.7), w2 + 0.01)  # after it, though handed on before the tick ran
    node._tick(2)
    assert sent == [(1, pytest.approx(0.96), 0.04), (2, pytest.approx(0.96), 0.04)]
    assert refreshed[-1] == [pytest.approx(0.96), 0.5, 0.0]
    node._handle(st(1, 0.9), w2 - 0.005)  # due by the tick that already ran: counted
    assert node.stats["state_after_tick"] == 1
    node.loop = SimpleNamespace(call_at=lambda *a: None)
    node._tick(3)
    assert refreshed[-1][1:] == [0.9, 0.7]
