"""Expert-activation traces: which experts each token's gate picks at each layer.

A trace source answers ``route(request_id, n_tokens)`` with the top-k LOCAL
expert indices (and gate weights) of every token of a request at every MoE
layer. Consecutive tokens of a request form a sequence (prefill tokens first,
then decode tokens). Two sources exist: ``SyntheticTrace``, calibrated to
published routing statistics, and ``JsonlTrace``, which replays a recorded one.

Synthetic routing model (per model, seeded; no global state)
-------------------------------------------------------------
* Popularity skew: layer l draws experts from a Zipf profile p_l, rank^-s_l,
  over its own random permutation of experts, so the hot experts differ by
  layer; s_l = ``popularity_skew`` times a log-normal per-layer jitter.
* Tasks: requests belong to one of ``n_tasks`` tasks (e.g. prose, math, code).
  Task c keeps each layer's Zipf shares but re-draws the ranks of
  round(``task_specificity``_c * E) experts (shuffled among themselves), so its
  hot experts differ from the shared ones while its skew stays the same.
  ``route(request_id, n_tokens, task)`` routes by that task's popularity p_{c,l}.
* Inter-layer affinity: expert i at layer l prefers ``affinity_fanout``
  successors at l+1 (random, each successor preferred equally often; Dirichlet
  weights q_i). A token's
  layer-(l+1) draw uses T_l[i] = (1 - a_{l+1}) p_{c,l+1} + a_{l+1} q_i with i its
  first choice at l, as ExFlow models P(E_{l+1} | E_l). ``affinity`` is one
  float (same at every depth) or a depth profile a_l of anchors.
* Window bursts: each request has, per layer and window of ``burst_window``
  tokens, a hot expert drawn from p_{c,l}; fresh draws add ``burst_boost`` to
  its logit, so a window concentrates on a few experts more than independent
  draws would (short-window load bursts).
* Temporal repetition: at layer l, token t keeps token t-1's first choice with
  probability ``copy_first``(l), or (k >= 2) takes one of t-1's experts as its
  second choice with probability ``copy_one``(l), or avoids all of t-1's
  experts with probability ``avoid_prev``(l) (alternation: Mixtral's layer 31
  repeats first choices above chance yet overlaps less than chance otherwise);
  else it draws fresh. Draws are top-k without replacement (Gumbel top-k).
* Gate weights: Dirichlet(1, ..., 1) sorted descending (a choice: the statistics
  below do not depend on them). The expected top weight is 0.75 for k=2.

Calibration targets and sources
-------------------------------
Statistics are measured as in ``measure_stats``; "uniform" is the baseline of
independent uniform routing, used by the Mixtral paper.

[M] Jiang et al., "Mixtral of Experts", arXiv:2401.04088, Sec. 5, Table 5:
    share of consecutive-token pairs whose first-choice expert repeats, and
    whose top-2 sets overlap, at layers 0/15/31 for 8 Pile subsets. Means over
    the subsets (our targets): first 14.1/26.4/22.7% (range 13.6-28.4%), any
    48.0/63.7/50.9% (44.5-67.0%); uniform 12.5% and 46%. Fig. 10 shows the full
    depth profile is non-monotone (first-choice peak ~0.3 near layer 9, dip
    ~0.2 near layer 18); we interpolate linearly between the tabulated layers.
    Fig. 7: per-expert assignment shares lie within roughly 0.06-0.19 against
    1/8, i.e. a per-layer max/mean of 1.2-1.5; target 1.35 (read off a figure).
[L] Liang et al., "Not All Models Suit Expert Offloading: On Local Routing
    Consistency of Mixture-of-Expert Models", arXiv:2505.16056 (ICLR 2026):
    across 20 MoE LLMs, shared experts "significantly harm" local routing
    consistency, and top-k below 4 or MoE only every 2-6 layers go with lower
    consistency. Qualitative; used to rank the choices below.
[X] Yao et al., "Exploiting Inter-Layer Expert Affinity for Accelerating MoE
    Model Inference" (ExFlow), arXiv:2401.08383: pre-trained MoE LMs show a
    strong, dataset-stable P(E_{l+1} | E_l); affinity-aware placement cuts
    cross-GPU routing by up to 67%. No per-model conditional probability is
    tabulated there, so affinity targets are choices.
Demoted: Mario928/speculative-moe (GitHub, ~80 HumanEval tokens of Mixtral)
    was cited for a mean lookup accuracy of 0.37 between adjacent layers. It
    does not support that number: at ~80 tokens the shuffled-pair baseline of
    the same estimator is nearly as high (the max over 8 experts of a few
    counts is biased up), and its logged routing repeats every token twice. It
    is no longer a source for any target.

Task-dependent popularity: [M] Sec. 5 and Fig. 7 find expert assignment
largely independent of the domain (ArXiv, GitHub, PhilPapers, ...) except for
DM Mathematics, whose distribution is marginally different; per-domain
shares stay within about 0.06-0.19 (against 1/8). So tasks change WHICH
experts are hot, not how skewed a layer is, and the differences are modest.
The workload's default task specificity (``workloads.requests``) is
therefore higher for math (0.75) than for prose and code (0.25); the values
are choices, not measurements. [L] (domain-specialised experts contribute to
routing consistency) supports that tasks shape routing at all.

Per model (choices are marked as such):
* Mixtral-8x7B: repetition at layers 0/15/31 [M Table 5]; popularity 1.35
  [M Fig. 7]. Choices: layer 2 at first 0.24 / any 0.60, i.e. already near the
  mid-depth level (the rise is early in [M Fig. 10], which we read only
  qualitatively; a held-out check of real Mixtral routing reported in issue 13
  agrees); whole-pair reuse 0.08 at layers 2-15 and 0.06 at 31 (measured
  overall pair reuse 0.13, twice the 0.06 of the single-copy generator, since
  the held-out check found real routing reuses whole pairs about twice as
  often; no published figure gives the number); bursts: logit boost 1.0 per
  32-token window (no published figure; window burst 0.24 against 0.20 for
  shuffled tokens); affinity: weight 0.12 up to depth 0.29 (layers 0-9), 0.6
  from depth 0.42 (layer 13) on: weak early and strong after, the shape the
  held-out check reports and [X] motivates; measured lookup accuracy 0.20 in
  layers 1-10 and 0.40-0.42 after (shuffled baseline ~0.18), mean 0.34.
* Qwen1.5-MoE-A2.7B: no published per-token statistics found. Choices:
  first-choice repetition 0.06 and top-4 overlap 0.40 (uniform 0.017 and
  0.247): above random, but relatively weaker than Mixtral's because of the
  shared expert [L]; popularity max/mean 2.5 (fine-grained 60 experts leave
  more room for hot experts than 8); affinity 0.20 (uniform 0.017).
* Switch-Base-8: no published statistics found. Choices: top-1 repetition 0.22
  (uniform 0.125; below Mixtral's mid-depth 0.26 since top-1 routing and MoE
  every other block lower consistency [L]); popularity 1.8 (top-1 routing with
  a weak balancing loss, router_aux_loss_coef 0.001 in its config); affinity
  0.30, slightly below Mixtral since MoE layers are two blocks apart.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, NamedTuple, Protocol, Sequence, runtime_checkable

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from .models import ModelSpec, get_model

#: Request ids at or above this serve calibration (held-out) traffic, never evaluation.
CALIBRATION_ID_BASE = 1_000_000_000

_STRUCTURE_TAG = 0x5EED  # rng stream of the per-model structure (popularity, affinity)
_REQUEST_TAG = 0x7E0  # rng stream of per-request routing
_TASK_TAG = 0x7A5C  # rng stream of the per-task popularity
_BURST_TAG = 0xB0257  # rng stream of per-request hot experts (bursts)

Anchors = tuple[tuple[float, float], ...]


class Routing(NamedTuple):
    """Routing of one request: ``experts`` and ``weights``, both (n_tokens, L, k).

    Experts are LOCAL indices in [0, E), distinct within a token-layer and
    sorted by gate weight, descending; each weight row sums to 1.
    """

    experts: np.ndarray
    weights: np.ndarray


@runtime_checkable
class TraceSource(Protocol):
    """Anything that routes requests; must be a pure function of its arguments."""

    def route(self, request_id: int, n_tokens: int, task: int = 0) -> Routing: ...


# --------------------------------------------------------------------------
# Parameters and targets
# --------------------------------------------------------------------------
def _check_anchors(name: str, anchors: Anchors) -> None:
    if not anchors:
        raise ValueError(f"{name} needs at least one (depth, value) anchor")
    depths = [d for d, _ in anchors]
    if any(not 0.0 <= d <= 1.0 for d in depths) or depths != sorted(set(depths)):
        raise ValueError(f"{name}: depths must be strictly increasing in [0, 1]")
    if any(not 0.0 <= v <= 1.0 for _, v in anchors):
        raise ValueError(f"{name}: probabilities must be in [0, 1]")


def profile(anchors: Anchors, n_layers: int) -> np.ndarray:
    """Per-layer values from (relative depth, value) anchors, linearly interpolated."""
    depth = np.linspace(0.0, 1.0, n_layers) if n_layers > 1 else np.zeros(1)
    xs, ys = zip(*anchors)
    return np.interp(depth, xs, ys)


class TraceParams(BaseModel):
    """Knobs of ``SyntheticTrace``; see the module docstring for their meaning.

    Depth anchors are (l / (L - 1), probability) pairs so one profile fits any
    depth. Calibrated defaults per model: ``default_trace_params``. ``affinity``
    takes one float (the same weight at every depth, as before) or anchors.
    The new knobs default to "off" (``copy_pair`` 0, ``burst_boost`` 0, one
    task), so parameter sets written before them route exactly as they did.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    popularity_skew: float = Field(0.5, ge=0, le=5, description="Zipf exponent s")
    skew_jitter: float = Field(0.1, ge=0, le=2, description="per-layer log-normal sd of s")
    affinity: float | Anchors = Field(0.5, description="weight of preferred successors: a float "
                                      "or (depth, weight) anchors")
    affinity_fanout: int = Field(2, ge=1, description="preferred successors per expert")
    copy_first: Anchors = ((0.0, 0.1),)
    copy_one: Anchors = ((0.0, 0.0),)
    avoid_prev: Anchors = ((0.0, 0.0),)
    copy_pair: Anchors = ((0.0, 0.0),)
    burst_boost: float = Field(0.0, ge=0, le=10, description="logit boost of a window's hot expert")
    burst_window: int = Field(32, ge=1, le=1_000_000, description="tokens per hot-expert window")
    n_tasks: int = Field(1, ge=1, le=64, description="tasks with their own popularity")
    task_specificity: float | tuple[float, ...] = Field(
        0.5, description="per task (or one for all): share of experts whose popularity rank "
        "the task re-draws, in [0, 1]")

    @model_validator(mode="after")
    def _valid_profiles(self) -> "TraceParams":
        names = ("copy_first", "copy_one", "avoid_prev", "copy_pair")
        profiles = tuple(getattr(self, n) for n in names)
        for name, anchors in zip(names, profiles):
            _check_anchors(name, anchors)
        if isinstance(self.affinity, tuple):
            _check_anchors("affinity", self.affinity)
        elif not 0.0 <= self.affinity <= 1.0:
            raise ValueError("affinity must be in [0, 1]")
        depths = sorted({d for anchors in profiles for d, _ in anchors})
        total = sum(np.interp(depths, *zip(*anchors)) for anchors in profiles)
        if np.any(total > 1.0 + 1e-9):
            raise ValueError("copy_first + copy_one + avoid_prev + copy_pair must not exceed 1 "
                             "at any depth")
        spec = self.task_specificity
        values = spec if isinstance(spec, tuple) else (spec,)
        if any(not 0.0 <= v <= 1.0 for v in values):
            raise ValueError("task_specificity must be in [0, 1]")
        if isinstance(spec, tuple) and len(spec) != self.n_tasks:
            raise ValueError(f"task_specificity lists {len(spec)} values for n_tasks={self.n_tasks}")
        return self

    @property
    def affinity_anchors(self) -> Anchors:
        a = self.affinity
        return a if isinstance(a, tuple) else ((0.0, float(a)),)

    def task_specificities(self) -> tuple[float, ...]:
        spec = self.task_specificity
        return tuple(spec) if isinstance(spec, tuple) else (float(spec),) * self.n_tasks

    def with_overrides(self, overrides: Mapping[str, object] | None) -> "TraceParams":
        """A validated copy with some fields replaced (e.g. from an experiment spec)."""
        data = {**self.model_dump(), **dict(overrides or {})}
        if "n_tasks" in (overrides or {}) and "task_specificity" not in (overrides or {}) \
                and isinstance(self.task_specificity, tuple):
            data["task_specificity"] = float(np.mean(self.task_specificity))
        return TraceParams.model_validate(data)


