"""The step scheduler of one server's GPU stream: one rule for both backends and every router.

Serving engines batch per iteration (Orca, OSDI'22; vLLM, SOSP'23; SGLang):
when the stream is free it takes what is queued, runs it as one step, and
each expert that has tokens in the step reads its weights once (fused MoE
kernels group a step's tokens by expert). Under ``physics: hardware`` a step
is every job queued for one layer: the dense part of the tokens residing
here and the expert jobs of that layer, grouped by replica, at most
``max_batch_tokens`` distinct tokens, oldest request first. The layer is the
one holding the job of the oldest request (first come, first served, as
vLLM's scheduler), so a micro-batch that finishes one layer and queues for
the next is served next: a pipeline stage runs it through its consecutive
layers, and newer requests that reached the same layer join it. Between jobs of
one request the earlier arrival (model time) goes first, then the earlier
submission: the simulator submits each job at its arrival, so there the two
orders are one; the emulator's loop may submit a job after one that arrived
later (a dispatch to itself handled behind a peer's frame), and ordered by
submission such a pair once swapped two of a server's steps (README, "Emulator
against simulator", fastbehindslow4's seed 19).

    step time = sum over active replicas (load v/beta if CPU-resident + expert(n_r tokens))
                + dense(n tokens, their attention and KV-cache reads)

With ``engine.moe_kernels: fused`` (the default) the replicas of one
precision launch once per step, as grouped-GEMM MoE kernels (vLLM's
fused_moe) do: measured on an H100, 60 Qwen experts of one token run in
0.41 ms as grouped GEMMs against 0.94 ms as 60 back-to-back FFNs in a CUDA
graph (README, "Measured on a real GPU"). With ``per_expert`` each
expert(n_r) carries its own kernel launches (a loop over the step's experts,
each a fused gate/up GEMM, activation and down GEMM). The queued-work
estimate a server publishes follows the same rule.

Under ``physics: paper`` (the world as the paper's cost model has it, kept
for comparison) a step is one replica's queued jobs, ``load + n w/F``, and the
dense part is a delay outside the stream, as in the testbed before the
hardware model.

Every copy to a server's GPU goes over its one copy engine (``CopyEngine``,
one copy at a time): a router's prefetches queue on it FIFO, a step's load of
a CPU-resident replica (v / beta) goes after the copy in progress and ahead
of the prefetches not yet started, and a replica whose prefetch is under way
waits for the rest of that copy. ``engine.load_overlap`` says what the stream
does meanwhile. ``serial`` (the default; every figure's rule): the stream
reaches the replica, waits for its copy, then runs its kernel, so a load holds
up the rest of the step. ``copy_engine``: the step's loads are queued at its
start and the stream runs its dense part and GPU-resident experts while they
stream in, as MoE-Infinity and Pre-gated MoE overlap expert loads with
computation (a GPU's DMA engines copy beside its kernels)::

    t = dense + resident experts;  for each loaded replica i, by when its copy is
    done:  t = max(t, copy_i done) + expert_i;  step time = t

(less the launches ``fused`` shares, as in the serial rule). On an idle
engine the serial rule is the sum above with each load in full. The
queued-work estimate a server publishes adds loads in full under either rule.
Until 2026-12-05 a step's load ran in the stream and prefetches had an engine
of their own: a prefetching server had two PCIe links (``engine.prefetch_link:
own`` keeps that rule, to reproduce runs made under it). The paper's world (one
replica per step) keeps it too.

With ``engine.kv_overflow: spill`` each server's scheduler holds a K/V ledger
(``testbed/kv_spill.py``): a step's dense part first copies in, over PCIe, the share of
its requests' K/V that did not fit the room (the newest requests' spill first), then its
own positions join the cache. Under ``none`` (the default) the cache has no bound and the
step reads every position from GPU memory.

``hold_s`` (default 0) lets a step wait up to that long after its oldest job
arrived for more work to batch, as engines with a batching window do.
Times are model seconds; the emulator multiplies them by its dilation.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Callable

from hetroute.service import ServiceModel
from hetroute.system import Precision

from .kv_spill import KvSpill

DENSE = -1  # replica id of a dense-part job
#: a group's order is (prio, seq); sorting by prio alone gives it, as the sort is stable
#: and jobs of equal prio always sit in seq order in a group (appended with rising seq;
#: what a partial take leaves is sorted) -- and a float key sorts faster than a tuple
_BY_PRIO = attrgetter("prio")
_ARRIVAL = attrgetter("arrival")
#: model seconds within which two instants are one on the copy engine: the emulator's model
#: times come back from wall stamps with float error (a step that starts as a prefetch is
#: queued read 2e-18 s before it there, pushing the prefetch back where the simulator let it
#: run), as ``StepScheduler.take`` takes the jobs that arrived within it
SAME_INSTANT_S = 1e-9


def instant_key(t: float) -> int:
    """A model time on a grid of ``SAME_INSTANT_S``: arrivals within it are one instant, whose
    jobs go in submission order (the emulator's model times come back from wall stamps with
    float error, so two jobs the simulator receives at one instant may read 1e-18 s apart)."""
    return round(t / SAME_INSTANT_S)


def _by_prio_arrival(j: "Job") -> tuple[float, int]:
    """Within one prio, jobs go by model arrival (``StepScheduler`` docstring); the stable sort
    keeps submission order within one instant."""
    return j.prio, instant_key(j.arrival)


class Job:
    """One token's work at one server: an expert (``replica`` >= 0) or the dense part."""

    __slots__ = ("layer", "replica", "token", "request", "position", "arrival", "owner", "gpu",
                 "seq", "prio")

    def __init__(self, layer: int, replica: int, token: Any, request: int, position: int,
                 arrival: float, owner: Any = None, prio: float = 0.0) -> None:
        self.layer, self.replica, self.token = layer, replica, token
        self.request, self.position, self.arrival, self.owner = request, position, arrival, owner
        self.prio = prio  # the request's arrival time: older requests first (FCFS, as vLLM)
        self.gpu = True
        self.seq = 0


