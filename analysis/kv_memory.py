"""``python -m analysis kv-memory``: how much GPU memory runs' K/V caches took on each
server, against the room the memory model leaves them, for runs made before every run's
metrics carried it (``testbed/kv_memory.py`` holds the rule and the reading). It reports
both the server's own positions and, with them, the copies causal attention fetches: runs
under the paper's rule (``independent``) read the copies a causal forward pass would have
needed; their own records moved none.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from testbed.kv_memory import kv_room, peaks
from testbed.records import read_records


@dataclass(frozen=True)
class KvMemory:
    servers: int
    requests: int
    own_peak_b: float  # the largest, over servers, of the most K/V of its own computing held at once
    all_peak_b: float  # the same with the fetched copies
    room_b: float  # the room left to KV cache on that server ((1 - gpu_share) x G_n)
    peak_share: float  # max over servers of (own + copies at peak) / room


def measure_run(run_dir: Path) -> KvMemory:
    """The reading of one run folder (``requests``: those that finished; every request's
    K/V count, as ``testbed/kv_memory.peaks`` frees them; its resolved spec gives the
    model, the servers' G_n and ``memory.gpu_share``)."""
    from testbed.setup import check_spec
    from testbed.spec import load_spec

    spec_file = Path(run_dir) / "spec.resolved.yaml"
    if not spec_file.is_file():
        raise ValueError(f"{run_dir}: no spec.resolved.yaml (not a run folder)")
    checked = check_spec(load_spec(spec_file))
    tl, rq = read_records(Path(run_dir))
    if tl.empty or rq.empty:
        raise ValueError(f"{run_dir}: no token-layer or request records")
    n = checked.cluster.n
    own, both = peaks(tl, rq, float(checked.model.kv_bytes_per_token()), n)
    room = kv_room(checked.cluster.gpu_bytes, checked.spec.memory.gpu_share)
    share = both / np.maximum(room, 1.0)
    worst = int(np.argmax(share))
    return KvMemory(servers=n, requests=int((rq["status"] == "ok").sum()),
                    own_peak_b=float(own.max()), all_peak_b=float(both.max()),
                    room_b=float(room[worst]), peak_share=float(share.max()))


HEADER = ("run | requests | most K/V a server held of its own (MB) | with fetched copies (MB) "
          "| KV room of the fullest server (MB) | its peak / room")


def format_row(name: str, r: KvMemory) -> str:
    return (f"{name} | {r.requests} | {r.own_peak_b / 1e6:.1f} | {r.all_peak_b / 1e6:.1f} | "
            f"{r.room_b / 1e6:.0f} | {r.peak_share:.1%}")
