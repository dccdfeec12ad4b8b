"""GRPO step throughput, rlvr-ops against TRL's ``GRPOTrainer``, in one run on the same machine.

    python bench/grpo_vs_trl.py .rlvr/models/base_policy/<version> --prompts 2 --group 4 --tokens 128 --steps 5

Same model, prompts, group size, budget, temperature, lr, token-mean loss and beta = 0; each row in a
fresh process, the first step a warm-up. Throughput is completion tokens per second of step time;
TRL runs in bf16 with checkpointing (its defaults) and in float32 without, and each of our rows is
compared with the fastest TRL row at its precision. Prints a Markdown table and JSON (with peak GPU
memory on CUDA); ``--configs`` picks rows, ``--micro-batch`` splits the step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from rlvr.answers import answers_match, extract_final_answer
from rlvr.generation import SamplingConfig
from rlvr.grpo import GRPOConfig, GRPOTrainer
from rlvr.policy import load_policy
from rlvr.tasks import GSM8K
from rlvr.tasks.gsm8k.prompt import build_messages, render_prompt

QUESTIONS = [  # the first GSM8k train problems
    (
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May?",
        72.0,
    ),
    ("Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did she earn?", 10.0),
    (
        "Betty is saving money for a new wallet which costs $100. Betty has only half of the money she needs. "
        "Her parents decided to give her $15 for that purpose, and her grandparents twice as much as her parents. "
        "How much more money does Betty need to buy the wallet?",
        5.0,
    ),
    ("James writes a 3-page letter to 2 different friends twice a week. How many pages does he write a year?", 624.0),
]


def correctness_reward(text: str, answer: float) -> float:
    """1.0 when the completion's final answer matches ``answer``, else 0.0."""
    found = extract_final_answer(text)
    return 1.0 if found is not None and answers_match(found.value, answer) else 0.0


def run_rlvr(args, stop_at_final_answer: bool, compute_dtype: str = "float32") -> list[dict]:
    model, tokenizer = load_policy(args.model, args.device)
    stop = GSM8K.stop_rule if stop_at_final_answer else None  # GSM8k's rule: the row ends after its '#### <number>' line
    problems = [{"prompt": render_prompt(tokenizer, q), "answer_value": a, "problem_id": f"q{i}", "stop": stop} for i, (q, a) in enumerate(QUESTIONS)]

    def reward_fn(completions, batch):
        scores = [correctness_reward(c, p["answer_value"]) for c, p in zip(completions, batch)]
        return scores, {"correct": scores}

    config = GRPOConfig(
        group_size=args.group,
        prompts_per_step=args.prompts,
        lr=args.lr,
        lr_decay="constant",
        total_steps=args.steps,
        aggregation="token-mean",
        beta=0.0,
        micro_batch_size=args.micro_batch,
        skip_zero_variance=False,
        compute_dtype=compute_dtype,
        sampling=SamplingConfig(max_new_tokens=args.tokens, temperatures=[1.0]),
    )
    trainer = GRPOTrainer(model, tokenizer, config, reward_fn)
    steps = []
    for step in range(args.steps):
        batch = [problems[(step * args.prompts + i) % len(problems)] for i in range(args.prompts)]
        started = time.perf_counter()
        metrics, _ = trainer.step(batch)
        wall = time.perf_counter() - started
        steps.append({"step_s": wall, "tokens": metrics["completion_len_mean"] * args.prompts * args.group})
    return steps


