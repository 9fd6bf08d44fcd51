"""Speculative decoding over the paged KV cache (``llmu.spec.paged.PagedTarget``).

- greedy speculative decoding with ``cache="paged"`` gives exactly the tokens of plain greedy
  decoding with a contiguous cache (``decode_cached``), for the early-exit and n-gram drafts,
  several ``gamma`` and block sizes 1, 2 and 16 (with blocks of 1 or 2 positions a rollback
  releases whole blocks), on the tiny model and on SmolLM2;
- after a generation with rejected proposals the sequence holds exactly ``blocks_for(length)``
  blocks and every other block of the pool is free (no leak), and the rollbacks did free blocks;
- ``PagedTarget.forward`` returns the logits of ``ContiguousTarget.forward`` after the same
  forward/crop calls, for every attention implementation;
- sampling: the same seed gives the same tokens with either cache; bad arguments.
"""

from __future__ import annotations

import pytest
import torch

from llmu.kvcache.reference import decode_cached
from llmu.models import tiny_llama
from llmu.models.sampling import SamplingParams
from llmu.spec import paged as paged_mod
from llmu.spec.decode import ContiguousTarget, speculative_generate
from llmu.spec.drafts import EarlyExitDraft, NGramDraft
from llmu.spec.paged import PagedTarget

pytestmark = pytest.mark.kernels

PROMPT = [5, 9, 3, 7, 5, 9, 3]


@pytest.fixture
def targets(monkeypatch):
    """The ``PagedTarget`` objects ``speculative_generate`` builds, in order, each counting the
    blocks its crops released (``freed``): a generation's cache can be looked at afterwards."""
    made = []

    class Recording(PagedTarget):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.freed = 0
            made.append(self)

        def crop(self, length):
            before = len(self.table)
            super().crop(length)
            self.freed += before - len(self.table)

    monkeypatch.setattr(paged_mod, "PagedTarget", Recording)
    return made


def assert_no_leak(target):
    bm = target.blocks
    held = bm.blocks_for(target.length)
    assert len(target.table) == held, "the table holds blocks past the sequence's length"
    assert bm.num_free_blocks == bm.num_blocks - held, "blocks are neither in the table nor free"
    bm.check_invariants()


@pytest.mark.parametrize("block_size", [1, 2, 16])
@pytest.mark.parametrize("gamma", [1, 3, 5])
@pytest.mark.parametrize("kind", ["early1", "early2", "ngram"])
def test_greedy_equals_plain_decoding(targets, kind, gamma, block_size):
    model = tiny_llama(0)
    draft = {"early1": EarlyExitDraft(model, 1), "early2": EarlyExitDraft(model, 2), "ngram": NGramDraft()}[kind]
    out = speculative_generate(model, draft, PROMPT, 25, gamma=gamma, cache="paged", block_size=block_size)
    assert out.tokens == decode_cached(model, PROMPT, 25).tokens
    (target,) = targets
    assert target.blocks.block_size == block_size
    assert target.blocks.num_blocks == target.blocks.blocks_for(len(PROMPT) + 25 + gamma + 1)
    assert_no_leak(target)
    if kind == "early2":  # the draft is the whole target: nothing is rejected, nothing rolled back
        assert out.stats.acceptance_rate == 1.0 and target.freed == 0
    else:
        assert out.stats.acceptance_rate < 1
        if block_size <= 2:
            assert target.freed > 0, "the rejected proposals should have released blocks"


def test_sampling_gives_the_tokens_of_the_contiguous_cache():
    # on a CPU the paged "torch" attention computes what the contiguous cache's computes, in the
    # same order: same logits, same seed, same draws (a draw would have to fall within ~1e-7 of a
    # CDF boundary to differ under any rounding difference)
    model = tiny_llama(0, scale=0.3)
    params = SamplingParams(temperature=1.0, seed=3)
    for draft in (EarlyExitDraft(model, 1), NGramDraft()):
        want = speculative_generate(model, draft, PROMPT, 20, gamma=3, params=params).tokens
        got = speculative_generate(model, draft, PROMPT, 20, gamma=3, params=params, cache="paged",
                                   block_size=2).tokens
        assert got == want, draft.name


@pytest.mark.slow
def test_greedy_equals_plain_decoding_on_smollm2(smollm2, targets):
    model, tokenizer = smollm2
    # the n-gram draft copies "The ... sat on the" and is partly rejected: the rollbacks cross blocks
    prompt = tokenizer.encode("The cat sat on the mat. The dog sat on the")
    out = speculative_generate(model, NGramDraft(), prompt, 16, gamma=3, cache="paged", block_size=2)
    assert out.tokens == decode_cached(model, prompt, 16).tokens
    assert out.stats.acceptance_rate < 1 and targets[0].freed > 0
    assert_no_leak(targets[0])


