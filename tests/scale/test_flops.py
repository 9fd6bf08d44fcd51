"""llmu.scale.flops: 6·N·D and attention's causal count, by hand and against a brute-force sum.

The per-token attention count is checked against the work of each position summed one by one
(token t attends to t positions), and the matmul count against every weight matrix of a model
built here multiplied once per token (the embedding table excluded, the head included).
"""

from __future__ import annotations

import pytest

import llmu  # noqa: F401
from llmu.models import LlamaConfig
from llmu.models.llama import LlamaModel
from llmu.moe.params import SMOLLM2_135M, count_parameters
from llmu.scale import flops as Fl

SMALL = LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=64, num_hidden_layers=3,
                    num_attention_heads=6, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)


def test_six_n_d():
    assert Fl.training_flops(70e9, 1.4e12) == pytest.approx(5.88e23)
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match="n_params"):
            Fl.training_flops(bad, 10)
    with pytest.raises(TypeError, match="tokens"):
        Fl.training_flops(10, "10")


def test_matmul_parameters_are_every_multiplied_weight_of_a_real_model():
    model = LlamaModel(SMALL)
    # every parameter but the embedding table (norm gains multiply too, one multiply per element)
    multiplied = sum(p.numel() for name, p in model.named_parameters() if "embed" not in name)
    assert Fl.matmul_parameters(SMALL) == Fl.matmul_parameters(model) == multiplied
    # tied head: the one matrix is counted once, as the head
    assert Fl.matmul_parameters(SMOLLM2_135M) == count_parameters(SMOLLM2_135M).total


@pytest.mark.parametrize("seq_len", [1, 2, 7, 128])
def test_causal_attention_by_brute_force(seq_len):
    d_attn = SMALL.num_attention_heads * SMALL.head_dim
    # token t (1-based) does q.k and p.v against t positions: 2 * 2 * d_attn FLOPs each, per layer
    total = sum(4 * SMALL.num_hidden_layers * d_attn * t for t in range(1, seq_len + 1))
    fwd = Fl.forward_flops_per_token(SMALL, seq_len)
    assert fwd["attention"] * seq_len == total
    assert fwd["matmul"] == 2 * Fl.matmul_parameters(SMALL) and fwd["total"] == fwd["matmul"] + fwd["attention"]
    train = Fl.train_flops_per_token(SMALL, seq_len)
    assert train == {k: 3 * v for k, v in fwd.items()}
    assert train["attention"] == Fl.kaplan_attention_flops(3, seq_len + 1, d_attn)
    assert Fl.train_step_flops(SMALL, 5, seq_len) == 5 * seq_len * train["total"]


def test_attention_share_grows_with_context():
    shares = [Fl.attention_share(SMOLLM2_135M, t) for t in (128, 2048, 8192, 32768)]
    assert shares == sorted(shares) and 0 < shares[0] < 0.05 and shares[-1] > 0.7
    # a wide model: 8192 tokens of context are a small share of Llama 3 8B's work
    assert 0.1 < Fl.attention_share(Fl.LLAMA3_8B, 8192) < 0.15


def test_llama3_presets_match_published_sizes():
    assert round(count_parameters(Fl.LLAMA3_8B).total / 1e9, 2) == 8.03
    assert round(count_parameters(Fl.LLAMA3_70B).total / 1e9, 1) == 70.6


def test_bad_inputs():
    with pytest.raises(ValueError, match="seq_len"):
        Fl.forward_flops_per_token(SMALL, 0)
    with pytest.raises(ValueError, match="seq_len"):
        Fl.train_flops_per_token(SMALL, 3.5)
    with pytest.raises(TypeError, match="DecoderShape"):
        Fl.attention_share("llama", 10)
    with pytest.raises(ValueError, match="batch"):
        Fl.train_step_flops(SMALL, 0, 10)
