"""HetRoute believing the hardware model instead of the paper's w/F (issue 12).

The same method (Algorithm 1 placement, Algorithm 2 routing, feedback eq. 21);
only its cost model differs: an expert job costs one batch's roofline time on
the server's GPU class (its weights read once), a token sent to a replica at
which the decider already has a job queued costs the marginal batched time
(``StateView.pending``), the dense part and loads likewise. Compared with
``hetroute`` it shows what the paper's cost model costs the method when the
world is physical; it is not part of the paper.
"""

from __future__ import annotations

from typing import Literal

from .hetroute import HetRoute, HetRouteParams


class HardwareBeliefParams(HetRouteParams):
    cost_model: Literal["paper", "hardware"] = "hardware"


class HetRouteHardware(HetRoute):
    """HetRoute with the hardware cost model as its belief (not in the paper)."""

    name = "hetroute-hw"
    Params = HardwareBeliefParams
