"""Tree speculation (``llmu.spec.tree``): the tree's mask and positions, greedy acceptance on a tree,
the one-pass verification step and its cache, the loop, the replay, prompt-lookup trees, bad input.

The strongest check is the mask's meaning: with it, the target's logits at every node equal those of
a plain causal pass over the context and that node's path, on any tree.
"""

from __future__ import annotations

import random

import pytest
import torch

from llmu.kvcache.reference import decode_cached
from llmu.models import tiny_llama
from llmu.spec.drafts import NGramDraft
from llmu.spec.tree import (
    NGramTreeDraft,
    PassCounter,
    accept_path,
    answer_draft,
    chain_parents,
    check_tree,
    replay_tree,
    tree_attention,
    tree_depths,
    tree_generate,
    tree_mask,
    tree_positions,
    trie,
    verify_greedy,
)

PROMPT = [5, 9, 3, 7, 5, 9, 3]


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(0)


@pytest.fixture(scope="module")
def answer(tiny):
    return decode_cached(tiny, PROMPT, 48).tokens


def random_tree(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(-1, i - 1) for i in range(n)]


def path_of(parents, i):
    path = []
    while i != -1:
        path.append(i)
        i = parents[i]
    return path[::-1]


# -- mask and positions ----------------------------------------------------------------------------

def test_mask_and_positions_of_a_small_tree():
    mask, pos = tree_attention([-1, 0, 0, 1], 2)
    assert mask.dtype == torch.bool and pos.dtype == torch.int64
    assert mask.int().tolist() == [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 1, 0], [1, 1, 1, 1, 0, 1]]
    assert pos.tolist() == [2, 3, 3, 4]


@pytest.mark.parametrize("prefix", [0, 1, 7])
def test_a_chain_is_causal_attention(prefix):
    mask, pos = tree_mask(chain_parents(5), prefix), tree_positions(chain_parents(5), prefix)
    assert mask[:, :prefix].all()
    assert torch.equal(mask[:, prefix:], torch.ones(5, 5, dtype=torch.bool).tril())
    assert pos.tolist() == list(range(prefix, prefix + 5))


def test_a_star_sees_only_the_context_and_itself():
    mask, pos = tree_attention([-1, -1, -1], 3)
    assert torch.equal(mask[:, 3:], torch.eye(3, dtype=torch.bool)) and mask[:, :3].all()
    assert pos.tolist() == [3, 3, 3]


def test_an_empty_tree():
    mask, pos = tree_attention([], 4)
    assert mask.shape == (0, 4) and pos.shape == (0,)
    assert tree_depths([]) == [] and chain_parents(0) == []


@pytest.mark.parametrize("seed", range(8))
def test_mask_rows_are_the_paths_and_another_order_gives_the_same_tree(seed):
    rng = random.Random(seed)
    parents = random_tree(rng, rng.randint(1, 14))
    prefix = rng.randint(0, 5)
    mask, pos = tree_attention(parents, prefix)
    for i in range(len(parents)):
        seen = {j for j in range(len(parents)) if mask[i, prefix + j]}
        assert seen == set(path_of(parents, i))
        assert int(pos[i]) == prefix + len(path_of(parents, i)) - 1
    # relabel the nodes in another topological order (sorted by depth, then at random): same tree
    depth = tree_depths(parents)
    order = sorted(range(len(parents)), key=lambda i: (depth[i], rng.random()))
    new_of = {old: new for new, old in enumerate(order)}
    relabelled = [-1 if parents[old] == -1 else new_of[parents[old]] for old in order]
    mask2, pos2 = tree_attention(relabelled, prefix)
    idx = torch.tensor(order)
    assert torch.equal(mask2[:, prefix:], mask[idx][:, prefix + idx])
    assert torch.equal(pos2, pos[idx])


# -- greedy acceptance on a tree -------------------------------------------------------------------

def test_accept_path_holds_from_the_top_and_keeps_the_deepest():
    # predicted: after the context 10; after node i, predicted[i + 1]
    parents, tokens = [-1, 0, -1, 2, 3], [10, 11, 99, 20, 30]
    assert accept_path(parents, tokens, [10, 11, 0, 20, 30, 0]) == [0, 1]
    # node 3 matches its parent's prediction, but its parent (node 2, token 99) is wrong
    assert accept_path(parents, tokens, [10, 7, 0, 20, 30, 0]) == [0]
    assert accept_path(parents, tokens, [5, 11, 0, 20, 30, 0]) == []
    # two siblings with the same token: the deeper path wins, the lower index between equals
    assert accept_path([-1, -1, 1], [4, 4, 6], [4, 0, 6, 0]) == [1, 2]
    assert accept_path([-1, -1], [4, 4], [4, 0, 0]) == [0]
    assert accept_path([], [], [3]) == []


