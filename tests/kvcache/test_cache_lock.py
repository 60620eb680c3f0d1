"""``CacheLock``: held by one thread at a time, let go of for a stretch only by its holder."""

from __future__ import annotations

import threading

from nebula_engine.kvcache.cache_lock import CacheLock


def test_released_lets_another_thread_in_and_takes_the_lock_back():
    lock = CacheLock()
    got_in = threading.Event()

    def other():
        with lock:
            got_in.set()

    with lock:
        assert lock.held()
        thread = threading.Thread(target=other)
        thread.start()
        with lock.released():
            assert not lock.held()
            assert got_in.wait(timeout=30)
            thread.join(30)
        assert lock.held()
    assert not lock.held()


def test_released_without_holding_it_does_nothing():
    lock = CacheLock()
    with lock.released():
        assert not lock.held()
    with lock:  # still free
        pass


def test_a_thread_that_does_not_hold_it_sees_it_as_not_held():
    lock = CacheLock()
    seen = []
    with lock:
        thread = threading.Thread(target=lambda: seen.append(lock.held()))
        thread.start()
        thread.join(30)
    assert seen == [False]
