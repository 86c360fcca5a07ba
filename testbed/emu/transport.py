"""Frames between workers over TCP, with the receive-side delay line.

Each worker listens on one port on all its addresses and opens one connection
to every peer, at the peer's address on their direct link, so a message to a
peer crosses exactly that shaped link. Outgoing connections send, incoming
ones receive.

Peers are authenticated before any frame counts: the listener opens with a
CHALLENGE (a fresh nonce), the connector answers AUTH with the HMAC of the
nonce and both ranks under the run's secret (``wire.auth_mac``), the listener
also checks that the connection comes from that rank's address on the link,
and accepts with a PONG; only then does the connector send. A connection that fails any of this is closed and counted
(``auth_failures``) and touches no peer's state; after it, a frame whose
``src`` is not the connection's rank is dropped (``spoofed_frames``).

Delay ("transport" mechanism, used when the kernel has no netem): a frame is
handed to the worker at the time its last byte arrived plus the dilated
one-way delay of the link it came over, which is the simulator's rule
(transmission, then propagation). TCP's own ACKs are not delayed, so the
kernel's window dynamics see no round trip; under ``net.transport: tcp`` the
sender models its window (``testbed/tcp.py``, as the simulator does) and each
data frame carries the wait (``hold_s``), which this line adds. With netem the
delay is in the kernel and this line adds nothing.

A data frame's line starts at the time it was due, not at its arrival, where the
delay covers the difference (``emu.late_writes: absorbed``): the sender stamps
how much later the frame's bytes leave its shaped link than the model's
departure (``write_late_s``), and this line takes that from the link's delay.
The lateness is the sender's own Python per hop (dispatch 1.2-2.8 ms and
partials 0.6-1.7 ms of wall time at the median per worker, fastbehindslow4,
HetRoute, 40 req/s, T = 64); started at the arrival, 20-45 us (emulated) per hop
of it made the emulated run behave as the simulator does under 100 us of mean
per-hop jitter (README, "Emulator against simulator"). The departures are
modeled on two FIFO clocks per outgoing link (``_depart``): the model's (the
simulator's line-rate link, advanced by modeled frames from their model send
times) and the real link's (every byte written, from its write, at the shaped
rate). A frame written late onto a link that is still busy with earlier frames
leaves no later than it would have anyway, so only the difference of the two
starts is late: stamped from the write alone (commit 885b7ee), such frames were
handed on early by up to their write lateness.

The line also never hands a data frame on before the model would have it: the sender
stamps the instant its model link finishes sending the frame (``due_end_s``, host
monotonic time, which every Mininet host shares), and the line holds the frame to that
instant plus the link's delay (``early_held``). Without it a shaper's burst let frames
through early: an HTB class passes its bucket (1 ms of traffic, ``hosts/topo.htb_params``)
at once after an idle spell, so a lone hidden state's bytes arrived up to 1 ms of wall time
before the rate allows, and the emulated fan-outs ran 27-37 us (model, T = 32) ahead of the
simulator's at their 10 % quantile on most links of asym5 (HetRoute, 10 req/s, 24 seeds,
``python -m analysis first-fork``).

A frame arrives when the kernel received its last bytes, not when the worker read them
(``emu.arrivals: kernel``, since 2026-12-03): incoming connections are read with
``recvmsg`` and ``SO_TIMESTAMPNS`` (``_StampedConnection``), each read up to the end of
the next frame, so its stamp (that of the newest segment read) is the arrival of the frame
it completes. Read when the loop got to them, frames that came while
the worker was busy elsewhere (a step's padding, a decision) were late by that wait, which
is the host's Python and no part of the link; ``read_wait_ms_*`` per worker says how long.

Each connection's socket buffers are set large (``emu.socket_buffer_bytes``, 8 MiB by
default, since 2026-12-03): the receiver's on the listening socket before it listens
(accepted connections inherit it and the window scale it implies), the sender's before it
connects. The kernel's own start, an 87 kB receive buffer that grows only as the
application reads, holds at most about 2 ms of wall time of asym5's fastest shaped link
(312 Mbit/s at T = 32). While a receiving worker is busy longer than that (a kernel, a
decision, a collection; on 2 cores kernels reach 3-9 ms of wall time at p99), its window
closes and the bytes its peers send meanwhile reach its kernel, and their arrival stamps,
only when it reads again (``tests/test_emu_buffers.py``: 200 ms busy, the last of 4 MB
stamped 205 ms after the send began, against 3 ms with 8 MiB). That lateness is the host's
and no stamp absorbs it; it shows in ``after_model_ms_*`` (asym5's HetRoute at 10 req/s,
seed 12 run twice back to back: max 100.6 ms of wall time with the kernel's buffers, 10.4
with 8 MiB). ``0`` keeps the kernel's autotuned buffers.

Malformed, truncated or oversized frames close that connection only
(``WireError``); the worker keeps serving everyone else.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hmac
import os
import selectors
import socket
import struct
import time
from collections import deque
from typing import Callable, Iterator

from .wire import (DEFAULT_MAX_PAYLOAD, MAX_HOLD_S, NONCE_BYTES, STAMPED_MESSAGES, TENSOR_MESSAGES, Auth, Challenge,
                   Frame, FrameDecoder, KvData, Pong, WireError, auth_mac, due_end_field, encode_header,
                   write_late_field)
from ..acks import AckLine
from ..tcp import MSS_BYTES
from .worst import Worst

OnFrame = Callable[[Frame, float], None]  # (frame, arrival monotonic time)


def precise_loop() -> asyncio.AbstractEventLoop:
    """An event loop whose timers fire with microsecond, not millisecond, granularity.

    The default selector (epoll) rounds timeouts up to whole milliseconds;
    select(2) takes microseconds. The timer slack of the process is cut to
    1 us too (the kernel's default 50 us would add to every delayed delivery).
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(29, 1000, 0, 0, 0)  # PR_SET_TIMERSLACK, nanoseconds
    except (OSError, AttributeError):
        pass
    return asyncio.SelectorEventLoop(selectors.SelectSelector())


_ZEROS = bytes(1 << 16)


def _zeros(n: int) -> bytes | memoryview:
    """``n`` zero bytes (padding) without allocating them each time."""
    return memoryview(_ZEROS)[:n] if n <= len(_ZEROS) else bytes(n)


SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)  # Linux <asm-generic/socket.h>
#: past ``net.core.[rw]mem_max`` (CAP_NET_ADMIN, which the emulator's root has); Linux values
SO_SNDBUFFORCE = getattr(socket, "SO_SNDBUFFORCE", 32)
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)

