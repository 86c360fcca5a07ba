"""What a faithful emulator would read at a point: the simulator against itself (``agree-null``).

An agreement check at a point whose schedule branches on microseconds (an overloaded
HetRoute run cut at its drain cap) compares two trajectories of a chaotic system. Its
pooled ratio then moves by more than the 5% tolerance from seed to seed even for an
implementation that is exact up to timing noise, and ``agree-sweep``'s interval over the
seeds says "undecided" (asym5's HetRoute at 40 req/s: work 0.859-1.155 over six seeds).
Whether that verdict says something about the emulator or only about the point is a
question the simulator can answer alone: run each seed exactly and under a small mean hop
jitter (``sim.hop_jitter_s``: the jittered run stands in for a perfect emulator whose frames
land some microseconds late), cut both where the emulated run stopped, and read the same
pooled ratios and bootstrap interval (``seed_interval``) over the first N seeds for growing
N. The N at which this null check is decided is the fewest seeds at which *any* faithful
emulator could be confirmed within tolerance there; where the null check is itself
undecided at the emulated check's seed count, an emulated "undecided" is no evidence
against the emulator.

One jittered run per seed is one draw of the jitter (``sim.hop_jitter_draw``); at a chaotic
point a draw moves the pooled ratio by several percent (README, "Where the exact simulator's
seeds read high"). ``draws`` > 1 runs each seed under that many draws and pools them into the
seed's jittered side (every measured request once per draw, the work by the cut averaged),
and ``NullRow.per_draw`` keeps each draw's own pooled mean ratio.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from .agreement import (SIM_TWIN, TOL, TOL_WORK, SeedInterval, band_error, measure_cut, pool_seeds,
                        ratio, seed_interval, span_text)
from .records import read_records
from .runner import is_done, run_experiment
from .spec import ExperimentSpec


@dataclass
class NullRow:
    """The jittered simulator against the exact one over the first ``seeds`` seeds."""

    seeds: int
    mean_ms: tuple[float, float]  # (jittered, exact), the seeds' measured requests pooled
    p99_ms: tuple[float, float]  # the same requests' P99
    work: tuple[float, float]  # token-layers done by the cut, summed over the seeds (draws averaged)
    interval: SeedInterval
    cut: bool
    #: each jitter draw's own pooled mean ratio over these seeds (one entry per draw)
    per_draw: tuple[float, ...] = ()

    def judged(self) -> list[tuple[str, float, tuple[float, float], str]]:
        """(metric, pooled ratio, interval, verdict) for what a check at this point reads."""
        ratios = {"mean": ratio(*self.mean_ms), "P99": ratio(*self.p99_ms),
                  "work": ratio(*self.work)}
        requests = (int(self.mean_ms[0] == self.mean_ms[0]), int(self.mean_ms[1] == self.mean_ms[1]))
        return [(m, ratios[m], span, v)
                for m, span, v in self.interval.judged(requests, self.cut)]

    @property
    def decided(self) -> bool:
        """Every metric the check reads is decided (agrees or disagrees) at this many seeds."""
        parts = self.judged()
        return bool(parts) and all(not v.startswith(("undecided", "no interval"))
                                   for *_, v in parts)


def null_agreement(spec: ExperimentSpec, out: Path, seeds: int, jitter_s: float,
                   cut_s: float | None, steps: list[int] | None = None,
                   progress: bool = True, draws: int = 1) -> list[NullRow]:
    """Seeds ``spec.seed .. spec.seed+seeds-1`` of ``spec`` on the simulator, exactly
    (``<out>/seed<s>``) and under ``jitter_s`` of mean hop jitter (``<out>/seed<s>-jitter<J>``,
    and for ``draws`` > 1 the further draws ``<out>/seed<s>-jitter<J>-draw<k>``), all cut at
    ``cut_s`` (None: not cut); one ``NullRow`` per prefix of ``steps`` seeds (default 3, 6,
    12, ... up to ``seeds``). Complete runs are reused."""
    if seeds < 2:
        raise ValueError(f"seeds must be >= 2 for an interval over them, not {seeds}")
    if draws < 1:
        raise ValueError(f"draws must be >= 1, not {draws}")
    bad = band_error([jitter_s])
    if bad:
        raise ValueError(bad)
    steps = sorted({min(n, seeds) for n in (steps or _doubling(seeds)) if n >= 2})
    w = spec.workload

    def cut_run(s: ExperimentSpec, name: str) -> tuple:
        run = out / name
        if not is_done(run, s):
            run_experiment(s, run, progress=False)
        lat, _, done = measure_cut(*read_records(run), cut_s, w.warmup_s, w.duration_s)
        return lat, done

    exact: list[tuple] = []
    drawn: list[list[tuple]] = [[] for _ in range(draws)]  # per draw, per seed
    for k in tqdm(range(seeds), desc="agree-null", unit="seed", disable=not progress):
        seed = spec.seed + k
        exact.append(cut_run(spec.with_overrides({**SIM_TWIN, "seed": seed}), f"seed{seed}"))
        for d in range(draws):
            twin = spec.with_overrides({**SIM_TWIN, "seed": seed, "sim.hop_jitter_s": jitter_s,
                                        "sim.hop_jitter_draw": d})
            drawn[d].append(cut_run(twin, f"seed{seed}-jitter{jitter_s:g}" + (f"-draw{d}" if d else "")))
    # a seed's jittered side: its draws' measured requests together, their work averaged
    jittered = [(np.concatenate([drawn[d][k][0] for d in range(draws)]),
                 sum(drawn[d][k][1] for d in range(draws)) / draws) for k in range(seeds)]
    rows = []
    for n in steps:
        a, b = pool_seeds(jittered[:n], None, []), pool_seeds(exact[:n], None, [])
        per_draw = tuple(ratio(pool_seeds(drawn[d][:n], None, []).mean_ms, b.mean_ms)
                         for d in range(draws))
        rows.append(NullRow(n, (a.mean_ms, b.mean_ms), (a.p99_ms, b.p99_ms), (a.work, b.work),
                            seed_interval(jittered[:n], exact[:n]), cut_s is not None, per_draw))
    return rows


def _doubling(seeds: int) -> list[int]:
    n, out = 3, []
    while n < seeds:
        out.append(n)
        n *= 2
    return [*out, seeds]


def format_null(rows: list[NullRow], jitter_s: float, cut_s: float | None) -> str:
    draws = len(rows[0].per_draw) if rows else 1
    lines = [f"the simulator under {jitter_s * 1e6:g} us of mean hop jitter"
             + (f" ({draws} draws of it per seed, pooled)" if draws > 1 else "")
             + " against its exact run"
             f" ({'cut at ' + format(cut_s, '.2f') + ' s' if cut_s is not None else 'not cut'}),"
             " the seeds pooled; a faithful emulator's reading at this point:"]
    for r in rows:
        parts = "; ".join(f"{'token-layers' if m == 'work' else m} {v:.3f} ({span_text(span)}), "
                          f"{verdict}" for m, v, span, verdict in r.judged())
        if len(r.per_draw) > 1:
            parts += "; each draw's mean " + " ".join(f"{v:.3f}" for v in r.per_draw)
        lines.append(f"seeds={r.seeds:<3d} {parts or 'no metric to bound'}")
    first = next((r.seeds for r in rows if r.decided), None)
    lines.append(f"tolerances: mean {TOL['emu/sim'][0]:.0%}, P99 {TOL['emu/sim'][1]:.0%}, "
                 f"token-layers done by the cut "
                 f"{TOL_WORK:.0%}; intervals: 95% bootstrap over the seeds. "
                 + (f"Decided from {first} seeds." if first else
                    f"Not decided at {rows[-1].seeds} seeds."))
    return "\n".join(lines)
