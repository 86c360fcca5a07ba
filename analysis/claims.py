"""Machine-checkable claims: every number the paper states for a figure, beside ours.

A claim (in the figure spec) names a metric, one or two selections of runs
(``a``, ``b``: axis values) and the paper's number. Kinds:

- ``value``: the metric at ``a``; verdict "close" within 25% (or 0.05 absolute
  for shares of at least 0.2; small fractions such as a 1.6% degradation are
  judged relatively), else "differs".
- ``reduction``: 1 - a/b (the paper's "X% lower than"), paired by seed;
  ``ratio``: a/b. Verdict "agrees" when the direction matches the paper's
  (both better or both worse), else "disagrees"; magnitudes are reported, not judged.
- ``order``: runs ordered by the metric over an axis; "agrees" if the measured
  order of the paper's listed items is the paper's order.
- ``growth_less``: a's metric grows less than b's between two values of an axis.
- ``zero``/``at_most``: a bound that must hold in every run.

Measured values are means over seeds with a 95% t-interval when there are
several seeds; the raw per-seed values are kept.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd
from scipy import stats

from .load import select


def _ci(values: np.ndarray) -> list[float] | None:
    values = values[np.isfinite(values)]
    if len(values) < 2:
        return None
    m = values.mean()
    h = stats.t.ppf(0.975, len(values) - 1) * values.std(ddof=1) / math.sqrt(len(values))
    return [float(m - h), float(m + h)]


def _per_seed(df: pd.DataFrame, where: dict, metric: str) -> pd.Series:
    sub = select(df, where)
    if metric not in sub.columns or sub.empty:
        return pd.Series(dtype=float)
    return sub.groupby("seed")[metric].mean()


def _summary(vals: pd.Series) -> dict:
    arr = vals.to_numpy(dtype=float)
    if arr.size == 0 or not np.isfinite(arr).any():
        return {"measured": None, "ci95": None, "per_seed": []}
    return {"measured": float(np.nanmean(arr)), "ci95": _ci(arr),
            "per_seed": [float(x) for x in arr]}


def evaluate(claim: dict[str, Any], df: pd.DataFrame) -> dict[str, Any]:
    kind, metric = claim["kind"], claim["metric"]
    out: dict[str, Any] = {"id": claim["id"], "text": claim.get("text", ""), "kind": kind,
                           "metric": metric, "paper": claim["paper"]}
    paper = claim["paper"]
    if df.empty or metric not in df.columns:
        return {**out, "measured": None, "verdict": "no data"}
    if kind == "value":
        s = _summary(_per_seed(df, claim["a"], metric))
        out.update(s)
        if s["measured"] is not None:
            m = s["measured"]
            tol = 0.25 * abs(paper)
            if 0.2 <= abs(paper) <= 1:  # a share such as an SLA ratio: 5 points suffice
                tol = max(tol, 0.05)
            out["verdict"] = "close" if abs(m - paper) <= tol else "differs"
            out["ratio_to_paper"] = m / paper if paper else None
    elif kind in ("reduction", "ratio"):
        a = _per_seed(df, claim["a"], metric)
        b = _per_seed(df, claim["b"], metric)
        joined = pd.concat([a.rename("a"), b.rename("b")], axis=1).dropna()
        if joined.empty:
            out.update(measured=None, verdict="no data")
        else:
            with np.errstate(divide="ignore", invalid="ignore"):
                vals = joined.a / joined.b
            vals = 1 - vals if kind == "reduction" else vals
            s = _summary(vals.replace([np.inf, -np.inf], np.nan))
            out.update(s)
            m = s["measured"]
            if m is None:
                out["verdict"] = "no data"
            else:
                pivot = 0.0 if kind == "reduction" else 1.0
                if abs(paper - pivot) < 1e-9:  # the paper says "about the same"
                    out["verdict"] = "agrees" if abs(m - pivot) <= 0.05 else "disagrees"
                else:
                    out["verdict"] = "agrees" if (m - pivot) * (paper - pivot) > 0 else "disagrees"
    elif kind == "order":
        sub = select(df, claim.get("where", {}))
        axis = claim["over"]
        means = sub.groupby(axis)[metric].mean()
        listed = [x for x in paper if x in means.index]
        asc = not claim.get("descending", False)
        measured = [x for x in means.sort_values(ascending=asc).index if x in listed]
        out["measured"] = measured
        out["values"] = {str(k): float(v) for k, v in means.items()}
        if claim.get("first_only"):
            allm = list(means.sort_values(ascending=asc).index)
            out["measured"] = allm
            out["verdict"] = "agrees" if allm and allm[0] == paper[0] else "disagrees"
        elif len(listed) < 2:
            out["verdict"] = "no data"
        else:
            out["verdict"] = "agrees" if measured == listed else "disagrees"
            tau = stats.kendalltau([listed.index(x) for x in listed],
                                   [measured.index(x) for x in listed]).statistic
            out["kendall_tau"] = float(tau)
    elif kind == "growth_less":
        axis = claim["over"]
        g = {}
        for side in ("a", "b"):
            lo = _per_seed(df, {**claim[side], axis: claim["from"]}, metric)
            hi = _per_seed(df, {**claim[side], axis: claim["to"]}, metric)
            j = pd.concat([lo.rename("lo"), hi.rename("hi")], axis=1).dropna()
            g[side] = float((j.hi / j.lo).mean()) if not j.empty else None
        out["measured"] = [g["a"], g["b"]]
        out["verdict"] = "no data" if None in g.values() else (
            "agrees" if g["a"] < g["b"] else "disagrees")
    elif kind in ("zero", "at_most"):
        sub = select(df, claim.get("a", {}))
        vals = sub[metric].astype(float)
        out["measured"] = float(vals.max()) if len(vals) else None
        if out["measured"] is None:
            out["verdict"] = "no data"
        else:
            bound = 0.0 if kind == "zero" else paper
            out["verdict"] = "agrees" if out["measured"] <= bound + 1e-12 else "disagrees"
    else:
        raise ValueError(f"unknown claim kind {kind!r}")
    return out


def evaluate_all(claims: list[dict], df: pd.DataFrame) -> list[dict]:
    return [evaluate(c, df) for c in claims]
