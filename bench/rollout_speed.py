"""Training rollouts' completion tokens/s through each given source tree, in one invocation (before and after).

    python bench/rollout_speed.py /tmp/smol --trees /tmp/before . --prompts 8 --samples 8 --new-tokens 128
    python bench/rollout_speed.py --family qwen3 --trees /tmp/before .

Each tree's ``generate_rollouts`` runs in its own process on the same prompts and budget (no end token,
so equal work), the trees taking turns for ``--rounds``. ``--family qwen3`` builds a random-weight Qwen3
of the embedded model's shapes. Prints median tokens/s and each tree's ratio to the first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: `bench` and this tree's rlvr, also as `python bench/x.py`

from bench.harness import questions  # noqa: E402

WORKER = r"""
import json, sys, time, torch
args = json.loads(sys.argv[1])
try:
    from rlvr.generation import SamplingConfig, generate_rollouts
except ImportError:
    from rlvr.rollout import SamplingConfig, generate_rollouts
from rlvr.policy import load_policy, load_tokenizer
from rlvr.tasks.gsm8k.prompt import render_prompt
tokenizer = load_tokenizer(args["checkpoint"])
if args["family"] == "qwen3":
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=2048, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(config).eval()
else:
    model, tokenizer = load_policy(args["checkpoint"])
model.requires_grad_(False)
prompts = [render_prompt(tokenizer, q) for q in args["questions"]]
config = SamplingConfig(max_new_tokens=args["new_tokens"], temperatures=[1.0], seed=0, stop_token_ids=[])
generate_rollouts(model, tokenizer, prompts[:1], 1, SamplingConfig(max_new_tokens=4, stop_token_ids=[]))
started = time.perf_counter()
out = generate_rollouts(model, tokenizer, prompts, args["samples"], config)
elapsed = time.perf_counter() - started
print(json.dumps({"tokens_per_s": int(out.completion_mask.sum()) / elapsed, "threads": torch.get_num_threads()}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", nargs="?", default="/tmp/smol", help="the embedded model's checkpoint folder (its tokenizer for --family qwen3)")
    parser.add_argument("--trees", nargs="+", required=True, help="source trees to compare, the first is the baseline")
    parser.add_argument("--family", choices=("checkpoint", "qwen3"), default="checkpoint")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    payload = {"checkpoint": args.checkpoint, "family": args.family, "samples": args.samples, "new_tokens": args.new_tokens}
    payload["questions"] = questions(args.prompts)
    rates: dict[str, list[float]] = {tree: [] for tree in args.trees}
    threads: dict[str, int] = {}
    for _ in range(args.rounds):
        for tree in args.trees:
            env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
            done = subprocess.run([sys.executable, "-c", WORKER, json.dumps(payload)], env=env, cwd=tree, capture_output=True, text=True, check=True)
            result = json.loads(done.stdout.strip().splitlines()[-1])
            rates[tree].append(result["tokens_per_s"])
            threads[tree] = result["threads"]
    base = statistics.median(rates[args.trees[0]])
    rows = args.prompts * args.samples
    print(f"{args.family}: {args.prompts} prompts x {args.samples} samples x {args.new_tokens} tokens ({rows} rows), median of {args.rounds}\n")
    print("| tree | torch threads | completion tokens/s | vs first |\n|---|---|---|---|")
    for tree in args.trees:
        median = statistics.median(rates[tree])
        print(f"| {tree} | {threads[tree]} | {median:.1f} | {median / base:.2f}x |")


if __name__ == "__main__":
    main()
