"""The worst few of a worker's lateness samples, and when each happened.

A worker reports its lateness (a step's release, a frame's write, a frame handed on after
the model's instant) as quantiles over the run. Their maxima are stalls of the worker's
loop (20-145 ms of wall time in some runs, a few per run, where the p99 is 1-4 ms), and a
stall matters by when it falls: before the instant a run's schedule first parts from its
simulated twin's (``analysis first-fork``), or after it. ``Worst`` keeps the ``k`` largest
samples with the wall instant each was taken at, at one comparison per sample; the worker
reports them in model milliseconds since its start, and, for a frame's lateness, the peer it
went to or came from (which link a late frame took: fastbehindslow4's HetRoute at 80 req/s
had one frame into its fast server 1233 ms of wall time after the model's instant, the next
57 ms, and the report could not say from where).
"""

from __future__ import annotations

import heapq


class Worst:
    """The ``k`` largest (value, wall instant, peer) samples added (peer -1: none)."""

    def __init__(self, k: int = 5) -> None:
        if k < 1:
            raise ValueError(f"Worst keeps at least one sample, got k={k}")
        self.k = k
        self._heap: list[tuple[float, float, int]] = []

    def add(self, value: float, at: float, peer: int = -1) -> None:
        if len(self._heap) < self.k:
            heapq.heappush(self._heap, (value, at, peer))
        elif value > self._heap[0][0]:
            heapq.heapreplace(self._heap, (value, at, peer))

    def report(self, t0: float, T: float) -> list[list[float]]:
        """Largest first: [wall ms late, model ms since ``t0``] each, for a worker whose
        model time runs T times slower than the wall from wall instant ``t0``, and the peer's
        rank third where one was given."""
        return [[round(v * 1e3, 3), round((at - t0) / T * 1e3, 3), *([peer] if peer >= 0 else [])]
                for v, at, peer in sorted(self._heap, reverse=True)]
