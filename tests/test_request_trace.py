"""Request traces and bursty arrivals: what a run's requests are when they are not the
paper's Poisson process of fixed-length requests (``workloads/request_trace.py``,
``workloads.requests.gamma_arrivals`` / ``trace_arrivals``, ``workload.arrivals`` and
``workload.lengths`` in a spec)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from testbed.cli import app
from testbed.records import read_records
from testbed.runner import is_done, run_experiment
from testbed.spec import parse_spec
from workloads.request_trace import RequestTraceError, read_request_trace
from workloads.arrivals import (gamma_arrivals, make_requests, trace_arrivals,
                                window_gamma_arrivals)
from workloads.requests import RequestShape, Users, generate_requests, poisson_arrivals

AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:46.0000001,12,3
not a date,5,5
2023-11-16 18:15:52.5000000,0,7
2023-11-16 18:15:53.1000000,20,-2
2023-11-16 18:15:54.1000000,21
2023-11-16 18:16:46.6805900,20000,5000
"""

BURSTGPT = """Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,Total tokens,Log Type
5,a,1,ChatGPT,472,18,490,Conversation log
45,b,2,ChatGPT,1087,230,1317,Conversation log
118,c,3,GPT-4,417,276,693,Conversation log
120,d,4,GPT-4,0,0,0,API log
"""


def _write(tmp_path, name: str, text: str):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_an_azure_trace_reads_to_the_nanosecond_sorted_from_zero(tmp_path):
    tr = read_request_trace(_write(tmp_path, "a.csv", AZURE))
    assert tr.format == "azure"
    # the row stamped 46.0000001 comes first: 7 fractional digits are not rounded away
    assert tr.arrival_s[0] == 0.0
    np.testing.assert_allclose(tr.arrival_s[1:3], [0.6805899, 4.9951689], rtol=0, atol=1e-12)
    assert tr.arrival_s[-1] == pytest.approx(60.6805899, abs=1e-12)
    assert list(tr.prompt_tokens) == [12, 374, 396, 20000]
    assert list(tr.gen_tokens) == [3, 44, 109, 5000]
    # lines 5 (no date), 7 (a negative count) and 8 (a short row) skipped, by number
    assert tr.skipped_lines == (5, 7, 8)
    assert tr.dropped_empty == 1  # line 6: no prompt token
    rep = tr.report()
    assert rep["requests"] == 4 and rep["skipped_lines"] == 3 and len(rep["sha256"]) == 64
    assert tr.mean_rate_per_s == pytest.approx(3 / 60.6805899, rel=1e-9)


def test_burstgpt_and_the_native_format_are_told_by_their_headers(tmp_path):
    b = read_request_trace(_write(tmp_path, "b.csv", BURSTGPT))
    assert b.format == "burstgpt"
    assert list(b.arrival_s) == [0.0, 40.0, 113.0]  # the failed request (0 tokens) dropped
    assert list(b.prompt_tokens) == [472, 1087, 417] and list(b.gen_tokens) == [18, 230, 276]
    n = read_request_trace(_write(tmp_path, "n.csv", " Arrival_S , prompt_tokens,GEN_TOKENS\n"
                                                     "2.5,4,0\n1.0,8,2\n"))
    assert n.format == "native" and list(n.arrival_s) == [0.0, 1.5]
    assert list(n.prompt_tokens) == [8, 4]


@pytest.mark.parametrize("content, needle", [
    ("a,b,c\n1,2,3\n", "names no known format"),
    ("", "empty file"),
    ("arrival_s,prompt_tokens,gen_tokens\nx,1,1\n0,0,1\n", "no usable request"),
    (b"\x00\x01PK\x03\x04", "binary"),
    (b"arrival_s,prompt_tokens,gen_tokens\n1,\xff\xfe,2\n", "not UTF-8"),
])
def test_a_trace_that_cannot_be_used_is_one_error_naming_the_file(tmp_path, content, needle):
    p = tmp_path / "bad.csv"
    (p.write_bytes if isinstance(content, bytes) else p.write_text)(content)
    with pytest.raises(RequestTraceError, match=needle) as err:
        read_request_trace(p)
    assert str(p) in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(RequestTraceError, match="cannot read"):
        read_request_trace(tmp_path / "missing.csv")


