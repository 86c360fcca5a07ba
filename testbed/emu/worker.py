"""One emulated server: ``python -m testbed.emu.worker --htr-worker CONFIG.json``.

Runs inside its Mininet host. It rebuilds the run's setup from the spec (the
placement comes from the run's placement cache, so every worker and the runner
hold the same deployment), hosts its replicas as real scaled-down experts and
serves tokens exactly as the simulator models them:

- the token's residing worker waits the dense part (dense FLOPs / F, times T),
  routes with its own decider on its own ``StateView`` and sends the hidden
  state to every participant (HIDDEN, one frame per participant carrying the
  whole assignment in its context);
- a participant computes its experts' outputs at once (eagerly, in this
  thread) and queues the jobs on its modeled GPU stream: FIFO, every queued
  job of the same replica coalesced into one batch, a CPU-resident replica
  paying its load once per batch, times T. Results are released at the
  modeled batch end; a release later than that is measured (``late``);
- each participant sends its gate-weighted partial sum to the aggregator
  (PARTIAL); the aggregator adds them to the residual, writes the token-layer
  record and routes the next layer, or sends the token home (TOKEN FINAL);
- every window each worker broadcasts its stream backlog (STATE) to all peers
  over the data plane; views refresh from the latest snapshots at window
  boundaries. A peer whose connection breaks, or that is silent for two
  windows (every peer sends at least its STATE each window), is treated as
  unreachable.

Faults: a cut link drops frames without an error, so each STATE also carries
how many frames its sender has received from each peer (a cumulative
acknowledgement), and every frame a token depends on is kept with a resolver
until the peer acknowledges it. When a peer is lost, whatever it has not
acknowledged is resolved at once by whoever holds the hidden state: a hidden
state or partial that did not arrive makes the sender re-route the layer from
where it is (as the aggregator does when a participant's partial cannot come),
up to two retries as in the simulator; a token that cannot get home fails with
``home X unreachable``. A token that cannot continue is reported to its home
(FAIL, with the reason; relayed through another peer when the home cannot be
reached directly) and its request recorded as failed. A token the home already
counted is ignored if a retry delivers it twice. Times are reported in
emulated seconds (wall / T).

Protocol with the runner, one line each on stdin/stdout: the worker prints
``READY``; the runner sends ``START <t0>`` (a monotonic time shared by all
hosts of the machine); the worker prints ``DONE <request>`` per finished
home request and ``HOMEDONE`` after its last one; the runner sends ``STOP``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
import traceback
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import yaml

from hetroute.state import Assignment, StateView, TokenView, Unroutable

from ..core import Routed, TokenLayerCore
from ..progress import FINISHED, RequestProgress
from ..quality_inrun import INRUN_DIR, stepper_for_run
from ..records import RecordWriter
from ..setup import build_setup
from ..spec import parse_spec
from ..steps import DENSE, Job, StepScheduler
from .experts import ExpertBank, ExpertSpec, ProxyBank
from ..lifecycle import die_with_parent
from .rendezvous import rendezvous
from .stream import ModeledStream, Work
from .tolerances import RELEASE_LATE_REL
from .transport import Transport, precise_loop
from .wire import (ControlKind, DType, Flag, Frame, Header, MsgType, fail_frame, fail_reason,
                   parse_state, state_frame, state_received, tensor_frame)

SILENT_WINDOWS = 2  # a peer silent this many windows is lost (it sends STATE every window)


@dataclass
class WorkerConfig:
    rank: int
    run_dir: str
    spec_file: str
    placement_cache: str
    port: int
    peers: dict[int, tuple[str, int]]  # peer -> (its address on our link, port); {} with rendezvous
    delays_in: list[float]  # transport delay per source, seconds (dilated)
    dilation: float
    rendezvous: tuple[str, int] | None = None  # torch.distributed TCPStore (host, port) of rank 0
    world: int = 0  # number of workers (with rendezvous)
    listen: dict[str, str] = field(default_factory=dict)  # our address per peer rank, or {"*": addr}
    expert_d_model: int = 64
    faults: bool = False  # timeouts are armed only in runs that inject faults
    layer_timeout_s: float = 2.0  # emulated seconds before a stuck layer is re-routed
    request_timeout_s: float = 30.0  # emulated seconds before a home request fails
    secret: str = ""  # hex run secret that authenticates peers; "" takes rank 0's from the store

    @classmethod
    def load(cls, path: str) -> "WorkerConfig":
        d = json.loads(Path(path).read_text())
        d["peers"] = {int(k): tuple(v) for k, v in d["peers"].items()}
        return cls(**d)


# -- per token-layer state ----------------------------------------------------------

@dataclass
class _Participation:
    """This server's share of one token-layer."""

    key: tuple
    header: Header
    jobs_left: int
    partial: torch.Tensor
    arrival: float  # model time the hidden state arrived
    hidden: torch.Tensor | None = None  # the state as received: re-routed from here if the partial is lost
    gpus: dict[int, bool] = field(default_factory=dict)  # assignment position -> tier


