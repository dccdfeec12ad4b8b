"""GRPO: group-relative policy optimisation with verifiable rewards (Shao et al. 2024).

``config`` (the knobs), ``loss`` (the objective), ``trainer`` (the loop), ``checkpoint``
(atomic save / resume), ``distributed`` (torchrun / DDP), ``sampler`` (data order and seeds).
"""

from .checkpoint import export_merged, latest_checkpoint, load_checkpoint, save_checkpoint
from .config import GRPOConfig, LoRAConfig
from .loss import (
    POLICY_LOSSES,
    aggregate_loss,
    entropy_from_logits,
    group_advantages,
    kl_k3,
    register_policy_loss,
    token_logprobs,
    zero_variance_groups,
)
from .sampler import step_problems
from .trainer import GRPOTrainer
from .trainer_loop import WorldSizeChanged

__all__ = [
    "GRPOConfig",
    "GRPOTrainer",
    "WorldSizeChanged",
    "LoRAConfig",
    "POLICY_LOSSES",
    "aggregate_loss",
    "entropy_from_logits",
    "export_merged",
    "group_advantages",
    "kl_k3",
    "latest_checkpoint",
    "load_checkpoint",
    "register_policy_loss",
    "save_checkpoint",
    "step_problems",
    "token_logprobs",
    "zero_variance_groups",
]
