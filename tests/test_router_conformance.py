"""Conformance check: every registered router, and an out-of-tree one, obeys the contract.

Per router x topology (small3, paper10) x model (Switch, Qwen, Mixtral):
- placement: (c.1), (c.2), (c.4) via ``Deployment.check``, every expert covered,
  and placing twice gives the same deployment;
- online: every target of every token-layer is executed by an existing replica
  that is exact, a valid substitute or a full-precision fallback; at most k
  participants; every token passes every layer and trajectories are connected;
- determinism: two runs with fresh router instances give identical records;
- causality: changing the gated experts of one token from a middle layer on
  leaves every decision taken before that token-layer was decided unchanged.

Runs are short (5 requests of 4 tokens, 64 calibration tokens); placements
are built once per session and each run binds a fresh router instance to them.
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
import pandas as pd
import pytest

from hetroute.routers import RouterParams, available, get_router
from hetroute.state import ExecType
from hetroute.system import FULL_PRECISION
from testbed.records import RecordWriter, flat
from testbed.setup import RunSetup, build_setup
from testbed.sim.backend import SimBackend
from testbed.spec import parse_spec

OUT_OF_TREE = "examples.nearest_replica:NearestReplica"
ROUTERS = available() + [OUT_OF_TREE]
TOPOLOGIES = ("small3", "paper10")
MODELS = ("switch-base-8", "qwen1.5-moe-a2.7b", "mixtral-8x7b")
WORKLOAD = {"duration_s": 0.3, "warmup_s": 0.05, "rate_per_s": 20, "prompt_tokens": 4,
            "calibration_tokens": 64, "users": 20}
DECISION_COLUMNS = ["request", "token", "layer", "t_start", "server", "next_server", "participants",
                    "dq", "est_delay_s", "replica", "exec_server", "exec_expert"]


def spec_for(router: str, topology: str, model: str, **workload):
    return parse_spec({"topology": topology, "router": {"name": router},
                       "workload": {**WORKLOAD, "model": model, **workload}})


class Setups:
    """Placements built once per (router, topology, model) for the session."""

    def __init__(self) -> None:
        self._cache: dict[tuple[str, str, str], RunSetup] = {}

    def get(self, router: str, topology: str, model: str) -> RunSetup:
        key = (router, topology, model)
        if key not in self._cache:
            self._cache[key] = build_setup(spec_for(router, topology, model))
        return self._cache[key]


@pytest.fixture(scope="session")
def setups() -> Setups:
    return Setups()


def fresh(setup: RunSetup) -> RunSetup:
    """The same placement with a new router instance (no state from earlier runs)."""
    cls = type(setup.router)
    router = cls(setup.problem, setup.router.params)
    router.bind(setup.deployment)
    return dataclasses.replace(setup, router=router)


def simulate(setup: RunSetup, request_targets=None) -> tuple[pd.DataFrame, pd.DataFrame]:
    s = fresh(setup)
    if request_targets is not None:
        s.request_targets = request_targets  # shadows the method on this instance
    writer = RecordWriter(None, s.shape.top_k)
    SimBackend(s, writer).run()
    writer.close()
    return writer.frames()


CASES = [pytest.param(r, t, m, id=f"{r}-{t}-{m}") for r in ROUTERS for t in TOPOLOGIES for m in MODELS]


@pytest.mark.parametrize("router, topology, model", CASES)
def test_placement_is_feasible_covering_and_deterministic(setups, router, topology, model):
    s = setups.get(router, topology, model)
    dep = s.deployment
    dep.check(s.shape, s.problem.budget)
    assert all(dep.by_expert[e] for e in range(s.shape.n_experts)), "an expert has no replica"
    assert all(dep.full_precision(e) for e in range(s.shape.n_experts)), "(c.4)"
    again = get_router(router)(s.problem, s.router.params).place()
    assert again.replicas == dep.replicas


@pytest.mark.parametrize("router, topology, model", CASES)
def test_runs_are_valid_deterministic_and_causal(setups, router, topology, model):
    s = setups.get(router, topology, model)
    tl, rq = simulate(s)
    assert len(rq) == len(s.requests) > 0 and (rq.status == "ok").all()
    check_records(s, tl, rq)
    tl2, rq2 = simulate(s)
    pd.testing.assert_frame_equal(tl, tl2)
    pd.testing.assert_frame_equal(rq, rq2)
    check_causal(s, tl)


def check_records(s: RunSetup, tl: pd.DataFrame, rq: pd.DataFrame) -> None:
    dep, sh, q = s.deployment, s.shape, s.quality
    k, L = sh.top_k, sh.n_layers
    reps = flat(tl.replica).astype(int)
    assert reps.shape == (len(tl), k)
    assert ((reps >= 0) & (reps < len(dep.replicas))).all(), "replica index out of range"
    rep_server = np.array([r.server for r in dep.replicas])
    rep_expert = np.array([r.expert for r in dep.replicas])
    rep_prec = np.array([int(r.precision) for r in dep.replicas])
    servers, experts = flat(tl.exec_server), flat(tl.exec_expert)
    targets, types = flat(tl.target), flat(tl.exec_type)
    assert (rep_server[reps] == servers).all() and (rep_expert[reps] == experts).all()
    assert (rep_prec[reps] == flat(tl.precision)).all()
    sub = types == ExecType.SUBSTITUTE
    fb = types == ExecType.FALLBACK
    exact = ~(sub | fb)
    assert (experts[exact] == targets[exact]).all(), "exact execution of another expert"
    assert (experts[fb] == targets[fb]).all() and (rep_prec[reps[fb]] == FULL_PRECISION).all()
    for t, e in zip(targets[sub], experts[sub]):
        assert e in {x for x, _ in q.substitutes[t]}, f"{e} is not a substitute of {t}"
    # targets are the gated experts of that layer, in layer order
    assert ((targets // sh.experts_per_layer) == tl.layer.to_numpy()[:, None]).all()
    distinct = np.array([len(set(row)) for row in servers])
    assert (tl.participants.to_numpy() == distinct).all() and (distinct <= k).all()
    assert tl.next_server.between(0, s.cluster.n - 1).all()
    # every token passes every layer, each layer starting where the previous one aggregated
    per_token = tl.sort_values(["request", "token", "layer"]).groupby(["request", "token"])
    for (req, _), g in per_token:
        assert list(g.layer) == list(range(L))
        home = int(rq.loc[rq.request == req, "home"].iloc[0])
        assert g.server.iloc[0] == home
        assert (g.server.to_numpy()[1:] == g.next_server.to_numpy()[:-1]).all()


def check_causal(s: RunSetup, tl: pd.DataFrame) -> None:
    """Perturb one token's gated experts from a middle layer on; every token-layer
    decided before the perturbed one must be decided identically."""
    L, E = s.shape.n_layers, s.shape.experts_per_layer
    decided = (tl.t_start + tl.dense_s).to_numpy()  # when the decision was taken
    pivot = tl[tl.layer == L // 2].iloc[len(tl[tl.layer == L // 2]) // 2]
    req, tok, layer = int(pivot.request), int(pivot.token), int(pivot.layer)
    t0 = decided[pivot.name]
    original = s.request_targets

    def perturbed(rid, n_tokens):
        out = original(rid, n_tokens)
        if rid == req:
            row = list(out[tok])
            for l in range(layer, L):
                row[l] = tuple(l * E + (e - l * E + 1) % E for e in row[l])
            out[tok] = tuple(row)
        return out

    tl2, _ = simulate(s, perturbed)
    decided2 = (tl2.t_start + tl2.dense_s).to_numpy()
    before = tl[decided < t0].sort_values(["request", "token", "layer"])[DECISION_COLUMNS]
    before2 = tl2[decided2 < t0].sort_values(["request", "token", "layer"])[DECISION_COLUMNS]
    assert len(before) > 0
    pd.testing.assert_frame_equal(before.reset_index(drop=True), before2.reset_index(drop=True))
    changed = tl2[(tl2.request == req) & (tl2.token == tok) & (tl2.layer >= layer)]
    assert not (flat(changed.target) == flat(
        tl[(tl.request == req) & (tl.token == tok) & (tl.layer >= layer)].target)).all()


def test_registry_lists_every_baseline():
    assert {"hetroute", "prism", "edgeshard", "moe-infinity", "petals", "greedy",
            "hetroute-no-setlevel", "hetroute-no-residency", "hetroute-no-quality",
            "hetroute-no-replication"} <= set(available())
    for name in available():
        cls = get_router(name)
        assert cls.name == name and sys.modules[cls.__module__].__doc__  # cites its source
        assert issubclass(cls.Params, RouterParams) and cls.Params().model_config["frozen"]
    assert get_router(OUT_OF_TREE).__name__ == "NearestReplica"


# -- the check itself can fail ---------------------------------------------------
class WrongExpert(get_router(OUT_OF_TREE)):
    """Broken on purpose: runs the next expert of the layer and calls it exact."""

    def route(self, tok, targets, view):
        E = self.problem.shape.experts_per_layer
        a = super().route(tok, tuple(e - e % E + (e % E + 1) % E for e in targets), view)
        return dataclasses.replace(a, targets=tuple(targets))


class Unseeded(get_router(OUT_OF_TREE)):
    """Broken on purpose: picks among replicas with an unseeded generator."""

    def route(self, tok, targets, view):
        rng = np.random.default_rng()
        dep = self.deployment
        a = super().route(tok, targets, view)
        return dataclasses.replace(a, replicas=tuple(int(rng.choice(dep.by_expert[e])) for e in targets))


@pytest.mark.parametrize("broken, check", [("WrongExpert", "records"), ("Unseeded", "determinism")])
def test_conformance_catches_broken_routers(broken, check):
    s = build_setup(spec_for(f"{__name__}:{broken}", "small3", "mixtral-8x7b"))
    tl, rq = simulate(s)
    with pytest.raises(AssertionError):
        if check == "records":
            check_records(s, tl, rq)
        else:
            pd.testing.assert_frame_equal(tl, simulate(s)[0])
