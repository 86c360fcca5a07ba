"""Command line: ``python -m testbed run SPEC.yaml`` and friends.

Errors in user input (spec, topology, overrides) print one line and exit 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from hetroute.routers import available

from .hardware_cli import app as hardware_app
from .lifecycle import sigterm_as_interrupt
from .kv_memory import kv_warning
from .metrics import format_decode, format_table
from .spec import ExperimentSpec, SpecError, load_spec, parse_override, parse_spec

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="HetRoute testbed: run experiments on the simulator or the emulator.")
app.add_typer(hardware_app, name="hardware")


def _load(spec_path: str | None, overrides: list[str]) -> ExperimentSpec:
    spec = load_spec(spec_path) if spec_path else parse_spec({})
    if overrides:
        spec = spec.with_overrides(dict(parse_override(o) for o in overrides))
    return spec


def _warn(spec: ExperimentSpec, base_dir: Path | None) -> None:
    """Run the up-front checks (``setup.check_spec``); print its warnings, one line each."""
    from .setup import check_spec
    for w in check_spec(spec, base_dir).warnings:
        typer.echo(f"warning: {w}", err=True)


def _fail(msg: str) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(2)


@app.command()
def run(spec: str = typer.Argument(..., help="experiment spec (YAML)"),
        set_: list[str] = typer.Option([], "--set", help="override, e.g. workload.rate_per_s=80"),
        out: Path | None = typer.Option(None, help="results folder (default results/runs/NAME)"),
        quiet: bool = typer.Option(False, help="no progress bar"),
        trace_steps: bool = typer.Option(False, help="also write each step's composition to "
                                         "steps/ (for `hardware replay-steps` and `python -m "
                                         "analysis compare-steps`; on the emulator each worker's)")
        ) -> None:
    """Run one experiment, write its results folder and print its metrics."""
    from topologies import TopologyError

    from .runner import run_experiment
    try:
        s = _load(spec, set_)
        _warn(s, Path(spec).parent)
        with sigterm_as_interrupt():
            res = run_experiment(s, out or Path("results/runs") / s.name, progress=not quiet,
                                 base_dir=Path(spec).parent, trace_steps=trace_steps)
    except (SpecError, TopologyError) as err:
        _fail(str(err))
        return
    except KeyboardInterrupt as err:
        typer.echo(f"interrupted ({str(err) or 'SIGINT'}): run.json says interrupted; "
                   f"records written so far are kept", err=True)
        raise typer.Exit(130) from None
    typer.echo(format_table({s.router.name: res.metrics}))
    if decode := format_decode({s.router.name: res.metrics}):
        typer.echo(decode)
    if line := kv_warning(res.metrics):
        typer.echo(line, err=True)
    typer.echo(f"results: {res.out_dir}  (placement {res.info['placement_s']:.1f} s, "
               f"backend {res.info['backend_s']:.1f} s)")


@app.command()
def compare(spec: str = typer.Argument(..., help="experiment spec (YAML)"),
            routers: str = typer.Option("all", help="comma-separated router names, or 'all'"),
            set_: list[str] = typer.Option([], "--set", help="override, e.g. workload.rate_per_s=80"),
            out: Path | None = typer.Option(None, help="results folder (default results/compare/NAME)"),
            quiet: bool = typer.Option(False, help="no progress bar"),
            reference: bool = typer.Option(True, help="also run each router that declares its "
                                           "own regime (Router.own_regime) there, as a "
                                           "reference row"),
            results: Path = typer.Option(Path("results"), help="results root whose capacity "
                                         "searches (`testbed capacity`) are listed"),
            rerun: bool = typer.Option(False, help="run every router again, even where a "
                                       "complete run of the same resolved spec exists")) -> None:
    """Run the same spec under several routers and print one table (complete runs of the
    same resolved spec are reused, as sweeps do)."""
    from hetroute.routers import get_router
    from topologies import TopologyError

    from .runner import is_done, run_experiment
    names = available() if routers == "all" else [r.strip() for r in routers.split(",") if r.strip()]
    rows = {}
    try:
        base = _load(spec, set_)
        root = out or Path("results/compare") / base.name
        folder_of = {n: n.replace(":", ".") for n in names}  # pkg.mod:Class -> pkg.mod.Class
        runs = [(name, name, folder_of[name], {}) for name in names]
        if reference:
            runs += [(name, f"{name} (own regime)", f"{folder_of[name]}-own-regime", dict(regime))
                     for name in names if (regime := get_router(name).own_regime)]
        reused = []
        for name, label, folder, regime in runs:
            s = base.with_overrides({"router.name": name, "name": f"{base.name}-{folder}", **regime})
            if not rerun and is_done(root / folder, s):  # the same resolved spec ran to the end
                rows[label] = json.loads((root / folder / "metrics.json").read_text())
                reused.append(label)
                continue
            rows[label] = run_experiment(s, root / folder, progress=not quiet,
                                         base_dir=Path(spec).parent).metrics
    except (SpecError, TopologyError, KeyError) as err:
        _fail(str(err).strip("'\""))
        return
    if reused:
        typer.echo(f"reused {len(reused)} complete run(s) of the same resolved spec under {root} "
                   f"(--rerun runs them again): {', '.join(reused)}")
    typer.echo(format_table(rows))
    if decode := format_decode(rows):
        typer.echo(decode)
    for label, met in rows.items():
        if line := kv_warning(met):
            typer.echo(f"{label}: {line}", err=True)
    notes = {n: get_router(n).memory_note for n in names}
    for n, note in notes.items():
        if note:
            typer.echo(f"memory, {n}: {note}")
    from .capacity import criterion, describe, read_capacities
    caps = read_capacities(results, base)
    for n in names:
        if n in caps:
            c = caps[n]
            typer.echo(f"capacity, {n}: {describe(c)} with {criterion(c)} "
                       f"(`testbed capacity`, spec {c['spec']}, {c['duration_s']:g} s probes)")


@app.command()
def sweep(fig: int = typer.Option(..., help="figure number (analysis/specs/figN.yaml)"),
          backend: str = typer.Option("sim", help="sim or emu"),
          scale: str = typer.Option("quick", help="smoke, quick or full"),
          jobs: int = typer.Option(0, help="parallel sim runs (0: one per core, at most 2)"),
          results: Path = typer.Option(Path("results"), help="results root"),
          spec: Path | None = typer.Option(None, help="a figure spec file instead of figN"),
          quiet: bool = typer.Option(False),
          dry_run: bool = typer.Option(False, help="only print how many runs are left and the estimate"),
          physics: str = typer.Option("hardware", help="the world: hardware (default) or paper"),
          executor: str = typer.Option("local", help="local (a process pool here) or ray "
                                       "(Ray tasks; a local Ray instance of --jobs CPUs "
                                       "unless --address)"),
          address: str | None = typer.Option(None, help="with --executor ray: a running Ray "
                                             "cluster, 'auto' or HOST:PORT; --results must "
                                             "then be on a filesystem every node shares")
          ) -> None:
    """Run every point of a figure's sweep that is not already done."""
    from .runner import TRACEBACK
    from .sweep import default_jobs, figure_path, load_figure, run_sweep
    if backend not in ("sim", "emu") or scale not in ("smoke", "quick", "full"):
        _fail(f"backend must be sim|emu and scale smoke|quick|full, got {backend}/{scale}")
    try:
        f = load_figure(spec or figure_path(fig))
        with sigterm_as_interrupt():
            summary = run_sweep(f, backend, scale, results, jobs or default_jobs(),  # type: ignore[arg-type]
                                progress=not quiet, dry_run=dry_run, physics=physics,
                                executor=executor, address=address)
        if dry_run:
            return
    except SpecError as err:
        _fail(str(err))
        return
    except KeyboardInterrupt as err:
        what = "Ray tasks are" if executor == "ray" else "pool is"
        typer.echo(f"interrupted ({str(err) or 'SIGINT'}): the {what} stopped; run the same "
                   f"command again to resume (finished points are skipped)", err=True)
        raise typer.Exit(130) from None
    for path, err in summary["failed"]:
        tb = Path(path) / TRACEBACK
        typer.echo(f"failed: {path}: {err}" + (f" (traceback: {tb})" if tb.exists() else ""),
                   err=True)
    typer.echo(f"fig{fig}: {summary['points']} runs ({summary['skipped']} skipped) in "
               f"{summary['wall_s']} s")
    if over := summary["kv_over_room"]:
        typer.echo(f"warning: in {len(over)} run(s) a server held more K/V cache than its GPU "
                   f"memory leaves it (kv_peak_share > 1 in metrics.json; engine.kv_overflow: none "
                   f"let it grow on): {', '.join(over[:3])}"
                   + (" ..." if len(over) > 3 else ""), err=True)
    if summary["failed"]:
        raise typer.Exit(1)


