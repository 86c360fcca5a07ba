"""Capacity: the highest load at which a router keeps 90% of requests within the SLA.

``python -m testbed capacity SPEC --router R`` searches the arrival rate on the
simulator: doubling up from ``lo`` until the SLA share falls below the target,
then bisecting (geometrically) between the last load that met it and the
first that did not, to ``rel_tol``. Every probe is a complete run folder under
``results/capacity/<spec>-<physics>/<router>/rate=<r>/`` and is reused when its resolved
spec is unchanged, so a second search, or a killed one, costs only what is new.
The SLA share counts failed requests as misses (``metrics.sla_ratio``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .runner import is_done, run_experiment
from .setup import resolve_inputs
from .spec import ExperimentSpec, SpecError

TARGET = 0.9


@dataclass
class Capacity:
    router: str
    capacity_rps: float  # 0.0: not even ``lo`` meets the SLA
    probes: list[tuple[float, float, bool]] = field(default_factory=list)  # (rate, sla, unstable)
    bounded: bool = True  # False: ``hi`` still met the SLA


def _probe(spec: ExperimentSpec, rate: float, root: Path, cache: Path) -> dict:
    s = resolve_inputs(spec.with_overrides({"workload.rate_per_s": rate,
                                            "name": f"{spec.name}-rate{rate:g}"}))
    out = root / f"rate={rate:.4g}"
    if is_done(out, s):
        import json
        return json.loads((out / "metrics.json").read_text())
    return run_experiment(s, out, progress=False, placement_cache=cache).metrics


def find_capacity(spec: ExperimentSpec, router: str, results: Path = Path("results"),
                  lo: float = 1.0, hi: float = 320.0, rel_tol: float = 0.1,
                  target: float = TARGET, log=print) -> Capacity:
    if not (0 < lo < hi) or not (0 < rel_tol < 1) or not (0 < target <= 1):
        raise SpecError("capacity: need 0 < lo < hi, 0 < rel_tol < 1 and 0 < target <= 1")
    if spec.backend != "sim":
        raise SpecError("capacity: searches on the simulator (backend: sim)")
    spec = spec.with_overrides({"router.name": router})
    root = results / "capacity" / f"{spec.name}-{spec.physics}" / router.replace(":", "_")
    cache = results / ".placements"
    cap = Capacity(router, 0.0)

    def ok(rate: float) -> bool:
        m = _probe(spec, rate, root, cache)
        sla = float(m.get("sla_ratio", 0.0))
        cap.probes.append((rate, sla, bool(m.get("unstable", False))))
        log(f"  {router}: {rate:g} req/s -> {sla:.1%} within the SLA"
            + (" (unstable)" if m.get("unstable") else ""))
        return sla >= target

    if not ok(lo):
        return cap
    good, bad = lo, None
    while bad is None:
        nxt = good * 2
        if nxt > hi:
            cap.capacity_rps, cap.bounded = good, False
            return cap
        if ok(nxt):
            good = nxt
        else:
            bad = nxt
    while bad / good > 1 + rel_tol:
        mid = (good * bad) ** 0.5
        if ok(mid):
            good = mid
        else:
            bad = mid
    cap.capacity_rps = good
    return cap
