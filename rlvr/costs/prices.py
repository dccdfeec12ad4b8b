"""Prices as configuration: what a core-hour, GPU-hour, memory GB-hour and kWh cost on each kind of machine.

A price table is JSON, ``{machine kind: {"core_hour": ..., "gpu_hour": ..., "memory_gb_hour": ..., "kwh": ...}}``
(USD; any field may be left out). ``RLVR_PRICES`` names the file, or ``none`` for no prices (then no money
appears anywhere); unset, the shipped :data:`DEFAULT_PRICES_FILE` holds (docs/configuration.md). A machine
kind not in the table uses its ``default`` entry, if any.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from pathlib import Path

from rlvr.costs.usage import Usage

DEFAULT_PRICES_FILE = Path(__file__).resolve().parent / "default_prices.json"
PRICES_ENV = "RLVR_PRICES"


@dataclass(frozen=True)
class Prices:
    """One machine kind's prices, USD; None: not priced (that part of a usage costs nothing in the total)."""

    core_hour: float | None = None
    gpu_hour: float | None = None
    memory_gb_hour: float | None = None
    kwh: float | None = None

    @property
    def is_set(self) -> bool:
        return any(getattr(self, f.name) is not None for f in fields(self))

    def money(self, usage: Usage) -> float | None:
        """What ``usage`` cost at these prices, None when none is set. Memory is priced on the peak resident set
        held for the wall time."""
        if not self.is_set:
            return None
        parts = (
            (self.core_hour, usage.cpu_core_s / 3600),
            (self.gpu_hour, usage.gpu_s / 3600),
            (self.memory_gb_hour, usage.peak_rss_mb / 1024 * usage.wall_s / 3600),
            (self.kwh, usage.energy_kwh),
        )
        return sum(price * amount for price, amount in parts if price is not None)


@dataclass(frozen=True)
class PriceTable:
    """Prices per machine kind (``cpu``, ``nvidia-h100``, ...; ``default`` for any other)."""

    kinds: dict[str, Prices]

    def for_machine(self, machine: str) -> Prices:
        return self.kinds.get(machine) or self.kinds.get("default") or Prices()

    def money(self, usage: Usage, machine: str) -> float | None:
        return self.for_machine(machine).money(usage)

    @property
    def is_set(self) -> bool:
        return any(prices.is_set for prices in self.kinds.values())

    @classmethod
    def parse(cls, data: object, source: str) -> "PriceTable":
        """The table in ``data`` (parsed JSON); ValueError naming ``source`` and the entry that is wrong."""
        if not isinstance(data, dict):
            raise ValueError(f"{source}: a price table is an object of machine kind -> prices, got {type(data).__name__}")
        names = {f.name for f in fields(Prices)}
        kinds = {}
        for kind, entry in data.items():
            if not isinstance(entry, dict) or set(entry) - names:
                raise ValueError(f"{source}: prices of {kind!r} must be an object with fields among {sorted(names)}, got {entry!r}")
            for name, value in entry.items():
                if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
                    raise ValueError(f"{source}: {kind}.{name} must be a non-negative number (USD), got {value!r}")
            kinds[str(kind)] = Prices(**{name: float(value) if value is not None else None for name, value in entry.items()})
        return cls(kinds)

    @classmethod
    def load(cls, path: str | Path) -> "PriceTable":
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"price table {path}: {err}") from None
        return cls.parse(data, str(path))


def configured_prices(environ: dict | None = None) -> PriceTable:
    """The prices in force: ``RLVR_PRICES``'s file, none for ``none`` (or empty), else the shipped defaults."""
    value = (os.environ if environ is None else environ).get(PRICES_ENV)
    if value is None:
        return PriceTable.load(DEFAULT_PRICES_FILE)
    if value.strip().lower() in ("", "none"):
        return PriceTable({})
    return PriceTable.load(value)


def machine_kind() -> str:
    """This machine's kind as price tables name it: the first GPU's name (``nvidia-h200``) when torch sees one, else ``cpu``."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        name = torch.cuda.get_device_name(0).lower()
        for prefix in ("nvidia ", "nvidia-"):
            name = name.removeprefix(prefix)
        return "nvidia-" + "-".join(name.split()[:1])
    return "cpu"