@app.command()
def fidelity(topology: str = typer.Argument(..., help="topology YAML (or a shipped name)"),
             dilation: str = typer.Option("auto", help="T, or 'auto': what a prompt-only run "
                                          "at the default load uses"),
             model: str = typer.Option("mixtral", help="model whose experts time the streams"),
             mechanism: str = typer.Option("auto", help="delay: auto, netem or transport"),
             seconds: float = typer.Option(0.8, help="bulk transfer per directed link"),
             out: Path | None = typer.Option(None, help="also write the table as JSON here")) -> None:
    """Check the emulated network against the topology; non-zero exit when out of tolerance."""
    import dataclasses

    from topologies import TopologyError, load_topology
    from workloads import get_model

    from .emu.fidelity import format_rows, run_fidelity
    from .emu.hosts import EmulationUnavailable
    try:
        cl = load_topology(topology).to_cluster()
        if dilation == "auto":
            from .emu.dilation import choose_dilation
            from .setup import build_setup
            s = parse_spec({"topology": topology, "backend": "emu",  # the figures' prompt-only run
                            "workload": {"model": model, "calibration_tokens": 64, "gen_tokens": 0}})
            T = choose_dilation(build_setup(s))[0]
        else:
            T = float(dilation)
        rows, info = run_fidelity(cl, get_model(model).shape(), T, mechanism, seconds)
    except (TopologyError, EmulationUnavailable, KeyError) as err:
        _fail(str(err))
        return
    typer.echo(f"dilation T={T:g}, delay mechanism: {info['delay_mechanism']}")
    typer.echo(format_rows(rows))
    if out is not None:
        out.write_text(json.dumps({"info": info, "rows": [dataclasses.asdict(r) for r in rows]},
                                  indent=1, default=str))
    if not all(r.ok for r in rows):
        raise typer.Exit(1)


