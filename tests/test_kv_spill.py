"""``engine.kv_overflow: spill``: a server's K/V past its room sit in host memory and the steps
that read them copy them in over PCIe (testbed/kv_spill.py)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from testbed.kv_spill import KvSpill
from testbed.steps import DENSE, Job, StepScheduler


def _naive_spilled(held: dict[int, int], arrival: dict[int, float], room: float) -> dict[int, float]:
    """Positions of each request that do not fit, filling the room oldest request first and
    one position at a time."""
    left, out = room, {}
    for r in sorted(held, key=lambda r: (arrival[r], r)):
        out[r] = 0.0
        for _ in range(held[r]):
            if left >= 1:
                left -= 1
            elif left > 0:  # a fractional room: its remainder fits part of a position
                out[r] += 1 - left
                left = 0.0
            else:
                out[r] += 1
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 7), st.integers(1, 30)), min_size=1, max_size=40),
       st.integers(0, 120), st.lists(st.integers(0, 7), max_size=3))
def test_the_room_goes_to_the_oldest_requests_and_the_rest_is_copied_in(writes, room, freed):
    kv = KvSpill(room_bytes=room * 100.0, kv_bytes=100.0, host_bytes_per_s=1e4)  # 0.01 s each
    arrival = {r: 10.0 - r for r in range(8)}  # request 7 arrived first
    held: dict[int, int] = {}
    for r, n in writes:
        kv.write(r, arrival[r], n)
        held[r] = held.get(r, 0) + n
    for r in freed:
        kv.free(r)
        held.pop(r, None)
        kv.write(r, arrival[r], 5)  # a late step of a finished request adds nothing
    assert kv.total == sum(held.values())
    want = _naive_spilled(held, arrival, room)
    reads = {r: 2 * h for r, h in held.items()}  # each reads twice what it holds
    want_s = sum(want[r] / held[r] * reads[r] for r in held) * 0.01
    assert kv.copy_in_s(reads) == pytest.approx(want_s, abs=1e-12)
    assert sum(want.values()) == pytest.approx(max(0.0, kv.total - room))
    if kv.total <= room:
        assert kv.copy_in_s(reads) == 0.0


def test_a_request_with_nothing_held_here_copies_nothing_and_a_freed_one_makes_room():
    kv = KvSpill(room_bytes=10.0, kv_bytes=1.0, host_bytes_per_s=2.0)
    kv.write(0, 0.0, 8)
    kv.write(1, 1.0, 8)  # 6 past the room: request 1's, 6 of its 8
    assert kv.copy_in_s({2: 50}) == 0.0
    assert kv.copy_in_s({0: 8}) == 0.0
    assert kv.copy_in_s({1: 8}) == pytest.approx(6 / 8 * 8 / 2.0)
    assert kv.copied_positions == pytest.approx(6) and kv.spill_steps == 1
    kv.free(0)
    assert kv.copy_in_s({1: 8}) == 0.0 and kv.peak == 16
    with pytest.raises(ValueError):
        KvSpill(10.0, 0.0, 1.0)


def _hw():
    from hetroute.service import HardwareService
    from topologies import load_topology
    from workloads import get_model

    shape = get_model("mixtral").shape()
    return HardwareService(load_topology("small3").to_cluster(), shape), shape


def test_a_step_pays_the_copy_in_of_its_spilled_kv_on_top_of_the_dense_part():
    from hetroute.service import PCIE_EFFICIENCY

    svc, shape = _hw()
    kvb = shape.kv_bytes_per_token
    host = svc.cluster.pcie[0] * PCIE_EFFICIENCY

    def step(kv):
        sc = StepScheduler(svc, 0, lambda r: 0, lambda r: True, kv=kv)
        # request 3 decodes position 39 (reads 40 positions), request 4 position 9 (10)
        sc.submit(Job(0, DENSE, "a", 3, 39, 0.0, prio=5.0))
        sc.submit(Job(0, DENSE, "b", 4, 9, 0.0, prio=1.0))
        return sc.take(0.0).duration

    base = step(None)
    roomy = KvSpill(1e12, kvb, host)
    roomy.write(3, 5.0, 40)
    assert step(roomy) == base  # the same float: nothing spilled
    tight = KvSpill(30 * kvb, kvb, host)  # room for 30 positions
    tight.write(4, 1.0, 10)  # the older request fills 10
    tight.write(3, 5.0, 40)  # the newer one: 20 fit, 20 spill (half)
    got = step(tight)
    assert got == pytest.approx(base + 0.5 * 40 * kvb / host, rel=1e-12)
    # the step's own positions joined the cache after it was charged (one each)
    assert tight.held == {4: 11, 3: 41}


def test_spill_needs_the_layer_scope_and_is_refused_where_it_cannot_run():
    from testbed.spec import parse_spec

    svc, shape = _hw()
    with pytest.raises(ValueError, match="layer scope"):
        StepScheduler(svc, 0, lambda r: 0, lambda r: True, scope="replica",
                      kv=KvSpill(1.0, 1.0, 1.0))
    base = {"engine": {"kv_overflow": "spill"}}
    with pytest.raises(ValueError) as err:
        parse_spec({**base, "physics": "paper"})
    assert "engine.kv_overflow" in str(err.value) and "physics: hardware" in str(err.value)
    # at its default the field stays out of a resolved spec (older runs' specs stand)
    assert "kv_overflow" not in parse_spec({}).to_yaml()
    assert "kv_overflow: spill" in parse_spec(base).to_yaml()


TINY = {"topology": "small3", "workload": {"model": "switch", "duration_s": 0.4, "warmup_s": 0.1,
                                           "rate_per_s": 40, "calibration_tokens": 64,
                                           "prompt_tokens": 8, "gen_tokens": 16},
        "engine": {"decision_s": 1e-5}, "router": {"name": "edgeshard"}}


def _run(overrides: dict):
    from testbed.conformance import fresh
    from testbed.records import RecordWriter
    from testbed.setup import build_setup
    from testbed.sim.backend import SimBackend
    from testbed.spec import parse_spec

    setup = fresh(build_setup(parse_spec(TINY).with_overrides(overrides)))
    writer = RecordWriter(None, setup.shape.top_k)
    stats = SimBackend(setup, writer).run()
    writer.close()
    return stats, *writer.frames()


def test_a_run_whose_cache_fits_is_the_same_bit_for_bit_and_one_past_its_room_pays():
    from tests.test_sim_golden import digest

    for share in (0.9, 0.99999):
        off = _run({"memory.gpu_share": share})
        on = _run({"memory.gpu_share": share, "engine.kv_overflow": "spill"})
        if share == 0.9:  # room to spare: not one float moves
            assert on[0].kv_spill_steps == 0
            assert digest(on[1], on[2]) == digest(off[1], off[2])
            continue
        st = on[0]
        assert st.kv_spill_steps > 0 and st.kv_spill_bytes > 0 and st.kv_spill_s > 0
        assert off[0].kv_spill_steps == 0
        # the copies sit in the pipeline's streams: its requests take longer
        lat_on, lat_off = on[2]["latency_s"].mean(), off[2]["latency_s"].mean()
        assert lat_on > lat_off
        assert dataclasses.asdict(st)["kv_spill_servers"] >= 1


def test_a_spilled_run_reports_its_rule_and_neither_warns_nor_is_refused_by_capacity(tmp_path):
    from typer.testing import CliRunner

    from testbed.cli import app
    from testbed.kv_memory import kv_unheld, kv_warning
    from testbed.spec import parse_spec

    spec = tmp_path / "spill.yaml"
    spec.write_text(parse_spec({**TINY, "name": "spill", "memory": {"gpu_share": 0.99999},
                                "engine": {**TINY["engine"], "kv_overflow": "spill"}}).to_yaml())
    out = CliRunner().invoke(app, ["run", str(spec), "--out", str(tmp_path / "spill"), "--quiet"])
    assert out.exit_code == 0, out.output
    assert "K/V cache" not in out.stderr
    import json
    met = json.loads((tmp_path / "spill" / "metrics.json").read_text())
    run = json.loads((tmp_path / "spill" / "run.json").read_text())
    assert met["kv_overflow"] == "spill" and met["kv_peak_share"] > 1.0
    assert run["stats"]["kv_spill_steps"] > 0
    # the ledgers take a position in when its step starts and free it no sooner than the
    # records' reading, so the largest ledger holds at least the reading's peak
    assert run["stats"]["kv_ledger_peak_mb"] >= met["kv_peak_mb"] - 1e-3 > 0
    assert not kv_unheld(met) and kv_warning(met) is None
    # the same reading without the rule is a world the memory could not hold
    grown = {k: v for k, v in met.items() if k != "kv_overflow"}
    assert kv_unheld(grown) and kv_warning(grown) is not None


def _run_backend(overrides: dict):
    """A simulated run of TINY under ``overrides``, recording when each server freed each
    request's K/V: (server, request) -> model time."""
    from testbed.conformance import fresh
    from testbed.records import RecordWriter
    from testbed.setup import build_setup
    from testbed.sim.backend import SimBackend
    from testbed.spec import parse_spec

    setup = fresh(build_setup(parse_spec(TINY).with_overrides(overrides)))
    writer = RecordWriter(None, setup.shape.top_k)
    sim = SimBackend(setup, writer)
    freed: dict[tuple[int, int], float] = {}
    server = {id(k): m for m, k in enumerate(sim.kv_room)}
    inner = KvSpill.free

    def free(self, r):
        freed.setdefault((server[id(self)], r), sim.now)
        inner(self, r)

    KvSpill.free = free
    try:
        sim.run()
    finally:
        KvSpill.free = inner
    writer.close()
    return sim, writer.frames()[1], freed


