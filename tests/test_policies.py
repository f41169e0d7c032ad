"""Eviction policies: scripted eviction orders, skipping, and random-operation invariants."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.errors import ConfigError
from gateway.policies import (
    POLICY_NAMES,
    EvictionPolicy,
    FIFOPolicy,
    LFUPolicy,
    LRUPolicy,
    MRUPolicy,
    S3FIFOPolicy,
    make_policy,
)


def drain(policy: EvictionPolicy[Any]) -> list[Any]:
    """Every key in the order repeated victim() calls return them, emptying the policy."""
    order = []
    while (key := policy.victim()) is not None:
        order.append(key)
    return order


def insert_all(policy: EvictionPolicy[Any], keys: str, size: int = 1) -> None:
    for key in keys:
        policy.insert(key, size)


class ByteCache:
    """The minimal cache a tier builds on a policy: store sizes, evict while over capacity."""

    def __init__(self, policy: EvictionPolicy[str], capacity_bytes: int) -> None:
        self.policy = policy
        self.capacity_bytes = capacity_bytes
        self.sizes: dict[str, int] = {}
        self.evicted: list[str] = []

    def put(self, key: str, size: int) -> None:
        self.sizes[key] = size
        self.policy.insert(key, size)
        while sum(self.sizes.values()) > self.capacity_bytes:
            victim = self.policy.victim()
            assert victim is not None
            del self.sizes[victim]
            self.evicted.append(victim)

    def get(self, key: str) -> bool:
        if key in self.sizes:
            self.policy.touch(key)
            return True
        return False


# --- scripted orders -------------------------------------------------------------------------


def test_lru_evicts_least_recently_touched() -> None:
    policy: LRUPolicy[str] = LRUPolicy()
    insert_all(policy, "abc")
    policy.touch("a")
    assert policy.keys_in_eviction_order() == ["b", "c", "a"]
    assert drain(policy) == ["b", "c", "a"]


def test_mru_evicts_most_recently_touched() -> None:
    policy: MRUPolicy[str] = MRUPolicy()
    insert_all(policy, "abc")
    policy.touch("a")
    assert policy.keys_in_eviction_order() == ["a", "c", "b"]
    assert drain(policy) == ["a", "c", "b"]


def test_fifo_evicts_in_insertion_order_regardless_of_touches() -> None:
    policy: FIFOPolicy[str] = FIFOPolicy()
    insert_all(policy, "abc")
    policy.touch("a")
    policy.touch("a")
    policy.touch("b")
    assert policy.keys_in_eviction_order() == ["a", "b", "c"]
    assert drain(policy) == ["a", "b", "c"]


def test_lfu_evicts_least_frequent_then_least_recent() -> None:
    policy: LFUPolicy[str] = LFUPolicy()
    insert_all(policy, "abcd")
    policy.touch("a")  # a: 2
    policy.touch("b")  # b: 2, touched after a
    policy.touch("c")
    policy.touch("c")  # c: 3
    # d has frequency 1; a and b tie at 2 and a was used less recently.
    assert policy.keys_in_eviction_order() == ["d", "a", "b", "c"]
    assert [policy.frequency(key) for key in "abcd"] == [2, 2, 3, 1]
    assert drain(policy) == ["d", "a", "b", "c"]


def test_lfu_overwrite_resets_frequency_to_one() -> None:
    policy: LFUPolicy[str] = LFUPolicy()
    insert_all(policy, "ab")
    for _ in range(3):
        policy.touch("a")
    policy.touch("b")
    policy.insert("a", 1)
    assert policy.frequency("a") == 1
    assert drain(policy) == ["a", "b"]


def test_lfu_frequency_buckets_survive_removal_of_the_least_frequent() -> None:
    policy: LFUPolicy[str] = LFUPolicy()
    insert_all(policy, "abc")
    policy.touch("b")
    policy.touch("c")
    policy.touch("c")
    policy.remove("a")  # empties the frequency-1 bucket
    assert policy.keys_in_eviction_order() == ["b", "c"]
    policy.insert("d", 1)
    assert drain(policy) == ["d", "b", "c"]


def test_s3fifo_one_hit_wonders_leave_first_and_a_hit_key_is_promoted() -> None:
    # Capacity 100 bytes: S's share is 10 bytes, so S holding any 10-byte key is "full".
    policy: S3FIFOPolicy[str] = S3FIFOPolicy(100)
    for key in "abc":
        policy.insert(key, 10)
    policy.touch("b")
    assert policy.victim() == "a"
    assert policy.in_ghost("a")
    # b was hit while in S: it moves to M, and c, a one-hit wonder, is the victim.
    assert policy.victim() == "c"
    assert policy.in_main("b")
    assert policy.victim() == "b"
    assert policy.victim() is None


def test_s3fifo_key_hit_twice_survives_a_scan_that_flushes_lru() -> None:
    def run_scan(policy: EvictionPolicy[str]) -> ByteCache:
        cache = ByteCache(policy, capacity_bytes=100)
        cache.put("hot", 10)
        assert cache.get("hot")
        assert cache.get("hot")
        for index in range(50):
            cache.put(f"scan-{index}", 10)
        return cache

    s3fifo_cache = run_scan(S3FIFOPolicy(100))
    assert "hot" in s3fifo_cache.sizes
    assert "hot" not in s3fifo_cache.evicted
    # The scan keys themselves left in arrival order: S filtered them out one by one.
    assert s3fifo_cache.evicted == [f"scan-{index}" for index in range(41)]

    lru_cache = run_scan(LRUPolicy())
    assert "hot" in lru_cache.evicted


def test_s3fifo_ghost_hit_goes_straight_to_main() -> None:
    policy: S3FIFOPolicy[str] = S3FIFOPolicy(100)
    for key in "ab":
        policy.insert(key, 10)
    assert policy.victim() == "a"
    assert policy.in_ghost("a")
    policy.insert("a", 10)
    assert policy.in_main("a")
    assert not policy.in_small("a")
    assert not policy.in_ghost("a")
    policy.insert("c", 10)
    assert policy.in_small("c")


def test_s3fifo_main_gives_hit_keys_another_lap() -> None:
    # Drain once so every key is in the ghost, then reinsert: all land in M.
    policy: S3FIFOPolicy[str] = S3FIFOPolicy(1000)
    for key in "xyz":
        policy.insert(key, 10)
    assert drain(policy) == ["x", "y", "z"]
    for key in "xyz":
        policy.insert(key, 10)  # ghost hits: all in M
    assert all(policy.in_main(key) for key in "xyz")
    policy.touch("x")
    policy.touch("x")
    policy.touch("y")
    # x and y are reinserted behind z; y spends its single hit before x spends its two.
    assert policy.keys_in_eviction_order() == ["z", "y", "x"]
    assert drain(policy) == ["z", "y", "x"]


def test_s3fifo_frequency_is_capped_at_three() -> None:
    policy: S3FIFOPolicy[str] = S3FIFOPolicy(1000)
    insert_all(policy, "ab", size=10)
    drain(policy)
    insert_all(policy, "ab", size=10)  # both in M
    for _ in range(10):
        policy.touch("a")
    for _ in range(3):
        policy.touch("b")
    # Capped at 3, a's ten hits buy no more laps than b's three: a, older, still goes first.
    assert drain(policy) == ["a", "b"]


def test_s3fifo_ghost_is_bounded_by_the_most_keys_held() -> None:
    policy: S3FIFOPolicy[str] = S3FIFOPolicy(100)
    cache = ByteCache(policy, capacity_bytes=100)
    for index in range(200):
        cache.put(f"k{index}", 10)
    # Ten 10-byte keys fit, plus the one being inserted before its eviction round.
    assert len(policy._ghost) == 11
    assert policy.in_ghost("k179")  # k190..k199 are held; k179..k189 remembered
    assert not policy.in_ghost("k178")


def test_s3fifo_accounts_bytes_per_queue() -> None:
    policy: S3FIFOPolicy[str] = S3FIFOPolicy(100)
    policy.insert("a", 30)
    policy.insert("b", 20)
    assert (policy.small_bytes, policy.main_bytes) == (50, 0)
    policy.touch("a")
    assert policy.victim() == "b"  # a promoted on the way
    assert (policy.small_bytes, policy.main_bytes) == (0, 30)
    policy.insert("a", 7)  # overwrite: remove + insert, back into S
    assert (policy.small_bytes, policy.main_bytes) == (7, 0)
    policy.remove("a")
    assert (policy.small_bytes, policy.main_bytes) == (0, 0)


# --- skipping non-evictable keys ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected_victim", "order_after"),
    [
        ("lru", "b", ["a", "c"]),
        ("fifo", "b", ["a", "c"]),
        ("mru", "b", ["c", "a"]),
        ("lfu", "b", ["a", "c"]),
    ],
)
def test_skipped_keys_keep_their_place(
    name: str, expected_victim: str, order_after: list[str]
) -> None:
    policy = make_policy(name, 100)
    insert_all(policy, "abc")
    # For MRU the newest key c is the natural victim; pin c there and a elsewhere.
    pinned = {"c"} if name == "mru" else {"a"}
    assert policy.victim(lambda key: key not in pinned) == expected_victim
    assert policy.keys_in_eviction_order() == order_after
    assert len(policy) == 2


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_victim_is_none_when_nothing_is_evictable(name: str) -> None:
    policy = make_policy(name, 100)
    for key in "abcd":
        policy.insert(key, 10)
    policy.touch("a")
    assert policy.victim(lambda key: False) is None
    assert len(policy) == 4
    assert all(key in policy for key in "abcd")


def test_s3fifo_skips_pinned_keys_in_both_queues() -> None:
    policy: S3FIFOPolicy[str] = S3FIFOPolicy(100)
    insert_all(policy, "ab", size=10)
    drain(policy)
    insert_all(policy, "ab", size=10)  # a, b in M via the ghost
    insert_all(policy, "cd", size=10)  # c, d in S
    policy.touch("b")
    policy.touch("b")
    pinned = {"a", "c", "d"}
    # S is over its share but fully pinned, so M is scanned: a is pinned, b spends its hits.
    assert policy.victim(lambda key: key not in pinned) == "b"
    assert policy.victim(lambda key: key not in pinned) is None
    assert sorted(drain(policy)) == ["a", "c", "d"]


# --- remove, overwrite, len, contains ---------------------------------------------------------


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_remove_touch_absent_keys_are_no_ops(name: str) -> None:
    policy = make_policy(name, 100)
    policy.remove("missing")
    policy.touch("missing")
    assert len(policy) == 0
    assert policy.victim() is None
    assert policy.victim(lambda key: True) is None
    assert policy.keys_in_eviction_order() == []


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_len_contains_remove_and_overwrite(name: str) -> None:
    policy = make_policy(name, 100)
    insert_all(policy, "abc", size=10)
    policy.insert("a", 10)  # overwrite: still one entry
    assert len(policy) == 3
    assert "a" in policy
    assert "z" not in policy
    assert 42 not in policy
    policy.remove("b")
    assert len(policy) == 2
    assert "b" not in policy
    assert sorted(drain(policy)) == ["a", "c"]
    assert len(policy) == 0


@pytest.mark.parametrize(("name", "order"), [("lru", ["b", "a"]), ("fifo", ["b", "a"])])
def test_overwrite_counts_as_a_new_insert(name: str, order: list[str]) -> None:
    policy = make_policy(name, 100)
    insert_all(policy, "ab")
    policy.insert("a", 1)
    assert drain(policy) == order


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_negative_size_is_rejected(name: str) -> None:
    with pytest.raises(ValueError, match="size"):
        make_policy(name, 100).insert("a", -1)


# --- make_policy ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "policy_type"),
    [
        ("lru", LRUPolicy),
        ("LFU", LFUPolicy),
        ("Fifo", FIFOPolicy),
        ("mru", MRUPolicy),
        (" S3FIFO ", S3FIFOPolicy),
    ],
)
def test_make_policy_is_case_insensitive(name: str, policy_type: type[Any]) -> None:
    policy = make_policy(name, 1000)
    assert isinstance(policy, policy_type)
    assert isinstance(policy, EvictionPolicy)
    assert policy.name == name.strip().lower()


def test_make_policy_sizes_the_small_queue_from_the_capacity() -> None:
    policy = make_policy("s3fifo", 1000)
    assert isinstance(policy, S3FIFOPolicy)
    assert policy.small_target_bytes == 100


def test_make_policy_unknown_name_lists_the_valid_ones() -> None:
    with pytest.raises(ConfigError, match="arc") as raised:
        make_policy("arc", 100)
    for name in POLICY_NAMES:
        assert name in str(raised.value)


def test_make_policy_rejects_negative_capacity() -> None:
    with pytest.raises(ConfigError, match="capacity"):
        make_policy("lru", -1)


def test_policy_names_are_all_buildable() -> None:
    assert set(POLICY_NAMES) == {"lru", "lfu", "fifo", "mru", "s3fifo"}
    assert [make_policy(name, 10).name for name in POLICY_NAMES] == list(POLICY_NAMES)


# --- random operations against reference models --------------------------------------------------

KEYS = "abcdef"
operations = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.sampled_from(KEYS), st.integers(0, 40)),
        st.tuples(st.just("touch"), st.sampled_from(KEYS)),
        st.tuples(st.just("remove"), st.sampled_from(KEYS)),
        st.tuples(st.just("victim"), st.frozensets(st.sampled_from(KEYS), max_size=4)),
    ),
    max_size=60,
)
random_settings = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


class ReferenceOrder:
    """Slow, obviously right eviction order for the four exact policies.

    Each key carries (frequency, tick of last use, tick of insert); the policy's order is a sort.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.clock = 0
        self.state: dict[Hashable, tuple[int, int, int]] = {}

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def insert(self, key: Hashable) -> None:
        now = self._tick()
        self.state[key] = (1, now, now)

    def touch(self, key: Hashable) -> None:
        if key in self.state:
            frequency, _, inserted = self.state[key]
            self.state[key] = (frequency + 1, self._tick(), inserted)

    def order(self) -> list[Hashable]:
        sort_keys: dict[str, Callable[[tuple[int, int, int]], tuple[int, ...]]] = {
            "lru": lambda entry: (entry[1],),
            "mru": lambda entry: (-entry[1],),
            "fifo": lambda entry: (entry[2],),
            "lfu": lambda entry: (entry[0], entry[1]),
        }
        by = sort_keys[self.name]
        return sorted(self.state, key=lambda key: by(self.state[key]))


