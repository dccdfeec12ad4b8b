"""A float32 CPU decode step of a few rows through the compiled matrix-vector kernel
(rlvr.fastpaths.row_kernels): the same products as the linear layers, residuals added in place, and the
fused decoder takes it by its switch for steps of at most MAX_ROWS rows."""

import os
import subprocess
import sys

import pytest
import torch

from rlvr.fastpaths import FastPaths, jit, row_kernels
from rlvr.fastpaths.fused_decode import fused_decoder
from rlvr.fastpaths.plan import plan_backend
from rlvr.generation import SamplingConfig, generate_rollouts
from support.tiny_models import char_tokenizer, tiny_llama

needs_kernel = pytest.mark.skipif(not row_kernels.available(), reason="the row kernels need a C++ compiler here (see the log)")


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 4, 9])
def test_linear_is_the_layers_side_by_side_plus_the_residual_and_takes_a_gated_input(rows):
    torch.manual_seed(rows)
    layers = [torch.nn.Linear(72, width, bias=False) for width in (72, 24, 24, 5)]  # a width not a multiple of the block
    inputs, residual = torch.randn(rows, 72), torch.randn(rows, 125)
    with torch.no_grad():
        expected = torch.cat([layer(inputs) for layer in layers], dim=1)
        weights = row_kernels.weights(layers)
        torch.testing.assert_close(row_kernels.linear(weights, inputs), expected, rtol=1e-5, atol=1e-5)
        kept = residual.clone()
        out = row_kernels.linear(weights, inputs, kept)
        assert out is kept
        torch.testing.assert_close(out, residual + expected, rtol=1e-5, atol=1e-5)
        gate_up = torch.randn(rows, 144)
        gated = torch.nn.functional.silu(gate_up[:, :72]) * gate_up[:, 72:]
        torch.testing.assert_close(row_kernels.linear(weights, gate_up, gated=True), row_kernels.linear(weights, gated), rtol=1e-5, atol=1e-5)
        layers[1].weight.mul_(2)  # an update in place is seen: the kernel reads the layer's own weight
        torch.testing.assert_close(row_kernels.linear(weights, inputs)[:, 72:96], 2 * expected[:, 72:96], rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, row_kernels.MAX_ROWS, row_kernels.MAX_ROWS + 2])
def test_the_fused_decoder_steps_equal_with_and_without_them(rows):
    model = tiny_llama(40, seed=3).requires_grad_(False)
    with torch.inference_mode():
        on, off = fused_decoder(model, 8), fused_decoder(model, 8, FastPaths(row_kernels=False))
        assert on.row_kernels and not off.row_kernels
        tokens, positions = torch.arange(5, 5 + rows), torch.arange(rows) * 2
        logits = [d.forward(tokens, positions, lambda index, queries, keys, values, scaling: queries.reshape(len(queries), -1)) for d in (on, off)]
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)


@needs_kernel
def test_a_single_stream_generates_the_plain_paths_tokens():
    model, tokenizer = tiny_llama(40, seed=4).requires_grad_(False), char_tokenizer()
    runs = []
    for fast in (FastPaths(), FastPaths(row_kernels=False)):
        config = SamplingConfig(max_new_tokens=24, temperatures=[0.0], stop_token_ids=[], fast_paths=fast)
        runs.append(generate_rollouts(model, tokenizer, ["abcab", "ccba"], 1, config))
    assert runs[0].completion_token_lists() == runs[1].completion_token_lists()
    torch.testing.assert_close(runs[0].logprobs, runs[1].logprobs, rtol=1e-4, atol=1e-4)


@needs_kernel
def test_they_apply_to_float32_cpu_fused_decoders_by_their_switch():
    model = tiny_llama(20)
    assert plan_backend(model, FastPaths()).row_kernels
    assert not plan_backend(model, FastPaths(row_kernels=False)).row_kernels
    assert not plan_backend(model, FastPaths(fused_decode=False)).row_kernels
    assert not plan_backend(model.to(torch.bfloat16), FastPaths()).row_kernels


def test_without_a_compiler_they_stay_off_and_say_why(monkeypatch, caplog):
    monkeypatch.setattr(jit.shutil, "which", lambda name: None)
    with caplog.at_level("INFO", logger=jit.__name__):
        assert jit.cpp_module.__wrapped__("row kernels", "rlvr_row_kernels_", row_kernels.SOURCE, ("rows_linear",)) is None
    assert "row kernels off: no C++ compiler" in caplog.text


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
    probe = "import os; from rlvr.fastpaths import row_kernels; print(row_kernels.available(), os.environ['PATH'] == os.environ['EXPECTED'])"
    done = subprocess.run([sys.executable, "-c", probe], env=env | {"EXPECTED": env["PATH"]}, capture_output=True, text=True, timeout=300)
    assert done.stdout.split() == ["True", "True"], done.stderr[-2000:]  # built (or found built), PATH as it was
    assert not called.exists()
