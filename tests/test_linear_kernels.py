"""The fused decoder's float32 and bf16 CPU linear layers through the compiled panel GEMM
(rlvr.fastpaths.linear_kernels): the same products as the linear layers for any row count (bf16: rounded
where the model's bf16 operations round), residuals added in place, SiLU-gated inputs, and the fused
decoder takes it by its switch."""

import os
import subprocess
import sys

import pytest
import torch

from rlvr.fastpaths import FastPaths, jit, linear_kernels
from rlvr.fastpaths.fused_decode import fused_decoder
from rlvr.fastpaths.plan import plan_backend
from rlvr.generation import SamplingConfig, generate_rollouts
from support.tiny_models import char_tokenizer, tiny_llama

needs_kernel = pytest.mark.skipif(not linear_kernels.available(), reason="the linear kernels need a C++ compiler here (see the log)")
needs_bf16 = pytest.mark.skipif(not linear_kernels.available(torch.bfloat16), reason="bf16 panels need a C++ compiler and a CPU with AVX-512 BF16")


def _float64_product(layers, inputs):
    return torch.cat([inputs.double() @ layer.weight.double().T for layer in layers], dim=1)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 16, 31, 70])
@pytest.mark.parametrize("inputs_width", [72, 13])
def test_linear_is_the_layers_side_by_side_plus_the_residual_and_takes_a_gated_input(rows, inputs_width):
    torch.manual_seed(rows)
    widths = (72, 24, 24, 5)  # 125 outputs: two full panels of 48 and one of 29
    layers = [torch.nn.Linear(inputs_width, width, bias=False) for width in widths]
    inputs, residual = torch.randn(rows, inputs_width), torch.randn(rows, sum(widths))
    with torch.no_grad():
        expected = _float64_product(layers, inputs)
        panels = linear_kernels.pack(layers)
        assert panels.packed.shape == (3, inputs_width, linear_kernels.PANEL) and panels.outputs == 125
        out = linear_kernels.linear(panels, inputs)
        assert out.shape == (rows, 125) and out.dtype == torch.float32
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
        kept = residual.clone()
        out = linear_kernels.linear(panels, inputs, kept)
        assert out is kept
        torch.testing.assert_close(out.double(), residual.double() + expected, rtol=1e-5, atol=1e-5)
        gate_up = torch.randn(rows, 2 * inputs_width)
        gated = torch.nn.functional.silu(gate_up[:, :inputs_width]) * gate_up[:, inputs_width:]
        torch.testing.assert_close(linear_kernels.linear(panels, gate_up, gated=True).double(), _float64_product(layers, gated), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_linear_refuses_inputs_that_do_not_fit_the_panels():
    panels = linear_kernels.pack([torch.nn.Linear(16, 50, bias=False)])
    with pytest.raises(RuntimeError, match="input width 17 for a weight of 16 inputs"):
        linear_kernels.linear(panels, torch.randn(3, 17))
    with pytest.raises(RuntimeError, match="input width 16 for a weight of 16 inputs .gated."):
        linear_kernels.linear(panels, torch.randn(3, 16), gated=True)
    with pytest.raises(RuntimeError, match="out width 40 for 2 panels"):
        linear_kernels.linear(panels, torch.randn(3, 16), torch.zeros(3, 40))
    with pytest.raises(RuntimeError, match=r"input rows of the weight's dtype \(Float\), not Double"):
        linear_kernels.linear(panels, torch.randn(3, 16, dtype=torch.float64))


@needs_bf16
@pytest.mark.parametrize("rows", [1, 7, 8, 9, 31])
@pytest.mark.parametrize("inputs_width", [72, 13])
def test_bf16_panels_round_where_the_models_bf16_layers_round(rows, inputs_width):
    torch.manual_seed(rows)
    widths = (72, 24, 24, 5)
    layers = [torch.nn.Linear(inputs_width, width, bias=False).to(torch.bfloat16) for width in widths]
    inputs, residual = torch.randn(rows, inputs_width, dtype=torch.bfloat16), torch.randn(rows, sum(widths), dtype=torch.bfloat16)
    gate_up = torch.randn(rows, 2 * inputs_width, dtype=torch.bfloat16)
    gated = torch.nn.functional.silu(gate_up[:, :inputs_width]) * gate_up[:, inputs_width:]  # in bf16, as the model's MLP
    bf16_ulp = dict(rtol=2**-7, atol=1e-6)  # the float32 sums rounded to bf16 once: at most one unit in the last place apart
    with torch.no_grad():
        panels = linear_kernels.pack(layers)
        assert panels.packed.shape == (3, (inputs_width + 1) // 2, 2 * linear_kernels.PANEL) and panels.packed.dtype == torch.bfloat16
        product = _float64_product(layers, inputs)
        out = linear_kernels.linear(panels, inputs)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.double(), product.to(torch.bfloat16).double(), **bf16_ulp)
        kept = residual.clone()
        assert linear_kernels.linear(panels, inputs, kept) is kept
        torch.testing.assert_close(kept.double(), (residual + product.to(torch.bfloat16)).double(), **bf16_ulp)
        expected = _float64_product(layers, gated).to(torch.bfloat16).double()
        torch.testing.assert_close(linear_kernels.linear(panels, gate_up, gated=True).double(), expected, **bf16_ulp)
        with pytest.raises(RuntimeError, match=r"input rows of the weight's dtype \(BFloat16\), not Float"):
            linear_kernels.linear(panels, inputs.float())
        with pytest.raises(RuntimeError, match=f"input width {inputs_width + 2} for a weight of"):
            linear_kernels.linear(panels, torch.zeros(rows, inputs_width + 2, dtype=torch.bfloat16))


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 8, 21])
def test_the_fused_decoder_steps_equal_with_and_without_them(rows):
    model = tiny_llama(40, seed=3).requires_grad_(False)
    with torch.inference_mode():
        on, off = fused_decoder(model, 8), fused_decoder(model, 8, FastPaths(linear_kernels=False))
        assert on.linear_kernels and not off.linear_kernels
        assert on.head.panels is not None and off.head.panels is None
        tokens, positions = torch.arange(5, 5 + rows), torch.arange(rows) * 2
        logits = [d.forward(tokens, positions, lambda index, queries, keys, values, scaling: queries.reshape(len(queries), -1)) for d in (on, off)]
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)


