"""llmu.bench: the runner, the arithmetic, results files, plots and the command line.

Every test uses an entry of its own (passed with ``entries=`` or put in the registry for the
duration of one test with monkeypatch), so the course's real entries are neither needed nor
changed, and nothing here loads a model.
"""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

import llmu.bench as bench
from llmu.bench import registry as registry_mod, runner as runner_mod
from llmu.bench.peaks import peak_for
from llmu.bench.registry import Entry, Provider


def _scale_setup(size, device, dtype):
    return (torch.arange(size["N"], device=device, dtype=dtype),)


def _no_external(x):
    raise ImportError("No module named 'fancy_kernels'")


def _broken(x):
    raise RuntimeError("this provider is broken")


class _Counter:
    """A provider function that counts its calls (to prove a triton provider is never called)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, x):
        self.calls += 1
        return x * 2


def _entry(name="scale_test", providers=None, **kw) -> Entry:
    kw.setdefault("cpu_sizes", [{"N": 1000}, {"N": 4096}])
    kw.setdefault("gpu_sizes", [{"N": 2**20}])
    return Entry(
        name=name, module="99_test", description="y = 2x",
        providers=providers or {
            "ref": Provider(lambda x: x * 2, "torch", "llmu reference"),
            "builtin": Provider(lambda x: torch.mul(x, 2), "builtin"),
        },
        setup=_scale_setup, flops=lambda s: s["N"], bytes=lambda s, e: 2 * s["N"] * e, x_axis="N", **kw,
    )


def _fake_timer(ms):
    def timer(fn):
        fn()  # the provider still runs once, so a broken one is still caught
        return {"ms": ms, "ms_min": ms / 2, "ms_max": 2 * ms, "ms_p20": 0.9 * ms, "ms_p80": 1.1 * ms,
                "n_samples": 5}
    return timer


# ---------------------------------------------------------------------------------------------
# run()
# ---------------------------------------------------------------------------------------------

def test_run_on_cpu_produces_complete_rows():
    triton_fn = _Counter()
    entry = _entry(providers={
        "ref": Provider(lambda x: x * 2, "torch"),
        "builtin": Provider(lambda x: torch.mul(x, 2), "builtin"),
        "kernel": Provider(triton_fn, "triton"),
    })
    res = bench.run(entries=[entry], device="cpu", repeats=3)
    assert res["schema_version"] == bench.SCHEMA_VERSION
    assert res["environment"]["bench_device"] == "cpu"
    assert res["environment"]["threads"] == torch.get_num_threads()
    assert res["peak"] is None  # a CPU has no table entry
    rows = res["rows"]
    assert len(rows) == 2 * 3  # two sizes x three providers
    for row in rows:
        assert set(row) == set(bench.ROW_FIELDS)
        assert row["entry"] == "scale_test" and row["dtype"] == "float32" and row["device"] == "cpu"
        assert row["x_key"] == "N" and row["x"] == row["size"]["N"]
    ok = [r for r in rows if r["status"] == "ok"]
    assert {r["provider"] for r in ok} == {"ref", "builtin"}
    for r in ok:
        assert 0 < r["ms_min"] <= r["ms_p20"] <= r["ms"] <= r["ms_p80"] <= r["ms_max"]
        assert r["n_samples"] >= 3
        # The row's throughput is the entry's formulas over its own median time.
        assert r["tflops"] == pytest.approx(r["size"]["N"] / (r["ms"] * 1e-3) / 1e12)
        assert r["gbs"] == pytest.approx(2 * r["size"]["N"] * 4 / (r["ms"] * 1e-3) / 1e9)
        assert r["frac_flops"] is None and r["frac_bw"] is None


def test_triton_providers_are_skipped_on_cpu_with_a_reason():
    triton_fn = _Counter()
    entry = _entry(providers={"kernel": Provider(triton_fn, "triton"), "ref": Provider(lambda x: x * 2, "torch")})
    rows = bench.run(entries=[entry], device="cpu", timer=_fake_timer(1.0))["rows"]
    skipped = [r for r in rows if r["kind"] == "triton"]
    assert len(skipped) == 2
    for r in skipped:
        assert r["status"] == "skipped" and "interpreter" in r["reason"]
        assert r["ms"] is None and r["tflops"] is None
    assert triton_fn.calls == 0


def test_failing_and_missing_providers_are_recorded_not_raised():
    entry = _entry(providers={
        "ok": Provider(lambda x: x * 2, "torch"),
        "missing": Provider(_no_external, "external"),
        "broken": Provider(_broken, "torch"),
    }, cpu_sizes=[{"N": 10}])
    rows = {r["provider"]: r for r in bench.run(entries=[entry], device="cpu", timer=_fake_timer(1.0))["rows"]}
    assert rows["ok"]["status"] == "ok"
    assert rows["missing"]["status"] == "skipped" and "not installed" in rows["missing"]["reason"]
    assert rows["broken"]["status"] == "error" and "this provider is broken" in rows["broken"]["reason"]


def test_setup_failure_marks_every_provider():
    def bad_setup(size, device, dtype):
        raise ValueError("cannot build inputs")

    entry = Entry(name="bad_setup", module="99_test", description="", setup=bad_setup,
                  providers={"a": Provider(lambda x: x, "torch"), "b": Provider(lambda x: x, "builtin")},
                  cpu_sizes=[{"N": 1}])
    rows = bench.run(entries=[entry], device="cpu")["rows"]
    assert [r["status"] for r in rows] == ["error", "error"]
    assert all("setup failed" in r["reason"] and "cannot build inputs" in r["reason"] for r in rows)


def test_broken_formula_is_reported():
    entry = _entry(cpu_sizes=[{"M": 3}])  # the formulas read size["N"]
    rows = bench.run(entries=[entry], device="cpu")["rows"]
    assert all(r["status"] == "error" and "formula failed: KeyError" in r["reason"] for r in rows)


def test_flops_and_bytes_become_tflops_and_gbs_on_a_fake_timing():
    # N = 1e6 elements in 2 ms: 1e6 / 2e-3 s = 5e8 FLOP/s = 5e-4 TFLOP/s;
    # 2 * 1e6 * 4 bytes / 2e-3 s = 4e9 B/s = 4 GB/s.
    entry = _entry(cpu_sizes=[{"N": 10**6}])
    rows = bench.run(entries=[entry], device="cpu", timer=_fake_timer(2.0))["rows"]
    for r in rows:
        assert r["ms"] == 2.0 and r["ms_min"] == 1.0 and r["ms_max"] == 4.0
        assert r["flops"] == 1e6 and r["bytes"] == 8e6
        assert r["tflops"] == pytest.approx(5e-4, rel=1e-12)
        assert r["gbs"] == pytest.approx(4.0, rel=1e-12)


def test_fraction_of_peak_uses_the_gpu_table():
    h200 = peak_for("NVIDIA H200")
    assert h200.tflops_for(torch.bfloat16) == 989.5 and h200.bandwidth_gbs == 4800.0
    # 989.5e9 FLOPs in 1 ms is exactly the bf16 dense peak; 2.4e9 bytes in 1 ms is half of 4.8 TB/s.
    out = bench.throughput(1.0, 989.5e9, 2.4e9, h200, torch.bfloat16)
    assert out["tflops"] == pytest.approx(989.5)
    assert out["frac_flops"] == pytest.approx(1.0)
    assert out["gbs"] == pytest.approx(2400.0)
    assert out["frac_bw"] == pytest.approx(0.5)
    # A dtype the table has no peak for gives no FLOP fraction (bandwidth still applies).
    t4 = bench.throughput(1.0, 1e9, 1e9, peak_for("Tesla T4"), torch.bfloat16)
    assert t4["frac_flops"] is None and t4["frac_bw"] == pytest.approx(1000 / 320)
    assert bench.throughput(None, 1e9, 1e9, h200, torch.bfloat16)["tflops"] is None


def test_peak_table_matches_names_as_torch_reports_them():
    assert peak_for("NVIDIA H100 80GB HBM3").name == "NVIDIA H100 SXM"
    assert peak_for("NVIDIA H100 PCIe").name == "NVIDIA H100 PCIe"
    assert peak_for("NVIDIA A100-SXM4-80GB").bandwidth_gbs == 2039.0
    assert peak_for("NVIDIA A100-SXM4-40GB").bandwidth_gbs == 1555.0
    assert peak_for("NVIDIA L4").name == "NVIDIA L4"
    assert peak_for("NVIDIA L40S") is None  # not an L4
    assert peak_for("x86_64") is None and peak_for(None) is None


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown benchmark name.*'nope'.*known: scale_test"):
        bench.run(["nope"], entries=[_entry()], device="cpu")


def test_bad_sizes_argument():
    with pytest.raises(ValueError, match="sizes must be"):
        bench.run(entries=[_entry()], device="cpu", sizes="tiny")


def test_sizes_choice_and_explicit_sizes():
    entry = _entry()
    rows = bench.run(entries=[entry], device="cpu", sizes="gpu", timer=_fake_timer(1.0))["rows"]
    assert {r["size"]["N"] for r in rows} == {2**20}
    rows = bench.run(entries=[entry], device="cpu", sizes=[{"N": 7}], timer=_fake_timer(1.0))["rows"]
    assert {r["size_label"] for r in rows} == {"N=7"}


def test_entry_without_cpu_sizes_is_skipped():
    rows = bench.run(entries=[_entry(cpu_sizes=[])], device="cpu")["rows"]
    assert len(rows) == 1 and rows[0]["status"] == "skipped" and "no CPU sizes" in rows[0]["reason"]


def test_budget_skips_sizes_not_started_in_time():
    rows = bench.run(entries=[_entry()], device="cpu", budget_s=0.0, timer=_fake_timer(1.0))["rows"]
    assert rows and all(r["status"] == "skipped" and "budget" in r["reason"] for r in rows)


def test_run_entries_measure_themselves():
    def whole(size, device):
        return [{"provider": "model", "kind": "torch", "ms": 5.0, "flops": 1e9, "dtype": torch.float32,
                 "tokens_per_s": 200.0}]

    entry = Entry(name="decode", module="99_test", description="tokens/s", run=whole)
    (row,) = bench.run(entries=[entry], device="cpu")["rows"]
    assert row["status"] == "ok" and row["tokens_per_s"] == 200.0 and row["dtype"] == "float32"
    assert row["tflops"] == pytest.approx(1e9 / 5e-3 / 1e12)
    json.dumps(row)  # JSON-ready


def test_threads_are_set_for_the_run_and_restored():
    before = torch.get_num_threads()
    res = bench.run(entries=[_entry()], device="cpu", timer=_fake_timer(1.0), threads=1)
    assert res["environment"]["threads"] == 1
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="threads must be >= 1"):
        bench.run(entries=[_entry()], device="cpu", threads=0)


def test_progress_sees_every_row():
    seen = []
    res = bench.run(entries=[_entry()], device="cpu", timer=_fake_timer(1.0), progress=seen.append)
    assert seen == res["rows"]


# ---------------------------------------------------------------------------------------------
# Timers
# ---------------------------------------------------------------------------------------------

def test_time_cpu_measures_a_known_delay():
    # time.sleep(2 ms) takes at least 2 ms, however busy the machine; how much longer depends on
    # the load, so no upper bound here (the units are checked on a fake clock below).
    stats = bench.time_cpu(lambda: time.sleep(0.002), repeats=3)
    assert stats["ms"] >= 2.0 and math.isfinite(stats["ms"])
    assert stats["n_samples"] == 3


def test_time_cpu_reports_milliseconds_per_call(fake_clock):
    """Every call lasts exactly 2**-12 s on a clock the test moves: the figures must be that, in ms.
    A wrong unit, or a sample not divided by its inner loop (here about 20 calls long), shows."""
    clock = fake_clock(runner_mod)
    stats = bench.time_cpu(lambda: clock.advance(2.0**-12), repeats=3)
    assert stats["ms"] == stats["ms_min"] == stats["ms_max"] == 1e3 * 2.0**-12
    assert stats["n_samples"] == 3


def test_time_cuda_uses_do_bench_and_falls_back_to_quantiles(monkeypatch):
    import triton.testing

    calls = []

    def fake_all(fn, warmup, rep, return_mode="mean", quantiles=None):
        calls.append(return_mode)
        fn()
        return [3.0, 1.0, 2.0, 5.0, 4.0]

    monkeypatch.setattr(triton.testing, "do_bench", fake_all)
    stats = bench.time_cuda(lambda: None)
    assert stats["ms"] == 3.0 and stats["ms_min"] == 1.0 and stats["ms_max"] == 5.0
    assert stats["ms_p20"] == pytest.approx(1.8) and stats["ms_p80"] == pytest.approx(4.2)

    def fake_old(fn, warmup, rep, return_mode="mean", quantiles=None):
        assert return_mode in ("mean", "median"), "an older Triton rejects 'all'"
        return [math.nan if q is None else 10 * q for q in quantiles]

    monkeypatch.setattr(triton.testing, "do_bench", fake_old)
    stats = bench.time_cuda(lambda: None)
    assert (stats["ms"], stats["ms_p20"], stats["ms_p80"], stats["ms_min"], stats["ms_max"]) == (5, 2, 8, 0, 10)


# ---------------------------------------------------------------------------------------------
# Results files
# ---------------------------------------------------------------------------------------------

def test_json_round_trip(tmp_path):
    res = bench.run(entries=[_entry()], device="cpu", timer=_fake_timer(1.5))
    path = bench.save(res, tmp_path / "sub" / "r.json")
    back = bench.load(path)
    assert back == json.loads(json.dumps(res))
    assert back["rows"][0]["ms"] == 1.5


def test_load_rejects_other_files(tmp_path):
    (tmp_path / "other.json").write_text(json.dumps({"rows": [], "schema_version": 999}))
    with pytest.raises(ValueError, match="schema version 999"):
        bench.load(tmp_path / "other.json")
    (tmp_path / "none.json").write_text("[]")
    with pytest.raises(ValueError, match="not an llmu benchmark results file"):
        bench.load(tmp_path / "none.json")
    with pytest.raises(ValueError, match="what llmu.bench.run"):
        bench.save({"rows": []}, tmp_path / "x.json")


def _recorded_file(tmp_path, ms=0.01):
    res = bench.run(entries=[_entry(cpu_sizes=[{"N": 1024}, {"N": 4096}])], device="cpu",
                    timer=_fake_timer(ms))
    res["created"] = "2025-03-04T05:06:07+00:00"
    res["environment"]["gpu_name"] = "NVIDIA H200"
    res["rows"][0]["status"] = "error"  # failed rows are not recorded results
    return bench.save(res, tmp_path / "h200-2025-03-04.json")


def test_recorded_rows_are_labelled(tmp_path, monkeypatch):
    _recorded_file(tmp_path)
    (tmp_path / "broken.json").write_text("{not json")
    monkeypatch.setenv("LLMU_RESULTS_DIR", str(tmp_path))
    with pytest.warns(UserWarning, match="skipping broken.json"):
        rows = bench.recorded("scale_test")
    assert len(rows) == 3  # 2 sizes x 2 providers, less the failed one
    for r in rows:
        assert r["recorded"] is True and r["device_name"] == "H200" and r["date"] == "2025-03-04"
        assert r["source"] == "h200-2025-03-04.json" and r["entry"] == "scale_test"
    assert bench.recorded("no_such_entry", directory=tmp_path / "missing") == []


# ---------------------------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------------------------

def test_figure_has_one_trace_per_provider_and_labelled_recorded_traces(tmp_path):
    res = bench.run(entries=[_entry()], device="cpu", timer=_fake_timer(1.0))
    fig = bench.figure(res, "scale_test", recorded=False)
    assert len(fig.data) == 2
    names = sorted(t.name for t in fig.data)
    assert names[0].startswith("builtin") and names[1].startswith("llmu reference")
    for trace in fig.data:
        assert list(trace.x) == [1000, 4096] and list(trace.y) == [1.0, 1.0]
        assert trace.line.dash == "solid"
    assert fig.layout.xaxis.title.text == "N"

    rec = bench.load(_recorded_file(tmp_path))["rows"]
    rec = [{**r, "recorded": True, "device_name": "H200", "date": "2025-03-04", "created": "x"} for r in rec
           if r["status"] == "ok"]
    fig = bench.figure(res, "scale_test", metric="tflops", recorded=rec)
    dashed = [t for t in fig.data if t.line.dash == "dash"]
    assert len(fig.data) == 4 and len(dashed) == 2
    assert all("H200 2025-03-04" in t.name for t in dashed)
    assert fig.layout.yaxis.title.text == "TFLOP/s"


def test_figure_without_measurements_says_so():
    entry = _entry(providers={"kernel": Provider(lambda x: x, "triton")})
    res = bench.run(entries=[entry], device="cpu")
    fig = bench.figure(res, "scale_test", recorded=False)
    assert len(fig.data) == 0 and "no measurements" in fig.layout.annotations[0].text
    with pytest.raises(ValueError, match="metric must be"):
        bench.figure(res, "scale_test", metric="speed")


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def cli_entry(monkeypatch):
    entry = _entry(name="cli_scale_test", cpu_sizes=[{"N": 256}])
    monkeypatch.setitem(registry_mod.REGISTRY, entry.name, entry)
    return entry


def test_cli_list(cli_entry, capsys):
    assert bench.cli_main(["--list"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("cli_scale_test"))
    assert "99_test" in line and "ref [torch]" in line and "builtin [builtin]" in line and "1/1" in line


def test_cli_runs_and_writes_json(cli_entry, tmp_path, capsys):
    out_file = tmp_path / "res.json"
    assert bench.cli_main(["cli_scale_test", "--device", "cpu", "--repeats", "3", "--out", str(out_file)]) == 0
    out = capsys.readouterr().out
    assert "cli_scale_test" in out and "N=256" in out and f"wrote {out_file}" in out
    data = bench.load(out_file)
    assert {r["provider"] for r in data["rows"]} == {"ref", "builtin"}
    assert all(r["status"] == "ok" and r["ms"] > 0 for r in data["rows"])


def test_cli_unknown_name(cli_entry, capsys):
    assert bench.cli_main(["no_such_bench"]) == 2
    err = capsys.readouterr().err
    assert "unknown benchmark name(s) no_such_bench" in err and "cli_scale_test" in err


def test_cli_exit_status_is_1_when_a_provider_fails(monkeypatch, capsys):
    entry = _entry(name="cli_broken_test", providers={"broken": Provider(_broken, "torch")}, cpu_sizes=[{"N": 8}])
    monkeypatch.setitem(registry_mod.REGISTRY, entry.name, entry)
    assert bench.cli_main(["cli_broken_test", "--device", "cpu"]) == 1
    assert "error: RuntimeError: this provider is broken" in capsys.readouterr().out


def test_format_table_is_aligned():
    rows = bench.run(entries=[_entry()], device="cpu", timer=_fake_timer(1.0))["rows"]
    lines = bench.format_table(rows).splitlines()
    assert lines[0].startswith("entry") and set(lines[1]) == {"-"}
    assert len(lines) == 2 + len(rows)
    col = lines[0].index("ms")
    assert all(ln[col - 8:col + 2].strip() for ln in lines[2:])  # every ms cell is filled, in its column


# ---------------------------------------------------------------------------------------------
# Registry loading
# ---------------------------------------------------------------------------------------------

def test_load_all_records_broken_topics_when_not_strict(monkeypatch):
    monkeypatch.setattr(registry_mod, "TOPICS", ["_no_such_topic"])
    with pytest.raises(ModuleNotFoundError):
        registry_mod.load_all()
    try:
        registry_mod.load_all(strict=False)
        assert "llmu._no_such_topic.bench" in registry_mod.LOAD_ERRORS
    finally:
        registry_mod.LOAD_ERRORS.pop("llmu._no_such_topic.bench", None)


def test_cli_saves_partial_results_when_terminated(tmp_path):
    """`timeout` stops a long GPU run with SIGTERM: what was measured by then is still written."""
    import os
    import signal
    import subprocess
    import sys
    import textwrap

    out_file = tmp_path / "partial.json"
    script = textwrap.dedent(f"""
        import time, torch
        from llmu.bench import Entry, Provider, register, cli_main
        register(Entry(name="slow_test", module="99_test", description="sleeps",
                       providers={{"sleep": Provider(lambda x: time.sleep(0.05), "torch")}},
                       setup=lambda s, d, t: (None,), cpu_sizes=[{{"N": n}} for n in range(1, 200)]))
        raise SystemExit(cli_main(["slow_test", "--device", "cpu", "--repeats", "3",
                                   "--out", {str(out_file)!r}]))
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        for line in proc.stdout:  # wait for the first measured row
            if line.startswith("slow_test"):
                break
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert "(partial)" in rest
    data = bench.load(out_file)
    assert data["interrupted"] is True
    assert 1 <= len(data["rows"]) < 199 and data["rows"][0]["status"] == "ok"


