"""``make bench``: routing and simulator speed, printed and written to results/bench.json.

- ``router_decisions_per_s[model]``: HetRoute's Algorithm 2 decisions per second
  on one core, over held-out token trajectories on paper10 (each token starts
  at its home server and follows its own routing, so the mix of fast-path,
  enumeration and beam search is the one a run sees), with a view whose
  backlogs are drawn around one scheduling window.
- ``sim_token_layers_per_s``: token-layers per second of the discrete-event
  backend end to end (routing, events, records), Mixtral at the paper's load,
  under each physics (the hardware world drains a backlog after the arrivals).

Floors from the issue: 20,000 of each; aim 100,000.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import numpy as np

from hetroute.state import StateView, TokenView

from .records import RecordWriter
from .setup import build_setup
from .sim.backend import SimBackend
from .spec import parse_spec

FLOOR = 20_000


def _decisions(model: str, tokens: int, seed: int = 11) -> dict:
    spec = parse_spec({"name": f"bench-{model}", "workload": {"model": model, "duration_s": 1.0,
                                                              "warmup_s": 0.1}})
    setup = build_setup(spec)
    from workloads import calibration_traffic
    traffic = calibration_traffic(setup.trace, setup.model, setup.users.home_probs(), tokens,
                                  seed=seed)
    N = setup.cluster.n
    rng = np.random.default_rng(seed)
    view = StateView(N)
    view.backlog[:] = [float(x) for x in rng.exponential(0.5 * spec.window_s, N)]
    router = setup.router.decider(0)
    route = router.route
    T, L, _ = traffic.targets.shape
    jobs = []
    for i in range(T):
        jobs.append((int(traffic.homes[i]), [tuple(int(e) for e in traffic.targets[i, l])
                                             for l in range(L)]))
    t0 = time.perf_counter()
    n = 0
    for home, layers in jobs:
        tok = TokenView(0, 0, home, spec.quality.budget)
        for layer, targets in enumerate(layers):
            tok.layer = layer
            a = route(tok, targets, view)
            tok.lam_acc += a.dq
            tok.server = a.next_server
            n += 1
    dt = time.perf_counter() - t0
    return {"decisions": n, "seconds": round(dt, 3), "per_s": round(n / dt),
            "placement_s": round(setup.placement_s, 2),
            "replicas_per_expert": round(setup.deployment.summary(setup.shape)["replicas_per_expert"], 2)}


def _sim(duration_s: float, physics: str) -> dict:
    spec = parse_spec({"name": "bench-sim", "physics": physics,
                       "workload": {"duration_s": duration_s, "warmup_s": 0.2}})
    setup = build_setup(spec)
    writer = RecordWriter(None, setup.shape.top_k)
    t0 = time.perf_counter()
    st = SimBackend(setup, writer).run()
    writer.close()
    dt = time.perf_counter() - t0
    return {"token_layers": st.token_layers, "events": st.events, "seconds": round(dt, 3),
            "per_s": round(st.token_layers / dt), "sim_time_s": round(st.sim_time_s, 3)}


def main() -> None:
    out = Path("results")
    out.mkdir(exist_ok=True)
    res: dict = {"host": {"machine": platform.machine(), "cpus": os.cpu_count(),
                          "python": platform.python_version()}}
    dec = {m: _decisions(m, 400) for m in ("mixtral-8x7b", "qwen1.5-moe-a2.7b")}
    res["router_decisions"] = dec
    res["router_decisions_per_s"] = {m: d["per_s"] for m, d in dec.items()}
    res["sim"] = {p: _sim(3.0, p) for p in ("hardware", "paper")}
    res["sim_token_layers_per_s"] = {p: r["per_s"] for p, r in res["sim"].items()}
    (out / "bench.json").write_text(json.dumps(res, indent=2))
    for m, v in res["router_decisions_per_s"].items():
        floor = f"floor {FLOOR:,}" if m.startswith("mixtral") else "no floor: the issue sets one for the Mixtral shape"
        print(f"router_decisions_per_s[{m}] = {v:,}  ({floor})")
    for p, sim in res["sim"].items():
        print(f"sim_token_layers_per_s[physics={p}] = {sim['per_s']:,}  (floor {FLOOR:,}; "
              f"{sim['token_layers']:,} token-layers in {sim['seconds']} s)")
    print("written: results/bench.json")


if __name__ == "__main__":
    main()
