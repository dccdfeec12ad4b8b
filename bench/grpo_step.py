"""Time GRPO steps on a real policy: ``python bench/grpo_step.py <checkpoint> --prompts 2 --group 4 --tokens 128``.

Uses a minimal correctness reward (strict ``#### <number>`` match) so that it depends on the
core only. Prints each step's timing breakdown, throughput, and the kernel time and page faults
it cost (``--no-keep-freed-memory`` leaves glibc's malloc at its defaults, see ``rlvr/fastpaths/heap.py``).
Runs on CUDA when there is a GPU (``--device``), reporting the peak GPU memory too; ``--from-config``
builds the model with random weights from a folder holding only the config and tokenizer files,
for machines the checkpoint cannot be copied to; ``--engine vllm`` generates the rollouts with vLLM.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: `bench` and this tree's rlvr, also as `python bench/x.py`

from bench.grpo_vs_trl import QUESTIONS, correctness_reward  # noqa: E402
from bench.harness import bench_model  # noqa: E402
from rlvr.fastpaths import FastPaths  # noqa: E402
from rlvr.generation import SamplingConfig  # noqa: E402
from rlvr.generation.generator import EngineConfig  # noqa: E402
from rlvr.grpo import GRPOConfig, GRPOTrainer  # noqa: E402
from rlvr.tasks.gsm8k.prompt import render_prompt  # noqa: E402


def correctness_rewards(completions: list[str], problems: list[dict]) -> tuple[list[float], dict[str, list[float]]]:
    """Each completion's correctness reward, and the same scores as the trainer's reward breakdown."""
    scores = [correctness_reward(text, problem["answer_value"]) for text, problem in zip(completions, problems)]
    return scores, {"correctness": scores}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--compute-dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="auto: the backend plan's choice")
    parser.add_argument("--no-keep-freed-memory", action="store_true", help="leave glibc's malloc at its defaults")
    parser.add_argument("--engine", default="auto", choices=["auto", "native", "vllm"], help="the rollout engine (rollout.engine)")
    parser.add_argument("--kv-cache-gib", type=float, default=None, help="vLLM's KV cache (default: vLLM's)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--from-config",
        action="store_true",
        help="random weights built from the folder's config (it needs only config and tokenizer files): "
        "timings depend on shapes only, completions are noise and run to the token budget",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = bench_model(args.model, args.device, torch.float32, args.from_config)
    problems = [{"prompt": render_prompt(tokenizer, q), "answer_value": a, "problem_id": f"bench-{i}"} for i, (q, a) in enumerate(QUESTIONS)]
    config = GRPOConfig(
        group_size=args.group,
        prompts_per_step=args.prompts,
        sampling=SamplingConfig(max_new_tokens=args.tokens, temperatures=[0.7, 0.8, 0.9, 1.0]),
        lr=1e-6,
        total_steps=args.steps,
        micro_batch_size=args.micro_batch,
        compute_dtype=args.compute_dtype,
        fast_paths=FastPaths(keep_freed_memory=not args.no_keep_freed_memory),
        skip_zero_variance=False,  # time the full update even when every reward is equal
        rollout=EngineConfig(engine=args.engine, kv_cache_gib=args.kv_cache_gib),
    )
    trainer = GRPOTrainer(model, tokenizer, config, correctness_rewards)
    for _ in range(args.steps):
        started, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        batch = [problems[(trainer.step_count * args.prompts + i) % len(problems)] for i in range(args.prompts)]
        metrics, _ = trainer.step(batch)
        keys = ("gen_time_s", "update_time_s", "step_time_s", "tokens_per_s", "completion_len_mean", "reward_mean")
        keys += ("ratio_mean", "clip_frac", "entropy")
        after = resource.getrusage(resource.RUSAGE_SELF)
        report = {k: round(metrics[k], 4 if k in ("ratio_mean", "clip_frac") else 2) for k in keys} | {
            "wall_s": round(time.perf_counter() - started, 2),
            "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 2),
            "system_cpu_s": round(after.ru_stime - before.ru_stime, 2),  # the kernel's share: page faults
            "page_faults": after.ru_minflt - before.ru_minflt,
            "gen_tokens_per_s": round(args.prompts * args.group * metrics["completion_len_mean"] / metrics["gen_time_s"], 1),
        }
        if args.device.startswith("cuda"):
            report["max_gpu_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
