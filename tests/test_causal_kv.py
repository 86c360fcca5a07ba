"""What a token's attention needs that the world does not charge (analysis/causal_kv.py)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from analysis.causal_kv import measure, measure_run
from testbed.runner import run_experiment
from testbed.spec import parse_spec

KV = 4096.0
DELAY = np.array([[0.0, 0.010], [0.010, 0.0]])
BW = np.full((2, 2), 1e9)


def _records(rows, home=0, gen=()):
    """Token-layers from (token, layer, t_start, server, next_server, dense_s, total_s) of one
    request, and its request row."""
    tl = pd.DataFrame([{"request": 7, "token": k, "layer": l, "t_start": t, "server": s,
                        "next_server": n, "dense_s": d, "total_s": tot}
                       for k, l, t, s, n, d, tot in rows])
    ends = tl.t_start + tl.total_s
    rq = pd.DataFrame([{"request": 7, "status": "ok", "home": home, "tokens": tl.token.nunique(),
                        "gen_done_s": list(gen), "latency_s": float(ends.max())}])
    return tl, rq


# token 0 spends 3 ms in layer 0's dense part; token 1, released with it, ends that part at
# 1 ms and layer 1's at 3 ms: both before token 0's, so it attended K/V that did not exist
RACE = [(0, 0, 0.000, 0, 0, 0.003, 0.004), (0, 1, 0.004, 0, 0, 0.001, 0.001),
        (1, 0, 0.000, 0, 0, 0.001, 0.002), (1, 1, 0.002, 0, 0, 0.001, 0.004)]


def test_a_later_position_that_ran_ahead_waits_for_the_earlier_ones_kv():
    r = measure(*_records(RACE), KV, DELAY, BW, 8192.0)
    assert r.token_layers == 4 and r.kv_remote == 0.0 and r.kv_bytes == 0.0
    assert r.causal == pytest.approx(0.5)  # token 1 at both layers
    assert r.lead_mean_s == pytest.approx(0.002)  # 2 ms at layer 0, 2 ms at layer 1
    assert r.latency_mean_s == pytest.approx(0.006)
    # token 1's layer 0 ends with token 0's (3 ms), so its layer 1 starts at 4 ms, its dense
    # part ends with token 0's at 5 ms, and its 3 ms after that end it at 8 ms
    assert r.order_mean_s == pytest.approx(0.008)
    assert r.push_mean_s == r.pull_mean_s == pytest.approx(0.008)  # nothing crosses a link


def test_kv_computed_on_another_server_crosses_the_link_before_it_is_attended():
    rows = list(RACE)
    rows[2] = (1, 0, 0.000, 1, 0, 0.001, 0.002)  # token 1 attends at server 1 in layer 0
    r = measure(*_records(rows), KV, DELAY, BW, 8192.0)
    assert r.kv_remote == pytest.approx(0.25) and r.kv_bytes == KV
    assert r.order_mean_s == pytest.approx(0.008)
    lat = 0.010 + KV / 1e9  # token 0's K/V of layer 0, pushed from server 0 when computed
    assert r.push_mean_s == pytest.approx(0.003 + lat + 0.001 + 0.001 + 0.003)
    # pulled: server 1 asks for it when token 1 arrives (at 0), the answer leaves at 10 ms
    assert r.pull_mean_s == pytest.approx(0.010 + lat + 0.001 + 0.001 + 0.003)


def test_pulled_kv_stays_where_it_was_fetched():
    rows = list(RACE)
    rows[2] = (1, 0, 0.000, 1, 0, 0.001, 0.002)
    # a generated token attends at server 1 in layer 0 too: token 0's K/V are there already
    rows += [(2, 0, 0.006, 1, 0, 0.001, 0.001), (2, 1, 0.007, 0, 0, 0.001, 0.001)]
    r = measure(*_records(rows, gen=(0.008,)), KV, DELAY, BW, 8192.0)
    prompt_end = 0.020 + KV / 1e9 + 0.005  # token 1's, as in the test before
    assert r.pull_mean_s == pytest.approx(prompt_end + 0.002)  # no second round trip


def test_a_pipeline_whose_tokens_share_each_step_reads_zero_on_every_count():
    rows = [(k, l, 0.002 * l, l % 2, (l + 1) % 2, 0.001, 0.002) for k in range(3) for l in range(2)]
    r = measure(*_records(rows, home=0), KV, DELAY, BW, 8192.0)
    assert (r.kv_remote, r.causal, r.kv_bytes) == (0.0, 0.0, 0.0)
    assert r.order_mean_s == r.push_mean_s == pytest.approx(r.latency_mean_s)


def test_a_generated_token_starts_later_when_the_prompt_ends_later():
    # prompt tokens 0 and 1 race as in RACE; token 2 (generated) starts when the prompt is home
    rows = RACE + [(2, 0, 0.006, 0, 0, 0.001, 0.001), (2, 1, 0.007, 0, 0, 0.001, 0.001)]
    r = measure(*_records(rows, gen=(0.008,)), KV, DELAY, BW, 8192.0)
    assert r.latency_mean_s == pytest.approx(0.008)
    assert r.order_mean_s == pytest.approx(0.010)  # the prompt ends 2 ms later, and so does it


def test_unfinished_requests_are_left_out_and_no_finished_one_is_an_error():
    tl, rq = _records(RACE)
    rq.loc[0, "status"] = "failed"
    with pytest.raises(ValueError, match="no finished request"):
        measure(tl, rq, KV, DELAY, BW, 8192.0)


TINY = {"topology": "small3", "workload": {"model": "switch", "duration_s": 0.4, "warmup_s": 0.1,
                                           "rate_per_s": 40, "calibration_tokens": 64,
                                           "prompt_tokens": 8, "gen_tokens": 0}}


@pytest.mark.slow
def test_real_runs_a_pipeline_reads_zero_and_a_router_whose_tokens_part_does_not(tmp_path):
    runs = {}
    for name in ("edgeshard", "hetroute"):
        spec = parse_spec({**TINY, "name": name, "router": {"name": name}})
        run_experiment(spec, tmp_path / name, progress=False)
        runs[name] = tmp_path / name
    pipe = measure_run(runs["edgeshard"])
    assert pipe.token_layers > 0 and (pipe.kv_remote, pipe.causal) == (0.0, 0.0)
    assert pipe.order_mean_s == pytest.approx(pipe.latency_mean_s)
    het = measure_run(runs["hetroute"])
    assert het.kv_remote > 0 and het.order_mean_s >= het.latency_mean_s
    out = subprocess.run([sys.executable, "-m", "analysis", "causal-kv", str(tmp_path / "hetroute")],
                         capture_output=True, text=True, check=True).stdout
    assert "hetroute" in out and "%" in out
    bad = subprocess.run([sys.executable, "-m", "analysis", "causal-kv", str(tmp_path / "none")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "error:" in bad.stderr and "Traceback" not in bad.stderr


# -- engine.attention: causal (testbed/kv.py, the simulator) ---------------------------------

def test_a_token_waits_for_earlier_positions_and_fetches_what_other_servers_computed():
    from testbed.kv import RequestKv
    kv = RequestKv()
    assert kv.needs(3, 0, 1) == {}  # the first position needs nothing
    assert kv.needs(3, 2, 1) is None  # positions 0 and 1 have not reached layer 3
    kv.submitted(3, 0, 1)
    kv.submitted(3, 1, 2)
    assert kv.needs(3, 1, 1) == {}  # position 0 is in this server's stream: same or earlier step
    assert kv.needs(3, 2, 1) is None  # position 1 is in another server's stream
    kv.done(3, 1, 2)
    assert kv.needs(3, 2, 1) == {2: [1]}  # its K/V exist on server 2: fetch them
    kv.fetched(3, 1, [1])
    assert kv.needs(3, 2, 1) == {}
    assert kv.needs(3, 2, 2) is None  # on server 2, position 0 (queued on server 1) is missing
    kv.done(3, 0, 1)
    assert kv.needs(3, 2, 2) == {1: [0]} and kv.needs(4, 1, 2) is None  # layers apart
    kv.park(3, "t")
    assert kv.take_waiting(3) == ["t"] and kv.take_waiting(3) == []


def test_causal_attention_is_the_hardware_worlds_rule_and_the_papers_world_has_none():
    from testbed.spec import SpecError
    # the hardware world's default since 2026-12-08, written into its resolved specs
    assert (parse_spec({}).engine.attention, parse_spec({}).engine.kv_news) == ("causal", "home")
    assert "attention: causal" in parse_spec({}).to_yaml()
    assert "attention: independent" in parse_spec({"engine": {"attention": "independent"}}).to_yaml()
    # the paper's world is per token: its resolved specs, made before or since, say nothing
    paper = parse_spec({"physics": "paper"})
    assert paper.engine.attention == "independent" and "attention" not in paper.to_yaml()
    # a changed world picks again what the spec left out, and keeps what it wrote
    assert parse_spec({}).with_overrides({"physics": "paper"}) == paper
    assert paper.with_overrides({"physics": "hardware"}).engine.attention == "causal"
    kept = parse_spec({"engine": {"attention": "independent"}}).with_overrides({"seed": 3})
    assert kept.engine.attention == "independent"
    for other in ({"backend": "emu", "engine": {"attention": "causal", "kv_news": "instant"}},
                  {"physics": "paper", "engine": {"attention": "causal"}}):
        with pytest.raises(SpecError, match="engine.attention"):
            parse_spec(other)
    # the emulated workers run the home's directory (no worker sees every K/V), fault-free
    home = {"engine": {"attention": "causal", "kv_news": "home"}, "backend": "emu"}
    assert "kv_news: home" in parse_spec(home).to_yaml()
    fault = [{"kind": "kill_worker", "at_s": 0.5, "server": "s1"}]
    for spec in ({**home, "faults": fault}, {"backend": "emu", "faults": fault}):
        with pytest.raises(SpecError, match="without faults.*engine.attention: independent"):
            parse_spec(spec)
    assert parse_spec({"backend": "emu", "faults": fault,
                       "engine": {"attention": "independent"}}).faults


CAUSAL = {**TINY, "workload": {**TINY["workload"], "gen_tokens": 4}}


@pytest.mark.slow
def test_under_causal_attention_no_token_outruns_an_earlier_position(tmp_path):
    import json
    spec = parse_spec({**CAUSAL, "name": "h", "router": {"name": "hetroute"},
                       "engine": {"attention": "causal", "kv_news": "instant"}})
    run_experiment(spec, tmp_path / "h", progress=False)
    r = measure_run(tmp_path / "h", every_request=True)  # as the run's counters count
    stats = json.loads((tmp_path / "h" / "run.json").read_text())["stats"]
    assert r.causal == 0.0 and r.lead_mean_s == 0.0  # every dense part after the earlier ones'
    assert r.kv_remote > 0 and stats["kv_fetches"] > 0 and stats["kv_waits"] > 0
    assert stats["kv_bytes"] == r.kv_bytes  # the fetches moved what the records say was needed
    measured = measure_run(tmp_path / "h")  # the requests the metrics measure: fewer
    assert 0 < measured.requests < r.requests and measured.kv_bytes < r.kv_bytes
    assert r.pull_mean_s == pytest.approx(r.latency_mean_s)  # nothing left for a replay to add
    # a pipeline's tokens run each layer together in one server's steps: nothing changes
    for name, rule in (("edgeshard", "independent"), ("edgeshard", "causal")):
        s = parse_spec({**CAUSAL, "name": name, "router": {"name": name},
                        "engine": {"attention": rule}})
        run_experiment(s, tmp_path / rule, progress=False)
    from testbed.records import read_records
    a = read_records(tmp_path / "independent")[1].sort_values("request").latency_s.to_numpy()
    b = read_records(tmp_path / "causal")[1].sort_values("request").latency_s.to_numpy()
    assert len(a) > 0 and np.array_equal(a, b)


# -- engine.kv_news: home (a directory at the request's home) --------------------------------

def test_the_home_answers_only_once_it_has_heard_of_every_position_asked_for():
    from testbed.kv import RequestKv
    kv = RequestKv()
    kv.submitted(2, 0, 1)
    kv.done(2, 1, 1)
    kv.fetched(2, 1, [2])
    assert kv.local_missing(2, 4, 1) == [3]  # 0 in its stream, 1 computed there, 2 fetched
    assert kv.local_missing(2, 4, 0) == [0, 1, 2, 3] and kv.local_missing(2, 0, 0) == []
    assert kv.located(2, [1, 3]) is None  # the home has heard of neither
    kv.notice(2, 1, 1)
    assert kv.located(2, [1, 3]) is None
    kv.notice(2, 3, 4)
    assert kv.located(2, [1, 3]) == {1: [1], 4: [3]} and kv.located(3, [1]) is None


def _ledger(events):
    from testbed.kv import RequestKv
    kv = RequestKv()
    for kind, pos, server in events:  # one layer (0); positions 0-7 on servers 0-2
        if kind == 0:
            kv.submitted(0, pos, server)
        elif kind == 1:
            kv.done(0, pos, server)
        else:
            kv.fetched(0, server, [pos])
    return kv


@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 7), st.integers(0, 2)), max_size=30),
       st.integers(0, 8), st.integers(0, 2))
@settings(max_examples=300, deadline=None)
def test_the_quick_checks_answer_as_the_rules_read(events, position, server):
    """``sees_all`` and ``needs`` stop at the first position that decides (speed, since a
    parked token is checked again at each of its request's completions); their answers are
    the module docstring's rules, written out position by position here."""
    kv = _ledger(events)
    comp, queued = kv.computed.get(0, {}), kv.queued.get(0, {})
    held = kv.held.get((0, server), set())
    visible = [comp.get(j, queued.get(j)) == server or j in held for j in range(position)]
    assert kv.sees_all(0, position, server) == all(visible)
    assert kv.local_missing(0, position, server) == [j for j in range(position) if not visible[j]]
    if any(j not in comp and queued.get(j) != server for j in range(position)):
        assert kv.needs(0, position, server) is None
    else:
        want: dict[int, list[int]] = {}
        for j in range(position):
            if j in comp and comp[j] != server and j not in held:
                want.setdefault(comp[j], []).append(j)
        assert kv.needs(0, position, server) == want
        assert list(kv.needs(0, position, server)) == list(want)  # the holders in the same order


def test_kv_news_from_the_home_needs_causal_attention():
    from testbed.spec import SpecError
    assert "kv_news: home" in parse_spec({"engine": {"attention": "causal"}}).to_yaml()
    assert "kv_news: instant" in parse_spec({"engine": {"kv_news": "instant"}}).to_yaml()
    assert "kv_news" not in parse_spec({"engine": {"attention": "independent"}}).to_yaml()
    for wrong in ({"attention": "independent", "kv_news": "home"}, {"kv_news": "home"}):
        with pytest.raises(SpecError, match="engine.kv_news"):
            parse_spec({"engine": wrong, "physics": "paper"} if "attention" not in wrong
                       else {"engine": wrong})


@pytest.mark.slow
def test_with_a_directory_at_the_home_tokens_ask_it_and_still_never_outrun_a_position(tmp_path):
    import json
    stats, runs = {}, {}
    for news in ("instant", "home"):
        spec = parse_spec({**CAUSAL, "name": "h", "router": {"name": "hetroute"},
                           "engine": {"attention": "causal", "kv_news": news}})
        run_experiment(spec, tmp_path / news, progress=False)
        stats[news] = json.loads((tmp_path / news / "run.json").read_text())["stats"]
        runs[news] = measure_run(tmp_path / news, every_request=True)
    home, instant = stats["home"], stats["instant"]
    assert instant["kv_asks"] == 0 == instant["kv_notices"]
    assert home["kv_asks"] > 0 and home["kv_notices"] > 0 and home["kv_fetches"] > 0
    r = runs["home"]
    assert r.causal == 0.0 and home["kv_bytes"] == r.kv_bytes  # fetched what was needed
    assert r.pull_mean_s == pytest.approx(r.latency_mean_s)
    again = parse_spec({**CAUSAL, "name": "h", "router": {"name": "hetroute"},
                        "engine": {"attention": "causal", "kv_news": "home"}})
    run_experiment(again, tmp_path / "again", progress=False)  # seeded: the same to the bit
    from testbed.records import read_records
    assert read_records(tmp_path / "again")[0].equals(read_records(tmp_path / "home")[0])
    # a pipeline's stage sees every earlier position in its own stream: it never asks, and
    # the notices it sends the home (tens of bytes) move nothing
    lat = {}
    for news in ("instant", "home"):
        spec = parse_spec({**CAUSAL, "name": "e", "router": {"name": "edgeshard"},
                           "engine": {"attention": "causal", "kv_news": news}})
        run_experiment(spec, tmp_path / f"e-{news}", progress=False)
        lat[news] = read_records(tmp_path / f"e-{news}")[1].sort_values("request").latency_s
    assert len(lat["home"]) > 0 and np.array_equal(lat["instant"].to_numpy(),
                                                   lat["home"].to_numpy())
