"""Where two runs of one spec first part, from their token-layer records alone.

``compare-steps`` lines up step tables, which only runs made with ``--trace-steps`` have. An
agreement check's many seeds are ordinary runs, and at a point whose schedule branches on
microseconds (HetRoute under load) the question is not whether two trajectories part but
what parts them first: a routing decision taken differently while every token-layer before
it started at the same model time (the router read another state: a view or feedback applied
in another order), or a token-layer that started at another time first (a hop, a step or a
queue took another time). Both backends record every token-layer with its decider, its
aggregator, the replicas it used and the model-time durations that make up its life, so
joined on (request, token, layer) each token-layer has six instants (``INSTANTS``: its start,
its decision, its dispatch, the end of its fan-out, of its step and of its fan-in). Decisions
are taken in the reference run's order of decision instants (the router runs when the
layer's dense part ends, which under load is tens of ms after the layer started), and the
first decision that differs is a *decision* fork only if no instant of any token-layer
differed by more than the tolerance before it; otherwise the earliest such instant is where
the runs parted (*timing*). Until 2026-12-06 decisions were taken in the order of their
layers' starts and only starts were compared, which read a decision made after a dense wait
of another length, or after a partial that arrived later, as a decision fork. The start
differences of the rows decided before the first decision that differs are the compared
run's timing noise in model time on the common trajectory; their change from one layer of
a token to its next is that noise per layer (a layer is a fan-out, a step and a fan-in),
which the simulator's ``sim.hop_jitter_s`` draws once per hop.
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
#: a token-layer's instants, in order: each is the one before plus a recorded duration
#: (its start; the dense part's end, when the decision begins; the decision's end, when the
#: state leaves; the fan-out's end; the step's end; the fan-in's end, the layer's end)
INSTANTS = ["start", "decision", "dispatch", "fan-out end", "step end", "end"]
_DURATIONS = ["dense_s", "decision_s", *PARTS]


@dataclass
class Fork:
    """Run A against reference run B over the token-layers both started by ``horizon_s`` and
    their instants up to it."""

    horizon_s: float
    compared: int  # token-layers in both runs, started by the horizon
    #: B's instant of the first decision taken differently (the dense part's end at its
    #: residing server, where the router ran), in B's order of decision instants
    decision_s: float | None
    decision_key: tuple | None
    decision_ab: tuple | None  # ((decider, aggregator, replicas) in A, in B)
    decision_dt_us: float | None  # A's decision instant less B's at that token-layer
    #: B's time of the first instant (``INSTANTS``) of any token-layer that differs by more
    #: than the tolerance in A (or a token-layer B started that A did not)
    timing_s: float | None
    timing_key: tuple | None
    timing_dt_us: float | None
    tol_us: float
    #: |A's start - B's| over the token-layers decided before the decision fork, µs: p50, p99, max
    drift_us: tuple[float, float, float]
    #: |change of that difference from a token's layer to its next|, same rows: p50, p99, max
    per_layer_us: tuple[float, float, float]
    rows_before: int  # token-layers decided before the decision fork
    #: |A's part - B's| per part (``PARTS``) over those of the same rows that ended in both
    #: runs by the decision fork (a part still running then waits on work that followed it
    #: in one run only), µs: (p50, p99, max) each
    parts_us: dict[str, tuple[float, float, float]]
    parts_rows: int  # how many rows ``parts_us`` reads
    timing_what: str | None = None  # which of ``INSTANTS`` differed first

    @property
    def first(self) -> str:
        """What parts first: ``decision`` (a decision differs while every instant of every
        token-layer before it, starts, decisions and parts' ends, is within tolerance),
        ``timing`` (an instant differed first, or at the decision's own instant), or
        ``none`` (nothing by the horizon)."""
        if self.decision_s is None and self.timing_s is None:
            return "none"
        if self.timing_s is None or (self.decision_s is not None and self.decision_s < self.timing_s):
            return "decision"
        return "timing"


def _decisions(tl: pd.DataFrame) -> pd.DataFrame:
    """One row per token-layer (a retried one's first attempt), its decision as a tuple and
    its instants (``INSTANTS``; a duration the records lack counts as zero)."""
    tl = tl.sort_values("t_start", kind="stable").drop_duplicates(KEY, keep="first")
    out = tl[KEY + ["t_start", "server", "next_server", *PARTS]].copy()
    t = tl.t_start.to_numpy(dtype=float)
    out[INSTANTS[0]] = t
    for name, d in zip(INSTANTS[1:], _DURATIONS):
        t = t + (tl[d].to_numpy(dtype=float) if d in tl else 0.0)
        out[name] = t
    out["routing"] = [(int(s), int(n), tuple(int(r) for r in rep))
                       for s, n, rep in zip(tl.server, tl.next_server, tl.replica)]
    return out


def _quantiles(x: np.ndarray) -> tuple[float, float, float]:
    if x.size == 0:
        return (float("nan"),) * 3
    return float(np.median(x)), float(np.percentile(x, 99)), float(x.max())


def _first_timing(j: pd.DataFrame, tol_s: float, horizon_s: float, a_last_end: float):
    """(B's time, row, instant name, A less B in s) of the earliest instant by the horizon
    that differs beyond ``tol_s``; a token-layer A lacks counts at its start (NaN) if B's
    ended by A's last recorded end (records are written as layers end, so one that ended
    later in B may just lie past where A's records stop, e.g. its drain cap)."""
    best = None
    ended_in_a = j["end_b"].to_numpy() <= a_last_end
    for name in INSTANTS:
        b = j[f"{name}_b"].to_numpy()
        d = j[f"{name}_a"].to_numpy() - b
        gone = np.isnan(d)
        bad = ((gone & ended_in_a) | (np.abs(np.nan_to_num(d)) > tol_s)) & (b <= horizon_s)
        if name != INSTANTS[0]:
            bad &= ~gone  # a missing token-layer counts once, at its start
        if bad.any():
            i = int(np.flatnonzero(bad)[np.argmin(b[bad])])
            if best is None or b[i] < best[0]:
                best = (float(b[i]), i, name, float(d[i]))
    return best


def first_fork(a: pd.DataFrame, b: pd.DataFrame, tol_s: float = 1e-6,
               horizon_s: float | None = None) -> Fork:
    """Token-layer records ``a`` against the reference ``b`` (``Fork``). The horizon defaults
    to the earlier of the two runs' last starts, so a run cut earlier is not read as parted.

    A decision is placed at the instant the router made it (its token-layer's start plus its
    dense part), not at the layer's start: under load a layer's dense part waits in its
    server's stream for tens of milliseconds, and what the router read at its decision is
    what every other token-layer had done by then."""
    if tol_s < 0:
        raise ValueError(f"tolerance must be >= 0 s, not {tol_s}")
    if a.empty or b.empty:
        raise ValueError("a run has no token-layer records")
    da, db = _decisions(a), _decisions(b)
    if horizon_s is None:
        horizon_s = float(min(da.t_start.max(), db.t_start.max()))
    j = db.merge(da, on=KEY, suffixes=("_b", "_a"), how="left")
    j = j[j.t_start_b <= horizon_s]
    order = np.lexsort((j.layer.to_numpy(), j.token.to_numpy(), j.request.to_numpy(),
                        j[f"{INSTANTS[1]}_b"].to_numpy()))
    j = j.iloc[order].reset_index(drop=True)
    missing = j.t_start_a.isna().to_numpy()
    differs = (np.array([x != y for x, y in zip(j.routing_a, j.routing_b)], bool) & ~missing
               & (j[f"{INSTANTS[1]}_b"].to_numpy() <= horizon_s))
    di = int(np.argmax(differs)) if differs.any() else None
    t_dec = f"{INSTANTS[1]}_b"
    fork_t = float(j[t_dec].iloc[di]) if di is not None else None
    timing = _first_timing(j, tol_s, horizon_s, float(da["end"].max()))
    before = j.iloc[:di] if di is not None else j
    bdt = (before.t_start_a - before.t_start_b)
    steps = (bdt.groupby([before.request, before.token]).diff()
             if not before.empty else pd.Series(dtype=float))
    key = lambda i: tuple(int(v) for v in j.iloc[i][KEY])  # noqa: E731
    if di is not None:
        ended = before[(before["end_a"] <= fork_t) & (before["end_b"] <= fork_t)]
    else:
        ended = before
    return Fork(
        horizon_s=horizon_s, compared=len(j),
        decision_s=fork_t,
        decision_key=key(di) if di is not None else None,
        decision_ab=(j.routing_a.iloc[di], j.routing_b.iloc[di]) if di is not None else None,
        decision_dt_us=float((j[f"{INSTANTS[1]}_a"].iloc[di] - fork_t) * 1e6) if di is not None else None,
        timing_s=timing[0] if timing else None,
        timing_key=key(timing[1]) if timing else None,
        timing_dt_us=timing[3] * 1e6 if timing else None,  # NaN: not started in A
        tol_us=tol_s * 1e6,
        drift_us=_quantiles(np.abs(bdt.dropna().to_numpy()) * 1e6),
        per_layer_us=_quantiles(np.abs(steps.dropna().to_numpy()) * 1e6),
        rows_before=len(before),
        parts_us={p: _quantiles(np.abs((ended[f"{p}_a"] - ended[f"{p}_b"]).dropna().to_numpy()) * 1e6)
                  for p in PARTS},
        parts_rows=len(ended),
        timing_what=timing[2] if timing else None)


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
        lines.append(f"  first decision that differs, made at {ms(f.decision_s)} in {b}: token-layer "
                     f"{f.decision_key} (request, token, layer): decider, aggregator, replicas "
                     f"{da} in {a}, {db} in {b}; its decision instant {f.decision_dt_us:+.1f} us")
    else:
        lines.append("  every decision alike up to the horizon")
    if f.timing_s is not None:
        lines.append(f"  first instant that differs by more than {f.tol_us:g} us at {ms(f.timing_s)}, "
                     f"token-layer {f.timing_key}'s {f.timing_what}: "
                     + (f"{f.timing_dt_us:+.1f} us" if f.timing_dt_us == f.timing_dt_us
                        else f"not started in {a} by then"))
    p, q = f.drift_us, f.per_layer_us
    lines.append(f"  before the first decision that differs ({f.rows_before} token-layers decided): "
                 f"start difference p50 {p[0]:.1f} / p99 {p[1]:.1f} / max {p[2]:.1f} us; its change "
                 f"per layer of a token p50 {q[0]:.1f} / p99 {q[1]:.1f} / max {q[2]:.1f} us")
    lines.append(f"  the parts' differences of the {f.parts_rows} of them that ended by it, "
                 "p50 / p99 / max us: " + "; ".join(
        f"{p.removesuffix('_s')} {v[0]:.1f} / {v[1]:.1f} / {v[2]:.1f}" for p, v in f.parts_us.items()))
    return "\n".join(lines)
