"""Two runs' step tables lined up (analysis/steps_diff.py, ``python -m analysis compare-steps``)."""

from __future__ import annotations

import subprocess
import sys

import pandas as pd
import pytest

from analysis.steps_diff import compare_runs, diff_steps, format_diffs
from testbed.records import read_steps
from testbed.runner import run_experiment
from testbed.spec import parse_spec

TINY = {"topology": "small3", "workload": {"model": "switch", "duration_s": 0.4, "warmup_s": 0.1,
                                           "rate_per_s": 20, "calibration_tokens": 64,
                                           "gen_tokens": 0}}


def _step(server, t, layer, reps, dense, model_s=1e-3):
    return {"server": server, "layer": layer, "t_start": t, "model_s": model_s,
            "rep_precision": [p for p, _ in reps], "rep_tokens": [c for _, c in reps],
            "rep_gpu": [True] * len(reps), "dense_request": [q for q, _ in dense],
            "dense_position": [p for _, p in dense]}


def test_the_first_step_that_differs_is_found_per_server_and_the_totals_up_to_the_horizon():
    a = pd.DataFrame([_step(0, 0.0, 0, [], [(0, 0), (0, 1)]), _step(0, 0.01, 0, [(16, 2)], []),
                      _step(0, 0.02, 1, [], [(0, 0), (0, 1)]), _step(1, 0.015, 0, [(4, 1)], []),
                      _step(0, 0.5, 2, [(16, 2)], [])])
    b = pd.DataFrame([_step(0, 0.0, 0, [], [(0, 1), (0, 0)]),  # same tokens in another order
                      _step(0, 0.0101, 0, [(16, 2)], []),
                      _step(0, 0.02, 1, [], [(0, 0)]),  # one token short: the schedules part
                      _step(0, 0.03, 1, [], [(0, 1)]), _step(1, 0.015, 0, [(4, 1)], [])])
    d0, d1 = diff_steps(a, b, until_s=0.1)
    assert d0.same_prefix == 2 and d0.start_drift_s == pytest.approx(1e-4)
    assert "dense 2 tokens" in d0.first_diff[0] and "dense 1 tokens" in d0.first_diff[1]
    assert d0.steps == (3, 4) and d0.expert_tokens == (2, 2) and d0.dense_tokens == (4, 4)
    assert d1.first_diff is None and d1.same_prefix == 1 and d1.steps == (1, 1)
    # by default the horizon is a time both runs reached: a's step at 0.5 s is left out
    assert diff_steps(a, b)[0].steps == (3, 4)
    text = format_diffs(0.1, [d0, d1], ("emu", "sim"))
    assert "server 0: step 2 differs" in text and "server 1: step" not in text
    with pytest.raises(ValueError, match="--trace-steps"):
        diff_steps(a, a.iloc[0:0])


def test_two_runs_of_one_spec_agree_step_for_step_and_a_run_without_steps_is_refused(tmp_path):
    spec = parse_spec(TINY)
    for name in ("a", "b"):
        run_experiment(spec, tmp_path / name, progress=False, trace_steps=True)
    horizon, diffs = compare_runs(tmp_path / "a", tmp_path / "b")
    steps = read_steps(tmp_path / "a")
    assert horizon == steps.t_start.max() and len(diffs) == steps.server.nunique()
    assert all(d.first_diff is None and d.same_prefix == d.steps[0] == d.steps[1] > 0
               and d.start_drift_s == 0 for d in diffs)
    run_experiment(spec, tmp_path / "plain", progress=False)
    cli = subprocess.run([sys.executable, "-m", "analysis", "compare-steps", str(tmp_path / "a"),
                          str(tmp_path / "plain")], capture_output=True, text=True)
    assert cli.returncode == 2 and "no step table" in cli.stderr and "plain" in cli.stderr
    ok = subprocess.run([sys.executable, "-m", "analysis", "compare-steps", str(tmp_path / "a"),
                         str(tmp_path / "b")], capture_output=True, text=True)
    assert ok.returncode == 0 and "differs" not in ok.stdout.split("same:")[0]