def test_cli_strict_fails_on_modules_that_did_not_import(cli_entry, monkeypatch, capsys):
    monkeypatch.setitem(registry_mod.LOAD_ERRORS, "llmu._planted.bench", "ImportError: no gguf here")
    assert bench.cli_main(["--list"]) == 0  # without --strict: a warning only
    assert bench.cli_main(["--list", "--strict"]) == 1
    assert "strict: llmu._planted.bench did not import, its entries were not measured: ImportError: no gguf here" \
        in capsys.readouterr().err
    run = ["cli_scale_test", "--device", "cpu", "--repeats", "3"]
    assert bench.cli_main(run) == 0
    assert bench.cli_main([*run, "--strict"]) == 1
    assert "strict: llmu._planted.bench did not import" in capsys.readouterr().err


def test_cli_strict_fails_when_the_budget_left_sizes_unmeasured(cli_entry, capsys):
    args = ["cli_scale_test", "--device", "cpu", "--budget", "0"]
    assert bench.cli_main(args) == 0  # skipped rows are no failure...
    assert bench.cli_main([*args, "--strict"]) == 1  # ...but under --strict, unmeasured sizes are
    assert "strict: cli_scale_test: 1 size(s) not measured, the --budget ran out before them" in capsys.readouterr().err


def test_cli_strict_passes_skipped_rows(monkeypatch):
    entry = _entry(name="cli_skips_test", providers={"k": Provider(lambda x: x, "triton"),
                                                     "ext": Provider(_no_external, "external")},
                   cpu_sizes=[{"N": 8}])
    monkeypatch.setitem(registry_mod.REGISTRY, entry.name, entry)
    assert bench.cli_main(["cli_skips_test", "--device", "cpu", "--strict"]) == 0


