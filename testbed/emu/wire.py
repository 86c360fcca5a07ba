"""Data-plane wire format between emulated workers: one typed message per frame.

Why a home-made format and not pickle: a worker reads frames from peers it does
not control (a crashed or buggy peer, a fuzzer), so decoding must be a pure
function of bytes that can only fail with ``WireError`` and never allocate more
than a configured limit. Every field is a named field of one message class,
packed by an explicit per-class layout, so each value is bounded and means
exactly what its name says.

Frame = envelope (``ENVELOPE_SIZE`` bytes, little-endian: magic, version, kind,
``meta_len``, ``payload_len``, ``pad_len``) + the message's fields (``meta_len``
bytes: its fixed fields, then its counted lists) + payload + padding.

- The envelope is checked first, payload limit included, so no meta or payload
  byte is buffered for a frame that is too large or of an unknown kind.
- Only the messages that carry a tensor (``Hidden``, ``Partial``, ``Token``) have a
  payload: one C-contiguous float tensor described by their ``dtype`` and ``shape``
  fields; ``payload_len == prod(shape) * itemsize`` is checked.
- ``pad_len`` zero bytes follow the payload and are dropped by the receiver. They
  let the emulator put a real model's hidden-state size on the wire (8 KiB for
  Mixtral) while computing on scaled-down experts.
- Decoding is canonical: an accepted frame re-encodes to exactly the bytes read
  (booleans are 0/1, floats finite, counts exact, unknown values rejected).

Server ranks are 16-bit; lists that have one entry per server (``State``) hold
at most ``MAX_SERVERS``; an assignment at most ``MAX_PICKS`` targets (the spec's
top-k limit), so nothing is clipped.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import socket
import struct
from dataclasses import KW_ONLY, dataclass, field, replace
from enum import IntEnum
from typing import Callable, NamedTuple, Union

import torch

from hetroute.state import Mode

MAGIC = b"HRTW"
#: a congestion-window wait longer than this is a sender's bug, not a window
MAX_HOLD_S = 3600.0
VERSION = 12  # 3: HIDDEN and PARTIAL carry their dispatch group; 4: FEEDBACK what was measured;
#: 5: HIDDEN, PARTIAL and TOKEN carry their congestion-window wait (``hold_s``); 6: HIDDEN
#: carries the router's delay estimate (``est_delay_us``); 7: CUSTODY; 8: HIDDEN, PARTIAL
#: and TOKEN carry how late their sender wrote them (``write_late_s``); 9: and when the
#: model's link finished sending them (``due_end_s``); 10: STATE and FEEDBACK carry both too;
#: 11: the K/V exchange of causal attention (KV_NOTICE, KV_ASK, KV_WHERE, KV_FETCH, KV_DATA);
#: 12: STATE names the requests finished at its sender since its last (``finished``)
MAX_DIMS = 4
MAX_PICKS = 256  # targets of one assignment: the spec's top-k bound
MAX_ROUTER_CTX = 1024  # int32 entries a router may carry with a token (Petals: one per layer)
MAX_SERVERS = 4096  # entries of a per-server list (STATE)
MAX_FINISHED = 4096  # requests one STATE names as finished (more wait for the next)
MAX_HELD = 4096  # (request, token) entries of one CUSTODY frame (more are sent as more frames)
#: positions one K/V message names (a prompt longer than this is not on any figure); a step's
#: KV_NOTICE entries (more go as more frames)
MAX_KV_POSITIONS = 8192
MAX_KV_ENTRIES = 4096
MAX_REASON = 255  # UTF-8 bytes of a FAIL reason
MAX_META = 0xFFFF  # bytes of a message's fields (its ``meta_len`` is 16-bit)
NONCE_BYTES = 16
MAC_BYTES = 32
#: Default payload limit: far above any scaled-down batch, far below memory.
DEFAULT_MAX_PAYLOAD = 16 * 2**20


class WireError(ValueError):
    """A malformed, truncated or oversized frame: close that connection only."""


class Kind(IntEnum):
    """The envelope's message kind; each value has exactly one message class."""

    HIDDEN = 1
    PARTIAL = 2
    TOKEN = 3
    STATE = 4
    FAIL = 5
    SHUTDOWN = 6
    PING = 7
    PONG = 8
    CHALLENGE = 9
    AUTH = 10
    FEEDBACK = 11
    CUSTODY = 12
    KV_NOTICE = 13
    KV_ASK = 14
    KV_WHERE = 15
    KV_FETCH = 16
    KV_DATA = 17


class DType(IntEnum):
    NONE = 0
    FLOAT16 = 1
    BFLOAT16 = 2
    FLOAT32 = 3


_TORCH_OF = {DType.FLOAT16: torch.float16, DType.BFLOAT16: torch.bfloat16,
             DType.FLOAT32: torch.float32}
_CODE_OF = {v: k for k, v in _TORCH_OF.items()}
_ITEMSIZE = {k: torch.empty(0, dtype=v).element_size() for k, v in _TORCH_OF.items()}


class Pick(NamedTuple):
    """One target of an assignment: the gated expert, the replica serving it, and how."""

    target: int  # global expert id (layer * E + j)
    replica: int  # index into the deployment's replicas
    mode: int  # hetroute.state.Mode


class Ran(NamedTuple):
    """One assignment position a participant computed, and on which tier."""

    position: int  # index into the HIDDEN frame's assignment
    on_gpu: bool


# -- messages ----------------------------------------------------------------------
# Every message names its sender (``src``): the transport drops a frame whose
# ``src`` is not the rank its connection proved. Model times are emulated seconds
# since the run started; PING/PONG times are the sender's monotonic clock.

