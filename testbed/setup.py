"""From a spec to the objects a backend runs: topology, model, quality model,
workload, and the router after its offline stage (placement).

This is the first half of the data flow (topology and workload -> placement);
both backends start from the same ``RunSetup``, so they share everything but
time and transport.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import os
import platform
import sysconfig
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from pydantic import ValidationError

from hetroute.deployment import ConstraintViolation, Deployment, MemoryBudget, Replica
from hetroute.quality import QualityModel, prior_quality
from hetroute.routers import Problem, Router, get_router
from hetroute.system import Cluster, MoEShape, Precision
from topologies import TopologyError, TopologySpec, generate, load_topology
from workloads import (JsonlTrace, ModelSpec, Request, RequestShape, SyntheticTrace, TraceSource,
                       Users, calibration_traffic, default_trace_params,
                       get_model)
from workloads.arrivals import make_requests
from workloads.quality_profile import ProfileError, load_profile
from workloads.request_trace import (RequestTrace, RequestTraceError, gap_cv,
                                     read_request_trace)

from . import decision_profile as dprofile
from .core import DECISION_REPEATS, DECISION_SAMPLES, calibrate_decision_s
from .spec import ExperimentSpec, GeneratedTopology, SpecError

#: How a cached decision time was timed; an entry timed another way is timed again.
DECISION_METHOD = f"median of {DECISION_SAMPLES} fastest-of-{DECISION_REPEATS}"
#: Tokens routed in one ``request_targets`` batch at most: its largest array holds
#: tokens x L x E draws (about 13 MB for Mixtral, 52 MB for Qwen1.5-MoE, freed per batch).
TARGETS_BATCH_TOKENS = 4096


@dataclass
class RunSetup:
    spec: ExperimentSpec
    topology: TopologySpec
    cluster: Cluster
    model: ModelSpec
    shape: MoEShape
    quality: QualityModel
    users: Users
    requests: list[Request]
    trace: TraceSource
    problem: Problem
    router: Router
    deployment: Deployment
    placement_s: float = 0.0
    notes: dict = field(default_factory=dict)
    #: CPU seconds the simulator charges per routing decision (``engine.decision_s``)
    decision_s: float = 0.0
    #: task of each request id this run generated (derived from ``requests``)
    tasks: dict[int, int] = field(init=False, repr=False)
    #: position of each request id in ``requests`` (arrival order)
    order: dict[int, int] = field(init=False, repr=False)
    #: (request id, tokens) -> targets routed ahead of their request (``request_targets``)
    ahead: dict[tuple[int, int], list] = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.tasks = {rq.id: rq.task for rq in self.requests}
        self.order = {rq.id: i for i, rq in enumerate(self.requests)}

    def task_of(self, rid: int) -> int:
        """The task of request ``rid`` (0 for ids this run did not generate)."""
        return self.tasks.get(int(rid), 0)

    def routing(self, rid: int, n_tokens: int):
        """The trace's routing of request ``rid``, by its task."""
        return self.trace.route(rid, n_tokens, self.task_of(rid))

    def request_targets(self, rid: int, n_tokens: int) -> list[tuple[tuple[int, ...], ...]]:
        """Per token, per layer: the gated experts as global ids.

        A synthetic trace routes the next requests of the same length in the same call
        (``SyntheticTrace.route_many``: the numpy work per request is many tiny calls, a
        batch shares them) and hands each out once; the result is what ``routing`` gives."""
        got = self.ahead.pop((rid, n_tokens), None)
        if got is not None:
            return got
        trace = self.trace
        if not isinstance(trace, SyntheticTrace):
            return self._global(np.asarray(self.routing(rid, n_tokens).experts)[None])[0]
        ids = self._batch(rid, n_tokens)
        routed = trace.route_many(ids, n_tokens, [self.task_of(i) for i in ids])
        out = self._global(np.stack([r.experts for r in routed]))
        for i, targets in zip(ids[1:], out[1:]):
            self.ahead[(i, n_tokens)] = targets
        return out[0]

    def _batch(self, rid: int, n_tokens: int, max_tokens: int = TARGETS_BATCH_TOKENS) -> list[int]:
        """``rid`` and the requests after it (arrival order) of the same length not yet routed,
        up to ``max_tokens`` tokens in all (bounds the batch's arrays)."""
        ids = [rid]
        pos = self.order.get(rid)
        if pos is None:
            return ids
        room = max_tokens // max(n_tokens, 1)  # looks at as many requests as fit at most
        for rq in self.requests[pos + 1:pos + room]:
            if rq.prompt_tokens + rq.gen_tokens == n_tokens and (rq.id, n_tokens) not in self.ahead:
                ids.append(rq.id)
        return ids

    def _global(self, local: np.ndarray) -> list[list[tuple[tuple[int, ...], ...]]]:
        """(requests, tokens, L, k) local expert ids -> per request, token, layer: global ids."""
        E = self.shape.experts_per_layer
        glob = local + (np.arange(self.shape.n_layers) * E)[None, None, :, None]
        return [[tuple(map(tuple, tok)) for tok in req] for req in glob.tolist()]  # map: a C loop