@dataclass(frozen=True)
class TraceTargets:
    """Published (or chosen) routing statistics a synthetic trace must reproduce."""

    repeat_first: tuple[tuple[int, float], ...]  # (layer, rate)
    repeat_any: tuple[tuple[int, float], ...]
    popularity_max_over_mean: float
    affinity_top1: float
    source: str
    #: further (metric, where, target) rows of the report, matched by label (see
    #: ``compare_to_targets``), each a choice or read off a cited figure
    extra: tuple[tuple[str, str, float], ...] = ()


TARGETS: Mapping[str, TraceTargets] = types.MappingProxyType({
    "mixtral-8x7b": TraceTargets(
        repeat_first=((0, 0.141), (2, 0.24), (15, 0.264), (31, 0.227)),
        repeat_any=((0, 0.480), (2, 0.60), (15, 0.637), (31, 0.509)),
        popularity_max_over_mean=1.35, affinity_top1=0.34,
        source="[M] Table 5, Figs. 7 and 10; layer 2, pair reuse, bursts, affinity "
               "profile: choices (module docstring)",
        extra=(("pair reuse", "all layers", 0.13), ("affinity top-1", "layers 1-10 (l-1,l)", 0.20),
               ("affinity top-1", "layers 11-21 (l-1,l)", 0.40))),
    "qwen1.5-moe-a2.7b": TraceTargets(
        repeat_first=((0, 0.06), (23, 0.06)), repeat_any=((0, 0.40), (23, 0.40)),
        popularity_max_over_mean=2.5, affinity_top1=0.20,
        source="choices ([L]: shared expert lowers consistency)"),
    "switch-base-8": TraceTargets(
        repeat_first=((0, 0.22), (11, 0.22)), repeat_any=((0, 0.22), (11, 0.22)),
        popularity_max_over_mean=1.8, affinity_top1=0.30,
        source="choices ([L]: top-1, MoE every other block)"),
})

