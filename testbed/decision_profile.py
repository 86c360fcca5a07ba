"""Profiled decision times: what ``engine.decision_s: calibrated`` charges on every machine.

A routing decision's CPU time is part of the world (issue 12 item 5), and the simulator
charges one constant per run. Timed on whatever host runs the sweep, that constant moved a
figure by up to 20% between two sessions of the same code (paper10 EdgeShard at 40 req/s:
463 and 553 ms), because a microsecond per decision moves queues past step boundaries
(README, "Decisions cost time"). So, as Vidur profiles operators once and simulates from
the profile, the constants are measured once on a named CPU (``python -m testbed
profile-decisions``), committed here, and charged wherever the code runs: a figure reruns
the same on any machine. A setting the profile does not hold is timed on the host, and its
run says so (``run.json``: ``decision_s_source``).

Entries are keyed by the placement cache's key (``setup.placement_key``: topology, model,
quality, memory, router and its parameters with their defaults filled in, seed, calibration
workload and a hash of the method's code), so a change to the method's code is never
charged an older code's time: its settings are timed again until the profile is
re-recorded. A recording times every setting in several passes over all of them and keeps
each setting's median (``measure(rounds=...)``).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
from pathlib import Path

#: the profile this repository ships (measured on the CPU each entry names)
PROFILE = Path(__file__).with_name("decision_profile.json")


def resolve(path: Path | str | None) -> Path | None:
    """``"shipped"``: this repository's profile (read at call time); None: no profile."""
    return PROFILE if path == "shipped" else (None if path is None else Path(path))


def load(path: Path | str | None = "shipped") -> dict[str, dict]:
    """Every entry of a profile file (none when there is no file)."""
    path = resolve(path)
    if path is None or not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except ValueError as err:
        raise ValueError(f"{path.name}: not a decision profile ({err})") from None
    return dict(data.get("entries", {}))


def lookup(key: str, path: Path | str | None = "shipped") -> dict | None:
    """The entry for one placement key, or None."""
    return load(path).get(key)


def record(entries: dict[str, dict], path: Path | str = "shipped",
           drop_code: str | None = None) -> int:
    """Merge ``entries`` into the profile (atomically; keys sorted, so diffs stay small).
    With ``drop_code``, entries measured on another version of the method's code go.
    Returns how many entries were dropped."""
    old = load(path)
    dropped = 0
    if drop_code is not None:
        keep = {k: v for k, v in old.items() if v.get("code") == drop_code}
        dropped = len(old) - len(keep)
        old = keep
    merged = {**old, **entries}
    path = resolve(path) or PROFILE
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"about": "CPU seconds per routing decision, by placement key "
                               "(testbed/decision_profile.py; `python -m testbed "
                               "profile-decisions` records them)",
                               "entries": dict(sorted(merged.items()))}, indent=1) + "\n")
    os.replace(tmp, path)
    return dropped


def host_cpu() -> str:
    """This machine's CPU model as the kernel names it (what an entry was measured on)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def entry(decision_s: float, method: str, code: str, what: dict) -> dict:
    """One profile entry: the number, how and where it was timed, and what it was of."""
    return {"decision_s": decision_s, "method": method, "cpu": host_cpu(),
            "measured": _dt.date.today().isoformat(), "code": code, **what}


def source(e: dict | None) -> str:
    """How a run's constant was obtained, for ``run.json``."""
    if e is None:
        return f"calibrated on this host ({host_cpu()}); not in the decision profile"
    return f"decision profile ({e.get('cpu', '?')}, {e.get('measured', '?')})"


def measure(specs: list, placement_cache: Path | None, fresh: bool = False,
            progress: bool = True, rounds: int = 1) -> dict[str, dict]:
    """Time the decision constant of every distinct setting among ``specs`` on this host
    (``core.calibrate_decision_s``: each of 256 calibration decisions' fastest of five
    passes, the median) and return them as profile entries. Placements come from (and go
    to) ``placement_cache``; a timing already stored there for this host and method is
    reused unless ``fresh``. Run it on a quiet machine: a shared core slows decisions.

    ``rounds`` > 1 times every setting again in further passes over all of them, so a
    setting's timings lie minutes apart, and records their median (``rounds_us`` keeps
    each): one timing drifts with this VM by about a third within minutes (README,
    "The decision profile"), and a pass over all settings spreads that drift over them
    instead of handing it to whichever setting was timed in a slow minute."""
    from tqdm import tqdm

    from .core import calibrate_decision_s
    from .setup import (DECISION_METHOD, _code_version, build_setup, check_spec,
                        placement_key, save_deployment)
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, not {rounds}")
    todo: dict[str, object] = {}
    for s in specs:
        if s.engine.decision_s != "calibrated":
            continue
        checked = check_spec(s)
        todo.setdefault(placement_key(checked.spec, checked.topology, checked.router_cls), s)
    timed: dict[str, list[float]] = {}
    routers, what = {}, {}
    for key, s in tqdm(todo.items(), desc="decisions", unit="setting", disable=not progress):
        # fresh: the set-up need not time the setting too (a fixed constant skips that)
        setup = build_setup(s.with_overrides({"engine.decision_s": 0.0}) if fresh else s,
                            placement_cache=placement_cache, decision_profile=None)
        d = setup.decision_s
        if fresh:
            d = calibrate_decision_s(setup.router)
            if placement_cache is not None:
                save_deployment(Path(placement_cache) / f"{key}.json", setup.deployment,
                                setup.router.placement_report,
                                {"host": platform.node(), "method": DECISION_METHOD,
                                 "decision_s": d})
        timed[key] = [d]
        what[key] = {"router": s.router.name, "model": s.workload.model,
                     "topology": setup.topology.name, "seed": s.seed}
        if rounds > 1:
            routers[key] = setup.router  # only the router: a setup holds its whole workload
    for r in range(1, rounds):
        for key in tqdm(todo, desc=f"decisions, round {r + 1} of {rounds}", unit="setting",
                        disable=not progress):
            timed[key].append(calibrate_decision_s(routers[key]))
    code = _code_version()
    method = DECISION_METHOD if rounds == 1 else f"{DECISION_METHOD}, median of {rounds} rounds"
    out: dict[str, dict] = {}
    for key, ds in timed.items():
        extra = {} if rounds == 1 else {"rounds_us": [round(d * 1e6, 1) for d in ds]}
        out[key] = entry(round(statistics.median(ds), 6), method, code, {**what[key], **extra})
    return out
