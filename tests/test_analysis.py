"""Claims, sweep expansion and skipping, figure rendering and the report."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from analysis.claims import evaluate
from analysis.load import flatten, select
from analysis.render import FIGURES
from testbed.spec import SpecError
from testbed.sweep import FigureSpec, done, expand, figure_path, load_figure


def _df():
    rows = []
    for seed in (0, 1, 2):
        for router, mean, tput in (("hetroute", 100 + seed, 1500), ("prism", 150 + seed, 1000),
                                   ("edgeshard", 300 + seed, 700)):
            for rate, f in ((10, 1.0), (80, 2.0 if router == "hetroute" else 3.0)):
                rows.append({"router.name": router, "workload.rate_per_s": rate, "seed": seed,
                             "mean_ms": mean * f, "throughput_tok_s": tput, "budget_violations": 0})
    return pd.DataFrame(rows)


def test_value_reduction_ratio_order_growth():
    df = _df()
    v = evaluate({"id": "v", "kind": "value", "metric": "mean_ms",
                  "a": {"router.name": "hetroute", "workload.rate_per_s": 10}, "paper": 101}, df)
    assert v["measured"] == pytest.approx(101) and v["verdict"] == "close" and len(v["per_seed"]) == 3
    assert v["ci95"][0] < 101 < v["ci95"][1]
    r = evaluate({"id": "r", "kind": "reduction", "metric": "mean_ms",
                  "a": {"router.name": "hetroute", "workload.rate_per_s": 10},
                  "b": {"router.name": "prism", "workload.rate_per_s": 10}, "paper": 0.28}, df)
    assert r["measured"] == pytest.approx(1 - 101 / 151, rel=1e-3) and r["verdict"] == "agrees"
    bad = evaluate({"id": "b", "kind": "reduction", "metric": "mean_ms",
                    "a": {"router.name": "prism"}, "b": {"router.name": "hetroute"}, "paper": 0.28}, df)
    assert bad["verdict"] == "disagrees"
    q = evaluate({"id": "q", "kind": "ratio", "metric": "throughput_tok_s", "a": {"router.name": "hetroute"},
                  "b": {"router.name": "edgeshard"}, "paper": 2.13}, df)
    assert q["measured"] == pytest.approx(1500 / 700) and q["verdict"] == "agrees"
    o = evaluate({"id": "o", "kind": "order", "metric": "mean_ms", "over": "router.name",
                  "where": {"workload.rate_per_s": 80}, "paper": ["hetroute", "prism", "edgeshard"]}, df)
    assert o["verdict"] == "agrees"
    o2 = evaluate({"id": "o", "kind": "order", "metric": "mean_ms", "over": "router.name",
                   "paper": ["prism", "hetroute"]}, df)
    assert o2["verdict"] == "disagrees" and o2["kendall_tau"] == pytest.approx(-1)
    g = evaluate({"id": "g", "kind": "growth_less", "metric": "mean_ms", "over": "workload.rate_per_s",
                  "from": 10, "to": 80, "a": {"router.name": "hetroute"}, "b": {"router.name": "prism"},
                  "paper": [1.95, 2.2]}, df)
    assert g["measured"] == pytest.approx([2.0, 3.0]) and g["verdict"] == "agrees"
    z = evaluate({"id": "z", "kind": "zero", "metric": "budget_violations", "a": {}, "paper": 0}, df)
    assert z["verdict"] == "agrees"
    missing = evaluate({"id": "m", "kind": "value", "metric": "p99_ms", "a": {}, "paper": 1}, df)
    assert missing["verdict"] == "no data"


def test_every_figure_spec_loads_and_expands(tmp_path):
    for fig in FIGURES:
        spec = load_figure(figure_path(fig))
        for scale in ("smoke", "quick", "full"):
            pts = expand(spec, "sim", scale, tmp_path)
            assert pts and len({p.out_dir for p in pts}) == len(pts)
        for c in spec.claims:  # every claim names a kind the evaluator knows
            assert c["kind"] in {"value", "reduction", "ratio", "order", "growth_less", "zero", "at_most"}


def test_bad_figure_spec_is_one_line(tmp_path):
    p = tmp_path / "f.yaml"
    p.write_text("figure: 2\ntitle: x\nscales: {tiny: {seeds: [0]}}\n")
    with pytest.raises(SpecError) as err:
        load_figure(p)
    assert "\n" not in str(err.value) and "scales" in str(err.value)


def test_sweep_skips_done_points_and_reruns_changed_ones(tmp_path):
    fig = FigureSpec.model_validate({
        "figure": 99, "title": "t",
        "base": {"topology": "small3",
                 "workload": {"model": "switch", "calibration_tokens": 64, "gen_tokens": 0}},
        "axes": {"workload.rate_per_s": [5, 10]},
        "scales": {"smoke": {"seeds": [0], "set": {"workload.duration_s": 0.4, "workload.warmup_s": 0.1}}}})
    from testbed.sweep import run_sweep
    s0 = run_sweep(fig, "sim", "smoke", tmp_path, jobs=1, progress=False, dry_run=True)
    assert s0["skipped"] == 0 and s0["estimate_s"] > 0 and not (tmp_path / "fig99").exists()
    s1 = run_sweep(fig, "sim", "smoke", tmp_path, jobs=1, progress=False)
    assert s1["skipped"] == 0 and not s1["failed"]
    s2 = run_sweep(fig, "sim", "smoke", tmp_path, jobs=1, progress=False)
    assert s2["skipped"] == 2
    pts = expand(fig, "sim", "smoke", tmp_path)
    (pts[0].out_dir / "run.json").write_text(json.dumps({"status": "running"}))  # killed mid-run
    assert not done(pts[0]) and done(pts[1])
    s3 = run_sweep(fig, "sim", "smoke", tmp_path, jobs=1, progress=False)
    assert s3["skipped"] == 1


def test_flatten_and_select():
    assert flatten({"a": 1, "b": {"c": 2, "d": {"e": 3}}}) == {"a": 1, "b.c": 2, "b.d.e": 3}
    df = pd.DataFrame({"x": [1.0, 2.0], "y": ["a", "b"]})
    assert len(select(df, {"x": 2})) == 1 and len(select(df, {"y": "a", "zz": 1})) == 1


def test_restrict_makes_a_partial_grid(tmp_path):
    spec = load_figure(figure_path(4))
    pts = expand(spec, "sim", "quick", tmp_path)
    by_router = {}
    for p in pts:
        by_router.setdefault(p.values["router.name"], set()).add(p.values["quality.budget"])
    assert len(by_router["hetroute"]) == 6 and by_router["prism"] == by_router["moe-infinity"] == {0.02}
    assert len(pts) == (6 + 1 + 1) * 3
    bad = spec.model_copy(update={"restrict": [type(spec.restrict[0])(when={"nope": [1]}, only={"seed": [0]})]})
    with pytest.raises(SpecError, match="not an axis"):
        expand(bad, "sim", "quick", tmp_path)


@pytest.mark.parametrize("spread, scale", [(100.0, "log"), (3.0, "linear")])
def test_latency_bars_spanning_orders_of_magnitude_use_a_log_axis(spread, scale):
    import matplotlib
    matplotlib.use("Agg")
    from analysis.plots import common as C

    df = pd.DataFrame({"router.name": ["hetroute", "prism"] * 2, "model": ["a", "a", "b", "b"],
                       "mean_ms": [10.0, 10.0 * spread, 12.0, 11.0]})
    for draw in (lambda ax: C.router_bars(ax, df, "mean_ms", "t"),
                 lambda ax: C.grouped_bars(ax, df, "mean_ms", "model", "t")):
        fig, (ax,) = C.grid(1, "x")
        draw(ax)
        assert ax.get_yscale() == scale
        C.plt.close(fig)


def test_report_prints_quantities_with_units_as_numbers_and_shares_as_percent():
    from analysis.report import _fmt
    assert _fmt(0.132, "value", "gb_per_1k_tokens") == "0.132"
    assert _fmt(0.5, "value", "mean_ms") == "0.5"
    assert _fmt(0.286, "value", "remote_ratio") == "28.6%"
    assert _fmt(0.3, "reduction", "mean_ms") == "30.0%"
    assert _fmt(2.13, "ratio", "throughput_tok_s") == "2.13x"
    assert _fmt(0.857, "ratio", "exec_types.remote_gpu") == "0.86x"  # a ratio's CI bound too
    assert _fmt(0.000394, "value", "lam_mean") == "0.0394%"  # small shares keep their digits


def _fidelity_detail(T: float, *, late_p99_ms: float, drops: int = 0, tc_rate: int = 1_000_000,
                     timed_out: bool = False, unrecorded: int = 0, cpu_max: float = 60.0) -> dict:
    return {"dilation": T, "delay_mechanism": "transport", "wall_s": 10.0, "emulated_s": 10.0 / T,
            "timed_out": timed_out, "killed": [], "cpu_percent_mean": 40.0, "cpu_percent_max": cpu_max,
            "requests_unrecorded": unrecorded, "fidelity_flags": ["x"],
            "links": [{"rate_bit": 1_000_000, "tc_rate_bit": tc_rate, "drops": drops},
                      {"rate_bit": 2_000_000, "tc_rate_bit": 2_000_000, "drops": 0}],
            "workers": [{"rank": 0, "batches": 10, "late_over_tolerance": 5, "release_late_p99_ms": late_p99_ms,
                         "release_late_max_ms": 2 * late_p99_ms, "delivery_late_mean_ms": 1.0,
                         "worst_release_late": [[2 * late_p99_ms, 310.5], [0.5, 20.0]],
                         "wire_errors": 0, "kernel_errors": 0},
                        {"rank": 1, "batches": 10, "late_over_tolerance": 0, "release_late_p99_ms": 0.1,
                         "release_late_max_ms": 0.2, "delivery_late_mean_ms": 0.5,
                         "worst_release_late": [[0.2, 99.0]],
                         "wire_errors": 0, "kernel_errors": 0}]}


def test_fidelity_table_converts_lateness_to_emulated_time_and_names_every_problem(tmp_path):
    from types import SimpleNamespace

    from analysis.fidelity import fidelity_table, run_row, summarise
    from analysis.load import FigureData
    from analysis.report import _fidelity_lines
    runs = []
    for i, (T, detail) in enumerate([(32, _fidelity_detail(32, late_p99_ms=64.0)),
                                     (64, _fidelity_detail(64, late_p99_ms=64.0))]):
        d = tmp_path / f"run{i}"
        d.mkdir()
        (d / "fidelity.json").write_text(json.dumps({"flags": [], "detail": detail}))
        runs.append({"router.name": "hetroute", "seed": i, "run_dir": str(d)})
    runs.append({"router.name": "prism", "seed": 0, "run_dir": str(tmp_path / "sim-run")})  # no file
    data = FigureData(SimpleNamespace(axes={"router.name": []}), "emu", "quick", pd.DataFrame(runs), [], 0)
    table = fidelity_table(data)
    assert list(table["release_late_p99_emu_ms"]) == [2.0, 1.0]  # worst worker, wall ms / T
    assert list(table["late_release_share"]) == [0.25, 0.25]
    # when the worst stall fell (model ms), over every worker; runs written before have none
    assert list(table["release_late_max_at_ms"]) == [310.5, 310.5]
    assert np.isnan(table["write_late_max_at_ms"]).all()
    s = summarise(table)
    assert s["runs"] == 2 and s["problems"] == [] and s["drops"] == 0
    assert s["release_late_p99_emu_ms_max"] == 2.0 and s["T_min"] == 32 and s["T_max"] == 64
    assert "No drops" in "\n".join(_fidelity_lines(9, s))

    broken = run_row(_fidelity_detail(64, late_p99_ms=1.0, drops=3, tc_rate=1_100_000, timed_out=True,
                                      unrecorded=4, cpu_max=99.0))
    bad = pd.DataFrame([table.iloc[0].to_dict(), {**table.iloc[1].to_dict(), **broken}])
    problems = summarise(bad)["problems"]
    assert len(problems) == 4 and any("10.0% off" in p for p in problems)
    assert any("4 requests unfinished" in p and "(router.name = hetroute)" in p for p in problems) and any("3 packets" in p for p in problems)
    assert "**Fidelity problems:**" in "\n".join(_fidelity_lines(9, summarise(bad)))
    assert summarise(fidelity_table(FigureData(data.spec, "sim", "quick", pd.DataFrame(runs[2:]), [], 0))) is None


def test_figures_with_capacity_list_their_routers_searched_for_their_setting(tmp_path):
    from analysis.render import capacities, capacity_line
    from testbed.capacity import setting_key
    from testbed.spec import parse_spec

    fig9 = load_figure(figure_path(9))
    base = parse_spec({"name": "capacity", "topology": "paper10", "sla_s": 0.3,
                       "workload": {"model": "mixtral-8x7b", "duration_s": 4.0, "warmup_s": 1.0,
                                    "gen_tokens": 0}})  # specs/capacity.yaml's setting
    for router, spec in (("hetroute", base), ("petals", base), ("greedy", base),
                         ("prism", base.with_overrides({"sla_s": 1.0})),
                         ("edgeshard", base.with_overrides({"workload.model": "qwen"}))):
        d = tmp_path / "capacity" / f"x-{router}" / router
        d.mkdir(parents=True)
        (d / "capacity.json").write_text(json.dumps(
            {"router": router, "capacity_rps": 1.5, "bounded": True, "sla_s": spec.sla_s, "lo": 1.0,
             "hi": 320.0, "target": 0.9, "physics": "hardware", "setting": setting_key(spec),
             "spec": "capacity", "duration_s": 4.0}))
    got = capacities(fig9, tmp_path, "hardware")
    # greedy is not in Fig. 9; prism was searched at 1 s and edgeshard on another model
    assert sorted(got) == ["hetroute", "petals"]
    assert capacity_line(got) == "capacity, req/s (90% within 300 ms): hetroute 1.5, petals 1.5"
    assert capacities(fig9, tmp_path, "paper") == {}
    assert capacities(load_figure(figure_path(5)), tmp_path, "hardware") == {}  # not asked for


def test_line_figures_mark_points_that_are_not_a_steady_state():
    import matplotlib.pyplot as plt

    from analysis.plots import common as C

    df = pd.DataFrame({"router.name": ["a", "a", "b", "b"], "workload.rate_per_s": [1, 10, 1, 10],
                       "mean_ms": [1.0, 2.0, 3.0, 4.0], "unstable": [False, True, False, False],
                       "window_x_latency": [3.0, 2.0, 1.5, 0.5]})
    fig, ax = plt.subplots()
    C.lines(ax, df, "mean_ms", "workload.rate_per_s", "t")
    marks = [c.get_offsets().tolist() for c in ax.collections if len(c.get_offsets()) == 1]
    assert [10.0, 2.0] in [m[0] for m in marks] and [10.0, 4.0] in [m[0] for m in marks]
    assert "unstable" in ax.texts[0].get_text() and "window < latency" in ax.texts[0].get_text()
    plt.close(fig)
