"""The row kernels against oneDNN's packed GEMM by row count: where ``row_kernels.MAX_ROWS`` comes from.

    python bench/row_kernels.py .rlvr/models/base_policy/<version> --rows 1 2 3 4 6 8

On the checkpoint's config (random weights: timings depend on shapes only), float32, this process's
threads: every linear layer once on ``rows`` token rows (one decode step's projections, the output head
included), grouped as the fused decoder runs them (q/k/v side by side, o, gate/up side by side, down
with its SiLU gate), through ``row_kernels.linear`` and through oneDNN's
packed weights (``packed_linears``, the gate applied apart); median ms of ``--repeats`` runs of
``--steps`` steps, and the ratio.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: `bench` and this tree's rlvr, also as `python bench/x.py`

from bench.harness import median_ms, random_weights_model  # noqa: E402
from rlvr.fastpaths import row_kernels  # noqa: E402
from rlvr.fastpaths.packed_linear import packed_linears  # noqa: E402


def groups(model) -> list[tuple[list[torch.nn.Linear], bool]]:
    """A step's projections as the fused decoder groups them, and whether the group takes the SiLU-gated
    input (down: gate and up side by side): each layer's q/k/v, o, gate/up and down, then the output head."""
    out = []
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        out += [([attention.q_proj, attention.k_proj, attention.v_proj], False), ([attention.o_proj], False)]
        out += [([mlp.gate_proj, mlp.up_proj], False), ([mlp.down_proj], True)]
    return out + [([model.lm_head], False)]


def step(model, rows: int, steps: int, kernels: bool):
    """``steps`` steps of every group on ``rows`` rows: through the row kernels, or (``kernels`` False)
    through ``nn.Linear`` (oneDNN's packed weights while :func:`packed_linears` holds them)."""
    work = []
    for group, gated in groups(model):
        width = group[0].in_features
        work.append((group, row_kernels.weights(group), gated, torch.randn(rows, 2 * width if gated else width)))

    def run() -> None:
        for _ in range(steps):
            for group, weights, gated, inputs in work:
                if kernels:
                    row_kernels.linear(weights, inputs, gated=gated)
                    continue
                if gated:
                    gate, up = inputs.chunk(2, dim=-1)
                    inputs = F.silu(gate) * up
                for layer in group:
                    layer(inputs)

    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a Hugging Face checkpoint folder (only its config is read)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if not row_kernels.available():
        raise SystemExit("the row kernels are not built here (no C++ compiler?): see `python -m rlvr.fastpaths.row_kernels`")
    model = random_weights_model(args.model, torch.float32).eval().requires_grad_(False)
    print(f"float32, {torch.get_num_threads()} threads; ms per step's projections, median of {args.repeats} x {args.steps} steps")
    print(f"the engine's MAX_ROWS: {row_kernels.MAX_ROWS}\n")
    print("| rows | row kernels ms | oneDNN packed ms | row kernels speed |")
    print("|---|---|---|---|")
    for rows in args.rows:
        with torch.inference_mode():
            ours = median_ms(step(model, rows, args.steps, kernels=True), args.repeats) / args.steps
            with packed_linears(model, rows):
                onednn = median_ms(step(model, rows, args.steps, kernels=False), args.repeats) / args.steps
        print(f"| {rows} | {ours:.1f} | {onednn:.1f} | {onednn / ours:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
