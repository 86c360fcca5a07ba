"""What a token's attention needs and the world does not give it: its request's earlier positions.

Both backends follow the paper's per-token model: a request's prompt tokens are released
together and each goes its own way through the layers, its dense part (attention
included) running wherever it resides (README, "Dense part"). A real forward pass cannot
do that. Token i's attention at layer l reads the keys and values (K/V) of positions
0..i-1 at layer l, so it can run only once each earlier position has computed them (its
own dense part at layer l), and only where those K/V are. The world charges neither: a
later position may finish a layer before an earlier one has started it, and a token may
attend at a server that holds none of its request's cache.

This module measures, from a run's token-layer records alone, how often that happens and,
to first order, what honouring it would cost:

- ``kv_remote``: token-layers whose attention ran at a server where some earlier position
  of the request had *not* run that layer (its K/V would have to be fetched);
- ``causal``: token-layers whose dense part ended before an earlier position's dense part
  of the same layer ended (they attended K/V that did not exist yet), and by how much;
- latency under three replays of the request's own recorded durations (queue waits,
  steps, decisions, hops held as recorded; each request replayed alone): ``order`` lets
  token i's dense part of layer l end no earlier than every earlier position's (K/V present
  anywhere at once); ``push`` also waits for each earlier position's K/V to reach i's
  server from where they were computed, sent the moment they were (one-way delay plus
  their bytes over the link, link sharing ignored); ``pull`` has i's server ask each
  holder when i arrives and wait for the answer (fetched K/V stay). A step in which a token
  waits is charged no extra kernel time. The replays show the extent, not the outcome: a
  real engine's waits also move other requests' queues and how steps batch, which
  ``engine.attention: causal`` simulates (README, "A token's attention needs its request's
  earlier positions": there the replay and the simulation disagree in sign for Prism).

A pipeline (every token of a request runs a layer at one server, in one step) reads zero on
every count; a router whose tokens part ways does not.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from testbed.records import read_records


@dataclass(frozen=True)
class CausalKv:
    """One run's reading (times in seconds)."""

    token_layers: int
    kv_remote: float  # share of token-layers attending where an earlier position did not run
    kv_bytes: float  # K/V bytes ``push`` moves (each position to each server that needs it once)
    causal: float  # share of token-layers done before an earlier position's same layer
    lead_mean_s: float  # by how much, over those token-layers
    lead_p99_s: float
    requests: int
    latency_mean_s: float  # as recorded
    latency_p99_s: float
    order_mean_s: float  # replayed with causal order
    order_p99_s: float
    push_mean_s: float  # replayed with causal order and K/V pushed over the links
    push_p99_s: float
    pull_mean_s: float  # replayed with causal order and K/V fetched when a token needs them
    pull_p99_s: float


def _grid(tl: pd.DataFrame, col: str, shape: tuple[int, int, int], idx, fill) -> np.ndarray:
    out = np.full(shape, fill, dtype=float if isinstance(fill, float) else np.int64)
    out[idx] = tl[col].to_numpy()
    return out


