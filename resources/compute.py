"""Where tensors live: CUDA when present, else CPU, with an inference dtype policy (bf16 on GPU, fp32 on CPU).

Training always loads float32 master weights; its compute dtype is ``GRPOConfig.compute_dtype``.
"""

from __future__ import annotations

from pathlib import Path

from dagster import ConfigurableResource
from pydantic import Field


class ComputeResource(ConfigurableResource):
    """Picks the torch device and dtype for training and inference."""

    device: str = Field(default="auto", description="'auto' (CUDA when available), 'cpu', 'cuda' or 'cuda:N'")
    dtype: str = Field(
        default="auto",
        description="inference dtype (evaluation, serving): 'auto' (bfloat16 on GPU, float32 on "
        "CPU), 'float32', 'bfloat16' or 'float16'; training keeps float32 weights",
    )

    def torch_device(self):
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"compute device {self.device!r} requested but CUDA is not available")
        return device

    def torch_dtype(self):
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device().type == "cuda" else torch.float32
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"unknown dtype {self.dtype!r}; expected auto, float32, bfloat16 or float16")
        return getattr(torch, self.dtype)

    def inference_policy(self, path: str | Path):
        """(model, tokenizer) of a stored checkpoint on this device in the inference dtype, frozen: rollout
        chunks reuse one packed copy of its weights (``rlvr.fastpaths.fused_decode``)."""
        from rlvr.policy import load_policy

        model, tokenizer = load_policy(path, self.torch_device(), self.torch_dtype())
        model.requires_grad_(False)
        return model, tokenizer
