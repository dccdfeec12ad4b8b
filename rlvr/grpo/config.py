"""GRPO training configuration: plain dataclasses, every knob in one place."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from rlvr.fastpaths import FastPaths
from rlvr.fastpaths.eligibility import COMPUTE_DTYPES
from rlvr.generation import SamplingConfig, is_greedy
from rlvr.generation.generator import EngineConfig

from .loss import AGGREGATIONS, POLICY_LOSSES

TIS_MODES = ("auto", "on", "off")


@dataclass
class LoRAConfig:
    """Low-rank adapters on the named linear layers (Hu et al. 2021, via peft)."""

    rank: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


@dataclass
class GRPOConfig:
    """One GRPO run. A step samples ``group_size`` completions for each of ``prompts_per_step``
    prompts, then makes ``num_iterations`` (μ) passes over them, each split into
    ``num_minibatches`` optimizer steps of micro-batches of ``micro_batch_size`` rows (gradient
    accumulation). ``sampling.seed`` is replaced by a seed derived from (``seed``, step, rank).
    """

    # rollouts
    group_size: int = 8
    prompts_per_step: int = 8
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    rollout: EngineConfig = field(default_factory=EngineConfig)  # the engine that generates them (native or vLLM)
    # objective
    loss_type: str = "grpo"  # a key of loss.POLICY_LOSSES: "grpo" (token ratio) or "gspo" (sequence ratio)
    aggregation: str = "seq-mean-token-mean"  # or "token-mean" (DAPO), "seq-mean-token-sum-norm" (Dr. GRPO)
    eps_low: float = 0.2
    eps_high: float = 0.2  # > eps_low is DAPO's clip-higher, e.g. 0.28
    beta: float = 0.0  # KL(π || π_ref) coefficient; 0 skips the reference model entirely
    scale_rewards: bool = True  # divide advantages by the group's reward std (False: Dr. GRPO)
    advantage_eps: float = 1e-6
    mask_truncated: bool = False  # drop completions that hit max_new_tokens from the loss (DAPO)
    skip_zero_variance: bool = True  # drop groups whose rewards are all equal from the update
    dynamic_sampling_rounds: int = 0  # DAPO: up to this many extra rounds refill groups whose rewards are all equal (off: docs/results.md 6)
    num_iterations: int = 1  # μ: optimisation passes per batch of rollouts
    num_minibatches: int = 1  # optimizer steps per pass
    micro_batch_size: int = 8  # rows per forward/backward
    share_prompt_forward: bool = True  # one prompt pass per group in the update (off with gradient checkpointing)
    # truncated importance sampling: each token's policy loss times min(π_old / π_rollout, tis_cap)
    tis: str = "auto"  # "on", "off" or "auto": on exactly when rollouts come from a low-precision copy (bf16 compute, no fsdp) or vLLM
    tis_cap: float = 2.0  # C, the largest TIS weight; must be > 1
    # optimisation (AdamW, linear warmup then decay, per training step)
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.99)
    adam_eps: float = 1e-8
    max_grad_norm: float | None = 1.0
    warmup_steps: int = 0
    total_steps: int = 100
    lr_decay: str = "cosine"  # "cosine", "linear" or "constant"
    min_lr_ratio: float = 0.1
    # model
    lora: LoRAConfig | None = None
    gradient_checkpointing: bool = False
    # "bfloat16": mixed precision. The update runs under autocast (fp32 master weights and
    # optimizer); rollouts come from a bf16 copy of the policy, refreshed after every update.
    # "auto": bfloat16 where the device computes bf16 natively (rlvr.fastpaths.eligibility.native_bf16),
    # else float32; decided once by the training's backend plan. "float32": float32 everywhere.
    compute_dtype: str = "auto"
    fsdp: bool = False  # shard with FSDP2 under torchrun on GPUs (DDP otherwise)
    fast_paths: FastPaths = field(default_factory=FastPaths)  # speed-ups of rollouts and update (rlvr.fastpaths)
    # bookkeeping
    checkpoint_every: int = 0  # steps between checkpoints; 0 = only at the end
    keep_checkpoints: int | None = 2  # newest checkpoints kept on disk (None = all)
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.sampling, dict):
            self.sampling = SamplingConfig(**self.sampling)
        self.fast_paths = FastPaths.coerce(self.fast_paths)
        if self.sampling.fast_paths != self.fast_paths:  # one setting: the run's governs its rollouts too
            if self.sampling.fast_paths != FastPaths():
                raise ValueError("set fast_paths on the GRPOConfig (it governs the rollouts too), not on its sampling")
            self.sampling = replace(self.sampling, fast_paths=self.fast_paths)
        if any(is_greedy(t) for t in self.sampling.temperatures):
            raise ValueError(
                f"sampling.temperatures {self.sampling.temperatures} holds 0: a greedy row is not a sample "
                "of the policy, so its group's advantages and importance ratios would be wrong; "
                "use temperatures > 0 for training (evaluation and serving keep greedy)"
            )
        if isinstance(self.lora, dict):
            self.lora = LoRAConfig(**self.lora)
        if isinstance(self.rollout, dict):
            self.rollout = EngineConfig(**self.rollout)
        if self.rollout.engine == "vllm" and self.fsdp:
            raise ValueError("rollout.engine vllm with fsdp: vLLM shards its own copy (rollout.tensor_parallel_size); train with DDP")
        self.betas = tuple(self.betas)
        if self.loss_type not in POLICY_LOSSES:
            raise ValueError(f"unknown loss_type {self.loss_type!r}; registered: {sorted(POLICY_LOSSES)}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"unknown aggregation {self.aggregation!r}; expected one of {AGGREGATIONS}")
        if self.group_size < 2:
            raise ValueError("group_size must be >= 2: advantages are relative to the group")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype must be one of {COMPUTE_DTYPES}, got {self.compute_dtype!r}")
        if self.lr_decay not in ("cosine", "linear", "constant"):
            raise ValueError(f"unknown lr_decay {self.lr_decay!r}")
        if self.dynamic_sampling_rounds < 0:
            raise ValueError("dynamic_sampling_rounds must be >= 0")
        if self.dynamic_sampling_rounds and not self.skip_zero_variance:
            raise ValueError("dynamic_sampling_rounds needs skip_zero_variance: refills replace the groups it skips")
        if self.dynamic_sampling_rounds and self.fsdp:
            raise ValueError("dynamic_sampling_rounds is not supported with fsdp (ranks would generate different rounds)")
        if self.tis not in TIS_MODES:
            raise ValueError(f"tis must be one of {TIS_MODES}, got {self.tis!r}")
        if isinstance(self.tis_cap, bool) or not isinstance(self.tis_cap, (int, float)) or not self.tis_cap > 1:
            raise ValueError(f"tis_cap must be a number > 1 (the largest importance weight a token gets), got {self.tis_cap!r}")
        for name in ("prompts_per_step", "num_iterations", "num_minibatches", "micro_batch_size", "total_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")

    def tis_weight_cap(self, other_rollouts: bool) -> float | None:
        """The TIS cap in force, None when TIS is off: ``tis="auto"`` turns it on exactly when the
        rollouts come from other numerics than the update's (a lower-precision copy, another engine)."""
        on = self.tis == "on" or (self.tis == "auto" and other_rollouts)
        return float(self.tis_cap) if on else None
