"""What tool calling costs the engine: ``generate_rollouts`` with no environment against the calculator.

    OMP_NUM_THREADS=1 python bench/tool_rollouts.py /tmp/smol --prompts 4 --samples 8 --new-tokens 256

Both runs sample the same GSM8k prompts under the calculator's system prompt at T=1, alternating,
``--repeats`` times after a warm-up; use a policy that calls the calculator (``sft_policy`` trained in
it). Prints one JSON line: per run, median seconds, policy and total tokens/s and calls per completion.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: `bench` and this tree's rlvr, also as `python bench/x.py`

from rlvr.environments.calculator import Calculator  # noqa: E402
from rlvr.generation import Rollouts, SamplingConfig, generate_rollouts  # noqa: E402
from rlvr.policy import load_policy  # noqa: E402
from rlvr.settings import Settings  # noqa: E402
from rlvr.tasks.gsm8k.dataset import load_local  # noqa: E402
from rlvr.tasks.gsm8k.prompt import render_prompt, system_prompt_for  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="a policy checkpoint")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    model, tokenizer = load_policy(args.checkpoint, "cpu")
    model.eval().requires_grad_(False)
    questions = [p.question for p in load_local(Settings.from_env().gsm8k_dir) if p.split == "test"][: args.prompts]
    environments = {"none": None, "calculator": Calculator()}
    system_prompt = system_prompt_for(environments["calculator"])
    prompts = [tokenizer(render_prompt(tokenizer, q, system_prompt), add_special_tokens=False).input_ids for q in questions]

    def rollout(name: str) -> Rollouts:
        config = SamplingConfig(max_new_tokens=args.new_tokens, temperatures=[1.0], environment=environments[name])
        return generate_rollouts(model, tokenizer, prompts, args.samples, config)

    seconds: dict[str, list[float]] = {name: [] for name in environments}
    last: dict[str, Rollouts] = {}
    for name in environments:  # warm-up: packing, caches
        rollout(name)
    for _ in range(args.repeats):
        for name in environments:
            started = time.perf_counter()
            last[name] = rollout(name)
            seconds[name].append(time.perf_counter() - started)
    report = {"checkpoint": str(args.checkpoint), "prompts": args.prompts, "samples": args.samples, "new_tokens": args.new_tokens}
    report["threads"] = torch.get_num_threads()
    for name, out in last.items():
        median = statistics.median(seconds[name])
        report[name] = {
            "median_s": round(median, 3),
            "policy_tokens_per_s": round(int(out.policy_mask.sum()) / median, 1),
            "total_tokens_per_s": round(int(out.completion_mask.sum()) / median, 1),
            "calls_per_completion": round(sum(map(len, out.tool_calls)) / len(out), 3),
            "mean_completion_tokens": round(float(out.completion_lengths.float().mean()), 1),
        }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
