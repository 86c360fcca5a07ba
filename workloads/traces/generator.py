"""The synthetic routing generator (``SyntheticTrace``) and the trace interface.

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

Calibrated parameters and their sources: ``workloads.traces.params``.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable

import numpy as np

from ..models import ModelSpec
from .params import TraceParams, default_trace_params, profile


#: Request ids at or above this serve calibration (held-out) traffic, never evaluation.
CALIBRATION_ID_BASE = 1_000_000_000

_STRUCTURE_TAG = 0x5EED  # rng stream of the per-model structure (popularity, affinity)
_REQUEST_TAG = 0x7E0  # rng stream of per-request routing
_TASK_TAG = 0x7A5C  # rng stream of the per-task popularity
_BURST_TAG = 0xB0257  # rng stream of per-request hot experts (bursts)



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




def readonly(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


def _gumbel(u: np.ndarray) -> np.ndarray:
    return -np.log(-np.log(np.clip(u, 1e-300, 1.0 - 1e-16)))


def validate_request(request_id: int, n_tokens: int) -> None:
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
        self._affinity = readonly(profile(self.params.affinity_anchors, L))
        pop, task_pop, trans = self._structure()
        self.popularity = readonly(pop)  # (L, E), the shared base distribution p_l
        self.task_popularity = readonly(task_pop)  # (C, L, E), p_{c,l} of each task
        self.transitions = readonly(trans[0])  # (L-1, E, E), T_l[i] of task 0
        self.task_transitions = readonly(trans)  # (C, L-1, E, E)
        self._log_pop0 = readonly(np.log(task_pop[:, 0]))  # (C, E)
        self._log_pop = readonly(np.log(task_pop))
        self._log_trans = readonly(np.log(trans))
        self._copy_first = readonly(profile(self.params.copy_first, L))
        copy_one = profile(self.params.copy_one, L) if model.top_k > 1 else np.zeros(L)
        self._copy_one = readonly(copy_one)
        self._avoid = readonly(profile(self.params.avoid_prev, L))
        self._copy_pair = readonly(profile(self.params.copy_pair, L))

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
        return self.route_many([request_id], n_tokens, [task])[0]

    def route_many(self, request_ids, n_tokens: int, tasks) -> list[Routing]:
        """``route`` of several requests of the same length at once, equal to routing each
        alone: every cell is a row of its own, so batching only saves numpy calls (the
        anti-diagonal sweep costs ~70 small calls per request; a simulator pays it per
        arrival)."""
        validate_request(0, n_tokens)
        for rid in request_ids:
            validate_request(rid, n_tokens)
        for task in tasks:
            if int(task) != task or not 0 <= task < self.n_tasks:
                raise ValueError(f"task must be an integer in [0, {self.n_tasks}), got {task!r}")
        m, p = self.model, self.params
        R, n, L, E, k = len(request_ids), int(n_tokens), m.n_layers, m.experts_per_layer, m.top_k
        task = np.array([int(c) for c in tasks], dtype=np.int64)
        u = np.empty((R, n, L, E + 2 + k))
        for i, rid in enumerate(request_ids):  # one C-order draw keeps prefixes stable
            u[i] = np.random.default_rng([self.seed, _REQUEST_TAG, int(rid)]).random((n, L, E + 2 + k))
        hot = None
        if p.burst_boost > 0 and n:
            # One hot expert per (window of burst_window tokens, layer), drawn from the
            # task's popularity (own stream; C-order, so prefixes stay stable too).
            n_win = -(-n // p.burst_window)
            hot = np.empty((R, n_win, L), dtype=np.int64)
            for i, rid in enumerate(request_ids):
                brng = np.random.default_rng([self.seed, _BURST_TAG, int(rid)])
                g = _gumbel(brng.random((n_win, L, E)))
                hot[i] = np.argmax(self._log_pop[task[i]][None] + g, axis=-1)
        sel = np.zeros((R, n, L, k), dtype=np.int64)
        # Cell (t, l) needs (t, l-1) for affinity and (t-1, l) for repetition:
        # sweep anti-diagonals t + l = d, each vectorized over its cells of every request.
        for d in range(n + L - 1):
            t1 = np.arange(max(0, d - L + 1), min(n - 1, d) + 1)
            r = np.repeat(np.arange(R), t1.size)
            t = np.tile(t1, R)
            self._fill_diagonal(sel, u, r, t, d - t, task[r], hot)
        weights = _gate_weights(u[..., E + 2:])
        return [Routing(sel[i], weights[i]) for i in range(R)]

    def tokens(self, request_id: int, n_tokens: int, task: int = 0) -> np.ndarray:
        """Only the expert indices of ``route``."""
        return self.route(request_id, n_tokens, task).experts

    def _fill_diagonal(self, sel: np.ndarray, u: np.ndarray, r: np.ndarray, t: np.ndarray,
                       l: np.ndarray, task: np.ndarray, hot: np.ndarray | None = None) -> None:
        """Fill cells (r, t, l) of ``sel``: request r's token t at layer l, of task ``task``."""
        E, k = self.model.experts_per_layer, self.model.top_k
        base = np.empty((t.size, E))
        top = l == 0
        base[top] = self._log_pop0[task[top]]
        deep = ~top
        rd, td, ld = r[deep], t[deep], l[deep]
        base[deep] = self._log_trans[task[deep], ld - 1, sel[rd, td, ld - 1, 0]]
        scores = base + _gumbel(u[r, t, l, :E])
        if hot is not None:
            scores[np.arange(t.size), hot[r, t // self.params.burst_window, l]] += self.params.burst_boost
        a, b, v, um = self._copy_first[l], self._copy_one[l], self._avoid[l], u[r, t, l, E]
        w = self._copy_pair[l]
        later = t > 0
        keep = later & (um < a)
        part = later & (um >= a) & (um < a + b)
        avoid = later & (um >= a + b) & (um < a + b + v)
        pair = later & (um >= a + b + v) & (um < a + b + v + w)
        prev = sel[r, np.maximum(t - 1, 0), l]
        pick = np.minimum((u[r, t, l, E + 1] * k).astype(np.int64), k - 1)
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
        sel[r, t, l] = out
