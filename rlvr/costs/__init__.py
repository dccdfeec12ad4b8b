"""What work costs: :class:`Usage` (compute, memory, energy, tokens), measured by :class:`UsageMeter` over a
process tree, and turned into money by a :class:`PriceTable` where prices are set. Attribution (run, asset,
step, task, API key) is the caller's."""

from rlvr.costs.meter import UsageMeter
from rlvr.costs.prices import Prices, PriceTable, configured_prices, machine_kind
from rlvr.costs.usage import ESTIMATED, Usage, total

__all__ = ["ESTIMATED", "PriceTable", "Prices", "Usage", "UsageMeter", "configured_prices", "machine_kind", "total"]
