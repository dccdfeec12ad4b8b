"""The CPU sampling kernel (rlvr.fastpaths.sampling_kernel): the sampler's draw by inverse CDF and its
log-probs, greedy rows' argmax, no token of zero probability ever drawn, a row's draw its own; the engine
samples through it where its plan says."""

import pytest
import torch

from rlvr.fastpaths import FastPaths, sampling_kernel
from rlvr.fastpaths.plan import plan_backend
from rlvr.generation import SamplingConfig, generate_rollouts, sample_tokens
from rlvr.generation.sampler import GREEDY_BELOW_TEMPERATURE
from support.tiny_models import tiny_llama_with_embedded_tokenizer

pytestmark = pytest.mark.skipif(not sampling_kernel.available(), reason="no C++ kernel here (no compiler, or its build failed: logged)")


def _exact_draws(logits: torch.Tensor, temperatures: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draws by the definition, in float64."""
    cdf = torch.softmax(logits.double() / temperatures.double().unsqueeze(1), dim=-1).cumsum(dim=-1)
    return torch.searchsorted(cdf, (uniforms.double() * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)


@pytest.mark.parametrize("vocab", [1, 7, 512, 513, 49152])
def test_draws_and_log_probs_are_the_samplers(vocab):
    """Rows of a vocabulary within one block, at a block's edge and of many blocks, temperatures from 0.3 to 2:
    the float64 inverse-CDF draw (a uniform within float32 rounding of a boundary apart), the PyTorch path's
    tokens, and the log-prob of the drawn token under softmax(logits / T)."""
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(64, vocab, generator=generator) * 4
    temperatures = torch.rand(64, generator=generator) * 1.7 + 0.3
    uniforms = torch.rand(64, generator=generator)
    tokens, logprobs = sample_tokens(logits, temperatures, 1.0, uniforms=uniforms, compiled=True)
    plain, _ = sample_tokens(logits, temperatures, 1.0, uniforms=uniforms)
    assert (tokens == _exact_draws(logits, temperatures, uniforms)).float().mean() >= 63 / 64
    assert (tokens == plain).float().mean() >= 63 / 64
    want = torch.log_softmax(logits.double() / temperatures.double().unsqueeze(1), dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(logprobs.double(), want, atol=1e-5, rtol=0)


def test_evenly_spaced_uniforms_land_in_each_tokens_share():
    """2,000 uniforms spaced evenly over [0, 1) on one row of known probabilities: each token is drawn for
    the uniforms within its slice of the CDF, so its count is its probability x 2,000 (one at an edge)."""
    probs = torch.tensor([0.1, 0.0, 0.25, 0.05, 0.6] + [0.0] * 600)  # a zero inside, a block's worth of zeros after
    uniforms = (torch.arange(2000) + 0.5) / 2000
    logits = probs.log().expand(2000, -1).contiguous()
    tokens, _ = sampling_kernel.sample_rows(logits, torch.ones(2000), uniforms, GREEDY_BELOW_TEMPERATURE)
    counts = torch.bincount(tokens, minlength=len(probs)).float()
    assert (counts - probs * 2000).abs().max() <= 1
    assert counts[probs == 0].sum() == 0


def test_tokens_of_zero_probability_are_never_drawn():
    """Masked logits (-inf) in every block: uniforms at 0, the largest float32 below 1 and between never
    draw them; a row at a tiny temperature puts nearly all its mass on its top token and still draws it."""
    logits = torch.full((5, 1500), float("-inf"))
    logits[:, [3, 700, 1499]] = torch.tensor([0.0, 2.0, 1.0])
    uniforms = torch.tensor([0.0, 1 - 2**-24, 0.5, 0.999, 1e-7])
    tokens, logprobs = sample_tokens(logits, torch.tensor([1.0, 1.0, 1.0, 1.0, 1e-3]), 1.0, uniforms=uniforms, compiled=True)
    assert tokens.tolist() == [3, 1499, 700, 1499, 700]
    assert torch.isfinite(logprobs).all()


def test_greedy_rows_take_the_first_argmax_at_the_models_log_probs():
    """Temperatures below the sampler's greedy bound (0, 1e-38) take the first of tied maxima, their
    log-prob at temperature 1; a sampled row beside them keeps its own draw."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [0.5, 0.1, 0.2, 2.5], [1.0, 1.0, 1.0, 1.0]]) * 10
    temperatures = torch.tensor([0.0, 1e-38, 1.0])
    uniforms = torch.tensor([0.9, 0.9, 0.6])
    tokens, logprobs = sample_tokens(logits, temperatures, 1.0, uniforms=uniforms, compiled=True)
    assert tokens.tolist() == [1, 3, 2]
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1))


