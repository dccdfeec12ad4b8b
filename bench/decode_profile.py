"""Where a rollout's decode steps spend their time: torch.profiler tables of one warm rollout.

    python bench/decode_profile.py <checkpoint> --from-config --rows 8 128 --tokens 64 [--dtype bfloat16]

For each row count the engine generates ``--tokens`` tokens per row once to warm up (graph capture,
allocator) and once under the profiler, then prints the wall time, the kernels' total time on the
GPU and the host's waits on it (``cudaStreamSynchronize``) and graph launches, then the profiler's
tables sorted by device time and by host time. ``--from-config`` builds random weights from the
folder's config, so every row runs to the token budget (as ``bench/decode_step.py``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: `bench` and this tree's rlvr, also as `python bench/x.py`

from bench.grpo_vs_trl import QUESTIONS  # noqa: E402
from bench.harness import bench_model, seconds  # noqa: E402
from rlvr.fastpaths import FastPaths  # noqa: E402
from rlvr.generation import SamplingConfig, generate_rollouts  # noqa: E402
from rlvr.tasks.gsm8k.prompt import render_prompt  # noqa: E402


def rollout(model, tokenizer, prompts: list[str], samples: int, tokens: int, cuda: bool) -> float:
    config = SamplingConfig(max_new_tokens=tokens, temperatures=[1.0], seed=0, max_batch_rows=len(prompts) * samples, fast_paths=FastPaths())
    return seconds(lambda: generate_rollouts(model, tokenizer, prompts, samples, config), cuda=cuda)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 128], help="rows decoded together (up to 8, or multiples of 8)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--from-config", action="store_true", help="random weights from the folder's config: rows run to the budget")
    parser.add_argument("--top", type=int, default=25, help="rows of each profiler table")
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    model, tokenizer = bench_model(args.model, args.device, getattr(torch, args.dtype), args.from_config)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    for rows in args.rows:
        prompts = [render_prompt(tokenizer, QUESTIONS[i % len(QUESTIONS)][0]) for i in range(max(1, rows // 8))]
        samples = rows // len(prompts)
        rollout(model, tokenizer, prompts, samples, args.tokens, cuda)
        with torch.profiler.profile(activities=activities) as profile:
            wall = rollout(model, tokenizer, prompts, samples, args.tokens, cuda)
        events = profile.key_averages()
        calls = {event.key: event for event in events if event.key in ("cudaStreamSynchronize", "cudaGraphLaunch")}
        device_ms = sum(event.self_device_time_total for event in events) / 1000
        print(f"### {rows} rows x {args.tokens} tokens ({args.dtype}, {args.device}): wall {wall * 1000:.1f} ms", flush=True)
        if cuda:
            print(f"kernels' time on the GPU {device_ms:.1f} ms ({device_ms / args.tokens:.2f} ms per token)")
            for name, event in calls.items():
                print(f"{name}: {event.count} calls ({event.count / args.tokens:.1f} per token), {event.self_cpu_time_total / 1000:.1f} ms on the host")
            print(events.table(sort_by="self_cuda_time_total", row_limit=args.top, max_name_column_width=70))
        print(events.table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=70), flush=True)


if __name__ == "__main__":
    main()
