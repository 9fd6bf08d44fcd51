"""Notebook 05's graded exercises, run in-process (no kernel, no model): the instructor's solutions
pass every test cell, hidden parts included, and typical wrong answers fail them.

Exercises 1 to 4 and 6 are plain Python. Exercise 5 is a Triton kernel (and the tiles chosen for a GPU):
its launcher cell (``ex5_launcher``) runs after it, and the cells run with the kernel device as
torch's default device (Triton's interpreter on a CPU, where the speed part of ``test_ex5_speed``
only prints why it is not judged). The whole notebook (model cells, widgets, benchmark) is
executed by the course-wide notebook tests.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import llmu  # noqa: F401
from llmu import course

NOTEBOOK = Path(__file__).resolve().parents[2] / "solutions" / "05_prefill_decode" / "05_prefill_decode.ipynb"


EXERCISES = {
    **{f"ex{n}": course.Exercise.numbered(n) for n in (1, 2, 3, 4)},
    "ex5": course.Exercise("ex5_solution", ("test_ex5_visible", "test_ex5_hidden", "test_ex5_speed"),
                           after=("ex5_launcher",)),
    "ex6": course.Exercise.numbered(6),
}


WRONG = {
    # exercise, replaced text, replacement, the test cell that must catch it
    "ex1: output not counted": ("ex1", "(M * K + K * N + M * N)", "(M * K + K * N)", "test_ex1_visible"),
    "ex1: FLOPs without the 2": ("ex1", "flops = 2 * M * N * K", "flops = M * N * K", "test_ex1_visible"),
    "ex1: no validation": ("ex1", "raise ValueError", "pass  #", "test_ex1_hidden"),
    "ex2: max instead of min": ("ex2", "return min(", "return max(", "test_ex2_visible"),
    "ex2: no validation": ("ex2", 'raise ValueError("peak_flops', 'print("peak_flops', "test_ex2_hidden"),
    "ex3: ridge counted as memory-bound": ("ex3", "intensity < ridge", "intensity <= ridge", "test_ex3_hidden"),
    "ex3: ridge inverted": ("ex3", "ridge = peak_flops / bandwidth", "ridge = bandwidth / peak_flops",
                            "test_ex3_visible"),
    "ex4: TPOT over n gaps": ("ex4", "/ (n - 1) if n > 1", "/ n if n > 1", "test_ex4_visible"),
    "ex4: TPOT as the last gap": ("ex4", "(timestamps[-1] - timestamps[0]) / (n - 1)",
                                  "(timestamps[-1] - timestamps[-2])", "test_ex4_hidden"),
    "ex5: rows and columns strides of A swapped": (
        "ex5", "offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak",
        "offs_m[:, None] * stride_ak + offs_k[None, :] * stride_am", "test_ex5_visible"),
    "ex5: no mask on K": ("ex5", "k_ok = offs_k < K - k0", "k_ok = offs_k < BLOCK_K", "test_ex5_hidden"),
    "ex5: B read as if contiguous": ("ex5", "offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn",
                                     "offs_k[:, None] * N + offs_n[None, :]", "test_ex5_hidden"),
    "ex5: C written as if contiguous": ("ex5", "offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn",
                                        "offs_m[:, None] * N + offs_n[None, :]", "test_ex5_hidden"),
    "ex5: float16 accumulator": ("ex5", "acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)",
                                 "acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=c_ptr.dtype.element_ty)", "test_ex5_hidden"),
    "ex5: a short last group taken as GROUP_M rows": (
        "ex5", "group_size_m = min(num_pid_m - first_pid_m, GROUP_M)", "group_size_m = GROUP_M", "test_ex5_hidden"),
    "ex5: % and // swapped in the grouped order": (
        "ex5", "pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m\n"
               "    pid_n = (pid % num_pid_in_group) // group_size_m",
        "pid_m = first_pid_m + (pid % num_pid_in_group) // group_size_m\n"
        "    pid_n = (pid % num_pid_in_group) % group_size_m", "test_ex5_visible"),
    "ex5: GPU_TILES over an H100's shared memory": ("ex5", "num_warps=8, num_stages=3)", "num_warps=8, num_stages=6)",
                                                    "test_ex5_speed"),
    "ex5: GPU_TILES block not a power of two": ("ex5", "GPU_TILES = dict(BLOCK_M=128, BLOCK_N=256",
                                                "GPU_TILES = dict(BLOCK_M=128, BLOCK_N=192", "test_ex5_speed"),
    "ex5: GPU_TILES num_warps of 3": ("ex5", "num_warps=8, num_stages=3)", "num_warps=3, num_stages=3)",
                                      "test_ex5_speed"),
    "ex5: kernel right only at the small tiles (BLOCK_K hard-coded)": (
        "ex5", "a_ptrs += BLOCK_K * stride_ak\n        b_ptrs += BLOCK_K * stride_bk",
        "a_ptrs += 16 * stride_ak\n        b_ptrs += 16 * stride_bk", "test_ex5_speed"),
    "ex6: KV heads counted as query heads": ("ex6", "k = cfg.num_key_value_heads * D", "k = cfg.num_attention_heads * D",
                                             "test_ex6_visible"),
    "ex6: the cache read once, not per sequence": ("ex6", "kv * 2 * B * n * k", "kv * 2 * n * k", "test_ex6_visible"),
    "ex6: weights read once per sequence": ("ex6", "e * (n_in * n_out + B * n_in)", "e * B * (n_in * n_out + n_in)",
                                            "test_ex6_visible"),
    "ex6: the LM head forgotten": ("ex6", '        linear("lm_head", d, V, layers=1),', "", "test_ex6_visible"),
    "ex6: a tied head counted twice": ("ex6", 'linear("lm_head", d, V, layers=1)',
                                       'linear("lm_head", d, V, layers=2 if cfg.tie_word_embeddings else 1)',
                                       "test_ex6_visible"),
    "ex6: one FLOP per multiply-add": ("ex6", "layers * 2 * B * n_in * n_out", "layers * B * n_in * n_out",
                                       "test_ex6_visible"),
    "ex6: attention without the weighted sum of the values": ("ex6", "L * 2 * 2 * B * H * n * D", "L * 2 * B * H * n * D",
                                                              "test_ex6_visible"),
    "ex6: attention over the cached tokens only": ("ex6", "n = context + 1 ", "n = context ", "test_ex6_visible"),
    "ex6: the sum of the two times, not their max": ("ex6", "max(flops / peak_flops, nbytes / bandwidth)",
                                                     "flops / peak_flops + nbytes / bandwidth", "test_ex6_visible"),
    "ex6: the max of the totals, not the sum of the maxima": (
        "ex6", "sum(max(flops / peak_flops, nbytes / bandwidth) for _, flops, nbytes in costs)",
        "max(sum(c[1] for c in costs) / peak_flops, sum(c[2] for c in costs) / bandwidth)", "test_ex6_hidden"),
    "ex6: the query width taken as hidden_size": ("ex6", "q = H * D ", "q = d ", "test_ex6_hidden"),
    "ex6: kv_elem_bytes ignored": ("ex6", "kv_elem_bytes = elem_bytes if kv_elem_bytes is None else kv_elem_bytes",
                                   "kv_elem_bytes = elem_bytes", "test_ex6_hidden"),
    "ex6: batch and context not checked": ("ex6", 'raise ValueError(f"{name} must be an int', 'print(f"{name} must be an int',
                                           "test_ex6_hidden"),
}


# The exercise file's two tests: every solution passes its test cells; every wrong answer is
# caught by the test cell named for it (cell metadata is checked in tests/course/test_notebooks.py).
(notebook, test_solutions_pass_all_tests, test_wrong_answers_fail,
 test_library_answers_fail) = course.exercise_tests(
    NOTEBOOK, EXERCISES, WRONG, on_kernel_device=True)


#: What the test cells say about the important mistakes of exercise 6 (a fragment of the message).
EX6_MESSAGES = {
    "ex6: KV heads counted as query heads": "k_proj over the 30 layers, 3 KV heads of 64",
    "ex6: the cache read once, not per sequence": "the bytes that do not grow with the batch",
    "ex6: weights read once per sequence": "the bytes that do not grow with the batch",
    "ex6: the LM head forgotten": "the twelve operations' names",
    "ex6: a tied head counted twice": "lm_head, a 49152 x 576 matrix read once",
    "ex6: attention without the weighted sum of the values": "attention over 64 positions",
    "ex6: the sum of the two times, not their max": "two operations on a device of 1 PFLOP/s",
    "ex6: the max of the totals, not the sum of the maxima": "on a CPU of 92.7 GFLOP/s and 7.1 GB/s",
    "ex6: the query width taken as hidden_size": "4 heads of 96 over a hidden size of 256",
}


@pytest.mark.parametrize("case", list(EX6_MESSAGES))
def test_ex6_wrong_answers_name_the_property(case, notebook, tmp_path):
    message = str(notebook.check_caught(*WRONG[case], workdir=tmp_path))
    assert EX6_MESSAGES[case] in message, message


def test_ex6_solution_is_a_design_of_30_to_50_lines():
    """Exercise 6's reference answer (both functions) has 30 to 50 lines of code."""
    lines = course.solution_code_lines(course.cells_by_grade_id(NOTEBOOK)["ex6_solution"])
    assert 30 <= lines <= 50, lines


