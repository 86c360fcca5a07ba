"""Fig. 9: mean latency, P99 and SLA satisfaction vs request load."""

from __future__ import annotations

from ..load import FigureData
from . import common as C


def render(data: FigureData):
    panels = data.spec.panels
    fig, axes = C.grid(len(panels), data.spec.title)
    for i, (ax, p) in enumerate(zip(axes, panels)):  # one legend, where the SLA panel has room
        C.lines(ax, data.runs, p["metric"], p["x"], p["title"],
                legend="center right" if i == len(panels) - 1 else None)
    if not data.runs.empty:
        axes[2].axhline(1.0, color="grey", lw=0.5)
    fig.tight_layout()
    return fig
