"""The warehouse's costs against its size: one step's append, a reader beside a writer, the report, drift and
metadata queries, at each size asked for (on-disk: the DuckDB file and its Parquet parts).

    python bench/warehouse_scale.py --sizes 10MB 1GB 10GB --dir /tmp/warehouse-scale

Each size is grown as a file of the older layout (the big tables in DuckDB, generated in SQL: runs of 200
steps x 16 rollouts, 4 reward rows each, traffic days of 20,000 requests, 20 evaluations), opened once by the
warehouse (which moves its big tables into parts: timed), then measured in a fresh process (its peak RSS).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ROLLOUTS_PER_RUN, TRAFFIC_PER_DAY, RUNS_PER_DAY = 3200, 20_000, 4
UNITS = {"KB": 2**10, "MB": 2**20, "GB": 2**30}


def parse_size(text: str) -> int:
    return int(float(text[:-2]) * UNITS[text[-2:].upper()])


def on_disk(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and "snapshot" not in p.name)


def generate(folder: Path, runs: int) -> None:
    """An older-layout DuckDB file of ``runs`` training runs and their traffic days, built in SQL."""
    import duckdb

    from resources.warehouse import SCHEMAS

    folder.mkdir(parents=True, exist_ok=True)
    days = max(1, runs // RUNS_PER_DAY)
    text = lambda seed, n: " || ' ' || ".join(f"md5({seed} || '{k}')" for k in range(n))  # noqa: E731  (hex words: about 2x compressible)
    with duckdb.connect(str(folder / "rlvr.duckdb")) as conn:
        conn.execute(
            f"""CREATE TABLE rollouts AS SELECT printf('run-%05d', i // {ROLLOUTS_PER_RUN}) AS run_id,
            printf('run-%05d:%d:%d:%d', i // {ROLLOUTS_PER_RUN}, (i % {ROLLOUTS_PER_RUN}) // 16 + 1, (i % 16) // 4, i % 4) AS completion_id,
            ((i % {ROLLOUTS_PER_RUN}) // 16 + 1)::INTEGER AS step, 'gsm8k-train-' || (i % 7473) AS problem_id, 'gsm8k' AS task,
            ((i % 16) // 4)::INTEGER AS group_index, (i % 4)::INTEGER AS sample_index, 1.0 AS temperature,
            'Solve the problem. ' || {text("(i % 7473)::VARCHAR", 8)} AS prompt, {text("i::VARCHAR", 20)} || ' #### ' || (i % 97) AS completion,
            120::BIGINT AS prompt_tokens, 300::BIGINT AS completion_tokens, 300::BIGINT AS policy_tokens, 0::BIGINT AS environment_tokens,
            0::BIGINT AS tool_calls, CASE WHEN i % 9 = 0 THEN 'length' ELSE 'answer' END AS finish_reason, 'v' || (i // {ROLLOUTS_PER_RUN}) AS policy_version,
            true AS trained FROM range({runs * ROLLOUTS_PER_RUN}) t(i)"""
        )
        conn.execute(
            """CREATE TABLE rewards AS SELECT run_id, completion_id, step, task, name AS reward_name, (hash(completion_id || name) % 100) / 100.0 AS value,
            1.0 AS weight, 0.1 AS advantage FROM rollouts, (VALUES ('math_answer'), ('format'), ('length'), ('total')) n(name)"""
        )
        conn.execute(SCHEMAS["serving_traffic"])
        conn.execute(
            f"""INSERT INTO serving_traffic (record_id, "timestamp", request_id, endpoint, model_version, status, latency_s, prompt, answer,
            well_formed, completion_chars, source_file, source_offset)
            SELECT 'rec-' || i, TIMESTAMPTZ '2026-01-01 00:00:00+00' + to_days((i // {TRAFFIC_PER_DAY})::INTEGER) + to_seconds(i % 86400), 'req-' || i,
            '/solve', 'v1', 200, 0.5, 'Question: ' || {text("(i % 5000)::VARCHAR", 6)}, (i % 97)::VARCHAR, 1.0, 600.0,
            'traffic-' || strftime(DATE '2026-01-01' + (i // {TRAFFIC_PER_DAY})::INTEGER, '%Y%m%d') || 'T000000.000000000-1.jsonl', i * 800
            FROM range({days * TRAFFIC_PER_DAY}) t(i)"""
        )
        conn.execute(SCHEMAS["serving_traffic_cursor"])
        conn.execute(
            "CREATE TABLE gsm8k_problems AS SELECT 'gsm8k-train-' || i AS problem_id, 'train' AS split, "
            "'question ' || md5(i::VARCHAR) AS question FROM range(7473) t(i)"
        )
        conn.execute(
            """CREATE TABLE eval_results AS SELECT 'eval-' || e AS eval_id, 'v' || e AS policy_version, 'gsm8k-test-' || p AS problem_id,
            md5(e || '-' || p) AS completion, p % 3 = 0 AS correct_strict, true AS well_formed,
            TIMESTAMPTZ '2026-01-01 00:00:00+00' + to_hours(e) AS evaluated_at
            FROM range(20) a(e), range(1319) b(p)"""
        )


def step_append(warehouse, run: str, step: int) -> float:
    """One training step's write: 16 rollouts and their 4 reward rows each, upserted by completion; returns seconds."""
    import pandas as pd

    from resources import Upsert

    ids = [f"{run}:{step}:{i // 4}:{i % 4}" for i in range(16)]
    rollouts = pd.DataFrame(
        {"run_id": run, "completion_id": ids, "step": step, "prompt": "Solve. " * 60, "completion": "x y " * 200, "finish_reason": "answer"}
    )
    rewards = pd.DataFrame(
        {
            "run_id": run,
            "completion_id": [c for c in ids for _ in range(4)],
            "step": step,
            "reward_name": ["math_answer", "format", "length", "total"] * 16,
            "value": 0.5,
        }
    )
    start = time.perf_counter()
    warehouse.write(Upsert("rollouts", rollouts, "completion_id"), Upsert("rewards", rewards, "completion_id"))
    return time.perf_counter() - start


def timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def measure(folder: Path, appends: int) -> dict:
    """Every timing of one data directory (run in its own process: ``ru_maxrss`` is its peak)."""
    import duckdb

    from resources import Warehouse

    warehouse = Warehouse(database=str(folder / "rlvr.duckdb"))
    last_run = warehouse.query("SELECT max(run_id) AS r FROM rollouts")["r"].iloc[0]
    last_day = warehouse.query("SELECT max(source_file) AS f FROM serving_traffic")["f"].iloc[0][8:16]
    day = f"{last_day[:4]}-{last_day[4:6]}-{last_day[6:]}"
    first = 10_000 + int(time.time()) % 1_000_000 * 10  # steps no earlier invocation wrote: appends, not re-executions
    append = [step_append(warehouse, last_run, first + k) for k in range(appends)]
    read, beside = [], []
    writer = threading.Thread(target=lambda: beside.extend(step_append(warehouse, last_run, first + appends + k) for k in range(appends)))
    writer.start()
    while writer.is_alive() or not read:  # a SQL session's statement on the snapshot while the run appends

        def reader():
            with duckdb.connect(str(warehouse.snapshot_path), read_only=True) as conn:
                conn.execute("SELECT reward_name, avg(value), count(*) FROM rewards WHERE run_id = ? GROUP BY 1", [last_run]).fetchall()

        read.append(timed(reader))
    writer.join()
    return {
        "on_disk_bytes": on_disk(folder),
        "snapshot_bytes": warehouse.snapshot_path.stat().st_size,
        "live_parts": int(warehouse.query("SELECT count(*) AS n FROM _part_files WHERE retired_at IS NULL")["n"].iloc[0]),
        "append_s": append,
        "append_beside_reader_s": beside,
        "reader_query_s": read,
        "eval_report_s": timed(lambda: warehouse.latest_evaluation("v19")),
        "drift_window_s": timed(lambda: warehouse.traffic_window(day, 500)),
        "drift_reference_s": timed(lambda: warehouse.reference_questions(500)),
        "training_run_summary_s": timed(lambda: warehouse.training_run_summary(last_run)),
        "traffic_rows_s": timed(lambda: warehouse.traffic_rows(day)),
        "compact_s": timed(warehouse.compact),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def grow(folder: Path, target: int, bytes_per_run: float, fixed_bytes: float = 0) -> dict:
    shutil.rmtree(folder, ignore_errors=True)
    runs = max(1, round((target - fixed_bytes) / bytes_per_run))
    start = time.perf_counter()
    generate(folder, runs)
    generated = time.perf_counter() - start
    database = str(folder / "rlvr.duckdb")
    move = (
        f"import resource, time; from resources import Warehouse; w = Warehouse(database={database!r}); "
        "t = time.perf_counter(); w.write(); print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)"
    )
    moved = subprocess.run([sys.executable, "-c", move], cwd=ROOT, check=True, capture_output=True, text=True)
    seconds, peak_mb = map(float, moved.stdout.split()[-2:])  # the move's own process: its peak RSS
    return {"runs": runs, "generate_s": generated, "move_into_parts_s": seconds, "move_peak_rss_mb": peak_mb}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["10MB", "1GB"])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/warehouse-scale"))
    parser.add_argument("--appends", type=int, default=20)
    parser.add_argument("--reuse", action="store_true", help="measure a size already grown under --dir again (a grown.json there)")
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.appends)))
        return
    sizes = {}
    for runs in (RUNS_PER_DAY, 2 * RUNS_PER_DAY):  # bytes on disk per run (with its share of traffic), and the fixed part
        grow(args.dir / "calibration", runs, 1)
        sizes[runs] = on_disk(args.dir / "calibration")
    bytes_per_run = (sizes[2 * RUNS_PER_DAY] - sizes[RUNS_PER_DAY]) / RUNS_PER_DAY
    fixed_bytes = sizes[RUNS_PER_DAY] - RUNS_PER_DAY * bytes_per_run
    rows = []
    for size in args.sizes:
        folder = args.dir / size
        if args.reuse and (folder / "grown.json").is_file():
            grown = json.loads((folder / "grown.json").read_text())
        else:
            grown = grow(folder, parse_size(size), bytes_per_run, fixed_bytes)
            (folder / "grown.json").write_text(json.dumps(grown))
        measured = subprocess.run(
            [sys.executable, __file__, "--measure", str(folder), "--appends", str(args.appends)], capture_output=True, text=True, check=True
        )
        rows.append({"size": size, **grown, **json.loads(measured.stdout.strip().splitlines()[-1])})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    interleaved = appends_interleaved([args.dir / size for size in args.sizes], args.appends)  # the sizes side by side: one machine load for all
    med = lambda xs: statistics.median(xs)  # noqa: E731
    print(
        f"calibration: {bytes_per_run / 2**20:.2f} MiB per run ({ROLLOUTS_PER_RUN} rollouts, their rewards, a quarter traffic day), "
        f"{fixed_bytes / 2**20:.1f} MiB fixed"
    )
    print(
        "| size | on disk | snapshot | parts | move into parts (peak RSS) | append p50 / max | append beside reader p50 | reader query p50 | "
        "eval report | drift window | drift reference | run summary | traffic rows | compact | peak RSS | append p50, sizes interleaved |"
    )
    print("|" + "---|" * 16)
    rows = [{**r, "interleaved_s": t} for r, t in zip(rows, interleaved)]
    for r in rows:
        print(
            f"| {r['size']} | {r['on_disk_bytes'] / 2**20:.0f} MiB | {r['snapshot_bytes'] / 2**20:.1f} MiB | {r['live_parts']} | "
            f"{r['move_into_parts_s']:.1f} s, {r['move_peak_rss_mb'] / 1024:.1f} GiB | "
            f"{med(r['append_s']) * 1e3:.0f} / {max(r['append_s']) * 1e3:.0f} ms | {med(r['append_beside_reader_s']) * 1e3:.0f} ms | "
            f"{med(r['reader_query_s']) * 1e3:.0f} ms | {r['eval_report_s'] * 1e3:.0f} ms | {r['drift_window_s'] * 1e3:.0f} ms | "
            f"{r['drift_reference_s'] * 1e3:.0f} ms | {r['training_run_summary_s'] * 1e3:.0f} ms | {r['traffic_rows_s'] * 1e3:.0f} ms | "
            f"{r['compact_s']:.1f} s | {r['peak_rss_mb']:.0f} MiB | {med(r['interleaved_s']) * 1e3:.0f} ms "
            f"({med(r['interleaved_s']) / med(rows[0]['interleaved_s']):.2f}x the first size) |"
        )


def appends_interleaved(folders: list[Path], appends: int) -> list[list[float]]:
    """Step appends to each data directory in turn, ``appends`` rounds: the same moment's load for every size."""
    from resources import Warehouse

    warehouses = [Warehouse(database=str(folder / "rlvr.duckdb")) for folder in folders]
    runs = [w.query("SELECT max(run_id) AS r FROM rollouts")["r"].iloc[0] for w in warehouses]
    times: list[list[float]] = [[] for _ in folders]
    first = 20_000_000 + int(time.time()) % 1_000_000 * 10
    for k in range(appends):
        for i, warehouse in enumerate(warehouses):
            times[i].append(step_append(warehouse, runs[i], first + k))
    return times


if __name__ == "__main__":
    main()
