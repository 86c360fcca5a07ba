"""The K/V cache a run's servers held at once, read from its records, against their room.

The memory model (``hetroute.deployment.MemoryBudget``) gives experts and dense weights
``memory.gpu_share`` of each server's G_n and leaves the rest, (1 - gpu_share) x G_n, to KV
cache and activations. Under ``engine.kv_overflow: none`` (the default) no backend admits,
evicts or spills on a full cache, so every run's metrics carry what its world held
(``kv_metrics``); ``run``, ``compare`` and ``sweep`` warn when a server held more than its
room (that run's world is not one a real server could be in), and a capacity search does
not count such a load. Under ``spill`` (``testbed/kv_spill.py``) what is past
the room sat in host memory and was paid for, so the same reading is the cache's size
(GPU and host together) and nothing warns.

- a position's K/V of layer l sit where its dense part of l ran, from that part's end
  until its request finishes or fails (a serving engine frees a request's cache then; a
  request the run never finished holds them to its end);
- under causal attention (``engine.attention: causal``) a server also holds the earlier
  positions' K/V it needed for a later position of the same layer that ran there (each
  fetched once and kept, ``testbed/kv.py``), from that later position's layer start.

Activations are not counted. The reading is columnar (two sorts of the token-layer
records), so a run of millions of token-layers or of long prompts costs about a second.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from .kv_spill import room_bytes


def peaks(tl: pd.DataFrame, rq: pd.DataFrame, kv_bytes: float, n_servers: int,
          with_copies: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(own, with copies): each server's most K/V bytes held at once. ``tl`` and ``rq`` are
    a run's token-layer and request records; ``with_copies=False`` skips the copies and
    returns (own, own). A request's K/V are freed when it finished or failed; one the run
    never finished (the emulator's drain cap) holds them to the end."""
    if tl.empty or rq.empty:
        return np.zeros(n_servers), np.zeros(n_servers)
    until = np.nan_to_num((rq["arrival_s"] + rq["latency_s"]).to_numpy(dtype=float), nan=np.inf)
    order = np.argsort(rq["request"].to_numpy(), kind="stable")
    rids, until = rq["request"].to_numpy()[order], until[order]
    req = tl["request"].to_numpy()
    keep = np.isin(req, rids)
    if not keep.any():
        return np.zeros(n_servers), np.zeros(n_servers)
    ri = np.searchsorted(rids, req[keep])
    tok = tl["token"].to_numpy()[keep].astype(np.int64)
    lay = tl["layer"].to_numpy()[keep].astype(np.int64)
    srv = tl["server"].to_numpy()[keep].astype(np.int64)
    start = tl["t_start"].to_numpy(dtype=float)[keep]
    done = start + tl["dense_s"].to_numpy(dtype=float)[keep]
    end = until[ri]

    def held(t: np.ndarray, s: np.ndarray, e: np.ndarray, w: np.ndarray) -> np.ndarray:
        # at one instant arrivals come before releases: the most held is, over arrivals, all
        # that arrived by then less what was released strictly before
        out = np.zeros(n_servers)
        by_server = np.argsort(s, kind="stable")
        bounds = np.searchsorted(s[by_server], np.arange(n_servers + 1))
        for n in range(n_servers):
            rows = by_server[bounds[n]:bounds[n + 1]]
            if rows.size == 0:
                continue
            tn, en, wn = t[rows], e[rows], w[rows]
            a, r = np.argsort(tn), np.argsort(en)
            arrived = np.cumsum(wn[a])
            released = np.r_[0.0, np.cumsum(wn[r])]
            out[n] = (arrived - released[np.searchsorted(en[r], tn[a], side="left")]).max() * kv_bytes
        return out

    ones = np.ones(ri.size)
    own = held(done, srv, end, ones)
    if not with_copies:
        return own, own
    # each row's rank among its (request, layer)'s positions: which earlier positions exist
    P, L = int(tok.max()) + 1, int(lay.max()) + 1
    layer_of = ri * L + lay  # one key per (request, layer)
    by_pos = np.argsort(layer_of * P + tok, kind="stable")
    rank = np.empty(ri.size, dtype=np.int64)
    first = np.r_[True, np.diff(layer_of[by_pos]) != 0]
    group_start = np.maximum.accumulate(np.where(first, np.arange(ri.size), 0))
    rank[by_pos] = np.arange(ri.size) - group_start
    # a server fetches, at the start of each position of a layer that ran there, copies of
    # the earlier positions of that layer it has not seen: those since its previous one
    at_server = layer_of * n_servers + srv  # one key per (request, layer, server)
    by_srv = np.argsort(at_server * P + tok, kind="stable")
    r, s_srv = rank[by_srv], srv[by_srv]
    same = np.r_[False, np.diff(at_server[by_srv]) == 0]
    prev = np.where(same, np.r_[-1, r[:-1]], -1)
    copies = (r - prev - 1).astype(float)
    fetched = copies > 0

    both = held(np.concatenate([done, start[by_srv][fetched]]),
                np.concatenate([srv, s_srv[fetched]]),
                np.concatenate([end, end[by_srv][fetched]]),
                np.concatenate([ones, copies[fetched]]))
    return own, both


def kv_room(gpu_bytes, gpu_share: float) -> np.ndarray:
    """Each server's room for KV cache and activations: (1 - gpu_share) x G_n
    (``kv_spill.room_bytes``, the rule ``engine.kv_overflow: spill`` holds the cache to)."""
    return np.array([room_bytes(float(g), gpu_share) for g in gpu_bytes], dtype=float)


def kv_metrics(tl: pd.DataFrame, rq: pd.DataFrame, kv_bytes: float, room: np.ndarray,
               causal: bool, names=None) -> dict:
    """A run's K/V cache against its servers' room, for ``metrics.json``: the most a server
    held at once in the run's own world (its positions; under causal attention also the
    copies it fetched) in MB, that server's room, and the largest held/room over servers
    (above 1: some server held more K/V than its memory leaves). ``names``: the servers'."""
    n = len(room)
    held = peaks(tl, rq, kv_bytes, n, with_copies=causal)[1]
    share = held / np.maximum(room, 1.0)
    worst = int(np.argmax(share))
    return {"kv_peak_mb": round(float(held[worst]) / 1e6, 3),
            "kv_room_mb": round(float(room[worst]) / 1e6, 3),
            "kv_peak_share": round(float(share[worst]), 4),
            "kv_peak_server": names[worst] if names is not None else f"server {worst}"}


def kv_unheld(metrics: dict) -> bool:
    """Whether a run's K/V outgrew a server's room in a world that did not hold it there:
    ``kv_peak_share`` above 1 without ``engine.kv_overflow: spill`` (under which the part
    past the room sat in host memory and the steps that read it paid its copies in)."""
    share = metrics.get("kv_peak_share")
    return share is not None and share > 1.0 and metrics.get("kv_overflow") != "spill"


def kv_warning(metrics: dict) -> str | None:
    """One line when a run's K/V outgrew a server's room (``kv_metrics``) and the world did
    not spill them (``kv_unheld``), else None."""
    if not kv_unheld(metrics):
        return None
    share = metrics["kv_peak_share"]
    return (f"warning: {metrics['kv_peak_server']} held {metrics['kv_peak_mb']:.0f} MB of K/V cache at once, "
            f"{share:.2f}x the {metrics['kv_room_mb']:.0f} MB its GPU memory leaves it "
            f"((1 - memory.gpu_share) x G_n); the world let it grow on (engine.kv_overflow: "
            f"none), so this run's world is not physical there (kv_overflow: spill holds it)")
