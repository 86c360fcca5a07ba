"""``agree``'s pooling over seeds, on the simulator alone (the emulator's side is the same
code with another backend)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from testbed.agreement import TOL, _compare, _side, format_rows
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
    assert not row.cut and row.ok_work  # nothing was cut: the work is not checked
    assert format_rows([row]).splitlines()[1].split()[:2] == ["emu/sim", "edgeshard"]


def _frames(done_s, ends):
    import pandas as pd
    rq = pd.DataFrame({"arrival_s": [0.2, 0.3, 0.4, 0.5], "done_s": done_s,
                       "latency_s": [d - a for d, a in zip(done_s, [0.2, 0.3, 0.4, 0.5])],
                       "status": ["ok"] * 4})
    tl = pd.DataFrame({"t_start": [e - 0.01 for e in ends], "total_s": [0.01] * len(ends)})
    return tl, rq


def test_the_simulators_records_are_cut_where_the_emulated_run_stopped():
    from testbed.agreement import compare_point, cut_records
    sim = _frames([0.4, 0.6, 1.5, 2.5], [0.5, 0.9, 1.4, 2.4])
    tl, rq = cut_records(*sim, 1.0)
    assert list(rq.status) == ["ok", "ok", "failed", "failed"] and len(tl) == 2
    assert cut_records(*sim, None)[1].status.eq("ok").all()  # not cut: unchanged
    # the emulator finished the same two requests by its cut, 4% slower: within 5%
    emu = _frames([0.408, 0.612, float("nan"), float("nan")], [0.5, 0.9])
    emu[1].loc[2:, "status"] = "failed"
    n, c = compare_point("r", emu, sim, 1.0, 0.0, 1.0)
    assert n == 4 and c.requests == (2, 2) and c.work == (2, 2) and c.cut
    assert c.ok_mean and c.ok_p99 and c.ok_work
    assert c.mean_ms[1] == pytest.approx(250.0) and c.mean_ms[0] == pytest.approx(260.0)
    # uncut, the simulator's slow requests would enter its mean and the check would fail
    assert not compare_point("r", emu, sim, None, 0.0, 1.0)[1].ok_mean
    # the emulator got through less work by its cut: the work check fails
    short = (emu[0].iloc[:1], emu[1])
    assert not compare_point("r", short, sim, 1.0, 0.0, 1.0)[1].ok_work


def test_agree_sweep_runs_each_emulated_point_on_the_simulator(tmp_path):
    """An emulated point stood in for by a simulated run relabelled ``emu``: its twin gives the
    same records (every ratio 1), and a cut the stand-in did not make shows as lost work."""
    import yaml

    from testbed.agreement import format_points, sweep_agreement
    from testbed.runner import run_experiment
    point = tmp_path / "sweep" / "name=edgeshard" / "seed0"
    run_experiment(parse_spec(SPEC), point, progress=False)
    spec = yaml.safe_load((point / "spec.resolved.yaml").read_text())
    (point / "spec.resolved.yaml").write_text(yaml.safe_dump({**spec, "backend": "emu"}, sort_keys=False))
    info = json.loads((point / "run.json").read_text())
    (point / "run.json").write_text(json.dumps({**info, "backend": "emu", "stats": {"dilation": 8.0}}))
    (row,) = sweep_agreement(tmp_path / "sweep", tmp_path / "twins", progress=False)
    assert is_done(tmp_path / "twins" / "name=edgeshard" / "seed0",  # the emulator's views
                   parse_spec({**spec, "backend": "sim", "net": {**spec["net"], "control": "links"}}))
    c = row.check
    assert row.ok and c.mean_ms[0] == c.mean_ms[1] and c.work[0] == c.work[1] > 0
    assert row.point == "name=edgeshard/seed0" and row.cut_s is None and c.router == "edgeshard"
    (point / "run.json").write_text(json.dumps(
        {**info, "backend": "emu", "stats": {"dilation": 8.0, "timed_out": True, "emulated_s": 0.3}}))
    (row,) = sweep_agreement(tmp_path / "sweep", tmp_path / "twins", progress=False)
    assert row.cut_s == 0.3 and row.check.work[1] < row.check.work[0] and not row.ok
    line = format_points([row]).splitlines()[1]
    assert line.split()[:4] == ["edgeshard", "10", "8.0", "0.30"] and line.endswith("NO")


def _stand_in(spec_dict: dict, folder) -> None:
    """A simulated run relabelled as emulated (the emulator's side is the same code)."""
    import yaml

    from testbed.runner import run_experiment
    run_experiment(parse_spec(spec_dict), folder, progress=False)
    spec = yaml.safe_load((folder / "spec.resolved.yaml").read_text())
    (folder / "spec.resolved.yaml").write_text(yaml.safe_dump({**spec, "backend": "emu"},
                                                              sort_keys=False))
    info = json.loads((folder / "run.json").read_text())
    (folder / "run.json").write_text(json.dumps({**info, "backend": "emu",
                                                 "stats": {"dilation": 8.0}}))


def test_agree_sweep_pools_a_points_seeds_and_runs_the_missing_ones(tmp_path, monkeypatch):
    """A point with seeds 0 and 2 in the sweep, pooled to three: seed 1 is run (on the
    emulator; here by the stand-in) under the twins' folder, each seed gets its simulated
    twin, and the pooled check is over all three seeds' requests."""
    import testbed.agreement as agreement
    from testbed.agreement import format_points, sweep_agreement
    sweep = tmp_path / "sweep" / "name=edgeshard"
    for s in (0, 2):
        _stand_in({**SPEC, "seed": s}, sweep / f"seed{s}")
    ran = []

    def run_experiment(spec, out, progress=True):
        ran.append((spec.backend, spec.seed, out.relative_to(tmp_path).as_posix()))
        if spec.backend == "emu":
            _stand_in({**spec.model_dump(mode="json"), "backend": "sim"}, out)
        else:
            from testbed.runner import run_experiment as real
            real(spec, out, progress=False)

    monkeypatch.setattr(agreement, "run_experiment", run_experiment)
    (one,) = sweep_agreement(tmp_path / "sweep", tmp_path / "twins", progress=False)
    assert one.point == "name=edgeshard/seeds 0,2" and one.check.seeds == 2  # the sweep's two
    assert [r[0] for r in ran] == ["sim", "sim"]
    ran.clear()
    (row,) = sweep_agreement(tmp_path / "sweep", tmp_path / "twins", progress=False, seeds=3)
    assert ran == [("emu", 1, "twins/name=edgeshard/emu-seed1"),
                   ("sim", 1, "twins/name=edgeshard/seed1")]  # seeds 0 and 2 reused
    assert row.point == "name=edgeshard/seeds 0,2,1" and row.check.seeds == 3
    assert [p[0] for p in row.per_seed] == [0, 2, 1]
    # stand-ins and twins are the same runs: every seed agrees exactly, the pool too
    assert all(e == m and a == b > 0 for _, e, m, a, b in row.per_seed) and row.ok
    sizes = [_side(parse_spec({**SPEC, "seed": s}), 1, tmp_path / "twins" / "name=edgeshard",
                   f"seed{s}").latency_s.size for s in (0, 1, 2)]
    assert row.check.requests == (sum(sizes), sum(sizes)) and row.measured >= sum(sizes)
    line = format_points([row]).splitlines()[1]
    assert line.split()[-3:] == ["3", "1.00-1.00", "ok"]
    ran.clear()
    sweep_agreement(tmp_path / "sweep", tmp_path / "twins", progress=False, seeds=3)
    assert ran == []  # everything reused



def test_agree_sweep_draws_one_bar_over_its_points_not_one_per_run(tmp_path, monkeypatch, capsys):
    """With progress on, every run it starts is quiet and one bar counts the points, naming
    the run under way: a bar per simulated twin made logs hundreds of lines long."""
    import testbed.agreement as agreement
    from testbed.agreement import sweep_agreement
    _stand_in(SPEC, tmp_path / "sweep" / "name=edgeshard" / "seed0")
    flags = []

    def run_experiment(spec, out, progress=True):
        flags.append(progress)
        if spec.backend == "emu":
            _stand_in({**spec.model_dump(mode="json"), "backend": "sim"}, out)
        else:
            from testbed.runner import run_experiment as real
            real(spec, out, progress=False)

    monkeypatch.setattr(agreement, "run_experiment", run_experiment)
    capsys.readouterr()
    sweep_agreement(tmp_path / "sweep", tmp_path / "twins", progress=True, seeds=2)
    err = capsys.readouterr().err
    assert flags == [False, False, False]  # seed 0's twin, seed 1 emulated, seed 1's twin
    assert "agree-sweep" in err and "1/1" in err and "[sim]" not in err
    assert "name=edgeshard/emu-seed1 (emulated)" in err

def test_the_seeds_interval_says_agrees_disagrees_or_undecided():
    from testbed.agreement import seed_interval, span_text
    lat = [np.array([0.5, 0.6]), np.array([0.7]), np.array([0.4, 0.5, 0.6])]
    same = seed_interval([(x, 100) for x in lat], [(x, 100) for x in lat])
    assert same.seeds == 3 and same.mean == (1.0, 1.0) and same.work == (1.0, 1.0)
    assert same.verdict(0.05, "mean") == "agrees" == same.verdict(0.05, "work")
    # two seeds 10% apart either way: their pool can be anything from 0.9 to 1.1
    split = seed_interval([(lat[0], 90), (lat[1], 110)], [(lat[0], 100), (lat[1], 100)])
    assert split.work[0] == pytest.approx(0.9) and split.work[1] == pytest.approx(1.1)
    assert split.verdict(0.05, "work") == "undecided at 2 seeds"
    slow = seed_interval([(x * 1.2, 80) for x in lat], [(x, 100) for x in lat])
    assert slow.mean[0] == pytest.approx(1.2) and slow.verdict(0.05, "mean") == "disagrees"
    assert slow.verdict(0.05, "work") == "disagrees"
    # a seed without a measured request: resamples of it alone have no mean
    none = seed_interval([(np.zeros(0), 50), (lat[1], 50)], [(np.zeros(0), 50), (lat[1], 50)])
    assert none.verdict(0.05, "mean") == "no interval: too few seeds finish a measured request"
    assert none.verdict(0.05, "work") == "agrees"
    assert span_text(none.mean) == "-" and span_text(split.work) == "0.900-1.100"
    # reproducible: seeded
    assert seed_interval([(lat[0], 90), (lat[1], 110)], [(lat[0], 100), (lat[1], 100)]) == split
    # the P99 too: equal seeds agree, 20% slower everywhere disagrees, no request no interval
    assert same.p99 == (1.0, 1.0) and same.verdict(0.10, "P99") == "agrees"
    assert slow.p99[0] == pytest.approx(1.2) and slow.p99[1] == pytest.approx(1.2)
    assert slow.verdict(0.10, "P99") == "disagrees"
    assert none.verdict(0.10, "P99") == "no interval: too few seeds finish a measured request"
    assert [m for m, *_ in same.judged((3, 3), cut=True)] == ["mean", "P99", "work"]


def test_one_heavy_tailed_seed_moves_the_pooled_p99_and_its_interval_says_so():
    """The pooled P99 is set by the seeds with the heaviest tails: one emulated seed whose
    five slowest requests run 30% longer than any simulated one takes the pooled P99 out
    of 10% while the mean stays within, and the interval over the seeds is undecided (a
    resample without that seed reads 1.0), where the same seeds without it agree."""
    from testbed.agreement import seed_interval
    rng = np.random.default_rng(3)
    sim = [rng.uniform(0.4, 1.0, 20) for _ in range(14)]
    emu = [x.copy() for x in sim]
    emu[11][-5:] = 1.3 * max(float(x.max()) for x in sim)
    pool = lambda parts: np.percentile(np.concatenate(parts), 99)  # noqa: E731
    assert pool(emu) / pool(sim) > 1.10
    assert np.concatenate(emu).mean() / np.concatenate(sim).mean() < 1.05
    ci = seed_interval([(x, 100) for x in emu], [(x, 100) for x in sim])
    assert ci.p99[0] == pytest.approx(1.0) and ci.p99[1] > 1.10
    assert ci.verdict(0.10, "P99") == "undecided at 14 seeds"
    assert ci.verdict(0.05, "mean") == "agrees"
    drop = [k for k in range(14) if k != 11]
    ci13 = seed_interval([(emu[k], 100) for k in drop], [(sim[k], 100) for k in drop])
    assert ci13.p99 == (1.0, 1.0) and ci13.verdict(0.10, "P99") == "agrees"


def test_pooled_seeds_carry_their_interval_and_one_seed_none():
    from testbed.agreement import compare_seeds, format_points, PointComparison
    import pandas as pd
    rq = lambda lat: pd.DataFrame({"request": range(len(lat)), "arrival_s": [0.1] * len(lat),  # noqa: E731
                                   "done_s": [0.1 + x for x in lat], "latency_s": lat,
                                   "status": ["ok"] * len(lat)})
    tl = pd.DataFrame({"t_start": [0.0], "total_s": [0.1]})
    runs = [((tl, rq([0.5, 0.6])), (tl, rq([0.5, 0.6])), None),
            ((tl, rq([0.9])), (tl, rq([0.7])), None)]
    _, one, _ = compare_seeds("r", runs[:1], 0.0, 1.0)
    assert one.seed_ci is None
    _, two, _ = compare_seeds("r", runs, 0.0, 1.0)
    assert two.seed_ci.seeds == 2 and two.seed_ci.mean[1] == pytest.approx(0.9 / 0.7)
    row = PointComparison("p/seeds 0,1", 10, None, 3, two)
    assert "over the 2 seeds (bootstrap, 95%): mean 1.000-1.286, undecided at 2 seeds" in format_points([row])


def test_the_ensemble_pools_latencies_and_averages_work():
    from testbed.agreement import Side, ensemble_side
    a = Side(np.array([1.0, 2.0]), None, [2.0, None], work=10)
    b = Side(np.array([3.0]), None, [2.0, None], work=14)
    e = ensemble_side([a, b])
    assert e.latency_s.tolist() == [1.0, 2.0, 3.0] and e.work == 12 and e.cuts == [2.0, None]
    assert e.mean_ms == pytest.approx(2000.0)


def test_seed_spread_shows_work_ratios_where_an_overloaded_point_finishes_nothing():
    from testbed.agreement import seed_spread
    nan = float("nan")
    assert seed_spread([(0, 110.0, 100.0, 5, 5), (1, 90.0, 100.0, 5, 5)], cut=False) == "0.90-1.10"
    over = [(0, nan, nan, 17243, 18058), (1, nan, nan, 17102, 20221), (2, nan, nan, 15535, 15467)]
    assert seed_spread(over, cut=True) == "w 0.85-1.00"
    assert seed_spread(over, cut=False) == "-"  # not cut: the work is all of it on both sides
    assert seed_spread(over[:1], cut=True) == "-"


def test_sim_band_runs_jittered_twins_and_places_the_emulator_in_their_range(tmp_path, monkeypatch):
    """``agree --sim-band``: each jitter's twin is pooled and cut like the exact one, the band
    spans all of them, and a metric out of tolerance passes the band check only inside it."""
    import dataclasses

    import testbed.agreement as agreement
    from testbed.agreement import Band, agreement as agree

    def run_experiment(spec, out, progress=True):  # the emulator stood in for by the simulator
        if spec.backend == "emu":
            _stand_in({**spec.model_dump(mode="json"), "backend": "sim"}, out)
        else:
            from testbed.runner import run_experiment as real
            real(spec, out, progress=False)

    monkeypatch.setattr(agreement, "run_experiment", run_experiment)
    spec = parse_spec(SPEC)
    (row,) = agree(spec, ["edgeshard"], tmp_path, seeds=2, double_t=False, band=(2e-5, 1e-4))
    names = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("sim-"))
    assert names == ["sim-edgeshard", "sim-edgeshard-jitter0.0001", "sim-edgeshard-jitter0.0001-seed1",
                     "sim-edgeshard-jitter2e-05", "sim-edgeshard-jitter2e-05-seed1",
                     "sim-edgeshard-seed1"]
    b = row.band
    assert b.jitter_s == (0.0, 2e-5, 1e-4)
    jit = _side(spec.with_overrides({**agreement.SIM_TWIN, "sim.hop_jitter_s": 1e-4}), 2, tmp_path,
                "sim-edgeshard-jitter0.0001")  # reused
    # the exact twin is the stand-in itself; 100 us per hop makes every request slower
    assert b.mean_ms[0] == pytest.approx(row.mean_ms[1]) and b.mean_ms[1] == pytest.approx(jit.mean_ms)
    assert jit.mean_ms > row.mean_ms[1]
    assert row.ok and row.in_band
    # the ensemble: the emulator's side as checked, against the exact and jittered twins pooled
    exact = _side(spec.with_overrides(agreement.SIM_TWIN), 2, tmp_path, "sim-edgeshard")
    mid = _side(spec.with_overrides({**agreement.SIM_TWIN, "sim.hop_jitter_s": 2e-5}), 2, tmp_path,
                "sim-edgeshard-jitter2e-05")
    pooled = np.concatenate([exact.latency_s, mid.latency_s, jit.latency_s])
    e = row.ensemble
    assert e.kind == "emu/ensemble" and e.mean_ms[0] == row.mean_ms[0]
    assert e.mean_ms[1] == pytest.approx(pooled.mean() * 1e3) and e.mean_ms[1] > row.mean_ms[1]
    assert e.requests == (row.requests[0], pooled.size) and row.ok_ensemble is e.ok
    saved = json.loads((tmp_path / "agreement.json").read_text())[0]
    assert saved["band"]["jitter_s"] == [0.0, 2e-5, 1e-4] and saved["ok_ensemble"] is e.ok
    assert saved["ensemble"]["mean_ms"][1] == pytest.approx(e.mean_ms[1])
    assert "against the simulator's ensemble (3 runs per seed pooled): mean " in format_rows([row])
    # two seeds pooled: the interval over them (stand-in and twin are one run: exactly 1)
    assert row.seed_ci.seeds == 2 and row.seed_ci.mean == (1.0, 1.0)
    assert "over the 2 seeds (bootstrap, 95%): mean 1.000-1.000, agrees" in format_rows([row])
    assert "100 us of mean hop jitter" in format_rows([row]) and "is inside it" in format_rows([row])
    # a mean out of tolerance: inside the band passes the band check, outside does not
    lo, hi = 100.0, 130.0
    wide = Band((0.0, 1e-5), (lo, hi), (200.0, 260.0), (1000, 1400))
    off = dataclasses.replace(row, mean_ms=(120.0, lo), ok_mean=False, band=wide)
    assert not off.ok and off.in_band
    assert not dataclasses.replace(off, mean_ms=(140.0, lo)).in_band
    assert "is outside it" in format_rows([dataclasses.replace(off, mean_ms=(140.0, lo))])
    # within tolerance but outside a narrow band: said so, not called inside
    narrow = Band((0.0, 1e-5), (100.0, 100.5), (200.0, 200.5), (1000, 1000))
    near = dataclasses.replace(row, mean_ms=(103.0, 100.0), p99_ms=(200.2, 200.0), work=(1000, 1000),
                               ok_mean=True, ok_p99=True, band=narrow)
    assert near.ok and near.in_band and "is within tolerance where outside it" in format_rows([near])
    assert "is inside it" in format_rows([dataclasses.replace(near, mean_ms=(100.2, 100.0))])
    assert dataclasses.replace(row, band=None).in_band is None


