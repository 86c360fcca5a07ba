"""Topology schema, loader errors (one line each) and the seeded generator."""

from __future__ import annotations

import pytest
import yaml

from topologies import TopologyError, generate, load_topology, parse_topology
from topologies.generator import Ranges


def _small():
    return yaml.safe_load(open(load_topology.__globals__["Path"](__file__).parent.parent
                               / "topologies" / "small3.yaml"))


def test_shipped_topologies_load_and_convert():
    for name, n in (("paper10", 10), ("small3", 3)):
        t = load_topology(name)
        cl = t.to_cluster()
        assert cl.n == n
        for m in range(n):
            for k in range(n):
                if m != k:
                    assert cl.bandwidth[m][k] > 0


def test_units_are_converted_to_si():
    cl = load_topology("small3").to_cluster()
    assert cl.flops[1] == pytest.approx(149.7e12)  # hub: an A40's dense FP16 tensor rate
    assert cl.mem_bw[1] == pytest.approx(696e9) and cl.gpu_class[1] == "a40"
    assert cl.pcie[1] == pytest.approx(31.5e9)  # PCIe Gen4 x16, per direction
    assert cl.gpu_bytes[0] == pytest.approx(16e9)
    assert cl.bandwidth[0][1] == pytest.approx(5e9 / 8)  # symmetric entry covers both ways
    assert cl.bandwidth[1][0] == pytest.approx(5e9 / 8)
    assert cl.delay[0][2] == pytest.approx(0.015)


@pytest.mark.parametrize("mutate, expected", [
    (lambda d: d["servers"][0].update(gpu_tflops=-1), "servers[0].gpu_tflops"),
    (lambda d: d["links"].pop(), "no link"),
    (lambda d: d["links"][0].update(delay_ms=-2), "links[0].delay_ms"),
    (lambda d: d["links"].append(dict(d["links"][0])), "repeats"),
    (lambda d: d["servers"][1].update(name="edge"), "unique"),
    (lambda d: d["links"][0].update(dst="nowhere"), "unknown server"),
    (lambda d: d.update(colour="blue"), "colour"),
])
def test_bad_files_get_one_line(mutate, expected):
    d = _small()
    mutate(d)
    with pytest.raises(TopologyError) as err:
        parse_topology(d, "x.yaml")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("x.yaml") and expected in msg


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(TopologyError, match="no such topology"):
        load_topology(tmp_path / "nope.yaml")
    p = tmp_path / "bad.yaml"
    p.write_text("servers: [unclosed")
    with pytest.raises(TopologyError, match="not valid YAML"):
        load_topology(p)


def test_generator_is_seeded_and_in_range():
    a, b, c = generate(12, 5), generate(12, 5), generate(12, 6)
    assert a == b and a != c
    r = Ranges()
    for s in a.servers:
        assert s.gpu in r.gpu_classes  # a whole datasheet per server
        assert r.cpu_mem_gb[0] <= s.cpu_mem_gb <= r.cpu_mem_gb[1]
    assert len({s.gpu for s in a.servers}) > 1
    delays = [ln.delay_ms for ln in a.links]
    bws = [ln.bandwidth_gbps for ln in a.links]
    assert min(delays) >= r.delay_ms[0] and max(delays) == pytest.approx(r.delay_ms[1])
    assert r.bandwidth_gbps[0] <= min(bws) and max(bws) <= r.bandwidth_gbps[1]
    # YAML round trip
    assert parse_topology(yaml.safe_load(a.to_yaml())) == a


def test_generated_delays_obey_triangle_inequality():
    cl = generate(10, 3).to_cluster()
    for a in range(10):
        for b in range(10):
            for c in range(10):
                if len({a, b, c}) == 3:
                    assert cl.delay[a][b] <= cl.delay[a][c] + cl.delay[c][b] + 2e-5  # 2-decimal ms rounding
