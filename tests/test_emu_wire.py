"""Wire format: exact round trips, strict validation, fuzzing, and per-connection failure."""

from __future__ import annotations

import math
import selectors
import socket
import struct
import threading
import tracemalloc
from typing import cast

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from testbed.emu import wire as w
from testbed.emu.wire import (HEADER_SIZE, ControlKind, DType, Flag, Frame, FrameDecoder, Header,
                              MsgType, WireError)

LIMIT = 64 * 1024

_u16 = st.integers(0, 0xFFFF)
_i32 = st.integers(-2**31, 2**31 - 1)
_fin = st.floats(allow_nan=False, allow_infinity=False, width=64)
_float_dtypes = st.sampled_from([torch.float16, torch.bfloat16, torch.float32])


@st.composite
def data_frames(draw: st.DrawFn) -> Frame:
    mtype = draw(st.sampled_from([MsgType.HIDDEN, MsgType.PARTIAL, MsgType.TOKEN]))
    dtype = draw(_float_dtypes)
    shape = draw(st.lists(st.integers(0, 9), min_size=1, max_size=w.MAX_DIMS))
    n = math.prod(shape)
    raw = draw(st.binary(min_size=n * torch.empty(0, dtype=dtype).element_size(),
                         max_size=n * torch.empty(0, dtype=dtype).element_size()))
    t = torch.frombuffer(bytearray(raw), dtype=dtype).view(shape) if n else torch.empty(shape, dtype=dtype)
    h = Header(mtype, flags=draw(st.sampled_from([0, Flag.FINAL])),
               mode=draw(st.integers(0, 255)), part=draw(st.integers(0, 255)),
               n_parts=draw(st.integers(0, 255)), request=draw(st.integers(0, 2**64 - 1)),
               seq=draw(st.integers(0, 2**64 - 1)), token=draw(st.integers(0, 2**32 - 1)),
               layer=draw(_u16), src=draw(_u16), home=draw(_u16), residing=draw(_u16),
               aggregator=draw(_u16), target=draw(_i32), expert=draw(_i32), replica=draw(_i32),
               gate=draw(_fin), lam_acc=draw(st.floats(0, 1e300)), t_origin=draw(_fin),
               t_send=draw(_fin), ctx=tuple(draw(st.lists(_i32, max_size=w.MAX_CTX))))
    pad = draw(st.integers(0, 300))
    return w.tensor_frame(h, t, pad_to=len(raw) + pad)


@st.composite
def control_frames(draw: st.DrawFn) -> Frame:
    kind = draw(st.sampled_from(list(ControlKind)[1:]))
    if kind in (ControlKind.CHALLENGE, ControlKind.AUTH):
        n = w.NONCE_BYTES if kind == ControlKind.CHALLENGE else 32
        return w.bytes_frame(kind, draw(_u16), draw(st.binary(min_size=n, max_size=n)))
    if kind == ControlKind.STATE:
        n = draw(st.integers(1, 12))
        return w.state_frame(draw(st.lists(st.floats(0, 1e3), min_size=n, max_size=n)),
                             draw(st.lists(st.booleans(), min_size=n, max_size=n)),
                             src=draw(_u16), window=draw(st.integers(0, 2**40)),
                             opened_at=draw(_fin), t_send=draw(_fin))
    return w.control_frame(kind, src=draw(_u16), t_send=draw(_fin), t_origin=draw(_fin),
                           seq=draw(st.integers(0, 2**64 - 1)))


any_frame = st.one_of(data_frames(), control_frames())


def _chunks(data: bytes, cuts: list[int]) -> list[bytes]:
    idx = sorted({c % (len(data) + 1) for c in cuts})
    out, prev = [], 0
    for i in idx + [len(data)]:
        out.append(data[prev:i])
        prev = i
    return out


# -- round trips -----------------------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(frames=st.lists(any_frame, min_size=1, max_size=4), cuts=st.lists(st.integers(0, 10**6), max_size=8))
def test_valid_frames_round_trip_exactly_in_any_chunking(frames: list[Frame], cuts: list[int]) -> None:
    stream = b"".join(w.encode(f) for f in frames)
    dec = FrameDecoder(LIMIT)
    got: list[Frame] = []
    for chunk in _chunks(stream, cuts):
        got += dec.feed(chunk)
    assert len(got) == len(frames) and dec.buffered == 0 and not dec.mid_frame
    for a, b in zip(frames, got):
        assert a.same_as(b), (a.header, b.header)
        if a.header.dtype != DType.NONE:
            x, y = a.tensor(), b.tensor()
            assert x.dtype == y.dtype and x.shape == y.shape
            assert bytes(w.tensor_bytes(x)) == bytes(w.tensor_bytes(y))  # bitwise, NaNs included


