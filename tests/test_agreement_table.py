"""``python -m analysis agreement-table``: an agree-sweep's file as the README's table."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
from typer.testing import CliRunner

from analysis.__main__ import app
from analysis.agreement_table import load, table
from testbed.agreement import Band, Comparison, PointComparison, SeedInterval


def _point(router: str, rate: float, mean: tuple, p99: tuple, work: tuple, cut: float | None,
           band: Band | None = None, seeds: int = 1, ensemble: Comparison | None = None,
           seed_ci: SeedInterval | None = None) -> dict:
    """A point as ``sweep_agreement`` writes it: the real dataclasses through ``asdict``."""
    ok_mean = abs(mean[0] / mean[1] - 1) <= 0.05 if mean[1] == mean[1] else True
    ok_p99 = abs(p99[0] / p99[1] - 1) <= 0.10 if p99[1] == p99[1] else True
    ok_work = cut is None or abs(work[0] / work[1] - 1) <= 0.05
    c = Comparison("emu/sim", router, mean, p99, (64.0, None), ok_mean, ok_p99, seeds,
                   (3, 4), work, cut is not None, ok_work, band, ensemble, seed_ci)
    p = PointComparison(f"name={router},rate_per_s={rate:g}/seed0", rate, cut, 5, c)
    return json.loads(json.dumps({**asdict(p), "ok": p.ok, "in_band": c.in_band,
                                  "ok_ensemble": c.ok_ensemble}))


def test_the_p99_interval_is_shown_where_the_file_has_one(tmp_path):
    """Files since 2026-12-06 bound the P99 over the seeds too; older ones (no ``p99``)
    keep their rows as they were."""
    new = _point("hetroute", 40, (538.4, 551.1), (1274.2, 1068.5), (405504, 405504), None,
                 seeds=14, seed_ci=SeedInterval(14, (0.913, 1.047), (1.0, 1.0), (0.84, 1.25)))
    old = _point("edgeshard", 10, (541.2, 540.5), (617.8, 617.3), (5760, 5760), None, seeds=3,
                 seed_ci=SeedInterval(3, (0.97, 1.04), (1.0, 1.0)))
    del old["check"]["seed_ci"]["p99"]  # as an agreement.json of 2026-12-05 has it
    (tmp_path / "agreement.json").write_text(json.dumps([new, old]))
    rows = table(load(tmp_path)).splitlines()[2:4]
    assert rows[0].endswith("| mean 0.970-1.040 (agrees) |")
    assert rows[1].endswith("| mean 0.913-1.047 (undecided at 14 seeds); "
                            "P99 0.840-1.250 (undecided at 14 seeds) |")


def test_rows_say_what_the_file_holds_sorted_and_counted(tmp_path):
    band = Band((0.0, 1e-5), (900.0, 1300.0), (1000.0, 1600.0), (4000, 5000))
    # against the ensemble (exact and jittered twins pooled) the mean is within, the work not
    ens = Comparison("emu/ensemble", "prism", (1000.0, 990.0), (1500.0, 1450.0), (64.0, None),
                     True, True, 1, (3, 8), (4100, 4500), True, False)
    points = [
        _point("prism", 40, (1000.0, 1100.0), (1500.0, 1510.0), (4100, 4400), 2.07, band,
               ensemble=ens),
        _point("edgeshard", 80, (571.0, 570.6), (795.5, 795.3), (55296, 55296), None),
        _point("edgeshard", 10, (541.2, 540.5), (617.8, 617.3), (5760, 5760), None, seeds=3,
               seed_ci=SeedInterval(3, (0.97, 1.04), (1.0, 1.0))),
        _point("moe-infinity", 40, (float("nan"), float("nan")), (float("nan"), float("nan")),
               (8748, 8748), 2.07),
    ]
    (tmp_path / "agreement.json").write_text(json.dumps(points))
    text = table(load(tmp_path))  # the folder or the file
    lines = text.splitlines()
    assert lines[0].startswith("| router | req/s |") and lines[1].count("---") == 14
    rows = lines[2:6]
    assert [r.split(" | ")[0] for r in rows] == ["| edgeshard (3 seeds)", "| edgeshard",
                                                   "| moe-infinity", "| prism"]
    es10 = rows[0].split(" | ")
    assert es10[1:5] == ["10", "64", "-", "3 / 4 (5)"]
    assert es10[5:7] == ["541.2 / 540.5", f"{541.2 / 540.5:.3f}"] and rows[0].endswith(
        "| yes | - | mean 0.970-1.040 (agrees) |")
    assert " - | - | - | - | 8748 / 8748 | 1.000 | yes | - | - |" in rows[2]  # nothing finished
    # Prism: mean 0.909 is out, but inside the simulator's band on every metric
    assert "| 2.07 |" in rows[3] and "0.909" in rows[3] and rows[3].endswith(
        f"| **no** (inside the band) | **no** (mean {1000 / 990:.3f}, P99 {1500 / 1450:.3f}, "
        f"work {4100 / 4500:.3f}) | - |")
    assert lines[-1] == ("3 of 4 within tolerance; 4 within or inside the simulator's jitter "
                         "band; 0 within tolerance of the simulator's ensemble")


def test_a_file_that_is_not_an_agreement_gets_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text('{"not": "a list"}')
    with pytest.raises(ValueError, match="expected a list of points"):
        load(bad)
    res = CliRunner().invoke(app, ["agreement-table", str(bad)])
    assert res.exit_code == 2 and "not an agree-sweep's agreement.json" in res.output
    res = CliRunner().invoke(app, ["agreement-table", str(tmp_path / "missing.json")])
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1