def measure(tl: pd.DataFrame, rq: pd.DataFrame, kv_bytes: float,
            delay: np.ndarray, bandwidth: np.ndarray, hidden_bytes: float) -> CausalKv:
    """The reading of one run's records. ``delay[m, n]`` (s) and ``bandwidth[m, n]`` (bytes/s)
    are the topology's links; ``kv_bytes`` what one position adds to the cache per layer;
    ``hidden_bytes`` a hidden state (the last hop home). Requests that did not finish, and
    their token-layers, are left out."""
    ok = rq[rq["status"] == "ok"]
    tl = tl[tl["request"].isin(ok["request"])]
    if tl.empty:
        raise ValueError("no finished request has token-layers")
    rids = np.sort(ok["request"].unique())
    ri = np.searchsorted(rids, tl["request"].to_numpy())
    tok = tl["token"].to_numpy()
    lay = tl["layer"].to_numpy()
    Q, P, L = len(rids), int(tok.max()) + 1, int(lay.max()) + 1
    idx = (ri, tok, lay)
    shape = (Q, P, L)
    start = _grid(tl, "t_start", shape, idx, np.nan)
    dense = _grid(tl, "dense_s", shape, idx, np.nan)
    total = _grid(tl, "total_s", shape, idx, np.nan)
    srv = _grid(tl, "server", shape, idx, 0)
    nxt = _grid(tl, "next_server", shape, idx, 0)
    done = start + dense  # the dense part's end: the K/V of (token, layer) exist from here
    present = ~np.isnan(start[:, :, 0])  # (Q, P): the request's tokens
    if np.isnan(start[present]).any():
        raise ValueError("a finished request lacks some token-layer's record")
    order = ok.set_index("request").loc[rids]
    n_tok = order["tokens"].to_numpy().astype(int)
    n_gen = np.array([len(g) for g in order["gen_done_s"]], dtype=int)
    prompt = n_tok - n_gen
    home = order["home"].to_numpy().astype(int)

    # -- what the records show -------------------------------------------------------------
    remote = np.zeros(shape, dtype=bool)
    lead = np.zeros(shape)
    for i in range(1, P):
        earlier = srv[:, :i, :]  # (Q, i, L)
        mine = srv[:, i:i + 1, :]
        remote[:, i, :] = (earlier != mine).any(axis=1)
        lead[:, i, :] = np.nanmax(done[:, :i, :], axis=1) - done[:, i, :]
    valid = ~np.isnan(start)
    remote &= valid
    late = (lead > 1e-9) & valid
    n = int(valid.sum())
    leads = lead[late]

    # -- replays ---------------------------------------------------------------------------
    last = nxt[:, :, L - 1]  # where each token ends; it then goes home (one hidden state)
    away = last != home[:, None]
    hop = np.where(away, delay[last, home[:, None]]
                   + hidden_bytes / np.where(away, bandwidth[last, home[:, None]], 1.0), 0.0)
    rec_end = start[:, :, L - 1] + total[:, :, L - 1] + hop  # (Q, P), as recorded

    N = len(delay)
    same = np.eye(N, dtype=bool)
    per_kv = np.where(same, 0.0, kv_bytes / np.where(same, 1.0, bandwidth))  # one position's K/V
    delay = np.where(same, 0.0, delay)  # (a topology's diagonal means nothing)

    def replay(mode: str) -> np.ndarray:
        """Each token's end (home) when token i's dense part of layer l ends no earlier than
        every earlier position's K/V is at i's server: at once (``order``), pushed there when
        computed (``push``), or fetched when i arrives (``pull``: a request to each server
        holding some, answered once they exist; fetched K/V stay at i's server)."""
        end = np.full((Q, P), np.nan)
        D = np.full(shape, -np.inf)
        fetched = np.full((Q, L, N, P), np.inf) if mode == "pull" else None
        before_gen = np.arange(P)[None, :] < prompt[:, None]
        qs = np.arange(Q)
        for i in range(P):
            live = present[:, i]
            r = start[:, i, 0].copy()
            gen = live & (i >= prompt)  # a generated token starts when the one before is home
            if i and gen.any():
                moved = np.where(i == prompt,
                                 np.nanmax(np.where(before_gen, end, np.nan), axis=1)
                                 - np.nanmax(np.where(before_gen, rec_end, np.nan), axis=1),
                                 end[:, i - 1] - rec_end[:, i - 1])
                r = np.where(gen, r + moved, r)
            for l in range(L):
                d = r + dense[:, i, l]
                if i:
                    a = D[:, :i, l]
                    src, me = srv[:, :i, l], srv[:, i:i + 1, l]
                    if mode == "push":
                        a = a + delay[src, me] + per_kv[src, me]
                    elif mode == "pull":
                        held = fetched[qs, l, me[:, 0], :i]  # (Q, i)
                        need = (src != me) & np.isinf(held) & live[:, None]
                        if need.any():
                            got = np.full(need.shape, np.inf)
                            for n in np.unique(src[need]):
                                m = need & (src == n)
                                cnt = m.sum(axis=1, keepdims=True)
                                ready = np.where(m, a, -np.inf).max(axis=1, keepdims=True)
                                t = (np.maximum(r[:, None] + delay[me, n], ready)
                                     + delay[n, me] + cnt * per_kv[n, me])
                                got = np.where(m, t, got)
                            held = np.where(need, got, held)
                            fetched[qs, l, me[:, 0], :i] = held
                        a = np.where(src == me, a, held)
                    d = np.maximum(d, a.max(axis=1))
                D[:, i, l] = np.where(live, d, -np.inf)
                r = d + (total[:, i, l] - dense[:, i, l])
            end[:, i] = np.where(live, r + hop[:, i], np.nan)
        return end

    lat_rec = (ok.set_index("request").loc[rids, "latency_s"]).to_numpy()
    base = np.nanmax(rec_end, axis=1)

    def latencies(end: np.ndarray) -> np.ndarray:
        return lat_rec + (np.nanmax(end, axis=1) - base)

    lo, lp, lf = (latencies(replay(m)) for m in ("order", "push", "pull"))
    return CausalKv(
        token_layers=n, kv_remote=float(remote.sum() / n),
        kv_bytes=float(_pushed(srv, present)) * kv_bytes,
        causal=float(late.sum() / n),
        lead_mean_s=float(leads.mean()) if leads.size else 0.0,
        lead_p99_s=float(np.quantile(leads, 0.99)) if leads.size else 0.0,
        requests=Q, latency_mean_s=float(lat_rec.mean()),
        latency_p99_s=float(np.quantile(lat_rec, 0.99)),
        order_mean_s=float(lo.mean()), order_p99_s=float(np.quantile(lo, 0.99)),
        push_mean_s=float(lp.mean()), push_p99_s=float(np.quantile(lp, 0.99)),
        pull_mean_s=float(lf.mean()), pull_p99_s=float(np.quantile(lf, 0.99)))


