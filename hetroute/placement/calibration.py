"""Calibration traffic T_cal and the offline simulation of a router on it.

Algorithm 1 estimates pi_E (activation frequency) from T_cal and
p^route_{E,n} by running the online router over T_cal (line 3). The
simulation uses a static view (empty queues, everything reachable): the
offline stage has no online state, only the cost model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..state import Assignment, StateView, TokenView

RouteFn = Callable[[TokenView, tuple[int, ...], StateView], Assignment]


@dataclass(frozen=True)
class CalibrationTraffic:
    """Tokens with a home server and their gated experts per layer (global ids)."""

    homes: np.ndarray  # (T,) int
    targets: np.ndarray  # (T, L, k) int, global expert ids

    def __post_init__(self) -> None:
        if self.targets.ndim != 3 or self.homes.shape != (self.targets.shape[0],):
            raise ValueError("targets must be (T, L, k) and homes (T,)")
        if self.targets.shape[0] == 0:
            raise ValueError("calibration traffic is empty")

    @property
    def n_tokens(self) -> int:
        return int(self.targets.shape[0])

    def popularity(self, n_experts: int) -> np.ndarray:
        """pi_E: probability that E is among a token's targets at its layer."""
        counts = np.bincount(self.targets.ravel(), minlength=n_experts).astype(float)
        return counts / self.n_tokens

    def per_home_popularity(self, n_servers: int, n_experts: int) -> np.ndarray:
        """f_n(E): activations of E by tokens homed at n, per calibration token."""
        out = np.zeros((n_servers, n_experts))
        T, L, k = self.targets.shape
        np.add.at(out, (np.repeat(self.homes, L * k), self.targets.ravel()), 1.0)
        return out / self.n_tokens


@dataclass(frozen=True)
class RoutingStats:
    """What simulating a router over T_cal tells the offline stage.

    ``replica_uses[r]``: executions by replica r per calibration token, i.e.
    pi_E * p^route_{E,n} of eq. (13) summed over the targets r served.
    ``residing[e, n, b]``: how often a token resided on n when e was a target,
    per calibration token (the distribution eq. 14 takes expectations over),
    split by the token's remaining budget: b = 0 if even an INT4 replica of e
    would pass guard (18), 1 if only INT8 or better would, 2 if only FP16.
    """

    replica_uses: np.ndarray
    residing: np.ndarray  # (n_experts, n_servers, 3)
    mean_delay: float  # mean sum of est. D_{i,l} per token



def budget_class(slack: float, q_int8: float, q_int4: float) -> int:
    """0: INT4 admissible under guard (18); 1: INT8 at best; 2: FP16 only."""
    if slack + 1e-12 >= q_int4:
        return 0
    return 1 if slack + 1e-12 >= q_int8 else 2


def simulate(route: RouteFn, calib: CalibrationTraffic, n_replicas: int, n_servers: int,
             n_experts: int, lam_max: float, q: np.ndarray | None = None) -> RoutingStats:
    """Route every calibration token through all layers on a static view.

    ``q`` (n_experts, 3) splits ``residing`` by budget class; without it every
    activation counts as class 0.
    """
    view = StateView(n_servers)
    uses = np.zeros(n_replicas)
    residing = np.zeros((n_experts, n_servers, 3))
    total_delay = 0.0
    T, L, _ = calib.targets.shape
    for i in range(T):
        home = int(calib.homes[i])
        tok = TokenView(request=-1, index=i, home=home, lam_max=lam_max)
        for layer in range(L):
            targets = tuple(int(e) for e in calib.targets[i, layer])
            tok.layer = layer
            slack = lam_max - tok.lam_acc
            for e in targets:
                b = 0 if q is None else budget_class(slack, q[e, 1], q[e, 2])
                residing[e, tok.server, b] += 1
            a = route(tok, targets, view)
            for r in a.replicas:
                uses[r] += 1
            if a.est_delay == a.est_delay:  # not NaN
                total_delay += a.est_delay
            tok.lam_acc += a.dq
            tok.server = a.next_server
    return RoutingStats(uses / T, residing / T, total_delay / T)
