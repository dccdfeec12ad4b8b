"""Scoring: each token's log-prob under the model, and the most likely alternatives at each position."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rlvr.generation.sampler import logprob_temperatures


@dataclass
class TokenScores:
    """One sequence scored by the model: each token's log-prob after its prefix (from the second token
    on), and the ``top_k`` most likely tokens at each of those positions with their log-probs."""

    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


def score_tokens(model: Any, sequences: list[list[int]], temperatures: list[float], top_k: int = 0, positions_per_chunk: int = 256) -> list[TokenScores]:
    """Score each sequence in one forward pass (``temperatures``: one per sequence; a greedy one scores at
    1, as :func:`sample_tokens` records): what serving's prompt log-probs (``echo``) and alternatives
    (``logprobs: k``) read. The vocabulary projection runs ``positions_per_chunk`` positions at a time,
    so a long prompt never holds its whole [positions, vocabulary] logits."""
    device = next(model.parameters()).device
    head, scores = model.get_output_embeddings(), []
    with torch.inference_mode():
        for ids, temperature in zip(sequences, temperatures):
            scale = float(logprob_temperatures(torch.tensor([float(temperature)]))[0])
            hidden = model.get_decoder()(input_ids=torch.tensor([ids], device=device)).last_hidden_state[0, :-1]
            targets = torch.tensor(ids[1:], device=device)
            logprobs, top_ids, top_logprobs = [], [], []
            for start in range(0, hidden.shape[0], positions_per_chunk):
                part = torch.log_softmax(head(hidden[start : start + positions_per_chunk]).float() / scale, dim=-1)
                logprobs += part.gather(1, targets[start : start + positions_per_chunk, None]).squeeze(1).tolist()
                if top_k:
                    values, indices = part.topk(top_k, dim=-1)
                    top_ids += indices.tolist()
                    top_logprobs += values.tolist()
            scores.append(TokenScores(logprobs, top_ids, top_logprobs))
    return scores