def make_trace(model: ModelSpec, source: str, params: dict | None, seed: int,
               tasks: dict | None = None) -> TraceSource:
    """'synthetic' (calibrated generator, optional parameter overrides) or a JSON-lines file.

    ``tasks``: the workload's task knobs (``WorkloadSpec.task_trace_params``);
    ``params`` may override them."""
    if source == "synthetic":
        try:
            p = default_trace_params(model.name).with_overrides({**(tasks or {}), **(params or {})})
        except ValueError as err:
            raise SpecError(f"workload.trace_params: {str(err).splitlines()[0]}") from None
        return SyntheticTrace(model, p, seed=seed)
    if params:
        raise SpecError("workload.trace_params: only for the synthetic trace")
    try:
        return JsonlTrace(source, model)
    except (OSError, ValueError) as err:
        raise SpecError(f"workload.trace: {err}") from None


QUALITY_ROOT = Path("results/quality")  # where `make quality-profile` writes, per model


def resolve_inputs(spec: ExperimentSpec, quality_root: Path = QUALITY_ROOT) -> ExperimentSpec:
    """Replace the symbolic inputs by the files they stand for, so that
    ``spec.resolved.yaml`` names exactly what a run used: quality profile
    'measured'/'auto', trace 'proxy'/'auto' and replay 'auto'.

    'auto' takes the measured proxy profile and trace where they exist
    (issue 6: the measured profile where it exists) and the prior and
    synthetic trace otherwise; 'measured' and 'proxy' insist on them.
    """
    try:
        name = get_model(spec.workload.model).name
    except KeyError as err:
        raise SpecError(f"workload.model: {err.args[0]}") from None
    folder = quality_root / name
    hint = f"run `make quality-profile` (python -m workloads.proxy profile --model {name}) first"
    over: dict = {}
    # field, its value, the word that insists on the file, the file, the fallback of 'auto'
    for key, value, insist, path, fallback in (
            ("quality.profile", spec.quality.profile, "measured", folder / "profile.npz", "prior"),
            ("workload.trace", spec.workload.trace, "proxy", folder / "trace.jsonl", "synthetic")):
        if value not in (insist, "auto"):
            continue
        if path.exists():
            over[key] = str(path)
        elif value == insist:
            raise SpecError(f"{key}: no {insist} file {path}; {hint}")
        else:
            over[key] = fallback
    if spec.quality.replay == "auto":  # a proxy trace's runs, where requests fit its segments
        over["quality.replay"] = (_is_proxy_trace(Path(over.get("workload.trace", spec.workload.trace)))
                                  and _replay_segment(spec) is None)
    elif spec.quality.replay is True and (seg := _replay_segment(spec)) is not None:
        w = spec.workload
        got = (f"prompt_tokens + gen_tokens = {w.prompt_tokens + w.gen_tokens}"
               if w.fixed_tokens() is not None else "lengths from a request trace")
        raise SpecError(f"quality.replay: at most {seg} tokens per request (a trace segment), got "
                        f"{got}; set workload.gen_tokens: 0 or quality.replay: false")
    if spec.quality.inrun:
        _check_inrun(spec, Path(over.get("workload.trace", spec.workload.trace)), hint)
    return spec.with_overrides(over) if over else spec


