"""Peer authentication of the emulator's transport (issue 14): a connection must prove its
rank with the run's secret and come from that rank's address before any frame counts; a
connection that fails changes no peer's state. Runs on localhost, no root needed."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
import torch

from testbed.emu.transport import Transport
from testbed.emu.wire import (Auth, Challenge, Frame, FrameDecoder, Ping, State, auth_mac,
                              encode_header)

SECRET = b"s" * 32


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _state(src: int, backlog_s: float) -> Frame:
    return Frame(State(src, window=1, opened_at=0.0, t_send=0.0, backlog_s=backlog_s,
                       alive=(True, True)))


def _bytes(frame) -> bytes:
    return encode_header(frame) + bytes(frame.payload) + bytes(frame.pad_len)


class Pair:
    """Workers 0 and 1 on 127.0.0.1, each recording what it receives and whom it lost."""

    def __init__(self):
        self.ports = [_free_port(), _free_port()]
        self.got = {0: [], 1: []}
        self.lost = {0: [], 1: []}
        self.t = [Transport(r, self.ports[r], {1 - r: ("127.0.0.1", self.ports[1 - r])}, [0.0, 0.0],
                            lambda f, a, r=r: self.got[r].append(f),
                            lambda p, why, r=r: self.lost[r].append((p, why)), SECRET)
                  for r in (0, 1)]

    async def start(self):
        await asyncio.gather(self.t[0].start(), self.t[1].start())


async def _intruder(port: int, answer, source: str = "127.0.0.1") -> None:
    """Connect to worker 0, read its CHALLENGE, send ``answer(nonce)`` bytes, close."""
    r, w = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    dec = FrameDecoder()
    frames = []
    while not frames:
        frames = dec.feed(await r.read(4096))
    assert isinstance(frames[0].msg, Challenge)
    w.write(answer(frames[0].msg.nonce))
    await w.drain()
    await asyncio.sleep(0.05)
    w.close()
    await asyncio.sleep(0.05)


def _run(coro):
    return asyncio.run(coro)


async def _until(cond, timeout_s: float = 10.0) -> None:
    """Wait until ``cond()`` holds (a loaded host delivers late; a fixed sleep flaked under
    a parallel suite), at most ``timeout_s``; the asserts after it judge."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not cond() and loop.time() < end:
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("name, answer, source", [
    ("PING naming rank 1 (the old handshake)", lambda n: _bytes(Frame(Ping(1, 0, 0.0))), "127.0.0.1"),
    ("garbage", lambda n: b"\x00" * 200, "127.0.0.1"),
    ("AUTH for rank 1 under a guessed secret",
     lambda n: _bytes(Frame(Auth(1, auth_mac(b"g" * 32, n, 1, 0)))), "127.0.0.1"),
    ("AUTH replayed for another nonce",
     lambda n: _bytes(Frame(Auth(1, auth_mac(SECRET, b"\x01" * 16, 1, 0)))), "127.0.0.1"),
    ("the right AUTH from another address (a leaked secret)",
     lambda n: _bytes(Frame(Auth(1, auth_mac(SECRET, n, 1, 0)))), "127.0.0.2"),
])
def test_an_impersonator_changes_no_peer_state(name, answer, source):
    async def main():
        pair = Pair()
        await pair.start()
        await _intruder(pair.ports[0], answer, source)
        # the real peer still reaches worker 0, and nobody was marked lost
        await _until(lambda: pair.t[0].auth_failures >= 1)
        pair.t[1].send(0, _state(src=1, backlog_s=0.5))
        await _until(lambda: pair.got[0])
        await asyncio.sleep(0.1)  # time for a wrong liveness change to show
        assert pair.lost == {0: [], 1: []}, name
        assert pair.t[0].auth_failures == 1
        assert [type(f.msg) for f in pair.got[0]] == [State]
        for t in pair.t:
            t.close()
    _run(main())