# -- the verification step on the tiny model -------------------------------------------------------

@pytest.mark.parametrize("seed", range(6))
def test_with_the_mask_every_node_is_scored_as_if_alone(tiny, seed):
    rng = random.Random(seed)
    parents = random_tree(rng, rng.randint(1, 10))
    tokens = [rng.randrange(tiny.config.vocab_size) for _ in parents]
    ctx = PROMPT[: rng.randint(1, len(PROMPT))]
    mask, pos = tree_attention(parents, len(ctx))
    full = torch.cat([torch.ones(len(ctx), len(ctx), dtype=torch.bool).tril(),
                      torch.zeros(len(ctx), len(parents), dtype=torch.bool)], 1)
    full = torch.cat([full, mask])
    positions = torch.cat([torch.arange(len(ctx)), pos])
    with torch.no_grad():
        out = tiny(torch.tensor([ctx + tokens]), position_ids=positions[None], attention_mask=full[None, None]).logits[0]
        for i in range(len(parents)):
            alone = tiny(torch.tensor([ctx + [tokens[j] for j in path_of(parents, i)]])).logits[0, -1]
            torch.testing.assert_close(out[len(ctx) + i], alone, atol=1e-5, rtol=1e-5)


def test_one_step_returns_the_path_and_the_bonus_and_keeps_the_cache_exact(tiny, answer):
    parents, right = [-1, 0, -1, 2, 2, 4, 3], [False, True, True, False, True, True, True]
    draft = answer_draft(PROMPT, answer, parents, right, tiny.config.vocab_size)
    cache = tiny.new_cache(batch_size=1, max_len=64)
    with torch.no_grad():
        tiny(torch.tensor([PROMPT[:3]]), cache=cache)           # part of the context already cached
    with PassCounter(tiny) as passes:
        new = verify_greedy(tiny, cache, PROMPT, *draft(PROMPT))
    assert passes.count == 1
    assert new == answer[:4]
    assert cache.length == len(PROMPT) + 3
    fresh = tiny.new_cache(batch_size=1, max_len=64)
    with torch.no_grad():
        tiny(torch.tensor([PROMPT + new[:-1]]), cache=fresh)
    for layer in range(cache.num_layers):
        for mine, ref in zip(cache.get(layer), fresh.get(layer)):
            torch.testing.assert_close(mine, ref, atol=1e-5, rtol=1e-5)


def test_an_empty_tree_is_a_plain_decoding_step(tiny, answer):
    cache = tiny.new_cache(batch_size=1, max_len=64)
    assert verify_greedy(tiny, cache, PROMPT, [], []) == answer[:1]
    assert cache.length == len(PROMPT)


@pytest.mark.parametrize("seed", range(5))
def test_random_trees_generate_plain_greedy_decoding_one_pass_a_step(tiny, answer, seed):
    rng = random.Random(100 + seed)
    parents = random_tree(rng, rng.randint(1, 9))
    right = [rng.random() < 0.6 for _ in parents]
    draft = answer_draft(PROMPT, answer, parents, right, tiny.config.vocab_size)
    with PassCounter(tiny) as passes:
        run = tree_generate(tiny, verify_greedy, draft, PROMPT, 30)
    assert run.tokens == answer[:30]
    assert passes.count == run.steps
    # every step accepts the deepest right node whose path is right all the way down
    depth = tree_depths(parents)
    best = max([depth[i] + 1 for i in range(len(parents)) if all(right[j] for j in path_of(parents, i))], default=0)
    assert run.accepted == [best] * run.steps
    assert run.accepted == replay_tree(draft, PROMPT, answer, 30).accepted


def test_a_wrong_branch_listed_first_changes_nothing(tiny, answer):
    parents, right = [-1, 0, 1, 2, -1, 4, 5, 6], [False] * 4 + [True] * 4
    run = tree_generate(tiny, verify_greedy, answer_draft(PROMPT, answer, parents, right, 97), PROMPT, 30)
    assert run.tokens == answer[:30] and run.accepted == [4] * run.steps and run.tokens_per_step == 5.0


def test_prompt_lookup_trees_are_lossless_and_replay_exactly(tiny, answer):
    for width, nodes in ((1, 6), (2, 6), (3, 7)):
        draft = NGramTreeDraft(width, nodes)
        run = tree_generate(tiny, verify_greedy, draft, PROMPT, 40)
        assert run.tokens == answer[:40]
        assert run.accepted == replay_tree(draft, PROMPT, answer, 40).accepted
        assert max(run.nodes) <= nodes


