"""Measurement programs that run inside the emulated hosts (for the fidelity monitor).

``recv --port P``: accept TCP connections and discard what arrives.
``send --addr A --port P --seconds S``: push bytes to A:P for S seconds.
``pong --rank N --port P --delay D``: answer PINGs over the workers' transport,
  holding each frame for the transport delay D (what workers do).
``ping --rank M --peer N --addr A --port P --delay D --count C``: send C PINGs
  over the transport and print the round-trip times as JSON.
``burst-recv --port P --count C --size S`` and ``burst-send --addr A --port P --count C
  --size S --gap G``: C messages of S bytes on one warm TCP connection, G seconds of idle
  before each; the sender prints when each write began, the receiver when each
  message's last byte arrived (one clock: the hosts share the machine's).

Only addresses of the run's own hosts are ever used.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import time


def _accept(port: int) -> socket.socket:
    """Listen on ``port``, say READY, and return the first connection."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", port))
    srv.listen(1)
    print("READY", flush=True)
    return srv.accept()[0]


def recv(port: int) -> None:
    conn = _accept(port)
    buf = bytearray(1 << 20)
    while conn.recv_into(buf):
        pass


def send(addr: str, port: int, seconds: float) -> None:
    s = socket.create_connection((addr, port), timeout=10)
    print("READY", flush=True)
    chunk = b"\0" * (1 << 16)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        s.sendall(chunk)
    s.close()


def burst_recv(port: int, count: int, size: int) -> None:
    conn = _accept(port)
    buf = bytearray(1 << 20)
    for _ in range(count):
        got = 0
        while got < size:
            n = conn.recv_into(buf, min(len(buf), size - got))
            if not n:
                raise SystemExit(f"connection closed after {got} of {size} bytes")
            got += n
        print(f"{time.monotonic():.6f}", flush=True)


def burst_send(addr: str, port: int, count: int, size: int, gap: float) -> None:
    s = socket.create_connection((addr, port), timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    print("READY", flush=True)
    buf = b"\0" * size
    for _ in range(count):
        time.sleep(gap)  # idle: the kernel may send the next burst's first packet at once
        print(f"{time.monotonic():.6f}", flush=True)
        s.sendall(buf)
    s.close()


def _transport_pair(rank: int, peer: int, addr: str | None, port: int, delay: float, n: int,
                    on_frame):
    from .transport import Transport  # imports torch: only the RTT probes need it
    delays = [0.0] * n
    delays[peer] = delay
    peers = {peer: (addr, port)} if addr else {}
    # the probes measure RTT, not trust: both ends share a fixed secret
    return Transport(rank, port, peers, delays, on_frame, lambda p, why: None,
                     secret=b"htr-fidelity-probe", check_source=False)


def pong(rank: int, peer: int, peer_addr: str, port: int, delay: float, n: int) -> None:
    from .transport import Transport, precise_loop
    from .wire import Frame, Ping, pong_for
    loop = precise_loop()
    asyncio.set_event_loop(loop)
    tr: Transport

    def on_frame(f: Frame, arrival: float) -> None:
        if isinstance(f.msg, Ping):
            tr.send(peer, Frame(pong_for(f.msg, rank, time.monotonic())))
    tr = _transport_pair(rank, peer, peer_addr, port, delay, n, on_frame)
    loop.run_until_complete(tr.start())
    print("READY", flush=True)
    loop.run_until_complete(loop.run_in_executor(None, sys.stdin.readline))


def ping(rank: int, peer: int, addr: str, port: int, delay: float, n: int, count: int) -> None:
    from .transport import precise_loop
    from .wire import Frame, Ping, Pong
    loop = precise_loop()
    asyncio.set_event_loop(loop)
    rtts: list[float] = []
    got = asyncio.Event()

    def on_frame(f: Frame, arrival: float) -> None:
        if isinstance(f.msg, Pong):
            rtts.append(arrival - f.msg.t_ping)
            got.set()
    tr = _transport_pair(rank, peer, addr, port, delay, n, on_frame)

    async def go() -> None:
        await tr.start()
        for i in range(count + 1):  # the first exchange warms the connection up
            got.clear()
            tr.send(peer, Frame(Ping(rank, i, time.monotonic())))
            await asyncio.wait_for(got.wait(), timeout=60)
        print(json.dumps(rtts[1:]), flush=True)
    loop.run_until_complete(go())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("recv")
    r.add_argument("--port", type=int, required=True)
    s = sub.add_parser("send")
    s.add_argument("--addr", required=True)
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--seconds", type=float, required=True)
    br = sub.add_parser("burst-recv")
    bs = sub.add_parser("burst-send")
    for p in (br, bs):
        p.add_argument("--port", type=int, required=True)
        p.add_argument("--count", type=int, required=True)
        p.add_argument("--size", type=int, required=True)
    bs.add_argument("--addr", required=True)
    bs.add_argument("--gap", type=float, required=True)
    for name in ("pong", "ping"):
        p = sub.add_parser(name)
        p.add_argument("--rank", type=int, required=True)
        p.add_argument("--peer", type=int, required=True)
        p.add_argument("--addr", required=True)
        p.add_argument("--port", type=int, required=True)
        p.add_argument("--delay", type=float, required=True)
        p.add_argument("--servers", type=int, required=True)
        if name == "ping":
            p.add_argument("--count", type=int, default=5)
    a = ap.parse_args(argv)
    if a.cmd == "recv":
        recv(a.port)
    elif a.cmd == "send":
        send(a.addr, a.port, a.seconds)
    elif a.cmd == "burst-recv":
        burst_recv(a.port, a.count, a.size)
    elif a.cmd == "burst-send":
        burst_send(a.addr, a.port, a.count, a.size, a.gap)
    elif a.cmd == "pong":
        pong(a.rank, a.peer, a.addr, a.port, a.delay, a.servers)
    else:
        ping(a.rank, a.peer, a.addr, a.port, a.delay, a.servers, a.count)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
