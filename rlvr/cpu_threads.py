"""How many threads torch should use on CPU: the CPUs this process may run on, less those others keep busy.

PyTorch's OpenMP threads spin while they wait, so two torch processes that each take every core of
a shared host slow each other several-fold. :func:`pick_threads` counts the CPUs in this process's
affinity mask, caps them by the cgroup CPU quota, and leaves out the CPUs other processes kept busy
over a short interval (``/proc/stat`` less this process's own CPU time). A user's choice wins:
``$RLVR_THREADS`` (this project's; ``auto`` measures even when ``$OMP_NUM_THREADS`` is set), else
``$OMP_NUM_THREADS``. :class:`ThreadPolicy` applies the pick to torch and re-measures at most every
``refresh_s`` seconds, from the CPU time between its calls, so a server adapts to other jobs (and warns
once where a user's count takes CPUs others keep busy).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_STAT = Path("/proc/stat")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
MEASURE_INTERVAL_S = 0.1
REFRESH_S = 10.0


def parse_cpu_max(text: str) -> float | None:
    """CPUs allowed by a cgroup v2 ``cpu.max`` ("quota period"); None for "max" (no cap) or text that is not a quota."""
    fields = text.split()
    if len(fields) != 2 or fields[0] == "max":
        return None
    return _quota_cpus(fields[0], fields[1])


def parse_cfs_quota(quota_text: str, period_text: str) -> float | None:
    """CPUs allowed by cgroup v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``; None for -1 (no cap) or malformed text."""
    return _quota_cpus(quota_text.strip(), period_text.strip())


def _quota_cpus(quota: str, period: str) -> float | None:
    try:
        quota_us, period_us = int(quota), int(period)
    except ValueError:
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def parse_proc_cgroup(text: str) -> tuple[str | None, str | None]:
    """This process's cgroup paths from ``/proc/self/cgroup``: (v2 unified path, v1 ``cpu`` controller path)."""
    unified = cpu = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            unified = path
        elif "cpu" in controllers.split(","):
            cpu = path
    return unified, cpu


