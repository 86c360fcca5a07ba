"""The router conformance checker, shipped with the library (as Gymnasium ships ``check_env``).

``python -m testbed check-router NAME`` (a registered name or ``package.module:Class``)
runs these checks on short simulated runs and prints each failure with how to fix it;
the test suite runs the same function over every registered router.

Per topology x model (default: small3 and paper10 x Switch, Qwen, Mixtral):

- **placement**: ``Deployment.check`` (c.1, c.2, c.4), every expert covered, and placing
  twice with the same problem gives the same deployment;
- **records**: every target of every token-layer is executed by an existing replica that
  is exact, a listed substitute or a full-precision fallback; at most k participants;
  every token passes every layer and its trajectory is connected;
- **quality**: the quality increment a router reports (``Assignment.dq``) is the one the
  quality model gives for the replicas it chose (0 for exact full-precision executions).
  The backend never uses the reported value (it derives every increment itself, so a
  misreport cannot escape the budget); a router whose own budget arithmetic is wrong
  fails here;
- **determinism**: two runs with fresh router instances give identical records;
- **causality**: changing one token's gated experts from a middle layer on leaves every
  decision taken before that token-layer unchanged (a router reads only what it could
  observe online).

Runs are short (5 requests of 4 tokens, 64 calibration tokens) and decisions cost no
simulated time here (``engine.decision_s: 0``), so a check does not depend on this
machine's speed. Each check raises ``ConformanceError`` (an ``AssertionError``) with a
message and a hint; ``check_router`` collects them into a ``Report``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pandas as pd

from hetroute.state import ExecType
from hetroute.system import FULL_PRECISION

from .records import RecordWriter, flat
from .setup import RunSetup, build_setup
from .sim.backend import SimBackend, SimStats
from .spec import ExperimentSpec, SpecError, parse_spec

TOPOLOGIES = ("small3", "paper10")
MODELS = ("switch-base-8", "qwen1.5-moe-a2.7b", "mixtral-8x7b")
#: Short prompt-only requests (gen_tokens 0, pinned): the contract is per token-layer, and
#: the suite runs it for every router on 2 topologies x 3 models.
WORKLOAD = {"duration_s": 0.3, "warmup_s": 0.05, "rate_per_s": 20, "prompt_tokens": 4,
            "gen_tokens": 0, "calibration_tokens": 64, "users": 20}
DECISION_COLUMNS = ["request", "token", "layer", "t_start", "server", "next_server", "participants",
                    "dq", "est_delay_s", "replica", "exec_server", "exec_expert"]
CHECKS = ("setup", "placement", "records", "quality", "determinism", "causality")

HINTS = {
    "setup": "the router could not be built or placed; the message names the line that raised",
    "placement": "place() must return a Deployment that passes Deployment.check (GPU and CPU "
                 "memory, one full-precision copy per expert), gives every expert a replica, and "
                 "is the same when called again on the same Problem (seed randomness from "
                 "problem.seed)",
    "records": "route() must return, per target, a replica that exists and runs the target "
               "itself, one of quality.substitutes[target], or its FP16 copy (fallback), on at "
               "most k servers, with next_server a valid server",
    "quality": "Assignment.dq must be the sum over targets of quality.increment(target, "
               "executed expert, precision) of the replicas route() returns (leave it 0 only "
               "if every execution is the target's own FP16 copy); the backend accounts the "
               "budget from the quality model, so a router that under-reports dq only fools "
               "its own budget checks",
    "determinism": "route() and any state it keeps must depend only on its inputs and "
                   "problem.seed: use np.random.default_rng(problem.seed), never an unseeded "
                   "generator, wall time, or iteration over a set of objects",
    "causality": "route() may read only the token, its targets and the StateView it is given; "
                 "it must not look at other tokens' future experts or arrivals",
}


class ConformanceError(AssertionError):
    """One broken rule of the router contract."""

    def __init__(self, check: str, message: str) -> None:
        super().__init__(f"{check}: {message}")
        self.check, self.message = check, message


def _require(ok: bool, check: str, message: str) -> None:
    if not ok:
        raise ConformanceError(check, message)


@dataclass
class Failure:
    check: str
    case: str
    message: str

    @property
    def hint(self) -> str:
        return HINTS[self.check]


@dataclass
class Report:
    router: str
    cases: list[str] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def format(self) -> str:
        lines = [f"{self.router}: {len(self.cases)} cases x {len(CHECKS) - 1} checks, "
                 f"{len(self.failures)} failed"]
        for f in self.failures:
            lines += [f"FAIL {f.check:11s} {f.case}: {f.message}", f"     how to fix: {f.hint}"]
        return "\n".join(lines)


def spec_for(router: str, topology: str, model: str, **workload) -> ExperimentSpec:
    return parse_spec({"topology": topology, "router": {"name": router},
                       "engine": {"decision_s": 0.0},
                       "workload": {**WORKLOAD, "model": model, **workload}})


def fresh(setup: RunSetup) -> RunSetup:
    """The same placement with a new router instance (no state from earlier runs)."""
    cls = type(setup.router)
    router = cls(setup.problem, setup.router.params)
    router.bind(setup.deployment)
    return dataclasses.replace(setup, router=router)


def run_sim(setup: RunSetup, request_targets: Callable | None = None
            ) -> tuple[pd.DataFrame, pd.DataFrame, SimStats]:
    """One short run on the simulator with a fresh router: records in memory, and the
    run's statistics (``dq_misreported`` among them)."""
    s = fresh(setup)
    if request_targets is not None:
        s.request_targets = request_targets  # shadows the method on this instance
    writer = RecordWriter(None, s.shape.top_k)
    stats = SimBackend(s, writer).run()
    writer.close()
    return (*writer.frames(), stats)