@dataclass(frozen=True, slots=True)
class Hidden:
    """A token-layer's hidden state, sent by the residing server to every participant
    and to the aggregator, with the whole assignment so each can find its share."""

    src: int  # the residing server, which made the decision
    request: int
    token: int
    layer: int
    seq: int  # per-token dispatch number: grows with every layer and retry
    retries: int  # re-routings of this layer before this attempt (the third loss fails it)
    home: int  # the request's home server
    aggregator: int  # where the partials are summed and the token continues
    n_participants: int  # partials the aggregator waits for
    lam_acc: float  # the token's quality degradation before this layer
    t_layer: float  # model time the layer began at the residing server
    t_dispatch: float  # model time the decision was done and the state sent
    view_age_us: int  # age of the state view the decision used
    backlog_err_us: int  # view backlog minus true backlog where they differ most (signed)
    decision_us: int  # decision time, dispatch minus decision start
    assignment: tuple[Pick, ...]
    router_ctx: tuple[int, ...]  # the router's own context (TokenView.ctx) after deciding
    dtype: DType = DType.NONE
    shape: tuple[int, ...] = ()
    #: ``engine.dispatch: step``: frames a sender released together to this destination
    #: (one message in the simulator) share ``group``; the receiver takes them when all
    #: ``group_n`` are in, at the last one's arrival. 1: on its own
    group: int = 0
    group_n: int = 1
    #: ``net.transport: tcp``: emulated seconds the message waits for its sender's
    #: congestion window beyond line rate (``testbed/tcp.py``), added by the receiver's
    #: delay line (the kernel's own TCP sees no delay to grow its window over)
    hold_s: float = 0.0
    #: wall seconds the sender wrote the frame after the model time it was due (stamped by
    #: ``Transport`` at the write): the receiver's delay line starts at the due time, so the
    #: sender's own Python per hop is hidden where the link's dilated delay covers it
    write_late_s: float = 0.0
    #: the host's monotonic clock (wall s) at which the model's link finishes sending the
    #: frame (stamped by ``Transport`` at the write; 0: none): the receiver never hands it on
    #: before this plus the link's delay, however early its bytes came (a shaper's burst)
    due_end_s: float = 0.0
    #: the router's own estimate of the layer's delay in us (``Assignment.est_delay``; -1: it
    #: has none), for the aggregator's record: both backends' records carry ``est_delay_s``
    est_delay_us: int = -1


@dataclass(frozen=True, slots=True)
class Partial:
    """A participant's gate-weighted sum of its experts' outputs, to the aggregator."""

    src: int  # the participant
    request: int
    token: int
    layer: int
    seq: int  # the HIDDEN frame's seq
    t_arrived: float  # model time the hidden state arrived at the participant
    t_computed: float  # model time its last expert finished
    ran: tuple[Ran, ...]  # the assignment positions summed here
    dtype: DType = DType.NONE
    shape: tuple[int, ...] = ()
    #: ``engine.dispatch: step``: frames a sender released together to this destination
    #: (one message in the simulator) share ``group``; the receiver takes them when all
    #: ``group_n`` are in, at the last one's arrival. 1: on its own
    group: int = 0
    group_n: int = 1
    #: ``net.transport: tcp``: emulated seconds the message waits for its sender's
    #: congestion window beyond line rate (``testbed/tcp.py``), added by the receiver's
    #: delay line (the kernel's own TCP sees no delay to grow its window over)
    hold_s: float = 0.0
    #: wall seconds the sender wrote the frame after the model time it was due (stamped by
    #: ``Transport`` at the write): the receiver's delay line starts at the due time, so the
    #: sender's own Python per hop is hidden where the link's dilated delay covers it
    write_late_s: float = 0.0
    #: the host's monotonic clock (wall s) at which the model's link finishes sending the
    #: frame (stamped by ``Transport`` at the write; 0: none): the receiver never hands it on
    #: before this plus the link's delay, however early its bytes came (a shaper's burst)
    due_end_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Token:
    """A token handed to the server where it continues: the aggregator itself for the
    next layer (in process), or its home with the output when ``final``."""

    src: int
    request: int
    token: int
    layer: int  # the layer it enters next (n_layers when final)
    seq: int  # dispatch number of its last layer
    home: int
    lam_acc: float  # accumulated quality degradation
    final: bool  # all layers done; the payload is the output
    router_ctx: tuple[int, ...] = ()
    dtype: DType = DType.NONE
    shape: tuple[int, ...] = ()
    #: ``net.transport: tcp``: emulated seconds the message waits for its sender's
    #: congestion window beyond line rate (``testbed/tcp.py``), added by the receiver's
    #: delay line (the kernel's own TCP sees no delay to grow its window over)
    hold_s: float = 0.0
    #: wall seconds the sender wrote the frame after the model time it was due (stamped by
    #: ``Transport`` at the write): the receiver's delay line starts at the due time, so the
    #: sender's own Python per hop is hidden where the link's dilated delay covers it
    write_late_s: float = 0.0
    #: the host's monotonic clock (wall s) at which the model's link finishes sending the
    #: frame (stamped by ``Transport`` at the write; 0: none): the receiver never hands it on
    #: before this plus the link's delay, however early its bytes came (a shaper's burst)
    due_end_s: float = 0.0