_STAMP = struct.Struct("@qq")  # struct timespec
_ANC = socket.CMSG_SPACE(_STAMP.size)
_READ = 1 << 18  # bytes per read, at most
_READS_PER_PASS = 64  # reads per readable callback before the loop serves the others


def set_socket_buffer(sock: socket.socket, receive: bool, size: int) -> int:
    """Set ``sock``'s receive (else send) buffer to ``size`` bytes, forced past the
    system's maximum where the process may; returns what the kernel reports (it doubles
    the request for its own bookkeeping)."""
    opt, force = ((socket.SO_RCVBUF, SO_RCVBUFFORCE) if receive
                  else (socket.SO_SNDBUF, SO_SNDBUFFORCE))
    try:
        sock.setsockopt(socket.SOL_SOCKET, force, size)
    except OSError:  # not privileged: capped at net.core.[rw]mem_max
        sock.setsockopt(socket.SOL_SOCKET, opt, size)
    return sock.getsockopt(socket.SOL_SOCKET, opt)


class _StampedConnection:
    """An accepted connection read with ``recvmsg``, so each read carries the kernel's
    receive time of the newest bytes in it (``SO_TIMESTAMPNS``; TCP reports its last
    segment's, Linux >= 4.14). asyncio's transports read with ``recv`` and drop it, and the
    time a read happens is later by however long the worker's loop was busy elsewhere
    (a step's padding, a routing decision): that wait is the loop's, not the link's.

    Just what ``_Inbound`` uses of a transport: ``write`` (a CHALLENGE or a PONG, buffered
    if the socket will not take it at once), ``close``, ``is_closing``, ``get_extra_info``;
    the protocol's ``connection_lost`` follows a close or an end of stream, once."""

    def __init__(self, sock: socket.socket, proto: "_Inbound", kernel_stamps: bool) -> None:
        self.sock, self.proto = sock, proto
        self.loop = asyncio.get_running_loop()
        self._closing = False
        self._out = bytearray()
        sock.setblocking(False)
        self.stamped = False
        if kernel_stamps:
            try:
                sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
                self.stamped = True
            except OSError:
                pass
        self._peer = sock.getpeername()
        self.loop.add_reader(sock.fileno(), self._readable)
        proto.connection_made(self)

    def get_extra_info(self, name: str, default=None):
        return self._peer if name == "peername" else default

    def is_closing(self) -> bool:
        return self._closing

    def write(self, data) -> None:
        if self._closing:
            return
        if not self._out:
            try:
                n = self.sock.send(data)
            except BlockingIOError:
                n = 0
            except OSError as err:
                self._lost(err)
                return
            data = memoryview(data)[n:]
            if not len(data):
                return
            self.loop.add_writer(self.sock.fileno(), self._writable)
        self._out += data

    def _writable(self) -> None:
        try:
            n = self.sock.send(self._out)
        except BlockingIOError:
            return
        except OSError as err:
            self._lost(err)
            return
        del self._out[:n]
        if not self._out:
            self.loop.remove_writer(self.sock.fileno())

    def _readable(self) -> None:
        """Read up to the end of the next frame at a time (``FrameDecoder.need``): the stamp
        is the newest segment's of the read, so a read that ran past a frame's end would date
        the frame by bytes that came after it. Several reads per call, so a burst of frames
        costs one loop pass."""
        for _ in range(_READS_PER_PASS):
            want = self.proto.decoder.need if self.stamped else _READ
            try:
                data, anc, _, _ = self.sock.recvmsg(min(want, _READ), _ANC if self.stamped else 0)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:
                self._lost(err)
                return
            if not data:
                self._lost(None)
                return
            now = time.monotonic()
            arrival = now
            for level, kind, raw in anc:
                if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(raw) >= _STAMP.size:
                    sec, ns = _STAMP.unpack_from(raw)
                    # the stamp is CLOCK_REALTIME: carried over to the monotonic clock here
                    arrival = min(now, sec + ns * 1e-9 - (time.time() - now))
            self.proto.data_received(data, arrival, now)
            if self._closing or len(data) < want:
                return

    def close(self) -> None:
        self._lost(None)

    def _lost(self, exc) -> None:
        if self._closing:
            return
        self._closing = True
        fd = self.sock.fileno()
        if fd >= 0:
            self.loop.remove_reader(fd)
            self.loop.remove_writer(fd)
        self.sock.close()
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is left to tell
            self.loop.call_soon(self.proto.connection_lost, exc)


