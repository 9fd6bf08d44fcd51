"""Notebook 09's graded exercises, run in-process (no kernel, no model): the instructor's solutions
pass every test cell, hidden parts included, and typical wrong answers fail them.

The whole notebook (simulation, picture, model cells, benchmark) is executed by the course-wide
notebook tests.

The cells make their tensors without naming a device and move the paged inputs to
``kernel_device()`` themselves (``paged_inputs`` in the launcher cell); they are run with the
kernel device as torch's default device (a no-op in the interpreter, cuda when the kernels are
compiled), as the notebook 02 tests do.
"""

from __future__ import annotations

import pytest

import llmu  # noqa: F401  (Triton mode first: the exercise kernel is defined below)
from llmu import course

NOTEBOOK = course.repo_root() / "solutions" / "09_paged_attention" / "09_paged_attention.ipynb"


EXERCISES = {
    "ex1": course.Exercise.numbered(1),
    "ex2": course.Exercise.numbered(2),
    "ex3": course.Exercise("ex3_kernel", ("test_ex3_visible", "test_ex3_hidden"), after=("ex3_launcher",)),
    "ex4": course.Exercise.numbered(4),
    "ex5": course.Exercise("ex5_kernel", ("test_ex5_visible", "test_ex5_hidden"), after=("ex5_launcher",)),
}


