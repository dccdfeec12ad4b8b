"""The precision policy: weights and optimizer state stay float32 whatever the policy was loaded in;
low precision is the compute's (``GRPOConfig.compute_dtype``), so no update rounds away."""

import logging

import pytest
import torch

from rlvr.generation import SamplingConfig, generate_rollouts
from rlvr.grpo import GRPOConfig, GRPOTrainer
from rlvr.grpo.scoring import completion_logprobs, pack_rows
from rlvr.sft import SFTConfig
from support.tiny_models import COPY_DIGIT_CHARS, COPY_DIGIT_PROBLEMS, char_tokenizer, tiny_llama, tiny_qwen2


def even_first_digit(completions: list[str], problems: list[dict]) -> tuple[list[float], dict[str, list[float]]]:
    """A reward that splits nearly every group of a random policy, so every step updates."""
    values = [1.0 if text[:1] in "02468" and text[:1] else 0.0 for text in completions]
    return values, {"even": values}


def trained_fraction(compute_dtype: str, load_dtype: torch.dtype, steps: int = 3):
    """(trainer, fraction of weight elements that changed) after ``steps`` GRPO steps at lr 1e-6."""
    tokenizer = char_tokenizer(COPY_DIGIT_CHARS)
    model = tiny_qwen2(len(tokenizer)).to(load_dtype)  # tied embeddings: the output layer's gradient is dense
    before = {name: p.detach().float().clone() for name, p in model.named_parameters()}
    config = GRPOConfig(
        group_size=8,
        prompts_per_step=4,
        sampling=SamplingConfig(max_new_tokens=4, temperatures=[1.0]),
        lr=1e-6,
        lr_decay="constant",
        total_steps=steps,
        micro_batch_size=32,
        compute_dtype=compute_dtype,
    )
    trainer = GRPOTrainer(model, tokenizer, config, even_first_digit)
    trainer.train(COPY_DIGIT_PROBLEMS)
    assert trainer.history[-1]["optimizer_steps"] == 1
    changed = total = 0
    for name, p in trainer.policy.named_parameters():
        changed += int((p.detach().float() != before[name]).sum())
        total += p.numel()
    return trainer, changed / total


def test_a_bf16_policy_with_bf16_compute_changes_essentially_every_weight(caplog):
    with caplog.at_level(logging.WARNING, logger="rlvr.grpo"):
        trainer, fraction = trained_fraction("bfloat16", torch.bfloat16)
    assert fraction > 0.99  # AdamW on the bf16 weights themselves changed ~2% at this lr
    assert {p.dtype for p in trainer.policy.parameters()} == {torch.float32}
    states = [s for s in trainer.optimizer.state.values() if "exp_avg" in s]
    assert states and {s["exp_avg"].dtype for s in states} == {torch.float32}
    assert {p.dtype for p in trainer.rollout_policy.parameters()} == {torch.bfloat16}  # sampling stays bf16
    upcasts = [r for r in caplog.records if "upcast to float32 master weights" in r.getMessage()]
    assert len(upcasts) == 1 and "bfloat16" in upcasts[0].getMessage()


def test_a_bf16_policy_with_float32_compute_trains_in_float32_without_autocast():
    trainer, fraction = trained_fraction("float32", torch.bfloat16, steps=1)
    assert fraction > 0.99
    assert trainer.rollout_policy is trainer.policy  # no low-precision copy: nothing is mixed
    with trainer._autocast():
        assert not torch.is_autocast_enabled("cpu")  # CUDA would warn and disable a float32 autocast


def test_a_float32_policy_is_not_copied_or_logged(caplog):
    with caplog.at_level(logging.WARNING, logger="rlvr.grpo"):
        trainer, _ = trained_fraction("bfloat16", torch.float32, steps=1)
    assert not [r for r in caplog.records if "upcast" in r.getMessage()]
    assert {p.dtype for p in trainer.policy.parameters()} == {torch.float32}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))])
@pytest.mark.parametrize("compute_dtype, tolerance", [("float32", 1e-4), ("bfloat16", 0.05)])
def test_sampled_logprobs_equal_the_trainers_recomputed_ones(device, compute_dtype, tolerance):
    """On-policy, the importance ratio starts at 1: the log-probs the rollout copy sampled with (CUDA
    graphs on a GPU) equal those the update recomputes from the float32 master weights under the
    compute dtype, token by token within ``tolerance`` (bf16: 0.05; on CPU the largest difference is about 0.004)."""
    tokenizer = char_tokenizer(COPY_DIGIT_CHARS)
    model = tiny_llama(len(tokenizer), seed=2).to(device)
    sampling = SamplingConfig(max_new_tokens=8, temperatures=[0.7, 1.0])
    config = GRPOConfig(group_size=8, prompts_per_step=4, sampling=sampling, lr=1e-6, total_steps=1, micro_batch_size=32, compute_dtype=compute_dtype)
    trainer = GRPOTrainer(model, tokenizer, config, even_first_digit)
    rollouts = generate_rollouts(trainer.rollout_policy, tokenizer, [p["prompt"] for p in COPY_DIGIT_PROBLEMS[:4]], 8, sampling)
    batch = pack_rows(rollouts, torch.arange(len(rollouts)), device)
    with torch.no_grad(), trainer._autocast():
        recomputed, _ = completion_logprobs(trainer.policy, batch, share_prompts=True, with_entropy=False)
    mask = batch.mask.bool()
    error = (recomputed.float() - rollouts.logprobs[:, : batch.width].to(recomputed.device))[mask].abs()
    assert mask.sum() > 100 and error.max() < tolerance, f"largest |sampled - recomputed| log-prob {error.max():.2e}"
    metrics = trainer.train(COPY_DIGIT_PROBLEMS)[0]  # one pass, one optimizer step: every ratio is taken before it
    assert metrics["rollout_logprob_abs_diff"] < tolerance and metrics["clip_frac"] == 0


@pytest.mark.parametrize("config_class", [GRPOConfig, SFTConfig])
def test_compute_dtype_defaults_to_auto_and_names_itself_when_wrong(config_class):
    assert config_class().compute_dtype == "auto"
    assert config_class(compute_dtype="float32").compute_dtype == "float32"  # float32 everywhere: one setting
    with pytest.raises(ValueError, match=r"compute_dtype must be one of \('auto', 'float32', 'bfloat16'\), got 'float16'"):
        config_class(compute_dtype="float16")
