"""``make bench``'s router ceiling: the router's time is part of the loop's, so the rate it
alone allows lies above the simulator's own."""

import time

from testbed.bench import _router_share, _sim


def test_the_routers_ceiling_lies_above_the_simulators_rate():
    t0 = time.process_time()
    share = _router_share(0.3, "paper")
    cpu = time.process_time() - t0
    assert share["decision_us"] > 0 and share["feedback_us"] > 0
    sim = _sim(0.3, "paper")
    # the ceiling counts only the router's CPU time of a run whose whole CPU time (set-up
    # included) is ``cpu``: above the rate of the loop, and finite
    assert sim["per_s"] < share["ceiling_per_s"] < 1e9
    assert share["ceiling_per_s"] > sim["token_layers"] / cpu
