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

from .paths import (  # noqa: F401
    COURSE_ID,
    SOURCE_DIR,
    RELEASE_DIR,
    AUTOGRADER_DIR,
    CELL_TIMEOUT,
    AUTOGRADING_ENV,
    CODE_STUB,
    TIMEOUT_ERROR,
    BEGIN_SOLUTION,
    END_SOLUTION,
    BEGIN_HIDDEN,
    END_HIDDEN,
    CourseError,
    _nbgrader_failure,
    _looks_like_course_root,
    repo_root,
    _root,
    solutions_dir,
    course_dir,
    autograder_dir,
    gradebook_url,
    list_assignments,
    source_notebooks,
    released_twin,
)
from .settings import (  # noqa: F401
    nbgrader_config,
    _HIDE,
    hide_hidden_tracebacks,
    _scripts_on_path,
    _api,
    _checked,
)
from .releasing import (  # noqa: F401
    RECORD,
    FORCE_HINT,
    ReleaseResult,
    read_record,
    backup_name,
    release,
)
from .validation import (  # noqa: F401
    ValidationRun,
    _make_validator,
    execute_and_validate,
    validate,
    validate_executed,
    MEMORY_PROBE,
    add_memory_probe,
    peak_rss_mb,
    cell_seconds,
)
from .autograding import (  # noqa: F401
    StudentResult,
    _timed_out_cells,
    _collect,
    _grade_students,
    cell_line,
    format_summary,
    autograding_environment,
    submitted_students,
    grade,
    autograde,
)
from .notebooks import (  # noqa: F401
    cells_by_grade_id,
    setup_namespace,
    exec_cell,
    Exercise,
    NotebookExercises,
    exercise_tests,
    library_answer_cheat,
    own_work_calls_in,
    without_hidden_tests,
    HELPER_CELL,
    demo_names_read_by_tests,
    nbgrader_meta,
    is_solution,
    is_grade,
    is_test,
    solution_region,
    answer_from_solution,
)
from .colab import (  # noqa: F401
    REPOSITORY_URL,
    PUBLISHED_BRANCH,
    COLAB_REQUIREMENTS,
    COLAB_KEEPS,
    colab_cell_source,
    _github_path,
    colab_url,
    binder_url,
)
from .links import (  # noqa: F401
    _HELPER_MODULES,
    _FROM_IMPORT,
    _PLAIN_IMPORT,
    _module_file,
    _module_summary,
    _defining_module,
    llmu_imports,
    code_links_source,
)
from .skeleton import (  # noqa: F401
    CLOSING_CELLS,
    EXERCISE_HEADING,
    exercise_groups,
    _LINK,
    skeleton_problems,
    apply_skeleton,
)
from .cell_deps import (  # noqa: F401
    cells_to_run,
    release_check_skips,
)
