import json
import threading

import pytest

from rlvr.answers import is_well_formed
from rlvr.monitoring.traffic import TRAFFIC_COLUMNS, TrafficLog, day_prefix, file_day, read_traffic, traffic_row


def test_append_rotate_and_read_incrementally(tmp_path):
    log = TrafficLog(tmp_path, max_bytes=2048)
    for i in range(40):
        log.append({"i": i, "prompt": "x" * 100})
    files = sorted(tmp_path.glob("traffic-*.jsonl"))
    assert len(files) > 1 and all(f.stat().st_size <= 2048 for f in files)
    first = read_traffic(tmp_path)
    assert [r["i"] for r in first.records] == list(range(40)) and not first.malformed
    assert read_traffic(tmp_path, first.cursor).records == []  # nothing new: nothing read twice
    log.append({"i": 40})
    assert [r["i"] for r in read_traffic(tmp_path, first.cursor).records] == [40]


def test_files_rotate_at_utc_midnight_and_a_day_is_read_alone(tmp_path):
    midnight = 1795392000 * 10**9  # 2026-11-23T00:00:00Z
    now = [midnight - 10**9]
    log = TrafficLog(tmp_path, clock=lambda: now[0])
    log.append({"i": 0})
    log.append({"i": 1})
    now[0] = midnight  # the first line of the new day starts a new file
    log.append({"i": 2})
    days = sorted(file_day(f.name) for f in tmp_path.glob("traffic-*.jsonl"))
    assert days == ["2026-11-22", "2026-11-23"]
    assert [r["i"] for r in read_traffic(tmp_path, day="2026-11-22").records] == [0, 1]
    assert [r["i"] for r in read_traffic(tmp_path, day="2026-11-23").records] == [2]
    assert read_traffic(tmp_path, day="2026-11-24").records == []
    assert file_day("traffic-20261399T000000.1.jsonl") is None and file_day("other.jsonl") is None
    with pytest.raises(ValueError, match="YYYY-MM-DD"):
        day_prefix("23/11/2026")


def test_partial_last_line_waits_for_the_next_pass(tmp_path):
    path = tmp_path / "traffic-0001.jsonl"
    path.write_text(json.dumps({"i": 0}) + "\n" + '{"i": 1, "prom')
    batch = read_traffic(tmp_path)
    assert [r["i"] for r in batch.records] == [0] and not batch.malformed
    with open(path, "a") as f:
        f.write('pt": "done"}\n')
    later = read_traffic(tmp_path, batch.cursor)
    assert later.records[0]["i"] == 1 and later.records[0]["prompt"] == "done"


def test_malformed_lines_are_counted_not_fatal(tmp_path):
    (tmp_path / "traffic-0001.jsonl").write_text('{"i": 0}\nnot json\n[1, 2]\n{"i": 3}\n')
    batch = read_traffic(tmp_path)
    assert [r["i"] for r in batch.records] == [0, 3]
    assert len(batch.malformed) == 2 and "traffic-0001.jsonl@" in batch.malformed[0]


def test_concurrent_writers_never_interleave_lines(tmp_path):
    log = TrafficLog(tmp_path, max_bytes=1 << 20)
    threads = [threading.Thread(target=lambda t=t: [log.append({"t": t, "j": j, "pad": "y" * 500}) for j in range(50)]) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    batch = read_traffic(tmp_path)
    assert len(batch.records) == 200 and not batch.malformed


def test_rejects_tiny_rotation_size(tmp_path):
    with pytest.raises(ValueError, match="max_bytes"):
        TrafficLog(tmp_path, max_bytes=10)


def test_traffic_row_summarizes_a_request(tmp_path):
    TrafficLog(tmp_path).append(
        {
            "timestamp": "2026-11-22T10:00:00.000+00:00",
            "request_id": "r1",
            "endpoint": "/solve",
            "model_version": "v1",
            "status": 200,
            "latency_s": 0.5,
            "prompt": "2+2?",
            "answer": "4",
            "vote_share": 0.5,
            "completions": ["2+2=4\n#### 4", "four"],
            "completion_tokens": [6, 2],
            "finish_reasons": ["answer", "length"],
        }
    )
    row = traffic_row(read_traffic(tmp_path).records[0])
    assert set(row) == set(TRAFFIC_COLUMNS)
    assert row["well_formed"] == 0.5 and row["truncated"] == 0.5 and row["completion_tokens"] == 4.0
    assert row["num_completions"] == 2 and row["ground_truth"] is None and row["record_id"].endswith("@0")


def test_well_formed_is_the_requests_own_tasks_format(tmp_path):
    """A reasoning-gym request is held to ``<answer>`` tags, an older /solve record (no task) is GSM8k's, and an
    OpenAI route's request has no task, so no format it could be held to."""
    log = TrafficLog(tmp_path)
    tagged = ["Add them.\n<answer>12</answer>", "<answer>12</answer>"]
    log.append({"endpoint": "/solve", "task": "reasoning_gym:basic_arithmetic", "completions": tagged})
    log.append({"endpoint": "/solve", "completions": ["Step one.\n#### 12", "<answer>12</answer>"]})  # written before records named their task
    log.append({"endpoint": "/generate", "task": "humaneval", "completions": ["    return 1\n```"]})  # continues the fence its prompt opened
    log.append({"endpoint": "/v1/chat/completions", "completions": ["#### 12"]})
    rows = [traffic_row(r) for r in read_traffic(tmp_path).records]
    assert [(row["task"], row["well_formed"]) for row in rows] == [
        ("reasoning_gym:basic_arithmetic", 1.0),
        ("gsm8k", 0.5),
        ("humaneval", 1.0),
        (None, None),
    ]
    assert not any(is_well_formed(c) for c in tagged)  # the GSM8k rule would have called them all malformed


def test_a_request_of_a_task_this_process_cannot_resolve_has_no_format_rate(tmp_path):
    TrafficLog(tmp_path).append({"endpoint": "/solve", "task": "no_such_task", "completions": ["#### 1"]})
    row = traffic_row(read_traffic(tmp_path).records[0])
    assert row["task"] == "no_such_task" and row["well_formed"] is None


def test_a_removed_log_file_starts_a_new_one(tmp_path):
    log = TrafficLog(tmp_path)
    log.append({"i": 0})
    for path in tmp_path.glob("traffic-*.jsonl"):
        path.unlink()  # e.g. a retention job
    log.append({"i": 1})
    assert [r["i"] for r in read_traffic(tmp_path).records] == [1]