# the same forward/crop calls on both caches: prefill, a few "steps" that append and roll back
# (to the middle of a block, to a boundary, to 0), then a longer chunk
CALLS = [("forward", 7), ("forward", 5), ("crop", 9), ("forward", 1), ("forward", 6), ("crop", 10), ("crop", 3),
         ("forward", 20), ("crop", 16), ("forward", 4), ("crop", 0), ("forward", 3)]


def _impls():
    from llmu.runtime import kernel_device

    dev = kernel_device()
    # the Triton kernels take block sizes that are powers of two >= 16 and head_dim >= 16, on the
    # kernel device (the CPU in Triton's interpreter)
    cases = [("torch", 1, "cpu", 8), ("torch", 3, "cpu", 8), ("torch", 16, "cpu", 8), ("reference", 2, "cpu", 8),
             ("triton", 16, dev, 16)]
    return [pytest.param(*c, id=f"{c[0]}-{c[1]}") for c in cases]


@pytest.mark.parametrize("impl, block_size, device, head_dim", _impls())
@torch.no_grad()
def test_forward_matches_the_contiguous_target(impl, block_size, device, head_dim):
    model = tiny_llama(0, head_dim=head_dim).to(device)
    contiguous = ContiguousTarget(model, 40)
    paged = PagedTarget(model, 40, block_size=block_size, impl=impl)
    g = torch.Generator(device="cpu").manual_seed(0)
    for op, n in CALLS:
        if op == "crop":
            contiguous.crop(n)
            paged.crop(n)
        else:
            ids = torch.randint(0, model.config.vocab_size, (n,), generator=g, device="cpu").tolist()
            want, got = contiguous.forward(ids), paged.forward(ids)
            assert got.shape == (n, model.config.vocab_size)
            # the same model and math, but each implementation adds up attention in its own order
            # (blocks gathered, tiles with an online softmax, float32 loops): float32 rounding
            # differences of about 1e-6 on logits of size ~5. A wrong slot, position or block
            # table changes logits by O(1).
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert paged.length == contiguous.length
        assert_no_leak(paged)


def test_rollback_returns_blocks_to_the_pool():
    model = tiny_llama(0)
    t = PagedTarget(model, 20, block_size=4, num_blocks=8)
    assert (t.length, t.table, t.blocks.num_free_blocks) == (0, [], 8)
    t.forward(range(10))
    table = t.table
    assert len(table) == 3 and t.blocks.num_free_blocks == 5
    t.crop(5)  # positions 0..4: blocks 0 and 1 stay, block 2 goes back
    assert t.table == table[:2] and t.blocks.num_free_blocks == 6
    t.forward([1, 2, 3, 4])  # positions 5..8: block 1 is written in place, one block more
    assert t.table[:2] == table[:2] and len(t.table) == 3 and t.length == 9
    t.crop(0)
    assert t.table == [] and t.blocks.num_free_blocks == 8
    t.blocks.check_invariants()
    assert "length=0/20" in repr(t)


def test_bad_arguments():
    model = tiny_llama(0)
    cases = [
        (lambda: PagedTarget(model, 0), ValueError, "max_len"),
        (lambda: PagedTarget(model, 8.0), ValueError, "max_len"),
        (lambda: PagedTarget(model, 8, block_size=0), ValueError, "block_size"),
        (lambda: PagedTarget(model, 8, block_size=True), ValueError, "block_size"),
        (lambda: PagedTarget(model, 20, block_size=4, num_blocks=4), ValueError, "num_blocks must be an int >= 5"),
        (lambda: PagedTarget(model, 8, num_blocks=2.0), ValueError, "num_blocks"),
        (lambda: PagedTarget(model, 8, impl="cuda"), ValueError, "impl"),
        (lambda: PagedTarget(object(), 8), TypeError, "model"),
        (lambda: speculative_generate(model, NGramDraft(), PROMPT, 4, cache="paged", block_size=0), ValueError,
         "block_size"),
    ]
    for fn, exc, match in cases:
        with pytest.raises(exc, match=match):
            fn()
    t = PagedTarget(model, 8, block_size=4)
    with pytest.raises(ValueError, match="at least one token"):
        t.forward([])
    t.forward([1, 2, 3])
    with pytest.raises(ValueError, match="max_len=8"):
        t.forward(range(6))
    for bad in (-1, 4, 1.0):
        with pytest.raises(ValueError, match=r"length must be an int in 0\.\.3"):
            t.crop(bad)
    assert t.length == 3 and len(t.table) == 1
    t.blocks.check_invariants()
