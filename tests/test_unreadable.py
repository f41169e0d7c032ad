"""``UnreadableKeys``: marks that hide keys from lookups, bounded in count and in time."""

from __future__ import annotations

from gateway.unreadable import UnreadableKeys


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_marked_key_is_hidden_until_its_time_passes_or_it_is_discarded() -> None:
    clock = _Clock()
    marks = UnreadableKeys(limit=10, ttl=5.0, clock=clock)
    marks.add("a")
    marks.add("b")
    assert marks.hide(["a", "b", "c"], [True, True, True]) == [False, False, True]
    assert marks.hide(["a"], [False]) == [False]  # absent stays absent
    marks.discard("b")
    assert marks.hide(["a", "b"], [True, True]) == [False, True]
    clock.now = 5.5
    assert marks.hide(["a", "b"], [True, True]) == [True, True]
    assert len(marks) == 0  # an expired mark is dropped when it is met


def test_the_oldest_marks_are_forgotten_past_the_limit() -> None:
    marks = UnreadableKeys(limit=3, ttl=60.0, clock=_Clock())
    for key in "abcd":
        marks.add(key)
    assert len(marks) == 3
    assert marks.hide(list("abcd"), [True] * 4) == [True, False, False, False]
    marks.add("b")  # marked again: now the newest
    marks.add("e")
    assert marks.hide(list("bcde"), [True] * 4) == [False, True, False, False]


def test_a_read_that_ends_after_a_write_of_its_key_marks_nothing() -> None:
    marks = UnreadableKeys(limit=10, ttl=60.0, clock=_Clock())
    marks.begin_read("k")  # reads the old object, which this store cannot read
    marks.written("k")  # meanwhile a put of the store's own object completes
    marks.end_read("k", True)
    assert marks.hide(["k"], [True]) == [True]  # the store's object is looked up as stored
    marks.begin_read("k")  # a later read that finds it unreadable again does mark it
    marks.end_read("k", True)
    assert marks.hide(["k"], [True]) == [False]


def test_reads_that_learn_nothing_leave_the_mark_and_a_readable_one_ends_it() -> None:
    marks = UnreadableKeys(limit=10, ttl=60.0, clock=_Clock())
    marks.add("k")
    marks.begin_read("k")
    marks.end_read("k", None)  # the backend failed: nothing learnt
    assert marks.hide(["k"], [True]) == [False]
    marks.begin_read("k")
    marks.end_read("k", False)  # read fine (another writer replaced it)
    assert marks.hide(["k"], [True]) == [True]
