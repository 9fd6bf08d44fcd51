"""Notebook 14's graded exercises, run in-process (no kernel): the instructor's solutions pass every
test cell, hidden parts included, and typical wrong answers fail them.

The exercises are pure functions (a notebook cell cannot start processes: ``launch`` refuses
functions defined in a notebook), so everything here runs in this process, in a second or two.
The whole notebook (the launches on real processes, widgets, the benchmark) is executed by the
course-wide notebook tests.
"""

from __future__ import annotations

import math

import llmu  # noqa: F401
from llmu import course
from llmu.moe.params import count_parameters
from llmu.parallel import comm, memory

NOTEBOOK = course.repo_root() / "solutions" / "14_parallelism" / "14_parallelism.ipynb"


EXERCISES = {f"ex{n}": course.Exercise.numbered(n) for n in (1, 2, 3, 4)}
# Exercise 5, the capstone, is one %%module cell with four graded strategies: one entry per test
# cell, so that llmu's answer to one strategy is refused by that strategy's cell (the others
# grade the learner's own classes).
EXERCISES |= {f"ex5 {part}": course.Exercise("ex5_solution", (f"test_ex5_{part}",), before=("ex5_harness",))
              for part in ("naive", "overlapped", "bucketed", "zero1")}


WRONG = {
    # case: (exercise, replaced text, replacement, the test cell that must catch it)
    "ex1: stage 2 shards the weights": ("ex1", "params = w * num_params / (n if stage >= 3 else 1)",
                                        "params = w * num_params / (n if stage >= 2 else 1)", "test_ex1_visible"),
    "ex1: stage 1 shards nothing": ("ex1", "optimizer = k * num_params / (n if stage >= 1 else 1)",
                                    "optimizer = k * num_params / (n if stage >= 2 else 1)", "test_ex1_visible"),
    "ex1: float32 with K = 12": ("ex1", '"float32": (4, 4, 8)', '"float32": (4, 4, 12)', "test_ex1_hidden"),
    "ex1: no check of the stage": ("ex1", "if stage not in (0, 1, 2, 3):", "if stage not in range(0, 5):",
                                   "test_ex1_hidden"),
    "ex1: no check of the precision": ("ex1", "if precision not in sizes:", "if False:", "test_ex1_hidden"),
    "ex2: down split by rows": ("ex2", "w_down[:, block]", "w_down[block]", "test_ex2_visible"),
    "ex2: up from the other end": ("ex2", "return w_gate[block], w_up[block], w_down[:, block]",
                                   "return w_gate[block], w_up.flip(0)[block], w_down[:, block]", "test_ex2_visible"),
    "ex2: strided instead of contiguous": ("ex2", "block = slice(rank * size, (rank + 1) * size)",
                                           "block = slice(rank, ffn, world_size)", "test_ex2_hidden"),
    "ex2: uneven split accepted": ("ex2", "if ffn % world_size:", "if False:", "test_ex2_hidden"),
    "ex2: rank not checked": ("ex2", "if not 0 <= rank < world_size:", "if False:", "test_ex2_hidden"),
    "ex3: GPipe instead of 1F1B": ("ex3", "warmup = min(num_stages - rank - 1, m)", "warmup = m", "test_ex3_visible"),
    "ex3: one warm-up forward too many": ("ex3", "warmup = min(num_stages - rank - 1, m)",
                                          "warmup = min(num_stages - rank, m)", "test_ex3_visible"),
    "ex3: backward before forward in the steady state": (
        "ex3", 'order += [Action("F", warmup + i), Action("B", i)]',
        'order += [Action("B", i), Action("F", warmup + i)]', "test_ex3_visible"),
    "ex3: warm-up not capped by m": ("ex3", "warmup = min(num_stages - rank - 1, m)", "warmup = num_stages - rank - 1",
                                     "test_ex3_hidden"),
    "ex4: reduce-scatter replaces": ("ex4", "chunks[(r + 1) % p][index] = chunks[(r + 1) % p][index] + data",
                                     "chunks[(r + 1) % p][index] = data", "test_ex4_visible"),
    "ex4: all-gather sends the wrong chunk": ("ex4", "messages = [(r, (r + 1 - s) % p, chunks[r][(r + 1 - s) % p].clone())",
                                              "messages = [(r, (r - s) % p, chunks[r][(r - s) % p].clone())",
                                              "test_ex4_visible"),
    "ex4: inputs modified in place": ("ex4", "chunks = [[c.clone() for c in torch.tensor_split(t, p)] for t in tensors]",
                                      "chunks = [list(torch.tensor_split(t, p)) for t in tensors]\n"
                                      "    for c in chunks:\n        for x in c:\n            x.mul_(1.0)\n"
                                      "    tensors[0].add_(1.0)", "test_ex4_visible"),
    "ex4: one phase only": ("ex4", "    for s in range(p - 1):                                   # all-gather",
                            "    for s in range(0):                                       # all-gather",
                            "test_ex4_visible"),
    "ex5: naive forgets to divide": ("ex5 naive", "            dist.all_reduce(p.grad)\n            p.grad.div_(world)",
                                     "            dist.all_reduce(p.grad)", "test_ex5_naive"),
    "ex5: naive all-reduces twice": ("ex5 naive", "            dist.all_reduce(p.grad)\n            p.grad.div_(world)",
                                     "            dist.all_reduce(p.grad)\n            p.grad.div_(world)\n"
                                     "            dist.all_reduce(p.grad)\n            p.grad.div_(world)", "test_ex5_naive"),
    "ex5: overlapped without the broadcast": ("ex5 overlapped", "        _broadcast_from_rank_0(model)\n        self.model, self.world",
                                              "        self.model, self.world", "test_ex5_overlapped"),
    "ex5: overlapped all-reduce blocks in the hook": (
        "ex5 overlapped", "self.works.append(dist.all_reduce(p.grad, async_op=True))", "dist.all_reduce(p.grad)",
        "test_ex5_overlapped"),
    "ex5: buckets in the forward order": ("ex5 bucketed", "for p in reversed([p for p in model.parameters() if p.requires_grad]):",
                                          "for p in [p for p in model.parameters() if p.requires_grad]:", "test_ex5_bucketed"),
    "ex5: a bucket closed before it exceeds the size": (
        "ex5 bucketed", "            if not self.buckets or size >= limit:",
        "            if not self.buckets or size + p.numel() * p.element_size() > limit:", "test_ex5_bucketed"),
    "ex5: buckets all sent in finish": ("ex5 bucketed", "        self.ready[b] += 1\n",
                                        "        self.ready[b] += 1\n        return\n", "test_ex5_bucketed"),
    "ex5: ZeRO-1 forgets to divide": ("ex5 zero1", "self.slice.grad = mine.div_(self.world)", "self.slice.grad = mine",
                                      "test_ex5_zero1"),
    "ex5: ZeRO-1 all-reduces the gradients": (
        "ex5 zero1", "        reduce_scatter(mine, grads)",
        "        dist.all_reduce(grads)\n        mine.copy_(grads[self.rank * self.shard:(self.rank + 1) * self.shard])",
        "test_ex5_zero1"),
    "ex5: ZeRO-1 keeps the whole optimizer": (
        "ex5 zero1", "        self.optimizer = optimizer_cls([self.slice], **kwargs)",
        "        self.optimizer = optimizer_cls([self.slice], **kwargs)\n"
        "        self.full = optimizer_cls(self.params, **{**kwargs, 'lr': 0.0})\n"
        "        for p in self.params:\n            p.grad = torch.zeros_like(p)\n        self.full.step()",
        "test_ex5_zero1"),
}


