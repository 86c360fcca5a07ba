"""Knobs of the synthetic generator, the statistics it is calibrated to, per-model defaults.

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

import types
from dataclasses import dataclass
from typing import Mapping

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..models import get_model

Anchors = tuple[tuple[float, float], ...]


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
