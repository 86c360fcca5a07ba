"""What first parts two runs (analysis/first_fork.py, ``python -m analysis first-fork``)."""

from __future__ import annotations

import subprocess
import sys

import pandas as pd
import pytest

from analysis.first_fork import first_fork, fork_of_runs, format_fork
from testbed.runner import run_experiment
from testbed.spec import parse_spec

TINY = {"topology": "small3", "workload": {"model": "switch", "duration_s": 0.4, "warmup_s": 0.1,
                                           "rate_per_s": 40, "calibration_tokens": 64,
                                           "gen_tokens": 0}}


def _tl(rows):
    """Token-layer records from (request, token, layer, t_start, server, next, replicas)."""
    return pd.DataFrame([{"request": q, "token": k, "layer": l, "t_start": t, "server": s,
                          "next_server": n, "replica": list(r), "fanout_s": 1e-4,
                          "compute_s": 1e-3, "fanin_s": 1e-4}
                         for q, k, l, t, s, n, r in rows])


REF = [(0, 0, 0, 0.000, 0, 1, (1, 2)), (0, 0, 1, 0.010, 1, 1, (0, 2)),
       (1, 0, 0, 0.020, 2, 0, (0, 1)), (1, 0, 1, 0.030, 0, 0, (1, 2))]


def test_a_decision_taken_differently_with_every_earlier_start_alike_is_a_decision_fork():
    a = list(REF)
    a[1] = (0, 0, 1, 0.010 + 3e-7, 1, 1, (0, 2))  # within 1 us: not a timing difference
    a[2] = (1, 0, 0, 0.020, 2, 0, (1, 2))  # another replica set
    a[3] = (1, 0, 1, 0.040, 0, 0, (1, 2))  # a later start, after the decision
    f = first_fork(_tl(a), _tl(REF))
    assert f.first == "decision" and f.decision_key == (1, 0, 0)
    assert f.decision_ab == ((2, 0, (1, 2)), (2, 0, (0, 1))) and f.decision_s == 0.020
    assert f.decision_dt_us == pytest.approx(0.0)
    assert f.timing_key == (1, 0, 1) and f.timing_dt_us == pytest.approx(1e4)
    assert f.timing_what == "start"
    assert f.rows_before == 2 and f.drift_us[2] == pytest.approx(0.3)
    assert f.per_layer_us[0] == pytest.approx(0.3)  # token (0, 0): layer 0 at 0, layer 1 +0.3
    assert "first to part: decision" in format_fork(f, ("emu", "sim"))


def test_a_start_that_moves_first_is_a_timing_fork_and_identical_runs_do_not_part():
    a = list(REF)
    a[1] = (0, 0, 1, 0.010 + 5e-6, 1, 1, (0, 2))
    a[3] = (1, 0, 1, 0.030, 2, 0, (1, 2))
    f = first_fork(_tl(a), _tl(REF))
    assert f.first == "timing" and f.timing_key == (0, 0, 1) and f.decision_key == (1, 0, 1)
    assert f.timing_dt_us == pytest.approx(5.0)
    assert first_fork(_tl(a), _tl(REF), tol_s=1e-5).first == "decision"
    same = first_fork(_tl(REF), _tl(REF))
    assert same.first == "none" and same.compared == 4 and same.drift_us[2] == 0
    # a token-layer the reference started that the other run did not, by the horizon
    short = first_fork(_tl(REF[:2] + REF[3:]), _tl(REF), horizon_s=0.03)
    assert short.first == "timing" and short.timing_key == (1, 0, 0)
    assert "not started in emu" in format_fork(short, ("emu", "sim"))
    with pytest.raises(ValueError, match="tolerance"):
        first_fork(_tl(REF), _tl(REF), tol_s=-1)


def test_two_runs_of_one_spec_do_not_part_and_jitter_parts_them(tmp_path):
    spec = parse_spec(TINY)
    run_experiment(spec, tmp_path / "a", progress=False)
    run_experiment(spec, tmp_path / "b", progress=False)
    run_experiment(spec.with_overrides({"sim.hop_jitter_s": 1e-5}), tmp_path / "j", progress=False)
    same = fork_of_runs(tmp_path / "a", tmp_path / "b")
    assert same.first == "none" and same.compared > 100
    jit = fork_of_runs(tmp_path / "j", tmp_path / "b")
    assert jit.first == "timing" and jit.drift_us[2] > 1.0  # every hop moved by microseconds
    cli = subprocess.run([sys.executable, "-m", "analysis", "first-fork", str(tmp_path / "j"),
                          str(tmp_path / "b")], capture_output=True, text=True)
    assert cli.returncode == 0 and "first to part: timing" in cli.stdout
    bad = subprocess.run([sys.executable, "-m", "analysis", "first-fork", str(tmp_path),
                          str(tmp_path / "b")], capture_output=True, text=True)
    assert bad.returncode == 2 and "no token_layers" in bad.stderr