@dataclass(frozen=True, slots=True)
class State:
    """The window broadcast: the sender's stream backlog, its view of who is alive,
    and how many frames it has received from each server (a cumulative
    acknowledgement; empty when not given)."""

    src: int
    window: int
    opened_at: float  # model time the window opened
    t_send: float  # model time of sending
    backlog_s: float  # the sender's stream backlog, model seconds
    alive: tuple[bool, ...]  # per server
    received: tuple[int, ...] = ()  # per server, or ()
    #: requests home at the sender that finished or failed since its last broadcast: their
    #: K/V leave the receiver's cache (``engine.kv_overflow: spill``; empty otherwise)
    finished: tuple[int, ...] = ()
    #: as a data frame's (``Hidden``): the broadcast is due at its tick's model instant and
    #: crosses its link behind the data frames sent before it, as the simulator's does
    write_late_s: float = 0.0
    due_end_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Feedback:
    """What the aggregator measured of a finished token-layer, to the server that routed it.
    That server kept its decision (the assignment, its view's age and error, its times), so
    with these it builds the same ``TokenLayerRecord`` the aggregator wrote, and its
    decider's ``on_layer_done`` gets the whole record, as the simulator hands each record to
    the decider that made the decision."""

    src: int  # the aggregator
    request: int
    token: int
    layer: int
    seq: int  # the HIDDEN frame's seq
    window: int  # scheduling window the layer completed in at the aggregator
    fan_out_end: float  # model time the last participant had the hidden state
    compute_end: float  # model time the last expert finished
    t_done: float  # model time the last partial reached the aggregator
    nbytes: int  # hidden-state bytes the layer moved
    participants: int
    gpus: tuple[bool, ...]  # per assignment position: ran on a GPU-resident copy
    #: as a data frame's (``Hidden``): due when the aggregator wrote the record
    write_late_s: float = 0.0
    due_end_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Fail:
    """A token cannot continue: tells its home (a peer that is not the home forwards it)."""

    src: int
    home: int
    request: int
    token: int
    reason: str  # at most MAX_REASON bytes of UTF-8 (``fail`` cuts longer ones)


class Held(NamedTuple):
    """A token whose hidden state a server holds (``Custody``)."""

    request: int
    token: int


@dataclass(frozen=True, slots=True)
class Custody:
    """Tokens of the receiver's requests that the sender holds at ``t_send`` (sent each
    window in runs that inject faults; a long list as several frames): a home fails the
    tokens whose last holder died, which nobody else knows of (``faults``)."""

    src: int
    t_send: float  # model time the list was taken
    held: tuple[Held, ...]


@dataclass(frozen=True, slots=True)
class Shutdown:
    src: int


@dataclass(frozen=True, slots=True)
class Ping:
    src: int
    seq: int
    t_send: float  # sender's monotonic clock


@dataclass(frozen=True, slots=True)
class Pong:
    """The reply to a PING (the pinger measures RTT on its own clock); a listener also
    sends one with seq 0 to accept an authenticated connection."""

    src: int
    seq: int  # the PING's seq
    t_ping: float  # the PING's t_send, echoed
    t_send: float = 0.0


@dataclass(frozen=True, slots=True)
class Challenge:
    """The listener's first frame on a connection: a fresh nonce."""

    src: int
    nonce: bytes


@dataclass(frozen=True, slots=True)
class Auth:
    """The connector's answer: ``auth_mac`` of the nonce and both ranks."""

    src: int
    mac: bytes



# -- causal attention's K/V exchange (``engine.attention: causal``, ``kv_news: home``;
# ``testbed/kv.py`` says the rule, ``node/kv.py`` runs it). Every message but KV_DATA is a
# control frame: stamped, behind the data on its link, as the simulator's ``_control``.

class KvPos(NamedTuple):
    """One position's K/V of one layer, computed by a KV_NOTICE's sender."""

    request: int
    layer: int
    position: int


class KvHolder(NamedTuple):
    """Where the home heard one position's K/V are (KV_WHERE)."""

    server: int
    position: int


@dataclass(frozen=True, slots=True)
class KvNotice:
    """To a request's home: the positions whose dense parts a step of the sender computed
    (one frame per step and home)."""

    src: int
    entries: tuple[KvPos, ...]
    write_late_s: float = 0.0
    due_end_s: float = 0.0


@dataclass(frozen=True, slots=True)
class KvAbout:
    """Which token's K/V exchange a message belongs to (not a wire message itself)."""

    src: int
    request: int
    token: int
    layer: int
    seq: int  # the waiting token's dispatch number (its attempt)
    _: KW_ONLY
    write_late_s: float = 0.0  # the transport's stamps (``Hidden`` says what they are)
    due_end_s: float = 0.0


@dataclass(frozen=True, slots=True)
class KvRequest(KvAbout):
    """Earlier positions' K/V of ``layer`` that token ``token`` at the sender needs (not a
    wire message itself: KV_ASK and KV_FETCH are)."""

    positions: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class KvAsk(KvRequest):
    """To the home: where are these positions' K/V, which the sender cannot see?"""


@dataclass(frozen=True, slots=True)
class KvWhere(KvAbout):
    """The home's answer to a KV_ASK, once it has heard of every position asked for."""

    holders: tuple[KvHolder, ...]


@dataclass(frozen=True, slots=True)
class KvFetch(KvRequest):
    """To a holder: send these positions' K/V (KV_DATA)."""


@dataclass(frozen=True, slots=True)
class KvData(KvAbout):
    """The K/V a KV_FETCH asked for: a data frame padded to their bytes (the emulator's
    scaled-down experts keep no real cache; the link carries the real model's size)."""

    positions: tuple[int, ...]
    dtype: DType = DType.NONE  # an empty FLOAT32 tensor: the bytes are the padding
    shape: tuple[int, ...] = ()
    hold_s: float = 0.0


Message = Union[Hidden, Partial, Token, State, Fail, Shutdown, Ping, Pong, Challenge, Auth,
                Feedback, Custody, KvNotice, KvAsk, KvWhere, KvFetch, KvData]
