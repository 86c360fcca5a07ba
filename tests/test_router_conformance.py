"""Conformance: every registered router, and an out-of-tree one, passes the public checker
(``testbed.conformance``, also ``python -m testbed check-router NAME``), and the checker
catches routers broken on purpose.

Placements are built once per (router, topology, model) for the session; each run binds
a fresh router instance to them.
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

from hetroute.routers import RouterParams, available, get_router
from testbed.cli import app
from testbed.conformance import (MODELS, TOPOLOGIES, ConformanceError, check_causal,
                                 check_determinism, check_placement, check_records,
                                 check_router, simulate, spec_for)
from testbed.setup import RunSetup, build_setup

OUT_OF_TREE = "examples.nearest_replica:NearestReplica"
ROUTERS = available() + [OUT_OF_TREE]


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


# paper10 with the larger models repeats the small3 checks at scale: `make test` runs them,
# `make test-fast` (the inner loop) keeps small3 for every model and paper10 for Switch
CASES = [pytest.param(r, t, m, id=f"{r}-{t}-{m}",
                      marks=pytest.mark.slow if t == "paper10" and "switch" not in m else ())
         for r in ROUTERS for t in TOPOLOGIES for m in MODELS]


@pytest.mark.parametrize("router, topology, model", CASES)
def test_placement_is_feasible_covering_and_deterministic(setups, router, topology, model):
    check_placement(setups.get(router, topology, model))


@pytest.mark.parametrize("router, topology, model", CASES)
def test_runs_are_valid_deterministic_and_causal(setups, router, topology, model):
    s = setups.get(router, topology, model)
    tl, rq = simulate(s)
    check_records(s, tl, rq)
    check_determinism(s, tl, rq)
    check_causal(s, tl)


def test_registry_lists_every_baseline():
    assert {"hetroute", "prism", "edgeshard", "edgeshard-tp", "moe-infinity", "petals", "greedy",
            "hetroute-no-setlevel", "hetroute-no-residency", "hetroute-no-quality",
            "hetroute-no-replication"} <= set(available())
    for name in available():
        cls = get_router(name)
        assert cls.name == name and sys.modules[cls.__module__].__doc__  # cites its source
        assert issubclass(cls.Params, RouterParams) and cls.Params().model_config["frozen"]
    assert get_router(OUT_OF_TREE).__name__ == "NearestReplica"


# -- the checker itself can fail --------------------------------------------------
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
def test_checker_catches_broken_routers(broken, check):
    report = check_router(f"{__name__}:{broken}", topologies=("small3",), models=("mixtral-8x7b",))
    assert not report.ok and report.failures[0].check == check
    assert "how to fix" in report.format()


def test_each_check_raises_a_conformance_error():
    s = build_setup(spec_for(f"{__name__}:Unseeded", "small3", "mixtral-8x7b"))
    tl, rq = simulate(s)
    with pytest.raises(ConformanceError, match="determinism: two runs differ"):
        check_determinism(s, tl, rq)


def test_running_another_expert_as_exact_is_stopped_by_the_backend():
    """The core derives the quality increment of what ran, so an execution that is neither
    the target nor one of its substitutes cannot pass unnoticed."""
    s = build_setup(spec_for(f"{__name__}:WrongExpert", "small3", "mixtral-8x7b"))
    with pytest.raises(RuntimeError, match="neither it nor one of its substitutes"):
        simulate(s)


def test_check_router_command(tmp_path):
    cli = CliRunner()
    ok = cli.invoke(app, ["check-router", OUT_OF_TREE, "--topology", "small3", "--model", "switch-base-8"])
    assert ok.exit_code == 0, ok.output
    assert "0 failed" in ok.stdout
    bad = cli.invoke(app, ["check-router", f"{__name__}:Unseeded", "--topology", "small3",
                           "--model", "switch-base-8"])
    assert bad.exit_code == 1 and "FAIL determinism" in bad.stdout and "how to fix" in bad.stdout
    unknown = cli.invoke(app, ["check-router", "no-such-router"])
    assert unknown.exit_code == 2 and "unknown router" in unknown.stderr


def test_an_installed_plugin_registers_by_name(tmp_path, monkeypatch):
    """A package with a ``hetroute.routers`` entry point is found by its router's name."""
    from hetroute import routers

    (tmp_path / "plugrouter.py").write_text(
        "from examples.nearest_replica import NearestReplica\n\n"
        "class Plugged(NearestReplica):\n    name = 'plugged-nearest'\n")
    dist = tmp_path / "plugrouter-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: plugrouter\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[hetroute.routers]\nplugged = plugrouter:Plugged\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    routers._discover.cache_clear()
    try:
        assert "plugged-nearest" in available()
        assert get_router("plugged-nearest").__name__ == "Plugged"
    finally:
        monkeypatch.undo()
        routers._discover.cache_clear()
    assert "plugged-nearest" not in available()


class Understating(get_router("hetroute")):
    """Claims every layer is free of quality loss (dq = 0), whatever it executes."""

    def route(self, tok, targets, view):
        return dataclasses.replace(super().route(tok, targets, view), dq=0.0)


def test_the_backend_not_the_router_accounts_quality():
    """A router reporting dq = 0 for quantized or substitute executions does not escape the
    budget: the records carry the increment the quality model gives for what ran."""
    honest = build_setup(spec_for("hetroute", "paper10", "mixtral-8x7b"))
    lying = build_setup(spec_for(f"{__name__}:Understating", "paper10", "mixtral-8x7b"))
    tl_h, _ = simulate(honest)
    tl_l, _ = simulate(lying)
    assert (tl_h.dq > 0).any(), "the honest run executed nothing lossy: the test proves nothing"
    np.testing.assert_array_equal(tl_l.dq.to_numpy(), tl_h.dq.to_numpy())
    q, dep = lying.quality, lying.deployment
    derived = [sum(q.increment(int(t), dep.replicas[int(r)].expert, int(dep.replicas[int(r)].precision))
                   for t, r in zip(ts, rs)) for ts, rs in zip(tl_l.target, tl_l.replica)]
    np.testing.assert_allclose(tl_l.dq.to_numpy(), derived, rtol=1e-12, atol=0)