class Copy:
    """One host-to-device copy on a ``CopyEngine``: a prefetch, or a step's on-demand load
    (``demand``). ``version`` counts the times a step's load moved it (a prefetch pushed
    back behind the load, or brought forward as the load itself): a backend schedules a
    prefetch's landing for ``(copy, version)`` and ignores a landing whose version is stale."""

    __slots__ = ("replica", "start", "end", "demand", "version")

    def __init__(self, replica: int, start: float, end: float, demand: bool = False) -> None:
        self.replica, self.start, self.end, self.demand = replica, start, end, demand
        self.version = 0


class CopyEngine:
    """A server's host-to-device copy engine: one queue of copies over its PCIe link, one
    at a time, in model seconds. Prefetches (a router's ``Assignment.prefetch``) queue on it
    FIFO under either load rule. A step's on-demand loads use it too: behind the copy in
    progress (a DMA transfer is not preempted) and the on-demand loads queued before them,
    ahead of the prefetches that have not started (MoE-Infinity re-prioritises its copy
    queue for the experts a batch waits on), which move back by the load's time; a queued
    prefetch of the replica itself becomes the load. ``notify(copy)`` (set by the backend)
    hears of every prefetch whose landing moved, to schedule it again."""

    __slots__ = ("free", "queue", "notify")

    def __init__(self, notify=None) -> None:
        self.free = 0.0  # when the last queued copy ends
        self.queue: list[Copy] = []  # copies not yet done, in the order they run (a few)
        self.notify = notify

    def _drop_done(self, now: float) -> None:
        q = self.queue
        i = 0
        while i < len(q) and q[i].end <= now + SAME_INSTANT_S:
            i += 1
        if i:
            del q[:i]

    def prefetch(self, replica: int, now: float, load_s: float) -> Copy:
        """Queue a prefetch of ``replica`` behind every copy queued; it lands at ``.end``."""
        self._drop_done(now)
        start = self.free if self.free > now else now
        self.free = end = start + load_s
        c = Copy(replica, start, end)
        self.queue.append(c)
        return c

    def load(self, replica: int, now: float, load_s: float,
             since: float | None = None) -> tuple[float, float]:
        """A stream needs ``replica`` on the GPU from ``now``: (begin, end) of the copy that
        puts it there. A prefetch of it already under way is waited for; otherwise its copy
        runs after the copy in progress and the on-demand copies queued, before the queued
        prefetches (a queued prefetch of it is that copy, brought forward). ``begin ==
        now``: the engine was free, and the copy takes ``load_s`` from now. ``since`` (the
        step's start, where the stream reaches the replica later): a prefetch of it that
        landed after ``since`` and by ``now`` put it there, and ``end <= now`` says so."""
        q = self.queue
        eps = SAME_INSTANT_S
        mine = next((c for c in reversed(q) if c.replica == replica), None)  # its latest copy
        if mine is not None and mine.end <= now + eps:  # done: ``_drop_done`` drops it
            if since is not None and not mine.demand and mine.end > since + eps:
                return mine.start, mine.end  # its prefetch landed before the stream got here
            mine = None
        self._drop_done(now)
        if mine is not None and mine.start <= now + eps:
            return mine.start, mine.end
        i = 0  # the first queued prefetch: the copies before it run first
        while i < len(q) and (q[i].demand or q[i].start <= now + eps):
            i += 1
        begin = q[i - 1].end if i else now
        t = end = begin + load_s
        if mine is not None:  # its prefetch, queued: it runs now, as the load
            q.remove(mine)
            mine.start, mine.end, mine.demand = begin, end, True
            self._moved(mine)
            q.insert(i, mine)
        else:
            q.insert(i, Copy(replica, begin, end, demand=True))
        for c in q[i + 1:]:
            if c.start != t:
                c.start, c.end = t, t + (c.end - c.start)
                self._moved(c)
            t = c.end
        self.free = t
        return begin, end

    def _moved(self, c: Copy) -> None:
        c.version += 1
        if self.notify is not None:
            self.notify(c)