def test_agree_sweep_sim_band_runs_each_seeds_jittered_twin_and_reuses_it(tmp_path, monkeypatch):
    """``agree-sweep --sim-band``: every seed of a point gets a jittered twin beside its exact
    one, the band spans the pooled exact and jittered twins, and a second call reuses them."""
    import testbed.agreement as agreement
    from testbed.agreement import format_points, sweep_agreement
    point = tmp_path / "sweep" / "name=edgeshard"
    for s in (0, 1):
        _stand_in({**SPEC, "seed": s}, point / f"seed{s}")
    with pytest.raises(ValueError, match="sim-band"):
        sweep_agreement(tmp_path / "sweep", tmp_path / "twins", progress=False, band=(0.0,))
    (row,) = sweep_agreement(tmp_path / "sweep", tmp_path / "twins", progress=False, band=(1e-4,))
    twins = sorted(p.name for p in (tmp_path / "twins" / "name=edgeshard").iterdir()
                   if not p.name.startswith("."))
    assert twins == ["seed0", "seed0-jitter0.0001", "seed1", "seed1-jitter0.0001"]
    b = row.check.band
    from testbed.records import read_records
    w = parse_spec(SPEC).workload
    jit_mean = agreement._pooled([(read_records(tmp_path / "twins" / "name=edgeshard" /
                                                f"seed{s}-jitter0.0001"), None) for s in (0, 1)],
                                 w.warmup_s, w.duration_s).mean_ms
    assert b.jitter_s == (0.0, 1e-4) and jit_mean > row.check.mean_ms[1]  # 100 us per hop: slower
    assert b.mean_ms == pytest.approx((row.check.mean_ms[1], jit_mean))
    assert b.work == (row.check.work[1], row.check.work[1])  # nothing cut: every token-layer done
    assert row.ok and row.check.in_band
    e = row.check.ensemble  # the emulator against the exact and jittered twins pooled
    assert e.mean_ms[0] == row.check.mean_ms[0] and e.requests[1] == 2 * row.check.requests[1]
    assert row.check.mean_ms[1] < e.mean_ms[1] < jit_mean and e.work == row.check.work
    saved = json.loads((tmp_path / "twins" / "agreement.json").read_text())[0]
    assert saved["in_band"] is True and saved["check"]["band"]["jitter_s"] == [0.0, 1e-4]
    assert saved["ok_ensemble"] is e.ok and "simulator's ensemble (2 runs" in format_points([row])
    assert "100 us of mean hop jitter" in format_points([row]) and "is inside it" in format_points([row])
    ran = []
    monkeypatch.setattr(agreement, "run_experiment", lambda *a, **k: ran.append(a))
    (again,) = sweep_agreement(tmp_path / "sweep", tmp_path / "twins", progress=False, band=(1e-4,))
    assert ran == [] and again.check.band == b
