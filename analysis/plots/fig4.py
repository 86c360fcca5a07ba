"""Fig. 4: quality by method at the default budget, and HetRoute vs the budget.

Degradation is measured on the proxy model where the runs were replayed
(KL from the full-precision output over CE_ref, per request), otherwise the
accumulated Lambda of eq. (8) under the run's quality model; the panel titles
say which. The dotted line is the budget.
"""

from __future__ import annotations

from ..load import FigureData, select
from . import common as C


def render(data: FigureData):
    fig, (a, b) = C.grid(2, data.spec.title, cols=2, size=(5.2, 3.6))
    pa, pb = data.spec.panels
    df = data.runs
    df, source = C.with_degradation(df)
    C.router_bars(a, select(df, pa.get("where", {})), "degradation_pct", f"{pa['title']} (%)\n{source}")
    for bars in a.containers:  # a method that never quantizes has a zero bar: say so
        a.bar_label(bars, fmt="%.3g", fontsize=7)
    sub = select(df, pb.get("where", {}))
    if sub.empty:
        C._empty(b, pb["title"])
    else:
        sub = sub.assign(budget_pct=sub["quality.budget"] * 100)
        C.lines(b, sub, "mean_ms", "budget_pct", pb["title"], hue="none")
        b.set_ylabel("mean latency (ms)")
        b.set_xlabel("budget (%)")
        twin = b.twinx()
        g = sub.groupby("budget_pct").degradation_pct.mean()
        twin.plot(g.index, g.values, "s--", color="tab:red", label=f"degradation ({source})")
        if "surrogate_pct" in sub:
            gs = sub.groupby("budget_pct").surrogate_pct.mean()
            twin.plot(gs.index, gs.values, "^-.", color="tab:purple", label="surrogate Lambda")
        twin.plot(g.index, g.index, ":", color="grey", label="budget")
        twin.set_ylabel("degradation (%)", color="tab:red")
        twin.legend(fontsize=7, loc="upper center")
    fig.tight_layout()
    return fig