@dataclass
class Step:
    jobs: list[Job]
    start: float
    duration: float
    layer: int
    replicas: int  # active replicas
    tokens: int  # distinct tokens
    loads: int  # CPU-resident replicas loaded over PCIe
    expert_jobs: int = 0  # jobs that are not a dense part


class StepScheduler:
    """Queue and step rule of one server. The backend owns time: it calls ``take``
    when the stream is free (at a time not before ``ready_at``) and ``finish``
    when the step's duration has passed."""

    def __init__(self, service: ServiceModel, server: int, precision_of: Callable[[int], Precision],
                 resident: Callable[[int], bool], scope: str = "layer",
                 max_batch_tokens: int = 2048, hold_s: float = 0.0,
                 on_execute: Callable[[int, bool], None] | None = None,
                 moe_kernels: str = "fused", load_overlap: str = "serial",
                 prefetch_link: str = "shared", kv: KvSpill | None = None) -> None:
        if kv is not None and scope != "layer":
            raise ValueError("a K/V room (engine.kv_overflow: spill) needs the layer scope")
        if scope not in ("layer", "replica"):
            raise ValueError("scope must be 'layer' or 'replica'")
        if moe_kernels not in ("per_expert", "fused"):
            raise ValueError("moe_kernels must be 'per_expert' or 'fused'")
        if load_overlap not in ("serial", "copy_engine"):
            raise ValueError("load_overlap must be 'serial' or 'copy_engine'")
        if load_overlap == "copy_engine" and scope != "layer":
            raise ValueError("load_overlap 'copy_engine' needs the layer scope (hardware physics)")
        if prefetch_link not in ("shared", "own"):
            raise ValueError("prefetch_link must be 'shared' or 'own'")
        if prefetch_link == "own" and load_overlap != "serial":
            raise ValueError("prefetch_link 'own' needs load_overlap 'serial'")
        #: own: a step's load runs in the stream, prefetches alone on ``copy`` (before 2026-12-05)
        self.shared_link = prefetch_link == "shared"
        #: copy_engine: a step's loads run on ``copy`` beside its kernels (``_cost``)
        self.overlap = load_overlap == "copy_engine"
        self.copy = CopyEngine()
        #: fused: a step's experts of one precision launch once (a grouped GEMM), so each
        #: further active replica of that precision costs its kernel time without launches
        self.fused = moe_kernels == "fused"
        self.svc, self.n = service, server
        self.precision_of, self.resident = precision_of, resident
        self.scope, self.max_tokens, self.hold = scope, int(max_batch_tokens), float(hold_s)
        self.on_execute = on_execute
        #: ``engine.kv_overflow: spill``: this server's K/V cache against its room; a step
        #: copies in from host memory the spilled share of what its attention reads
        self.kv = kv
        self.queue: OrderedDict[int, list[Job]] = OrderedDict()  # layer or replica -> jobs
        self.queued_s = 0.0  # estimated stream time of what is queued
        self._pending: dict[int, dict[int, int]] = {}  # layer -> replica -> queued jobs
        self._positions: dict[int, int] = {}  # layer -> positions its queued dense jobs attend
        self._layer_cost: dict[int, float] = {}  # layer -> estimated stream time
        #: layer -> (prio, arrival on the ``instant_key`` grid, seq) of its first job
        self._head: dict[int, tuple[float, int, int]] = {}
        #: fused: layer -> precision -> queued replicas of it (the launches they share)
        self._prec_reps: dict[int, dict[Precision, int]] = {}
        self._expert_steps: dict[Precision, list[float]] = {}  # see ``_extend_steps``
        self.busy = False
        self.free_at = 0.0
        self._seq = 0
        #: steps (emulator path: ``take`` with ``arrived_by``) whose layer or job order by
        #: arrival differs from the order of submission: what ordering by submission changed
        self.order_swaps = 0
        self.steps = 0
        self.jobs_run = 0
        #: ``submit(job)`` queues a job by the scope's rule, picked once here (a backend
        #: submits every job through it: no per-job branch on the hot path)
        self.submit = self._submit_layer if scope == "layer" else self._submit_replica

    # -- queueing ----------------------------------------------------------------
    def _submit_replica(self, job: Job) -> None:
        self._seq += 1
        job.seq = self._seq
        r = job.replica
        group = self.queue.get(r)
        if group is None:
            self.queue[r] = [job]
        else:
            group.append(job)
        p = self.precision_of(r)
        self.queued_s += self.svc.expert_s(self.n, p, 1) + (
            0.0 if group is not None or self.resident(r) else self.svc.load_s(self.n, p))

    def _submit_layer(self, job: Job) -> None:
        self._seq += 1
        job.seq = seq = self._seq
        layer, r, prio = job.layer, job.replica, job.prio
        group = self.queue.get(layer)
        if group is None:
            self.queue[layer] = [job]
        else:
            group.append(job)
        head = self._head.get(layer)
        if head is None or prio <= head[0]:  # (a tie on prio and instant keeps the older seq)
            at = instant_key(job.arrival)
            if head is None or prio < head[0] or at < head[1]:
                self._head[layer] = (prio, at, seq)
        pend = self._pending.get(layer)
        if pend is None:
            pend = self._pending[layer] = {}
        c = pend.get(r, 0)
        pend[r] = c + 1
        svc, n = self.svc, self.n
        if r == DENSE:  # what one more token adds to the layer's step (incremental estimate)
            old = self._positions.get(layer, 0)
            new = self._positions[layer] = old + job.position + 1
            delta = svc.dense_s(n, c + 1, new, new) - (svc.dense_s(n, c, old, old) if c else 0.0)
        else:
            p = self.precision_of(r)
            steps = self._expert_steps.get(p)
            if steps is None:
                steps = self._expert_steps[p] = []
            if c >= len(steps):
                self._extend_steps(steps, p, c)
            delta = steps[c]
            if not c:
                if not self.resident(r):
                    delta += svc.load_s(n, p)
                if self.fused:  # a further replica of p in this layer shares p's launches
                    reps = self._prec_reps.get(layer)
                    if reps is None:
                        reps = self._prec_reps[layer] = {}
                    k = reps.get(p, 0)
                    reps[p] = k + 1
                    if k:
                        delta -= svc.expert_launch_s(n)
        self._layer_cost[layer] = self._layer_cost.get(layer, 0.0) + delta
        self.queued_s += delta

    def _extend_steps(self, steps: list[float], p: Precision, c: int) -> None:
        """Fill ``steps[b]`` up to b = c: what the (b+1)-th token adds to a replica's job
        at precision ``p``, ``expert_s(b + 1) - expert_s(b)`` (``expert_s(1)`` for the
        first): the same floats ``_submit_layer`` would compute, computed once."""
        svc, n = self.svc, self.n
        for b in range(len(steps), c + 1):
            steps.append(svc.expert_s(n, p, b + 1) - svc.expert_s(n, p, b) if b
                         else svc.expert_s(n, p, 1))

    def _shared_launches(self, replicas: int, precisions: int) -> float:
        """Under ``fused``: the launch seconds that ``replicas`` active replicas of
        ``precisions`` precisions do not pay, each precision launching once."""
        return (replicas - precisions) * self.svc.expert_launch_s(self.n)

    def _update_layer(self, layer: int) -> None:
        """Re-estimate one layer's queued work from its counts (layer scope, after a step)."""
        old = self._layer_cost.get(layer, 0.0)
        pend = self._pending.get(layer)
        new = 0.0
        if pend:
            svc, n = self.svc, self.n
            reps: dict[Precision, int] = {}
            for r, c in pend.items():
                if r == DENSE:
                    pos = self._positions.get(layer, 0)
                    new += svc.dense_s(n, c, pos, pos)
                else:
                    p = self.precision_of(r)
                    new += svc.expert_s(n, p, c) + (0.0 if self.resident(r) else svc.load_s(n, p))
                    reps[p] = reps.get(p, 0) + 1
            if self.fused:
                new -= self._shared_launches(sum(reps.values()), len(reps))
                self._prec_reps[layer] = reps
            self._layer_cost[layer] = new
        else:
            self._pending.pop(layer, None)
            self._positions.pop(layer, None)
            self._layer_cost.pop(layer, None)
            self._prec_reps.pop(layer, None)
        self.queued_s += new - old
        if not self.queue:
            self.queued_s = 0.0  # no float drift

    def _next_key(self) -> int:
        if self.scope == "replica":
            return next(iter(self.queue))
        return min(self._head, key=self._head.__getitem__)

    def earliest(self) -> float:
        """Arrival of the first-arrived queued job: the earliest a step can start (the
        emulator's jobs carry model-time arrivals that may lie ahead of its loop)."""
        return min(j.arrival for group in self.queue.values() for j in group)

    def _next_arrived_key(self, by: float) -> int:
        """The group ``_next_key`` would pick among the jobs that had arrived by ``by``: a
        step does not wait for an older request's job that is still on its way (the
        simulator never sees such a job before it arrives; the emulator may, when its loop
        runs late)."""
        if self.scope == "replica":
            return self._next_key()
        best, key, by_seq, seq_key = None, None, None, None
        for k, group in self.queue.items():
            for j in group:
                if j.arrival <= by:
                    order = (j.prio, instant_key(j.arrival), j.seq)
                    if best is None or order < best:
                        best, key = order, k
                    if by_seq is None or (j.prio, j.seq) < by_seq:
                        by_seq, seq_key = (j.prio, j.seq), k
        if key is None:
            return self._next_key()
        if seq_key != key:
            self.order_swaps += 1
        return key

    def ready_at(self, now: float) -> float:
        """Earliest time the next step may start (``hold_s`` after its oldest job)."""
        if not self.hold:
            return now
        jobs = self.queue[self._next_key()]
        if len({j.token for j in jobs}) >= self.max_tokens:
            return now
        return max(now, min(j.arrival for j in jobs) + self.hold)

    # -- a step ---------------------------------------------------------------------
    def take(self, now: float, arrived_by: float | None = None) -> Step:
        """Start the next step at ``now``; jobs that arrived after ``arrived_by``
        (default ``now``) wait for a later one (the emulator's timers fire late)."""
        limit = (now if arrived_by is None else arrived_by) + 1e-9
        key = self._next_key() if arrived_by is None else self._next_arrived_key(limit)
        group = self.queue[key]
        if self.scope == "layer":
            # the simulator (``arrived_by`` None) submits each job at its arrival, so its
            # groups are in arrival order within a prio already and the float key gives the
            # same order faster; the emulator's may not be (``_by_prio_arrival``)
            if arrived_by is None:
                group.sort(key=_BY_PRIO)
            else:
                group.sort(key=_by_prio_arrival)
                if any(a.seq > b.seq and a.prio == b.prio for a, b in zip(group, group[1:])):
                    self.order_swaps += 1
        if len(group) <= self.max_tokens and max(map(_ARRIVAL, group)) <= limit:
            return self._take_all(key, group, now)  # the common case: all of it
        taken, rest, tokens = [], [], set()
        for j in group:
            if j.arrival <= limit and (j.token in tokens or len(tokens) < self.max_tokens):
                taken.append(j)
                tokens.add(j.token)
            else:
                rest.append(j)
        if not taken:  # nothing has arrived by then: take the oldest alone
            taken, rest = [group[0]], group[1:]
            tokens = {group[0].token}
        if rest:
            self.queue[key] = rest
        else:
            del self.queue[key]
        if self.scope == "layer":
            if rest:
                self._head[key] = min((j.prio, instant_key(j.arrival), j.seq) for j in rest)
            else:
                del self._head[key]
        dur, nrep, loads, experts = self._cost(taken, now)
        if self.scope == "layer":
            pend, layer = self._pending[key], key
            for j in taken:
                pend[j.replica] -= 1
                if not pend[j.replica]:
                    del pend[j.replica]
                if j.replica == DENSE:
                    self._positions[layer] -= j.position + 1
            self._update_layer(layer)
        elif self.queue:
            self.queued_s -= dur
        else:
            self.queued_s = 0.0  # no float drift
        return self._started(taken, now, dur, nrep, len(tokens), loads, experts)

    def _take_all(self, key: int, jobs: list[Job], now: float) -> Step:
        """``take`` when a group's whole queue (sorted, all arrived, within the token cap)
        is the step: no split into taken and rest, and under the layer scope its counts,
        positions and cost estimate go at once, with the same arithmetic as a partial
        take followed by ``_update_layer``."""
        del self.queue[key]
        dur, nrep, loads, experts = self._cost(jobs, now)
        if self.scope == "layer":
            del self._head[key]
            self._pending.pop(key, None)
            self._positions.pop(key, None)
            self._prec_reps.pop(key, None)
            self.queued_s += 0.0 - self._layer_cost.pop(key, 0.0)
            if not self.queue:
                self.queued_s = 0.0  # no float drift
        elif self.queue:
            self.queued_s -= dur
        else:
            self.queued_s = 0.0  # no float drift
        return self._started(jobs, now, dur, nrep, len({j.token for j in jobs}), loads, experts)

    def _started(self, jobs: list[Job], now: float, dur: float, nrep: int, n_tokens: int,
                 loads: int, experts: int) -> Step:
        """The stream is busy with ``jobs`` from ``now`` for ``dur`` seconds."""
        self.busy = True
        self.free_at = now + dur
        self.steps += 1
        self.jobs_run += len(jobs)
        return Step(jobs, now, dur, jobs[0].layer, nrep, n_tokens, loads, experts)

    def _cost(self, jobs: list[Job], now: float = 0.0) -> tuple[float, int, int, int]:
        """Stream seconds, active replicas, loads and expert jobs of a step starting at
        ``now`` (the load rules in the module docstring); marks each job with the tier its
        replica ran from."""
        if self.scope == "replica" and jobs[0].replica != DENSE:
            return self._cost_one(jobs)
        svc, n = self.svc, self.n
        counts: dict[int, int] = {}  # replicas in order of first appearance
        for j in jobs:
            counts[j.replica] = counts.get(j.replica, 0) + 1
        dur, loads, tier = 0.0, 0, {}
        waits = []  # copy_engine: (copy done, kernel) of each loaded replica
        precision_of, resident, on_execute = self.precision_of, self.resident, self.on_execute
        for r, c in counts.items():
            if r == DENSE:
                continue
            p = precision_of(r)
            gpu = tier[r] = resident(r)
            if on_execute is not None:
                on_execute(r, not gpu)  # dynamic caches insert and evict here
            if not gpu:
                loads += 1
                load = svc.load_s(n, p)
                if self.overlap:  # queued at the step's start; the kernel waits for it
                    waits.append((self.copy.load(r, now, load)[1] - now, svc.expert_s(n, p, c)))
                    continue
                # serial: the stream waits for the copy, on the engine the prefetches use
                at = now + dur
                begin, end = self.copy.load(r, at, load, since=now) if self.shared_link else (0.0, 0.0)
                if not self.shared_link or begin == at:
                    dur += load  # the engine was free: the copy starts as the stream reaches it
                elif end > at:  # behind a copy in progress (or the rest of this replica's prefetch)
                    dur = end - now
                # else its prefetch landed during the step, before the stream reached it
            dur += svc.expert_s(n, p, c)
        shared = (self._shared_launches(len(tier), len({precision_of(r) for r in tier}))
                  if self.fused and len(tier) > 1 else None)  # one set of launches per precision
        if not self.overlap and shared is not None:
            dur -= shared
        dense = self._dense_and_tiers(jobs, counts, tier)
        if dense is not None:
            dur += dense
        if self.overlap:  # the loaded replicas' kernels, each once its copy is done
            for ready, kernel in sorted(waits):
                dur = (dur if dur > ready else ready) + kernel
            if shared is not None:
                dur -= shared
        return dur, len(tier), loads, len(jobs) - counts.get(DENSE, 0)

    def _dense_and_tiers(self, jobs: list[Job], counts: dict[int, int],
                         tier: dict[int, bool]) -> float | None:
        """Marks each expert job with its replica's tier; the step's dense part in seconds
        (its tokens' attention and each request's KV cache read once), None without one."""
        attn = 0
        per_request: dict[int, int] = {}
        for j in jobs:
            if j.replica == DENSE:
                attn += j.position + 1
                if j.position + 1 > per_request.get(j.request, 0):
                    per_request[j.request] = j.position + 1
            else:
                j.gpu = tier[j.replica]
        if DENSE not in counts:
            return None
        dense = self.svc.dense_s(self.n, counts[DENSE], attn, sum(per_request.values()))
        kv = self.kv
        if kv is not None:  # spilled K/V in first, then this step's own K/V join the cache
            dense += kv.copy_in_s(per_request)
            for j in jobs:
                if j.replica == DENSE:
                    kv.write(j.request, j.prio)
        return dense

    def _cost_one(self, jobs: list[Job]) -> tuple[float, int, int, int]:
        """``_cost`` of a step of one replica's jobs (the replica scope: the paper's world
        runs a step per replica), without the general case's counting; the same floats."""
        r = jobs[0].replica
        p = self.precision_of(r)
        gpu = self.resident(r)
        if self.on_execute is not None:
            self.on_execute(r, not gpu)
        dur, loads = 0.0, 0
        if not gpu:
            dur += self.svc.load_s(self.n, p)
            loads = 1
        dur += self.svc.expert_s(self.n, p, len(jobs))
        for j in jobs:
            j.gpu = gpu
        return dur, 1, loads, len(jobs)

    def finish(self) -> None:
        self.busy = False

    def backlog(self, now: float) -> float:
        """Queued work in stream seconds: what the server publishes each window."""
        rem = self.free_at - now if self.busy else 0.0
        return (rem if rem > 0 else 0.0) + self.queued_s


