"""``agree``'s pooling over seeds, on the simulator alone (the emulator's side is the same
code with another backend)."""

from __future__ import annotations

import json

import pytest

from testbed.agreement import TOL, _compare, _side
from testbed.runner import is_done
from testbed.spec import parse_spec

SPEC = {"name": "agree-test", "topology": "small3", "router": {"name": "edgeshard"},
        "engine": {"decision_s": 5e-6},
        "workload": {"rate_per_s": 10, "duration_s": 0.6, "warmup_s": 0.1, "gen_tokens": 0,
                     "calibration_tokens": 64}}


def test_one_seed_is_the_runs_own_metrics_and_seeds_pool_their_requests(tmp_path):
    spec = parse_spec(SPEC)
    one = _side(spec, 1, tmp_path, "sim-edgeshard")
    m = json.loads((tmp_path / "sim-edgeshard" / "metrics.json").read_text())
    assert one.mean_ms == pytest.approx(m["mean_ms"]) and one.p99_ms == pytest.approx(m["p99_ms"])
    # the spec as written (``quality.replay: auto``) matches the run that resolved it: reused
    assert spec.quality.replay == "auto" and is_done(tmp_path / "sim-edgeshard", spec)
    stamp = (tmp_path / "sim-edgeshard" / "run.json").stat().st_mtime_ns
    three = _side(spec, 3, tmp_path, "sim-edgeshard")  # seed 0 reused, seeds 1 and 2 run
    assert (tmp_path / "sim-edgeshard" / "run.json").stat().st_mtime_ns == stamp
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("sim-")) == \
        ["sim-edgeshard", "sim-edgeshard-seed1", "sim-edgeshard-seed2"]
    sizes = [_side(parse_spec({**SPEC, "seed": k}), 1, tmp_path, d).latency_s.size  # reused
             for k, d in enumerate(["sim-edgeshard", "sim-edgeshard-seed1", "sim-edgeshard-seed2"])]
    assert three.latency_s.size == sum(sizes) > one.latency_s.size
    row = _compare("emu/sim", "edgeshard", three, one, 3)
    assert row.requests == (three.latency_s.size, one.latency_s.size) and row.seeds == 3
    assert row.ok_mean == (abs(three.mean_ms / one.mean_ms - 1) <= TOL["emu/sim"][0])