WRONG = {
    # exercise, replaced text, replacement, the test cell that must catch it
    "ex1: blocks counted with floor": ("ex1", "need = -(-num_tokens // self.block_size)",
                                       "need = num_tokens // self.block_size", "test_ex1_visible"),
    "ex1: a new block every append": ("ex1", "if self.lengths[seq] % self.block_size == 0:", "if True:",
                                      "test_ex1_visible"),
    "ex1: fork adds no reference": ("ex1", "            self.ref_count[b] += 1\n", "            pass\n",
                                    "test_ex1_visible"),
    "ex1: free ignores the count": (
        "ex1", "            if self.ref_count[b] == 0:\n                self.free_blocks.append(b)",
        "            self.free_blocks.append(b)", "test_ex1_visible"),
    "ex1: allocate takes blocks before checking": (
        "ex1",
        "        if need > len(self.free_blocks):\n"
        "            raise NoFreeBlocks(f\"{need} blocks needed, {len(self.free_blocks)} free\")\n"
        "        table = [self.free_blocks.pop(0) for _ in range(need)]",
        "        table = [self.free_blocks.pop(0) for _ in range(min(need, len(self.free_blocks)))]\n"
        "        if len(table) < need:\n"
        "            raise NoFreeBlocks('not enough')",
        "test_ex1_hidden"),
    "ex1: no duplicate check": ("ex1", "        if seq in self.tables:\n            raise ValueError",
                                "        if False:\n            raise ValueError", "test_ex1_hidden"),
    "ex2: blocks read in pool order": ("ex2", "slots = block_tables[i, p // bs].long() * bs + p % bs", "slots = p",
                                       "test_ex2_hidden"),
    "ex2: query heads tiled, not grouped": ("ex2", ".repeat_interleave(h // hkv, dim=1)", ".repeat(1, h // hkv, 1)",
                                            "test_ex2_hidden"),
    "ex2: the padding is read": ("ex2", "p = torch.arange(int(context_lens[i]), device=q.device)",
                                 "p = torch.arange(block_tables.shape[1] * bs, device=q.device)", "test_ex2_visible"),
    "ex3: sum not rescaled": ("ex3", "l = l * alpha + tl.sum(p, axis=0)", "l = l + tl.sum(p, axis=0)",
                              "test_ex3_visible"),
    "ex3: last block not masked": ("ex3", 's = tl.where(valid, s, float("-inf"))', "s = s", "test_ex3_visible"),
    "ex3: blocks read in pool order": ("ex3", "block = tl.load(tables_ptr + b * max_blocks + i).to(tl.int64)",
                                       "block = (b * 0 + i).to(tl.int64)", "test_ex3_visible"),
    "ex3: one KV head for all": ("ex3", "kvh = h // (NUM_HEADS // NUM_KV_HEADS)", "kvh = h * 0", "test_ex3_hidden"),
    "ex4: no copy": ("ex4", "if ref_count[block] > 1:", "if False:", "test_ex4_visible"),
    "ex4: old block keeps its reference": ("ex4", "        ref_count[block] -= 1\n", "", "test_ex4_visible"),
    "ex4: only the new slot copied": ("ex4", "v_pool[new] = v_pool[block]", "v_pool[new] = 0", "test_ex4_visible"),
    "ex4: copies on any write": ("ex4", "if ref_count[block] > 1:", "if ref_count[block] >= 1:", "test_ex4_hidden"),
    "ex4: changes before raising": ("ex4", "        if not free_blocks:\n",
                                    "        if not free_blocks:\n            ref_count[block] -= 1\n",
                                    "test_ex4_hidden"),
    "ex5: block table ignored (logical block read as physical)": (
        "ex5", "block = tl.load(tables_ptr + b * max_blocks + i).to(tl.int64)", "block = (b * 0 + i).to(tl.int64)",
        "test_ex5_visible"),
    "ex5: causal mask without the prefix offset": (
        "ex5", "(pos[None, :] <= offset + offs_m[:, None])", "(pos[None, :] <= offs_m[:, None])", "test_ex5_visible"),
    "ex5: a row does not see its own position": (
        "ex5", "(pos[None, :] <= offset + offs_m[:, None])", "(pos[None, :] < offset + offs_m[:, None])",
        "test_ex5_visible"),
    "ex5: chunk rows read from row 0 of q, not cu_seqlens_q[b]": (
        "ex5", "q_rows = (q_start + offs_m) * NUM_HEADS + h", "q_rows = offs_m * NUM_HEADS + h", "test_ex5_visible"),
    "ex5: rows masked against the packed end cu_seqlens_q[b + 1], not q_len": (
        "ex5", "row_ok = offs_m < q_len", "row_ok = offs_m < q_start + q_len", "test_ex5_visible"),
    "ex5: cu_seqlens_q off by one (chunk one row short)": (
        "ex5", "q_len = tl.load(cu_ptr + b + 1) - q_start", "q_len = tl.load(cu_ptr + b + 1) - q_start - 1",
        "test_ex5_visible"),
    "ex5: one KV head per query head index (h % Hkv), not h // G": (
        "ex5", "kvh = h // (NUM_HEADS // NUM_KV_HEADS)", "kvh = h % NUM_KV_HEADS", "test_ex5_hidden"),
    "ex5: accumulator not rescaled": ("ex5", "acc = acc * alpha[:, None] + tl.dot(p, v)", "acc = acc + tl.dot(p, v)",
                                      "test_ex5_visible"),
    "ex5: sum not rescaled": ("ex5", "l = l * alpha + tl.sum(p, axis=1)", "l = l + tl.sum(p, axis=1)",
                              "test_ex5_visible"),
    "ex5: last block read past the context length": (
        "ex5", "v = tl.load(v_ptr + kv, mask=in_ctx[:, None], other=0.0)", "v = tl.load(v_ptr + kv)",
        "test_ex5_visible"),
    "ex5: padding rows stored": ("ex5", "acc / l[:, None], mask=row_ok[:, None])", "acc / l[:, None])",
                                 "test_ex5_visible"),
    "ex5: no causal skip (every block of the context read)": (
        "ex5", "for i in range(0, tl.cdiv(end, BLOCK_SIZE)):", "for i in range(0, tl.cdiv(ctx, BLOCK_SIZE)):",
        "test_ex5_visible"),
    "ex5: loop stopped at the tile's first row": (
        "ex5", "end = offset + tl.minimum(start_m + BLOCK_M, q_len)", "end = offset + start_m + 1",
        "test_ex5_visible"),
}


# The exercise file's tests: every solution passes its test cells; every wrong answer is caught
# by the test cell named for it; llmu's own answer fails every test cell of its exercise (cell
# metadata is checked in tests/course/test_notebooks.py).
(notebook, test_solutions_pass_all_tests, test_wrong_answers_fail,
 test_library_answers_fail) = course.exercise_tests(
    NOTEBOOK, EXERCISES, WRONG, on_kernel_device=True,
    warnings_to_ignore=["ignore::RuntimeWarning"])  # a wrong kernel's NaN rows in the interpreter's numpy


# -- the figures the prose states, recomputed from llmu.paged.waste (no model) -------------------

def _prose(grade_id):
    """A cell's text with its line breaks and indentation folded into single spaces."""
    return " ".join(course.cells_by_grade_id(NOTEBOOK)[grade_id].split())