@app.command()
def agree(spec: str = typer.Argument(..., help="experiment spec (YAML)"),
          router: list[str] = typer.Option(["hetroute", "edgeshard"], help="routers to compare"),
          set_: list[str] = typer.Option([], "--set", help="override, e.g. topology=small3"),
          out: Path = typer.Option(Path("results/agreement"), help="results folder"),
          seeds: int = typer.Option(1, min=1, max=100, help="seeds per side, their requests "
                                    "pooled (the spec's seed and the next ones)"),
          double_t: bool = typer.Option(True, help="also run the first router on the emulator "
                                        "at twice its dilation"),
          sim_band: list[float] = typer.Option([], help="also run the simulator with this mean "
                                               "random delay per hop (s; repeat for several) and "
                                               "report the range its metrics take: how far the "
                                               "point's schedule moves under tiny timing noise; "
                                               "the emulator is also checked against these runs "
                                               "and the exact one pooled (the ensemble)")
          ) -> None:
    """Emulator vs simulator on one spec, and the emulator at T vs 2T; non-zero exit when out of tolerance."""
    from .agreement import agreement, band_error, format_rows
    bad = band_error(sim_band)
    if bad:
        _fail(bad)
        return
    try:
        rows = agreement(_load(spec, set_), router, out, seeds, double_t, tuple(sim_band))
    except SpecError as err:
        _fail(str(err))
        return
    typer.echo(format_rows(rows))
    if not all(r.ok for r in rows):
        raise typer.Exit(1)


