"""How fast does ``humaneval_tests`` grade? HumanEval answers through ``RewardPool``, as a training step scores them.

    python bench/code_grading.py --n 328 --workers 2

Builds ``--n`` answers over the 164 problems in turn, as the assistant writes them after the task's
completion prefix: the canonical solution as a whole script, the canonical body alone, a body that
returns None, a body that raises; ``--loops`` adds that fraction of infinite loops (each costs the CPU
limit). Prints graded answers per second over the whole batch, and p50/p99 of one answer's grading
(both sandboxes, from spawn to verdict). Checks every canonical answer passed and every broken one failed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: `bench` and this tree's rlvr, also as `python bench/x.py`

from bench.harness import percentile  # noqa: E402
from rlvr.rewards import RewardPool  # noqa: E402
from rlvr.tasks.humaneval import humaneval_problem, humaneval_records  # noqa: E402

KINDS = ("script", "body", "none", "raise")


def answers(n: int, loops: float) -> tuple[list[str], list[dict], list[bool]]:
    """(completions, references, should pass) for ``n`` answers, problems and kinds in turn."""
    records = humaneval_records()
    completions, references, expected = [], [], []
    every = round(1 / loops) if loops > 0 else 0
    for i in range(n):
        record = records[i % len(records)]
        kind = "loop" if every and i % every == every - 1 else KINDS[(i // len(records) + i) % len(KINDS)]
        code = {
            "script": record["prompt"] + record["canonical_solution"],
            "body": record["canonical_solution"],
            "none": "    return None\n",
            "raise": "    raise ValueError('broken')\n",
            "loop": "    while True:\n        pass\n",
        }[kind]
        completions.append(code.rstrip("\n") + "\n```")
        references.append(humaneval_problem(record, record["task_id"]).reference)
        expected.append(kind in ("script", "body"))
    return completions, references, expected


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=328, help="answers to grade")
    parser.add_argument("--workers", type=int, default=2, help="RewardPool worker processes")
    parser.add_argument("--loops", type=float, default=0.0, help="fraction of answers that loop forever")
    args = parser.parse_args()

    completions, references, expected = answers(args.n, args.loops)
    with RewardPool(workers=args.workers) as pool:
        pool.score_batch({"humaneval_tests": 1.0}, completions[:2], references[:2])  # start the workers
        start = time.perf_counter()
        scored = pool.score_batch({"humaneval_tests": 1.0}, completions, references)
        elapsed = time.perf_counter() - start
    results = [s["humaneval_tests"] for s in scored]
    wrong = [i for i, (r, e) in enumerate(zip(results, expected)) if (r.value == 1.0) != e]
    latencies = sorted(r.details.get("wall_time_s", 0.0) for r in results)
    p99 = percentile(latencies, 99)
    print(f"{args.n} answers ({sum(expected)} correct), {args.workers} workers: {elapsed:.1f} s, {args.n / elapsed:.1f} graded answers/s")
    print(f"one answer: p50 {statistics.median(latencies) * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms")
    if wrong:
        raise SystemExit(f"{len(wrong)} answers graded against expectation, e.g. {[results[i].details for i in wrong[:3]]}")


if __name__ == "__main__":
    main()
