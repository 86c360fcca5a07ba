"""Where two runs of one spec first part, from their token-layer records alone.

``compare-steps`` lines up step tables, which only runs made with ``--trace-steps`` have. An
agreement check's many seeds are ordinary runs, and at a point whose schedule branches on
microseconds (HetRoute under load) the question is not whether two trajectories part but
what parts them first: a routing decision taken differently while every token-layer before
it started at the same model time (the router read another state: a view or feedback applied
in another order), or a token-layer that started at another time first (a hop, a step or a
queue took another time). Both backends record every token-layer with its decider, its
aggregator, the replicas it used and its model-time start, so joined on (request, token,
layer) and taken in the reference run's order of starts, the first row that differs says
which. The start differences of the rows before the first decision that differs are the
compared run's timing noise in model time on the common trajectory; their change from one
layer of a token to its next is that noise per layer (a layer is a fan-out, a step and a
fan-in), which the simulator's ``sim.hop_jitter_s`` draws once per hop.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from testbed.records import read_records

KEY = ["request", "token", "layer"]
#: a token-layer's parts as both backends record them: the state to the participants, the
#: experts' step (queue and kernels), the partials to the aggregator
PARTS = ["fanout_s", "compute_s", "fanin_s"]


@dataclass
class Fork:
    """Run A against reference run B over the token-layers both started by ``horizon_s``."""

    horizon_s: float
    compared: int  # token-layers in both runs, started by the horizon
    decision_s: float | None  # B's start of the first token-layer decided differently
    decision_key: tuple | None
    decision_ab: tuple | None  # ((decider, aggregator, replicas) in A, in B)
    decision_dt_us: float | None  # A's start less B's at that token-layer
    timing_s: float | None  # B's start of the first token-layer whose start differs > tol
    timing_key: tuple | None
    timing_dt_us: float | None
    tol_us: float
    #: |A's start - B's| over the token-layers before the decision fork, µs: p50, p99, max
    drift_us: tuple[float, float, float]
    #: |change of that difference from a token's layer to its next|, same rows: p50, p99, max
    per_layer_us: tuple[float, float, float]
    rows_before: int  # token-layers before the decision fork
    #: |A's part - B's| per part (``PARTS``) over those of the same rows that ended in both
    #: runs by the decision fork (a part still running then waits on work that followed it
    #: in one run only), µs: (p50, p99, max) each
    parts_us: dict[str, tuple[float, float, float]]
    parts_rows: int  # how many rows ``parts_us`` reads

    @property
    def first(self) -> str:
        """What part first: ``decision`` (a decision differs with every earlier start within
        tolerance), ``timing`` (a start differed first), or ``none`` (nothing by the horizon)."""
        if self.decision_s is None and self.timing_s is None:
            return "none"
        if self.timing_s is None or (self.decision_s is not None and self.decision_s <= self.timing_s):
            return "decision"
        return "timing"


def _decisions(tl: pd.DataFrame) -> pd.DataFrame:
    """One row per token-layer (a retried one's first attempt), its decision as a tuple."""
    tl = tl.sort_values("t_start", kind="stable").drop_duplicates(KEY, keep="first")
    out = tl[KEY + ["t_start", "server", "next_server", *PARTS]].copy()
    out["decision"] = [(int(s), int(n), tuple(int(r) for r in rep))
                       for s, n, rep in zip(tl.server, tl.next_server, tl.replica)]
    return out


def _quantiles(x: np.ndarray) -> tuple[float, float, float]:
    if x.size == 0:
        return (float("nan"),) * 3
    return float(np.median(x)), float(np.percentile(x, 99)), float(x.max())


def first_fork(a: pd.DataFrame, b: pd.DataFrame, tol_s: float = 1e-6,
               horizon_s: float | None = None) -> Fork:
    """Token-layer records ``a`` against the reference ``b`` (``Fork``). The horizon defaults
    to the earlier of the two runs' last starts, so a run cut earlier is not read as parted."""
    if tol_s < 0:
        raise ValueError(f"tolerance must be >= 0 s, not {tol_s}")
    if a.empty or b.empty:
        raise ValueError("a run has no token-layer records")
    da, db = _decisions(a), _decisions(b)
    if horizon_s is None:
        horizon_s = float(min(da.t_start.max(), db.t_start.max()))
    j = db.merge(da, on=KEY, suffixes=("_b", "_a"), how="left")
    j = j[j.t_start_b <= horizon_s].sort_values(["t_start_b", *KEY], kind="stable")
    dt = (j.t_start_a - j.t_start_b).to_numpy()  # NaN: started in B only (by the horizon)
    missing = np.isnan(dt)
    differs = np.array([x != y for x, y in zip(j.decision_a, j.decision_b)], bool) & ~missing
    late = missing | (np.abs(np.nan_to_num(dt)) > tol_s)
    di = int(np.argmax(differs)) if differs.any() else None
    ti = int(np.argmax(late)) if late.any() else None
    before = j.iloc[:di] if di is not None else j
    bdt = (before.t_start_a - before.t_start_b)
    steps = (bdt.groupby([before.request, before.token]).diff()
             if not before.empty else pd.Series(dtype=float))
    key = lambda i: tuple(int(v) for v in j.iloc[i][KEY])  # noqa: E731
    if di is not None:
        ends = [before.t_start_a + sum(before[f"{p}_a"] for p in PARTS),
                before.t_start_b + sum(before[f"{p}_b"] for p in PARTS)]
        ended = before[(ends[0] <= j.t_start_b.iloc[di]) & (ends[1] <= j.t_start_b.iloc[di])]
    else:
        ended = before
    return Fork(
        horizon_s=horizon_s, compared=len(j),
        decision_s=float(j.t_start_b.iloc[di]) if di is not None else None,
        decision_key=key(di) if di is not None else None,
        decision_ab=(j.decision_a.iloc[di], j.decision_b.iloc[di]) if di is not None else None,
        decision_dt_us=float(dt[di] * 1e6) if di is not None else None,
        timing_s=float(j.t_start_b.iloc[ti]) if ti is not None else None,
        timing_key=key(ti) if ti is not None else None,
        timing_dt_us=float(dt[ti] * 1e6) if ti is not None else None,  # NaN: not started in A
        tol_us=tol_s * 1e6,
        drift_us=_quantiles(np.abs(bdt.dropna().to_numpy()) * 1e6),
        per_layer_us=_quantiles(np.abs(steps.dropna().to_numpy()) * 1e6),
        rows_before=len(before),
        parts_us={p: _quantiles(np.abs((ended[f"{p}_a"] - ended[f"{p}_b"]).dropna().to_numpy()) * 1e6)
                  for p in PARTS},
        parts_rows=len(ended))


def fork_of_runs(run_a: Path, run_b: Path, tol_s: float = 1e-6) -> Fork:
    """``first_fork`` of two run folders' token-layer records."""
    for r in (run_a, run_b):
        if not (r / "token_layers").exists():
            raise ValueError(f"{r}: no token_layers records (not a finished run folder)")
    return first_fork(read_records(run_a)[0], read_records(run_b)[0], tol_s)


def format_fork(f: Fork, names: tuple[str, str]) -> str:
    a, b = names
    ms = lambda t: "-" if t is None else f"{t * 1e3:.3f} ms"  # noqa: E731
    lines = [f"{a} against {b}: {f.compared} token-layers compared up to {ms(f.horizon_s)} "
             f"(model time); first to part: {f.first}"]
    if f.decision_s is not None:
        (da, db) = f.decision_ab
        lines.append(f"  first decision that differs at {ms(f.decision_s)}, token-layer "
                     f"{f.decision_key} (request, token, layer): decider, aggregator, replicas "
                     f"{da} in {a}, {db} in {b}; its start {f.decision_dt_us:+.1f} us")
    else:
        lines.append("  every decision alike up to the horizon")
    if f.timing_s is not None:
        lines.append(f"  first start that differs by more than {f.tol_us:g} us at {ms(f.timing_s)}, "
                     f"token-layer {f.timing_key}: "
                     + (f"{f.timing_dt_us:+.1f} us" if f.timing_dt_us == f.timing_dt_us
                        else f"not started in {a} by then"))
    p, q = f.drift_us, f.per_layer_us
    lines.append(f"  before the first decision that differs ({f.rows_before} token-layers): start "
                 f"difference p50 {p[0]:.1f} / p99 {p[1]:.1f} / max {p[2]:.1f} us; its change per "
                 f"layer of a token p50 {q[0]:.1f} / p99 {q[1]:.1f} / max {q[2]:.1f} us")
    lines.append(f"  the parts' differences of the {f.parts_rows} of them that ended by it, "
                 "p50 / p99 / max us: " + "; ".join(
        f"{p.removesuffix('_s')} {v[0]:.1f} / {v[1]:.1f} / {v[2]:.1f}" for p, v in f.parts_us.items()))
    return "\n".join(lines)