@needs_bf16
@pytest.mark.parametrize("rows", [1, 9])
def test_the_fused_decoders_bf16_steps_are_the_onednn_ones_within_bf16_rounding(rows):
    model = tiny_llama(40, seed=3).requires_grad_(False).to(torch.bfloat16)
    with torch.inference_mode():
        on, off = fused_decoder(model, 8), fused_decoder(model, 8, FastPaths(linear_kernels=False))
        assert on.head.panels is not None and on.head.panels.packed.dtype == torch.bfloat16 and off.head.panels is None
        tokens, positions = torch.arange(5, 5 + rows), torch.arange(rows) * 2
        logits = [d.forward(tokens, positions, lambda index, queries, keys, values, scaling: queries.reshape(len(queries), -1)) for d in (on, off)]
    torch.testing.assert_close(logits[0].float(), logits[1].float(), rtol=0.05, atol=0.05)


@needs_kernel
def test_a_single_stream_generates_the_plain_paths_tokens():
    model, tokenizer = tiny_llama(40, seed=4).requires_grad_(False), char_tokenizer()
    runs = []
    for fast in (FastPaths(), FastPaths(linear_kernels=False)):
        config = SamplingConfig(max_new_tokens=24, temperatures=[0.0], stop_token_ids=[], fast_paths=fast)
        runs.append(generate_rollouts(model, tokenizer, ["abcab", "ccba"], 1, config))
    assert runs[0].completion_token_lists() == runs[1].completion_token_lists()
    torch.testing.assert_close(runs[0].logprobs, runs[1].logprobs, rtol=1e-4, atol=1e-4)


@needs_kernel
def test_they_apply_to_float32_and_bf16_cpu_fused_decoders_by_their_switch():
    model = tiny_llama(20)
    assert plan_backend(model, FastPaths()).linear_kernels
    assert not plan_backend(model, FastPaths(linear_kernels=False)).linear_kernels
    assert not plan_backend(model, FastPaths(fused_decode=False)).linear_kernels
    assert plan_backend(model.to(torch.bfloat16), FastPaths()).linear_kernels == linear_kernels.available(torch.bfloat16)
    assert not plan_backend(model.to(torch.float16), FastPaths()).linear_kernels


def test_without_a_compiler_they_stay_off_and_say_why(monkeypatch, caplog):
    monkeypatch.setattr(jit.shutil, "which", lambda name: None)
    with caplog.at_level("INFO", logger=jit.__name__):
        assert jit.cpp_module.__wrapped__("linear kernels", "rlvr_linear_kernels_", linear_kernels.SOURCE, ("panel_linear",)) is None
    assert "linear kernels off: no C++ compiler" in caplog.text


@needs_kernel
def test_kernels_build_with_this_environments_ninja_whatever_path_says(tmp_path):
    """A process whose PATH puts another ninja first (a shell without the virtual environment activated)
    still builds with this environment's: ninja versions keep build logs in different formats, and one that
    finds another's log builds every kernel again."""
    pytest.importorskip("ninja")
    called = tmp_path / "called"
    other = tmp_path / "ninja"
    other.write_text(f"#!/bin/sh\ntouch {called}\nexit 1\n")
    other.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    probe = "import os; from rlvr.fastpaths import linear_kernels; print(linear_kernels.available(), os.environ['PATH'] == os.environ['EXPECTED'])"
    done = subprocess.run([sys.executable, "-c", probe], env=env | {"EXPECTED": env["PATH"]}, capture_output=True, text=True, timeout=300)
    assert done.stdout.split() == ["True", "True"], done.stderr[-2000:]  # built (or found built), PATH as it was
    assert not called.exists()
