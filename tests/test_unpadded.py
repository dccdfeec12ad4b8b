"""The update's forward without padding: the padded forward's log-probs and gradients, on fewer tokens."""

import pytest
import torch

from rlvr.fastpaths import FastPaths
from rlvr.fastpaths.plan import plan_backend
from rlvr.grpo.scoring import PackedRows, completion_logprobs
from support.tiny_models import tiny_causal_lm, tiny_llama


def uneven_batch(vocab: int, width: int = 9) -> PackedRows:
    """Two left-padded prompts shared by five rows whose completions end at different lengths."""
    torch.manual_seed(7)
    prompt_mask = torch.ones(2, 6, dtype=torch.long)
    prompt_mask[1, :2] = 0
    lengths = torch.tensor([width, 3, 1, width - 2, 5]).clamp(1, width)
    return PackedRows(
        prompt_ids=torch.randint(3, vocab, (2, 6)),
        prompt_mask=prompt_mask,
        prompt_index=torch.tensor([0, 0, 1, 1, 1]),
        targets=torch.randint(3, vocab, (5, width)),
        mask=(torch.arange(width) < lengths.unsqueeze(1)).float(),
        temperatures=torch.tensor([1.0, 0.7, 0.0, 1.3, 1.0]),
    )


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_values_and_gradients_equal_the_padded_forward(family, autocast):
    model = tiny_causal_lm(family, 60, seed=2).train()
    assert plan_backend(model, FastPaths()).unpadded_update
    batch = uneven_batch(60)
    weights = torch.linspace(-1, 1, batch.targets.numel()).view_as(batch.targets)
    results = []
    for unpadded in (True, False):
        model.zero_grad()
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            logprobs, entropy = completion_logprobs(model, batch, with_entropy=True, fast=FastPaths(unpadded_update=unpadded))
        (logprobs * weights).sum().backward()
        results.append((logprobs.detach(), entropy, [p.grad.clone() for p in model.parameters()]))
    tolerance = dict(rtol=3e-2, atol=3e-2) if autocast else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(results[0][0], results[1][0], **tolerance)
    torch.testing.assert_close(results[0][1], results[1][1], **tolerance)
    for a, b in zip(results[0][2], results[1][2]):
        torch.testing.assert_close(a, b, **tolerance)
    assert (results[0][0][batch.mask == 0] == 0).all()


def test_padding_never_reaches_the_projections():
    model = tiny_llama(60, seed=3)
    batch = uneven_batch(60)
    seen = []
    model.model.layers[0].mlp.register_forward_hook(lambda module, args, out: seen.append(args[0].shape))
    for unpadded in (True, False):
        completion_logprobs(model, batch, fast=FastPaths(unpadded_update=unpadded))
    inputs = int(batch.mask.sum()) - len(batch.targets)  # each row's last token predicts nothing
    prompt_pass = (2, 6, 64)
    assert seen == [prompt_pass, (1, inputs, 64), prompt_pass, (5, batch.width - 1, 64)]  # real tokens as one flat sequence


def test_one_token_completions():
    model = tiny_llama(60, seed=1)
    batch = uneven_batch(60, width=1)
    got, _ = completion_logprobs(model, batch, fast=FastPaths(unpadded_update=True))
    expected, _ = completion_logprobs(model, batch, fast=FastPaths(unpadded_update=False))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
