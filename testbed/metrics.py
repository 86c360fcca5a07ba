"""The paper's metrics, computed from records (Section VI-A).

Requests arriving in [warmup, duration) are measured; every request runs to
completion. Throughput (``throughput_tok_s``) counts generated tokens when the run
decodes, as the paper's Fig. 2(f) counts output (``gen_tok_s``), and otherwise the
prompt tokens of requests completed inside the window, so an overloaded router shows
its capacity rather than the offered load; ``throughput_counts`` says which.
Traffic counts every cross-server hidden-state message (fan-out, fan-in and
the final hop home) and is reported in GB (10^9 bytes) per 1000 tokens.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from hetroute.state import ExecType
from hetroute.system import FULL_PRECISION

from .records import flat

HEADLINE = (
    ("mean_ms", "mean latency (ms)"),
    ("p50_ms", "median latency (ms)"),
    ("p99_ms", "P99 latency (ms)"),
    ("gb_per_1k_tokens", "cross-server GB / 1000 tokens"),
    ("remote_ratio", "remote execution ratio"),
    ("cpu_offload_ratio", "CPU-offload ratio"),
    ("throughput_tok_s", "throughput (tokens/s): generated tokens when the run decodes, "
     "else prompt tokens of completed requests (throughput_counts)"),
    ("sla_ratio", "SLA satisfaction"),
    ("latency_trend", "latency of the last third of arrivals over the first"),
    ("served_ratio", "requests home in the window's second half over those arriving in it"),
    ("mem_gpu_gb", "replica GB in GPU memory / the GPU budget"),
    ("mem_cpu_gb", "replica GB in CPU memory / the CPU budget"),
    ("mem_x_model", "replica bytes over the model's experts in FP16"),
)


def measured(rq: pd.DataFrame, warmup_s: float, duration_s: float) -> pd.DataFrame:
    """The requests a run measures: those arriving in [warmup, duration)."""
    return rq[(rq.arrival_s >= warmup_s) & (rq.arrival_s < duration_s)]


def compute_metrics(tl: pd.DataFrame, rq: pd.DataFrame, warmup_s: float, duration_s: float,
                    sla_s: float, budget: float, decodes: bool | None = None) -> dict:
    """``decodes``: whether requests generate tokens (the spec's ``gen_tokens > 0``); None
    reads it off the records (a generated token home)."""
    out: dict = {}
    if rq.empty:
        return {"requests": 0}
    win = measured(rq, warmup_s, duration_s)
    ok = win[win.status == "ok"]
    lat = ok.latency_s.to_numpy()
    out["requests"] = int(len(win))
    out["failed"] = int((win.status != "ok").sum())
    out["mean_ms"] = float(lat.mean() * 1e3) if lat.size else math.nan
    out["p50_ms"] = float(np.percentile(lat, 50) * 1e3) if lat.size else math.nan
    out["p99_ms"] = float(np.percentile(lat, 99) * 1e3) if lat.size else math.nan
    out["sla_ratio"] = float((lat <= sla_s).sum() / len(win)) if len(win) else math.nan
    done = rq[(rq.status == "ok") & (rq.done_s >= warmup_s) & (rq.done_s < duration_s)]
    # every token (prompt and generated) of requests completed inside the window: the
    # headline throughput of a prompt-only run, and what it was for decode runs before
    out["throughput_tok_s"] = out["completed_tok_s"] = float(done.tokens.sum() / (duration_s - warmup_s))
    out["lam_mean"] = float(ok.lam_mean.mean()) if len(ok) else math.nan
    out["lam_max"] = float(ok.lam_max.max()) if len(ok) else math.nan
    out["budget_violations"] = int((ok.lam_max > budget * (1 + 1e-9) + 1e-12).sum())
    out.update(stability(ok, rq, warmup_s, duration_s))
    out.update(decode_metrics(ok, rq, warmup_s, duration_s))
    if decodes is None:
        decodes = "gen_done_s" in rq and bool(rq.gen_done_s.map(
            lambda v: _is_list(v) and len(v) > 0).any())
    out["throughput_counts"] = "generated" if decodes else "prompt"
    if decodes:
        out["throughput_tok_s"] = out["gen_tok_s"]
    if tl.empty:
        return out
    m = tl[tl.request.isin(win.request)]
    if m.empty:  # no request arrived in the window (a light or bursty load): nothing to average
        return out
    tokens = int(win.tokens.sum())
    out["gb_per_1k_tokens"] = float(m["bytes"].sum() / max(tokens, 1) * 1000 / 1e9)
    servers = flat(m.exec_server)
    theta = m.server.to_numpy()[:, None]
    gpu = flat(m.gpu).astype(bool)
    types = flat(m.exec_type)
    n_exec = servers.size
    out["remote_ratio"] = float((servers != theta).sum() / n_exec) if n_exec else math.nan
    # The paper does not define "remote"; eq. (9) charges a transfer when the
    # executing server is not the residing one (remote_ratio above). Its Fig. 2
    # numbers (EdgeShard 68%, Petals 61%) read more like "not the home server":
    home = m.request.map(win.set_index("request").home).to_numpy()[:, None]
    out["offhome_ratio"] = float((servers != home).sum() / n_exec) if n_exec else math.nan
    out["cpu_offload_ratio"] = float((~gpu).sum() / n_exec) if n_exec else math.nan
    counts = np.bincount(types.ravel(), minlength=len(ExecType))
    out["exec_types"] = {t.label: float(counts[t] / n_exec) for t in ExecType} if n_exec else {}
    out["participants"] = {int(k): float(v) for k, v in
                           m.participants.value_counts(normalize=True).sort_index().items()}
    out["fanout_ms"] = float(m.fanout_s.mean() * 1e3)
    out["compute_ms"] = float(m.compute_s.mean() * 1e3)
    out["fanin_ms"] = float(m.fanin_s.mean() * 1e3)
    out["layer_ms"] = float(m.total_s.mean() * 1e3)
    if "dense_s" in m:
        out["dense_ms"] = float(m.dense_s.mean() * 1e3)  # dense part, with its stream queueing
        out["decision_ms"] = float(m.decision_s.mean() * 1e3)  # routing CPU, with its queueing
    out["view_age_ms"] = float(m.view_age_s.mean() * 1e3)
    out["backlog_err_ms"] = float(m.backlog_err_s.abs().mean() * 1e3)
    return out


DECODE = (
    ("ttft_ms", "mean time to first token (ms): arrival to the prompt's last token home"),
    ("ttft_p99_ms", "P99 time to first token (ms)"),
    ("tpot_ms", "mean time per output token (ms): first token to last, over generated tokens"),
    ("gen_tok_s", "generated tokens home inside the window, per second (Fig. 2(f) with decode)"),
    ("window_x_latency", "measured window over the mean request latency"),
)


def decode_metrics(ok: pd.DataFrame, done: pd.DataFrame, warmup_s: float, duration_s: float) -> dict:
    """Prefill and decode timing of the measured, completed requests (``ok``).

    Generated tokens of every recorded request (``done``, failed ones included: their
    tokens reached home) are counted one by one when they reach home inside the window,
    whenever their request arrived, so a decode run's throughput does not wait for
    requests that outlast the window. ``window_x_latency`` below 1 says the window is
    shorter than a request's life: the queues may not have reached their level, and the
    figures mark the point. Records written before these columns existed give NaN.
    """
    window = duration_s - warmup_s
    out = {k: math.nan for k, _ in DECODE}
    if "gen_done_s" not in done:
        return out
    times = np.concatenate([np.asarray(v, dtype=float) for v in done.gen_done_s if _is_list(v)]
                           + [np.empty(0)])
    out["gen_tok_s"] = float(((times >= warmup_s) & (times < duration_s)).sum() / window)
    if ok.empty:
        return out
    ttft = (ok.first_s - ok.arrival_s).to_numpy()
    if np.isfinite(ttft).any():
        out["ttft_ms"] = float(np.nanmean(ttft) * 1e3)
        out["ttft_p99_ms"] = float(np.nanpercentile(ttft, 99) * 1e3)
    n_gen = ok.gen_done_s.map(lambda v: len(v) if _is_list(v) else 0).to_numpy()
    dec = n_gen > 0
    if dec.any():
        out["tpot_ms"] = float(((ok.done_s - ok.first_s).to_numpy()[dec] / n_gen[dec]).mean() * 1e3)
    if ok.latency_s.mean() > 0:
        out["window_x_latency"] = float(window / ok.latency_s.mean())
    return out


def _is_list(v) -> bool:
    return hasattr(v, "__len__") and not isinstance(v, str)


#: A run is flagged unstable when the requests arriving in the last third of the
#: measured window wait this many times longer than those of the first third:
#: its queues grow with the run's length, so its mean says how long it ran.
UNSTABLE_TREND = 1.5
#: ... or when fewer than this share of the requests arriving in the second half of
#: the measured window were matched by requests getting home in it: the run served
#: less than half its offered load there. Latency need not trend up when a run cannot
#: keep up: a server that batches up to ``engine.max_batch_tokens`` takes a growing
#: queue in ever larger steps, so later arrivals join bigger batches and wait about
#: as long as earlier ones (EdgeShard on small3, Mixtral, 20 req/s for 3 s: 4% of the
#: offered tokens served in the window, latency trend 0.75).
UNSTABLE_SERVED = 0.5
#: arrivals in the second half below which ``served_ratio`` says too little
SERVED_MIN_ARRIVALS = 10


def stability(ok: pd.DataFrame, rq: pd.DataFrame | None = None, warmup_s: float = 0.0,
              duration_s: float = 0.0) -> dict:
    """Latency trend over arrival time (last third of measured arrivals over the first)
    and ``served_ratio``: requests home in the second half of the measured window over
    those arriving in it (from every request row ``rq``; NaN below SERVED_MIN_ARRIVALS
    arrivals). Either one beyond its bound flags the run ``unstable``. A run whose window
    is shorter than its requests' latency (``window_x_latency`` < 1) can read unstable
    by the second rule while its queues are still filling: it cannot show that they
    stop growing."""
    served = math.nan
    if rq is not None and len(rq) and duration_s > warmup_s:
        mid = (warmup_s + duration_s) / 2
        arrived = int(((rq.arrival_s >= mid) & (rq.arrival_s < duration_s)).sum())
        if arrived >= SERVED_MIN_ARRIVALS:
            home = int(((rq.status == "ok") & (rq.done_s >= mid) & (rq.done_s < duration_s)).sum())
            served = home / arrived
    low = bool(served < UNSTABLE_SERVED)  # False for NaN
    if len(ok) < 6:
        return {"latency_trend": math.nan, "served_ratio": served, "unstable": low}
    s = ok.sort_values("arrival_s")
    third = len(s) // 3
    first, last = s.latency_s.iloc[:third].mean(), s.latency_s.iloc[-third:].mean()
    trend = float(last / first) if first > 0 else math.nan
    return {"latency_trend": trend, "served_ratio": served,
            "unstable": bool(trend > UNSTABLE_TREND) or low}


def memory_use(deployment, shape, budget) -> dict:
    """What a placement holds against what the memory rule gives it (GB, 10^9 bytes):
    replica bytes in GPU and CPU memory, the budgets, and the replicas' bytes as a
    multiple of the model's experts in FP16 (issue 13: budgets differ by router)."""
    d = deployment.summary(shape)
    model = shape.n_experts * shape.expert_bytes[FULL_PRECISION] / 1e9
    return {"mem_gpu_gb": d["gpu_gb"], "mem_cpu_gb": d["cpu_gb"],
            "mem_budget_gpu_gb": sum(budget.gpu) / 1e9, "mem_budget_cpu_gb": sum(budget.cpu) / 1e9,
            "mem_x_model": (d["gpu_gb"] + d["cpu_gb"]) / model if model else math.nan}


def throughput_header(rows: dict[str, dict]) -> str:
    """What the table's throughput column counts: "prompt tok/s" (prompt-only runs),
    "gen tok/s" (every row decodes) or, mixed, "tok/s (*gen)" with decoding rows starred."""
    counts = {met.get("throughput_counts", "prompt") for met in rows.values()}
    if counts == {"generated"}:
        return "gen tok/s"
    return "tok/s (*gen)" if "generated" in counts else "prompt tok/s"


def format_table(rows: dict[str, dict], keys=HEADLINE) -> str:
    """A plain-text table: one row per run label, the headline metrics as columns."""
    short = {"mean_ms": "mean ms", "p50_ms": "p50 ms", "p99_ms": "P99 ms",
             "gb_per_1k_tokens": "GB/1k tok", "remote_ratio": "remote", "cpu_offload_ratio": "CPU-off",
             "throughput_tok_s": "tok/s", "sla_ratio": "SLA", "latency_trend": "trend",
             "mem_gpu_gb": "GPU GB", "mem_cpu_gb": "CPU GB", "mem_x_model": "replicas",
             "ttft_ms": "TTFT ms", "ttft_p99_ms": "TTFT P99", "tpot_ms": "TPOT ms",
             "gen_tok_s": "gen tok/s", "window_x_latency": "window/latency",
             "served_ratio": "served"}
    cols = [k for k, _ in keys]
    # the flag goes after the stability columns: either rule may have raised it
    flag_col = "served_ratio" if "served_ratio" in cols else "latency_trend"
    short["throughput_tok_s"] = tok_head = throughput_header(rows)
    head = ["router"] + [short.get(c, c) for c in cols]
    lines = [head]
    for label, met in rows.items():
        cells = [label]
        for c in cols:
            v = met.get(c, math.nan)
            flag = " UNSTABLE" if c == flag_col and met.get("unstable") else ""
            if isinstance(v, float) and math.isnan(v):
                cells.append("-" + flag)
            elif c in ("remote_ratio", "cpu_offload_ratio", "sla_ratio", "served_ratio"):
                cells.append(f"{100 * v:.1f}%" + flag)
            elif c == "gb_per_1k_tokens":
                cells.append(f"{v:.3f}")
            elif c == "latency_trend":
                cells.append(f"{v:.2f}" + flag)
            elif c in ("mem_gpu_gb", "mem_cpu_gb"):
                budget = met.get(c.replace("mem_", "mem_budget_"), math.nan)
                cells.append(f"{v:.0f}/{budget:.0f}")
            elif c == "mem_x_model":
                cells.append(f"{v:.2f}x")
            elif c == "throughput_tok_s" and tok_head.endswith("(*gen)"):
                cells.append(f"{v:.1f}" + ("*" if met.get("throughput_counts") == "generated" else ""))
            else:
                cells.append(f"{v:.1f}")
        lines.append(cells)
    widths = [max(len(r[i]) for r in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in
                               enumerate(zip(r, widths))) for r in lines)


def format_decode(rows: dict[str, dict]) -> str:
    """The decode table (``DECODE`` columns) of the rows that generated tokens; "" if none."""
    dec = {label: met for label, met in rows.items() if not math.isnan(met.get("tpot_ms", math.nan))}
    return format_table(dec, DECODE) if dec else ""
