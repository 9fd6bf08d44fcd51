"""llmu.layers.decoder (the trainable decoder of plain modules) == llmu's LlamaModel, its
initialisation and refusals; llmu.grading.decoder, the recipe notebook 03's grader trains it with.

Tolerances, float32: ``DecoderLM`` and ``LlamaModel`` do the same arithmetic in another order (the
attention's softmax and mask, RoPE's tables rounded from float64 the same way, llmu's Linear vs a
plain matmul), so logits of size up to ~6 (random weights of std 0.2) differ by a few 1e-6
(measured: at most 7.5e-6 over the configurations and shapes below); 1e-4 absolute and relative leaves a margin and is
far below what a wrong part changes (a wrong RoPE base or KV grouping moves logits by O(1)). On
SmolLM2, 30 blocks deep, the difference grows to about 1e-4 on logits up to ~40 (measured 7.8e-5):
1e-3 there, with equal top-1 tokens. Training from the same weights: the two follow each other to
float32 rounding for as many steps as the tests run (measured over 60 steps: 2.1e-6).
"""

from __future__ import annotations

import math

import pytest
import torch

from llmu.grading.decoder import MEASURED, TRAIN_CONFIG, init_report, llama_config, train_bytes
from llmu.layers.decoder import INIT_STD, DecoderLM, decoder_args, load_llmu_weights
from llmu.models.llama import make_trainable, tiny_llama

# (seed, overrides of llmu's TINY_CONFIG): 6 query heads over 2 KV heads (GQA), 6 (MHA), 1 (MQA);
# head sizes 8 and 16; RoPE bases 1e4, 1e5 (the default) and 1e6; a tied head; another eps; an odd
# FFN width and a vocabulary of 97.
CONFIGS = [
    (0, {}),
    (1, dict(num_key_value_heads=6, rope_theta=1e4)),
    (2, dict(num_key_value_heads=1, num_hidden_layers=3, intermediate_size=37)),
    (3, dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1e6,
             tie_word_embeddings=True, rms_norm_eps=1e-3)),
]
SHAPES = [(1, 1), (1, 7), (3, 19), (2, 33)]   # (batch, tokens): one token, odd lengths, batch 1 and 3


@pytest.mark.parametrize("seed, overrides", CONFIGS)
@pytest.mark.parametrize("batch, tokens", SHAPES)
def test_logits_equal_llamamodels_after_loading(seed, overrides, batch, tokens):
    model = tiny_llama(seed, **overrides)
    lm = load_llmu_weights(DecoderLM(**decoder_args(model.config)), model)
    ids = torch.randint(0, model.config.vocab_size, (batch, tokens), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        mine, theirs = lm(ids), model(ids).logits
    assert mine.shape == (batch, tokens, model.config.vocab_size) and mine.dtype == torch.float32
    torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)


def test_loading_copies_and_keeps_the_tie():
    model = tiny_llama(3, tie_word_embeddings=True)
    lm = DecoderLM(**decoder_args(model.config))
    assert load_llmu_weights(lm, model) is lm
    assert lm.lm_head.weight is lm.embed_tokens.weight
    assert lm.embed_tokens.weight.data_ptr() != model.embed_tokens.weight.data_ptr()   # copied, not shared
    assert all(p.requires_grad for p in lm.parameters())


@pytest.mark.parametrize("kw", [{}, dict(n_kv_heads=4), dict(n_kv_heads=1, tie_embeddings=True),
                                dict(vocab_size=97, d_model=48, n_heads=6, n_kv_heads=3, d_ff=100, n_layers=3)])
def test_fresh_initialisation_and_count(kw):
    args = {**TRAIN_CONFIG, **kw}
    torch.manual_seed(0)
    report = init_report(DecoderLM(**args))
    assert report["count"] == llama_config(**args).num_parameters()
    assert report["others"] == 0
    # std of n normal draws: relative error about 1/sqrt(2n) <= 1.6 % for the smallest matrix (2048)
    for n, mean, std in report["matrices"]:
        assert abs(std - INIT_STD) <= 0.1 * INIT_STD and abs(mean) <= 5 * INIT_STD / math.sqrt(n)
    assert all(lo == hi == 1.0 for _, lo, hi in report["vectors"])
    assert sum(n for n, _, _ in report["vectors"]) == (2 * args["n_layers"] + 1) * args["d_model"]


def test_grouped_attention_has_narrow_keys_and_values():
    lm = DecoderLM(**{**TRAIN_CONFIG, "n_heads": 4, "n_kv_heads": 1})
    attn = lm.layers[0].self_attn
    assert attn.q_proj.weight.shape == (64, 64) and attn.k_proj.weight.shape == (16, 64)
    assert attn.v_proj.weight.shape == (16, 64)


def test_causal():
    model = tiny_llama(5)
    lm = load_llmu_weights(DecoderLM(**decoder_args(model.config)), model)
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    changed = ids.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % 97
    with torch.no_grad():
        a, b = lm(ids), lm(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7], atol=1e-6, rtol=1e-6)
    assert (a[:, 7:] - b[:, 7:]).abs().max() > 1e-2


