"""Start-up helpers: the garbage collector stops walking what start-up made, and still frees what serving makes."""

import gc

from moe_serve.server.core.startup import freeze_startup_heap


def test_freeze_startup_heap_hides_start_up_objects_and_still_collects_new_garbage():
    made_at_startup = [{"weights": i} for i in range(1000)]
    try:
        frozen = freeze_startup_heap()
        assert frozen == gc.get_freeze_count() >= len(made_at_startup)
        assert not any(obj is made_at_startup for obj in gc.get_objects())   # out of the collector's walk

        class Node:
            pass

        a, b = Node(), Node()
        a.other, b.other = b, a    # a cycle made while serving
        del a, b
        assert gc.collect() >= 2
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0
