"""The scheduler side's bookkeeping (``gateway.vllm.plan``), driven as vLLM drives it."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from gateway.keys import Chunker
from gateway.vllm.plan import NewRequest, Planner, RunningRequest, saves_after_loads

BLOCK, CHUNK = 128, 256  # two blocks a chunk, as with vLLM's CPU block size


class Lookups:
    """A store that holds the first ``held`` chunks of whatever it is asked."""

    def __init__(self, held: int) -> None:
        self.held = held
        self.asked: list[list[int]] = []

    def __call__(self, hashes: Sequence[int]) -> int:
        self.asked.append(list(hashes))
        return min(self.held, len(hashes))


def planner(held: int = 0, seed: str = "0") -> tuple[Planner, Lookups]:
    lookups = Lookups(held)
    return Planner(CHUNK, BLOCK, seed, lookups), lookups


def test_chunk_hashes_are_the_chunkers() -> None:
    """The keys of a chunk are LMCache's prefix hashes, whoever computes them."""
    plan, lookups = planner()
    prompt = list(range(1000))
    plan.matched_tokens("r", prompt, lambda: prompt, 0)
    want = Chunker("m", 1, 0, "float32", CHUNK, seed="0").hashes(prompt)
    assert lookups.asked == [want[:3]]  # 999 tokens to spare: 3 whole chunks


def test_at_least_one_prompt_token_is_left_to_compute() -> None:
    plan, lookups = planner(held=10)
    prompt = list(range(2 * CHUNK))  # exactly two chunks
    assert plan.matched_tokens("r", prompt, lambda: prompt, 0) == CHUNK  # not 2 * CHUNK
    assert len(lookups.asked[0]) == 1


def test_a_load_covers_what_vllm_does_not_hold_and_skips_its_blocks() -> None:
    plan, _ = planner(held=3)
    prompt = list(range(900))
    # vLLM's own prefix cache holds one block (128 tokens): half of chunk 0.
    assert plan.matched_tokens("r", prompt, lambda: prompt, BLOCK) == 3 * CHUNK - BLOCK
    plan.allocated("r", 3 * CHUNK - BLOCK)
    blocks = list(range(10, 18))
    loads, saves = plan.step([NewRequest("r", blocks, 3 * CHUNK + 100)], [])
    moves = loads["r"]
    assert [m.index for m in moves] == [0, 1, 2]
    assert [m.block_ids for m in moves] == [(10, 11), (12, 13), (14, 15)]
    assert [m.skip for m in moves] == [1, 0, 0]  # block 10 is vLLM's already
    assert "r" not in saves  # the loaded chunks are in the store already


def test_chunks_are_saved_once_as_they_fill() -> None:
    plan, _ = planner()
    tokens = list(range(600))
    assert plan.matched_tokens("r", tokens[:600], lambda: tokens, 0) == 0
    plan.allocated("r", 0)
    blocks = [7, 3, 9, 1, 5]
    # Chunked prefill: 300 tokens, then the other 300.
    _, saves = plan.step([NewRequest("r", blocks, 300)], [])
    assert [(m.index, m.block_ids) for m in saves["r"]] == [(0, (7, 3))]
    _, saves = plan.step([], [RunningRequest("r", None, False, 600)])
    assert [(m.index, m.block_ids) for m in saves["r"]] == [(1, (9, 1))]
    # Decoding fills chunk 2 (tokens 512..767) once 768 have KV; a block is added on the way.
    tokens += list(range(600, 800))
    _, saves = plan.step([], [RunningRequest("r", [2], False, 700)])
    assert "r" not in saves
    _, saves = plan.step([], [RunningRequest("r", None, False, 768)])
    assert [(m.index, m.block_ids) for m in saves["r"]] == [(2, (5, 2))]
    want = Chunker("m", 1, 0, "float32", CHUNK, seed="0").hashes(tokens[:768])
    assert saves["r"][0].chunk_hash == want[2]
    _, saves = plan.step([], [RunningRequest("r", None, False, 769)])
    assert "r" not in saves  # saved once


