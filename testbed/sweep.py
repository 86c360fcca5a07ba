"""Sweeps: a figure spec expanded into runs, executed with skip-if-done and progress.

A figure spec (``analysis/specs/figN.yaml``) names a base experiment, the axes
to sweep (dotted spec keys, cartesian product) and per-scale settings (seeds,
overrides, axis subsets) and per-backend overrides. Each point-and-seed runs
into ``results/figN/<backend>-<scale>/<point>/seed<k>/`` under the default
``physics: hardware`` and ``results/figN/<backend>-<scale>-paper/...`` under
the paper's world (``--physics paper``). A point whose folder
holds a complete run of the identical resolved spec is skipped, so a killed
sweep loses nothing finished and a re-run only does what is missing. Points run in a
local process pool (``--executor local``) or as Ray tasks (``--executor ray``, on a local
Ray instance or a running cluster; testbed/ray_executor.py) under the same rules.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from tqdm import tqdm

from topologies.schema import InputFileError, one_line, read_yaml

from .lifecycle import die_with_parent, sigterm_as_interrupt
from .kv_memory import kv_unheld
from .runner import is_done, run_experiment
from .setup import profiled_decision_s, resolve_inputs
from .spec import ExperimentSpec, SpecError, parse_spec

Scale = Literal["smoke", "quick", "full"]


class ScaleSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    seeds: list[int] = Field(min_length=1)
    set: dict[str, Any] = Field(default_factory=dict)
    axes: dict[str, list[Any]] = Field(default_factory=dict)  # replaces an axis' values


class Restriction(BaseModel):
    """A partial grid: points whose values are all in ``when`` run only at the ``only`` values.

    Fig. 4 sweeps the budget for HetRoute alone; the baselines ignore the budget
    and are compared at the 2% default: ``{when: {router.name: [prism]},
    only: {quality.budget: [0.02]}}``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    when: dict[str, list[Any]] = Field(min_length=1)
    only: dict[str, list[Any]] = Field(min_length=1)

    def drops(self, values: dict[str, Any]) -> bool:
        return (all(values.get(k) in v for k, v in self.when.items())
                and not all(values.get(k) in v for k, v in self.only.items()))


class FigureSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    figure: int
    title: str
    base: dict[str, Any] = Field(default_factory=dict)
    axes: dict[str, list[Any]] = Field(default_factory=dict)
    scales: dict[Scale, ScaleSpec]
    backends: dict[Literal["sim", "emu"], dict[str, Any]] = Field(default_factory=dict)
    # the emulator runs in wall time x T on 2 cores: a scale may be smaller there
    emu_scales: dict[Scale, ScaleSpec] = Field(default_factory=dict)
    restrict: list[Restriction] = Field(default_factory=list)
    panels: list[dict[str, Any]] = Field(default_factory=list)  # read by the plotting script
    claims: list[dict[str, Any]] = Field(default_factory=list)  # read by analysis/claims.py
    capacity: bool = False  # the figure lists each router's capacity (`testbed capacity`)


@dataclass(frozen=True)
class Point:
    key: str  # folder name of the point
    values: dict[str, Any]  # axis -> value
    seed: int
    spec: ExperimentSpec
    out_dir: Path


def load_figure(path: Path) -> FigureSpec:
    try:
        return FigureSpec.model_validate(read_yaml(path, "figure spec"))
    except InputFileError as err:
        raise SpecError(str(err)) from None
    except ValidationError as err:
        raise SpecError(one_line(err, Path(path).name)) from None


def figure_path(fig: int, root: Path | None = None) -> Path:
    root = root or Path(__file__).resolve().parent.parent / "analysis" / "specs"
    return root / f"fig{fig}.yaml"


def _slug(values: dict[str, Any]) -> str:
    if not values:
        return "base"
    parts = []
    for k, v in values.items():
        short = k.split(".")[-1]
        parts.append(f"{short}={v}")
    s = ",".join(parts).replace("/", "_").replace(" ", "")
    return s if len(s) <= 120 else hashlib.sha1(s.encode()).hexdigest()[:16]


