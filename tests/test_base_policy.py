"""The base_policy asset: embedded GGUF -> HF checkpoint in the model store, cached by content hash."""

import time

import pytest
import torch
from dagster import materialize

from resources import ModelStore, Warehouse
from rlvr.policy import EMBEDDED_MODEL, load_policy, load_source, resolve_source
from rlvr.tasks.gsm8k.prompt import render_prompt
from rlvr_assets.models import base_policy


@pytest.mark.slow  # loads the embedded model
def test_embedded_policy_is_a_standard_checkpoint_that_generates(embedded_policy):
    files = {p.name for p in embedded_policy.path.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "manifest.json"} <= files
    assert embedded_policy.manifest["parameters"] == 134_515_008
    assert embedded_policy.manifest["source"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    model, tokenizer = load_policy(embedded_policy.path)
    prompt = render_prompt(tokenizer, "What is 2 + 3?")
    assert "<|im_start|>assistant" in prompt
    ids = tokenizer(prompt, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**ids, max_new_tokens=20, do_sample=False)
        saved_logits = model(**ids).logits[0, -1]
        gguf_model, _ = load_source(resolve_source(EMBEDDED_MODEL))
        gguf_logits = gguf_model(**ids).logits[0, -1]
    text = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert len(text.split()) >= 5 and text.isascii()
    # the stored checkpoint computes exactly what transformers' own GGUF load computes
    torch.testing.assert_close(saved_logits, gguf_logits)


@pytest.mark.slow  # loads the embedded model
def test_second_materialization_reuses_the_stored_checkpoint(embedded_policy, session_store, session_warehouse):
    started = time.perf_counter()
    result = materialize([base_policy], resources={"model_store": session_store, "duckdb": session_warehouse})
    elapsed = time.perf_counter() - started
    metadata = result.asset_materializations_for_node("base_policy")[0].metadata
    assert metadata["reused_stored_checkpoint"].value is True
    assert metadata["version"].value == embedded_policy.version
    assert elapsed < 20


def test_local_hf_folder_source(tmp_path, tiny_llama_dir):
    store = ModelStore(root=str(tmp_path / "store"))
    config = {"ops": {"base_policy": {"config": {"model": str(tiny_llama_dir)}}}}
    result = materialize([base_policy], resources={"model_store": store, "duckdb": Warehouse(database=str(tmp_path / "rlvr.duckdb"))}, run_config=config)
    metadata = result.asset_materializations_for_node("base_policy")[0].metadata
    assert metadata["source"].value.startswith("hf_dir:") and metadata["parameters"].value > 0
    assert store.latest("base_policy").path.is_dir()


@pytest.mark.parametrize(
    "model, message",
    [("/no/such/folder", "model path not found"), ("./missing.gguf", "GGUF model file not found")],
)
def test_missing_model_is_named(tmp_path, model, message):
    store = ModelStore(root=str(tmp_path / "store"))
    config = {"ops": {"base_policy": {"config": {"model": model}}}}
    result = materialize(
        [base_policy], resources={"model_store": store, "duckdb": Warehouse(database=str(tmp_path / "rlvr.duckdb"))}, run_config=config, raise_on_error=False
    )
    assert not result.success
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    assert message in failure.event_specific_data.error.message