def test_a_resumed_request_takes_its_new_block_list() -> None:
    plan, _ = planner()
    tokens = list(range(300))
    plan.matched_tokens("r", tokens, lambda: tokens, 0)
    plan.step([NewRequest("r", [1, 2, 3], 100)], [])
    _, saves = plan.step([], [RunningRequest("r", [8, 9, 4], True, 300)])
    assert [m.block_ids for m in saves["r"]] == [(8, 9)]


def test_finished_requests_are_forgotten() -> None:
    plan, _ = planner()
    tokens = list(range(300))
    plan.matched_tokens("r", tokens, lambda: tokens, 0)
    assert plan.tracked() == 1
    plan.finished("r")
    assert plan.tracked() == 0
    loads, saves = plan.step([], [RunningRequest("r", None, False, 300)])
    assert loads == saves == {}


def test_the_seed_changes_every_key() -> None:
    a, lookups_a = planner(seed="0")
    b, lookups_b = planner(seed="1")
    prompt = list(range(600))
    a.matched_tokens("r", prompt, lambda: prompt, 0)
    b.matched_tokens("r", prompt, lambda: prompt, 0)
    assert set(lookups_a.asked[0]).isdisjoint(lookups_b.asked[0])


def test_chunk_size_must_be_whole_blocks() -> None:
    with pytest.raises(ValueError, match="multiple"):
        Planner(200, BLOCK, "0", Lookups(0))


def test_a_preempted_request_loads_what_it_saved_into_its_new_blocks() -> None:
    """vLLM preempts a request (its blocks freed, its computed tokens back to 0), asks the
    connector again how many tokens it can load, and reschedules it as a resumed running
    request: the chunks it saved during its prefill are loaded into its new blocks in that
    step. vLLM counts the tokens the connector matched as loaded, so a load left unsent
    means attention over blocks nobody wrote (wrong text, no error)."""
    plan, lookups = planner()
    prompt = list(range(800))
    tokens = list(prompt)
    assert plan.matched_tokens("r", prompt, lambda: tokens, 0) == 0
    plan.allocated("r", 0)
    _, saves = plan.step([NewRequest("r", list(range(10, 17)), 800)], [])
    assert [m.index for m in saves["r"]] == [0, 1, 2]
    lookups.held = 3  # the store now holds the three chunks it saved
    tokens += [1, 2, 3]
    assert plan.matched_tokens("r", prompt, lambda: tokens, 0) == 3 * CHUNK
    plan.allocated("r", 3 * CHUNK)
    new_blocks = list(range(40, 47))
    loads, saves = plan.step([], [RunningRequest("r", new_blocks, True, 3 * CHUNK + 35)])
    assert [(m.index, m.block_ids, m.skip) for m in loads["r"]] == [
        (0, (40, 41), 0),
        (1, (42, 43), 0),
        (2, (44, 45), 0),
    ]
    assert "r" not in saves  # saved already: not again
    loads, _ = plan.step([], [RunningRequest("r", None, False, 3 * CHUNK + 36)])
    assert loads == {}  # sent once


def test_no_chunk_computed_over_a_failed_load_is_saved() -> None:
    """One step loads chunk 0 and computes chunks 1-2 on top of it: when chunk 0's load
    fails, chunks 1-2 attended to unwritten blocks and must not be stored (vLLM recomputes
    them). Another request's saves in the same step are kept."""
    plan, _ = planner(held=1)
    prompt = list(range(800))
    assert plan.matched_tokens("r", prompt, lambda: prompt, 0) == CHUNK
    plan.allocated("r", CHUNK)
    other = list(range(1000, 1600))
    plan.matched_tokens("o", other, lambda: other, 0)
    plan.allocated("o", 0)
    loads, saves = plan.step(
        [NewRequest("r", list(range(10, 17)), 800), NewRequest("o", list(range(30, 35)), 600)], []
    )
    assert [m.index for m in loads["r"]] == [0]
    assert [m.index for m in saves["r"]] == [1, 2]
    kept = saves_after_loads(loads, saves, failed_blocks={10, 11})
    assert [m.block_ids for m in kept] == [m.block_ids for m in saves["o"]]
    assert saves_after_loads(loads, saves, failed_blocks=set()) == [*saves["r"], *saves["o"]]
