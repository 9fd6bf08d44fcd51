"""The block manager: free list, block tables, reference counts, copy-on-write, prefix caching.

Every test ends with ``check_invariants()``: each block's reference count equals the number of
tables that list it, the free list holds exactly the blocks nobody references, and the prefix
cache points only at blocks that carry its hash.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from llmu.paged import BlockManager, NoFreeBlocks, block_manager as bm_mod


def prompt(n, start=0):
    return list(range(start, start + n))


def test_allocate_takes_ceil_blocks_and_free_returns_them():
    bm = BlockManager(10, 4)
    assert bm.allocate("a", prompt(9)) == 0  # nothing cached yet
    assert len(bm.table("a")) == 3 and bm.num_free_blocks == 7
    bm.allocate("b", prompt(4, 100))
    assert len(bm.table("b")) == 1 and bm.num_free_blocks == 6
    assert not set(bm.table("a")) & set(bm.table("b")), "two sequences were given the same block"
    bm.free("a")
    assert bm.num_free_blocks == 9
    bm.check_invariants()


def test_extra_tokens_reserve_blocks_up_front():
    bm = BlockManager(20, 4)
    bm.allocate("a", prompt(5), extra_tokens=10)  # 15 positions -> 4 blocks
    assert len(bm.table("a")) == 4
    bm.check_invariants()


def test_prepare_write_grows_the_table_one_block_at_a_time():
    bm = BlockManager(10, 4)
    bm.allocate("a", prompt(4))
    assert bm.prepare_write("a", 0, 4) == []
    assert len(bm.table("a")) == 1
    assert bm.prepare_write("a", 4, 5) == []  # position 4 starts a new block
    assert len(bm.table("a")) == 2
    bm.prepare_write("a", 5, 8)
    assert len(bm.table("a")) == 2, "positions 5..7 fit the second block"
    bm.check_invariants()


def test_out_of_blocks_raises_and_changes_nothing():
    bm = BlockManager(3, 4)
    bm.allocate("a", prompt(8))
    before = bm.snapshot()
    with pytest.raises(NoFreeBlocks):
        bm.allocate("b", prompt(5, 50))  # needs 2, 1 free
    with pytest.raises(NoFreeBlocks):
        bm.prepare_write("a", 8, 13)  # needs 2 more
    assert bm.snapshot() == before
    assert bm.can_allocate(prompt(4, 50)) and not bm.can_allocate(prompt(5, 50))
    bm.check_invariants()


def test_prefix_cache_reuses_committed_full_blocks():
    bm = BlockManager(20, 4)
    system = prompt(8, 1000)  # two full blocks of a shared "system prompt"
    a = system + [1, 2, 3]
    bm.allocate("a", a)
    bm.prepare_write("a", 0, len(a))
    bm.commit("a", a, len(a))  # blocks 0 and 1 are full: registered
    b = system + [7, 8, 9, 10, 11]
    cached = bm.allocate("b", b)
    assert cached == 8, "the two system-prompt blocks should come from the prefix cache"
    assert bm.table("b")[:2] == bm.table("a")[:2]
    assert bm.table("b")[2] != bm.table("a")[2]
    assert [bm.blocks[i].ref_count for i in bm.table("a")[:2]] == [2, 2]
    bm.check_invariants()


def test_uncommitted_blocks_are_not_shared():
    bm = BlockManager(20, 4)
    a = prompt(8)
    bm.allocate("a", a)  # allocated but not computed yet: nothing to share
    assert bm.allocate("b", a) == 0
    bm.check_invariants()


def test_the_hash_covers_the_whole_prefix():
    """The same four tokens after a different prefix have different keys and values: no hit."""
    bm = BlockManager(20, 4)
    a = [1, 1, 1, 1, 5, 6, 7, 8]
    bm.allocate("a", a)
    bm.prepare_write("a", 0, 8)
    bm.commit("a", a, 8)
    assert bm.allocate("b", [2, 2, 2, 2, 5, 6, 7, 8, 9]) == 0
    bm.check_invariants()


def test_a_fully_cached_prompt_still_computes_its_last_token():
    bm = BlockManager(20, 4)
    a = prompt(8)
    bm.allocate("a", a)
    bm.prepare_write("a", 0, 8)
    bm.commit("a", a, 8)
    assert bm.allocate("b", a) == 7, "the last prompt position must be recomputed: its logits pick a token"
    copies = bm.prepare_write("b", 7, 8)  # ... and it falls in a shared block: copy on write
    assert len(copies) == 1 and copies[0][0] == bm.table("a")[1] and copies[0][1] == bm.table("b")[1]
    assert bm.table("b")[0] == bm.table("a")[0]
    bm.check_invariants()


def test_freed_blocks_stay_cached_until_reused():
    bm = BlockManager(4, 4)
    a = prompt(8)
    bm.allocate("a", a)
    bm.prepare_write("a", 0, 8)
    bm.commit("a", a, 8)
    bm.free("a")
    assert bm.num_free_blocks == 4
    assert bm.allocate("b", a + [99]) == 8, "a freed block keeps its contents until it is handed out again"
    assert bm.num_free_blocks == 1
    bm.free("b")
    bm.allocate("c", prompt(16, 500))  # needs every block: the cached ones are evicted
    bm.free("c")
    assert bm.allocate("d", a + [99]) == 0
    bm.check_invariants()


def test_free_list_hands_out_uncached_blocks_before_cached_ones():
    bm = BlockManager(6, 4)
    a = prompt(8)
    bm.allocate("a", a)
    bm.prepare_write("a", 0, 8)
    bm.commit("a", a, 8)
    bm.free("a")  # two cached blocks back on the free list
    bm.allocate("x", prompt(12, 300))  # three blocks: the four uncached ones go first
    bm.free("x")
    assert bm.allocate("b", a + [1]) == 8
    bm.check_invariants()


def test_hash_collisions_are_caught_by_the_stored_tokens(monkeypatch):
    monkeypatch.setattr(bm_mod, "block_hash", lambda parent, tokens: 42)  # every block collides
    bm = BlockManager(10, 4)
    a = prompt(4)
    bm.allocate("a", a)
    bm.prepare_write("a", 0, 4)
    bm.commit("a", a, 4)
    assert bm.allocate("b", prompt(5, 10)) == 0, "a hash collision must not share a block with other tokens"
    bm.check_invariants()


def test_fork_shares_and_the_first_write_copies():
    bm = BlockManager(10, 4)
    a = prompt(6)
    bm.allocate("p", a)
    bm.prepare_write("p", 0, 6)
    bm.fork("p", "c")
    assert bm.table("c") == bm.table("p")
    assert all(bm.blocks[i].ref_count == 2 for i in bm.table("p"))
    copies = bm.prepare_write("c", 6, 7)  # position 6 is in the shared, half-full second block
    assert copies == [(bm.table("p")[1], bm.table("c")[1])]
    assert bm.table("c")[0] == bm.table("p")[0], "the untouched first block stays shared"
    assert bm.prepare_write("p", 6, 7) == [], "the parent is the block's only owner now: no copy"
    bm.check_invariants()
    bm.free("p")
    bm.free("c")
    assert bm.num_free_blocks == 10
    bm.check_invariants()


def test_fork_into_a_new_block_copies_nothing():
    bm = BlockManager(10, 4)
    bm.allocate("p", prompt(8))
    bm.prepare_write("p", 0, 8)
    bm.fork("p", "c")
    assert bm.prepare_write("c", 8, 9) == [] and bm.prepare_write("p", 8, 9) == []
    assert bm.table("c")[2] != bm.table("p")[2]
    bm.check_invariants()


def test_write_needs_counts_copies_and_growth():
    bm = BlockManager(10, 4)
    bm.allocate("p", prompt(6))
    bm.fork("p", "c")
    assert bm.write_needs("c", 6, 9) == 2  # copy block 1, then grow into block 2
    assert bm.can_write("c", 6, 9)


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_blocks=0), "num_blocks"),
    (dict(num_blocks=4, block_size=0), "block_size"),
    (dict(num_blocks=4.0), "num_blocks"),
])
def test_bad_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BlockManager(**kwargs)


def test_bad_calls():
    bm = BlockManager(4, 4)
    with pytest.raises(ValueError, match="empty"):
        bm.allocate("a", [])
    bm.allocate("a", [1])
    with pytest.raises(ValueError, match="already holds"):
        bm.allocate("a", [1])
    with pytest.raises(KeyError, match="no sequence"):
        bm.free("zz")
    with pytest.raises(ValueError, match="start < end"):
        bm.prepare_write("a", 3, 3)
    with pytest.raises(ValueError, match="extra_tokens"):
        bm.allocate("b", [1], extra_tokens=-1)
    with pytest.raises(TypeError, match="prefix_caching"):
        BlockManager(4, 4, prefix_caching="yes")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "grow", "fork", "free"]), st.integers(0, 5),
                          st.integers(1, 9)), max_size=40))
def test_random_operations_keep_the_books_straight(ops):
    """Any sequence of operations, including ones the pool cannot serve, leaves consistent books."""
    bm = BlockManager(12, 4)
    lengths: dict[int, int] = {}
    tokens: dict[int, list[int]] = {}
    for op, sid, n in ops:
        try:
            if op == "alloc" and sid not in lengths:
                toks = [sid % 2] * n  # two kinds of prompts, so prefixes repeat
                bm.allocate(sid, toks)
                try:
                    bm.prepare_write(sid, 0, n)
                except NoFreeBlocks:  # allocated, but no block to write the prompt: give them back
                    bm.free(sid)
                    raise
                bm.commit(sid, toks, n)
                lengths[sid], tokens[sid] = n, toks
            elif op == "grow" and sid in lengths:
                bm.prepare_write(sid, lengths[sid], lengths[sid] + n)
                tokens[sid] += [7] * n
                lengths[sid] += n
                bm.commit(sid, tokens[sid], lengths[sid])
            elif op == "fork" and sid in lengths and sid + 6 not in lengths:
                bm.fork(sid, sid + 6)
                lengths[sid + 6], tokens[sid + 6] = lengths[sid], list(tokens[sid])
            elif op == "free" and sid in lengths:
                bm.free(sid)
                del lengths[sid], tokens[sid]
        except NoFreeBlocks:
            pass
        bm.check_invariants()
        for sid, n in lengths.items():
            assert len(bm.table(sid)) >= bm.blocks_for(n)
