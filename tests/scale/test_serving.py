"""llmu.scale.serving: dollars per million tokens and the roofline ceilings of decode and prefill."""

from __future__ import annotations

import pytest

import llmu  # noqa: F401
from llmu.moe.params import SMOLLM2_135M, count_parameters
from llmu.roofline import Roof, gpu_roofs
from llmu.scale import serving as S
from llmu.scale.flops import LLAMA3_8B, forward_flops_per_token

H200 = next(r for r in gpu_roofs() if "H200" in r.name)


def test_cost_per_million_tokens():
    # 1000 tokens/s for an hour = 3.6 M tokens for $3.60: one dollar per million
    assert S.cost_per_million_tokens(1000, 3.6) == pytest.approx(1.0)
    assert S.cost_per_million_tokens(2000, 3.6) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="tokens_per_s"):
        S.cost_per_million_tokens(0, 1)


def test_kv_and_weight_bytes():
    # Llama 3 8B: 32 layers x K and V x 8 heads x 128 dims x 2 bytes = 128 KiB a token
    assert S.kv_bytes_per_token(LLAMA3_8B) == 131072
    assert S.weight_bytes(SMOLLM2_135M, 4) == 4 * count_parameters(SMOLLM2_135M).total


def test_decode_at_batch_one_reads_the_weights():
    t = S.decode_step_seconds(LLAMA3_8B, 1, 0, H200)
    assert t == pytest.approx(2 * 8_030_261_248 / 4.8e12)
    assert S.decode_tokens_per_s(LLAMA3_8B, 1, 0, H200) == pytest.approx(1 / t)


def test_decode_batches_until_the_compute_roof():
    rates = [S.decode_tokens_per_s(LLAMA3_8B, b, 1024, H200) for b in (1, 8, 64, 512)]
    assert rates == sorted(rates)
    # a roof with a tiny peak: the step is compute-bound and tokens/s stops growing with the batch
    slow = Roof("slow", peak_flops=1e12, bandwidth=4.8e12)
    per_token = forward_flops_per_token(LLAMA3_8B, 1)["total"]   # context 0: the token attends to itself
    assert S.decode_tokens_per_s(LLAMA3_8B, 4096, 0, slow) == pytest.approx(1e12 / per_token)


def test_prefill_is_compute_bound():
    r = S.prefill_tokens_per_s(LLAMA3_8B, 1024, H200, utilization=0.5)
    assert r == pytest.approx(0.5 * H200.peak_flops / forward_flops_per_token(LLAMA3_8B, 1024)["total"])
    assert r > 50 * S.decode_tokens_per_s(LLAMA3_8B, 1, 1024, H200)
    with pytest.raises(ValueError, match="utilization"):
        S.prefill_tokens_per_s(LLAMA3_8B, 1024, H200, utilization=1.5)
    with pytest.raises(TypeError, match="roof"):
        S.decode_tokens_per_s(LLAMA3_8B, 1, 10, (1e15, 4.8e12))
    with pytest.raises(ValueError, match="context"):
        S.decode_step_seconds(LLAMA3_8B, 1, -1, H200)
