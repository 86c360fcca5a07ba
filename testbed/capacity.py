"""Capacity: the highest load at which a router keeps 90% of requests within the SLA.

``python -m testbed capacity SPEC --router R`` searches the arrival rate on the
simulator: doubling up from ``lo`` until the SLA share falls below the target,
then bisecting (geometrically) between the last load that met it and the
first that did not, to ``rel_tol``. Latency need not grow with load: under TCP's
idle decay (``net.transport: tcp``) a light load finds every connection cold and
a busier one keeps them warm, so where ``lo`` misses the search keeps doubling
until a load meets the SLA (then goes on as above; the loads below that missed are
kept in ``missed_below``) or a probe's queues grow (``unstable``: more load cannot
help) or ``hi`` is passed; only then is the capacity 0. Every probe is a complete run folder under
``results/capacity/<spec>-<physics>-sla<ms>/<router>/rate=<r>/`` and is reused when its
resolved spec is unchanged, so a second search, or a killed one, costs only what is new.
The SLA share counts failed requests as misses (``metrics.sla_ratio``). A probe in which
some server held more K/V cache than its memory leaves it (``kv_peak_share`` > 1,
``testbed/kv_memory.py``; any seed) in a world that let the cache grow on
(``engine.kv_overflow: none``, the default) does not meet the SLA whatever its share: that
load's latencies are of a world the cluster's memory could not hold, and cannot certify a
capacity (its rate is kept in ``kv_over``). Under ``kv_overflow: spill`` the part past the
room sat in host memory and its copies were charged, so such a probe counts as any other. With ``seeds`` > 1
each probe runs that many seeds (the spec's and the next ones: ``rate=<r>/``, then
``rate=<r>-seed<s>/``; the answer in ``capacity-seeds<n>.json``) and the share is pooled
over their measured requests: one seed per probe let a chaotic router's answer turn on
its luckiest or unluckiest seed (HetRoute at 1 s: 91.3% at 32 req/s and 0.9% at 34.9 on
seed 0). The answer is
written beside the probes (``capacity.json``, with the setting it holds for: ``setting_key``),
where the compare table and Figs. 2 and 9 read it (``read_capacities``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .kv_memory import kv_unheld
from .runner import is_done, run_experiment
from .setup import resolve_inputs
from .spec import ExperimentSpec, SpecError

TARGET = 0.9


@dataclass
class Capacity:
    """A search's answer and what it holds for; ``capacity.json`` is this as a dict."""

    router: str
    sla_s: float
    target: float
    physics: str
    setting: str  # ``setting_key`` of the searched spec
    spec: str  # its name
    duration_s: float  # of each probe's arrivals
    lo: float
    hi: float
    capacity_rps: float = 0.0  # 0.0: not even ``lo`` meets the SLA
    probes: list[tuple[float, float, bool]] = field(default_factory=list)  # (rate, sla, unstable)
    bounded: bool = True  # False: ``hi`` still met the SLA
    missed_below: list[float] = field(default_factory=list)  # lighter loads that missed
    seeds: int = 1  # per probe, their measured requests pooled
    probe_seeds: list[list[float]] = field(default_factory=list)  # per probe: each seed's share
    kv_over: list[float] = field(default_factory=list)  # probed loads whose K/V outgrew a server


def _probe(spec: ExperimentSpec, rate: float, root: Path, cache: Path, tag: str = "") -> dict:
    """One run at ``rate`` (its metrics), in ``rate=<r><tag>/``, reused when complete."""
    s = resolve_inputs(spec.with_overrides({"workload.rate_per_s": rate,
                                            "name": f"{spec.name}-rate{rate:g}{tag}"}))
    out = root / f"rate={rate:.4g}{tag}"
    if is_done(out, s):
        return json.loads((out / "metrics.json").read_text())
    return run_experiment(s, out, progress=False, placement_cache=cache).metrics


def pooled_probe(spec: ExperimentSpec, rate: float, root: Path, cache: Path, seeds: int = 1) -> dict:
    """A probe over ``seeds`` seeds (the spec's and the next ones): the SLA share of all
    their measured requests together, unstable if any seed's queues grew, over its K/V
    room if any seed's cache outgrew a server's (``kv_over``), and each seed's own share. A
    seed whose window measured no request counts as none of either."""
    within, measured, shares, unstable, kv_over = 0.0, 0, [], False, False
    for k in range(seeds):
        m = _probe(spec.with_overrides({"seed": spec.seed + k}), rate, root, cache,
                   f"-seed{spec.seed + k}" if k else "")
        n = int(m.get("requests", 0) or 0)
        sla = float(m.get("sla_ratio", 0.0))
        if n and sla == sla:  # (not NaN)
            within += sla * n
            measured += n
        shares.append(sla)
        unstable = unstable or bool(m.get("unstable", False))
        kv_over = kv_over or kv_unheld(m)
    share = shares[0] if seeds == 1 else (within / measured if measured else 0.0)
    return {"sla_ratio": share, "unstable": unstable, "per_seed": shares, "kv_over": kv_over}


