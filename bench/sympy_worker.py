"""What a symbolic check's time limit costs: a round trip to the reused sympy worker against a fork per call.

    python bench/sympy_worker.py --calls 500

``rlvr.rewards.sympy_worker.run_bounded`` sends each math-verify comparison to a warm worker process it can
kill past the limit. Prints the first call (the worker's start and imports), the median and max round trip of
a trivial call, the same through a fork per call from a process with math-verify loaded, a restart, and the
worker's memory.
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: this tree's rlvr, also as `python bench/x.py`

import math_verify  # noqa: E402, F401 - loaded as in a reward worker

from rlvr.rewards import sympy_worker  # noqa: E402


def timed_ms(call, n: int) -> tuple[float, float]:
    """(median, max) milliseconds of ``n`` calls."""
    seconds = []
    for _ in range(n):
        started = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds) * 1e3, max(seconds) * 1e3


def forked_call() -> None:
    """``len("x")`` in a forked child, its value back through a pipe."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(write, pickle.dumps(len("x")))
        os._exit(0)
    os.close(write)
    pickle.loads(os.read(read, 1 << 16))
    os.close(read)
    os.waitpid(pid, 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=500)
    args = parser.parse_args()
    started = time.perf_counter()
    sympy_worker.run_bounded(len, "x")
    print(f"first call (the worker's start and imports): {time.perf_counter() - started:.2f} s")
    print("reused worker, round trip: median %.3f ms, max %.3f ms" % timed_ms(lambda: sympy_worker.run_bounded(len, "x"), args.calls))
    print("fork per call: median %.3f ms, max %.3f ms" % timed_ms(forked_call, max(1, args.calls // 2)))
    worker = sympy_worker._WORKERS.all[0]
    started = time.perf_counter()
    worker.restart()
    sympy_worker.run_bounded(len, "x")
    print(f"restart to the next answer: {time.perf_counter() - started:.2f} s")
    with open(f"/proc/{worker.process.pid}/status") as status:
        print("worker memory:", next(" ".join(line.split()) for line in status if line.startswith("VmRSS")))


if __name__ == "__main__":
    main()
