"""Where a request's keys and values are: what a token's attention waits for (``engine.attention``).

Token i's attention at layer l reads the K/V of positions 0..i-1 at layer l. The paper's
per-token model (``engine.attention: independent``, the paper's world's only rule and the
hardware world's until 2026-12-08) lets each token attend wherever it resides as if they
were there. Under ``causal`` (the hardware world's default since) a token's
dense part of layer l joins its server's stream only when, for every earlier position j
of its request,

- j's dense part of layer l has ended (its K/V exist) and they are at this server: j ran
  the layer here, or they were fetched here before; or
- j's dense job of layer l is queued or running in this server's stream: a stream runs one
  step at a time and takes a layer's jobs in order of submission within a request, so j's
  step is this token's or an earlier one (a step attends with a causal mask).

Otherwise the token waits: for an earlier position still on its way to layer l, or for
the K/V computed on other servers, which its server fetches (a request to each server
holding some, answered with them; fetched K/V stay). Prompt tokens, released together,
thus move through a layer no faster than the positions before them, as a real prefill
does; a generated token fetches what the earlier positions left on other servers.

How a waiting server learns where the K/V are (``engine.kv_news``):

- ``instant``: at once, as soon as an earlier position has computed them, wherever that
  was. Nothing carries the news, so this is a lower bound (the simulator's alone).
- ``home`` (the default): a directory at the request's home server. A server tells the home which
  positions' dense parts of which layer a step computed (one message per step and home,
  none when it is the home); a token whose earlier positions are not all in its own
  server's stream, computed there or held there asks the home for the rest; the home
  answers once it has heard of all of them, with their holders, and the token's server
  fetches from those. A server still sees its own stream: a token whose missing positions
  arrive there attends without waiting for the answer.

Fetched K/V take no memory under either.

This module is the bookkeeping, with no time and no transport (the backend sends the
fetches and charges them); one ledger per request: the simulator's sees every server, each
emulated worker keeps its own (``testbed/emu/node/kv.py``, ``home`` only: no worker sees
what ``instant`` assumes).
"""

from __future__ import annotations

from typing import Any


class RequestKv:
    """One request's K/V, layer by layer, and the tokens waiting on them."""

    __slots__ = ("computed", "queued", "held", "waiting", "noticed", "asks")

    def __init__(self) -> None:
        self.computed: dict[int, dict[int, int]] = {}  # layer -> position -> server
        self.queued: dict[int, dict[int, int]] = {}  # layer -> position -> server (in its stream)
        self.held: dict[tuple[int, int], set[int]] = {}  # (layer, server) -> positions fetched
        self.waiting: dict[int, list[Any]] = {}  # layer -> tokens parked on it
        #: ``kv_news: home``: what the home has heard (layer -> position -> server) and the
        #: asks it holds until it has heard of every position they name (layer -> asks)
        self.noticed: dict[int, dict[int, int]] = {}
        self.asks: dict[int, list[Any]] = {}

    def needs(self, layer: int, position: int, server: int) -> dict[int, list[int]] | None:
        """What ``position``'s attention at ``layer`` on ``server`` lacks: None while some
        earlier position's K/V do not exist and are not coming from this server's own
        stream (wait); else the positions to fetch, by the server holding them (empty:
        attend now)."""
        comp = self.computed.get(layer, {})
        queued = self.queued.get(layer, {})
        for j in range(position - 1, -1, -1):  # the wait first, latest position down (cheap)
            if j not in comp and queued.get(j) != server:
                return None
        held = self.held.get((layer, server), ())
        fetch: dict[int, list[int]] = {}
        for j in range(position):
            s = comp.get(j)  # None: in this server's stream (the loop above saw to that)
            if s is not None and s != server and j not in held:
                fetch.setdefault(s, []).append(j)
        return fetch

    def sees_all(self, layer: int, position: int, server: int) -> bool:
        """Whether ``server`` sees every earlier position's K/V of ``layer``: ``not
        local_missing(...)``, checked from the latest position down and stopped at the first
        it lacks (a parked token is re-checked at each of its request's completions, and it is
        almost always its nearest predecessors that are still on their way)."""
        comp = self.computed.get(layer, {})
        queued = self.queued.get(layer, {})
        held = self.held.get((layer, server), ())
        for j in range(position - 1, -1, -1):
            if comp.get(j, queued.get(j)) != server and j not in held:
                return False
        return True

    def local_missing(self, layer: int, position: int, server: int) -> list[int]:
        """The earlier positions whose K/V of ``layer`` ``server`` cannot see: not in its
        stream, not computed there, not fetched there (``kv_news: home``)."""
        comp = self.computed.get(layer, {})
        queued = self.queued.get(layer, {})
        held = self.held.get((layer, server), ())
        return [j for j in range(position)
                if comp.get(j, queued.get(j)) != server and j not in held]

    def notice(self, layer: int, position: int, server: int) -> None:
        """The home hears that ``server`` computed ``position``'s K/V of ``layer``."""
        self.noticed.setdefault(layer, {})[position] = server

    def located(self, layer: int, positions: list[int]) -> dict[int, list[int]] | None:
        """Where the home knows ``positions``' K/V of ``layer`` are, by server; None while it
        has not heard of some."""
        seen = self.noticed.get(layer, {})
        out: dict[int, list[int]] = {}
        for j in positions:
            s = seen.get(j)
            if s is None:
                return None
            out.setdefault(s, []).append(j)
        return out

    def submitted(self, layer: int, position: int, server: int) -> None:
        """``position``'s dense job of ``layer`` joined ``server``'s stream."""
        self.queued.setdefault(layer, {})[position] = server

    def done(self, layer: int, position: int, server: int) -> None:
        """``position``'s dense part of ``layer`` ended on ``server``: its K/V exist there."""
        self.queued.get(layer, {}).pop(position, None)
        self.computed.setdefault(layer, {})[position] = server

    def fetched(self, layer: int, server: int, positions: list[int]) -> None:
        self.held.setdefault((layer, server), set()).update(positions)

    def park(self, layer: int, token: Any) -> None:
        self.waiting.setdefault(layer, []).append(token)

    def take_waiting(self, layer: int) -> list[Any]:
        """The tokens parked on ``layer`` (the caller checks each again, re-parking some)."""
        return self.waiting.pop(layer, [])
