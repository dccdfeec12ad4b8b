"""Supervised fine-tuning on worked solutions: the cold start before GRPO (DeepSeek-R1's recipe).

A base model that almost never answers correctly gives GRPO groups without signal; a short SFT on the
train split's reference solutions (:func:`sft_target`: the reasoning, then ``#### <number>``) teaches
the format first. The loss is the mean negative log-likelihood of the completion tokens, computed by
the GRPO update's scorer (:class:`rlvr.grpo.scoring.CompletionScorer`); optimizer, schedule,
checkpoints and resume are the GRPO trainer's (:class:`rlvr.grpo.trainer_loop.TrainerLoop`). GSM8k's
calculator annotations are stripped, or kept with ``keep_calculator_annotations`` (their results then
masked out of the loss: the calculator environment writes them at rollout time).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from rlvr.fastpaths import FastPaths
from rlvr.fastpaths.attention import use_fast_attention
from rlvr.fastpaths.eligibility import COMPUTE_DTYPES
from rlvr.fastpaths.heap import keep_freed_memory
from rlvr.fastpaths.plan import log_plan, plan_backend
from rlvr.grpo.sampler import step_problems
from rlvr.grpo.scoring import CompletionScorer, PackedRows
from rlvr.grpo.trainer_loop import TrainerLoop, float32_master_weights
from rlvr.policy import load_policy
from rlvr.tasks import GSM8K, problem_record
from rlvr.training_run import TrainedPolicy

_CALCULATOR = re.compile(r"<<[^<>]*>>")  # GSM8k's calculator annotations: 48/2 = <<48/2=24>>24
_CALCULATOR_RESULT = re.compile(r"<<[^<>]*=([^<>=]*>>)")  # group 1: what the calculator writes, "24>>"

PROFILES: dict[str, dict] = {
    # the embedded 135M model on 2 CPU cores: a short cold start (about a minute)
    "default": {"total_steps": 8, "batch_size": 8, "micro_batch_size": 4, "lr": 2e-5, "warmup_steps": 1, "max_completion_tokens": 256},
    # one GPU: two epochs of GSM8k's 7,473 train solutions (bf16 compute where the GPU has it: compute_dtype auto)
    "full": {
        "total_steps": 470,
        "batch_size": 32,
        "micro_batch_size": 32,
        "lr": 1e-5,
        "warmup_steps": 20,
        "checkpoint_every": 100,
        "max_completion_tokens": 384,
    },
}


@dataclass
class SFTConfig:
    """One SFT run: ``total_steps`` optimizer steps of ``batch_size`` examples (gradient-accumulated
    micro-batches of ``micro_batch_size``), walking seeded permutations of the examples."""

    batch_size: int = 16
    micro_batch_size: int = 8
    total_steps: int = 100
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    adam_eps: float = 1e-8
    max_grad_norm: float | None = 1.0
    warmup_steps: int = 0
    lr_decay: str = "cosine"  # "cosine", "linear" or "constant"
    min_lr_ratio: float = 0.1
    max_completion_tokens: int = 384  # longer targets are cut (counted in the metrics)
    compute_dtype: str = "auto"  # "bfloat16" (mixed precision: float32 weights and optimizer) where native, else "float32"
    keep_calculator_annotations: bool = False  # keep <<48/2=24>> (the result masked out of the loss): the calculator's call format
    fast_paths: FastPaths = field(default_factory=FastPaths)
    checkpoint_every: int = 0  # steps between checkpoints; 0 = only at the end
    keep_checkpoints: int | None = 2
    seed: int = 0

    def __post_init__(self) -> None:
        self.fast_paths = FastPaths.coerce(self.fast_paths)
        self.betas = tuple(self.betas)
        for name in ("batch_size", "micro_batch_size", "total_steps", "max_completion_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype must be one of {COMPUTE_DTYPES}, got {self.compute_dtype!r}")
        if self.lr_decay not in ("cosine", "linear", "constant"):
            raise ValueError(f"unknown lr_decay {self.lr_decay!r}")


def build_sft_config(profile: str, overrides: dict | None = None) -> SFTConfig:
    """The profile's SFTConfig with ``overrides`` (any SFTConfig field) applied."""
    if profile not in PROFILES:
        raise ValueError(f"unknown SFT profile {profile!r}; expected one of {sorted(PROFILES)}")
    unknown = sorted(set(overrides or {}) - set(SFTConfig.__dataclass_fields__))
    if unknown:
        raise ValueError(f"unknown SFTConfig field(s) {unknown} in overrides")
    return SFTConfig(**{**PROFILES[profile], **(overrides or {})})


