"""A training budget: core-hours, GPU-hours and money a run may spend, and whether its :class:`Spend` reached it.

A run checks its spend after each step (the sum of its steps' usage, earlier attempts' included) and stops at
that step boundary once any limit is reached. Money is spend at the run's machine's :class:`Prices`, so a
``usd`` limit needs them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Iterable

from rlvr.costs.prices import Prices
from rlvr.costs.usage import Usage

LIMITS = ("core_hours", "gpu_hours", "usd")


@dataclass(frozen=True)
class Spend:
    """What a run has spent: CPU core-hours, GPU-hours and USD (0 without prices)."""

    core_hours: float = 0.0
    gpu_hours: float = 0.0
    usd: float = 0.0

    def __add__(self, other: "Spend") -> "Spend":
        return Spend(*(a + b for a, b in zip(self.as_tuple(), other.as_tuple())))

    def as_tuple(self) -> tuple[float, float, float]:
        return self.core_hours, self.gpu_hours, self.usd


def spend_of(usages: Iterable[Usage], prices: Prices) -> Spend:
    """The spend of ``usages`` (each priced on its own: memory is priced on its own peak and wall time)."""
    spend = Spend()
    for usage in usages:
        spend += Spend(usage.cpu_core_s / 3600, usage.gpu_s / 3600, prices.money(usage) or 0.0)
    return spend


@dataclass(frozen=True)
class Budget:
    """Limits on a run's spend (None: no limit on that); ``prices``: the run's machine's, what ``usd`` counts in."""

    core_hours: float | None = None
    gpu_hours: float | None = None
    usd: float | None = None
    prices: Prices = Prices()

    def __post_init__(self) -> None:
        for name in LIMITS:
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise ValueError(f"budget.{name} must be a positive number, got {value!r}")
        if self.usd is not None and not self.prices.is_set:
            raise ValueError("budget.usd needs prices for this machine kind, and none are set (RLVR_PRICES names the price table; 'none' sets none)")

    @property
    def is_set(self) -> bool:
        return any(getattr(self, name) is not None for name in LIMITS)

    def reached(self, spend: Spend) -> str | None:
        """The first limit ``spend`` has reached, said with what was spent (``budget core_hours 0.5 reached: spent
        0.51 core-hours``); None while every limit has room."""
        for name, spent in zip(LIMITS, spend.as_tuple()):
            limit = getattr(self, name)
            if limit is not None and spent >= limit:
                return f"budget {name} {limit:g} reached: spent {spent:.6g} {name.replace('_', '-')}"
        return None

    def as_dict(self) -> dict:
        """The budget as JSON (:meth:`from_dict` reads it back)."""
        return {**{name: getattr(self, name) for name in LIMITS}, "prices": asdict(self.prices)}

    @classmethod
    def from_dict(cls, data: dict) -> "Budget":
        prices = data.get("prices") or {}
        return cls(**{name: data.get(name) for name in LIMITS}, prices=Prices(**{f.name: prices.get(f.name) for f in fields(Prices)}))
