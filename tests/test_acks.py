"""The reverse link's ACKs (``net.ack_every``, testbed/acks.py) in both backends' model links."""

from __future__ import annotations

import pytest

from testbed.acks import ACK_WIRE_BYTES, AckLine, ack_bytes_per_byte
from testbed.emu.backend import wire_accounting
from testbed.records import RecordWriter
from testbed.setup import build_setup
from testbed.sim.backend import SimBackend
from testbed.spec import parse_spec


def test_one_66_byte_ack_per_two_full_segments():
    assert ack_bytes_per_byte(1448, 2) == pytest.approx(66 / 2896)
    assert ack_bytes_per_byte(1448, 1) == pytest.approx(2 * ack_bytes_per_byte(1448, 2))
    assert ack_bytes_per_byte(1448, 0) == 0.0
    assert ACK_WIRE_BYTES == 14 + 20 + 20 + 12


def test_an_ack_line_lets_through_only_what_left_by_the_message_in_fifo_order():
    line = AckLine()
    line.add(1.0, 0.1)
    line.add(1.05, 0.1)
    line.add(3.0, 0.5)
    # an idle link at 2.0: the first two blocks ran at 1.0-1.1 and 1.1-1.2, behind each other
    assert line.absorb(0.0, 2.0) == pytest.approx(1.2)
    assert len(line) == 1  # the block of 3.0 waits for a later message
    # a link busy until 3.2 with data when the block leaves: it queues behind that data
    assert line.absorb(3.2, 3.5) == pytest.approx(3.7)
    assert len(line) == 0
    # an arrival earlier than the last is put in its place
    line.add(5.0, 0.1)
    line.add(4.0, 0.1)
    assert [t for t, _ in line.q] == [4.0, 5.0]
    assert line.absorb(0.0, 4.5) == pytest.approx(4.1)


def _asym5(**over):
    spec = parse_spec({"name": "acks", "topology": "asym5", "backend": "sim",
                       "workload": {"rate_per_s": 10, "duration_s": 0.5, "warmup_s": 0.0,
                                    "gen_tokens": 0, "calibration_tokens": 16}, **over})
    setup = build_setup(spec)
    return setup, SimBackend(setup, RecordWriter(None, setup.shape.top_k))


def test_a_message_queues_behind_the_acks_of_the_data_it_answers():
    """s0 sends s1 ten hidden states; s1's message back, sent after they arrived, starts
    behind their ACKs: 66 bytes per two segments of the states' bytes at s1->s0's rate."""
    setup, sim = _asym5()
    m, n = 0, 1
    arrive = sim.send(m, n, 1.0, count=10)
    wire = sim.msg_wire * 10
    acks_s = wire / (setup.spec.net.mss_bytes * 2) * ACK_WIRE_BYTES / setup.cluster.bandwidth[n][m]
    assert acks_s > 0
    back = sim.send(n, m, arrive, count=1)
    assert back == pytest.approx(arrive + acks_s + sim.tx[n][m] + sim.delay[n][m], abs=1e-12)
    # a message n sent before the states arrived went first, ACKs or not
    setup, sim = _asym5()
    arrive = sim.send(m, n, 1.0, count=10)
    assert sim.send(n, m, 1.0, count=1) == pytest.approx(1.0 + sim.tx[n][m] + sim.delay[n][m])


@pytest.mark.parametrize("over", [{"net": {"ack_every": 0}}, {"physics": "paper"}])
def test_no_acks_without_ack_every_or_in_the_papers_world(over):
    setup, sim = _asym5(**over)
    assert sim.ack_lines is None
    arrive = sim.send(0, 1, 1.0, count=10)
    assert sim.send(1, 0, arrive, count=1) == pytest.approx(arrive + sim.tx[1][0] + sim.delay[1][0])


def test_the_wire_accounting_sets_tc_against_what_each_worker_wrote():
    links = [{"src": 0, "dst": 1, "bytes": 1100 + 66 * 3, "packets": 3},
             {"src": 1, "dst": 0, "bytes": 66, "packets": 1},
             {"src": 0, "dst": 2, "bytes": 0, "packets": 0}]
    workers = [{"rank": 0, "bytes_sent_to": {"1": 1100}, "writes_to": {"1": 2}, "segments_to": {"1": 2}},
               {"rank": 1, "bytes_sent_to": {"0": 0}, "writes_to": {"0": 0}, "segments_to": {"0": 0}}]
    tot = wire_accounting(links, workers)
    assert links[0]["bytes_written"] == 1100 and links[0]["other_packets"] == 1
    assert links[0]["wire_ratio"] == pytest.approx((1100 + 198) / 1100, abs=1e-4)
    assert links[1]["wire_ratio"] is None and links[1]["other_packets"] == 1
    assert "bytes_written" not in links[2]  # no worker reported it
    assert tot["tc_bytes"] == 1100 + 66 * 4 and tot["packets"] == 4
    assert tot["header_bytes_per_packet"] == pytest.approx(66.0)


def test_the_emulators_model_link_takes_the_acks_of_what_it_received():
    """Worker 0 receives a data frame from 1 whose model end of sending is ``e``; at the
    model's arrival (``e`` + the delay) its model link to 1 carries the frame's ACKs, so a
    frame due after that is stamped to end behind them, and one due before is not."""
    import asyncio
    import time
    from dataclasses import replace

    import torch

    from testbed.emu.transport import Transport, precise_loop
    from testbed.emu.wire import FrameDecoder, tensor_frame
    from tests.test_emu_stream import _HIDDEN as m
    from tests.test_emu_stream import _Wire as Wire

    spb, acks, delay = 1e-6, 0.004, 0.010

    def ends(offset_after_arrival: float) -> float:
        loop = precise_loop()
        net = Transport(0, 0, {1: ("h", 1)}, [0.0, delay], lambda f, a: None,
                        lambda p, why: None, b"s" * 16, link_s_per_byte={1: spb},
                        ack_s_per_frame={1: acks})
        wire = net.out[1] = Wire()
        t = time.monotonic()

        async def go():
            net.deliver(tensor_frame(replace(m, due_end_s=t), torch.zeros(4)), 1, t)
            await asyncio.sleep(0.02)
        loop.run_until_complete(go())
        loop.close()
        due = t + delay + offset_after_arrival
        net.send(1, tensor_frame(m, torch.zeros(4)), due=due)
        (f,) = FrameDecoder().feed(bytes(wire.data))
        return f.msg.due_end_s - due, len(wire.data) * spb

    behind, tx = ends(0.001)  # 1 ms after the ACKs left: 3 ms of them still ahead
    assert behind == pytest.approx(0.003 + tx, abs=1e-9)
    before, tx = ends(-0.001)  # due before the model's arrival: its link is idle
    assert before == pytest.approx(tx, abs=1e-9)