def _replay_segment(spec: ExperimentSpec) -> int | None:
    """None where replay can re-execute the spec's requests, else the segment length they
    exceed: replay scores each request as one proxy-trace segment (decode requests are longer)."""
    from workloads.proxy.profile import SEGMENT  # lazy: workloads.proxy imports torch (~1 s)

    n = spec.workload.fixed_tokens()  # None: a trace's lengths, not bounded by one segment
    return None if n is not None and n <= SEGMENT else SEGMENT


def _is_proxy_trace(trace: Path) -> bool:
    """A JSON-lines trace whose sidecar says a proxy made it (``workloads.proxy.trace``)."""
    meta = trace.with_name(trace.name.removesuffix(".jsonl") + ".meta.json")
    return trace.suffix == ".jsonl" and meta.exists() and "proxy" in meta.read_text()


def _check_inrun(spec: ExperimentSpec, trace: Path, hint: str) -> None:
    """quality.inrun runs the proxy on the request's own text: the emulator, a proxy trace."""
    from workloads.proxy.profile import SEGMENT  # lazy: workloads.proxy imports torch (~1 s)

    if spec.backend != "emu":
        raise SpecError("quality.inrun: only emulated workers execute the proxy during a run; "
                        "the simulator measures quality by replay (quality.replay)")
    if not _is_proxy_trace(trace):
        raise SpecError(f"quality.inrun: needs workload.trace 'proxy' (a proxy trace), got "
                        f"{str(trace)!r}; {hint}")
    n = spec.workload.fixed_tokens()
    if n is None:
        raise SpecError("quality.inrun: needs fixed request lengths (workload.lengths: fixed); "
                        "a request trace's may exceed a proxy trace segment")
    if n > SEGMENT:
        raise SpecError(f"quality.inrun: at most {SEGMENT} tokens per request (a trace segment), "
                        f"got prompt_tokens + gen_tokens = {n}")


def resolve_topology(spec: ExperimentSpec) -> TopologySpec:
    if isinstance(spec.topology, GeneratedTopology):
        return generate(spec.topology.servers, spec.topology.seed)
    return load_topology(spec.topology)


@dataclass(frozen=True)
class CheckedSpec:
    """What ``check_spec`` loaded on the way; ``build_setup`` goes on from it."""

    spec: ExperimentSpec  # with its symbolic inputs resolved (resolve_inputs)
    topology: TopologySpec
    cluster: Cluster
    model: ModelSpec
    router_cls: type[Router]
    warnings: tuple[str, ...]
    request_trace: RequestTrace | None = None  # ``workload.requests_file``, read


