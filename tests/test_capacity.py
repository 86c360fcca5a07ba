"""Capacity search (issue 12): the highest load with 90% of requests within the SLA."""

from __future__ import annotations

import pytest

from testbed.capacity import find_capacity
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


def test_capacity_refuses_bad_bounds_and_the_emulator(tmp_path):
    with pytest.raises(SpecError, match="lo < hi"):
        find_capacity(parse_spec(SPEC), "edgeshard", tmp_path, lo=5, hi=1)
    with pytest.raises(SpecError, match="simulator"):
        find_capacity(parse_spec({**SPEC, "backend": "emu"}), "edgeshard", tmp_path)
