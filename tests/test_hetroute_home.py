"""examples/hetroute_home.py: HetRoute gathering every layer at the request's home."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from examples.hetroute_home import HetRouteHome
from hetroute.routers import get_router
from hetroute.state import StateView, TokenView
from testbed.conformance import check_router
from testbed.runner import run_experiment
from testbed.setup import build_setup
from testbed.spec import parse_spec

NAME = "examples.hetroute_home:HetRouteHome"


def _spec(router: str, model: str, **engine) -> dict:
    return {"topology": "small3", "router": {"name": router}, "engine": engine,
            "workload": {"model": model, "duration_s": 0.4, "warmup_s": 0.1, "rate_per_s": 40,
                         "calibration_tokens": 64, "prompt_tokens": 8, "gen_tokens": 2}}


@pytest.mark.parametrize("model", ["mixtral-8x7b", "qwen1.5-moe-a2.7b"])
def test_every_decision_gathers_at_the_home_whatever_the_backlogs(model):
    """Mixtral's two targets go through the pair enumeration, Qwen's four through the
    enumeration or the beam, a third of them through the emergency fallback; eq. (11) would
    gather at a participant under most backlogs."""
    setup = build_setup(parse_spec(_spec(NAME, model)))
    router = setup.router
    assert get_router(NAME) is HetRouteHome
    N = router.problem.cluster.n
    E = router.problem.shape.experts_per_layer
    k = router.problem.shape.top_k
    rng = np.random.default_rng(0)
    deciders = [router.decider(n) for n in range(N)]
    gathered_elsewhere = 0
    for i in range(300):
        home = int(rng.integers(N))
        view = StateView(N)
        view.backlog[:] = rng.random(N) * 0.02
        if i % 3 == 0:  # guard (19) admits nothing: Algorithm 2's emergency fallback
            view.admitted[:] = 1.0
        tok = TokenView(i, 0, home, router.problem.lam_max, layer=int(rng.integers(8)))
        targets = tuple(int(e) for e in rng.choice(E, k, replace=False))
        a = deciders[home].route(tok, targets, view)
        assert a.next_server == home
        servers = {router.deployment.replicas[r].server for r in a.replicas}
        gathered_elsewhere += home not in servers  # the fan-in comes home from elsewhere
    assert gathered_elsewhere > 0  # the home is not merely where everything ran


def test_it_places_as_hetroute_and_passes_the_conformance_checks():
    a = build_setup(parse_spec(_spec(NAME, "mixtral-8x7b"))).router.deployment
    b = build_setup(parse_spec(_spec("hetroute", "mixtral-8x7b"))).router.deployment
    assert a.replicas == b.replicas
    report = check_router(NAME, topologies=("small3",), models=("qwen1.5-moe-a2.7b",))
    assert report.ok, report.format()


@pytest.mark.slow
def test_under_causal_attention_its_requests_never_fetch_keys_and_values(tmp_path):
    for name in ("hetroute", NAME):
        out = tmp_path / name.split(":")[-1]
        # a fixed decision time: the variant's is timed on the host, and how its decisions
        # queue at the home decides whether any token waits at all
        run_experiment(parse_spec({**_spec(name, "mixtral-8x7b", attention="causal",
                                           decision_s=1.3e-05), "name": "h"}), out,
                       progress=False)
        stats = json.loads((out / "run.json").read_text())["stats"]
        tl = pd.read_parquet(out / "token_layers")
        rq = pd.read_parquet(out / "requests")
        home = tl.request.map(rq.set_index("request").home)
        if name == "hetroute":  # eq. (11) moves tokens: their K/V follow them
            assert (tl.next_server != home).any() and stats["kv_fetches"] > 0
        else:
            assert (tl.server == home).all() and (tl.next_server == home).all()
            assert stats["kv_fetches"] == 0 == stats["kv_bytes"] and stats["kv_waits"] > 0
