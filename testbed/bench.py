"""``make bench``: routing and simulator speed, printed and written to results/bench.json.

- ``router_decisions_per_s[model]``: HetRoute's Algorithm 2 decisions per second
  on one core, over held-out token trajectories on paper10 (each token starts
  at its home server and follows its own routing, so the mix of fast-path,
  enumeration and beam search is the one a run sees), with a view whose
  backlogs are drawn around one scheduling window.
  ``router_decisions_per_s_reference`` is the same for the Python reference
  (``Alg2Params(compiled=False)``), which decides identically.
- ``sim_token_layers_per_s``: token-layers per second of the discrete-event
  backend end to end (routing, events, records), Mixtral at the paper's load,
  under each physics (the hardware world drains a backlog after the arrivals; since
  2026-12-08 its attention is causal with the K/V news from the home, the figures' rule),
  and ``hardware-independent``: the hardware world with per-token attention, the setting
  every reading before 2026-12-08 was taken in (the causal world's asks, notices and
  fetches are about four times the events per token-layer).
- ``router_per_token_layer[physics]``: HetRoute's own CPU time per simulated token-layer
  (its decisions and its feedback) in a run of ``sim_token_layers_per_s``'s setting, and the
  token-layers/s that time alone allows: the ceiling the router puts on the simulator.
- ``fig9_full``: one run of the full-scale Fig. 9 sim sweep (its largest point,
  HetRoute at 80 req/s), timed, and the whole sweep's time extrapolated from it
  by the ratio of measured to estimated time (what ``sweep --dry-run`` prints).

Targets (issue 16): Mixtral >= 200,000 and Qwen >= 50,000 decisions/s, the simulator
>= 200,000 token-layers/s; floors of the earlier issues: 20,000 of each.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from hetroute.state import StateView, TokenView

from .records import RecordWriter
from .setup import build_setup
from .sim.backend import SimBackend
from .spec import parse_spec

FLOOR = 20_000


def _decisions(model: str, tokens: int, seed: int = 11, reference: bool = False) -> dict:
    spec = parse_spec({"name": f"bench-{model}", "workload": {"model": model, "duration_s": 1.0,
                                                              "warmup_s": 0.1, "gen_tokens": 0}})
    setup = build_setup(spec)
    from workloads import calibration_traffic
    traffic = calibration_traffic(setup.trace, setup.model, setup.users.home_probs(), tokens,
                                  seed=seed, task_probs=setup.users.task_probs)
    N = setup.cluster.n
    rng = np.random.default_rng(seed)
    view = StateView(N)
    view.backlog[:] = [float(x) for x in rng.exponential(0.5 * spec.window_s, N)]
    router = setup.router.decider(0)
    if reference:
        eng = router.engine
        eng.params = dataclasses.replace(eng.params, compiled=False)
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


#: The simulator's readings: name -> (physics, engine.attention; None: the world's default).
SIM_SETTINGS = {"hardware": ("hardware", None), "hardware-independent": ("hardware", "independent"),
                "paper": ("paper", None)}


def _backend(duration_s: float, physics: str,
             attention: str | None = None) -> tuple[SimBackend, RecordWriter]:
    """The bench's simulator setting: paper10, Mixtral, prompt only (pinned: the speeds
    README and bench.json report are of the figures' runs)."""
    engine = {} if attention is None else {"attention": attention}
    spec = parse_spec({"name": "bench-sim", "physics": physics, "engine": engine,
                       "workload": {"duration_s": duration_s, "warmup_s": 0.2, "gen_tokens": 0}})
    setup = build_setup(spec)
    writer = RecordWriter(None, setup.shape.top_k)
    return SimBackend(setup, writer), writer


def _sim(duration_s: float, physics: str, attention: str | None = None) -> dict:
    sim, writer = _backend(duration_s, physics, attention)
    t0 = time.perf_counter()
    st = sim.run()
    writer.close()
    dt = time.perf_counter() - t0
    return {"token_layers": st.token_layers, "events": st.events, "seconds": round(dt, 3),
            "per_s": round(st.token_layers / dt), "sim_time_s": round(st.sim_time_s, 3)}


