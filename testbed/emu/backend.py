"""The emulation backend: one run on Mininet hosts with real workers and sockets.

The runner (this process, as root) has already placed the deployment; it writes
it to the run folder (``deployment.json``) and each worker, rebuilding the rest of
the setup from the same spec, runs that deployment. Then it builds the network
at dilation T, starts one worker per host, gives them a common start time on
the machine's monotonic clock, injects the spec's faults at their (dilated)
times, follows progress, stops the workers and reconciles the records: a
request that no worker recorded (its home died) is written as failed, so no
request is silently lost. ``fidelity.json`` beside the records holds the
run's fidelity table (tc read-back and counters, stream release lateness,
CPU load, delay mechanism).
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
from tqdm import tqdm

from ..progress import RequestProgress
from ..records import RecordWriter, read_records
from ..setup import RunSetup, save_deployment
from ..tcp import MSS_BYTES
from .dilation import choose_dilation
from .hosts import EmulatedNetwork
from .hosts.names import WORKER_MARK
from .hosts.readback import tc_classes
from .tolerances import (CPU_SATURATED_PCT, KERNEL_OVER_NOISE, MISSED_STEP_REL, RATE_READBACK_REL,
                         RELEASE_LATE_REL)

STORE_PORT = 29400  # torch.distributed TCPStore on rank 0
BASE_PORT = 47000


class EmuBackend:
    def __init__(self, setup: RunSetup, writer: RecordWriter, progress: bool = False) -> None:
        if writer.out_dir is None:
            raise ValueError("the emulator needs a results folder")
        self.s, self.writer, self.progress = setup, writer, progress
        self.out = Path(writer.out_dir)
        self.timers: list[threading.Timer] = []

    def run(self) -> dict:
        s, spec, out = self.s, self.s.spec, self.out
        cl = s.cluster
        T, why = choose_dilation(s)
        if spec.quality.inrun:  # workers load the trace's proxy; train it here if the cache lacks it
            from workloads.proxy.data import load_corpus  # lazy: torch (~1 s), only for inrun
            from workloads.proxy.trace import trace_proxy
            trace_proxy(Path(spec.workload.trace), load_corpus())
        deployment_file = out / "deployment.json"  # every worker runs this placement
        save_deployment(deployment_file, s.deployment, s.router.placement_report)
        spec_file = out / "spec.resolved.yaml"
        if not spec_file.exists():
            spec_file.write_text(spec.to_yaml())
        frac = spec.emu.cpu_fraction
        # 'auto': each worker may use at most one core (Mininet's fraction is of the
        # whole machine); a cap that isolates hosts without freezing a busy one
        cpu_fraction = 1.0 / (os.cpu_count() or 1) if frac == "auto" else float(frac)
        wdir = out / "workers"
        wdir.mkdir(parents=True, exist_ok=True)
        stats: dict = {"dilation": T, "dilation_reason": why, "cpu_fraction": cpu_fraction}
        with EmulatedNetwork(cl, dilation=T, delay_mechanism=spec.emu.delay_mechanism,
                             cpu_fraction=cpu_fraction) as net:
            stats["delay_mechanism"] = net.mechanism
            stats["congestion_control"] = net.congestion_control
            delays = net.transport_delays()
            procs, lines = [], queue.Queue()
            for rank in range(cl.n):
                cfg = {"rank": rank, "run_dir": str(out), "spec_file": str(spec_file),
                       "deployment_file": str(deployment_file), "port": BASE_PORT,
                       "peers": {}, "world": cl.n,  # peers come from the rendezvous
                       "rendezvous": [net.addr(rank, 0) if rank else net.addr(1, 0), STORE_PORT],
                       "listen": {str(p): net.addr(p, rank) for p in range(cl.n) if p != rank},
                       "delays_in": [delays[src][rank] for src in range(cl.n)], "dilation": T,
                       "expert_d_model": spec.emu.expert_d_model, "faults": bool(spec.faults),
                       # ``run --trace-steps``: each worker writes its stream's steps
                       "trace_steps": self.writer.st is not None}
                path = wdir / f"w{rank}.config.json"
                path.write_text(json.dumps(cfg))
                log = open(wdir / f"w{rank}.log", "w")
                p = net.popen(rank, [sys.executable, "-m", "testbed.emu.worker", WORKER_MARK, str(path)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                              bufsize=1, cwd=str(Path(__file__).resolve().parents[2]))
                procs.append(p)
                threading.Thread(target=_pump, args=(rank, p, lines), daemon=True).start()
            try:
                stats.update(self._drive(net, procs, lines, T))
            finally:  # workers first (so their cgroups empty), then read, then the network
                for t in self.timers:
                    t.cancel()
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                for p in procs:
                    try:
                        p.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        pass
                if net.gso_unlimited:
                    stats["gso_unlimited"] = list(net.gso_unlimited)
                try:
                    stats["links"] = _link_table(net)
                except Exception as err:  # noqa: BLE001 - never mask why the run ended
                    stats["links"] = {"error": f"{type(err).__name__}: {err}"}
        stats.update(self._reconcile())
        stats["workers"] = [json.loads(f.read_text()) for f in sorted(wdir.glob("w*.json"))
                            if not f.name.endswith("config.json")]
        if isinstance(stats.get("links"), list):
            stats["wire"] = wire_accounting(stats["links"], stats["workers"])
        for key in ("tcp_waits", "tcp_wait_s", "handler_errors"):  # summed over workers
            stats[key] = sum(w.get(key, 0) for w in stats["workers"])
        if spec.engine.kv_overflow == "spill":  # the simulator's counters (testbed/kv_spill.py)
            for key in ("kv_written", "kv_spill_steps", "kv_spill_bytes", "kv_spill_s",
                        "kv_state_frees"):
                stats[key] = sum(w.get(key, 0) for w in stats["workers"])
            stats["kv_spill_servers"] = sum(1 for w in stats["workers"] if w.get("kv_spill_steps"))
            stats["kv_ledger_peak_mb"] = max((w.get("kv_ledger_peak_mb", 0.0) for w in stats["workers"]),
                                             default=0.0)
        if spec.engine.attention == "causal":  # the simulator's counters (node/kv.py)
            for key in ("kv_waits", "kv_asks", "kv_notices", "kv_fetches", "kv_bytes"):
                stats[key] = sum(w.get(key, 0) for w in stats["workers"])
        fid = fidelity_summary(stats)
        stats["fidelity_flags"] = fid["flags"]
        (out / "fidelity.json").write_text(json.dumps({**fid, "detail": stats}, indent=1, default=str))
        return {k: v for k, v in stats.items() if k not in ("links", "workers")}

    def _drive(self, net, procs, lines: queue.Queue, T: float) -> dict:
        s, spec = self.s, self.s.spec
        N = len(procs)
        ready = set()
        deadline = time.monotonic() + 300
        while len(ready) < N:
            try:
                rank, line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"workers not ready after 300 s: {sorted(set(range(N)) - ready)}")
            if line is None:
                raise RuntimeError(f"worker {rank} exited before READY (see workers/w{rank}.log)")
            if line == "READY":
                ready.add(rank)
        t0 = time.monotonic() + 1.0
        for p in procs:
            p.stdin.write(f"START {t0!r}\n")
            p.stdin.flush()
        dead: set[int] = set()
        for f in spec.faults:
            timer = threading.Timer(max(0.0, t0 + f.at_s * T - time.monotonic()), self._fault,
                                    args=(net, procs, f, dead))
            timer.daemon = True  # an interrupted run must not wait for a pending fault
            timer.start()
            self.timers.append(timer)
        total = len(s.requests)
        bar = tqdm(total=total, unit="req", desc=f"{spec.name} [emu T={T:g}]", disable=not self.progress)
        homedone: set[int] = set()
        n_done = 0
        cpu = []
        psutil.cpu_percent(None)
        end_of_arrivals = t0 + spec.workload.duration_s * T
        # an overloaded router would otherwise drain for (its backlog x T): cap it
        limit = end_of_arrivals + spec.emu.max_drain_s * T + 30
        last_cpu = last_progress = time.monotonic()
        while len(homedone | dead) < N:
            now = time.monotonic()
            if now > limit or (now > end_of_arrivals and now - last_progress > max(60.0, 20 * T)):
                break  # stuck: report what is in flight rather than wait forever
            try:
                rank, line = lines.get(timeout=0.5)
            except queue.Empty:
                line, rank = "", -1
            if time.monotonic() - last_cpu >= 1.0:
                cpu.append(psutil.cpu_percent(None))
                last_cpu = time.monotonic()
            if line is None:
                dead.add(rank)
            elif line.startswith("DONE"):
                n_done += 1
                last_progress = time.monotonic()
                bar.update(1)
            elif line == "HOMEDONE":
                homedone.add(rank)
        bar.close()
        wall = time.monotonic() - t0
        for p in procs:
            if p.poll() is None:
                try:
                    p.stdin.write("STOP\n")
                    p.stdin.flush()
                except (BrokenPipeError, OSError):
                    pass
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
        return {"wall_s": round(wall, 2), "emulated_s": round(wall / T, 3), "requests_done": n_done,
                "timed_out": len(homedone | dead) < N, "killed": sorted(dead),
                "cpu_percent_mean": round(sum(cpu) / len(cpu), 1) if cpu else None,
                "cpu_percent_max": max(cpu) if cpu else None}

    def _fault(self, net, procs, f, dead: set) -> None:
        names = self.s.cluster.names
        i = names.index(f.server)
        if f.kind == "kill_worker":
            procs[i].kill()
            dead.add(i)
        else:
            net.set_link(i, names.index(f.peer), up=False)

    def _reconcile(self) -> dict:
        """Every generated request gets a row: one no worker recorded failed with its home."""
        _, rq = read_records(self.out)
        have = set(rq.request) if len(rq) else set()
        missing = [r for r in self.s.requests if r.id not in have]
        if missing:
            w = RecordWriter(self.out, self.s.shape.top_k, part_prefix="runner-")
            for r in missing:
                w.request(RequestProgress(r.prompt_tokens, r.gen_tokens).row(
                    r.id, r.user, r.home, r.arrival_s, float("nan"), "failed",
                    f"no record: home {self.s.cluster.names[r.home]} did not answer within "
                    f"emu.max_drain_s={self.s.spec.emu.max_drain_s:g} s of the last arrival"))
            w.close()
        return {"requests_unrecorded": len(missing)}


def _pump(rank: int, p: subprocess.Popen, lines: queue.Queue) -> None:
    for line in p.stdout:
        lines.put((rank, line.strip()))
    lines.put((rank, None))


def _link_table(net: EmulatedNetwork) -> list[dict]:
    rows = []
    for (m, n), end in net.ends.items():
        got = tc_classes(lambda c, m=m: net.cmd(m, c), end.intf)
        cls = got.get("1:1", {})
        rows.append({"src": m, "dst": n, "intf": end.intf, "rate_bit": end.rate_bit,
                     "tc_rate_bit": cls.get("rate_bit"), "bytes": cls.get("bytes", 0),
                     "packets": cls.get("packets", 0), "drops": cls.get("dropped", 0), "delay_s": end.delay_s})
    return rows


def wire_accounting(links: list[dict], workers: list[dict]) -> dict:
    """What each link carried beyond the frames written to it: tc's link-layer bytes and
    packets of a direction against what its sender wrote there. Every packet carries its
    Ethernet, IP and TCP headers (66 bytes with timestamps); a direction's packets are its
    data segments and the pure ACKs of the opposite direction's data. Sets on each row
    ``bytes_written``, ``writes`` (system calls), ``segments`` (their full and short
    segments) and ``wire_ratio``, ``other_packets`` (packets beyond those segments: ACKs,
    and writes split further); returns the run's totals."""
    per = {(w["rank"], int(d)): (b, w.get("writes_to", {}).get(d, 0), w.get("segments_to", {}).get(d, 0))
           for w in workers for d, b in w.get("bytes_sent_to", {}).items()}
    keys = ("tc_bytes", "bytes_written", "packets", "writes", "segments", "other_packets")
    tot = dict.fromkeys(keys, 0)
    for row in links:
        got = per.get((row["src"], row["dst"]))
        if got is None:
            continue
        b, writes, segs = got
        row.update(bytes_written=b, writes=writes, segments=segs,
                   other_packets=row.get("packets", 0) - segs,
                   wire_ratio=round(row["bytes"] / b, 4) if b else None)
        for k, v in zip(keys, (row["bytes"], b, row.get("packets", 0), writes, segs,
                               row["other_packets"])):
            tot[k] += v
    if tot["bytes_written"]:
        tot["wire_ratio"] = round(tot["tc_bytes"] / tot["bytes_written"], 4)
        tot["header_bytes_per_packet"] = round(
            (tot["tc_bytes"] - tot["bytes_written"]) / max(1, tot["packets"]), 2)
    return tot


