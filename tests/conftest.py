"""Shared fixtures: the GSM8k folder, a session-wide converted embedded policy, tiny models."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def gsm8k_dir() -> Path:
    """The official GSM8k jsonl files: the local source's default (``$RLVR_GSM8K_DIR``, else the shipped copy)."""
    from rlvr.settings import Settings

    path = Settings.from_env().gsm8k_dir
    assert (path / "train.jsonl").is_file(), f"GSM8k data not found at {path}: set RLVR_GSM8K_DIR"
    return path


@pytest.fixture(scope="session")
def session_store(tmp_path_factory):
    """A model store shared by the whole session (the embedded policy is converted into it once)."""
    from resources import ModelStore

    return ModelStore(root=str(tmp_path_factory.mktemp("model_store")))


@pytest.fixture(scope="session")
def embedded_policy(session_store):
    """The embedded SmolLM2-135M-Instruct, materialized once as the ``base_policy`` asset."""
    from dagster import materialize

    from rlvr_assets.models import base_policy

    result = materialize([base_policy], resources={"model_store": session_store})
    assert result.success
    return session_store.latest("base_policy")


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A fresh data directory ($RLVR_HOME) for a pipeline test."""
    monkeypatch.setenv("RLVR_HOME", str(tmp_path))
    monkeypatch.delenv("BENTOML_HOME", raising=False)
    return tmp_path


@pytest.fixture
def tiny_llama_dir(tmp_path):
    """A tiny randomly initialised Llama checkpoint with the embedded model's tokenizer and chat template."""
    return save_tiny_llama(tmp_path / "tiny")


def tiny_llama_with_embedded_tokenizer(seed: int = 0, tie_word_embeddings: bool = True):
    """(a randomly initialised 2-layer Llama, the embedded model's tokenizer and chat template)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from rlvr import policy

    gguf = policy.embedded_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=tie_word_embeddings,
    )
    return LlamaForCausalLM(config), tokenizer


def save_tiny_llama(out_dir: Path, seed: int = 0) -> Path:
    from rlvr import policy

    model, tokenizer = tiny_llama_with_embedded_tokenizer(seed)
    policy.export_checkpoint(model, tokenizer, out_dir)
    return out_dir
