"""Whether a run kept up with its load (issue 13 item 4): the latency trend, and the share of
the second half's arrivals matched by requests getting home in it (``served_ratio``)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from testbed.cli import app
from testbed.metrics import SERVED_MIN_ARRIVALS, stability
from testbed.runner import run_experiment
from testbed.spec import parse_spec


def _requests(arrivals, latencies):
    a, lat = np.asarray(arrivals, float), np.asarray(latencies, float)
    return pd.DataFrame({"arrival_s": a, "latency_s": lat, "done_s": a + lat, "status": "ok"})


def test_a_run_that_keeps_up_is_stable_and_one_that_serves_little_is_not_whatever_its_trend():
    arrivals = np.arange(0.0, 10.0, 0.1)  # 10 req/s for 10 s, window [1, 9)
    kept = _requests(arrivals, np.full(arrivals.size, 0.3))
    s = stability(kept, kept, 1.0, 9.0)
    assert not s["unstable"] and s["served_ratio"] == pytest.approx(1.0, abs=0.05)
    assert s["latency_trend"] == pytest.approx(1.0)
    # batched service: everything queued goes home together at 12 s, so the latency of
    # later arrivals does not grow, but nothing gets home while the window lasts
    batch = _requests(arrivals, 12.0 - arrivals)
    s = stability(batch, batch, 1.0, 9.0)
    assert s["latency_trend"] < 1.5 and s["served_ratio"] < 0.5 and s["unstable"]
    # too few arrivals in the second half to say: no verdict from the second rule
    few = _requests(np.linspace(0, 10, 2 * SERVED_MIN_ARRIVALS - 4), np.full(2 * SERVED_MIN_ARRIVALS - 4, 50.0))
    s = stability(few, few, 0.0, 10.0)
    assert np.isnan(s["served_ratio"]) and not s["unstable"]


SPEC = {"name": "stab", "topology": "small3", "router": {"name": "edgeshard"},
        "engine": {"decision_s": 5e-6},
        "workload": {"model": "mixtral-8x7b", "duration_s": 3.0, "warmup_s": 0.5, "gen_tokens": 0,
                     "calibration_tokens": 64}}


@pytest.fixture(scope="module")
def overloaded(tmp_path_factory):
    """EdgeShard with Mixtral on small3 (88 GB of GPU for 90 GB of experts) at 20 req/s."""
    run = tmp_path_factory.mktemp("stab") / "sweep" / "p" / "seed0"
    m = run_experiment(parse_spec({**SPEC, "workload": {**SPEC["workload"], "rate_per_s": 20}}),
                       run, progress=False).metrics
    return run, m


def test_an_overloaded_pipeline_is_flagged_though_its_latency_does_not_trend_up(overloaded):
    """It serves a few percent of its load; its steps batch the growing queue, so latency
    stays flat."""
    run, m = overloaded
    assert m["latency_trend"] < 1.5 and m["served_ratio"] < 0.2 and m["unstable"]
    assert json.loads((run / "metrics.json").read_text())["unstable"] is True


def test_remetric_brings_an_old_metrics_file_up_to_date(overloaded, tmp_path):
    run, m = overloaded
    sweep = run.parents[1]
    old = {k: v for k, v in m.items() if k != "served_ratio"}
    (run / "metrics.json").write_text(json.dumps({**old, "unstable": False, "kept": 1}))
    r = CliRunner().invoke(app, ["remetric", str(sweep), "--quiet"])
    assert r.exit_code == 0, r.output
    assert "1 run folders: 1 metrics.json rewritten, 1 flagged unstable" in r.output
    now = json.loads((run / "metrics.json").read_text())
    assert now["unstable"] is True and now["served_ratio"] == m["served_ratio"] and now["kept"] == 1
    r = CliRunner().invoke(app, ["remetric", str(sweep), "--quiet"])
    assert "0 metrics.json rewritten" in r.output  # nothing changed the second time
    assert CliRunner().invoke(app, ["remetric", str(tmp_path / "none")]).exit_code == 2
