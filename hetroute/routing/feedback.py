"""Projected feedback on the unit costs alpha_j (eq. 21).

Components j are transmission, offload, compute-queue and quality. Each window
the backend reports the realized contribution of every component over the
token-layers the decider routed; a component whose share exceeds its target
share gets more expensive, and alphas are projected back onto the simplex.

Target shares are not given by the paper. We use the shares observed in the
first window with traffic (``targets=None``), so alphas only move when the mix
drifts away from where the run started, e.g. when load makes queueing the
bottleneck. Explicit targets can be passed instead. The rule integrates the gap
without a leak, so a decider whose mix stays off its first window ends at a corner
of the simplex (a first window all local prices links at up to 4x and the rest
near 0; one mostly remote, the reverse): measured on the figures' settings this
costs HetRoute 7-27% of its mean against ``eta = 0`` (README, "Measured behaviour
worth knowing").

The denominator of eq. (21) as printed has no [.]_+; with alphas on the simplex and
shares summing to 1 it equals 1 identically, so clipped numerators would leave the
simplex. We divide by the sum of the clipped terms, which puts alphas back on the
simplex as the paper's text says (``tests/test_feedback.py`` has the numbers).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..cost import COMPONENTS, CostWeights


@dataclass(frozen=True)
class FeedbackParams:
    eta: float = 0.05  # step size; 0 disables feedback
    targets: tuple[float, float, float, float] | None = None

    def __post_init__(self) -> None:
        if self.eta < 0:
            raise ValueError("eta must be >= 0")
        if self.targets is not None:
            if len(self.targets) != len(COMPONENTS) or abs(sum(self.targets) - 1) > 1e-6:
                raise ValueError("targets must be four shares summing to 1")


class UnitCostFeedback:
    """State of eq. (21) for one decider."""

    def __init__(self, params: FeedbackParams = FeedbackParams()) -> None:
        self.params = params
        self.alphas = [1.0 / len(COMPONENTS)] * len(COMPONENTS)
        self.targets = list(params.targets) if params.targets is not None else None

    def update(self, realized: dict[str, float]) -> CostWeights | None:
        """Apply eq. (21) once; returns new weights, or None if nothing changed."""
        if self.params.eta == 0:
            return None
        vals = [max(0.0, float(realized.get(c, 0.0))) for c in COMPONENTS]
        total = sum(vals)
        if total <= 0:
            return None
        rho = [v / total for v in vals]
        if self.targets is None:
            self.targets = rho
            return None
        eta = self.params.eta
        raw = [max(0.0, a + eta * (r - t)) for a, r, t in zip(self.alphas, rho, self.targets)]
        s = sum(raw)
        if s <= 0:
            return None
        self.alphas = [x / s for x in raw]
        return CostWeights.from_simplex(tuple(self.alphas))  # type: ignore[arg-type]
