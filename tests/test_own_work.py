"""``llmu.grading.check_own_work``: a submission that is, wraps or calls llmu's answer fails; one
that uses other helpers, or the same names for other things, passes.

Each submission is written as a learner would, in a namespace of its own (as a notebook's kernel
has), so the check reads it exactly as it reads a notebook cell.
"""

from __future__ import annotations

import textwrap

import pytest

import llmu  # noqa: F401 - chooses the Triton interpreter before triton is imported
from llmu.attention import reference
from llmu.grading import CheckFailed, check_own_work
from llmu.grading.own_work import find_library_answer, resolve

ANSWER = "llmu.attention.reference.attention"


def _define(source: str, name: str = "mine"):
    ns: dict = {"__name__": "__main__"}
    exec(compile(textwrap.dedent(source), "<cell>", "exec"), ns)  # noqa: S102 - the test's own code
    return ns[name]


CHEATS = {
    "alias": "from llmu.attention.reference import attention as mine",
    "module attribute": "import llmu.attention.reference\nmine = llmu.attention.reference.attention",
    "wrapper": """
        from llmu.attention import reference as R
        def mine(q, k, v, causal=True):
            return R.attention(q, k, v, causal=causal)
    """,
    "import inside the function": """
        def mine(q, k, v):
            from llmu.attention.reference import attention
            return attention(q, k, v)
    """,
    "plain import inside the function": """
        def mine(q, k, v):
            import llmu.attention.reference
            return llmu.attention.reference.attention(q, k, v)
    """,
    "through a helper": """
        import llmu
        def _helper(*args):
            return llmu.attention.reference.attention(*args)
        def mine(q, k, v):
            out = _helper(q, k, v)
            return out
    """,
    "in a lambda": """
        from llmu.attention.reference import attention
        def mine(q, k, v):
            run = lambda: attention(q, k, v)
            return run()
    """,
    "in a comprehension": """
        from llmu.attention import reference
        def mine(qs, k, v):
            return [reference.attention(q, k, v) for q in qs]
    """,
    "default argument": """
        from llmu.attention.reference import attention
        def mine(q, k, v, impl=attention):
            return impl(q, k, v)
    """,
    "closure": """
        def make():
            from llmu.attention.reference import attention as impl
            def mine(q, k, v):
                return impl(q, k, v)
            return mine
        mine = make()
    """,
    "partial": """
        import functools
        from llmu.attention.reference import attention
        mine = functools.partial(attention, causal=True)
    """,
    "copied code object": """
        import types
        from llmu.attention.reference import attention
        mine = types.FunctionType(attention.__code__, attention.__globals__)
    """,
    "method of a class": """
        from llmu.attention import reference
        class Mine:
            def forward(self, q, k, v):
                return reference.attention(q, k, v)
        mine = Mine
    """,
}


@pytest.mark.parametrize("case", list(CHEATS))
def test_a_submission_that_uses_the_answer_fails(case):
    submission = _define(CHEATS[case])
    with pytest.raises(CheckFailed) as info:
        check_own_work(submission, ANSWER, what="exercise 2 (attention)")
    message = str(info.value)
    assert message.startswith("exercise 2 (attention): your code uses llmu.attention.reference.attention, "
                              "a ready-made answer to this exercise")
    assert "Look at:" in message


def test_a_torch_answer_is_named_as_the_check_wrote_it():
    mine = _define("""
        import torch.nn.functional as F
        def mine(q, k, v):
            return F.scaled_dot_product_attention(q, k, v)
    """)
    with pytest.raises(CheckFailed, match=r"uses torch.nn.functional.scaled_dot_product_attention, a ready-made"):
        check_own_work(mine, "torch.nn.functional.scaled_dot_product_attention", what="exercise 2")
    import torch

    with pytest.raises(CheckFailed, match=r"uses softmax, a ready-made.*\(mine -> torch.softmax\)"):
        check_own_work(_define("import torch\ndef mine(x):\n    return torch.softmax(x, -1)"), torch.softmax,
                       what="exercise 1")


def test_the_route_to_the_answer_is_named():
    submission = _define(CHEATS["through a helper"])
    answer, chain = find_library_answer(submission, [ANSWER])
    assert answer is reference.attention
    assert chain[:2] == ["mine", "_helper"], chain


def test_a_subclass_of_the_answer_class_fails():
    from llmu.paged.block_manager import BlockManager

    mine = _define("""
        from llmu.paged.block_manager import BlockManager
        class mine(BlockManager):
            pass
    """)
    with pytest.raises(CheckFailed, match="BlockManager"):
        check_own_work(mine, BlockManager, what="exercise 1")


def test_an_object_of_the_answer_class_fails():
    # the notebook's measured run is an object of the answer class: its method is the answer
    mine = _define("""
        from llmu.paged.block_manager import BlockManager
        manager = BlockManager(8, 4)
        def mine(tokens):
            return manager.allocate("a", tokens)
    """)
    with pytest.raises(CheckFailed, match="BlockManager"):
        check_own_work(mine, "llmu.paged.block_manager.BlockManager", what="exercise 1")


