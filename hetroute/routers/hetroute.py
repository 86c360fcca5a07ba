"""HetRoute: Algorithm 1 placement and Algorithm 2 set-level routing with feedback (21).

Defaults follow Section VI-A: quality budget 2% (``Problem.lam_max``), beam
width 8, enumeration threshold 64, memory budget ratio 2.0. Knobs the paper
does not fix (window, local threshold, lambda_q, memory price, per-expert
replica cap, feedback step) are documented in ``Alg1Params``/``Alg2Params``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ..cost import CostModel
from ..deployment import Deployment
from ..placement.algorithm1 import Alg1Params, algorithm1
from ..routing.algorithm2 import Alg2Params, SetLevelRouter
from ..routing.feedback import FeedbackParams, UnitCostFeedback
from ..state import Assignment, StateView, TokenView
from ..system import Precision
from .base import Router, RouterParams


# Defaults live with the algorithms (one source of truth); the router exposes them as knobs.
_A1, _A2, _FB = Alg1Params(), Alg2Params(), FeedbackParams()


class HetRouteParams(RouterParams):
    # Algorithm 1
    memory_ratio: float = Field(_A1.memory_ratio, ge=1.0)
    precisions: tuple[Literal["fp16", "int8", "int4"], ...] = ("fp16", "int8", "int4")
    max_replicas_per_expert: int = Field(_A1.max_replicas_per_expert, ge=1)
    replication_cap: int | None = Field(_A1.replication_cap, ge=0)
    memory_price: float = Field(_A1.memory_price, ge=0)
    residency: Literal["routing", "frequency"] = _A1.residency
    replicate: bool = _A1.replicate
    diminishing_returns: bool = _A1.diminishing_returns
    residency_order: Literal["density", "value"] = _A1.residency_order
    replication_order: Literal["density", "value"] = _A1.replication_order
    fill_gpu: bool = _A1.fill_gpu
    stage2_rounds: int = Field(_A1.stage2_rounds, ge=1)
    # cost model (eq. 9)
    lambda_q: float = Field(_A1.lambda_q, ge=0, description="seconds per unit of quality loss")
    include_propagation: bool = True
    # Algorithm 2
    beam_width: int = Field(_A2.beam_width, ge=1)
    enum_limit: int = Field(_A2.enum_limit, ge=1)
    window_s: float | None = Field(None, gt=0, description="Delta t of guard (19); None: the run's window")
    local_threshold_s: float = Field(_A2.local_threshold_s, ge=0)
    set_level: bool = _A2.set_level
    fast_path: bool = _A2.fast_path
    exchange: bool = _A2.exchange
    lookahead_weight: float = Field(_A2.lookahead_weight, ge=0)
    # feedback (eq. 21)
    feedback_eta: float = Field(_FB.eta, ge=0)
    feedback_min_change: float = Field(0.02, ge=0, description="re-price only past this relative change")

    def alg1(self) -> Alg1Params:
        return Alg1Params(
            memory_ratio=self.memory_ratio,
            precisions=tuple(Precision[p.upper()] for p in self.precisions),
            max_replicas_per_expert=self.max_replicas_per_expert,
            replication_cap=self.replication_cap, memory_price=self.memory_price,
            lambda_q=self.lambda_q, residency=self.residency, replicate=self.replicate,
            diminishing_returns=self.diminishing_returns, residency_order=self.residency_order,
            replication_order=self.replication_order, stage2_rounds=self.stage2_rounds,
            fill_gpu=self.fill_gpu)

    def alg2(self, window_s: float) -> Alg2Params:
        return Alg2Params(beam_width=self.beam_width, enum_limit=self.enum_limit,
                          window_s=self.window_s or window_s, local_threshold_s=self.local_threshold_s,
                          set_level=self.set_level, fast_path=self.fast_path,
                          exchange=self.exchange, lookahead_weight=self.lookahead_weight,
                          marginal=self.cost_model == "hardware")


class HetRoute(Router):
    """The paper's method."""

    name = "hetroute"
    Params = HetRouteParams
    params: HetRouteParams

    def _engine(self, deployment: Deployment) -> SetLevelRouter:
        pr, p = self.problem, self.params
        cost = CostModel(pr.cluster, pr.shape, deployment, pr.quality, lambda_q=p.lambda_q,
                         include_propagation=p.include_propagation, service=self.service)
        return SetLevelRouter(cost, p.alg2(pr.window_s), popularity=list(pr.popularity))

    def place(self) -> Deployment:
        pr = self.problem
        dep, report = algorithm1(pr.cluster, pr.shape, pr.quality, pr.calibration, pr.budget,
                                 pr.lam_max, lambda d: self._engine(d).route, self.params.alg1(),
                                 service=self.service)
        self.placement_report = vars(report)
        return dep

    def bind(self, deployment: Deployment) -> None:
        super().bind(deployment)
        self.engine = self._engine(deployment)
        self.feedback = UnitCostFeedback(FeedbackParams(eta=self.params.feedback_eta))
        self._open_feedback_window()

    def decider(self, server: int) -> "HetRoute":
        if self.params.feedback_eta == 0:
            return self
        d = self.clone()
        d.engine = self.engine.spawn()
        d.feedback = UnitCostFeedback(self.feedback.params)
        d._open_feedback_window()
        return d

    def route(self, tok: TokenView, targets: tuple[int, ...], view: StateView) -> Assignment:
        if view.window != self._fb_window:  # a window closed since this decider last looked
            self._close_feedback_window(view.window)
        return self.engine.route(tok, targets, view)

    # -- feedback (eq. 21) from the records of finished token-layers --------------------
    def _open_feedback_window(self) -> None:
        self._fb_window = -1  # the scheduling window the realized costs below belong to
        self._realized = dict(tx=0.0, off=0.0, cq=0.0, q=0.0)

    def on_layer_done(self, record) -> None:
        """Add a finished layer's realized cost components (tx, off, cq, q) to its
        window's; the window's total updates the unit costs once the window closed,
        before this decider's next decision or record (eq. 21)."""
        if self.params.feedback_eta == 0:
            return
        if record.window != self._fb_window:
            self._close_feedback_window(record.window)
        acc = self._realized
        off = record.offload_s
        acc["tx"] += record.fanout_s + record.fanin_s
        acc["off"] += off
        acc["cq"] += record.compute_s - off if record.compute_s > off else 0.0
        acc["q"] += self.params.lambda_q * record.dq

    def _close_feedback_window(self, window: int) -> None:
        r = self._realized
        self._fb_window = window
        if r["tx"] or r["off"] or r["cq"] or r["q"]:
            self._apply_feedback(dict(r))
            for key in r:
                r[key] = 0.0

    def _apply_feedback(self, realized: dict[str, float]) -> None:
        w = self.feedback.update(realized)
        if w is None:
            return
        cur = self.engine.weights
        change = max(abs(a - b) / max(b, 1e-12) for a, b in
                     ((w.tx, cur.tx), (w.off, cur.off), (w.cq, cur.cq), (w.q, cur.q)))
        if change > self.params.feedback_min_change:
            self.engine.set_weights(w)
