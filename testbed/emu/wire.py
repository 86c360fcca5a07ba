"""Data-plane wire format between emulated workers: a fixed header plus raw tensor bytes.

Why a home-made format and not pickle: a worker reads frames from peers it does
not control (a crashed or buggy peer, a fuzzer), so decoding must be a pure
function of bytes that can only fail with ``WireError`` and never allocate more
than a configured limit. A fixed ``struct`` header makes every field bounded
and the payload length known before a single payload byte is buffered.

Frame = header (``HEADER_SIZE`` bytes, little-endian) + context (``n_ctx``
int32) + payload + padding. The context is variable-length so a frame pays
only for the entries it uses.

- ``payload`` is one C-contiguous tensor (dtype code + up to 4 dims);
  ``len == prod(shape) * itemsize`` is checked.
- ``pad_len`` zero bytes follow the payload and are dropped by the receiver.
  They let the emulator put a real model's hidden-state size on the wire
  (8 KiB for Mixtral) while computing on scaled-down experts.
- Routing fields the sender must carry (residing/aggregation server, the
  token's accumulated quality budget as float64, gate weight, up to
  ``MAX_CTX`` int32 of router context) live in the header, so a frame is
  self-describing and no side channel is needed.

CONTROL frames carry a ``kind``: STATE (a state-view snapshot, payload
float64 ``[2, N]`` or ``[3, N]``: row 0 backlog seconds, row 1 alive flags, row 2
if present the number of frames the sender has received from each server, a
cumulative acknowledgement), FAIL (a token cannot continue; ``home`` names the
request's home, a peer that is not the home forwards it there, and ``ctx``
holds the reason's UTF-8 bytes, one per int), SHUTDOWN, PING
and PONG (a PONG echoes the PING's ``t_send`` in ``t_origin`` so the pinger
measures RTT with its own clock).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import socket
import struct
from dataclasses import dataclass, field, replace
from enum import IntEnum
from typing import Sequence

import numpy as np
import torch

MAGIC = b"HRTW"
VERSION = 1
MAX_DIMS = 4
MAX_CTX = 64
NO_SERVER = 0xFFFF
#: Default payload limit: far above any scaled-down batch, far below memory.
DEFAULT_MAX_PAYLOAD = 16 * 2**20


class WireError(ValueError):
    """A malformed, truncated or oversized frame: close that connection only."""


class MsgType(IntEnum):
    HIDDEN = 1  # hidden state fanned out to run one expert replica
    PARTIAL = 2  # an expert's (gate-weighted) output back to the aggregator
    TOKEN = 3  # token handed to its next residing server, or home when FINAL
    CONTROL = 4  # see ControlKind


class ControlKind(IntEnum):
    NONE = 0  # data frames
    STATE = 1
    SHUTDOWN = 2
    PING = 3
    PONG = 4
    FAIL = 5  # a token cannot continue: tells its home server (request, token, reason in ctx)
    CHALLENGE = 6  # the listener's first frame on a connection: a fresh nonce (uint8 [16])
    AUTH = 7  # the connector's answer: HMAC-SHA256 of the nonce and both ranks (uint8 [32])


class Flag:
    """Bits of ``Header.flags``; unknown bits are rejected."""

    FINAL = 0x1  # TOKEN: all layers done, this is the output going home
    ERROR = 0x2  # PARTIAL: the replica could not run; no payload expected
    MASK = FINAL | ERROR


class DType(IntEnum):
    NONE = 0
    FLOAT16 = 1
    BFLOAT16 = 2
    FLOAT32 = 3
    FLOAT64 = 4
    INT8 = 5
    UINT8 = 6
    INT32 = 7
    INT64 = 8


_TORCH_OF = {
    DType.FLOAT16: torch.float16, DType.BFLOAT16: torch.bfloat16,
    DType.FLOAT32: torch.float32, DType.FLOAT64: torch.float64,
    DType.INT8: torch.int8, DType.UINT8: torch.uint8,
    DType.INT32: torch.int32, DType.INT64: torch.int64,
}
_CODE_OF = {v: k for k, v in _TORCH_OF.items()}
_ITEMSIZE = {k: torch.empty(0, dtype=v).element_size() for k, v in _TORCH_OF.items()}
_ITEMSIZE[DType.NONE] = 0

# The packed header, in order. Header fields keep their names; shape and ctx are
# fixed-size arrays whose unused slots must be zero.
_LAYOUT: tuple[tuple[str, str], ...] = (
    ("magic", "4s"), ("version", "B"),
    ("mtype", "B"), ("flags", "H"), ("kind", "B"), ("mode", "B"), ("part", "B"), ("n_parts", "B"),
    ("request", "Q"), ("seq", "Q"), ("token", "I"), ("layer", "H"),
    ("src", "H"), ("home", "H"), ("residing", "H"), ("aggregator", "H"),
    ("target", "i"), ("expert", "i"), ("replica", "i"),  # -1: none
    ("gate", "d"), ("lam_acc", "d"), ("t_origin", "d"), ("t_send", "d"),
    ("dtype", "B"), ("ndim", "B"), ("n_ctx", "B"), ("reserved", "B"),
    ("shape", f"{MAX_DIMS}I"),
    ("payload_len", "Q"), ("pad_len", "I"),
)
_FMT = "<" + "".join(code for _, code in _LAYOUT)
_STRUCT = struct.Struct(_FMT)
#: Scalar Header fields packed as they are (between version and ndim).
_FIELDS = tuple(name for name, _ in _LAYOUT[2:_LAYOUT.index(("ndim", "B"))])


def field_offset(name: str) -> int:
    """Byte offset of a header field (tests and debugging tools patch frames with it)."""
    names = [n for n, _ in _LAYOUT]
    return struct.calcsize("<" + "".join(c for _, c in _LAYOUT[:names.index(name)]))


HEADER_SIZE = _STRUCT.size


@dataclass(frozen=True, slots=True)
class Header:
    """Every fixed field of a frame except magic/version and the byte lengths.

    ``shape``/``dtype`` describe the payload; ``ctx`` is the router context
    (e.g. the next layer's top-k expert ids); ``lam_acc`` the accumulated
    quality degradation of the token (float64 so it sums exactly like the
    simulator's). Timestamps are seconds of the sender's monotonic clock.
    """

    mtype: MsgType
    flags: int = 0
    kind: ControlKind = ControlKind.NONE
    mode: int = 0
    part: int = 0
    n_parts: int = 0
    request: int = 0
    seq: int = 0
    token: int = 0
    layer: int = 0
    src: int = NO_SERVER
    home: int = NO_SERVER
    residing: int = NO_SERVER
    aggregator: int = NO_SERVER
    target: int = -1
    expert: int = -1
    replica: int = -1
    gate: float = 1.0
    lam_acc: float = 0.0
    t_origin: float = 0.0
    t_send: float = 0.0
    dtype: DType = DType.NONE
    shape: tuple[int, ...] = ()
    ctx: tuple[int, ...] = field(default=())

    @property
    def payload_len(self) -> int:
        return _ITEMSIZE[self.dtype] * math.prod(self.shape) if self.dtype else 0


@dataclass(frozen=True, slots=True)
class Frame:
    """A header and its payload bytes (``bytearray`` when decoded: writable, so
    ``tensor()`` wraps it without a copy)."""

    header: Header
    payload: bytes | bytearray | memoryview = b""
    pad_len: int = 0

    def tensor(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The payload as a tensor; zero-copy on CPU when the buffer is writable."""
        h = self.header
        if h.dtype == DType.NONE:
            raise WireError("frame has no payload tensor")
        buf = self.payload
        if isinstance(buf, bytes) or (isinstance(buf, memoryview) and buf.readonly):
            buf = bytearray(buf)
        if len(buf) == 0:
            t = torch.empty(h.shape, dtype=_TORCH_OF[h.dtype])
        else:
            t = torch.frombuffer(buf, dtype=_TORCH_OF[h.dtype]).view(h.shape)
        return t if device is None else t.to(device)

    def same_as(self, other: "Frame") -> bool:
        """Equality of header, payload bytes and padding (payload buffer types differ)."""
        return (self.header == other.header and bytes(self.payload) == bytes(other.payload)
                and self.pad_len == other.pad_len)


# -- building frames -----------------------------------------------------------

def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Raw bytes of a tensor; no copy for a contiguous CPU tensor (any dtype, bf16 too)."""
    if t.device.type != "cpu":
        t = t.cpu()  # the one unavoidable copy of a device tensor
    t = t.contiguous()
    if t.dim() == 0:
        t = t.reshape(1)
    return memoryview(t.view(-1).view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


def tensor_frame(header: Header, t: torch.Tensor, pad_to: int = 0) -> Frame:
    """Frame carrying ``t``; ``pad_to`` pads the body with zeros up to that many bytes."""
    if t.dtype not in _CODE_OF:
        raise WireError(f"dtype {t.dtype} is not supported on the wire")
    if t.dim() > MAX_DIMS:
        raise WireError(f"tensor has {t.dim()} dims, at most {MAX_DIMS} go on the wire")
    code, shape = _CODE_OF[t.dtype], tuple(t.shape)
    h = header if (header.dtype == code and header.shape == shape) else \
        replace(header, dtype=code, shape=shape)
    data = tensor_bytes(t) if t.numel() else memoryview(b"")
    return Frame(h, data, max(0, pad_to - len(data)))


def state_frame(backlog: Sequence[float], alive: Sequence[bool], src: int, window: int,
                opened_at: float, t_send: float = 0.0,
                received: Sequence[int] | None = None) -> Frame:
    """CONTROL/STATE snapshot: ``seq`` is the window number, ``t_origin`` its opening time;
    ``received`` (frames received from each server so far) acknowledges them."""
    if len(backlog) != len(alive) or (received is not None and len(received) != len(alive)):
        raise ValueError("backlog, alive and received must have one entry per server")
    rows = [list(map(float, backlog)), [1.0 if a else 0.0 for a in alive]]
    if received is not None:
        rows.append([float(c) for c in received])
    arr = torch.tensor(rows, dtype=torch.float64)
    h = Header(MsgType.CONTROL, kind=ControlKind.STATE, src=src, seq=window,
               t_origin=opened_at, t_send=t_send)
    return tensor_frame(h, arr)


def parse_state(frame: Frame) -> tuple[list[float], list[bool]]:
    """(backlog seconds, alive flags) of a STATE frame."""
    h = frame.header
    if h.mtype != MsgType.CONTROL or h.kind != ControlKind.STATE:
        raise WireError("not a STATE frame")
    arr = np.frombuffer(frame.payload, dtype=np.float64).reshape(h.shape)
    return arr[0].tolist(), [bool(a) for a in arr[1]]


def state_received(frame: Frame) -> list[int] | None:
    """The STATE frame's acknowledgements (frames received per server), None if it has none."""
    h = frame.header
    if h.shape[0] < 3:
        return None
    arr = np.frombuffer(frame.payload, dtype=np.float64).reshape(h.shape)
    return [int(c) for c in arr[2]]


def fail_frame(src: int, home: int, request: int, token: int, reason: str) -> Frame:
    """CONTROL/FAIL: token ``token`` of ``request`` (homed at ``home``) cannot continue."""
    return Frame(Header(MsgType.CONTROL, kind=ControlKind.FAIL, src=src, home=home,
                        request=request, token=token,
                        ctx=tuple(reason.encode("utf-8", "replace")[:MAX_CTX])))


def fail_reason(frame: Frame) -> str:
    return bytes(int(c) & 0xFF for c in frame.header.ctx).decode("utf-8", "replace")


def control_frame(kind: ControlKind, src: int, t_send: float = 0.0, t_origin: float = 0.0,
                  seq: int = 0) -> Frame:
    """A payload-less CONTROL frame (SHUTDOWN, PING, PONG)."""
    return Frame(Header(MsgType.CONTROL, kind=kind, src=src, seq=seq, t_send=t_send,
                        t_origin=t_origin))


def pong_for(ping: Frame, src: int, t_send: float = 0.0) -> Frame:
    """The reply to a PING: echoes its ``t_send`` as ``t_origin`` and its ``seq``."""
    return control_frame(ControlKind.PONG, src, t_send=t_send, t_origin=ping.header.t_send,
                         seq=ping.header.seq)


# -- encoding ------------------------------------------------------------------

def _validate(h: Header, pad_len: int, max_payload: int) -> None:
    """Every rule a decoded header must satisfy; the encoder applies the same ones."""
    try:
        mtype = MsgType(h.mtype)
        kind = ControlKind(h.kind)
        dtype = DType(h.dtype)
    except ValueError as e:
        raise WireError(f"unknown enum value: {e}") from None
    if h.flags & ~Flag.MASK:
        raise WireError(f"unknown flag bits 0x{h.flags & ~Flag.MASK:x}")
    if (mtype == MsgType.CONTROL) != (kind != ControlKind.NONE):
        raise WireError("control kind must be set exactly on CONTROL frames")
    ndim = len(h.shape)
    if ndim > MAX_DIMS or len(h.ctx) > MAX_CTX:
        raise WireError("too many dims or context entries")
    if dtype == DType.NONE and ndim:
        raise WireError("shape given without a dtype")
    for name in ("gate", "lam_acc", "t_origin", "t_send"):
        if not math.isfinite(getattr(h, name)):
            raise WireError(f"{name} is not finite")
    if h.lam_acc < 0:
        raise WireError("lam_acc must be >= 0")
    n = h.payload_len
    if n + pad_len > max_payload:
        raise WireError(f"body of {n + pad_len} bytes exceeds the limit of {max_payload}")
    errored = bool(h.flags & Flag.ERROR)
    if mtype in (MsgType.HIDDEN, MsgType.TOKEN) or (mtype == MsgType.PARTIAL and not errored):
        if dtype not in (DType.FLOAT16, DType.BFLOAT16, DType.FLOAT32) or ndim < 1:
            raise WireError(f"{mtype.name} needs a floating tensor payload")
    if kind == ControlKind.STATE and (dtype != DType.FLOAT64 or ndim != 2 or h.shape[0] not in (2, 3)):
        raise WireError("STATE needs a float64 [2, N] or [3, N] payload")
    if kind in (ControlKind.SHUTDOWN, ControlKind.PING, ControlKind.PONG, ControlKind.FAIL) and dtype:
        raise WireError(f"{kind.name} carries no payload")
    if kind in _AUTH_BYTES and (dtype != DType.UINT8 or h.shape != (_AUTH_BYTES[kind],)):
        raise WireError(f"{kind.name} needs a uint8 [{_AUTH_BYTES[kind]}] payload")


# -- peer authentication -----------------------------------------------------------
# A connection is bound to the rank it claims before any of its frames count: the
# listener sends CHALLENGE (a fresh nonce), the connector answers AUTH with
# HMAC-SHA256(run secret, nonce | connector rank | listener rank). Without the run's
# secret a connection cannot claim a rank, and a recorded answer does not fit a new nonce.
NONCE_BYTES = 16
_AUTH_BYTES = {ControlKind.CHALLENGE: NONCE_BYTES, ControlKind.AUTH: 32}


def auth_mac(secret: bytes, nonce: bytes, src: int, dst: int) -> bytes:
    """What rank ``src`` answers to ``dst``'s ``nonce``."""
    return hmac.new(secret, b"htr-auth\0" + bytes(nonce) + struct.pack("<II", src, dst),
                    hashlib.sha256).digest()


def bytes_frame(kind: ControlKind, src: int, data: bytes) -> Frame:
    """A CHALLENGE or AUTH frame carrying ``data``."""
    return tensor_frame(Header(MsgType.CONTROL, kind=kind, src=src),
                        torch.frombuffer(bytearray(data), dtype=torch.uint8))


def encode_header(frame: Frame, max_payload: int = DEFAULT_MAX_PAYLOAD) -> bytes:
    """Header bytes of ``frame``; raises WireError for a frame no decoder would accept."""
    h = frame.header
    _validate(h, frame.pad_len, max_payload)
    if len(frame.payload) != h.payload_len:
        raise WireError(f"payload has {len(frame.payload)} bytes, header says {h.payload_len}")
    shape = tuple(h.shape) + (0,) * (MAX_DIMS - len(h.shape))
    try:
        return _STRUCT.pack(MAGIC, VERSION, *(getattr(h, f) for f in _FIELDS),
                            len(h.shape), len(h.ctx), 0, *shape,
                            h.payload_len, frame.pad_len) + struct.pack(f"<{len(h.ctx)}i", *h.ctx)
    except struct.error as e:
        raise WireError(f"field out of range: {e}") from None


def encode(frame: Frame, max_payload: int = DEFAULT_MAX_PAYLOAD) -> bytes:
    """The whole frame as one bytes object (tests, small frames); sockets use ``send_frame``."""
    return encode_header(frame, max_payload) + bytes(frame.payload) + bytes(frame.pad_len)


def decode_header(buf: bytes | bytearray | memoryview,
                  max_payload: int = DEFAULT_MAX_PAYLOAD) -> tuple[Header, int, int, int]:
    """(header without ctx, ctx_bytes, payload_len, pad_len) from the first
    HEADER_SIZE bytes of ``buf``; ``with_ctx`` completes the header."""
    if len(buf) < HEADER_SIZE:
        raise WireError("truncated header")
    vals = _STRUCT.unpack_from(buf)
    magic, version = vals[0], vals[1]
    if magic != MAGIC:
        raise WireError(f"bad magic {magic!r}")
    if version != VERSION:
        raise WireError(f"unsupported version {version}")
    k = 2 + len(_FIELDS)
    named = dict(zip(_FIELDS, vals[2:k]))
    ndim, n_ctx, reserved = vals[k:k + 3]
    shape_all = vals[k + 3:k + 3 + MAX_DIMS]
    payload_len, pad_len = vals[-2:]
    if reserved:
        raise WireError("reserved header byte must be zero")
    if ndim > MAX_DIMS or n_ctx > MAX_CTX:
        raise WireError("too many dims or context entries")
    if any(shape_all[ndim:]):
        raise WireError("unused shape slots must be zero")
    try:
        named["mtype"] = MsgType(named["mtype"])
        named["kind"] = ControlKind(named["kind"])
        named["dtype"] = DType(named["dtype"])
    except ValueError as e:
        raise WireError(f"unknown enum value: {e}") from None
    h = Header(shape=tuple(shape_all[:ndim]), **named)
    _validate(h, pad_len, max_payload)
    if payload_len != h.payload_len:
        raise WireError(f"payload_len {payload_len} does not match dtype/shape ({h.payload_len})")
    return h, 4 * n_ctx, payload_len, pad_len


def with_ctx(h: Header, ctx_bytes: bytes | bytearray | memoryview) -> Header:
    """The header completed with its context entries."""
    if not ctx_bytes:
        return h
    return replace(h, ctx=struct.unpack(f"<{len(ctx_bytes) // 4}i", ctx_bytes))


def decode(data: bytes | bytearray, max_payload: int = DEFAULT_MAX_PAYLOAD) -> Frame:
    """Exactly one frame from ``data`` (no trailing bytes allowed)."""
    dec = FrameDecoder(max_payload)
    frames = dec.feed(data)
    if len(frames) != 1 or dec.buffered:
        raise WireError(f"expected one whole frame, got {len(frames)} and {dec.buffered} extra bytes")
    return frames[0]


class FrameDecoder:
    """Incremental decoder for a byte stream (non-blocking sockets, selectors).

    Memory bound: the header is validated (including the payload limit) as soon
    as it is complete, so at rest the buffer never holds more than
    ``HEADER_SIZE + max_payload`` bytes plus what was handed to the last
    ``feed``. After the first ``WireError`` the decoder stays failed: the
    stream position is lost and the connection must be closed.
    """

    def __init__(self, max_payload: int = DEFAULT_MAX_PAYLOAD) -> None:
        if max_payload < 0:
            raise ValueError("max_payload must be >= 0")
        self.max_payload = max_payload
        self._buf = bytearray()
        self._pending: tuple[Header, int, int, int] | None = None
        self._failed: WireError | None = None

    @property
    def buffered(self) -> int:
        return len(self._buf)

    @property
    def mid_frame(self) -> bool:
        """True when EOF now would truncate a frame."""
        return bool(self._buf) or self._pending is not None

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        if self._failed is not None:
            raise self._failed
        self._buf += data
        out: list[Frame] = []
        buf = self._buf
        try:
            while True:
                if self._pending is None:
                    if len(buf) < HEADER_SIZE:
                        break
                    self._pending = decode_header(buf, self.max_payload)
                    del buf[:HEADER_SIZE]
                h, c, n, pad = self._pending
                if len(buf) < c + n + pad:
                    break
                h = with_ctx(h, buf[:c])
                payload = buf[c:c + n]
                if pad and any(buf[c + n:c + n + pad]):
                    raise WireError("padding bytes must be zero")
                del buf[:c + n + pad]
                self._pending = None
                out.append(Frame(h, payload, pad))
        except WireError as e:
            self._failed = e
            self._buf = bytearray()
            raise
        return out


# -- sockets ---------------------------------------------------------------------

def send_frame(sock: socket.socket, frame: Frame, max_payload: int = DEFAULT_MAX_PAYLOAD) -> int:
    """Write one frame (blocking); header and payload go out without concatenation."""
    bufs: list[memoryview] = [memoryview(encode_header(frame, max_payload))]
    if len(frame.payload):
        bufs.append(memoryview(frame.payload).cast("B"))
    if frame.pad_len:
        bufs.append(memoryview(bytes(frame.pad_len)))
    total = sum(len(b) for b in bufs)
    _sendmsg_all(sock, bufs)
    return total


def _sendmsg_all(sock: socket.socket, bufs: list[memoryview]) -> None:
    while bufs:
        sent = sock.sendmsg(bufs)
        while sent:
            if sent >= len(bufs[0]):
                sent -= len(bufs[0])
                bufs.pop(0)
            else:
                bufs[0] = bufs[0][sent:]
                sent = 0


def _recv_exact(sock: socket.socket, view: memoryview, allow_eof: bool) -> bool:
    """Fill ``view``; False on EOF before the first byte when ``allow_eof``."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            if got == 0 and allow_eof:
                return False
            raise WireError(f"connection closed mid-frame ({got}/{len(view)} bytes)")
        got += n
    return True


def recv_frame(sock: socket.socket, max_payload: int = DEFAULT_MAX_PAYLOAD) -> Frame | None:
    """Read one frame (blocking); None on a clean EOF between frames.

    The payload is received straight into the buffer the tensor will wrap,
    allocated only after the header passed validation.
    """
    head = bytearray(HEADER_SIZE)
    if not _recv_exact(sock, memoryview(head), allow_eof=True):
        return None
    h, c, n, pad = decode_header(head, max_payload)
    if c:
        ctx = bytearray(c)
        _recv_exact(sock, memoryview(ctx), allow_eof=False)
        h = with_ctx(h, ctx)
    body = bytearray(n + pad)
    _recv_exact(sock, memoryview(body), allow_eof=False)
    if pad:
        if any(memoryview(body)[n:]):
            raise WireError("padding bytes must be zero")
        del body[n:]
    return Frame(h, body, pad)


