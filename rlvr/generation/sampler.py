"""The sampler: one token per row from its logits, each row drawing from its own generator.

A row's generator is seeded by its request's seed, the prompt's index in its call and the row's sample
index (:func:`row_seed`), so a seeded row samples the same tokens alone, beside other requests,
in training and in serving.
"""

from __future__ import annotations

import numpy as np
import torch

from rlvr.fastpaths import sampling_kernel

GREEDY_BELOW_TEMPERATURE = 1e-5  # a lower temperature is greedy: logits / T would overflow float32 (NaN probabilities)
NUCLEUS_CANDIDATES = (64, 1024)  # top-p seeks a row's nucleus among this many of its most likely tokens first (_top_p_filter)


def derive_seed(*parts: int) -> int:
    """A 63-bit seed mixing ``parts`` (e.g. run seed, step, rank) through numpy's SeedSequence."""
    return int(np.random.SeedSequence([int(p) % 2**64 for p in parts]).generate_state(2, np.uint64)[0] >> np.uint64(1))


def row_seed(seed: int, prompt: int, sample: int, temperature: float) -> int | None:
    """The seed of the generator of sample ``sample`` of prompt ``prompt`` (its index in the call) under
    ``seed``; None when greedy (no generator)."""
    return None if is_greedy(temperature) else derive_seed(seed, prompt, sample)


def is_greedy(temperature: float) -> bool:
    """Whether a row at ``temperature`` decodes greedily (see :func:`sample_tokens`)."""
    return temperature < GREEDY_BELOW_TEMPERATURE


def logprob_temperatures(temperatures: torch.Tensor) -> torch.Tensor:
    """The temperature each row's log-probs are taken at: its own, 1 for a greedy row (below
    ``GREEDY_BELOW_TEMPERATURE``). The sampler and every recomputation of its log-probs use this."""
    return torch.where(temperatures < GREEDY_BELOW_TEMPERATURE, 1.0, temperatures)


def sample_tokens(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_p: float | torch.Tensor,
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its log-prob. Row r samples from softmax(logits_r / T_r) truncated to its
    top-p nucleus (``top_p``: one for all rows or one per row) by inverse CDF at ``uniforms[r]`` (else a
    draw from ``generator``), or takes the argmax when greedy; its log-prob is taken before truncation
    (T_r = 1 for greedy rows), as training recomputes it. ``compiled`` (CPU logits, the plan's
    ``sampling_kernel``): rows without top-p through ``rlvr.fastpaths.sampling_kernel``."""
    if compiled:
        return _sample_compiled(logits, temperatures, top_p, generator, uniforms)
    greedy = temperatures < GREEDY_BELOW_TEMPERATURE
    scaled = logits.float() / logprob_temperatures(temperatures).unsqueeze(1)
    probs = torch.softmax(scaled, dim=-1)
    if greedy.all():
        tokens = probs.argmax(dim=-1)
    else:
        truncated = bool((torch.as_tensor(top_p) < 1.0).any())
        sampling_probs = _top_p_filter(probs, top_p) if truncated else probs
        tokens = _inverse_cdf_sample(sampling_probs, generator, uniforms)
        if greedy.any():
            tokens = torch.where(greedy, probs.argmax(dim=-1), tokens)
    return tokens, probs.gather(1, tokens.unsqueeze(1)).squeeze(1).log()


def _sample_compiled(
    logits: torch.Tensor, temperatures: torch.Tensor, top_p: float | torch.Tensor, generator: torch.Generator | None, uniforms: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sample_tokens` with each row sampled by the kernel, but a row with a nucleus to find (top-p
    below 1, not greedy), sampled as before: a row's draw never depends on the rows beside it. Each row
    is sampled once, by one of the two."""
    rows = logits.shape[0]
    if uniforms is None:
        uniforms = torch.rand((rows,), generator=generator, device=logits.device)
    top_p = torch.as_tensor(top_p, dtype=torch.float32).expand(rows)
    nucleus = (top_p < 1.0) & ~(temperatures < GREEDY_BELOW_TEMPERATURE)
    if not nucleus.any():
        return sampling_kernel.sample_rows(logits, temperatures, uniforms, GREEDY_BELOW_TEMPERATURE)
    whole, found = (~nucleus).nonzero().squeeze(1), nucleus.nonzero().squeeze(1)
    tokens, logprobs = torch.empty(rows, dtype=torch.int64), torch.empty(rows)
    if len(whole):
        tokens[whole], logprobs[whole] = sampling_kernel.sample_rows(logits[whole], temperatures[whole], uniforms[whole], GREEDY_BELOW_TEMPERATURE)
    tokens[found], logprobs[found] = sample_tokens(logits[found], temperatures[found], top_p[found], uniforms=uniforms[found])
    return tokens, logprobs


def draw_uniforms(generators: list[torch.Generator | None]) -> torch.Tensor:
    """One draw in [0, 1) per row from its own generator (0 for greedy rows, which draw nothing)."""
    return torch.tensor([0.0 if g is None else float(torch.rand((), generator=g)) for g in generators])


def _inverse_cdf_sample(probs: torch.Tensor, generator: torch.Generator | None, uniforms: torch.Tensor | None) -> torch.Tensor:
    """One draw per row from unnormalized ``probs`` (many times faster than ``torch.multinomial`` on CPU);
    zero-probability tokens are never drawn, so the sampled token's log-prob is finite."""
    cdf = probs.cumsum(dim=-1)
    if uniforms is None:
        uniforms = torch.rand((probs.shape[0],), generator=generator, device=probs.device)
    u = uniforms.unsqueeze(1) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def _top_p_filter(probs: torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """Zero the tail of each row outside the smallest set of tokens whose mass reaches ``top_p`` (its own, per
    row; a row at 1 is left whole). Each row's nucleus is sought among its most likely tokens first
    (``NUCLEUS_CANDIDATES``), then the whole sorted vocabulary: a token past candidates whose mass reaches
    ``top_p`` has at least that much before it (sorting a 49k vocabulary takes ~2-4 ms a row on CPU)."""
    vocab = probs.shape[1]
    thresholds = torch.as_tensor(top_p, dtype=probs.dtype, device=probs.device).expand(probs.shape[0])
    left = (thresholds < 1.0).nonzero().squeeze(1)  # rows whose nucleus is not found yet
    filtered = probs.clone()
    for k in (*(k for k in NUCLEUS_CANDIDATES if k < vocab), vocab):
        if not len(left):
            break
        rows, threshold = probs[left], thresholds[left].unsqueeze(1)
        top, order = rows.topk(k, dim=-1) if k < vocab else rows.sort(dim=-1, descending=True)
        mass = top.cumsum(dim=-1)
        found = mass[:, -1] >= threshold[:, 0] if k < vocab else torch.ones_like(left, dtype=torch.bool)
        kept = torch.where(mass - top < threshold, top, 0.0)  # the mass before it not yet enough
        filtered[left[found]] = torch.zeros_like(rows[found]).scatter_(-1, order[found], kept[found])
        left = left[~found]
    return filtered