def test_a_rows_draw_is_its_own_beside_nucleus_rows():
    """Rows with top-p below 1 take the PyTorch path, the others the kernel: each row's token and log-prob
    are what it gets sampled alone."""
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 3000, generator=generator) * 3
    temperatures, top_p = torch.tensor([1.0, 0.7, 0.0, 1.2, 1.0, 0.5]), torch.tensor([1.0, 0.9, 0.5, 1.0, 0.8, 1.0])
    uniforms = torch.rand(6, generator=generator)
    together = sample_tokens(logits, temperatures, top_p, uniforms=uniforms, compiled=True)
    for row in range(6):
        alone = sample_tokens(logits[row : row + 1], temperatures[row : row + 1], top_p[row : row + 1], uniforms=uniforms[row : row + 1], compiled=True)
        assert (together[0][row], together[1][row]) == (alone[0][0], alone[1][0])
    nucleus = torch.tensor([1, 4])
    plain = sample_tokens(logits[nucleus], temperatures[nucleus], top_p[nucleus], uniforms=uniforms[nucleus])
    assert torch.equal(together[0][nucleus], plain[0]) and torch.equal(together[1][nucleus], plain[1])


def test_the_engine_samples_through_it_where_its_plan_says(monkeypatch):
    """On by default on CPU, off with its switch; seeded rollouts with and without it draw the same tokens
    (a uniform within float32 rounding of a boundary apart: none in these) at the same log-probs."""
    model, tokenizer = tiny_llama_with_embedded_tokenizer()
    calls, sample_rows = [], sampling_kernel.sample_rows
    monkeypatch.setattr(sampling_kernel, "sample_rows", lambda *args: calls.append(len(args[0])) or sample_rows(*args))
    assert plan_backend(model, FastPaths()).sampling_kernel
    assert not plan_backend(model, FastPaths(sampling_kernel=False)).sampling_kernel
    assert not plan_backend(model, FastPaths(), device="meta").sampling_kernel
    configs = [SamplingConfig(max_new_tokens=12, temperatures=[1.0], seed=3, fast_paths=FastPaths(sampling_kernel=on)) for on in (True, False)]
    runs = []
    for config in configs:
        calls.clear()
        runs.append(generate_rollouts(model, tokenizer, ["What is 6 * 7?", "Name a prime."], 3, config))
        assert bool(calls) == config.fast_paths.sampling_kernel
    assert torch.equal(runs[0].completion_ids, runs[1].completion_ids)
    torch.testing.assert_close(runs[0].logprobs, runs[1].logprobs, atol=1e-5, rtol=0)


def test_shapes_that_do_not_match_are_refused_by_name():
    with pytest.raises(RuntimeError, match="one a row"):
        sampling_kernel.sample_rows(torch.zeros(3, 10), torch.ones(2), torch.rand(3), GREEDY_BELOW_TEMPERATURE)
    with pytest.raises(RuntimeError, match="at least one token"):
        sampling_kernel.sample_rows(torch.zeros(3, 0), torch.ones(3), torch.rand(3), GREEDY_BELOW_TEMPERATURE)