@pytest.mark.parametrize("cv", [0.5, 1.0, 2.0, 4.0])
def test_gamma_arrivals_have_the_rate_and_the_burstiness_asked_for(cv):
    rate = 40.0
    t = gamma_arrivals(rate, cv, np.random.default_rng(7), duration_s=2000.0)
    gaps = np.diff(t)
    assert np.all(gaps >= 0) and 0 < t[0] and t[-1] < 2000.0
    assert len(t) / 2000.0 == pytest.approx(rate, rel=0.06 if cv > 2 else 0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.06)
    assert len(gamma_arrivals(rate, cv, np.random.default_rng(1), n_requests=9)) == 9
    with pytest.raises(ValueError):
        gamma_arrivals(rate, 0.0, np.random.default_rng(1), duration_s=1.0)


def test_window_mode_moves_the_poisson_runs_own_requests_and_nothing_else():
    """``gamma_count: window``: the same requests (ids, users, homes, tasks, lengths) as
    the Poisson run of the seed, only at bursty times inside the window."""
    users = Users(n_users=50, n_servers=4, seed=3, n_tasks=3)
    shape = RequestShape(36, 0)
    plain = generate_requests(30.0, shape, users, seed=5, duration_s=4.0)
    bursty = make_requests(30.0, shape, users, seed=5, duration_s=4.0, arrivals="gamma", cv=4.0)
    assert len(bursty) == len(plain) > 0
    same = [(r.id, r.user, r.home, r.task, r.prompt_tokens) for r in plain]
    assert [(r.id, r.user, r.home, r.task, r.prompt_tokens) for r in bursty] == same
    t = np.array([r.arrival_s for r in bursty])
    assert np.all(np.diff(t) >= 0) and t[0] >= 0 and t[-1] < 4.0
    assert not np.allclose(t, [r.arrival_s for r in plain])


def test_window_gamma_at_cv_1_is_the_poisson_processs_law_given_its_count():
    """n exponential gaps scaled to the window are n uniform order statistics: the spread
    of the k-th of n arrivals matches the Beta(k, n + 1 - k) law of Poisson's."""
    rng = np.random.default_rng(11)
    n, k = 9, 3
    kth = np.array([window_gamma_arrivals(n, 1.0, 1.0, rng)[k - 1] for _ in range(20000)])
    assert kth.mean() == pytest.approx(k / (n + 1), abs=0.005)
    beta_var = k * (n + 1 - k) / ((n + 1) ** 2 * (n + 2))
    assert kth.var() == pytest.approx(beta_var, rel=0.05)
    # and at cv 4 the same count comes in bursts: the largest gap takes far more of it
    big = [np.max(np.diff(np.r_[0, window_gamma_arrivals(40, 1.0, cv, rng), 1.0]))
           for cv in (1.0, 4.0) for _ in range(200)]
    assert np.mean(big[200:]) > 3 * np.mean(big[:200])


def test_the_renewal_processs_count_over_a_short_window_varies_far_more_than_poissons():
    """Why the window mode is the default: over 4 s a cv-4 renewal process draws a request
    count whose spread is several times Poisson's, and a seed's gaps at any rate are the
    same draws scaled, so a seed light at one load is light at every load (the first bursty
    sweep's three seeds: 12 / 39 / 19 requests at 10 req/s, 40 expected); the window mode
    keeps the Poisson run's count, seed by seed."""
    def spread(counts):
        return np.std(counts) / np.mean(counts)
    renewal = [len(gamma_arrivals(10.0, 4.0, np.random.default_rng(s), duration_s=4.0))
               for s in range(400)]
    poisson = [len(poisson_arrivals(10.0, np.random.default_rng(s), duration_s=4.0))
               for s in range(400)]
    assert spread(renewal) > 2.5 * spread(poisson)
    lo = [len(gamma_arrivals(r, 4.0, np.random.default_rng([0, 0xA441]), duration_s=4.0))
          for r in (10.0, 40.0)]
    assert lo == [12, 97]  # seed 0 of the first sweep: light at both loads
    users = Users(n_users=20, n_servers=3, seed=0)
    for seed in range(3):
        kw = dict(duration_s=4.0, seed=seed)
        assert len(make_requests(10.0, RequestShape(), users, arrivals="gamma", cv=4.0, **kw)) \
            == len(generate_requests(10.0, RequestShape(), users, **kw))