def train_sft(
    start: Path,
    rows: Sequence[dict],
    config: SFTConfig,
    checkpoint_dir: Path,
    device: Any = None,
    on_step: Callable[[int, dict], None] | None = None,
    environment: Any = None,
) -> TrainedPolicy:
    """Fine-tune the checkpoint at ``start`` on the GSM8k problem ``rows``' reference solutions; resumes from
    the latest checkpoint in ``checkpoint_dir``. ``environment``: the one the rollouts will use (its
    instructions join the prompt, when GRPO runs with one)."""
    model, tokenizer = load_policy(start, device)
    trainer = SFTTrainer(model, tokenizer, config, checkpoint_dir=checkpoint_dir, on_step=on_step)
    history = trainer.train(sft_examples(rows, tokenizer, config.keep_calculator_annotations, environment))
    return TrainedPolicy(trainer.policy, tokenizer, history, trainer.step_count, environment, {GSM8K.name: 1.0})


def sft_target(solution: str, answer_text: str, keep_calculator_annotations: bool = False) -> str:
    """A reference solution in the format the policy is asked for: the reasoning without GSM8k's
    calculator annotations (or with those that hold a result, when kept), then ``#### <answer>``
    on the last line."""
    if keep_calculator_annotations:
        reasoning = _CALCULATOR.sub(lambda m: m[0] if _CALCULATOR_RESULT.fullmatch(m[0]) else "", solution).strip()
    else:
        reasoning = _CALCULATOR.sub("", solution).strip()
    if not str(answer_text).strip():
        raise ValueError("answer_text is empty")
    return f"{reasoning}\n#### {str(answer_text).strip()}" if reasoning else f"#### {str(answer_text).strip()}"


def sft_examples(rows: Sequence[dict], tokenizer: Any, keep_calculator_annotations: bool = False, environment: Any = None) -> list[dict]:
    """Token ids of each problem's prompt (GSM8k's, with ``environment``'s instructions, as its rollouts
    render it) and target (ending with the end-of-turn token, so the policy learns to stop), and the
    target's ``environment_mask``: 1 on the tokens of kept calculator results, which the calculator
    writes at rollout time."""
    end = tokenizer.eos_token or ""
    examples = []
    for row in map(problem_record, rows):
        prompt = GSM8K.render_prompt(tokenizer, row, environment)
        target = sft_target(row["solution"], row["answer_text"], keep_calculator_annotations) + end
        target_ids, environment_mask = [], []
        for text, by_environment in _target_pieces(target):  # each piece on its own, as the rollout's turns are
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            target_ids += ids
            environment_mask += [int(by_environment)] * len(ids)
        examples.append(
            {
                "problem_id": row.get("problem_id"),
                "prompt_ids": tokenizer(prompt, add_special_tokens=False)["input_ids"],
                "target_ids": target_ids,
                "environment_mask": environment_mask,
            }
        )
    return examples


def _target_pieces(target: str) -> list[tuple[str, bool]]:
    """``target`` cut into (text, written by the environment) pieces at its calculator results."""
    pieces, start = [], 0
    for match in _CALCULATOR_RESULT.finditer(target):
        pieces += [(target[start : match.start(1)], False), (match[1], True)]
        start = match.end(1)
    pieces.append((target[start:], False))
    return [(text, by_environment) for text, by_environment in pieces if text]


