"""Notebook 16's graded exercises, run in-process (no kernel, no model): the instructor's solutions
pass every test cell, hidden parts included, and typical wrong answers fail the cell named for
them.

The exercises are bookkeeping on plain Python data (packing a step, a scheduler step, the
prefix-cache keys) checked against the engine's own ``PackedInputs``, ``Scheduler`` (through
``llmu.engine.timeline.simulate``) and ``BlockManager``: every comparison is exact, there is no
tolerance to explain. The whole notebook (the model cells, the measurement, the widgets) is
executed by the course-wide notebook tests.
"""

from __future__ import annotations

from pathlib import Path

import llmu  # noqa: F401
from llmu import course

NOTEBOOK = Path(__file__).resolve().parents[2] / "solutions" / "16_serving_engine" / "16_serving_engine.ipynb"


EXERCISES = {
    "ex1": course.Exercise.numbered(1, before=["ex1_reference"]),
    "ex2": course.Exercise.numbered(2, before=["ex2_harness"]),
    "ex3": course.Exercise.numbered(3),
    "ex4": course.Exercise.numbered(4, before=["ex4_harness"]),
}


def test_setup_cell_loads_no_model(notebook):
    """The exercises must run without the model: the setup cell only imports."""
    assert "load_model(" not in notebook.cells["setup"]


WRONG = {
    # case: (exercise, replaced text, replacement, the test cell that must catch it)
    "ex1: positions are packed rows": ("ex1", "positions += range(start, end)",
                                       "positions += range(len(positions), len(positions) + n)", "test_ex1_visible"),
    "ex1: slots ignore the block table": ("ex1", "table[p // block_size] * block_size + p % block_size", "p",
                                          "test_ex1_visible"),
    "ex1: every sequence samples": ("ex1", "if end == len(token_ids):", "if True:", "test_ex1_hidden"),
    "ex1: context_lens without the new positions": ("ex1", "context_lens.append(end)", "context_lens.append(start)",
                                                    "test_ex1_hidden"),
    "ex2: budget not spent by admissions": ("ex2", "budget -= chunk", "pass", "test_ex2_visible"),
    "ex2: running sequences take no block": ("ex2", 'free_blocks -= max(0, need - seq["num_blocks"])', "pass",
                                             "test_ex2_visible"),
    "ex2: no chunking": ("ex2", 'chunk = min(seq["num_tokens"], budget)', 'chunk = seq["num_tokens"]',
                         "test_ex2_hidden"),
    "ex2: max_num_seqs ignored": ("ex2", " and len(running) < max_num_seqs", "", "test_ex2_hidden"),
    "ex2: blocks ignored on admission": ("ex2", "if need > free_blocks:", "if False:", "test_ex2_hidden"),
    "ex3: no chain": ("ex3", "hash((parent, tuple(", "hash((None, tuple(", "test_ex3_visible"),
    "ex3: the whole prompt reused": ("ex3", "min(hits * block_size, len(token_ids) - 1)", "hits * block_size",
                                     "test_ex3_hidden"),
    "ex3: no stop at the first miss": ("ex3", "            break\n        hits += 1",
                                       "            continue\n        hits += 1", "test_ex3_hidden"),
    "ex4: one token past max_tokens": ("ex4", "if seq.num_output_tokens >= seq.params.max_tokens:",
                                       "if seq.num_output_tokens > seq.params.max_tokens:", "test_ex4_visible"),
    "ex4: finished without the scheduler": ("ex4", 'self.scheduler.finish(seq, "length")', 'seq.finish_reason = "length"',
                                            "test_ex4_visible"),
    "ex4: the prompt counted as output": ("ex4", "Sequence(rid, 0, list(prompt_ids), len(prompt_ids),",
                                          "Sequence(rid, 0, list(prompt_ids), 0,", "test_ex4_visible"),
    "ex4: a step returns nothing": ("ex4", "            new.append((seq.request_id, token))\n", "", "test_ex4_visible"),
    "ex4: the eos token kept in the output": ("ex4", '                self.scheduler.finish(seq, "eos")',
                                              '                seq.token_ids.append(token)\n'
                                              '                self.scheduler.finish(seq, "eos")', "test_ex4_hidden"),
    "ex4: eos ends with the wrong reason": ("ex4", 'self.scheduler.finish(seq, "eos")', 'self.scheduler.finish(seq, "length")',
                                            "test_ex4_hidden"),
    "ex4: eos ignored": ("ex4", "            if token in self.eos_ids:", "            if False:", "test_ex4_hidden"),
    "ex4: the pool's last blocks leak": ("ex4", "        self.blocks = BlockManager(num_blocks, block_size, prefix_caching=False)",
                                         "        self.blocks = BlockManager(num_blocks, block_size, prefix_caching=False)\n"
                                         "        self.blocks.allocate(-1, list(range(3 * block_size)), 0)",
                                         "test_ex4_hidden"),
}


