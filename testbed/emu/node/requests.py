"""Requests at their home server: tokens start as the request's progress allows
(``testbed/progress.py``, the simulator's rule), finished tokens come back home
(TOKEN, final), and each request is recorded once, done or failed. A token the
home already counted is ignored if a retry delivers it twice.
"""

from __future__ import annotations

import torch

from ...progress import FINISHED, RequestProgress
from ..wire import Frame, Token


class HomeRequest(RequestProgress):
    __slots__ = ("rid", "user", "arrival", "done", "scores", "finished")

    def __init__(self, rid: int, user: int, arrival: float, prompt: int, gen: int) -> None:
        super().__init__(prompt, gen)
        self.rid, self.user, self.arrival = rid, user, arrival
        self.done = False
        self.finished: set[int] = set()  # token indices counted (a retry may deliver one twice)
        self.scores: dict[int, tuple[float, float, float]] = {}  # token -> KL, CE ref, CE run


class Requests:
    """Owns ``requests`` and ``pending_home``."""

    def _init_requests(self) -> None:
        self.home_requests = [rq for rq in self.setup.requests if rq.home == self.rank]
        self.requests: dict[int, HomeRequest] = {}
        self.pending_home = len(self.home_requests)

    def _arrive(self, rq) -> None:
        req = HomeRequest(rq.id, rq.user, rq.arrival_s, rq.prompt_tokens, rq.gen_tokens)
        self.requests[rq.id] = req
        for i in range(req.prompt):  # all at the request's arrival (model time), as the simulator
            self._start_token(req, i, rq.arrival_s)

    def _start_token(self, req: HomeRequest, index: int, t: float | None = None) -> None:
        if self.inrun is not None:
            h = self.inrun.embed(req.rid, index)
        else:
            g = torch.Generator().manual_seed(hash((self.spec.seed, req.rid, index)) & 0x7FFFFFFF)
            h = torch.randn(self.d, generator=g)
        self._begin_layer(Token(src=self.rank, request=req.rid, token=index, layer=0, seq=0,
                                home=self.rank, lam_acc=0.0, final=False), h, t)

    def _on_token(self, frame: Frame, arrival: float | None = None) -> None:
        m = frame.msg
        t = self.now() if arrival is None else (arrival - self.t0) / self.T
        rq = self.requests.get(m.request)
        if rq is None or rq.done or m.token in rq.finished:
            return
        rq.finished.add(m.token)
        if self.inrun is not None:
            rq.scores[m.token] = self.inrun.score(rq.rid, m.token, frame.tensor())
        nxt = rq.token_done(m.token, float(m.lam_acc), t)
        if nxt == FINISHED:
            self._request_done(rq, "ok", "", t)
        elif nxt is not None:
            self._start_token(rq, nxt, t)

    def _request_failed(self, rq: HomeRequest, reason: str) -> None:
        if not rq.done:
            self._request_done(rq, "failed", reason)

    def _request_done(self, rq: HomeRequest, status: str, reason: str,
                      t: float | None = None) -> None:
        rq.done = True
        if self.kv_room is not None:  # its K/V leave here now, the peers with the next STATE
            self.kv_room.free(rq.rid)
            self.kv_finished.append(rq.rid)
        t = self.now() if t is None else t
        lam_mean, lam_max = rq.lam_stats()
        self.writer.request(rq.row(rq.rid, rq.user, self.rank, rq.arrival, t, status, reason))
        if self.inrun is not None and status == "ok":
            self.inrun.write(rq, lam_mean, lam_max)
        self.decider.on_request_done(rq.rid)
        print(f"DONE {rq.rid}", flush=True)
        self.pending_home -= 1
        if self.pending_home == 0:
            print("HOMEDONE", flush=True)
