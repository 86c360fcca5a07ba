"""``python -m analysis figure --fig N --backend B --scale S``, ``figures``, ``report``."""

from __future__ import annotations

from pathlib import Path

import typer

from .render import FIGURES, available, render_figure
from .report import build_report

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Figures and the claims report, from existing results only.")


@app.command()
def figure(fig: int = typer.Option(...), backend: str = typer.Option("emu"),
           scale: str = typer.Option("quick"), results: Path = typer.Option(Path("results")),
           out: Path = typer.Option(Path("figures"))) -> None:
    """Render figures/figN.png, .pdf and figN.claims.json from one sweep's results."""
    claims = render_figure(fig, backend, scale, results, out)
    n = len(claims["claims"])
    bad = sum(c.get("verdict") in ("disagrees", "differs") for c in claims["claims"])
    typer.echo(f"fig{fig}: {claims['runs']} runs ({claims['missing_runs']} missing); "
               f"{n} claims, {bad} disagree or differ -> {out}/fig{fig}.png, {out}/fig{fig}.claims.json")
    fid = claims.get("fidelity")
    if fid:  # emulated runs: say what the network and timing checks found
        typer.echo(f"fig{fig}: fidelity of {fid['runs']} emulated runs -> {out}/fig{fig}.fidelity.csv; "
                   + ("problems: " + "; ".join(fid["problems"]) if fid["problems"] else "no problems"))


@app.command()
def figures(results: Path = typer.Option(Path("results")),
            out: Path = typer.Option(Path("figures"))) -> None:
    """Re-render every figure from its most recent sweep."""
    for fig in FIGURES:
        runs = available(fig, results)
        if not runs:
            typer.echo(f"fig{fig}: no results")
            continue
        backend, scale, _ = runs[0]
        figure(fig, backend, scale, results, out)


@app.command()
def report(out: Path = typer.Option(Path("figures"))) -> None:
    """Write figures/REPORT.md: every figure and the paper-vs-measured claims."""
    typer.echo(f"written: {build_report(out)}")


if __name__ == "__main__":
    app()