class SFTTrainer(TrainerLoop):
    """Fine-tunes ``model`` in place on :func:`sft_examples`; ``on_step(step, metrics)`` after each step."""

    def __init__(
        self, model: Any, tokenizer: Any, config: SFTConfig, checkpoint_dir: str | Path | None = None, on_step: Callable[[int, dict], None] | None = None
    ):
        self.on_step = on_step
        device = next(model.parameters()).device
        self.plan = plan_backend(model, config.fast_paths, dtype=torch.float32, compute_dtype=config.compute_dtype)  # decided once
        log_plan(self.plan, "SFT")
        if self.plan.keep_freed_memory:
            keep_freed_memory()
        model = float32_master_weights(model)
        policy = use_fast_attention(model, self.plan.fast_attention).train()
        self.scorer = CompletionScorer(policy, share_prompts=True, plan=self.plan)
        compute_dtype = getattr(torch, self.plan.compute_dtype)
        self._autocast = partial(torch.autocast, device.type, compute_dtype, enabled=compute_dtype != torch.float32)
        self.device = device
        super().__init__(policy, tokenizer, config, checkpoint_dir)  # optimizer, schedule, step count

    def train(self, examples: Sequence[dict], resume: bool = True) -> list[dict]:
        """Train until ``config.total_steps`` (resuming from the latest checkpoint first); returns this call's metrics."""
        if not examples:
            raise ValueError("no SFT examples")
        if resume and self.step_count == 0:
            self.resume()
        history = []
        while self.step_count < self.config.total_steps:
            batch = step_problems(examples, self.step_count, self.config.batch_size, self.config.seed)
            metrics = self.step(batch)
            if self.on_step is not None:
                self.on_step(self.step_count, metrics)  # before the step's resume point, as in GRPO
            history.append(self.record_step(metrics))  # and the step's checkpoint, when one is due
        return history

    def step(self, batch: Sequence[dict]) -> dict:
        """One optimizer step: token-mean NLL of the policy's completion tokens over the whole batch."""
        started, config = time.perf_counter(), self.config
        truncated = sum(len(e["target_ids"]) > config.max_completion_tokens for e in batch)
        budget = config.max_completion_tokens
        tokens = sum(min(len(e["target_ids"]), budget) - sum(e.get("environment_mask", [])[:budget]) for e in batch)
        loss_sum = 0.0
        for start in range(0, len(batch), config.micro_batch_size):
            packed = pack_examples(batch[start : start + config.micro_batch_size], config.max_completion_tokens, self.tokenizer.pad_token_id or 0, self.device)
            with self._autocast():
                logprobs, _ = self.scorer(packed)
            loss = -(logprobs * packed.policy_mask).sum() / tokens
            loss.backward()
            loss_sum += float(loss.detach())
        grad_norm = self.optimizer_step()
        self.scheduler.step()
        self.step_count += 1
        elapsed = time.perf_counter() - started
        return {
            "step": self.step_count,
            "loss": loss_sum,
            "grad_norm": grad_norm,
            "lr": self.optimizer.param_groups[0]["lr"],
            "tokens": tokens,
            "tokens_per_s": tokens / elapsed,
            "truncated": truncated,
            "step_time_s": elapsed,
        }


def pack_examples(examples: Sequence[dict], max_completion_tokens: int, pad_id: int, device: Any) -> PackedRows:
    """Examples laid out for the scorer: prompts left-padded, targets right-padded (cut to the budget),
    with their ``environment_mask`` where they have one."""
    targets = [e["target_ids"][:max_completion_tokens] for e in examples]
    prompt_width, width = max(len(e["prompt_ids"]) for e in examples), max(len(t) for t in targets)
    prompt_ids = torch.full((len(examples), prompt_width), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros_like(prompt_ids)
    target_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.float32)
    environment_mask = torch.zeros_like(mask)
    for i, (example, target) in enumerate(zip(examples, targets)):
        prompt = example["prompt_ids"]
        prompt_ids[i, prompt_width - len(prompt) :] = torch.tensor(prompt)
        prompt_mask[i, prompt_width - len(prompt) :] = 1
        target_ids[i, : len(target)] = torch.tensor(target)
        mask[i, : len(target)] = 1
        environment_mask[i, : len(target)] = torch.tensor(example.get("environment_mask", [0] * len(target))[: len(target)], dtype=torch.float32)
    return PackedRows(
        prompt_ids=prompt_ids.to(device),
        prompt_mask=prompt_mask.to(device),
        prompt_index=torch.arange(len(examples), device=device),
        targets=target_ids.to(device),
        mask=mask.to(device),
        temperatures=torch.ones(len(examples), device=device),
        environment_mask=environment_mask.to(device),
    )
