"""Shared plotting helpers: fixed colours per router, CI error bars, panel layouts.

Error bars are 95% bootstrap confidence intervals over seeds (seaborn, seeded),
drawn whenever a point has more than one seed.
"""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

ROUTER_ORDER = ["hetroute", "greedy", "prism", "moe-infinity", "petals", "edgeshard", "edgeshard-tp",
                "hetroute-no-setlevel", "hetroute-no-residency", "hetroute-no-quality",
                "hetroute-no-replication"]
LABELS = {"hetroute": "HetRoute", "prism": "Prism", "edgeshard": "EdgeShard", "edgeshard-tp": "EdgeShard (thr.)",
          "moe-infinity": "MoE-Infinity", "petals": "Petals", "greedy": "per-expert greedy",
          "hetroute-no-setlevel": "w/o set-level", "hetroute-no-residency": "w/o residency",
          "hetroute-no-quality": "w/o quality prec.", "hetroute-no-replication": "w/o replication"}
CI = ("ci", 95)


def palette(names) -> dict:
    colours = sns.color_palette("colorblind", len(ROUTER_ORDER))
    fixed = dict(zip(ROUTER_ORDER, colours))
    extra = sns.color_palette("muted", 10)
    return {n: fixed.get(n, extra[i % 10]) for i, n in enumerate(names)}


def ordered(names) -> list:
    names = list(dict.fromkeys(names))
    return sorted(names, key=lambda n: (ROUTER_ORDER.index(n) if n in ROUTER_ORDER else 99, str(n)))


def grid(n_panels: int, title: str, cols: int = 3, size=(4.2, 3.2)):
    cols = min(cols, n_panels)
    rows = math.ceil(n_panels / cols)
    sns.set_theme(style="whitegrid", context="paper")
    fig, axes = plt.subplots(rows, cols, figsize=(size[0] * cols, size[1] * rows), squeeze=False)
    for ax in axes.ravel()[n_panels:]:
        ax.set_visible(False)
    fig.suptitle(title)
    return fig, list(axes.ravel()[:n_panels])


def router_bars(ax, df: pd.DataFrame, metric: str, title: str, x: str = "router.name") -> None:
    if df.empty or metric not in df:
        _empty(ax, title)
        return
    order = ordered(df[x])
    sns.barplot(data=df, x=x, y=metric, hue=x, order=order, hue_order=order,
                palette=palette(order), errorbar=CI, seed=0, ax=ax, legend=False)
    ax.set_xticks(range(len(order)))
    ax.set_xticklabels([LABELS.get(o, o) for o in order], rotation=30, ha="right")
    ax.set(title=title, xlabel="", ylabel="")
    _log_if_spread(ax, df[metric])


def lines(ax, df: pd.DataFrame, metric: str, x: str, title: str, hue: str = "router.name",
          legend: str | None = "best") -> None:
    """One line per hue level with CIs over seeds; ``legend`` is its location, None for none."""
    if df.empty or metric not in df:
        _empty(ax, title)
        return
    if hue in df and df[hue].nunique() > 1:
        order = ordered(df[hue])
        # a marker per router as well as a colour: lines that coincide (an SLA share of
        # exactly 0 or 1) stay distinguishable
        drawn = len(ax.lines)
        sns.lineplot(data=df, x=x, y=metric, hue=hue, hue_order=order, palette=palette(order),
                     style=hue, style_order=order, markers=True, dashes=False,
                     markersize=7, errorbar=CI, seed=0, ax=ax, legend=legend is not None)
        plotted = [ln for ln in ax.lines[drawn:] if len(ln.get_xdata())]  # not legend proxies
        for i, line in enumerate(plotted):  # later levels smaller: coincident ones nest
            line.set_markersize(max(3.0, 10.0 - 1.5 * i))
        if legend is not None:
            handles, labels = ax.get_legend_handles_labels()
            ax.legend(handles, [LABELS.get(lb, lb) for lb in labels], fontsize=7, loc=legend)
    else:
        sns.lineplot(data=df, x=x, y=metric, marker="o", errorbar=CI, seed=0, ax=ax)
    mark_unstable(ax, df, metric, x, hue)
    ax.set(title=title, xlabel=x.split(".")[-1], ylabel="")
    _log_if_spread(ax, df[metric])


