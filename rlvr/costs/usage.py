"""What a piece of work used: :class:`Usage`, the one record every meter returns and every ledger row holds."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

ESTIMATED = "estimate"  # energy_source of energy computed from core- and GPU-seconds (no counter on the machine)


@dataclass(frozen=True)
class Usage:
    """Compute, memory, energy and tokens of one piece of work (a step, an asset, a request, a task's share)."""

    wall_s: float = 0.0
    cpu_core_s: float = 0.0  # user + system CPU seconds of the process tree (ranks, reward workers, ...)
    gpu_s: float = 0.0  # wall seconds x GPUs held
    peak_rss_mb: float = 0.0  # the process tree's largest resident memory, summed over its processes
    peak_gpu_mem_mb: float = 0.0  # the largest GPU memory one device held
    energy_kwh: float = 0.0
    energy_source: str = ESTIMATED  # "rapl", "rapl+nvml": read from counters; "estimate" (or "...+estimate"): partly or wholly estimated
    prompt_tokens: int = 0
    completion_tokens: int = 0
    trained_tokens: int = 0  # completion tokens the update trained on

    def __add__(self, other: "Usage") -> "Usage":
        """Two pieces of work one after the other: times, energy and tokens add, peaks take the larger."""
        peaks = {"peak_rss_mb", "peak_gpu_mem_mb"}
        summed = {
            f.name: max(getattr(self, f.name), getattr(other, f.name)) if f.name in peaks else getattr(self, f.name) + getattr(other, f.name)
            for f in fields(self)
            if f.name != "energy_source"
        }
        source = self.energy_source if self.energy_source == other.energy_source else ESTIMATED
        return Usage(**summed, energy_source=source)

    def share(self, fraction: float) -> "Usage":
        """``fraction`` of this work's compute and energy (a task's share of a step's tokens); peaks and tokens kept."""
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"a share is in [0, 1], got {fraction}")
        scaled = ("wall_s", "cpu_core_s", "gpu_s", "energy_kwh")
        return replace(self, **{name: getattr(self, name) * fraction for name in scaled})

    def with_tokens(self, prompt: int = 0, completion: int = 0, trained: int = 0) -> "Usage":
        return replace(self, prompt_tokens=int(prompt), completion_tokens=int(completion), trained_tokens=int(trained))

    def as_dict(self) -> dict:
        return asdict(self)


def total(usages) -> Usage:
    """The sum of ``usages`` (:meth:`Usage.__add__`); an empty Usage for none."""
    usages = list(usages)
    result = usages[0] if usages else Usage()
    for usage in usages[1:]:
        result = result + usage
    return result
