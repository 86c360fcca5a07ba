"""A sweep that varies one setting, beside its figure's own sweep.

``python -m analysis beside --spec SPEC --results ROOT`` reads the sweep of a figure spec
that adds one axis to its figure's (``specs/fig9-bursty.yaml``: the arrival process;
``specs/fig9-overlap.yaml``: where expert loads run) and the figure's own sweep of the same
backend and scale (``--base-results``, default ``results``), averages each point's metric
over its seeds and prints one Markdown row per point of the figure's own axes (router and
load in Fig. 9, model and router in Fig. 7, router in Fig. 8): the figure's value, then
each value of the extra axis with its ratio to it and, with ``--seed-ratios``, the range of
the seeds' own ratios (seed s against seed s: the same requests, placement and decision
constant, so the range says whether the change moved every seed the same way).
``python -m analysis arrivals`` is the same with the base labelled Poisson and no seed
ratios. Reads results only.
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


def seed_ratios(base: pd.DataFrame, other: pd.DataFrame, keys: list[str], axis: str,
                metric: str) -> pd.DataFrame:
    """Per point of ``keys`` and value of ``axis``, over the seeds present on both sides:
    the ratio of their means (``paired``) and the smallest and largest ratio of a seed's
    value to the same seed's base value."""
    b = base[keys + ["seed", metric]].rename(columns={metric: "base"})
    o = other[keys + [axis, "seed", metric]]
    j = o.merge(b, on=keys + ["seed"])
    j = j[j["base"] > 0]
    j["ratio"] = j[metric] / j["base"]
    g = j.groupby(keys + [axis], dropna=False)
    return pd.DataFrame({"paired": g[metric].mean() / g["base"].mean(),
                         "lo": g["ratio"].min(), "hi": g["ratio"].max()})


def _level(v) -> str:
    return f"{v:g}" if isinstance(v, (int, float)) else str(v)


def compare_table(base: pd.DataFrame, other: pd.DataFrame, axis: str, metric: str,
                  keys: tuple[str, ...] = ("router.name", "workload.rate_per_s"),
                  base_label: str = "Poisson", by_seed: bool = False) -> str:
    """Markdown: per point of ``keys``, the base value and, per value of ``axis`` in
    ``other``, its value and ratio to the base (``by_seed``: and the seeds' own ratios'
    range; then the ratio is over the seeds both sides have). Seeds in brackets where a
    point lacks some."""
    k = list(keys)
    b = point_means(base, k, metric).set_index(k)
    o = point_means(other, k + [axis], metric)
    levels = sorted(o[axis].unique(), key=_level)
    o = o.set_index(k + [axis])
    ratios = seed_ratios(base, other, k, axis, metric) if by_seed and metric != "sla_ratio" else None
    fmt = (lambda v: f"{v:.2f}") if metric == "sla_ratio" else (lambda v: f"{v:.0f}")
    head = [_LABELS.get(key, key.split(".")[-1]) for key in k]
    head.append(f"{base_label} {METRICS.get(metric, metric)}")
    head += [f"{axis.split('.')[-1]} {_level(lv)}" for lv in levels]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    seeds = int(max(b["seeds"].max(), o["seeds"].max())) if len(o) else 0
    tup = (lambda i: i if isinstance(i, tuple) else (i,))  # one key: a plain index
    b_val = {tup(i): v for i, v in b["value"].items()}
    b_n = {tup(i): v for i, v in b["seeds"].items()}
    o_val, o_n = dict(o["value"].items()), dict(o["seeds"].items())
    r_at = {} if ratios is None else {tup(i): tuple(row) for i, row in ratios.iterrows()}
    for idx in sorted(set(b_val) | {i[:-1] for i in o_val}):
        cells = [str(x) for x in idx]
        base_v = b_val.get(idx)
        cells.append("-" if base_v is None else fmt(base_v) + _short(b_n.get(idx), seeds))
        for lv in levels:
            v = o_val.get((*idx, lv))
            if v is None:
                cells.append("-")
                continue
            ratio = f" ({v / base_v:.2f}x" if base_v and metric != "sla_ratio" else ""
            if ratio and (*idx, lv) in r_at:
                paired, lo, hi = r_at[(*idx, lv)]  # over the seeds both sides have
                ratio = f" ({paired:.2f}x; seeds {lo:.2f}-{hi:.2f}x"
            cells.append(fmt(v) + (ratio + ")" if ratio else "") + _short(o_n.get((*idx, lv)), seeds))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


#: column heads of the usual point keys; any other axis is headed by its last name
_LABELS = {"router.name": "router", "workload.rate_per_s": "req/s"}


def _short(n, full: int) -> str:
    return "" if n is None or n >= full else f" [{int(n)} seeds]"


def beside_tables(spec_file: Path, results: Path, base_results: Path, backend: str = "sim",
                  scale: str = "quick", physics: str = "hardware", base_label: str = "figure's",
                  by_seed: bool = False) -> str:
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
    keys = tuple(base_spec.axes)  # a point is a value of each of the figure's own axes
    out = []
    for metric, name in METRICS.items():
        out.append(f"{name}, mean over seeds:\n\n" + compare_table(
            base, other, extra[0], metric, keys=keys, base_label=base_label, by_seed=by_seed))
    return "\n\n".join(out)