def test_bursty_arrivals_bunch_where_poisson_does_not():
    """The point of cv > 1: at the same mean rate, more arrivals fall in the busiest
    tenth of a second than under Poisson."""
    def busiest(t):
        return np.bincount((t / 0.1).astype(int)).max()
    p = poisson_arrivals(40.0, np.random.default_rng(3), duration_s=200.0)
    g = gamma_arrivals(40.0, 4.0, np.random.default_rng(3), duration_s=200.0)
    assert busiest(g) > 2 * busiest(p)


def test_trace_arrivals_rescale_to_the_rate_and_keep_the_shape(tmp_path):
    tr = read_request_trace(_write(tmp_path, "a.csv", AZURE))
    t, rows = trace_arrivals(tr, rate_per_s=tr.mean_rate_per_s * 10, duration_s=1e9)
    np.testing.assert_allclose(t, tr.arrival_s / 10)
    assert list(rows) == [0, 1, 2, 3]
    rec, _ = trace_arrivals(tr, 123.0, "recorded", duration_s=5.0)  # the rate is ignored
    np.testing.assert_allclose(rec, tr.arrival_s[:3])
    late, rows = trace_arrivals(tr, 1.0, "recorded", start_s=1.0, duration_s=100.0)
    np.testing.assert_allclose(late, tr.arrival_s[2:] - 1.0)
    assert list(rows) == [2, 3]
    first, _ = trace_arrivals(tr, 1.0, "recorded", duration_s=None, n_requests=2)
    assert len(first) == 2


def test_poisson_requests_are_drawn_as_before_the_other_processes_existed():
    """The default keeps every earlier run's requests: the same arrival and user draws
    from the same stream, the spec's fixed lengths."""
    users = Users(n_users=50, n_servers=4, seed=3)
    shape = RequestShape(36, 5)
    got = make_requests(20.0, shape, users, seed=3, duration_s=5.0)
    assert got == generate_requests(20.0, shape, users, seed=3, duration_s=5.0)
    rng = np.random.default_rng([3, 0xA441])  # requests._ARRIVAL_TAG
    times = poisson_arrivals(20.0, rng, duration_s=5.0)
    who = rng.integers(0, users.n_users, size=len(times))
    assert [r.arrival_s for r in got] == [float(x) for x in times]
    assert [r.user for r in got] == [int(u) for u in who]
    assert {(r.prompt_tokens, r.gen_tokens) for r in got} == {(36, 5)}


def test_lengths_from_a_trace_follow_its_rows_and_their_caps(tmp_path):
    tr = read_request_trace(_write(tmp_path, "a.csv", AZURE))
    users = Users(n_users=10, n_servers=3, seed=0)
    # trace arrivals: each request is the row it arrived as
    got = make_requests(tr.mean_rate_per_s, RequestShape(), users, seed=0, duration_s=1e6,
                            arrivals="trace", trace=tr, lengths="trace", max_prompt_tokens=1000)
    assert [(r.prompt_tokens, r.gen_tokens) for r in got] == [(12, 3), (374, 44), (396, 109),
                                                             (1000, 5000)]
    # Poisson arrivals with the trace's lengths: rows in order, cycled
    got = make_requests(50.0, RequestShape(), users, seed=0, duration_s=1.0,
                        lengths="trace", trace=tr, max_gen_tokens=50)
    plain = generate_requests(50.0, RequestShape(), users, seed=0, duration_s=1.0)
    assert [(r.arrival_s, r.user, r.task) for r in got] == \
        [(r.arrival_s, r.user, r.task) for r in plain]  # only the lengths differ
    assert len(got) > 8
    assert [r.prompt_tokens for r in got[:6]] == [12, 374, 396, 20000, 12, 374]
    assert [r.gen_tokens for r in got[:4]] == [3, 44, 50, 50]


