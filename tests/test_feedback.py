"""The projected feedback rule (21) on the unit costs alpha_j, against the equation by hand.

alpha_j <- [alpha_j + eta (rho_j - rho_bar_j)]_+ / sum_j' [alpha_j' + eta (rho_j' - rho_bar_j')]_+

Components in order (tx, off, cq, q). The paper's denominator has no [.]_+; with
alphas on the simplex and shares summing to 1 it is identically 1, so the clipped
numerators would leave the simplex. The code divides by the sum of the clipped
terms, which is the renormalisation "to the simplex" the paper's text asks for;
the numbers below follow the code and say so where clipping happens.
``CostWeights`` carries the alphas scaled to mean 1 (4 * alpha).
"""

from __future__ import annotations

import pytest

from hetroute.cost import COMPONENTS, CostWeights
from hetroute.routing.feedback import FeedbackParams, UnitCostFeedback


def _weights(w: CostWeights) -> list[float]:
    return [w.tx, w.off, w.cq, w.q]


def test_components_are_in_the_documented_order():
    assert COMPONENTS == ("tx", "off", "cq", "q")


def test_one_step_by_hand():
    """alphas 1/4, targets 1/4, realized shares (0.5, 0.3, 0.2, 0), eta 0.1:
    alpha = 0.25 + 0.1 * (0.25, 0.05, -0.05, -0.25) = (0.275, 0.255, 0.245, 0.225),
    which sums to 1 (no clipping)."""
    fb = UnitCostFeedback(FeedbackParams(eta=0.1, targets=(0.25, 0.25, 0.25, 0.25)))
    w = fb.update({"tx": 5.0, "off": 3.0, "cq": 2.0, "q": 0.0})  # shares from raw seconds
    expect = [0.275, 0.255, 0.245, 0.225]
    assert fb.alphas == pytest.approx(expect, abs=1e-15)
    assert _weights(w) == pytest.approx([4 * a for a in expect], abs=1e-14)
    # a second window with the same mix moves the same way again
    w = fb.update({"tx": 0.5, "off": 0.3, "cq": 0.2, "q": 0.0})
    expect = [a + 0.1 * d for a, d in zip(expect, (0.25, 0.05, -0.05, -0.25))]
    assert fb.alphas == pytest.approx(expect, abs=1e-15)


def test_the_bottleneck_component_gets_more_expensive():
    fb = UnitCostFeedback(FeedbackParams(eta=0.05, targets=(0.4, 0.1, 0.4, 0.1)))
    w = fb.update({"tx": 0.2, "off": 0.1, "cq": 0.6, "q": 0.1})  # queueing over its share
    assert w.cq > 1.0 > w.tx
    assert w.off == pytest.approx(1.0) and w.q == pytest.approx(1.0)


def test_clipping_and_renormalisation_by_hand():
    """eta 2, targets 1/4, shares (0.75, 0.25, 0, 0):
    raw = 0.25 + 2 * (0.5, 0, -0.25, -0.25) = (1.25, 0.25, -0.25, -0.25)
    clipped (1.25, 0.25, 0, 0), sum 1.5 -> alpha (5/6, 1/6, 0, 0)."""
    fb = UnitCostFeedback(FeedbackParams(eta=2.0, targets=(0.25, 0.25, 0.25, 0.25)))
    w = fb.update({"tx": 3.0, "off": 1.0, "cq": 0.0, "q": 0.0})
    assert fb.alphas == pytest.approx([5 / 6, 1 / 6, 0.0, 0.0], abs=1e-15)
    assert sum(fb.alphas) == pytest.approx(1.0, abs=1e-15)
    assert _weights(w) == pytest.approx([10 / 3, 2 / 3, 0.0, 0.0], abs=1e-14)


def test_first_window_sets_the_target_shares():
    """Without explicit targets the first window with traffic only records its shares;
    the same mix later changes nothing, a drifted one moves alphas by eta * drift."""
    fb = UnitCostFeedback(FeedbackParams(eta=0.1))
    assert fb.update({"tx": 0.0, "off": 0.0, "cq": 0.0, "q": 0.0}) is None  # no traffic
    assert fb.update({"tx": 4.0, "off": 2.0, "cq": 2.0, "q": 2.0}) is None
    assert fb.targets == pytest.approx([0.4, 0.2, 0.2, 0.2])
    w = fb.update({"tx": 0.4, "off": 0.2, "cq": 0.2, "q": 0.2})
    assert fb.alphas == pytest.approx([0.25] * 4, abs=1e-15)
    assert _weights(w) == pytest.approx([1.0] * 4, abs=1e-14)
    fb.update({"tx": 0.2, "off": 0.2, "cq": 0.4, "q": 0.2})
    assert fb.alphas == pytest.approx([0.25 - 0.02, 0.25, 0.25 + 0.02, 0.25], abs=1e-15)


def test_eta_zero_disables_feedback():
    fb = UnitCostFeedback(FeedbackParams(eta=0.0, targets=(0.25, 0.25, 0.25, 0.25)))
    assert fb.update({"tx": 1.0, "off": 0.0, "cq": 0.0, "q": 0.0}) is None
    assert fb.alphas == [0.25] * 4


def test_negative_contributions_count_as_zero():
    fb = UnitCostFeedback(FeedbackParams(eta=0.1, targets=(0.25, 0.25, 0.25, 0.25)))
    fb.update({"tx": 1.0, "off": 1.0, "cq": -5.0, "q": 0.0})
    assert fb.alphas == pytest.approx([0.275, 0.275, 0.225, 0.225], abs=1e-15)
