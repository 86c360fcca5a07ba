"""Fig. 7: latency, traffic and quality retention of HetRoute and baselines on three models."""

from __future__ import annotations

from ..load import FigureData
from . import common as C


def render(data: FigureData):
    panels = data.spec.panels
    fig, axes = C.grid(len(panels), data.spec.title)
    df = data.runs
    df, source = C.with_degradation(df)
    if not df.empty:
        df = df.assign(retention=1.0 - df.degradation_pct / 100)
    for ax, p in zip(axes, panels):
        metric = "retention" if p.get("kind") == "retention" else p["metric"]
        C.grouped_bars(ax, df, metric, p["x"], p["title"] + (f"\n{source}" if metric == "retention" else ""))
        if metric == "retention" and not df.empty:
            ax.set_ylim(0.95, 1.0)
    fig.tight_layout()
    return fig
