"""What a router sees online and what it returns (the interface to every backend).

A router decides where the token resides, on a ``StateView`` that the backend
refreshes once per scheduling window; between refreshes the view only changes
by the decider's own admissions. That is all the online state a router may
read; staleness is part of the model, not hidden.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple

import numpy as np


class Mode(IntEnum):
    """How a target expert is served (Section III-B and the fallback of Alg. 2)."""

    EXACT = 0
    SUBSTITUTE = 1
    FALLBACK = 2


class ExecType(IntEnum):
    """Execution-type breakdown of Fig. 3(b); derived by the backend from an assignment."""

    LOCAL_GPU = 0
    LOCAL_CPU = 1
    REMOTE_GPU = 2
    REMOTE_CPU = 3
    SUBSTITUTE = 4
    FALLBACK = 5

    @property
    def label(self) -> str:
        return self.name.lower()

    @staticmethod
    def table() -> tuple:
        """``table()[mode][local][gpu]`` -> int, for hot loops."""
        return tuple(tuple(tuple(int(ExecType.of(m, bool(lo), bool(g))) for g in (0, 1))
                           for lo in (0, 1)) for m in Mode)

    @staticmethod
    def of(mode: int, local: bool, gpu: bool) -> "ExecType":
        if mode == Mode.SUBSTITUTE:
            return ExecType.SUBSTITUTE
        if mode == Mode.FALLBACK:
            return ExecType.FALLBACK
        if local:
            return ExecType.LOCAL_GPU if gpu else ExecType.LOCAL_CPU
        return ExecType.REMOTE_GPU if gpu else ExecType.REMOTE_CPU


class TokenView:
    """The token being routed: theta_{i,l}, its home a_i and accumulated budget."""

    __slots__ = ("request", "index", "home", "server", "layer", "lam_acc", "lam_max", "now", "ctx")

    def __init__(self, request: int, index: int, home: int, lam_max: float,
                 server: int | None = None, layer: int = 0, lam_acc: float = 0.0,
                 now: float = 0.0) -> None:
        self.request = request
        self.index = index
        self.home = home
        self.server = home if server is None else server
        self.layer = layer
        self.lam_acc = lam_acc
        self.lam_max = lam_max
        self.now = now
        #: Router-owned context that travels with the token (e.g. a Petals chain),
        #: a tuple of small ints; backends carry it between servers unchanged.
        self.ctx: tuple[int, ...] | None = None

    def __repr__(self) -> str:
        return (f"TokenView(req={self.request}, tok={self.index}, home={self.home}, "
                f"server={self.server}, layer={self.layer}, lam={self.lam_acc:.4g}/{self.lam_max:.4g})")


class StateView:
    """Backlogs and reachability as one decider last observed them.

    ``backlog[n]`` is Q_n(t)/F_n in seconds: the work queued at server n when the
    window opened, plus what this decider admitted since (the queueing term of
    eq. 9). ``admitted[n]`` is W_n of the stability guard (19), in seconds of
    stream time: the work this decider admitted to n in the current window;
    other deciders' admissions are not observable before the next refresh, and
    show up there as backlog. ``alive[n]`` is False once a server stopped
    answering (it is removed from every candidate set).
    """

    __slots__ = ("window", "opened_at", "backlog", "admitted", "alive", "link_up", "faultless",
                 "pending")

    def __init__(self, n_servers: int) -> None:
        self.window = -1
        self.opened_at = 0.0
        #: float64 arrays, so that a compiled router reads them without a copy
        self.backlog = np.zeros(n_servers)
        self.admitted = np.zeros(n_servers)
        self.alive = [True] * n_servers
        self.link_up: list[list[bool]] | None = None  # None: every link up
        self.faultless = True  # every server alive and every link up (fast path)
        #: replica -> until when this decider expects a job it admitted there to be queued
        #: (its admission time plus the backlog it saw): a token sent before then shares
        #: that step's weight read (the marginal cost of ``cost_model: hardware``)
        self.pending: dict[int, float] = {}

    def refresh(self, window: int, opened_at: float, backlog: list[float],
                alive: list[bool], link_up: list[list[bool]] | None = None) -> None:
        self.window = window
        self.opened_at = opened_at
        self.backlog[:] = backlog
        self.admitted[:] = 0.0
        self.alive[:] = alive
        self.link_up = link_up
        self.faultless = link_up is None and all(alive)

    def admit(self, server: int, seconds: float, replica: int = -1, now: float = 0.0) -> None:
        if replica >= 0:
            until = now + self.backlog[server]
            if until > self.pending.get(replica, -1.0):
                self.pending[replica] = until
        self.backlog[server] += seconds
        self.admitted[server] += seconds

    def reachable(self, src: int, dst: int) -> bool:
        if not self.alive[dst]:
            return False
        lu = self.link_up
        return src == dst or lu is None or (lu[src][dst] and lu[dst][src])


@dataclass(slots=True)
class Assignment:
    """z_{i,l}: one executed replica per target, and the aggregation server theta_{i,l+1}.

    ``replicas[j]`` indexes ``Deployment.replicas`` and serves ``targets[j]``;
    ``dq`` is the layer's quality increment (the inner sums of eq. 8) as the router
    believes it: the backend derives the increment it accounts from the quality
    model and never uses this one (a differing value is counted as misreported).
    ``est_delay`` is the router's own estimate of D_{i,l} (NaN if it has none).
    ``prefetch`` lists replicas to copy into their server's GPU ahead of use
    (online-cache routers); the backend tells the server's residency
    (``Router.residency``) with ``on_prefetched`` once a copy lands.
    """

    targets: tuple[int, ...]
    replicas: tuple[int, ...]
    modes: tuple[int, ...]
    next_server: int
    dq: float = 0.0
    est_delay: float = float("nan")
    prefetch: tuple[int, ...] = ()

    @property
    def k(self) -> int:
        return len(self.targets)


class Unroutable(RuntimeError):
    """No replica of a target can be reached without breaking the quality budget.

    Only possible when faults removed every full-precision replica of an expert;
    the backend then reports the request as failed (never silently lost).
    """


class TokenLayerRecord(NamedTuple):
    """A finished token-layer, as the backends record it and routers see it in
    ``Router.on_layer_done``: the scalars (in the column order of the backends' table,
    ``testbed.records.TOKEN_LAYER_SCALARS``), then k values per target, then context
    fields the table does not store. A named tuple: typed fields, and cheap on the hot
    path of both backends."""

    request: int
    token: int
    layer: int
    t_start: float
    server: int
    next_server: int
    participants: int
    fanout_s: float
    compute_s: float
    fanin_s: float
    total_s: float
    bytes: int
    dq: float
    est_delay_s: float
    view_age_s: float
    backlog_err_s: float
    dense_s: float
    decision_s: float
    # per target (k each)
    targets: tuple
    exec_experts: list
    replicas: tuple
    exec_servers: list
    precisions: list
    gpus: list
    exec_types: list
    # context for ``Router.on_layer_done``, not written to the table
    offload_s: float = 0.0  # the world's GPU-CPU load time of the layer (its slowest CPU-tier replica)
    window: int = -1  # the scheduling window (backend's count) in which the layer completed