def mark_unstable(ax, df: pd.DataFrame, metric: str, x: str, hue: str) -> None:
    """Marks points whose mean is not a steady state: a black cross where some seed's
    queues grew over the run (``metrics.unstable``: its mean says how long the run
    lasted), an open square where some seed's measured window was shorter than its mean
    request latency (``metrics.window_x_latency`` < 1: decode runs at high load)."""
    flags = (("unstable", lambda s: s.fillna(False).astype(bool), dict(marker="x", color="black"),
              "x: unstable (queues grow)"),
             ("window_x_latency", lambda s: s < 1.0,
              dict(marker="s", facecolors="none", edgecolors="black"), "square: window < latency"))
    keys = [k for k in (hue, x) if k in df]
    notes = []
    for col, bad, style, note in flags:
        if col not in df or not bad(df[col]).any():
            continue
        g = df.assign(_bad=bad(df[col])).groupby(keys).agg(y=(metric, "mean"), bad=("_bad", "any"))
        g = g[g.bad].reset_index()
        ax.scatter(g[x], g.y, s=40, zorder=5, linewidths=1.2, **style)
        notes.append(note)
    if notes:
        ax.text(0.01, 0.99, "; ".join(notes), transform=ax.transAxes, fontsize=6, va="top", ha="left")


def _log_if_spread(ax, values: pd.Series) -> None:
    """Latencies that span orders of magnitude (a saturated baseline) on a log axis."""
    v = values[values > 0]
    if metric_is_time(values.name) and len(v) and v.max() / v.min() > 20:
        ax.set_yscale("log")
        ax.set_title(ax.get_title() + " (log)")


def metric_is_time(name) -> bool:
    return isinstance(name, str) and name.endswith("_ms")


def grouped_bars(ax, df: pd.DataFrame, metric: str, x: str, title: str, hue: str = "router.name") -> None:
    if df.empty or metric not in df:
        _empty(ax, title)
        return
    order = ordered(df[hue])
    sns.barplot(data=df, x=x, y=metric, hue=hue, hue_order=order, palette=palette(order),
                errorbar=CI, seed=0, ax=ax)
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles, [LABELS.get(lb, lb) for lb in labels], fontsize=7)
    ax.set(title=title, xlabel=x.split(".")[-1], ylabel="")
    _log_if_spread(ax, df[metric])


def cdf(ax, rq: pd.DataFrame, title: str, hue: str = "router.name") -> None:
    if rq.empty:
        _empty(ax, title)
        return
    rq = rq[rq.status == "ok"].assign(latency_ms=lambda d: d.latency_s * 1e3)
    order = ordered(rq[hue])
    sns.ecdfplot(data=rq, x="latency_ms", hue=hue, hue_order=order, palette=palette(order), ax=ax)
    leg = ax.get_legend()
    if leg is not None:
        for t in leg.get_texts():
            t.set_text(LABELS.get(t.get_text(), t.get_text()))
    ax.set(title=title, xlabel="latency (ms)", ylabel="CDF")


def stacked(ax, df: pd.DataFrame, prefix: str, title: str, x: str = "router.name") -> None:
    cols = [c for c in df.columns if c.startswith(prefix)]
    if df.empty or not cols:
        _empty(ax, title)
        return
    mean = df.groupby(x)[cols].mean()
    mean = mean.loc[ordered(mean.index)]
    mean.columns = [c[len(prefix):] for c in cols]
    mean.index = [LABELS.get(i, i) for i in mean.index]
    mean.plot(kind="bar", stacked=True, ax=ax, colormap="tab20c", width=0.75)
    ax.legend(fontsize=6, loc="upper right")
    ax.set(title=title, xlabel="", ylabel="share")
    ax.tick_params(axis="x", rotation=30)


def _empty(ax, title: str) -> None:
    ax.set_title(title)
    ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def with_degradation(df: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """Add ``degradation_pct``: the measured per-request degradation on the proxy
    (``quality.json`` of a replayed run, issue 6) where every run has it, else the
    surrogate Lambda of eq. (8); the returned label says which one was drawn."""
    if df.empty:
        return df, "degradation"
    col = "measured.degradation_mean"
    if col in df and df[col].notna().all():
        return df.assign(degradation_pct=df[col] * 100, surrogate_pct=df.lam_mean * 100), \
            "measured KL / CE_ref on the proxy"
    return df.assign(degradation_pct=df.lam_mean * 100), "surrogate Lambda, eq. (8)"
