"""Shared fixtures: the GSM8k folder, a session-wide converted embedded policy, tiny models.

The shared harness is the package tests/support/ (``from support.tiny_models import ...``), which serves
Bentos through ``bench.harness``: tests/ and the repo root are put on ``sys.path`` here, so subprocesses
given this process's path as PYTHONPATH import both too.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = str(Path(__file__).resolve().parent)
for path in (TESTS, str(ROOT)):
    if path not in sys.path:
        sys.path.insert(0, path)


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
def session_warehouse(tmp_path_factory):
    """A DuckDB file for the session's materializations' cost rows."""
    from resources import Warehouse

    return Warehouse(database=str(tmp_path_factory.mktemp("warehouse") / "rlvr.duckdb"))


@pytest.fixture(scope="session")
def embedded_policy(session_store, session_warehouse):
    """The embedded SmolLM2-135M-Instruct, materialized once as the ``base_policy`` asset."""
    from dagster import materialize

    from rlvr_assets.models import base_policy

    result = materialize([base_policy], resources={"model_store": session_store, "duckdb": session_warehouse})
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
    from support.tiny_models import save_tiny_llama

    return save_tiny_llama(tmp_path / "tiny")