def test_a_proven_peer_cannot_speak_for_another_rank():
    async def main():
        pair = Pair()
        await pair.start()
        pair.t[1].send(0, _state(src=5, backlog_s=0.1))  # claims rank 5
        pair.t[1].send(0, _state(src=1, backlog_s=0.2))
        await _until(lambda: pair.got[0] and pair.t[0].spoofed_frames)
        assert [f.msg.src for f in pair.got[0]] == [1] and pair.t[0].spoofed_frames == 1
        assert pair.t[0].auth_failures == 0 and pair.lost == {0: [], 1: []}
        for t in pair.t:
            t.close()
    _run(main())


def test_workers_with_different_secrets_do_not_connect():
    async def main():
        pair = Pair()
        pair.t[1].secret = b"x" * 32
        with pytest.raises(RuntimeError):
            await asyncio.gather(pair.t[0].start(2.0), pair.t[1].start(2.0))
        for t in pair.t:
            t.close()
    _run(main())


def test_frames_sent_corked_leave_in_one_write_and_arrive_whole_in_order():
    """A step's frames to one peer go out as one write (``Transport.corked``); outside a
    corked block each frame is one write, where it used to be three."""
    import torch

    from testbed.emu.wire import Hidden, Pick, sized_frame

    def hidden(i: int) -> Frame:
        m = Hidden(1, i, 0, 0, 0, 0, 1, 0, 1, 0.0, 0.0, 0.0, 0, 0, 0, (Pick(0, 0, 0),), ())
        return sized_frame(m, torch.full((8,), float(i)), 300)

    async def main():
        pair = Pair()
        await pair.start()
        tr = pair.t[1].out[0]
        writes = []
        real = tr.write
        tr.write = lambda data: (writes.append(len(data)), real(data))[1]
        with pair.t[1].corked():
            with pair.t[1].corked():  # nested: the outermost block writes
                for i in range(3):
                    pair.t[1].send(0, hidden(i))
            assert writes == [] and pair.t[1].is_corked
            for i in range(3, 5):
                pair.t[1].send(0, hidden(i))
            assert writes == []
        assert writes == [5 * 300] and not pair.t[1].is_corked
        pair.t[1].send(0, hidden(5))
        assert writes == [5 * 300, 300]
        await _until(lambda: len(pair.got[0]) == 6)
        assert [f.msg.request for f in pair.got[0]] == list(range(6))
        assert [f.tensor()[0].item() for f in pair.got[0]] == [float(i) for i in range(6)]
        assert pair.t[1].sent_frames[0] == 6 and pair.t[0].received_frames[1] == 6
        for t in pair.t:
            t.close()
    _run(main())


@pytest.mark.parametrize("kernel", [True, False])
def test_a_frame_arrives_when_the_kernel_had_it_not_when_a_busy_loop_read_it(kernel):
    """With ``emu.arrivals: kernel`` a frame's arrival is the kernel's receive time of its
    last bytes (SO_TIMESTAMPNS), so 60 ms in which the receiving worker's loop is busy
    elsewhere do not make it late; with ``read`` (before 2026-12-03) they do, by all of it."""
    from testbed.emu.wire import Hidden, Pick, tensor_frame

    got = []
    p = Pair()
    p.t[1] = Transport(1, p.ports[1], {0: ("127.0.0.1", p.ports[0])}, [0.0, 0.0],
                       lambda f, a: got.append((f, a)), lambda q, why: None, SECRET,
                       kernel_stamps=kernel)
    hidden = Hidden(0, 9, 1, 4, 1, 0, 1, 1, 1, 0.0, 0.0, 0.0, 0, 0, 0, (Pick(3, 5, 0),), ())

    async def go():
        await p.start()
        await asyncio.sleep(0.05)  # the handshake's last frames read
        sent = time.monotonic()
        assert p.t[0].send(1, tensor_frame(hidden, torch.zeros(64)))
        time.sleep(0.06)  # the loop busy: nothing reads
        await _until(lambda: got)
        return sent

    sent = _run(go())
    assert len(got) == 1 and isinstance(got[0][0].msg, Hidden)
    late = got[0][1] - sent
    waits = p.t[1].read_waits
    if kernel:
        assert late < 0.02 and max(waits) > 0.05
    else:
        assert late > 0.06 and max(waits) == 0.0
