"""Two runs' step tables side by side: where two schedules of one spec part.

A run made with ``python -m testbed run SPEC --trace-steps`` (either backend) records every
step each server's stream ran: its model-time start, modeled seconds, layer, the active
replicas' precisions and token counts, and the dense part's (request, position) per token.
The emulator and its simulated twin run one step rule on one spec, so they should run the
same steps; an agreement check that fails says only that the totals differ. Lined up server
by server, the first step whose composition differs says where the two schedules parted
(a job that reached a stream in time on one side and not on the other, a routing decision
made on another view, a different step boundary), and the steps up to a time both runs
reached say how each server's work differed (steps, tokens per step, busy seconds).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from testbed.records import read_steps


def composition(row) -> tuple:
    """What a step held, independent of replica numbering: its layer, the (precision,
    tokens, GPU-resident) of each active replica and the dense part's (request, position)
    per token, each sorted."""
    reps = sorted(zip(map(int, row.rep_precision), map(int, row.rep_tokens), map(bool, row.rep_gpu)))
    dense = sorted(zip(map(int, row.dense_request), map(int, row.dense_position)))
    return int(row.layer), tuple(reps), tuple(dense)


def describe(row) -> str:
    layer, reps, dense = composition(row)
    reqs = sorted({q for q, _ in dense})
    return (f"t={row.t_start:.6f} layer {layer}, {len(reps)} replicas / "
            f"{sum(c for _, c, _ in reps)} expert tokens, dense {len(dense)} tokens of requests "
            f"{reqs}, {row.model_s * 1e3:.3f} ms")


@dataclass
class ServerDiff:
    server: int
    steps: tuple[int, int]  # steps each run's stream ran up to the horizon
    expert_tokens: tuple[int, int]  # expert jobs over them
    dense_tokens: tuple[int, int]
    busy_s: tuple[float, float]  # modeled stream seconds over them
    same_prefix: int  # steps that agree in composition before the first that differs
    start_drift_s: float  # largest start-time difference over that common prefix
    first_diff: tuple[str, str] | None  # the two runs' first differing steps, described


def diff_steps(a: pd.DataFrame, b: pd.DataFrame, until_s: float | None = None) -> list[ServerDiff]:
    """Server by server, the steps of ``a`` and ``b`` that started before ``until_s`` (default:
    the earlier of the two runs' last step starts, a time both reached)."""
    if a.empty or b.empty:
        raise ValueError("a run has no step table: run it with --trace-steps")
    if until_s is None:
        until_s = min(a.t_start.max(), b.t_start.max())
    out = []
    for n in sorted(set(a.server) | set(b.server)):
        sa = a[(a.server == n) & (a.t_start <= until_s)].sort_values("t_start", kind="stable")
        sb = b[(b.server == n) & (b.t_start <= until_s)].sort_values("t_start", kind="stable")
        ca, cb = [composition(r) for r in sa.itertuples()], [composition(r) for r in sb.itertuples()]
        same, drift = 0, 0.0
        for x, y, ta, tb in zip(ca, cb, sa.t_start, sb.t_start):
            if x != y:
                break
            same += 1
            drift = max(drift, abs(ta - tb))
        first = None
        if same < max(len(ca), len(cb)):
            ra = describe(sa.iloc[same]) if same < len(sa) else "(no further step)"
            rb = describe(sb.iloc[same]) if same < len(sb) else "(no further step)"
            first = (ra, rb)

        def tokens(s: pd.DataFrame, dense: bool) -> int:
            col = s.dense_request if dense else s.rep_tokens
            return int(sum(len(x) if dense else sum(x) for x in col))
        out.append(ServerDiff(int(n), (len(sa), len(sb)), (tokens(sa, False), tokens(sb, False)),
                              (tokens(sa, True), tokens(sb, True)),
                              (float(sa.model_s.sum()), float(sb.model_s.sum())), same, drift, first))
    return out


def compare_runs(run_a: Path, run_b: Path, until_s: float | None = None) -> tuple[float, list[ServerDiff]]:
    a, b = read_steps(run_a), read_steps(run_b)
    for run, s in ((run_a, a), (run_b, b)):
        if s.empty:
            raise ValueError(f"{run}: no step table (run it with --trace-steps)")
    horizon = until_s if until_s is not None else min(a.t_start.max(), b.t_start.max())
    return horizon, diff_steps(a, b, horizon)


def format_diffs(horizon: float, diffs: list[ServerDiff], names: tuple[str, str] = ("a", "b")) -> str:
    x, y = names
    lines = [f"steps that started by {horizon:.4f} model s ({x} / {y})",
             f"{'server':>6} {'steps':>13} {'expert tokens':>15} {'dense tokens':>15} "
             f"{'busy ms':>19} {'same':>6} {'drift us':>9}"]
    for d in diffs:
        lines.append(f"{d.server:6d} {d.steps[0]:6d}/{d.steps[1]:<6d} {d.expert_tokens[0]:7d}/"
                     f"{d.expert_tokens[1]:<7d} {d.dense_tokens[0]:7d}/{d.dense_tokens[1]:<7d} "
                     f"{d.busy_s[0] * 1e3:9.2f}/{d.busy_s[1] * 1e3:<9.2f} {d.same_prefix:6d} "
                     f"{d.start_drift_s * 1e6:9.1f}")
    for d in diffs:
        if d.first_diff is not None:
            lines.append(f"server {d.server}: step {d.same_prefix} differs\n  {x}: {d.first_diff[0]}\n"
                         f"  {y}: {d.first_diff[1]}")
    lines.append("same: steps alike in composition (layer, replicas' precision/tokens/tier, dense "
                 "tokens) before the first that differs; drift: the largest start-time difference "
                 "over them")
    return "\n".join(lines)
