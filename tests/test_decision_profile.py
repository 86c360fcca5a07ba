"""The decision profile: a calibrated decision constant measured once on a named CPU and
charged on every machine (testbed/decision_profile.py), so a figure reruns the same."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from hetroute.routers import available, get_router
from testbed import decision_profile as dp
from testbed import setup as setup_mod
from testbed.records import read_records
from testbed.runner import is_done, run_experiment
from testbed.setup import build_setup, check_spec, placement_key, router_sources
from testbed.spec import load_spec, parse_spec

TINY = {"topology": "small3", "workload": {"model": "switch", "duration_s": 0.6, "warmup_s": 0.1,
                                           "rate_per_s": 20, "calibration_tokens": 64,
                                           "gen_tokens": 0}}
REPO = Path(__file__).resolve().parent.parent


def _key(spec) -> str:
    c = check_spec(spec)
    return placement_key(c.spec, c.topology, c.router_cls)


def test_a_profiled_setting_is_charged_the_profiles_number_and_never_timed_here(tmp_path, monkeypatch):
    spec = parse_spec(TINY)
    prof = tmp_path / "profile.json"
    dp.record({_key(spec): dp.entry(3.21e-5, "test", "x", {"router": "hetroute"})}, prof)

    def no_timing(*a, **k):
        raise AssertionError("a profiled setting was timed on the host")
    monkeypatch.setattr(setup_mod, "calibrate_decision_s", no_timing)
    s = build_setup(spec, decision_profile=prof)
    assert s.decision_s == 3.21e-5 and s.notes["decision_s_source"].startswith("decision profile")
    # another seed is another setting: not in the profile, so it is timed here (and says so)
    monkeypatch.undo()
    other = build_setup(spec.with_overrides({"seed": 1}), decision_profile=prof)
    assert other.decision_s != 3.21e-5 and other.notes["decision_s_source"].startswith("calibrated")
    # a fixed number is never replaced by the profile's
    assert build_setup(spec.with_overrides({"engine.decision_s": 2e-5}),
                       decision_profile=prof).decision_s == 2e-5


def test_runs_charge_the_shipped_profile_and_a_host_timed_run_is_not_done_against_it(tmp_path, monkeypatch):
    """Two machines whose hosts time different constants make the same records once the
    profile holds the setting; a run made before (timed on its host) is run again."""
    prof = tmp_path / "profile.json"
    monkeypatch.setattr(dp, "PROFILE", prof)
    spec = parse_spec(TINY)
    run_experiment(spec, tmp_path / "before", progress=False)  # no profile: timed here
    timed = json.loads((tmp_path / "before" / "run.json").read_text())
    assert timed["decision_s_source"].startswith("calibrated on this host")
    assert is_done(tmp_path / "before", spec)
    charged = timed["decision_s_calibrated"] * 3 + 1e-6
    dp.record({_key(spec): dp.entry(charged, "test", "x", {})}, prof)
    assert not is_done(tmp_path / "before", spec)  # it charged another number
    for host, fake in (("a", 1e-6), ("b", 9e-5)):  # each host would time something else
        monkeypatch.setattr(setup_mod, "calibrate_decision_s", lambda *a, f=fake, **k: f)
        run_experiment(spec, tmp_path / host, progress=False, placement_cache=tmp_path / host / "c")
        info = json.loads((tmp_path / host / "run.json").read_text())
        assert info["decision_s_calibrated"] == charged
        assert info["decision_s_source"].startswith("decision profile")
        assert load_spec(tmp_path / host / "spec.resolved.yaml").engine.decision_s == charged
        assert is_done(tmp_path / host, spec)
    pd.testing.assert_frame_equal(read_records(tmp_path / "a")[0], read_records(tmp_path / "b")[0])


def test_measure_times_each_distinct_setting_once():
    spec = parse_spec(TINY)
    specs = [spec, spec.with_overrides({"workload.rate_per_s": 40}),  # load: same setting
             spec.with_overrides({"seed": 1}), spec.with_overrides({"engine.decision_s": 0.0})]
    got = dp.measure(specs, None, progress=False)
    assert sorted(got) == sorted({_key(spec), _key(specs[2])})
    e = got[_key(spec)]
    assert 0 < e["decision_s"] < 1e-2 and e["router"] == "hetroute" and e["topology"] == "small3"
    assert e["code"] == setup_mod._code_version() and e["cpu"] == dp.host_cpu()


def test_a_setting_spelled_with_its_defaults_is_one_setting():
    """Fig. 6's ``memory_ratio: 2.0`` and Fig. 5's ``top_k: 2`` are Fig. 2's HetRoute on
    Mixtral: one key, so one placement and one charged constant; another value is another
    setting."""
    base = parse_spec({**TINY, "workload": {**TINY["workload"], "model": "mixtral-8x7b"}})
    hr = get_router("hetroute").Params()
    same = [base.with_overrides({"router.params.memory_ratio": hr.memory_ratio}),
            base.with_overrides({"workload.top_k": 2}),
            base.with_overrides({"router.params": {"beam_width": hr.beam_width,
                                                   "lambda_q": hr.lambda_q}})]
    assert {_key(s) for s in same} == {_key(base)}
    other = [base.with_overrides({"router.params.memory_ratio": hr.memory_ratio + 1}),
             base.with_overrides({"workload.top_k": 1}),
             base.with_overrides({"router.name": "edgeshard"})]
    assert len({_key(s) for s in other} | {_key(base)}) == 4
    es = base.with_overrides({"router.name": "edgeshard"})
    spelled = es.with_overrides({"router.params": get_router("edgeshard").Params().model_dump()})
    assert _key(spelled) == _key(es)


def test_rounds_record_the_median_of_timings_made_in_passes_over_all_settings(monkeypatch):
    """With rounds, every setting is timed once per pass over all of them (so its timings
    lie apart), and the entry holds their median and each of them."""
    import testbed.core as core_mod
    spec = parse_spec(TINY)
    specs = [spec, spec.with_overrides({"seed": 1})]
    a, b = _key(specs[0]), _key(specs[1])
    draws = iter([4e-6, 9e-6, 6e-6, 5e-6, 5e-6, 30e-6])  # pass 1: a, b; pass 2: a, b; ...
    calls = []

    def fake(router, *args, **kwargs):
        calls.append(router)
        return next(draws)
    monkeypatch.setattr(core_mod, "calibrate_decision_s", fake)
    got = dp.measure(specs, None, fresh=True, progress=False, rounds=3)
    assert len(calls) == 6
    assert got[a]["rounds_us"] == [4.0, 6.0, 5.0] and got[a]["decision_s"] == 5e-6
    assert got[b]["rounds_us"] == [9.0, 5.0, 30.0] and got[b]["decision_s"] == 9e-6
    assert got[a]["method"].endswith("median of 3 rounds")
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        dp.measure(specs, None, progress=False, rounds=0)


@pytest.mark.parametrize("name", sorted(available()))
def test_the_key_hashes_no_file_outside_the_method_and_its_router(name):
    """Python's own abc.py differs between builds: hashed, it would make the key, and so
    the profile's lookups, differ from one machine to the next."""
    files = router_sources(get_router(name))
    assert files and all(REPO in f.resolve().parents for f in files)


def test_profile_decisions_command_records_settings_and_refuses_no_input(tmp_path):
    spec_file = tmp_path / "tiny.yaml"
    spec_file.write_text(parse_spec(TINY).to_yaml())
    prof = tmp_path / "p.json"
    run = lambda *a: subprocess.run([sys.executable, "-m", "testbed", "profile-decisions", *a],
                                    capture_output=True, text=True, cwd=tmp_path)
    bad = run("--profile", str(prof))
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: nothing to profile")
    ok = run("--run", str(spec_file), "--profile", str(prof), "--quiet")
    assert ok.returncode == 0, ok.stderr
    assert "1 settings recorded" in ok.stdout
    (key, e), = dp.load(prof).items()
    assert key == _key(parse_spec(TINY)) and e["decision_s"] > 0
    assert len(e["rounds_us"]) == 3 and "median of 3 rounds" in e["method"]  # the default