@app.command("agree-sweep")
def agree_sweep(sweep: Path = typer.Argument(..., help="an emulated sweep's folder, e.g. "
                                           "results/fig9/emu-quick"),
                out: Path = typer.Option(None, help="where the simulated twins go (default: "
                                         "results/agreement-fig9-emu-quick for results/fig9/emu-quick)"),
                seeds: int = typer.Option(1, min=1, max=100, help="pool at least this many seeds "
                                          "per point: the sweep's own, then further seeds run on "
                                          "the emulator under --out"),
                sim_band: list[float] = typer.Option([], help="also run each "
                                                     "point's simulated twins with this mean "
                                                     "per-hop jitter, seconds (repeatable), and "
                                                     "say whether the emulator lies in their range "
                                                     "and within tolerance of them and the exact "
                                                     "twin pooled (the ensemble)"),
                quiet: bool = typer.Option(False, help="no progress bar")) -> None:
    """Every emulated point of a sweep against the simulator on its own resolved specs, cut
    where each emulated run stopped, its seeds pooled; non-zero exit when out of tolerance."""
    from .agreement import band_error, format_points, sweep_agreement
    if not sweep.is_dir():
        _fail(f"sweep folder {sweep} does not exist")
        return
    bad = band_error(sim_band)
    if bad:
        _fail(bad)
        return
    out = out or sweep.parent.parent / f"agreement-{sweep.parent.name}-{sweep.name}"
    rows = sweep_agreement(sweep, out, not quiet, seeds, tuple(sim_band))
    if not rows:
        _fail(f"no complete emulated run under {sweep}")
        return
    typer.echo(format_points(rows))
    if not all(r.ok for r in rows):
        raise typer.Exit(1)


@app.command("agree-null")
def agree_null(point: Path = typer.Argument(..., help="an emulated run's folder (its resolved "
                                            "spec and, where it reached its drain cap, its cut) "
                                            "or a spec file"),
               out: Path = typer.Option(None, help="where the simulated runs go (default: "
                                        "<run folder>/null, or results/agree-null/<spec name>)"),
               seeds: int = typer.Option(12, min=2, max=200, help="seeds to run, from the spec's own"),
               jitter: float = typer.Option(1e-6, help="mean hop jitter of the stand-in for a "
                                            "faithful emulator, seconds"),
               cut: float = typer.Option(None, help="cut the records here, emulated seconds "
                                         "(default: where the emulated run stopped, if it did)"),
               at: list[int] = typer.Option([], help="seed counts to read the pool at "
                                            "(repeatable; default 3, 6, 12, ... and --seeds)"),
               draws: int = typer.Option(1, min=1, max=20, help="draws of the jitter per seed "
                                         "(sim.hop_jitter_draw), pooled; each draw's own mean "
                                         "ratio is printed beside"),
               quiet: bool = typer.Option(False, help="no progress bar")) -> None:
    """The simulator under tiny hop jitter against its exact run, over growing numbers of
    seeds: what a faithful emulator would read at this point, and how many seeds decide it."""
    from .agreement import own_cut, band_error
    from .agreement_null import format_null, null_agreement
    bad = band_error([jitter])
    if bad:
        _fail(bad.replace("--sim-band", "--jitter"))
        return
    wrong = [n for n in at if not 2 <= n <= seeds]
    if wrong:
        _fail(f"--at {wrong[0]}: each seed count must be in [2, --seeds = {seeds}]")
        return
    if point.is_dir():
        if not (point / "spec.resolved.yaml").exists():
            _fail(f"{point}: no spec.resolved.yaml (not a run folder)")
            return
        spec = load_spec(point / "spec.resolved.yaml")
        info = point / "run.json"
        if cut is None and info.exists():
            cut = own_cut(json.loads(info.read_text()).get("stats", {}))
        out = out or point / "null"
    elif point.exists():
        try:
            spec = load_spec(point)
        except SpecError as err:
            _fail(str(err))
            return
        out = out or Path("results/agree-null") / spec.name
    else:
        _fail(f"{point} does not exist")
        return
    if cut is not None and not cut > 0:
        _fail(f"--cut must be > 0 s, not {cut}")
        return
    rows = null_agreement(spec, out, seeds, jitter, cut, steps=at or None, progress=not quiet,
                          draws=draws)
    typer.echo(format_null(rows, jitter, cut))