def test_state_ping_pong_helpers() -> None:
    f = w.decode(w.encode(w.state_frame([0.5, 0.0, 2.25], [True, False, True], src=2,
                                        window=7, opened_at=3.5)))
    assert f.header.seq == 7 and f.header.t_origin == 3.5 and f.header.src == 2
    assert w.parse_state(f) == ([0.5, 0.0, 2.25], [True, False, True])
    ping = w.control_frame(ControlKind.PING, src=1, t_send=12.5, seq=3)
    pong = w.decode(w.encode(w.pong_for(w.decode(w.encode(ping)), src=4, t_send=13.0)))
    assert pong.header.kind == ControlKind.PONG and pong.header.t_origin == 12.5
    assert pong.header.seq == 3 and pong.header.src == 4


def test_payload_is_zero_copy_on_both_ends() -> None:
    t = torch.arange(12, dtype=torch.float32).view(3, 4)
    f = w.tensor_frame(Header(MsgType.HIDDEN), t)
    t[0, 0] = 42.0  # the frame views the tensor's memory
    assert torch.frombuffer(bytearray(f.payload), dtype=torch.float32)[0] == 42.0
    g = w.decode(w.encode(f))
    out = g.tensor()
    out[1, 1] = -1.0  # and the decoded tensor views the frame's buffer
    assert torch.frombuffer(g.payload, dtype=torch.float32)[5] == -1.0


def test_header_size_is_fixed_and_small() -> None:
    assert HEADER_SIZE == struct.calcsize(w._FMT) == w.field_offset("pad_len") + 4
    assert HEADER_SIZE <= 160


# -- strict validation ----------------------------------------------------------------

def _valid() -> bytes:
    return w.encode(w.tensor_frame(Header(MsgType.HIDDEN, lam_acc=0.01), torch.ones(2, 8)))


def _patch(data: bytes, offset: int, fmt: str, value: object) -> bytes:
    b = bytearray(data)
    struct.pack_into("<" + fmt, b, offset, value)
    return bytes(b)


@pytest.mark.parametrize("field,fmt,value,msg", [
    ("version", "B", 9, "version"),
    ("mtype", "B", 99, "enum"),
    ("kind", "B", ControlKind.PING, "control kind"),
    ("flags", "H", 0x80, "flag"),
    ("dtype", "B", DType.INT64, "floating"),
    ("dtype", "B", 200, "enum"),
    ("ndim", "B", 7, "dims"),
    ("n_ctx", "B", w.MAX_CTX + 1, "context"),
    ("lam_acc", "d", float("nan"), "finite"),
    ("lam_acc", "d", -1.0, "lam_acc"),
    ("gate", "d", float("inf"), "finite"),
    ("reserved", "B", 1, "reserved"),
])
def test_each_corrupted_field_is_a_wire_error(field: str, fmt: str, value: object, msg: str) -> None:
    bad = _patch(_valid(), w.field_offset(field), fmt, value)
    with pytest.raises(WireError, match=msg):
        w.decode(bad)


def test_bad_magic_length_mismatch_and_padding_are_rejected() -> None:
    data = _valid()
    with pytest.raises(WireError, match="magic"):
        w.decode(b"XXXX" + data[4:])
    with pytest.raises(WireError, match="does not match"):
        w.decode(_patch(data, w.field_offset("payload_len"), "Q", 60))
    padded = w.encode(w.tensor_frame(Header(MsgType.HIDDEN), torch.ones(2), pad_to=100))
    with pytest.raises(WireError, match="padding"):
        w.decode(padded[:-1] + b"\x01")
    with pytest.raises(WireError, match="extra"):
        w.decode(data + b"\x00")


