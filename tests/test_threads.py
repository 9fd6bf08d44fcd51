"""llmu.runtime.configure_threads: torch gets no more CPU threads than the process may use.

The cgroup files are read from a folder given as an argument, so each test writes the files a
container would have (cgroup v2 ``cpu.max``, v1 ``cpu/cpu.cfs_quota_us``) into a temporary folder.
"""

from __future__ import annotations

import os

import pytest
import torch

from llmu import runtime


def _cgroup(tmp_path, files: dict[str, str | bytes], own: str | None = None):
    """A fake /sys/fs/cgroup with ``files`` in it, and a fake /proc/self/cgroup naming ``own``."""
    root = tmp_path / "cgroup"
    root.mkdir(parents=True)
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(text)
    proc = tmp_path / "proc_self_cgroup"
    if own is not None:
        proc.write_text(own)
    return root, proc


@pytest.mark.parametrize("text, cpus", [
    ("150000 100000\n", 2),  # 1.5 CPUs: rounded up
    ("200000 100000", 2),
    ("50000 100000", 1),     # half a CPU: at least one thread
    ("100000 100000", 1),
    ("400000 50000", 8),
])
def test_cgroup_v2_quota_in_whole_cpus_rounded_up(tmp_path, text, cpus):
    root, proc = _cgroup(tmp_path, {"cpu.max": text})
    quota = runtime.cgroup_cpu_quota(root, proc)
    assert quota.count == cpus
    assert "cpu.max" in quota.source and text.split()[0] in quota.source


def test_cgroup_v2_max_is_no_limit(tmp_path):
    root, proc = _cgroup(tmp_path, {"cpu.max": "max 100000\n"})
    assert runtime.cgroup_cpu_quota(root, proc) is None


def test_cgroup_v1_quota(tmp_path):
    root, proc = _cgroup(tmp_path, {"cpu/cpu.cfs_quota_us": "150000\n", "cpu/cpu.cfs_period_us": "100000\n"})
    quota = runtime.cgroup_cpu_quota(root, proc)
    assert quota.count == 2 and "cpu.cfs_quota_us 150000 per 100000" in quota.source


def test_cgroup_v1_minus_one_is_no_limit(tmp_path):
    root, proc = _cgroup(tmp_path, {"cpu,cpuacct/cpu.cfs_quota_us": "-1", "cpu,cpuacct/cpu.cfs_period_us": "100000"})
    assert runtime.cgroup_cpu_quota(root, proc) is None


def test_the_process_own_group_and_its_parents_count(tmp_path):
    # A systemd slice with a quota, the process in a group below it, no limit at the top.
    root, proc = _cgroup(tmp_path, {"cpu.max": "max 100000", "user.slice/cpu.max": "100000 100000",
                                    "user.slice/job/cpu.max": "300000 100000"}, own="0::/user.slice/job\n")
    quota = runtime.cgroup_cpu_quota(root, proc)
    assert quota.count == 1 and "user.slice/cpu.max" in quota.source
    # cgroup v1 names the controller on its line of /proc/self/cgroup.
    root2, proc2 = _cgroup(tmp_path / "v1", {"cpu/docker/abc/cpu.cfs_quota_us": "250000",
                                             "cpu/docker/abc/cpu.cfs_period_us": "100000"},
                           own="4:memory:/docker/abc\n2:cpu,cpuacct:/docker/abc\n")
    assert runtime.cgroup_cpu_quota(root2, proc2).count == 3


@pytest.mark.parametrize("files", [
    {},                                                    # no cgroup files at all (macOS, old kernels)
    {"cpu.max": "garbage"},
    {"cpu.max": "1 2 3"},
    {"cpu.max": ""},
    {"cpu.max": "0 100000"},
    {"cpu.max": "100000 0"},
    {"cpu.max": b"\xff\xfe\x00 100000"},                   # not text
    {"cpu/cpu.cfs_quota_us": "100000"},                    # the period is missing
    {"cpu/cpu.cfs_quota_us": "lots", "cpu/cpu.cfs_period_us": "100000"},
])
def test_missing_or_unreadable_files_mean_no_quota(tmp_path, files):
    root, proc = _cgroup(tmp_path, files, own="0::/../../etc\nnot a cgroup line\n")
    assert runtime.cgroup_cpu_quota(root, proc) is None


def test_a_folder_where_a_file_should_be_is_no_quota(tmp_path):
    root, proc = _cgroup(tmp_path, {"cpu.max/x": "1"})
    assert runtime.cgroup_cpu_quota(root, proc) is None


