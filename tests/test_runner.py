"""End to end: a run writes its folder, same seed gives identical records, CLI errors are one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd
import pytest

import inspect

from testbed.backends import BACKENDS, backend_class
from testbed.records import read_records
from testbed.runner import is_complete, run_experiment
from testbed.setup import build_setup
from testbed.spec import load_spec, parse_spec

TINY = {"topology": "small3", "workload": {"model": "switch", "duration_s": 0.6, "warmup_s": 0.1,
                                           "rate_per_s": 20, "calibration_tokens": 64,
                                           "gen_tokens": 0}}  # prompt only: short runs


def test_same_seed_same_records_and_different_seed_differs(tmp_path):
    spec = parse_spec(TINY)
    a = run_experiment(spec, tmp_path / "a", progress=False)
    b = run_experiment(spec, tmp_path / "b", progress=False)
    run_experiment(spec.with_overrides({"seed": 1}), tmp_path / "c", progress=False)
    ta, ra = read_records(tmp_path / "a")
    tb, rb = read_records(tmp_path / "b")
    tc, _ = read_records(tmp_path / "c")
    assert len(ta) > 0 and len(ra) > 0
    pd.testing.assert_frame_equal(ta, tb)
    pd.testing.assert_frame_equal(ra, rb)
    assert not ta.equals(tc)
    assert a.metrics == b.metrics
    assert is_complete(tmp_path / "a")


def test_run_folder_carries_provenance_and_resolved_spec(tmp_path):
    spec = parse_spec(TINY)
    run_experiment(spec, tmp_path / "r", progress=False)
    info = json.loads((tmp_path / "r" / "run.json").read_text())
    assert info["status"] == "complete" and info["seed"] == 0 and info["backend"] == "sim"
    assert info["versions"]["numpy"] and "deployment" in info and "placement" in info
    resolved = (tmp_path / "r" / "spec.resolved.yaml").read_text()
    assert "rate_per_s: 20" in resolved and "budget: 0.02" in resolved
    m = json.loads((tmp_path / "r" / "metrics.json").read_text())
    assert m["requests"] > 0 and m["budget_violations"] == 0
    # every measured token routed through every layer
    tl, rq = read_records(tmp_path / "r")
    per_token = tl.groupby(["request", "token"]).layer.count()
    assert (per_token == 12).all()


def test_resolved_spec_carries_the_calibrated_decision_time_and_reruns_the_same(tmp_path):
    """The decision time is measured on this host; the resolved config keeps the number
    charged, so running it again elsewhere (no shared cache) gives the same records."""
    run_experiment(parse_spec(TINY), tmp_path / "r", progress=False)
    info = json.loads((tmp_path / "r" / "run.json").read_text())
    resolved = load_spec(tmp_path / "r" / "spec.resolved.yaml")
    assert resolved.engine.decision_s == info["decision_s_calibrated"] > 0
    run_experiment(resolved, tmp_path / "elsewhere" / "r2", progress=False)
    pd.testing.assert_frame_equal(read_records(tmp_path / "r")[0],
                                  read_records(tmp_path / "elsewhere" / "r2")[0])


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "testbed", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=300)


def test_cli_run_prints_metrics(tmp_path):
    spec = tmp_path / "s.yaml"
    spec.write_text("name: cli\ntopology: small3\nworkload: {model: switch, duration_s: 0.5, "
                    "warmup_s: 0.1, rate_per_s: 10, calibration_tokens: 64, gen_tokens: 0}\n")
    r = _cli("run", str(spec), "--quiet", "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    assert "mean ms" in r.stdout and "hetroute" in r.stdout
    assert (tmp_path / "out" / "metrics.json").exists()


@pytest.mark.parametrize("content, needle", [
    ("workload: {rate_per_s: -1}\n", "workload.rate_per_s"),
    ("router: {name: nope}\n", "unknown router"),
    ("topology: nowhere.yaml\n", "no such topology"),
    ("router: {name: hetroute, params: {beam_width: 0}}\n", "beam_width"),
])
def test_cli_bad_input_is_one_line(tmp_path, content, needle):
    spec = tmp_path / "bad.yaml"
    spec.write_text(content)
    r = _cli("run", str(spec), "--quiet", "--out", str(tmp_path / "o"))
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.strip().splitlines() if ln]
    assert len(lines) == 1 and needle in lines[0], r.stderr


def test_placement_cache_reuses_the_same_deployment(tmp_path):
    spec = parse_spec(TINY)
    cache = tmp_path / "cache"
    a = run_experiment(spec, tmp_path / "a", progress=False, placement_cache=cache)
    assert len(list(cache.glob("*.json"))) == 1 and "cached" not in a.info["placement"]
    b = run_experiment(spec.with_overrides({"workload.rate_per_s": 20}), tmp_path / "b",
                       progress=False, placement_cache=cache)
    assert b.info["placement"].get("cached") is True
    pd.testing.assert_frame_equal(read_records(tmp_path / "a")[0], read_records(tmp_path / "b")[0])
    # anything placement depends on makes a new entry
    run_experiment(spec.with_overrides({"router.params.memory_ratio": 1.5}), tmp_path / "c",
                   progress=False, placement_cache=cache)
    assert len(list(cache.glob("*.json"))) == 2


def test_editing_an_out_of_tree_router_invalidates_its_cached_placement(tmp_path, monkeypatch):
    mod = tmp_path / "myrouter_cache_probe.py"
    mod.write_text("from examples.nearest_replica import NearestReplica\n\n"
                   "class Mine(NearestReplica):\n    name = 'mine'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = parse_spec({**TINY, "router": {"name": "myrouter_cache_probe:Mine"}})
    cache = tmp_path / "cache"
    build_setup(spec, placement_cache=cache)
    assert build_setup(spec, placement_cache=cache).router.placement_report.get("cached") is True
    mod.write_text(mod.read_text() + "    # place() edited\n")
    assert "cached" not in build_setup(spec, placement_cache=cache).router.placement_report
    assert len(list(cache.glob("*.json"))) == 2


def test_rerun_into_a_folder_drops_what_an_earlier_attempt_left(tmp_path):
    out = tmp_path / "r"
    (out / "quality_inrun").mkdir(parents=True)
    (out / "quality_inrun" / "w0.jsonl").write_text('{"request": 0}\n')
    for name in ("quality_inrun.csv", "quality_replay.csv", "quality.json"):
        (out / name).write_text("stale")
    run_experiment(parse_spec(TINY), out, progress=False)
    assert not (out / "quality_inrun").exists()
    assert not any((out / n).exists() for n in ("quality_inrun.csv", "quality_replay.csv", "quality.json"))
    assert is_complete(out)


def test_calibrated_decision_time_is_stored_once_with_the_placement(tmp_path):
    """A decision's calibrated CPU time is timed once per placement and machine and stored
    in the cache entry; loading it writes nothing (emulated workers load one entry at once),
    and the emulator charges the same constant (issue 14 item 6: it charged each decision's
    CPU time measured on a shared host, 5-30x the simulator's constant)."""
    import json
    import os

    from testbed.setup import build_setup
    cache = tmp_path / "cache"
    s1 = build_setup(parse_spec(TINY), placement_cache=cache)
    (entry,) = cache.glob("*.json")
    stored = json.loads(entry.read_text())["decision"]
    assert stored["decision_s"] == s1.decision_s > 0 and s1.notes["decision_s_calibrated"] == s1.decision_s
    before = os.stat(entry).st_mtime_ns
    s2 = build_setup(parse_spec(TINY), placement_cache=cache)
    assert s2.decision_s == s1.decision_s and os.stat(entry).st_mtime_ns == before
    emu = build_setup(parse_spec({**TINY, "backend": "emu"}), placement_cache=cache)
    assert emu.decision_s == s1.decision_s and emu.notes["decision_s_calibrated"] == s1.decision_s
    fixed = build_setup(parse_spec(TINY).with_overrides({"engine.decision_s": 2e-5}))
    assert fixed.decision_s == 2e-5


def test_metrics_carry_each_routers_memory_use_against_its_budget(tmp_path):
    """Budgets differ by design (issue 13): the table shows what each placement holds."""
    from testbed.metrics import format_table
    rows = {}
    for router in ("edgeshard", "hetroute"):
        spec = parse_spec({**TINY, "router": {"name": router}})
        rows[router] = run_experiment(spec, tmp_path / router, progress=False).metrics
    es, hr = rows["edgeshard"], rows["hetroute"]
    assert es["mem_x_model"] == pytest.approx(1.0)  # one FP16 copy of every expert
    assert hr["mem_x_model"] > 1.0  # replication
    for m in rows.values():
        assert 0 < m["mem_gpu_gb"] <= m["mem_budget_gpu_gb"] + 1e-9
        assert 0 <= m["mem_cpu_gb"] <= m["mem_budget_cpu_gb"] + 1e-9
    table = format_table(rows)
    assert "GPU GB" in table and "1.00x" in table


def test_decision_calibration_keeps_each_decisions_fastest_pass():
    """A pass slowed by other load (here: the first, every decision 10x) or one slow
    decision in another pass does not move the constant: each token-layer counts its
    fastest pass, the constant is their median."""
    from testbed.core import calibrate_decision_s
    from testbed.setup import build_setup

    s = build_setup(parse_spec(TINY).with_overrides({"engine.decision_s": 0.0}))
    calls = {"n": 0, "t": 0.0}

    def clock():  # start and stop alternate; decision j of pass p lasts dur(p, j)
        k = calls["n"]
        calls["n"] += 1
        if k % 2 == 0:
            return calls["t"]
        j = k // 2
        p, i = divmod(j, per_pass)
        calls["t"] += (10 if p == 0 else 1) * (1 + i % 3) * 1e-6 + (5e-3 if (p, i) == (2, 7) else 0)
        return calls["t"]

    L = s.shape.n_layers
    per_pass = min(64, len(s.problem.calibration.homes) * L)
    assert calibrate_decision_s(s.router, samples=64, repeats=3, clock=clock) == 2e-6
    calls.update(n=0, t=0.0)
    assert calibrate_decision_s(s.router, samples=64, repeats=1, clock=clock) == 2e-5  # one pass: the loaded one


def test_a_given_deployment_is_run_as_it_is_and_a_non_cacheable_router_must_match_it(
        tmp_path, monkeypatch):
    """The emulator's workers run the deployment the runner placed (deployment.json), not a
    placement of their own or a cache entry found by hashing their inputs."""
    from hetroute.deployment import Deployment
    from hetroute.system import FULL_PRECISION
    from testbed.setup import save_deployment
    from testbed.spec import SpecError

    def one_exact_copy(dep: Deployment) -> Deployment:  # still valid: c.4 holds
        first = {}
        for r in dep.replicas:
            if r.precision == FULL_PRECISION and r.expert not in first:
                first[r.expert] = r
        return Deployment(tuple(first.values()), dep.n_experts, dep.n_servers)

    placed = build_setup(parse_spec(TINY)).deployment
    given = one_exact_copy(placed)
    assert given.replicas != placed.replicas  # HetRoute replicates: the two differ
    path = tmp_path / "deployment.json"
    save_deployment(path, given, {"note": "the runner's"})
    got = build_setup(parse_spec(TINY), deployment_file=path)
    assert got.deployment.replicas == given.replicas
    assert got.router.placement_report["given"] == str(path)

    mod = tmp_path / "fresh_probe.py"  # a router that cannot be handed a deployment
    mod.write_text("from examples.nearest_replica import NearestReplica\n\n"
                   "class Fresh(NearestReplica):\n    name = 'fresh'\n    cacheable_placement = False\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = parse_spec({**TINY, "router": {"name": "fresh_probe:Fresh"}})
    own = build_setup(spec).deployment
    save_deployment(path, own, {})
    assert build_setup(spec, deployment_file=path).deployment.replicas == own.replicas
    save_deployment(path, Deployment(own.replicas[1:] + own.replicas[:1], own.n_experts, own.n_servers), {})
    with pytest.raises(SpecError, match="placed differently"):
        build_setup(spec, deployment_file=path)


def test_every_backend_is_built_the_same_way_and_chosen_by_name():
    """Issue 15: one constructor signature, so the runner builds any backend alike."""
    sigs = {name: [(p.name, p.default) for p in
                   inspect.signature(backend_class(name).__init__).parameters.values()]
            for name in BACKENDS}
    assert set(sigs) == {"sim", "emu"}
    assert all(sig == [("self", inspect.Parameter.empty), ("setup", inspect.Parameter.empty),
                       ("writer", inspect.Parameter.empty), ("progress", False)]
               for sig in sigs.values()), sigs
    assert all(callable(getattr(backend_class(name), "run", None)) for name in BACKENDS)
    with pytest.raises(KeyError, match="unknown backend 'gpu'; known: emu, sim"):
        backend_class("gpu")


def test_run_json_carries_the_backends_counters_and_the_setups_notes(tmp_path):
    run_experiment(parse_spec(TINY), tmp_path / "r", progress=True)  # the progress bar path too
    stats = json.loads((tmp_path / "r" / "run.json").read_text())["stats"]
    assert stats["token_layers"] > 0 and stats["decisions"] > 0  # SimStats, as a dict
    assert stats["decision_s_calibrated"] > 0  # the set-up's note
