"""The course as nbgrader sees it: where things live, and release / validate / autograde.

The instructor notebooks live in ``solutions/NN_topic/NN_topic.ipynb`` (nbgrader's *source*
directory); the student copies in ``course/`` (nbgrader's *release* directory) are generated from
them: instructors never edit them by hand, learners fill them in, and a release never overwrites a
learner's edits (see :mod:`~llmu.course.releasing`). Everything nbgrader writes while grading
(submissions, autograded copies, feedback, the gradebook) goes under ``autograder/``.

All nbgrader settings are made in one place, :func:`nbgrader_config`. The file
``autograder/nbgrader_config.py`` (read by the ``nbgrader`` command line and by the formgrader)
merges the same settings, so the command line and the Python functions below always agree.

Three nbgrader habits this module guards against (see ``autograder/README.md``):

* ``nbgrader validate`` exits 0 even when validation fails: :func:`validate` returns the
  validator's result dictionary instead, and callers look at it.
* ``generate_assignment --force`` deletes the whole release folder before it can fail (for example
  when graded cells were added after submissions exist): :func:`release` lets nbgrader write into a
  temporary folder and copies the result into ``course/`` only when it succeeded, without
  overwriting files a learner edited.
* The nbgrader API never raises; it returns ``{"success": False, ...}``. Every call here checks
  it and raises :class:`CourseError` with nbgrader's log.

Each part lives in a module of its own: :mod:`~llmu.course.paths` (folders and constants),
:mod:`~llmu.course.settings` (nbgrader's configuration), :mod:`~llmu.course.releasing`,
:mod:`~llmu.course.validation`, :mod:`~llmu.course.autograding`, :mod:`~llmu.course.notebooks`
(cells by grade_id, playing a student), and the notebook skeleton: :mod:`~llmu.course.colab`
(the first cell), :mod:`~llmu.course.links` (the last) and :mod:`~llmu.course.skeleton`;
:mod:`~llmu.course.cell_deps` (which released cells the release check need not run again).
Every public name is importable from ``llmu.course`` itself.
"""

from .autograding import (  # noqa: F401
    StudentResult,
    _collect,
    _grade_students,
    _timed_out_cells,
    autograde,
    autograding_environment,
    cell_line,
    format_summary,
    grade,
    submitted_students,
)
from .cell_deps import (  # noqa: F401
    cells_to_run,
    release_check_skips,
)
from .colab import (  # noqa: F401
    COLAB_KEEPS,
    COLAB_REQUIREMENTS,
    PUBLISHED_BRANCH,
    REPOSITORY_URL,
    _github_path,
    binder_url,
    colab_cell_source,
    colab_url,
)
from .links import (  # noqa: F401
    _FROM_IMPORT,
    _HELPER_MODULES,
    _PLAIN_IMPORT,
    _defining_module,
    _module_file,
    _module_summary,
    code_links_source,
    llmu_imports,
)
from .notebooks import (  # noqa: F401
    HELPER_CELL,
    RUBRIC_HEADING,
    Exercise,
    NotebookExercises,
    answer_from_solution,
    cells_by_grade_id,
    demo_names_read_by_tests,
    exec_cell,
    exercise_tests,
    is_grade,
    is_solution,
    is_test,
    is_written,
    library_answer_cheat,
    nbgrader_meta,
    own_work_calls_in,
    rubric_of,
    rubric_points,
    setup_namespace,
    solution_code_lines,
    solution_region,
    without_hidden_tests,
)
from .paths import (  # noqa: F401
    AUTOGRADER_DIR,
    AUTOGRADING_ENV,
    BEGIN_HIDDEN,
    BEGIN_SOLUTION,
    CELL_TIMEOUT,
    CODE_STUB,
    COURSE_ID,
    END_HIDDEN,
    END_SOLUTION,
    RELEASE_DIR,
    SOURCE_DIR,
    TEXT_STUB,
    TIMEOUT_ERROR,
    CourseError,
    _looks_like_course_root,
    _nbgrader_failure,
    _root,
    autograder_dir,
    course_dir,
    gradebook_url,
    list_assignments,
    released_twin,
    repo_root,
    solutions_dir,
    source_notebooks,
)
from .releasing import (  # noqa: F401
    FORCE_HINT,
    RECORD,
    ReleaseResult,
    backup_name,
    read_record,
    release,
)
from .settings import (  # noqa: F401
    _HIDE,
    _api,
    _checked,
    _scripts_on_path,
    hide_hidden_tracebacks,
    nbgrader_config,
)
from .skeleton import (  # noqa: F401
    _LINK,
    CLOSING_CELLS,
    EXERCISE_HEADING,
    apply_skeleton,
    exercise_groups,
    skeleton_problems,
)
from .validation import (  # noqa: F401
    MEMORY_PROBE,
    ValidationRun,
    _make_validator,
    add_memory_probe,
    cell_seconds,
    execute_and_validate,
    peak_rss_mb,
    validate,
    validate_executed,
)