def test_rope_scores_depend_on_the_offset_only():
    """Rotating q at position m and k at position n gives the score of positions m + s and n + s."""
    rot = DecoderLM(**TRAIN_CONFIG).layers[0].self_attn.rotary
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 1, 16, generator=g), torch.randn(1, 1, 1, 16, generator=g)
    seq = 40

    def at(v, pos):
        x = torch.zeros(1, 1, seq, 16)
        x[:, :, pos] = v[:, :, 0]
        return rot(x)[:, :, pos]

    s1 = (at(q, 9) * at(k, 3)).sum()
    s2 = (at(q, 35) * at(k, 29)).sum()
    torch.testing.assert_close(s1, s2, atol=1e-5, rtol=1e-5)


def test_training_follows_llamamodel_from_the_same_weights():
    config = llama_config(**TRAIN_CONFIG)
    recipe = dict(steps=12, batch_size=4, seq_len=32)
    theirs = train_bytes(make_trainable(config, seed=2), **recipe)
    mine = train_bytes(load_llmu_weights(DecoderLM(**TRAIN_CONFIG), make_trainable(config, seed=2)), **recipe)
    assert len(mine) == 12
    assert max(abs(a - b) for a, b in zip(mine, theirs)) < 1e-4
    assert mine[-1] < mine[0] - 1.0        # from ln 256 = 5.55: the byte frequencies are learned within steps


def test_training_is_seeded_and_restores_threads():
    before = torch.get_num_threads()
    runs = []
    for _ in range(2):
        torch.manual_seed(3)
        runs.append(train_bytes(DecoderLM(**TRAIN_CONFIG), steps=3, batch_size=2, seq_len=16, seed=7))
    assert runs[0] == runs[1]
    assert torch.get_num_threads() == before
    assert abs(runs[0][0] - math.log(256)) < 0.15       # small initial weights: a near-uniform first guess


def test_measured_figures_are_consistent():
    assert max(MEASURED["fresh_last5"]) < MEASURED["unigram_entropy"]
    assert all(abs(x - math.log(256)) < 0.1 for x in MEASURED["fresh_first"])


def test_args_and_config_round_trip():
    config = llama_config(**TRAIN_CONFIG)
    assert decoder_args(config) == TRAIN_CONFIG
    assert config.head_dim == 16 and config.num_key_value_heads == 2


@pytest.mark.parametrize("kw, match", [
    (dict(d_model=60, n_heads=8), "multiple of n_heads"),
    (dict(n_heads=4, n_kv_heads=3), "multiple of n_kv_heads"),
    (dict(d_model=36, n_heads=4, n_kv_heads=4), "even"),
    (dict(n_layers=0), "n_layers"),
    (dict(vocab_size=True), "vocab_size"),
    (dict(d_ff=2.5), "d_ff"),
    (dict(rope_base=0), "rope_base"),
    (dict(eps=-1e-5), "eps"),
])
def test_bad_sizes_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        DecoderLM(**{**TRAIN_CONFIG, **kw})


def test_bad_ids_raise():
    lm = DecoderLM(**TRAIN_CONFIG)
    for ids in (torch.tensor([1, 2, 3]), torch.zeros(1, 3), [[1, 2]]):
        with pytest.raises(ValueError, match="ids"):
            lm(ids)


def test_loading_refuses_other_shapes_and_layouts():
    model = tiny_llama(0)
    with pytest.raises(ValueError, match="shape|DecoderLM"):
        load_llmu_weights(DecoderLM(**{**decoder_args(model.config), "d_ff": 65}), model)
    with pytest.raises(TypeError, match="LlamaModel"):
        load_llmu_weights(DecoderLM(**TRAIN_CONFIG), torch.nn.Linear(2, 2))
    interleaved = tiny_llama(0, rope_layout="interleaved")
    with pytest.raises(ValueError, match="half"):
        load_llmu_weights(DecoderLM(**decoder_args(interleaved.config)), interleaved)


def test_train_bytes_refuses():
    with pytest.raises(TypeError, match="lm"):
        train_bytes(lambda ids: ids, steps=1)
    with pytest.raises(ValueError, match="steps"):
        train_bytes(DecoderLM(**TRAIN_CONFIG), steps=0)
    with pytest.raises(ValueError, match="nothing to train"):
        train_bytes(DecoderLM(**TRAIN_CONFIG).requires_grad_(False), steps=1)
    with pytest.raises(ValueError, match="logits"):
        train_bytes(_Constant(), steps=1, batch_size=2, seq_len=8)
    with pytest.raises(TypeError, match="nn.Module"):
        init_report("a model")


class _Constant(torch.nn.Module):
    """Returns logits of the wrong shape."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(256))

    def forward(self, ids):
        return self.w.expand(ids.shape[0], 256)


@pytest.mark.slow
def test_smollm2_in_a_decoder_lm(smollm2):
    model, tok = smollm2
    lm = load_llmu_weights(DecoderLM(**decoder_args(model.config)), model)
    ids = torch.tensor([tok.encode("Rotary embeddings rotate pairs of channels by")], device=model.device)
    with torch.no_grad():
        mine, theirs = lm.to(model.device)(ids), model(ids).logits
    torch.testing.assert_close(mine, theirs, atol=1e-3, rtol=1e-4)
    assert torch.equal(mine.argmax(-1), theirs.argmax(-1))
