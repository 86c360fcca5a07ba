"""K/V cache past a server's room lives in host memory (``engine.kv_overflow: spill``).

Without this rule (``none``, every figure's) a server's K/V cache grows past what its GPU
memory leaves it and the run only says so (``testbed/kv_memory.py``). Under ``spill`` the
world holds each server's cache to its room, (1 - ``memory.gpu_share``) x G_n, as
offloading caches do (Hugging Face transformers' ``OffloadedCache``; vLLM's CPU offloading
connector): the K/V that do not fit sit in host memory, and a step whose attention reads
them first copies them in over PCIe, at the achieved fraction of the link that loads use
(``hetroute.service.PCIE_EFFICIENCY``). A decode step cannot hide that copy behind its
little compute (vLLM-Ascend's design note on layerwise KV offloading says as much), so the
copy is serial in the step, like a CPU-resident expert's load under ``load_overlap:
serial``.

Which K/V spill: first come, first served, as a serving engine preempts its newest
requests first (vLLM's scheduler). A server's requests are ranked by arrival; the room
goes to the oldest, and the request at the boundary spills the share of its K/V that does
not fit. A step reads, for each request in it, its positions of that layer (the step
rule's K/V read) and copies in the request's spilled share of them.

What a server holds is ``kv_memory``'s reading of the run's world: the positions whose
dense part ran there, added when the step that computes them starts, and under causal
attention (``engine.attention: causal``) also the earlier positions' K/V it fetched, added
when they arrive; all freed when the request finishes or fails (the backend calls
``free``): at the request's home at once, on every other server when the home's next window
broadcast reaches it (the emulator's STATE frame names the requests finished since the last
one; the simulator sends the same over its control links, or frees everywhere at once under
``net.control: instant``). Left out: copying the step's new positions of a spilled
request out (one position per layer and token in a decode step; the opposite direction of
a full-duplex link), the host memory's own size, and the copy engine's queue (the copy
runs in the stream, not behind a prefetch). Measured where the room binds, the rule moves
a run's mean by 0.2% or less (README, "GPU memory for experts").
"""

from __future__ import annotations

from bisect import insort

from hetroute.service import PCIE_EFFICIENCY
from hetroute.system import Cluster, MoEShape


class KvSpill:
    """One server's K/V cache against its room, in positions (token-layers)."""

    __slots__ = ("room", "kv_bytes", "copy_s", "held", "total", "freed", "_order", "_spilled",
                 "copied_positions", "copied_s", "spill_steps", "peak", "written")

    def __init__(self, room_bytes: float, kv_bytes: float, host_bytes_per_s: float) -> None:
        if kv_bytes <= 0 or host_bytes_per_s <= 0:
            raise ValueError("KvSpill needs positive K/V bytes per position and host bandwidth")
        self.room = room_bytes / kv_bytes  # positions the room holds
        self.kv_bytes = kv_bytes
        self.copy_s = kv_bytes / host_bytes_per_s  # seconds to copy one position in
        self.held: dict[int, int] = {}  # request -> positions held here
        self.total = 0
        self.freed: set[int] = set()  # requests finished or failed: a late step adds nothing
        self._order: list[tuple[float, int]] = []  # (arrival, request), oldest first
        self._spilled: dict[int, float] | None = {}  # request -> spilled share; None: stale
        self.copied_positions = 0.0  # positions copied in from host memory over the run
        self.copied_s = 0.0  # stream seconds those copies took
        self.spill_steps = 0  # steps that copied any
        self.peak = 0  # most positions held at once
        self.written = 0  # positions ever written here (own and fetched copies)

    def copy_in_s(self, reads: dict[int, int]) -> float:
        """Seconds to copy in the spilled share of what a step reads: ``reads`` is request ->
        positions its attention reads in the step. 0 while the cache fits its room."""
        if self.total <= self.room:
            return 0.0
        shares = self._spilled
        if shares is None:
            shares = self._spilled = self._shares()
        positions = 0.0
        for r, n in reads.items():
            f = shares.get(r)
            if f:
                positions += f * n
        if positions <= 0.0:
            return 0.0
        s = positions * self.copy_s
        self.copied_positions += positions
        self.copied_s += s
        self.spill_steps += 1
        return s

    def _shares(self) -> dict[int, float]:
        """Each request's spilled share of its K/V here: oldest first into the room."""
        out: dict[int, float] = {}
        before, room, held = 0, self.room, self.held
        for _, r in self._order:
            h = held[r]
            over = before + h - room
            if over > 0:
                out[r] = min(1.0, over / h)
            before += h
        return out

    def write(self, request: int, arrival: float, positions: int = 1) -> None:
        """A step computes ``positions`` of ``request``'s K/V here (its dense part ran here)."""
        if request in self.freed:
            return
        h = self.held.get(request)
        if h is None:
            insort(self._order, (arrival, request))
            h = 0
        self.held[request] = h + positions
        self.total += positions
        self.written += positions
        if self.total > self.peak:
            self.peak = self.total
        self._spilled = None

    def free(self, request: int) -> None:
        """The request finished or failed: its K/V leave this server."""
        self.freed.add(request)
        h = self.held.pop(request, None)
        if h is None:
            return
        self.total -= h
        self._order.remove(next(x for x in self._order if x[1] == request))
        self._spilled = None


def room_bytes(gpu_bytes: float, gpu_share: float) -> float:
    """A server's room for K/V cache and activations, (1 - gpu_share) x G_n: the one rule
    the ledgers here and the records' reading (``kv_memory.kv_room``) both hold to."""
    return gpu_bytes * (1.0 - gpu_share)


def server_room(cluster: Cluster, shape: MoEShape, gpu_share: float, n: int) -> KvSpill:
    """Server n's K/V ledger against its room, with its host link at the achieved fraction
    loads get: what both backends' step schedulers hold the cache to."""
    return KvSpill(room_bytes(cluster.gpu_bytes[n], gpu_share), shape.kv_bytes_per_token,
                   cluster.pcie[n] * PCIE_EFFICIENCY)


def spill_stats(rooms: list[KvSpill]) -> dict:
    """A run's (or a worker's) spill counters, summed over servers: positions written to
    the ledgers, the largest ledger (MB; the records' ``kv_peak_mb`` reads the same cache
    from their times), steps that copied spilled K/V in, the bytes and stream seconds they
    copied, the servers that spilled."""
    return {"kv_written": sum(k.written for k in rooms),
            "kv_ledger_peak_mb": round(max((k.peak * k.kv_bytes for k in rooms), default=0) / 1e6, 3),
            "kv_spill_steps": sum(k.spill_steps for k in rooms),
            "kv_spill_bytes": int(round(sum(k.copied_positions * k.kv_bytes for k in rooms))),
            "kv_spill_s": sum(k.copied_s for k in rooms),
            "kv_spill_servers": sum(1 for k in rooms if k.spill_steps)}