# The exercise file's two tests: every solution passes its test cells; every wrong answer is
# caught by the test cell named for it (cell metadata is checked in tests/course/test_notebooks.py).
(notebook, test_solutions_pass_all_tests, test_wrong_answers_fail,
 test_library_answers_fail) = course.exercise_tests(
    NOTEBOOK, EXERCISES, WRONG)


# The figures the notebook's prose states, recomputed here from llmu.parallel's calculator and cost
# model: each test fails if the prose drifts from what the code gives.

def _prose(grade_id: str) -> str:
    """A cell's text with its line breaks folded into spaces."""
    return " ".join(course.cells_by_grade_id(NOTEBOOK)[grade_id].split())


def test_the_7b_model_on_one_gpu():
    m = memory.training_memory(memory.LLAMA2_7B, seq_len=4096, micro_batch=1, recompute="selective")
    h100, h200 = memory.GPU_MEMORY_GB["H100 SXM"], memory.GPU_MEMORY_GB["H200"]
    assert h100 < m["total"] / 1e9 < h200                   # too much for an H100, most of an H200
    text = _prose("memory_widget_md")
    assert f"its bf16 weights take {m['params'] / 1e9:.1f} GB" in text
    assert f"needs {m['total'] / 1e9:.0f} GB (the table's total), more than an H100's {h100} GB" in text
    assert f"most of an H200's {h200} GB" in text


