"""The training-memory calculator (llmu.parallel.memory): Korthikanti et al.'s activation formula,
the ZeRO formulas it reuses, and how the parallel degrees divide the memory. No processes needed.

Everything here is exact arithmetic on ints and floats: equalities are checked with a relative
tolerance of 1e-12 (float rounding of a few products), never more.
"""

from __future__ import annotations

import math

import pytest

from llmu.moe.params import count_parameters
from llmu.parallel import memory as M
from llmu.parallel.zero import zero_memory_formula

S, B, H, A = 4096, 2, 4096, 32
SBH = S * B * H


def close(a, b):
    return math.isclose(a, b, rel_tol=1e-12)


def test_activation_formula_follows_korthikanti_table_2():
    # no parallelism: s·b·h·(34 + 5·a·s/h)
    assert close(M.activation_bytes_per_layer(S, B, H, A), SBH * (34 + 5 * A * S / H))
    for t in (2, 4, 8):
        tp = M.activation_bytes_per_layer(S, B, H, A, tensor_parallel=t)
        assert close(tp, SBH * (10 + 24 / t + 5 * A * S / (H * t)))
        sp = M.activation_bytes_per_layer(S, B, H, A, tensor_parallel=t, sequence_parallel=True)
        assert close(sp, SBH * (34 / t + 5 * A * S / (H * t)))
        sel = M.activation_bytes_per_layer(S, B, H, A, tensor_parallel=t, sequence_parallel=True, recompute="selective")
        assert close(sel, SBH * 34 / t)
        assert close(M.activation_bytes_per_layer(S, B, H, A, tensor_parallel=t, recompute="selective"),
                     SBH * (10 + 24 / t))
    assert close(M.activation_bytes_per_layer(S, B, H, A, recompute="full"), 2 * SBH)
    # sequence parallelism changes nothing at t = 1
    assert close(M.activation_bytes_per_layer(S, B, H, A, sequence_parallel=True), M.activation_bytes_per_layer(S, B, H, A))


def test_published_parameter_counts():
    # Llama 2 7B: 6.74B; Llama 3 70B: 70.6B; Llama 3.1 405B: 405.9B (the model cards round these)
    assert round(count_parameters(M.LLAMA2_7B).total / 1e9, 2) == 6.74
    assert round(count_parameters(M.LLAMA3_70B).total / 1e9, 1) == 70.6
    assert round(count_parameters(M.LLAMA31_405B).total / 1e9, 1) == 405.9


def test_states_are_zero_formula_of_this_ranks_share():
    psi = count_parameters(M.LLAMA3_70B).total
    for precision in ("mixed", "float32"):
        for stage in range(4):
            got = M.training_memory(M.LLAMA3_70B, seq_len=2048, precision=precision, data_parallel=16,
                                    zero_stage=stage, tensor_parallel=8, pipeline_parallel=4)
            want = zero_memory_formula(-(-psi // 32), 16, stage, precision)
            assert {k: got[k] for k in ("params", "grads", "optimizer")} == \
                {k: want[k] for k in ("params", "grads", "optimizer")}
            assert close(got["total"], want["total"] + got["activations"])
    plain = M.training_memory(M.LLAMA2_7B, seq_len=1024)
    assert plain["params"] + plain["grads"] + plain["optimizer"] == 16 * plain["num_params"]


def test_parallel_degrees_divide_the_activations():
    shape = M.LLAMA2_7B
    base = M.training_memory(shape, seq_len=4096, recompute="selective")
    logits = 4 * 4096 * shape.vocab_size
    layers = base["activations"] - logits
    assert close(layers, 32 * M.activation_bytes_per_layer(4096, 1, 4096, 32, recompute="selective"))
    # 1F1B: the first stage holds p micro-batches of L/p layers: L layers' worth, whatever p is
    for p in (2, 4, 8):
        assert close(M.training_memory(shape, seq_len=4096, recompute="selective", pipeline_parallel=p)["activations"],
                     layers)
    # fewer micro-batches than stages: fewer in flight
    assert close(M.training_memory(shape, seq_len=4096, recompute="selective", pipeline_parallel=4,
                                   micro_batches=2)["activations"], layers / 2)
    # context parallelism halves everything linear in s (selective recomputation removed the s² term)
    assert close(M.training_memory(shape, seq_len=4096, recompute="selective", context_parallel=2)["activations"],
                 base["activations"] / 2)
    # tensor parallelism with sequence parallelism (the default for t > 1) divides by t
    assert close(M.training_memory(shape, seq_len=4096, recompute="selective", tensor_parallel=8)["activations"],
                 base["activations"] / 8)
    # full recomputation keeps 2·s·b·h per layer, plus one layer recomputed at a time
    full = M.training_memory(shape, seq_len=4096, recompute="full")["activations"] - logits
    assert close(full, 32 * 2 * 4096 * 4096 + M.activation_bytes_per_layer(4096, 1, 4096, 32, recompute="selective"))


def test_70b_does_not_fit_one_gpu_and_zero3_over_64_does_its_states():
    one = M.training_memory(M.LLAMA3_70B, seq_len=4096, recompute="selective")
    assert one["params"] / 1e9 > M.GPU_MEMORY_GB["H200"] / 2          # even the bf16 weights take 141 GB
    sharded = M.training_memory(M.LLAMA3_70B, seq_len=4096, recompute="full", data_parallel=64, zero_stage=3)
    assert close(sharded["params"] + sharded["grads"] + sharded["optimizer"], 16 * sharded["num_params"] / 64)


def test_memory_table_rows():
    rows = M.memory_table(M.LLAMA2_7B, [dict(zero_stage=s, data_parallel=8) for s in range(4)], seq_len=2048)
    assert [r["zero_stage"] for r in rows] == [0, 1, 2, 3]
    totals = [r["total"] for r in rows]
    assert totals == sorted(totals, reverse=True)
    assert close(rows[0]["params"], 2 * count_parameters(M.LLAMA2_7B).total / 1e9)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(seq_len=0), ValueError, "seq_len"),
    (dict(seq_len=100, context_parallel=3), ValueError, "divisible by context_parallel"),
    (dict(seq_len=128, tensor_parallel=0), ValueError, "tensor_parallel"),
    (dict(seq_len=128, pipeline_parallel=64), ValueError, "more than the model"),
    (dict(seq_len=128, precision="fp8"), ValueError, "precision"),
    (dict(seq_len=128, zero_stage=4), ValueError, "stage"),
    (dict(seq_len=128, recompute="some"), ValueError, "recompute"),
    (dict(seq_len=128, micro_batches=0), ValueError, "micro_batches"),
])
def test_bad_input(kwargs, error, match):
    with pytest.raises(error, match=match):
        M.training_memory(M.LLAMA2_7B, **kwargs)


def test_bad_input_elsewhere():
    with pytest.raises(TypeError, match="DecoderShape"):
        M.training_memory("Llama-2-7B", seq_len=128)
    with pytest.raises(TypeError, match="sequence_parallel"):
        M.activation_bytes_per_layer(8, 1, 8, 2, sequence_parallel=1)
    with pytest.raises(ValueError, match="heads"):
        M.activation_bytes_per_layer(8, 1, 8, 0)
    with pytest.raises(TypeError, match="layouts"):
        M.memory_table(M.LLAMA2_7B, dict(zero_stage=1), seq_len=8)
