"""A shaped link holds a burst to its rate from the first byte (needs root and Mininet).

veth hands TCP's multi-segment (GSO) packets to HTB whole, and HTB sends a packet
whenever its bucket is not empty: a message's first packet, up to 64 kB, used to leave
unshaped, so a 317 kB message crossed a 43.5 Mbit/s class in ~49 ms instead of ~60 ms.
Steady-state rates were right, so the fidelity command's bandwidth check did not see it;
its burst check now does.
"""

from __future__ import annotations

import re
import sys
import types

import pytest

from tests.test_emu import _clean_machine, _why_not  # noqa: F401 (the fixture is autouse)

pytestmark = [pytest.mark.emu, pytest.mark.skipif(_why_not() is not None, reason=str(_why_not()))]


def test_a_message_crosses_a_shaped_link_at_its_rate_from_the_first_byte() -> None:
    """The fidelity command's burst check (``measure_burst``) on a 2-host network."""
    from testbed.emu.fidelity import burst_bounds, burst_ok, measure_burst
    from testbed.emu.hosts import EmulatedNetwork
    B, size = 5e6, 300_000  # 40 Mbit/s, four 300 kB messages on one warm connection
    cl = types.SimpleNamespace(n=2, bandwidth=[[0, B], [B, 0]], delay=[[0, 0.001], [0.001, 0]],
                               names=["a", "b"])
    with EmulatedNetwork(cl, dilation=1.0, delay_mechanism="transport") as net:
        assert not net.gso_unlimited
        took = measure_burst(net, 0, 1, size, count=4, gap=0.4)
        floor, full = burst_bounds(net.ends[(0, 1)].rate_bit, size)
    assert burst_ok(took, floor, full), (took, floor, full)  # none early, and the link is not slow


def test_the_kernels_own_tcp_window_is_kept_out_of_the_way() -> None:
    """Every host's TCP neither restarts its window after idle (its timeout is wall time,
    T times too short in emulated time) nor starts a link's connection from 10 segments:
    the window the workers model (``testbed/tcp.py``) is the only one. On asym5 the
    kernel's restarts added 1.8-4.8 emulated ms to early hops (README)."""
    from testbed.emu.hosts import EmulatedNetwork
    from testbed.emu.hosts.topo import KERNEL_CONGESTION_CONTROL, KERNEL_INIT_WINDOW, RTO_MIN_S
    B = 5e6
    cl = types.SimpleNamespace(n=3, bandwidth=[[0, B, B], [B, 0, B], [B, B, 0]],
                               delay=[[0, 1e-3, 1e-3], [1e-3, 0, 1e-3], [1e-3, 1e-3, 0]],
                               names=["a", "b", "c"])
    with EmulatedNetwork(cl, dilation=32.0, delay_mechanism="transport") as net:
        assert net.congestion_control == KERNEL_CONGESTION_CONTROL == "reno"
        for h in net.hosts:
            assert h.cmd("sysctl -n net.ipv4.tcp_slow_start_after_idle").strip() == "0"
            # not the machine's default (BBR here on 2026-12-07: its own window and probes)
            assert h.cmd("sysctl -n net.ipv4.tcp_congestion_control").strip() == "reno"
            routes = [r for r in h.cmd("ip route show").splitlines() if r.strip()]
            assert len(routes) == cl.n - 1  # one /30 per link
            for r in routes:
                assert f"initcwnd {KERNEL_INIT_WINDOW}" in r, r
                # the receiver's quick-ACK idle and a loss's timeout, dilated: 200 ms x 32
                assert re.search(rf"rto_min (lock )?{RTO_MIN_S * 32:g}s", r), r
        # a connection on a link runs it (TCP_CONGESTION, 13, read on the connecting socket)
        server = net.popen(1, [sys.executable, "-c", "import socket, time; s = socket.socket(); "
                               "s.bind(('', 5999)); s.listen(); c, _ = s.accept(); time.sleep(2)"])
        try:
            got = net.cmd(0, f"{sys.executable} -c \"import socket, time; time.sleep(0.5); "
                             f"s = socket.create_connection(('{net.addr(0, 1)}', 5999)); "
                             f"print(s.getsockopt(6, 13, 16).rstrip(bytes(1)).decode())\"")
        finally:
            server.kill()
            server.wait()
        assert got.strip().splitlines()[-1] == "reno", got