#: data frames: a tensor payload (KV_DATA's is empty, its bytes the padding), a link's FIFO
TENSOR_MESSAGES = (Hidden, Partial, Token, KvData)
KV_CONTROL = (KvNotice, KvAsk, KvWhere, KvFetch)
#: frames the transport stamps with ``write_late_s`` and ``due_end_s`` when sent with a due
#: time: the data frames, and the control frames the simulator sends over the links
#: (``net.control: links``), which queue behind the data on their link
STAMPED_MESSAGES = (*TENSOR_MESSAGES, State, Feedback, *KV_CONTROL)


@dataclass(frozen=True, slots=True)
class Frame:
    """A message and its payload bytes (``bytearray`` when decoded: writable, so
    ``tensor()`` wraps it without a copy)."""

    msg: Message
    payload: bytes | bytearray | memoryview = b""
    pad_len: int = 0
    #: the envelope and message bytes, where the sender encoded them ahead of the write
    #: (``sized_frame``, ``patched``): the transport writes them instead of encoding again
    head: bytes | None = field(default=None, compare=False, repr=False)

    def tensor(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The payload as a tensor; zero-copy on CPU when the buffer is writable."""
        m = self.msg
        if not isinstance(m, TENSOR_MESSAGES) or m.dtype == DType.NONE:
            raise WireError("frame has no payload tensor")
        buf = self.payload
        if isinstance(buf, bytes) or (isinstance(buf, memoryview) and buf.readonly):
            buf = bytearray(buf)
        if len(buf) == 0:
            t = torch.empty(m.shape, dtype=_TORCH_OF[m.dtype])
        else:
            t = torch.frombuffer(buf, dtype=_TORCH_OF[m.dtype]).view(m.shape)
        return t if device is None else t.to(device)

    def same_as(self, other: "Frame") -> bool:
        """Equality of message, payload bytes and padding (payload buffer types differ)."""
        return (self.msg == other.msg and bytes(self.payload) == bytes(other.payload)
                and self.pad_len == other.pad_len)


def payload_len(m: Message) -> int:
    """Payload bytes the message's dtype and shape announce (0 for the rest)."""
    if not isinstance(m, TENSOR_MESSAGES) or m.dtype == DType.NONE:
        return 0
    return _ITEMSIZE[m.dtype] * math.prod(m.shape)


# -- building frames -----------------------------------------------------------

def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Raw bytes of a tensor; no copy for a contiguous CPU tensor (any dtype, bf16 too)."""
    if t.device.type != "cpu":
        t = t.cpu()  # the one unavoidable copy of a device tensor
    t = t.contiguous()
    if t.dim() == 0:
        t = t.reshape(1)
    return memoryview(t.view(-1).view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


def tensor_frame(msg: Hidden | Partial | Token, t: torch.Tensor, pad_to: int = 0) -> Frame:
    """Frame carrying ``t``; ``pad_to`` pads the body with zeros up to that many bytes."""
    if t.dtype not in _CODE_OF:
        raise WireError(f"dtype {t.dtype} is not supported on the wire")
    if t.dim() > MAX_DIMS:
        raise WireError(f"tensor has {t.dim()} dims, at most {MAX_DIMS} go on the wire")
    code, shape = _CODE_OF[t.dtype], tuple(t.shape)
    m = msg if (msg.dtype == code and msg.shape == shape) else replace(msg, dtype=code, shape=shape)
    data = tensor_bytes(t) if t.numel() else memoryview(b"")
    return Frame(m, data, max(0, pad_to - len(data)))


def fail(src: int, home: int, request: int, token: int, reason: str) -> Fail:
    """A FAIL whose reason is cut, at a character boundary, to what fits."""
    raw = reason.encode("utf-8", "replace")[:MAX_REASON]
    return Fail(src, home, request, token, raw.decode("utf-8", "ignore"))


def pong_for(ping: Ping, src: int, t_send: float = 0.0) -> Pong:
    """The reply to a PING: echoes its ``seq`` and ``t_send``."""
    return Pong(src, ping.seq, ping.t_send, t_send)


# -- peer authentication -----------------------------------------------------------
# A connection is bound to the rank it claims before any of its frames count: the
# listener sends CHALLENGE (a fresh nonce), the connector answers AUTH with
# HMAC-SHA256(run secret, nonce | connector rank | listener rank), the listener
# accepts with a PONG. Without the run's secret a connection cannot claim a rank,
# and a recorded answer does not fit a new nonce.

def auth_mac(secret: bytes, nonce: bytes, src: int, dst: int) -> bytes:
    """What rank ``src`` answers to ``dst``'s ``nonce``."""
    return hmac.new(secret, b"htr-auth\0" + bytes(nonce) + struct.pack("<II", src, dst),
                    hashlib.sha256).digest()


# -- the codec -------------------------------------------------------------------
# Each message class has a fixed part (its scalar fields, in the order listed) and
# then its lists, each preceded by a count. ``_LISTS`` names the lists and how one
# item is packed; ``_check`` holds the rules struct cannot express.

_ENVELOPE_LAYOUT = (("magic", "4s"), ("version", "B"), ("kind", "B"), ("meta_len", "H"),
                    ("payload_len", "I"), ("pad_len", "I"))
_ENVELOPE = struct.Struct("<" + "".join(f for _, f in _ENVELOPE_LAYOUT))
ENVELOPE_SIZE = _ENVELOPE.size

_KIND_OF: dict[type, Kind] = {Hidden: Kind.HIDDEN, Partial: Kind.PARTIAL, Token: Kind.TOKEN,
                              State: Kind.STATE, Fail: Kind.FAIL, Shutdown: Kind.SHUTDOWN,
                              Ping: Kind.PING, Pong: Kind.PONG, Challenge: Kind.CHALLENGE,
                              Auth: Kind.AUTH, Feedback: Kind.FEEDBACK, Custody: Kind.CUSTODY,
                              KvNotice: Kind.KV_NOTICE, KvAsk: Kind.KV_ASK, KvWhere: Kind.KV_WHERE,
                              KvFetch: Kind.KV_FETCH, KvData: Kind.KV_DATA}
_CLASS_OF = {k: c for c, k in _KIND_OF.items()}

_REQ = (("request", "Q"), ("token", "I"), ("layer", "H"), ("seq", "Q"))
_SCALARS: dict[type, tuple[tuple[str, str], ...]] = {
    Hidden: (("src", "H"), *_REQ, ("retries", "B"), ("home", "H"), ("aggregator", "H"),
             ("n_participants", "H"), ("lam_acc", "d"), ("t_layer", "d"), ("t_dispatch", "d"),
             ("view_age_us", "q"), ("backlog_err_us", "q"), ("decision_us", "q"),
             ("est_delay_us", "q"), ("dtype", "B"), ("group", "I"), ("group_n", "H"), ("hold_s", "d"),
             ("write_late_s", "d"), ("due_end_s", "d")),
    Partial: (("src", "H"), *_REQ, ("t_arrived", "d"), ("t_computed", "d"), ("dtype", "B"),
              ("group", "I"), ("group_n", "H"), ("hold_s", "d"), ("write_late_s", "d"),
              ("due_end_s", "d")),
    Token: (("src", "H"), *_REQ, ("home", "H"), ("lam_acc", "d"), ("final", "B"), ("dtype", "B"),
            ("hold_s", "d"), ("write_late_s", "d"), ("due_end_s", "d")),
    State: (("src", "H"), ("window", "Q"), ("opened_at", "d"), ("t_send", "d"), ("backlog_s", "d"),
            ("write_late_s", "d"), ("due_end_s", "d")),
    Fail: (("src", "H"), ("home", "H"), ("request", "Q"), ("token", "I")),
    Custody: (("src", "H"), ("t_send", "d")),
    Shutdown: (("src", "H"),),
    Ping: (("src", "H"), ("seq", "Q"), ("t_send", "d")),
    Pong: (("src", "H"), ("seq", "Q"), ("t_ping", "d"), ("t_send", "d")),
    Challenge: (("src", "H"), ("nonce", f"{NONCE_BYTES}s")),
    Auth: (("src", "H"), ("mac", f"{MAC_BYTES}s")),
    Feedback: (("src", "H"), *_REQ, ("window", "Q"), ("fan_out_end", "d"), ("compute_end", "d"),
               ("t_done", "d"), ("nbytes", "Q"), ("participants", "H"), ("write_late_s", "d"),
               ("due_end_s", "d")),
    KvNotice: (("src", "H"), ("write_late_s", "d"), ("due_end_s", "d")),
    KvAsk: (("src", "H"), *_REQ, ("write_late_s", "d"), ("due_end_s", "d")),
    KvWhere: (("src", "H"), *_REQ, ("write_late_s", "d"), ("due_end_s", "d")),
    KvFetch: (("src", "H"), *_REQ, ("write_late_s", "d"), ("due_end_s", "d")),
    KvData: (("src", "H"), *_REQ, ("dtype", "B"), ("hold_s", "d"), ("write_late_s", "d"),
             ("due_end_s", "d")),
}
_STRUCTS = {c: struct.Struct("<" + "".join(f for _, f in lay)) for c, lay in _SCALARS.items()}


class _List(NamedTuple):
    name: str
    count: str  # struct code of the count
    item: str  # struct code of one item (several codes: a tuple item)
    limit: int
    make: Callable | None = None  # builds one decoded item from its unpacked values


_SHAPE = _List("shape", "B", "I", MAX_DIMS)
_CTX = _List("router_ctx", "H", "i", MAX_ROUTER_CTX)
_LISTS: dict[type, tuple[_List, ...]] = {
    Hidden: (_SHAPE, _List("assignment", "H", "IIB", MAX_PICKS, Pick), _CTX),
    Partial: (_SHAPE, _List("ran", "H", "HB", MAX_PICKS, Ran)),
    Token: (_SHAPE, _CTX),
    State: (_List("alive", "H", "B", MAX_SERVERS), _List("received", "H", "Q", MAX_SERVERS),
            _List("finished", "H", "Q", MAX_FINISHED)),
    Fail: (_List("reason", "B", "B", MAX_REASON),),
    Feedback: (_List("gpus", "H", "B", MAX_PICKS),),
    Custody: (_List("held", "H", "QI", MAX_HELD, Held),),
    KvNotice: (_List("entries", "H", "QHI", MAX_KV_ENTRIES, KvPos),),
    KvAsk: (_List("positions", "H", "I", MAX_KV_POSITIONS),),
    KvWhere: (_List("holders", "H", "HI", MAX_KV_POSITIONS, KvHolder),),
    KvFetch: (_List("positions", "H", "I", MAX_KV_POSITIONS),),
    KvData: (_SHAPE, _List("positions", "H", "I", MAX_KV_POSITIONS)),
}
_BOOL_SCALARS = {"final"}
_FLOAT_NAMES = {n for lay in _SCALARS.values() for n, f in lay if f == "d"}


def field_offset(cls: type | None, name: str) -> int:
    """Byte offset of an envelope field (``cls`` None) or of a message's fixed field in an
    encoded frame (tests patch frames with it)."""
    lay = _ENVELOPE_LAYOUT if cls is None else _SCALARS[cls]
    names = [n for n, _ in lay]
    base = 0 if cls is None else ENVELOPE_SIZE
    return base + struct.calcsize("<" + "".join(f for _, f in lay[:names.index(name)]))


def _check(m: Message) -> None:
    """Every rule a message must satisfy beyond its fields' struct ranges; applied
    on both ends, so the encoder refuses what a decoder would refuse."""
    for name in _FLOAT_NAMES:
        v = getattr(m, name, 0.0)
        if not math.isfinite(v):
            raise WireError(f"{name} is not finite")
    if getattr(m, "lam_acc", 0.0) < 0:
        raise WireError("lam_acc must be >= 0")
    if not 0.0 <= getattr(m, "hold_s", 0.0) <= MAX_HOLD_S:
        raise WireError(f"hold_s must be in [0, {MAX_HOLD_S:g}] s")
    if not 0.0 <= getattr(m, "write_late_s", 0.0) <= MAX_HOLD_S:
        raise WireError(f"write_late_s must be in [0, {MAX_HOLD_S:g}] s")
    due_end = getattr(m, "due_end_s", 0.0)
    if not (due_end >= 0.0 and math.isfinite(due_end)):
        raise WireError("due_end_s must be a finite time >= 0")
    if isinstance(m, TENSOR_MESSAGES):
        if m.dtype not in _TORCH_OF or not 1 <= len(m.shape) <= MAX_DIMS:
            raise WireError(f"{type(m).__name__} needs a float tensor payload of 1-{MAX_DIMS} dims")
    if isinstance(m, Hidden):
        if m.est_delay_us < -1:
            raise WireError("est_delay_us must be >= 0, or -1 for no estimate")
        if not m.assignment:
            raise WireError("an assignment needs at least one target")
        if not 1 <= m.n_participants <= len(m.assignment):
            raise WireError("n_participants out of range")
        for p in m.assignment:
            if p.mode not in Mode._value2member_map_:
                raise WireError(f"unknown mode {p.mode}")
    if isinstance(m, Partial):
        pos = [r.position for r in m.ran]
        if not pos or pos != sorted(set(pos)):
            raise WireError("ran must list distinct positions in increasing order")
    if isinstance(m, State) and m.received and len(m.received) != len(m.alive):
        raise WireError("received needs one entry per server, like alive")
    if isinstance(m, Fail) and len(m.reason.encode("utf-8")) > MAX_REASON:
        raise WireError(f"reason longer than {MAX_REASON} bytes")
    if isinstance(m, KvData) and math.prod(m.shape) != 0:
        raise WireError("KV_DATA carries no tensor: its K/V's bytes are its padding")
    if isinstance(m, (KvAsk, KvFetch, KvData)):
        if not m.positions or list(m.positions) != sorted(set(m.positions)):
            raise WireError("positions must list distinct positions in increasing order")
        if max(m.positions) >= m.token:
            raise WireError("a token's K/V messages name only earlier positions")
    if isinstance(m, KvWhere):
        pos = [h.position for h in m.holders]
        if not pos or pos != sorted(set(pos)) or pos[-1] >= m.token:
            raise WireError("holders must name distinct earlier positions in increasing order")
    if isinstance(m, KvNotice) and not m.entries:
        raise WireError("a KV_NOTICE names at least one position")
    if isinstance(m, Challenge) and len(m.nonce) != NONCE_BYTES:
        raise WireError(f"a nonce has {NONCE_BYTES} bytes")
    if isinstance(m, Auth) and len(m.mac) != MAC_BYTES:
        raise WireError(f"a MAC has {MAC_BYTES} bytes")


def _list_items(m: Message, spec: _List) -> list:
    v = getattr(m, spec.name)
    if spec.name == "reason":
        return list(v.encode("utf-8"))
    return list(v)


def _encode_meta(m: Message) -> bytes:
    cls = type(m)
    if cls not in _STRUCTS:
        raise WireError(f"{cls.__name__} is not a wire message")
    _check(m)
    out = bytearray()
    try:
        out += _STRUCTS[cls].pack(*(getattr(m, n) for n, _ in _SCALARS[cls]))
        for spec in _LISTS.get(cls, ()):
            items = _list_items(m, spec)
            if len(items) > spec.limit:
                raise WireError(f"{spec.name} has {len(items)} entries, at most {spec.limit}")
            out += struct.pack("<" + spec.count, len(items))
            fmt = "<" + spec.item
            for it in items:
                out += struct.pack(fmt, *it) if len(spec.item) > 1 else struct.pack(fmt, it)
    except struct.error as e:
        raise WireError(f"field out of range: {e}") from None
    if len(out) > MAX_META:
        raise WireError(f"message fields take {len(out)} bytes, at most {MAX_META}")
    return bytes(out)


def _decode_meta(kind: Kind, buf: bytes | bytearray | memoryview) -> Message:
    """The message in exactly ``buf``; WireError for anything a clean encoder never writes."""
    cls = _CLASS_OF[kind]
    st = _STRUCTS[cls]
    if len(buf) < st.size:
        raise WireError(f"{kind.name} fields truncated")
    vals = dict(zip((n for n, _ in _SCALARS[cls]), st.unpack_from(buf)))
    off = st.size
    for name in _BOOL_SCALARS & vals.keys():
        if vals[name] > 1:
            raise WireError(f"{name} must be 0 or 1")
        vals[name] = bool(vals[name])
    if "dtype" in vals:
        try:
            vals["dtype"] = DType(vals["dtype"])
        except ValueError:
            raise WireError(f"unknown dtype {vals['dtype']}") from None
    for spec in _LISTS.get(cls, ()):
        cs = struct.calcsize("<" + spec.count)
        if len(buf) < off + cs:
            raise WireError(f"{kind.name} fields truncated")
        (n,), off = struct.unpack_from("<" + spec.count, buf, off), off + cs
        if n > spec.limit:
            raise WireError(f"{spec.name} has {n} entries, at most {spec.limit}")
        item = struct.Struct("<" + spec.item)
        if len(buf) < off + n * item.size:
            raise WireError(f"{kind.name} fields truncated")
        raw = [item.unpack_from(buf, off + i * item.size) for i in range(n)]
        off += n * item.size
        vals[spec.name] = _decoded_list(spec, raw)
    if off != len(buf):
        raise WireError(f"{len(buf) - off} bytes after the {kind.name} fields")
    m = cls(**vals)
    _check(m)
    return m


def _decoded_list(spec: _List, raw: list[tuple]) -> object:
    if spec.name == "reason":
        try:
            return bytes(v for (v,) in raw).decode("utf-8")
        except UnicodeDecodeError:
            raise WireError("reason is not UTF-8") from None
    if spec.name in ("alive", "gpus") or spec.make is Ran:
        for r in raw:
            if r[-1] > 1:
                raise WireError(f"{spec.name} flags must be 0 or 1")
    if spec.name in ("alive", "gpus"):
        return tuple(bool(v) for (v,) in raw)
    if spec.make is Ran:
        return tuple(Ran(p, bool(g)) for p, g in raw)
    if spec.make is not None:
        return tuple(spec.make(*r) for r in raw)
    return tuple(v for (v,) in raw)


def encode_header(frame: Frame, max_payload: int = DEFAULT_MAX_PAYLOAD) -> bytes:
    """Envelope and message bytes of ``frame`` (all but payload and padding); raises
    WireError for a frame no decoder would accept."""
    return _header(frame, _encode_meta(frame.msg), max_payload)


def _header(frame: Frame, meta: bytes, max_payload: int) -> bytes:
    m = frame.msg
    n = payload_len(m)
    if len(frame.payload) != n:
        raise WireError(f"payload has {len(frame.payload)} bytes, the message says {n}")
    if frame.pad_len and not isinstance(m, TENSOR_MESSAGES):
        raise WireError(f"{type(m).__name__} carries no payload or padding")
    if n + frame.pad_len > max_payload:
        raise WireError(f"body of {n + frame.pad_len} bytes exceeds the limit of {max_payload}")
    try:
        env = _ENVELOPE.pack(MAGIC, VERSION, _KIND_OF[type(m)], len(meta), n, frame.pad_len)
    except struct.error as e:
        raise WireError(f"field out of range: {e}") from None
    return env + meta


def sized_frame(msg: Hidden | Partial | Token, t: torch.Tensor, total: int,
                max_payload: int = DEFAULT_MAX_PAYLOAD) -> Frame:
    """``t`` framed so that the whole frame on the wire (envelope, message fields, payload,
    padding) is ``total`` bytes (no padding where it is longer already), its head encoded
    once and kept: a sender builds it ahead of the write (``patched`` for per-destination
    fields), since encoding took tens of microseconds per frame on the hop's path."""
    f = tensor_frame(msg, t)
    meta = _encode_meta(f.msg)
    f = Frame(f.msg, f.payload, max(0, total - ENVELOPE_SIZE - len(meta) - len(f.payload)))
    return Frame(f.msg, f.payload, f.pad_len, _header(f, meta, max_payload))


def _field_structs(cls: type) -> dict[str, tuple[int, struct.Struct]]:
    return {name: (field_offset(cls, name), struct.Struct("<" + code))
            for name, code in _SCALARS[cls]}


_FIELD_AT = {cls: _field_structs(cls) for cls in STAMPED_MESSAGES}


def patched(frame: Frame, **fields) -> Frame:
    """``frame`` with some of its message's fixed fields changed (a dispatch group's count
    per destination, a congestion-window wait); a prepared head is patched where those
    fields lie instead of encoded again. The same rules as ``encode_header`` apply."""
    m = replace(frame.msg, **fields)
    if frame.head is None:
        return Frame(m, frame.payload, frame.pad_len)
    _check(m)
    head = bytearray(frame.head)
    at = _FIELD_AT[type(m)]
    try:
        for name, v in fields.items():
            off, st = at[name]
            st.pack_into(head, off, v)
    except struct.error as e:
        raise WireError(f"field out of range: {e}") from None
    return Frame(m, frame.payload, frame.pad_len, bytes(head))


def write_late_field(cls: type) -> tuple[int, struct.Struct]:
    """Where a stamped message's ``write_late_s`` lies in its encoded frame, and its struct:
    the transport stamps it into a prepared head at the write."""
    return _FIELD_AT[cls]["write_late_s"]


def due_end_field(cls: type) -> tuple[int, struct.Struct]:
    """Where a stamped message's ``due_end_s`` lies in its encoded frame, and its struct."""
    return _FIELD_AT[cls]["due_end_s"]


def warm_codec(d: int, total: int, rounds: int = 200) -> int:
    """Build, patch, encode and decode ``rounds`` frames of each tensor message as a worker
    sends them (``d`` floats framed to ``total`` bytes); returns the bytes decoded. A
    worker's first frames cost several times its later ones (the interpreter's and torch's
    first calls): a worker's first dispatch of a 36-token prompt took 8-15 ms of wall
    time to build where later ones took 2-3 ms (T = 32, asym5). Workers run this before
    the run starts, as they warm the router and the kernels."""
    x = torch.zeros(d)
    msgs = (Hidden(0, 0, 0, 0, 0, 0, 0, 0, 1, 0.0, 0.0, 0.0, 0, 0, 0, (Pick(0, 0, 0), Pick(1, 1, 0)),
                   (), dtype=DType.FLOAT32, shape=(d,)),
            Partial(0, 0, 0, 0, 0, 0.0, 0.0, (Ran(0, True),), dtype=DType.FLOAT32, shape=(d,)),
            Token(0, 0, 0, 0, 0, 0, 0.0, True, (), dtype=DType.FLOAT32, shape=(d,)))
    dec, n = FrameDecoder(), 0
    for i in range(rounds):
        for m in msgs:
            f = sized_frame(m, x, total)
            f = patched(f, group=i, group_n=2) if not isinstance(m, Token) else f
            f = patched(f, hold_s=1e-6)
            for got in dec.feed(b"".join((f.head, f.payload, bytes(f.pad_len)))):
                n += len(got.tensor().clone()) * 4
    return n


def encode(frame: Frame, max_payload: int = DEFAULT_MAX_PAYLOAD) -> bytes:
    """The whole frame as one bytes object (tests, small frames); sockets use ``send_frame``."""
    return encode_header(frame, max_payload) + bytes(frame.payload) + bytes(frame.pad_len)


class _Envelope(NamedTuple):
    kind: Kind
    meta_len: int
    payload_len: int
    pad_len: int


def decode_envelope(buf: bytes | bytearray | memoryview,
                    max_payload: int = DEFAULT_MAX_PAYLOAD) -> _Envelope:
    """The envelope in the first ENVELOPE_SIZE bytes of ``buf``, with the payload limit
    enforced before anything after it is buffered."""
    if len(buf) < ENVELOPE_SIZE:
        raise WireError("truncated envelope")
    magic, version, kind, meta_len, n, pad = _ENVELOPE.unpack_from(buf)
    if magic != MAGIC:
        raise WireError(f"bad magic {magic!r}")
    if version != VERSION:
        raise WireError(f"unsupported version {version}")
    try:
        kind = Kind(kind)
    except ValueError:
        raise WireError(f"unknown message kind {kind}") from None
    if n + pad > max_payload:
        raise WireError(f"body of {n + pad} bytes exceeds the limit of {max_payload}")
    if (n or pad) and _CLASS_OF[kind] not in TENSOR_MESSAGES:
        raise WireError(f"{kind.name} carries no payload or padding")
    return _Envelope(kind, meta_len, n, pad)


def decode_message(env: _Envelope, meta: bytes | bytearray | memoryview) -> Message:
    """The message of ``env`` from its ``meta_len`` field bytes, checked against the envelope."""
    m = _decode_meta(env.kind, meta)
    if payload_len(m) != env.payload_len:
        raise WireError(f"payload_len {env.payload_len} does not match dtype/shape ({payload_len(m)})")
    return m


def decode(data: bytes | bytearray, max_payload: int = DEFAULT_MAX_PAYLOAD) -> Frame:
    """Exactly one frame from ``data`` (no trailing bytes allowed)."""
    dec = FrameDecoder(max_payload)
    frames = dec.feed(data)
    if len(frames) != 1 or dec.buffered:
        raise WireError(f"expected one whole frame, got {len(frames)} and {dec.buffered} extra bytes")
    return frames[0]


class FrameDecoder:
    """Incremental decoder for a byte stream (non-blocking sockets, selectors).

    Memory bound: the envelope is validated (including the payload limit) as soon
    as it is complete and the message as soon as its fields are, so at rest the
    buffer never holds more than ``max(MAX_META, max_payload)`` bytes plus what
    was handed to the last ``feed``. After the first ``WireError`` the decoder
    stays failed: the stream position is lost and the connection must be closed.
    """

    def __init__(self, max_payload: int = DEFAULT_MAX_PAYLOAD) -> None:
        if max_payload < 0:
            raise ValueError("max_payload must be >= 0")
        self.max_payload = max_payload
        self._buf = bytearray()
        self._env: _Envelope | None = None
        self._msg: Message | None = None
        self._failed: WireError | None = None

    @property
    def buffered(self) -> int:
        return len(self._buf)

    @property
    def mid_frame(self) -> bool:
        """True when EOF now would truncate a frame."""
        return bool(self._buf) or self._env is not None

    @property
    def need(self) -> int:
        """Bytes still missing before the next frame, or the next envelope, is complete
        (at least 1): a reader that takes just these learns when each frame's last byte came
        (the emulator's stamped reads, ``transport._StampedConnection``)."""
        env = self._env
        if env is None:
            return max(1, ENVELOPE_SIZE - len(self._buf))
        rest = env.payload_len + env.pad_len + (env.meta_len if self._msg is None else 0)
        return max(1, rest - len(self._buf))

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        if self._failed is not None:
            raise self._failed
        self._buf += data
        out: list[Frame] = []
        buf = self._buf
        try:
            while True:
                if self._env is None:
                    if len(buf) < ENVELOPE_SIZE:
                        break
                    self._env = decode_envelope(buf, self.max_payload)
                    del buf[:ENVELOPE_SIZE]
                env = self._env
                if self._msg is None:
                    if len(buf) < env.meta_len:
                        break
                    self._msg = decode_message(env, bytes(buf[:env.meta_len]))
                    del buf[:env.meta_len]
                n, pad = env.payload_len, env.pad_len
                if len(buf) < n + pad:
                    break
                payload = buf[:n]
                if pad and any(buf[n:n + pad]):
                    raise WireError("padding bytes must be zero")
                del buf[:n + pad]
                out.append(Frame(self._msg, payload, pad))
                self._env = self._msg = None
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
    allocated only after the envelope and the message passed validation.
    """
    head = bytearray(ENVELOPE_SIZE)
    if not _recv_exact(sock, memoryview(head), allow_eof=True):
        return None
    env = decode_envelope(head, max_payload)
    meta = bytearray(env.meta_len)
    _recv_exact(sock, memoryview(meta), allow_eof=False)
    msg = decode_message(env, meta)
    n, pad = env.payload_len, env.pad_len
    body = bytearray(n + pad)
    _recv_exact(sock, memoryview(body), allow_eof=False)
    if pad:
        if any(memoryview(body)[n:]):
            raise WireError("padding bytes must be zero")
        del body[n:]
    return Frame(msg, body, pad)