PHYSICS = ("hardware", "paper")


def sweep_dir(results: Path, figure: int, backend: str, scale: str, physics: str = "hardware") -> Path:
    """Where one sweep's runs live; the default physics has no suffix."""
    suffix = "" if physics == "hardware" else f"-{physics}"
    return results / f"fig{figure}" / f"{backend}-{scale}{suffix}"


def expand(fig: FigureSpec, backend: str, scale: Scale, results: Path,
           physics: str = "hardware") -> list[Point]:
    if scale not in fig.scales:
        raise SpecError(f"figure {fig.figure} has no scale {scale!r}")
    sc = fig.emu_scales[scale] if backend == "emu" and scale in fig.emu_scales else fig.scales[scale]
    axes = {k: sc.axes.get(k, v) for k, v in fig.axes.items()}
    if physics not in PHYSICS:
        raise SpecError(f"physics: one of {', '.join(PHYSICS)}, got {physics!r}")
    base = parse_spec(fig.base, f"fig{fig.figure}.base").with_overrides(
        {"backend": backend, "physics": physics, **fig.backends.get(backend, {}),
         **sc.set})  # type: ignore[dict-item]
    for r in fig.restrict:
        unknown = sorted((set(r.when) | set(r.only)) - set(axes))
        if unknown:
            raise SpecError(f"fig{fig.figure}.restrict: {', '.join(unknown)} is not an axis")
    out = []
    names = list(axes)
    for combo in itertools.product(*(axes[n] for n in names)):
        values = dict(zip(names, combo))
        if any(r.drops(values) for r in fig.restrict):
            continue
        key = _slug(values)
        for seed in sc.seeds:
            spec = resolve_inputs(base.with_overrides({**values, "seed": seed,
                                                       "name": f"fig{fig.figure}-{key}-s{seed}"}))
            d = sweep_dir(results, fig.figure, backend, scale, physics) / key / f"seed{seed}"
            out.append(Point(key, values, seed, spec, d))
    return out


def unprofiled(points: list[Point]) -> int:
    """How many of ``points`` will time their decision constant on this host, because
    the decision profile does not hold their setting (testbed/decision_profile.py)."""
    def timed_here(p: Point) -> bool:
        try:
            return profiled_decision_s(p.spec) is None
        except SpecError:  # it will fail as a point, with its own message
            return False
    return sum(p.spec.engine.decision_s == "calibrated" and timed_here(p) for p in points)


def done(p: Point) -> bool:
    """A complete run of exactly this resolved spec exists."""
    return is_done(p.out_dir, p.spec)


def estimate_s(p: Point) -> float:
    """Rough wall-clock estimate of one run, for the ETA printed before a sweep."""
    s = p.spec
    w = s.workload
    layers = {"switch": 12, "qwen": 24, "mixtral": 32}
    L = next((v for k, v in layers.items() if k in w.model), 32)
    place = {"switch": 1.0, "qwen": 15.0, "mixtral": 3.0}
    placement = next((v for k, v in place.items() if k in w.model), 3.0)
    requests, tokens = _requests_and_tokens(w)
    token_layers = requests * tokens * L
    replay = _replay_s(token_layers) if _replays(s) else 0.0
    if s.backend == "emu":
        from .emu.dilation import dilation_for
        dil = dilation_for(s, L)[0]
        return placement + 25.0 + (w.duration_s + 0.3 * s.emu.max_drain_s) * dil + replay
    return placement + token_layers / sim_rate(s) + replay


#: The simulator's rough speed for the estimate (token-layers/s); causal attention's asks,
#: notices and fetches take about twice the time per token-layer (``make bench`` of
#: 2026-12-08, same host and hour: 4,858 causal against 10,027 per-token in the hardware
#: world). Routers whose tokens share each step (pipelines) are not slowed, so for them the
#: causal estimate is high.
SIM_RATE = 15_000
CAUSAL_SLOWDOWN = 10_027 / 4_858


