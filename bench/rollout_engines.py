"""Training rollouts through the one generation interface, ours against vLLM, in one invocation:

    python bench/rollout_engines.py .rlvr/models/base_policy/<version> --prompts 4 --samples 8 --new-tokens 128

Each engine runs in its own process (``make_generator`` as the trainer calls it) on the same GSM8k prompts
and budget, no end token (equal work), sampled at temperature 1 (``--top-p`` below 1: from the nucleus), after one warm-up call; the engines take
turns for ``--rounds``. ``--calls N``: each process generates N times, each call on prompts of its own (as a trainer's steps), and the
first call and the later ones' median are told apart. ``--dtype``: the weights' (float32, or bfloat16 as the trainer's rollout copy);
``--device cuda`` on a GPU. Prints each round's completion tokens/s, the medians and ours over vLLM's.
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
from rlvr.generation import SamplingConfig
from rlvr.generation.generator import EngineConfig, make_generator
from rlvr.policy import load_policy
from rlvr.tasks.gsm8k.prompt import render_prompt
model, tokenizer = load_policy(args["checkpoint"], args["device"], getattr(torch, args["dtype"]))
prompts = [render_prompt(tokenizer, q) for q in args["questions"]]
generator = make_generator(EngineConfig(engine=args["engine"], kv_cache_gib=2), model.eval(), tokenizer)
config = SamplingConfig(max_new_tokens=args["new_tokens"], temperatures=[1.0], top_p=args["top_p"], stop_token_ids=[], seed=1)
speeds, per_call = [], len(prompts) // args["calls"]
with torch.inference_mode():
    list(generator.stream(prompts[:1], 1, SamplingConfig(max_new_tokens=8, temperatures=[1.0], stop_token_ids=[])))
    for call in range(args["calls"]):
        started = time.perf_counter()
        rollouts = [chunk for chunk in generator.stream(prompts[call * per_call : (call + 1) * per_call], args["samples"], config)]
        elapsed = time.perf_counter() - started
        speeds.append(sum(int(chunk.completion_mask.sum()) for chunk in rollouts) / elapsed)
print(json.dumps(speeds))
"""


def run(engine: str, args: argparse.Namespace) -> list[float]:
    """Each call's completion tokens/s in one process of ``engine``."""
    payload = dict(checkpoint=args.checkpoint, engine=engine, dtype=args.dtype, questions=questions(args.prompts * args.calls))
    payload |= dict(samples=args.samples, new_tokens=args.new_tokens, device=args.device, top_p=args.top_p, calls=args.calls)
    env = os.environ | {"VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, "-c", WORKER, json.dumps(payload)], capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        raise SystemExit(f"{engine} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--calls", type=int, default=1, help="calls per process, each on prompts of its own")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's top-p (1: off)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (vLLM's GPU build where it is installed)")
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    firsts: dict[str, list[float]] = {"native": [], "vllm": []}
    laters: dict[str, list[float]] = {"native": [], "vllm": []}
    for round_ in range(args.rounds):
        for engine in firsts:
            speeds = run(engine, args)
            firsts[engine].append(speeds[0])
            laters[engine] += speeds[1:]
            print(f"round {round_ + 1} {engine}: {' '.join(f'{s:.1f}' for s in speeds)} completion tok/s (call by call)", flush=True)
    for name, speeds in (("first calls", firsts), ("later calls", laters)):
        if speeds["native"]:
            native, vllm = (statistics.median(speeds[e]) for e in ("native", "vllm"))
            print(f"median of {name}: native {native:.1f}, vllm {vllm:.1f} tok/s; native / vllm = {native / vllm:.2f}x")


if __name__ == "__main__":
    main()
