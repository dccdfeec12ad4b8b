"""Score completions in worker processes that can be killed, so no verifier can stall its caller.

Rewards run arbitrary code over model-written text (sympy on ``9^{9^{9}}``, a backtracking regular
expression), which in a thread holds the GIL and cannot be stopped. Here each (sample, reward) job runs
in one of ``workers`` subprocesses; a job past ``timeout_s``, or whose worker dies, scores 0 with an
error and its worker is killed and replaced. The caller never waits longer than one timeout per job in
flight. Rewards reach the workers through cloudpickle (docs/architecture.md, "Rewards and the sandbox").
"""

from __future__ import annotations

import hashlib
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection, wait
from typing import Mapping, Sequence

from rlvr.rewards.composite import CompositeReward
from rlvr.rewards.registry import TOTAL, RewardResult, pickled_reward

PRELOAD = ("rlvr.rewards", "math_verify")  # imported by a worker before it reports ready
START_TIMEOUT_S = 60.0


class RewardPool:
    """Context manager scoring batches: ``pool.score_batch(weights, completions, references)``.

    Safe to share between threads: each batch takes the idle workers it can use and gives them back.
    """

    def __init__(self, workers: int = 2, timeout_s: float = 30.0, memory_limit_bytes: int | None = 4 * 2**30):
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
            raise ValueError(f"workers must be a positive int, got {workers!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        if memory_limit_bytes is not None and memory_limit_bytes < 2**28:
            raise ValueError(f"memory_limit_bytes must be None or at least 256 MiB, got {memory_limit_bytes!r}")
        self.workers, self.timeout_s, self.memory_limit_bytes = workers, timeout_s, memory_limit_bytes
        self.killed = 0  # jobs whose worker was killed at the timeout
        self._idle = [_Worker(memory_limit_bytes) for _ in range(workers)]  # processes start on first use
        self._all = list(self._idle)
        self._changed = threading.Condition()
        self._closed = False

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Stop every worker process."""
        with self._changed:
            self._closed = True
            for worker in self._all:
                worker.stop()
            self._changed.notify_all()

    def score_batch(self, reward_weights: Mapping[str, float], completions: Sequence[str], references: Sequence[Mapping]) -> list[dict[str, RewardResult]]:
        """One dict per completion, in input order: each reward's result plus ``"total"``, their weighted mean."""
        if self._closed:
            raise RuntimeError("RewardPool is closed")
        if len(completions) != len(references):
            raise ValueError(f"{len(completions)} completions but {len(references)} references")
        composite = CompositeReward(reward_weights)
        if not completions:
            return []
        rewards = {name: _shipped(name) for name in composite.weights}
        jobs = [(i, name) for i in range(len(completions)) for name in composite.weights]
        workers = self._checkout(len(jobs))
        try:
            results = self._run_jobs(jobs, workers, rewards, completions, references)
        finally:
            self._checkin(workers)
        batch = []
        for i in range(len(completions)):
            components = {name: results[(i, name)] for name in composite.weights}
            batch.append({**components, TOTAL: composite.combine(components)})
        return batch

    def reward_fn(self, reward_weights: Mapping[str, float]):
        """The trainer's reward callback: ``(completions, problems) -> (totals, {name: values})``."""
        CompositeReward(reward_weights)  # validate names and weights now, not at the first step

        def rewards(completions: Sequence[str], problems: Sequence[Mapping]) -> tuple[list[float], dict[str, list[float]]]:
            batch = self.score_batch(reward_weights, completions, problems)
            return [b[TOTAL].value for b in batch], {name: [b[name].value for b in batch] for name in reward_weights}

        return rewards

    def reward_fn_by_task(self, weights_by_task: Mapping[str, Mapping[str, float]]):
        """The trainer's reward callback for a task mixture: each completion scored by its problem's
        ``task``'s weights; a reward another task has but this one lacks is NaN in that row."""
        for weights in weights_by_task.values():
            CompositeReward(weights)
        names = list(dict.fromkeys(name for weights in weights_by_task.values() for name in weights))

        def rewards(completions: Sequence[str], problems: Sequence[Mapping]) -> tuple[list[float], dict[str, list[float]]]:
            unknown = {problem["task"] for problem in problems} - set(weights_by_task)
            if unknown:
                raise ValueError(f"completions of task(s) {sorted(unknown)} have no reward weights")
            totals, per_reward = [0.0] * len(completions), {name: [math.nan] * len(completions) for name in names}
            for task, weights in weights_by_task.items():
                rows = [i for i, problem in enumerate(problems) if problem["task"] == task]
                for i, scored in zip(rows, self.score_batch(weights, [completions[i] for i in rows], [problems[i] for i in rows])):
                    totals[i] = scored[TOTAL].value
                    for name in weights:
                        per_reward[name][i] = scored[name].value
            return totals, per_reward

        return rewards

    # --- scheduling ------------------------------------------------------------------------------

    def _run_jobs(self, jobs, workers, rewards, completions, references) -> dict[tuple[int, str], RewardResult]:
        pending, results = list(reversed(jobs)), {}
        while len(results) < len(jobs):
            for worker in workers:
                if worker.process is None:
                    worker.start()
                if worker.ready and worker.job is None and pending:
                    i, name = job = pending.pop()
                    if not worker.submit(job, rewards[name], completions[i], references[i]):
                        results[job] = _error(f"reward {name!r} could not reach its worker on sample {i}")
            waiting = {worker.connection: worker for worker in workers if worker.job is not None or not worker.ready}
            if not waiting:
                continue
            deadline = min(worker.deadline(self.timeout_s) for worker in waiting.values())
            for connection in wait(list(waiting), timeout=max(deadline - time.monotonic(), 0.0)):
                worker = waiting.pop(connection)
                if (done := worker.receive()) is not None:
                    results[done[0]] = done[1]
                elif worker.job is not None:
                    waiting[connection] = worker  # loaded its reward: the job's clock starts now
            now = time.monotonic()
            for worker in waiting.values():
                if now < worker.deadline(self.timeout_s):
                    continue
                if worker.job is None:
                    raise RuntimeError(f"a reward worker process did not start within {START_TIMEOUT_S:g} s")
                (i, name), loading, _ = worker.job, worker.loading, worker.kill()
                self.killed += 1
                limit = f"could not be loaded within {START_TIMEOUT_S:g} s" if loading else f"timed out after {self.timeout_s:g} s"
                results[(i, name)] = _error(f"reward {name!r} {limit} on sample {i}; its worker process was killed")
        return results

    def _checkout(self, wanted: int) -> list["_Worker"]:
        with self._changed:
            while not self._idle and not self._closed:
                self._changed.wait()
            if self._closed:
                raise RuntimeError("RewardPool is closed")
            taken, self._idle = self._idle[:wanted], self._idle[wanted:]
            return taken

    def _checkin(self, workers: list["_Worker"]) -> None:
        with self._changed:
            self._idle.extend(workers)
            self._changed.notify_all()


class _Worker:
    """One worker process and the parent's end of its socket: started, then ready, then one job at a time."""

    def __init__(self, memory_limit_bytes: int | None):
        self.memory_limit_bytes = memory_limit_bytes
        self.process: subprocess.Popen | None = None
        self.connection: Connection | None = None
        self.ready = self.loading = False  # loading: unpickling a reward new to it (importing its module)
        self.failed_starts = 0
        self.known: set[str] = set()  # rewards this process has unpickled
        self.job: tuple[int, str] | None = None
        self.started = 0.0  # when the job (or, before ready, the process) started

    def start(self) -> None:
        parent, child = socket.socketpair()
        command = f"from rlvr.rewards.pool import serve; serve({child.fileno()})"
        self.process = subprocess.Popen([sys.executable, "-c", command], pass_fds=[child.fileno()], stdin=subprocess.DEVNULL, start_new_session=True)
        child.close()
        self.connection = Connection(parent.detach())
        self.connection.send((list(sys.path), self.memory_limit_bytes))
        self.ready, self.known, self.job, self.started = False, set(), None, time.monotonic()

    def deadline(self, timeout_s: float) -> float:
        return self.started + (timeout_s if self.ready and not self.loading else START_TIMEOUT_S)

    def submit(self, job: tuple[int, str], reward: tuple[str, bytes], completion: str, reference: Mapping) -> bool:
        key, payload = reward
        try:
            self.connection.send((key, None if key in self.known else payload, completion, dict(reference), job[0]))
        except (OSError, ValueError):
            self.kill()
            return False
        self.loading = key not in self.known
        self.known.add(key)
        self.job, self.started = job, time.monotonic()
        return True

    def receive(self) -> tuple[tuple[int, str], RewardResult] | None:
        """(job, result) when a job ends; None for the start-up and reward-loaded messages. A dead
        worker is replaced."""
        try:
            message = self.connection.recv()
        except (EOFError, OSError):
            job, code = self.job, self._exit_code()
            self.kill()
            if job is None:
                self.failed_starts += 1
                if self.failed_starts >= 3:
                    raise RuntimeError(f"a reward worker process exits at start-up (exit code {code}); see its stderr") from None
                return None
            return job, _error(f"reward {job[1]!r} crashed its worker process on sample {job[0]} (exit code {code})")
        if not self.ready:
            self.ready, self.failed_starts = True, 0
            return None
        if message == "loaded":
            self.loading, self.started = False, time.monotonic()
            return None
        job, self.job = self.job, None
        return job, message

    def _exit_code(self) -> int | None:
        """The exit code of a worker whose end of the socket closed (it may take a moment to exit)."""
        try:
            return self.process.wait(timeout=2)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        """Kill the worker and everything it started (its own process group), and start a fresh one."""
        self.stop()
        self.start()

    def stop(self) -> None:
        if self.connection is not None:
            self.connection.close()
        if self.process is not None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.process.wait()
        self.process, self.connection, self.ready, self.loading, self.job = None, None, False, False, None


def _shipped(name: str) -> tuple[str, bytes]:
    """The reward ``name`` pickled for the workers, keyed by its content (a re-registered name ships anew)."""
    payload = pickled_reward(name)
    return f"{name}:{hashlib.sha256(payload).hexdigest()[:16]}", payload


def _error(message: str) -> RewardResult:
    return RewardResult(0.0, {"error": message})


def serve(fd: int) -> None:
    """A worker process: take the caller's ``sys.path`` and memory limit, preload, say ready, then
    answer (reward key, pickled reward or None, completion, reference, sample) with a RewardResult
    until the caller's end closes."""
    import importlib
    import pickle
    import resource

    from rlvr.rewards.registry import load_pickled_reward

    connection = Connection(fd)
    sys.path[:], memory_limit_bytes = connection.recv()
    if memory_limit_bytes is not None:
        resource.setrlimit(resource.RLIMIT_AS, (memory_limit_bytes, memory_limit_bytes))
    for module in PRELOAD:
        importlib.import_module(module)
    connection.send("ready")
    rewards = {}
    while True:
        try:
            key, payload, completion, reference, sample = connection.recv()
        except (EOFError, OSError):
            return
        name = key.split(":")[0]
        try:
            if payload is not None:
                rewards[key] = load_pickled_reward(payload)
                connection.send("loaded")
            result = rewards[key].score(completion, sample=sample, **reference)
        except BaseException as err:  # noqa: BLE001 - nothing a reward does may end the loop
            result = _error(f"reward {name!r} failed on sample {sample}: {type(err).__name__}: {err}")
        try:
            connection.send(result)
        except (pickle.PicklingError, TypeError, AttributeError) as err:
            connection.send(_error(f"reward {name!r} returned details that cannot be sent back: {err}"))