def sim_rate(spec) -> float:
    """Token-layers per second assumed for a simulated run of ``spec``."""
    if spec.physics == "hardware" and spec.engine.attention == "causal":
        return SIM_RATE / CAUSAL_SLOWDOWN
    return SIM_RATE


def _requests_and_tokens(w) -> tuple[float, float]:
    """Requests a run will get and their mean tokens: rate x duration of the spec's lengths,
    or what a request trace gives (``workload.requests_file``: the recorded arrivals in the
    window under ``trace_rate: recorded``, each row's capped lengths under ``lengths:
    trace``). A trace that cannot be read counts as the spec's fixed lengths (the run says
    what is wrong with it)."""
    requests = w.rate_per_s * w.duration_s
    tokens = float(w.prompt_tokens + w.gen_tokens)
    if not w.requests_file:
        return requests, tokens
    try:
        trace = _trace(str(w.requests_file))
    except (OSError, ValueError):
        return requests, tokens
    import numpy as np
    from workloads.arrivals import trace_arrivals
    if w.arrivals == "trace":
        try:
            times, rows = trace_arrivals(trace, w.rate_per_s, w.trace_rate, w.trace_start_s,
                                         duration_s=w.duration_s)
        except ValueError:
            return requests, tokens
        requests = float(times.size)
    else:
        rows = np.arange(int(round(requests))) % max(trace.n, 1)
    if w.lengths == "trace" and rows.size:
        big = np.iinfo(np.int64).max
        prompt = np.minimum(trace.prompt_tokens[rows], w.max_prompt_tokens or big)
        gen = np.minimum(trace.gen_tokens[rows], w.max_gen_tokens if w.max_gen_tokens is not None
                         else big)
        tokens = float((prompt + gen).mean())
    return requests, tokens


@functools.lru_cache(maxsize=8)
def _trace(path: str):
    from workloads.request_trace import read_request_trace
    return read_request_trace(path)


def _replays(spec) -> bool:
    """Whether the run will be replayed on the proxy (quality.replay, resolved)."""
    try:
        return resolve_inputs(spec).quality.replay is True
    except SpecError:
        return False


def _replay_s(token_layers: float) -> float:
    """Replay on the proxy: loading it and the profile, then re-executing every token-layer.

    Fitted to Fig. 4 quick here (Mixtral, 4 s at 40 req/s: 20-33 s of replay and ~15 s of
    loading per run, two runs at a time on 2 cores).
    """
    return 15.0 + token_layers * 1.1e-4


def _run_one(p: Point, cache: Path | None = None) -> tuple[str, float]:
    t0 = time.perf_counter()
    run_experiment(p.spec, p.out_dir, progress=False, placement_cache=cache)
    return str(p.out_dir), time.perf_counter() - t0


EXECUTORS = ("local", "ray")


def run_sweep(fig: FigureSpec, backend: str, scale: Scale, results: Path, jobs: int = 1,
              progress: bool = True, dry_run: bool = False, physics: str = "hardware",
              executor: str = "local", address: str | None = None) -> dict:
    """Run the points not done yet; ``dry_run`` only counts them and estimates the time.

    ``executor``: ``local`` (a process pool of ``jobs``) or ``ray`` (Ray tasks on a local
    instance of ``jobs`` CPUs, or on the running cluster at ``address``:
    testbed/ray_executor.py). Both skip the same points, show the same progress and
    report a failed point the same way.
    """
    check_executor(executor, backend, address)
    points = expand(fig, backend, scale, results, physics)
    todo = [p for p in points if not done(p)]
    ray = None
    if executor == "ray" and todo and not dry_run:
        from .ray_executor import RaySession
        ray = RaySession(jobs, address)
    try:
        if ray is not None:
            ray.start()  # inside: a Ctrl-C while Ray starts still stops what it started
        slots = ray.slots if ray is not None else jobs
        est = sum(estimate_s(p) for p in todo) / max(1, slots if backend == "sim" else 1)
        summary = {"figure": fig.figure, "backend": backend, "scale": scale, "physics": physics,
                   "points": len(points),
                   "skipped": len(points) - len(todo), "estimate_s": round(est)}
        summary["decision_timed_here"] = timed_here = unprofiled(todo)
        if progress:
            print(f"fig{fig.figure} [{backend}/{scale}/{physics}]: {len(points)} runs, "
                  f"{summary['skipped']} already done, estimated {_hms(est)} for the rest")
            if timed_here:
                print(f"  {timed_here} of them charge a decision time timed on this host (not "
                      f"in the decision profile; `python -m testbed profile-decisions "
                      f"--fig {fig.figure}` records them)")
        if dry_run:
            return summary | {"wall_s": 0.0, "failed": []}
        cache = results / ".placements"
        bar = tqdm(total=len(todo), unit="run", disable=not progress, desc=f"fig{fig.figure}")
        t0 = time.perf_counter()
        failed = ray.run(todo, cache, bar) if ray is not None else \
            _run_local(todo, jobs, backend, cache, bar)
        bar.close()
    finally:
        if ray is not None:
            ray.stop()
    summary["wall_s"] = round(time.perf_counter() - t0, 1)
    summary["failed"] = failed
    summary["kv_over_room"] = kv_over_room(points)
    root = sweep_dir(results, fig.figure, backend, scale, physics)
    root.mkdir(parents=True, exist_ok=True)
    (root / "sweep.json").write_text(json.dumps(summary, indent=2))
    return summary