def test_workload_lengths_stated():
    import inspect
    import math

    from llmu.paged import waste

    requests = waste.workload(64, seed=0)
    prompts = [r.prompt_len for r in requests]
    outputs = [r.output_len for r in requests]
    defaults = inspect.signature(waste.workload).parameters
    z = 1.6448536269514722          # the 95th percentile of a standard normal: 90 % lie within +-z

    def band(median, sigma):
        return [round(defaults[median].default * math.exp(s * z * defaults[sigma].default), -1) for s in (-1, 1)]

    (p_lo, p_hi), (o_lo, o_hi) = band("prompt_median", "prompt_sigma"), band("output_median", "output_sigma")
    text = _prose("waste_md")
    assert (f"around a median of {defaults['prompt_median'].default:.0f} tokens (90 % of them between about "
            f"{p_lo:.0f} and {p_hi:.0f}; the 64 drawn here run from {min(prompts)} to {max(prompts)})") in text
    assert (f"answers around a median of {defaults['output_median'].default:.0f} (90 % between {o_lo:.0f} and "
            f"{o_hi:.0f}; here from {min(outputs)} to {max(outputs)})") in text


def test_paged_run_length_stated():
    from llmu.paged import waste

    requests = waste.workload(64, seed=0)
    (paged,) = waste.compare(requests, policies=["paged"], budget=16384)
    longest = max(r.output_len for r in requests)
    assert paged.num_steps == 1 + longest
    assert (f"finishes in {paged.num_steps} steps (one prefill step, then one step for each of the {longest} "
            "tokens of its longest answer)") in _prose("waste_read")


def test_internal_fragmentation_example_stated():
    assert f"stops at 400 positions (prompt and answer) in a slab of 2048 leaves {2048 - 400} positions empty" \
        in _prose("idea_md")


# -- the benchmark cell ---------------------------------------------------------------------------

def test_the_benchmark_times_your_kernel_beside_llmus(notebook, tmp_path):
    """The benchmark cell hands exercise 3's kernel (through my_paged_decode) the paged decode
    entry's inputs as llmu's kernel takes them: with the solution in place, it gives llmu's output.
    37 positions: the last block of 16 is partly used."""
    size = {"B": 2, "H": 4, "Hkv": 2, "T": 37, "D": 16, "block_size": 16}
    assert notebook.check_bench_yours(tmp_path, {"paged_decode_attention": "ex3"},
                                      sizes={"paged_decode_attention": size}) == {"paged_decode_attention": "ok"}


def test_the_benchmark_launcher_takes_a_16_bit_cache(notebook, tmp_path):
    """On a GPU the benchmark's cache is 16-bit (bf16, fp16 on a T4): my_paged_decode takes it and
    the solution matches llmu's kernel there too. Checked in float16 (Triton's interpreter computes
    bfloat16 wrongly), within what one rounding of a 16-bit output allows."""
    import torch

    from llmu.paged import kernels

    ns = notebook.namespace("ex3", tmp_path)
    q, k_cache, v_cache, tables, lens = ns["paged_inputs"](4, 2, 16, 16, [5, 37], seed=3)
    q, k_cache, v_cache = (x.half() for x in (q, k_cache, v_cache))
    out = ns["my_paged_decode"](q, k_cache, v_cache, tables, lens)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens),
                               atol=2e-3, rtol=2e-3)


# -- exercise 5: wrong answers fail with a message that names what is wrong ----------------------

EX5_MESSAGES = {
    "ex5: block table ignored (logical block read as physical)": "every row of the three chunks is written and finite",
    "ex5: causal mask without the prefix offset": "chunk 1, 5 tokens after a prefix of 13",
    "ex5: rows masked against the packed end cu_seqlens_q[b + 1], not q_len": "writes nothing past the end of out",
    "ex5: cu_seqlens_q off by one (chunk one row short)": "every row of the three chunks is written and finite",
    "ex5: one KV head per query head index (h % Hkv), not h // G": "SmolLM2's 9 query heads on 3 KV heads",
    "ex5: accumulator not rescaled": "equal to reference.paged_prefill_attention",
    "ex5: last block read past the context length": "every row of the three chunks is written and finite",
    "ex5: padding rows stored": "writes nothing past the end of out",
    "ex5: no causal skip (every block of the context read)": "no tile reads a block wholly after its last row",
}


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("case", list(EX5_MESSAGES))
def test_ex5_wrong_answers_name_the_property(case, notebook, tmp_path):
    message = str(notebook.check_caught(*WRONG[case], workdir=tmp_path))
    assert EX5_MESSAGES[case] in message, message


def test_ex5_solution_is_a_real_kernel():
    """Exercise 5's reference answer is a whole kernel: 30 to 50 lines of code in its solution region."""
    lines = course.solution_code_lines(course.cells_by_grade_id(NOTEBOOK)["ex5_kernel"])
    assert 30 <= lines <= 50, lines