def test_a_finished_request_leaves_its_home_at_once_and_the_peers_with_the_next_broadcast():
    over = {"memory.gpu_share": 0.99999, "engine.kv_overflow": "spill"}
    sim, rq, freed = _run_backend({**over, "net.control": "instant"})
    done = dict(zip(rq["request"], rq["done_s"]))
    home = dict(zip(rq["request"], rq["home"]))
    assert len(freed) == len(done) * sim.N
    assert all(t == pytest.approx(done[r], abs=1e-12) for (m, r), t in freed.items())
    assert all(k.total == 0 and not k.held for k in sim.kv_room)
    sim, rq, freed = _run_backend(over)  # over links: the home's window broadcast carries it
    done = dict(zip(rq["request"], rq["done_s"]))
    home = dict(zip(rq["request"], rq["home"]))
    window = sim.window
    later = 0
    for (m, r), t in freed.items():
        if m == home[r]:
            assert t == pytest.approx(done[r], abs=1e-12)
        else:  # the first tick after it finished, then the link's delay
            tick = (done[r] // window + 1) * window
            assert t >= tick + sim.delay[home[r]][m] - 1e-12
            later += 1
    assert later == len(done) * (sim.N - 1)
    assert all(k.total == 0 for k in sim.kv_room) and sim.stats.kv_spill_steps > 0


def test_under_causal_attention_the_fetched_copies_take_room_too():
    """Every position a step computed and every copy a causal pass fetched was written to
    the ledger of the server that holds it (``kv_memory``'s reading with copies)."""
    over = {"engine.kv_overflow": "spill", "engine.attention": "causal", "router.name": "hetroute",
            "memory.gpu_share": 0.9999}
    sim, rq, _ = _run_backend(over)
    kvb = sim.kv_bytes
    written = sum(k.written for k in sim.kv_room)
    assert sim.stats.kv_fetches > 0 and sim.stats.kv_bytes > 0
    assert written == sim.stats.token_layers + sim.stats.kv_bytes // kvb
    assert sim.stats.kv_spill_steps > 0
