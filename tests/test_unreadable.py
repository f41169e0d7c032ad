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
