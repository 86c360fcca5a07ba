"""``python -m analysis figure --fig N --backend B --scale S``, ``figures``, ``report``,
``compare-steps``, ``first-fork``, ``causal-kv``, ``kv-memory``, ``seed-scatter``,
``agreement-table``."""

from __future__ import annotations

from pathlib import Path

import typer

from .render import FIGURES, available, render_figure, stem
from .report import build_report

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Figures and the claims report, from existing results only.")


@app.command()
def figure(fig: int = typer.Option(...), backend: str = typer.Option("emu"),
           scale: str = typer.Option("quick"), results: Path = typer.Option(Path("results")),
           out: Path = typer.Option(Path("figures")),
           physics: str = typer.Option("hardware", help="hardware (figN.*) or paper (figN-paper.*)")
           ) -> None:
    """Render figures/figN.png, .pdf and figN.claims.json from one sweep's results."""
    if physics not in ("hardware", "paper"):
        typer.echo(f"error: --physics: hardware or paper, got {physics!r}", err=True)
        raise typer.Exit(2)
    claims = render_figure(fig, backend, scale, results, out, physics)
    name = stem(fig, physics)
    n = len(claims["claims"])
    bad = sum(c.get("verdict") in ("disagrees", "differs") for c in claims["claims"])
    typer.echo(f"fig{fig} ({physics}): {claims['runs']} runs ({claims['missing_runs']} missing); "
               f"{n} claims, {bad} disagree or differ -> {out}/{name}.png, {out}/{name}.claims.json")
    fid = claims.get("fidelity")
    if fid:  # emulated runs: say what the network and timing checks found
        typer.echo(f"fig{fig}: fidelity of {fid['runs']} emulated runs -> {out}/{name}.fidelity.csv; "
                   + ("problems: " + "; ".join(fid["problems"]) if fid["problems"] else "no problems"))


@app.command()
def figures(results: Path = typer.Option(Path("results")),
            out: Path = typer.Option(Path("figures"))) -> None:
    """Re-render every figure from its most recent sweep, per physics."""
    for fig in FIGURES:
        runs = available(fig, results)
        if not runs:
            typer.echo(f"fig{fig}: no results")
            continue
        for physics in ("hardware", "paper"):
            mine = [r for r in runs if r[2] == physics]
            if mine:
                backend, scale, _, _ = mine[0]
                figure(fig, backend, scale, results, out, physics)


@app.command()
def report(out: Path = typer.Option(Path("figures"))) -> None:
    """Write figures/REPORT.md: every figure and the paper-vs-measured claims."""
    typer.echo(f"written: {build_report(out)}")


