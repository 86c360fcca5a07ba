"""``make experiment FIG=N BACKEND=sim SCALE=smoke`` for every figure (the paper's and ours).

Runs the real entry point into a temporary results folder and checks that the
figure, its PDF and its claims file are written, that every claim of the spec
is in the claims file, and that a rerun skips every finished point. The wall
time of each figure is printed (a speed figure, not a timed assertion).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from analysis.render import FIGURES

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize("fig", FIGURES)
def test_smoke_experiment_renders_figure_and_claims(fig: int, tmp_path: Path) -> None:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    cmd = ["make", "-s", "experiment", f"FIG={fig}", "BACKEND=sim", "SCALE=smoke",
           f"RESULTS={tmp_path / 'results'}", f"FIGURES={tmp_path / 'figures'}",
           f"PYTHON={sys.executable}", "STAMP="]
    t = time.perf_counter()
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    print(f"fig{fig} sim smoke: {wall:.1f} s")
    for ext in ("png", "pdf", "claims.json"):
        assert (tmp_path / "figures" / f"fig{fig}.{ext}").stat().st_size > 0
    claims = json.loads((tmp_path / "figures" / f"fig{fig}.claims.json").read_text())
    rows = claims["claims"] if isinstance(claims, dict) else claims
    spec = yaml.safe_load((ROOT / "analysis" / "specs" / f"fig{fig}.yaml").read_text())
    assert {c["id"] for c in rows} == {c["id"] for c in spec["claims"]}
    assert any(c.get("measured") is not None for c in rows) or not spec["claims"]  # 10: none
    if spec["base"].get("workload", {}).get("gen_tokens"):  # a decode figure measures decode
        runs = list((tmp_path / "results" / f"fig{fig}").rglob("metrics.json"))
        assert runs and all(math.isfinite(json.loads(r.read_text())["tpot_ms"]) for r in runs)
    # the simulator has no network to check: no fidelity table, and none left from an emulated run
    assert claims["fidelity"] is None and not (tmp_path / "figures" / f"fig{fig}.fidelity.csv").exists()
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    m = re.search(r"(\d+) runs \((\d+) skipped\)", again.stdout)
    assert again.returncode == 0 and m and m.group(1) == m.group(2), again.stdout  # nothing rerun
