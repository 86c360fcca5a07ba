"""The step rule's order among one request's jobs: by model arrival, whatever the submission order.

fastbehindslow4's HetRoute at 40 req/s, seed 19 (2026-12-06): two of server 3's steps ran in
swapped order on the emulator, because its loop submitted a dispatch to itself (arrived at
16.463 ms) behind a peer's jobs for the next layer (arrived at 16.481 ms), and the scheduler
broke the tie between one request's jobs by submission. The simulator submits every job at its
arrival, so there the two orders coincide and its runs do not change (``test_sim_golden``).
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hetroute.service import ServiceModel
from hetroute.system import Precision
from testbed.steps import DENSE, Job, StepScheduler


class _Flat(ServiceModel):
    def __init__(self) -> None:
        pass

    def expert_s(self, server, precision, tokens=1):
        return 1e-4 * tokens

    def dense_s(self, server, tokens=1, attn_positions=0, kv_positions=0):
        return 1e-4 * tokens

    def load_s(self, server, precision):
        return 1e-3


def _sched() -> StepScheduler:
    return StepScheduler(_Flat(), 3, lambda r: Precision.FP16, lambda r: True, scope="layer")


def _job(layer: int, replica: int, token, arrival: float, prio: float = 0.0) -> Job:
    return Job(layer, replica, token, 0, 0, arrival, None, prio)


def test_of_one_requests_jobs_the_earlier_arrival_goes_first_whatever_was_submitted_first():
    sc = _sched()
    sc.submit(_job(5, 454, "t23", 0.016481))  # handed on first by the emulator's loop
    sc.submit(_job(4, 35, "t14", 0.016463))  # arrived earlier, submitted later
    sc.submit(_job(4, DENSE, "t16", 0.017264))
    step = sc.take(0.017264, arrived_by=0.017264)
    assert step.layer == 4 and [j.token for j in step.jobs] == ["t14", "t16"]
    assert sc.order_swaps == 1  # by submission, layer 5 would have gone first
    sc.finish()
    assert sc.take(step.start + step.duration, arrived_by=step.start + step.duration).layer == 5


def test_within_a_step_one_requests_jobs_go_in_arrival_order():
    sc = _sched()
    sc.submit(_job(2, DENSE, "b", 0.002))
    sc.submit(_job(2, DENSE, "a", 0.001))
    sc.submit(_job(2, DENSE, "c", 0.002))  # ties keep submission order
    assert [j.token for j in sc.take(0.003, arrived_by=0.003).jobs] == ["a", "b", "c"]
    assert sc.order_swaps == 1


def test_an_older_request_still_goes_before_an_earlier_arrival_of_a_newer_one():
    sc = _sched()
    sc.submit(_job(7, 1, "new", 0.001, prio=0.5))
    sc.submit(_job(3, 1, "old", 0.002, prio=0.1))
    assert sc.take(0.003, arrived_by=0.003).layer == 3


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(-1, 2), st.integers(0, 2),
                          st.integers(0, 3)), min_size=1, max_size=30))
def test_submitted_in_arrival_order_the_simulators_and_the_emulators_take_agree(jobs):
    """(arrival tick, replica, prio, layer) per job, submitted in arrival order as the
    simulator does: its path (``take(now)``) and the emulator's (``take(now, arrived_by)``)
    make the same steps."""
    jobs = sorted(jobs, key=lambda j: j[0])
    steps = []
    for path in ("sim", "emu"):
        sc = _sched()
        for i, (tick, rep, prio, layer) in enumerate(jobs):
            sc.submit(_job(layer, rep, i, tick * 1e-3, prio=float(prio)))
        out, now = [], 0.004
        while sc.queue:
            step = sc.take(now) if path == "sim" else sc.take(now, arrived_by=now)
            out.append((step.layer, [j.token for j in step.jobs]))
            sc.finish()
            now += step.duration
        steps.append(out)
        if path == "emu":
            assert sc.order_swaps == 0  # submitted in arrival order: nothing to reorder
    assert steps[0] == steps[1]


def test_arrivals_a_float_error_apart_are_one_instant_and_keep_submission_order():
    """The emulator's model times come back from wall stamps: two jobs the simulator receives
    at one instant may read 1e-18 s apart, the later-submitted one first."""
    sc = _sched()
    sc.submit(_job(2, DENSE, "first", 0.01 + 2e-18))
    sc.submit(_job(2, DENSE, "second", 0.01))
    sc.submit(_job(3, 1, "other layer", 0.01 - 1e-18))
    step = sc.take(0.02, arrived_by=0.02)
    assert step.layer == 2 and [j.token for j in step.jobs] == ["first", "second"]
    assert sc.order_swaps == 0