@app.command("profile-decisions")
def profile_decisions(
        fig: list[int] = typer.Option([], help="a figure whose settings to profile (repeatable)"),
        spec: list[Path] = typer.Option([], help="a figure spec file to profile (repeatable)"),
        run_spec: list[Path] = typer.Option([], "--run", help="an experiment spec to profile "
                                            "(repeatable)"),
        scale: list[str] = typer.Option(["quick"], help="scales of the figures (repeatable)"),
        backend: list[str] = typer.Option(["sim", "emu"], help="backends of the figures' "
                                          "scales (repeatable; the emulator's scales may "
                                          "differ)"),
        profile: Path = typer.Option(None, help="the profile file (default: the one this "
                                     "repository ships, testbed/decision_profile.json)"),
        fresh: bool = typer.Option(False, help="time every setting again, not reusing this "
                                   "host's cached timings"),
        rounds: int = typer.Option(3, min=1, max=20, help="passes over all settings; each "
                                   "setting's median is recorded (its timings minutes apart, "
                                   "so one slow minute of a shared VM does not decide it)"),
        prune: bool = typer.Option(False, help="drop entries measured on another version of "
                                   "the method's code"),
        results: Path = typer.Option(Path("results"), help="results root (its .placements "
                                     "cache is used)"),
        quiet: bool = typer.Option(False)) -> None:
    """Time the routing decision of every setting of figures or specs on this machine and
    record them in the decision profile, which `engine.decision_s: calibrated` charges on
    every machine (testbed/decision_profile.py). Run on a quiet machine."""
    from topologies import TopologyError

    from . import decision_profile as dp
    from .setup import _code_version, resolve_inputs
    from .sweep import expand, figure_path, load_figure
    if not (fig or spec or run_spec):
        _fail("nothing to profile: give --fig, --spec or --run")
        return
    try:
        specs = [resolve_inputs(load_spec(str(p))) for p in run_spec]
        for f in [load_figure(figure_path(n)) for n in fig] + [load_figure(p) for p in spec]:
            for b in backend:
                for sc in scale:
                    if sc in f.scales:
                        specs += [pt.spec for pt in expand(f, b, sc, results)]  # type: ignore[arg-type]
        entries = dp.measure(specs, results / ".placements", fresh=fresh, progress=not quiet,
                             rounds=rounds)
    except (SpecError, TopologyError) as err:
        _fail(str(err))
        return
    path = profile or dp.resolve("shipped")
    dropped = dp.record(entries, path, drop_code=_code_version() if prune else None)
    for key, e in entries.items():
        spread = (f" (rounds: {', '.join(f'{x:g}' for x in e['rounds_us'])})"
                  if "rounds_us" in e else "")
        typer.echo(f"{key}: {e['decision_s'] * 1e6:.0f} us{spread} ({e['router']}, "
                   f"{e['model']}, {e['topology']}, seed {e['seed']})")
    typer.echo(f"{len(entries)} settings recorded in {path} on {dp.host_cpu()}"
               + (f"; {dropped} entries of other code dropped" if prune else ""))


@app.command()
def remetric(paths: list[Path] = typer.Argument(..., help="run folders, or folders holding "
                                                "them (results/fig9, results/compare-hardware)"),
             quiet: bool = typer.Option(False, help="only the summary line")) -> None:
    """Recompute metrics.json of every complete run under PATHS from its records with this
    code (sweeps, compare and capacity reuse complete runs: after a metric or flag changes,
    this brings their tables and figures up to date without running them again)."""
    from .runner import refresh_metrics
    runs = sorted({f.parent for p in paths for f in
                   ([p / "spec.resolved.yaml"] if (p / "spec.resolved.yaml").exists()
                    else p.glob("**/spec.resolved.yaml"))})
    if not runs:
        _fail(f"no run folder under {', '.join(map(str, paths))}")
        return
    changed = flagged = skipped = 0
    for run in runs:
        try:
            got = refresh_metrics(run)
        except (SpecError, OSError, ValueError) as err:  # an old or foreign folder: say so, go on
            typer.echo(f"skipped {run}: {err}", err=True)
            skipped += 1
            continue
        if got is None:
            skipped += 1
            continue
        m, rewritten = got
        changed += rewritten
        flagged += bool(m.get("unstable"))
        if not quiet and rewritten:
            typer.echo(f"{run}: unstable={m.get('unstable')} served={m.get('served_ratio')}")
    typer.echo(f"{len(runs)} run folders: {changed} metrics.json rewritten, {flagged} flagged "
               f"unstable, {skipped} skipped (not complete or unreadable)")


