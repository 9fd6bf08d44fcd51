"""Where a token is: NoPE models, per-row ``position_ids`` and ``attention_mask`` through the model.

Oracles are the model itself on simpler inputs: a row of a batch run at its own positions must
give what that row gives alone (at ``position=`` its offset, or through the KV cache), a
left-padded row what the unpadded row gives, two documents packed in one row what each gives
alone. Every comparison is float32 on a random 2-layer model (logits O(1)); the batched and the
single-row forward do the same arithmetic in another order or through another torch kernel
(a masked one instead of ``is_causal``): rounding only, 1e-5.
"""

from __future__ import annotations

import pytest
import torch

import llmu  # noqa: F401
import llmu.flash  # noqa: F401  (registers "flash", which takes no mask)
from llmu.models import KVCache
from llmu.models.config import LlamaConfig
from llmu.models.llama import TINY_CONFIG, tiny_llama

F32 = dict(atol=1e-5, rtol=1e-5)
BACKENDS = ["naive", "sdpa"]


def ids_of(*shape, seed=0):
    return torch.randint(1, 97, shape, generator=torch.Generator().manual_seed(seed))


# -- NoPE -----------------------------------------------------------------------------------------

def test_position_embedding_is_validated():
    assert LlamaConfig().position_embedding == "rope"
    with pytest.raises(ValueError, match="position_embedding must be one of .*'rope', 'none'.*got 'alibi'"):
        LlamaConfig(**TINY_CONFIG, position_embedding="alibi")
    with pytest.raises(ValueError, match="head_dim must be even for RoPE"):
        LlamaConfig(**{**TINY_CONFIG, "head_dim": 7})
    assert LlamaConfig(**{**TINY_CONFIG, "head_dim": 7}, position_embedding="none").head_dim == 7  # no pairs needed


