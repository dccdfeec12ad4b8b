"""The linear kernels against oneDNN's packed GEMM by row count, every layer's weights from memory.

    python bench/linear_kernels.py .rlvr/models/base_policy/<version> --rows 1 4 8 32 256

On the checkpoint's config (random weights: timings depend on shapes only), float32 (``--dtype bfloat16``:
bf16, the trainer's rollout copy), this process's threads: every linear layer once on ``rows`` token rows
(one decode step's projections, the output head included), grouped as the fused decoder runs them (q/k/v
side by side, o with the residual, gate/up side by side, down with its SiLU gate and the residual), through
``linear_kernels.linear`` on panels and through oneDNN's weights packed for ``rows`` rows (the gate and
residual applied apart, as the fused decoder does); median ms of ``--repeats`` runs of ``--steps`` steps.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: `bench` and this tree's rlvr, also as `python bench/x.py`

from bench.harness import median_ms, random_weights_model  # noqa: E402
from rlvr.fastpaths import linear_kernels  # noqa: E402
from rlvr.fastpaths.fused_decode import Projection  # noqa: E402


def groups(model) -> list[tuple[list[torch.nn.Linear], bool, bool]]:
    """A step's projections as the fused decoder groups them, whether the group takes the SiLU-gated input
    (down: gate and up side by side) and whether it adds the residual: each layer's q/k/v, o, gate/up and
    down, then the output head."""
    out = []
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        out += [([attention.q_proj, attention.k_proj, attention.v_proj], False, False), ([attention.o_proj], False, True)]
        out += [([mlp.gate_proj, mlp.up_proj], False, False), ([mlp.down_proj], True, True)]
    return out + [([model.lm_head], False, False)]


def step(model, rows: int, steps: int, panels: bool):
    """``steps`` steps of every group on ``rows`` rows through the fused decoder's projections: on panels
    (the linear kernels) or on oneDNN's packed weights."""
    work = []
    dtype = model.dtype
    for group, gated, residual in groups(model):
        width, outputs = group[0].in_features, sum(layer.out_features for layer in group)
        inputs = torch.randn(rows, 2 * width if gated else width, dtype=dtype)
        work.append((Projection(group, rows, panels), gated, inputs, torch.randn(rows, outputs, dtype=dtype) if residual else None))

    def run() -> None:
        for _ in range(steps):
            for projection, gated, inputs, residual in work:
                projection(inputs, residual, gated)

    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a Hugging Face checkpoint folder (only its config is read)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 256])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if not linear_kernels.available(dtype):
        raise SystemExit(f"the linear kernels are not built here for {args.dtype}: see `python -m rlvr.fastpaths.linear_kernels`")
    model = random_weights_model(args.model, dtype).eval().requires_grad_(False)
    print(f"{args.dtype}, {torch.get_num_threads()} threads; ms per step's projections, median of {args.repeats} x {args.steps} steps\n")
    print("| rows | linear kernels ms | oneDNN packed ms | linear kernels' speed |")
    print("|---|---|---|---|")
    for rows in args.rows:
        with torch.inference_mode():
            ours = median_ms(step(model, rows, args.steps, panels=True), args.repeats) / args.steps
            onednn = median_ms(step(model, rows, args.steps, panels=False), args.repeats) / args.steps
        print(f"| {rows} | {ours:.1f} | {onednn:.1f} | {onednn / ours:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