def check_spec(spec: ExperimentSpec, base_dir: Path | None = None) -> CheckedSpec:
    """Every check that needs no placement and no workload, in the order a reader
    would fix them: inputs, topology, faults, model, router and its parameters,
    input files, and whether the model can fit the cluster at all. Raises
    ``SpecError`` (one line, naming the field); ``show-spec`` runs it too.
    ``warnings`` lists numbers far outside real hardware."""
    try:
        spec = resolve_inputs(spec)
        topo = resolve_topology(spec)
    except TopologyError as err:
        raise SpecError(f"topology: {err}") from None
    cluster = topo.to_cluster()
    w = spec.workload
    for i, f in enumerate(spec.faults):
        for field_name in ("server", "peer"):
            name = getattr(f, field_name)
            if name is not None and name not in cluster.names:
                raise SpecError(f"faults[{i}].{field_name}: unknown server {name!r} "
                                f"(topology has {', '.join(cluster.names)})")
        if f.server is None or (f.kind == "cut_link" and f.peer is None):
            raise SpecError(f"faults[{i}]: {f.kind} needs server" + (" and peer" if f.kind == "cut_link" else ""))
        if f.kind == "cut_link" and f.peer == f.server:
            raise SpecError(f"faults[{i}].peer: a link joins two different servers")
        if f.at_s >= w.duration_s:
            raise SpecError(f"faults[{i}].at_s: {f.at_s:g} s is not before the arrivals end "
                            f"(workload.duration_s {w.duration_s:g} s)")
    try:
        model = get_model(w.model)
    except KeyError as err:
        raise SpecError(f"workload.model: {err.args[0]}") from None
    if w.top_k:
        if w.top_k > model.experts_per_layer:
            raise SpecError(f"workload.top_k: {w.top_k} > {model.experts_per_layer} experts per layer")
        model = dataclasses.replace(model, top_k=w.top_k)
    try:
        cls = get_router(spec.router.name)
    except KeyError as err:
        raise SpecError(f"router.name: {err.args[0]}") from None
    try:
        cls.Params.model_validate(spec.router.params)
    except ValidationError as err:
        e = err.errors()[0]
        loc = ".".join(str(x) for x in e["loc"])
        raise SpecError(f"router.params.{loc}: {e['msg']} ({spec.router.name})") from None
    if w.task_mix is not None and len(w.task_mix) != cluster.n:
        raise SpecError(f"workload.task_mix: {len(w.task_mix)} rows for {cluster.n} servers")
    if w.trace == "synthetic":
        try:
            default_trace_params(model.name).with_overrides(
                {**w.task_trace_params(), **(w.trace_params or {})})
        except ValueError as err:
            raise SpecError(f"workload.trace_params: {str(err).splitlines()[0]}") from None
    elif w.trace_params:
        raise SpecError("workload.trace_params: only for the synthetic trace")
    for key, value in (("quality.profile", spec.quality.profile), ("workload.trace", w.trace)):
        if value not in ("prior", "synthetic") and not _path(value, base_dir).is_file():
            raise SpecError(f"{key}: no such file {value!r}")
    request_trace = None
    if w.requests_file:
        try:
            request_trace = read_request_trace(_path(w.requests_file, base_dir))
        except RequestTraceError as err:
            raise SpecError(f"workload.requests_file: {err}") from None
        if w.arrivals == "trace" and w.trace_start_s >= request_trace.span_s and request_trace.n > 1:
            raise SpecError(f"workload.trace_start_s: {w.trace_start_s:g} s is past the trace's "
                            f"last arrival ({request_trace.span_s:g} s)")
        if w.arrivals == "trace" and w.trace_rate == "spec" and request_trace.mean_rate_per_s <= 0:
            raise SpecError("workload.trace_rate: the trace has no rate to rescale (one request, "
                            "or all at one instant); use trace_rate: recorded")
    _check_fit(model.shape(), cluster, spec)
    return CheckedSpec(spec, topo, cluster, model, cls, tuple(topo.warnings()), request_trace)


def _check_fit(shape: MoEShape, cluster: Cluster, spec: ExperimentSpec) -> None:
    """Every expert needs one replica somewhere: at its smallest format the model's
    experts must fit the memory the shares give (GPU minus dense weights, plus CPU)."""
    budget = MemoryBudget.of(cluster, shape, spec.memory.gpu_share, spec.memory.cpu_share)
    have = sum(budget.gpu) + sum(budget.cpu)
    small = min(shape.precisions, key=lambda p: shape.expert_bytes[p])
    need = shape.n_experts * shape.expert_bytes[small]
    if need > have:
        raise SpecError(f"workload.model: {shape.name} does not fit this cluster: its experts need "
                        f"{need / 1e9:.1f} GB even in {small.label}, the cluster offers "
                        f"{have / 1e9:.1f} GB (memory.gpu_share of GPU memory less the dense "
                        f"weights, plus memory.cpu_share of CPU memory)")


def _router_failed(name: str, stage: str, err: BaseException) -> SpecError:
    """A router's own code raised: one line with where, so its author can find it."""
    frames = traceback.extract_tb(err.__traceback__)
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    msg = " ".join(str(err).split())[:200]
    return SpecError(f"router.name: {name} failed in {stage}: {type(err).__name__}: {msg}{where}")