def test_the_benchmark_times_your_matmul_beside_llmus(notebook, tmp_path):
    """The benchmark cell passes exercise 5's kernel (through its launcher, as x @ W^T) the way the
    gemm entry calls llmu's Triton matmul: with the solution in place, it gives llmu's output."""
    assert notebook.check_bench_yours(tmp_path, {"gemm": "ex5"}, sizes={"gemm": {"M": 40, "N": 72, "K": 100}}) == \
        {"gemm": "ok"}


# The figures the notebook's prose states, recomputed from llmu's code and SmolLM2's config (no model).

def _prose(grade_id: str) -> str:
    return course.cells_by_grade_id(NOTEBOOK)[grade_id]


def test_decode_reads_the_weights_and_a_small_cache():
    """Section 5: SmolLM2's fp32 weights, and the cache the longest prompt (256 + 8 new tokens) leaves."""
    import torch

    from llmu.kvcache.reference import kv_cache_bytes
    from llmu.models import LlamaConfig

    c = LlamaConfig()
    weights = c.num_parameters() * 4
    per_token = kv_cache_bytes(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 1, 1, torch.float32)
    cache = per_token * (256 + 8)
    text = _prose("latency_read")
    assert f"{weights / 1e6:.0f} MB" == "538 MB" and "reads all 538 MB of fp32 weights" in text
    assert per_token == 46_080 and "46,080 bytes each in fp32" in text
    assert f"{cache / 1e6:.0f} MB" == "12 MB" and round(100 * cache / weights) == 2
    assert "12 MB, about 2 % of the weights" in text and "a few MB" not in text


