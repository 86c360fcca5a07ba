"""One emulated server: ``python -m testbed.emu.worker --htr-worker CONFIG.json``.

Runs inside its Mininet host. It rebuilds the run's setup from the spec and runs
the deployment the runner placed (``deployment.json`` in the run folder, so every
worker and the runner hold the same one), hosts its replicas as real scaled-down experts and
serves tokens exactly as the simulator models them. What it does is split by
concern under ``testbed/emu/node/``: the residing server routes and fans out
(``routing``), participants compute on the modeled GPU stream (``compute``),
the aggregator sums, records and hands the token on (``aggregation``), peers
exchange window state and acknowledgements (``peers``), losses are resolved
where the hidden state is, or at the home from its custody reports (``faults``),
requests advance at their home
(``requests``), ``quality.inrun`` runs the trained proxy (``inrun``), and under causal
attention a token waits for, and fetches, its request's earlier K/V (``kv``).
Times are reported in emulated seconds (wall / T).

Protocol with the runner, one line each on stdin/stdout: the worker prints
``READY``; the runner sends ``START <t0>`` (a monotonic time shared by all
hosts of the machine); the worker prints ``DONE <request>`` per finished
home request and ``HOMEDONE`` after its last one; the runner sends ``STOP``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import yaml

from hetroute.state import StateView

from ..collector import GcPauses, freeze_more, quiet_collector
from ..core import TokenLayerCore, calibrate_decision_s
from ..kv_spill import server_room, spill_stats
from ..lifecycle import die_with_parent
from ..records import RecordWriter
from ..setup import build_setup
from ..spec import parse_spec
from ..steps import StepScheduler, step_row
from ..tcp import hold_clocks, warm_up
from .experts import ExpertBank, ExpertSpec
from .node.aggregation import Aggregation
from .node.compute import Compute
from .node.faults import Faults
from .node.inrun import InrunQuality
from .node.kv import KvExchange
from .node.peers import Peers
from .node.requests import Requests
from .node.routing import Routing
from .rendezvous import rendezvous
from .stream import ModeledStream
from .tolerances import RELEASE_LATE_REL
from .transport import Transport, precise_loop
from .wire import warm_codec


@dataclass
class WorkerConfig:
    rank: int
    run_dir: str
    spec_file: str
    deployment_file: str  # the runner's placement (testbed.setup.save_deployment)
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
    trace_steps: bool = False  # ``run --trace-steps``: every step's composition to steps/

    @classmethod
    def load(cls, path: str) -> "WorkerConfig":
        d = json.loads(Path(path).read_text())
        d["peers"] = {int(k): tuple(v) for k, v in d["peers"].items()}
        return cls(**d)


class Worker(Peers, Routing, Aggregation, Compute, Faults, Requests, KvExchange):
    """The setup, the clocks, start-up and the final statistics; the rest is in the mixins."""

    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        self.rank = cfg.rank
        self.gc_pauses = GcPauses()
        spec = parse_spec(yaml.safe_load(Path(cfg.spec_file).read_text()), cfg.spec_file)
        self.spec = spec
        self.setup = build_setup(spec, Path(cfg.spec_file).parent, deployment_file=Path(cfg.deployment_file))
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
        #: quality.inrun: the proxy's real hidden states and trained experts
        self.inrun = InrunQuality(spec, s, cfg.run_dir, self.rank, reps) if spec.quality.inrun else None
        if self.inrun is not None:
            self.bank, self.d = self.inrun.bank, self.inrun.d
        else:
            d = cfg.expert_d_model
            self.bank = ExpertBank(ExpertSpec(d_model=d, d_ff=3 * d, activation=act, seed=spec.seed), reps)
            self.d = d
        sh = s.shape
        #: decide/admit/record/feedback, shared with the simulator
        self.core = TokenLayerCore(s.router, self.dep, s.cluster, sh, spec.physics, s.quality)
        self.hardware = spec.physics == "hardware"
        #: ``engine.dispatch: step``: a step's tokens and partials leave together (routing.py)
        self.step_dispatch = self.hardware and spec.engine.dispatch == "step"
        self.dense_s = self.core.world.dense_s(self.rank, 1)  # physics: paper (a delay)
        self.hidden_bytes = sh.hidden_bytes
        #: one hidden state's message on the wire, as the simulator charges it
        self.wire_bytes = sh.hidden_bytes + spec.sim.header_bytes
        #: ``net.transport: tcp`` with the transport delay line: this sender's window per
        #: peer, whose waits its data frames carry (``hold_s``); with netem the kernel's
        #: own TCP sees the delay and nothing is added
        self.holds = (hold_clocks(spec.net.params(), s.cluster.bandwidth, s.cluster.delay,
                                  spec.sim.payload_efficiency, self.rank,
                                  sh.hidden_bytes + spec.sim.header_bytes)
                      if spec.tcp_windows and any(cfg.delays_in)
                      else None)
        self.view = StateView(self.N)
        self.writer = RecordWriter(Path(cfg.run_dir), self.k, part_prefix=f"w{self.rank}-",
                                   trace_steps=cfg.trace_steps)
        self.stats = {"frames_out": 0, "token_layers": 0, "retries": 0, "failed_tokens": 0,
                      "resolved_unacked": 0, "fails_relayed": 0, "feedback_unmatched": 0,
                      "handler_errors": 0}
        self.stopping = False
        #: ``engine.kv_overflow: spill``: this server's K/V cache held to its room
        #: (testbed/kv_spill.py); its STATE frames name the requests home here that finished
        #: since the last (``Peers.kv_finished``), which frees the peers' K/V
        self.kv_room = (server_room(self.setup.cluster, self.setup.shape,
                                    self.spec.memory.gpu_share, self.rank)
                        if self.hardware and self.spec.engine.kv_overflow == "spill" else None)
        self._init_peers()
        self._init_faults()
        self._init_routing()
        self._init_aggregation()
        self._init_compute()
        self._init_requests()
        self._init_kv()

    # -- clocks ------------------------------------------------------------------
    def now(self) -> float:
        """Emulated seconds since the run started."""
        return (time.monotonic() - self.t0) / self.T

    def wall(self, t_model: float) -> float:
        return self.t0 + t_model * self.T

    def _link_s_per_byte(self) -> dict[int, float]:
        """Wall seconds a byte of a frame takes on each outgoing link, shaped at B/T with
        TCP/IP's framing (the simulator's ``msg / (B x payload efficiency)``, dilated)."""
        bw, eff = self.setup.cluster.bandwidth, self.spec.sim.payload_efficiency
        return {n: self.T / (bw[self.rank][n] * eff) for n in range(self.N) if n != self.rank}

    def _ack_s_per_frame(self) -> dict[int, float]:
        """Wall seconds the model's link to each peer carries in ACKs per data frame the
        peer sends this worker (``net.ack_every``; the simulator's ``ack_s``, dilated)."""
        per_byte = self.spec.ack_bytes_per_byte
        if per_byte <= 0:
            return {}
        bw = self.setup.cluster.bandwidth
        return {n: self.wire_bytes * per_byte * self.T / bw[self.rank][n]
                for n in range(self.N) if n != self.rank}

    # -- start-up ------------------------------------------------------------------
    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self.loop = loop
        loop.set_exception_handler(self._callback_error)
        eng = self.spec.engine
        prec = [r.precision for r in self.dep.replicas]
        sched = StepScheduler(self.core.world, self.rank, prec.__getitem__, self.residency.is_gpu,
                              scope="layer" if self.hardware else "replica",
                              max_batch_tokens=eng.max_batch_tokens, hold_s=eng.hold_s,
                              on_execute=self.residency.on_execute,
                              moe_kernels=eng.moe_kernels, load_overlap=eng.load_overlap,
                              prefetch_link=eng.prefetch_link, kv=self.kv_room)
        sched.copy.notify = self._landing  # a prefetch a step's load moved lands when it ends
        trace = self.writer.step if self.writer.st is not None else None
        self.stream = ModeledStream(loop, self.T, sched, self.bank.run, self._job_done, self.now,
                                    self.wall, self._log,
                                    self._flush_step if self.step_dispatch or self.causal else None,
                                    on_step=None if trace is None else
                                    (lambda step: trace(step_row(self.rank, step, prec.__getitem__))),
                                    on_step_ran=self._step_ran)
        if self.cfg.rendezvous is not None:  # peers from the store, not from the config
            host, port = self.cfg.rendezvous
            peers, self._store, secret = await loop.run_in_executor(
                None, lambda: rendezvous(self.rank, self.cfg.world, host, port, self.cfg.port,
                                         self.cfg.listen, bytes.fromhex(self.cfg.secret)))
            self.cfg.peers = peers
        else:
            secret = bytes.fromhex(self.cfg.secret)
        self.net = Transport(self.rank, self.cfg.port, self.cfg.peers, self.cfg.delays_in,
                             self._on_frame, self._peer_lost, secret, log=self._log,
                             hold_scale=self.T if self.holds is not None else 0.0,
                             absorb_late=self.spec.emu.late_writes == "absorbed",
                             link_s_per_byte=self._link_s_per_byte(),
                             kernel_stamps=self.spec.emu.arrivals == "kernel",
                             socket_buffer=self.spec.emu.socket_buffer_bytes,
                             control_bytes=self.spec.sim.header_bytes,
                             ack_s_per_frame=self._ack_s_per_frame(),
                             data_frame_bytes=self.wire_bytes, on_heard=self._heard)
        await self.net.start()
        _ = self.bank.run(next(iter(self.bank.replicas)), torch.zeros(1, self.d)) \
            if self.bank.replicas else None  # warm the kernels up
        self.router_warmup_s = warm_router(self.setup.router, self.setup.shape.n_layers)
        self.routing_warmup_s = self._warm_routing()  # every request's trace routing, ahead
        t_wire = time.perf_counter()
        warm_codec(self.d, self.wire_bytes)  # the frames' first builds (wire.warm_codec)
        self.wire_warmup_s = time.perf_counter() - t_wire
        # the window's compiled kernel too: its first load held the first message back
        self.tcp_warmup_s = warm_up(self.spec.net.params()) if self.holds is not None else 0.0
        print("READY", flush=True)
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line.startswith("START"):
            raise RuntimeError(f"expected START, got {line!r}")
        self.t0 = float(line.split()[1])
        self.cpu_at_start = time.process_time()
        freeze_more()  # the start-up's objects too (a full collection walked them: 14-50 ms)
        self.gc_pauses.install()  # collections during the run stall this loop (wall time)
        # silence counts from the first window, when the first STATE frames are sent
        self.last_heard = [self.wall(self.window)] * self.N
        # window 0 from the start, as the simulator's views (hetroute.state: -1 is "none yet")
        self.view.refresh(0, 0.0, [0.0] * self.N, list(self.reachable))
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
                      f"(states {[g.msg is not None for g in list(self.gathers.values())[:10]]}, "
                      f"partials {[sorted(g.partials) for g in list(self.gathers.values())[:10]]}); "
                      f"participations {list(self.parts)[:10]}; "
                      f"stream queue {[(r, len(j)) for r, j in self.stream.queue.items()][:10]}, "
                      f"busy {self.stream.busy}")

    def _callback_error(self, loop, context: dict) -> None:
        """A scheduled step (a decision, a dispatch, an arrival) raised: an emulator bug that
        loses its token, counted as a frame handler's error is (``handler_errors``)."""
        self.stats["handler_errors"] += 1
        loop.default_exception_handler(context)

    def _log(self, msg: str) -> None:
        print(f"[w{self.rank}] {msg}", file=sys.stderr, flush=True)

    def close(self) -> dict:
        self.gc_pauses.remove()
        self.writer.close()
        if self.inrun is not None:
            self.inrun.close()
        st = self.stream.stats
        t0 = getattr(self, "t0", 0.0)  # none where the run failed before START (nor samples)
        late = np.array(st.late) if st.late else np.zeros(1)
        svc = np.array(st.service) if st.service else np.zeros((1, 2))
        rel = svc[:, 1] / np.maximum(svc[:, 0], 1e-12)
        kern = np.array(st.kernel) if st.kernel else np.zeros((1, 2))
        # the real kernels' wall time as a share of the step's padding T x modeled
        use = kern[:, 1] / np.maximum(kern[:, 0] * self.T, 1e-12)
        return {**self.stats, "rank": self.rank, "batches": st.batches, "jobs": st.jobs,
                **(spill_stats([self.kv_room]) if self.kv_room is not None else {}),
                **self.gc_pauses.stats(),
                "dq_misreported": self.core.dq_misreported,
                "kernel_errors": st.kernel_errors,
                "cpu_s": time.process_time(), "cpu_run_s": getattr(self, "cpu_run_s", None),
                "release_late_p50_ms": float(np.percentile(late, 50) * 1e3),
                "release_late_p99_ms": float(np.percentile(late, 99) * 1e3),
                "release_late_max_ms": float(late.max() * 1e3),
                # the largest lateness of each kind, [wall ms, model ms since the start] each:
                # when in the run this worker's loop stalled
                **{f"worst_{name}": w.report(t0, self.T) for name, w in (
                    ("release_late", st.worst_late), ("write_late", self.net.worst_written),
                    ("after_model", self.net.worst_after_model))},
                "late_over_tolerance": int((late > RELEASE_LATE_REL * np.maximum(svc[:, 0] * self.T, 1e-4)).sum()),
                "service_ratio_p50": float(np.median(rel)), "service_ratio_p99": float(np.percentile(rel, 99)),
                "kernel_wall_ms_p50": float(np.median(kern[:, 1]) * 1e3),
                "kernel_wall_ms_p99": float(np.percentile(kern[:, 1], 99) * 1e3),
                "kernel_padding_share_p50": float(np.median(use)),
                "kernel_padding_share_p99": float(np.percentile(use, 99)),
                "kernel_over_padding": int((use > 1.0).sum()),
                "jobs_missed_step": st.missed,
                # steps whose layer or job order by model arrival (the rule) differs from the
                # order this loop submitted their jobs in (steps.py, ``order_swaps``)
                "steps_reordered_by_arrival": self.stream.sched.order_swaps,
                "missed_late_ms_p50": float(np.median(st.missed_late) * 1e3) if st.missed_late else 0.0,
                "missed_late_ms_p99": float(np.percentile(st.missed_late, 99) * 1e3)
                if st.missed_late else 0.0,
                "decisions": len(self.decision_cpu),
                "router_warmup_ms": getattr(self, "router_warmup_s", 0.0) * 1e3,
                "routing_warmup_ms": getattr(self, "routing_warmup_s", 0.0) * 1e3,
                "wire_warmup_ms": getattr(self, "wire_warmup_s", 0.0) * 1e3,
                "tcp_warmup_ms": getattr(self, "tcp_warmup_s", 0.0) * 1e3,
                "decision_cpu_us_mean": float(np.mean(self.decision_cpu) * 1e6) if self.decision_cpu else 0.0,
                "decision_cpu_us_p99": float(np.percentile(self.decision_cpu, 99) * 1e6)
                if self.decision_cpu else 0.0,
                **{f"hop_{name}_ms_{q}": float(np.percentile(v, qv) * 1e3) if v else 0.0
                   for name, v in (("dispatch", self.hop_dispatch), ("partial", self.hop_partial),
                                   ("queue", self.hop_queue))
                   for q, qv in (("p50", 50), ("p99", 99))},
                "max_silence_windows": [round(g / (self.window * self.T), 3) for g in self.max_gap],
                "wire_errors": self.net.wire_errors, "auth_failures": self.net.auth_failures,
                "spoofed_frames": self.net.spoofed_frames, "bytes_sent": self.net.sent_bytes,
                "bytes_sent_to": {str(d): b for d, b in self.net.sent_bytes_to.items()},
                "writes_to": {str(d): b for d, b in self.net.writes_to.items()},
                "segments_to": {str(d): b for d, b in self.net.segments_to.items()},
                "delivery_late_mean_ms": self.net.late_deliveries / max(1, self.net.frames_in) * 1e3,
                # wall ms per data frame: how late this worker's own left their links (and that
                # less their write lateness), and how late the received ones left theirs, split
                # into what the delay line absorbed and not
                **{f"write_late_ms_{q}": float(np.percentile(self.net.late_written, qv) * 1e3)
                   if self.net.late_written else 0.0 for q, qv in (("p50", 50), ("p99", 99), ("max", 100))},
                "write_late_vs_write_mean_ms": self.net.late_vs_write
                / max(1, len(self.net.late_written)) * 1e3,
                "write_late_absorbed_mean_ms": self.net.late_absorbed
                / max(1, self.net.data_frames_in) * 1e3,
                "write_late_exposed_mean_ms": self.net.late_exposed
                / max(1, self.net.data_frames_in) * 1e3,
                # received data frames whose bytes came before the model's link had sent them
                # (a shaper's burst), held to the model's instant: how many, and wall ms per
                # data frame received
                "early_held": self.net.early_held,
                "early_held_mean_ms": self.net.early_held_s / max(1, self.net.data_frames_in) * 1e3,
                # per read of a peer's bytes: wall ms from the kernel's receipt to the loop's
                # read (the worker busy elsewhere), which ``emu.arrivals: kernel`` keeps off
                # the frames' arrival; per data frame not held, how long after the model's
                # instant the delay line handed it on
                **{f"{name}_ms_{q}": float(np.percentile(v, qv) * 1e3) if v else 0.0
                   for name, v in (("read_wait", self.net.read_waits),
                                   ("after_model", self.net.after_model))
                   for q, qv in (("p50", 50), ("p99", 99), ("max", 100))},
                # the connections' socket buffers as the kernel reports them (bytes)
                **{f"{k}_bytes": v for k, v in self.net.buffers.items()}}


def warm_router(router, layers: int) -> float:
    """Run a few decisions of the router before the run starts; returns their CPU seconds.

    A router's first decision in a process can cost far more than the rest: HetRoute's
    numba kernel compiles or loads its cache then, 136-306 ms of CPU per worker measured on
    paper10. Under ``engine.decision_s: measured`` the emulator charges that to the
    server's modeled CPU (not divided by T) and every decision queued behind it; under the
    default constant it would still stall the worker's loop in the first window. The
    simulator's process has made its calibration decisions before its run starts, so its
    first decision costs what the others do. The decisions here are made by a fresh
    instance (``calibrate_decision_s``), so the run's deciders keep their state."""
    t0 = time.thread_time()
    calibrate_decision_s(router, samples=max(1, layers), repeats=1)
    return time.thread_time() - t0


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
        # torch's and the set-up's objects out of every collection (a full one walked them
        # for 175-231 ms of wall time); young collections stay short and frequent.
        # HTR_WORKER_GC=default keeps Python's behaviour, for comparison (README)
        quiet = os.environ.get("HTR_WORKER_GC") != "default"
        with quiet_collector(young=None) if quiet else nullcontext():
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
