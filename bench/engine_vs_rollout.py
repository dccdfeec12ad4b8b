"""Training's rollouts through ``rlvr.rollout.generate_rollouts`` (static batch, finished rows dropped)
against the same rollouts through ``rlvr.engine.Engine`` (iteration-level scheduling), in one invocation:
does the trainer gain from the serving engine?

    OMP_NUM_THREADS=1 python bench/engine_vs_rollout.py /tmp/smol --prompts 4 --samples 8 --new-tokens 128

Both get the same prompts (GSM8k questions in the chat template), samples, temperature and token budget
(no end token stops a row: every row decodes the whole budget, so the work is equal); each is timed
``--repeats`` times after a warm-up, alternating. Reports completion tokens/s of each and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_load import questions  # noqa: E402

from rlvr.generation import Engine, EngineRequest, SamplingConfig, generate_rollouts  # noqa: E402
from rlvr.policy import load_policy  # noqa: E402
from rlvr.prompts import render_prompt  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    model, tokenizer = load_policy(args.checkpoint, "cpu")
    model.eval().requires_grad_(False)
    prompts = [tokenizer(render_prompt(tokenizer, q), add_special_tokens=False).input_ids for q in questions(args.prompts)]
    tokens = args.prompts * args.samples * args.new_tokens

    def rollout() -> None:
        config = SamplingConfig(max_new_tokens=args.new_tokens, temperatures=[1.0], stop_at_final_answer=False, stop_token_ids=[])
        out = generate_rollouts(model, tokenizer, prompts, args.samples, config)
        assert int(out.completion_lengths.sum()) == tokens

    engine = Engine(model, tokenizer, max_rows=max(64, args.prompts * args.samples), kv_budget_bytes=4 * 2**30, max_share=1.0)
    engine.stop_ids = set()

    def engined() -> None:
        requests = [EngineRequest(list(p), args.samples, (1.0,), args.new_tokens, stop_at_final_answer=False, seed=i) for i, p in enumerate(prompts)]
        for request in requests:
            engine.submit(request)
        engine._take_inbox(block=False)
        while any(q.done_s is None for q in requests):
            engine.step()
        assert sum(len(ids) for q in requests for ids in q.token_ids) == tokens

    timings: dict[str, list[float]] = {"rollout": [], "engine": []}
    with torch.inference_mode():
        rollout(), engined()  # warm-up: packing, caches
        for _ in range(args.repeats):
            for name, run in (("rollout", rollout), ("engine", engined)):
                started = time.perf_counter()
                run()
                timings[name].append(time.perf_counter() - started)
    print(f"{args.prompts} prompts x {args.samples} samples x {args.new_tokens} tokens, T=1, {torch.get_num_threads()} thread(s)\n")
    print("| path | median s | completion tok/s |")
    print("|---|---|---|")
    rates = {}
    for name, values in timings.items():
        rates[name] = tokens / statistics.median(values)
        print(f"| {name} | {statistics.median(values):.2f} | {rates[name]:.1f} |")
    print(f"\nengine / rollout: {rates['engine'] / rates['rollout']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