def _pushed(srv: np.ndarray, present: np.ndarray) -> int:
    """Positions' K/V that must reach another server: for each (request, layer) and each
    server where some position attended, the earlier positions computed elsewhere (each
    sent there once)."""
    Q, P, L = srv.shape
    count = 0
    for q in range(Q):
        p = int(present[q].sum())
        s = srv[q, :p, :]  # (p, L)
        for l in range(L):
            col = s[:, l]
            for dst in np.unique(col):
                last = p - 1 - int(np.argmax(col[::-1] == dst))  # the last position there
                count += int(np.count_nonzero(col[:last] != dst))
    return count


def measure_run(run_dir: Path, every_request: bool = False) -> CausalKv:
    """``measure`` of a run folder over the requests its metrics measure (arriving in
    [warmup, duration); ``every_request``: all of them, as a run's own counters count):
    its records, and its links and model from its resolved spec."""
    from testbed.metrics import measured
    from testbed.setup import check_spec
    from testbed.spec import load_spec

    spec_file = Path(run_dir) / "spec.resolved.yaml"
    if not spec_file.is_file():
        raise ValueError(f"{run_dir}: no spec.resolved.yaml (not a run folder)")
    checked = check_spec(load_spec(spec_file))
    cl, model = checked.cluster, checked.model
    tl, rq = read_records(Path(run_dir))
    if tl.empty or rq.empty:
        raise ValueError(f"{run_dir}: no token-layer or request records")
    w = checked.spec.workload
    if not every_request:
        rq = measured(rq, w.warmup_s, w.duration_s)  # the requests the run's metrics measure
    return measure(tl, rq, float(model.kv_bytes_per_token()), np.array(cl.delay, dtype=float),
                   np.array(cl.bandwidth, dtype=float), float(model.hidden_bytes()))


def run_folders(paths: list[Path]) -> list[Path]:
    """Run folders named directly, or every run (``*/seed*``, ``seed*``) under a sweep's folder."""
    out: list[Path] = []
    for p in paths:
        if (p / "spec.resolved.yaml").is_file():
            out.append(p)
            continue
        found = sorted(d for d in p.glob("**/seed*") if (d / "spec.resolved.yaml").is_file())
        if not found:
            raise ValueError(f"{p}: neither a run folder nor a folder of runs")
        out.extend(found)
    return out


HEADER = ("run | token-layers | attends away from earlier positions | K/V pushed (MB) | done "
          "before an earlier position (mean / p99 lead, ms) | mean latency: recorded / order / "
          "push / pull (ms) | p99: recorded / order / push / pull (ms)")


def format_row(name: str, r: CausalKv) -> str:
    ms = 1e3
    return (f"{name} | {r.token_layers} | {r.kv_remote:.1%} | {r.kv_bytes / 1e6:.1f} | "
            f"{r.causal:.1%} ({r.lead_mean_s * ms:.1f} / {r.lead_p99_s * ms:.1f}) | "
            f"{r.latency_mean_s * ms:.1f} / {r.order_mean_s * ms:.1f} / {r.push_mean_s * ms:.1f} / "
            f"{r.pull_mean_s * ms:.1f} | {r.latency_p99_s * ms:.1f} / {r.order_p99_s * ms:.1f} / "
            f"{r.push_p99_s * ms:.1f} / {r.pull_p99_s * ms:.1f}")


def mean_reading(readings: list[CausalKv]) -> CausalKv:
    """The seeds of one point, each figure averaged over them (runs weigh alike)."""
    if not readings:
        raise ValueError("no readings to average")
    fields = CausalKv.__dataclass_fields__
    return CausalKv(**{f: (sum(getattr(r, f) for r in readings) // len(readings)
                           if fields[f].type in (int, "int")
                           else sum(getattr(r, f) for r in readings) / len(readings))
                       for f in fields})