class _Inbound(asyncio.Protocol):
    def __init__(self, owner: "Transport") -> None:
        self.owner = owner
        self.decoder = FrameDecoder(owner.max_payload)
        self.src: int | None = None  # set once the peer has proved its rank
        self.nonce = os.urandom(NONCE_BYTES)
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport
        self.owner._write(transport, Frame(Challenge(self.owner.rank, self.nonce)))

    def _refuse(self, why: str) -> None:
        self.owner.auth_failures += 1
        peer = self.transport.get_extra_info("peername") if self.transport else None
        self.owner.log(f"refused a connection from {peer}: {why}")
        if self.transport is not None:
            self.transport.close()

    def _authenticate(self, f: Frame) -> bool:
        m, o = f.msg, self.owner
        if not isinstance(m, Auth):
            self._refuse("first frame is not AUTH")
            return False
        claimed = m.src
        if claimed == o.rank or claimed not in o.peers:
            self._refuse(f"claims rank {claimed}, not a peer")
            return False
        if not hmac.compare_digest(m.mac, auth_mac(o.secret, self.nonce, claimed, o.rank)):
            self._refuse(f"wrong AUTH for rank {claimed}")
            return False
        peer = self.transport.get_extra_info("peername") if self.transport else None
        expected = o.peers[claimed][0]
        if o.check_source and (peer is None or peer[0] != expected):
            self._refuse(f"rank {claimed} must connect from {expected}, not {peer}")
            return False
        self.src = claimed
        assert self.transport is not None
        self.owner._write(self.transport, Frame(Pong(o.rank, 0, 0.0)))  # accepted
        return True

    def data_received(self, data: bytes, arrival: float | None = None,
                      read: float | None = None) -> None:
        """``arrival``: when the kernel received the newest of these bytes (monotonic s);
        ``read``: when the loop read them. Without a stamp both are now."""
        if arrival is None:
            arrival = read = time.monotonic()
        assert read is not None
        if self.src is not None:
            self.owner.read_waits.append(read - arrival)
        try:
            frames = self.decoder.feed(data)
        except WireError as err:
            if self.src is None:
                self._refuse(f"malformed frame before authentication ({err})")
                return
            self.owner.wire_errors += 1
            self.owner.log(f"closing connection from {self.src}: {err}")
            assert self.transport is not None
            self.transport.close()
            return
        for f in frames:
            if self.src is None:
                if not self._authenticate(f):
                    return
                continue
            if f.msg.src != self.src:  # a proven peer speaking for another: dropped
                self.owner.spoofed_frames += 1
                continue
            self.owner.deliver(f, self.src, arrival)

    def connection_lost(self, exc) -> None:  # type: ignore[override]
        if self.src is not None:
            self.owner.peer_lost(self.src, "inbound connection closed")


