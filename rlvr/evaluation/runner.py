"""Evaluate a policy on problems with the rollout engine: per-problem results and their summary.

The protocol is the one peers publish, so numbers compare: zero-shot, the training prompt, greedy
decoding for pass@1, graded by strict ``####`` extraction (lm-evaluation-harness' strict-match,
verl) beside flexible extraction. With ``num_samples`` > 0 it also samples n completions per
problem for pass@k (unbiased estimator) and maj@k (self-consistency). A policy trained with an
environment (``rlvr.environments``: a calculator, code execution) is evaluated in it, as it rolls
out in training and serving; each greedy completion's tool calls are counted, and their errors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from rlvr.answers import answers_match, extract_final_answer, format_number, is_well_formed, lm_eval_gsm8k_answers, lm_eval_gsm8k_match
from rlvr.environments.driver import drives_episodes
from rlvr.evaluation.estimators import maj_at_k, majority_vote, pass_at_k_per_problem
from rlvr.evaluation.intervals import accuracy_by_group, bootstrap_ci
from rlvr.evaluation.significance import mcnemar_test, paired_bootstrap
from rlvr.generation import SamplingConfig, StopRule
from rlvr.generation.generator import EngineConfig, make_generator
from rlvr.rewards import RewardPool
from rlvr.tasks import DEFAULT_TASK, GSM8K, get_task
from rlvr.tasks.base import problem_record
from rlvr.tasks.parsers import HASH_NUMBER


@dataclass
class EvalConfig:
    """What an evaluation generates and how it is summarized."""

    max_new_tokens: int = 256  # token budget per completion
    num_samples: int = 0  # n sampled completions per problem for pass@k / maj@k; 0 = greedy only
    ks: list[int] = field(default_factory=lambda: [1])  # k values of pass@k and maj@k (each <= num_samples)
    sample_temperature: float = 0.7  # temperature of the sampled completions
    top_p: float = 1.0  # nucleus sampling of the sampled completions
    batch_rows: int = 32  # completions decoded together
    seed: int = 0  # seed of the sampled completions and of the bootstrap
    reward_weights: dict[str, float] = field(default_factory=lambda: dict(GSM8K.rewards))  # rewards reported per completion of a numeric-answer task
    confidence: float = 0.95  # level of the confidence intervals
    engine: EngineConfig = field(default_factory=EngineConfig)  # the generation engine (native or vLLM), as training's rollout

    def __post_init__(self) -> None:
        if isinstance(self.engine, dict):
            self.engine = EngineConfig(**self.engine)
        if self.num_samples < 0 or self.max_new_tokens < 1 or self.batch_rows < 1:
            raise ValueError("need num_samples >= 0, max_new_tokens >= 1 and batch_rows >= 1")
        if self.num_samples and any(not 1 <= k <= self.num_samples for k in self.ks):
            raise ValueError(f"every k in {self.ks} must be between 1 and num_samples={self.num_samples}")


def evaluate_policy(
    model: Any,
    tokenizer: Any,
    problems: list[dict],
    config: EvalConfig,
    progress: Callable[[int, int], None] | None = None,
    environment: Any = None,
    task: Any = None,
) -> list[dict]:
    """One result dict per problem (problems need ``problem_id``, ``question``, ``answer_value``).

    ``progress(done, total)`` is called after each decoded chunk, counting completions.
    ``environment``: the policy's (None: single-turn); its instructions join the system prompt.
    ``task`` (``rlvr.tasks``; None: ``DEFAULT_TASK``): a task whose answers are ``#### <number>`` lines is
    graded here (strict and flexible, lm-evaluation-harness' grading, maj@k), any other by :func:`evaluate_task`.
    """
    task = task if task is not None else get_task(DEFAULT_TASK)
    if task.parser is not HASH_NUMBER:
        return evaluate_task(model, tokenizer, task, problems, config, progress, environment)
    if not problems:
        raise ValueError("no problems to evaluate")
    problems = [problem_record(p) for p in problems]
    prompts = [task.render_prompt(tokenizer, p, environment) for p in problems]
    decoder = _Decoder(model, tokenizer, prompts, config, environment, progress, task.stop_rule)
    greedy = decoder.decode(1, 0.0)
    with RewardPool(workers=2) as pool:
        scored = pool.score_batch(config.reward_weights, greedy.texts, problems)
    samples = decoder.decode(config.num_samples, config.sample_temperature).per_problem() if config.num_samples else [[] for _ in problems]

    results = []
    for i, problem in enumerate(problems):
        gold = float(problem["answer_value"])
        row = {
            "problem_id": problem["problem_id"],
            "num_steps": problem.get("num_steps"),
            **grade_completion(greedy.texts[i], gold),
            **grade_lm_eval(greedy.texts[i], str(problem.get("answer_text") or format_number(gold))),
            **greedy.row(i, decoder.environment_name),
            **{f"reward_{name}": result.value for name, result in scored[i].items()},
        }
        if config.num_samples:
            row.update(grade_samples(samples[i], gold, config.ks))
        results.append(row)
    return results


def evaluate_task(
    model: Any,
    tokenizer: Any,
    task: Any,
    problems: list[dict],
    config: EvalConfig,
    progress: Callable[[int, int], None] | None = None,
    environment: Any = None,
) -> list[dict]:
    """One result dict per problem of ``task``, graded by the task's own rewards: ``correct_strict`` is
    its binary ``correctness`` reward (``correct_flexible`` the same), ``score`` its partial credit,
    ``well_formed`` its format reward; sampled completions count toward pass@k. A grader that failed
    scores 0 with its error in ``grading_error``."""
    if not problems:
        raise ValueError("no problems to evaluate")
    records = [problem_record(p) for p in problems]
    prompts = [task.render_prompt(tokenizer, r, environment) for r in records]
    decoder = _Decoder(model, tokenizer, prompts, config, environment, progress, task.stop_rule)
    greedy = decoder.decode(1, 0.0)
    weights = {**task.rewards, **{name: 0.0 for name in (task.partial_credit, task.format_reward) if name and name not in task.rewards}}
    with RewardPool(workers=2) as pool:
        scored = pool.score_batch(weights, greedy.texts, records)
        sampled = decoder.decode(config.num_samples, config.sample_temperature) if config.num_samples else None
        correct_samples = pool.score_batch({task.correctness: 1.0}, sampled.texts, [r for r in records for _ in range(config.num_samples)]) if sampled else []

    results = []
    for i, record in enumerate(records):
        correct = scored[i][task.correctness].value >= 1.0
        errors = [result.details["error"] for result in scored[i].values() if "error" in result.details]
        row = {
            "problem_id": record["problem_id"],
            "task": task.name,
            "num_steps": record.get("num_steps"),
            "completion": greedy.texts[i],
            "correct_strict": correct,
            "correct_flexible": correct,
            "well_formed": scored[i][task.format_reward].value >= 0.5 if task.format_reward else True,
            "score": scored[i][task.partial_credit].value if task.partial_credit else float(correct),
            "grading_error": "; ".join(errors) or None,
            **greedy.row(i, decoder.environment_name),
            **{f"reward_{name}": result.value for name, result in scored[i].items()},
        }
        if config.num_samples:
            verdicts = [
                scored_sample[task.correctness].value >= 1.0 for scored_sample in correct_samples[i * config.num_samples : (i + 1) * config.num_samples]
            ]
            row |= {"num_samples": config.num_samples, "num_correct_samples": int(sum(verdicts))}
        results.append(row)
    return results


@dataclass
class _Decoded:
    """What one decoding pass produced, completion by completion (problem-major)."""

    texts: list[str]
    reasons: list[str]
    lengths: list[int]
    calls: list[list]
    per_problem_count: int = 1

    def row(self, i: int, environment_name: str) -> dict:
        """The generation columns of completion ``i``: tokens, finish reason, tool use."""
        return {
            "completion_tokens": int(self.lengths[i]),
            "finish_reason": self.reasons[i],
            "truncated": self.reasons[i] == "length",
            "environment": environment_name,
            "tool_calls": len(self.calls[i]),
            "tool_errors": sum(call.error is not None for call in self.calls[i]),
        }

    def per_problem(self) -> list[list[str]]:
        n = self.per_problem_count
        return [self.texts[i : i + n] for i in range(0, len(self.texts), n)]


class _Decoder:
    """Decodes the evaluation's prompts on the engine ``config.engine`` chooses (one for every pass), reporting progress."""

    def __init__(self, model, tokenizer, prompts, config: EvalConfig, environment, progress, stop: StopRule):
        self.prompts, self.config, self.environment = prompts, config, environment
        self.progress, self.stop, self.done = progress, stop, 0
        self.generator = make_generator(config.engine, model, tokenizer, seed=config.seed, tools=drives_episodes(environment))
        self.total = len(prompts) * (1 + config.num_samples)
        self.environment_name = environment.name if environment is not None else "single_turn"

    def decode(self, num_samples: int, temperature: float) -> _Decoded:
        config = self.config
        sampling = SamplingConfig(
            max_new_tokens=config.max_new_tokens,
            temperatures=[temperature],
            top_p=config.top_p,
            seed=config.seed,
            max_batch_rows=config.batch_rows,
            environment=self.environment,
        )
        decoded = _Decoded([], [], [], [], num_samples)
        for chunk in self.generator.stream(self.prompts, num_samples, sampling, [self.stop] * len(self.prompts)):
            decoded.texts += chunk.texts
            decoded.reasons += chunk.finish_reasons
            decoded.lengths += chunk.completion_lengths.tolist()
            decoded.calls += chunk.tool_calls
            self.done += len(chunk)
            if self.progress:
                self.progress(self.done, self.total)
        return decoded


def grade_completion(text: str, gold: float) -> dict:
    """Strict and flexible correctness of one completion, and whether it is well formed."""
    strict = extract_final_answer(text, "strict")
    flexible = extract_final_answer(text, "flexible")
    return {
        "completion": text,
        "extracted_strict": strict.text if strict else None,
        "extracted_flexible": flexible.text if flexible else None,
        "correct_strict": bool(strict and answers_match(strict.value, gold)),
        "correct_flexible": bool(flexible and answers_match(flexible.value, gold)),
        "well_formed": is_well_formed(text),
    }


def grade_lm_eval(text: str, reference_text: str) -> dict:
    """Correctness as lm-evaluation-harness' gsm8k task grades it (strict-match, flexible-extract), for published numbers."""
    strict, flexible = lm_eval_gsm8k_answers(text)
    return {"correct_lm_eval_strict": lm_eval_gsm8k_match(strict, reference_text), "correct_lm_eval_flexible": lm_eval_gsm8k_match(flexible, reference_text)}


def grade_samples(texts: list[str], gold: float, ks: list[int]) -> dict:
    """Self-consistency over n sampled completions (strict extraction): counts, majority, vote share, maj@k."""
    found = [extract_final_answer(t, "strict") for t in texts]
    answers = [f.text if f else None for f in found]
    correct = [f is not None and answers_match(f.value, gold) for f in found]
    majority, share = majority_vote(answers)
    graded = [("correct" if ok else a) for a, ok in zip(answers, correct)]  # equal-valued answers vote together
    return {
        "num_samples": len(texts),
        "num_correct_samples": int(sum(correct)),
        "majority_answer": majority,
        "vote_share": share,
        **{f"maj_at_{k}": maj_at_k(graded, "correct", k) for k in ks},
    }


def summarize(results: list[dict], config: EvalConfig) -> dict:
    """Headline metrics with confidence intervals (ours, and lm-evaluation-harness's gsm8k grading where
    the rows carry it), and accuracy by difficulty (reasoning steps)."""
    columns = {"pass@1_strict": "correct_strict", "pass@1_flexible": "correct_flexible"}
    if all(r.get("correct_lm_eval_strict") is not None for r in results):  # rows stored before that column lack it
        columns.update({"pass@1_lm_eval_strict": "correct_lm_eval_strict", "pass@1_lm_eval_flexible": "correct_lm_eval_flexible"})
    metrics: dict[str, Any] = {"num_problems": len(results)}
    for name, column in columns.items():
        values = np.array([r[column] for r in results], dtype=float)
        low, high = bootstrap_ci(values, confidence=config.confidence, seed=config.seed)
        metrics[name] = float(values.mean())
        metrics[f"{name}_ci_low"], metrics[f"{name}_ci_high"] = low, high
    if all(r.get("score") is not None and r["score"] == r["score"] for r in results):  # a task's partial credit
        values = np.array([r["score"] for r in results], dtype=float)
        metrics["mean_score"] = float(values.mean())
        metrics["mean_score_ci_low"], metrics["mean_score_ci_high"] = bootstrap_ci(values, confidence=config.confidence, seed=config.seed)
    metrics["format_compliance"] = float(np.mean([r["well_formed"] for r in results]))
    metrics["truncation_rate"] = float(np.mean([r["truncated"] for r in results]))
    metrics["mean_completion_tokens"] = float(np.mean([r["completion_tokens"] for r in results]))
    for key in sorted(k for k in results[0] if k.startswith("reward_")):
        metrics[f"mean_{key}"] = float(np.mean([r[key] for r in results]))
    if all(r.get("tool_calls") is not None and r["tool_calls"] == r["tool_calls"] for r in results):  # rows stored before tool calling: None / NaN
        metrics.update(tool_use(results))
    if config.num_samples:
        n = np.array([r["num_samples"] for r in results])
        c = np.array([r["num_correct_samples"] for r in results])
        voted = all(r.get("vote_share") is not None for r in results)  # tasks without a final answer to vote on have no maj@k
        for k in config.ks:
            metrics[f"pass@{k}"] = float(pass_at_k_per_problem(n, c, k).mean())
            if voted:
                metrics[f"maj@{k}"] = float(np.mean([r[f"maj_at_{k}"] for r in results]))
        if voted:
            metrics["mean_vote_share"] = float(np.mean([r["vote_share"] for r in results]))
    by_steps = accuracy_by_group([r["correct_strict"] for r in results], [r["num_steps"] or 0 for r in results], config.confidence)
    metrics["accuracy_by_steps"] = by_steps.to_dict(orient="records")
    return metrics


def tool_use(results: list[dict]) -> dict:
    """How completions used their environment's tool: the share that called it, calls per completion,
    and the share of calls that failed (0 without calls: nothing failed)."""
    calls = np.array([r["tool_calls"] for r in results], dtype=float)
    errors = float(sum(r["tool_errors"] for r in results))
    return {
        "tool_use_rate": float((calls > 0).mean()),
        "mean_tool_calls": float(calls.mean()),
        "tool_error_rate": errors / float(calls.sum()) if calls.sum() else 0.0,
    }


def compare(base: list[dict], new: list[dict], confidence: float = 0.95, seed: int = 0, column: str = "correct_strict") -> dict:
    """Paired comparison of two evaluations on the same problems (pass@1 by ``column``, strict by
    default): McNemar and paired bootstrap."""
    base_by_id = {r["problem_id"]: r[column] for r in base}
    shared = [r for r in new if r["problem_id"] in base_by_id]
    if not shared:
        raise ValueError("the two evaluations share no problems")
    base_correct = np.array([base_by_id[r["problem_id"]] for r in shared])
    new_correct = np.array([r[column] for r in shared])
    test = mcnemar_test(base_correct, new_correct)
    boot = paired_bootstrap(base_correct.astype(float), new_correct.astype(float), confidence=confidence, seed=seed)
    return {
        "shared_problems": len(shared),
        "base_accuracy": float(base_correct.mean()),
        "new_accuracy": float(new_correct.mean()),
        "delta": boot.delta,
        "delta_ci_low": boot.ci_low,
        "delta_ci_high": boot.ci_high,
        "paired_bootstrap_p_value": boot.p_value,
        "mcnemar_p_value": test.p_value,
        "mcnemar_method": test.method,
        "base_only_correct": test.base_only,
        "new_only_correct": test.new_only,
    }