# The exercise file's two tests: every solution passes its test cells; every wrong answer is
# caught by the test cell named for it (cell metadata is checked in tests/course/test_notebooks.py).
(notebook, test_solutions_pass_all_tests, test_wrong_answers_fail,
 test_library_answers_fail) = course.exercise_tests(
    NOTEBOOK, EXERCISES, WRONG)


def test_hidden_tests_are_not_in_the_visible_part(notebook):
    """Each hidden test cell runs a visible check first, then the hidden block (after the hidden
    own-work check that opens every test cell)."""
    for name in ("test_ex1_hidden", "test_ex2_hidden", "test_ex3_hidden"):
        own, _, rest = notebook.cells[name].partition(course.END_HIDDEN)
        assert "check_own_work(" in own, f"{name} does not open with the own-work check"
        before, _, after = rest.partition(course.BEGIN_HIDDEN)
        assert after, f"{name} has no hidden block"
        assert "check" in before, f"{name}: the learner should see at least one check before the hidden block"


# What the notebook's prose states, checked against llmu's code and the course's order.

def _prose(grade_id: str) -> str:
    """A cell's text with its line breaks folded into spaces."""
    return " ".join(course.cells_by_grade_id(NOTEBOOK)[grade_id].split())


def test_quantization_and_speculative_decoding_come_before_this_module():
    text = _prose("next_md")
    assert text.startswith("## 7 · Where quantization and speculative decoding fit")
    assert "Two modules you have already done, 10 and 11," in text and "later" not in text
    assert "**Quantized weights (module 10).**" in text and "**Speculative decoding (module 11).**" in text
    assert "7 · where quantization and speculative decoding fit" in _prose("intro")


def test_the_draft_length_is_gamma():
    text = _prose("next_md")
    assert "proposes $\\gamma$ tokens" in text and "$\\gamma + 1$ positions" in text and "$k" not in text


def test_the_gpu_size_of_the_serving_entry():
    import inspect

    from llmu.engine.bench import SERVING, measure_serving

    size = SERVING.gpu_sizes[0]
    prompt_min = size.get("prompt_min", inspect.signature(measure_serving).parameters["prompt_min"].default)
    text = _prose("bench_md")
    assert (f"{size['requests']} requests, each a shared {size['shared_prefix']}-token prefix followed by "
            f"{prompt_min} to {size['prompt_max']} random tokens and asking for {size['new_min']} to "
            f"{size['new']} new tokens") in text


def test_section_3_schedules_as_the_prose_says():
    # section 3's workload, scheduled without a model (timeline.simulate runs the engine's own
    # Scheduler and BlockManager; with end-of-sequence ignored the schedule is the real run's)
    import torch

    from llmu.engine import timeline
    from llmu.engine.bench import serving_workload

    prompts = serving_workload(49152, requests=12, prompt_min=8, prompt_max=48, shared_prefix=16, seed=0)
    news = torch.randint(4, 25, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    common = dict(num_blocks=4 * 96 // 16 + 1, max_model_len=96)
    runs = {name: timeline.summary(timeline.simulate(prompts, news, **common, **kw)) for name, kw in {
        "static": dict(max_num_seqs=4, policy="static", prefix_caching=False),
        "contiguous": dict(max_num_seqs=12, reserve="context", prefix_caching=False),
        "paged": dict(max_num_seqs=12, prefix_caching=False),
        "prefix": dict(max_num_seqs=12, prefix_caching=True)}.items()}
    summary = _prose("summary")
    assert (f"needed {runs['contiguous']['steps']} steps instead of static batching's "
            f"{runs['static']['steps']}") in summary
    assert f"the paged cache ran {runs['paged']['peak_running']} requests at once" in summary
    # prefix caching: the requests admitted with the first one compute the prefix themselves, and
    # in a run this small the steps and the peak do not change
    first = timeline.simulate(prompts, news, **common, max_num_seqs=12, prefix_caching=True)[0]
    assert len(first.work) > 1 and first.cached_tokens == 0
    assert 0 < runs["prefix"]["cached_tokens"] < 16 * 11
    assert (runs["prefix"]["steps"], runs["prefix"]["peak_running"]) == (runs["paged"]["steps"],
                                                                          runs["paged"]["peak_running"])
    text = _prose("measure_read")
    assert "request admitted after the prefix's block was first computed" in text
    assert "the steps and the peak stay those of the paged row" in text
