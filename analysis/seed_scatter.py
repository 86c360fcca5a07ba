"""How far each seed's emulated run strays from its exact simulated twin, against how far a
jittered simulated twin strays from the same twin (``python -m analysis seed-scatter``).

A pooled agreement check can hold while single seeds stray far: at a point whose schedule
branches on microseconds (HetRoute under load) one seed's ratio is a chaotic draw. What
says whether the emulator is as faithful as an implementation with a known timing noise is
the *spread* of its per-seed ratios next to the spread of the simulator's own, seed by
seed, when the simulator runs with a mean hop jitter J (``sim.hop_jitter_s``, the runs that
``agree-sweep --sim-band J`` leaves beside each twin). Both are read at the emulated run's
cut, as the check reads them. The statistic is the root mean square of (ratio - 1) over
the seeds; its emulator / null quotient gets a bootstrap interval over the seeds
(resampled jointly, so a seed that is hard for both counts once). A quotient whose interval
holds 1 says the emulator scatters as the simulator does under J of jitter; above 1, more.
Beside the ratios, where each side's run first takes a routing decision differently from
its exact twin (``first-fork``) and how far its starts had moved before that: a side with
more timing noise parts sooner.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from testbed.agreement import (TOL, TOL_WORK, emulated_points, further_seed_dir, measure_cut,
                               own_cut, twin_dir)
from testbed.records import read_records
from testbed.spec import load_spec

from .first_fork import first_fork

METRICS = ("work", "mean")
#: one seed's ratio is out when it strays by more than the check's tolerance
OUT = {"work": TOL_WORK, "mean": TOL["emu/sim"][0]}


@dataclass
class Spread:
    """One side's per-seed ratios (against the exact twin) of one metric."""

    ratios: np.ndarray  # per seed; NaN where a side finished no measured request by the cut

    @property
    def valid(self) -> np.ndarray:
        return self.ratios[self.ratios == self.ratios]

    def rms(self) -> float:
        v = self.valid
        return float(np.sqrt(np.mean((v - 1) ** 2))) if v.size else float("nan")

    def out(self, tol: float) -> int:
        return int((abs(self.valid - 1) > tol).sum())


@dataclass
class PointScatter:
    """A point's emulator and jittered simulators, seed by seed, against its exact twins."""

    point: str
    seeds: list[int]
    sides: dict[str, dict[str, Spread]] = field(default_factory=dict)  # side -> metric -> spread
    #: side -> per seed, against the exact twin (``first_fork``): the instant of the first
    #: decision taken differently (model s; NaN: none by the horizon), the p99 of the start
    #: differences before it (us), and 1 where it parted with every earlier instant alike
    #: (``Fork.first == "decision"``), else 0
    forks: dict[str, np.ndarray] = field(default_factory=dict)

    def quotient(self, side: str, metric: str, draws: int = 4000, seed: int = 0
                 ) -> tuple[float, float, float]:
        """rms(emulator) / rms(side) and its 95% bootstrap interval over the seeds."""
        e, j = self.sides["emu"][metric].ratios, self.sides[side][metric].ratios
        both = (e == e) & (j == j)
        e, j = e[both] - 1, j[both] - 1
        if e.size < 2 or not np.any(j):
            return float("nan"), float("nan"), float("nan")
        idx = np.random.default_rng(seed).integers(0, e.size, size=(draws, e.size))
        num, den = np.sqrt((e[idx] ** 2).mean(1)), np.sqrt((j[idx] ** 2).mean(1))
        q = num[den > 0] / den[den > 0]
        return (float(np.sqrt((e ** 2).mean() / (j ** 2).mean())),
                float(np.percentile(q, 2.5)), float(np.percentile(q, 97.5)))


def _seed_runs(sweep: Path, agree: Path, rel: Path) -> dict[int, Path]:
    """The point's emulated runs by seed: the sweep's own, then those agree-sweep ran for
    further seeds (``further_seed_dir``)."""
    runs = {spec.seed: run for run, spec, _ in emulated_points(sweep).get(sweep / rel, [])}
    for d in (agree / rel).glob("emu-seed*"):
        m = re.fullmatch(r"emu-seed(\d+)", d.name)
        if (m and d == further_seed_dir(agree, rel, int(m.group(1))) and (d / "run.json").exists()
                and json.loads((d / "run.json").read_text()).get("status") == "complete"):
            runs.setdefault(int(m.group(1)), d)
    return runs