class Transport:
    """One worker's connections; ``send`` queues a frame, ``on_frame`` receives."""

    def __init__(self, rank: int, port: int, peers: dict[int, tuple[str, int]],
                 delays_in: list[float], on_frame: OnFrame, on_peer_lost: Callable[[int, str], None],
                 secret: bytes, log: Callable[[str], None] = lambda s: None,
                 max_payload: int = DEFAULT_MAX_PAYLOAD, check_source: bool = True,
                 hold_scale: float = 0.0, absorb_late: bool = True,
                 link_s_per_byte: dict[int, float] | None = None,
                 kernel_stamps: bool = True, socket_buffer: int = 0,
                 control_bytes: int = 64, ack_s_per_frame: dict[int, float] | None = None,
                 data_frame_bytes: int = 0,
                 on_heard: Callable[[int, float], None] | None = None) -> None:
        if len(secret) < 16:
            raise ValueError("the run secret must have at least 16 bytes")
        self.rank, self.port, self.peers = rank, port, peers
        self.secret, self.check_source = secret, check_source
        self.delays_in = delays_in  # seconds, per source server
        #: wall seconds per emulated second of a frame's ``hold_s`` (its congestion-window
        #: wait, ``net.transport: tcp``): T with the transport delay line, else 0
        self.hold_scale = hold_scale
        #: ``emu.late_writes: absorbed``: a data frame's delay line starts when it was due
        self.absorb_late = absorb_late
        #: ``emu.arrivals: kernel``: a frame arrives when the kernel received its last bytes
        #: (``_StampedConnection``), not when the loop got round to reading them
        self.kernel_stamps = kernel_stamps
        #: ``emu.socket_buffer_bytes``: each connection's send and receive buffer (0: the
        #: kernel's autotuned ones); ``buffers`` what the kernel reports having set
        self.socket_buffer = socket_buffer
        self.buffers: dict[str, int] = {}
        #: the bytes of a STATE or FEEDBACK frame on the model's link (``sim.header_bytes``,
        #: the simulator's control frame) whatever its encoding takes on the real one
        self.control_bytes = control_bytes
        #: per read of a proven peer's bytes, wall s from the kernel's receipt to the read
        #: (0 when unstamped): the loop's own wait, which a kernel stamp keeps off the link
        self.read_waits: list[float] = []
        self._listener: socket.socket | None = None
        #: wall seconds a byte takes on each outgoing shaped link (T / (B x payload
        #: efficiency)); a destination without one is modeled as infinitely fast
        self.link_s_per_byte = link_s_per_byte or {}
        #: per destination, when the model's link and the real one are next free (wall s)
        self._model_free: dict[int, float] = {}
        #: ``net.ack_every``: wall seconds of ACKs the model's link to a peer carries per data
        #: frame received from it, and the ACK blocks waiting to take it (testbed/acks.py)
        self.ack_s_per_frame = ack_s_per_frame or {}
        self._acks: dict[int, AckLine] = {p: AckLine() for p in self.ack_s_per_frame}
        #: the wire bytes of the hidden-state frame those ACKs are per: a KV_DATA frame's
        #: are scaled by its own bytes (the simulator's ACKs go by bytes)
        self.data_frame_bytes = data_frame_bytes
        self._real_free: dict[int, float] = {}
        self.on_frame, self._on_peer_lost, self.log = on_frame, on_peer_lost, log
        #: ``on_heard(src, arrival)`` for every frame as its bytes arrive, before the delay
        #: line: a peer is heard when its bytes come, though a frame of it may then wait
        #: behind its data (a STATE behind a message held for its congestion window)
        self.on_heard = on_heard
        self.max_payload = max_payload
        self.out: dict[int, asyncio.Transport] = {}
        self.lost: set[int] = set()
        self.wire_errors = 0
        self.auth_failures = 0  # connections refused before they proved a rank
        self.spoofed_frames = 0  # frames a proven peer sent in another's name (dropped)
        self.sent_bytes = 0
        #: bytes written per destination (head, payload, padding), against which the link
        #: table sets what tc counted on that link (``wire_ratio``: headers, ACKs)
        self.sent_bytes_to: dict[int, int] = {p: 0 for p in peers}
        self.writes_to: dict[int, int] = {p: 0 for p in peers}  # system calls per destination
        self.segments_to: dict[int, int] = {p: 0 for p in peers}  # their full and short segments
        self.sent_frames: dict[int, int] = {p: 0 for p in peers}  # per destination
        self.received_frames: dict[int, int] = {p: 0 for p in peers}  # per proven source
        self.frames_in = 0
        self.late_deliveries = 0.0  # summed lateness of delayed deliveries (s)
        #: how late (s) each data frame this worker sent with a due time left its link
        self.late_written: list[float] = []
        self.worst_written = Worst()  # the largest write lateness, with their instants
        #: summed over them: that lateness less the frame's write lateness (what 885b7ee
        #: stamped): negative where the model's link was still busy, positive where the real
        #: one carried an earlier frame's lateness
        self.late_vs_write = 0.0
        #: received data frames' stamped lateness (s), summed: hidden by the delay line, and not
        self.late_absorbed = 0.0
        self.late_exposed = 0.0
        self.data_frames_in = 0
        #: received data frames held past their old due time because they came before the
        #: model's link had finished sending them (``due_end_s``): how many, and for how long
        #: in all (wall s). An HTB class lets its bucket's burst (1 ms of traffic,
        #: ``hosts/topo.htb_params``) through at once after an idle spell, so a lone frame's
        #: bytes come up to 1 ms of wall time before the rate would have them
        self.early_held = 0
        self.early_held_s = 0.0
        #: the others, per frame: wall s after the model's instant that the line hands it on
        #: (its bytes came late beyond what its stamp absorbed)
        self.after_model: list[float] = []
        self.worst_after_model = Worst()
        #: corked writes, in order: (dst, bytes, due, modeled, head, fields' (offset, struct))
        self._stamps: list[tuple] = []
        self._corked = 0  # depth of ``corked`` blocks
        #: per source, frames waiting for their due time, in the order they arrived
        self._due_queue: dict[int, deque] = {}
        self._pending: dict[asyncio.Transport, list] = {}  # what they hold, per connection

    async def start(self, deadline_s: float = 30.0) -> None:
        loop = asyncio.get_running_loop()
        lsock = self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if self.socket_buffer:  # before listen: accepted connections inherit it and its scale
            self.buffers["rcvbuf"] = set_socket_buffer(lsock, True, self.socket_buffer)
        lsock.bind(("0.0.0.0", self.port))
        lsock.listen(64)
        lsock.setblocking(False)
        loop.add_reader(lsock.fileno(), self._accept)
        t_end = time.monotonic() + deadline_s
        for peer, (host, port) in self.peers.items():
            while True:
                try:
                    tr, proto = await self._connect(peer, host, port)
                    break
                except OSError:
                    if time.monotonic() > t_end:
                        raise RuntimeError(f"worker {self.rank}: cannot reach peer {peer} at {host}:{port}")
                    await asyncio.sleep(0.05)
            try:  # the peer's CHALLENGE answered before anything is sent
                await asyncio.wait_for(proto.ready, max(1.0, t_end - time.monotonic()))
            except (asyncio.TimeoutError, ConnectionError) as err:
                raise RuntimeError(f"worker {self.rank}: no handshake with peer {peer} at "
                                   f"{host}:{port} ({err or 'timed out'})") from None
            self.out[peer] = tr

    def _write(self, tr: asyncio.Transport, frame: Frame, dst: int = -1, due: float | None = None,
               modeled: bool = True) -> int:
        """One write per frame, or none while corked: an asyncio transport makes a system
        call per ``write`` while its buffer is empty, and a frame used to take three.
        ``dst`` -1: a handshake frame, on no modeled link.
        ``due``: the wall time a data frame should have left; how late it leaves is stamped
        into its head (``write_late_s``) when it is written, at the corked block's end."""
        head = frame.head  # prepared by the sender (``sized_frame``), or encoded here
        if head is None or len(frame.payload) + frame.pad_len > self.max_payload:
            head = encode_header(frame, self.max_payload)
        nbytes = len(head) + len(frame.payload) + frame.pad_len
        off = None
        model_bytes = nbytes
        if due is not None and isinstance(frame.msg, STAMPED_MESSAGES):
            head = bytearray(head)
            off = (write_late_field(type(frame.msg)), due_end_field(type(frame.msg)))
            if not isinstance(frame.msg, TENSOR_MESSAGES):  # control: behind the data only
                modeled, model_bytes = False, self.control_bytes
        else:
            due = None
        if self._corked:
            self._stamps.append((dst, nbytes, due, modeled, head, off, model_bytes))
        else:
            self._depart(time.monotonic(), dst, nbytes, due, modeled, head, off, model_bytes)
        parts = [head]
        if len(frame.payload):
            parts.append(frame.payload)
        if frame.pad_len:
            parts.append(_zeros(frame.pad_len))
        if self._corked:
            self._pending.setdefault(tr, []).extend(parts)
        else:
            self._count_write(dst, nbytes)
            tr.write(b"".join(parts))
        return nbytes

    def _count_write(self, dst: int, nbytes: int) -> None:
        """A system call's bytes to ``dst``: its segments, had it left alone on an idle
        connection (what the link table sets against tc's packets, ``wire_accounting``)."""
        if dst >= 0:
            self.writes_to[dst] = self.writes_to.get(dst, 0) + 1
            self.segments_to[dst] = self.segments_to.get(dst, 0) + -(-nbytes // MSS_BYTES)

    def _depart(self, now: float, dst: int, nbytes: int, due: float | None, modeled: bool,
                head, off, model_bytes: int | None = None) -> None:
        """A frame of ``nbytes`` written to ``dst`` at ``now``: its start on the real link
        (behind what was written before it, at the shaped rate) against its start on the
        model's (its due time, behind the modeled frames before it); the difference is
        stamped into a data frame's head as ``write_late_s``, and the model's end of sending
        it as ``due_end_s``. ``off``: the two fields' (offset, struct). Frames the simulator does not
        send (``modeled=False``) take real link time only; a stamped control frame (STATE,
        FEEDBACK: ``modeled=False`` and ``model_bytes``, the simulator's header) is stamped
        behind the modeled frames before it without holding up later ones, as the
        simulator's ``send_control``; an unstamped one (no ``due``) takes real time only."""
        spb = self.link_s_per_byte.get(dst)
        tx = nbytes * spb if spb else 0.0
        free = self._real_free.get(dst, 0.0)
        start = free if free > now else now
        if spb:
            self._real_free[dst] = start + tx
        if due is None:
            return
        model = due
        if model_bytes is not None and model_bytes != nbytes and spb:
            tx = model_bytes * spb
        if spb:
            mfree = self._model_free.get(dst, 0.0)
            acks = self._acks.get(dst)
            if acks is not None and acks.q:  # the peer's data's ACKs sent by then
                mfree = self._model_free[dst] = acks.absorb(mfree, model)
            if mfree > model:
                model = mfree
            if modeled:
                self._model_free[dst] = model + tx
        late = self._late(start, model, dst)
        self.late_vs_write += late - (now - due if now > due else 0.0)
        (lo, ls), (eo, es) = off
        ls.pack_into(head, lo, late)
        es.pack_into(head, eo, model + tx)  # the model's link is done with it

    @property
    def is_corked(self) -> bool:
        return self._corked > 0

    @contextlib.contextmanager
    def corked(self) -> Iterator[None]:
        """Frames sent inside go out when the outermost block ends, one write per peer: what
        a step releases (its partials, its tokens' dispatch group) leaves together, as the
        simulator's one message per destination, without a system call per frame on the
        hop's path (about 0.1 ms of wall time each, measured on the emulated hosts)."""
        self._corked += 1
        try:
            yield
        finally:
            self._corked -= 1
            if not self._corked:
                self._flush()

    def _flush(self) -> None:
        """Each destination's frames in one write, stamped just before it: stamped once for
        all before the first write, a later destination's frames left by the earlier
        writes' time later than their stamps said."""
        stamps, self._stamps = self._stamps, []
        pending, self._pending = self._pending, {}
        by_dst: dict[int, list] = {}
        for st in stamps:
            by_dst.setdefault(st[0], []).append(st)
        for tr, parts in pending.items():
            dst = next((d for d in by_dst if self.out.get(d) is tr), None)
            now = time.monotonic()
            for st in by_dst.pop(dst, ()):
                self._depart(now, *st)
            if not tr.is_closing():
                data = b"".join(parts)
                if dst is not None:
                    self._count_write(dst, len(data))
                tr.write(data)
        now = time.monotonic()
        for rest in by_dst.values():  # a closed connection's: counted as the others
            for st in rest:
                self._depart(now, *st)

    def _late(self, now: float, due: float, dst: int = -1) -> float:
        late = min(MAX_HOLD_S, max(0.0, now - due))
        self.late_written.append(late)
        self.worst_written.add(late, now, dst)
        return late

    def send(self, dst: int, frame: Frame, due: float | None = None, modeled: bool = True) -> bool:
        """Queue ``frame`` for ``dst``; False if that peer is known to be gone. Frames to
        ``dst`` are numbered 1, 2, ... in ``sent_frames``; the peer's ``received_frames``
        counts the same frames, so its count acknowledges them (a cut link drops what
        was queued after the peer's last acknowledgement without an error). ``due``: the
        wall time a data frame should leave (its model send time), for ``write_late_s``;
        ``modeled=False``: a frame the simulator does not send (it occupies the real link
        only)."""
        tr = self.out.get(dst)
        if tr is None or dst in self.lost or tr.is_closing():
            return False
        nbytes = self._write(tr, frame, dst, due, modeled)
        self.sent_bytes += nbytes
        self.sent_bytes_to[dst] = self.sent_bytes_to.get(dst, 0) + nbytes
        self.sent_frames[dst] = self.sent_frames.get(dst, 0) + 1
        return True

    def deliver(self, frame: Frame, src: int, arrival: float) -> None:
        """Hand ``frame`` on after its link's delay and its congestion-window wait. A data
        frame (hidden state, partial, token) never goes before one that ``src`` sent ahead
        of it, as on the simulator's link, where a message queues behind the earlier ones.
        Each frame's due time is its own arrival plus its delay (less how late it left
        its link, ``emu.late_writes: absorbed``, as far as the delay covers it), and an
        arrival carries the hosts' wall-time noise, so a frame could fall due before a group sent ahead of it:
        on asym5's Prism at 80 req/s (T = 127) a one-token frame overtook the 16-frame group
        it queued behind on the simulator (7 us after it there, 10 us before it here), and
        server 2's first step took the wrong layer. Control frames keep their own delay, as
        the simulator's control messages do (``net.control: links``): a stamped one (STATE,
        FEEDBACK sent with a due time) takes this line like a data frame, behind the data
        frames sent ahead of it."""
        self.frames_in += 1
        self.received_frames[src] = self.received_frames.get(src, 0) + 1
        if self.on_heard is not None:
            self.on_heard(src, arrival)
        d = self.delays_in[src]
        if self.hold_scale:
            d += getattr(frame.msg, "hold_s", 0.0) * self.hold_scale
        loop = asyncio.get_running_loop()
        stamped = getattr(frame.msg, "due_end_s", 0.0) > 0.0
        if not stamped and not isinstance(frame.msg, TENSOR_MESSAGES):
            if d <= 0:
                self.on_frame(frame, arrival)
            else:
                loop.call_at(arrival + d, self._due_one, frame, arrival + d)
            return
        # the line starts when the frame was due, as far as the delay covers its lateness
        if isinstance(frame.msg, TENSOR_MESSAGES):
            self.data_frames_in += 1
        late = frame.msg.write_late_s
        hidden = min(late, d) if self.absorb_late and d > 0 else 0.0
        self.late_absorbed += hidden
        self.late_exposed += late - hidden
        # never before the model's instant: its link's end of sending it plus the delay
        floor = frame.msg.due_end_s + d if frame.msg.due_end_s > 0.0 else 0.0
        if floor and isinstance(frame.msg, TENSOR_MESSAGES) and src in self._acks:
            ack = self.ack_s_per_frame[src]  # its ACKs, in the model
            if isinstance(frame.msg, KvData) and self.data_frame_bytes:  # by its bytes
                ack *= (len(encode_header(frame, self.max_payload)) + frame.pad_len) / self.data_frame_bytes
            self._acks[src].add(floor, ack)
        d -= hidden
        due = arrival + max(0.0, d)
        if floor > due:
            self.early_held += 1
            self.early_held_s += floor - due
            due = floor
        elif floor:  # handed on after the model's instant: how much (wall s)
            self.after_model.append(due - floor)
            self.worst_after_model.add(due - floor, due, src)
        queue = self._due_queue.get(src)
        if due <= arrival and not queue:
            self.on_frame(frame, arrival)
            return
        if queue is None:
            queue = self._due_queue[src] = deque()
        if queue:  # behind what this peer sent before it
            queue.append((max(due, queue[-1][0]), frame))
            return
        queue.append((due, frame))
        loop.call_at(due, self._due, src)

    def _due_one(self, frame: Frame, due: float) -> None:
        self.late_deliveries += max(0.0, time.monotonic() - due)
        self.on_frame(frame, due)

    def _due(self, src: int) -> None:
        """The head of ``src``'s data queue is due: hand it on, then every later frame
        already due (in order), and wake again for the next."""
        queue = self._due_queue[src]
        while queue:
            due, frame = queue[0]
            now = time.monotonic()
            if due > now:
                asyncio.get_running_loop().call_at(due, self._due, src)
                return
            queue.popleft()
            self.late_deliveries += max(0.0, now - due)
            try:
                self.on_frame(frame, due)
            except Exception as err:  # one frame's failure must not hold up the frames behind it
                self.log(f"handing on a frame from {src} failed: {err!r}")

    def peer_lost(self, peer: int, why: str) -> None:
        if peer not in self.lost:
            self.lost.add(peer)
            self._on_peer_lost(peer, why)

    def _accept(self) -> None:
        assert self._listener is not None
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as err:
            self.log(f"accept failed: {err!r}")
            return
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _StampedConnection(sock, _Inbound(self), self.kernel_stamps)  # the loop's reader keeps it

    async def _connect(self, peer: int, host: str, port: int):
        """A connection to ``peer`` whose send buffer is set before it connects."""
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            if self.socket_buffer:
                self.buffers["sndbuf"] = set_socket_buffer(sock, False, self.socket_buffer)
            await loop.sock_connect(sock, (host, port))
            return await loop.create_connection(lambda: _Outbound(self, peer), sock=sock)
        except BaseException:
            sock.close()
            raise

    def close(self) -> None:
        for tr in self.out.values():
            tr.close()
        if self._listener is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._listener.fileno())
            self._listener.close()
            self._listener = None


