"""llmu.moe.params: total and active parameters, FLOPs per token.

The presets are checked against the figures their authors publish (rounded as published) and
against exact sums worked by hand from each config.json; the counting rules are checked against
real modules (every parameter of a model built here is counted, none twice) and against
``LlamaConfig.num_parameters`` for the course's own model.
"""

from __future__ import annotations

import pytest

import llmu  # noqa: F401
from llmu.models.config import LlamaConfig
from llmu.moe import params as P
from llmu.moe.train import TinyMoEConfig, TinyMoELM


def test_mixtral_published_figures():
    count = P.count_parameters(P.MIXTRAL_8X7B)
    # Mistral AI: "46.7B total parameters but only uses 12.9B parameters per token"
    assert round(count.total / 1e9, 1) == 46.7 and round(count.active / 1e9, 1) == 12.9
    # by hand: per layer attention 2*4096*4096 + 2*4096*1024, norms 2*4096, router 8*4096,
    # experts 8 (total) or 2 (active) * 3*4096*14336; plus embedding, head and final norm
    layer_fixed = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 2 * 4096 + 8 * 4096
    expert = 3 * 4096 * 14336
    outside = 2 * 32000 * 4096 + 4096
    assert count.total == 32 * (layer_fixed + 8 * expert) + outside == 46_702_792_704
    assert count.active == 32 * (layer_fixed + 2 * expert) + outside == 12_879_925_248


def test_mistral_is_mixtral_with_one_expert():
    count = P.count_parameters(P.MISTRAL_7B)
    assert count.total == count.active == 7_241_732_096          # Mistral's "7.24B"
    one = P.with_experts(P.MISTRAL_7B, 8, 2)
    mix = P.count_parameters(P.MIXTRAL_8X7B)
    assert P.count_parameters(one).total == mix.total and P.count_parameters(one).active == mix.active


def test_qwen_moe_shared_experts():
    count = P.count_parameters(P.QWEN15_MOE_A27B)
    # Qwen team: 14.3B total, 2.7B activated, 2.0B activated without the embeddings
    assert round(count.total / 1e9, 1) == 14.3 and round(count.active / 1e9, 1) == 2.7
    non_embedding = count.active - sum(count.parts[p][1] for p in ("embedding", "lm_head"))
    assert 2.0e9 <= non_embedding < 2.1e9                                  # stated as "2.0 billion"
    # the shared expert (and its gate) is active for every token
    assert count.parts["shared_experts"] == (24 * (3 * 2048 * 5632 + 2048),) * 2
    assert count.parts["experts"][1] * 15 == count.parts["experts"][0]        # 4 of 60


def test_smollm2_matches_llama_config():
    config = LlamaConfig()
    shape = P.from_llama_config(config)
    count = P.count_parameters(shape)
    assert count.total == count.active == config.num_parameters() == P.count_parameters(P.SMOLLM2_135M).total
    assert count.parts["lm_head"] == (0, 0)                                  # tied


@pytest.mark.parametrize("tied", [True, False])
def test_counts_every_parameter_of_a_real_model(tied):
    cfg = TinyMoEConfig(hidden=32, num_layers=3, num_heads=4, intermediate=24, num_experts=5, k=2)
    model = TinyMoELM(cfg)
    shape = P.DecoderShape(name="tiny", vocab_size=256, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                           num_key_value_heads=4, intermediate_size=24, num_experts=5, num_experts_per_tok=2,
                           tie_word_embeddings=tied)
    count = P.count_parameters(shape)
    numel = sum(p.numel() for p in model.parameters())             # the tiny model ties its head
    assert count.total == numel + (0 if tied else 256 * 32)
    experts = sum(p.numel() for n, p in model.named_parameters() if n.split(".")[-1] in ("w_gate", "w_up", "w_down"))
    assert count.parts["experts"] == (experts, experts * 2 // 5)


def test_flops_per_token():
    f = P.flops_per_token(P.MISTRAL_7B)
    # untied: everything but the embedding lookup multiplies, twice (multiply + add)
    assert f["matmul"] == 2 * (7_241_732_096 - 32000 * 4096) and f["attention"] == 0
    assert f["dense_equivalent"] == f["matmul"]
    mix = P.flops_per_token(P.MIXTRAL_8X7B, context=1000)
    assert mix["attention"] == 4 * 32 * 32 * 128 * 1000 and mix["total"] == mix["matmul"] + mix["attention"]
    # the MoE spends the active parameters' FLOPs; all 8 experts would cost the dense equivalent
    assert mix["matmul"] == 2 * (12_879_925_248 - 32000 * 4096)
    assert mix["dense_equivalent"] == 2 * (46_702_792_704 - 32000 * 4096)
    # a tied head still multiplies with the embedding matrix
    smol = P.flops_per_token(P.SMOLLM2_135M)
    assert smol["matmul"] == 2 * 134_515_008


def test_more_experts_grow_total_not_active():
    base = P.count_parameters(P.with_experts(P.SMOLLM2_135M, 8, 2))
    more = P.count_parameters(P.with_experts(P.SMOLLM2_135M, 16, 2))
    per_expert = 30 * 3 * 576 * 1536
    assert more.total - base.total == 8 * per_expert + 30 * 8 * 576       # 8 more experts and router rows
    assert more.active - base.active == 30 * 8 * 576                      # only the router grows


def test_bad_input():
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        P.with_experts(P.MISTRAL_7B, 4, 5)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        P.DecoderShape(name="x", vocab_size=10, hidden_size=8, num_hidden_layers=1, num_attention_heads=3,
                       num_key_value_heads=2, intermediate_size=4, head_dim=2)
    with pytest.raises(ValueError, match="hidden_size"):
        P.DecoderShape(name="x", vocab_size=10, hidden_size=0, num_hidden_layers=1, num_attention_heads=1,
                       num_key_value_heads=1, intermediate_size=4)
    with pytest.raises(ValueError, match="context"):
        P.flops_per_token(P.MISTRAL_7B, context=-1)
    with pytest.raises(TypeError, match="DecoderShape"):
        P.count_parameters(LlamaConfig())
