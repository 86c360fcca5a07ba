"""Run one experiment: spec -> setup (placement) -> backend -> records -> metrics.

A run folder holds ``spec.resolved.yaml`` (every default filled in),
``run.json`` (provenance, status, placement report, timings), the records
(``token_layers/`` and ``requests/`` Parquet parts) and ``metrics.json``.
``run.json`` says ``"status": "complete"`` only once everything is written, so
an interrupted run is recognisable and a sweep re-runs it.
"""

from __future__ import annotations

import json
import shutil
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from workloads.quality_profile import profile_ce

from .backends import run_backend
from .kv_memory import kv_metrics, kv_room
from .metrics import compute_metrics, memory_use
from .provenance import provenance, write_json_atomic
from .records import RecordWriter, read_records
from .setup import RunSetup, build_setup, check_spec, profiled_decision_s, resolve_inputs
from .spec import ExperimentSpec, SpecError


@dataclass
class RunResult:
    spec: ExperimentSpec
    metrics: dict
    out_dir: Path | None
    info: dict
    setup: RunSetup | None = None
    frames: tuple | None = None  # (token_layers, requests) when out_dir is None


def is_complete(out_dir: Path) -> bool:
    try:
        return json.loads((out_dir / "run.json").read_text()).get("status") == "complete"
    except (OSError, ValueError):
        return False


def is_done(out_dir: Path, spec: ExperimentSpec) -> bool:
    """A complete run of exactly this spec is in ``out_dir`` (what sweeps, capacity
    searches and agreement checks skip). The spec's symbolic inputs are resolved first
    (``resolve_inputs``: ``quality.replay: auto`` and the like), as the run resolved them
    before writing ``spec.resolved.yaml``. A spec asking for ``decision_s: calibrated``
    matches the run that resolved it to the number it charged, and, where the decision
    profile holds the setting, only if that number is the profile's."""
    f = out_dir / "spec.resolved.yaml"
    if not (is_complete(out_dir) and f.exists()):
        return False
    try:
        spec = resolve_inputs(spec)
    except SpecError:
        return False  # it could not run as it stands
    on_disk = f.read_text()
    if on_disk == spec.to_yaml():
        return True
    if spec.engine.decision_s != "calibrated":
        return False
    charged = json.loads((out_dir / "run.json").read_text()).get("decision_s_calibrated")
    if charged is None:
        return False
    try:
        profiled = profiled_decision_s(spec)
    except SpecError:
        return False
    if profiled is not None and profiled != charged:
        return False  # timed on a host before the profile held it, or an older profile
    return on_disk == spec.with_overrides({"engine.decision_s": charged}).to_yaml()


#: a failed run's full traceback, beside its run.json (sweeps print its path)
TRACEBACK = "traceback.txt"


def run_experiment(spec: ExperimentSpec, out_dir: Path | None = None, progress: bool = True,
                   base_dir: Path | None = None, keep_setup: bool = False,
                   placement_cache: Path | None = None, trace_steps: bool = False) -> RunResult:
    """Run one spec; writes ``out_dir`` (run.json says running, then complete, failed or
    interrupted). Bad input raises ``SpecError`` before anything is written. ``trace_steps``
    also writes every step's composition to ``steps/`` (the emulator's workers each write
    their own stream's, model-time starts; ``python -m analysis compare-steps`` lines two
    runs' up)."""
    spec = check_spec(spec, base_dir).spec  # one line for bad input, before any folder exists
    info = provenance(spec.seed, spec.backend)
    info["name"] = spec.name
    info["status"] = "running"
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        for sub in ("token_layers", "requests", "quality_inrun", "steps"):
            shutil.rmtree(out_dir / sub, ignore_errors=True)
        for name in ("metrics.json", "quality_inrun.csv", "quality_replay.csv", "quality.json",
                     TRACEBACK):
            (out_dir / name).unlink(missing_ok=True)  # nothing of an earlier attempt is merged
        (out_dir / "spec.resolved.yaml").write_text(spec.to_yaml())
        write_json_atomic(out_dir / "run.json", info)
    try:
        return _execute(spec, out_dir, progress, base_dir, keep_setup, placement_cache, info,
                        trace_steps)
    except BaseException as err:
        if out_dir is not None:  # never left saying "running"
            info["status"] = "interrupted" if isinstance(err, KeyboardInterrupt) else "failed"
            info["error"] = " ".join(f"{type(err).__name__}: {err}".split())[:500]
            if not isinstance(err, KeyboardInterrupt):  # the whole story, for the sweep's report
                (out_dir / TRACEBACK).write_text(traceback.format_exc())
                info["traceback"] = TRACEBACK
            write_json_atomic(out_dir / "run.json", info)
        raise