def _with_ancestors(base: Path, path: str | None) -> list[Path]:
    """``base/path`` and each of its parents up to ``base``: a quota set on any of them applies."""
    parts = [p for p in (path or "").split("/") if p]
    return [base.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def cgroup_cpu_quota(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_SELF_CGROUP) -> float | None:
    """The smallest CPU quota on this process's cgroup or its ancestors (v2 ``cpu.max``, v1 CFS files); None if none."""
    try:
        unified, cpu = parse_proc_cgroup(proc_cgroup.read_text())
    except OSError:
        unified = cpu = None
    quotas = []
    for folder in _with_ancestors(root, unified):
        quotas.append(parse_cpu_max(_read(folder / "cpu.max")))
    for mount in (root / "cpu", root / "cpu,cpuacct"):
        for folder in _with_ancestors(mount, cpu):
            quotas.append(parse_cfs_quota(_read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")))
    found = [q for q in quotas if q is not None]
    return min(found) if found else None


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def affinity_cpus() -> set[int]:
    """The CPUs the scheduler may run this process on."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def usable_cpus() -> int:
    """CPUs this process may use: its affinity mask, capped by the cgroup quota (rounded down), at least 1."""
    cpus = len(affinity_cpus())
    quota = cgroup_cpu_quota()
    if quota is not None:
        cpus = min(cpus, math.floor(quota))
    return max(1, cpus)


@dataclass(frozen=True)
class CpuSample:
    """Busy time of some CPUs and this process's own CPU time, at one moment."""

    cpus: frozenset[int]
    at_s: float  # time.monotonic()
    busy_s: float  # non-idle time of ``cpus`` since boot (/proc/stat; 0.0 where unreadable)
    own_s: float  # this process's user + system time, all threads


def parse_proc_stat(text: str) -> dict[int, int]:
    """Non-idle ticks per CPU from ``/proc/stat``'s ``cpuN`` lines: user, nice, system, irq, softirq and steal."""
    busy = {}
    for line in text.splitlines():
        fields = line.split()
        if not fields or not fields[0].startswith("cpu") or fields[0] == "cpu":
            continue
        try:
            ticks = [int(v) for v in fields[1:9]]
        except ValueError:
            continue
        if len(ticks) < 8:
            ticks += [0] * (8 - len(ticks))
        user, nice, system, _idle, _iowait, irq, softirq, steal = ticks
        busy[int(fields[0][3:])] = user + nice + system + irq + softirq + steal
    return busy


def sample_cpu(cpus: set[int] | None = None) -> CpuSample:
    """A :class:`CpuSample` of ``cpus`` (default: this process's affinity)."""
    cpus = frozenset(affinity_cpus() if cpus is None else cpus)
    ticks = parse_proc_stat(_read(PROC_STAT))
    busy_s = sum(ticks.get(cpu, 0) for cpu in cpus) / os.sysconf("SC_CLK_TCK")
    return CpuSample(cpus, time.monotonic(), busy_s, time.process_time())


def busy_elsewhere_between(before: CpuSample, after: CpuSample) -> float:
    """CPUs (of ``before.cpus``) that other processes kept busy between two samples, in [0, number of CPUs]."""
    wall_s = after.at_s - before.at_s
    if wall_s <= 0 or before.cpus != after.cpus:
        return 0.0
    others_s = (after.busy_s - before.busy_s) - (after.own_s - before.own_s)
    return min(float(len(before.cpus)), max(0.0, others_s / wall_s))


def cpus_busy_elsewhere(interval_s: float = MEASURE_INTERVAL_S) -> float:
    """CPUs of this process's affinity that other processes keep busy, measured over ``interval_s`` (blocks that long)."""
    before = sample_cpu()
    time.sleep(interval_s)
    return busy_elsewhere_between(before, sample_cpu(before.cpus))


def threads_for(usable: int, affinity: int, busy_elsewhere: float) -> int:
    """Threads for ``usable`` CPUs when others keep ``busy_elsewhere`` of the ``affinity`` CPUs busy.

    A CPU more than half busy counts as taken; at least 1.
    """
    taken = max(0, math.ceil(busy_elsewhere - 0.5))
    return max(1, min(usable, affinity - taken))


def requested_threads(env: dict[str, str] | None = None) -> int | None:
    """The user's thread count: ``$RLVR_THREADS``, else ``$OMP_NUM_THREADS`` (its first level); None to measure."""
    env = os.environ if env is None else env
    for name in ("RLVR_THREADS", "OMP_NUM_THREADS"):
        value = env.get(name, "").strip()
        if not value:
            continue
        if name == "RLVR_THREADS" and value.lower() == "auto":
            return None
        first = value.split(",")[0].strip()
        if not first.isdigit() or int(first) < 1:
            raise ValueError(f"${name} must be a positive integer{' or auto' if name == 'RLVR_THREADS' else ''}, got {value!r}")
        return int(first)
    return None


def pick_threads(interval_s: float = MEASURE_INTERVAL_S) -> int:
    """Threads for torch on this host now: the user's choice if set, else usable CPUs less those busy elsewhere."""
    requested = requested_threads()
    if requested is not None:
        return requested
    return threads_for(usable_cpus(), len(affinity_cpus()), cpus_busy_elsewhere(interval_s))


class ThreadPolicy:
    """Keeps ``torch.set_num_threads`` at :func:`pick_threads`.

    Call :meth:`apply` once and :meth:`maybe_refresh` between steps, on the thread that runs the
    forwards: torch's OpenMP thread count is per calling thread.
    """

    def __init__(self, refresh_s: float = REFRESH_S, interval_s: float = MEASURE_INTERVAL_S):
        self.refresh_s = refresh_s
        self.interval_s = interval_s
        self.threads: int | None = None
        self.requested = requested_threads()
        self._since: CpuSample | None = None
        self._warned = False

    def apply(self) -> int:
        """Measure for ``interval_s`` (none if the user chose), set torch's threads, and return them."""
        if self.requested is not None:
            self._since = sample_cpu()  # what a refresh checks the user's count against
            return self._set(self.requested)
        before = sample_cpu()
        time.sleep(self.interval_s)
        self._since = sample_cpu(before.cpus)
        return self._set(self._threads_since(before, self._since))

    def maybe_refresh(self) -> int | None:
        """If ``refresh_s`` passed since the last measurement: re-pick from the CPU time since then, without
        waiting. Returns the new thread count when it changed, else None. A user's count stays; the first
        time it is more than the CPUs others leave free, a warning says so."""
        if self._since is None or time.monotonic() - self._since.at_s < self.refresh_s:
            return None
        before, self._since = self._since, sample_cpu()
        if self._since.cpus != before.cpus:  # affinity changed: measure afresh from now
            return None
        threads = self._threads_since(before, self._since)
        if self.requested is not None:
            if self.requested > threads and not self._warned:
                self._warned = True
                logger.warning(
                    "torch runs %d threads as $RLVR_THREADS or $OMP_NUM_THREADS asks, but other processes keep CPUs busy: %d fit. "
                    "OpenMP threads that share a busy CPU slow every step several-fold; unset the variable or set RLVR_THREADS=auto",
                    self.requested,
                    threads,
                )
            return None
        if threads == self.threads:
            return None
        logger.info("torch threads %s -> %s (CPUs busy elsewhere changed)", self.threads, threads)
        return self._set(threads)

    def _threads_since(self, before: CpuSample, after: CpuSample) -> int:
        return threads_for(usable_cpus(), len(after.cpus), busy_elsewhere_between(before, after))

    def _set(self, threads: int) -> int:
        torch.set_num_threads(threads)
        self.threads = threads
        return threads


_POLICIES = threading.local()


def tune_threads() -> int | None:
    """Keep the calling thread's torch threads at :func:`pick_threads`: the first call on a thread
    measures and applies, later ones re-pick at most every ``REFRESH_S`` (the engine calls this each step)."""
    policy = getattr(_POLICIES, "policy", None)
    if policy is None:
        policy = _POLICIES.policy = ThreadPolicy()
        return policy.apply()
    return policy.maybe_refresh()
