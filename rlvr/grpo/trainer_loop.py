"""What the SFT and GRPO trainers share: AdamW and its LR schedule, the step count and history,
checkpoints (:mod:`rlvr.grpo.checkpoint`), resume and an early stop. Each trainer's loop::
    if resume and self.step_count == 0:
        self.resume()                                  # weights, optimizer, schedule, step, RNG states
    while self.step_count < self.config.total_steps:
        metrics = self.step(batch)                     # ... optimizer_step(), scheduler.step(), step_count += 1
        self.on_step(self.step_count, metrics)         # before the step's resume point: a kill loses nothing
        history.append(self.record_step(metrics))      # the checkpoint, when one is due
        if self.stop_early(should_stop, metrics):      # a stop hook (a budget) ends the run at this boundary
            break
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch

from . import checkpoint
from .distributed import DistributedContext, all_gather_objects, barrier

logger = logging.getLogger("rlvr.grpo")

StopHook = Callable[[int], "str | None"]  # after step n: why the run stops there (the same on every rank), or None


class WorldSizeChanged(RuntimeError):
    """A run's checkpoint was written by another number of processes than the run now has."""


class TrainerLoop:
    """The skeleton of a trainer over ``config`` (a dataclass with ``lr``, ``betas``, ``adam_eps``,
    ``weight_decay``, ``max_grad_norm``, the schedule's fields, ``total_steps``, ``checkpoint_every`` and
    ``keep_checkpoints``): AdamW on ``policy``'s trainable weights, :func:`lr_multiplier`'s schedule, and
    checkpoints of the whole state. A subclass builds its model, then calls ``__init__``."""

    def __init__(
        self,
        policy: Any,
        tokenizer: Any,
        config: Any,
        checkpoint_dir: str | Path | None,
        dist: DistributedContext | None = None,
        sharded: bool = False,
    ):
        self.policy, self.tokenizer, self.config, self.sharded = policy, tokenizer, config, sharded
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.dist = dist if dist is not None else DistributedContext(device=next(policy.parameters()).device)
        self.optimizer = torch.optim.AdamW(
            decay_param_groups(policy, config.weight_decay),
            lr=config.lr,
            betas=config.betas,
            eps=config.adam_eps,
            fused=self.dist.device.type in ("cpu", "cuda") and not sharded,  # one kernel, several times faster
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, partial(lr_multiplier, config=config))
        self.step_count = 0  # training steps completed
        self.history: list[dict] = []
        self.stopped: str | None = None  # why the run stopped before total_steps (a stop hook's reason)

    def optimizer_step(self) -> float:
        """Clip the accumulated gradients to ``max_grad_norm``, step AdamW, clear them; returns the norm before clipping."""
        max_norm = self.config.max_grad_norm if self.config.max_grad_norm is not None else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_([p for p in self.policy.parameters() if p.requires_grad], max_norm)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm  # FSDP
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm)

    def record_step(self, metrics: dict) -> dict:
        """Keep a finished step's ``metrics``; write a checkpoint when one is due (its path joins them)."""
        self.history.append(metrics)
        if self.checkpoint_due():
            metrics["checkpoint"] = str(self.save_checkpoint())
        return metrics

    def stop_early(self, should_stop: StopHook | None, metrics: dict) -> bool:
        """After a recorded step (never the last): whether ``should_stop`` ends the run here. Then its reason is
        :attr:`stopped` and the step is a resume point (its checkpoint saved even when none was due). Every rank
        calls it, and the hook must answer the same on each (the checkpoint is collective)."""
        if should_stop is None or self.step_count >= self.config.total_steps:
            return False
        self.stopped = should_stop(self.step_count)
        if self.stopped is not None and self.checkpoint_dir is not None and "checkpoint" not in metrics:
            metrics["checkpoint"] = str(self.save_checkpoint())
        return self.stopped is not None

    def checkpoint_due(self) -> bool:
        """A checkpoint is due every ``checkpoint_every`` steps (0: never) and after the last step."""
        if self.checkpoint_dir is None:
            return False
        every = self.config.checkpoint_every
        return self.step_count == self.config.total_steps or (every > 0 and self.step_count % every == 0)

    def save_checkpoint(self) -> Path | None:
        """Write a checkpoint of the current step (rank 0 writes; every rank's RNG state goes in)."""
        if self.checkpoint_dir is None:
            raise ValueError("no checkpoint_dir given")
        rng_states = all_gather_objects(checkpoint.capture_rng_state(), self.dist)
        model_state = optimizer_state = None
        if self.sharded and self.dist.enabled:  # GPU-only path, untested here: gather full state dicts
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            model_state, optimizer_state = get_state_dict(self.policy, self.optimizer, options=options)
        path = None
        if self.dist.is_main:
            path = checkpoint.save_checkpoint(
                self.checkpoint_dir,
                self.step_count,
                self.policy,
                self.tokenizer,
                self.optimizer,
                self.scheduler,
                rng_states,
                config=asdict(self.config),
                keep=self.config.keep_checkpoints,
                model_state=model_state,
                optimizer_state=optimizer_state,
            )
        barrier(self.dist)
        return path

    def resume(self) -> bool:
        """Load the latest checkpoint, if any: weights, optimizer, scheduler, step and RNG states."""
        path = checkpoint.latest_checkpoint(self.checkpoint_dir) if self.checkpoint_dir is not None else None
        if path is None:
            return False
        if self.sharded and self.dist.enabled:
            raise NotImplementedError("resuming an FSDP run is not implemented; its checkpoints hold full weights")
        state = checkpoint.load_checkpoint(path, self.policy, self.optimizer, self.scheduler)
        self.step_count = int(state["step"])
        rng = state["rng"]
        if len(rng) != self.dist.world_size:  # each rank's sampling and data share depend on the world size
            raise WorldSizeChanged(
                f"checkpoint {path} was written by {len(rng)} rank(s) and this run has {self.dist.world_size}: it cannot resume; start it afresh"
            )
        checkpoint.restore_rng_state(rng[self.dist.rank])
        return True


def lr_multiplier(step: int, config: Any) -> float:
    """Linear warmup over ``warmup_steps``, then cosine / linear decay to ``min_lr_ratio`` at ``total_steps``."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.lr_decay == "constant":
        return 1.0
    progress = min(1.0, (step - config.warmup_steps) / max(1, config.total_steps - config.warmup_steps))
    shape = 1.0 - progress if config.lr_decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * shape


def float32_master_weights(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with float32 parameters, upcast (and said once in the log) when it was loaded in
    bf16/fp16: AdamW on low-precision weights rounds away updates below their resolution (at lr 1e-6
    most of them), so low precision belongs to the compute (``compute_dtype``), never to the weights or
    the optimizer state."""
    low = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.is_floating_point() and p.dtype != torch.float32})
    if not low:
        return model
    logger.warning("policy loaded in %s: upcast to float32 master weights for training (set compute_dtype for low-precision compute)", "/".join(low))
    return model.float()


def decay_param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only (nanoGPT): not on norms and biases."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