@app.command("compare-steps")
def compare_steps(run_a: Path = typer.Argument(..., help="a run folder written with --trace-steps"),
                  run_b: Path = typer.Argument(..., help="another run of the same spec (e.g. its "
                                               "simulated twin), also with --trace-steps"),
                  until: float = typer.Option(None, help="model seconds: compare the steps that "
                                              "started by then (default: a time both runs reached)")
                  ) -> None:
    """Line two runs' steps up server by server: where their schedules part, and what each
    server ran (steps, tokens, busy time) up to a time both reached."""
    from .steps_diff import compare_runs, format_diffs
    try:
        horizon, diffs = compare_runs(run_a, run_b, until)
    except (ValueError, OSError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    typer.echo(format_diffs(horizon, diffs, (run_a.name, run_b.name)))


@app.command("first-fork")
def first_fork(run_a: Path = typer.Argument(..., help="a finished run folder (e.g. emulated)"),
               run_b: Path = typer.Argument(..., help="the reference run of the same spec (e.g. "
                                            "its simulated twin)"),
               tol_us: float = typer.Option(1.0, help="an instant (a start, a decision, a "
                                            "part's end) differs if by more than this, model "
                                            "microseconds")) -> None:
    """What first parts two runs of one spec, from their token-layer records: a routing
    decision taken differently with every earlier instant alike, or an instant that moved
    first; and how far the starts and each part (fan-out, step, fan-in) drifted on the
    common trajectory before it."""
    from .first_fork import fork_of_runs, format_fork
    try:
        fork = fork_of_runs(run_a, run_b, tol_us * 1e-6)
    except (ValueError, OSError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    typer.echo(format_fork(fork, (run_a.name, run_b.name)))


@app.command("causal-kv")
def causal_kv(runs: list[Path] = typer.Argument(..., help="run folders, or folders of runs "
                                                "(a sweep's, e.g. results/fig9/sim-quick)"),
              by_point: bool = typer.Option(False, help="one line per point: its seeds' "
                                            "figures averaged")) -> None:
    """What a token's attention needs that neither backend charges: how many token-layers
    attended where an earlier position of their request did not run (its K/V would have to
    move), how many ended before an earlier position's same layer did, and each run's latency
    replayed from its own records with causal order, with the K/V pushed over the links, and
    with them pulled when needed."""
    from .causal_kv import HEADER, format_row, mean_reading, measure_run, run_folders
    try:
        folders = run_folders(runs)
        typer.echo(HEADER)
        points: dict[Path, list] = {}
        for f in folders:
            r = measure_run(f)
            if by_point:
                points.setdefault(f.parent, []).append(r)
            else:
                typer.echo(format_row(f"{f.parent.name}/{f.name}", r))
        for point, readings in points.items():
            typer.echo(format_row(f"{point.name} ({len(readings)} seeds)", mean_reading(readings)))
    except (ValueError, OSError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None


@app.command("kv-memory")
def kv_memory(runs: list[Path] = typer.Argument(..., help="run folders, or folders of runs "
                                                "(a sweep's, e.g. results/fig9/sim-quick)")) -> None:
    """The most K/V cache each run's servers held at once (their own positions', and with
    the copies causal attention fetches) against the room the memory model leaves them
    ((1 - memory.gpu_share) x G_n), which neither backend enforces."""
    from .causal_kv import run_folders
    from .kv_memory import HEADER, format_row, measure_run
    try:
        folders = run_folders(runs)
        typer.echo(HEADER)
        for f in folders:
            typer.echo(format_row(f"{f.parent.name}/{f.name}", measure_run(f)))
    except (ValueError, OSError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None


@app.command("seed-scatter")
def seed_scatter(sweep: Path = typer.Argument(..., help="an emulated sweep's folder, e.g. "
                                             "results/fig9/emu-quick"),
                 agree: Path = typer.Argument(..., help="where agree-sweep --sim-band put its "
                                              "twins (its --out)"),
                 per_seed: bool = typer.Option(False, help="also print each seed's ratios, one "
                                               "line per seed and metric (to pair two sweeps "
                                               "of the same seeds)")) -> None:
    """Each seed's emulated ratio against its exact simulated twin, beside each jittered
    twin's: their range, rms and how many stray past the tolerance, and the emulator's rms
    over the jittered simulator's with a bootstrap interval over the seeds."""
    from .seed_scatter import format_per_seed, format_scatter, sweep_scatter
    try:
        points = sweep_scatter(sweep, agree)
    except (ValueError, OSError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    typer.echo(format_scatter(points))
    if per_seed:
        typer.echo(format_per_seed(points))


@app.command("arrivals")
def arrivals(spec: Path = typer.Option(..., help="a figure spec with one extra axis, e.g. "
                                       "specs/fig9-bursty.yaml"),
             results: Path = typer.Option(..., help="that sweep's results root"),
             base_results: Path = typer.Option(Path("results"), help="the figure's own sweep's "
                                               "results root (Poisson arrivals)"),
             backend: str = typer.Option("sim"), scale: str = typer.Option("quick"),
             physics: str = typer.Option("hardware")) -> None:
    """A sweep under other arrivals beside the figure's own: per router and load, the
    Poisson value and each value of the extra axis with its ratio (mean, P99, SLA share)."""
    _beside(spec, results, base_results, backend, scale, physics, "Poisson", False)


@app.command("beside")
def beside(spec: Path = typer.Option(..., help="a figure spec with one extra axis, e.g. "
                                     "specs/fig9-overlap.yaml"),
           results: Path = typer.Option(..., help="that sweep's results root"),
           base_results: Path = typer.Option(Path("results"), help="the figure's own sweep's "
                                             "results root"),
           backend: str = typer.Option("sim"), scale: str = typer.Option("quick"),
           physics: str = typer.Option("hardware"),
           seed_ratios: bool = typer.Option(True, help="each ratio's range over the seeds "
                                            "(seed s against the figure's seed s)")) -> None:
    """A sweep that varies one setting beside the figure's own: per router and load, the
    figure's value and each value of the extra axis with its ratio (mean, P99, SLA share)."""
    _beside(spec, results, base_results, backend, scale, physics, "figure's", seed_ratios)


def _beside(spec: Path, results: Path, base_results: Path, backend: str, scale: str,
            physics: str, base_label: str, by_seed: bool) -> None:
    from .beside import beside_tables
    try:
        typer.echo(beside_tables(spec, results, base_results, backend, scale, physics,
                                 base_label, by_seed))
    except (ValueError, OSError) as err:
        typer.echo(f"error: {str(err).splitlines()[0]}", err=True)
        raise typer.Exit(2) from None


@app.command("agreement-table")
def agreement_table(path: Path = typer.Argument(..., help="an agree-sweep's agreement.json, or "
                                                "the folder that holds it")) -> None:
    """Print an agree-sweep's points as the README's Markdown table (emulator / simulator)."""
    from .agreement_table import load, table
    try:
        points = load(path)
    except ValueError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    typer.echo(table(points))


if __name__ == "__main__":
    app()