@app.command()
def capacity(spec: str = typer.Argument(..., help="experiment spec (YAML)"),
             router: list[str] = typer.Option(..., help="router(s) to search"),
             set_: list[str] = typer.Option([], "--set", help="override, e.g. physics=paper"),
             lo: float = typer.Option(1.0, help="lowest load tried (req/s)"),
             hi: float = typer.Option(320.0, help="highest load tried (req/s)"),
             rel_tol: float = typer.Option(0.1, help="stop when the bracket is this tight"),
             seeds: int = typer.Option(1, min=1, max=100, help="seeds per probe, their "
                                       "requests pooled (the spec's seed and the next ones)"),
             results: Path = typer.Option(Path("results"), help="results root")) -> None:
    """Highest load at which 90% of requests meet the SLA (simulator, cached runs)."""
    from topologies import TopologyError

    from dataclasses import asdict

    from .capacity import criterion, describe, find_capacity
    try:
        base = _load(spec, set_)
        for r in router:
            c = find_capacity(base, r, results, lo=lo, hi=hi, rel_tol=rel_tol, seeds=seeds,
                              log=lambda m: typer.echo(m, err=True))
            c = asdict(c)
            typer.echo(f"{r}: capacity {describe(c)} ({criterion(c)}, physics {c['physics']})")
    except (SpecError, TopologyError) as err:
        _fail(str(err))


@app.command()
def routers() -> None:
    """List registered routers."""
    from hetroute.routers import get_router
    for name in available():
        doc = (get_router(name).__doc__ or "").strip().splitlines()
        typer.echo(f"{name:24s} {doc[0] if doc else ''}")


@app.command("check-router")
def check_router_cmd(
        router: str = typer.Argument(..., help="a registered name or package.module:Class"),
        topology: list[str] = typer.Option([], help="topologies to check on (default small3, paper10)"),
        model: list[str] = typer.Option([], help="models to check with (default Switch, Qwen, Mixtral)")
) -> None:
    """Check a router against the contract (testbed/conformance.py); exit 1 on a failure."""
    from hetroute.routers import get_router

    from .conformance import MODELS, TOPOLOGIES, check_router
    try:
        get_router(router)
    except KeyError as err:
        _fail(f"router: {err.args[0]}")
        return
    report = check_router(router, tuple(topology) or TOPOLOGIES, tuple(model) or MODELS,
                          log=lambda m: typer.echo(m, err=True))
    typer.echo(report.format())
    if not report.ok:
        raise typer.Exit(1)


@app.command("show-spec")
def show_spec(spec: str | None = typer.Argument(None, help="spec to resolve (default: all defaults)"),
              set_: list[str] = typer.Option([], "--set")) -> None:
    """Print a spec with every default filled in, after the checks a run makes first."""
    from topologies import TopologyError
    try:
        s = _load(spec, set_)
        _warn(s, Path(spec).parent if spec else None)
    except (SpecError, TopologyError) as err:
        _fail(str(err))
        return
    typer.echo(s.to_yaml(full=True), nl=False)


@app.command("quality-replay")
def quality_replay(run: Path = typer.Argument(..., help="finished run folder"),
                   trace: Path | None = typer.Option(None, help="default: the run's workload.trace"),
                   profile: Path | None = typer.Option(None, help="default: the run's quality.profile"),
                   cache: Path | None = typer.Option(None, help="proxy weight cache (default: the "
                                                                 "proxy that made the trace)")) -> None:
    """Measured quality of a finished run on its proxy trace: writes quality_replay.csv and quality.json."""
    import sys

    if not (run / "spec.resolved.yaml").exists():
        _fail(f"{run}: not a run folder (no spec.resolved.yaml)")
        return
    import torch  # the replay runs the proxy; imported here, as it costs about 1 s

    from .quality_replay import replay_run_dir
    torch.set_num_threads(1)  # bit-reproducible, and the machine is shared
    try:
        summary = replay_run_dir(run, trace, profile, cache,
                                 lambda m: print(m, file=sys.stderr, flush=True))
    except ValueError as err:  # SpecError and ProfileError are ValueErrors
        _fail(str(err))
        return
    typer.echo(json.dumps(summary, indent=1))
