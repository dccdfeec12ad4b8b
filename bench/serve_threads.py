"""The served policy's decode speed on a host another torch job keeps busy: no thread variable (the engine
picks its threads) against ``OMP_NUM_THREADS=1``, in one invocation.

    python bench/serve_threads.py /tmp/smol --requests 5 --max-tokens 64

The Bento is built from the checkpoint and served as the README says (``bentoml serve``), once without
``OMP_NUM_THREADS``/``RLVR_THREADS`` and once with ``OMP_NUM_THREADS=1``, while a second process runs
512x512 float32 matmuls in a loop with torch's default threads. Each server answers ``--requests``
greedy ``/v1/completions`` requests one after another (after a warm-up); reports the median
milliseconds per completion token and the ratio of the two.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: `bench` and this tree's rlvr, also as `python bench/x.py`

from bench.harness import ServedBento, build_served_bento, post, questions  # noqa: E402

MODEL = "bench"  # the served model's name (its version label, as bench/serve_mixed.py names it)
BUSY = "import torch\na = torch.randn(512, 512)\nwhile True:\n    a @ a"


def ms_per_token(server: ServedBento, prompts: list[str], max_tokens: int) -> list[float]:
    times = []
    for prompt in prompts:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stop": []}
        started = time.perf_counter()
        status, out = post(server.url + "/v1/completions", body, 600)
        if status != 200:
            raise RuntimeError(f"/v1/completions answered {status}: {out}")
        times.append(1000 * (time.perf_counter() - started) / max(1, out["usage"]["completion_tokens"]))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    for name in ("OMP_NUM_THREADS", "RLVR_THREADS"):
        os.environ.pop(name, None)
    work = Path(tempfile.mkdtemp(prefix="rlvr-serve-threads-"))
    busy = subprocess.Popen([sys.executable, "-c", BUSY])
    results = {}
    try:
        home = work / "bentoml"
        built = build_served_bento(args.checkpoint, home, MODEL)
        prompts = questions(args.requests)
        for label, threads in (("no thread variable", None), ("OMP_NUM_THREADS=1", 1)):
            with ServedBento(built.tag, home, work / f"traffic-{threads}", True, threads, work / f"serve-{threads}.log") as server:
                server.wait_ready(600)
                ms_per_token(server, prompts[:1], 8)  # warm-up
                results[label] = statistics.median(ms_per_token(server, prompts, args.max_tokens))
                print(f"{label}: {results[label]:.1f} ms per token", flush=True)
    finally:
        busy.kill()
        busy.wait()
        shutil.rmtree(work, ignore_errors=True)
    base = results["OMP_NUM_THREADS=1"]
    print(f"\n{args.requests} greedy /v1/completions of {args.max_tokens} tokens, one at a time; another process keeps the cores busy\n")
    print("| server | ms per token (median) | vs OMP_NUM_THREADS=1 |\n|---|---|---|")
    for label, value in results.items():
        print(f"| {label} | {value:.1f} | {value / base:.2f}x |")


if __name__ == "__main__":
    main()
