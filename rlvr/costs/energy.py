"""Energy of a block of work: the machine's counters where it has them, an estimate marked as such where not.

RAPL (``/sys/class/powercap/intel-rapl:*``, the CPU packages; often root-only) and NVML (each GPU's total
energy) are read at the start and end. Without them, energy is estimated from the work's core- and
GPU-seconds at :data:`WATTS_PER_CORE` and :data:`WATTS_PER_GPU`, and the row says ``estimate``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rlvr.costs.usage import ESTIMATED

RAPL_ROOT = Path("/sys/class/powercap")
WATTS_PER_CORE = 10.0  # a busy server core's share of its package power (about 10 W per core under load, all-core turbo)
WATTS_PER_GPU = 700.0  # an H100/H200 SXM at its board power limit
JOULES_PER_KWH = 3.6e6


def rapl_joules() -> float | None:
    """The CPU packages' energy counters summed, in joules; None when the machine exposes none or we may not read them."""
    zones = sorted(RAPL_ROOT.glob("intel-rapl:[0-9]*")) if RAPL_ROOT.exists() else []
    zones = [zone for zone in zones if zone.name.count(":") == 1]  # packages, not their sub-zones (counted inside)
    try:
        return sum(int((zone / "energy_uj").read_text()) for zone in zones) / 1e6 if zones else None
    except (OSError, ValueError):
        return None


def nvml_joules(gpus: int) -> float | None:
    """The first ``gpus`` GPUs' total energy counters, in joules; None without NVML or GPUs."""
    if gpus <= 0:
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        return sum(pynvml.nvmlDeviceGetTotalEnergyConsumption(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(gpus)) / 1e3
    except Exception:  # no driver, no library, a GPU without the counter: estimate instead
        return None


@dataclass
class EnergyCounters:
    """The counters read when a block starts; :meth:`kwh_since_open` gives the energy since, and where it came from."""

    gpus: int
    rapl_start: float | None
    nvml_start: float | None

    @classmethod
    def open(cls, gpus: int = 0) -> "EnergyCounters":
        return cls(gpus, rapl_joules(), nvml_joules(gpus))

    def kwh_since_open(self, cpu_core_s: float, gpu_s: float) -> tuple[float, str]:
        """(kWh, source): each side measured where its counter was readable at both ends (a wrapped RAPL
        counter counts as unreadable), estimated where not; the source says which."""
        cpu_j, sources = cpu_core_s * WATTS_PER_CORE, []
        if self.rapl_start is not None and (now := rapl_joules()) is not None and now >= self.rapl_start:
            cpu_j, sources = now - self.rapl_start, ["rapl"]
        gpu_j = gpu_s * WATTS_PER_GPU
        if self.nvml_start is not None and (now := nvml_joules(self.gpus)) is not None:
            gpu_j, sources = now - self.nvml_start, [*sources, "nvml"]
        measured = "+".join(sources)
        fully_measured = sources and (self.gpus == 0 or "nvml" in sources) and "rapl" in sources
        return (cpu_j + gpu_j) / JOULES_PER_KWH, measured if fully_measured else (ESTIMATED if not sources else f"{measured}+{ESTIMATED}")
