"""Residency strategies: which replicas of one server are in GPU memory right now.

A router hands the backend one ``Residency`` per server (``Router.residency``). Both
backends query it the same way, whatever the router:

- ``is_gpu(replica)``: the tier of a replica of that server now (the step scheduler
  charges a GPU-CPU load for a CPU-tier replica, and the server's own decider admits
  its belief of that cost);
- ``on_execute(replica, loaded)``: the server starts a batch of the replica; ``loaded``
  if it paid the load (a miss);
- ``on_prefetched(replica)``: a prefetch copy of the replica into the server's GPU
  (an ``Assignment.prefetch``) finished.

``StaticTiers`` is the deployment's fixed tiers (every placement-based router);
``OnlineCache`` is the base of caches whose content changes at run time (MoE-Infinity's
expert cache). A decider sees its own server's residency live and every other server's
static tier only (a real server cannot read a peer's cache); the token-layer core
enforces that.
"""

from __future__ import annotations

import abc

from .deployment import Deployment


class Residency(abc.ABC):
    """The GPU tier of one server's replicas, as the backend and that server's decider see it."""

    @abc.abstractmethod
    def is_gpu(self, replica: int) -> bool:
        """Whether ``replica`` (a replica of this server) is in GPU memory now."""

    def on_execute(self, replica: int, loaded: bool) -> None:
        """The server starts a batch of ``replica``; ``loaded`` if it paid the GPU-CPU load."""

    def on_prefetched(self, replica: int) -> None:
        """A prefetch copy of ``replica`` into this server's GPU finished."""


class StaticTiers(Residency):
    """The tiers the deployment fixed offline; executions and prefetches change nothing."""

    def __init__(self, deployment: Deployment) -> None:
        self.gpu = [r.gpu for r in deployment.replicas]
        self.is_gpu = self.gpu.__getitem__  # type: ignore[method-assign]  # hot path: a list read

    def is_gpu(self, replica: int) -> bool:  # shadowed per instance by the list read above
        return self.gpu[replica]


class OnlineCache(Residency):
    """A GPU cache whose content changes at run time: insert on a miss (``on_execute``
    with ``loaded``) or a finished prefetch, evict by the cache's own policy."""

    @abc.abstractmethod
    def on_execute(self, replica: int, loaded: bool) -> None: ...

    @abc.abstractmethod
    def on_prefetched(self, replica: int) -> None: ...
