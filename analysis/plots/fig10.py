"""Fig. 10 (the testbed's, not the paper's): prefill and decode timing vs request load."""

from __future__ import annotations

from ..load import FigureData
from . import common as C


def render(data: FigureData):
    panels = data.spec.panels
    fig, axes = C.grid(len(panels), data.spec.title)
    for i, (ax, p) in enumerate(zip(axes, panels)):
        C.lines(ax, data.runs, p["metric"], p["x"], p["title"], legend="center right" if i == len(panels) - 1 else None)
    fig.tight_layout()
    return fig