def test_large_gemv_weights():
    """Section 6: the fp32 bytes of the sweep's matrices larger than a last-level cache."""
    import ast
    import re

    shapes = ast.literal_eval(re.search(r"^SHAPES = (.*)$", _prose("gemv_sweep"), re.M).group(1))
    large = sorted(n * k * 4 for n, k in shapes if n * k * 4 > 32e6)
    assert (f"{large[0] / 1e6:.0f}", f"{large[-1] / 1e6:.0f}") == ("67", "134")
    assert "the large matrices (67 to 134 MB in fp32" in _prose("gemv_read")


def test_softmax_intensity():
    """Self-check 3: softmax's intensity in bf16, as the benchmark registry counts it."""
    from llmu.bench.registry import load_all

    entry = load_all()["softmax_rows"]
    for size in entry.gpu_sizes:
        assert entry.flops(size) / entry.bytes(size, 2) == 1.25
    text = _prose("self_check")
    assert "1.25 FLOP/byte at any size" in text and "about 1.5 FLOP/byte" not in text


def _flat(grade_id: str) -> str:
    """A cell's text with its line breaks and runs of spaces as single spaces."""
    return " ".join(_prose(grade_id).split())


def test_tile_figures():
    """Section 7: a tile's intensity, the loads of a 4096^3 GEMM, shared memory, registers and the
    grid, recomputed from llmu's formulas, the datasheet table and ``llmu gpu-compile``'s targets."""
    from llmu.bench.peaks import peak_for
    from llmu.gpu_compile.capture import TARGETS
    from llmu.roofline.kernels import H100_SHARED_MEMORY, Tiles, shared_memory_bytes
    from llmu.roofline.model import gemm_flops

    text = _flat("matmul_md")
    h200 = peak_for("NVIDIA H200")
    peak, bandwidth = h200.tflops["bfloat16"] * 1e12, h200.bandwidth_gbs * 1e9
    n, e = 4096, 2

    def tile_intensity(bm, bn):
        return 2 * bm * bn / (e * (bm + bn))

    def loads(bm, bn):                  # every program reads its row panel of A and column panel of B
        return e * n ** 3 * (1 / bn + 1 / bm)

    assert f"{tile_intensity(16, 16):.0f} FLOP/byte and a $128 \\times 256$ tile {tile_intensity(128, 256):.1f}" \
        in text
    assert (tile_intensity(16, 16), round(tile_intensity(128, 256), 1)) == (8, 85.3)
    assert f"load {loads(16, 16) / 1e9:.1f} GB with $16 \\times 16$ tiles and {loads(128, 256) / 1e9:.1f} GB" in text
    assert f"{loads(16, 16) / bandwidth * 1e3:.1f} ms against {loads(128, 256) / bandwidth * 1e3:.2f} ms at an H200's " \
           f"{bandwidth / 1e12:.1f} TB/s" in text
    assert f"{gemm_flops(n, n, n) / peak * 1e3:.3f} ms at {peak / 1e12:.1f} TFLOP/s" in text
    assert f"left of the H200's ridge ({peak / bandwidth:.0f})" in text
    big = Tiles(128, 256, 64, GROUP_M=8, num_warps=8, num_stages=3)
    per_stage = shared_memory_bytes(Tiles(128, 256, 64, num_stages=1), e)
    assert f"{per_stage // 1024} KB per stage, {shared_memory_bytes(big, e) // 1024} KB with 3 stages, of the " \
           f"{H100_SHARED_MEMORY // 1024} KB" in text
    assert TARGETS["sm_90"][1] == H100_SHARED_MEMORY
    assert f"({TARGETS['sm_80'][1] // 1024} KB on an A100, {TARGETS['sm_75'][1] // 1024} KB on a T4)" in text
    acc = 128 * 256 * 4
    assert f"{acc // 1024} KB of registers, {128 * 256 // (8 * 32)} per thread with 8 warps" in text
    assert f"With 4 warps it would need {128 * 256 // (4 * 32)} per thread, more than the 255" in text
    assert 2 * shared_memory_bytes(big, e) > 228 * 1024 and "only one fits in an H100 SM's 228 KB" in text
    programs, sms = (n // 128) * (n // 256), TARGETS["sm_90"][2]
    assert f"has {programs} programs, {programs / sms:.1f} for each of an H100's {sms} SMs" in text


def test_exercise_5_rules_match_the_checks(notebook):
    """What exercise 5's text promises is what ``test_ex5_speed`` checks, and the solution's
    GPU_TILES keep to it."""
    from llmu.gpu_compile.capture import TARGETS
    from llmu.roofline.kernels import H100_SHARED_MEMORY, MAX_STAGES, NUM_WARPS, shared_memory_bytes

    text = _flat("ex5_md")
    speed = notebook.cells["test_ex5_speed"]
    assert NUM_WARPS == (1, 2, 4, 8, 16) and "`num_warps` is 1, 2, 4, 8 or 16" in text
    assert MAX_STAGES == 6 and "`num_stages` 1 to 6" in text
    assert f"stays within {H100_SHARED_MEMORY // 1024} KB" in text
    assert f"a T4 has {TARGETS['sm_75'][1] // 1024} KB" in text
    assert "**at least half of llmu's**" in text and "yours_tflops >= 0.5 * llmu_tflops" in speed
    assert "$M = N = K = 4096$ in bf16" in text and "size = 4096" in speed and "2 * size ** 3" in speed
    import ast
    import re

    line = re.search(r"^GPU_TILES = dict\((.*)\)$", notebook.cells["ex5_solution"], re.M).group(1)
    tiles = {kw.arg: ast.literal_eval(kw.value) for kw in ast.parse(f"dict({line})").body[0].value.keywords}
    assert shared_memory_bytes(tiles, 2) == 144 * 1024 <= H100_SHARED_MEMORY


def test_self_check_tile_question():
    """Self-check 7: a 64 x 64 tile, BLOCK_K 64, bf16, 4 stages."""
    from llmu.roofline.kernels import Tiles, shared_memory_bytes

    text = _flat("self_check")
    t = Tiles(64, 64, 64, num_stages=4)
    assert 2 * 64 * 64 / (2 * (64 + 64)) == 32 and "(64 + 64)) = 32$ FLOP/byte" in text
    assert shared_memory_bytes(t, 2) == 65_536 and "= 65{,}536$ bytes, 64 KB" in text
    assert shared_memory_bytes(Tiles(64, 64, 64, num_stages=2), 2) == 32 * 1024 and "use 2 stages (32 KB)" in text


def test_kernel_tests_choose_their_own_device_and_tolerance(notebook):
    """Exercise 5's test cells pick the kernel device and the tolerance (TF32 on a GPU) themselves."""
    for name in ("test_ex5_visible", "test_ex5_hidden", "test_ex5_speed"):
        _, _, body = notebook.cells[name].partition(course.END_HIDDEN)
        assert "dev = llmu.runtime.kernel_device()" in body
    for name in ("test_ex5_visible", "test_ex5_hidden"):
        assert "tol = 1e-4 if llmu.runtime.interpreting() else 5e-2" in notebook.cells[name]


def test_grouped_order_example():
    """Exercise 5's worked example of the grouped order (3 row tiles, 2 column tiles, GROUP_M 2),
    recomputed with the solution's (and llmu's) index arithmetic, line for line, in Python."""
    def tile(pid, num_pid_m, num_pid_n, group_m):
        num_pid_in_group = group_m * num_pid_n
        first_pid_m = (pid // num_pid_in_group) * group_m
        group_size_m = min(num_pid_m - first_pid_m, group_m)
        return first_pid_m + (pid % num_pid_in_group) % group_size_m, (pid % num_pid_in_group) // group_size_m

    order = [tile(pid, 3, 2, 2) for pid in range(6)]
    assert sorted(order) == [(i, j) for i in range(3) for j in range(2)]      # every tile once
    written = ", ".join(f"({i}, {j})" for i, j in order)
    assert written == "(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (2, 1)"
    assert f"programs 0 to 5 compute tiles (row, column) {written}" in _flat("ex5_md")


def test_the_decode_steps_memory_roof_is_tens_of_milliseconds_here():
    """Section 5b: 538 MB at the 27 GB/s this course's 2-core machine copies is 20 ms, not "a few"."""
    from llmu.models import LlamaConfig

    weights = LlamaConfig().num_parameters() * 4
    text = " ".join(_prose("decode_step_md").split())
    assert f"{weights / 1e6:.0f} MB at 27 GB/s" in text
    assert f"is {weights / 27e9 * 1e3:.0f} ms" in text and "takes tens of milliseconds" in text
    assert "a few milliseconds" not in text


def test_exercise_6_figures():
    """Section 8, exercise 6, the analysis's model answer, the summary and self-check 8: the figures
    recomputed from llmu's count of a step (``llmu.roofline.decode_cost``) and the datasheet roofs."""
    from llmu.models import LlamaConfig
    from llmu.roofline import gpu_roofs
    from llmu.roofline.decode_cost import predict_time, step_cost, step_totals

    c = LlamaConfig()
    d, f, H, Hkv, D, L = c.hidden_size, c.intermediate_size, 9, 3, c.head_dim, c.num_hidden_layers

    def neglected(batch, e=2):       # RoPE on q and k, SwiGLU's gate product, two residual adds, the lookup
        per_layer = 2 * (H + Hkv) * D * e + 3 * f * e + 2 * 3 * d * e
        return L * batch * per_layer + 2 * batch * d * e

    def share(batch, context):
        return 100 * neglected(batch) / step_totals(step_cost(c, batch, context))[1]

    text = _flat("step_md")
    assert (round(share(1, 0), 1), round(share(1, 1024), 1), round(share(64, 1024)), round(share(64, 64))) == (0.2, 0.2, 2, 9)
    assert "add 0.2 % to SmolLM2's bytes at batch 1 and 2 % at batch 64 with 1,024 tokens of context (9 % at " \
           "batch 64 with 64 tokens" in text
    assert c.num_parameters() == 134_515_008 and "2 bytes × 134,515,008 parameters" in _flat("ex6_md")

    h100 = next(g for g in gpu_roofs() if g.name == "NVIDIA H100 SXM")

    def on_h100(batch, context=1024):
        ops = step_cost(c, batch, context)
        t = predict_time(ops, h100.peak_flops, h100.bandwidth)
        att = predict_time([o for o in ops if o.name == "attention"], h100.peak_flops, h100.bandwidth)
        return t * 1e6, 100 * att / t

    t1, a1 = on_h100(1)
    t16, a16 = on_h100(16)
    t64, a64 = on_h100(64)
    t256, a256 = on_h100(256)
    assert (round(t1), round(t16 / 16), round(t64), round(t64 / 64, 1), round(t256 / 256, 1)) == (88, 12, 549, 8.6, 7.6)
    assert (round(a1), round(a16), round(a64), round(a256)) == (8, 57, 82, 93)
    written = _flat("ex6_written")
    assert "attention is 8 % of the predicted step at batch 1, 57 % at 16, 82 % at 64 and 93 % at 256" in written
    assert "falls from 88 µs to 12 µs at batch 16, then only to 8.6 at 64 and 7.6 at 256" in written
    assert "About 88 µs at batch 1 and 549 µs at batch 64 (8.6 µs per token)" in written
    first = {}
    for batch in range(1, 1100):
        for o in step_cost(c, batch, 1024):
            if o.name not in first and o.flops / h100.peak_flops > o.bytes / h100.bandwidth:
                first[o.name] = batch
    assert first == {"lm_head": 614, "gate_proj": 1002, "up_proj": 1002, "down_proj": 1002}
    assert "the LM head crosses the ridge at a batch of 614 and the MLP's three products at 1,002" in written
    assert round(h100.ridge) == 295 and d / 2 == 288
    attention = next(o for o in step_cost(c, 64, 1024) if o.name == "attention")
    assert round(attention.flops / attention.bytes) == 3
    # 50 MB of attention at batch 16 with 64 tokens in fp32, 7 ms at about 7 GB/s
    att16 = next(o for o in step_cost(c, 16, 64, 4) if o.name == "attention")
    assert round(att16.bytes / 1e6) == 50 and round(att16.bytes / 7.1e9 * 1e3) == 7 and "its 50 MB would take 7" in written

    shares = {b: on_h100(b)[1] for b in (11, 12)}
    assert shares[11] < 50 < shares[12] and "takes most of a step from a batch of 12 on" in _flat("summary")

    cache = L * 2 * 64 * 1025 * Hkv * D * 2
    total = step_totals(step_cost(c, 64, 1024))[1]
    weights = c.num_parameters() * 2
    check = _flat("self_check")
    assert f"{cache / 1e9:.2f} GB" == "1.51 GB" and f"{weights / 1e6:.0f} MB" == "269 MB" and cache / total > 0.8
    assert "= 1.51 GB; the weights: 269 MB" in check and "of its predicted 549 µs" in check