def _execute(spec: ExperimentSpec, out_dir: Path | None, progress: bool, base_dir: Path | None,
             keep_setup: bool, placement_cache: Path | None, info: dict,
             trace_steps: bool = False) -> RunResult:
    t0 = time.perf_counter()
    if placement_cache is None and out_dir is not None:
        # beside the run: a rerun of the same spec reuses its placement and its calibrated
        # decision time, so it reproduces its records exactly
        placement_cache = out_dir.parent / ".placement-cache"
    setup = build_setup(spec, base_dir, placement_cache)
    if "decision_s_calibrated" in setup.notes and out_dir is not None:
        # the resolved config carries the number charged, so it reruns the same on any host
        (out_dir / "spec.resolved.yaml").write_text(
            spec.with_overrides({"engine.decision_s": setup.decision_s}).to_yaml())
        info["decision_s_calibrated"] = setup.decision_s
        info["decision_s_source"] = setup.notes.get("decision_s_source")
    info["requests"] = setup.notes.get("requests")
    info["placement_s"] = round(setup.placement_s, 3)
    info["placement"] = setup.router.placement_report
    info["deployment"] = setup.deployment.summary(setup.shape)
    # every server's numbers, and which of them came from a catalogue class (README)
    info["topology_resolved"] = setup.topology.resolved().model_dump(mode="json", exclude_none=True)
    info["quality_model"] = setup.quality.source
    writer = RecordWriter(out_dir, setup.shape.top_k, trace_steps=trace_steps)
    t1 = time.perf_counter()
    stats = run_backend(setup, writer, progress)
    writer.close()
    info["backend_s"] = round(time.perf_counter() - t1, 3)
    info["stats"] = stats
    if out_dir is not None:
        tl, rq = read_records(out_dir)
        frames = None
    else:
        tl, rq = writer.frames()
        frames = (tl, rq)
    w = spec.workload
    metrics = compute_metrics(tl, rq, w.warmup_s, w.duration_s, spec.sla_s, spec.quality.budget,
                              decodes=_decodes(w))
    metrics.update(memory_use(setup.deployment, setup.shape, setup.problem.budget))
    metrics.update(_kv(tl, rq, spec, setup.model, setup.cluster))
    if spec.quality.replay is True and out_dir is not None:
        info["quality_replay_s"] = _replay(out_dir, metrics)
    if spec.quality.inrun and out_dir is not None:
        metrics["inrun"] = _collect_inrun(out_dir, spec)
    info["wall_s"] = round(time.perf_counter() - t0, 3)
    info["status"] = "complete"
    if out_dir is not None:
        write_json_atomic(out_dir / "metrics.json", metrics)
        write_json_atomic(out_dir / "run.json", info)
    return RunResult(spec, metrics, out_dir, info, setup if keep_setup else None, frames)


def _kv(tl, rq, spec: ExperimentSpec, model, cluster) -> dict:
    """The K/V cache the run's servers held against their room (``testbed/kv_memory.py``)."""
    out = kv_metrics(tl, rq, float(model.kv_bytes_per_token()),
                     kv_room(cluster.gpu_bytes, spec.memory.gpu_share),
                     causal=spec.engine.attention == "causal", names=cluster.names)
    if spec.engine.kv_overflow != "none":  # (absent at the default: older runs' metrics stand)
        out["kv_overflow"] = spec.engine.kv_overflow
    return out


def _decodes(w) -> bool | None:
    """Whether the run's requests generate tokens: the spec says so for fixed lengths; with
    a trace's lengths the records do (None: ``compute_metrics`` reads them)."""
    return None if w.fixed_tokens() is None else w.gen_tokens > 0


def refresh_metrics(out_dir: Path) -> tuple[dict, bool] | None:
    """Recompute a complete run's record-derived metrics with this code (``compute_metrics``
    from its records and ``spec.resolved.yaml``) and rewrite ``metrics.json``, keeping what
    the records do not give (memory use, measured quality). For results written before a
    metric or a flag changed: sweeps, compare and capacity reuse complete runs as they are.
    None where ``out_dir`` holds no complete run."""
    if not (is_complete(out_dir) and (out_dir / "spec.resolved.yaml").exists()):
        return None
    from .spec import load_spec
    spec = load_spec(out_dir / "spec.resolved.yaml")
    tl, rq = read_records(out_dir)
    w = spec.workload
    old = json.loads((out_dir / "metrics.json").read_text()) if (out_dir / "metrics.json").exists() else {}
    checked = check_spec(spec)
    new = {**old, **compute_metrics(tl, rq, w.warmup_s, w.duration_s, spec.sla_s,
                                    spec.quality.budget, decodes=_decodes(w)),
           **_kv(tl, rq, spec, checked.model, checked.cluster)}
    changed = json.dumps(new, sort_keys=True) != json.dumps(old, sort_keys=True)  # NaN != NaN
    if changed:
        write_json_atomic(out_dir / "metrics.json", new)
    return new, changed


# The quality modules below are imported inside the functions that use them, not for
# a hierarchy reason (testbed may import workloads): workloads.proxy imports torch
# (about 1 s), which a run without measured quality should not pay.


def _replay(out_dir: Path, metrics: dict) -> float:
    """Measured quality on the proxy (issue 6): writes quality.json, adds it to the metrics."""
    from .quality_replay import replay_run_dir  # torch: see above

    t = time.perf_counter()
    summary = replay_run_dir(out_dir)
    metrics["measured"] = {k: v for k, v in summary.items() if isinstance(v, (int, float))}
    return round(time.perf_counter() - t, 3)


def _collect_inrun(out_dir: Path, spec: ExperimentSpec) -> dict:
    """Quality the workers measured during the run (issue 6): quality_inrun.csv and a summary."""
    from .quality_inrun import collect  # torch: see above

    _, summary = collect(out_dir, _ce_ref(spec), spec.workload.warmup_s)
    return {k: v for k, v in summary.items() if isinstance(v, (int, float))}


def _ce_ref(spec: ExperimentSpec) -> float:
    """The profile's reference cross-entropy; only without one is the proxy loaded to measure it."""
    prof = Path(spec.quality.profile) if spec.quality.profile != "prior" else None
    ce = profile_ce(prof)
    if ce is not None:
        return ce
    from workloads.proxy.data import load_corpus  # torch: see above
    from workloads.proxy.replay import reference_ce
    from workloads.proxy.trace import trace_proxy

    corpus = load_corpus()
    return reference_ce(None, trace_proxy(Path(spec.workload.trace), corpus)[0], corpus)
