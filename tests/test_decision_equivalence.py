"""The compiled Algorithm 2 decides exactly as the Python reference, on real run states.

Every ``SetLevelRouter.route`` call of a simulated run (placement's calibration
runs included) is made twice on the same view: by the numba kernel
(``hetroute/routing/compiled.py``, the default) and by ``route_reference``; the
assignments (replicas, modes, aggregation server, dq, estimated delay, bit for
bit), the work counters and any ``Unroutable`` must agree. The runs cover both
models' shapes (Mixtral: pair enumeration and the fast path; Qwen: beam search
and 1-exchange), the marginal cost model (``hetroute-hw``), per-expert routing
(the set-level ablation), a tight quality budget (substitutes) and faults
(reachability and the emergency fallback).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetroute.routing.algorithm2 import Alg2Params, SetLevelRouter
from hetroute.state import Mode, Unroutable
from testbed.runner import run_experiment
from testbed.spec import parse_spec

from .test_algorithm2 import _instance


def _checked(monkeypatch) -> Counter:
    """Patch ``SetLevelRouter.route`` to run both implementations and compare them."""
    seen: Counter = Counter()
    compiled = SetLevelRouter.route

    def route(self, tok, targets, view):
        before = self.evaluations
        try:
            a, err_a = compiled(self, tok, targets, view), None
        except Unroutable as err:
            a, err_a = None, str(err)
        work_a = self.evaluations - before
        try:
            b, err_b = self.route_reference(tok, targets, view), None
        except Unroutable as err:
            b, err_b = None, str(err)
        work_b = self.evaluations - before - work_a
        self.evaluations = before + work_a
        where = f"{tok!r} targets={targets}"
        assert err_a == err_b, where
        assert a == b, f"{where}\ncompiled:  {a}\nreference: {b}"
        assert work_a == work_b, where
        seen["decisions"] += 1
        if err_a is not None:
            seen["unroutable"] += 1
            raise Unroutable(err_a)
        for m in a.modes:
            seen[Mode(m).name] += 1
        return a

    monkeypatch.setattr(SetLevelRouter, "route", route)
    return seen


def _run(monkeypatch, router: str, model: str, topology: str = "paper10", **extra) -> Counter:
    seen = _checked(monkeypatch)
    spec = {"topology": topology, "router": {"name": router},
            "workload": {"model": model, "duration_s": 0.6, "warmup_s": 0.05, "rate_per_s": 30,
                         "prompt_tokens": 16, "gen_tokens": 0, "calibration_tokens": 128},
            "engine": {"decision_s": 0.0}}
    for key, value in extra.items():
        spec[key] = {**spec.get(key, {}), **value} if isinstance(value, dict) else value
    run_experiment(parse_spec(spec), None, progress=False)
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("router", ["hetroute", "hetroute-hw"])
@pytest.mark.parametrize("model", ["mixtral-8x7b", "qwen1.5-moe-a2.7b"])
def test_compiled_routing_equals_reference_over_ten_thousand_token_layers(monkeypatch, router,
                                                                          model):
    seen = _run(monkeypatch, router, model)
    assert seen["decisions"] >= 10_000, seen


@pytest.mark.slow
def test_equal_under_a_tight_budget_and_per_expert_routing(monkeypatch):
    seen = _run(monkeypatch, "hetroute", "mixtral-8x7b", quality={"budget": 0.002})
    assert seen["SUBSTITUTE"] > 0 or seen["FALLBACK"] > 0, seen
    seen = _run(monkeypatch, "hetroute-no-setlevel", "qwen1.5-moe-a2.7b")
    assert seen["decisions"] > 1000, seen


@pytest.mark.slow
def test_equal_under_faults(monkeypatch):
    faults = [{"kind": "cut_link", "at_s": 0.2, "server": "edge", "peer": "hub"},
              {"kind": "kill_worker", "at_s": 0.4, "server": "mid"}]
    seen = _run(monkeypatch, "hetroute", "switch", topology="small3", faults=faults)
    assert seen["decisions"] > 1000 and seen["unroutable"] > 0, seen


@pytest.mark.slow
def test_equal_when_the_stability_guard_forces_the_fallback(monkeypatch):
    seen = _run(monkeypatch, "hetroute", "qwen1.5-moe-a2.7b", window_s=0.0005,
                workload={"rate_per_s": 120})
    assert seen["FALLBACK"] > 0, seen


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**9), st.sampled_from([1, 2, 64, 10**6]), st.sampled_from([1, 3, 8]),
       st.booleans(), st.booleans(), st.booleans(), st.booleans())
def test_compiled_equals_reference_on_random_instances(seed, enum_limit, width, fast_path,
                                                       set_level, faults, idle_here):
    """Random clusters, deployments, views and budgets (k = 1-3; every search path:
    fast path, pairs, depth-first, beam with and without 1-exchange, fallback)."""
    sh, cl, dep, q, cost, r, view, tok, targets = _instance(seed)
    rng = np.random.default_rng(seed + 1)
    if idle_here:  # the dominance fast path is tried only below tau_loc
        view.backlog[tok.server] = 0.0
    if faults:
        view.alive[int(rng.integers(cl.n))] = False
        view.link_up = [[bool(x) for x in row] for row in rng.random((cl.n, cl.n)) > 0.2]
        view.faultless = False
    params = Alg2Params(window_s=r.params.window_s, enum_limit=enum_limit, beam_width=width,
                        fast_path=fast_path, set_level=set_level)
    fast = SetLevelRouter(cost, params)
    ref = SetLevelRouter(cost, dataclasses.replace(params, compiled=False))
    outcomes = []
    for router in (fast, ref):
        try:
            outcomes.append(router.route(tok, targets, view))
        except Unroutable as err:
            outcomes.append(str(err))
    assert outcomes[0] == outcomes[1]
    assert fast.evaluations == ref.evaluations
