"""Decode-step time of the rollout engine against its plain path and the weight-read bound, in one run.

    python bench/decode_step.py <checkpoint> --rows 8 128 --tokens 128 [--dtype bfloat16] [--from-config]

Per row count, the engine generates ``--tokens`` tokens per row with its fast paths (CUDA graphs on
CUDA, the fused decoder on CPU) and with them off; a step's time is (run of ``--tokens`` - run of 1) /
(``--tokens`` - 1), median of ``--repeats``. The bound reads the weights once per step at
``--bandwidth-gbs`` (default: the GPU's datasheet). ``--from-config`` uses random weights, so every
row runs to the budget.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: `bench` and this tree's rlvr, also as `python bench/x.py`

from bench.grpo_vs_trl import QUESTIONS  # noqa: E402
from bench.harness import bench_model, decode_step_ms, seconds  # noqa: E402
from rlvr.fastpaths import FastPaths  # noqa: E402
from rlvr.generation import SamplingConfig, generate_rollouts  # noqa: E402
from rlvr.tasks.gsm8k.prompt import render_prompt  # noqa: E402

DATASHEET_BANDWIDTH_GBS = {"H200": 4800.0, "H100 NVL": 3900.0, "H100 PCIe": 2000.0, "H100": 3350.0, "A100-SXM4-80GB": 2039.0, "A100": 1555.0}
PLAIN = FastPaths(fused_decode=False, packed_linears=False, cuda_graphs=False)


def generation_time(model, tokenizer, prompts: list[str], samples: int, tokens: int, fast: FastPaths, device: str) -> float:
    config = SamplingConfig(max_new_tokens=tokens, temperatures=[1.0], seed=0, max_batch_rows=len(prompts) * samples, fast_paths=fast)
    return seconds(lambda: generate_rollouts(model, tokenizer, prompts, samples, config), cuda=device.startswith("cuda"))


def step_ms(model, tokenizer, rows: int, tokens: int, fast: FastPaths, device: str, repeats: int) -> float:
    prompts = [render_prompt(tokenizer, QUESTIONS[i % len(QUESTIONS)][0]) for i in range(max(1, rows // 8))]
    samples = rows // len(prompts)
    run = lambda new_tokens: generation_time(model, tokenizer, prompts, samples, new_tokens, fast, device)
    run(tokens)  # warm-up: graph capture, allocator
    return decode_step_ms(run, tokens, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 128], help="rows decoded together (up to 8, or multiples of 8)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--bandwidth-gbs", type=float, help="memory bandwidth of the weight-read bound (default: the GPU's datasheet figure)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--from-config", action="store_true", help="random weights from the folder's config: rows run to the budget")
    args = parser.parse_args()
    if any(rows > 8 and rows % 8 for rows in args.rows):
        parser.error("--rows above 8 must be multiples of 8 (prompts of 8 samples each)")
    if args.tokens < 2:
        parser.error("--tokens must be at least 2 (a step is the difference between a run of --tokens and one of 1)")
    if args.bandwidth_gbs is None:  # before the model loads: a CPU has no datasheet entry
        name = torch.cuda.get_device_name() if args.device.startswith("cuda") else ""
        known = [gbs for card, gbs in DATASHEET_BANDWIDTH_GBS.items() if card in name]
        if not known:
            parser.error(f"no datasheet bandwidth for {name or 'this CPU'}: give --bandwidth-gbs")
        args.bandwidth_gbs = known[0]
    model, tokenizer = bench_model(args.model, args.device, getattr(torch, args.dtype), args.from_config)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bound_ms = weight_bytes / (args.bandwidth_gbs * 1e9) * 1000
    for rows in args.rows:
        fast = step_ms(model, tokenizer, rows, args.tokens, FastPaths(), args.device, args.repeats)
        plain = step_ms(model, tokenizer, rows, args.tokens, PLAIN, args.device, args.repeats)
        report = {
            "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
            "dtype": args.dtype,
            "rows": rows,
            "engine_ms_per_step": round(fast, 3),
            "plain_forward_ms_per_step": round(plain, 3),
            "speedup": round(plain / fast, 2),
            "weight_read_bound_ms": round(bound_ms, 4),
            "engine_over_bound": round(fast / bound_ms, 1),
        }
        if args.device.startswith("cuda"):
            report["max_gpu_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
