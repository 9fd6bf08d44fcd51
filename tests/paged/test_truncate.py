"""``BlockManager.truncate``: a sequence keeps its first ``n`` positions, the blocks after them go back.

Speculative decoding rolls back rejected draft tokens with it (``llmu.spec.paged``). Checked: a cut
in the middle of a block, at a block boundary, to 0 and to the full length (nothing changes); the
released blocks reach the free list, the last one first; a block shared with a fork stays with the
fork; a prefix-cached block cut partway stays registered and read-only, so the next write into it
is a copy; bad arguments. Every test ends with ``check_invariants()``.
"""

from __future__ import annotations

import pytest

from llmu.paged import BlockManager


def written(bm, seq, n):
    """A sequence of ``n`` tokens (0, 1, ...) whose positions are all written."""
    tokens = list(range(n))
    bm.allocate(seq, tokens)
    assert bm.prepare_write(seq, 0, n) == []
    return tokens


def test_truncate_in_the_middle_of_a_block():
    bm = BlockManager(10, 4)
    written(bm, "a", 11)  # 3 blocks: 4 + 4 + 3 positions
    table = bm.table("a")
    bm.truncate("a", 6)  # positions 0..5: blocks 0 and 1 (1 partly used)
    assert bm.table("a") == table[:2]
    assert bm.num_free_blocks == 8
    assert bm.snapshot()["ref_counts"][table[2]] == 0
    bm.check_invariants()
    # the sequence grows again from position 6: block 1 is written in place, a new block follows
    assert bm.prepare_write("a", 6, 9) == []
    assert bm.table("a")[:2] == table[:2] and len(bm.table("a")) == 3
    bm.check_invariants()


def test_truncate_at_a_block_boundary_releases_the_tail_last_block_first():
    bm = BlockManager(10, 4)
    written(bm, "a", 16)
    table = bm.table("a")
    bm.truncate("a", 8)
    assert bm.table("a") == table[:2]
    # nothing registered in them: the released blocks are handed out first, the head-most one first
    assert bm.snapshot()["free"][:2] == [table[2], table[3]]
    bm.check_invariants()


def test_truncate_to_zero_and_to_the_full_length():
    bm = BlockManager(10, 4)
    written(bm, "a", 7)
    table = bm.table("a")
    before = bm.snapshot()
    bm.truncate("a", 7)  # the full length: nothing changes
    assert bm.snapshot() == before
    bm.truncate("a", 8)  # the positions the table covers: nothing changes either
    assert bm.snapshot() == before
    bm.truncate("a", 0)
    assert bm.table("a") == [] and bm.num_free_blocks == 10
    bm.check_invariants()
    assert bm.prepare_write("a", 0, 5) == []  # the (empty) table is still there and grows again,
    assert bm.table("a") == table[:2]          # from the blocks just released
    bm.free("a")
    assert bm.num_free_blocks == 10
    bm.check_invariants()


def test_a_shared_block_stays_with_the_fork():
    bm = BlockManager(10, 4)
    written(bm, "a", 12)
    bm.fork("a", "b")
    table = bm.table("a")
    bm.truncate("a", 2)
    assert bm.table("a") == table[:1] and bm.table("b") == table
    assert [bm.blocks[i].ref_count for i in table] == [2, 1, 1]
    assert bm.num_free_blocks == 7, "blocks the fork still holds must not be freed"
    bm.check_invariants()
    # block 0 is still shared: writing position 2 of "a" copies it first
    assert bm.prepare_write("a", 2, 3) == [(table[0], bm.table("a")[0])]
    assert bm.table("b") == table
    bm.truncate("b", 0)
    assert bm.num_free_blocks == 9  # only the private copy of "a" is held
    bm.check_invariants()


def test_a_committed_block_cut_partway_stays_registered_and_is_copied_on_write():
    bm = BlockManager(10, 4)
    tokens = written(bm, "a", 10)
    bm.commit("a", tokens, 10)  # blocks 0 and 1 are full: registered
    table = bm.table("a")
    cached = bm.snapshot()["cached"]
    assert sorted(table[:2]) == cached
    bm.truncate("a", 6)  # block 1 is now partly used, block 2 released
    assert bm.table("a") == table[:2]
    assert bm.snapshot()["cached"] == cached, "block 1 still holds the keys and values its hash names"
    assert bm._hashes["a"] == [bm.blocks[table[0]].hash]  # only block 0 is full
    bm.check_invariants()
    # another sequence with the same first 8 tokens still finds both blocks in the prefix cache
    assert bm.allocate("b", tokens[:8] + [99]) == 8
    bm.free("b")
    # the next write into block 1 goes to a private copy; the registered block keeps its contents
    copies = bm.prepare_write("a", 6, 7)
    assert copies == [(table[1], bm.table("a")[1])] and bm.table("a")[1] != table[1]
    assert bm.snapshot()["cached"] == cached
    assert bm.blocks[table[1]].ref_count == 0 and table[1] in bm.snapshot()["free"]
    new = tokens[:6] + [50, 51]  # a different block 1: committed under its own hash
    bm.prepare_write("a", 7, 8)
    bm.commit("a", new, 8)
    assert bm.blocks[bm.table("a")[1]].hash is not None and len(bm._hashes["a"]) == 2
    bm.check_invariants()


def test_truncate_at_a_boundary_keeps_the_committed_blocks():
    bm = BlockManager(10, 4)
    tokens = written(bm, "a", 10)
    bm.commit("a", tokens, 10)
    hashes, table = list(bm._hashes["a"]), bm.table("a")
    bm.truncate("a", 8)
    assert bm._hashes["a"] == hashes  # both full blocks are kept, with their hashes
    assert bm.prepare_write("a", 8, 9) == []  # a new block after them: nothing to copy
    assert bm.table("a")[:2] == table[:2] and len(bm.table("a")) == 3
    bm.check_invariants()


def test_bad_arguments():
    bm = BlockManager(10, 4)
    written(bm, "a", 5)  # 2 blocks: positions 0..7 covered
    with pytest.raises(KeyError, match="no sequence 'x'"):
        bm.truncate("x", 0)
    for bad in (-1, 9, 2.0, True, "3", None):
        with pytest.raises(ValueError, match=r"num_tokens must be an int in 0\.\.8"):
            bm.truncate("a", bad)
    assert len(bm.table("a")) == 2
    bm.check_invariants()
