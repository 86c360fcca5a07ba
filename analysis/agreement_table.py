"""An ``agree-sweep``'s ``agreement.json`` as a Markdown table, one row per point.

The README's agreement tables were copied from the printed rows by hand; this renders them
from the file the check wrote, so a table says exactly what the run measured (ratios as
``agree-sweep`` computes them: emulator over simulator, NaN where a side finished no
measured request). Where the check ran jittered twins (``--sim-band``), the last column is
the emulator against the simulator's ensemble (``testbed.agreement.ensemble_side``); for
pooled seeds the next says what their bootstrap interval decides (``SeedInterval``).
Reads results only.
"""

from __future__ import annotations

import json
from pathlib import Path

from testbed.agreement import SeedInterval, checked_ratios, ratio, span_text

HEADER = ("| router | req/s | T | cut at (s) | finished (of measured) | mean ms | ratio | P99 ms "
          "| ratio | token-layers done by the cut | ratio | within | within the ensemble "
          "| over the seeds (95%) |")


def _pair(pair: list, fmt: str) -> tuple[str, str]:
    """``emu / sim`` and their ratio, or ``-`` where a side has no value."""
    a, b = pair
    if a is None or b is None or a != a or b != b:
        return "-", "-"
    return f"{a:{fmt}} / {b:{fmt}}", f"{ratio(a, b):.3f}"


def _ensemble(c: dict) -> str:
    """The emulator against the simulator's ensemble (exact and jittered twins pooled):
    ``yes`` / ``**no**`` and the ratios it checked, ``-`` where the check ran no band."""
    e = c.get("ensemble")
    if not e:
        return "-"
    ratios = [f"{name} {r:.3f}" for name, r in
              checked_ratios(e["mean_ms"], e["p99_ms"], e["work"], e["requests"], e["cut"])]
    ok = e["ok_mean"] and e["ok_p99"] and e["ok_work"]
    return f"{'yes' if ok else '**no**'} ({', '.join(ratios)})" if ratios else (
        "yes" if ok else "**no**")


def _seeds(c: dict) -> str:
    """The seeds' bootstrap interval of the mean and P99 ratios (and of the work's, where a
    run was cut) and what each decides; ``-`` for one seed."""
    d = c.get("seed_ci")
    if not d:
        return "-"
    p99 = d.get("p99")  # absent from files written before the P99 was bounded
    ci = SeedInterval(d["seeds"], tuple(d["mean"]), tuple(d["work"]),
                      tuple(p99) if p99 is not None else None)
    parts = ci.judged(c["requests"], c["cut"], c["kind"])
    return "; ".join(f"{name} {span_text(span)} ({v})" for name, span, v in parts) or "-"


def row(point: dict) -> str:
    """One point of ``agreement.json`` (a ``PointComparison`` as ``asdict`` wrote it)."""
    c = point["check"]
    cut = point.get("cut_s")
    mean, mean_r = _pair(c["mean_ms"], ".1f")
    p99, p99_r = _pair(c["p99_ms"], ".1f")
    work, work_r = _pair(c["work"], "d")
    dil = c["dilation"][0]
    seeds = c.get("seeds", 1)
    finished = f"{c['requests'][0]} / {c['requests'][1]} ({point['measured']})"
    ok = "yes" if point["ok"] else "**no**"
    if point["ok"] is False and point.get("in_band"):
        ok = "**no** (inside the band)"
    router = c["router"] + (f" ({seeds} seeds)" if seeds > 1 else "")
    return (f"| {router} | {point['rate_per_s']:g} | {'-' if dil is None else f'{dil:g}'} | "
            f"{'-' if cut is None else f'{cut:.2f}'} | {finished} | {mean} | {mean_r} | {p99} | "
            f"{p99_r} | {work} | {work_r} | {ok} | {_ensemble(c)} | {_seeds(c)} |")


def table(points: list[dict]) -> str:
    """The rows sorted by router and load, under the README's header, and a count line."""
    points = sorted(points, key=lambda p: (p["check"]["router"], p["rate_per_s"]))
    within = sum(bool(p["ok"]) for p in points)
    banded = sum(bool(p["ok"]) or bool(p.get("in_band")) for p in points)
    ensemble = sum(bool(p.get("ok_ensemble")) for p in points)
    sep = "|" + "---|" * HEADER.count(" | ") + "---|"
    lines = [HEADER, sep, *(row(p) for p in points), "",
             f"{within} of {len(points)} within tolerance"
             + (f"; {banded} within or inside the simulator's jitter band; {ensemble} within "
                f"tolerance of the simulator's ensemble"
                if any(p.get("in_band") is not None for p in points) else "")]
    return "\n".join(lines)


def load(path: Path) -> list[dict]:
    """The points of an ``agreement.json`` (or of the folder that holds one)."""
    path = Path(path)
    if path.is_dir():
        path = path / "agreement.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not an agree-sweep's agreement.json ({err})") from None
    if not isinstance(data, list) or not all(isinstance(p, dict) and "check" in p for p in data):
        raise ValueError(f"{path}: not an agree-sweep's agreement.json (expected a list of points)")
    return data
