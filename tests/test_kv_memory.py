"""The most K/V a server holds at once, from the records (``testbed/kv_memory.py``, every
run's metrics and ``python -m analysis kv-memory``)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from testbed.kv_memory import kv_metrics, kv_warning, peaks


def _records():
    # request 0 (ends at 10): positions 0 and 2 on server 0, 1 on server 1; request 1 (ends at
    # 0.5, before any of request 0's K/V exist) on server 0; request 2 failed
    tl = pd.DataFrame({
        "request": [0, 0, 0, 1, 2],
        "token": [0, 1, 2, 0, 0],
        "layer": [0, 0, 0, 0, 0],
        "server": [0, 1, 0, 0, 1],
        "t_start": [0.5, 2.0, 4.0, 0.1, 0.0],
        "dense_s": [0.5, 1.0, 1.0, 0.1, 0.1],
    })
    rq = pd.DataFrame({"request": [0, 1, 2], "status": ["ok", "ok", "failed"],
                       "arrival_s": [0.0, 0.0, 0.0], "latency_s": [10.0, 0.5, 1.0]})
    return tl, rq


def test_a_server_holds_its_own_positions_until_the_request_ends_and_the_copies_it_needed():
    tl, rq = _records()
    own, both = peaks(tl, rq, kv_bytes=2.0, n_servers=3)
    # server 0: positions 0 and 2 of request 0 (request 1's was freed at 0.5, before them)
    assert list(own) == [4.0, 2.0, 0.0]
    # with copies: position 1 fetched to server 0 (for position 2, at 4.0) and position 0 to
    # server 1 (for position 1, at 2.0); the failed request's K/V went at its failure (1.0)
    assert list(both) == [6.0, 4.0, 0.0]
    # one the run never finished holds its K/V to the end: with request 0's on server 1
    own, both = peaks(tl, rq.assign(latency_s=[10.0, 0.5, float("nan")]), 2.0, 3)
    assert list(own) == [4.0, 4.0, 0.0] and list(both) == [6.0, 6.0, 0.0]


def test_positions_on_one_server_need_no_copies():
    tl, rq = _records()
    tl = tl.assign(server=0)
    own, both = peaks(tl, rq, kv_bytes=1.0, n_servers=2)
    assert list(own) == list(both) == [3.0, 0.0]
    with pytest.raises(KeyError):
        peaks(tl.drop(columns="dense_s"), rq, 1.0, 2)


def _naive(tl, rq, kv_bytes, n_servers):
    """The rule read literally, one position at a time (the columnar reading must equal it)."""
    ends = {r.request: r.arrival_s + r.latency_s if r.latency_s == r.latency_s else float("inf")
            for r in rq.itertuples()}
    own = {n: [] for n in range(n_servers)}
    cop = {n: [] for n in range(n_servers)}
    for (q, _), g in tl[tl["request"].isin(list(ends))].groupby(["request", "layer"]):
        g = g.sort_values("token")
        for row in g.itertuples():
            own[row.server].append((row.t_start + row.dense_s, ends[q]))
        for j in g.itertuples():
            for n in range(n_servers):
                later = g[(g["token"] > j.token) & (g["server"] == n)]
                if j.server != n and not later.empty:
                    cop[n].append((later["t_start"].iloc[0], ends[q]))

    def most(spans):
        events = sorted([(a, 0) for a, _ in spans] + [(e, 1) for _, e in spans])
        cur = best = 0
        for _, release in events:
            cur += -1 if release else 1
            best = max(best, cur)
        return best * kv_bytes

    return ([most(own[n]) for n in range(n_servers)],
            [most(own[n] + cop[n]) for n in range(n_servers)])


@given(st.data())
@settings(max_examples=60, deadline=None)
def test_the_columnar_reading_equals_the_rule_read_one_position_at_a_time(data):
    n_req = data.draw(st.integers(1, 4))
    n_srv = data.draw(st.integers(1, 3))
    rows = []
    for q in range(n_req):
        for layer in range(data.draw(st.integers(1, 3))):
            for tok in sorted(data.draw(st.sets(st.integers(0, 5), min_size=1, max_size=5))):
                rows.append((q, tok, layer, data.draw(st.integers(0, n_srv - 1)),
                             float(data.draw(st.integers(0, 6))), float(data.draw(st.integers(0, 2)))))
    tl = pd.DataFrame(rows, columns=["request", "token", "layer", "server", "t_start", "dense_s"])
    rq = pd.DataFrame({"request": range(n_req),
                       "status": [data.draw(st.sampled_from(["ok", "ok", "failed"])) for _ in range(n_req)],
                       "arrival_s": 0.0,
                       "latency_s": [data.draw(st.sampled_from([float("nan"), *map(float, range(1, 11))]))
                                     for _ in range(n_req)]})
    own, both = peaks(tl, rq, 2.0, n_srv)
    want_own, want_both = _naive(tl, rq, 2.0, n_srv)
    assert list(own) == want_own and list(both) == want_both


def test_a_run_whose_cache_outgrows_a_server_is_flagged():
    tl, rq = _records()
    room = np.array([5.0e6, 100.0e6, 100.0e6])
    met = kv_metrics(tl, rq, kv_bytes=2.0e6, room=room, causal=True, names=["s1", "s2", "s3"])
    # server 0 holds 6 MB with the fetched copy, 1.2x its 5 MB
    assert met["kv_peak_server"] == "s1" and met["kv_peak_mb"] == 6.0 and met["kv_peak_share"] == 1.2
    line = kv_warning(met)
    assert line is not None and line.startswith("warning: s1 held 6 MB") and "1.20x the 5 MB" in line
    # under the paper's rule the copies are not held: 4 MB, inside the room
    met = kv_metrics(tl, rq, kv_bytes=2.0e6, room=room, causal=False)
    assert met["kv_peak_mb"] == 4.0 and kv_warning(met) is None


TINY = {"topology": "small3", "workload": {"model": "switch", "duration_s": 0.4, "warmup_s": 0.1,
                                           "rate_per_s": 40, "calibration_tokens": 64,
                                           "prompt_tokens": 8, "gen_tokens": 0}}


def test_every_run_reports_its_kv_cache_and_the_cli_warns_when_a_server_outgrew_its_room(tmp_path):
    from typer.testing import CliRunner

    from analysis.kv_memory import measure_run
    from testbed.cli import app
    from testbed.runner import run_experiment
    from testbed.setup import check_spec
    from testbed.spec import parse_spec

    roomy = parse_spec({**TINY, "name": "roomy"})
    met = run_experiment(roomy, tmp_path / "roomy", progress=False).metrics
    assert 0.0 < met["kv_peak_share"] < 1.0 and met["kv_peak_server"] in check_spec(roomy).cluster.names
    # causal attention (the default) holds the copies it fetched too: the analysis reading's
    # peak with them; the per-token rule holds a server's own positions only
    read = measure_run(tmp_path / "roomy")
    assert met["kv_peak_mb"] == pytest.approx(read.all_peak_b / 1e6, abs=1e-3)
    assert read.all_peak_b > read.own_peak_b  # this run's tokens did fetch K/V
    per_token = parse_spec({**TINY, "name": "own", "engine": {"attention": "independent"}})
    met = run_experiment(per_token, tmp_path / "own", progress=False).metrics
    assert met["kv_peak_mb"] == pytest.approx(measure_run(tmp_path / "own").own_peak_b / 1e6, abs=1e-3)
    # leave the cache almost no room: the same run is flagged, one line on stderr
    spec = tmp_path / "tight.yaml"
    spec.write_text(parse_spec({**TINY, "name": "tight", "memory": {"gpu_share": 0.99999}}).to_yaml())
    out = CliRunner().invoke(app, ["run", str(spec), "--out", str(tmp_path / "tight"), "--quiet"])
    assert out.exit_code == 0, out.output
    warned = [ln for ln in out.stderr.splitlines() if "K/V cache" in ln]
    assert len(warned) == 1 and warned[0].startswith("warning: ") and "not physical" in warned[0]
    assert "K/V cache" not in out.stdout


def test_a_figure_counts_its_runs_past_the_room_and_says_nothing_for_runs_made_before():
    from analysis.render import kv_room_use

    runs = pd.DataFrame({"kv_peak_share": [0.2, 1.4, np.nan, 1.01]})
    assert kv_room_use(runs) == {"kv_peak_share_max": 1.4, "kv_over_room": 2}
    assert kv_room_use(pd.DataFrame({"mean_ms": [1.0]})) == {"kv_peak_share_max": None,
                                                            "kv_over_room": None}


def test_a_sweep_names_its_runs_past_the_room(tmp_path):
    import json
    from types import SimpleNamespace

    from testbed.sweep import kv_over_room

    points = []
    for name, met in (("fits", {"kv_peak_share": 0.3}), ("over", {"kv_peak_share": 1.2}),
                      ("old", {"mean_ms": 1.0}), ("unfinished", None)):
        (tmp_path / name).mkdir()
        if met is not None:
            (tmp_path / name / "metrics.json").write_text(json.dumps(met))
        points.append(SimpleNamespace(out_dir=tmp_path / name))
    assert kv_over_room(points) == [str(tmp_path / "over")]
