"""Atomic training checkpoints (whole or not at all), resumable at the same step; under ``checkpoint_dir``::

    step-000010/model/                      HF ``save_pretrained`` (safetensors) + tokenizer; a LoRA adapter for LoRA runs
    step-000010/trainer_state.safetensors   the trainer state's tensors (optimizer moments and steps, torch RNG states)
    step-000010/trainer_state.json          the rest: step, param groups, scheduler, python/numpy RNG states of every rank, config
    latest                                  the name of the newest complete checkpoint

Loading runs no code from the files (no pickle): an old pickled ``trainer_state.pt`` is refused. A
checkpoint is assembled in a hidden folder, flushed and renamed into place, then ``latest`` replaced.
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
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from rlvr.files import fsync_dir, fsync_tree, write_atomically

LATEST = "latest"
STATE_TENSORS = "trainer_state.safetensors"
STATE_FILE = "trainer_state.json"
PICKLED_STATE_FILE = "trainer_state.pt"  # the old format, refused
STATE_FORMAT = 1


class PickledCheckpoint(ValueError):
    """A checkpoint in the old pickle format: unpickling can run code, so it is not loaded."""


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
        write_trainer_state(
            tmp,
            {
                "step": step,
                "optimizer": optimizer_state if optimizer_state is not None else optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "rng": rng_states,
                "config": config,
            },
        )
        (tmp / "meta.json").write_text(json.dumps({"step": step, "saved_at": time.time(), "lora": _is_peft(model)}))
        fsync_tree(tmp)
        if final.exists():  # a checkpoint of this step from an earlier attempt: replace it
            stale = checkpoint_dir / f".stale-{final.name}-{uuid.uuid4().hex[:8]}"
            os.rename(final, stale)
            shutil.rmtree(stale)
        os.rename(tmp, final)
        fsync_dir(checkpoint_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    write_atomically(checkpoint_dir / LATEST, final.name)
    if keep is not None:
        for old in sorted(checkpoint_dir.glob("step-*"))[:-keep]:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(checkpoint_dir: str | Path) -> Path | None:
    """The checkpoint ``latest`` points to (also one in the old format, which loading refuses), or None
    when there is none."""
    pointer = Path(checkpoint_dir) / LATEST
    if not pointer.is_file():
        return None
    path = Path(checkpoint_dir) / pointer.read_text().strip()
    return path if (path / STATE_FILE).is_file() or (path / PICKLED_STATE_FILE).is_file() else None


def load_checkpoint(path: str | Path, model: Any, optimizer: Any = None, scheduler: Any = None) -> dict:
    """Load weights (and optimizer / scheduler state when given) from a checkpoint; return its state
    dict (``step``, ``rng``, ``config``). The trainer state is read first: a refused one changes nothing."""
    path = Path(path)
    state = read_trainer_state(path)
    load_model_weights(model, path / "model")
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
    saved = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, use_safetensors=True, trust_remote_code=False)
    model.load_state_dict(saved.state_dict())


def write_trainer_state(folder: str | Path, state: dict) -> None:
    """Write ``state`` into ``folder`` as safetensors (its tensors) + JSON (the rest, tensors by name)."""
    folder, tensors = Path(folder), {}
    document = {"format": STATE_FORMAT} | {key: _encode(value, key, tensors) for key, value in state.items()}
    save_file(_unshared(tensors), folder / STATE_TENSORS)
    (folder / STATE_FILE).write_text(json.dumps(document))


def read_trainer_state(folder: str | Path) -> dict:
    """The trainer state :func:`write_trainer_state` wrote into ``folder``; refuses an old pickled one."""
    folder = Path(folder)
    if not (folder / STATE_FILE).is_file() and (folder / PICKLED_STATE_FILE).exists():
        raise PickledCheckpoint(
            f"{folder / PICKLED_STATE_FILE} is a checkpoint in the old pickle format, which is not loaded (unpickling can run code), "
            f"so the run cannot resume from it: start the run afresh (remove {folder.parent} or use another checkpoint_dir)"
        )
    try:
        document = json.loads((folder / STATE_FILE).read_text())
        tensors = load_file(folder / STATE_TENSORS, device="cpu")
    except (SafetensorError, ValueError) as e:  # ValueError: bad JSON or bytes that are not text
        raise ValueError(f"checkpoint {folder} holds no readable trainer state ({e}), so the run cannot resume from it: start the run afresh") from e
    if not isinstance(document, dict) or document.get("format") != STATE_FORMAT:
        raise ValueError(f"{folder / STATE_FILE} is not a trainer state of format {STATE_FORMAT}")
    return {key: _decode(value, tensors, folder) for key, value in document.items() if key != "format"}


def _encode(value: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """``value`` as JSON, its tensors moved into ``tensors`` under their path; tuples, dicts with
    keys other than strings, and numpy arrays tagged so :func:`_decode` restores them exactly."""
    if isinstance(value, torch.Tensor):
        if path in tensors:
            raise ValueError(f"two tensors of the trainer state are both named {path!r}")
        tensors[path] = value.detach().cpu().contiguous()
        return {"__tensor__": path}
    if isinstance(value, np.ndarray):
        return {"__ndarray__": value.tolist(), "dtype": value.dtype.str}
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, f"{path}/{i}", tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, f"{path}/{i}", tensors) for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: _encode(v, f"{path}/{k}", tensors) for k, v in value.items()}
        return {"__dict__": [[_encode(k, path, tensors), _encode(v, f"{path}/{k}", tensors)] for k, v in value.items()]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"trainer state {path!r} is a {type(value).__name__}: a checkpoint holds tensors, numbers, strings, lists, tuples and dicts")


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors``, copying each one whose memory an earlier one holds (safetensors refuses shared memory)."""
    seen: set[int] = set()
    unshared = {}
    for name, tensor in tensors.items():
        storage = tensor.untyped_storage().data_ptr()
        unshared[name] = tensor.clone() if storage in seen else tensor
        seen.add(storage)
    return unshared


def _decode(value: Any, tensors: dict[str, torch.Tensor], folder: Path) -> Any:
    """The value :func:`_encode` turned into ``value``."""
    if isinstance(value, list):
        return [_decode(v, tensors, folder) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tensor__" in value:
        if value["__tensor__"] not in tensors:
            raise ValueError(f"{folder / STATE_TENSORS} lacks the tensor {value['__tensor__']!r} that {STATE_FILE} names")
        return tensors[value["__tensor__"]]
    if "__ndarray__" in value:
        return np.array(value["__ndarray__"], dtype=np.dtype(value["dtype"]))
    if "__tuple__" in value:
        return tuple(_decode(v, tensors, folder) for v in value["__tuple__"])
    if "__dict__" in value:
        return {_decode(k, tensors, folder): _decode(v, tensors, folder) for k, v in value["__dict__"]}
    return {k: _decode(v, tensors, folder) for k, v in value.items()}


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
