"""The ACKs a link carries for the opposite direction's data, shared by both backends.

Each directed server pair is one TCP connection (the emulator's workers hold one per
peer), so the data n sends to m is acknowledged by pure ACKs on the link m -> n, where they
queue with m's own data. The rate model (``msg / (B x payload efficiency)``) charges
every data segment its 66 header bytes but no link charged the ACKs: on the emulator's
fastbehindslow4 Prism run at 40 req/s (2026-12-06) tc counted 8.3% more bytes than the
workers wrote, 66.1 bytes of headers per packet, and 40,049 packets beyond the 54,412
segments of the writes, 0.74 per segment (README, "ACKs on the reverse link").

The rule (``net.ack_every``, hardware world): one 66-byte ACK (Ethernet 14, IPv4 20, TCP
with timestamps 32) per ``ack_every`` segments of ``mss`` payload bytes, as a fluid share of
each message's bytes, so a message split over frames (the emulator) and one sent whole
(the simulator) leave the same ACK bytes. Two is RFC 5681 Sec. 4.2's "at least every
second full-sized segment" and RFC 1122 Sec. 4.2.3.2's delayed ACK, what a Linux receiver
does in steady state. Left out: Linux's quick-ACK mode (an ACK per segment for up to 16
segments after the connection idled for a retransmission timeout, 200 ms or more; the
emulator dilates that timeout on its routes, ``testbed/emu/hosts/topo.py``), the short
last segment's own ACK, control frames' ACKs, and a receiver's GRO, which on a physical
NIC coalesces segments and ACKs less often. The ACKs of a message leave the receiver when it has arrived
(its last byte plus the link's delay) as one block on the reverse link, which a message
sent there later queues behind (``AckLine``); they do not delay data already queued.
"""

from __future__ import annotations

from bisect import insort
from collections import deque

#: bytes of a pure ACK on the link: Ethernet 14 + IPv4 20 + TCP 20 + timestamps option 12
ACK_WIRE_BYTES = 66


def ack_bytes_per_byte(mss_bytes: int, ack_every: int) -> float:
    """ACK bytes on the reverse link per payload byte of data (0 if ACKs are not modeled)."""
    return ACK_WIRE_BYTES / (mss_bytes * ack_every) if ack_every > 0 else 0.0


class AckLine:
    """ACK blocks waiting to take one link: (instant they leave, seconds they occupy it),
    in the order they leave. A data message sent on the link at ``t`` first lets every
    block that left by ``t`` through (``absorb``), as a FIFO link would."""

    __slots__ = ("q",)

    def __init__(self) -> None:
        self.q: deque[tuple[float, float]] = deque()

    def add(self, t: float, seconds: float) -> None:
        q = self.q
        if not q or q[-1][0] <= t:
            q.append((t, seconds))
        else:  # rare: an arrival earlier than the last (the emulator's window holds)
            insort(q, (t, seconds))

    def absorb(self, free: float, t: float) -> float:
        """The link's next free instant for a message queued at ``t``, given ``free``
        before the ACK blocks that left by then took it."""
        q = self.q
        while q and q[0][0] <= t:
            ta, s = q.popleft()
            free = (free if free > ta else ta) + s
        return free

    def __len__(self) -> int:
        return len(self.q)
