"""One page with every figure and the table of paper vs measured claims.

It states plainly where the testbed disagrees with the paper; nothing is tuned
here, it only reads the claims files written with the figures.
"""

from __future__ import annotations

import json
from pathlib import Path

from testbed.sweep import figure_path, load_figure

from .render import FIGURES


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


def build_report(out: Path) -> Path:
    lines = ["# HetRoute testbed: figures and the paper's claims", "",
             "Each figure is regenerated from raw results by `make experiment FIG=N`. "
             "Claims list every number the paper states for the figure beside the measured "
             "counterpart (mean over seeds, 95% CI where there are several seeds). Verdicts: "
             "for values, *close* within 25%; for reductions and ratios, *agrees* when the "
             "direction (better or worse) matches the paper, whatever the magnitude; for "
             "orderings, *agrees* only for the same order.", ""]
    summary = []
    for fig in FIGURES:
        cf = out / f"fig{fig}.claims.json"
        spec = load_figure(figure_path(fig))
        lines += [f"## Fig. {fig}: {spec.title}", ""]
        if not cf.exists():
            lines += ["No results yet: run `make experiment FIG=%d`." % fig, ""]
            continue
        data = json.loads(cf.read_text())
        lines += [f"![fig{fig}](fig{fig}.png)", "",
                  f"Backend **{data['backend']}**, scale **{data['scale']}**, {data['runs']} runs, "
                  f"seeds {data['seeds']}" + (f", **{data['missing_runs']} runs missing**"
                                              if data["missing_runs"] else "") + ".", "",
                  "| claim | paper | measured | 95% CI | verdict |", "|---|---|---|---|---|"]
        for c in data["claims"]:
            ci = c.get("ci95")
            ci_s = f"{_fmt(ci[0], c['kind'], c['metric'])} .. {_fmt(ci[1], c['kind'], c['metric'])}" if ci else "-"
            verdict = c.get("verdict", "-")
            if verdict in ("disagrees", "differs"):
                verdict = f"**{verdict}**"
                summary.append(f"- Fig. {fig}, {c['text']}: paper {_fmt(c['paper'], c['kind'], c['metric'])}, "
                               f"measured {_fmt(c.get('measured'), c['kind'], c['metric'])}.")
            lines.append(f"| {c['text']} | {_fmt(c['paper'], c['kind'], c['metric'])} | "
                         f"{_fmt(c.get('measured'), c['kind'], c['metric'])} | {ci_s} | {verdict} |")
        lines.append("")
        lines += _fidelity_lines(fig, data.get("fidelity"))
    lines += ["## Where the testbed disagrees with the paper", ""]
    lines += summary or ["Nothing: every evaluated claim agrees or is close."]
    why = Path(__file__).resolve().parent / "findings.md"
    if why.exists():  # the reasons, written by people from the measurements, not tuned
        lines += ["", why.read_text().strip()]
    path = out / "REPORT.md"
    path.write_text("\n".join(lines) + "\n")
    return path
