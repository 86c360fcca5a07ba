"""How much GPU memory a run's K/V cache took on each server, against the room it has.

The memory model (``hetroute.deployment.MemoryBudget``) gives experts and dense weights
``memory.gpu_share`` of each server's G_n and leaves the rest to KV cache and activations;
neither backend checks that the cache fits there. This reads, from a run's records, the
most K/V each server held at once, so a reader can see how far a run is from that limit:

- a position's K/V of layer l sit where its dense part of l ran, from that part's end
  until its request finishes (a serving engine frees a request's cache then);
- under causal attention (``engine.attention: causal``) a server also holds the earlier
  positions' K/V it needed for a later position of the same layer that ran there (each
  fetched once and kept, ``testbed/kv.py``), from that later position's layer start.

Runs under the paper's rule (``independent``) read the copies a causal forward pass would
have needed; their own records moved none. Activations are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from testbed.records import read_records


@dataclass(frozen=True)
class KvMemory:
    servers: int
    requests: int
    own_peak_b: float  # the largest, over servers, of the most K/V of its own computing held at once
    all_peak_b: float  # the same with the fetched copies
    room_b: float  # the room left to KV cache on that server ((1 - gpu_share) x G_n)
    peak_share: float  # max over servers of (own + copies at peak) / room


def peaks(tl, rq, kv_bytes: float, n_servers: int) -> tuple[np.ndarray, np.ndarray]:
    """(own, with copies): each server's most K/V bytes held at once. ``tl`` and ``rq`` are
    a run's token-layer and request records; requests that did not finish are left out."""
    ok = rq[rq["status"] == "ok"]
    tl = tl[tl["request"].isin(ok["request"])]
    if tl.empty:
        return np.zeros(n_servers), np.zeros(n_servers)
    rids = np.sort(ok["request"].unique())
    ri = np.searchsorted(rids, tl["request"].to_numpy())
    tok, lay = tl["token"].to_numpy(), tl["layer"].to_numpy()
    Q, P, L = len(rids), int(tok.max()) + 1, int(lay.max()) + 1
    start = np.full((Q, L, P), np.nan)
    srv = np.full((Q, L, P), -1)
    start[ri, lay, tok] = tl["t_start"].to_numpy()
    srv[ri, lay, tok] = tl["server"].to_numpy()
    done = start.copy()
    done[ri, lay, tok] += tl["dense_s"].to_numpy()
    ends = ok.set_index("request").loc[rids]
    end = np.broadcast_to((ends["arrival_s"] + ends["latency_s"]).to_numpy()[:, None], (Q, L))
    valid = srv >= 0
    own = (done[valid], srv[valid], np.broadcast_to(end[:, :, None], valid.shape)[valid])
    # a copy of position j's K/V reaches server n at the start of the first later position of
    # the same layer that ran at n (none where j ran at n itself)
    nxt = np.full((Q, L, n_servers), P)  # the first position after the current one at each n
    cp_t, cp_s, cp_e = [], [], []
    for j in range(P - 1, -1, -1):
        here = srv[:, :, j]
        for n in range(n_servers):
            first = nxt[:, :, n]
            need = valid[:, :, j] & (first < P) & (here != n)
            if need.any():
                q, l = np.nonzero(need)
                cp_t.append(start[q, l, first[q, l]])
                cp_s.append(np.full(q.size, n))
                cp_e.append(end[q, l])
            nxt[:, :, n] = np.where(here == n, j, first)

    def held(t, s, e) -> np.ndarray:
        out = np.zeros(n_servers)
        for n in range(n_servers):
            m = s == n
            if not m.any():
                continue
            times = np.concatenate([t[m], e[m]])
            delta = np.concatenate([np.ones(m.sum()), -np.ones(m.sum())])
            order = np.lexsort((-delta, times))  # at one instant, arrivals before releases
            out[n] = np.cumsum(delta[order]).max() * kv_bytes
        return out

    both = [np.concatenate([own[k], *c]) for k, c in enumerate((cp_t, cp_s, cp_e))]
    return held(*own), held(*both)


def measure_run(run_dir: Path) -> KvMemory:
    """The reading of one run folder (every finished request; its resolved spec gives the
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
    room = np.array(checked.cluster.gpu_bytes, dtype=float) * (1.0 - checked.spec.memory.gpu_share)
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
