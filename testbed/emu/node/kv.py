"""Causal attention on the emulated workers: the K/V exchange of ``engine.kv_news: home``.

The rule is ``testbed/kv.py``'s, which the simulator runs with one ledger per request
that sees every server. Here each worker keeps its own ledger of each request: what its
stream holds and computed, what it fetched, and, at the request's home, what the home has
heard (the directory) and the asks it holds until it has heard enough. ``kv_news:
instant`` needs the whole cluster's ledger, which no worker has, so the emulator runs
``home`` only (``testbed/spec.py`` says so).

Frames (``wire.py``), each sent at the model time of the event that causes it, as the
simulator schedules its messages: a step's KV_NOTICE to each home whose positions it
computed (handled at once where the step ran at the home); a waiting token's KV_ASK to
its home, answered by KV_WHERE once the home has heard of every position asked for; a
KV_FETCH to each holder, answered by KV_DATA, a data frame padded to the positions' K/V
bytes, which crosses the link (its congestion window and ACKs too) as the simulator's
``_kv_answer`` charges it. The first four are control frames, behind the data on their
link (``net.control: links``).

A token whose fetches are under way does not ask again (the simulator's rule since the
emulator's was written; before, a wake in between could ask and fetch twice).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...kv import RequestKv
from ..wire import (MAX_KV_ENTRIES, DType, Frame, KvAsk, KvData, KvFetch, KvHolder, KvNotice,
                    KvPos, KvWhere, Token, sized_frame)

EMPTY = torch.empty(0)  # KV_DATA's payload: its bytes are the padding


@dataclass
class _Parked:
    """A token waiting at this server for its request's earlier K/V of its layer."""

    tok: Token
    h: torch.Tensor
    t_layer: float  # model time the layer began here (its record's)
    asked: bool = False  # an ask to the home is out, unanswered
    pending: int = 0  # fetches out, their K/V not in yet


