"""rlvr.cpu_threads: cgroup quota parsing, affinity, the user's override, and a real busy process on one CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from rlvr import cpu_threads
from rlvr.cpu_threads import (
    CpuSample,
    ThreadPolicy,
    busy_elsewhere_between,
    cgroup_cpu_quota,
    parse_cfs_quota,
    parse_cpu_max,
    parse_proc_cgroup,
    parse_proc_stat,
    pick_threads,
    requested_threads,
    sample_cpu,
    threads_for,
    usable_cpus,
)
from support.waiting import wait_for

BUSY_LOOP = """import os, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])})
print("ready", flush=True)
end = time.monotonic() + 30
while time.monotonic() < end:
    pass
"""


@pytest.mark.parametrize(
    ("text", "cpus"),
    [
        *[("200000 100000\n", 2.0), ("150000 100000", 1.5), ("50000 100000", 0.5), ("max 100000\n", None), ("max", None)],
        *[("", None), ("abc 100000", None), ("0 100000", None), ("100000 0", None), ("1 2 3", None)],
    ],
)
def test_cpu_max_gives_the_quota_in_cpus_and_none_for_max_or_malformed(text, cpus):
    assert parse_cpu_max(text) == cpus


@pytest.mark.parametrize(
    ("quota", "period", "cpus"),
    [("300000\n", "100000\n", 3.0), ("-1\n", "100000\n", None), ("", "", None), ("50000", "abc", None), ("50000", "0", None)],
)
def test_cfs_files_give_the_quota_in_cpus_and_none_for_minus_one_or_malformed(quota, period, cpus):
    assert parse_cfs_quota(quota, period) == cpus


def test_proc_cgroup_names_the_unified_and_v1_cpu_paths():
    text = "12:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n1:name=systemd:/x\n0::/user.slice/job\nnot a line\n"
    assert parse_proc_cgroup(text) == ("/user.slice/job", "/docker/abc")
    assert parse_proc_cgroup("0::/\n") == ("/", None)


def test_the_smallest_quota_of_the_cgroup_and_its_ancestors_applies(tmp_path: Path):
    proc = tmp_path / "cgroup"
    proc.write_text("0::/outer/inner\n")
    (tmp_path / "outer" / "inner").mkdir(parents=True)
    (tmp_path / "cpu.max").write_text("max 100000\n")
    (tmp_path / "outer" / "cpu.max").write_text("150000 100000\n")
    (tmp_path / "outer" / "inner" / "cpu.max").write_text("400000 100000\n")
    assert cgroup_cpu_quota(tmp_path, proc) == 1.5
    (tmp_path / "outer" / "cpu.max").write_text("garbage")
    assert cgroup_cpu_quota(tmp_path, proc) == 4.0


def test_a_v1_quota_is_read_at_the_mount_root_when_the_host_path_is_not_mounted(tmp_path: Path):
    proc = tmp_path / "cgroup"
    proc.write_text("3:cpu,cpuacct:/docker/abc\n")  # a container without a cgroup namespace sees its own cgroup at the root
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("200000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_quota(tmp_path, proc) == 2.0
    assert cgroup_cpu_quota(tmp_path / "missing", tmp_path / "missing") is None


def test_usable_cpus_follow_the_affinity_mask_and_the_quota(monkeypatch):
    cpus = os.sched_getaffinity(0)
    monkeypatch.setattr(cpu_threads, "cgroup_cpu_quota", lambda: None)
    assert usable_cpus() == len(cpus)
    try:
        os.sched_setaffinity(0, {min(cpus)})
        assert usable_cpus() == 1
    finally:
        os.sched_setaffinity(0, cpus)
    monkeypatch.setattr(cpu_threads, "cgroup_cpu_quota", lambda: 0.5)
    assert usable_cpus() == 1  # a quota under one CPU still leaves one thread
    monkeypatch.setattr(cpu_threads, "cgroup_cpu_quota", lambda: len(cpus) + 0.9)
    assert usable_cpus() == len(cpus)


def test_proc_stat_counts_non_idle_ticks_per_cpu():
    text = "cpu  9 9 9 9 9 9 9 9 0 0\ncpu0 10 1 5 100 7 2 3 4 0 0\ncpu1 1 0 0 50 0 0 0 0\nintr 5\n"
    assert parse_proc_stat(text) == {0: 10 + 1 + 5 + 2 + 3 + 4, 1: 1}


def test_busy_elsewhere_is_the_cpus_busy_time_less_this_process_own():
    cpus = frozenset({0, 1})
    before = CpuSample(cpus, at_s=10.0, busy_s=100.0, own_s=5.0)
    assert busy_elsewhere_between(before, CpuSample(cpus, 12.0, 103.0, 6.0)) == 1.0
    assert busy_elsewhere_between(before, CpuSample(cpus, 12.0, 101.0, 7.0)) == 0.0  # own time over busy time: none elsewhere
    assert busy_elsewhere_between(before, CpuSample(cpus, 12.0, 110.0, 5.0)) == 2.0  # at most every CPU
    assert busy_elsewhere_between(before, CpuSample(frozenset({0}), 12.0, 103.0, 5.0)) == 0.0  # other CPUs: not comparable


@pytest.mark.parametrize(
    ("usable", "affinity", "busy", "threads"),
    [(4, 4, 0.0, 4), (4, 4, 0.5, 4), (4, 4, 0.6, 3), (4, 4, 1.4, 3), (4, 4, 2.7, 1), (4, 4, 4.0, 1), (2, 8, 5.0, 2), (2, 8, 7.0, 1)],
)
def test_a_cpu_more_than_half_busy_counts_as_taken(usable, affinity, busy, threads):
    assert threads_for(usable, affinity, busy) == threads


def test_the_user_choice_wins_and_rlvr_threads_before_omp():
    assert requested_threads({}) is None
    assert requested_threads({"OMP_NUM_THREADS": "3"}) == 3
    assert requested_threads({"OMP_NUM_THREADS": "2,1"}) == 2  # nested levels: the first is torch's
    assert requested_threads({"OMP_NUM_THREADS": "3", "RLVR_THREADS": "5"}) == 5
    assert requested_threads({"OMP_NUM_THREADS": "3", "RLVR_THREADS": "auto"}) is None
    assert requested_threads({"OMP_NUM_THREADS": " ", "RLVR_THREADS": ""}) is None


@pytest.mark.parametrize(("name", "value"), [("RLVR_THREADS", "0"), ("RLVR_THREADS", "many"), ("OMP_NUM_THREADS", "-1"), ("OMP_NUM_THREADS", "auto")])
def test_a_bad_thread_count_names_its_variable(name, value):
    with pytest.raises(ValueError, match=rf"\${name} must be a positive integer.*{value}"):
        requested_threads({name: value})


def test_pick_threads_honours_the_environment_without_measuring(monkeypatch):
    monkeypatch.setenv("RLVR_THREADS", "7")
    monkeypatch.setattr(cpu_threads, "cpus_busy_elsewhere", lambda interval_s: pytest.fail("measured despite $RLVR_THREADS"))
    assert pick_threads() == 7


@pytest.fixture
def torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_policy_sets_torch_threads_and_refreshes_when_the_load_changes(monkeypatch, torch_threads):
    monkeypatch.delenv("RLVR_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_threads, "usable_cpus", lambda: 4)
    monkeypatch.setattr(cpu_threads, "affinity_cpus", lambda: {0, 1, 2, 3})
    busy = iter([0.0, 2.0, 2.0, 0.2])
    monkeypatch.setattr(cpu_threads, "busy_elsewhere_between", lambda before, after: next(busy))
    policy = ThreadPolicy(refresh_s=0.0, interval_s=0.01)
    assert policy.apply() == 4 and torch.get_num_threads() == 4
    assert policy.maybe_refresh() == 2 and torch.get_num_threads() == 2
    assert policy.maybe_refresh() is None  # unchanged
    assert policy.maybe_refresh() == 4 and torch.get_num_threads() == 4
    assert ThreadPolicy(refresh_s=3600.0, interval_s=0.01).maybe_refresh() is None  # not applied yet


def test_refresh_waits_for_its_period_and_does_not_block(monkeypatch, torch_threads):
    monkeypatch.delenv("RLVR_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    policy = ThreadPolicy(refresh_s=3600.0, interval_s=1.0)
    policy.apply()
    assert policy.maybe_refresh() is None
    policy.refresh_s = 0.0
    started = time.perf_counter()
    policy.maybe_refresh()
    assert time.perf_counter() - started < 0.5  # measures from the last sample, not over another interval_s


def test_policy_keeps_the_users_choice(monkeypatch, torch_threads):
    monkeypatch.setenv("RLVR_THREADS", "3")
    policy = ThreadPolicy(refresh_s=0.0)
    assert policy.apply() == 3 and torch.get_num_threads() == 3
    assert policy.maybe_refresh() is None


def test_a_users_count_past_the_free_cpus_is_kept_and_warned_about_once(monkeypatch, torch_threads, caplog):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.delenv("RLVR_THREADS", raising=False)
    monkeypatch.setattr(cpu_threads, "usable_cpus", lambda: 2)
    monkeypatch.setattr(cpu_threads, "affinity_cpus", lambda: {0, 1})
    busy = iter([0.0, 1.0, 1.0])
    monkeypatch.setattr(cpu_threads, "busy_elsewhere_between", lambda before, after: next(busy))
    policy = ThreadPolicy(refresh_s=0.0)
    with caplog.at_level("WARNING", logger=cpu_threads.__name__):
        assert policy.apply() == 2
        assert policy.maybe_refresh() is None and not caplog.records  # both CPUs free
        for _ in range(2):  # another job takes a CPU: the count stays, one warning
            assert policy.maybe_refresh() is None and torch.get_num_threads() == 2
    assert [r.getMessage() for r in caplog.records] == [
        "torch runs 2 threads as $RLVR_THREADS or $OMP_NUM_THREADS asks, but other processes keep CPUs busy: 1 fit. "
        "OpenMP threads that share a busy CPU slow every step several-fold; unset the variable or set RLVR_THREADS=auto"
    ]


def cpu_time_s(pid: int) -> float:
    """utime + stime of a process, from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.fixture
