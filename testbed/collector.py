"""How both backends' event loops treat Python's garbage collector.

A loop allocates millions of short-lived objects (jobs, tokens, records, frames) that die
by reference count: they form no cycles, so a collection finds nothing to free and only
costs time. Two costs are worth removing:

- a full collection walks every tracked object: the set-up's (deployment, router tables,
  in an emulated worker also torch's: ~300,000 objects and 136-144 ms of wall time per
  full collection, measured here in a process with paper10's set-up and torch imported),
  and every record column (a list of a run's floats is walked element by element);
- a young collection every 700 allocations (Python's default).

``quiet_collector`` freezes what exists when the loop starts (``gc.freeze``: left out of
every later collection; an object that dies by reference count is freed at once, frozen or
not, and a frozen cycle is freed after the block, when everything is unfrozen) and, in the
simulator, collects the youngest generation every ``GC_YOUNG`` allocations; cycles a
router makes are still collected, later. ``GcPauses`` measures what collections remain
(in an emulated worker a pause is wall time in which its loop serves nothing: the pause
divided by T of emulated time).
"""

from __future__ import annotations

import gc
import time
from contextlib import contextmanager

GC_YOUNG = 50_000  # allocations between young-generation collections in a loop


@contextmanager
def quiet_collector(young: int | None = GC_YOUNG):
    """Freeze the objects that exist now and, with ``young``, collect young objects only
    every ``young`` allocations, until the end of the block; the thresholds are restored
    and a caller's own freeze is left alone.

    ``young=None`` keeps Python's threshold: for a loop that serves wall-clock deadlines
    (an emulated worker) many short young collections are better than a few long ones:
    at 50,000 a young collection took 11-62 ms of an emulated worker's wall time."""
    thresholds = gc.get_threshold()
    if young is not None:
        gc.set_threshold(max(thresholds[0], young), *thresholds[1:])
    try:
        if gc.get_freeze_count():
            yield
            return
        gc.freeze()
        try:
            yield
        finally:
            gc.unfreeze()
    finally:
        gc.set_threshold(*thresholds)


def freeze_more() -> None:
    """Inside ``quiet_collector``: freeze what was made since it began as well (a worker's
    start-up: transport, the kernels' and the router's warm-up, which loads numba's
    compiled code); outside one, nothing (a caller that did not freeze keeps Python's
    behaviour). Unfrozen with the rest when the block ends."""
    if gc.get_freeze_count():
        gc.freeze()


class GcPauses:
    """Collections by generation and their wall time, while installed (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.total_s = 0.0
        self.max_s = 0.0
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        dt = time.perf_counter() - self._t0
        self.count[info["generation"]] += 1
        self.total_s += dt
        if dt > self.max_s:
            self.max_s = dt

    def install(self) -> "GcPauses":
        gc.callbacks.append(self)
        return self

    def remove(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)

    def stats(self, prefix: str = "gc_") -> dict:
        return {f"{prefix}collections": list(self.count),
                f"{prefix}pause_ms_total": round(self.total_s * 1e3, 3),
                f"{prefix}pause_ms_max": round(self.max_s * 1e3, 3)}