def _router_share(duration_s: float, physics: str) -> dict:
    """The router's own CPU time per simulated token-layer, decisions (the core's measured
    time around ``route``) and feedback (``on_layer_done``, timed here), and the
    token-layers/s the simulator could not pass if everything but the router were free: the
    ceiling the router puts on ``sim_token_layers_per_s``. A run of its own, since timing
    the feedback slows the loop it times."""
    sim, writer = _backend(duration_s, physics)
    spent = [0.0]
    clock = time.thread_time
    for d in {id(x): x for x in sim.deciders}.values():
        def timed(rec, f=d.on_layer_done):
            t0 = clock()
            f(rec)
            spent[0] += clock() - t0
        d.on_layer_done = timed
    st = sim.run()
    writer.close()
    n = st.token_layers
    router_s = st.decision_cpu_s + spent[0]
    return {"decision_us": round(1e6 * st.decision_cpu_s / n, 2),
            "feedback_us": round(1e6 * spent[0] / n, 2),
            "ceiling_per_s": round(n / router_s) if router_s > 0 else None}


def _fig9_full() -> dict:
    """Time the full-scale Fig. 9 sim sweep's largest run; extrapolate the sweep."""
    from .runner import run_experiment
    from .sweep import default_jobs, estimate_s, expand, figure_path, load_figure
    with tempfile.TemporaryDirectory() as tmp:
        points = expand(load_figure(figure_path(9)), "sim", "full", Path(tmp))
        big = max((p for p in points if p.values["router.name"] == "hetroute"), key=estimate_s)
        t0 = time.perf_counter()
        run_experiment(big.spec, big.out_dir, progress=False)
        dt = time.perf_counter() - t0
    est = sum(estimate_s(p) for p in points)
    ratio = dt / estimate_s(big)
    jobs = default_jobs()
    return {"point": big.key, "run_s": round(dt, 1), "estimated_run_s": round(estimate_s(big), 1),
            "sweep_runs": len(points), "jobs": jobs,
            "sweep_estimate_s": round(est / jobs), "sweep_extrapolated_s": round(est * ratio / jobs)}


def main() -> None:
    out = Path("results")
    out.mkdir(exist_ok=True)
    res: dict = {"host": {"machine": platform.machine(), "cpus": os.cpu_count(),
                          "python": platform.python_version()}}
    dec = {m: _decisions(m, 400) for m in ("mixtral-8x7b", "qwen1.5-moe-a2.7b")}
    res["router_decisions"] = dec
    res["router_decisions_per_s"] = {m: d["per_s"] for m, d in dec.items()}
    res["router_decisions_per_s_reference"] = {
        m: _decisions(m, 100, reference=True)["per_s"] for m in dec}
    res["sim"] = {k: _sim(3.0, *v) for k, v in SIM_SETTINGS.items()}
    res["sim_token_layers_per_s"] = {p: r["per_s"] for p, r in res["sim"].items()}
    res["router_per_token_layer"] = {p: _router_share(3.0, p) for p in ("hardware", "paper")}
    res["fig9_full"] = _fig9_full()
    (out / "bench.json").write_text(json.dumps(res, indent=2))
    for m, v in res["router_decisions_per_s"].items():
        target = 200_000 if m.startswith("mixtral") else 50_000
        print(f"router_decisions_per_s[{m}] = {v:,}  (target {target:,}; Python reference "
              f"{res['router_decisions_per_s_reference'][m]:,})")
    for p, sim in res["sim"].items():
        physics, attention = SIM_SETTINGS[p]
        label = f"physics={physics}" + (f", attention={attention}" if attention else "")
        print(f"sim_token_layers_per_s[{label}] = {sim['per_s']:,}  (floor {FLOOR:,}, "
              f"target 200,000; {sim['token_layers']:,} token-layers in {sim['seconds']} s)")
    for p, r in res["router_per_token_layer"].items():
        print(f"router per simulated token-layer [physics={p}]: decisions {r['decision_us']} us, "
              f"feedback {r['feedback_us']} us: the simulator cannot pass "
              f"{r['ceiling_per_s']:,} token-layers/s with this router, all else free")
    f9 = res["fig9_full"]
    print(f"fig9 full sim sweep: one run ({f9['point']}) {f9['run_s']} s (estimated "
          f"{f9['estimated_run_s']} s); {f9['sweep_runs']} runs on {f9['jobs']} jobs: "
          f"~{f9['sweep_extrapolated_s'] / 60:.0f} min (dry-run estimate "
          f"{f9['sweep_estimate_s'] / 60:.0f} min; target 15 min)")
    print("written: results/bench.json")


if __name__ == "__main__":
    main()