def build_setup(spec: ExperimentSpec, base_dir: Path | None = None,
                placement_cache: Path | None = None, deployment_file: Path | None = None,
                decision_profile: Path | str | None = "shipped") -> RunSetup:
    """Build everything up to and including placement; raises SpecError on bad input.

    Under ``engine.decision_s: calibrated`` the constant comes from ``decision_profile``
    ("shipped": testbed/decision_profile.json; None: none) when it holds this setting (the
    same number on every machine), else it is timed here.

    With ``placement_cache``, a deployment computed before for the same inputs
    (everything placement depends on, hashed) is reused instead of placed again.
    With ``deployment_file`` (``save_deployment``: what the emulator's runner placed), that
    deployment is used as it is; a router that cannot rebuild its state from a deployment
    alone (``cacheable_placement = False``) places again and must get the same one.
    """
    checked = check_spec(spec, base_dir)
    spec, topo, cluster, model, cls = (checked.spec, checked.topology, checked.cluster,
                                       checked.model, checked.router_cls)
    shape = model.shape()
    if spec.quality.profile == "prior":
        quality = prior_quality(shape, seed=spec.seed)
    else:
        try:
            quality = load_profile(_path(spec.quality.profile, base_dir), shape)
        except ProfileError as err:
            raise SpecError(f"quality.profile: {err}") from None
    w = spec.workload
    trace = make_trace(model, w.trace if w.trace == "synthetic" else str(_path(w.trace, base_dir)),
                       w.trace_params, seed=spec.seed, tasks=w.task_trace_params())
    n_tasks = getattr(trace, "n_tasks", 1)  # a recorded trace has no task popularity of ours
    users = Users(n_users=w.users, n_servers=cluster.n, zipf_s=w.zipf_s, seed=spec.seed,
                  n_tasks=n_tasks, task_concentration=w.task_concentration,
                  task_mix=(tuple(tuple(r) for r in w.task_mix)
                            if w.task_mix is not None and n_tasks > 1 else None))
    requests = make_requests(w.rate_per_s, RequestShape(w.prompt_tokens, w.gen_tokens), users,
                             seed=spec.seed, duration_s=w.duration_s, arrivals=w.arrivals,
                             cv=w.arrival_cv, gamma_count=w.gamma_count,
                             trace=checked.request_trace,
                             trace_rate=w.trace_rate, trace_start_s=w.trace_start_s,
                             lengths=w.lengths, max_prompt_tokens=w.max_prompt_tokens,
                             max_gen_tokens=w.max_gen_tokens)
    calib = calibration_traffic(trace, model, users.home_probs(), w.calibration_tokens,
                                seed=spec.seed, tokens_per_request=w.prompt_tokens,
                                task_probs=users.task_probs)
    budget = MemoryBudget.of(cluster, shape, spec.memory.gpu_share, spec.memory.cpu_share)
    problem = Problem(cluster=cluster, shape=shape, quality=quality, budget=budget,
                      lam_max=spec.quality.budget, calibration=calib, seed=spec.seed,
                      window_s=spec.window_s)
    try:
        router = cls(problem, spec.router.params)
    except Exception as err:  # noqa: BLE001 - a router's own code: reported, not trusted
        raise _router_failed(spec.router.name, "__init__", err) from None
    t0 = time.perf_counter()
    given = load_deployment(deployment_file, shape, cluster.n) if deployment_file else None
    cached = _cache_file(spec, topo, placement_cache, cls) \
        if placement_cache and cls.cacheable_placement and given is None else None
    timed = None
    if given is not None and cls.cacheable_placement:
        deployment, router.placement_report, _ = given
        router.placement_report = {**router.placement_report, "given": str(deployment_file)}
    elif cached is not None and cached.exists():
        deployment, router.placement_report, timed = load_deployment(cached, shape, cluster.n)
        router.placement_report = {**router.placement_report, "cached": True}
    else:
        try:
            deployment = router.place()
        except ConstraintViolation as err:  # the router's own verdict that it does not fit
            raise SpecError(f"router.name: {spec.router.name} cannot place this model here: "
                            f"{err}") from None
        except Exception as err:  # noqa: BLE001
            raise _router_failed(spec.router.name, "place()", err) from None
    if given is not None and deployment.replicas != given[0].replicas:
        raise SpecError(f"router.name: {spec.router.name} placed differently than the deployment "
                        f"it was given ({deployment_file}): its place() must be a function of the spec")
    try:
        deployment.check(shape, budget, cluster)
    except ConstraintViolation as err:
        raise SpecError(f"router.name: {spec.router.name} placed an invalid deployment: {err}") from None
    try:
        router.bind(deployment)
    except Exception as err:  # noqa: BLE001
        raise _router_failed(spec.router.name, "bind()", err) from None
    notes: dict = {"requests": requests_report(requests, checked.request_trace)}
    decision_s = spec.engine.decision_s
    fresh = cached is not None and not cached.exists()
    profiled = decision_profile_entry(spec, topo, cls, decision_profile) \
        if decision_s == "calibrated" else None
    if profiled is not None:  # measured once on a named CPU: the same charge everywhere
        decision_s = float(profiled["decision_s"])
        notes["decision_s_calibrated"] = decision_s
        notes["decision_s_source"] = dprofile.source(profiled)
    elif decision_s == "calibrated":  # both backends charge the same constant
        # timed once per placement and machine, then reused: a rerun is reproducible
        notes["decision_s_source"] = dprofile.source(None)
        if (timed is None or timed.get("host") != platform.node()
                or timed.get("method") != DECISION_METHOD):
            timed = {"host": platform.node(), "method": DECISION_METHOD,
                     "decision_s": calibrate_decision_s(router)}
            fresh = cached is not None
        decision_s = timed["decision_s"]
        notes["decision_s_calibrated"] = decision_s
    if fresh:
        save_deployment(cached, deployment, router.placement_report, timed)
    return RunSetup(spec=spec, topology=topo, cluster=cluster, model=model, shape=shape,
                    quality=quality, users=users, requests=requests, trace=trace, problem=problem,
                    router=router, deployment=deployment, placement_s=time.perf_counter() - t0,
                    notes=notes,
                    decision_s=float(decision_s) if isinstance(decision_s, (int, float)) else 0.0)