def run_trl(args, gradient_checkpointing: bool, bf16: bool | None) -> list[dict]:
    """TRL's GRPOTrainer; ``bf16=None`` leaves TRL's default (bf16 mixed precision unless fp16)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer as TRLTrainer

    # as a TRL user loads it: transformers' own attention ("sdpa"), not rlvr's low-precision CPU variant
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.padding_side = "left"
    rows = [{"prompt": build_messages(q), "answer": a} for q, a in QUESTIONS]
    dataset = Dataset.from_list([rows[i % len(rows)] for i in range(args.prompts * args.steps)])

    def reward(completions, answer, **_):
        return [correctness_reward(c[0]["content"] if isinstance(c, list) else c, a) for c, a in zip(completions, answer)]

    steps: list[dict] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.started = time.perf_counter()

        def on_step_end(self, *_, **__):
            steps.append({"step_s": time.perf_counter() - self.started})

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs and "completions/mean_length" in logs and steps:
                steps[-1]["tokens"] = logs["completions/mean_length"] * args.prompts * args.group

    with tempfile.TemporaryDirectory() as out:
        config = TRLConfig(
            output_dir=out,
            per_device_train_batch_size=args.micro_batch,
            gradient_accumulation_steps=args.prompts * args.group // args.micro_batch,
            num_generations=args.group,
            max_completion_length=args.tokens,
            temperature=1.0,
            beta=0.0,
            learning_rate=args.lr,
            lr_scheduler_type="constant",
            max_steps=args.steps,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=args.device == "cpu",
            gradient_checkpointing=gradient_checkpointing,
            shuffle_dataset=False,
            seed=0,
            **({} if bf16 is None else {"bf16": bf16}),
        )
        if bf16 is None:
            assert config.bf16, "TRL's default precision changed: relabel the rows"
        trainer = TRLTrainer(model=model, reward_funcs=[reward], args=config, train_dataset=dataset, processing_class=tokenizer, callbacks=[Timer()])
        trainer.train()
    return steps


def summarize(name: str, steps: list[dict]) -> dict:
    counted = steps[1:] or steps  # the first step warms up
    step_s = statistics.median(s["step_s"] for s in counted)
    tokens_per_s = sum(s["tokens"] for s in counted) / sum(s["step_s"] for s in counted)
    memory = {"max_gpu_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)} if torch.cuda.is_initialized() else {}
    return {
        "trainer": name,
        "median_step_s": round(step_s, 2),
        "tokens_per_s": round(tokens_per_s, 2),
        "mean_tokens_per_step": round(statistics.mean(s["tokens"] for s in counted), 1),
        "steps_counted": len(counted),
    } | memory


# (name, precision, runner): TRL's bf16=None is its default (bf16 mixed precision unless fp16)
ROWS = [
    ("TRL GRPOTrainer (defaults: bf16 mixed precision, gradient checkpointing on)", "bf16", lambda args: run_trl(args, gradient_checkpointing=True, bf16=None)),
    ("TRL GRPOTrainer (bf16, gradient checkpointing off)", "bf16", lambda args: run_trl(args, gradient_checkpointing=False, bf16=True)),
    ("TRL GRPOTrainer (fp32: bf16=False, gradient checkpointing on)", "fp32", lambda args: run_trl(args, gradient_checkpointing=True, bf16=False)),
    ("TRL GRPOTrainer (fp32: bf16=False, gradient checkpointing off)", "fp32", lambda args: run_trl(args, gradient_checkpointing=False, bf16=False)),
    ("rlvr-ops (fp32, stop after the #### line)", "fp32", lambda args: run_rlvr(args, stop_at_final_answer=True)),
    ("rlvr-ops (fp32, stop at final answer off)", "fp32", lambda args: run_rlvr(args)),
    (
        "rlvr-ops (compute_dtype=bfloat16: bf16 rollouts, bf16 autocast update)",
        "bf16",
        lambda args: run_rlvr(args, stop_at_final_answer=True, compute_dtype="bfloat16"),
    ),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a Hugging Face checkpoint folder (e.g. the base_policy in the model store)")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument(
        "--micro-batch", type=int, help="completions per forward/backward of the update (default: the whole step's); TRL accumulates gradients over the step"
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--configs", type=int, nargs="+", help=f"which rows to run, by index into the table's {len(ROWS)} rows (default: all)")
    parser.add_argument("--row", type=int, help=argparse.SUPPRESS)  # run one row here (the parent's child)
    args = parser.parse_args()
    args.micro_batch = args.micro_batch or args.prompts * args.group
    if (args.prompts * args.group) % args.micro_batch:
        parser.error("--micro-batch must divide --prompts x --group")
    chosen = args.configs or list(range(len(ROWS)))
    if not set(chosen) <= set(range(len(ROWS))):
        parser.error(f"--configs takes row indices 0..{len(ROWS) - 1}")
    if not any(ROWS[i][0].startswith("TRL") for i in chosen):
        parser.error("--configs must include a TRL row: every rlvr-ops row is compared with TRL")
    if args.row is not None:
        torch.manual_seed(0)
        name, precision, run = ROWS[args.row]
        print("RESULT " + json.dumps(summarize(name, run(args)) | {"precision": precision}), flush=True)
        return
    results = []
    for row in chosen:  # each in a fresh process: no state (allocator, threads) carries over
        child = subprocess.run([sys.executable, *sys.argv, "--row", str(row)], capture_output=True, text=True)
        lines = [line for line in child.stdout.splitlines() if line.startswith("RESULT ")]
        if child.returncode != 0 or not lines:
            sys.exit(f"row {row} failed:\n{child.stderr[-3000:]}")
        results.append(json.loads(lines[-1].removeprefix("RESULT ")))
        print(json.dumps(results[-1]), flush=True)
    trl = [r for r in results if r["trainer"].startswith("TRL")]
    baseline = trl[0]["tokens_per_s"]
    fastest_trl = {p: max(r["tokens_per_s"] for r in trl if r["precision"] == p) for p in ("fp32", "bf16") if any(r["precision"] == p for r in trl)}
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"cpu, {torch.get_num_threads()} threads"
    print(f"\n{args.prompts} prompts x {args.group} completions x {args.tokens} tokens, beta 0, {where}\n")
    versus = "TRL defaults" if trl[0]["trainer"] == ROWS[0][0] else "first TRL row"
    print(f"| trainer | median step (s) | completion tokens / step | tokens / s | vs {versus} | vs fastest TRL, same precision |")
    print("|---|---|---|---|---|---|")
    for r in results:
        same = "" if r in trl or r["precision"] not in fastest_trl else f"{r['tokens_per_s'] / fastest_trl[r['precision']]:.2f}x"
        print(f"| {r['trainer']} | {r['median_step_s']} | {r['mean_tokens_per_step']} | {r['tokens_per_s']} | {r['tokens_per_s'] / baseline:.2f}x | {same} |")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
