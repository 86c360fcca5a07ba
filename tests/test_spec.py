"""Experiment specs: defaults, one-line errors, overrides."""

from __future__ import annotations

import pytest

from testbed.spec import SpecError, load_spec, parse_override, parse_spec


def test_empty_spec_is_all_defaults():
    s = parse_spec({})
    assert s.workload.rate_per_s == 40 and s.quality.budget == 0.02 and s.router.name == "hetroute"


@pytest.mark.parametrize("data, expected", [
    ({"workload": {"rate_per_s": 0}}, "workload.rate_per_s"),
    ({"workload": {"warmup_s": 20, "duration_s": 10}}, "warmup_s"),
    ({"backend": "cloud"}, "backend"),
    ({"router": {"nam": "x"}}, "router.nam"),
    ({"topology": {"servers": 0}}, "topology"),
])
def test_errors_are_one_line(data, expected):
    with pytest.raises(SpecError) as err:
        parse_spec(data, "s.yaml")
    assert "\n" not in str(err.value) and expected in str(err.value)


def test_overrides_and_files(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("name: x\nworkload: {rate_per_s: 10}\n")
    s = load_spec(p)
    s2 = s.with_overrides(dict([parse_override("workload.rate_per_s=80"),
                                parse_override("router.params.beam_width=4")]))
    assert s2.workload.rate_per_s == 80 and s2.router.params == {"beam_width": 4}
    assert s.workload.rate_per_s == 10  # immutable original
    with pytest.raises(SpecError, match="expected key=value"):
        parse_override("rate")
    with pytest.raises(SpecError, match="no such spec"):
        load_spec(tmp_path / "missing.yaml")


def test_symbolic_quality_inputs_resolve_to_files(tmp_path) -> None:
    """'auto' falls back to the prior and the synthetic trace, 'measured'/'proxy' insist,
    and the resolved spec names the files used."""
    from testbed.setup import resolve_inputs
    from testbed.spec import parse_spec

    base = {"workload": {"model": "switch", "trace": "auto", "gen_tokens": 0},  # replay: prompt only
            "quality": {"profile": "auto"}}
    s = resolve_inputs(parse_spec(base), tmp_path)
    assert (s.quality.profile, s.workload.trace, s.quality.replay) == ("prior", "synthetic", False)
    with pytest.raises(SpecError, match="quality-profile"):
        resolve_inputs(parse_spec({**base, "quality": {"profile": "measured"}}), tmp_path)
    with pytest.raises(SpecError, match="no proxy file"):
        resolve_inputs(parse_spec({**base, "workload": {"model": "switch", "trace": "proxy",
                                                        "gen_tokens": 0}}), tmp_path)
    d = tmp_path / "switch-base-8"
    d.mkdir()
    (d / "profile.npz").write_bytes(b"x")
    (d / "trace.jsonl").write_text("")
    (d / "trace.meta.json").write_text('{"source": "proxy:switch-base-8"}')
    s = resolve_inputs(parse_spec(base), tmp_path)
    assert s.quality.profile == str(d / "profile.npz") and s.workload.trace == str(d / "trace.jsonl")
    assert s.quality.replay is True
    assert resolve_inputs(s, tmp_path) == s  # idempotent
    # replay re-executes each request as one 36-token trace segment: a decoding request
    # (the default shape) is not replayed under 'auto' and is refused up front under true
    dec = parse_spec({**base, "workload": {"model": "switch", "trace": "auto"}})
    assert dec.workload.gen_tokens > 0 and resolve_inputs(dec, tmp_path).quality.replay is False
    with pytest.raises(SpecError, match="quality.replay: at most 36 tokens"):
        resolve_inputs(dec.with_overrides({"quality.replay": True}), tmp_path)
