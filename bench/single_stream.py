"""One request at a time: ours against llama.cpp on the same weights, in one invocation.

    python bench/single_stream.py <checkpoint> --gguf /tmp/smol-f32.gguf --llama-python /tmp/llama-venv/bin/python

Greedy, ``--new-tokens`` after a GSM8k prompt in the chat template (~150 tokens), no end token (equal work),
``--threads`` each: ours through ``generate_rollouts``, llama.cpp through llama-cpp-python (its own
environment) on a GGUF of the same checkpoint (its sdist's ``convert_hf_to_gguf.py --outtype f32``); the
same prompt token ids; each in a process of its own after one warm-up call, taking turns for ``--rounds``.
Prints tokens/s (prompt included in the time) and ours over llama.cpp's.
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

OURS = r"""
import json, sys, time, torch
args = json.loads(sys.argv[1])
from rlvr.generation import SamplingConfig, generate_rollouts
from rlvr.policy import load_policy
model, tokenizer = load_policy(args["checkpoint"], "cpu", torch.float32)
model.requires_grad_(False)  # served, not trained: its packed weights are kept from the warm-up on
config = SamplingConfig(max_new_tokens=args["new_tokens"], temperatures=[0.0], stop_token_ids=[])
generate_rollouts(model, tokenizer, [args["ids"]], 1, SamplingConfig(max_new_tokens=8, temperatures=[0.0], stop_token_ids=[]))
started = time.perf_counter()
out = generate_rollouts(model, tokenizer, [args["ids"]], 1, config)
print(json.dumps({"tokens": int(out.completion_mask.sum()), "seconds": time.perf_counter() - started}))
"""

LLAMA = r"""
import json, sys, time
args = json.loads(sys.argv[1])
from llama_cpp import Llama
llm = Llama(model_path=args["gguf"], n_ctx=1024, n_threads=args["threads"], n_threads_batch=args["threads"], verbose=False)
def run(n):
    llm.reset()
    tokens = []
    for token in llm.generate(args["ids"], temp=0.0, reset=True):
        tokens.append(token)
        if len(tokens) == n:
            return tokens
run(8)
started = time.perf_counter()
tokens = run(args["new_tokens"])
print(json.dumps({"tokens": len(tokens), "seconds": time.perf_counter() - started}))
"""


def run(code: str, python: str, payload: dict, threads: int) -> float:
    env = os.environ | {"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([python, "-c", code, json.dumps(payload)], capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result["tokens"] / result["seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("--gguf", required=True, help="the same weights as a GGUF file")
    parser.add_argument("--llama-python", required=True, help="a Python with llama-cpp-python installed")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from rlvr.policy import load_tokenizer
    from rlvr.tasks.gsm8k.prompt import render_prompt

    tokenizer = load_tokenizer(args.checkpoint)
    ids = tokenizer(render_prompt(tokenizer, questions(1)[0]), add_special_tokens=False).input_ids
    payload = dict(checkpoint=args.checkpoint, gguf=args.gguf, ids=ids, new_tokens=args.new_tokens, threads=args.threads)
    print(f"load average before: {os.getloadavg()[0]:.2f}; prompt {len(ids)} tokens, {args.new_tokens} new, {args.threads} threads")
    speeds: dict[str, list[float]] = {"ours": [], "llama.cpp": []}
    for round_ in range(args.rounds):
        speeds["ours"].append(run(OURS, sys.executable, payload, args.threads))
        speeds["llama.cpp"].append(run(LLAMA, args.llama_python, payload, args.threads))
        print(f"round {round_ + 1}: ours {speeds['ours'][-1]:.1f}, llama.cpp {speeds['llama.cpp'][-1]:.1f} tok/s", flush=True)
    ours, llama = statistics.median(speeds["ours"]), statistics.median(speeds["llama.cpp"])
    print(f"median: ours {ours:.1f}, llama.cpp {llama:.1f} tok/s; ours / llama.cpp = {ours / llama:.2f}x")


if __name__ == "__main__":
    main()
