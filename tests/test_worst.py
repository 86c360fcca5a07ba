"""A worker's worst lateness samples and their instants (testbed/emu/worst.py)."""

import pytest
from hypothesis import given, strategies as st

from testbed.emu.worst import Worst

def test_keeps_the_largest_with_their_instants_in_model_ms():
    w = Worst(k=3)
    for value, at in [(0.001, 10.0), (0.050, 10.5), (0.002, 11.0), (0.145, 12.0), (0.020, 12.5)]:
        w.add(value, at)
    # T = 64 from wall instant 10.0: 2.0 s of wall is 31.25 ms of model time
    assert w.report(t0=10.0, T=64) == [[145.0, 31.25], [50.0, 7.812], [20.0, 39.062]]

def test_fewer_samples_than_k_and_none():
    assert Worst().report(0.0, 1.0) == []
    w = Worst(k=5)
    w.add(0.003, 1.0)
    assert w.report(0.0, 2.0) == [[3.0, 500.0]]
    with pytest.raises(ValueError):
        Worst(k=0)

@given(st.lists(st.floats(0, 1, allow_nan=False), max_size=200), st.integers(1, 8))
def test_equals_sorting_everything(values, k):
    w = Worst(k=k)
    for i, v in enumerate(values):
        w.add(v, float(i))
    got = [v for v, _ in w.report(0.0, 1.0)]
    assert got == [round(v * 1e3, 3) for v in sorted(values, reverse=True)[:k]]

def test_a_peer_goes_third_where_one_is_given():
    w = Worst(k=2)
    w.add(0.010, 2.0, 3)  # a frame from (or to) rank 3
    w.add(0.002, 1.0)
    w.add(1.233, 4.0, 0)
    assert w.report(t0=0.0, T=100) == [[1233.0, 40.0, 0], [10.0, 20.0, 3]]
