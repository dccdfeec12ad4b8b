"""A float32 CPU decode step's compiled RMSNorm and rotary embedding (rlvr.fastpaths.layer_kernels):
the model's own formulas, and the fused decoder uses them where its switch says."""

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


def test_the_fused_decoder_takes_them_by_its_switch_on_the_same_packed_weights():
    model = tiny_llama(40, seed=2).requires_grad_(False)
    with torch.inference_mode():
        on, off = fused_decoder(model, 4), fused_decoder(model, 4, FastPaths(layer_kernels=False))
        assert on.kernels and not off.kernels
        assert off.layers[0][1] is on.layers[0][1]  # not packed again
        tokens, positions = torch.tensor([5, 7, 9]), torch.tensor([0, 3, 11])
        logits = [decoder.forward(tokens, positions, lambda index, queries, keys, values, scaling: queries.reshape(len(queries), -1)) for decoder in (on, off)]
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)
