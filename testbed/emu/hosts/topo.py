"""Mininet hosts joined by shaped direct links: the emulated network of one run.

One Mininet host (a network namespace) per server, a veth pair per server pair
(no switch, no controller), each pair on its own /30, so host m reaches host
n's address on their link and nothing else. Every resource carries
``names.PREFIX`` so ``cleanup`` can find leftovers by name.

Shaping, per direction, by the project itself (Mininet's TCLink applies no
shaping above 1 Gbit/s): an HTB root class on the sender's interface at
rate B/T. Burst is one dilated millisecond of traffic (at least two MTU-sized
frames) so the token bucket neither starves a 1500-byte frame at low rates nor
lets long line-rate bursts through at high ones; quantum is one MTU frame.

Delay: netem where the kernel has it (a child qdisc of the HTB class), else
"transport": the workers hold each received frame until its send time plus
the dilated one-way delay (``delays``), measured against the shared host clock.
Transport delay keeps message latency exact but does not delay TCP's own ACKs;
the run records which mechanism it used.
"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path
from dataclasses import dataclass, field

from hetroute.system import Cluster

from . import names

MTU_FRAME = 1514  # bytes on the wire for a full Ethernet frame
#: The kernel's own TCP window is kept out of the way (``_build``): under ``net.transport:
#: tcp`` the workers model the window in emulated time (``testbed/tcp.py``) and add its wait
#: to each frame, and with ``ideal`` there is none. The kernel's window runs on wall time: it
#: restarts from 10 segments after one retransmission timeout of idle (``rto_min``, 200 ms
#: of *wall* time, so 6 ms emulated at T = 32) and regrows over round trips in which ACKs
#: queue behind data on the shaped reverse link. On asym5 (Prism at 10 req/s, T = 32) that
#: put 1.8-4.8 ms of emulated time on early hidden-state hops the simulator's same hops did
#: not have; without the idle restart 0.57-1.68 ms, with this initial window as well
#: 0.15-0.78 ms (README, "The kernel's TCP window"). Segments, for ``initcwnd`` on every
#: link's route. (``initrwnd`` is left alone: with it the burst check of
#: ``tests/test_emu_shaping.py`` failed twice in the emulator suite.)
KERNEL_INIT_WINDOW = 1000
#: Linux's minimum retransmission timeout (``TCP_RTO_MIN``, 200 ms), dilated on every link's
#: route (``rto_min``): the kernel's timers run on wall time, and a receiver that has heard
#: nothing for a timeout ACKs every segment of the next 16 (quick-ACK mode). Undilated, an
#: idle of 200 ms of wall time (3 emulated ms at T = 64) was enough, and the emulator's
#: links carried 0.74 ACKs per data segment where the model's carry 0.5 (README, "ACKs on
#: the reverse link"). A lost segment's timeout is then the physical one in emulated time.
RTO_MIN_S = 0.2
#: Every host's congestion control, set in its namespace (``net.ipv4.tcp_congestion_control``
#: is per namespace, and a new one inherits the machine's). Without it the emulator ran
#: whatever the machine runs: on the machine of 2026-12-07 that was BBR, which sizes its
#: window from the smallest round trip it saw (microseconds of wall time on a veth: 142
#: segments, whatever ``initcwnd`` says), paces, and every 10 s of wall time without a new
#: minimum drops its window to 4 segments for 200 ms (PROBE_RTT). A busy connection whose
#: ACKs queue behind the reverse link's data then stalls: fastbehindslow4's Prism at 80
#: req/s (T = 127) had hidden states into its fast server 400-556 ms of wall time (3-4 ms
#: emulated) after the model's instant, and 17% fewer token-layers than the simulator by the
#: drain cap (README, "The kernel's congestion control"). Reno, the one every kernel builds
#: in and lets any namespace choose, without losses (the shaped links queue, they do not
#: drop) only grows its window from ``initcwnd``: no pacing, no probing, no HyStart. The
#: window TCP would have in emulated time is the workers' model's (``testbed/tcp.py``).
KERNEL_CONGESTION_CONTROL = "reno"


class EmulationUnavailable(RuntimeError):
    """Mininet or root is missing; the message says which, in one line."""


def require_mininet():
    import os
    if os.geteuid() != 0:
        raise EmulationUnavailable("emulation needs root (network namespaces, tc)")
    try:
        from mininet.net import Mininet  # noqa: F401
    except ImportError:
        raise EmulationUnavailable("Mininet not installed: run make setup") from None
    if subprocess.run(["which", "mnexec"], capture_output=True).returncode != 0:
        raise EmulationUnavailable("mnexec not found: run make setup (Debian package mininet)")


def netem_available() -> bool:
    """Try netem on a scratch veth in a scratch namespace."""
    ns = f"{names.PREFIX}probe"
    try:
        subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
        subprocess.run(["ip", "-n", ns, "link", "add", "p0", "type", "veth", "peer", "name", "p1"],
                       check=True, capture_output=True)
        r = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "p0", "root",
                            "netem", "delay", "1ms"], capture_output=True)
        return r.returncode == 0
    except (OSError, subprocess.CalledProcessError):
        return False
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def htb_params(rate_bps: float) -> dict:
    """tc numbers for one direction: rate in bit/s, burst and quantum in bytes."""
    burst = max(2 * MTU_FRAME, int(rate_bps / 8 * 1e-3))
    return {"rate_bit": int(rate_bps), "burst": burst, "quantum": MTU_FRAME}


@dataclass
class LinkEnd:
    host: int
    peer: int
    intf: str
    addr: str  # this end's address
    rate_bit: int  # configured egress rate after dilation
    delay_s: float  # configured one-way delay after dilation


@dataclass
class EmulatedNetwork:
    """Context manager building and tearing down one run's network."""

    cluster: Cluster
    dilation: float = 1.0
    delay_mechanism: str = "auto"  # auto | netem | transport
    cpu_fraction: float | None = None  # cgroup CPU share of the machine per host (CPULimitedHost)
    cpu_period_us: int = 10_000  # short CFS period: a throttled host waits at most this long
    ends: dict[tuple[int, int], LinkEnd] = field(default_factory=dict)
    mechanism: str = ""
    #: every host's TCP congestion control, read back after it was set (``_build``)
    congestion_control: str = ""
    #: interfaces whose packets could not be limited to one segment (``_shape``)
    gso_unlimited: list[str] = field(default_factory=list)
    _net: object = None

    def __enter__(self) -> "EmulatedNetwork":
        require_mininet()
        self._old_handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        for s in self._old_handlers:
            signal.signal(s, self._on_signal)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _on_signal(self, signum, frame) -> None:
        """Interrupt the run where it is; tearing down is left to the ``finally`` blocks
        and ``__exit__`` (workers stopped first, then the network), so nothing runs on
        hosts already gone. Further SIGINT/SIGTERM are ignored until the teardown ends."""
        for s in self._old_handlers:
            signal.signal(s, signal.SIG_IGN)
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    # -- building ----------------------------------------------------------------
    def _build(self) -> None:
        from mininet.link import Link
        from mininet.log import setLogLevel
        from mininet.net import Mininet
        from mininet.node import CPULimitedHost, Host
        setLogLevel("error")
        if self.delay_mechanism == "auto":
            self.mechanism = "netem" if netem_available() else "transport"
        else:
            self.mechanism = self.delay_mechanism
            if self.mechanism == "netem" and not netem_available():
                raise EmulationUnavailable("netem requested but this kernel has no netem")
        cl, T = self.cluster, float(self.dilation)
        host_cls = CPULimitedHost if self.cpu_fraction else Host
        net = Mininet(topo=None, build=False, controller=None, switch=None, link=Link,
                      host=host_cls, autoSetMacs=False, autoStaticArp=False, waitConnected=False)
        self._net = net
        hosts = []
        for i in range(cl.n):
            kw = {"ip": None}
            if self.cpu_fraction:
                kw["cpu"] = self.cpu_fraction
                kw["period_us"] = self.cpu_period_us
            hosts.append(net.addHost(names.host(i), **kw))
        for i in range(cl.n):
            for j in range(i + 1, cl.n):
                net.addLink(hosts[i], hosts[j], intfName1=names.intf(i, j), intfName2=names.intf(j, i))
        net.build()
        if self.cpu_fraction:
            for h in hosts:
                h.setCPUFrac(self.cpu_fraction, sched="cfs")
        for i in range(cl.n):
            for j in range(i + 1, cl.n):
                a, b = names.pair_addrs(i, j, cl.n)
                for (m, n, addr) in ((i, j, a), (j, i, b)):
                    h = hosts[m]
                    intf = names.intf(m, n)
                    _check(h.cmd(f"ip addr add {addr}/30 dev {intf} && ip link set {intf} up; echo rc=$?"))
                    rate = cl.bandwidth[m][n] * 8 / T
                    delay = cl.delay[m][n] * T
                    self.ends[(m, n)] = LinkEnd(m, n, intf, addr, int(rate), delay)
                    self._shape(h, intf, rate, delay)
                    _check(h.cmd(f"ip route show dev {intf} | while read r; do ip route change $r "
                                 f"dev {intf} initcwnd {KERNEL_INIT_WINDOW} "
                                 f"rto_min {int(round(RTO_MIN_S * T * 1e3))}ms || exit 1; done; "
                                 f"echo rc=$?"))
        for h in hosts:
            _check(h.cmd("ip link set lo up; sysctl -qw net.ipv4.tcp_no_metrics_save=1 "
                         "net.ipv4.tcp_slow_start_after_idle=0 "
                         f"net.ipv4.tcp_congestion_control={KERNEL_CONGESTION_CONTROL}; "
                         "echo rc=$?"), f"{h.name}: sysctl (congestion control "
                   f"{KERNEL_CONGESTION_CONTROL}, no slow start after idle)")
            got = h.cmd("sysctl -n net.ipv4.tcp_congestion_control").strip()
            if got != KERNEL_CONGESTION_CONTROL:
                raise RuntimeError(f"emulated network setup failed: {h.name}'s TCP congestion "
                                   f"control reads {got!r}, not {KERNEL_CONGESTION_CONTROL!r}")
        self.congestion_control = KERNEL_CONGESTION_CONTROL
        self.hosts = hosts

    def _shape(self, host, intf: str, rate_bps: float, delay_s: float) -> None:
        # One segment per packet. veth takes TCP's GSO packets whole (up to 64 kB), and HTB
        # sends a packet whenever its bucket is not empty and charges the whole size after:
        # a message's first GSO packet then leaves unshaped. Measured here on a 43.5 Mbit/s
        # class (a Mixtral prompt step's 317 kB, written after 1.5 s idle on a warm
        # connection): 49.4 ms instead of the 59.7 ms one-segment packets take (the rate,
        # less the 1 ms bucket), so large messages crossed up to ~20% fast. Steady-state
        # rates were right, which is what the bandwidth check measures.
        out = host.cmd(f"ip link set dev {intf} gso_max_segs 1 2>&1; echo rc=$?")
        if not out.strip().endswith("rc=0"):
            self.gso_unlimited.append(intf)
        p = htb_params(rate_bps)
        cmds = [
            f"tc qdisc replace dev {intf} root handle 1: htb default 1 r2q 10",
            f"tc class replace dev {intf} parent 1: classid 1:1 htb rate {p['rate_bit']}bit "
            f"ceil {p['rate_bit']}bit burst {p['burst']}b cburst {p['burst']}b quantum {p['quantum']}",
        ]
        if self.mechanism == "netem":
            cmds.append(f"tc qdisc replace dev {intf} parent 1:1 handle 10: netem "
                        f"delay {delay_s * 1e6:.0f}us limit 1000000")
        for c in cmds:
            _check(host.cmd(c + " 2>&1; echo rc=$?"), c)

    # -- what workers need ---------------------------------------------------------
    def addr(self, src: int, dst: int) -> str:
        """dst's address on the (src, dst) link: connect here to use that link."""
        return self.ends[(dst, src)].addr

    def transport_delays(self) -> list[list[float]]:
        """Dilated one-way delays the transport must add (zeros under netem)."""
        n = self.cluster.n
        if self.mechanism == "netem":
            return [[0.0] * n for _ in range(n)]
        return [[0.0 if m == k else self.ends[(m, k)].delay_s for k in range(n)] for m in range(n)]

    def popen(self, i: int, args: list[str], **kw) -> subprocess.Popen:
        return self.hosts[i].popen(args, **kw)

    def cmd(self, i: int, command: str) -> str:
        return self.hosts[i].cmd(command)

    def set_link(self, i: int, j: int, up: bool) -> None:
        """Cut or restore the link between servers i and j (both directions)."""
        state = "up" if up else "down"
        self.hosts[i].cmd(f"ip link set {names.intf(i, j)} {state}")
        self.hosts[j].cmd(f"ip link set {names.intf(j, i)} {state}")

    def close(self) -> None:
        net, self._net = self._net, None
        if net is not None:
            try:
                net.stop()
            except Exception:  # teardown must go on; cleanup() reclaims the rest
                pass
            # Mininet deletes its CPU cgroups with cgdelete, absent without cgroup-tools
            from .cleanup import remove_cgroup
            for i in range(self.cluster.n):
                for path in Path("/sys/fs/cgroup").glob(f"*/{names.host(i)}"):
                    remove_cgroup(path)
        for s, h in getattr(self, "_old_handlers", {}).items():
            signal.signal(s, h)
        self._old_handlers = {}


def _check(out: str, what: str = "") -> None:
    if "rc=0" not in out:
        raise RuntimeError(f"emulated network setup failed: {what} -> {out.strip()}")