@pytest.mark.parametrize("backend", BACKENDS)
def test_nope_model_ignores_positions_and_differs_from_rope(backend):
    rope = tiny_llama(3).set_attention(backend)
    nope = tiny_llama(3, position_embedding="none").set_attention(backend)   # the same weights
    assert "position_embedding='none'" in repr(nope)
    ids = ids_of(2, 9, seed=1)
    with torch.inference_mode():
        base = nope(ids).logits
        # rotation is what RoPE adds: without it, the same weights give other logits
        assert not torch.allclose(base, rope(ids).logits, atol=1e-3)
        # the first token sees only itself: its logits do not depend on where it is said to be
        first = nope(ids[:, :1]).logits
        for pos in ([[0], [0]], [[5], [100]], [[37], [2]]):
            torch.testing.assert_close(nope(ids[:, :1], position_ids=torch.tensor(pos)).logits, first, **F32)
        torch.testing.assert_close(base[:, :1], first, **F32)
        # and NoPE ignores position_ids altogether (gaps, repeats), which RoPE does not
        odd = torch.tensor([[0, 3, 4, 9, 10, 11, 30, 31, 50]] * 2)
        torch.testing.assert_close(nope(ids, position_ids=odd).logits, base, **F32)
        assert not torch.allclose(rope(ids, position_ids=odd).logits, rope(ids).logits, atol=1e-3)
        # a NoPE model is still causal: a token's logits do not depend on the tokens after it
        torch.testing.assert_close(nope(ids[:, :4]).logits, base[:, :4], **F32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nope_with_a_cache_equals_the_full_forward(backend):
    model = tiny_llama(4, position_embedding="none").set_attention(backend)
    assert model.rope_tables(0, 5) == (None, None)
    ids = ids_of(2, 11, seed=2)
    full = model(ids).logits
    cache = KVCache.for_model(model, batch_size=2, max_len=16)
    steps = [model(ids[:, a:b], cache=cache).logits for a, b in [(0, 6), (6, 7), (7, 11)]]
    torch.testing.assert_close(torch.cat(steps, 1), full, **F32)


def test_rope_model_at_position_zero_equals_nope_for_one_token():
    # angle 0 is the identity rotation: one token at position 0 cannot tell RoPE from NoPE
    ids = ids_of(3, 1, seed=3)
    torch.testing.assert_close(tiny_llama(5)(ids).logits, tiny_llama(5, position_embedding="none")(ids).logits, **F32)


# -- per-row positions ----------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_per_row_positions_equal_each_row_at_its_offset(backend, layout):
    model = tiny_llama(6, rope_layout=layout).set_attention(backend)
    ids = ids_of(3, 7, seed=4)
    starts = [0, 5, 41]
    position_ids = torch.stack([torch.arange(s, s + 7) for s in starts])
    got = model(ids, position_ids=position_ids).logits
    for b, s in enumerate(starts):
        torch.testing.assert_close(got[b], model(ids[b:b + 1], position=s).logits[0], **F32)
    # position_ids = 0..T-1 in every row is the default
    torch.testing.assert_close(model(ids, position_ids=torch.arange(7).expand(3, 7)).logits, model(ids).logits, **F32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_position_ids_with_a_cache_equal_the_cache_path(backend):
    # each row continues its own cache at cache.length: position_ids saying so give the same logits
    model = tiny_llama(7).set_attention(backend)
    ids = ids_of(2, 10, seed=5)
    ref_cache = KVCache.for_model(model, 2, 16)
    ref = [model(ids[:, :6], cache=ref_cache).logits, model(ids[:, 6:], cache=ref_cache).logits]
    cache = KVCache.for_model(model, 2, 16)
    got = [model(ids[:, :6], cache=cache, position_ids=torch.arange(6).expand(2, 6)).logits,
           model(ids[:, 6:], cache=cache, position_ids=torch.arange(6, 10).expand(2, 4)).logits]
    torch.testing.assert_close(torch.cat(got, 1), torch.cat(ref, 1), **F32)


# -- padding and masks ----------------------------------------------------------------------------

PAD = 0


def left_padded(rows):
    """Left-pad ``rows`` (lists of ids) to one length: ``(ids, attention_mask, position_ids)``."""
    n = max(len(r) for r in rows)
    ids = torch.tensor([[PAD] * (n - len(r)) + r for r in rows])
    mask = torch.tensor([[False] * (n - len(r)) + [True] * len(r) for r in rows])
    position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)   # 0 at the first real token of each row
    return ids, mask, position_ids


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("position_embedding", ["rope", "none"])
def test_left_padded_batch_decodes_like_each_row_alone(backend, position_embedding):
    model = tiny_llama(8, position_embedding=position_embedding).set_attention(backend)
    rows = [ids_of(1, 6, seed=6)[0].tolist(), ids_of(1, 3, seed=7)[0].tolist(), ids_of(1, 1, seed=8)[0].tolist()]
    ids, mask, position_ids = left_padded(rows)
    nxt = ids_of(3, 3, seed=9)                       # three more tokens per row, fed one at a time
    with torch.inference_mode():
        cache = KVCache.for_model(model, 3, 16)
        out = model(ids, cache=cache, attention_mask=mask, position_ids=position_ids)
        assert torch.isfinite(out.logits).all(), "padding queries see no key: zeros, never NaN"
        steps = []
        for j in range(3):
            mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.bool)], 1)
            position_ids = position_ids[:, -1:] + 1
            steps.append(model(nxt[:, j:j + 1], cache=cache, attention_mask=mask, position_ids=position_ids).logits)
        for b, row in enumerate(rows):
            alone = KVCache.for_model(model, 1, 16)
            want = model(torch.tensor([row]), cache=alone).logits[0]
            torch.testing.assert_close(out.logits[b, -len(row):], want, **F32)
            for j in range(3):
                step = model(nxt[b:b + 1, j:j + 1], cache=alone).logits[0, 0]
                torch.testing.assert_close(steps[j][b, 0], step, **F32)


