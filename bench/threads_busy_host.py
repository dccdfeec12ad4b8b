"""Decode speed on a host another torch job keeps busy: torch's default threads, ``rlvr.cpu_threads.pick_threads()``, 1 thread.

    python bench/threads_busy_host.py [<checkpoint>] [--tokens 32] [--repeats 3]

Without a checkpoint: a Llama of hidden size 256, 4 layers, 32k vocabulary, random weights (seed 0).
One sequence, greedy, one model forward per token on a KV cache; a step's time excludes the prefill.
A second process runs 512x512 float32 matmuls in a loop with torch's default threads (it counts
them: the load's own rate is reported too). Each condition runs ``--repeats`` times, interleaved,
after a warm-up; medians. ``$OMP_NUM_THREADS`` and ``$RLVR_THREADS`` are cleared first, so
"default" is torch's own default, in both processes.
"""

from __future__ import annotations

import os

USER_THREADS = {name: os.environ.pop(name) for name in ("OMP_NUM_THREADS", "RLVR_THREADS") if name in os.environ}  # before torch loads

import argparse  # noqa: E402
import multiprocessing  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: `bench` and this tree's rlvr, also as `python bench/x.py`

from rlvr.cpu_threads import cpus_busy_elsewhere, pick_threads, usable_cpus  # noqa: E402
from rlvr.policy import load_policy  # noqa: E402

DEFAULT_THREADS = torch.get_num_threads()


def tiny_llama() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=32_000,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=1024,
        max_position_embeddings=1024,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


@torch.inference_mode()
def decode_s_per_token(model, prompt_len: int, tokens: int) -> float:
    """Seconds per decode step of one greedy sequence, prefill excluded."""
    ids = torch.arange(1, prompt_len + 1).unsqueeze(0)
    cache = DynamicCache()
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    started = time.perf_counter()
    for _ in range(tokens):
        ids = out.logits[:, -1:].argmax(-1)
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    return (time.perf_counter() - started) / tokens


def matmul_load(count, stop) -> None:
    """The other job: float32 matmuls with torch's default threads until ``stop`` is set."""
    a = torch.randn(512, 512)
    while not stop.is_set():
        a = torch.tanh(a @ a)
        with count.get_lock():
            count.value += 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, nargs="?", help="a saved policy (default: a tiny Llama from a config)")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = load_policy(args.checkpoint, "cpu")[0].eval() if args.checkpoint else tiny_llama()
    before_busy, before_pick = cpus_busy_elsewhere(0.5), pick_threads()
    torch.set_num_threads(DEFAULT_THREADS)
    decode_s_per_token(model, args.prompt_tokens, 4)  # warm-up
    alone = statistics.median(decode_s_per_token(model, args.prompt_tokens, args.tokens) for _ in range(args.repeats))

    spawn = multiprocessing.get_context("spawn")
    count, stop = spawn.Value("q", 0), spawn.Event()
    load = spawn.Process(target=matmul_load, args=(count, stop), daemon=True)
    load.start()
    try:
        deadline = time.monotonic() + 60
        while count.value < 10:  # the load is running
            if time.monotonic() > deadline or not load.is_alive():
                raise RuntimeError("the matmul load did not start")
            time.sleep(0.05)
        under_busy, picked = cpus_busy_elsewhere(0.5), pick_threads()
        conditions = {"torch default": DEFAULT_THREADS, "pick_threads()": picked, "1 thread": 1}
        seconds: dict[str, list[float]] = {name: [] for name in conditions}
        load_rates: dict[str, list[float]] = {name: [] for name in conditions}
        for repeat in range(args.repeats + 1):
            for name, threads in conditions.items():
                torch.set_num_threads(threads)
                done, started = count.value, time.perf_counter()
                step_s = decode_s_per_token(model, args.prompt_tokens, args.tokens if repeat else 4)
                if repeat:  # 0: warm-up at this thread count
                    seconds[name].append(step_s)
                    load_rates[name].append((count.value - done) / (time.perf_counter() - started))
    finally:
        stop.set()
        load.join(10)
        if load.is_alive():
            load.kill()

    print(f"\n{args.checkpoint or 'tiny Llama (hidden 256, 4 layers, 32k vocab)'}: 1 sequence, {args.tokens} tokens after {args.prompt_tokens}")
    print(f"usable CPUs {usable_cpus()}, torch default threads {DEFAULT_THREADS}")
    print(f"before the load: {before_busy:.2f} CPUs busy elsewhere, pick_threads() {before_pick}; under it: {under_busy:.2f}, {picked}")
    if USER_THREADS:
        print(f"(cleared for this run: {USER_THREADS})")
    print(f"\nbefore the load, torch default threads: {alone * 1000:.1f} ms/token, {1 / alone:.1f} tokens/s\n")
    print("| decode threads, other job busy | threads | ms/token | tokens/s | vs default | other job's matmuls/s |")
    print("|---|---|---|---|---|---|")
    default_s = statistics.median(seconds["torch default"])
    for name, threads in conditions.items():
        step_s = statistics.median(seconds[name])
        print(f"| {name} | {threads} | {step_s * 1000:.1f} | {1 / step_s:.1f} | {default_s / step_s:.2f}x | {statistics.median(load_rates[name]):.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
