"""Run a function's tests (HumanEval's ``check(candidate)``) in two sandboxes: the verdict never comes from the candidate's process.

The candidate process runs the untrusted program and answers calls of its entry point; the tests process runs
the trusted prompt and tests, ``candidate`` there a stand-in that forwards each call over a pipe, values
crossing as data the tests' side rebuilds (:mod:`rlvr.code_execution.function_tests_child`). Only the tests process holds the verdict pipe and
the run's nonce (sent on its stdin): a run passes only when it wrote ``{"nonce": <nonce>, "verdict": "passed"}``
after ``check`` returned and then exited 0. What the program prints, or its exit status, counts for nothing.
Both processes have every layer of :mod:`rlvr.code_execution.sandbox`; the limits bound each, the wall time the whole run.
"""

from __future__ import annotations

import ast
import json
import os
import secrets
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from rlvr.code_execution.function_tests_child import EXITED, PASSED
from rlvr.code_execution.sandbox import SandboxLimits, SandboxProcess, SandboxResult, package_imports

MAX_PROGRAM_CHARS = 1 << 18
_CHILD_SOURCE = (Path(__file__).parent / "function_tests_child.py").read_text(encoding="utf-8")
_EXIT_GRACE_S = 0.5  # how long a candidate may take to exit by itself once the tests closed its pipe


@dataclass(frozen=True)
class FunctionTestReport:
    """Whether a program passed its tests and, if not, why (``reason``, a few words)."""

    passed: bool
    reason: str
    calls: int  # calls of the entry point the tests made
    wall_time_s: float
    isolation: tuple[str, ...]  # the candidate process's layers (``SandboxResult.isolation``)


def run_function_tests(
    program: str, test: str, entry_point: str, prompt: str = "", limits: SandboxLimits | None = None, use_namespaces: bool = True
) -> FunctionTestReport:
    """Whether ``check(<entry_point>)`` of ``test`` returns for the function ``program`` defines.

    ``prompt`` is trusted code run before the tests in their namespace (HumanEval's helpers such as
    ``poly``); a name the tests use for the entry point itself is the candidate.
    """
    limits = limits or SandboxLimits()
    start = time.monotonic()
    if len(program) > MAX_PROGRAM_CHARS:
        return FunctionTestReport(False, f"refused: a program of {len(program)} characters (limit {MAX_PROGRAM_CHARS})", 0, 0.0, ())
    try:
        compile(program, "<candidate>", "exec", dont_inherit=True)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as error:
        return FunctionTestReport(False, f"syntax error: {type(error).__name__}: {str(error)[:200]}", 0, time.monotonic() - start, ())
    preload = ("__future__", "hashlib", *trusted_imports(prompt + "\n" + test), *package_imports(program))  # for the fallback's uid drop
    nonce = secrets.token_hex(16)
    request_read, request_write = os.pipe()
    response_read, response_write = os.pipe()
    verdict_read, verdict_write = os.pipe()
    candidate = tests = None
    try:
        candidate = SandboxProcess(
            _child_code("serve_candidate", request_read, response_write),
            json.dumps({"program": program, "entry_point": entry_point}),
            limits,
            use_namespaces,
            pass_fds=(request_read, response_write),
            preload=preload,
        )
        tests = SandboxProcess(
            _child_code("run_tests", response_read, request_write, verdict_write),
            json.dumps({"nonce": nonce, "prompt": prompt, "test": test, "entry_point": entry_point}),
            limits,
            use_namespaces,
            pass_fds=(response_read, request_write, verdict_write),
            preload=preload,
        )
        for fd in (request_read, request_write, response_read, response_write, verdict_write):
            os.close(fd)  # the children hold them now: each pipe reads as closed once its writer ends
        request_read = request_write = response_read = response_write = verdict_write = -1
        tests.wait(max(limits.wall_time_s - (time.monotonic() - start), 0.0))
        tests_result = tests.finish()
        candidate.wait(min(_EXIT_GRACE_S, max(limits.wall_time_s - (time.monotonic() - start), 0.01)))
        candidate_result = candidate.finish()
        record = _read_all(verdict_read)
    finally:  # also on an error on the way (finish is idempotent)
        for process in (tests, candidate):
            if process is not None:
                process.finish()
        for fd in (request_read, request_write, response_read, response_write, verdict_read, verdict_write):
            if fd >= 0:
                os.close(fd)
    passed, reason, calls = read_verdict(record, nonce, tests_result, candidate_result)
    return FunctionTestReport(passed, reason, calls, time.monotonic() - start, candidate_result.isolation)


def trusted_imports(source: str) -> tuple[str, ...]:
    """Top-level modules the (trusted) ``source`` imports."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return ()
    names = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    names += [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module and not node.level]
    return tuple(dict.fromkeys(name.split(".")[0] for name in names))


def read_verdict(record: bytes, nonce: str, tests: SandboxResult, candidate: SandboxResult) -> tuple[bool, str, int]:
    """(passed, reason, calls) from the tests process's record: passed only for the exact passing record."""
    try:
        verdict = json.loads(record)
        valid = type(verdict) is dict and verdict.get("nonce") == nonce and verdict.get("verdict") in ("passed", "failed")
    except ValueError:
        valid = False
    if not valid:
        if tests.timed_out:
            return False, "timed out", 0
        return False, f"the tests process ended without a verdict ({tests.failure or 'no record'})", 0
    calls = verdict.get("calls") if type(verdict.get("calls")) is int else 0
    if verdict["verdict"] == "passed":
        if tests.returncode == 0 and not tests.timed_out:
            return True, PASSED, calls
        return False, f"the tests process failed after its verdict ({tests.failure})", calls
    reason = str(verdict.get("reason", "failed"))
    if reason == EXITED and not candidate.timed_out:  # it ended by itself: say how
        if candidate.returncode == -signal.SIGXCPU:
            return False, "timed out (cpu-time limit)", calls
        reason = f"{EXITED} ({candidate.failure or 'exit status 0'})"
    return False, reason, calls


def _read_all(fd: int, max_bytes: int = 1 << 16) -> bytes:
    chunks, size = [], 0
    while size < max_bytes and (chunk := os.read(fd, max_bytes - size)):
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _child_code(role: str, *fds: int) -> str:
    return f"{_CHILD_SOURCE}\n{role}({', '.join(map(str, fds))})\n"
