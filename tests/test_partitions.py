"""Traffic partitions start where the traffic starts, not months before it."""

from datetime import date, datetime, timedelta, timezone

from resources import Settings
from rlvr_assets.partitions import traffic_days, traffic_start


def test_the_first_partition_is_the_oldest_traffic_day_or_a_week_back(tmp_path):
    today = date(2026, 11, 25)
    assert traffic_start(tmp_path / "missing", today) == "2026-11-18"
    (tmp_path / "traffic-20261123T000000Z-1.jsonl").write_text("")
    (tmp_path / "notes.txt").write_text("")
    assert traffic_start(tmp_path, today) == "2026-11-18"  # newer traffic: the week before today still shows
    (tmp_path / "traffic-20261020T120000Z-1.jsonl").write_text("")
    assert traffic_start(tmp_path, today) == "2026-10-20"


def test_the_partitions_run_from_the_traffic_start_to_today():
    """The start is computed when the code location loads: the day before's, where this run crossed midnight."""
    today = datetime.now(timezone.utc).date()
    keys = traffic_days.get_partition_keys()
    folder = Settings.from_env().traffic_dir
    assert keys[0] in {traffic_start(folder, today), traffic_start(folder, today - timedelta(days=1))} and keys[-1] == today.isoformat()