def find_capacity(spec: ExperimentSpec, router: str, results: Path = Path("results"),
                  lo: float = 1.0, hi: float = 320.0, rel_tol: float = 0.1,
                  target: float = TARGET, log=print, seeds: int = 1) -> Capacity:
    if not (0 < lo < hi) or not (0 < rel_tol < 1) or not (0 < target <= 1):
        raise SpecError("capacity: need 0 < lo < hi, 0 < rel_tol < 1 and 0 < target <= 1")
    if not 1 <= seeds <= 100:
        raise SpecError(f"capacity: seeds must be 1-100, not {seeds}")
    if spec.backend != "sim":
        raise SpecError("capacity: searches on the simulator (backend: sim)")
    w = spec.workload
    if w.arrivals == "trace" and w.trace_rate == "recorded":
        raise SpecError("capacity: workload.trace_rate: recorded replays the trace's own rate, "
                        "which the search cannot vary; use trace_rate: spec")
    spec = spec.with_overrides({"router.name": router})
    root = (results / "capacity" / f"{spec.name}-{spec.physics}-sla{spec.sla_s * 1e3:g}ms"
            / router.replace(":", "_"))
    cache = results / ".placements"
    cap = Capacity(router, spec.sla_s, target, spec.physics, setting_key(spec), spec.name,
                   spec.workload.duration_s, lo, hi, seeds=seeds)
    _search(cap, spec, root, cache, rel_tol, log)
    root.mkdir(parents=True, exist_ok=True)
    (root / capacity_file(seeds)).write_text(json.dumps(asdict(cap), indent=1))
    return cap


def capacity_file(seeds: int) -> str:
    """Where a search's answer is kept beside its probes: ``capacity.json`` with one seed
    per probe, ``capacity-seeds<n>.json`` with n (whose first seed's runs are the one-seed
    search's own, so either search reuses the other's)."""
    return "capacity.json" if seeds == 1 else f"capacity-seeds{seeds}.json"


def _search(cap: Capacity, spec: ExperimentSpec, root: Path, cache: Path, rel_tol: float, log) -> None:
    router, lo, hi, target = cap.router, cap.lo, cap.hi, cap.target

    def ok(rate: float) -> bool:
        m = pooled_probe(spec, rate, root, cache, cap.seeds)
        sla = m["sla_ratio"]
        cap.probes.append((rate, sla, m["unstable"]))
        cap.probe_seeds.append(m["per_seed"])
        each = (f" (seeds: {', '.join(f'{x:.1%}' for x in m['per_seed'])})"
                if cap.seeds > 1 else "")
        if m["kv_over"]:
            cap.kv_over.append(rate)
        log(f"  {router}: {rate:g} req/s -> {sla:.1%} within the SLA{each}"
            + (" (unstable)" if m["unstable"] else "")
            + (" (K/V cache past a server's room: does not count)" if m["kv_over"] else ""))
        return sla >= target and not m["kv_over"]

    good = lo
    while not ok(good):
        cap.missed_below.append(good)
        if cap.probes[-1][2] or good * 2 > hi:  # overloaded, or nothing left to try
            cap.missed_below = []
            return
        good *= 2
    bad = None
    while bad is None:
        nxt = good * 2
        if nxt > hi:
            cap.capacity_rps, cap.bounded = good, False
            return
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


def setting_key(spec: ExperimentSpec) -> str:
    """What a capacity holds for: the spec without the load, the run's length, its name,
    seed, router, backend and after-run measurement (the world, SLA, topology, model,
    request shape, budgets, engine and faults stay in). Resolved first (``resolve_inputs``)."""
    d = resolve_inputs(spec).model_dump(mode="json")
    for k in ("name", "seed", "router", "backend", "emu"):
        d.pop(k, None)
    for k in ("rate_per_s", "duration_s", "warmup_s"):
        d["workload"].pop(k, None)
    for k in ("replay", "inrun"):
        d["quality"].pop(k, None)
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def read_capacities(results: Path, spec: ExperimentSpec) -> dict[str, dict]:
    """Every capacity found under ``results/capacity`` for this spec's setting
    (``setting_key``: same world, SLA, topology, model, ...), by router: where several
    searched the same router, the one with the most seeds per probe (pooled: the less
    chance-bound answer), and of those the newest."""
    key = setting_key(spec)
    found: dict[str, tuple[tuple[int, float], dict]] = {}
    for f in (results / "capacity").glob("*/*/capacity*.json"):
        try:
            c = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if c.get("setting") == key:
            t = (int(c.get("seeds", 1)), f.stat().st_mtime)
            if c["router"] not in found or t > found[c["router"]][0]:
                found[c["router"]] = (t, c)
    return {r: c for r, (_, c) in sorted(found.items())}


def describe(c: dict) -> str:
    """One phrase: the capacity in req/s, with its search's bounds and seeds per probe."""
    seeds = int(c.get("seeds", 1))
    pooled = f"{seeds} seeds pooled per probe" if seeds > 1 else ""
    if not c["capacity_rps"]:
        tried = [p[0] for p in c.get("probes", [])]
        why = (f"every load tried misses: {', '.join(f'{r:g}' for r in tried)} req/s"
               if len(tried) > 1 else f"{c['lo']:g} req/s already misses")
        return f"0 ({why}{'; ' + pooled if pooled else ''}{_over(c)})"
    below = c.get("missed_below") or []
    return (f"{c['capacity_rps']:.3g} req/s" + (f" ({pooled})" if pooled else "")
            + ("" if c["bounded"] else f" or more (the search stops below {c['hi']:g})")
            + (f"; lighter loads miss ({', '.join(f'{r:g}' for r in below)} req/s)" if below else "")
            + _over(c))


def _over(c: dict) -> str:
    over = c.get("kv_over") or []
    return (f"; the K/V cache outgrew a server at {', '.join(f'{r:.3g}' for r in over)} req/s"
            if over else "")


def criterion(c: dict) -> str:
    """The capacity's criterion in words, e.g. '90% within 300 ms'."""
    return f"{c['target']:.0%} within {c['sla_s'] * 1e3:g} ms"
