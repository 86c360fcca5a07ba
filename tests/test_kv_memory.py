"""``python -m analysis kv-memory``: the most K/V a server holds at once, from the records."""

from __future__ import annotations

import pandas as pd
import pytest

from analysis.kv_memory import peaks


def _records():
    # request 0 (ends at 10): positions 0 and 2 on server 0, 1 on server 1; request 1 (ends at
    # 0.5, before any of request 0's K/V exist) on server 0; request 2 failed
    tl = pd.DataFrame({
        "request": [0, 0, 0, 1, 2],
        "token": [0, 1, 2, 0, 0],
        "layer": [0, 0, 0, 0, 0],
        "server": [0, 1, 0, 0, 1],
        "t_start": [0.5, 2.0, 4.0, 0.1, 0.0],
        "dense_s": [0.5, 1.0, 1.0, 0.1, 0.1],
    })
    rq = pd.DataFrame({"request": [0, 1, 2], "status": ["ok", "ok", "failed"],
                       "arrival_s": [0.0, 0.0, 0.0], "latency_s": [10.0, 0.5, 1.0]})
    return tl, rq


def test_a_server_holds_its_own_positions_until_the_request_ends_and_the_copies_it_needed():
    tl, rq = _records()
    own, both = peaks(tl, rq, kv_bytes=2.0, n_servers=3)
    # server 0: positions 0 and 2 of request 0 (request 1's was freed at 0.5, before them)
    assert list(own) == [4.0, 2.0, 0.0]
    # with copies: position 1 fetched to server 0 (for position 2, at 4.0) and position 0 to
    # server 1 (for position 1, at 2.0); the failed request holds nothing
    assert list(both) == [6.0, 4.0, 0.0]


def test_positions_on_one_server_need_no_copies():
    tl, rq = _records()
    tl = tl.assign(server=0)
    own, both = peaks(tl, rq, kv_bytes=1.0, n_servers=2)
    assert list(own) == list(both) == [3.0, 0.0]
    with pytest.raises(KeyError):
        peaks(tl.drop(columns="dense_s"), rq, 1.0, 2)