def test_a_triton_kernel_that_calls_the_answer_kernel_fails(tmp_path):
    # Triton reads a kernel's source back, so the cell is written to a file first (as the notebooks' tests do)
    source = textwrap.dedent("""
        import triton
        import triton.language as tl
        from llmu.welcome.kernels import _add_kernel as lib_add

        @triton.jit
        def _inner(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
            lib_add(x_ptr, y_ptr, out_ptr, n, BLOCK)

        @triton.jit
        def mine(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
            _inner(x_ptr, y_ptr, out_ptr, n, BLOCK)
    """)
    path = tmp_path / "cell.py"
    path.write_text(source)
    ns: dict = {"__name__": "__main__"}
    exec(compile(source, str(path), "exec"), ns)  # noqa: S102
    with pytest.raises(CheckFailed, match="_add_kernel"):
        check_own_work(ns["mine"], "llmu.welcome.kernels._add_kernel", what="the add kernel")


HONEST = {
    "own code": """
        import torch
        def mine(q, k, v):
            s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
            return torch.softmax(s, -1) @ v
    """,
    "another llmu helper": """
        from llmu.attention.reference import softmax, causal_mask
        def mine(q, k, v):
            s = q @ k.transpose(-1, -2)
            return softmax(s.masked_fill(~causal_mask(s.shape[-1]), float("-inf")), -1) @ v
    """,
    "a local variable of the same name": """
        def mine(q, k, v):
            attention = q @ k.transpose(-1, -2)
            return attention.softmax(-1) @ v
    """,
    "a string that names it": """
        def mine(q, k, v):
            '''Unlike llmu.attention.reference.attention, this one is mine.'''
            return (q @ k.transpose(-1, -2)).softmax(-1) @ v
    """,
    "recursion": """
        def mine(n):
            return 1 if n < 2 else n * mine(n - 1)
    """,
}


@pytest.mark.parametrize("case", list(HONEST))
def test_own_work_passes(case):
    check_own_work(_define(HONEST[case]), ANSWER, reference.attention, what="exercise 2")


def test_the_answers_are_resolved_from_dotted_paths():
    assert resolve(ANSWER) is reference.attention
    assert resolve(reference.attention) is reference.attention
    with pytest.raises(ValueError, match="cannot import"):
        resolve("llmu_no_such_package.thing")


def test_bad_arguments_are_refused():
    mine = _define(HONEST["own code"])
    with pytest.raises(ValueError, match="answers"):
        check_own_work(mine, what="exercise 2")
    with pytest.raises(TypeError, match="what"):
        check_own_work(mine, ANSWER, what="")
    with pytest.raises(CheckFailed, match="None"):
        check_own_work(None, ANSWER, what="exercise 2")


def test_run_catches_a_call_on_an_object_the_submission_is_given():
    import torch

    from llmu.models import byte_llama_config
    from llmu.models.llama import DecoderLayer, LlamaModel

    model = LlamaModel(byte_llama_config(64, 1, max_len=8)).eval()
    ids = torch.tensor([[1, 2, 3]])
    delegating = _define("def mine(model, ids):\n    return model(ids).logits")
    # read, it calls nothing of llmu's: only running it shows the model's forward at work
    check_own_work(delegating, LlamaModel, what="exercise 6")
    with pytest.raises(CheckFailed, match=r"while it ran, your code called llmu.models.llama.LlamaModel.forward"):
        check_own_work(delegating, LlamaModel, what="exercise 6", run=lambda: delegating(model, ids))
    # the tripwires are gone afterwards, and an honest submission runs through them
    assert model(ids).logits.shape == (1, 3, model.config.vocab_size)
    honest = _define("import torch\ndef mine(model, ids):\n    return model.embed_tokens(ids) @ model.embed_tokens.weight.T")
    check_own_work(honest, LlamaModel, DecoderLayer, what="exercise 6", run=lambda: honest(model, ids))


def test_run_catches_an_answer_function_reached_at_run_time():
    import torch

    sneaky = _define("""
        import importlib
        def mine(x, dim=-1):
            module = importlib.import_module("llmu.attention." + "reference")
            return getattr(module, "soft" + "max")(x, dim)
    """)
    x = torch.randn(3, 4)
    check_own_work(sneaky, "llmu.attention.reference.softmax", what="exercise 1")  # hidden from a reading
    with pytest.raises(CheckFailed, match="called llmu.attention.reference.softmax"):
        check_own_work(sneaky, "llmu.attention.reference.softmax", what="exercise 1", run=lambda: sneaky(x))
    torch.testing.assert_close(reference.softmax(x, -1), torch.softmax(x, -1))  # restored
    with pytest.raises(TypeError, match="run must be a callable"):
        check_own_work(sneaky, "llmu.attention.reference.softmax", what="exercise 1", run=3)