def test_bench_modules_env_loads_more_modules(tmp_path, monkeypatch):
    import sys

    (tmp_path / "planted_bench_ok.py").write_text(
        "import torch\nfrom llmu.bench.registry import Entry, Provider, register\n"
        "register(Entry(name='planted_env_entry', module='99_test', description='x',\n"
        "               providers={'p': Provider(lambda x: x, 'torch')}, setup=lambda s, d, t: (None,)))\n")
    (tmp_path / "planted_bench_broken.py").write_text("import no_such_module_for_this_test\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("LLMU_BENCH_MODULES", "planted_bench_ok, planted_bench_broken planted_bench_missing")
    try:
        assert registry_mod.bench_modules()[-3:] == ["planted_bench_ok", "planted_bench_broken",
                                                     "planted_bench_missing"]
        registry = registry_mod.load_all(strict=False)
        assert "planted_env_entry" in registry
        assert "no_such_module_for_this_test" in registry_mod.LOAD_ERRORS["planted_bench_broken"]
        assert "planted_bench_missing" in registry_mod.LOAD_ERRORS  # named, so missing is an error
        with pytest.raises(ModuleNotFoundError, match="no_such_module_for_this_test"):
            registry_mod.load_all(strict=True)
    finally:
        registry_mod.REGISTRY.pop("planted_env_entry", None)
        for name in ("planted_bench_ok", "planted_bench_broken", "planted_bench_missing"):
            registry_mod.LOAD_ERRORS.pop(name, None)
            sys.modules.pop(name, None)


# ---------------------------------------------------------------------------------------------
# yours=: a learner's kernel beside llmu's
# ---------------------------------------------------------------------------------------------

def _kernel_entry(kernel=None):
    return _entry(providers={"llmu triton": Provider(kernel or (lambda x: x * 2), "triton", "llmu kernel"),
                             "ref": Provider(lambda x: x * 2, "torch", "llmu reference")})


def test_yours_is_skipped_on_cpu_with_the_interpreter_reason_and_never_called():
    mine = _Counter()
    entry = _kernel_entry()
    res = bench.run(entries=[entry], device="cpu", timer=_fake_timer(1.0), yours={"scale_test": mine})
    rows = [r for r in res["rows"] if r["provider"] == bench.YOURS]
    assert len(rows) == 2 and mine.calls == 0
    assert all(r["status"] == "skipped" and r["label"] == "your kernel" and r["kind"] == "triton" for r in rows)
    note = bench.untimed_note(res)
    assert note.startswith("not timed here (llmu kernel, your kernel): ") and "interpreter" in note
    assert list(entry.providers) == ["llmu triton", "ref"]  # the entry passed in is left as it was


def test_yours_is_timed_where_kernels_compile_once_its_output_matches(monkeypatch):
    from llmu.bench import runner

    monkeypatch.setattr(runner, "_kernels_timed_here", lambda device: True)  # as on a GPU
    mine = _Counter()
    res = bench.run(entries=[_kernel_entry()], device="cpu", timer=_fake_timer(2.0), yours={"scale_test": mine})
    rows = [r for r in res["rows"] if r["provider"] == bench.YOURS]
    assert [r["status"] for r in rows] == ["ok", "ok"] and rows[0]["ms"] == 2.0
    assert mine.calls == 2 * 2  # per size: once checked against llmu's kernel, once timed
    assert bench.untimed_note(res) == ""


@pytest.mark.parametrize(("mine", "says"), [
    (lambda x: x * 2 + 1, "4096 of 4096 values differ (largest difference 1)"),
    (lambda x: (x * 2)[:-1], "shape (4095,), llmu's kernel gives (4096,)"),
    (lambda x: None, "returned None"),
    (lambda x: (x * 2, x), "returned tuple of 2, llmu's kernel one Tensor"),
])
def test_a_wrong_kernel_of_yours_is_an_error_not_a_time(monkeypatch, mine, says):
    from llmu.bench import runner

    monkeypatch.setattr(runner, "_kernels_timed_here", lambda device: True)
    calls = []
    timer = _fake_timer(1.0)
    res = bench.run(entries=[_kernel_entry()], device="cpu", sizes=[{"N": 4096}],
                    timer=lambda fn: calls.append(fn) or timer(fn), yours={"scale_test": mine})
    (row,) = [r for r in res["rows"] if r["provider"] == bench.YOURS]
    assert row["status"] == "error" and row["ms"] is None
    assert row["reason"].startswith("wrong output, so not timed: against llmu kernel, "), row["reason"]
    assert says in row["reason"], row["reason"]
    assert len(calls) == 2  # llmu's kernel and the reference were timed, yours was not
    assert "failed (your kernel): wrong output" in bench.untimed_note(res)


def test_yours_within_the_tolerance_of_its_dtype_is_timed(monkeypatch):
    from llmu.bench import runner

    monkeypatch.setattr(runner, "_kernels_timed_here", lambda device: True)
    rtol, _ = bench.YOURS_TOLERANCE[torch.float32]
    res = bench.run(entries=[_kernel_entry()], device="cpu", sizes=[{"N": 4096}], timer=_fake_timer(1.0),
                    yours={"scale_test": lambda x: x * 2 * (1 + rtol / 2)})
    assert [r["status"] for r in res["rows"] if r["provider"] == bench.YOURS] == ["ok"]


def test_a_stub_of_yours_fails_its_row_only(monkeypatch):
    from llmu.bench import runner

    monkeypatch.setattr(runner, "_kernels_timed_here", lambda device: True)

    def stub(x):
        raise NotImplementedError()

    res = bench.run(entries=[_kernel_entry()], device="cpu", sizes=[{"N": 64}], timer=_fake_timer(1.0),
                    yours={"scale_test": stub})
    statuses = {r["provider"]: r["status"] for r in res["rows"]}
    assert statuses == {"llmu triton": "ok", "ref": "ok", bench.YOURS: "error"}


def test_bad_yours_arguments_are_named():
    entry = _kernel_entry()
    with pytest.raises(TypeError, match="yours must be a dict"):
        bench.run(entries=[entry], device="cpu", yours=[lambda x: x])
    with pytest.raises(ValueError, match=r"yours names 'other', which this run does not include; it runs scale_test"):
        bench.run(entries=[entry], device="cpu", yours={"other": lambda x: x})
    with pytest.raises(TypeError, match=r"yours\['scale_test'\] must be a function"):
        bench.run(entries=[entry], device="cpu", yours={"scale_test": 3})
    with pytest.raises(ValueError, match="has no Triton kernel of llmu's"):
        bench.run(entries=[_entry()], device="cpu", yours={"scale_test": lambda x: x})
    whole = Entry(name="whole", module="99_test", description="tokens/s", run=lambda size, device: [])
    with pytest.raises(ValueError, match="measures a whole model"):
        bench.run(entries=[whole], device="cpu", yours={"whole": lambda x: x})
    with pytest.raises(TypeError, match="results must be what llmu.bench.run returned"):
        bench.untimed_note([])
