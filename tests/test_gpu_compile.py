"""``llmu gpu-compile``: every Triton kernel of llmu compiled for H100/H200 (sm_90), A100 (sm_80)
and T4 (sm_75) on this CPU-only machine, at the configurations its launcher picks on a GPU.

One test per target runs the whole check (each in a compile-only child process, so pytest-xdist can
spread them); a planted faulty kernel shows that the check fails where it should.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from llmu import gpu_compile
from llmu.gpu_compile.capture import TARGETS


def _check(tmp_path, monkeypatch, targets, only=None, cache=None):
    out = tmp_path / "rows.json"
    rc = gpu_compile.run(targets, only=only, json_path=str(out), quiet=True,
                         cache_dir=str(cache or tmp_path / "cache"))
    return rc, json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("target", list(TARGETS))
def test_every_kernel_compiles_for(target, tmp_path, monkeypatch):
    # A cache of the test's own: every kernel is compiled here, and ptxas reports on each.
    rc, report = _check(tmp_path, monkeypatch, [target])
    assert report["problems"] == [], "\n".join(report["problems"])
    assert rc == 0
    rows = [r for r in report["rows"] if r["status"] == "ok"]
    limit = TARGETS[target][1]
    assert all(r["shared"] <= limit for r in rows)
    # ptxas reported on every compiled kernel (registers and spills come from its -v output)
    assert all(r["registers"] is not None and r["spill_stores"] is not None for r in rows)
    # every float dtype reaches the compiler for the kernels that take floats
    dtypes = {r["dtype"] for r in rows}
    assert {"float32", "float16", "bfloat16"} <= dtypes
    # the rows carry the configurations the launchers chose on a GPU, not the interpreter's
    assert all("UPCAST_DOT=True" not in r["config"] for r in rows)


_PLANTED = '''
import torch
import triton
import triton.language as tl

from llmu.checks import require_tensor
from llmu.gpu_compile.cases import F32, Case, rand


@triton.jit
def _too_big_kernel(a_ptr, b_ptr, out_ptr, K: tl.constexpr):
    m = tl.arange(0, 16)
    k = tl.arange(0, K)
    a = tl.load(a_ptr + m[:, None] * K + k[None, :])
    b = tl.load(b_ptr + k[:, None] * 16 + m[None, :])
    tl.store(out_ptr + m[:, None] * 16 + m[None, :], tl.dot(a, b))


def too_big(a, b):
    require_tensor("a", a, dtypes=(torch.float32, torch.float16))
    out = torch.empty((16, 16), dtype=a.dtype)
    _too_big_kernel[(1,)](a, b, out, K=a.shape[1], num_warps=4)
    return out


def cases():
    # (16, 2048) x (2048, 16) float32 operands of tl.dot staged in shared memory: 256 KB, four
    # times a T4's 64 KB; and the case leaves out float16, which the launcher accepts.
    return [Case("planted.too_big", lambda dt: too_big(rand(16, 2048, dtype=dt), rand(2048, 16, dtype=dt)),
                 dtypes=(F32,))]
'''


@pytest.mark.slow
def test_a_planted_fault_fails_the_check(tmp_path, monkeypatch):
    (tmp_path / "planted_kernels.py").write_text(textwrap.dedent(_PLANTED))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}")
    monkeypatch.setenv("LLMU_GPU_COMPILE_CASES", "planted_kernels:cases")
    rc, report = _check(tmp_path, monkeypatch, ["sm_75"], only="planted.")
    assert rc == 1
    problems = "\n".join(report["problems"])
    assert "planted_kernels:_too_big_kernel" in problems and "allows 65536 B" in problems, problems
    assert "accepts float16, which the case does not compile" in problems, problems


def test_command_line_rejects_an_unknown_target(capsys):
    from llmu.cli import main

    assert main(["gpu-compile", "--targets", "sm_61", "--quiet"]) == 2
