"""Remove everything a run of the emulator left behind: ``make clean-net``.

Finds by prefix: worker processes (their command line carries the worker
mark), Mininet host shells named ``mininet:htr*`` (killing them removes their
namespaces and the veth pairs inside), interfaces and named namespaces with
the prefix, and CPU cgroups named after hosts. Idempotent.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from .names import PREFIX, WORKER_MARK


def _procs() -> list[tuple[int, str]]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            out.append((int(d.name), cmd))
    return out


def leftovers() -> dict[str, list[str]]:
    """What clean-up would remove (also what tests assert is gone)."""
    me = os.getpid()
    procs = [f"{pid} {cmd.strip()[:80]}" for pid, cmd in _procs()
             if pid != me and (WORKER_MARK in cmd or f"mininet:{PREFIX}" in cmd)]
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    intfs = [ln.split(":")[1].strip().split("@")[0] for ln in links.splitlines()
             if ln.split(":")[1].strip().startswith(PREFIX)]
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    # Mininet's namespaces are unnamed (ip netns cannot see them): count the network
    # namespaces, other than this one, that a process of ours holds, read from /proc
    netns = [x for x in ns if x.startswith(PREFIX)] + _held_netns(me)
    qdiscs = [ln for ln in subprocess.run(["tc", "qdisc", "show"], capture_output=True,
                                          text=True).stdout.splitlines()
              if f" dev {PREFIX}" in ln]
    cg = [str(p) for p in Path("/sys/fs/cgroup").glob(f"*/{PREFIX}*")] if Path("/sys/fs/cgroup").exists() else []
    return {"processes": procs, "interfaces": intfs, "namespaces": netns, "qdiscs": qdiscs,
            "cgroups": cg}


def _held_netns(me: int) -> list[str]:
    """Each network namespace other than ours that a process of the emulator holds."""
    try:
        mine = os.readlink(f"/proc/{me}/ns/net")
    except OSError:
        return []
    held: dict[str, list[int]] = {}
    for pid, cmd in _procs():
        if pid != me and (WORKER_MARK in cmd or f"mininet:{PREFIX}" in cmd):
            try:
                ns = os.readlink(f"/proc/{pid}/ns/net")
            except OSError:
                continue
            if ns != mine:
                held.setdefault(ns, []).append(pid)
    return [f"{ns} (pids {', '.join(map(str, pids))})" for ns, pids in sorted(held.items())]


def remove_cgroup(path: str | Path) -> None:
    """rmdir a cgroup, waiting (2 s at most) for its last task to be gone."""
    for _ in range(20):
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)


def cleanup(verbose: bool = False) -> dict[str, list[str]]:
    found = leftovers()
    me = os.getpid()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid, cmd in _procs():
            if pid != me and (WORKER_MARK in cmd or f"mininet:{PREFIX}" in cmd):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        time.sleep(0.2)
    for name in found["interfaces"]:
        subprocess.run(["ip", "link", "del", name], capture_output=True)
    for name in found["namespaces"]:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    for path in found["cgroups"]:
        remove_cgroup(path)
    if verbose:
        for k, v in found.items():
            print(f"{k}: {len(v)} removed" + (f" ({', '.join(v[:5])}{' ...' if len(v) > 5 else ''})" if v else ""))
    return found


if __name__ == "__main__":
    cleanup(verbose=True)
    rest = {k: v for k, v in leftovers().items() if v}
    if rest:
        print(f"still present: {rest}")
        raise SystemExit(1)
    print("clean")
