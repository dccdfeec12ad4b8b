"""The engine's CPU kernel choices, each timed against transformers' / torch's default, in one run.

    python bench/cpu_kernels.py .rlvr/models/base_policy/<version> --rows 8 --prompt 150 --completion 128

On the checkpoint's config with random weights: decode linears (packed oneDNN vs ``nn.Linear``), a
decode step (fused decoder vs the model's forward; its norms and rotary in PyTorch vs ``layer_kernels``), decode attention (GQA-packed and slot attention
vs SDPA), a prompt chunk's attention (prompt_attention vs SDPA), update forward + backward (``rlvr_sdpa``, unpadded), the output head (``head_logprobs``),
AdamW (``fused`` vs ``foreach``), a whole update (``keep_freed_memory`` vs glibc malloc), float32
and bf16, and sampling a step's rows (``sampling_kernel``). Prints a Markdown table: median ms of ``--repeats`` runs after a warm-up, and the ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Callable

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: `bench` and this tree's rlvr, also as `python bench/x.py`

from bench.harness import median_ms, random_weights_model  # noqa: E402
from rlvr.fastpaths import FastPaths  # noqa: E402
from rlvr.fastpaths.attention import use_fast_attention  # noqa: E402
from rlvr.fastpaths.eligibility import head_dim  # noqa: E402
from rlvr.fastpaths.fused_decode import fused_decoder, gqa_attention  # noqa: E402
from rlvr.fastpaths.heap import keep_freed_memory  # noqa: E402
from rlvr.fastpaths.packed_linear import packed_linears  # noqa: E402
from rlvr.fastpaths.prompt_attention import prompt_attention  # noqa: E402
from rlvr.fastpaths.slot_attention import prompt_slots, slot_attention  # noqa: E402
from rlvr.generation.sampler import sample_tokens  # noqa: E402
from rlvr.grpo.head import head_logprobs  # noqa: E402
from rlvr.grpo.loss import token_logprobs_and_entropy  # noqa: E402
from rlvr.grpo.scoring import CompletionScorer, PackedRows  # noqa: E402


def decode_step(model, rows: int, prompt: int, steps: int, mode: str) -> Callable[[], float]:
    """Seconds per decode step over ``steps`` steps after a ``prompt``-token prefill (not timed).
    ``mode``: "default" (the model's own forward on a ``DynamicCache``), "packed" (the model's forward
    on packed linears, last position's logits only), "fused" (``rlvr.fastpaths.fused_decode``) or
    "fused-torch" (the same, its norms and rotary in PyTorch: no layer kernels), each on a ``DynamicCache``."""
    ids = torch.randint(0, model.config.vocab_size, (rows, prompt))

    def timed() -> float:
        packing = packed_linears(model, rows) if mode == "packed" else contextlib.nullcontext()
        with torch.inference_mode(), packing:
            fused = fused_decoder(model, rows, FastPaths(layer_kernels=mode == "fused")) if mode.startswith("fused") else None
            cache = DynamicCache(config=model.config)
            model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            token, mask = ids[:, -1:], torch.ones(rows, prompt, dtype=torch.long)
            started = time.perf_counter()
            for t in range(steps):
                mask = torch.cat([mask, mask.new_ones(rows, 1)], dim=1)
                positions = torch.full((rows, 1), prompt + t)
                if fused is not None:
                    fused(token[:, 0], positions[:, 0], mask, cache)
                    continue
                inputs = dict(input_ids=token, attention_mask=mask, position_ids=positions, past_key_values=cache)
                model(**inputs, use_cache=True, logits_to_keep=1) if mode == "packed" else model(**inputs, use_cache=True)
            return (time.perf_counter() - started) / steps

    return timed


def decode_linears(model, rows: int, packed: bool) -> Callable[[], float]:
    """Seconds for every ``nn.Linear`` of ``model`` once on ``rows`` rows (one decode step's
    matrix products); packing the weights is not timed."""
    dtype = next(model.parameters()).dtype
    layers = [m for m in model.modules() if type(m) is torch.nn.Linear]
    inputs = [torch.randn(rows, 1, m.in_features, dtype=dtype) for m in layers]

    def timed() -> float:
        packing = packed_linears(model, rows) if packed else contextlib.nullcontext()
        with torch.inference_mode(), packing:
            started = time.perf_counter()
            for layer, x in zip(layers, inputs):
                layer(x)
            return time.perf_counter() - started

    return timed


def pack_once(model, rows: int) -> None:
    """Pack (and release) the weights of every linear layer, as a rollout does once."""
    with torch.inference_mode(), packed_linears(model, rows):
        pass


def pack_fused(model, rows: int) -> None:
    """Build (and release) the fused decoder's packed weights, as a rollout of a Llama-family model does once."""
    with torch.inference_mode():
        assert fused_decoder(model, rows) is not None, "the fused decoder takes Llama-family models only"


def decode_attention(config, rows: int, prompt: int, completion: int, kind: str) -> Callable[[], None]:
    """One decode step's attention in every layer: ``rows`` queries over their own cache (lengths
    ``prompt`` .. ``prompt + completion`` in slot buffers with room to spare, as the engine's are),
    each layer's keys and values in their own buffers (read from memory, as in a step). ``kind``:
    SDPA's ``enable_gqa`` or ``gqa_attention`` (queries packed by KV head) over every row up to the
    longest, masked per row (``"sdpa"``, ``"packed"``), or ``slot_attention`` (``"slot"``), each row to
    its own length (this one also writes each row's new key and value into its slot, as a step does;
    ``"slot-shared"``: the rows one request's, reading its ``prompt`` positions from the first row's slot)."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    width = head_dim(config)
    length = prompt + completion
    lengths = torch.linspace(prompt, length, rows).long()
    mask = (torch.arange(length)[None] < lengths[:, None])[:, None, None, :]
    queries = torch.randn(rows, heads, 1, width)
    new_keys, new_values, positions = torch.randn(rows, kv_heads, width), torch.randn(rows, kv_heads, width), lengths - 1
    slots = (2 * rows, kv_heads, 2 * length, width)  # the engine's slot buffers have room to spare: its views are strided
    caches = [(torch.randn(slots), torch.randn(slots)) for _ in range(config.num_hidden_layers)]
    scale = width**-0.5
    prompts = prompt_slots([(0, prompt - 1)] * rows) if kind == "slot-shared" else None  # the shortest row: a new token at prompt - 1
    if prompts is not None:  # every slot holds the prompt alike, as the engine's rows of a request do
        for keys, values in caches:
            keys[1:rows, :, :prompt], values[1:rows, :, :prompt] = keys[0, :, :prompt], values[0, :, :prompt]

    def run() -> None:
        for keys, values in caches:
            if kind.startswith("slot"):
                slot_attention(queries[:, :, 0], new_keys, new_values, keys, values, positions, scale, prompts)
            elif kind == "packed":
                gqa_attention(queries, keys[:rows, :, :length], values[:rows, :, :length], mask, scale)
            else:
                torch.nn.functional.scaled_dot_product_attention(
                    queries, keys[:rows, :, :length], values[:rows, :, :length], attn_mask=mask, scale=scale, enable_gqa=True
                )

    return run


def chunk_attention(config, tokens: int, begin: int, kernel: bool) -> Callable[[], None]:
    """A prompt chunk's attention in every layer: ``tokens`` queries at positions ``begin`` .. over the keys
    so far, causal, as the engine's prefill runs it: SDPA (``gqa_attention``: causal for a first chunk, an
    explicit mask for a later one) or ``prompt_attention`` (``kernel``)."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    width = head_dim(config)
    end, scale = begin + tokens, width**-0.5
    mask = None if begin == 0 else torch.arange(end)[None] <= torch.arange(begin, end)[:, None]
    shapes = ((tokens, heads, width), (kv_heads, end, width), (kv_heads, end, width))
    layers = [tuple(torch.randn(shape) for shape in shapes) for _ in range(config.num_hidden_layers)]

    def run() -> None:
        for queries, keys, values in layers:
            if kernel:
                prompt_attention(queries, keys, values, begin, scale)
            else:
                gqa_attention(queries.transpose(0, 1)[None], keys[None], values[None], mask, scale, causal=begin == 0)

    return run