class KvExchange:
    """Owns ``kv_ledgers``, ``kv_parked`` and the step's notices (``_kv_out``)."""

    def _init_kv(self) -> None:
        eng = self.spec.engine
        self.causal = self.hardware and eng.attention == "causal"
        self.kv_ledgers: dict[int, RequestKv] = {}
        #: (request, layer, position) -> a token waiting here (the ledger's ``waiting`` lists
        #: the order to check them in)
        self.kv_parked: dict[tuple[int, int, int], _Parked] = {}
        self._kv_out: dict[int, list[KvPos]] = {}  # home -> what the running step computed
        self.kv_bytes = self.setup.shape.kv_bytes_per_token
        if self.causal:
            self.stats.update(kv_waits=0, kv_asks=0, kv_notices=0, kv_fetches=0, kv_bytes=0)

    def _kv(self, rid: int) -> RequestKv:
        kv = self.kv_ledgers.get(rid)
        if kv is None:
            kv = self.kv_ledgers[rid] = RequestKv()
        return kv

    def _attend(self, tok: Token, h: torch.Tensor, t_layer: float, t: float) -> None:
        """Queue the token's dense part at model time ``t`` once this server sees every
        earlier position's K/V of its layer; else park it (each check that finds some
        missing parks it again, as the simulator's ``_attend_home``) and ask the home."""
        rid, index, layer = tok.request, tok.token, tok.layer
        kv = self._kv(rid)
        key = (rid, layer, index)
        if kv.sees_all(layer, index, self.rank):
            self.kv_parked.pop(key, None)
            kv.submitted(layer, index, self.rank)
            self._submit_dense(tok, h, t_layer, t)
            self._kv_wake(rid, layer, t)
            return
        p = self.kv_parked.get(key)
        if p is None:
            p = self.kv_parked[key] = _Parked(tok, h, t_layer)
        kv.park(layer, index)
        self.stats["kv_waits"] += 1
        if p.asked or p.pending:
            return
        p.asked = True
        self.stats["kv_asks"] += 1
        missing = kv.local_missing(layer, index, self.rank)
        self._send(tok.home, Frame(KvAsk(self.rank, rid, index, layer, tok.seq, tuple(missing))),
                   at=t)

    def _kv_wake(self, rid: int, layer: int, t: float) -> None:
        """Check again the tokens parked on ``layer`` of ``rid`` (some park again)."""
        for index in self._kv(rid).take_waiting(layer):
            p = self.kv_parked.get((rid, layer, index))
            if p is not None:  # not attended since it parked
                self._attend(p.tok, p.h, p.t_layer, t)

    def _kv_done(self, tok: Token, t: float) -> None:
        """The token's dense part of its layer ended here at ``t``: its K/V exist here."""
        rid, layer = tok.request, tok.layer
        self._kv(rid).done(layer, tok.token, self.rank)
        self._kv_out.setdefault(tok.home, []).append(KvPos(rid, layer, tok.token))
        self._kv_wake(rid, layer, t)

    def _kv_flush(self, t: float) -> None:
        """A step's notices, one frame per home (its own home's at once)."""
        out, self._kv_out = self._kv_out, {}
        for home, items in out.items():
            if home == self.rank:
                self._on_kv_notice(KvNotice(self.rank, tuple(items)), t)
                continue
            self.stats["kv_notices"] += 1
            for i in range(0, len(items), MAX_KV_ENTRIES):
                self._send(home, Frame(KvNotice(self.rank, tuple(items[i:i + MAX_KV_ENTRIES]))), at=t)

    # -- frames --------------------------------------------------------------------
    def _on_kv(self, m, arrival: float) -> None:
        t = (arrival - self.t0) / self.T
        if isinstance(m, KvNotice):
            self._on_kv_notice(m, t)
        elif type(m) is KvAsk:
            kv = self._kv(m.request)
            where = kv.located(m.layer, list(m.positions))
            if where is None:  # held until the home has heard of every position
                kv.asks.setdefault(m.layer, []).append(m)
            else:
                self._kv_tell(m, where, t)
        elif isinstance(m, KvWhere):
            self._on_kv_where(m, t)
        elif type(m) is KvFetch:  # the holder sends the K/V asked for
            nbytes = len(m.positions) * self.kv_bytes
            data = KvData(self.rank, m.request, m.token, m.layer, m.seq, m.positions,
                          dtype=DType.FLOAT32, shape=(0,))
            self.stats["kv_fetches"] += 1
            self.stats["kv_bytes"] += nbytes
            self._send(m.src, sized_frame(data, EMPTY, nbytes), at=t,
                       hold_n=nbytes / self.wire_bytes)
        elif isinstance(m, KvData):
            self._kv(m.request).fetched(m.layer, self.rank, list(m.positions))
            if self.kv_room is not None:  # the copies take room here (testbed/kv_spill.py)
                self.kv_room.write(m.request, self._prio(m.request), len(m.positions))
            p = self._kv_parked_token(m)
            if p is not None and p.pending:
                p.pending -= 1
                if not p.pending:
                    self._attend(p.tok, p.h, p.t_layer, t)

    def _kv_parked_token(self, m) -> _Parked | None:
        p = self.kv_parked.get((m.request, m.layer, m.token))
        return p if p is not None and p.tok.seq == m.seq else None

    def _on_kv_notice(self, m: KvNotice, t: float) -> None:
        """The home hears what a step computed; held asks now fully known are answered."""
        touched: dict[tuple[int, int], None] = {}  # in the order heard
        for e in m.entries:
            kv = self._kv(e.request)
            kv.notice(e.layer, e.position, m.src)
            if kv.asks.get(e.layer):
                touched[e.request, e.layer] = None
        for rid, layer in touched:
            kv = self.kv_ledgers[rid]
            for ask in kv.asks.pop(layer):
                where = kv.located(layer, list(ask.positions))
                if where is None:
                    kv.asks.setdefault(layer, []).append(ask)
                else:
                    self._kv_tell(ask, where, t)

    def _kv_tell(self, ask: KvAsk, where: dict[int, list[int]], t: float) -> None:
        holders = tuple(KvHolder(s, j) for j, s in sorted((j, s) for s, ps in where.items()
                                                           for j in ps))
        self._send(ask.src, Frame(KvWhere(self.rank, ask.request, ask.token, ask.layer, ask.seq,
                                          holders)), at=t)

    def _on_kv_where(self, m: KvWhere, t: float) -> None:
        """The home's answer: fetch what this server does not hold yet."""
        p = self._kv_parked_token(m)
        if p is None:  # attended meanwhile
            return
        p.asked = False
        held = self._kv(m.request).held.get((m.layer, self.rank), ())
        need: dict[int, list[int]] = {}
        for srv, j in m.holders:
            if srv != self.rank and j not in held:
                need.setdefault(srv, []).append(j)
        if not need:
            self._attend(p.tok, p.h, p.t_layer, t)
            return
        p.pending = len(need)
        for srv, positions in need.items():
            self._send(srv, Frame(KvFetch(self.rank, m.request, m.token, m.layer, m.seq,
                                          tuple(positions))), at=t)
