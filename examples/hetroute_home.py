"""HetRoute with every layer gathered at the request's home (not in the paper).

Why it exists: under causal attention (``engine.attention: causal``) HetRoute ran 2.7-3.3x
slower on Fig. 9 while Prism did not (README, "A token's attention needs its request's
earlier positions"). HetRoute differs from Prism in two things at once: which replicas
serve a token (Algorithm 2's set-level choice) and where the token resides afterwards
(eq. 11 moves it to a participant, so a request's positions attend on different servers
and their keys and values must follow them). This router keeps the first and removes the
second: the placement is Algorithm 1's, the replica choice is Algorithm 2's with eq. (10)'s
fan-in going to the home, and theta_{l+1} is always the home (as Prism's ``residing:
home``), so a request's attention never leaves its home. Running it beside ``hetroute``
under both attention rules tells which of the two produced the slowdown.

It lives here, out of tree (``examples.hetroute_home:HetRouteHome`` in a spec), because it
is an experiment on the method rather than the method, and a file under ``hetroute/``
would change the method's code hash that the shipped decision profile is keyed by. It runs
Algorithm 2's Python reference (the compiled kernel fixes eq. 11's rule), so its decision
time is timed on the host that runs it (``decision_s_source`` in ``run.json``).
"""

from __future__ import annotations

from dataclasses import replace

from hetroute.deployment import Deployment
from hetroute.routers.hetroute import HetRoute
from hetroute.routing.algorithm2 import SetLevelRouter
from hetroute.routing.search import enumerate_plain


class HomeGathering(SetLevelRouter):
    """Algorithm 2 with theta_{l+1} fixed at the token's home (eq. 10's fan-in goes there)."""

    def _aggregator_fn(self, layer: int, home: int):
        fns = self._agg_fns.get(("home", home))
        if fns is None:
            n = self.cost.cluster.n
            self._agg_fns[("home", home)] = fns = (lambda servers: home,
                                                   [[home] * n for _ in range(n)])
        return fns

    def _search(self, problem):
        """Algorithm 2's search, its exact enumeration without the k = 2 shortcut, which
        takes a pair on one server to gather there (true under eq. 11 only)."""
        p = self.params
        if p.set_level and problem.product_size() <= p.enum_limit:
            return enumerate_plain(problem)
        return super()._search(problem)

    def _fallback_search(self, problem, targets, theta, view):
        """Algorithm 2's emergency fallback, its choice evaluated again so that it gathers at
        the home (its all-fallback enumeration takes the same k = 2 shortcut)."""
        chosen, _ = super()._fallback_search(problem, targets, theta, view)
        return chosen, problem.evaluate(chosen)

    def spawn(self) -> "HomeGathering":
        other = super().spawn()
        other.__class__ = type(self)
        return other


class HetRouteHome(HetRoute):
    """HetRoute's placement and replica choice; every layer gathers at the home."""

    name = "hetroute-home"

    def bind(self, deployment: Deployment) -> None:
        super().bind(deployment)  # Algorithm 1 placed with the paper's rule (``place``)
        base = self.engine
        self.engine = HomeGathering(base.cost, replace(base.params, compiled=False),
                                    popularity=base.popularity)