def update_step(
    model,
    rows: int,
    prompt: int,
    completion: int,
    autocast: bool = True,
    optimizer: torch.optim.Optimizer | None = None,
    unpadded: bool = True,
) -> Callable[[], None]:
    """The GRPO update's forward + backward (``CompletionScorer``), under bf16 autocast or not, as
    the trainer batches it: two prompts (one left-padded by a tenth) each shared by half the rows,
    completions of lengths spread evenly from half of ``completion`` to all of it (right-padded);
    then ``optimizer``'s step, if given. ``unpadded``: the completions' per-token work skips their
    padding (``rlvr.grpo.unpadded``, as the trainer runs Llama-family models)."""
    vocab = model.config.vocab_size
    prompt_mask = torch.ones(2, prompt, dtype=torch.long)
    prompt_mask[1, : prompt // 10] = 0
    lengths = torch.linspace(completion // 2, completion, rows).long()
    batch = PackedRows(
        prompt_ids=torch.randint(0, vocab, (2, prompt)),
        prompt_mask=prompt_mask,
        prompt_index=torch.arange(rows) * 2 // rows,
        targets=torch.randint(0, vocab, (rows, completion)),
        mask=(torch.arange(completion) < lengths.unsqueeze(1)).float(),
        temperatures=torch.ones(rows),
    )
    scorer = CompletionScorer(model, fast=FastPaths(unpadded_update=unpadded))

    def run() -> None:
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            logprobs, _ = scorer(batch)
        logprobs.sum().backward()
        if optimizer is not None:
            optimizer.step()
        model.zero_grad(set_to_none=True)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a Hugging Face checkpoint folder (only its config is read)")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=150)
    parser.add_argument("--completion", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default="", help="time only the operations whose name holds this text")
    args = parser.parse_args()
    base = random_weights_model(args.model, torch.float32, attn_implementation="sdpa").eval()
    config = base.config
    rows, prompt, completion, repeats = args.rows, args.prompt, args.completion, args.repeats
    table = []

    def compare(name: str, default: Callable[[], object], ours: Callable[[], object], per_call: bool = False) -> None:
        if args.only not in name:
            return
        if per_call:  # the callables return their own per-step seconds
            a = 1000 * statistics.median(default() for _ in range(repeats))
            b = 1000 * statistics.median(ours() for _ in range(repeats))
        else:
            a, b = median_ms(default, repeats), median_ms(ours, repeats)
        table.append((name, a, b))
        print(f"{name}: {a:.1f} ms -> {b:.1f} ms ({a / b:.2f}x)", flush=True)

    bf16_sdpa = copy.deepcopy(base).to(torch.bfloat16)
    bf16_fast = use_fast_attention(copy.deepcopy(bf16_sdpa))
    packing, fused_packing = [], []  # what a rollout pays once, before its first step
    for dtype, model in (("float32", base), ("bf16", bf16_sdpa)):
        compare(
            f"decode linears, {dtype} (every nn.Linear once, {rows} rows)",
            decode_linears(model, rows, packed=False),
            decode_linears(model, rows, packed=True),
            per_call=True,
        )
        if not args.only:
            packing.append((dtype, median_ms(partial(pack_once, model, rows), repeats)))
            fused_packing.append((dtype, median_ms(partial(pack_fused, model, rows), repeats)))

    for dtype, models in (("float32", (base, base)), ("bf16", (bf16_sdpa, bf16_fast))):
        compare(
            f"decode step, {dtype} ({rows} rows, {prompt}-token prompt, {completion} steps)",
            decode_step(models[0], rows, prompt, completion, "default"),
            decode_step(models[1], rows, prompt, completion, "fused"),
            per_call=True,
        )
    steps = {
        "engine cache: model forward on packed linears -> fused decoder": "packed",
        f"fused decoder: norms and rotary in PyTorch -> layer_kernels ({rows} rows, {completion} steps)": "fused-torch",
    }
    for what, before in steps.items():
        for dtype, model in (("float32", base), ("bf16", bf16_fast)):
            name = f"decode step, {dtype}, {what}"
            compare(name, decode_step(model, rows, prompt, completion, before), decode_step(model, rows, prompt, completion, "fused"), per_call=True)
    compare(
        f"decode step, bf16, engine cache, packed linears: attention sdpa -> rlvr_sdpa ({rows} rows, {completion} steps)",
        decode_step(bf16_sdpa, rows, prompt, completion, "packed"),
        decode_step(bf16_fast, rows, prompt, completion, "packed"),
        per_call=True,
    )

    for length in (prompt, 10 * prompt):
        compare(
            f"decode attention, float32: enable_gqa -> packed by KV head ({rows} rows, {length}..{length + completion} keys, every layer)",
            decode_attention(config, rows, length, completion, "sdpa"),
            decode_attention(config, rows, length, completion, "packed"),
        )
    for length in (prompt, 10 * prompt):
        compare(
            f"decode attention, float32: packed by KV head -> slot_attention ({rows} rows, {length}..{length + completion} keys, every layer)",
            decode_attention(config, rows, length, completion, "packed"),
            decode_attention(config, rows, length, completion, "slot"),
        )
    for length in (prompt, 10 * prompt):
        compare(
            f"decode attention, float32: slot_attention, each row its prompt -> a request's rows one ({rows} rows of one request, {length}.. keys)",
            decode_attention(config, rows, length, completion, "slot"),
            decode_attention(config, rows, length, completion, "slot-shared"),
        )

    for tokens, begin in ((10 * prompt, 0), (256, 10 * prompt - 256)):
        compare(
            f"prompt attention, float32: SDPA -> prompt_attention ({tokens}-token chunk after {begin}, every layer)",
            chunk_attention(config, tokens, begin, kernel=False),
            chunk_attention(config, tokens, begin, kernel=True),
        )

    compare(
        f"update fwd+bwd, bf16 autocast: attention sdpa -> rlvr_sdpa ({rows} x <= {completion} tokens after {prompt})",
        update_step(copy.deepcopy(base).train(), rows, prompt, completion),
        update_step(use_fast_attention(copy.deepcopy(base)).train(), rows, prompt, completion),
    )

    for autocast in (False, True):
        model = use_fast_attention(copy.deepcopy(base)).train()
        compare(
            f"update fwd+bwd, {'bf16 autocast' if autocast else 'float32'}: completions padded -> unpadded "
            f"({rows} x {completion // 2}..{completion} tokens after {prompt})",
            update_step(model, rows, prompt, completion, autocast, unpadded=False),
            update_step(model, rows, prompt, completion, autocast, unpadded=True),
        )

    tokens = rows * completion
    hidden = torch.randn(tokens, config.hidden_size, requires_grad=True)
    weight = base.get_output_embeddings().weight
    targets = torch.randint(0, config.vocab_size, (tokens,))
    temperatures = torch.ones(tokens)

    def head_run(fn, autocast: bool) -> Callable[[], None]:
        def run() -> None:
            with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                if fn is head_logprobs:
                    logprobs, _ = head_logprobs(hidden, weight, targets, temperatures, with_entropy=True)
                else:
                    logits = torch.nn.functional.linear(hidden, weight).unsqueeze(1)
                    logprobs, _ = token_logprobs_and_entropy(logits, targets.unsqueeze(1), temperatures)
            logprobs.sum().backward()
            hidden.grad = weight.grad = None

        return run

    for autocast in (False, True):
        compare(
            f"output head fwd+bwd, {'bf16 autocast' if autocast else 'float32'} ({tokens} tokens x {config.vocab_size})",
            head_run(token_logprobs_and_entropy, autocast),
            head_run(head_logprobs, autocast),
        )

    params = [p for p in base.parameters()]
    for p in params:
        p.grad = torch.randn_like(p)
    foreach = torch.optim.AdamW(params, lr=1e-6, foreach=True)
    fused = torch.optim.AdamW(copy.deepcopy(params), lr=1e-6, fused=True)
    for p in fused.param_groups[0]["params"]:
        p.grad = torch.randn_like(p)
    compare(f"AdamW step ({sum(p.numel() for p in params) / 1e6:.0f}M parameters)", foreach.step, fused.step)

    # Last: keep_freed_memory is process-wide and cannot be undone. The same updates (with a fused
    # AdamW step, as the trainer runs them) on glibc's default malloc, then with freed memory kept.
    names = {autocast: f"update fwd+bwd+AdamW, {'bf16 autocast' if autocast else 'float32'}: glibc malloc -> keep_freed_memory" for autocast in (False, True)}
    updates = []
    for autocast, name in names.items():
        if args.only not in name:
            continue
        model = use_fast_attention(copy.deepcopy(base)).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-9, fused=True)
        updates.append((name, update_step(model, rows, prompt, completion, autocast, optimizer)))
    default_ms = [median_ms(run, repeats) for _, run in updates]
    if updates:
        assert keep_freed_memory(), "glibc's malloc only"
    for (name, run), before in zip(updates, default_ms):
        run()  # the heap grows to the update's size once
        table.append((name, before, median_ms(run, repeats)))

    keep_freed_memory()  # as the engine samples: freed memory kept
    logits, uniforms = torch.randn(rows, config.vocab_size) * 3, torch.rand(rows)
    for temperature in (1.0, 0.7):
        temperatures = torch.full((rows,), temperature)
        compare(
            f"sampling at temperature {temperature}, top-p 1 ({rows} rows x {config.vocab_size}): PyTorch -> sampling_kernel",
            partial(sample_tokens, logits, temperatures, 1.0, uniforms=uniforms),
            partial(sample_tokens, logits, temperatures, 1.0, uniforms=uniforms, compiled=True),
        )

    print_table(table, packing, fused_packing)


def print_table(table: list[tuple[str, float, float]], packing: list, fused_packing: list) -> None:
    print(f"\n{torch.get_num_threads()} threads")
    if packing:
        print("packing the linear weights, once per rollout: " + ", ".join(f"{d} {ms:.0f} ms" for d, ms in packing))
        print("building the fused decoder (fused, packed weights), once per rollout: " + ", ".join(f"{d} {ms:.0f} ms" for d, ms in fused_packing))
    print()
    print("| operation | default (ms) | rlvr-ops (ms) | speed-up |")
    print("|---|---|---|---|")
    for name, a, b in table:
        print(f"| {name} | {a:.1f} | {b:.1f} | {a / b:.2f}x |")


if __name__ == "__main__":
    main()