def test_a_trace_driven_run_has_the_traces_requests_and_says_so(tmp_path):
    """End to end on the simulator: every request of the trace that arrives within the
    run is served with its own prompt and output lengths, and ``run.json`` names the trace
    (format, digest, burstiness) it came from."""
    lines = ["arrival_s,prompt_tokens,gen_tokens"]
    rng = np.random.default_rng(5)
    t = np.round(np.cumsum(rng.exponential(0.05, 30)), 6)
    for i, x in enumerate(t):
        lines.append(f"{x:.6f},{1 + i % 7},{i % 3}")
    trace = _write(tmp_path, "reqs.csv", "\n".join(lines) + "\n")
    spec = parse_spec({"topology": "small3", "workload": {
        "model": "switch", "arrivals": "trace", "trace_rate": "recorded", "lengths": "trace",
        "requests_file": str(trace), "duration_s": 1.0, "warmup_s": 0.1,
        "calibration_tokens": 64}})
    res = run_experiment(spec, tmp_path / "run", progress=False)
    _, rq = read_records(tmp_path / "run")
    arrived = t[t - t[0] < 1.0]
    assert len(rq) == len(arrived)
    rq = rq.sort_values("request").reset_index(drop=True)
    np.testing.assert_allclose(rq.arrival_s, arrived - t[0], rtol=0, atol=1e-9)
    want = [1 + i % 7 + i % 3 for i in range(len(arrived))]
    assert list(rq.tokens) == want  # prompt + generated, row by row
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    assert info["requests"]["trace"]["format"] == "native"
    assert info["requests"]["requests"] == len(arrived)
    assert res.metrics["throughput_counts"] == "generated"  # the records say it decodes
    assert is_done(tmp_path / "run", spec)


def test_new_workload_fields_stay_out_of_a_resolved_spec_at_their_defaults():
    """Runs made before the fields existed stay done: at the defaults the resolved spec is
    the one they wrote; set, the fields are written and read back."""
    plain = parse_spec({})
    text = plain.to_yaml()
    assert "arrival_cv" not in text and "requests_file" not in text and "lengths" not in text
    bursty = parse_spec({"workload": {"arrivals": "gamma", "arrival_cv": 3.0}})
    assert "arrival_cv: 3.0" in bursty.to_yaml()
    import yaml
    assert parse_spec(yaml.safe_load(bursty.to_yaml())) == bursty
    assert parse_spec(yaml.safe_load(text)) == plain
    shown = CliRunner().invoke(app, ["show-spec"])  # show-spec prints every field
    assert shown.exit_code == 0 and "arrivals: poisson" in shown.stdout
    assert "gamma_count: window" in shown.stdout and "requests_file: null" in shown.stdout


def test_a_bad_request_trace_is_one_line_before_anything_runs(tmp_path):
    bad = _write(tmp_path, "bad.csv", "when,what\n1,2\n")
    spec = _write(tmp_path, "s.yaml", f"workload: {{arrivals: trace, requests_file: {bad}}}\n")
    res = CliRunner().invoke(app, ["show-spec", str(spec)])
    assert res.exit_code == 2
    lines = [ln for ln in res.stderr.strip().splitlines() if ln]
    assert len(lines) == 1 and "workload.requests_file" in lines[0] and "known format" in lines[0]
    one = _write(tmp_path, "one.csv", "arrival_s,prompt_tokens,gen_tokens\n0,3,1\n")
    spec.write_text(f"workload: {{arrivals: trace, requests_file: {one}}}\n")
    res = CliRunner().invoke(app, ["show-spec", str(spec)])
    assert res.exit_code == 2 and "trace_rate" in res.stderr


