"""The sandbox against correct, partial and hostile programs: every hostile case is contained."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import time
from pathlib import Path

import pytest

from rlvr.code_execution.sandbox import CodeTest, SandboxLimits, as_test_cases, outputs_match, run_python, run_tests
from support.waiting import wait_for

FAST = SandboxLimits(cpu_time_s=1, wall_time_s=2)
SECCOMP = platform.machine() in ("x86_64", "aarch64") and "Seccomp_filters:" in Path("/proc/self/status").read_text()
MODES = [pytest.param(True, id="namespaces"), pytest.param(False, id="fallback")]

DOUBLE = "print(2 * int(input()))"
TESTS = [("1", "2"), ("21\n", "42\n"), {"input": "-3", "output": "-6"}, CodeTest("0", "0")]


def test_correct_program_passes_every_test():
    report = run_tests(DOUBLE, TESTS, FAST)
    assert (report.passed, report.total, report.fraction_passed) == (4, 4, 1.0)
    assert set(report.outcomes) == {"passed"}


def test_partial_program_passes_half():
    code = "n = int(input())\nprint(2 * n if n > 0 else n)"  # wrong for negative n
    report = run_tests(code, [("1", "2"), ("5", "10"), ("-3", "-6"), ("-1", "-2")], FAST)
    assert report.fraction_passed == 0.5
    assert report.outcomes == ("passed", "passed", "wrong output", "wrong output")


def test_runtime_error_fails_that_test_only():
    report = run_tests("n = int(input())\nprint(10 // n)", [("2", "5"), ("0", "0")], FAST)
    assert report.outcomes[0] == "passed"
    assert "ZeroDivisionError" in report.outcomes[1]


@pytest.mark.parametrize("tests", [[], "1 2", [("only input",)], [{"input": "x"}], 5])
def test_malformed_tests_are_rejected(tests):
    with pytest.raises(ValueError):
        as_test_cases(tests)


def test_outputs_match_ignores_trailing_whitespace_only():
    assert outputs_match("1 2  \n3\n\n", "1 2\n3")
    assert not outputs_match("1  2", "1 2")
    assert not outputs_match("3\n1", "1\n3")


def test_isolation_layers_on_this_host():
    result = run_python("print('hi')", limits=FAST)
    assert result.ok and result.stdout == "hi\n"
    if os.geteuid() == 0:
        assert "uid" in result.isolation
    assert "netns" in result.isolation or "audit-hook" in result.isolation


def test_environment_is_scrubbed_and_other_packages_are_not_importable(monkeypatch):
    monkeypatch.setenv("GRADER_TOKEN", "s3cret")
    result = run_python("import os\nprint(sorted(os.environ))\nimport torch", limits=FAST)
    assert "GRADER_TOKEN" not in result.stdout
    assert "No module named 'torch'" in result.stderr


@pytest.mark.parametrize("use_namespaces", MODES)
def test_numpy_imports_and_other_installed_packages_do_not(use_namespaces):
    result = run_python("import numpy as np\nprint(np.arange(4).sum())\nimport torch", limits=FAST, use_namespaces=use_namespaces)
    assert result.stdout == "6\n" and "No module named 'torch'" in result.stderr


@pytest.mark.skipif(not SECCOMP, reason="no seccomp filters on this host: threads are refused with processes")
@pytest.mark.parametrize("use_namespaces", MODES)
def test_threads_run_and_new_processes_are_refused(use_namespaces):
    code = (
        "import os, threading\nfrom concurrent.futures import ThreadPoolExecutor\n"
        "with ThreadPoolExecutor(32) as pool:\n    print(sum(pool.map(lambda i: i, range(1000))))\n"
        "done = []\nthreads = [threading.Thread(target=done.append, args=(i,)) for i in range(40)]\n"
        "for t in threads:\n    t.start()\nfor t in threads:\n    t.join()\nprint(len(done))\nos.fork()"
    )
    result = run_python(code, limits=FAST, use_namespaces=use_namespaces)
    assert "seccomp" in result.isolation
    assert result.stdout == "499500\n40\n" and "PermissionError" in result.stderr
    too_many = run_python("import threading, time\nfor _ in range(80):\n    threading.Thread(target=time.sleep, args=(1,)).start()", limits=FAST)
    assert "can't start new thread" in too_many.stderr  # max_threads, 64


def test_lone_surrogate_prints_as_its_escape():
    result = run_python("print('\\ud800', 'é')", limits=FAST)
    assert result.ok and result.stdout == "\\ud800 é\n"


def test_default_memory_limit_holds_700_mb():
    result = run_python("block = bytearray(700 << 20)\nprint(len(block) >> 20)", limits=SandboxLimits(cpu_time_s=2, wall_time_s=4))
    assert result.ok and result.stdout == "700\n", result.stderr


def test_infinite_loop_is_stopped_by_the_cpu_limit():
    result = run_python("while True:\n    pass", limits=FAST)
    assert not result.ok
    assert result.failure in ("cpu-time limit", "wall-time limit")
    assert result.wall_time_s < FAST.wall_time_s + 1.5


def test_sleeping_program_is_killed_at_the_wall_time_limit():
    result = run_python("import time\nprint('started', flush=True)\ntime.sleep(60)", limits=FAST)
    assert result.timed_out and result.failure == "wall-time limit"
    assert result.stdout == "started\n"  # output so far is kept
    assert result.wall_time_s < FAST.wall_time_s + 1.5


def test_infinite_loop_costs_one_timeout_not_one_per_test():
    start = time.monotonic()
    report = run_tests("import time\ntime.sleep(60)", [("", "")] * 5, SandboxLimits(cpu_time_s=1, wall_time_s=1))
    assert report.passed == 0 and report.outcomes[1:] == ("not run (earlier timeout)",) * 4
    assert time.monotonic() - start < 4


def test_fork_bomb_is_contained_and_every_process_killed():
    limits = SandboxLimits(cpu_time_s=1, wall_time_s=2, max_processes=6)
    code = (
        "import os, time\n"
        "for _ in range(3):\n"  # children that leave the process group, then a fork bomb
        "    if os.fork() == 0:\n"
        "        os.setsid(); print(os.getpid(), flush=True); time.sleep(60)\n"
        "while True:\n"
        "    try:\n"
        "        os.fork()\n"
        "    except OSError:\n"
        "        pass\n"
    )
    result = run_python(code, limits=limits)
    assert not result.ok
    assert result.wall_time_s < limits.wall_time_s + 1.5
    escaped = [int(pid) for pid in result.stdout.split()]
    assert 1 <= len(escaped) <= 3
    if "uid" in result.isolation:
        for pid in escaped:  # the sandbox uid is shared by nothing else, so these pids were its own
            assert not _alive(pid), f"process {pid} outlived the sandbox"
    assert subprocess.run(["true"]).returncode == 0  # the host can still start processes


def test_no_child_processes_by_default():
    result = run_python("import os\nprint(os.system('echo hacked'))", limits=FAST)
    assert "hacked" not in result.stdout
    assert result.stdout.strip() != "0"


def test_memory_hog_is_stopped():
    result = run_python("chunks = []\nwhile True:\n    chunks.append(bytearray(50 << 20))", limits=SandboxLimits(cpu_time_s=2, wall_time_s=4, memory_mb=256))
    assert not result.ok and "MemoryError" in result.stderr


def test_huge_file_and_stdout_flood_are_cut_off():
    big_file = run_python("f = open('big', 'wb')\nwhile True:\n    f.write(b'x' * (1 << 20))", limits=FAST)
    assert not big_file.ok and big_file.failure in ("file-size limit", "OSError: [Errno 27] File too large")
    flood = run_python("while True:\n    print('x' * 10000)", limits=SandboxLimits(cpu_time_s=1, wall_time_s=2, max_output_chars=1000))
    assert not flood.ok and len(flood.stdout) == 1000


@pytest.mark.parametrize("use_namespaces", MODES)
def test_writes_outside_the_sandbox_fail(tmp_path, use_namespaces):
    target = tmp_path / "escaped.txt"
    code = f"open({str(target)!r}, 'w').write('x')\nprint('wrote')"
    result = run_python(code, limits=FAST, use_namespaces=use_namespaces)
    assert not target.exists()
    assert not result.ok and ("PermissionError" in result.stderr or "FileNotFoundError" in result.stderr)


@pytest.mark.parametrize("use_namespaces", MODES)
def test_os_system_cannot_touch_the_host(tmp_path, use_namespaces):
    target = tmp_path / "pwned"
    code = f"import os\nos.system('touch {target}')\nos.system('rm -rf {tmp_path}')"
    run_python(code, limits=SandboxLimits(cpu_time_s=1, wall_time_s=2, max_processes=4), use_namespaces=use_namespaces)
    assert tmp_path.is_dir() and not target.exists()


@pytest.mark.parametrize("use_namespaces", MODES)
def test_grader_files_are_unreadable(tmp_path, use_namespaces):
    secret = tmp_path / "expected_outputs.txt"
    secret.write_text("42\n")
    code = f"print(open({str(secret)!r}).read())"
    report = run_tests(code, [("", "42")], FAST)
    assert report.passed == 0
    result = run_python(code, limits=FAST, use_namespaces=use_namespaces)
    assert "42" not in result.stdout


@pytest.mark.parametrize("use_namespaces", MODES)
def test_no_network(use_namespaces):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(0.2)
        port = listener.getsockname()[1]
        code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')"
        result = run_python(code, limits=FAST, use_namespaces=use_namespaces)
        with pytest.raises(socket.timeout):
            listener.accept()
    assert not result.ok and "connected" not in result.stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="without root there is no other uid to run the program as")
def test_program_cannot_signal_the_grader():
    code = f"import os, signal\nos.kill(-1, signal.SIGKILL)\nos.kill({os.getpid()}, signal.SIGKILL)"
    result = run_python(code, limits=FAST)
    assert "PermissionError" in result.stderr  # and this test process is still alive to check it


def test_sandbox_directory_is_private_and_removed():
    result = run_python("import os\nopen('note', 'w').write('x')\nprint(os.getcwd())", limits=FAST)
    assert result.ok
    if "chroot" in result.isolation:
        assert result.stdout.strip() == "/sandbox"
    leftovers = run_python("import os\nprint(os.listdir('.'))", limits=FAST)
    assert leftovers.stdout.strip() == "[]"  # a fresh directory per run


def _running(pid: int) -> bool:
    """Whether ``pid`` runs now (not gone, not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"
    except FileNotFoundError:
        return False


def _alive(pid: int, grace_s: float = 2.0) -> bool:
    """Whether ``pid`` is still running after a grace period to finish dying."""
    try:
        wait_for(lambda: not _running(pid), grace_s, f"process {pid} to end")
        return False
    except AssertionError:
        return True