def busy_cpu():
    """A child process busy-looping on one CPU of this process's affinity (for at most 30 s); yields that CPU."""
    if usable_cpus() < 2:
        pytest.skip("needs 2 usable CPUs: with one, a busy CPU elsewhere leaves nothing to compare")
    cpu = max(os.sched_getaffinity(0))
    child = subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(cpu)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        started = cpu_time_s(child.pid)
        wait_for(lambda: cpu_time_s(child.pid) - started >= 0.05, 10.0, "the child to spin", interval_s=0.01)
        yield cpu
    finally:
        child.kill()
        child.wait()


def test_a_process_spinning_on_one_cpu_is_about_one_cpu_busy_elsewhere(busy_cpu, monkeypatch):
    monkeypatch.delenv("RLVR_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = sample_cpu({busy_cpu})
    time.sleep(0.3)  # the window the CPU shares are measured over
    assert 0.8 <= busy_elsewhere_between(before, sample_cpu({busy_cpu})) <= 1.0
    assert cpu_threads.cpus_busy_elsewhere(0.3) >= 0.8
    assert pick_threads(0.3) < usable_cpus()  # with nothing else running it would be usable_cpus()


def test_this_process_own_spinning_is_not_busy_elsewhere():
    cpus = os.sched_getaffinity(0)
    cpu, done = max(cpus), threading.Event()

    def spin() -> None:
        os.sched_setaffinity(threading.get_native_id(), {cpu})  # pins this thread only
        while not done.is_set():
            pass

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        before = sample_cpu({cpu})
        time.sleep(0.3)  # the window the CPU shares are measured over
        after = sample_cpu({cpu})
    finally:
        done.set()
        spinner.join()
    own_share = (after.own_s - before.own_s) / (after.at_s - before.at_s)
    assert own_share >= 0.2  # it spun (other jobs on a shared host take the rest of the CPU)
    assert busy_elsewhere_between(before, after) + own_share <= 1.1  # the CPU is busy once: its share is not counted elsewhere
