"""Which released cells the release check may leave out (llmu.course.cell_deps): only cells that
cannot see the learner's code and that no running cell needs. Each test is one property, on a
small notebook written out as a list of cell sources; the answer cell is a stub."""

from __future__ import annotations

import nbformat
import pytest

from llmu import course
from llmu.course.cell_deps import cells_to_run, release_check_skips

STUB = "def my_fn(x):\n    raise NotImplementedError()"
TEST = "assert my_fn(2) == 4"


def _skipped(sources, answers=(), tests=()):
    seeds = set(answers) | set(tests)
    return set(range(len(sources))) - cells_to_run(sources, seeds, set(tests))


def test_a_demo_that_reads_only_the_setup_is_left_out_and_the_setup_is_not():
    sources = ["import torch\nmodel = torch.nn.Linear(2, 2)",      # 0 setup, read by the test
               "out = model(torch.ones(2))\nprint(out)",             # 1 demo of llmu's own code
               STUB,                                                  # 2 answer
               "assert my_fn(model) is not None"]                     # 3 test
    assert _skipped(sources, answers=[2], tests=[3]) == {1}


def test_a_cell_that_calls_the_learners_function_runs_and_so_do_its_readers():
    sources = [STUB,
               "y = my_fn(3)",          # reads the answer
               "z = y + 1",             # reads what a tainted cell bound
               "w = 5"]                 # independent
    assert _skipped(sources, answers=[0]) == {3}


def test_a_function_defined_before_the_exercise_that_calls_it_taints_its_callers():
    sources = ["def show():\n    return my_fn(1)",   # my_fn is looked up when show() runs
               STUB,
               "show()"]
    assert _skipped(sources, answers=[1]) == set()


def test_storing_the_learners_function_in_an_object_taints_the_objects_users():
    sources = ["class Box:\n    pass\nbox = Box()",
               STUB,
               "box.fn = my_fn",
               "box.fn(2)"]
    assert _skipped(sources, answers=[1]) == set()


def test_a_name_rebound_by_a_demo_before_it_reads_it_does_not_taint_the_demo():
    sources = [STUB,
               "case = my_fn(1)\nassert case == 2",   # test: binds case, from the learner's code
               "case = 3\nprint(case * 2)",            # rebinds case first: sees nothing of the test's
               "print(case)"]                          # reads the demo's case
    assert _skipped(sources, answers=[0], tests=[1]) == {2, 3}


def test_a_demo_that_reads_a_name_a_test_left_behind_runs():
    sources = [STUB, "case = my_fn(1)\nassert case == 2", "print(case)"]
    assert _skipped(sources, answers=[0], tests=[1]) == set()


def test_a_binding_that_may_not_happen_does_not_hide_an_earlier_one():
    sources = [STUB,
               "data = my_fn(1)",
               "if False:\n    data = 0",     # may not bind: data can still be the learner's
               "print(data)"]
    assert _skipped(sources, answers=[0]) == set()


def test_names_inside_loops_and_comprehensions_are_the_cells_own():
    sources = [STUB,
               "x = my_fn(1)",                                     # tainted x
               "for x in range(3):\n    print(x)",                 # the loop binds x before reading it
               "print([x * 2 for x in range(3)])"]                 # so does the comprehension
    assert _skipped(sources, answers=[0]) == {2, 3}


def test_an_import_in_an_answer_taints_nothing():
    sources = ["import math\ndef my_fn(x):\n    raise NotImplementedError()",
               "import math\nprint(math.pi)"]
    assert _skipped(sources, answers=[0]) == {1}


def test_a_running_cell_gets_every_earlier_cell_it_may_read_from():
    sources = ["a = 1",
               "if a:\n    a = 2",      # may rebind a: needed too
               STUB,
               "assert my_fn(a) == 4"]
    assert _skipped(sources, answers=[2], tests=[3]) == set()


@pytest.mark.parametrize("opaque", ["%timeit 1 + 1", "exec('q = 1')", "from math import *", "print(globals())",
                                    "match b:\n    case 2:\n        pass\n    case other:\n        q = other"])
def test_a_cell_the_analysis_cannot_follow_runs_with_everything_before_it(opaque):
    sources = ["a = 1", "b = 2", STUB, opaque, "assert my_fn(1)"]
    assert _skipped(sources, answers=[2], tests=[4]) == set()


def _nb(cells):
    nb = nbformat.v4.new_notebook()
    for source, meta in cells:
        cell = nbformat.v4.new_code_cell(source)
        if meta:
            cell.metadata["nbgrader"] = {"grade_id": meta[0], "solution": meta[1] == "answer",
                                         "grade": meta[1] == "test", "locked": meta[1] != "answer",
                                         "schema_version": 3, **({"points": 1} if meta[1] == "test" else {})}
        nb.cells.append(cell)
    return nb