# -- prompt-lookup trees ---------------------------------------------------------------------------

def test_trie_shares_prefixes():
    assert trie([[1, 2, 3], [1, 2, 4], [5]]) == ([-1, 0, 1, 1, -1], [1, 2, 3, 4, 5])
    assert trie([]) == ([], [])


def test_ngram_tree_width_one_is_ngram_lookup():
    ctx = [1, 2, 3, 9, 1, 2, 3, 8, 7, 1, 2, 3]
    parents, tokens = NGramTreeDraft(1, 4)(ctx)
    assert parents == chain_parents(len(tokens)) and tokens == NGramDraft().lookup(ctx, 4)


def test_ngram_tree_branches_on_older_occurrences():
    ctx = [1, 2, 3, 9, 9, 1, 2, 3, 8, 7, 1, 2, 3]
    assert NGramTreeDraft(2, 4).continuations(ctx) == [[8, 7, 1, 2], [9, 9, 1, 2]]
    parents, tokens = NGramTreeDraft(2, 4)(ctx)
    assert (parents, tokens) == ([-1, 0, -1, 2], [8, 7, 9, 9])
    check_tree(parents, tokens)
    assert NGramTreeDraft(2, 4)([4, 5, 6]) == ([], [])


# -- bad input -------------------------------------------------------------------------------------

@pytest.mark.parametrize("parents, match", [
    ([-1, 1], r"parents\[1\] = 1: a node's parent must come before it"),
    ([-1, 2, 0], r"parents\[1\] = 2"),
    ([0], r"parents\[0\] = 0"),
    ([-1, -2], r"parents\[1\] = -2: a parent is -1"),
    ([-1, 0.0], "parents must hold ints"),
    ([-1, True], "parents must hold ints"),
])
def test_bad_trees_are_refused(tiny, parents, match):
    with pytest.raises(ValueError, match=match):
        tree_mask(parents, 2)
    with pytest.raises(ValueError, match=match):
        tree_positions(parents, 2)
    with pytest.raises(ValueError, match=match):
        verify_greedy(tiny, tiny.new_cache(batch_size=1, max_len=32), PROMPT, parents, [1] * len(parents))


def test_mismatched_lengths_and_bad_arguments_are_refused(tiny):
    cache = tiny.new_cache(batch_size=1, max_len=32)
    with pytest.raises(ValueError, match="parents and tokens need one entry per node: lengths 3 and 2"):
        verify_greedy(tiny, cache, PROMPT, [-1, 0, 0], [1, 2])
    with pytest.raises(ValueError, match="predicted needs T \\+ 1 = 3 entries"):
        accept_path([-1, 0], [1, 2], [1, 2])
    with pytest.raises(ValueError, match="tokens must hold token ids"):
        check_tree([-1], [-4])
    with pytest.raises(ValueError, match="prefix_len must be an int >= 0"):
        tree_mask([-1], -1)
    with torch.no_grad():
        tiny(torch.tensor([PROMPT]), cache=cache)
    with pytest.raises(ValueError, match="the cache holds 7 positions but the context has 7 tokens"):
        verify_greedy(tiny, cache, PROMPT, [-1], [1])
    with pytest.raises(ValueError, match="width \\(3\\) cannot exceed nodes \\(2\\)"):
        NGramTreeDraft(3, 2)
    with pytest.raises(ValueError, match="max_new_tokens must be an int in 1..len\\(answer\\) - 1"):
        replay_tree(NGramTreeDraft(1, 2), PROMPT, [1, 2], 2)


def test_the_loop_checks_the_step(tiny):
    def lazy_step(model, cache, context, parents, tokens):
        return []

    def no_compaction(model, cache, context, parents, tokens):
        new = verify_greedy(model, cache, context, parents, tokens)
        cache.crop(len(context))                          # fine for the tokens, not what the loop asks
        return new

    with pytest.raises(ValueError, match="a step returns a non-empty list"):
        tree_generate(tiny, lazy_step, lambda c: ([], []), PROMPT, 3)
    with pytest.raises(ValueError, match="after a step the cache must hold the context and every new token"):
        tree_generate(tiny, no_compaction, lambda c: ([-1], [c[-1]]), PROMPT, 3)
    with pytest.raises(ValueError, match="a tree of 3 nodes; max_nodes is 2"):
        tree_generate(tiny, verify_greedy, lambda c: ([-1, 0, 1], [1, 2, 3]), PROMPT, 3, max_nodes=2)
