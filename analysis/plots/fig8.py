"""Fig. 8: ablations; latency, traffic and CPU-offload, and quality degradation."""

from __future__ import annotations

from ..load import FigureData
from . import common as C


def render(data: FigureData):
    fig, axes = C.grid(5, data.spec.title)
    df = data.runs
    df, source = C.with_degradation(df)
    for ax, (metric, title) in zip(axes, [
            ("mean_ms", "(a) mean latency (ms)"), ("p99_ms", "(a) P99 latency (ms)"),
            ("gb_per_1k_tokens", "(b) GB / 1000 tokens"), ("cpu_offload_ratio", "(b) CPU-offload ratio"),
            ("degradation_pct", f"(c) quality degradation (%)\n{source}")]):
        C.router_bars(ax, df, metric, title)
    fig.tight_layout()
    return fig