# Output of ``fit_params`` (structure seeds 0-3, 64 requests x 64 tokens each, 8
# rounds for Mixtral); the repetition anchors sit at the target layers. For Mixtral
# the fit started from the chosen copy_pair, burst_boost and affinity profile
# (kept fixed by the fit) and refitted popularity and copy_first/copy_one/avoid_prev.
_DEFAULT_PARAMS: Mapping[str, dict] = types.MappingProxyType({
    "mixtral-8x7b": dict(
        popularity_skew=0.308, affinity_fanout=2,
        affinity=((0.0, 0.12), (0.29, 0.12), (0.42, 0.6), (1.0, 0.6)),
        copy_first=((0.0, 0.002), (0.0645, 0.07), (0.4839, 0.082), (1.0, 0.082)),
        copy_one=((0.0, 0.0), (0.0645, 0.0), (0.4839, 0.033), (1.0, 0.0)),
        avoid_prev=((0.0, 0.124), (0.0645, 0.015), (0.4839, 0.0), (1.0, 0.161)),
        copy_pair=((0.0, 0.0), (0.0645, 0.08), (0.4839, 0.08), (1.0, 0.06)),
        burst_boost=1.0, burst_window=32),
    "qwen1.5-moe-a2.7b": dict(
        popularity_skew=0.402, affinity=0.353, affinity_fanout=4,
        copy_first=((0.0, 0.043), (1.0, 0.042)),
        copy_one=((0.0, 0.116), (1.0, 0.135))),
    "switch-base-8": dict(
        popularity_skew=0.652, affinity=0.291, affinity_fanout=2,
        copy_first=((0.0, 0.083), (1.0, 0.076))),
})


def default_trace_params(model_name: str) -> TraceParams:
    """Calibrated parameters for a catalogue model (name or alias)."""
    return TraceParams(**_DEFAULT_PARAMS[get_model(model_name).name])


