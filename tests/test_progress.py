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
        nxt = rp.token_done(tok, 0.1 * tok, float(i))
        if i < prompt - 1:
            assert nxt is None  # decoding waits for the whole prompt
        else:
            last = nxt
    while last != FINISHED:
        assert last == prompt + len(started)  # the next generated token, in order
        started.append(last)
        last = rp.token_done(last, 1.0, float(prompt + len(started)))
    assert len(started) == gen and len(rp.lams) == prompt + gen
    mean, mx = rp.lam_stats()
    assert mx == max(rp.lams) and math.isclose(mean, sum(rp.lams) / len(rp.lams))
    # the prompt's last token home is the first token; then one time per generated token
    assert rp.first_s == prompt - 1
    assert rp.gen_done_s == [float(prompt + 1 + i) for i in range(gen)]
    row = rp.row(5, 6, 7, 0.5, 99.0, "ok", "")
    assert row[:7] == (5, 6, 7, 0.5, 99.0, 98.5, prompt + gen) and row[-2:] == (prompt - 1, rp.gen_done_s)


def test_no_finished_token_gives_nan_lambda():
    assert all(math.isnan(v) for v in RequestProgress(3, 0).lam_stats())


def test_decode_metrics_count_generated_tokens_inside_the_window():
    import pandas as pd

    from testbed.metrics import decode_metrics
    # request 0 arrived before the window, its tokens straddle it; request 1 is prompt-only
    rq = pd.DataFrame({"arrival_s": [0.5, 1.2], "first_s": [0.9, 1.5], "done_s": [2.7, 1.5],
                       "latency_s": [2.2, 0.3], "gen_done_s": [[1.1, 1.9, 2.7], []]})
    m = decode_metrics(rq.iloc[1:], rq, warmup_s=1.0, duration_s=2.0)
    assert m["gen_tok_s"] == 2.0  # 1.1 and 1.9 are inside [1, 2); 2.7 is not
    assert math.isclose(m["ttft_ms"], 300.0) and math.isnan(m["tpot_ms"])  # no measured decode
    m = decode_metrics(rq, rq, warmup_s=0.0, duration_s=3.0)
    assert math.isclose(m["tpot_ms"], (2.7 - 0.9) / 3 * 1e3)
    assert math.isclose(m["window_x_latency"], 3.0 / 1.25)
    # a request that failed after two tokens home still produced them; a row written
    # before the decode columns existed (NaN) counts nothing; no completed request in
    # the window still leaves the tokens that reached home in it
    failed = pd.DataFrame({"arrival_s": [0.2, 0.3], "first_s": [0.4, float("nan")],
                           "done_s": [1.6, float("nan")], "latency_s": [1.4, float("nan")],
                           "gen_done_s": [[1.2, 1.5], float("nan")]})
    both = pd.concat([rq, failed], ignore_index=True)
    m = decode_metrics(rq.iloc[:0], both, warmup_s=1.0, duration_s=2.0)
    assert m["gen_tok_s"] == 4.0 and math.isnan(m["ttft_ms"]) and math.isnan(m["tpot_ms"])