def test_available_cpus_is_the_affinity_lowered_to_the_quota(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    root, proc = _cgroup(tmp_path, {"cpu.max": "150000 100000"})
    cpus = runtime.available_cpus(root, proc)
    assert cpus.count == 2 and "cgroup CPU quota 1.5" in cpus.source and "of 16 CPUs" in cpus.source

    big, proc = _cgroup(tmp_path / "big", {"cpu.max": "3200000 100000"})  # 32 CPUs: the affinity is smaller
    assert runtime.available_cpus(big, proc) == runtime.CPUs(16, "CPU affinity")

    bad, proc = _cgroup(tmp_path / "bad", {"cpu.max": "nonsense"})
    assert runtime.available_cpus(bad, proc) == runtime.CPUs(16, "CPU affinity")


def test_available_cpus_without_affinity(tmp_path, monkeypatch):
    def unsupported(pid):
        raise AttributeError("not on this platform")

    monkeypatch.setattr(os, "sched_getaffinity", unsupported, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    root, proc = _cgroup(tmp_path, {})
    assert runtime.available_cpus(root, proc) == runtime.CPUs(1, "os.cpu_count()")


# ---------------------------------------------------------------------------------------------
# configure_threads: applied once, only lowers, and the user's environment variables win
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def fresh_threads(monkeypatch):
    """No earlier configure_threads in this process, no thread variables, torch's count restored after."""
    before = torch.get_num_threads()
    monkeypatch.setattr(runtime, "_THREADS", None)
    for var in runtime.THREAD_ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    yield monkeypatch
    torch.set_num_threads(before)


def test_configure_threads_lowers_torch_to_the_quota(tmp_path, fresh_threads):
    root, proc = _cgroup(tmp_path, {"cpu.max": "100000 100000"})
    torch.set_num_threads(2)  # what torch chose from the host's cores
    got = runtime.configure_threads(root, proc)
    assert torch.get_num_threads() == 1
    assert got.count == 1 and "cgroup CPU quota 1" in got.source and "torch had 2" in got.source


def test_configure_threads_never_raises_the_count(tmp_path, fresh_threads):
    root, proc = _cgroup(tmp_path, {"cpu.max": "400000 100000"})
    torch.set_num_threads(1)  # e.g. the user's torch.set_num_threads(1)
    got = runtime.configure_threads(root, proc)
    assert torch.get_num_threads() == 1 and got.count == 1 and "torch's setting" in got.source


@pytest.mark.parametrize("var", ["OMP_NUM_THREADS", "MKL_NUM_THREADS"])
def test_the_users_environment_variable_wins(tmp_path, fresh_threads, var):
    fresh_threads.setenv(var, "2")
    root, proc = _cgroup(tmp_path, {"cpu.max": "100000 100000"})
    torch.set_num_threads(2)
    got = runtime.configure_threads(root, proc)
    assert torch.get_num_threads() == 2, f"{var} is the user's choice and must not be overridden"
    assert got == runtime.CPUs(2, f"{var}=2 set by you")


def test_configure_threads_runs_once(tmp_path, fresh_threads):
    one, proc = _cgroup(tmp_path / "a", {"cpu.max": "100000 100000"})
    torch.set_num_threads(2)
    first = runtime.configure_threads(one, proc)
    torch.set_num_threads(2)  # the user changes it afterwards: later calls leave it alone
    other, proc2 = _cgroup(tmp_path / "b", {"cpu.max": "max 100000"})
    assert runtime.configure_threads(other, proc2) is first
    assert torch.get_num_threads() == 2


def test_load_model_configures_threads_first(monkeypatch):
    from llmu.models import load_model, loading

    order = []

    def build(*args, **kwargs):  # stands in for reading the model (cache or GGUF): nothing is loaded
        order.append("build")
        raise RuntimeError("stopped by the test")

    monkeypatch.setattr(runtime, "configure_threads", lambda *a, **k: order.append("threads"))
    monkeypatch.setattr(loading, "load_weights", build)
    with pytest.raises(RuntimeError, match="stopped by the test"):
        load_model(fresh=True)
    assert order == ["threads", "build"]


def test_chat_and_bench_configure_threads_before_model_work(monkeypatch, capsys):
    import llmu.bench
    import llmu.models
    from llmu import cli

    order = []
    monkeypatch.setattr(runtime, "configure_threads",
                        lambda *a, **k: order.append("threads") or runtime.CPUs(3, "a test"))
    monkeypatch.setattr(llmu.bench, "cli_main", lambda argv: order.append("bench") or 0)
    assert cli.main(["bench", "--list"]) == 0
    assert order == ["threads", "bench"]

    def load(*a, **k):
        order.append("load")
        raise RuntimeError("stopped by the test")

    order.clear()
    monkeypatch.setattr(llmu.models, "load_model", load)
    with pytest.raises(RuntimeError, match="stopped by the test"):
        cli.main(["chat"])
    assert order == ["threads", "load"]
    assert "3 torch threads (a test)" in capsys.readouterr().err
