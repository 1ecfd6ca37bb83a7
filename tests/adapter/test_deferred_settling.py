"""Deferred draft context under a moving batch: `DDTreeProposer.store_deferred_context` called as the
runner calls it (every row before a draft pass; the rows in the freed requests' KV blocks when requests
finish or are preempted) lets every draft pass read exactly its requests' context, while the rows of
running requests stay deferred across arrivals, finishes and preemptions.

The check runs the real proposer methods against a small simulation of vLLM's KV block manager with
prefix caching (blocks cached by the hash of their token prefix once scheduled full, a prefix hit never
covering the last prompt token, freed blocks reused oldest first and a cached one evicted on reuse) and
a draft KV cache written only by store passes: a slot's content is the token prefix it was computed
from, and a draft pass reads every position its requests have computed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_ddtree.vllm.v1 import proposer as proposer_module
from vllm_ddtree.vllm.deferred_context import DeferredContext, rows_in_blocks
from vllm_ddtree.vllm.v1.proposer import DDTreeProposer


@dataclass
class Request:
    tokens: list[int]
    """Prompt, then one token per decode step."""
    max_tokens: int
    table: list[int] = field(default_factory=list)
    computed: int = 0


class BlockPool:
    """vLLM's KV blocks with prefix caching, reduced to what decides which block a slot lands in."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool) -> None:
        self.block_size, self.prefix_caching = block_size, prefix_caching
        self.free = list(range(num_blocks))  # oldest first
        self.refs = [0] * num_blocks
        self.cached: dict[tuple[int, ...], int] = {}  # token prefix ending a full block -> block
        self.key_of: dict[int, tuple[int, ...]] = {}

    def hits(self, request: Request) -> list[int]:
        """The cached blocks a new request reuses (never its last token's: vLLM recomputes it)."""
        blocks = []
        if self.prefix_caching:
            for end in range(self.block_size, len(request.tokens), self.block_size):
                block = self.cached.get(tuple(request.tokens[:end]))
                if block is None:
                    break
                blocks.append(block)
        return blocks

    def take(self, block: int) -> None:
        if self.refs[block] == 0:
            self.free.remove(block)
        self.refs[block] += 1

    def allocate(self) -> int | None:
        if not self.free:
            return None
        block = self.free.pop(0)
        key = self.key_of.pop(block, None)
        if key is not None:  # evicted: its prefix no longer hits
            del self.cached[key]
        self.refs[block] = 1
        return block

    def cache_full_blocks(self, request: Request, computed: int) -> None:
        if self.prefix_caching:
            for index in range(computed // self.block_size):
                key = tuple(request.tokens[: (index + 1) * self.block_size])
                if key not in self.cached and request.table[index] not in self.key_of:
                    self.cached[key], self.key_of[request.table[index]] = request.table[index], key

    def release(self, request: Request) -> None:
        for block in reversed(request.table):  # tail first, as vLLM frees them
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free.append(block)
        request.table, request.computed = [], 0


def bare_proposer(block_size: int, prefix_caching: bool, draft_cache: dict[int, float], passes: list[int]) -> DDTreeProposer:
    """The proposer's context bookkeeping without a model: a store pass writes each row's state (the id of
    its token prefix) into `draft_cache` at its slot and records its number of rows in `passes`."""
    drafter = object.__new__(DDTreeProposer)
    drafter._deferred, drafter.block_size, drafter._prefix_caching = DeferredContext(), block_size, prefix_caching

    def store(states: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        assert len(set(slots.tolist())) == slots.numel(), "a pass writing one slot twice writes it in no defined order"
        passes.append(int(slots.numel()))
        for state, slot in zip(states[:, 0].tolist(), slots.tolist()):
            draft_cache[slot] = state

    drafter._store_context = store  # type: ignore[method-assign]
    return drafter


def held_slots(drafter: DDTreeProposer) -> torch.Tensor:
    """The slots of the rows the drafter holds (removed rows left out), in order."""
    slots = drafter._deferred.indices()[1] if drafter._deferred.rows else torch.zeros(0, dtype=torch.int32)
    return slots[slots >= 0].clone()


@st.composite
def workloads(draw):
    """Block size, prefix caching, KV blocks, the requests (prompts from a few shared prefixes, so prefix
    hits happen), per step the arrivals and an event (a finish check, a preemption, nothing) and whether
    the step drafts, and the deferred-bytes limit (in rows)."""
    block_size = draw(st.sampled_from([1, 2, 4]))
    prefixes = [[draw(st.integers(0, 3)) for _ in range(draw(st.integers(0, 9)))] for _ in range(2)]
    requests = []
    for _ in range(draw(st.integers(1, 7))):
        prompt = draw(st.sampled_from(prefixes)) + [draw(st.integers(0, 3)) for _ in range(draw(st.integers(1, 6)))]
        requests.append((prompt, draw(st.integers(1, 9))))
    steps = draw(st.lists(st.tuples(st.integers(0, 2), st.sampled_from(["none", "none", "preempt"]), st.booleans()),
                          min_size=1, max_size=40))
    return block_size, draw(st.booleans()), draw(st.integers(6, 40)), requests, steps, draw(st.sampled_from([3, 2**40]))


@settings(max_examples=150, deadline=None)
@given(workloads(), st.integers(0, 2**31 - 1))
def test_every_draft_pass_reads_its_context_and_running_rows_stay_deferred(workload, seed):
    block_size, prefix_caching, num_blocks, specs, steps, limit_rows = workload
    rng = random.Random(seed)
    pool = BlockPool(num_blocks, block_size, prefix_caching)
    draft_cache: dict[int, float] = {}
    passes: list[int] = []
    drafter = bare_proposer(block_size, prefix_caching, draft_cache, passes)
    state_ids: dict[tuple[int, ...], float] = {}  # token prefix -> the hidden state the target computes there
    waiting = [Request(list(prompt), max_tokens) for prompt, max_tokens in specs]
    running: list[Request] = []
    freed: list[list[int]] = []  # tables of the requests freed since the last step (the runner's `_freed_req_ids`)
    old_limit = proposer_module.DEFERRED_BYTES
    proposer_module.DEFERRED_BYTES = limit_rows * 8
    try:
        for arrivals, event, drafts in steps:
            # the scheduler: running requests first (a block each when their next token starts one), then arrivals
            if event == "preempt" and running:
                victim = running.pop(rng.randrange(len(running)))
                freed.append(list(victim.table))
                pool.release(victim)
                waiting.insert(0, victim)
            scheduled: list[tuple[Request, int]] = []
            for request in list(running):
                if request.computed == len(request.table) * block_size:
                    block = pool.allocate()
                    if block is None:  # out of blocks: preempt it
                        running.remove(request)
                        freed.append(list(request.table))
                        pool.release(request)
                        waiting.insert(0, request)
                        continue
                    request.table.append(block)
                scheduled.append((request, len(request.tokens) - request.computed))
            for _ in range(arrivals):
                if not waiting:
                    break
                request = waiting[0]
                hits = pool.hits(request)
                needed = -(-len(request.tokens) // block_size) - len(hits)
                if needed > len([b for b in pool.free if b not in hits]):
                    break
                waiting.pop(0)
                for block in hits:
                    pool.take(block)
                request.table = hits + [pool.allocate() for _ in range(needed)]  # type: ignore[misc]
                request.computed = len(hits) * block_size
                running.append(request)
                scheduled.append((request, len(request.tokens) - request.computed))
            for request, count in scheduled:
                pool.cache_full_blocks(request, request.computed + count)
            # the runner: the freed requests' rows first, then the forward
            if freed and drafter.deferred_rows:
                held_before = held_slots(drafter)
                drafter.store_deferred_context(freed)
                # the rows kept are exactly those in no freed block: running requests' rows stay deferred
                assert held_slots(drafter).tolist() == held_before[~rows_in_blocks(held_before, freed, block_size)].tolist()
            # every row held is a running request's, at the slot its table gives (none is left in a block
            # that was freed, whoever holds that block now)
            owned = {(p, r.table[p // block_size] * block_size + p % block_size) for r in running for p in range(r.computed)}
            if drafter._deferred.rows:
                positions, slots = drafter._deferred.indices()
                assert {(p, s) for p, s in zip(positions.tolist(), slots.tolist()) if s >= 0} <= owned
            freed = []
            rows = []  # (state, position, slot) of every token computed this step
            for request, count in scheduled:
                for position in range(request.computed, request.computed + count):
                    state = state_ids.setdefault(tuple(request.tokens[: position + 1]), float(len(state_ids)))
                    rows.append((state, position, request.table[position // block_size] * block_size + position % block_size))
                request.computed += count
            if rows:
                states = torch.tensor([[s] for s, _, _ in rows], dtype=torch.float64)
                positions = torch.tensor([p for _, p, _ in rows])
                slots = torch.tensor([s for _, _, s in rows], dtype=torch.int32)
                if drafts:  # a draft pass: every row held first, then this step's context, then the read
                    drafter.store_deferred_context()
                    drafter._store_context(states, positions, slots)
                    for request in running:
                        for position in range(request.computed):
                            slot = request.table[position // block_size] * block_size + position % block_size
                            assert draft_cache.get(slot) == state_ids[tuple(request.tokens[: position + 1])]
                else:
                    drafter.defer_context([states], len(rows), positions, slots)
            # sampling: each scheduled request gets a token; finished ones leave (reported next step)
            for request, _ in scheduled:
                request.tokens.append(rng.randrange(4))
                request.max_tokens -= 1
                if request.max_tokens == 0:
                    running.remove(request)
                    freed.append(list(request.table))
                    pool.release(request)
    finally:
        proposer_module.DEFERRED_BYTES = old_limit


def test_a_finish_stores_only_the_finished_requests_full_blocks():
    """Two requests with deferred rows; one finishes: its full block's rows are stored, its partial
    block's dropped, and the other's rows stay deferred for the next pass."""
    draft_cache: dict[int, float] = {}
    passes: list[int] = []
    drafter = bare_proposer(4, True, draft_cache, passes)
    # request A: blocks 3, 5 (positions 0-5); request B: block 7 (positions 0-2); rows interleaved by step
    rows = [(0, 12), (0, 28), (1, 13), (1, 29), (2, 14), (2, 30), (3, 15), (4, 20), (5, 21)]
    positions = torch.tensor([p for p, _ in rows])
    slots = torch.tensor([s for _, s in rows], dtype=torch.int32)
    states = slots.double().unsqueeze(1)
    drafter.defer_context([states], len(rows), positions, slots)
    drafter.store_deferred_context([[3, 5]])
    assert passes == [4] and sorted(draft_cache) == [12, 13, 14, 15]
    assert held_slots(drafter).tolist() == [28, 29, 30] and drafter.deferred_rows == 3
    drafter.store_deferred_context([])  # nothing freed: nothing stored
    assert passes == [4]
    drafter.store_deferred_context()
    assert passes == [4, 3] and drafter.deferred_rows == 0


@given(
    slots=st.lists(st.integers(-1, 80), max_size=40),
    tables=st.lists(st.lists(st.integers(0, 20), max_size=4), max_size=3),
    block_size=st.sampled_from([1, 4, 16]),
)
def test_rows_in_blocks_on_the_host_and_in_torch_are_the_rows_in_a_listed_block(slots, tables, block_size):
    from vllm_ddtree.vllm.deferred_context import _rows_in_blocks_torch

    expected = [slot >= 0 and any(slot // block_size in table for table in tables) for slot in slots]
    held = torch.tensor(slots, dtype=torch.int64)
    assert rows_in_blocks(held, tables, block_size).tolist() == expected
    blocks = sorted({block for table in tables for block in table})
    if blocks and slots:
        assert _rows_in_blocks_torch(held, blocks, block_size).tolist() == expected
