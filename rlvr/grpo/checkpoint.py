"""Atomic training checkpoints: written whole or not at all, resumable at the same step.

Layout under ``checkpoint_dir``::

    step-000010/model/             HF ``save_pretrained`` (safetensors) + tokenizer; a LoRA adapter for LoRA runs
    step-000010/trainer_state.pt   optimizer, scheduler, step, RNG states of every rank, config
    latest                         the name of the newest complete checkpoint

A checkpoint is assembled in a hidden temporary folder, flushed to disk, and renamed into place;
``latest`` is then replaced atomically. A run killed at any moment leaves the previous checkpoint
intact and ``latest`` pointing at a complete one.
"""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch

LATEST = "latest"
STATE_FILE = "trainer_state.pt"


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


def save_checkpoint(
    checkpoint_dir: str | Path,
    step: int,
    model: Any,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    rng_states: list[dict],
    config: dict | None = None,
    keep: int | None = None,
    model_state: dict | None = None,
    optimizer_state: dict | None = None,
) -> Path:
    """Write ``checkpoint_dir/step-XXXXXX`` atomically, point ``latest`` at it, keep the newest ``keep``.

    ``model_state`` / ``optimizer_state`` override the modules' own state dicts (FSDP gathers them).
    """
    checkpoint_dir = Path(checkpoint_dir)
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    final = checkpoint_dir / checkpoint_name(step)
    tmp = checkpoint_dir / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        model.save_pretrained(tmp / "model", state_dict=model_state)
        tokenizer.save_pretrained(tmp / "model")
        torch.save(
            {
                "step": step,
                "optimizer": optimizer_state if optimizer_state is not None else optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "rng": rng_states,
                "config": config,
            },
            tmp / STATE_FILE,
        )
        (tmp / "meta.json").write_text(json.dumps({"step": step, "saved_at": time.time(), "lora": _is_peft(model)}))
        _fsync_tree(tmp)
        if final.exists():  # a checkpoint of this step from an earlier attempt: replace it
            stale = checkpoint_dir / f".stale-{final.name}-{uuid.uuid4().hex[:8]}"
            os.rename(final, stale)
            shutil.rmtree(stale)
        os.rename(tmp, final)
        _fsync_dir(checkpoint_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _write_atomically(checkpoint_dir / LATEST, final.name)
    if keep is not None:
        for old in sorted(checkpoint_dir.glob("step-*"))[:-keep]:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(checkpoint_dir: str | Path) -> Path | None:
    """The checkpoint ``latest`` points to, or None when there is none."""
    pointer = Path(checkpoint_dir) / LATEST
    if not pointer.is_file():
        return None
    path = Path(checkpoint_dir) / pointer.read_text().strip()
    return path if (path / STATE_FILE).is_file() else None


def load_checkpoint(path: str | Path, model: Any, optimizer: Any = None, scheduler: Any = None) -> dict:
    """Load weights (and optimizer / scheduler state when given) from a checkpoint; return its state
    dict (``step``, ``rng``, ``config``)."""
    path = Path(path)
    load_model_weights(model, path / "model")
    state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
    return state


def load_model_weights(model: Any, folder: str | Path) -> None:
    """Copy saved weights into ``model`` in place: a LoRA adapter into a peft model, else a full HF
    checkpoint (read through ``from_pretrained``, which undoes any on-disk format conversion)."""
    folder = Path(folder)
    if _is_peft(model):
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        result = set_peft_model_state_dict(model, load_file(folder / "adapter_model.safetensors"))
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise ValueError(f"adapter checkpoint {folder} has unexpected keys: {unexpected[:5]}")
        return
    from transformers import AutoModelForCausalLM

    dtype = next(model.parameters()).dtype
    saved = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
    model.load_state_dict(saved.state_dict())


def export_merged(model: Any, tokenizer: Any, out_dir: str | Path) -> Path:
    """Save a LoRA policy as a plain HF checkpoint with the adapters merged into the weights
    (what serving and evaluation load); a full model is saved as is."""
    out_dir = Path(out_dir)
    merged = copy.deepcopy(model).merge_and_unload() if _is_peft(model) else model
    merged.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def capture_rng_state() -> dict:
    """RNG states of python, numpy and torch (CPU and CUDA) on this process."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _is_peft(model: Any) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "merge_and_unload")


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_tree(root: Path) -> None:
    for folder, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(folder))


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
