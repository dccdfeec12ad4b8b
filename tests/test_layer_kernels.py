"""A float32 or bf16 CPU decode step's compiled RMSNorm and rotary embedding (rlvr.fastpaths.layer_kernels):
the model's own formulas (in bf16 rounded where the model's bf16 operations round), and the fused
decoder uses them where its switch says."""

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from rlvr.fastpaths import FastPaths, layer_kernels
from rlvr.fastpaths.fused_decode import fused_decoder
from support.tiny_models import tiny_llama


def test_rms_norm_is_the_models():
    torch.manual_seed(0)
    norm = LlamaRMSNorm(96, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    hidden = torch.randn(5, 96) * torch.tensor([1e-3, 1.0, 30.0, 1.0, 1e3])[:, None]  # rows of very different scales
    with torch.no_grad():
        torch.testing.assert_close(layer_kernels.rms_norm(hidden, norm.weight, norm.variance_epsilon), norm(hidden), rtol=1e-5, atol=1e-6)


def test_rotary_rotates_the_query_and_key_heads_as_the_model_does():
    """Queries (4 heads) and keys (2 heads) side by side with the values, as the fused projection
    gives them: the first 6 heads come back rotated as ``apply_rotary_pos_emb`` rotates them."""
    torch.manual_seed(1)
    rows, head_dim = 3, 16
    projected = torch.randn(rows, 8 * head_dim)
    angles = torch.rand(rows, head_dim // 2) * 100
    cos, sin = torch.cat([angles.cos()] * 2, dim=-1), torch.cat([angles.sin()] * 2, dim=-1)
    heads = projected.view(rows, 8, head_dim).transpose(0, 1)  # [heads, rows, head dim]
    queries, keys = apply_rotary_pos_emb(heads[:4], heads[4:6], cos, sin, unsqueeze_dim=0)
    got = layer_kernels.rotary(projected, cos, sin, 6)
    torch.testing.assert_close(got, torch.cat([queries, keys]).transpose(0, 1), rtol=1e-5, atol=1e-6)


def test_bf16_rms_norm_rounds_where_the_model_does():
    """Normalized in float32, rounded to bf16, then times the bf16 weight: the model's bf16 values, a
    sum taken in another order apart (a step at each of its two roundings at most, nearly every value
    bit for bit)."""
    torch.manual_seed(3)
    norm = LlamaRMSNorm(576, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.normal_()
        hidden = (torch.randn(64, 576) * torch.logspace(-3, 3, 64)[:, None]).to(torch.bfloat16)  # rows of very different scales
        got, want = layer_kernels.rms_norm(hidden, norm.weight, norm.variance_epsilon), norm(hidden)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=0)
    assert (got.view(torch.int16) == want.view(torch.int16)).float().mean() > 0.99


def test_bf16_rotary_is_pytorchs_bit_for_bit():
    """Each product and the sum rounded to bf16 as PyTorch's bf16 operations round them (ties to even,
    overflow to infinity): ``apply_rotary_pos_emb`` on bf16 heads, exactly."""
    torch.manual_seed(4)
    rows, head_dim = 5, 64
    projected = torch.randn(rows, 15 * head_dim)
    projected[0, :8] = torch.tensor([3e38, -3e38, 1e-38, 0.0, -0.0, 1.0, 2**-130, 7e37])  # tiny, signed zeros
    projected[0, head_dim // 2] = -3e38  # the first's rotation partner: their sum overflows
    projected = projected.to(torch.bfloat16)
    angles = torch.rand(rows, head_dim // 2) * 100
    angles[0, 0] = torch.pi / 4
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(torch.bfloat16) for f in (torch.cos, torch.sin))
    heads = projected.view(rows, 15, head_dim).transpose(0, 1)
    queries, keys = apply_rotary_pos_emb(heads[:9], heads[9:12], cos, sin, unsqueeze_dim=0)
    got = layer_kernels.rotary(projected, cos, sin, 12)
    want = torch.cat([queries, keys]).transpose(0, 1).contiguous()
    assert got.dtype == torch.bfloat16 and torch.isinf(want).any()
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_the_kernels_refuse_mixed_dtypes_by_name():
    with pytest.raises(ValueError, match="torch.float32 beside torch.bfloat16"):
        layer_kernels.rms_norm(torch.ones(2, 32, dtype=torch.bfloat16), torch.ones(32), 1e-5)
    with pytest.raises(ValueError, match="torch.bfloat16 beside torch.float32"):
        layer_kernels.rms_norm(torch.ones(2, 32), torch.ones(32, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(ValueError, match="torch.float32 beside torch.bfloat16"):
        layer_kernels.rotary(torch.ones(2, 64, dtype=torch.bfloat16), torch.ones(2, 16), torch.ones(2, 16), 2)


def test_the_fused_decoder_takes_them_by_its_switch_on_the_same_packed_weights():
    model = tiny_llama(40, seed=2).requires_grad_(False)
    with torch.inference_mode():
        on, off = fused_decoder(model, 4), fused_decoder(model, 4, FastPaths(layer_kernels=False))
        assert on.kernels and not off.kernels
        assert off.layers[0][1] is on.layers[0][1]  # not packed again
        tokens, positions = torch.tensor([5, 7, 9]), torch.tensor([0, 3, 11])
        logits = [decoder.forward(tokens, positions, lambda index, queries, keys, values, scaling: queries.reshape(len(queries), -1)) for decoder in (on, off)]
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)


def test_a_bf16_fused_decoder_takes_them_too():
    model = tiny_llama(40, seed=5).to(torch.bfloat16).requires_grad_(False)
    with torch.inference_mode():
        on, off = fused_decoder(model, 4), fused_decoder(model, 4, FastPaths(layer_kernels=False))
        assert on.kernels and not off.kernels
        tokens, positions = torch.tensor([5, 7, 9]), torch.tensor([0, 3, 11])
        logits = [decoder.forward(tokens, positions, lambda index, queries, keys, values, scaling: queries.reshape(len(queries), -1)) for decoder in (on, off)]
    assert logits[0].dtype == torch.bfloat16
    torch.testing.assert_close(logits[0].float(), logits[1].float(), rtol=0.05, atol=0.05)