def kv_over_room(points) -> list[str]:
    """The complete runs among ``points`` in which some server held more K/V cache than its
    memory leaves it and the world let it grow on (``kv_unheld``: ``kv_peak_share`` > 1 in
    their metrics without ``engine.kv_overflow: spill``, testbed/kv_memory.py)."""
    over = []
    for p in points:
        try:
            metrics = json.loads((p.out_dir / "metrics.json").read_text())
        except (OSError, ValueError):
            continue
        if kv_unheld(metrics):
            over.append(str(p.out_dir))
    return over


def check_executor(executor: str, backend: str, address: str | None) -> None:
    """One-line SpecError for an executor that cannot run this sweep, before any work."""
    if executor not in EXECUTORS:
        raise SpecError(f"executor: one of {', '.join(EXECUTORS)}, got {executor!r}")
    if address is not None and executor != "ray":
        raise SpecError("address: only with --executor ray (the local executor runs here)")
    if executor == "ray":
        if backend != "sim":
            raise SpecError("executor ray: the sim backend only (an emulated run needs a "
                            "whole host, as root)")
        from .ray_executor import import_ray
        import_ray()


def _run_local(todo: list[Point], jobs: int, backend: str, cache: Path,
               bar: tqdm) -> list[tuple[str, str]]:
    """The local executor: a process pool of ``jobs`` (sim), else one run after another;
    (folder, error) of each point that failed."""
    failed = []
    if jobs > 1 and backend == "sim" and len(todo) > 1:
        # pool processes die with the sweep, and any signal stops the pool (issue 14)
        ex = ProcessPoolExecutor(max_workers=jobs, initializer=die_with_parent)
        try:
            with sigterm_as_interrupt():
                futs = {ex.submit(_run_one, p, cache): p for p in todo}
                for f in as_completed(futs):
                    try:
                        f.result()
                    except Exception as err:  # a failed point is reported, the sweep goes on
                        failed.append((str(futs[f].out_dir), repr(err)))
                    bar.update(1)
        except BaseException:
            _stop_pool(ex)
            raise
        ex.shutdown(wait=True)
    else:
        for p in todo:
            try:
                _run_one(p, cache)
            except (SpecError, RuntimeError, OSError) as err:
                failed.append((str(p.out_dir), repr(err)))
            bar.update(1)
    return failed


def _stop_pool(ex: ProcessPoolExecutor) -> None:
    """Cancel what has not started and kill what runs: an interrupted point keeps its
    run.json saying ``running``, so the next sweep redoes it."""
    procs = list((getattr(ex, "_processes", None) or {}).values())
    ex.shutdown(wait=False, cancel_futures=True)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join(timeout=5)


def _hms(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def default_jobs() -> int:
    return max(1, min(2, os.cpu_count() or 1))
