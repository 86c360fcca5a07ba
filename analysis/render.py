"""Render one figure from existing results: PNG, PDF, the claims file and, for
emulated runs, the fidelity table (analysis/fidelity.py)."""

from __future__ import annotations

import datetime as _dt
import importlib
import json
from pathlib import Path

import pandas as pd

from testbed.capacity import criterion, describe, read_capacities
from testbed.spec import parse_spec
from testbed.sweep import figure_path, load_figure

from .claims import evaluate_all
from .fidelity import fidelity_table, summarise
from .load import FigureData, load_figure_data

#: The paper's Figs. 2-9, then the testbed's own (10: decode under load).
FIGURES = range(2, 11)


def available(fig: int, results: Path) -> list[tuple[str, str, str, float]]:
    """(backend, scale, physics, mtime) of every sweep of this figure that has results."""
    root = results / f"fig{fig}"
    out = []
    if root.exists():
        for d in root.iterdir():
            if d.is_dir() and "-" in d.name and (d / "sweep.json").exists():
                backend, rest = d.name.split("-", 1)
                scale, _, physics = rest.partition("-")
                out.append((backend, scale, physics or "hardware", (d / "sweep.json").stat().st_mtime))
    return sorted(out, key=lambda t: -t[3])


def stem(fig: int, physics: str = "hardware") -> str:
    """figN for the default physics, figN-paper for the paper's world."""
    return f"fig{fig}" if physics == "hardware" else f"fig{fig}-{physics}"


def render_figure(fig: int, backend: str, scale: str, results: Path, out: Path,
                  physics: str = "hardware") -> dict:
    spec = load_figure(figure_path(fig))
    data = load_figure_data(spec, backend, scale, results, physics)
    module = importlib.import_module(f"analysis.plots.fig{fig}")
    figure = module.render(data)
    capacity = capacities(spec, results, physics)
    if capacity:
        figure.text(0.01, 0.005, capacity_line(capacity), ha="left", fontsize=6, color="grey")
    seeds = sorted(set(int(x) for x in data.runs.seed)) if not data.runs.empty else []
    figure.text(0.99, 0.005, f"{backend}/{scale}, physics: {physics}: {len(data.runs)} runs"
                + (f", {data.missing} missing" if data.missing else "")
                + (", one seed: no confidence intervals" if len(seeds) == 1 else
                   f", {len(seeds)} seeds: 95% CIs" if seeds else ""),
                ha="right", fontsize=6, color="grey")
    out.mkdir(parents=True, exist_ok=True)
    by_run = out / "by-run"
    by_run.mkdir(exist_ok=True)
    name, tag = stem(fig, physics), f"{backend}-{scale}" + ("" if physics == "hardware" else f"-{physics}")
    for path in (out / name, by_run / f"fig{fig}-{tag}"):
        figure.savefig(path.with_suffix(".png"), dpi=130)
        figure.savefig(path.with_suffix(".pdf"))
    import matplotlib.pyplot as plt
    plt.close(figure)
    claims = claims_file(data)
    claims["capacity"] = capacity or None
    table = fidelity_table(data)
    claims["fidelity"] = summarise(table)
    for path in (out / f"{name}.claims.json", by_run / f"fig{fig}-{tag}.claims.json"):
        path.write_text(json.dumps(claims, indent=2))
    current = out / f"{name}.fidelity.csv"
    if table.empty:  # a simulated figure: no stale table from an earlier emulated one
        current.unlink(missing_ok=True)
    else:
        for path in (current, by_run / f"fig{fig}-{tag}.fidelity.csv"):
            table.to_csv(path, index=False, float_format="%.4g")
    return claims


def capacities(spec, results: Path, physics: str) -> dict[str, dict]:
    """Capacities searched for the figure's setting (its base spec in this world), for
    the figure's routers."""
    if not spec.capacity:
        return {}
    routers = spec.axes.get("router.name") or [spec.base.get("router", {}).get("name", "hetroute")]
    found = read_capacities(results, parse_spec(spec.base).with_overrides({"physics": physics}))
    return {r: found[r] for r in routers if r in found}


def capacity_line(capacity: dict[str, dict]) -> str:
    """The figure's footer: short, beside the run count (the claims file has the rest)."""
    first = next(iter(capacity.values()))
    return (f"capacity, req/s ({criterion(first)}): "
            + ", ".join(f"{r} {c['capacity_rps']:.3g}" + ("+" if not c["bounded"] else "")
                        for r, c in capacity.items()))


def claims_file(data: FigureData) -> dict:
    return {
        "figure": data.spec.figure, "title": data.spec.title, "backend": data.backend,
        "scale": data.scale, "physics": data.physics, "runs": int(len(data.runs)), "missing_runs": data.missing,
        "seeds": sorted(set(int(s) for s in data.runs.seed)) if not data.runs.empty else [],
        "generated": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "claims": evaluate_all(data.spec.claims, data.runs),
        **kv_room_use(data.runs),
    }


def kv_room_use(runs: pd.DataFrame) -> dict:
    """How near the figure's runs came to a server's K/V room (``kv_peak_share`` of their
    metrics; runs made before it have none): the largest share and how many went past 1."""
    share = runs["kv_peak_share"].dropna() if "kv_peak_share" in runs else pd.Series(dtype=float)
    if share.empty:
        return {"kv_peak_share_max": None, "kv_over_room": None}
    return {"kv_peak_share_max": float(share.max()), "kv_over_room": int((share > 1.0).sum())}
