"""The worst few of a worker's lateness samples, and when each happened.

A worker reports its lateness (a step's release, a frame's write, a frame handed on after
the model's instant) as quantiles over the run. Their maxima are stalls of the worker's
loop (20-145 ms of wall time in some runs, a few per run, where the p99 is 1-4 ms), and a
stall matters by when it falls: before the instant a run's schedule first parts from its
simulated twin's (``analysis first-fork``), or after it. ``Worst`` keeps the ``k`` largest
samples with the wall instant each was taken at, at one comparison per sample; the worker
reports them in model milliseconds since its start.
"""

from __future__ import annotations

import heapq


class Worst:
    """The ``k`` largest (value, wall instant) samples added."""

    def __init__(self, k: int = 5) -> None:
        if k < 1:
            raise ValueError(f"Worst keeps at least one sample, got k={k}")
        self.k = k
        self._heap: list[tuple[float, float]] = []

    def add(self, value: float, at: float) -> None:
        if len(self._heap) < self.k:
            heapq.heappush(self._heap, (value, at))
        elif value > self._heap[0][0]:
            heapq.heapreplace(self._heap, (value, at))

    def report(self, t0: float, T: float) -> list[list[float]]:
        """Largest first: [wall ms late, model ms since ``t0``] each, for a worker whose
        model time runs T times slower than the wall from wall instant ``t0``."""
        return [[round(v * 1e3, 3), round((at - t0) / T * 1e3, 3)]
                for v, at in sorted(self._heap, reverse=True)]
