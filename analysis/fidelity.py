"""A figure's fidelity table: was each emulated run the network and timing it claims?

Every emulated run writes ``fidelity.json`` (tc read-back per link, worker release
and delivery lateness, CPU, drain cap). A figure drawn from emulated runs is only as
good as the worst of them, so beside the claims we write one row per run to
``figures/figN.fidelity.csv`` and a summary into the claims file, which the report
prints. Lateness is converted to emulated milliseconds (wall / T): that is the
error it adds to a request's latency, comparable with the 300 ms SLA.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from testbed.emu.tolerances import CPU_SATURATED_PCT, RATE_READBACK_REL

from .load import FigureData


def run_row(detail: dict) -> dict:
    """One run's fidelity figures, from the ``detail`` of its fidelity.json."""
    T = float(detail.get("dilation") or 1.0)
    links = detail.get("links", [])
    errs = [abs(l["tc_rate_bit"] / l["rate_bit"] - 1) for l in links
            if l.get("tc_rate_bit") and l.get("rate_bit")]
    workers = detail.get("workers", [])
    batches = sum(w.get("batches", 0) for w in workers)

    def worst(key: str) -> float:
        vals = [w[key] for w in workers if w.get(key) is not None]
        return float(max(vals)) / T if vals else float("nan")

    def worst_at(key: str) -> float:
        # model ms since the start at which the largest of every worker's worst samples
        # (``worst_*``: [wall ms late, model ms] each) fell; NaN for runs written before
        samples = [s for w in workers for s in w.get(key) or []]
        return float(max(samples)[1]) if samples else float("nan")

    return {
        "T": T, "delay_mechanism": detail.get("delay_mechanism"),
        "wall_s": detail.get("wall_s"), "emulated_s": detail.get("emulated_s"),
        "links": len(links), "links_unread": len(links) - len(errs),
        "rate_err_max_pct": 100 * max(errs) if errs else float("nan"),
        "drops": int(sum(l.get("drops") or 0 for l in links)),
        "release_late_p99_emu_ms": worst("release_late_p99_ms"),
        "release_late_max_emu_ms": worst("release_late_max_ms"),
        "release_late_max_at_ms": worst_at("worst_release_late"),
        "write_late_max_at_ms": worst_at("worst_write_late"),
        "delivery_late_mean_emu_ms": worst("delivery_late_mean_ms"),
        "late_release_share": (sum(w.get("late_over_tolerance", 0) for w in workers) / batches
                               if batches else float("nan")),
        "cpu_mean_pct": detail.get("cpu_percent_mean"), "cpu_max_pct": detail.get("cpu_percent_max"),
        "timed_out": bool(detail.get("timed_out")),
        "killed_workers": len(detail.get("killed") or []),
        "requests_unrecorded": int(detail.get("requests_unrecorded") or 0),
        "wire_errors": int(sum(w.get("wire_errors", 0) for w in workers)),
        "kernel_errors": int(sum(w.get("kernel_errors", 0) for w in workers)),
        "flags": len(detail.get("fidelity_flags") or []),
    }


def fidelity_table(data: FigureData) -> pd.DataFrame:
    """One row per complete run that has a fidelity.json (none for the simulator)."""
    rows = []
    for _, run in data.runs.iterrows():
        path = Path(run["run_dir"]) / "fidelity.json"
        if not path.exists():
            continue
        detail = json.loads(path.read_text()).get("detail", {})
        axes = {k: run[k] for k in data.spec.axes if k in run}
        rows.append({**axes, "seed": int(run["seed"]), **run_row(detail)})
    return pd.DataFrame(rows)


def summarise(table: pd.DataFrame) -> dict | None:
    """The figure-level summary the report prints, with plain problems listed."""
    if table.empty:
        return None

    def fmax(col: str) -> float | None:
        v = table[col].dropna()
        return float(v.max()) if len(v) else None

    s = {
        "runs": int(len(table)), "T_min": float(table["T"].min()), "T_max": float(table["T"].max()),
        "rate_err_max_pct": fmax("rate_err_max_pct"), "links_unread": int(table["links_unread"].sum()),
        "drops": int(table["drops"].sum()),
        "release_late_p99_emu_ms_median": float(np.nanmedian(table["release_late_p99_emu_ms"])),
        "release_late_p99_emu_ms_max": fmax("release_late_p99_emu_ms"),
        "delivery_late_mean_emu_ms_max": fmax("delivery_late_mean_emu_ms"),
        "cpu_mean_pct_max": fmax("cpu_mean_pct"), "cpu_max_pct": fmax("cpu_max_pct"),
        "runs_cpu_saturated": int((table["cpu_max_pct"].fillna(0) >= CPU_SATURATED_PCT).sum()),
        "runs_timed_out": int(table["timed_out"].sum()),
        "killed_workers": int(table["killed_workers"].sum()),
        "requests_unrecorded": int(table["requests_unrecorded"].sum()),
        "wire_errors": int(table["wire_errors"].sum()), "kernel_errors": int(table["kernel_errors"].sum()),
    }
    problems = []
    if s["rate_err_max_pct"] is not None and s["rate_err_max_pct"] > 100 * RATE_READBACK_REL:
        problems.append(f"a tc rate read back {s['rate_err_max_pct']:.1f}% off its configured rate")
    if s["links_unread"]:
        problems.append(f"{s['links_unread']} link classes could not be read back")
    if s["runs_timed_out"]:
        hit = table[table["timed_out"]]
        first_axis = table.columns[0] if table.columns[0] != "seed" else None  # rows lead with the axes
        where = (f"{first_axis} = {', '.join(map(str, sorted(set(hit[first_axis]), key=str)))}"
                 if first_axis else "")
        problems.append(f"{s['runs_timed_out']} runs reached the drain cap (emu.max_drain_s)"
                        + (f" ({where})" if where else "") + "; "
                        f"{s['requests_unrecorded']} requests unfinished there are recorded as failed")
    for key, what in (("drops", "packets dropped by tc"), ("killed_workers", "workers killed"),
                      ("wire_errors", "malformed frames"), ("kernel_errors", "failed kernels")):
        if s[key]:
            problems.append(f"{s[key]} {what}")
    if s["runs_cpu_saturated"]:
        problems.append(f"{s['runs_cpu_saturated']} runs had a one-second CPU sample at or above "
                        f"{CPU_SATURATED_PCT:.0f}% (highest run mean {s['cpu_mean_pct_max']:.0f}%): "
                        "releases there may run late, which the lateness figures measure")
    s["problems"] = problems
    return s
