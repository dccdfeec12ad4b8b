"""Symbolic checks in worker processes killed past a time limit: ``run_bounded(function, *args)``.

sympy can hold a process, and the GIL, for minutes on a short answer (``(x+y+z)^{200}``, a huge
power); math-verify's own timeouts use SIGALRM, which only the main thread may set and which cannot
interrupt a big-integer operation. So each calling process keeps up to ``MAX_WORKERS`` warm worker
processes (math-verify imported), reused call after call (far cheaper than a fork per call): a call
past ``timeout_s`` kills its worker, which is replaced at once, and raises :class:`SymbolicCheckAborted`.
Workers are plain subprocesses (not multiprocessing), so RewardPool workers and service threads may
call it; they stay in the caller's process group, so killing a RewardPool worker's group ends them too.
"""

from __future__ import annotations

import atexit
import math
import os
import pickle
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection

TIMEOUT_S = 3.0  # one comparison: math-verify's parse of both answers and its verify
START_TIMEOUT_S = 60.0  # a worker's start: Python, sympy and math-verify imported
MAX_WORKERS = 4  # per calling process; further concurrent callers wait for one to be free
MEMORY_LIMIT_BYTES = 2 * 2**30  # a worker's address space, or its caller's limit when lower


class SymbolicCheckAborted(RuntimeError):
    """The call ran past its time limit, or its worker process died (killed, out of memory)."""


def run_bounded(function, *args, timeout_s: float = TIMEOUT_S):
    """``function(*args)`` in a worker process: its value, or the exception it raised.

    ``function`` and the values travel by pickle (a module-level function goes by name). Raises
    :class:`SymbolicCheckAborted` past ``timeout_s`` (the worker is killed) or when the worker dies;
    waiting for a worker to start or to be free is not counted.
    """
    worker = _WORKERS.checkout()
    try:
        return worker.call(function, args, timeout_s)
    finally:
        _WORKERS.checkin(worker)


class _Worker:
    """One worker process and this process's end of its socket."""

    def __init__(self):
        self.process: subprocess.Popen | None = None
        self.connection: Connection | None = None
        self.ready = False

    def start(self) -> None:
        parent, child = socket.socketpair()
        command = f"from rlvr.rewards.sympy_worker import serve; serve({child.fileno()})"
        self.process = subprocess.Popen([sys.executable, "-c", command], pass_fds=[child.fileno()], stdin=subprocess.DEVNULL)
        child.close()
        self.connection = Connection(parent.detach())
        self.connection.send(list(sys.path))
        self.ready = False

    def call(self, function, args: tuple, timeout_s: float):
        if self.process is None:
            self.start()
        if not self.ready:
            if not self.connection.poll(START_TIMEOUT_S):
                self.stop()
                raise RuntimeError(f"the sympy worker process did not start within {START_TIMEOUT_S:g} s")
            try:
                self.connection.recv()
            except (EOFError, OSError):
                code = self.stop()
                raise RuntimeError(f"the sympy worker process exits at start-up (exit code {code}); see its stderr") from None
            self.ready = True
        try:
            self.connection.send((function, args, timeout_s))
            reply = self.connection.recv() if self.connection.poll(timeout_s) else None
        except (EOFError, OSError):
            code = self.restart()
            raise SymbolicCheckAborted(f"its worker process died (exit code {code})") from None
        if reply is None:
            self.restart()
            raise SymbolicCheckAborted(f"ran past {timeout_s:g} s; its worker process was killed")
        outcome, value = reply
        if outcome == "raised":
            raise value
        return value

    def restart(self) -> int | None:
        code = self.stop()
        self.start()
        return code

    def stop(self) -> int | None:
        """Kill the process (if any) and return its exit code."""
        if self.connection is not None:
            self.connection.close()
        code = None
        if self.process is not None:
            self.process.kill()
            code = self.process.wait()
        self.process, self.connection, self.ready = None, None, False
        return code


class _Workers:
    """This process's workers: an idle one is reused, else one is started, up to ``MAX_WORKERS``."""

    def __init__(self):
        self.forget()

    def forget(self) -> None:
        """Start afresh without touching the processes (in a forked child: they answer the parent)."""
        self.changed = threading.Condition()
        self.idle: list[_Worker] = []
        self.all: list[_Worker] = []

    def checkout(self) -> _Worker:
        with self.changed:
            while not self.idle and len(self.all) >= MAX_WORKERS:
                self.changed.wait()
            if self.idle:
                return self.idle.pop()
            self.all.append(_Worker())
            return self.all[-1]

    def checkin(self, worker: _Worker) -> None:
        with self.changed:
            if worker in self.all:
                self.idle.append(worker)
            self.changed.notify()

    def stop(self) -> None:
        with self.changed:
            for worker in self.all:
                worker.stop()
            self.forget()


_WORKERS = _Workers()
atexit.register(_WORKERS.stop)
os.register_at_fork(after_in_child=_WORKERS.forget)


def serve(fd: int) -> None:
    """A worker process: take the caller's ``sys.path``, import math-verify, say ready, then answer
    (function, args, timeout_s) with ("returned", value) or ("raised", exception) until the caller's end
    closes. The time limit, not Python's digit limit, bounds int/str conversions here."""
    import logging
    import resource
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the caller, which stops us
    sys.set_int_max_str_digits(0)
    connection = Connection(fd)
    sys.path[:] = connection.recv()
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = MEMORY_LIMIT_BYTES if soft == resource.RLIM_INFINITY else min(soft, MEMORY_LIMIT_BYTES)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    import math_verify  # noqa: F401 - loaded before the first call is timed

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its warnings are about its own timeouts, off here
    connection.send("ready")
    while True:
        try:
            message = connection.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            function, args, timeout_s = pickle.loads(message)
            _limit_cpu_time(timeout_s)
            reply = ("returned", function(*args))
        except Exception as err:  # noqa: BLE001 - the caller gets it
            reply = ("raised", err)
        connection.send(_sendable(reply))


def _limit_cpu_time(timeout_s: float) -> None:
    """SIGXCPU ends this process once the call has used ``timeout_s`` (+1) s of CPU: a backstop in case
    its caller died mid-call and cannot kill it (CPU time never outruns the caller's wall clock)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = math.ceil(usage.ru_utime + usage.ru_stime + timeout_s) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def _sendable(reply: tuple[str, object]) -> tuple[str, object]:
    """``reply``, or a RuntimeError naming what it held when that does not survive a pickle round trip."""
    try:
        pickle.loads(pickle.dumps(reply))
        return reply
    except Exception as err:  # noqa: BLE001 - any value or exception may fail to pickle
        described = f"{type(reply[1]).__name__}: {reply[1]}" if reply[0] == "raised" else f"a {type(reply[1]).__name__}"
        return ("raised", RuntimeError(f"the sympy worker cannot send back {described} ({type(err).__name__})"))