class _Outbound(asyncio.Protocol):
    """Sends; reads only the listener's CHALLENGE, answers it, and waits for its PONG."""

    def __init__(self, owner: Transport, peer: int) -> None:
        self.owner, self.peer = owner, peer
        self.decoder = FrameDecoder(owner.max_payload)
        self.ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self.answered = False  # AUTH sent; the listener's PONG accepts it
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.ready.done():
            return  # nothing else is expected from a listener
        try:
            frames = self.decoder.feed(data)
        except WireError as err:
            self.ready.set_exception(ConnectionError(f"bad CHALLENGE: {err}"))
            return
        for f in frames:
            if not self.answered:
                if not isinstance(f.msg, Challenge):
                    self.ready.set_exception(ConnectionError("first frame is not CHALLENGE"))
                    return
                mac = auth_mac(self.owner.secret, f.msg.nonce, self.owner.rank, self.peer)
                assert self.transport is not None
                self.owner._write(self.transport, Frame(Auth(self.owner.rank, mac)))
                self.answered = True
            elif isinstance(f.msg, Pong):  # the listener accepted us
                self.ready.set_result(True)
                return
            else:
                self.ready.set_exception(ConnectionError("no acceptance after AUTH"))
                return

    def connection_lost(self, exc) -> None:  # type: ignore[override]
        if not self.ready.done():
            self.ready.set_exception(ConnectionError(f"closed before the handshake ({exc})"))
        elif not self.ready.cancelled() and self.ready.exception() is None:  # was a live peer
            self.owner.peer_lost(self.peer, f"outbound connection closed ({exc})")
