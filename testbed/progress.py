"""How a request advances as its tokens finish: one rule for both backends.

Prompt tokens all start when the request arrives and may finish in any
order; the first generated token starts when the last prompt token is done,
and each later one when the one before it is done (autoregressive decoding).

Times kept for the decode metrics (testbed/metrics.py): ``first_s``, when the
prompt's last token is home (the prefill's output is the first token: time to
first token), and ``gen_done_s``, when each generated token is home (time per
output token, generated tokens per second). Both backends build their request
row here, so the two record the same columns the same way.
"""

from __future__ import annotations

import math

FINISHED = -1


class RequestProgress:
    """Token bookkeeping of one request; backends subclass it with their own fields."""

    __slots__ = ("prompt", "gen", "remaining_prompt", "next_gen", "lams", "first_s", "gen_done_s")

    def __init__(self, prompt: int, gen: int) -> None:
        self.prompt, self.gen = prompt, gen
        self.remaining_prompt = prompt
        self.next_gen = 0
        self.lams: list[float] = []  # each finished token's accumulated Lambda (eq. 8)
        self.first_s = math.nan  # the prompt's last token home
        self.gen_done_s: list[float] = []  # each generated token home, in order

    def token_done(self, index: int, lam: float, now: float) -> int | None:
        """Record token ``index``, home at time ``now``; the index of the token to start
        next, ``FINISHED`` when the request is complete, or None while prompt tokens are
        still out."""
        self.lams.append(lam)
        if index < self.prompt:
            self.remaining_prompt -= 1
            if self.remaining_prompt > 0:
                return None
            self.first_s = now
        else:
            self.gen_done_s.append(now)
        if self.next_gen < self.gen:
            self.next_gen += 1
            return self.prompt + self.next_gen - 1
        return FINISHED

    def lam_stats(self) -> tuple[float, float]:
        """(mean, max) of the finished tokens' Lambda; NaN before any finished."""
        lams = self.lams
        return (sum(lams) / len(lams), max(lams)) if lams else (math.nan, math.nan)

    def row(self, rid: int, user: int, home: int, arrival: float, now: float,
            status: str, reason: str) -> tuple:
        """The request's record (``testbed.records.REQUEST_COLUMNS`` order)."""
        return (rid, user, home, arrival, now, now - arrival, self.prompt + self.gen,
                *self.lam_stats(), status, reason, self.first_s, self.gen_done_s)