def simulate(setup: RunSetup, request_targets: Callable | None = None
             ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """One short run on the simulator with a fresh router; records in memory."""
    return run_sim(setup, request_targets)[:2]


def check_placement(s: RunSetup) -> None:
    dep = s.deployment
    try:
        dep.check(s.shape, s.problem.budget)
    except Exception as err:  # noqa: BLE001 - reported as the failed rule
        raise ConformanceError("placement", str(err)) from None
    missing = [e for e in range(s.shape.n_experts) if not dep.by_expert[e]]
    _require(not missing, "placement", f"experts without a replica: {missing[:5]}")
    no_fp16 = [e for e in range(s.shape.n_experts) if not dep.full_precision(e)]
    _require(not no_fp16, "placement", f"experts without a full-precision copy (c.4): {no_fp16[:5]}")
    again = type(s.router)(s.problem, s.router.params).place()
    _require(again.replicas == dep.replicas, "placement",
             "placing twice on the same problem gave different deployments")


def check_records(s: RunSetup, tl: pd.DataFrame, rq: pd.DataFrame) -> None:
    c = "records"
    dep, sh, q = s.deployment, s.shape, s.quality
    k, L = sh.top_k, sh.n_layers
    _require(len(rq) == len(s.requests) > 0 and bool((rq.status == "ok").all()), c,
             f"{int((rq.status != 'ok').sum())} of {len(s.requests)} requests did not finish")
    reps = flat(tl.replica).astype(int)
    _require(reps.shape == (len(tl), k), c, f"assignments carry {reps.shape[1]} replicas, not k={k}")
    _require(bool(((reps >= 0) & (reps < len(dep.replicas))).all()), c, "replica index out of range")
    rep_server = np.array([r.server for r in dep.replicas])
    rep_expert = np.array([r.expert for r in dep.replicas])
    rep_prec = np.array([int(r.precision) for r in dep.replicas])
    servers, experts = flat(tl.exec_server), flat(tl.exec_expert)
    targets, types = flat(tl.target), flat(tl.exec_type)
    _require(bool((rep_server[reps] == servers).all() and (rep_expert[reps] == experts).all()), c,
             "an execution's server or expert is not its replica's")
    _require(bool((rep_prec[reps] == flat(tl.precision)).all()), c, "precision is not the replica's")
    sub = types == ExecType.SUBSTITUTE
    fb = types == ExecType.FALLBACK
    exact = ~(sub | fb)
    bad = np.flatnonzero((experts != targets) & exact)
    _require(bad.size == 0, c, f"{bad.size} executions labelled exact run another expert "
             f"(e.g. target {targets[bad[0]] if bad.size else '-'} ran expert "
             f"{experts[bad[0]] if bad.size else '-'})")
    _require(bool((experts[fb] == targets[fb]).all() and (rep_prec[reps[fb]] == FULL_PRECISION).all()),
             c, "a fallback is not the target's own full-precision copy")
    for t, e in zip(targets[sub], experts[sub]):
        _require(e in {x for x, _ in q.substitutes[t]}, c, f"expert {e} is not a substitute of {t}")
    _require(bool(((targets // sh.experts_per_layer) == tl.layer.to_numpy()[:, None]).all()), c,
             "a target is not a gated expert of its layer")
    distinct = np.array([len(set(row)) for row in servers])
    _require(bool((tl.participants.to_numpy() == distinct).all() and (distinct <= k).all()), c,
             f"more than k={k} participating servers, or a miscounted participant set")
    _require(bool(tl.next_server.between(0, s.cluster.n - 1).all()), c, "next_server out of range")
    per_token = tl.sort_values(["request", "token", "layer"]).groupby(["request", "token"])
    for (req, tok), g in per_token:
        _require(list(g.layer) == list(range(L)), c, f"token {req}/{tok} skipped a layer")
        home = int(rq.loc[rq.request == req, "home"].iloc[0])
        _require(g.server.iloc[0] == home, c, f"token {req}/{tok} did not start at its home")
        _require(bool((g.server.to_numpy()[1:] == g.next_server.to_numpy()[:-1]).all()), c,
                 f"token {req}/{tok} started a layer away from where the last one aggregated")


def check_quality(s: RunSetup, tl: pd.DataFrame, stats: SimStats) -> None:
    """The router's reported increments are the quality model's (the records always are)."""
    n = stats.dq_misreported
    first = stats.dq_misreport_first
    example = "" if first is None else (f" (e.g. request {first[0]} token {first[1]} layer "
                                        f"{first[2]}: reported dq={first[3]:.3g}, the quality "
                                        f"model gives {first[4]:.3g})")
    _require(n == 0, "quality", f"{n} of {len(tl)} token-layers report a quality increment dq "
             f"that differs from the quality model's for the replicas they execute{example}")


def check_determinism(s: RunSetup, tl: pd.DataFrame, rq: pd.DataFrame) -> None:
    tl2, rq2 = simulate(s)
    for a, b, what in ((tl, tl2, "token-layer"), (rq, rq2, "request")):
        try:
            pd.testing.assert_frame_equal(a, b)
        except AssertionError as err:
            first = " ".join(str(err).split())[:160]
            raise ConformanceError("determinism", f"two runs differ in their {what} records "
                                   f"({first})") from None


def check_causal(s: RunSetup, tl: pd.DataFrame) -> None:
    """Perturb one token's gated experts from a middle layer on; every token-layer
    decided before the perturbed one must be decided identically."""
    L, E = s.shape.n_layers, s.shape.experts_per_layer
    decided = (tl.t_start + tl.dense_s).to_numpy()  # when the decision was taken
    mid = tl[tl.layer == L // 2]
    pivot = mid.iloc[len(mid) // 2]
    req, tok, layer = int(pivot.request), int(pivot.token), int(pivot.layer)
    t0 = decided[pivot.name]
    original = s.request_targets

    def perturbed(rid, n_tokens):
        out = original(rid, n_tokens)
        if rid == req:
            row = list(out[tok])
            for l in range(layer, L):
                row[l] = tuple(l * E + (e - l * E + 1) % E for e in row[l])
            out[tok] = tuple(row)
        return out

    tl2, _ = simulate(s, perturbed)
    decided2 = (tl2.t_start + tl2.dense_s).to_numpy()
    before = tl[decided < t0].sort_values(["request", "token", "layer"])[DECISION_COLUMNS]
    before2 = tl2[decided2 < t0].sort_values(["request", "token", "layer"])[DECISION_COLUMNS]
    _require(len(before) > 0, "causality", "no decision precedes the perturbed token-layer")
    try:
        pd.testing.assert_frame_equal(before.reset_index(drop=True), before2.reset_index(drop=True))
    except AssertionError:
        raise ConformanceError("causality", f"changing token {req}/{tok}'s experts from layer "
                               f"{layer} on changed decisions taken before it") from None
    changed = tl2[(tl2.request == req) & (tl2.token == tok) & (tl2.layer >= layer)]
    _require(not (flat(changed.target) == flat(
        tl[(tl.request == req) & (tl.token == tok) & (tl.layer >= layer)].target)).all(),
        "causality", "the perturbation did not reach the run (checker fault)")


def check_case(s: RunSetup) -> None:
    """Every check on one built setup; raises the first ``ConformanceError``."""
    check_placement(s)
    tl, rq, stats = run_sim(s)
    check_records(s, tl, rq)
    check_quality(s, tl, stats)
    check_determinism(s, tl, rq)
    check_causal(s, tl)


def check_router(name: str, topologies: tuple[str, ...] = TOPOLOGIES,
                 models: tuple[str, ...] = MODELS, log: Callable[[str], None] | None = None
                 ) -> Report:
    """Run every check on ``name`` for each topology x model; never raises for the router's
    faults: they are the report's failures."""
    report = Report(name)
    for topo in topologies:
        for model in models:
            case = f"{topo}/{model}"
            report.cases.append(case)
            if log:
                log(f"checking {name} on {case}")
            try:
                s = build_setup(spec_for(name, topo, model))
            except SpecError as err:
                report.failures.append(Failure("setup", case, str(err)))
                continue
            try:
                check_case(s)
            except ConformanceError as err:
                report.failures.append(Failure(err.check, case, err.message))
            except Exception as err:  # noqa: BLE001 - a router that raises mid-run
                report.failures.append(Failure("records", case, f"the run raised "
                                               f"{type(err).__name__}: {err}"))
    return report