def point_scatter(sweep: Path, agree: Path, rel: Path) -> PointScatter:
    """One point: every emulated seed whose exact twin is under ``agree``, and every jitter
    whose twin is there for all of those seeds."""
    runs = _seed_runs(sweep, agree, rel)
    seeds = sorted(s for s in runs if (twin_dir(agree, rel, s) / "run.json").exists())
    if not seeds:
        raise ValueError(f"no emulated seed of {rel} has a simulated twin under {agree}")
    jitters = sorted({float(m.group(1)) for d in (agree / rel).glob(f"seed{seeds[0]}-jitter*")
                      if (m := re.fullmatch(rf"seed{seeds[0]}-jitter(.+)", d.name))})
    jitters = [j for j in jitters
               if all((twin_dir(agree, rel, s, j) / "run.json").exists() for s in seeds)]
    names = {"emu": None, **{f"{j:g}": j for j in jitters}}
    w = load_spec(runs[seeds[0]] / "spec.resolved.yaml").workload
    rows: dict[str, list[tuple[float, float]]] = {k: [] for k in names}
    forks: dict[str, list[tuple[float, float]]] = {k: [] for k in names}
    for s in seeds:
        cut = own_cut(json.loads((runs[s] / "run.json").read_text()).get("stats", {}))
        ref = read_records(twin_dir(agree, rel, s))
        lat, _, done = measure_cut(*ref, cut, w.warmup_s, w.duration_s)
        exact = (lat.mean() if lat.size else float("nan"), done)
        for side, j in names.items():
            recs = read_records(runs[s] if side == "emu" else twin_dir(agree, rel, s, j))
            lat, _, done = measure_cut(*recs, cut, w.warmup_s, w.duration_s)
            mean = lat.mean() if lat.size else float("nan")
            rows[side].append((done / exact[1] if exact[1] else float("nan"),
                               mean / exact[0] if exact[0] == exact[0] and exact[0] else float("nan")))
            f = first_fork(recs[0], ref[0])
            forks[side].append((float("nan") if f.decision_s is None else f.decision_s,
                                f.drift_us[1], float(f.first == "decision")))
    out = PointScatter(str(rel), seeds, forks={k: np.array(v, dtype=float) for k, v in forks.items()})
    for side, pairs in rows.items():
        arr = np.array(pairs, dtype=float)
        out.sides[side] = {"work": Spread(arr[:, 0]), "mean": Spread(arr[:, 1])}
    return out


def sweep_scatter(sweep: Path, agree: Path) -> list[PointScatter]:
    """Every point of an emulated sweep whose twins ``agree-sweep`` ran under ``agree``."""
    rels = sorted(point.relative_to(sweep) for point in emulated_points(sweep))
    found = [r for r in rels if (agree / r).is_dir()]
    if not found:
        raise ValueError(f"none of the points of {sweep} has a folder under {agree}")
    return [point_scatter(sweep, agree, r) for r in found]


def format_scatter(points: list[PointScatter]) -> str:
    lines = []
    for p in points:
        lines.append(f"{p.point}: {len(p.seeds)} seeds; each seed's ratio against its exact "
                     f"simulated twin, at the emulated run's cut")
        for metric in METRICS:
            for side, spreads in p.sides.items():
                sp = spreads[metric]
                v = sp.valid
                if not v.size:
                    continue
                name = "emulator" if side == "emu" else f"sim {side} s jitter"
                q = "" if side == "emu" else (
                    "   emulator rms / this: {:.2f} (95% {:.2f}-{:.2f})".format(*p.quotient(side, metric)))
                lines.append(f"  {metric:>4} {name:>22}: {v.min():.3f}-{v.max():.3f}  rms "
                             f"{sp.rms():.3f}  out of {OUT[metric]:.0%}: {sp.out(OUT[metric])} of "
                             f"{v.size}{q}")
        for side, f in p.forks.items():
            name = "emulator" if side == "emu" else f"sim {side} s jitter"
            d = f[:, 0][f[:, 0] == f[:, 0]]
            q = (" / ".join(f"{np.percentile(d, x) * 1e3:.1f}" for x in (25, 50, 75))
                 if d.size else "-")
            lines.append(f"  fork {name:>22}: first decision taken differently at p25 / p50 / "
                         f"p75 {q} ms ({f.shape[0] - d.size} seeds none; {int(f[:, 2].sum())} "
                         f"with every earlier instant alike); start difference "
                         f"before it p99 {np.nanmedian(f[:, 1]):.1f} us (median over the seeds)")
    return "\n".join(lines)


def format_per_seed(points: list[PointScatter]) -> str:
    """``point seed metric side=ratio ...`` per seed: the rows ``format_scatter`` summarises."""
    lines = []
    for p in points:
        for metric in METRICS:
            for i, seed in enumerate(p.seeds):
                vals = " ".join(f"{side}={spreads[metric].ratios[i]:.4f}"
                                for side, spreads in p.sides.items())
                lines.append(f"{p.point} seed={seed} {metric} {vals}")
    return "\n".join(lines)
