"""Measuring what a block of work uses: :class:`UsageMeter` over this process and every process it starts.

CPU time is the process tree's (psutil): this process, its live descendants, and every descendant reaped
meanwhile (each counted once, by its reaper). Resident memory is sampled on a thread (the tree's sum, every
``interval_s``). GPU time is wall time x the GPUs held; GPU memory is torch's peak of this process. Energy
comes from the machine's counters when it exposes them (:mod:`rlvr.costs.energy`), otherwise it is estimated.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import psutil

from rlvr.costs.energy import EnergyCounters
from rlvr.costs.usage import Usage


def tree_cpu_seconds(process: psutil.Process) -> float:
    """User + system CPU seconds of ``process``, its live descendants and the descendants they reaped."""
    total = 0.0
    for member in [process, *_descendants(process)]:
        try:
            times = member.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue  # ended between listing and reading: its reaper counts it from now on
        total += times.user + times.system + times.children_user + times.children_system
    return total


def tree_rss_mb(process: psutil.Process) -> float:
    """Resident memory of ``process`` and its live descendants, in MiB."""
    total = 0
    for member in [process, *_descendants(process)]:
        try:
            total += member.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return total / 2**20


def _descendants(process: psutil.Process) -> list[psutil.Process]:
    try:
        return process.children(recursive=True)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


class UsageMeter:
    """``with UsageMeter() as meter: ...`` then ``meter.usage``: what the block used (tokens are the caller's to add).

    ``gpus``: GPUs the block holds (GPU-seconds = wall x gpus); ``interval_s``: how often memory is sampled
    (0: only at the start and end). One meter measures one block; :meth:`read` gives the usage so far.
    """

    def __init__(self, gpus: int = 0, interval_s: float = 2.0, clock: Callable[[], float] = time.perf_counter):
        self.gpus, self.interval_s, self.clock = gpus, interval_s, clock
        self.process = psutil.Process()
        self._peak_rss = 0.0
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None

    def __enter__(self) -> "UsageMeter":
        self.started, self.cpu_at_start = self.clock(), tree_cpu_seconds(self.process)
        self.energy = EnergyCounters.open(self.gpus)
        self._peak_rss = tree_rss_mb(self.process)
        self._reset_gpu_peak()
        if self.interval_s > 0:
            self._sampler = threading.Thread(target=self._sample, name="usage-meter", daemon=True)
            self._sampler.start()
        return self

    def __exit__(self, *exc) -> None:
        self.usage = self.read()
        self._stop.set()
        if self._sampler is not None:
            self._sampler.join()

    def read(self) -> Usage:
        """What the block used so far."""
        wall = self.clock() - self.started
        cpu = max(tree_cpu_seconds(self.process) - self.cpu_at_start, 0.0)
        self._peak_rss = max(self._peak_rss, tree_rss_mb(self.process))
        gpu_s = wall * self.gpus
        energy_kwh, source = self.energy.kwh_since_open(cpu, gpu_s)
        return Usage(
            wall_s=wall,
            cpu_core_s=cpu,
            gpu_s=gpu_s,
            peak_rss_mb=self._peak_rss,
            peak_gpu_mem_mb=self._gpu_peak_mb(),
            energy_kwh=energy_kwh,
            energy_source=source,
        )

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._peak_rss = max(self._peak_rss, tree_rss_mb(self.process))

    def _reset_gpu_peak(self) -> None:
        torch = _torch_with_cuda()
        if torch is not None:
            torch.cuda.reset_peak_memory_stats()

    def _gpu_peak_mb(self) -> float:
        torch = _torch_with_cuda()
        return torch.cuda.max_memory_allocated() / 2**20 if torch is not None else 0.0


def _torch_with_cuda():
    """torch, when this process has already imported it and initialised CUDA; else None (a meter never starts CUDA)."""
    import sys

    torch = sys.modules.get("torch")
    return torch if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized() else None