def evictable_outside(pinned: frozenset[str]) -> Callable[[str], bool]:
    return lambda key: key not in pinned


def run_random_operations(name: str, ops: list[tuple[Any, ...]]) -> None:
    policy = make_policy(name, 100)
    sizes: dict[str, int] = {}
    reference = ReferenceOrder(name) if name != "s3fifo" else None
    for op in ops:
        if op[0] == "insert":
            _, key, size = op
            policy.insert(key, size)
            sizes[key] = size
            if reference:
                reference.insert(key)
        elif op[0] == "touch":
            policy.touch(op[1])
            if reference:
                reference.touch(op[1])
        elif op[0] == "remove":
            policy.remove(op[1])
            sizes.pop(op[1], None)
            if reference:
                reference.state.pop(op[1], None)
        else:
            pinned: frozenset[str] = op[1]
            expected_order = reference.order() if reference else None
            victim = policy.victim(evictable_outside(pinned))
            if victim is None:
                assert set(sizes) <= pinned, "None although an evictable key was present"
            else:
                assert victim in sizes, "victim was not a present key"
                assert victim not in pinned, "victim was a non-evictable key"
                assert victim not in policy
                del sizes[victim]
                if reference:
                    assert expected_order is not None
                    assert victim == next(k for k in expected_order if k not in pinned)
                    del reference.state[victim]
        assert len(policy) == len(sizes)
        assert all(key in policy for key in sizes)
        assert all(key not in policy for key in KEYS if key not in sizes)
        if reference:
            assert policy.keys_in_eviction_order() == reference.order()
        if isinstance(policy, S3FIFOPolicy):
            assert policy.small_bytes + policy.main_bytes == sum(sizes.values())
            assert len(policy._ghost) <= policy._peak_keys
            assert all(not policy.in_ghost(key) for key in sizes)
    order = policy.keys_in_eviction_order()
    assert sorted(order) == sorted(sizes)
    assert drain(policy) == order


@pytest.mark.parametrize("name", POLICY_NAMES)
@random_settings
@given(ops=operations)
def test_random_operations_keep_invariants(name: str, ops: list[tuple[Any, ...]]) -> None:
    run_random_operations(name, ops)