def test_on_notebooks_only_the_instructors_unchanged_cells_are_left_out():
    solution = _nb([("w = 5\nprint(w)", ("demo", "")),
                    ("def my_fn(x):\n    return 2 * x", ("ex1", "answer")),
                    ("assert my_fn(2) == 4", ("test_ex1", "test")),
                    ("v = 7", ("other", ""))])
    released = _nb([("w = 5\nprint(w)", ("demo", "")),
                    (STUB, ("ex1", "answer")),
                    ("assert my_fn(2) == 4", ("test_ex1", "test")),
                    ("v = 8", ("other", ""))])                   # differs from the instructor's: runs
    released.cells.append(nbformat.v4.new_code_cell("print('probe')"))   # in no instructor notebook: runs
    skips = release_check_skips(released, solution, course.is_solution, course.is_test)
    assert set(skips) == {0}


def test_a_name_bound_inside_an_if_is_still_read_from_outside_after_it():
    sources = [STUB,
               "data = my_fn(1)",
               "if len('ab') > 5:\n    data = 0\nprint(data)"]   # data may still be the learner's here
    assert _skipped(sources, answers=[0]) == set()


# ---------------------------------------------------------------------------------------------
# statements that read and bind at once, or bind from elsewhere: each can hide a reader of the
# learner's result if the analysis gets it wrong (the cell would then be left out of the check)
# ---------------------------------------------------------------------------------------------


def test_augmented_assignment_reads_the_name_before_binding_it():
    sources = [STUB,
               "total = my_fn(1)",          # tainted
               "total += 1\nprint(total)",  # reads the learner's total, then rebinds it
               "count = 0\ncount += 1"]     # binds count first: reads nothing from outside
    assert _skipped(sources, answers=[0]) == {3}


def test_augmented_assignment_to_an_attribute_or_item_reads_the_object():
    sources = [STUB,
               "stats = {'n': my_fn(1)}",
               "stats['n'] += 1",
               "print(stats)"]
    assert _skipped(sources, answers=[0]) == set()


def test_the_walrus_binds_its_name_for_the_cells_after_it():
    sources = [STUB,
               "if (best := my_fn(1)) > 0:\n    pass",   # binds best from the learner's code
               "print(best)"]
    assert _skipped(sources, answers=[0]) == set()


def test_a_walrus_inside_a_comprehension_binds_in_the_cell():
    sources = [STUB,
               "ys = [last := my_fn(i) for i in range(3)]",
               "print(last)"]
    assert _skipped(sources, answers=[0]) == set()


def test_del_changes_what_a_later_running_cell_sees():
    """``del x`` unbinds x: a running cell that reads x must see it deleted, as it was in the
    instructor's run, so the cell that deletes it runs too."""
    sources = ["x = 1",
               "del x",
               STUB,
               "try:\n    x\nexcept NameError:\n    x = 0\nassert my_fn(x) == 0"]
    assert _skipped(sources, answers=[2], tests=[3]) == set()


def test_del_of_an_unrelated_name_is_left_out():
    sources = ["tmp = 1\ndel tmp", STUB, "assert my_fn(1) == 2"]
    assert _skipped(sources, answers=[1], tests=[2]) == {0}


def test_global_inside_a_function_binds_the_name_for_the_cells_after_the_call():
    sources = [STUB,
               "def reset():\n    global total\n    total = my_fn(0)",   # binds total when called
               "reset()",
               "print(total)"]                                            # the learner's total
    assert _skipped(sources, answers=[0]) == set()


def test_global_inside_a_function_without_the_learners_code_still_orders_the_cells():
    """The function binds ``level`` at module scope: a test cell that reads ``level`` needs the cell
    that defines the function (and the call) to have run."""
    sources = ["def setup():\n    global level\n    level = 3",
               "setup()",
               STUB,
               "assert my_fn(level) == 6"]
    assert _skipped(sources, answers=[2], tests=[3]) == set()


# ---------------------------------------------------------------------------------------------
# calls made for their effect: the state they change is kept for the cells that read it
# ---------------------------------------------------------------------------------------------


def test_a_seed_set_by_a_demo_is_kept_for_the_tests_after_it():
    """``torch.manual_seed(0)`` changes torch's random state, which a test's random inputs read."""
    sources = ["import torch",
               STUB,
               "torch.manual_seed(0)\nprint('a demo')",
               "assert my_fn(torch.randn(3)) is not None"]
    assert _skipped(sources, answers=[1], tests=[3]) == set()


def test_a_module_function_that_sets_nothing_is_left_out():
    sources = ["import torch\nfrom llmu import viz",
               STUB,
               "fig = viz.bars([1, 2])\nviz.show(fig)",     # draws: changes neither viz nor torch
               "assert my_fn(torch.ones(3)) is not None"]
    assert _skipped(sources, answers=[1], tests=[3]) == {2}


def test_a_method_called_on_an_object_may_change_it():
    sources = ["import torch\nmodel = torch.nn.Linear(2, 2)",
               "model.eval()",                             # changes model: the test reads it
               STUB,
               "assert my_fn(model) is not None"]
    assert _skipped(sources, answers=[2], tests=[3]) == set()


def test_an_object_passed_to_a_function_may_be_changed_but_not_by_print():
    sources = ["import random\nitems = [1, 2, 3]",
               "random.shuffle(items)",                    # changes items in place
               "print(items, len(items))",                 # changes nothing
               STUB,
               "assert my_fn(items) is not None"]
    assert _skipped(sources, answers=[3], tests=[4]) == {2}
