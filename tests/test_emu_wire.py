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
from testbed.emu.wire import (ENVELOPE_SIZE, DType, Frame, FrameDecoder, Hidden, Partial, Pick, Ping,
                              Pong, Ran, Shutdown, State, Token, WireError)

LIMIT = 64 * 1024

_u8 = st.integers(0, 0xFF)
_u16 = st.integers(0, 0xFFFF)
_u32 = st.integers(0, 2**32 - 1)
_u64 = st.integers(0, 2**64 - 1)
_i32 = st.integers(-2**31, 2**31 - 1)
_i64 = st.integers(-2**63, 2**63 - 1)
_fin = st.floats(allow_nan=False, allow_infinity=False, width=64)
_lam = st.floats(0, 1e300)
_float_dtypes = st.sampled_from([torch.float16, torch.bfloat16, torch.float32])
_ctx = st.lists(_i32, max_size=40).map(tuple)


@st.composite
def _tensor(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(_float_dtypes)
    shape = draw(st.lists(st.integers(0, 9), min_size=1, max_size=w.MAX_DIMS))
    n = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    raw = draw(st.binary(min_size=n, max_size=n))
    return torch.frombuffer(bytearray(raw), dtype=dtype).view(shape) if n else torch.empty(shape, dtype=dtype)


@st.composite
def hidden_msgs(draw: st.DrawFn) -> Hidden:
    picks = draw(st.lists(st.builds(Pick, _u32, _u32, st.integers(0, 2)), min_size=1, max_size=12))
    return Hidden(draw(_u16), draw(_u64), draw(_u32), draw(_u16), draw(_u64), draw(_u8), draw(_u16),
                  draw(_u16), draw(st.integers(1, len(picks))), draw(_lam), draw(_fin), draw(_fin),
                  draw(_i64), draw(_i64), draw(_i64), tuple(picks), draw(_ctx),
                  group=draw(_u32), group_n=draw(_u16),
                  est_delay_us=draw(st.integers(-1, 2**63 - 1)))


@st.composite
def partial_msgs(draw: st.DrawFn) -> Partial:
    pos = sorted(draw(st.sets(_u16, min_size=1, max_size=12)))
    ran = tuple(Ran(p, draw(st.booleans())) for p in pos)
    return Partial(draw(_u16), draw(_u64), draw(_u32), draw(_u16), draw(_u64), draw(_fin),
                   draw(_fin), ran, group=draw(_u32), group_n=draw(_u16))


token_msgs = st.builds(Token, _u16, _u64, _u32, _u16, _u64, _u16, _lam, st.booleans(), _ctx)


@st.composite
def data_frames(draw: st.DrawFn, msgs: st.SearchStrategy | None = None) -> Frame:
    m = draw(msgs if msgs is not None else st.one_of(hidden_msgs(), partial_msgs(), token_msgs))
    t = draw(_tensor())
    n = t.numel() * t.element_size()
    return w.tensor_frame(m, t, pad_to=n + draw(st.integers(0, 300)))


@st.composite
def state_msgs(draw: st.DrawFn) -> State:
    n = draw(st.integers(1, 12))
    received = draw(st.one_of(st.just(()), st.lists(_u64, min_size=n, max_size=n).map(tuple)))
    return State(draw(_u16), draw(_u64), draw(_fin), draw(_fin), draw(_fin),
                 tuple(draw(st.lists(st.booleans(), min_size=n, max_size=n))), received,
                 finished=tuple(draw(st.lists(_u64, max_size=20))))


@st.composite
def _kv_req(draw: st.DrawFn) -> tuple:
    """(src, request, token, layer, seq, earlier positions) of a K/V message."""
    token = draw(st.integers(1, 2**32 - 1))
    pos = tuple(sorted(draw(st.sets(st.integers(0, min(token - 1, 5000)), min_size=1, max_size=20))))
    return draw(_u16), draw(_u64), token, draw(_u16), draw(_u64), pos


_kv_where = _kv_req().flatmap(lambda r: st.lists(_u16, min_size=len(r[5]), max_size=len(r[5])).map(
    lambda srv: w.KvWhere(*r[:5], tuple(w.KvHolder(s, j) for s, j in zip(srv, r[5])))))


@st.composite
def kv_data_frames(draw: st.DrawFn) -> Frame:
    """K/V data: no tensor, the K/V's bytes as padding (``node/kv.py``)."""
    m = w.KvData(*draw(_kv_req()), dtype=DType.FLOAT32, shape=(0,))
    return w.sized_frame(m, torch.empty(0), draw(st.integers(0, 20000)))


_control = {
    "state": state_msgs(),
    "fail": st.builds(w.fail, _u16, _u16, _u64, _u32, st.text(max_size=120)),
    "shutdown": st.builds(Shutdown, _u16),
    "ping": st.builds(Ping, _u16, _u64, _fin),
    "pong": st.builds(Pong, _u16, _u64, _fin, _fin),
    "challenge": st.builds(w.Challenge, _u16, st.binary(min_size=w.NONCE_BYTES, max_size=w.NONCE_BYTES)),
    "auth": st.builds(w.Auth, _u16, st.binary(min_size=w.MAC_BYTES, max_size=w.MAC_BYTES)),
    "feedback": st.builds(w.Feedback, _u16, _u64, _u32, _u16, _u64, _u64, _fin, _fin, _fin, _u64,
                          _u16, st.lists(st.booleans(), max_size=12).map(tuple)),
    "custody": st.builds(w.Custody, _u16, _fin,
                         st.lists(st.builds(w.Held, _u64, _u32), max_size=20).map(tuple)),
    "kvnotice": st.builds(w.KvNotice, _u16, st.lists(st.builds(w.KvPos, _u64, _u16, _u32),
                                                     min_size=1, max_size=20).map(tuple)),
    "kvask": _kv_req().map(lambda r: w.KvAsk(*r)),
    "kvwhere": _kv_where,
    "kvfetch": _kv_req().map(lambda r: w.KvFetch(*r)),
}
control_frames = st.one_of(*_control.values()).map(Frame)
any_frame = st.one_of(data_frames(), kv_data_frames(), control_frames)
_BY_TYPE = {"hidden": data_frames(hidden_msgs()), "partial": data_frames(partial_msgs()),
            "token": data_frames(token_msgs), "kvdata": kv_data_frames(),
            **{k: v.map(Frame) for k, v in _control.items()}}


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
        assert a.same_as(b), (a.msg, b.msg)
        if isinstance(a.msg, w.TENSOR_MESSAGES):
            x, y = a.tensor(), b.tensor()
            assert x.dtype == y.dtype and x.shape == y.shape
            assert bytes(w.tensor_bytes(x)) == bytes(w.tensor_bytes(y))  # bitwise, NaNs included


@st.composite
def _sized(draw: st.DrawFn) -> tuple[Frame, int]:
    m = draw(st.one_of(hidden_msgs(), partial_msgs(), token_msgs))
    t = draw(_tensor())
    total = draw(st.integers(0, ENVELOPE_SIZE + 400 + t.numel() * t.element_size()))
    return w.sized_frame(m, t, total), total


@settings(max_examples=150, deadline=None)
@given(got=_sized(), group=_u32, group_n=_u16, hold=st.floats(0, w.MAX_HOLD_S))
def test_a_prepared_head_is_the_head_the_message_encodes_to(got, group: int, group_n: int,
                                                            hold: float) -> None:
    """Senders build a frame's head once and patch per-destination fields into it (routing,
    ``engine.dispatch: step``): the bytes must be those a fresh encoding of the patched
    message gives, and decode to it; the frame fills ``total`` bytes where it fits."""
    f, total = got
    assert f.head == w.encode_header(f)
    whole = len(f.head) + len(f.payload) + f.pad_len
    assert whole == max(total, len(f.head) + len(f.payload))
    p = w.patched(f, group=group, group_n=group_n) if not isinstance(f.msg, Token) else f
    p = w.patched(p, hold_s=hold)
    assert p.head == w.encode_header(p) and p.msg.hold_s == hold
    data = p.head + bytes(p.payload) + bytes(p.pad_len)
    assert w.decode(data).same_as(p)


def test_a_patched_field_out_of_range_is_a_wire_error() -> None:
    f = w.sized_frame(Hidden(0, 0, 0, 0, 0, 0, 0, 0, 1, 0.0, 0.0, 0.0, 0, 0, 0, (Pick(0, 0, 0),), ()),
                      torch.zeros(4), 200)
    with pytest.raises(WireError, match="hold_s"):
        w.patched(f, hold_s=-1.0)
    with pytest.raises(WireError, match="out of range"):
        w.patched(f, group_n=1 << 16)


@pytest.mark.parametrize("kind", sorted(_BY_TYPE))
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_each_message_type_round_trips_with_every_field(kind: str, data: st.DataObject) -> None:
    frame = data.draw(_BY_TYPE[kind])
    got = w.decode(w.encode(frame, LIMIT), LIMIT)
    assert type(got.msg) is type(frame.msg) and got.same_as(frame)
    assert w.encode(got, LIMIT) == w.encode(frame, LIMIT)  # canonical


def test_every_message_class_has_a_kind_and_a_round_trip_test() -> None:
    assert {c.__name__.lower() for c in w._KIND_OF} == set(_BY_TYPE)
    assert sorted(w._KIND_OF.values()) == list(w.Kind)


def test_state_ping_pong_helpers() -> None:
    f = w.decode(w.encode(Frame(State(2, 7, 3.5, 4.0, 0.5, (True, False, True), (3, 0, 9),
                                      finished=(41, 2**40)))))
    assert f.msg.window == 7 and f.msg.opened_at == 3.5 and f.msg.src == 2
    assert f.msg.backlog_s == 0.5 and f.msg.alive == (True, False, True) and f.msg.received == (3, 0, 9)
    assert f.msg.finished == (41, 2**40)
    too_many = State(2, 7, 3.5, 4.0, 0.5, (True,), finished=tuple(range(w.MAX_FINISHED + 1)))
    with pytest.raises(WireError, match="finished has"):
        w.encode(Frame(too_many))
    ping = Ping(1, seq=3, t_send=12.5)
    pong = w.decode(w.encode(Frame(w.pong_for(w.decode(w.encode(Frame(ping))).msg, src=4, t_send=13.0))))
    assert isinstance(pong.msg, Pong) and pong.msg.t_ping == 12.5
    assert pong.msg.seq == 3 and pong.msg.src == 4 and pong.msg.t_send == 13.0


def test_fail_reason_is_cut_at_a_character_boundary() -> None:
    m = w.fail(1, 0, 5, 6, "é" * 200)  # 400 bytes of UTF-8
    assert m.reason == "é" * (w.MAX_REASON // 2)
    assert w.decode(w.encode(Frame(m))).msg == m
    with pytest.raises(WireError, match="reason longer"):
        w.encode(Frame(w.Fail(1, 0, 5, 6, "x" * (w.MAX_REASON + 1))))


def test_a_partial_names_its_positions_beyond_eight() -> None:
    """No bitmask clipped to 255: a top-k of 200 keeps every position and tier."""
    ran = tuple(Ran(j, j % 3 == 0) for j in range(0, 400, 2))
    f = w.tensor_frame(Partial(1, 2, 3, 4, 5, 0.5, 0.75, ran), torch.ones(4))
    assert w.decode(w.encode(f)).msg.ran == ran


def test_payload_is_zero_copy_on_both_ends() -> None:
    t = torch.arange(12, dtype=torch.float32).view(3, 4)
    f = w.tensor_frame(_token(), t)
    t[0, 0] = 42.0  # the frame views the tensor's memory
    assert torch.frombuffer(bytearray(f.payload), dtype=torch.float32)[0] == 42.0
    g = w.decode(w.encode(f))
    out = g.tensor()
    out[1, 1] = -1.0  # and the decoded tensor views the frame's buffer
    assert torch.frombuffer(g.payload, dtype=torch.float32)[5] == -1.0


def test_envelope_is_fixed_and_small() -> None:
    assert ENVELOPE_SIZE == struct.calcsize("<4sBBHII") == w.field_offset(None, "pad_len") + 4
    assert len(w.encode(Frame(Ping(1, 2, 3.0)))) <= 48


# -- strict validation ----------------------------------------------------------------

def _token(**kw) -> Token:
    base = dict(src=1, request=2, token=3, layer=4, seq=5, home=0, lam_acc=0.01, final=False)
    return Token(**{**base, **kw})


def _hidden(**kw) -> Hidden:
    base = dict(src=1, request=2, token=3, layer=4, seq=5, retries=0, home=0, aggregator=2,
                n_participants=1, lam_acc=0.01, t_layer=1.0, t_dispatch=1.5, view_age_us=10,
                backlog_err_us=-3, decision_us=7, assignment=(Pick(9, 4, 0),), router_ctx=(1, 2))
    return Hidden(**{**base, **kw})


def _valid() -> bytes:
    return w.encode(w.tensor_frame(_hidden(), torch.ones(2, 8)))


def _patch(data: bytes, offset: int, fmt: str, value: object) -> bytes:
    b = bytearray(data)
    struct.pack_into("<" + fmt, b, offset, value)
    return bytes(b)


@pytest.mark.parametrize("cls,field,fmt,value,msg", [
    (None, "version", "B", w.VERSION + 1, "version"),
    (None, "kind", "B", 99, "kind"),
    (None, "kind", "B", w.Kind.PING, "after the PING fields|carries no payload"),
    (None, "meta_len", "H", 7, "truncated"),
    (Hidden, "dtype", "B", DType.NONE, "float tensor"),
    (Hidden, "dtype", "B", 200, "dtype"),
    (Hidden, "n_participants", "H", 0, "n_participants"),
    (Hidden, "n_participants", "H", 2, "n_participants"),
    (Hidden, "lam_acc", "d", float("nan"), "finite"),
    (Hidden, "lam_acc", "d", -1.0, "lam_acc"),
    (Hidden, "t_dispatch", "d", float("inf"), "finite"),
    (Hidden, "est_delay_us", "q", -2, "est_delay_us"),
])
def test_each_corrupted_field_is_a_wire_error(cls, field: str, fmt: str, value: object, msg: str) -> None:
    bad = _patch(_valid(), w.field_offset(cls, field), fmt, value)
    with pytest.raises(WireError, match=msg):
        w.decode(bad)


def test_out_of_range_values_in_lists_and_flags_are_rejected() -> None:
    data = w.encode(w.tensor_frame(_token(final=True), torch.ones(2)))
    with pytest.raises(WireError, match="final must be 0 or 1"):
        w.decode(_patch(data, w.field_offset(Token, "final"), "B", 2))
    ok = w.encode(w.tensor_frame(_hidden(), torch.ones(2)))
    mode_at = ok.index(struct.pack("<IIB", 9, 4, 0)) + 8  # the one pick's mode byte
    with pytest.raises(WireError, match="unknown mode 7"):
        w.decode(_patch(ok, mode_at, "B", 7))
    st_ok = w.encode(Frame(State(1, 2, 0.0, 0.0, 0.0, (True, False))))
    with pytest.raises(WireError, match="alive flags"):
        w.decode(st_ok[:-5] + b"\x05" + st_ok[-4:])  # alive[1] = 5, then received's and
        # finished's counts


@pytest.mark.parametrize("frame,msg", [
    (lambda: w.tensor_frame(_token(layer=70000), torch.ones(1)), "out of range"),
    (lambda: w.tensor_frame(_token(src=-1), torch.ones(1)), "out of range"),
    (lambda: w.tensor_frame(_hidden(retries=256), torch.ones(1)), "out of range"),
    (lambda: w.tensor_frame(_hidden(assignment=(Pick(-1, 0, 0),)), torch.ones(1)), "out of range"),
    (lambda: w.tensor_frame(_hidden(assignment=(Pick(1, 0, 9),)), torch.ones(1)), "unknown mode"),
    (lambda: w.tensor_frame(_hidden(router_ctx=(2**31,)), torch.ones(1)), "out of range"),
    (lambda: w.tensor_frame(_hidden(router_ctx=(0,) * (w.MAX_ROUTER_CTX + 1)), torch.ones(1)),
     "at most"),
    (lambda: w.tensor_frame(_hidden(n_participants=2), torch.ones(1)), "n_participants"),
    (lambda: w.tensor_frame(Partial(1, 2, 3, 4, 5, 0.0, 0.0, (Ran(2, True), Ran(1, False))),
                            torch.ones(1)), "increasing"),
    (lambda: Frame(State(1, 2, 0.0, 0.0, 0.0, (True,) * (w.MAX_SERVERS + 1))), "at most"),
    (lambda: Frame(State(1, 2, 0.0, 0.0, 0.0, (True, True), (1,))), "one entry per server"),
    (lambda: Frame(w.Challenge(1, b"short")), "nonce"),
    (lambda: Frame(Ping(1, 2**64, 0.0)), "out of range"),
])
def test_a_field_out_of_range_is_rejected_by_the_encoder(frame, msg: str) -> None:
    with pytest.raises(WireError, match=msg):
        w.encode(frame())


def test_bad_magic_length_mismatch_and_padding_are_rejected() -> None:
    data = _valid()
    with pytest.raises(WireError, match="magic"):
        w.decode(b"XXXX" + data[4:])
    with pytest.raises(WireError, match="does not match"):
        w.decode(_patch(data, w.field_offset(None, "payload_len"), "I", 60))
    padded = w.encode(w.tensor_frame(_token(), torch.ones(2), pad_to=100))
    with pytest.raises(WireError, match="padding"):
        w.decode(padded[:-1] + b"\x01")
    with pytest.raises(WireError, match="extra"):
        w.decode(data + b"\x00")


def test_encoder_refuses_what_the_decoder_would_refuse() -> None:
    with pytest.raises(WireError, match="float tensor"):
        w.encode(Frame(_hidden()))
    with pytest.raises(WireError, match="payload has"):
        w.encode(Frame(_hidden(dtype=DType.FLOAT32, shape=(2,)), b"\x00" * 4))
    with pytest.raises(WireError, match="exceeds"):
        w.encode(w.tensor_frame(_token(), torch.ones(100)), max_payload=399)
    with pytest.raises(WireError, match="dims"):
        w.tensor_frame(_token(), torch.ones(1, 1, 1, 1, 1))
    with pytest.raises(WireError, match="no payload"):
        w.encode(Frame(Ping(1, 0, 0.0), b"", pad_len=4))
    with pytest.raises(WireError, match="not supported"):
        w.tensor_frame(_token(), torch.ones(2, dtype=torch.int64))


def test_oversized_frame_fails_on_its_envelope_without_allocating() -> None:
    big = w.tensor_frame(_token(), torch.ones(LIMIT // 4 + 1))
    head = w.encode_header(big, max_payload=2 * LIMIT)
    dec = FrameDecoder(LIMIT)
    tracemalloc.start()
    try:
        with pytest.raises(WireError, match="exceeds"):
            dec.feed(head[:ENVELOPE_SIZE])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 * 1024
    with pytest.raises(WireError):  # the decoder stays failed: the stream position is lost
        dec.feed(_valid())


def test_announced_payload_is_not_preallocated_by_the_incremental_decoder() -> None:
    f = w.tensor_frame(_token(), torch.ones(LIMIT // 4))
    data = w.encode(f, max_payload=LIMIT)
    head = len(w.encode_header(f, LIMIT))
    dec = FrameDecoder(LIMIT)
    tracemalloc.start()
    try:
        assert dec.feed(data[:head + 10]) == []
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * 1024 and dec.mid_frame


# -- fuzzing -----------------------------------------------------------------------

def _feed_all(dec: FrameDecoder, chunks: list[bytes]) -> list[Frame]:
    out: list[Frame] = []
    for c in chunks:
        out += dec.feed(c)
        # at rest: a partial envelope, part of one message's fields, or of one validated body
        assert dec.buffered <= max(ENVELOPE_SIZE, w.MAX_META, dec.max_payload)
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
        frames = [w.tensor_frame(_token(token=5, final=True), big, pad_to=400 * 1024),
                  Frame(Shutdown(1))]
        sender = threading.Thread(target=lambda: [w.send_frame(a, f, 2**20) for f in frames])
        sender.start()
        got = [w.recv_frame(b, 2**20), w.recv_frame(b, 2**20)]
        sender.join()
        a.shutdown(socket.SHUT_WR)
        assert w.recv_frame(b, 2**20) is None  # clean EOF between frames
    assert got[0] is not None and got[0].same_as(frames[0])
    assert torch.equal(got[0].tensor(), big) and got[1] is not None
    assert got[1].msg == Shutdown(1)


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
                        if isinstance(f.msg, Ping):
                            conn.setblocking(True)
                            w.send_frame(conn, Frame(w.pong_for(f.msg, src=0)))
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
                w.send_frame(good, Frame(Ping(1, seq=seq, t_send=float(seq))))
                return w.recv_frame(good)

            assert (p := ping(1)) is not None and p.msg.seq == 1
            bad.sendall(b"GET / HTTP/1.1\r\n" + bytes(range(256)) * 2)
            assert bad.recv(100) == b""  # the server closed the garbage connection
            for seq in range(2, 6):  # ... and keeps serving the other one
                p = ping(seq)
                assert p is not None and isinstance(p.msg, Pong)
                assert p.msg.seq == seq and p.msg.t_ping == float(seq)
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


def test_a_servers_state_for_itself_is_framed_without_head_or_padding():
    """A pipeline stage hands most layers to itself (``Peers._hidden_frame``): that frame
    goes straight to the server's own handler, so it is built without the encoded head and
    the padding to the simulator's size, with the same message and tensor; a frame for a
    peer is the simulator's size on the wire and decodes to the same state."""
    from testbed.emu.node.peers import Peers

    wire_bytes = 4096 + 512  # a state and the simulator's header bytes
    handed, written = [], []

    class Net:
        sent_frames = {1: 0}

        def send(self, dst, frame, due=None, modeled=True):
            written.append((dst, frame))
            return True

    class Loop:
        def call_soon(self, fn, *args):
            handed.append(args[0])

    class Node(Peers):
        N, rank, stopping, holds = 2, 0, False, None
        net, loop = Net(), Loop()
        reachable = [True, True]

        def wall(self, t):
            return t

    node = Node()
    node.wire_bytes = wire_bytes
    node.stats = {"frames_out": 0}
    node._init_peers()
    state = torch.arange(1024, dtype=torch.float32)
    m = Hidden(0, 9, 3, 4, 1, 0, 0, 1, 1, 0.0, 0.0, 0.0, 0, 0, 0, (Pick(3, 5, 0),), (),
               dtype=DType.FLOAT32, shape=(1024,))

    own = node._hidden_frame(m, state, 0)
    assert own.head is None and own.pad_len == 0
    assert own.msg == m and torch.equal(own.tensor(), state)
    grouped = w.patched(own, group=7, group_n=2)  # a dispatch group's count, as _outgoing does
    assert grouped.head is None and (grouped.msg.group, grouped.msg.group_n) == (7, 2)
    assert node._send(0, grouped, at=0.5) and handed == [grouped] and not written

    peer = node._hidden_frame(m, state, 1)
    assert peer.head is not None and len(w.encode(peer)) == wire_bytes
    assert node._send(1, peer) and written == [(1, peer)]
    got = w.decode(w.encode(w.patched(peer, group=7, group_n=2)))
    assert got.msg == grouped.msg and torch.equal(got.tensor(), state)
    # without a destination (a state some peer will read) it is the wire's size too
    assert len(w.encode(node._hidden_frame(m, state))) == wire_bytes


def test_the_decoder_says_how_many_bytes_complete_the_next_frame():
    """A stamped reader takes just ``need`` bytes, so each read ends at a frame's end."""
    from testbed.emu.wire import ENVELOPE_SIZE, FrameDecoder, Ping, encode
    raw = bytes(encode(Frame(Ping(1, 0, 0.0))))
    dec = FrameDecoder()
    assert dec.need == ENVELOPE_SIZE
    got, i = [], 0
    while i < 2 * len(raw):
        n = dec.need
        assert 1 <= n <= 2 * len(raw) - i
        got += dec.feed((raw + raw)[i:i + n])
        i += n
        assert (dec.need == ENVELOPE_SIZE) == (i % len(raw) == 0)
    assert len(got) == 2 and dec.need == ENVELOPE_SIZE


def test_k_v_messages_name_only_earlier_positions_once_each_and_carry_no_tensor() -> None:
    """A K/V message about token i names positions < i, in increasing order, none twice; a
    KV_DATA frame's bytes are padding (the emulated experts keep no real cache)."""
    for bad in ((0, 0), (2, 1), (5,)):
        with pytest.raises(WireError, match="positions"):
            w.encode(Frame(w.KvAsk(1, 2, 5, 3, 4, bad)))
    with pytest.raises(WireError, match="holders"):
        w.encode(Frame(w.KvWhere(1, 2, 5, 3, 4, (w.KvHolder(0, 3), w.KvHolder(2, 1)))))
    with pytest.raises(WireError, match="at least one"):
        w.encode(Frame(w.KvNotice(1, ())))
    with pytest.raises(WireError, match="no tensor"):
        w.encode(w.tensor_frame(w.KvData(1, 2, 5, 3, 4, (0, 1)), torch.ones(2)))
    f = w.sized_frame(w.KvData(1, 2, 5, 3, 4, (0, 1), dtype=DType.FLOAT32, shape=(0,)),
                      torch.empty(0), 8192)
    assert len(w.encode(f)) == 8192 and w.decode(w.encode(f)).same_as(f)
