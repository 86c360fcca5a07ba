"""How the event loops treat Python's collector (``testbed/collector.py``)."""

from __future__ import annotations

import gc

import pytest

from testbed.collector import GC_YOUNG, GcPauses, freeze_more, quiet_collector


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
    """What existed before the loop is not walked: a full collection inside frees the cycles
    made inside, not one that was made before (frozen), which is freed after the block."""
    import weakref

    class Node:
        pass

    gc.collect()
    old_a, old_b = Node(), Node()
    old_a.other, old_b.other = old_b, old_a
    old = weakref.ref(old_a)
    with quiet_collector():
        del old_a, old_b  # garbage now, but frozen
        for _ in range(100):  # cycles made in the loop
            a, b = Node(), Node()
            a.other, b.other = b, a
        new = weakref.ref(a)
        del a, b
        gc.collect()
        assert new() is None  # the loop's cycle is found and freed
        assert old() is not None  # the frozen one is not walked
    gc.collect()
    assert old() is None  # unfrozen with the rest: freed no later than the next collection


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


def test_freezing_more_inside_the_block_takes_what_start_up_made_and_nothing_outside():
    assert gc.get_freeze_count() == 0
    freeze_more()  # outside: Python's behaviour is kept
    assert gc.get_freeze_count() == 0
    with quiet_collector(young=None):
        first = gc.get_freeze_count()
        made = [[i] for i in range(1000)]  # the start-up's objects
        freeze_more()
        assert gc.get_freeze_count() >= first + len(made)
    assert gc.get_freeze_count() == 0
