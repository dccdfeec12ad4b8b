"""Named GRPO run profiles: a starting GRPOConfig per machine budget, any field overridable."""

from __future__ import annotations

from .config import GRPOConfig

PROFILES: dict[str, dict] = {
    # a handful of steps of the embedded 135M model on 2 CPU cores, in a few minutes
    "default": {
        "total_steps": 4,
        "prompts_per_step": 4,
        "group_size": 4,
        "lr": 2e-6,
        "warmup_steps": 0,
        "micro_batch_size": 8,
        "checkpoint_every": 2,
        "sampling": {"max_new_tokens": 128, "temperatures": [0.7, 0.8, 0.9, 1.0]},
    },
    # one GPU: a real run (bf16 compute where the GPU has it: compute_dtype auto)
    "full": {
        "total_steps": 500,
        "prompts_per_step": 32,
        "group_size": 8,
        "lr": 1e-6,
        "warmup_steps": 10,
        "micro_batch_size": 16,
        "num_iterations": 2,
        "eps_high": 0.28,
        "aggregation": "token-mean",
        "mask_truncated": True,
        "checkpoint_every": 50,
        "sampling": {"max_new_tokens": 512, "temperatures": [1.0]},
    },
}


def build_config(profile: str, overrides: dict | None = None) -> GRPOConfig:
    """The profile's GRPOConfig with ``overrides`` applied (nested ``sampling`` / ``lora`` dicts merge)."""
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; expected one of {sorted(PROFILES)}")
    fields = {**PROFILES[profile]}
    for key, value in (overrides or {}).items():
        if key not in GRPOConfig.__dataclass_fields__:
            raise ValueError(f"unknown GRPOConfig field {key!r} in overrides")
        if key in ("sampling", "lora") and isinstance(value, dict) and isinstance(fields.get(key), dict):
            fields[key] = {**fields[key], **value}
        else:
            fields[key] = value
    return GRPOConfig(**fields)
