"""Capacity search (issue 12): the highest load with 90% of requests within the SLA."""

from __future__ import annotations

import pytest

import json
import os

from testbed.capacity import describe, find_capacity, read_capacities
from testbed.spec import SpecError, parse_spec

# Qwen1.5-MoE through EdgeShard on small3: mean 89 ms (P99 131) at 8 req/s, 176 ms at 128
SPEC = {"name": "cap", "topology": "small3", "sla_s": 0.2,
        "workload": {"model": "qwen", "duration_s": 2.0, "warmup_s": 0.2, "calibration_tokens": 64},
        "engine": {"decision_s": 0.0}}


@pytest.mark.slow
def test_capacity_brackets_the_sla_target_and_reuses_its_runs(tmp_path):
    spec = parse_spec(SPEC)
    logs: list[str] = []
    c = find_capacity(spec, "edgeshard", tmp_path, lo=8.0, hi=512.0, rel_tol=0.25, log=logs.append)
    assert c.bounded and c.capacity_rps >= 8.0
    met = {r: sla for r, sla, _ in c.probes}
    assert met[c.capacity_rps] >= 0.9  # the answer met the target
    above = [r for r in met if r > c.capacity_rps]
    assert above and min(above) <= c.capacity_rps * 1.25 + 1e-9 and met[min(above)] < 0.9
    runs = sorted(p.name for p in (tmp_path / "capacity" / "cap-hardware" / "edgeshard").iterdir())
    again = find_capacity(spec, "edgeshard", tmp_path, lo=8.0, hi=512.0, rel_tol=0.25, log=logs.append)
    assert again.capacity_rps == c.capacity_rps
    assert sorted(p.name for p in (tmp_path / "capacity" / "cap-hardware" / "edgeshard").iterdir()) == runs
    # the answer is kept beside the probes, where compare and the figures read it
    saved = read_capacities(tmp_path, "hardware", 0.2)["edgeshard"]
    assert saved["capacity_rps"] == c.capacity_rps and saved["spec"] == "cap"
    assert read_capacities(tmp_path, "paper", 0.2) == {} and read_capacities(tmp_path, "hardware", 0.3) == {}


def test_capacity_refuses_bad_bounds_and_the_emulator(tmp_path):
    with pytest.raises(SpecError, match="lo < hi"):
        find_capacity(parse_spec(SPEC), "edgeshard", tmp_path, lo=5, hi=1)
    with pytest.raises(SpecError, match="simulator"):
        find_capacity(parse_spec({**SPEC, "backend": "emu"}), "edgeshard", tmp_path)


def _saved(root, spec, router, physics, sla, cap, mtime):
    d = root / "capacity" / f"{spec}-{physics}" / router
    d.mkdir(parents=True)
    f = d / "capacity.json"
    f.write_text(json.dumps({"router": router, "capacity_rps": cap, "bounded": True, "probes": [],
                             "sla_s": sla, "target": 0.9, "physics": physics, "spec": spec,
                             "duration_s": 4.0, "lo": 1.0, "hi": 320.0}))
    os.utime(f, (mtime, mtime))


def test_read_capacities_keeps_the_world_and_sla_and_the_newest_search(tmp_path):
    _saved(tmp_path, "a", "petals", "hardware", 0.3, 1.2, 100)
    _saved(tmp_path, "b", "petals", "hardware", 0.3, 2.5, 200)  # newer search of the same router
    _saved(tmp_path, "a", "hetroute", "hardware", 0.3, 0.0, 100)
    _saved(tmp_path, "c", "hetroute", "hardware", 1.0, 16.0, 300)  # another SLA
    _saved(tmp_path, "a", "edgeshard", "paper", 0.3, 99.0, 100)  # another world
    got = read_capacities(tmp_path, "hardware", 0.3)
    assert sorted(got) == ["hetroute", "petals"] and got["petals"]["capacity_rps"] == 2.5
    assert describe(got["petals"]) == "2.5 req/s"
    assert describe(got["hetroute"]) == "0 (1 req/s already misses)"
