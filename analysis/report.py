"""One page with every figure and the table of paper vs measured claims.

It states plainly where the testbed disagrees with the paper; nothing is tuned
here, it only reads the claims files written with the figures.
"""

from __future__ import annotations

import json
from pathlib import Path

from testbed.capacity import criterion, describe
from testbed.sweep import figure_path, load_figure

from .render import FIGURES, stem


def _has_unit(metric: str) -> bool:
    """Metrics in ms, tokens/s or GB print as numbers; shares and ratios as percentages."""
    return metric.endswith("_ms") or "tok_s" in metric or metric.startswith("gb_")


def _fmt(v, kind: str, metric: str) -> str:
    if v is None:
        return "-"
    if isinstance(v, list):
        return ", ".join(_fmt(x, "value", metric) if not isinstance(x, str) else x for x in v)
    if kind == "ratio":
        return f"{v:.2f}x"
    if kind in ("reduction",) or (isinstance(v, float) and abs(v) <= 1.0 and not _has_unit(metric)):
        p = 100 * v  # three significant digits: a 0.04% degradation must not read 0.0%
        return f"{p:.1f}%" if abs(p) >= 10 else f"{p:.3g}%"
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def _fidelity_lines(fig: int, f: dict | None) -> list[str]:
    """The emulated runs' fidelity, summarised; every problem named (analysis/fidelity.py)."""
    if not f:
        return []
    T = f"T = {f['T_min']:g}" + (f"-{f['T_max']:g}" if f["T_max"] != f["T_min"] else "")
    rate = "-" if f["rate_err_max_pct"] is None else f"{f['rate_err_max_pct']:.2f}%"
    lines = [f"Fidelity of the {f['runs']} emulated runs ({T}; one row per run in "
             f"`fig{fig}.fidelity.csv`): tc rates read back within {rate} of the configured "
             f"ones, {f['drops']} drops; stream release lateness p99 per run (worst worker) "
             f"median {f['release_late_p99_emu_ms_median']:.3g} ms, max "
             f"{f['release_late_p99_emu_ms_max']:.3g} ms of emulated time; frame delivery "
             f"lateness mean at most {f['delivery_late_mean_emu_ms_max']:.3g} ms; CPU "
             f"mean at most {f['cpu_mean_pct_max']:.0f}%, highest sample {f['cpu_max_pct']:.0f}%.", ""]
    if f["problems"]:
        lines += ["**Fidelity problems:** " + "; ".join(f["problems"]) + ".", ""]
    else:
        lines += ["No drops, drain-cap timeouts, killed workers, unrecorded requests, malformed "
                  "frames or failed kernels in any run.", ""]
    return lines


def _claim_cells(c: dict | None) -> tuple[str, str, str]:
    if c is None:
        return "-", "-", "-"
    ci = c.get("ci95")
    ci_s = f"{_fmt(ci[0], c['kind'], c['metric'])} .. {_fmt(ci[1], c['kind'], c['metric'])}" if ci else "-"
    verdict = c.get("verdict", "-")
    if verdict in ("disagrees", "differs"):
        verdict = f"**{verdict}**"
    return _fmt(c.get("measured"), c["kind"], c["metric"]), ci_s, verdict


def build_report(out: Path) -> Path:
    """figures/REPORT.md: each figure under the hardware world and the paper's, side by side."""
    lines = ["# HetRoute testbed: figures and the paper's claims", "",
             "Each figure is regenerated from raw results by `make experiment FIG=N` (the world of "
             "`physics: hardware`: roofline kernels of real GPU classes, per-layer steps) and "
             "`make experiment FIG=N PHYSICS=paper` (the paper's own w/F world, as the testbed had "
             "it before the hardware model). Claims list every number the paper states for the "
             "figure beside the measured counterpart under each world (mean over seeds, 95% CI "
             "where there are several seeds). Verdicts: for values, *close* within 25%; for "
             "reductions and ratios, *agrees* when the direction (better or worse) matches the "
             "paper, whatever the magnitude; for orderings, *agrees* only for the same order.", ""]
    summary: dict[str, list[str]] = {"hardware": [], "paper": []}
    for fig in FIGURES:
        spec = load_figure(figure_path(fig))
        lines += [f"## Fig. {fig}: {spec.title}", ""]
        data = {}
        for physics in ("hardware", "paper"):
            cf = out / f"{stem(fig, physics)}.claims.json"
            if cf.exists():
                data[physics] = json.loads(cf.read_text())
        if not data:
            lines += ["No results yet: run `make experiment FIG=%d`." % fig, ""]
            continue
        lines += ["| physics: hardware | physics: paper |", "|---|---|",
                  "| " + " | ".join(f"![fig{fig} {p}]({stem(fig, p)}.png)" if p in data else
                                    f"not run (`make experiment FIG={fig}"
                                    + (" PHYSICS=paper" if p == "paper" else "") + "`)"
                                    for p in ("hardware", "paper")) + " |", ""]
        for p, d in data.items():
            lines.append(f"- {p}: backend **{d['backend']}**, scale **{d['scale']}**, {d['runs']} "
                         f"runs, seeds {d['seeds']}" + (f", **{d['missing_runs']} runs missing**"
                                                        if d["missing_runs"] else "") + ".")
            if d.get("kv_peak_share_max") is not None:
                over = d["kv_over_room"]
                lines.append(f"  K/V cache, {p}: at most {d['kv_peak_share_max']:.0%} of a server's room"
                             + (f"; **{over} runs held more K/V than a server's memory leaves it "
                                f"(their world is not physical there)**" if over else "") + ".")
            if d.get("capacity"):
                lines.append(f"  Capacity, {p}: " + "; ".join(
                    f"{r} {describe(c)}" for r, c in d["capacity"].items())
                    + f" ({criterion(next(iter(d['capacity'].values())))}).")
        lines += ["", "| claim | paper | hardware | 95% CI | verdict | paper physics | 95% CI | verdict |",
                  "|---|---|---|---|---|---|---|---|"]
        by_id = {p: {c["id"]: c for c in d["claims"]} for p, d in data.items()}
        first = data.get("hardware") or data["paper"]
        for c in first["claims"]:
            row = [c["text"], _fmt(c["paper"], c["kind"], c["metric"])]
            for p in ("hardware", "paper"):
                mine = by_id.get(p, {}).get(c["id"])
                cells = _claim_cells(mine)
                row += cells
                if mine is not None and mine.get("verdict") in ("disagrees", "differs"):
                    summary[p].append(f"- Fig. {fig}, {c['text']}: paper "
                                      f"{_fmt(c['paper'], c['kind'], c['metric'])}, measured {cells[0]}.")
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
        for p, d in data.items():
            if d.get("fidelity"):
                lines += [f"*{p}:*", ""] + _fidelity_lines(fig, d.get("fidelity"))
    lines += ["## Where the testbed disagrees with the paper", ""]
    for p in ("hardware", "paper"):
        lines += [f"### physics: {p}", ""] + (summary[p] or ["Nothing: every evaluated claim agrees "
                                                              "or is close."]) + [""]
    why = Path(__file__).resolve().parent / "findings.md"
    if why.exists():  # the reasons, written by people from the measurements, not tuned
        lines += ["", why.read_text().strip()]
    path = out / "REPORT.md"
    path.write_text("\n".join(lines) + "\n")
    return path