def test_parts_are_compared_only_on_token_layers_that_ended_by_the_decision_fork():
    """A step still running at the fork waits on work that followed it in one run only."""
    a = list(REF)
    a[2] = (1, 0, 0, 0.020, 2, 0, (1, 2))  # the decision fork, at 0.020
    ta, tb = _tl(a), _tl(REF)
    ta.loc[1, "compute_s"] = tb.loc[1, "compute_s"] = 0.015  # (0, 0, 1) runs past 0.020 ...
    ta.loc[1, "compute_s"] = 0.016  # ... and differs by 1 ms, which is not timing noise
    ta.loc[0, "fanout_s"] = 1e-4 + 2e-6  # (0, 0, 0) ended by the fork: its 2 us count
    f = first_fork(ta, tb)
    assert f.rows_before == 2 and f.parts_rows == 1
    assert f.parts_us["fanout_s"][2] == pytest.approx(2.0) and f.parts_us["compute_s"][2] == 0


def test_a_decision_is_placed_at_its_instant_and_a_dense_wait_or_a_part_that_moved_first_is_timing():
    """Seed 19 of fastbehindslow4's HetRoute at 40 req/s (2026-12-06): request 1's first layer
    started at the same instant in both runs, but its dense part waited 25 ms in its server's
    stream on the simulator and 4 ms less on the emulator, and the router decided differently
    then. Ordered by layer starts that read as a decision with every earlier start alike; what
    parted first was a partial that arrived 424 us later, before that decision was made."""
    ref = _tl(REF).assign(dense_s=0.0, decision_s=0.0)
    ref.loc[2, "dense_s"] = 0.025  # (1, 0, 0) starts at 0.020 and is decided at 0.045
    a = ref.copy()
    a.loc[2, "dense_s"] = 0.021  # decided 4 ms earlier ...
    a.at[2, "replica"] = [1, 2]  # ... and differently
    assert first_fork(a, ref).decision_s is None  # decided after the horizon (the last start)
    f = first_fork(a, ref, horizon_s=0.05)
    assert f.decision_key == (1, 0, 0) and f.decision_s == pytest.approx(0.045)
    assert f.decision_dt_us == pytest.approx(-4000.0)
    assert f.first == "timing" and f.timing_key == (1, 0, 0) and f.timing_what == "decision"
    assert f.timing_s == pytest.approx(0.045)  # the reference's instant
    assert "(1, 0, 0)'s decision: -4000.0 us" in format_fork(f, ("emu", "sim"))
    # a fan-in of a token-layer that ended before the decision moved first: timing, at its end
    b = ref.copy()
    b.at[2, "replica"] = [1, 2]  # the same decision instant, another choice
    b.loc[1, "fanin_s"] = 1e-4 + 424e-6  # (0, 0, 1) ends at 0.0112 in the reference
    g = first_fork(b, ref, horizon_s=0.05)
    assert g.first == "timing" and g.timing_key == (0, 0, 1) and g.timing_what == "end"
    assert g.timing_s == pytest.approx(0.0112) and g.timing_dt_us == pytest.approx(424.0)
    # the same choice made at the same instant with nothing moved before it: a decision fork
    c = ref.copy()
    c.at[2, "replica"] = [1, 2]
    assert first_fork(c, ref, horizon_s=0.05).first == "decision"


def test_a_token_layer_that_ended_past_where_the_other_runs_records_stop_is_not_a_fork():
    """asym5's HetRoute at 40 req/s, seed 1: a layer that started at 82 ms waited 2.4 s for its
    dense part on the simulator, past the emulated run's drain cap, so the emulator has no
    record of it; that is the cut, not a token-layer the emulator failed to start."""
    ref = _tl(REF).assign(dense_s=0.0, decision_s=0.0)
    ref.loc[0, "dense_s"] = 0.5  # (0, 0, 0) starts at 0 and ends at 0.5012
    cut = ref.drop(index=0)  # A's records stop at (1, 0, 1)'s end, 0.0312
    assert first_fork(cut, ref).first == "none"
    early = ref.copy()
    early.loc[0, "dense_s"] = 0.01  # ended by then in B: A lacking it is a difference
    f = first_fork(early.drop(index=0), early)
    assert f.first == "timing" and f.timing_key == (0, 0, 0) and f.timing_dt_us != f.timing_dt_us