def test_encoder_refuses_what_the_decoder_would_refuse() -> None:
    with pytest.raises(WireError, match="floating"):
        w.encode(Frame(Header(MsgType.HIDDEN)))
    with pytest.raises(WireError, match="payload has"):
        w.encode(Frame(Header(MsgType.HIDDEN, dtype=DType.FLOAT32, shape=(2,)), b"\x00" * 4))
    with pytest.raises(WireError, match="out of range"):
        w.encode(w.tensor_frame(Header(MsgType.HIDDEN, layer=70000), torch.ones(1)))
    with pytest.raises(WireError, match="exceeds"):
        w.encode(w.tensor_frame(Header(MsgType.HIDDEN), torch.ones(100)), max_payload=399)
    with pytest.raises(WireError, match="dims"):
        w.tensor_frame(Header(MsgType.HIDDEN), torch.ones(1, 1, 1, 1, 1))
    with pytest.raises(WireError, match="no payload"):
        w.encode(w.tensor_frame(Header(MsgType.CONTROL, kind=ControlKind.PING), torch.ones(1)))
    # an ERROR partial may come without a payload
    assert w.decode(w.encode(Frame(Header(MsgType.PARTIAL, flags=Flag.ERROR)))).header.flags == Flag.ERROR


def test_oversized_frame_fails_on_its_header_without_allocating() -> None:
    big = w.tensor_frame(Header(MsgType.HIDDEN), torch.ones(LIMIT // 4 + 1))
    head = w.encode_header(big, max_payload=2 * LIMIT)
    dec = FrameDecoder(LIMIT)
    tracemalloc.start()
    try:
        with pytest.raises(WireError, match="exceeds"):
            dec.feed(head)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 * 1024
    with pytest.raises(WireError):  # the decoder stays failed: the stream position is lost
        dec.feed(_valid())


def test_announced_payload_is_not_preallocated_by_the_incremental_decoder() -> None:
    f = w.tensor_frame(Header(MsgType.HIDDEN), torch.ones(LIMIT // 4))
    data = w.encode(f, max_payload=LIMIT)
    dec = FrameDecoder(LIMIT)
    tracemalloc.start()
    try:
        assert dec.feed(data[:HEADER_SIZE + 10]) == []
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * 1024 and dec.mid_frame


# -- fuzzing -----------------------------------------------------------------------

def _feed_all(dec: FrameDecoder, chunks: list[bytes]) -> list[Frame]:
    out: list[Frame] = []
    for c in chunks:
        out += dec.feed(c)
        # at rest: a partial header, or part of one validated frame body
        assert dec.buffered <= max(HEADER_SIZE, dec.max_payload)
    return out


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=2000), cuts=st.lists(st.integers(0, 5000), max_size=6))
def test_random_bytes_only_ever_raise_wire_error(data: bytes, cuts: list[int]) -> None:
    dec = FrameDecoder(LIMIT)
    try:
        frames = _feed_all(dec, _chunks(data, cuts))
    except WireError:
        return
    for f in frames:
        assert len(f.payload) <= LIMIT


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frame=any_frame, flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)),
                                       min_size=1, max_size=4),
       cuts=st.lists(st.integers(0, 5000), max_size=4))
def test_mutated_frames_fail_cleanly_or_decode_canonically(frame: Frame, flips: list[tuple[int, int]],
                                                           cuts: list[int]) -> None:
    data = bytearray(w.encode(frame))
    for pos, x in flips:
        data[pos % len(data)] ^= x
    dec = FrameDecoder(LIMIT)
    try:
        frames = _feed_all(dec, _chunks(bytes(data), cuts))
    except WireError:
        return
    # whatever was accepted is a valid frame whose encoding is exactly the bytes consumed
    consumed = b"".join(w.encode(f, LIMIT) for f in frames)
    assert bytes(data).startswith(consumed)
    assert dec.mid_frame == (len(consumed) < len(data))  # the rest waits for more bytes


@settings(max_examples=100, deadline=None)
@given(frame=any_frame, cut=st.integers(0, 10**6))
def test_truncated_frames_never_yield_a_frame(frame: Frame, cut: int) -> None:
    data = w.encode(frame)
    n = cut % len(data)
    dec = FrameDecoder(LIMIT)
    assert dec.feed(data[:n]) == []
    assert dec.mid_frame == (n > 0)
    with pytest.raises(WireError, match="expected one whole frame"):
        w.decode(data[:n])


# -- sockets -------------------------------------------------------------------------

