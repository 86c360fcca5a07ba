"""How the arrival process moves a figure: a sweep under other arrivals beside the figure's own.

``python -m analysis arrivals --spec specs/fig9-bursty.yaml --results results/bursty``
reads that sweep and the figure's own (Poisson) sweep of the same backend and scale
(``--base-results``, default ``results``), averages each point's metric over its seeds and
prints one Markdown row per router and load: the Poisson value, then each value of the
extra axis (e.g. ``workload.arrival_cv``) with its ratio to Poisson. Reads results only.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from testbed.sweep import figure_path, load_figure

from .load import load_figure_data

METRICS = {"mean_ms": "mean ms", "p99_ms": "P99 ms", "sla_ratio": "within SLA"}


def point_means(runs: pd.DataFrame, keys: list[str], metric: str) -> pd.DataFrame:
    """Each point's metric averaged over its complete seeds, with the seed count."""
    g = runs.groupby(keys, dropna=False)[metric]
    return pd.DataFrame({"value": g.mean(), "seeds": g.size()}).reset_index()


def compare_table(base: pd.DataFrame, other: pd.DataFrame, axis: str, metric: str,
                  keys: tuple[str, ...] = ("router.name", "workload.rate_per_s")) -> str:
    """Markdown: per point of ``keys``, the base value and, per value of ``axis`` in
    ``other``, its value and ratio to the base. Seeds in brackets where a point lacks some."""
    k = list(keys)
    b = point_means(base, k, metric).set_index(k)
    o = point_means(other, k + [axis], metric)
    levels = sorted(o[axis].unique())
    o = o.set_index(k + [axis])
    fmt = (lambda v: f"{v:.2f}") if metric == "sla_ratio" else (lambda v: f"{v:.0f}")
    head = ["router", "req/s", f"Poisson {METRICS.get(metric, metric)}"]
    head += [f"{axis.split('.')[-1]} {lv:g}" for lv in levels]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    seeds = int(max(b["seeds"].max(), o["seeds"].max())) if len(o) else 0
    for idx in sorted(set(b.index) | {i[:-1] for i in o.index}):
        cells = [str(x) for x in idx]
        base_v = b["value"].get(idx)
        cells.append("-" if base_v is None else fmt(base_v) + _short(b["seeds"].get(idx), seeds))
        for lv in levels:
            v = o["value"].get((*idx, lv))
            if v is None:
                cells.append("-")
                continue
            ratio = f" ({v / base_v:.2f}x)" if base_v and metric != "sla_ratio" else ""
            cells.append(fmt(v) + ratio + _short(o["seeds"].get((*idx, lv)), seeds))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _short(n, full: int) -> str:
    return "" if n is None or n >= full else f" [{int(n)} seeds]"


def arrivals_tables(spec_file: Path, results: Path, base_results: Path, backend: str = "sim",
                    scale: str = "quick", physics: str = "hardware") -> str:
    """The tables for every metric of ``METRICS``: the sweep of ``spec_file`` against its
    figure's own sweep. The extra axis is the one the figure's spec lacks."""
    spec = load_figure(spec_file)
    base_spec = load_figure(figure_path(spec.figure))
    extra = [a for a in spec.axes if a not in base_spec.axes]
    if len(extra) != 1:
        raise ValueError(f"{spec_file}: needs exactly one axis the figure's spec lacks, has "
                         f"{extra or 'none'}")
    other = load_figure_data(spec, backend, scale, results, physics).runs
    base = load_figure_data(base_spec, backend, scale, base_results, physics).runs
    if other.empty or base.empty:
        raise ValueError(f"no complete runs under {results if other.empty else base_results} "
                         f"for {backend}/{scale}/{physics}")
    out = []
    for metric, name in METRICS.items():
        out.append(f"{name}, mean over seeds:\n\n" + compare_table(base, other, extra[0], metric))
    return "\n\n".join(out)
