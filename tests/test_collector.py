"""How the event loops treat Python's collector (``testbed/collector.py``)."""

from __future__ import annotations

import gc

import pytest

from testbed.collector import GC_YOUNG, GcPauses, quiet_collector


def test_the_loop_collects_young_objects_rarely_and_restores_the_collector():
    """The loops' objects die by reference count, so young collections only cost time
    (and a full one walks every record column and the set-up): the loop freezes what
    exists, raises the youngest generation's threshold and puts back the caller's
    thresholds, even on an error."""
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 7, 9)
        with quiet_collector():
            assert gc.get_threshold() == (GC_YOUNG, 7, 9) and gc.get_freeze_count() > 0
        assert gc.get_threshold() == (700, 7, 9) and gc.get_freeze_count() == 0
        with pytest.raises(RuntimeError), quiet_collector():
            raise RuntimeError("a router failed")
        assert gc.get_threshold() == (700, 7, 9) and gc.get_freeze_count() == 0
        with quiet_collector(young=None):  # an emulated worker's: freeze only
            assert gc.get_threshold() == (700, 7, 9) and gc.get_freeze_count() > 0
        assert gc.get_freeze_count() == 0
    finally:
        gc.set_threshold(*before)


def test_a_frozen_heap_leaves_a_full_collection_only_what_the_loop_made():
    """What existed before the loop is not walked: a full collection inside finds only
    the cycles made inside, and they are still freed."""
    class Node:
        pass

    with quiet_collector():
        frozen = gc.get_freeze_count()
        for _ in range(100):  # cycles made in the loop
            a, b = Node(), Node()
            a.other, b.other = b, a
        del a, b
        assert gc.collect() >= 200  # found and freed
        assert gc.get_freeze_count() == frozen


def test_pauses_count_every_collection_by_generation_while_installed():
    p = GcPauses().install()
    try:
        gc.collect(0)
        gc.collect(2)
    finally:
        p.remove()
    gc.collect(1)  # not counted: removed
    assert p.count == [1, 0, 1] and p.total_s > 0 and 0 < p.max_s <= p.total_s
    st = p.stats()
    assert st["gc_collections"] == [1, 0, 1] and st["gc_pause_ms_max"] > 0
    p.remove()  # a second removal is harmless