# -- a step's composition (``run --trace-steps`` and ``hardware replay-steps``) ----------

def step_row(server: int, step: Step, precision_of: Callable[[int], Precision]) -> tuple:
    """One row of the step table (``testbed.records.STEP_COLUMNS``): server, layer, start,
    modeled seconds, then the active replicas (precision, tokens, GPU-resident) in order of
    first appearance and the dense part's (request, position) per token. Enough to charge
    the step again by the same rule on another GPU (``rebuild_jobs``) or to run it."""
    counts: dict[int, int] = {}
    gpu: dict[int, bool] = {}
    d_req, d_pos = [], []
    for j in step.jobs:
        r = j.replica
        if r == DENSE:
            d_req.append(j.request)
            d_pos.append(j.position)
        else:
            counts[r] = counts.get(r, 0) + 1
            gpu[r] = j.gpu
    reps = list(counts)
    return (server, step.layer, step.start, step.duration,
            [int(precision_of(r)) for r in reps], [counts[r] for r in reps],
            [gpu[r] for r in reps], d_req, d_pos)


def rebuild_jobs(layer: int, rep_tokens, dense_request, dense_position) -> list[Job]:
    """The jobs of a traced step, replicas numbered 0.. in their traced order: what a
    ``StepScheduler`` takes to charge that step again (its request ids keep the KV-cache
    rule: a request's cache is read once per step)."""
    jobs, tok = [], 0
    for r, c in enumerate(rep_tokens):
        for _ in range(int(c)):
            jobs.append(Job(layer, r, ("e", tok), -1, 0, 0.0))
            tok += 1
    for q, p in zip(dense_request, dense_position):
        jobs.append(Job(layer, DENSE, ("d", tok), int(q), int(p), 0.0))
        tok += 1
    return jobs


def charge(service: ServiceModel, server: int, layer: int, rep_precision, rep_tokens, rep_gpu,
           dense_request, dense_position, moe_kernels: str = "fused",
           load_overlap: str = "serial") -> float:
    """Model seconds of a traced step on ``service``'s server ``server``, by the step rule
    itself (a fresh scheduler, its copy engine idle, takes exactly the traced jobs as one
    step)."""
    prec = [Precision(int(p)) for p in rep_precision]
    res = [bool(g) for g in rep_gpu]
    sc = StepScheduler(service, server, prec.__getitem__, res.__getitem__,
                       max_batch_tokens=1 << 30, moe_kernels=moe_kernels,
                       load_overlap=load_overlap)
    for j in rebuild_jobs(layer, rep_tokens, dense_request, dense_position):
        sc.submit(j)
    return sc.take(0.0).duration