def requests_report(requests: list[Request], trace: RequestTrace | None = None) -> dict:
    """What the run's requests are (``run.json``): how many, at what rate, how bursty (the
    coefficient of variation of the gaps; 1 for Poisson), their lengths, and the request
    trace they came from, if any (``RequestTrace.report``)."""
    prompt = np.array([r.prompt_tokens for r in requests])
    gen = np.array([r.gen_tokens for r in requests])
    out = {"requests": len(requests),
           "interarrival_cv": gap_cv([r.arrival_s for r in requests]),
           "prompt_tokens_mean": round(float(prompt.mean()), 2) if prompt.size else None,
           "gen_tokens_mean": round(float(gen.mean()), 2) if gen.size else None,
           "prompt_tokens_max": int(prompt.max()) if prompt.size else None,
           "gen_tokens_max": int(gen.max()) if gen.size else None}
    if trace is not None:
        out["trace"] = trace.report()
    return out


def _cache_file(spec: ExperimentSpec, topo: TopologySpec, root: Path, cls: type[Router]) -> Path:
    return root / f"{placement_key(spec, topo, cls)}.json"


def placement_key(spec: ExperimentSpec, topo: TopologySpec, cls: type[Router]) -> str:
    """Placement depends on the topology, model, quality, memory, router (its spec and
    the source of every module its class comes from, so an out-of-tree router's edit is
    seen), seed, window and the calibration-side workload fields, not on load or duration.
    The key names the placement cache's entry and the decision profile's
    (testbed/decision_profile.py); it is the same on every machine, and the same however
    a setting is spelled: a default written out (``top_k: 2`` for Mixtral,
    ``memory_ratio: 2.0``) is the default left out (``canonical_router``)."""
    w = spec.workload
    key = {
        "topology": topo.model_dump(mode="json"), "model": w.model,
        "top_k": w.top_k or get_model(w.model).top_k,
        "quality": spec.quality.model_dump(mode="json"), "memory": spec.memory.model_dump(mode="json"),
        "router": canonical_router(spec, cls), "seed": spec.seed, "window": spec.window_s,
        "calib": [w.trace, w.trace_params, w.calibration_tokens, w.users, w.zipf_s, w.prompt_tokens,
                  w.tasks, w.task_concentration, w.task_mix, w.task_specificity],
        "inputs": [_digest(p) for p in (spec.quality.profile, w.trace) if Path(p).is_file()],
        "code": _code_version(),
        "router_code": _router_code(cls),
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24]
    return f"{spec.router.name.replace(':', '_')}-{digest}"


