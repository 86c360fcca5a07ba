"""The emulated server's GPU stream: the step scheduler of ``testbed/steps.py`` in wall time.

The rule is the simulator's (one module decides what a step holds and how
long it takes); this driver runs it on the worker's event loop. A step starts
at the later of the previous step's modeled end and the arrival of the
oldest job it serves, takes the jobs that had arrived by then, runs the real
kernel once per replica on all its tokens' hidden states, and ends
``T x (modeled step time)`` after its start, when every result is released.
Starts follow the modeled timeline, not the time a timer happened to fire, so
a late release does not push later steps back; how late each release was is
recorded (the fidelity monitor reports it).

A job whose modeled arrival is before a step's start but whose frame the host
delivered after that step had started (a sender's loop running behind) waits
for the next step, where the simulator runs it in that one, or (an older
request's job of another layer) serves its own layer first; such jobs are
counted (``missed``, flagged above 1% of a worker's jobs), and so is one of the same
request that arrived before the step's first job (steps.py orders a request's jobs by
arrival). Measured on asym5's overloaded Prism at T = 32, none did (README, "Emulator
against simulator").

It runs in the worker's event loop: no thread hand-off, so a release costs a
timer callback, not a context switch and the GIL.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..steps import DENSE, Job, Step, StepScheduler, instant_key
from .worst import Worst

Kernel = Callable[[int, torch.Tensor], torch.Tensor]  # (replica, [B, d]) -> [B, d]


@dataclass
class Work:
    """What an emulated job carries: the hidden state (replaced by the expert's
    output when the step runs) and what the worker needs back."""

    x: torch.Tensor | None = None
    owner: Any = None
    gate: float = 1.0
    position: int = 0
    error: str = ""


@dataclass
class StreamStats:
    batches: int = 0  # steps
    jobs: int = 0
    kernel_errors: int = 0
    late: list[float] = field(default_factory=list)  # release lateness per step, wall s
    worst_late: Worst = field(default_factory=Worst)  # the largest of them, with their instants
    service: list[tuple[float, float]] = field(default_factory=list)  # (modeled, realised) model s
    #: (modeled step model s, wall s the step's real kernels took): how much of the padding
    #: T x modeled the worker's own compute uses (on CUDA with full-size experts, measured
    #: kernel time against the model's)
    kernel: list[tuple[float, float]] = field(default_factory=list)
    #: jobs queued while a step ran that had arrived, in model time, by that step's start
    #: and were of its group (layer, or replica under the paper's world) or, under the layer
    #: scope, of an older request (first come, first served would have served theirs first):
    #: the simulator would have had them in that step or ahead of it. Their delivery came
    #: too late in wall time (a sender's loop running late, the host's scheduling)
    missed_late: list[float] = field(default_factory=list)  # how late, wall s after the start

    @property
    def missed(self) -> int:
        return len(self.missed_late)


class ModeledStream:
    """``now()`` and ``wall(t)`` convert between model seconds and the loop's clock."""

    def __init__(self, loop: asyncio.AbstractEventLoop, dilation: float, scheduler: StepScheduler,
                 kernel: Kernel, on_done: Callable[[Job], None], now: Callable[[], float],
                 wall: Callable[[float], float], log: Callable[[str], None] = lambda s: None,
                 on_step_done: Callable[[], None] | None = None,
                 on_step: Callable[[Step], None] | None = None,
                 on_step_ran: Callable[[list[Job], float], None] | None = None) -> None:
        self.loop, self.T = loop, float(dilation)
        #: called with every step as it starts (``run --trace-steps``), as the simulator's
        self.on_step = on_step
        #: called once a step's jobs are all released (``released_at`` still set): what the
        #: step released together leaves together (``engine.dispatch: step``)
        self.on_step_done = on_step_done
        #: called with a step's jobs and its modeled end once its kernels have run (at its
        #: start): what the release hands on is made then, inside the step's padded time
        self.on_step_ran = on_step_ran
        self.sched, self.kernel, self.on_done = scheduler, kernel, on_done
        self.now, self.wall, self.log = now, wall, log
        self.free_at = 0.0  # model time the stream is free
        self.stats = StreamStats()
        self._wake: asyncio.TimerHandle | None = None
        self._soon = False
        #: while a step's jobs are released: the model time it ended (``on_done`` reads it)
        self.released_at: float | None = None
        #: the running step's model start, group key and first job's (prio, arrival instant)
        #: (``missed``)
        self._step_start = -1.0
        self._step_key = None
        self._step_order: tuple[float, float] = (float("inf"), float("inf"))  # (prio, instant)

    @property
    def busy(self) -> bool:
        return self.sched.busy

    @property
    def queue(self):
        return self.sched.queue

    def submit(self, job: Job) -> None:
        """``job.arrival`` in model seconds; ``job.owner`` a ``Work``. An idle stream starts
        once the current callback has queued all it submits (tokens released together
        batch together, as in the simulator)."""
        sc = self.sched
        layer = sc.scope == "layer"
        if sc.busy and job.arrival <= self._step_start + 1e-9 and (
                self._step_key == (job.layer if layer else job.replica)
                or (layer and (job.prio, instant_key(job.arrival)) < self._step_order)):
            self.stats.missed_late.append(time.monotonic() - self.wall(self._step_start))
        self.sched.submit(job)
        if self.sched.scope == "replica":  # the paper's world starts at once, as before
            if not self.sched.busy:
                self._start()
        elif not self.sched.busy and not self._soon:
            self._soon = True
            self.loop.call_soon(self._start)

    def _start(self) -> None:
        self._soon = False
        sc = self.sched
        if sc.busy or not sc.queue:
            return
        earliest = sc.earliest()
        start = max(earliest, self.free_at)
        # a step starts at the modeled end of the last one, or on an idle stream at the
        # modeled arrival of its oldest job, and takes what had arrived by then, as in the
        # simulator: jobs carry model-time arrivals (a frame to this server arrives at its
        # modeled send time), so what arrived later waits for the next step even when the
        # loop queued it before this callback ran
        arrived_by = start
        ready = sc.ready_at(start)
        if ready > start and ready > self.now():  # hold for more work (``hold_s``)
            if self._wake is None:
                self._wake = self.loop.call_at(self.wall(ready), self._woken)
            return
        start = max(start, ready)
        step = sc.take(start, arrived_by=max(arrived_by, start))
        if self.on_step is not None:
            self.on_step(step)
        self._step_start = start
        self._step_key = step.layer if sc.scope == "layer" else step.jobs[0].replica
        # (a layer's step is in request order, then arrival order: ``take``)
        self._step_order = (step.jobs[0].prio, instant_key(step.jobs[0].arrival))
        groups: dict[int, list[Job]] = {}
        for j in step.jobs:
            if j.replica != DENSE:
                groups.setdefault(j.replica, []).append(j)
        t0 = time.perf_counter()
        for r, jobs in groups.items():
            try:  # one batched kernel per replica, as a fused MoE step runs it
                out = self.kernel(r, torch.stack([j.owner.x for j in jobs]))
                for j, y in zip(jobs, out):
                    j.owner.x = y
            except Exception as err:  # a failing kernel fails its jobs, not the stream
                self.stats.kernel_errors += 1
                self.log(f"kernel of replica {r} failed: {err!r}")
                for j in jobs:
                    j.owner.error = repr(err)
        if groups:
            if torch.cuda.is_initialized():  # a bank on CUDA runs asynchronously: sync to time it
                torch.cuda.synchronize()
            self.stats.kernel.append((step.duration, time.perf_counter() - t0))
        end = start + step.duration
        if self.on_step_ran is not None:
            self.on_step_ran(step.jobs, end)
        self.free_at = end
        self.stats.batches += 1
        self.stats.jobs += len(step.jobs)
        self.loop.call_at(self.wall(end), self._finish, step.jobs, start, end, step.duration)

    def _woken(self) -> None:
        self._wake = None
        self._start()

    def _finish(self, jobs: list[Job], start: float, end: float, model: float) -> None:
        now = time.monotonic()
        late = now - self.wall(end)
        self.stats.late.append(late)
        self.stats.worst_late.add(late, now)
        self.stats.service.append((model, (now - self.wall(start)) / self.T))
        self.sched.finish()
        self.released_at = end
        try:
            for j in jobs:
                self.on_done(j)
            if self.on_step_done is not None:
                self.on_step_done()
        finally:
            self.released_at = None
        if not self._soon:  # after the frames already in the loop's queue are delivered
            self._soon = True
            self.loop.call_soon(self._start)

    def backlog(self) -> float:
        """Queued work in model seconds (what the server publishes each window)."""
        return self.sched.backlog(self.now())
