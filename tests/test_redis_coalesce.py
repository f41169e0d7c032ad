"""The Redis fast path's write plan (``connectors.redis.fastpath.coalesce``): a put's small
command pieces go out as one write, its payload as it is (never copied)."""

from __future__ import annotations

import os

from connectors.redis.fastpath import coalesce
from connectors.redis.resp import command, set_command


def test_small_pieces_are_joined_and_large_ones_pass_untouched() -> None:
    payload = memoryview(os.urandom(1 << 20))
    chunks = [
        command(b"MULTI"),
        command(b"GETRANGE", b"k", b"0", b"63"),
        command(b"STRLEN", b"k"),
        *set_command(b"k", [memoryview(b"\x01"), memoryview(b"head"), payload], None),
        command(b"EXEC"),
    ]
    plan = coalesce(chunks)
    assert len(plan) == 3  # head, payload, tail
    assert plan[1] is payload
    assert b"".join(bytes(c) for c in plan) == b"".join(bytes(c) for c in chunks)


def test_only_small_or_only_large() -> None:
    small = [b"a", b"bc", memoryview(b"def")]
    assert coalesce(small) == [b"abcdef"]
    large = [memoryview(os.urandom(1 << 17)), memoryview(os.urandom(1 << 17))]
    plan = coalesce(large)
    assert len(plan) == 2
    assert all(p is q for p, q in zip(plan, large, strict=True))
    assert coalesce([]) == []
