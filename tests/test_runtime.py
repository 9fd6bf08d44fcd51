"""llmu.runtime: the Triton mode is chosen before triton is imported, and a user setting wins.

Each scenario runs in a fresh interpreter (the mode is decided once, at import), with CUDA hidden
(``CUDA_VISIBLE_DEVICES=""``) so that the machine's GPU, if any, does not change the answer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import llmu
from llmu import runtime


def _run(code: str, script_dir=None, **env_changes) -> dict:
    """Run ``code`` in a fresh Python (from a file in ``script_dir`` when given: ``@triton.jit``
    outside the interpreter needs the kernel's source file) and return the JSON it prints last."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env["CUDA_VISIBLE_DEVICES"] = ""
    for k, v in env_changes.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    if script_dir is not None:
        script = Path(script_dir) / "probe.py"
        script.write_text(textwrap.dedent(code))
        cmd = [sys.executable, str(script)]
    else:
        cmd = [sys.executable, "-c", textwrap.dedent(code)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


_PROBE = """
    import json, os, sys
    before = {"env": os.environ.get("TRITON_INTERPRET"), "triton_loaded": "triton" in sys.modules}
    import llmu
    from llmu import runtime
    after_llmu = os.environ.get("TRITON_INTERPRET")
    import triton  # what triton sees when llmu's kernels are defined
    print(json.dumps({"before": before, "after_llmu": after_llmu, "mode": runtime.triton_mode(),
                      "interpreting": runtime.interpreting(), "kernel_device": str(runtime.kernel_device()),
                      "early": runtime.TRITON_IMPORTED_EARLY, "user": runtime.USER_SETTING,
                      "triton_env": os.environ.get("TRITON_INTERPRET")}))
"""


def test_import_sets_interpreter_without_cuda():
    r = _run(_PROBE)
    assert r["before"] == {"env": None, "triton_loaded": False}
    assert r["after_llmu"] == "1", "import llmu must export TRITON_INTERPRET=1 on a machine without CUDA"
    assert r["mode"] == "interpreter" and r["interpreting"] is True
    assert r["kernel_device"] == "cpu"
    assert r["early"] is False and r["user"] is None


def test_user_setting_zero_is_respected():
    r = _run(_PROBE, TRITON_INTERPRET="0")
    assert r["triton_env"] == "0", "llmu must not overwrite the user's TRITON_INTERPRET"
    assert r["mode"] == "compiled" and r["user"] == "0"
    assert r["kernel_device"] == "cuda"


def test_user_setting_one_is_respected():
    r = _run(_PROBE, TRITON_INTERPRET="1")
    assert r["mode"] == "interpreter" and r["user"] == "1"


def test_triton_imported_first_is_detected():
    r = _run("""
        import json, triton, llmu
        from llmu import runtime
        print(json.dumps({"early": runtime.TRITON_IMPORTED_EARLY, "mode": runtime.triton_mode()}))
    """)
    assert r == {"early": True, "mode": "interpreter"}


def test_a_trivial_kernel_runs_on_cpu_tensors():
    r = _run("""
        import json
        import llmu, torch, triton, triton.language as tl

        @triton.jit
        def scale_add(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            tl.store(out_ptr + offs, 2.0 * tl.load(x_ptr + offs, mask=mask) + 1.0, mask=mask)

        x = torch.arange(37, dtype=torch.float32)   # 37: not a multiple of the block
        out = torch.full_like(x, -1.0)
        scale_add[(triton.cdiv(37, 16),)](x, out, 37, BLOCK=16)
        print(json.dumps({"ok": bool(torch.equal(out, 2 * x + 1)), "device": str(out.device)}))
    """)
    assert r == {"ok": True, "device": "cpu"}


def test_in_process_helpers_are_consistent():
    assert runtime.triton_mode() in ("interpreter", "compiled")
    assert runtime.interpreting() == (runtime.triton_mode() == "interpreter")
    env = runtime.environment()
    assert env.triton_mode == runtime.triton_mode()
    assert env.torch and env.python and env.device in ("cpu", "cuda")
    assert set(env.as_dict()) >= {"python", "torch", "triton", "device", "triton_mode"}
    assert llmu.__version__


@pytest.mark.skipif(runtime.triton_mode() != "interpreter", reason="only meaningful without a GPU")
def test_this_process_runs_kernels_on_cpu():
    assert os.environ.get("TRITON_INTERPRET") not in (None, "", "0")
    assert str(runtime.kernel_device()) == "cpu"


def test_trim_memory_returns_freed_heap_on_glibc():
    import sys

    import llmu.runtime as rt

    ran = rt.trim_memory()
    assert ran == (sys.platform.startswith("linux") and _glibc())


def _glibc() -> bool:
    import platform

    return platform.libc_ver()[0] == "glibc"


def test_trim_hook_registers_once_in_an_ipython_shell(monkeypatch):
    import types

    import llmu.runtime as rt

    registered = []
    shell = types.SimpleNamespace(events=types.SimpleNamespace(register=lambda event, fn: registered.append((event, fn))))
    fake_ipython = types.SimpleNamespace(get_ipython=lambda: shell)
    monkeypatch.setitem(__import__("sys").modules, "IPython", fake_ipython)
    monkeypatch.setattr(rt, "_TRIM_HOOKED", False)
    rt._hook_trim_after_cells()
    rt._hook_trim_after_cells()
    assert [event for event, _ in registered] == ["post_run_cell"]
    registered[0][1](object())  # the callback takes IPython's result argument and runs
    monkeypatch.setattr(rt, "_TRIM_HOOKED", False)
    fake_ipython.get_ipython = lambda: None  # a plain Python process: nothing registered
    rt._hook_trim_after_cells()
    assert len(registered) == 1


def test_a_kernel_defined_before_llmu_switched_the_interpreter_on_says_what_to_do(tmp_path):
    r = _run("""
        import json
        import torch, triton, triton.language as tl

        @triton.jit
        def early_kernel(x_ptr, n, BLOCK: tl.constexpr):   # defined before llmu: built for a GPU
            offs = tl.arange(0, BLOCK)
            tl.store(x_ptr + offs, 1.0, mask=offs < n)

        import llmu
        from llmu import runtime
        from llmu.welcome.kernels import add

        @triton.jit
        def late_kernel(x_ptr, n, BLOCK: tl.constexpr):    # defined after: interpreted
            offs = tl.arange(0, BLOCK)
            tl.store(x_ptr + offs, 1.0, mask=offs < n)

        said = {"early": runtime.TRITON_IMPORTED_EARLY}
        for name, launch in (("early_kernel", lambda: early_kernel[(1,)](torch.zeros(8), 8, BLOCK=8)),
                             ("late_kernel", lambda: late_kernel[(1,)](torch.zeros(8), 8, BLOCK=8)),
                             ("add", lambda: add(torch.ones(8), torch.ones(8)))):
            try:
                launch()
                said[name] = "ran"
            except runtime.TritonImportedEarly as exc:
                said[name] = str(exc)
        print(json.dumps(said))
    """, script_dir=tmp_path)
    assert r["early"] is True
    assert r["early_kernel"].startswith("early_kernel cannot run: it was defined before llmu switched"), r
    assert "Run its cell again" in r["early_kernel"] and "import llmu before triton" in r["early_kernel"], r
    # llmu's kernels and those defined after `import llmu` are interpreted: they run
    assert r["late_kernel"] == "ran" and r["add"] == "ran", r


def test_launches_are_left_alone_when_llmu_came_first():
    r = _run("""
        import json
        import llmu, torch, triton
        from llmu.welcome.kernels import add
        print(json.dumps({"ok": bool(torch.equal(add(torch.ones(8), torch.ones(8)), torch.full((8,), 2.0)))}))
    """)
    assert r == {"ok": True}