# --------------------------------------------------------------------------
# Synthetic traces
# --------------------------------------------------------------------------
def _readonly(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


def _gumbel(u: np.ndarray) -> np.ndarray:
    return -np.log(-np.log(np.clip(u, 1e-300, 1.0 - 1e-16)))


def _validate_request(request_id: int, n_tokens: int) -> None:
    if int(request_id) != request_id or request_id < 0:
        raise ValueError(f"request_id must be a non-negative integer, got {request_id!r}")
    if int(n_tokens) != n_tokens or n_tokens < 0:
        raise ValueError(f"n_tokens must be a non-negative integer, got {n_tokens!r}")


def _gate_weights(u: np.ndarray) -> np.ndarray:
    """Dirichlet(1,..,1) from uniforms (normalized exponentials), sorted descending."""
    e = -np.log(np.clip(u, 1e-300, 1.0))
    w = e / e.sum(axis=-1, keepdims=True)
    return -np.sort(-w, axis=-1)


class SyntheticTrace:
    """Seeded synthetic routing for ``model``; ``route`` depends only on (seed, id, n, task).

    The per-model structure (popularity per task, preferred successors) is drawn
    from ``seed`` alone; each request from its own streams [seed, tag,
    request_id], so requests can be generated in any order, and a request's
    first m tokens do not depend on how many tokens were asked for.
    """

    def __init__(self, model: ModelSpec, params: TraceParams | None = None, seed: int = 0) -> None:
        self.model = model
        self.params = params if params is not None else default_trace_params(model.name)
        self.seed = int(seed)
        if self.params.affinity_fanout > model.experts_per_layer:
            raise ValueError("affinity_fanout exceeds the experts per layer")
        if any(v > 0 for _, v in self.params.avoid_prev) and model.experts_per_layer < 2 * model.top_k:
            raise ValueError("avoid_prev needs at least 2 * top_k experts per layer")
        L = model.n_layers
        self.n_tasks = self.params.n_tasks
        self._affinity = _readonly(profile(self.params.affinity_anchors, L))
        pop, task_pop, trans = self._structure()
        self.popularity = _readonly(pop)  # (L, E), the shared base distribution p_l
        self.task_popularity = _readonly(task_pop)  # (C, L, E), p_{c,l} of each task
        self.transitions = _readonly(trans[0])  # (L-1, E, E), T_l[i] of task 0
        self.task_transitions = _readonly(trans)  # (C, L-1, E, E)
        self._log_pop0 = _readonly(np.log(task_pop[:, 0]))  # (C, E)
        self._log_pop = _readonly(np.log(task_pop))
        self._log_trans = _readonly(np.log(trans))
        self._copy_first = _readonly(profile(self.params.copy_first, L))
        copy_one = profile(self.params.copy_one, L) if model.top_k > 1 else np.zeros(L)
        self._copy_one = _readonly(copy_one)
        self._avoid = _readonly(profile(self.params.avoid_prev, L))
        self._copy_pair = _readonly(profile(self.params.copy_pair, L))

    def _structure(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        p, m = self.params, self.model
        L, E, C = m.n_layers, m.experts_per_layer, self.n_tasks
        rng = np.random.default_rng([self.seed, _STRUCTURE_TAG])
        s = p.popularity_skew * np.exp(p.skew_jitter * rng.standard_normal(L) - p.skew_jitter**2 / 2)
        pop = np.empty((L, E))
        ranks = np.arange(1, E + 1, dtype=float)
        rank_of = np.empty((L, E), dtype=np.int64)  # rank (0 = hottest) of each expert
        zipf = np.empty((L, E))
        for layer in range(L):
            w = ranks ** -s[layer]
            zipf[layer] = w / w.sum()
            perm = rng.permutation(E)
            pop[layer, perm] = zipf[layer]
            rank_of[layer, perm] = np.arange(E)
        q = np.zeros((max(L - 1, 0), E, E))
        for layer in range(L - 1):
            # Balanced: every successor is preferred by exactly `fanout` experts,
            # so affinity shapes paths without making hot experts of its own.
            perm = rng.permutation(E)
            pref = perm[(np.arange(E)[:, None] + np.arange(p.affinity_fanout)) % E]
            np.put_along_axis(q[layer], pref, rng.dirichlet(np.ones(p.affinity_fanout), size=E), axis=1)
        # Tasks (own stream, so the shared structure above is the same for any task count):
        # task c re-draws the ranks of round(spec_c * E) experts per layer, shuffling
        # them among themselves; the other experts keep their shared rank. Each task
        # keeps the layer's Zipf shares (its skew), only which expert is hot moves.
        task_pop = np.repeat(pop[None], C, axis=0)
        if C > 1:
            trng = np.random.default_rng([self.seed, _TASK_TAG])
            for c, spec in enumerate(p.task_specificities()):
                n_move = int(round(spec * E))
                for layer in range(L):
                    moved = trng.choice(E, size=n_move, replace=False)
                    ranks_c = rank_of[layer].copy()
                    ranks_c[moved] = ranks_c[moved][trng.permutation(n_move)]
                    task_pop[c, layer] = zipf[layer][ranks_c]
        a = self._affinity[1:, None, None]  # the pair (l, l+1) uses the weight of layer l+1
        trans = (1.0 - a) * task_pop[:, 1:, None, :] + a * q[None]
        return pop, task_pop, np.maximum(trans, 1e-12)

    def route(self, request_id: int, n_tokens: int, task: int = 0) -> Routing:
        _validate_request(request_id, n_tokens)
        if int(task) != task or not 0 <= task < self.n_tasks:
            raise ValueError(f"task must be an integer in [0, {self.n_tasks}), got {task!r}")
        m, p = self.model, self.params
        n, L, E, k = int(n_tokens), m.n_layers, m.experts_per_layer, m.top_k
        rng = np.random.default_rng([self.seed, _REQUEST_TAG, int(request_id)])
        u = rng.random((n, L, E + 2 + k))  # one C-order draw keeps prefixes stable
        hot = None
        if p.burst_boost > 0 and n:
            # One hot expert per (window of burst_window tokens, layer), drawn from the
            # task's popularity (own stream; C-order, so prefixes stay stable too).
            brng = np.random.default_rng([self.seed, _BURST_TAG, int(request_id)])
            n_win = -(-n // p.burst_window)
            g = _gumbel(brng.random((n_win, L, E)))
            hot = np.argmax(self._log_pop[int(task)][None] + g, axis=-1)  # (n_win, L)
        sel = np.zeros((n, L, k), dtype=np.int64)
        # Cell (t, l) needs (t, l-1) for affinity and (t-1, l) for repetition:
        # sweep anti-diagonals t + l = d, each vectorized over its cells.
        for d in range(n + L - 1):
            t = np.arange(max(0, d - L + 1), min(n - 1, d) + 1)
            self._fill_diagonal(sel, u, t, d - t, int(task), hot)
        return Routing(sel, _gate_weights(u[..., E + 2:]))

    def tokens(self, request_id: int, n_tokens: int, task: int = 0) -> np.ndarray:
        """Only the expert indices of ``route``."""
        return self.route(request_id, n_tokens, task).experts

    def _fill_diagonal(self, sel: np.ndarray, u: np.ndarray, t: np.ndarray, l: np.ndarray,
                       task: int = 0, hot: np.ndarray | None = None) -> None:
        E, k = self.model.experts_per_layer, self.model.top_k
        base = np.empty((t.size, E))
        top = l == 0
        base[top] = self._log_pop0[task]
        deep = ~top
        base[deep] = self._log_trans[task, l[deep] - 1, sel[t[deep], l[deep] - 1, 0]]
        scores = base + _gumbel(u[t, l, :E])
        if hot is not None:
            scores[np.arange(t.size), hot[t // self.params.burst_window, l]] += self.params.burst_boost
        a, b, v, um = self._copy_first[l], self._copy_one[l], self._avoid[l], u[t, l, E]
        w = self._copy_pair[l]
        later = t > 0
        keep = later & (um < a)
        part = later & (um >= a) & (um < a + b)
        avoid = later & (um >= a + b) & (um < a + b + v)
        pair = later & (um >= a + b + v) & (um < a + b + v + w)
        prev = sel[np.maximum(t - 1, 0), l]
        pick = np.minimum((u[t, l, E + 1] * k).astype(np.int64), k - 1)
        x = np.where(keep, prev[:, 0], prev[np.arange(t.size), pick])
        copied = keep | part
        scores[np.nonzero(copied)[0], x[copied]] = -np.inf
        rows = np.nonzero(avoid)[0]
        scores[rows[:, None], prev[rows]] = -np.inf
        order = np.argsort(-scores, axis=1)[:, :k]
        out = order.copy()
        out[keep, 0] = x[keep]
        out[keep, 1:] = order[keep, : k - 1]
        if k > 1:
            out[part, 1] = x[part]
            out[part, 2:] = order[part, 1 : k - 1]
        if pair.any():
            # the whole previous set, rotated by `pick`: order kept with probability 1/k
            rot = (np.arange(k)[None, :] + pick[pair, None]) % k
            out[pair] = np.take_along_axis(prev[pair], rot, axis=1)
        sel[t, l] = out


# --------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------
def _gini(shares: np.ndarray) -> np.ndarray:
    s = np.sort(shares, axis=-1)
    n = s.shape[-1]
    idx = np.arange(1, n + 1)
    return (2 * (s * idx).sum(-1) / (n * s.sum(-1)) - (n + 1) / n)


def _lookup_accuracy(a: np.ndarray, b: np.ndarray, E: int) -> float:
    """Frequency-weighted mean over experts i of max_j P(b = j | a = i)."""
    if a.size == 0:
        return float("nan")
    joint = np.bincount(a * E + b, minlength=E * E).reshape(E, E)
    return float(joint.max(axis=1).sum() / a.size)


def depth_bands(n_layers: int) -> list[tuple[int, int]]:
    """Layer bands (first, last) for reports: layer 0, layers 1-10, then the rest in two halves."""
    if n_layers <= 2:
        return [(l, l) for l in range(n_layers)]
    bands = [(0, 0), (1, min(10, n_layers - 1))]
    rest = n_layers - 1 - bands[-1][1]
    if rest > 0:
        mid = bands[-1][1] + (rest + 1) // 2
        bands.append((bands[-1][1] + 1, mid))
        if mid < n_layers - 1:
            bands.append((mid + 1, n_layers - 1))
    return bands


def _window_burst(wins: np.ndarray, E: int) -> np.ndarray:
    """Per layer: mean over windows (n_w, W, L, k) of the hottest expert's share."""
    if wins.size == 0:
        return np.full(wins.shape[2] if wins.ndim == 4 else 0, np.nan)
    n_w, W, L, k = wins.shape
    flat = wins.transpose(0, 2, 1, 3).reshape(n_w, L, W * k)
    counts = np.zeros((n_w, L, E))
    np.add.at(counts, (np.arange(n_w)[:, None, None], np.arange(L)[None, :, None], flat), 1.0)
    return (counts.max(axis=2) / (W * k)).mean(axis=0)


def _group_difference(shares_of: callable, labels: np.ndarray, E: int) -> float:
    """Token-weighted mean over groups and layers of TV(p_group, p_all)."""
    groups, counts = np.unique(labels, return_counts=True)
    if len(groups) < 2:
        return float("nan")
    overall = shares_of(np.ones(len(labels), bool))
    tv = [0.5 * np.abs(shares_of(labels == g) - overall).sum(axis=1).mean() for g in groups]
    return float(np.average(tv, weights=counts))


def measure_stats(model: ModelSpec, token_arrays: Sequence[np.ndarray], seed: int = 0,
                  groups: Mapping[str, Sequence[int]] | None = None, window: int = 32) -> dict:
    """Popularity, repetition and affinity of traces (each array (n_i, L, k), local ids).

    * popularity: per layer, each expert's share of all top-k assignments;
      ``max_over_mean`` (1 = balanced), coefficient of variation and Gini.
    * repetition: over consecutive token pairs inside each array, the share
      whose first choice repeats (``first``) and whose top-k sets overlap
      (``any``), per layer, as in Mixtral's Table 5.
    * affinity: per layer pair (l, l+1), the frequency-weighted mean over
      first-choice experts i at l of max_j P(first choice j at l+1 | i), i.e.
      the accuracy of the best lookup table predicting l+1 from l (ExFlow).

    * pair reuse (``repetition.pair``): share of consecutive pairs whose whole
      top-k SET repeats (order ignored), per layer.
    * window bursts: per layer, the mean over non-overlapping windows of
      ``window`` consecutive tokens of one array (a request) of the hottest
      expert's share of the window's k * window assignments; ``independent``:
      the same on windows of tokens shuffled across all arrays.
    * groups (optional, e.g. {"task": one label per array, "home": ...}): the
      token-weighted mean over groups and layers of the total-variation distance
      between a group's expert popularity and the overall one; ``independent``:
      the same with the labels shuffled across arrays (sampling noise alone).

    Baselines: ``uniform`` (independent uniform routing) and ``independent``
    (the same estimator on pairs shuffled across tokens with a fixed seed: the
    marginals are kept and the small-sample bias of the max is included).
    """
    L, E, k = model.n_layers, model.experts_per_layer, model.top_k
    seqs = [np.asarray(a, dtype=np.int64) for a in token_arrays if len(a)]
    if not seqs:
        raise ValueError("measure_stats needs at least one non-empty token array")
    for a in seqs:
        if a.ndim != 3 or a.shape[1:] != (L, k):
            raise ValueError(f"token arrays must be (n, {L}, {k}), got {a.shape}")
    rng = np.random.default_rng(seed)
    tokens = np.concatenate(seqs)
    counts = np.stack([np.bincount(tokens[:, l].ravel(), minlength=E) for l in range(L)])
    shares = counts / counts.sum(axis=1, keepdims=True)
    prev = np.concatenate([a[:-1] for a in seqs])
    nxt = np.concatenate([a[1:] for a in seqs])
    shuffled = nxt[rng.permutation(len(nxt))]

    def rates(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if len(x) == 0:
            return np.full(L, np.nan), np.full(L, np.nan)
        first = (x[:, :, 0] == y[:, :, 0]).mean(axis=0)
        overlap = (x[:, :, :, None] == y[:, :, None, :]).any(axis=(2, 3)).mean(axis=0)
        return first, overlap

    first, overlap = rates(prev, nxt)
    first_ind, overlap_ind = rates(prev, shuffled)

    def pair_rate(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        if len(x) == 0:
            return np.full(L, np.nan)
        return (np.sort(x, axis=-1) == np.sort(y, axis=-1)).all(axis=-1).mean(axis=0)

    pair, pair_ind = pair_rate(prev, nxt), pair_rate(prev, shuffled)
    wins = [a[: len(a) // window * window].reshape(-1, window, L, k) for a in seqs if len(a) >= window]
    wins_arr = np.concatenate(wins) if wins else np.zeros((0, window, L, k), dtype=np.int64)
    in_windows = wins_arr.reshape(-1, L, k)
    burst = _window_burst(wins_arr, E)
    burst_ind = _window_burst(in_windows[rng.permutation(len(in_windows))].reshape(wins_arr.shape), E)
    group_stats = {}
    lengths = np.array([len(a) for a in seqs])
    for key, labels in (groups or {}).items():
        per_array = np.asarray([lab for lab, a in zip(labels, token_arrays) if len(a)])
        if len(per_array) != len(seqs):
            raise ValueError(f"groups[{key!r}] needs one label per token array")
        tok_labels = np.repeat(per_array, lengths)

        def shares_of(mask: np.ndarray) -> np.ndarray:
            c = np.stack([np.bincount(tokens[mask, l].ravel(), minlength=E) for l in range(L)])
            return c / max(c.sum(axis=1).max(), 1)

        group_stats[key] = {
            "tv": _group_difference(shares_of, tok_labels, E),
            "tv_independent": _group_difference(
                shares_of, np.repeat(per_array[rng.permutation(len(per_array))], lengths), E),
            "n_groups": int(len(np.unique(per_array))),
        }
    firsts = tokens[:, :, 0]
    perm = rng.permutation(len(tokens))
    aff = np.array([_lookup_accuracy(firsts[:, l], firsts[:, l + 1], E) for l in range(L - 1)])
    aff_ind = np.array([_lookup_accuracy(firsts[:, l], firsts[perm, l + 1], E)
                        for l in range(L - 1)])
    nan_mean = (lambda v: float(np.mean(v)) if len(v) else float("nan"))
    return {
        "n_tokens": int(len(tokens)),
        "n_pairs": int(len(prev)),
        "popularity": {
            "share": shares,
            "max_over_mean": shares.max(axis=1) * E,
            "cv": shares.std(axis=1) * E,
            "gini": _gini(shares),
            "hottest": shares.argmax(axis=1),
            "mean_max_over_mean": float((shares.max(axis=1) * E).mean()),
        },
        "repetition": {
            "first": first, "any": overlap,
            "first_independent": first_ind, "any_independent": overlap_ind,
            "first_uniform": 1.0 / E,
            "any_uniform": 1.0 - math.comb(E - k, k) / math.comb(E, k),
            "pair": pair, "pair_independent": pair_ind, "pair_uniform": 1.0 / math.comb(E, k),
        },
        "burst": {
            "window": int(window), "n_windows": int(len(wins_arr)),
            "per_layer": burst, "per_layer_independent": burst_ind,
            "mean": nan_mean(burst[np.isfinite(burst)]) if len(wins_arr) else float("nan"),
            "mean_independent": (nan_mean(burst_ind[np.isfinite(burst_ind)])
                                 if len(wins_arr) else float("nan")),
            "uniform": 1.0 / E,
        },
        "groups": group_stats,
        "affinity": {
            "top1": aff, "top1_independent": aff_ind, "uniform": 1.0 / E,
            "mean_top1": nan_mean(aff), "mean_top1_independent": nan_mean(aff_ind),
        },
    }


def compare_to_targets(stats: dict, targets: TraceTargets) -> list[tuple[str, str, float, float, float, float]]:
    """Rows (metric, where, measured, target, uniform, independent) for a report.

    The first rows are the published targets (layers of Table 5, popularity,
    mean affinity); then, per depth band (``depth_bands``), repetition,
    whole-pair reuse and affinity; window bursts; and per-group popularity
    differences where groups were measured. A row's target is nan (printed
    "-") unless ``targets.extra`` names it.
    """
    rep, pop, aff = stats["repetition"], stats["popularity"], stats["affinity"]
    rows = []
    for metric, anchors in (("repeat_first", targets.repeat_first), ("repeat_any", targets.repeat_any)):
        key = "first" if metric == "repeat_first" else "any"
        for layer, target in anchors:
            rows.append((metric, f"layer {layer}", float(rep[key][layer]), target,
                         rep[f"{key}_uniform"], float(rep[f"{key}_independent"][layer])))
    rows.append(("popularity max/mean", "mean over layers", pop["mean_max_over_mean"],
                 targets.popularity_max_over_mean, 1.0, float("nan")))
    rows.append(("affinity top-1", "mean over layers", aff["mean_top1"], targets.affinity_top1,
                 aff["uniform"], aff["mean_top1_independent"]))
    L = len(rep["first"])
    band_rows = []
    for lo, hi in depth_bands(L):
        where = f"layer {lo}" if lo == hi else f"layers {lo}-{hi}"
        sl = slice(lo, hi + 1)
        for metric, key in (("repeat_first", "first"), ("repeat_any", "any"), ("pair reuse", "pair")):
            band_rows.append((metric, where, float(np.mean(rep[key][sl])), rep[f"{key}_uniform"],
                              float(np.mean(rep[f"{key}_independent"][sl]))))
        pairs = slice(max(lo - 1, 0), hi)  # layer pairs (l, l+1) whose upper layer is in the band
        if len(aff["top1"][pairs]):
            band_rows.append(("affinity top-1", f"{where} (l-1,l)" if lo else "layers 0-1",
                              float(np.mean(aff["top1"][pairs])), aff["uniform"],
                              float(np.mean(aff["top1_independent"][pairs]))))
    band_rows.append(("pair reuse", "all layers", float(np.mean(rep["pair"])), rep["pair_uniform"],
                      float(np.mean(rep["pair_independent"]))))
    b = stats.get("burst")
    if b is not None:
        band_rows.append((f"window burst W={b['window']}", "mean over layers", b["mean"], b["uniform"],
                          b["mean_independent"]))
    for key, g in stats.get("groups", {}).items():
        band_rows.append((f"{key} popularity TV", f"{g['n_groups']} groups", g["tv"], 0.0,
                          g["tv_independent"]))
    extra = {(metric, where): t for metric, where, t in targets.extra}
    for metric, where, measured, uniform, independent in band_rows:
        rows.append((metric, where, measured, extra.get((metric, where), float("nan")), uniform,
                     independent))
    return rows


def sample_tokens(source: TraceSource, request_ids: Iterable[int], n_tokens: int,
                  tasks: Sequence[int] | None = None) -> list[np.ndarray]:
    """Expert ids of each request; ``tasks`` (one per request) routes each by its task."""
    ids = [int(r) for r in request_ids]
    if tasks is None:
        return [source.route(r, n_tokens).experts for r in ids]
    return [source.route(r, n_tokens, int(c)).experts for r, c in zip(ids, tasks)]


# --------------------------------------------------------------------------
# Calibration of the knobs to targets (how the defaults above were produced)
# --------------------------------------------------------------------------
def _fit_sample(model: ModelSpec, p: TraceParams, seeds: Sequence[int], n_requests: int,
                n_tokens: int) -> dict[str, np.ndarray]:
    """The statistics ``fit_params`` steers, averaged over structure seeds."""
    runs = [measure_stats(model, sample_tokens(SyntheticTrace(model, p, s), range(n_requests), n_tokens))
            for s in seeds]
    pick = {"first": ("repetition", "first"), "any": ("repetition", "any"),
            "first_ind": ("repetition", "first_independent"), "any_ind": ("repetition", "any_independent"),
            "popularity": ("popularity", "mean_max_over_mean"), "affinity": ("affinity", "mean_top1")}
    return {key: np.mean([r[a][b] for r in runs], axis=0) for key, (a, b) in pick.items()}


def _refit_repetition(model: ModelSpec, p: TraceParams, targets: TraceTargets,
                      st: dict[str, np.ndarray]) -> dict[str, Anchors]:
    """New copy/avoid anchors at the target layers from the repetition gaps."""
    L = model.n_layers
    a_now, b_now, v_now, w_now = (profile(x, L) for x in (p.copy_first, p.copy_one, p.avoid_prev,
                                                           p.copy_pair))
    out: dict[str, list[tuple[float, float]]] = {"copy_first": [], "copy_one": [], "avoid_prev": []}
    for (layer, t1), (_, ta) in zip(targets.repeat_first, targets.repeat_any):
        c1, ca = st["first_ind"][layer], st["any_ind"][layer]
        w = w_now[layer]  # whole-pair copies are a choice the fit leaves alone
        a = float(np.clip(a_now[layer] + (t1 - st["first"][layer]) / (1 - c1), 0, 1 - w))
        # copy_one raises overlap by ~(1 - ca) per unit, avoid_prev lowers it by ~ca.
        net = (b_now[layer] - v_now[layer] * ca / (1 - ca)
               + (ta - st["any"][layer]) / (1 - ca) - (a - a_now[layer]))
        b, v = (max(net, 0.0), max(-net, 0.0) * (1 - ca) / ca) if model.top_k > 1 else (0.0, 0.0)
        b = min(b, 1 - a - w)
        v = max(min(v, 1 - a - b - w), 0.0)
        depth = round(layer / (L - 1), 4) if L > 1 else 0.0
        for key, value in (("copy_first", a), ("copy_one", b), ("avoid_prev", v)):
            out[key].append((depth, round(float(value), 3)))
    return {key: tuple(v) for key, v in out.items()}


def fit_params(model: ModelSpec, targets: TraceTargets, params: TraceParams | None = None,
               seeds: Sequence[int] = (0, 1, 2, 3), n_requests: int = 64, n_tokens: int = 64,
               iterations: int = 12) -> TraceParams:
    """Fixed-point fit of the knobs so ``measure_stats`` meets ``targets``.

    Each round measures samples (one per structure seed, averaged) and moves
    every knob by its own error: the Zipf exponent by the popularity ratio, the
    affinity weight by the affinity gap, and the copy/avoid probabilities at the
    target layers by the repetition gaps over the room left above (or below)
    the independent baseline. This is how the defaults were produced.
    """
    p = params or TraceParams()
    for _ in range(iterations):
        st = _fit_sample(model, p, seeds, n_requests, n_tokens)
        ratio = float(st["popularity"])
        skew = p.popularity_skew * ((targets.popularity_max_over_mean - 1) / max(ratio - 1, 1e-3)) ** 0.8
        over = {"popularity_skew": round(float(np.clip(skew, 0, 5)), 3),
                **_refit_repetition(model, p, targets, st)}
        if not isinstance(p.affinity, tuple):  # a depth profile is a choice, kept as given
            aff = p.affinity + 1.2 * (targets.affinity_top1 - float(st["affinity"]))
            over["affinity"] = round(float(np.clip(aff, 0, 1)), 3)
        p = p.with_overrides(over)
    return p


# --------------------------------------------------------------------------
# Recorded traces (JSON lines)
# --------------------------------------------------------------------------
class TraceFormatError(ValueError):
    """A trace file that does not load; the message is one line naming file and line."""


_KEYS = ("request", "token", "layer", "experts", "weights")


def _parse_line(text: str, where: str, model: ModelSpec) -> tuple[int, int, int, list[int], list[float]]:
    try:
        rec = json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceFormatError(f"{where}: invalid JSON ({e.msg})") from None
    if not isinstance(rec, dict):
        raise TraceFormatError(f"{where}: expected a JSON object")
    missing = [key for key in _KEYS if key not in rec]
    if missing:
        raise TraceFormatError(f"{where}: missing field(s) {', '.join(missing)}")
    req, tok, layer, experts, weights = (rec[key] for key in _KEYS)
    for key, v in (("request", req), ("token", tok), ("layer", layer)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise TraceFormatError(f"{where}: {key} must be a non-negative integer")
    if not 0 <= layer < model.n_layers:
        raise TraceFormatError(f"{where}: layer {layer} outside [0, {model.n_layers})")
    if not isinstance(experts, list) or len(experts) != model.top_k:
        raise TraceFormatError(f"{where}: experts must list top_k={model.top_k} experts")
    E = model.experts_per_layer
    if any(not isinstance(e, int) or isinstance(e, bool) or not 0 <= e < E for e in experts):
        raise TraceFormatError(f"{where}: expert ids must be integers in [0, {E})")
    if len(set(experts)) != len(experts):
        raise TraceFormatError(f"{where}: experts must be distinct")
    if (not isinstance(weights, list) or len(weights) != len(experts)
            or any(not isinstance(w, (int, float)) or isinstance(w, bool) for w in weights)):
        raise TraceFormatError(f"{where}: weights must be {len(experts)} numbers")
    if any(not (w >= 0 and math.isfinite(w)) for w in weights) or sum(weights) <= 0:
        raise TraceFormatError(f"{where}: weights must be finite, >= 0 and not all 0")
    return req, tok, layer, experts, [float(w) for w in weights]


class JsonlTrace:
    """A recorded trace: one JSON object per line and token-layer.

    ``{"request": int, "token": int, "layer": int, "experts": [k ids],
    "weights": [k floats]}``. Experts are reordered by weight (descending) and
    weights renormalized. Every request needs tokens 0..T-1, each with all L
    layers. A request id present in the file returns that request; any other
    id maps to file request (id mod count) in sorted-id order. Asking for more
    tokens than a request has wraps around its tokens.

    ``holdout`` > 0 reserves the last share of the file's requests for ids at
    or above ``CALIBRATION_ID_BASE`` (calibration) and the rest for all other
    ids, so calibration stays held out on a real trace too.
    """

    def __init__(self, path: str | Path, model: ModelSpec, holdout: float = 0.0) -> None:
        if not 0.0 <= holdout < 1.0:
            raise ValueError("holdout must be in [0, 1)")
        self.path = Path(path)
        self.model = model
        self._requests = self._load()
        ids = sorted(self._requests)
        n_hold = math.ceil(holdout * len(ids)) if holdout else 0
        if holdout and n_hold >= len(ids):
            raise TraceFormatError(f"{self.path}: too few requests ({len(ids)}) for holdout={holdout}")
        self._eval_ids = tuple(ids[: len(ids) - n_hold])
        self._calib_ids = tuple(ids[len(ids) - n_hold:]) if n_hold else tuple(ids)
        self.request_ids = tuple(ids)

    def _load(self) -> dict[int, Routing]:
        cells: dict[int, dict[tuple[int, int], tuple[list[int], list[float]]]] = {}
        with self.path.open("r", encoding="utf-8") as fh:
            for lineno, text in enumerate(fh, start=1):
                if not text.strip():
                    continue
                where = f"{self.path}:{lineno}"
                req, tok, layer, experts, weights = _parse_line(text, where, self.model)
                per_req = cells.setdefault(req, {})
                if (tok, layer) in per_req:
                    raise TraceFormatError(f"{where}: duplicate request {req} token {tok} layer {layer}")
                per_req[(tok, layer)] = (experts, weights)
        if not cells:
            raise TraceFormatError(f"{self.path}: no records")
        return {req: self._assemble(req, per_req) for req, per_req in cells.items()}

    def _assemble(self, req: int, per_req: dict) -> Routing:
        L, k = self.model.n_layers, self.model.top_k
        n = 1 + max(tok for tok, _ in per_req)
        experts = np.empty((n, L, k), dtype=np.int64)
        weights = np.empty((n, L, k))
        for tok in range(n):
            for layer in range(L):
                if (tok, layer) not in per_req:
                    raise TraceFormatError(
                        f"{self.path}: request {req} token {tok} is missing layer {layer}")
                e, w = per_req[(tok, layer)]
                order = np.argsort(-np.asarray(w), kind="stable")
                experts[tok, layer] = np.asarray(e)[order]
                weights[tok, layer] = np.asarray(w)[order] / sum(w)
        return Routing(_readonly(experts), _readonly(weights))

    def _file_request(self, request_id: int) -> Routing:
        pool = self._calib_ids if request_id >= CALIBRATION_ID_BASE else self._eval_ids
        if request_id not in pool:
            request_id = pool[request_id % len(pool)]
        return self._requests[request_id]

    def route(self, request_id: int, n_tokens: int, task: int = 0) -> Routing:
        """``task`` is accepted and ignored: a recorded trace has its own tasks."""
        _validate_request(request_id, n_tokens)
        src = self._file_request(int(request_id))
        idx = np.arange(int(n_tokens)) % len(src.experts)
        return Routing(src.experts[idx], src.weights[idx])

    def tokens(self, request_id: int, n_tokens: int, task: int = 0) -> np.ndarray:
        return self.route(request_id, n_tokens).experts


def write_jsonl(path: str | Path, source: TraceSource, request_ids: Iterable[int], n_tokens: int) -> None:
    """Export ``n_tokens`` tokens of each request of any trace source as JSON lines."""
    with Path(path).open("w", encoding="utf-8") as fh:
        for rid in request_ids:
            routing = source.route(int(rid), n_tokens)
            n, L, _ = routing.experts.shape
            for tok in range(n):
                for layer in range(L):
                    fh.write(json.dumps({
                        "request": int(rid), "token": tok, "layer": layer,
                        "experts": [int(e) for e in routing.experts[tok, layer]],
                        "weights": [float(w) for w in routing.weights[tok, layer]],
                    }) + "\n")


# --------------------------------------------------------------------------
# Command line: python -m workloads.traces stats|calibrate --model mixtral
# --------------------------------------------------------------------------
def _format_rows(rows: list[tuple[str, str, float, float, float, float]]) -> str:
    head = f"{'metric':<22}{'where':<22}{'measured':>9}{'target':>9}{'uniform':>9}{'indep.':>9}"
    lines = [head, "-" * len(head)]
    cell = (lambda v: f"{v:>9.3f}" if math.isfinite(v) else f"{'-':>9}")
    for metric, where, *values in rows:
        lines.append(f"{metric:<22}{where:<22}" + "".join(cell(v) for v in values))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workloads.traces",
                                     description="Routing statistics of expert-activation traces.")
    parser.add_argument("command", choices=("stats", "calibrate", "convert"))
    parser.add_argument("paths", nargs="*", help="convert: IN OUT (a routing log, the trace to write)")
    parser.add_argument("--format", dest="fmt", choices=("hf", "vllm"),
                        help="convert: the log's shape (workloads/trace_convert.py)")
    parser.add_argument("--model", default="mixtral")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--requests", type=int, default=160)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--trace", help="a JSON-lines trace to measure instead of the synthetic one")
    parser.add_argument("--tasks", type=int, default=3,
                        help="stats: tasks of the synthetic trace (requests cycle through them)")
    args = parser.parse_intermixed_args(argv)  # convert takes IN OUT after options
    try:
        model = get_model(args.model)
    except KeyError as e:
        parser.error(str(e.args[0]))
    if args.command == "convert":
        return _convert(parser, args, model)
    targets = TARGETS[model.name]
    if args.command == "calibrate":
        seeds = range(args.seed, args.seed + 4)
        fitted = fit_params(model, targets, default_trace_params(model.name), seeds,
                            max(args.requests // 4, 1), args.tokens)
        print(json.dumps(fitted.model_dump(), indent=2))
        return 0
    try:
        source: TraceSource = (JsonlTrace(args.trace, model) if args.trace
                               else SyntheticTrace(model, default_trace_params(model.name)
                                                   .with_overrides({"n_tasks": args.tasks}),
                                                   seed=args.seed))
    except (OSError, TraceFormatError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    n_tasks = getattr(source, "n_tasks", 1)
    tasks = [r % n_tasks for r in range(args.requests)]  # synthetic: an even task mix
    stats = measure_stats(model, sample_tokens(source, range(args.requests), args.tokens, tasks),
                          groups={"task": tasks} if n_tasks > 1 else None)
    print(f"{model.name}: {stats['n_tokens']} tokens, {stats['n_pairs']} consecutive pairs, "
          f"{stats['burst']['n_windows']} windows of {stats['burst']['window']} tokens"
          + (f", {n_tasks} tasks" if n_tasks > 1 else "") + f"; targets: {targets.source}")
    print(_format_rows(compare_to_targets(stats, targets)))
    return 0


def _convert(parser: argparse.ArgumentParser, args: argparse.Namespace, model: ModelSpec) -> int:
    from .trace_convert import convert

    if len(args.paths) != 2 or args.fmt is None:
        parser.error("convert needs --format hf|vllm IN OUT")
    try:
        report = convert(args.paths[0], args.paths[1], model, args.fmt)
        JsonlTrace(args.paths[1], model)  # what was written reads back
    except (OSError, ValueError) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    print(report.format())
    print(f"written: {args.paths[1]} ({model.name}, top-{model.top_k})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
