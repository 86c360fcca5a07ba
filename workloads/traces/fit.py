"""Calibration of the generator's knobs to targets (how the defaults in ``params`` were made).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..models import ModelSpec
from .generator import SyntheticTrace
from .params import Anchors, TraceParams, TraceTargets, profile
from .stats import measure_stats, sample_tokens


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
