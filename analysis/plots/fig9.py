"""Fig. 9: mean latency, P99 and SLA satisfaction vs request load."""

from __future__ import annotations

from ..load import FigureData
from . import common as C


def render(data: FigureData):
    panels = data.spec.panels
    fig, axes = C.grid(len(panels), data.spec.title)
    for ax, p in zip(axes, panels):
        C.lines(ax, data.runs, p["metric"], p["x"], p["title"])
    if not data.runs.empty:
        axes[2].axhline(1.0, color="grey", lw=0.5)
        for ax in axes[:-1]:  # one legend, where the SLA panel has room for it
            if ax.get_legend():
                ax.get_legend().remove()
        legend = axes[-1].get_legend()
        if legend:
            labels = [t.get_text() for t in legend.get_texts()]
            handles = legend.legend_handles
            for h in handles:
                h.set_markersize(6)
            axes[-1].legend(handles, labels, fontsize=7, loc="center right")
    fig.tight_layout()
    return fig
