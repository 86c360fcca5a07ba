"""The router interface every backend drives.

A router has two halves, as in the paper: ``place`` (offline, once per run)
returns a ``Deployment``; ``route`` (online, once per token-layer) returns an
``Assignment``. Backends call them in this order::

    router = RouterClass(problem, params)
    deployment = router.place()
    router.bind(deployment)
    decider = router.decider(server)      # one per server that routes tokens
    residency = decider.residency(server) # that server's GPU tiers (hetroute.residency)
    decider.route(token, targets, view)   # at the token's residing server
    decider.on_layer_done(record)         # each token-layer this decider routed, once done
    decider.on_request_done(request_id)

The contract: two required hooks (``place``, ``route``) and five optional ones with
working defaults (``bind``, ``decider``, ``residency``, ``on_layer_done``,
``on_request_done``); docs/adding-a-router.md says when to override each.
``route`` may read only its arguments and its own state: the token (where it
is, its home and budget), the gated targets of this layer, and the decider's
``StateView``. The backend trusts nothing else a router reports: the quality
increment of each layer is derived from the quality model and the replicas
executed (``Assignment.dq`` is the router's own belief, checked but never used),
and a router computes any feedback it wants from the typed records it is given.
The conformance check (``testbed.conformance``, tests/test_router_conformance.py)
runs over every registered router.
"""

from __future__ import annotations

import abc
import copy
from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from ..deployment import Deployment, MemoryBudget
from ..placement.calibration import CalibrationTraffic
from ..quality import QualityModel
from ..residency import Residency, StaticTiers
from ..service import ServiceModel, make_service
from ..state import Assignment, StateView, TokenLayerRecord, TokenView
from ..system import Cluster, MoEShape



class RouterParams(BaseModel):
    """Base of every router's parameters: validated, immutable, no unknown keys.

    ``cost_model`` is the router's *belief* of service times (``hetroute.service``):
    the paper's w/F model or the hardware roofline. Placement, planners and
    online costs use it; the world a backend runs is chosen separately
    (``spec.physics``), so a run can show what a belief costs.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    cost_model: Literal["paper", "hardware"] = Field(
        "paper", description="belief of service times: 'paper' (w/F, eq. 9) or 'hardware'")


@dataclass(frozen=True)
class Problem:
    """Everything a router may know offline."""

    cluster: Cluster
    shape: MoEShape
    quality: QualityModel
    budget: MemoryBudget
    lam_max: float  # per-token quality budget Lambda_max (0.02 = 2%)
    calibration: CalibrationTraffic  # held-out T_cal, with home servers
    seed: int = 0
    window_s: float = 0.02  # scheduling window Delta t of the system

    @property
    def popularity(self) -> np.ndarray:
        return self.calibration.popularity(self.shape.n_experts)


class Router(abc.ABC):
    """Base class; subclasses set ``name`` and optionally ``Params``.

    Required: ``place`` and ``route``. Optional (defaults work): ``bind`` (precompute
    online tables), ``decider`` (per-server state), ``residency`` (an online GPU cache),
    ``on_layer_done`` (feedback from finished token-layers), ``on_request_done``
    (per-request state may go)."""

    name: ClassVar[str]
    Params: ClassVar[type[RouterParams]] = RouterParams
    #: Placements may be cached and reloaded: ``bind`` must then rebuild every
    #: online structure from the deployment alone. Set False if it cannot.
    cacheable_placement: ClassVar[bool] = True
    #: Workload overrides (spec keys) of the regime the router's source system was
    #: built for, when it differs from the experiment's; ``testbed compare`` adds a
    #: reference row run there, so a baseline is also seen where it is meant to work.
    own_regime: ClassVar[dict[str, object] | None] = None
    #: One line on how the design uses the common memory budget, when it cannot use
    #: it as HetRoute does (printed under ``testbed compare``'s memory columns).
    memory_note: ClassVar[str] = ""

    def __init__(self, problem: Problem, params: RouterParams | dict | None = None) -> None:
        self.problem = problem
        if params is None:
            params = self.Params()
        elif isinstance(params, dict):
            params = self.Params.model_validate(params)
        elif not isinstance(params, self.Params):
            raise TypeError(f"{self.name} expects {self.Params.__name__}")
        self.params = params
        #: the router's belief of stream times (not the world's physics)
        self.service: ServiceModel = make_service(params.cost_model, problem.cluster, problem.shape)
        self.deployment: Deployment | None = None
        self.placement_report: dict = {}

    @abc.abstractmethod
    def place(self) -> Deployment:
        """Offline stage: the replicas, their tier and precision."""

    def bind(self, deployment: Deployment) -> None:
        """Prepare online structures for ``deployment`` (override to precompute).

        Must not rely on state left by ``place``: a cached deployment may be
        bound to a fresh instance."""
        self.deployment = deployment

    @abc.abstractmethod
    def route(self, tok: TokenView, targets: tuple[int, ...], view: StateView) -> Assignment:
        """Online stage for one token-layer."""

    def decider(self, server: int) -> "Router":
        """The instance that routes tokens residing on ``server``.

        Routers with online state that each server keeps for itself (feedback
        weights, caches) return a copy; stateless ones return ``self``.
        """
        return self

    def residency(self, server: int) -> Residency:
        """The GPU tiers of ``server``'s replicas, asked once of that server's decider.

        Default: the deployment's static tiers. A router with a run-time expert cache
        returns an ``OnlineCache`` that it shares with its own routing state."""
        assert self.deployment is not None
        return StaticTiers(self.deployment)

    def on_layer_done(self, record: "TokenLayerRecord") -> None:
        """A token-layer this decider routed is done. The ``hetroute.state.TokenLayerRecord`` has
        its times, bytes, executed replicas and tiers, the derived quality increment
        ``dq``, the world's offload time ``offload_s`` and the scheduling ``window`` it
        completed in. Feedback such as eq. (21) is computed here by the router itself.
        In the emulator the record is made where the layer aggregates; the deciding server
        kept its decision and builds the same record from what a FEEDBACK frame
        (``testbed.emu.wire.Feedback``) says was measured there, so a decider gets the
        whole record in both backends."""

    def on_request_done(self, request: int) -> None:
        """A request this decider saw has completed (per-request state may go)."""

    def clone(self) -> "Router":
        """A shallow copy sharing immutable tables (helper for ``decider``)."""
        return copy.copy(self)