def test_a_capacity_search_refuses_a_trace_replayed_at_its_own_rate(tmp_path):
    from testbed.capacity import find_capacity
    from testbed.spec import SpecError
    trace = _write(tmp_path, "r.csv", "arrival_s,prompt_tokens,gen_tokens\n0,3,0\n1,3,0\n")
    spec = parse_spec({"workload": {"arrivals": "trace", "trace_rate": "recorded",
                                    "requests_file": str(trace)}})
    with pytest.raises(SpecError, match="trace_rate"):
        find_capacity(spec, "hetroute", results=tmp_path)


def test_a_window_that_measures_no_request_still_gives_metrics(tmp_path):
    """A burst that falls wholly in the warm-up (or a light bursty probe of a capacity
    search) leaves the measured window empty: the run completes with no latency rather
    than failing on an empty table (found by a cv-4 capacity search at 1 req/s)."""
    trace = _write(tmp_path, "early.csv", "arrival_s,prompt_tokens,gen_tokens\n0,4,0\n0.05,4,0\n")
    spec = parse_spec({"topology": "small3", "workload": {
        "model": "switch", "arrivals": "trace", "trace_rate": "recorded",
        "requests_file": str(trace), "duration_s": 1.0, "warmup_s": 0.5,
        "calibration_tokens": 64}})
    res = run_experiment(spec, tmp_path / "run", progress=False)
    assert res.metrics["requests"] == 0 and np.isnan(res.metrics["mean_ms"])
    assert res.info["status"] == "complete"


def test_a_sweeps_estimate_counts_what_a_trace_gives(tmp_path):
    """``sweep --dry-run``'s estimate takes a trace's recorded arrivals in the window and its
    rows' capped lengths, not the spec's rate and fixed lengths (it did before 2026-12-05)."""
    from testbed.setup import build_setup
    from testbed.sweep import _requests_and_tokens
    trace = tmp_path / "reqs.csv"
    rows = ["arrival_s,prompt_tokens,gen_tokens"]
    rows += [f"{0.07 * i:.2f},{100 + 300 * (i % 4)},{i % 3}" for i in range(12)]
    trace.write_text("\n".join(rows) + "\n")
    spec = parse_spec({"topology": "small3", "workload": {
        "model": "switch", "rate_per_s": 50, "duration_s": 0.5, "warmup_s": 0.1,
        "calibration_tokens": 64, "arrivals": "trace", "trace_rate": "recorded",
        "lengths": "trace", "max_prompt_tokens": 500, "requests_file": str(trace)}})
    reqs = build_setup(spec).requests
    n, tokens = _requests_and_tokens(spec.workload)
    assert n == len(reqs) == 8  # arrivals 0.00-0.49 s, not 50 req/s x 0.5 s
    assert tokens == pytest.approx(np.mean([r.prompt_tokens + r.gen_tokens for r in reqs]))
    assert max(r.prompt_tokens for r in reqs) == 500
    fixed = parse_spec({"workload": {"rate_per_s": 50, "duration_s": 0.5, "warmup_s": 0.1}})
    assert _requests_and_tokens(fixed.workload) == (25.0, 68.0)  # 36 + 32 tokens


def test_a_sweeps_estimate_knows_causal_attention_costs_the_simulator_more():
    """The hardware world's default (causal attention) is estimated at the bench's measured
    slowdown; per-token attention and the paper's world at the old rate."""
    from testbed.sweep import CAUSAL_SLOWDOWN, SIM_RATE, sim_rate
    causal = parse_spec({"workload": {"rate_per_s": 40, "duration_s": 1.0, "warmup_s": 0.1}})
    assert causal.engine.attention == "causal"
    assert sim_rate(causal) == pytest.approx(SIM_RATE / CAUSAL_SLOWDOWN) and CAUSAL_SLOWDOWN > 1.5
    assert sim_rate(causal.with_overrides({"engine.attention": "independent"})) == SIM_RATE
    assert sim_rate(causal.with_overrides({"physics": "paper"})) == SIM_RATE

