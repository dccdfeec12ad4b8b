"""What work costs (rlvr.costs): a process tree's usage measured, usages added and shared, prices applied."""

import json
import subprocess
import sys

import pytest

from rlvr.costs import ESTIMATED, Prices, PriceTable, Usage, UsageMeter, configured_prices, total
from rlvr.costs.energy import WATTS_PER_CORE, EnergyCounters

BURN = "import time\nend = time.process_time() + {seconds}\nwhile time.process_time() < end: pass"


def test_the_meter_counts_the_cpu_of_processes_the_block_starts_and_reaps():
    with UsageMeter(interval_s=0.05) as meter:
        subprocess.run([sys.executable, "-c", BURN.format(seconds=0.6)], check=True)
        grandchild = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {BURN.format(seconds=0.4)!r}], check=True)"
        subprocess.run([sys.executable, "-c", grandchild], check=True)
    usage = meter.usage
    assert usage.cpu_core_s >= 0.9  # both children, the grandchild counted through its reaper
    assert usage.wall_s >= usage.cpu_core_s * 0.5
    assert usage.energy_source == ESTIMATED or "rapl" in usage.energy_source
    assert usage.energy_kwh > 0


def test_the_meter_counts_a_child_still_running_when_read():
    child = subprocess.Popen([sys.executable, "-c", BURN.format(seconds=5)])
    try:
        with UsageMeter(interval_s=0) as meter:
            deadline = meter.clock() + 10
            while meter.read().cpu_core_s < 0.5 and meter.clock() < deadline:
                pass
        assert meter.usage.cpu_core_s >= 0.5
    finally:
        child.kill()
        child.wait()


def test_the_meter_samples_the_peak_resident_memory():
    with UsageMeter(interval_s=0.02) as meter:
        before = meter.read().peak_rss_mb
        block = bytearray(200 * 2**20)
        block[::4096] = b"x" * len(block[::4096])  # touch every page
        meter.read()
        del block
    assert meter.usage.peak_rss_mb >= before + 150


def test_usages_add_and_share():
    step = Usage(wall_s=2.0, cpu_core_s=3.0, peak_rss_mb=100.0, energy_kwh=0.01, prompt_tokens=10, completion_tokens=20, trained_tokens=20)
    other = Usage(wall_s=1.0, cpu_core_s=1.0, peak_rss_mb=300.0, energy_kwh=0.02, prompt_tokens=1, completion_tokens=2)
    both = step + other
    assert (both.wall_s, both.cpu_core_s, both.peak_rss_mb, both.prompt_tokens, both.trained_tokens) == (3.0, 4.0, 300.0, 11, 20)
    assert total([step, other]) == both and total([]) == Usage()
    quarter = step.share(0.25)
    assert (quarter.cpu_core_s, quarter.wall_s, quarter.peak_rss_mb, quarter.prompt_tokens) == (0.75, 0.5, 100.0, 10)
    with pytest.raises(ValueError, match="share"):
        step.share(1.5)


def test_measured_and_estimated_energy_add_to_an_estimate():
    assert (Usage(energy_source="rapl") + Usage(energy_source="rapl")).energy_source == "rapl"
    assert (Usage(energy_source="rapl") + Usage(energy_source=ESTIMATED)).energy_source == ESTIMATED


def test_energy_without_counters_is_estimated_from_core_seconds():
    kwh, source = EnergyCounters(gpus=0, rapl_start=None, nvml_start=None).kwh_since_open(cpu_core_s=3600.0, gpu_s=0.0)
    assert source == ESTIMATED and kwh == pytest.approx(WATTS_PER_CORE / 1000)


def test_prices_turn_usage_into_money_only_where_set():
    usage = Usage(wall_s=3600.0, cpu_core_s=7200.0, gpu_s=1800.0, peak_rss_mb=2048.0, energy_kwh=0.5)
    assert Prices().money(usage) is None
    assert Prices(core_hour=0.05).money(usage) == pytest.approx(0.1)
    full = Prices(core_hour=0.05, gpu_hour=2.0, memory_gb_hour=0.01, kwh=0.2)
    assert full.money(usage) == pytest.approx(0.1 + 1.0 + 0.02 + 0.1)
    table = PriceTable({"cpu": Prices(core_hour=0.05), "default": Prices(gpu_hour=1.0)})
    assert table.money(usage, "cpu") == pytest.approx(0.1) and table.money(usage, "nvidia-h100") == pytest.approx(0.5)
    assert PriceTable({}).money(usage, "cpu") is None and not PriceTable({}).is_set


def test_configured_prices(tmp_path):
    assert configured_prices({}).is_set  # the shipped default table
    assert not configured_prices({"RLVR_PRICES": "none"}).is_set
    path = tmp_path / "prices.json"
    path.write_text(json.dumps({"cpu": {"core_hour": 0.1}}))
    assert configured_prices({"RLVR_PRICES": str(path)}).for_machine("cpu") == Prices(core_hour=0.1)


@pytest.mark.parametrize(
    "data, named",
    [([1], "machine kind"), ({"cpu": {"core_hours": 1}}, "'cpu'"), ({"cpu": {"core_hour": -1}}, "cpu.core_hour"), ({"cpu": {"kwh": "cheap"}}, "cpu.kwh")],
)
def test_a_bad_price_table_is_refused_naming_the_entry(tmp_path, data, named):
    path = tmp_path / "prices.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=named):
        configured_prices({"RLVR_PRICES": str(path)})


def test_an_unreadable_price_file_is_refused_naming_it(tmp_path):
    with pytest.raises(ValueError, match="missing.json"):
        configured_prices({"RLVR_PRICES": str(tmp_path / "missing.json")})
