"""The request shape (issue 13 item 3): decode by default, prompt only where the paper is
reproduced, and a throughput that says what it counts."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from testbed.metrics import format_table
from testbed.records import read_records
from testbed.runner import run_experiment
from testbed.spec import parse_spec
from testbed.sweep import expand, figure_path, load_figure
from workloads.requests import DEFAULT_GEN_TOKENS, DEFAULT_PROMPT_TOKENS

ROOT = Path(__file__).resolve().parents[1]
SMALL = {"topology": "small3", "engine": {"decision_s": 0.0},
         "workload": {"model": "switch", "rate_per_s": 10, "duration_s": 0.6, "warmup_s": 0.1,
                      "calibration_tokens": 64}}


def test_default_spec_decodes_and_its_throughput_counts_generated_tokens(tmp_path):
    spec = parse_spec(SMALL)  # no gen_tokens: the library default
    assert (spec.workload.prompt_tokens, spec.workload.gen_tokens) == (36, 32) == \
        (DEFAULT_PROMPT_TOKENS, DEFAULT_GEN_TOKENS)
    m = run_experiment(spec, tmp_path, progress=False).metrics
    _, rq = read_records(tmp_path)
    ok = rq[rq.status == "ok"]
    assert len(ok) > 0 and (ok.tokens == 68).all()
    assert (ok.gen_done_s.map(len) == 32).all() and (ok.first_s < ok.done_s).all()
    assert m["throughput_counts"] == "generated" and m["throughput_tok_s"] == m["gen_tok_s"] > 0
    assert not math.isnan(m["tpot_ms"])
    # every token of the requests completed inside the window (under causal attention, the
    # default world, HetRoute's decode here outlasts the window: none may have)
    done = rq[(rq.status == "ok") & (rq.done_s >= 0.1) & (rq.done_s < 0.6)]
    assert m["completed_tok_s"] == pytest.approx(done.tokens.sum() / 0.5)


def test_prompt_only_run_counts_completed_prompts_as_before(tmp_path):
    spec = parse_spec({**SMALL, "workload": {**SMALL["workload"], "gen_tokens": 0}})
    m = run_experiment(spec, tmp_path, progress=False).metrics
    _, rq = read_records(tmp_path)
    assert (rq.tokens == 36).all() and (rq.gen_done_s.map(len) == 0).all()
    assert m["throughput_counts"] == "prompt" and m["throughput_tok_s"] == m["completed_tok_s"] > 0
    assert math.isnan(m["tpot_ms"])


def test_table_header_says_what_throughput_counts():
    row = {"mean_ms": 1.0, "throughput_tok_s": 100.0}
    prompt = {**row, "throughput_counts": "prompt"}
    gen = {**row, "throughput_counts": "generated", "throughput_tok_s": 2.5}
    assert "prompt tok/s" in format_table({"a": prompt, "b": row})  # old metrics: prompt
    assert "gen tok/s" in format_table({"a": gen})
    mixed = format_table({"a": prompt, "b (own regime)": gen}).splitlines()
    assert "tok/s (*gen)" in mixed[0]
    assert mixed[1].split()[-1] != "2.5*" and "100.0" in mixed[1] and "2.5*" in mixed[2]


@pytest.mark.parametrize("fig", range(2, 11))
def test_every_figure_states_its_request_shape_and_the_papers_are_prompt_only(fig, tmp_path):
    """Figs. 2-9 reproduce the paper (one forward pass per request): gen_tokens 0 stated in
    the figure spec, so their resolved specs, and the cached runs, do not follow the
    library default. Fig. 10 is the testbed's decode figure."""
    raw = yaml.safe_load(figure_path(fig).read_text())
    assert "gen_tokens" in raw["base"]["workload"]
    want = 32 if fig == 10 else 0
    spec = load_figure(figure_path(fig))
    for backend in ("sim", "emu"):
        for scale in spec.scales:
            for physics in ("hardware", "paper"):
                points = expand(spec, backend, scale, tmp_path, physics)
                assert points and {p.spec.workload.gen_tokens for p in points} == {want}


@pytest.mark.parametrize("name", ["compare", "capacity", "agreement", "example", "inrun"])
def test_shipped_specs_whose_numbers_are_prompt_only_pin_it(name):
    raw = yaml.safe_load((ROOT / "specs" / f"{name}.yaml").read_text())
    assert raw["workload"]["gen_tokens"] == 0


def test_the_asymmetric_fig9_spec_runs_fig9s_grid_on_asym5_prompt_only(tmp_path):
    """``specs/fig9-asym5.yaml`` (the README's asym5 agreement table) is Fig. 9's routers and
    loads on asym5, prompt only, on both backends."""
    spec = load_figure(ROOT / "specs" / "fig9-asym5.yaml")
    for backend in ("sim", "emu"):
        points = expand(spec, backend, "quick", tmp_path)
        assert len(points) == 15
        assert {p.spec.topology for p in points} == {"asym5"}
        assert {p.spec.workload.gen_tokens for p in points} == {0}
        assert {p.values["workload.rate_per_s"] for p in points} == {10, 40, 80}


@pytest.mark.parametrize("pooled, sweep", [
    ("paper10-hetroute", ROOT / "analysis" / "specs" / "fig9.yaml"),
    ("asym5-hetroute", ROOT / "specs" / "fig9-asym5.yaml"),
    ("fbs4-prism40", ROOT / "specs" / "fig9-fbs4.yaml"),
    ("fbs4-hetroute80", ROOT / "specs" / "fig9-fbs4.yaml")])
def test_a_pooled_spec_sweeps_its_agreement_sweeps_own_points(pooled, sweep, tmp_path):
    """``specs/pooled/*.yaml`` (the README's pooled agreement rows) resolve, point for point,
    to the emulated specs of the Fig. 9 agreement sweep they pool: only the folder differs."""
    mine = expand(load_figure(ROOT / "specs" / "pooled" / f"{pooled}.yaml"), "emu", "quick", tmp_path)
    theirs = {(p.values["router.name"], p.values["workload.rate_per_s"]): p.spec
              for p in expand(load_figure(sweep), "emu", "quick", tmp_path)}
    assert mine
    for p in mine:
        key = (p.values["router.name"], p.values["workload.rate_per_s"])
        assert p.spec.model_dump() == theirs[key].model_dump()