def test_the_405b_layout_in_memory_and_communication():
    shape, h100 = memory.LLAMA31_405B, memory.GPU_MEMORY_GB["H100 SXM"]
    layout = dict(seq_len=8192, micro_batch=1, data_parallel=128, tensor_parallel=8, pipeline_parallel=16,
                  micro_batches=16, recompute="selective")
    totals = [memory.training_memory(shape, zero_stage=stage, **layout)["total"] / 1e9 for stage in range(4)]
    assert totals[3] < totals[2] <= h100 < totals[1] < totals[0]   # ZeRO-2 just fits, ZeRO-1 does not
    text = _prose("three_d_read")
    assert f"the first stage needs {totals[3]:.0f} GB of an H100's {h100}" in text
    # section 9's estimate: TP's four all-reduces of one bf16 activation per layer, against the layer's compute
    psi = count_parameters(shape).total
    s, b, h, t = 8192, 1, shape.hidden_size, 8
    per_layer = (psi - 2 * shape.vocab_size * h) / shape.num_hidden_layers
    compute = 6 * per_layer * s * b / t / 400e12
    shares = [4 * comm.ring_all_reduce_time(s * b * h * 2, t, link) / compute
              for link in (comm.NVLINK4, comm.INFINIBAND_NDR)]
    assert f"cost {shares[0]:.0%} of the compute on NVLink and {shares[1]:.0%} on InfiniBand".replace("%", " %") in text


def test_sequence_length_is_T():
    text = _prose("memory_md")
    assert "for sequence length $T$" in text and "sbh" not in text and "5\\,a\\,T" in text


def test_zero_table_has_stage_1_reduce_scatter_then_all_gather():
    """Section 3's table and prose say what llmu.parallel.zero does (test_zero.py counts it): stage 1
    reduce-scatters the gradients and all-gathers the weights, the bytes of data parallelism."""
    cell = course.cells_by_grade_id(NOTEBOOK)["zero_md"]
    rows = {cols[1].strip(): cols[4].strip() for cols in (line.split("|") for line in cell.splitlines())
            if len(cols) == 6 and cols[1].strip() not in ("stage", "---")}
    assert list(rows) == ["0 (DP)", "1", "2", "3"]
    assert rows["0 (DP)"] == "all-reduce of the gradients"
    for stage in ("1", "2"):
        assert "reduce-scatter" in rows[stage] and "all-gather" in rows[stage] and "all-reduce" not in rows[stage]
    text = _prose("zero_md")
    assert "so stages 1 and 2 move the same bytes as plain data parallelism, $2\\Psi(N-1)/N$ values" in text
    assert "Stage 3 adds one all-gather of the weights" in text and "1.5 times the traffic" in text
    # the cost model behind it: a reduce-scatter and an all-gather cost what one ring all-reduce does
    n, p = 4e9, 8
    halves = comm.reduce_scatter_time(n, p, comm.NVLINK4) + comm.all_gather_time(n, p, comm.NVLINK4)
    assert math.isclose(halves, comm.ring_all_reduce_time(n, p, comm.NVLINK4), rel_tol=1e-12)


def test_the_capstone_states_the_tiny_models_size():
    """Section 10 states the size of the model the grader trains, whose 21 tensors the graded bucket
    size (0.05 MiB) packs into fewer messages."""
    from llmu.grading.data_parallel import expected_buckets
    from llmu.models import tiny_llama

    model = tiny_llama(0).requires_grad_(True)
    psi = sum(p.numel() for p in model.parameters())
    assert f"a tiny Llama ({psi:,} parameters)" in _prose("dp_capstone_md")
    assert len(expected_buckets(model, 0.05)) < len(list(model.parameters()))   # bucketing merges messages