def test_padding_changes_the_answer_without_the_mask():
    # the property above is not free: without attention_mask the padding is attended to
    model = tiny_llama(8)
    ids, mask, position_ids = left_padded([[5, 6, 7, 8], [9, 10]])
    alone = model(torch.tensor([[9, 10]])).logits[0]
    unmasked = model(ids, position_ids=position_ids).logits[1, -2:]
    assert not torch.allclose(unmasked, alone, atol=1e-3)
    torch.testing.assert_close(model(ids, position_ids=position_ids, attention_mask=mask).logits[1, -2:], alone, **F32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_documents_with_a_4d_mask(backend):
    # two documents in one row: a block-diagonal mask (with the causal one) and positions restarting
    # at the second document give each document's logits as if it ran alone
    model = tiny_llama(9).set_attention(backend)
    a, b = ids_of(1, 5, seed=10), ids_of(1, 4, seed=11)
    packed = torch.cat([a, b], 1)
    doc = torch.tensor([0] * 5 + [1] * 4)
    mask = (doc[:, None] == doc[None, :])[None, None]             # (1, 1, 9, 9)
    position_ids = torch.cat([torch.arange(5), torch.arange(4)])[None]
    got = model(packed, attention_mask=mask, position_ids=position_ids).logits[0]
    torch.testing.assert_close(got[:5], model(a).logits[0], **F32)
    torch.testing.assert_close(got[5:], model(b).logits[0], **F32)


def test_masked_keys_get_no_attention_weight():
    model = tiny_llama(10).set_attention("sdpa")      # output_attentions switches to "naive" for the weights
    ids, mask, position_ids = left_padded([[4, 5, 6, 7], [8, 9]])
    out = model(ids, attention_mask=mask, position_ids=position_ids, output_attentions=True)
    for w in out.attentions:                          # (B, H, T, T)
        assert torch.all(w[1, :, :, :2] == 0), "row 1's two padding keys must get weight 0"
        torch.testing.assert_close(w[1, :, 2:].sum(-1), torch.ones(w.shape[1], 2), **F32)
        assert torch.all(w[1, :, :2] == 0), "a padding query attends to nothing"


def test_all_true_mask_changes_nothing():
    model = tiny_llama(11)
    ids = ids_of(2, 6, seed=12)
    torch.testing.assert_close(model(ids, attention_mask=torch.ones(2, 6, dtype=torch.bool)).logits,
                               model(ids).logits, **F32)


# -- bad input ------------------------------------------------------------------------------------

class _Paged:
    attends = True   # what the model looks at to tell a paged batch (module 09)


_IDS = ids_of(2, 4, seed=13)
BAD = {
    "position_ids shape": (dict(position_ids=torch.arange(4)), ValueError, r"shaped like input_ids \(2, 4\)"),
    "position_ids float": (dict(position_ids=torch.zeros(2, 4)), ValueError, "position_ids must be integers"),
    "position_ids negative": (dict(position_ids=torch.full((2, 4), -1)), ValueError, "position_ids must be >= 0"),
    "position_ids and position": (dict(position_ids=torch.zeros(2, 4, dtype=torch.long), position=0), ValueError,
                                  "not several"),
    "position_ids paged": (dict(position_ids=torch.zeros(2, 4, dtype=torch.long), cache=_Paged()), ValueError,
                           "a paged batch takes positions="),
    "mask int": (dict(attention_mask=torch.ones(2, 4, dtype=torch.long)), TypeError, r"m\.bool\(\)"),
    "mask not a tensor": (dict(attention_mask=[[1, 1, 1, 1]] * 2), TypeError, "attention_mask must be a bool"),
    "mask 2-D shape": (dict(attention_mask=torch.ones(2, 5, dtype=torch.bool)), ValueError, r"\(2, 4\), got \(2, 5\)"),
    "mask 3-D": (dict(attention_mask=torch.ones(2, 4, 4, dtype=torch.bool)), ValueError, "or 4-D"),
    "mask 4-D shape": (dict(attention_mask=torch.ones(2, 2, 4, 4, dtype=torch.bool)), ValueError, "does not broadcast"),
    "mask paged": (dict(attention_mask=torch.ones(2, 4, dtype=torch.bool), positions=torch.arange(4), cache=_Paged()),
                   ValueError, "a paged batch takes no attention_mask"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input(case):
    over, exc, match = BAD[case]
    with pytest.raises(exc, match=match):
        tiny_llama()(_IDS, **over)


def test_a_backend_without_masks_refuses_one():
    model = tiny_llama().set_attention("flash_torch")
    with pytest.raises(ValueError, match="'flash_torch' attention backend does not take a mask.*'naive' or 'sdpa'"):
        model(_IDS, attention_mask=torch.ones(2, 4, dtype=torch.bool))
    model(_IDS)   # without a mask it serves as before
