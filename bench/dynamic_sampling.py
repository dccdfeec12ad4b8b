"""Does DAPO's dynamic sampling pay for its extra generations? ``GRPOConfig.dynamic_sampling_rounds`` measured.

    python bench/dynamic_sampling.py <checkpoint> --output /tmp/ds.json

Trains the same start policy on the same problems and seed once per ``--arms`` entry ``ROUNDS:STEPS``
(default: off and 2 rounds at 20 steps, off at 40), evaluates each greedily on held-out problems and
pairs it with the base and every other arm (McNemar). Prints each arm's training cost and accuracy.
The default task is docs/results.md's experiment 2 (reasoning-gym ``products``); ``--problems DIR``
reads GSM8k-format ``train.jsonl``/``test.jsonl`` instead; ``--device cuda`` runs on a GPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
import time
from pathlib import Path

from rlvr.evaluation.runner import EvalConfig, compare, evaluate_policy, summarize
from rlvr.grpo.profiles import build_config
from rlvr.policy import load_policy
from rlvr.tasks.gsm8k import dataset as gsm8k
from rlvr.training_run import train_grpo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="start checkpoint (a Hugging Face folder)")
    parser.add_argument("--task", default="products", help="reasoning-gym task")
    parser.add_argument("--task-config", default='{"min_terms": 3, "max_terms": 3, "min_digits": 1, "max_digits": 1}')
    parser.add_argument("--train", type=int, default=500, help="generated train problems")
    parser.add_argument("--test", type=int, default=200, help="generated held-out problems")
    parser.add_argument("--arms", nargs="+", default=["0:20", "2:20", "0:40"], help="ROUNDS:STEPS of each arm (dynamic_sampling_rounds, GRPO steps)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--lr", type=float, default=5e-6)
    parser.add_argument("--rewards", type=json.loads, default={"math_answer_flexible": 1.0}, help="reward weights as JSON")
    parser.add_argument("--problems", type=Path, help="a folder with train.jsonl and test.jsonl in GSM8k's format, instead of --task")
    parser.add_argument("--export-problems", type=Path, help="write the generated task's problems there in GSM8k's format, and stop")
    parser.add_argument("--profile", default="default", help="GRPO profile the overrides apply to (rlvr.grpo.profiles)")
    parser.add_argument("--compute-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--output", type=Path, help="write the results as JSON here")
    args = parser.parse_args()

    if args.problems:
        problems = gsm8k.load_local(args.problems)
    else:
        problems = gsm8k.generate_reasoning_gym(args.task, args.train, args.test, seed=0, task_config=json.loads(args.task_config))
    if args.export_problems:
        export(problems, args.export_problems)
        return
    train = [p.as_row() for p in problems if p.split == "train"][: args.train]
    test = [p.as_row() for p in problems if p.split == "test"][: args.test]
    protocol = EvalConfig(max_new_tokens=args.tokens, batch_rows=64)
    arms = [tuple(int(n) for n in arm.split(":")) for arm in args.arms]
    overrides = {
        "prompts_per_step": args.prompts,
        "group_size": args.group,
        "lr": args.lr,
        "checkpoint_every": 0,
        "compute_dtype": args.compute_dtype,
        "sampling": {"max_new_tokens": args.tokens, "temperatures": [0.7, 0.8, 0.9, 1.0]},
    }
    model, tokenizer = load_policy(args.model, args.device)
    rows = {"base": evaluate_policy(model, tokenizer, test, protocol)}
    results = {"args": {k: str(v) for k, v in vars(args).items()}, "base": summarize(rows["base"], protocol)}
    for rounds, steps in arms:
        label = f"{'off' if rounds == 0 else f'{rounds} rounds'}, {steps} steps"
        config = build_config(args.profile, {**overrides, "dynamic_sampling_rounds": rounds, "total_steps": steps})
        with tempfile.TemporaryDirectory() as checkpoints:
            started = time.perf_counter()
            trained = train_grpo(Path(args.model), train, config, args.rewards, Path(checkpoints), device=args.device)
            wall_s = time.perf_counter() - started
        rows[label] = evaluate_policy(trained.policy, tokenizer, test, protocol)
        history = trained.history
        train_s = sum(m["step_time_s"] for m in history)  # generation, rewards and updates of every step
        arm = {
            "train_s": train_s,
            "wall_s": wall_s,
            "groups_generated": sum(m["groups_generated"] for m in history),
            "groups_trained": sum(round(m["frac_groups_kept"] * m["groups_generated"]) for m in history),
            "completion_tokens": sum(m["tokens_per_s"] * m["step_time_s"] for m in history),
            "frac_groups_kept_per_step": [round(m["frac_groups_kept"], 3) for m in history],
            "reward_mean_per_step": [round(m["reward_mean"], 3) for m in history],
            "eval": summarize(rows[label], protocol),
        }
        results[label] = arm
        print(
            f"{label}: {arm['groups_generated']} groups generated, {arm['groups_trained']} trained on, {arm['completion_tokens']:.0f} "
            f"completion tokens, {train_s:.0f} s of steps ({wall_s:.0f} s with loading and saving); held-out pass@1 strict {arm['eval']['pass@1_strict']:.1%}, "
            f"flexible {arm['eval']['pass@1_flexible']:.1%}",
            flush=True,
        )
    labels = list(rows)[1:]
    for before, after in [("base", label) for label in labels] + list(itertools.combinations(labels, 2)):
        for column in ("correct_strict", "correct_flexible"):
            paired = compare(rows[before], rows[after], column=column)
            results[f"{after} vs {before}, {column}"] = paired
            print(
                f"{after} vs {before}, {column.removeprefix('correct_')} pass@1: {paired['delta']:+.1%} (95% CI {paired['delta_ci_low']:+.1%} "
                f"to {paired['delta_ci_high']:+.1%}), McNemar p = {paired['mcnemar_p_value']:.3g}"
            )
    base = results["base"]
    print(f"base: pass@1 strict {base['pass@1_strict']:.1%}, flexible {base['pass@1_flexible']:.1%}")
    for label in labels[1:]:
        print(f"cost {label} / {labels[0]}: {results[label]['train_s'] / results[labels[0]]['train_s']:.2f}x the seconds of steps")
    if args.output:
        args.output.write_text(json.dumps(results, indent=1, default=float))


def export(problems: list[gsm8k.Problem], folder: Path) -> None:
    """``problems`` as ``train.jsonl`` and ``test.jsonl`` in GSM8k's format (``gsm8k.load_local`` reads them back)."""
    folder.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        lines = [json.dumps({"question": p.question, "answer": f"{p.solution}\n#### {p.answer_text}".lstrip()}) for p in problems if p.split == split]
        (folder / f"{split}.jsonl").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
