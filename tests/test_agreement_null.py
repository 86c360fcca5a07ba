"""``agree-null``: the simulator under tiny hop jitter against its exact run, over seeds."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from testbed.agreement import measure_cut
from testbed.agreement_null import format_null, null_agreement
from testbed.cli import app
from testbed.records import read_records
from testbed.spec import load_spec, parse_spec
from tests.test_agreement import SPEC as AGREE_SPEC

SPEC = {**AGREE_SPEC, "name": "null-test", "router": {"name": "hetroute"}}  # small3, 0.6 s


def test_the_null_check_pools_each_seeds_exact_and_jittered_runs(tmp_path):
    spec = parse_spec(SPEC)
    rows = null_agreement(spec, tmp_path, 4, 1e-5, None, steps=[2, 4], progress=False)
    assert [r.seeds for r in rows] == [2, 4]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("seed")) == [
        "seed0", "seed0-jitter1e-05", "seed1", "seed1-jitter1e-05", "seed2",
        "seed2-jitter1e-05", "seed3", "seed3-jitter1e-05"]
    # the runs are the simulator's twins: the exact one has no jitter, the other the asked one
    for name, jit in (("seed3", 0.0), ("seed3-jitter1e-05", 1e-5)):
        twin = load_spec(tmp_path / name / "spec.resolved.yaml")
        assert (twin.backend, twin.net.control, twin.sim.hop_jitter_s, twin.seed) == \
            ("sim", "links", jit, spec.seed + 3)
    w = spec.workload
    exact = [measure_cut(*read_records(tmp_path / f"seed{k}"), None, w.warmup_s, w.duration_s)
             for k in range(4)]
    assert rows[1].work[1] == sum(done for _, _, done in exact)  # the exact side, summed
    lat = np.concatenate([x for x, _, _ in exact])
    assert rows[1].mean_ms[1] == pytest.approx(lat.mean() * 1e3)
    # 10 us per hop moves an underloaded run's mean a little, never by 5%: the null agrees
    jit_mean, exact_mean = rows[1].mean_ms
    assert jit_mean != exact_mean and abs(jit_mean / exact_mean - 1) < 0.05
    assert [m for m, *_ in rows[0].judged()] == ["mean", "P99"]  # not cut: no work
    # the conclusion names the fewest seeds at which the check was decided, or says it was
    # not (this run was decided from 2 seeds until the control frames waited behind the
    # data, 2026-12-03; since, its mean's interval is 1.037-1.075 at 2 and 1.018-1.064 at 4)
    first = next((r.seeds for r in rows if r.decided), None)
    text = format_null(rows, 1e-5, None)
    assert "seeds=4" in text and ("agrees" in text or "undecided" in text)
    assert text.endswith(f"Decided from {first} seeds." if first else "Not decided at 4 seeds.")
    # a second call reuses every run
    stamp = (tmp_path / "seed0" / "run.json").stat().st_mtime_ns
    null_agreement(spec, tmp_path, 2, 1e-5, None, progress=False)
    assert (tmp_path / "seed0" / "run.json").stat().st_mtime_ns == stamp


def test_a_cut_null_check_reads_the_work_done_by_the_cut(tmp_path):
    spec = parse_spec(SPEC)
    whole = null_agreement(spec, tmp_path, 2, 1e-5, None, progress=False)[-1]
    cut = null_agreement(spec, tmp_path, 2, 1e-5, 0.3, progress=False)[-1]
    assert cut.cut and "work" in [m for m, *_ in cut.judged()]
    assert 0 < cut.work[1] < whole.work[1] and 0 < cut.work[0] < whole.work[0]


@pytest.mark.parametrize("args, says", [
    (["--jitter", "0"], "--jitter: each jitter must be in (0, 0.001] s"),
    (["--seeds", "1"], "--seeds"),
    (["--cut", "-1"], "--cut must be > 0 s"),
    (["--seeds", "4", "--at", "5"], "--at 5: each seed count must be in [2, --seeds = 4]"),
    (["--at", "1"], "--at 1: each seed count"),
])
def test_agree_null_rejects_bad_input_in_one_line(tmp_path, args, says):
    spec = tmp_path / "s.yaml"
    spec.write_text(json.dumps(SPEC))
    res = CliRunner().invoke(app, ["agree-null", str(spec), "--out", str(tmp_path / "o"), *args])
    assert res.exit_code == 2 and says in res.output
    assert not (tmp_path / "o").exists()  # nothing was run


def test_agree_null_names_a_missing_point_or_a_folder_that_is_no_run(tmp_path):
    res = CliRunner().invoke(app, ["agree-null", str(tmp_path / "nope")])
    assert res.exit_code == 2 and "does not exist" in res.output
    res = CliRunner().invoke(app, ["agree-null", str(tmp_path)])
    assert res.exit_code == 2 and "no spec.resolved.yaml" in res.output


def test_draws_pool_several_jitter_draws_per_seed(tmp_path):
    spec = parse_spec(SPEC)
    one = null_agreement(spec, tmp_path, 2, 1e-5, None, progress=False)[-1]
    rows = null_agreement(spec, tmp_path, 2, 1e-5, None, progress=False, draws=3)
    r = rows[-1]
    names = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("seed1"))
    assert names == ["seed1", "seed1-jitter1e-05", "seed1-jitter1e-05-draw1",
                     "seed1-jitter1e-05-draw2"]
    draw = load_spec(tmp_path / "seed1-jitter1e-05-draw2" / "spec.resolved.yaml")
    assert (draw.sim.hop_jitter_s, draw.sim.hop_jitter_draw, draw.seed) == (1e-5, 2, spec.seed + 1)
    # draw 0 is the run a one-draw check made (reused), and the first per-draw ratio is its own
    assert r.per_draw[0] == pytest.approx(one.mean_ms[0] / one.mean_ms[1])
    assert r.mean_ms[1] == one.mean_ms[1]  # the exact side is the same runs
    # another draw is another trajectory; the pooled side holds every draw's requests once
    w = spec.workload
    lats = [measure_cut(*read_records(tmp_path / f"seed{k}-jitter1e-05{sfx}"), None, w.warmup_s,
                        w.duration_s)[0] for k in range(2) for sfx in ("", "-draw1", "-draw2")]
    assert not np.array_equal(lats[0], lats[1])
    assert r.mean_ms[0] == pytest.approx(np.concatenate(lats).mean() * 1e3)
    assert len(r.per_draw) == 3 and min(r.per_draw) <= r.mean_ms[0] / r.mean_ms[1] <= max(r.per_draw)
    text = format_null(rows, 1e-5, None)
    assert "3 draws of it per seed" in text and "each draw's mean" in text


def test_a_jitter_draw_is_reproducible_and_needs_jitter(tmp_path):
    from testbed.runner import run_experiment
    from testbed.spec import SpecError
    base = parse_spec({**SPEC, "sim": {"hop_jitter_s": 1e-5}})
    assert "hop_jitter_draw" not in base.to_yaml()  # at its default, resolved specs omit it
    runs = {}
    for name, d in (("a", 1), ("b", 1), ("c", 0)):
        run_experiment(base.with_overrides({"sim.hop_jitter_draw": d}), tmp_path / name, progress=False)
        runs[name] = read_records(tmp_path / name)[0].sort_values(["request", "token", "layer"])
    assert runs["a"].t_start.to_numpy().tolist() == runs["b"].t_start.to_numpy().tolist()
    assert runs["a"].t_start.to_numpy().tolist() != runs["c"].t_start.to_numpy().tolist()
    with pytest.raises(SpecError, match="hop_jitter_draw needs hop_jitter_s > 0"):
        parse_spec({**SPEC, "sim": {"hop_jitter_draw": 1}})
