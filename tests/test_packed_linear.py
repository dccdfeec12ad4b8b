"""Linear layers on packed oneDNN weights: the same outputs as nn.Linear, restored afterwards."""

from dataclasses import replace

import pytest
import torch
from torch import nn

import rlvr.fastpaths.packed_linear as packed_linear
from rlvr.fastpaths import FastPaths
from rlvr.fastpaths.packed_linear import packed_linears, packing_dtypes
from rlvr.generation import SamplingConfig, generate_rollouts
from support.tiny_models import char_tokenizer, tiny_llama

pytestmark = pytest.mark.skipif(not packing_dtypes(), reason="PyTorch built without oneDNN")


def linears(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if type(m) is nn.Linear]


@pytest.mark.parametrize("rows", [1, 3, 8, 40])
def test_outputs_equal_nn_linear_for_any_row_count(rows):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 96), nn.Linear(96, 32, bias=False))
    inputs = [torch.randn(rows, 48), torch.randn(rows, 1, 48)]  # 2-D and 3-D inputs
    with torch.no_grad():
        expected = [model(x) for x in inputs]
        with packed_linears(model, rows=8) as count:
            got = [model(x) for x in inputs]
    assert count == 2
    for e, g in zip(expected, got):
        assert g.shape == e.shape
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_layers_are_restored_on_exit_and_after_an_error():
    model = tiny_llama(vocab_size=20)
    layers = linears(model)
    with torch.no_grad(), packed_linears(model, rows=4) as count:
        assert count == len(layers) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer + output layer
        assert all("forward" in vars(m) for m in layers)
    assert not any("forward" in vars(m) for m in layers)
    with pytest.raises(RuntimeError, match="boom"), torch.no_grad(), packed_linears(model, rows=4):
        raise RuntimeError("boom")
    assert not any("forward" in vars(m) for m in layers)


def test_refuses_to_run_where_gradients_are_wanted():
    with pytest.raises(RuntimeError, match="no gradients"), packed_linears(nn.Linear(4, 4), rows=1):
        pass


def test_packed_weights_are_a_snapshot_taken_on_entry():
    """Weights change between rollouts (training): each rollout packs the current ones."""
    model = nn.Linear(16, 16)
    x = torch.randn(2, 16)
    with torch.no_grad():
        with packed_linears(model, rows=2):
            before = model(x)
        model.weight.add_(1.0)
        with packed_linears(model, rows=2):
            after = model(x)
        torch.testing.assert_close(after, nn.functional.linear(x, model.weight, model.bias), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(before, after)


def test_subclasses_and_unsupported_dtypes_are_left_alone():
    class Custom(nn.Linear):  # e.g. a quantized or adapter layer with its own forward
        pass

    model = nn.Sequential(Custom(8, 8), nn.Linear(8, 8).half())
    with torch.no_grad(), packed_linears(model, rows=2) as count:
        assert count == 0


def test_greedy_rollouts_are_the_same_with_and_without_packing(monkeypatch):
    tokenizer = char_tokenizer()
    model = tiny_llama(len(tokenizer), seed=4)
    prompts = ["12+3=", "7*8 = ?", "a"]
    config = SamplingConfig(max_new_tokens=12, temperatures=[0.0])
    config = replace(config, fast_paths=FastPaths(fused_decode=False))  # decode through the model's forward
    calls = []
    packed_forward = packed_linear._packed_forward
    monkeypatch.setattr(packed_linear, "_packed_forward", lambda *a: calls.append(1) or packed_forward(*a))
    packed = generate_rollouts(model, tokenizer, prompts, 2, config)
    assert len(calls) == 15 * 12  # every linear layer, prefill + 11 decode steps, ran packed
    plain = generate_rollouts(model, tokenizer, prompts, 2, replace(config, fast_paths=FastPaths(fused_decode=False, packed_linears=False)))
    assert len(calls) == 15 * 12  # ... and none with packing off
    assert torch.equal(packed.completion_ids, plain.completion_ids)
    torch.testing.assert_close(packed.logprobs, plain.logprobs, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(torch.bfloat16 not in packing_dtypes(), reason="no bf16 oneDNN on this CPU")
def test_bfloat16_outputs_stay_close():
    torch.manual_seed(1)
    model = nn.Linear(64, 128).to(torch.bfloat16)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = model(x).float()
        with packed_linears(model, rows=5) as count:
            got = model(x)
    assert count == 1 and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, rtol=0.02, atol=0.02)