def canonical_router(spec: ExperimentSpec, cls: type[Router]) -> dict:
    """The router's name and every parameter with its default filled in: one setting,
    one key. Until 2026-11-28 the key held the parameters as written, so Fig. 6's
    ``memory_ratio: 2.0`` and Fig. 2's HetRoute (the same setting) were timed as two
    settings."""
    return {"name": spec.router.name,
            "params": cls.Params.model_validate(spec.router.params).model_dump(mode="json")}


def decision_profile_entry(spec: ExperimentSpec, topo: TopologySpec, cls: type[Router],
                           path: Path | str | None = "shipped") -> dict | None:
    """The profile's entry for this setting (None: not profiled, or no profile)."""
    path = dprofile.resolve(path)
    return None if path is None else dprofile.lookup(placement_key(spec, topo, cls), path)


def profiled_decision_s(spec: ExperimentSpec, base_dir: Path | None = None,
                        path: Path | str | None = "shipped") -> float | None:
    """What a run of ``spec`` would charge from the profile under ``decision_s:
    calibrated`` (None: it would be timed on the host). For ``runner.is_done``."""
    path = dprofile.resolve(path)
    if spec.engine.decision_s != "calibrated" or path is None or not path.is_file():
        return None
    checked = check_spec(spec, base_dir)
    e = decision_profile_entry(checked.spec, checked.topology, checked.router_cls, path)
    return None if e is None else float(e["decision_s"])


def _digest(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def _router_code(cls: type[Router]) -> str:
    """Hash of the source files of the router class and its bases (an out-of-tree router
    and whatever it subclasses), leaving out Python's standard library (``abc.py``), which
    differs between Python builds and would make the key differ between machines."""
    h = hashlib.sha256()
    for src in router_sources(cls):
        h.update(src.read_bytes())
    return h.hexdigest()[:16]


def router_sources(cls: type[Router]) -> list[Path]:
    """The files ``_router_code`` hashes."""
    stdlib = {Path(sysconfig.get_paths()[k]).resolve() for k in ("stdlib", "platstdlib")}
    out = []
    for klass in cls.__mro__:
        try:
            src = inspect.getsourcefile(klass)
        except TypeError:  # builtins
            continue
        if src and Path(src).is_file() and not any(d in Path(src).resolve().parents
                                                     for d in stdlib):
            out.append(Path(src))
    return out


#: sources under ``workloads/`` that no placement and no decision reads: they make the
#: run's evaluation requests (arrivals, a request trace's lengths), while Algorithm 1, the
#: planners and the decision timing see only the calibration traffic (``requests.py``)
NOT_PLACEMENT = ("workloads/arrivals.py", "workloads/request_trace.py")


def _code_version() -> str:
    """Hash of the method's sources, so a code change invalidates cached placements (and
    the decision profile's entries, keyed with it)."""
    h = hashlib.sha256()
    root = Path(__file__).resolve().parent.parent
    for pkg in ("hetroute", "workloads"):
        for f in sorted((root / pkg).rglob("*.py")):
            rel = f.relative_to(root)
            if "proxy" in rel.parts or rel.as_posix() in NOT_PLACEMENT:  # they do not place
                continue
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def save_deployment(path: Path, dep: Deployment, report: dict, timed: dict | None = None) -> None:
    """A deployment as JSON: the placement cache's entry, and the file the emulator's runner
    hands its workers (``build_setup(..., deployment_file=...)``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"replicas": [[r.expert, r.server, int(r.precision), bool(r.gpu)] for r in dep.replicas],
            "report": {k: v for k, v in report.items() if k != "cached"}, "decision": timed}
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # processes may save the same entry at once
    tmp.write_text(json.dumps(data, default=str))
    os.replace(tmp, path)


def load_deployment(path: Path, shape: MoEShape, n_servers: int
                    ) -> tuple[Deployment, dict, dict | None]:
    data = json.loads(path.read_text())
    reps = tuple(Replica(e, n, Precision(c), g) for e, n, c, g in data["replicas"])
    return Deployment(reps, shape.n_experts, n_servers), data.get("report", {}), data.get("decision")


def _path(p: str, base_dir: Path | None) -> Path:
    path = Path(p)
    if not path.is_absolute() and base_dir is not None and (base_dir / path).exists():
        return base_dir / path
    return path
