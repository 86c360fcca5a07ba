"""Routing statistics of any trace: repetition, pair reuse, popularity, affinity, bursts.

How each is measured: ``measure_stats``; ``compare_to_targets`` lines them up against
a model's ``TraceTargets``.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping, Sequence

import numpy as np

from ..models import ModelSpec
from .generator import TraceSource
from .params import TraceTargets


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