def test_blocking_send_and_recv_over_a_socket() -> None:
    a, b = socket.socketpair()
    with a, b:
        big = torch.randn(300, 256)  # 300 KiB: many partial sends and receives
        frames = [w.tensor_frame(Header(MsgType.TOKEN, token=5), big, pad_to=400 * 1024),
                  w.control_frame(ControlKind.SHUTDOWN, src=1)]
        sender = threading.Thread(target=lambda: [w.send_frame(a, f, 2**20) for f in frames])
        sender.start()
        got = [w.recv_frame(b, 2**20), w.recv_frame(b, 2**20)]
        sender.join()
        a.shutdown(socket.SHUT_WR)
        assert w.recv_frame(b, 2**20) is None  # clean EOF between frames
    assert got[0] is not None and got[0].same_as(frames[0])
    assert torch.equal(got[0].tensor(), big) and got[1] is not None
    assert got[1].header.kind == ControlKind.SHUTDOWN


def test_recv_frame_raises_on_eof_mid_frame_and_on_oversize() -> None:
    data = _valid()
    for payload, limit, msg in ((data[:-3], LIMIT, "mid-frame"), (data, 10, "exceeds")):
        a, b = socket.socketpair()
        with a, b:
            a.sendall(payload)
            a.shutdown(socket.SHUT_WR)
            with pytest.raises(WireError, match=msg):
                w.recv_frame(b, limit)


class _EchoServer:
    """Answers PING with PONG per connection; a WireError closes that connection only."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sel = selectors.DefaultSelector()
        self.listener.setblocking(False)
        self.sel.register(self.listener, selectors.EVENT_READ, None)
        self.stop = threading.Event()
        self.closed_for_error = 0
        self.pongs = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            for key, _ in self.sel.select(timeout=0.05):
                if key.data is None:
                    conn, _ = self.listener.accept()
                    conn.setblocking(False)
                    self.sel.register(conn, selectors.EVENT_READ, FrameDecoder(LIMIT))
                    continue
                conn, dec = cast(socket.socket, key.fileobj), key.data
                try:
                    data = conn.recv(65536)
                    if not data:
                        if dec.mid_frame:
                            raise WireError("truncated at EOF")
                        self._close(conn)
                        continue
                    for f in dec.feed(data):
                        if f.header.kind == ControlKind.PING:
                            conn.setblocking(True)
                            w.send_frame(conn, w.pong_for(f, src=0))
                            conn.setblocking(False)
                            self.pongs += 1
                except WireError:
                    self.closed_for_error += 1
                    self._close(conn)
        for key in list(self.sel.get_map().values()):
            cast(socket.socket, key.fileobj).close()
        self.sel.close()

    def _close(self, conn: socket.socket) -> None:
        self.sel.unregister(conn)
        conn.close()


def test_garbage_from_one_client_closes_only_that_connection() -> None:
    srv = _EchoServer()
    srv.thread.start()
    try:
        good = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        bad = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        with good, bad:
            def ping(seq: int) -> Frame | None:
                w.send_frame(good, w.control_frame(ControlKind.PING, src=1, t_send=float(seq), seq=seq))
                return w.recv_frame(good)

            assert (p := ping(1)) is not None and p.header.seq == 1
            bad.sendall(b"GET / HTTP/1.1\r\n" + bytes(range(256)) * 2)
            assert bad.recv(100) == b""  # the server closed the garbage connection
            for seq in range(2, 6):  # ... and keeps serving the other one
                p = ping(seq)
                assert p is not None and p.header.kind == ControlKind.PONG
                assert p.header.seq == seq and p.header.t_origin == float(seq)
    finally:
        srv.stop.set()
        srv.thread.join(5)
    assert srv.closed_for_error == 1 and srv.pongs == 5  # read once the server thread ended


def test_rendezvous_through_a_tcp_store_gives_each_worker_its_peers() -> None:
    """Three workers on localhost: each learns the address its peers published for it."""
    import threading

    from testbed.emu.rendezvous import rendezvous

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        store_port = s.getsockname()[1]
    out: dict[int, dict] = {}
    secrets: dict[int, bytes] = {}

    def worker(rank: int) -> None:
        addrs = {str(p): f"127.0.{rank}.{p}" for p in range(3) if p != rank}
        peers, store, secret = rendezvous(rank, 3, "127.0.0.1", store_port, 9000 + rank, addrs,
                                          timeout_s=30)
        out[rank], secrets[rank] = peers, secret

    threads = [threading.Thread(target=worker, args=(r,)) for r in (0, 1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert out == {r: {p: (f"127.0.{p}.{r}", 9000 + p) for p in range(3) if p != r} for r in range(3)}
    # rank 0 drew the run secret that authenticates peers; everyone has the same one
    assert len(secrets[0]) == 32 and secrets[0] == secrets[1] == secrets[2]