@dataclass
class _Gather:
    """The aggregator's view of one token-layer."""

    key: tuple
    header: Header | None = None
    hidden: torch.Tensor | None = None
    partials: dict[int, tuple[torch.Tensor, float, float, float, int]] = field(default_factory=dict)
    opened: float = 0.0
    retries: int = 0


class _Request(RequestProgress):
    __slots__ = ("rid", "user", "arrival", "done", "scores", "finished")

    def __init__(self, rid: int, user: int, arrival: float, prompt: int, gen: int) -> None:
        super().__init__(prompt, gen)
        self.rid, self.user, self.arrival = rid, user, arrival
        self.done = False
        self.finished: set[int] = set()  # token indices counted (a retry may deliver one twice)
        self.scores: dict[int, tuple[float, float, float]] = {}  # token -> KL, CE ref, CE run


class Worker:
    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        self.rank = cfg.rank
        spec = parse_spec(yaml.safe_load(Path(cfg.spec_file).read_text()), cfg.spec_file)
        self.spec = spec
        self.setup = build_setup(spec, Path(cfg.spec_file).parent, Path(cfg.placement_cache))
        s = self.setup
        self.N, self.L, self.k = s.cluster.n, s.shape.n_layers, s.shape.top_k
        self.T = float(cfg.dilation)
        self.window = spec.window_s
        self.dep = s.deployment
        self.decider = s.router.decider(self.rank)
        #: this server's GPU tiers (static, or the router's online cache), as in the simulator
        self.residency = self.decider.residency(self.rank)
        reps = {i: r for i, r in enumerate(self.dep.replicas) if r.server == self.rank}
        act = "relu" if s.model.expert_matrices == 2 else "swiglu"
        torch.set_num_threads(1)
        self.proxy = None  # quality.inrun: the proxy's real hidden states and trained experts
        if spec.quality.inrun:
            n_tok = spec.workload.prompt_tokens + spec.workload.gen_tokens
            self.proxy = stepper_for_run(  # the reference follows the trace's experts, as the run
                spec, [rq.id for rq in s.requests],
                lambda rid: np.asarray(s.routing(rid, n_tok).experts))
            self.proxy.prepare()  # every request's exact reference, before the clock starts
            self.bank = ProxyBank(self.proxy, reps, s.shape.experts_per_layer)
            self.d = self.proxy.cfg.d_model
            self.E = s.shape.experts_per_layer
            qdir = Path(cfg.run_dir) / INRUN_DIR
            qdir.mkdir(parents=True, exist_ok=True)
            self.inrun_file = open(qdir / f"w{self.rank}.jsonl", "w", encoding="utf-8")
        else:
            d = cfg.expert_d_model
            self.bank = ExpertBank(ExpertSpec(d_model=d, d_ff=3 * d, activation=act, seed=spec.seed), reps)
            self.d = d
        sh = s.shape
        #: decide/admit/record/feedback, shared with the simulator
        self.core = TokenLayerCore(s.router, self.dep, s.cluster, sh, spec.physics, s.quality)
        self.hardware = spec.physics == "hardware"
        self.dense_s = self.core.world.dense_s(self.rank, 1)  # physics: paper (a delay)
        self.cpu_free = 0.0  # model time this server's CPU is free of routing decisions
        self.decision_cpu = []  # measured CPU seconds per decision (wall, not dilated)
        self.hidden_bytes = sh.hidden_bytes
        self.view = StateView(self.N)
        self.peer_backlog = [0.0] * self.N
        self.last_heard = [0.0] * self.N
        self.reachable = [True] * self.N
        self.max_gap = [0.0] * self.N  # longest silence heard from each peer (wall s)
        #: per peer: (frame number, resolver) of sent frames it has not acknowledged yet
        self.unacked: dict[int, deque] = {p: deque() for p in range(self.N) if p != self.rank}
        self.relayered: set[tuple] = set()  # token-layer attempts already re-routed or failed here
        self.writer = RecordWriter(Path(cfg.run_dir), self.k, part_prefix=f"w{self.rank}-")
        self.parts: dict[tuple, _Participation] = {}
        self.gathers: dict[tuple, _Gather] = {}
        self.home_requests = [rq for rq in s.requests if rq.home == self.rank]
        self.requests: dict[int, _Request] = {}
        self.routing_cache: OrderedDict[int, tuple] = OrderedDict()
        self.pending_home = len(self.home_requests)
        self.stats = {"frames_out": 0, "token_layers": 0, "retries": 0, "failed_tokens": 0,
                      "resolved_unacked": 0, "fails_relayed": 0}
        self.stopping = False

    # -- clocks ------------------------------------------------------------------
    def now(self) -> float:
        """Emulated seconds since the run started."""
        return (time.monotonic() - self.t0) / self.T

    def wall(self, t_model: float) -> float:
        return self.t0 + t_model * self.T

    # -- start-up ------------------------------------------------------------------
    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self.loop = loop
        eng = self.spec.engine
        prec = [r.precision for r in self.dep.replicas]
        sched = StepScheduler(self.core.world, self.rank, prec.__getitem__, self.residency.is_gpu,
                              scope="layer" if self.hardware else "replica",
                              max_batch_tokens=eng.max_batch_tokens, hold_s=eng.hold_s,
                              on_execute=self.residency.on_execute)
        self.stream = ModeledStream(loop, self.T, sched, self.bank.run, self._job_done, self.now,
                                    self.wall, self._log)
        if self.cfg.rendezvous is not None:  # peers from the store, not from the config
            host, port = self.cfg.rendezvous
            peers, self._store, secret = await loop.run_in_executor(
                None, lambda: rendezvous(self.rank, self.cfg.world, host, port, self.cfg.port,
                                         self.cfg.listen, bytes.fromhex(self.cfg.secret)))
            self.cfg.peers = peers
        else:
            secret = bytes.fromhex(self.cfg.secret)
        self.net = Transport(self.rank, self.cfg.port, self.cfg.peers, self.cfg.delays_in,
                             self._on_frame, self._peer_lost, secret, log=self._log)
        await self.net.start()
        _ = self.bank.run(next(iter(self.bank.replicas)), torch.zeros(1, self.d)) \
            if self.bank.replicas else None  # warm the kernels up
        print("READY", flush=True)
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line.startswith("START"):
            raise RuntimeError(f"expected START, got {line!r}")
        self.t0 = float(line.split()[1])
        self.cpu_at_start = time.process_time()
        # silence counts from the first window, when the first STATE frames are sent
        self.last_heard = [self.wall(self.window)] * self.N
        for rq in self.home_requests:
            loop.call_at(self.wall(rq.arrival_s), self._arrive, rq)
        loop.call_at(self.wall(self.window), self._tick, 1)
        if not self.home_requests:
            print("HOMEDONE", flush=True)
        stop = await loop.run_in_executor(None, sys.stdin.readline)
        self.stopping = True
        self.cpu_run_s = time.process_time() - self.cpu_at_start
        self._log(f"stopping ({stop.strip() or 'EOF'})")
        if self.gathers or self.parts or self.stream.queue:
            self._log(f"in flight at stop: gathers {list(self.gathers)[:10]} "
                      f"(headers {[g.header is not None for g in list(self.gathers.values())[:10]]}, "
                      f"partials {[sorted(g.partials) for g in list(self.gathers.values())[:10]]}); "
                      f"participations {list(self.parts)[:10]}; "
                      f"stream queue {[(r, len(j)) for r, j in self.stream.queue.items()][:10]}, "
                      f"busy {self.stream.busy}")

    def _log(self, msg: str) -> None:
        print(f"[w{self.rank}] {msg}", file=sys.stderr, flush=True)

    # -- windows -------------------------------------------------------------------
    def _tick(self, window: int) -> None:
        if self.stopping:
            return
        now_wall = time.monotonic()
        backlog = self.stream.backlog()
        got = self.net.received_frames
        frame = state_frame([backlog] + [0.0] * (self.N - 1), self.reachable, self.rank, window,
                            window * self.window, self.now(),
                            received=[got.get(p, 0) for p in range(self.N)])
        for peer in range(self.N):
            if peer != self.rank and self.reachable[peer]:
                self._send(peer, frame)
        silent = SILENT_WINDOWS * self.window * self.T
        for peer in range(self.N):
            if peer != self.rank and self.reachable[peer] and now_wall - self.last_heard[peer] > silent:
                self._peer_lost(peer, f"silent for {SILENT_WINDOWS} windows")
        snap = list(self.peer_backlog)
        snap[self.rank] = backlog
        self.view.refresh(window, window * self.window, snap, list(self.reachable))
        self._check_timeouts()
        self.loop.call_at(self.wall((window + 1) * self.window), self._tick, window + 1)

    def _check_timeouts(self) -> None:
        if not self.cfg.faults:
            return
        t = self.now()
        for key, g in list(self.gathers.items()):
            if self._stale(key):
                del self.gathers[key]
            elif g.header is not None and t - g.opened > self.cfg.layer_timeout_s:
                self._reroute(g, "layer timed out")
        for rq in self.requests.values():
            if not rq.done and t - rq.arrival > self.cfg.request_timeout_s:
                self._request_failed(rq, "timeout")

    def _peer_lost(self, peer: int, why: str) -> None:
        if not self.reachable[peer]:
            return
        self.reachable[peer] = False
        self.view.alive[peer] = False
        self.view.faultless = False
        self._log(f"peer {peer} unreachable: {why}")
        if self.stopping:
            return
        pending, self.unacked[peer] = self.unacked[peer], deque()
        for _, resolve in pending:  # sent, never acknowledged: lost with the link
            self.stats["resolved_unacked"] += 1
            try:
                resolve(peer)
            except Exception:
                self._log("error resolving a lost frame:\n" + traceback.format_exc())
        for g in list(self.gathers.values()):
            if g.header is not None and peer in self._participants(g.header) and peer not in g.partials:
                self._reroute(g, f"participant {peer} lost")

    # -- sending ------------------------------------------------------------------------
    def _send(self, dst: int, frame: Frame, resolve=None) -> bool:
        """Send ``frame``; ``resolve(dst)`` runs if ``dst`` is lost before acknowledging it."""
        if dst == self.rank:
            self.loop.call_soon(self._on_frame, frame, time.monotonic())
            return True
        if not self.reachable[dst]:  # lost: a cut link would swallow the frame without an error
            return False
        ok = self.net.send(dst, frame)
        if ok:
            self.stats["frames_out"] += 1
            if resolve is not None:
                self.unacked[dst].append((self.net.sent_frames[dst], resolve))
        return ok

    def _acked(self, src: int, received: list[int]) -> None:
        n = received[self.rank] if self.rank < len(received) else 0
        q = self.unacked.get(src)
        while q and q[0][0] <= n:
            q.popleft()

    def _hidden_frame(self, h: Header, t: torch.Tensor) -> Frame:
        """Callers build ``h`` with dtype FLOAT32 and shape (d,) so no copy of it is made."""
        return tensor_frame(h, t, pad_to=self.hidden_bytes)

    # -- requests at the home server --------------------------------------------------
    def _routing(self, rid: int, n_tokens: int):
        got = self.routing_cache.get(rid)
        if got is None:
            r = self.setup.routing(rid, n_tokens)
            E = self.setup.shape.experts_per_layer
            glob = np.asarray(r.experts) + (np.arange(self.L) * E)[None, :, None]
            got = (glob.tolist(), np.asarray(r.weights, dtype=np.float32))
            self.routing_cache[rid] = got
            if len(self.routing_cache) > 4096:
                self.routing_cache.popitem(last=False)
        return got

    def _arrive(self, rq) -> None:
        req = _Request(rq.id, rq.user, rq.arrival_s, rq.prompt_tokens, rq.gen_tokens)
        self.requests[rq.id] = req
        for i in range(req.prompt):
            self._start_token(req, i)

    def _start_token(self, req: _Request, index: int) -> None:
        if self.proxy is not None:
            h = self.proxy.embed(req.rid, index)
        else:
            g = torch.Generator().manual_seed(hash((self.spec.seed, req.rid, index)) & 0x7FFFFFFF)
            h = torch.randn(self.d, generator=g)
        hdr = Header(MsgType.TOKEN, request=req.rid, token=index, layer=0, home=self.rank,
                     residing=self.rank, src=self.rank, t_origin=self.now())
        self._begin_layer(hdr, h, ())

    # -- the residing server: dense part, then route and fan out -----------------------
    def _begin_layer(self, hdr: Header, h: torch.Tensor, ctx: tuple) -> None:
        t_layer = self.now()
        if self.proxy is not None:  # the layer's attention (and dense block) runs here
            h = self.proxy.attend(int(hdr.request), int(hdr.token), int(hdr.layer), h)
        if not self.hardware:  # the paper's world: a per-token delay outside the stream
            self.loop.call_at(self.wall(t_layer + self.dense_s), self._decide, hdr, h, ctx, t_layer, 0)
            return
        rid, index = int(hdr.request), int(hdr.token)
        self.stream.submit(Job(int(hdr.layer), DENSE, (rid, index), rid, index, t_layer,
                               Work(owner=(hdr, h, ctx, t_layer)), self._prio(rid)))

    def _prio(self, rid: int) -> float:
        """The request's arrival: older requests first in every step (steps.py)."""
        rq = self.setup.requests[rid] if 0 <= rid < len(self.setup.requests) else None
        return rq.arrival_s if rq is not None else 0.0

    def _decide(self, hdr: Header, h: torch.Tensor, rctx: tuple, t_layer: float, retries: int) -> None:
        if self.stopping:
            return
        t_dec = self.now()
        rid, index, layer = int(hdr.request), int(hdr.token), int(hdr.layer)
        n_tok = self._n_tokens(rid, hdr)
        targets = tuple(self._routing(rid, n_tok)[0][index][layer])
        tv = TokenView(rid, index, int(hdr.home), self.spec.quality.budget, server=self.rank,
                       layer=layer, lam_acc=float(hdr.lam_acc), now=t_dec)
        tv.ctx = tuple(rctx) if rctx else None
        view = self.view
        try:
            routed = self.core.decide(self.decider, self.residency, view, tv, targets,
                                      self._true_backlog)
        except Unroutable as err:
            self._token_failed(hdr, str(err))
            return
        # the decision's measured CPU time is emulated time, not divided by T: the
        # dispatch waits for it, behind earlier decisions of this server's CPU
        self.decision_cpu.append(routed.decision_s)
        start = self.cpu_free if self.cpu_free > t_dec else t_dec
        self.cpu_free = t_disp = start + routed.decision_s
        if self.wall(t_disp) > time.monotonic():
            self.loop.call_at(self.wall(t_disp), self._dispatch, hdr, h, rctx, t_layer, retries,
                              tv, routed, t_dec, t_disp)
        else:
            self._dispatch(hdr, h, rctx, t_layer, retries, tv, routed, t_dec, t_disp)

    def _true_backlog(self, n: int) -> float:
        return self.stream.backlog() if n == self.rank else self.peer_backlog[n]

    def _dispatch(self, hdr: Header, h: torch.Tensor, rctx: tuple, t_layer: float, retries: int,
                  tv: TokenView, routed: Routed, t_dec: float, t_disp: float) -> None:
        if self.stopping:
            return
        a = routed.assignment
        if a.prefetch:
            self._prefetch(a.prefetch)
        participants = sorted(routed.per_server)
        new_ctx = tuple(tv.ctx) if tv.ctx else ()
        ctx = [len(a.targets)]
        for e, r, m in zip(a.targets, a.replicas, a.modes):
            ctx += [int(e), int(r), int(m)]
        ctx += [int(round(routed.view_age_s * 1e6)), int(round(routed.backlog_err_s * 1e6)),
                int(round((t_disp - t_dec) * 1e6)), len(new_ctx)]
        ctx += list(new_ctx)
        rid, index, layer = tv.request, tv.index, tv.layer
        out = Header(MsgType.HIDDEN, request=rid, seq=int(hdr.seq) + 1 + retries, token=index,
                     layer=layer, src=self.rank, home=int(hdr.home), residing=self.rank,
                     aggregator=int(a.next_server), n_parts=len(participants), gate=float(routed.dq),
                     lam_acc=float(hdr.lam_acc), t_origin=t_layer, t_send=t_disp,
                     mode=min(retries, 255), ctx=tuple(ctx), dtype=DType.FLOAT32, shape=(self.d,))
        frame = self._hidden_frame(out, h)
        key = (rid, index, layer, int(out.seq))

        def lost(peer: int) -> None:  # the state never reached ``peer``: route again from here
            self._relayer(key, out, h, f"server {self.setup.cluster.names[peer]} lost")
        # the aggregator needs the header even where it runs none of the targets
        # (a whole-layer pipeline such as EdgeShard aggregates away from its experts)
        for n in sorted(set(participants) | {int(a.next_server)}):
            if not self._send(n, frame, lost):
                self.relayered.add(key)  # retried below; what was sent of it is stale
                self.view.alive[n] = False
                self.view.faultless = False
                if retries < 2:
                    self.stats["retries"] += 1
                    self.loop.call_at(self.wall(self.now() + self.window), self._decide, hdr, h,
                                      rctx, t_layer, retries + 1)
                else:
                    self._token_failed(hdr, f"cannot reach server {n}")
                return

    def _load_of(self, r: int) -> float:
        rep = self.dep.replicas[r]
        return self.core.world.load_s(rep.server, rep.precision)

    def _n_tokens(self, rid: int, hdr: Header) -> int:
        rq = self.setup.requests[rid] if rid < len(self.setup.requests) else None
        return rq.prompt_tokens + rq.gen_tokens if rq is not None else int(hdr.token) + 1

    @staticmethod
    def _assignment(h: Header) -> tuple[list[tuple[int, int, int]], tuple[int, int, int], tuple]:
        """(target, replica, mode) per target; (view age, backlog error, decision) in us; router ctx."""
        c = h.ctx
        k = c[0]
        triples = [(c[1 + 3 * j], c[2 + 3 * j], c[3 + 3 * j]) for j in range(k)]
        base = 1 + 3 * k
        n_r = c[base + 3]
        return triples, (c[base], c[base + 1], c[base + 2]), tuple(c[base + 4:base + 4 + n_r])

    def _participants(self, h: Header) -> set[int]:
        return {self.dep.replicas[r].server for _, r, _ in self._assignment(h)[0]}

    # -- frames -----------------------------------------------------------------------
    def _on_frame(self, frame: Frame, arrival: float) -> None:
        if self.stopping:
            return
        h = frame.header
        if 0 <= h.src < self.N:
            gap = arrival - self.last_heard[h.src]
            if gap > self.max_gap[h.src]:
                self.max_gap[h.src] = gap
            self.last_heard[h.src] = arrival
        try:
            if h.mtype == MsgType.HIDDEN:
                self._on_hidden(frame, arrival)
            elif h.mtype == MsgType.PARTIAL:
                self._on_partial(frame, arrival)
            elif h.mtype == MsgType.TOKEN:
                self._on_token(frame)
            elif h.kind == ControlKind.STATE:
                backlog, _ = parse_state(frame)
                self.peer_backlog[h.src] = backlog[0]
                received = state_received(frame)
                if received is not None:
                    self._acked(int(h.src), received)
            elif h.kind == ControlKind.FAIL:
                self._on_fail(frame)
        except Exception:  # one bad token must not take the server down
            self._log("error handling a frame:\n" + traceback.format_exc())

    def _on_hidden(self, frame: Frame, arrival: float) -> None:
        h = frame.header
        key = (int(h.request), int(h.token), int(h.layer), int(h.seq))
        x = frame.tensor().clone()
        received = x
        if h.aggregator == self.rank:
            g = self._gather(key)
            g.header, g.hidden, g.opened = h, x, float(h.t_send)
            self._maybe_complete(g)
        triples, _, _ = self._assignment(h)
        mine = [(j, e, r) for j, (e, r, _) in enumerate(triples)
                if self.dep.replicas[r].server == self.rank]
        if not mine:
            return
        if self.proxy is not None:  # gate weights from the real state, routing fixed (as replay)
            layer = int(h.layer)
            x = self.proxy.moe_input(layer, x)
            w = self.proxy.gate(layer, x, [e - layer * self.E for e, _, _ in triples]).tolist()
        else:
            _, weights = self._routing(int(h.request), self._n_tokens(int(h.request), h))
            w = weights[int(h.token), int(h.layer)]
        t_arr = (arrival - self.t0) / self.T
        p = _Participation(key, h, len(mine), torch.zeros(self.d), t_arr, hidden=received)
        self.parts[key] = p
        rid, index, prio = int(h.request), int(h.token), self._prio(int(h.request))
        for j, _, r in mine:
            self.stream.submit(Job(int(h.layer), r, (rid, index), rid, index, t_arr,
                                   Work(x, p, float(w[j]), j), prio))

    def _job_done(self, job: Job) -> None:
        work: Work = job.owner
        if job.replica == DENSE:  # the dense part ran: route the layer
            hdr, h, ctx, t_layer = work.owner
            self._decide(hdr, h, ctx, t_layer, 0)
            return
        p = work.owner
        p.gpus[work.position] = job.gpu
        p.partial += work.gate * work.x  # the expert output by now
        p.jobs_left -= 1
        if p.jobs_left:
            return
        self.parts.pop(p.key, None)
        h = p.header
        mask = sum(1 << j for j, g in p.gpus.items() if g)
        seen = sum(1 << j for j in p.gpus)
        out = Header(MsgType.PARTIAL, request=h.request, seq=h.seq, token=h.token, layer=h.layer,
                     src=self.rank, home=h.home, residing=h.residing, aggregator=h.aggregator,
                     part=min(mask, 255), n_parts=min(seen, 255), t_origin=p.arrival,
                     t_send=self.now(), dtype=DType.FLOAT32, shape=(self.d,))
        agg = int(h.aggregator)
        why = f"partial output cannot reach server {agg}"
        if not self._send(agg, self._hidden_frame(out, p.partial),
                          lambda _, p=p, why=why: self._relayer(p.key, p.header, p.hidden, why)):
            self._relayer(p.key, h, p.hidden, why)  # re-route the layer from here

    def _gather(self, key: tuple) -> _Gather:
        g = self.gathers.get(key)
        if g is None:
            g = self.gathers[key] = _Gather(key, opened=self.now())
        return g

    def _on_partial(self, frame: Frame, arrival: float) -> None:
        h = frame.header
        key = (int(h.request), int(h.token), int(h.layer), int(h.seq))
        g = self.gathers.get(key)
        if g is None and (self._stale(key)):
            return
        g = self._gather(key)
        g.partials[int(h.src)] = (frame.tensor().clone(), float(h.t_origin), float(h.t_send),
                                  (arrival - self.t0) / self.T, int(h.part) | (int(h.n_parts) << 8))
        self._maybe_complete(g)

    def _stale(self, key: tuple) -> bool:
        rid, tok, layer, seq = key
        return any(k[:3] == (rid, tok, layer) and k[3] > seq for k in self.gathers)

    # -- the aggregator: finish the layer -------------------------------------------------
    def _maybe_complete(self, g: _Gather) -> None:
        h = g.header
        if h is None or len(g.partials) < h.n_parts:
            return
        del self.gathers[g.key]
        rid, tok, layer, seq = g.key
        for old in [k for k in self.gathers if k[:3] == (rid, tok, layer) and k[3] < seq]:
            del self.gathers[old]  # an abandoned attempt of this layer
        t = self.now()
        triples, stamps, rctx = self._assignment(h)
        if self.proxy is not None:
            routed = torch.zeros_like(g.hidden)
            for part in g.partials.values():
                routed += part[0]
            out = self.proxy.combine(int(h.layer), g.hidden, routed)
        else:
            out = g.hidden.clone()
            for part in g.partials.values():
                out += part[0]
            out = out / out.pow(2).mean().clamp_min(1e-12).sqrt()
        theta = int(h.residing)
        gpus = [True] * len(triples)
        for n, (_, _, _, _, bits) in g.partials.items():
            mask, seen = bits & 0xFF, bits >> 8
            for j in range(len(triples)):
                if seen >> j & 1:
                    gpus[j] = bool(mask >> j & 1)
        fo_end = max(p[1] for p in g.partials.values())
        comp_end = max(p[2] for p in g.partials.values())
        t_disp = float(h.t_send)
        remote_parts = [n for n in g.partials if n != theta]
        n_bytes = self.hidden_bytes * (len(remote_parts) + sum(1 for n in g.partials if n != self.rank))
        last = int(h.layer) == self.L - 1
        if last and int(h.home) != self.rank:
            n_bytes += self.hidden_bytes
        view_age_us, err_us, decision_us = stamps
        a = Assignment(tuple(e for e, _, _ in triples), tuple(r for _, r, _ in triples),
                       tuple(m for _, _, m in triples), self.rank)
        dq = self.core.increment(a.targets, a.replicas)  # derived here too, not read off the wire
        routed = Routed(a, {}, decision_us * 1e-6, view_age_us * 1e-6, err_us * 1e-6, dq)
        tv = TokenView(int(h.request), int(h.token), int(h.home), 0.0, server=theta,
                       layer=int(h.layer))
        rec = self.core.record(tv, routed, gpus, float(h.t_origin), t_disp - decision_us * 1e-6,
                               t_disp, fo_end, comp_end, t, n_bytes, len(g.partials), self.view.window)
        self.writer.token_layer(rec)
        self.stats["token_layers"] += 1
        self.decider.on_layer_done(rec)  # recorded (and fed back) where the layer aggregates
        lam = float(h.lam_acc) + dq
        nxt = Header(MsgType.TOKEN, request=h.request, seq=h.seq, token=h.token, layer=int(h.layer) + 1,
                     home=h.home, residing=self.rank, src=self.rank, lam_acc=lam, t_origin=t,
                     ctx=rctx)
        if not last:
            self._begin_layer(nxt, out, rctx)
            return
        final = Header(MsgType.TOKEN, flags=Flag.FINAL, request=h.request, seq=h.seq, token=h.token,
                       layer=self.L, home=h.home, residing=self.rank, src=self.rank, lam_acc=lam,
                       t_origin=t, t_send=t, dtype=DType.FLOAT32, shape=(self.d,))
        why = f"home {self.setup.cluster.names[int(h.home)]} unreachable"
        if not self._send(int(h.home), self._hidden_frame(final, out),
                          lambda _, final=final, why=why: self._token_failed(final, why)):
            self._token_failed(final, why)

    def _reroute(self, g: _Gather, why: str) -> None:
        """A participant or partial is lost: route the layer again from here."""
        self.gathers.pop(g.key, None)
        if g.header is not None:
            self._relayer(g.key, g.header, g.hidden, why)

    def _relayer(self, key: tuple, h: Header, hidden: torch.Tensor | None, why: str) -> None:
        """Route attempt ``key`` (HIDDEN header ``h``, its state) again from this server, once;
        the third loss of one layer fails the token, as in the simulator."""
        if key in self.relayered or hidden is None or self.stopping:
            return
        self.relayered.add(key)
        self.gathers.pop(key, None)
        if int(h.mode) >= 2:
            self._token_failed(h, why)
            return
        self.stats["retries"] += 1
        base = Header(MsgType.TOKEN, request=h.request, seq=h.seq, token=h.token, layer=h.layer,
                      home=h.home, residing=self.rank, src=self.rank, lam_acc=h.lam_acc,
                      t_origin=h.t_origin)
        _, _, rctx = self._assignment(h)
        self._decide(base, hidden, rctx, float(h.t_origin), int(h.mode) + 1)

    # -- tokens back home ---------------------------------------------------------------
    def _on_token(self, frame: Frame) -> None:
        h = frame.header
        rq = self.requests.get(int(h.request))
        if rq is None or rq.done or int(h.token) in rq.finished:
            return
        rq.finished.add(int(h.token))
        if self.proxy is not None:
            rq.scores[int(h.token)] = self.proxy.score(rq.rid, int(h.token), frame.tensor())
        nxt = rq.token_done(int(h.token), float(h.lam_acc), self.now())
        if nxt == FINISHED:
            self._request_done(rq, "ok", "")
        elif nxt is not None:
            self._start_token(rq, nxt)

    def _token_failed(self, h: Header, reason: str) -> None:
        self.stats["failed_tokens"] += 1
        home = int(h.home)
        if home == self.rank:
            rq = self.requests.get(int(h.request))
            if rq is not None:
                self._request_failed(rq, reason)
            return
        frame = fail_frame(self.rank, home, int(h.request), int(h.token), reason)
        if not (self.reachable[home] and self._send(home, frame, lambda _: self._relay_fail(frame))):
            self._relay_fail(frame)

    def _relay_fail(self, frame: Frame) -> None:
        """The home cannot be reached from here: hand the FAIL to a peer that forwards it."""
        home = int(frame.header.home)
        for peer in range(self.N):
            if peer not in (self.rank, home) and self.reachable[peer] and self._send(peer, frame):
                self.stats["fails_relayed"] += 1
                return
        self._log(f"FAIL of request {frame.header.request} cannot reach its home {home}")

    def _on_fail(self, frame: Frame) -> None:
        h = frame.header
        reason = fail_reason(frame) or f"token failed at server {h.src}"
        if int(h.home) != self.rank:  # relayed: forward to the home
            if h.src != self.rank and self.reachable[int(h.home)]:
                out = fail_frame(self.rank, int(h.home), int(h.request), int(h.token), reason)
                self._send(int(h.home), out)
            return
        rq = self.requests.get(int(h.request))
        if rq is not None:
            self._request_failed(rq, reason)

    def _request_failed(self, rq: _Request, reason: str) -> None:
        if not rq.done:
            self._request_done(rq, "failed", reason)

    def _request_done(self, rq: _Request, status: str, reason: str) -> None:
        rq.done = True
        t = self.now()
        lam_mean, lam_max = rq.lam_stats()
        self.writer.request(rq.row(rq.rid, rq.user, self.rank, rq.arrival, t, status, reason))
        if self.proxy is not None and status == "ok":
            sc = [rq.scores[i] for i in sorted(rq.scores)]
            self.inrun_file.write(json.dumps({
                "request": rq.rid, "arrival_s": rq.arrival, "tokens": len(sc),
                "lam_mean": lam_mean, "lam_max": lam_max,
                "kl_tokens": [s[0] for s in sc], "ce_ref_tokens": [s[1] for s in sc],
                "ce_run_tokens": [s[2] for s in sc]}) + "\n")
            self.inrun_file.flush()  # a killed run keeps every finished request
        self.decider.on_request_done(rq.rid)
        print(f"DONE {rq.rid}", flush=True)
        self.pending_home -= 1
        if self.pending_home == 0:
            print("HOMEDONE", flush=True)

    # -- prefetch copies (online caches) ----------------------------------------------------
    def _prefetch(self, replicas) -> None:
        """Copies into this server's GPU on its copy engine (local replicas only)."""
        t = time.monotonic()
        free = getattr(self, "_copy_free", 0.0)
        for r in replicas:
            if self.dep.replicas[r].server != self.rank:
                continue
            start = max(t, free)
            free = start + self._load_of(r) * self.T
            self.loop.call_at(free, self.residency.on_prefetched, r)
        self._copy_free = free

    def close(self) -> dict:
        self.writer.close()
        if self.proxy is not None:
            self.inrun_file.close()
        st = self.stream.stats
        late = np.array(st.late) if st.late else np.zeros(1)
        svc = np.array(st.service) if st.service else np.zeros((1, 2))
        rel = svc[:, 1] / np.maximum(svc[:, 0], 1e-12)
        return {**self.stats, "rank": self.rank, "batches": st.batches, "jobs": st.jobs,
                "dq_misreported": self.core.dq_misreported,
                "kernel_errors": st.kernel_errors,
                "cpu_s": time.process_time(), "cpu_run_s": getattr(self, "cpu_run_s", None),
                "release_late_p50_ms": float(np.percentile(late, 50) * 1e3),
                "release_late_p99_ms": float(np.percentile(late, 99) * 1e3),
                "release_late_max_ms": float(late.max() * 1e3),
                "late_over_tolerance": int((late > RELEASE_LATE_REL * np.maximum(svc[:, 0] * self.T, 1e-4)).sum()),
                "service_ratio_p50": float(np.median(rel)), "service_ratio_p99": float(np.percentile(rel, 99)),
                "decisions": len(self.decision_cpu),
                "decision_cpu_us_mean": float(np.mean(self.decision_cpu) * 1e6) if self.decision_cpu else 0.0,
                "decision_cpu_us_p99": float(np.percentile(self.decision_cpu, 99) * 1e6)
                if self.decision_cpu else 0.0,
                "max_silence_windows": [round(g / (self.window * self.T), 3) for g in self.max_gap],
                "wire_errors": self.net.wire_errors, "auth_failures": self.net.auth_failures,
                "spoofed_frames": self.net.spoofed_frames, "bytes_sent": self.net.sent_bytes,
                "delivery_late_mean_ms": self.net.late_deliveries / max(1, self.net.frames_in) * 1e3}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--htr-worker", dest="config", required=True)
    args = ap.parse_args(argv)
    die_with_parent()  # SIGKILL when the runner exits, however it exits (Mininet's
    # `mnexec -da` execs without forking, so the runner is the parent)
    sys.setswitchinterval(0.0005)
    cfg = WorkerConfig.load(args.config)
    worker = Worker(cfg)
    loop = precise_loop()
    asyncio.set_event_loop(loop)
    prof = None
    if os.environ.get("HTR_PROFILE_WORKER") == str(cfg.rank):  # opt-in, for development
        import cProfile
        prof = cProfile.Profile()
        prof.enable()
    try:
        loop.run_until_complete(worker.run())
    finally:
        if prof is not None:
            prof.disable()
            prof.dump_stats(str(Path(cfg.run_dir, "workers", f"w{cfg.rank}.prof")))
        stats = worker.close()
        Path(cfg.run_dir, "workers").mkdir(parents=True, exist_ok=True)
        Path(cfg.run_dir, "workers", f"w{cfg.rank}.json").write_text(json.dumps(stats, indent=1))
        try:
            worker.net.close()
        except AttributeError:
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