def fidelity_summary(stats: dict) -> dict:
    """Flags for one emulated run (the table ``python -m testbed fidelity`` checks in depth)."""
    flags = []
    for row in stats.get("links", []):
        if row["drops"]:
            flags.append(f"drops on {row['intf']}: {row['drops']}")
        if row["tc_rate_bit"] and abs(row["tc_rate_bit"] / row["rate_bit"] - 1) > RATE_READBACK_REL:
            flags.append(f"{row['intf']}: tc rate {row['tc_rate_bit']} != configured {row['rate_bit']}")
    if stats.get("gso_unlimited"):
        flags.append(f"{len(stats['gso_unlimited'])} interfaces kept multi-segment packets "
                     f"(`ip link set gso_max_segs 1` failed): a burst's first packet, up to 64 kB, "
                     f"leaves ahead of the shaped rate")
    T = stats.get("dilation") or 1.0
    for w in stats.get("workers", []):
        if w.get("late_over_tolerance"):  # lateness is measured on the wall clock; / T is emulated
            p99 = w["release_late_p99_ms"]
            flags.append(f"w{w['rank']}: {w['late_over_tolerance']} releases late beyond "
                         f"{RELEASE_LATE_REL:.0%} of their service time (p99 {p99:.2f} ms of wall "
                         f"time = {p99 / T:.3f} ms emulated at T={T:g})")
        over = w.get("kernel_over_padding", 0)
        if (w.get("kernel_padding_share_p99", 0.0) > 1.0  # over 1% of steps: systematic, not a
                # preempted kernel now and then (whose late release the lateness flag reports);
                # with under 100 steps one such step is the p99, so a count floor too
                and over > max(KERNEL_OVER_NOISE, 0.01 * (w.get("batches") or 0))):
            flags.append(f"w{w['rank']}: {w['kernel_over_padding']} steps whose real kernels took "
                         f"longer than their padding T x modeled (p99 {w['kernel_padding_share_p99']:.2f} "
                         f"of it): the worker's own compute is not hidden by T")
        missed = w.get("jobs_missed_step", 0)
        if missed > max(KERNEL_OVER_NOISE, MISSED_STEP_REL * (w.get("jobs") or 0)):
            flags.append(f"w{w['rank']}: {missed} jobs ({missed / w['jobs']:.1%}) delivered "
                         f"late for the step they had arrived for (p99 "
                         f"{w['missed_late_ms_p99']:.2f} ms of wall time after its start): the "
                         f"simulator runs them in it; raise T")
        if w.get("wire_errors"):
            flags.append(f"w{w['rank']}: {w['wire_errors']} malformed frames")
        if w.get("handler_errors") or w.get("kernel_errors"):
            flags.append(f"w{w['rank']}: {w.get('handler_errors', 0)} frames or scheduled steps "
                         f"raised, {w.get('kernel_errors', 0)} kernels raised (an emulator bug: "
                         f"their tokens are lost; tracebacks in workers/w{w['rank']}.log)")
        if w.get("auth_failures") or w.get("spoofed_frames"):
            flags.append(f"w{w['rank']}: {w.get('auth_failures', 0)} connections refused "
                         f"(failed authentication), {w.get('spoofed_frames', 0)} spoofed frames dropped")
    if (stats.get("cpu_percent_max") or 0) >= CPU_SATURATED_PCT:
        flags.append(f"CPU saturated (max {stats['cpu_percent_max']}%)")
    if stats.get("timed_out"):
        flags.append("drain cap (emu.max_drain_s) reached: unfinished requests recorded as failed")
    return {"dilation": stats.get("dilation"), "delay_mechanism": stats.get("delay_mechanism"),
            "congestion_control": stats.get("congestion_control"), "flags": flags}
