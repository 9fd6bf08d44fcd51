"""``llmu gpu-compile``: every Triton kernel of llmu compiled for H100/H200 (sm_90), A100 (sm_80)
and T4 (sm_75) on this CPU-only machine, at the configurations its launcher picks on a GPU.

One test per target runs the whole check (each in a compile-only child process, so pytest-xdist can
spread them); a planted faulty kernel shows that the check fails where it should.

The whole check compiles about 320 kernel configurations per target, some 20 CPU-minutes for the
three. The suite therefore runs it with the record ``tests/gpu_compile_record.json``
(``make gpu-compile-record`` writes it): every launch still goes through its launcher and gets
Triton's hash of the compile; a hash the record holds takes the record's shared memory, registers
and spills, any other is compiled, and the first launch of every kernel for every target is
compiled regardless and must agree with the record. ``LLMU_GPU_COMPILE_FULL=1`` compiles all.
"""

from __future__ import annotations

import json
import os
import textwrap
import warnings
from pathlib import Path

import pytest

from llmu import gpu_compile
from llmu.gpu_compile.capture import TARGETS

RECORD = Path(__file__).with_name("gpu_compile_record.json")


def _check(tmp_path, monkeypatch, targets, only=None, cache=None, record=None, write_record=None):
    out = tmp_path / "rows.json"
    rc = gpu_compile.run(targets, only=only, json_path=str(out), quiet=True,
                         cache_dir=str(cache or tmp_path / "cache"), record=record, write_record=write_record)
    return rc, json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("target", list(TARGETS))
def test_every_kernel_compiles_for(target, tmp_path, monkeypatch):
    # A Triton cache of the test's own: nothing compiled earlier on this machine is reused.
    full = os.environ.get("LLMU_GPU_COMPILE_FULL") == "1"
    rc, report = _check(tmp_path, monkeypatch, [target], record=None if full else str(RECORD))
    assert report["problems"] == [], "\n".join(report["problems"])
    assert rc == 0
    rows = [r for r in report["rows"] if r["status"] == "ok"]
    # every kernel was compiled here for this target at least once, record or not
    assert {r["kernel"] for r in rows if r["source"] == "compiled"} == {r["kernel"] for r in rows}
    stale = report["compiles"]["compiled"] - len({r["kernel"] for r in rows})
    if not full and stale > 0:
        warnings.warn(f"{stale} compiles for {target} were not in {RECORD.name} (a kernel or Triton changed): "
                      "they were compiled, which takes longer; `make gpu-compile-record` writes the record again",
                      stacklevel=2)
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


_SMALL = '''
import torch
import triton
import triton.language as tl

from llmu.gpu_compile.cases import F16, F32, Case, rand


@triton.jit
def _scale_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(out_ptr + offs, x * 2, mask=offs < n)


def scale(x, block):
    out = torch.empty_like(x)
    _scale_kernel[(triton.cdiv(x.numel(), block),)](x, out, x.numel(), BLOCK=block)
    return out


def cases():
    return [Case("small.scale", lambda dt: [scale(rand(1000, dtype=dt), b) for b in (64, 128, 256)],
                 dtypes=(F32, F16))]
'''


def _small_kernel(tmp_path, monkeypatch, source=_SMALL):
    (tmp_path / "small_kernels.py").write_text(textwrap.dedent(source))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}")
    monkeypatch.setenv("LLMU_GPU_COMPILE_CASES", "small_kernels:cases")


def _outcomes(report):
    return sorted((r["kernel"], r["config"], r["signature"], r["shared"], r["registers"], r["spill_stores"])
                  for r in report["rows"] if r["status"] == "ok")


def test_a_record_spares_compiles_and_changes_no_row(tmp_path, monkeypatch):
    _small_kernel(tmp_path, monkeypatch)
    record = tmp_path / "record.json"
    rc, written = _check(tmp_path, monkeypatch, ["sm_80"], only="small.", cache=tmp_path / "c1",
                         write_record=str(record))
    assert rc == 0 and written["compiles"] == {"compiled": 6, "record": 0}
    assert len(json.loads(record.read_text())["entries"]) == 6
    # a fresh Triton cache: only the record can spare a compile
    rc, recalled = _check(tmp_path, monkeypatch, ["sm_80"], only="small.", cache=tmp_path / "c2", record=str(record))
    assert rc == 0, recalled["problems"]
    # the first launch of the kernel compiles anyway (and agrees); the five others come from the record
    assert recalled["compiles"] == {"compiled": 1, "record": 5}
    assert _outcomes(recalled) == _outcomes(written)


def test_another_target_or_an_edited_kernel_is_not_in_the_record(tmp_path, monkeypatch):
    _small_kernel(tmp_path, monkeypatch)
    record = tmp_path / "record.json"
    _check(tmp_path, monkeypatch, ["sm_80"], only="small.", cache=tmp_path / "c1", write_record=str(record))
    # the target is part of the hash
    rc, other = _check(tmp_path, monkeypatch, ["sm_75"], only="small.", cache=tmp_path / "c2", record=str(record))
    assert rc == 0 and other["compiles"] == {"compiled": 6, "record": 0}
    # so is the kernel's source: an edit (here, x * 3) compiles every configuration again
    _small_kernel(tmp_path, monkeypatch, _SMALL.replace("x * 2", "x * 3"))
    rc, edited = _check(tmp_path, monkeypatch, ["sm_80"], only="small.", cache=tmp_path / "c3", record=str(record))
    assert rc == 0 and edited["compiles"] == {"compiled": 6, "record": 0}


def test_a_record_that_disagrees_with_the_compiler_fails_the_check(tmp_path, monkeypatch):
    _small_kernel(tmp_path, monkeypatch)
    record = tmp_path / "record.json"
    _check(tmp_path, monkeypatch, ["sm_80"], only="small.", cache=tmp_path / "c1", write_record=str(record))
    data = json.loads(record.read_text())
    for entry in data["entries"].values():
        entry["registers"] += 1   # not what ptxas says: a record from another compiler, or edited by hand
    record.write_text(json.dumps(data))
    rc, report = _check(tmp_path, monkeypatch, ["sm_80"], only="small.", cache=tmp_path / "c2", record=str(record))
    assert rc == 1
    assert any("the record disagrees with the compiler here" in p and "registers: recorded" in p
               for p in report["problems"]), report["problems"]


def test_the_record_covers_every_target_and_warns_on_another_triton():
    import triton

    data = json.loads(RECORD.read_text())
    # Another Triton (pyproject allows a range) is not an error: the record's hashes simply do not
    # match and every kernel compiles in full, which is correct but slow. Say so, do not fail.
    if data["triton"] != triton.__version__:
        warnings.warn(f"{RECORD.name} was written with Triton {data['triton']}, this is {triton.__version__}: "
                      "every kernel compiles in full until `make gpu-compile-record` writes it again", stacklevel=2)
    assert {e["target"] for e in data["entries"].values()} == set(TARGETS)


def test_command_line_rejects_an_unknown_target(capsys):
    from llmu.cli import main

    assert main(["gpu-compile", "--targets", "sm_61", "--quiet"]) == 2
