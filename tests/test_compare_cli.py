"""``testbed compare``: one row per router, plus a reference row in each router's own regime."""

from __future__ import annotations

import yaml

from typer.testing import CliRunner

from testbed.cli import app

SPEC = """\
name: cmp
topology: small3
workload: {model: switch-base-8, rate_per_s: 4, duration_s: 1.0, warmup_s: 0.2, calibration_tokens: 64,
           gen_tokens: 0}  # prompt only: the own-regime row is the one that decodes
"""


def test_compare_adds_a_row_run_in_the_routers_own_regime(tmp_path):
    spec = tmp_path / "cmp.yaml"
    spec.write_text(SPEC)
    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["compare", str(spec), "--routers",
                                 "tests.regime_router:DecodeRegime", "--out", str(out), "--quiet"])
    assert r.exit_code == 0, r.output
    lines = r.output.strip().splitlines()
    assert lines[-4].startswith("tests.regime_router:DecodeRegime ")
    assert lines[-3].startswith("tests.regime_router:DecodeRegime (own regime)")
    # the decode table under it lists only the row that generated tokens
    assert lines[-2].split()[:3] == ["router", "TTFT", "ms"]
    assert lines[-1].startswith("tests.regime_router:DecodeRegime (own regime)")
    base = yaml.safe_load((out / "tests.regime_router.DecodeRegime" / "spec.resolved.yaml").read_text())
    own = yaml.safe_load((out / "tests.regime_router.DecodeRegime-own-regime" / "spec.resolved.yaml").read_text())
    assert base["workload"]["gen_tokens"] == 0 and own["workload"]["gen_tokens"] == 3
    assert own["workload"]["rate_per_s"] == 2.0 and own["topology"] == base["topology"]

    r = CliRunner().invoke(app, ["compare", str(spec), "--routers",
                                 "tests.regime_router:DecodeRegime", "--out", str(tmp_path / "o2"),
                                 "--quiet", "--no-reference"])
    assert r.exit_code == 0 and "own regime" not in r.output


def test_compare_names_an_unknown_router_in_one_line(tmp_path):
    spec = tmp_path / "cmp.yaml"
    spec.write_text(SPEC)
    r = CliRunner().invoke(app, ["compare", str(spec), "--routers", "no-such-router",
                                 "--out", str(tmp_path / "o"), "--quiet"])
    assert r.exit_code == 2 and "unknown router 'no-such-router'" in r.output


def test_compare_reuses_complete_runs_of_the_same_spec_and_reruns_on_request(tmp_path):
    spec = tmp_path / "cmp.yaml"
    spec.write_text(SPEC)
    out = tmp_path / "out"
    args = ["compare", str(spec), "--routers", "edgeshard", "--out", str(out), "--quiet", "--no-reference"]
    first = CliRunner().invoke(app, args)
    assert first.exit_code == 0, first.output
    assert "reused" not in first.output
    stamp = (out / "edgeshard" / "run.json").stat().st_mtime_ns
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0 and "reused 1 complete run(s)" in again.output
    assert (out / "edgeshard" / "run.json").stat().st_mtime_ns == stamp
    table = [ln for ln in first.output.splitlines() if ln.startswith("edgeshard ")]
    assert table and table == [ln for ln in again.output.splitlines() if ln.startswith("edgeshard ")]
    # --rerun runs the same spec again; another load is another spec: run, not reused
    forced = CliRunner().invoke(app, args + ["--rerun"])
    assert forced.exit_code == 0 and "reused" not in forced.output
    assert (out / "edgeshard" / "run.json").stat().st_mtime_ns != stamp
    other = CliRunner().invoke(app, args + ["--set", "workload.rate_per_s=6"])
    assert other.exit_code == 0 and "reused" not in other.output
