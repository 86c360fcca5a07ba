"""A shaped link holds a burst to its rate from the first byte (needs root and Mininet).

veth hands TCP's multi-segment (GSO) packets to HTB whole, and HTB sends a packet
whenever its bucket is not empty: a message's first packet, up to 64 kB, used to leave
unshaped, so a 317 kB message crossed a 43.5 Mbit/s class in ~49 ms instead of ~60 ms.
Steady-state rates were right, so the fidelity command's bandwidth check did not see it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types

import pytest

from tests.test_emu import _clean_machine, _why_not  # noqa: F401 (the fixture is autouse)

pytestmark = [pytest.mark.emu, pytest.mark.skipif(_why_not() is not None, reason=str(_why_not()))]

RECV = textwrap.dedent("""
    import socket, sys, time
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", 7071)); s.listen(1); print("ready", flush=True)
    c, _ = s.accept()
    for _ in range(int(sys.argv[1])):
        got = 0
        while got < int(sys.argv[2]):
            got += len(c.recv(1 << 20))
        print(f"{time.monotonic():.6f}", flush=True)
""")
SEND = textwrap.dedent("""
    import socket, sys, time
    s = socket.create_connection((sys.argv[1], 7071))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = b"x" * int(sys.argv[3])
    time.sleep(0.3)
    for _ in range(int(sys.argv[2])):
        print(f"{time.monotonic():.6f}", flush=True); s.sendall(buf); time.sleep(0.4)
""")


def test_a_message_crosses_a_shaped_link_at_its_rate_from_the_first_byte(tmp_path) -> None:
    from testbed.emu.hosts import EmulatedNetwork
    from testbed.emu.hosts.topo import MTU_FRAME, htb_params
    B, n, size = 5e6, 4, 300_000  # 40 Mbit/s, four 300 kB messages on one warm connection
    cl = types.SimpleNamespace(n=2, bandwidth=[[0, B], [B, 0]], delay=[[0, 0.001], [0.001, 0]],
                               names=["a", "b"])
    (tmp_path / "recv.py").write_text(RECV)
    (tmp_path / "send.py").write_text(SEND)
    with EmulatedNetwork(cl, dilation=1.0, delay_mechanism="transport") as net:
        assert not net.gso_unlimited
        end = net.ends[(0, 1)]
        rx = net.popen(1, [sys.executable, str(tmp_path / "recv.py"), str(n), str(size)],
                       stdout=subprocess.PIPE, text=True)
        assert rx.stdout.readline().strip() == "ready"
        tx = net.popen(0, [sys.executable, str(tmp_path / "send.py"), net.addr(0, 1), str(n), str(size)],
                       stdout=subprocess.PIPE, text=True)
        sent = [float(tx.stdout.readline()) for _ in range(n)]
        got = [float(rx.stdout.readline()) for _ in range(n)]
        tx.wait(timeout=30)
        rx.wait(timeout=30)
    # full segments of 1448 payload bytes in 1514-byte frames, less what the bucket holds
    frames = size / 1448 * MTU_FRAME
    floor = (frames - htb_params(end.rate_bit)["burst"]) * 8 / end.rate_bit
    took = [g - s for s, g in zip(sent, got)]
    assert all(t >= 0.97 * floor for t in took), (took, floor)
    assert all(t <= 1.15 * floor for t in took), (took, floor)  # and the link is not slow
