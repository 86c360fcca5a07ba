"""The request-progress rule both backends share (testbed/progress.py)."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from testbed.progress import FINISHED, RequestProgress


@given(st.integers(1, 40), st.integers(0, 8), st.randoms(use_true_random=False))
def test_prompt_in_any_order_then_decode_one_at_a_time(prompt, gen, rnd):
    rp = RequestProgress(prompt, gen)
    order = list(range(prompt))
    rnd.shuffle(order)
    started = []
    for i, tok in enumerate(order):
        nxt = rp.token_done(tok, 0.1 * tok)
        if i < prompt - 1:
            assert nxt is None  # decoding waits for the whole prompt
        else:
            last = nxt
    while last != FINISHED:
        assert last == prompt + len(started)  # the next generated token, in order
        started.append(last)
        last = rp.token_done(last, 1.0)
    assert len(started) == gen and len(rp.lams) == prompt + gen
    mean, mx = rp.lam_stats()
    assert mx == max(rp.lams) and math.isclose(mean, sum(rp.lams) / len(rp.lams))


def test_no_finished_token_gives_nan_lambda():
    assert all(math.isnan(v) for v in RequestProgress(3, 0).lam_stats())
