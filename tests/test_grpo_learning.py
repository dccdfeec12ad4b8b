"""GRPO learns a verifiable toy task from scratch, and would not with the advantage's sign flipped.

Task: the prompt is ``"dd:"`` for a digit d; the reward is 1 when the completion starts with d.
A randomly initialised 2-layer model starts near chance (about 1/14) and must learn to read the
prompt to do better. Runs train in the default compute dtype (bf16 where the CPU has native bf16, else
float32); the float32 and bf16 variants pin each.
"""

import copy

import pytest
import torch

import rlvr.grpo.trainer as trainer_module
from rlvr.generation import SamplingConfig
from rlvr.grpo import GRPOConfig, GRPOTrainer, LoRAConfig
from support.tiny_models import COPY_DIGIT_CHARS, char_tokenizer, copy_digit_reward, tiny_llama
from support.tiny_models import COPY_DIGIT_PROBLEMS as PROBLEMS

pytestmark = pytest.mark.slow  # trains until the policy learns


def config(**overrides) -> GRPOConfig:
    settings = dict(
        group_size=16,
        prompts_per_step=16,
        sampling=SamplingConfig(max_new_tokens=3, temperatures=[1.0]),
        lr=1e-2,
        lr_decay="constant",
        total_steps=30,
        micro_batch_size=128,
        seed=0,
    )
    return GRPOConfig(**(settings | overrides))


def train(cfg: GRPOConfig, seed: int = 0) -> list[dict]:
    tokenizer = char_tokenizer(COPY_DIGIT_CHARS)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threads only add overhead
    try:
        return GRPOTrainer(tiny_llama(len(tokenizer), seed=seed), tokenizer, cfg, copy_digit_reward).train(PROBLEMS)
    finally:
        torch.set_num_threads(threads)


def mean_reward(history: list[dict], steps: slice) -> float:
    values = [h["reward_mean"] for h in history[steps]]
    return sum(values) / len(values)


def test_grpo_raises_reward_on_toy_task():
    history = train(config(total_steps=40))
    assert mean_reward(history, slice(0, 3)) < 0.2
    assert mean_reward(history, slice(-5, None)) > 0.75  # 0.79 to 0.99 over the last 5 steps across seeds 0-2, float32 or bf16
    reached = next(h["step"] for h in history if h["reward_mean"] > 0.6)
    assert reached <= 25
    last = history[-1]
    assert last["reward_copy_digit_mean"] == last["reward_mean"]
    assert last["entropy"] < history[0]["entropy"]


def test_flipped_advantage_does_not_learn(monkeypatch):
    flipped = lambda *args, **kwargs: -group_advantages(*args, **kwargs)  # noqa: E731
    group_advantages = trainer_module.group_advantages
    monkeypatch.setattr(trainer_module, "group_advantages", flipped)
    history = train(config(total_steps=20))
    assert mean_reward(history, slice(-5, None)) < 0.05


# LoRA on a random model learns slower: the adapters must also reach the (random) output layer
LORA = LoRAConfig(rank=8, alpha=16, target_modules=["q_proj", "v_proj", "lm_head"])


@pytest.mark.parametrize(
    "overrides, final_reward",
    [
        (dict(aggregation="token-mean", eps_high=0.28), 0.6),
        (dict(aggregation="seq-mean-token-sum-norm", scale_rewards=False), 0.6),
        (dict(loss_type="gspo", eps_low=3e-4, eps_high=4e-4, num_iterations=2), 0.6),
        (dict(beta=0.01, num_iterations=2, num_minibatches=2, micro_batch_size=64), 0.6),
        (dict(lora=LORA, lr=3e-2, beta=0.01), 0.25),  # reference = the policy with adapters off
        (dict(gradient_checkpointing=True, micro_batch_size=32), 0.6),
        (dict(compute_dtype="bfloat16"), 0.6),
        (dict(compute_dtype="float32"), 0.6),
    ],
    ids=["dapo-token-mean", "dr-grpo", "gspo-mu2", "kl-mu2-minibatches", "lora-kl", "grad-checkpointing", "bf16", "float32"],
)
def test_objective_variants_learn(overrides, final_reward):
    history = train(config(**overrides))
    assert mean_reward(history, slice(0, 3)) < 0.15
    assert mean_reward(history, slice(-5, None)) > final_reward
    if overrides.get("beta"):
        assert max(h["kl"] for h in history) > 0
    if overrides.get("num_iterations", 1) > 1:
        assert history[-1]["optimizer_steps"] == overrides["num_iterations"] * overrides.get("num_minibatches", 1)


def test_rows_without_signal_cost_no_update():
    tokenizer = char_tokenizer(COPY_DIGIT_CHARS)
    model = tiny_llama(len(tokenizer), seed=0)
    before = copy.deepcopy(model.state_dict())
    constant = lambda completions, problems: ([1.0] * len(completions), {})  # noqa: E731
    trainer = GRPOTrainer(model, tokenizer, config(total_steps=2), constant)
    update_calls = []
    trainer.model.register_forward_pre_hook(lambda *a: update_calls.append(1))  # the update's forwards
    history = trainer.train(PROBLEMS)
    assert [h["frac_zero_variance_groups"] for h in history] == [1.0, 1.0]
    assert [h["trained_rows"] for h in history] == [0, 0] and history[-1]["optimizer_steps"] == 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not update_calls

    # truncated completions are dropped from the update when masked
    seen = []
    cfg = config(total_steps=1, mask_truncated=True)
    trainer = GRPOTrainer(model, tokenizer, cfg, copy_digit_reward, on_step=lambda *args: seen.append(args))
    metrics = trainer.train(PROBLEMS)[0]
    ((step, logged, records),) = seen
    assert step == 1 and logged is metrics and len(records) == 16 * 16
    truncated = [r for r in records if r["finish_reason"] == "length"]
    assert 0 < len(truncated) < len(records) and metrics["truncation_rate"] == len(truncated) / len(records)
    assert not any(r["trained"] for r in truncated)
    assert metrics["trained_rows"] == sum(r["trained"] for r in records) > 0


def test_dynamic_sampling_refills_groups_without_signal():
    """DAPO's dynamic sampling: groups whose rewards are all equal are replaced by fresh problems'
    groups; every generation is recorded and counted, the update trains on at most the step's share."""
    tokenizer = char_tokenizer(COPY_DIGIT_CHARS)
    problems = [{**p, "solvable": p["digit"] in "0123"} for p in PROBLEMS]  # the rest always score 0

    def reward(completions, batch):
        values = [float(p["solvable"] and text[:1] in "02468") for text, p in zip(completions, batch)]
        return values, {"r": values}

    def run(rounds):
        cfg = config(group_size=8, prompts_per_step=4, total_steps=3, lr=1e-3, dynamic_sampling_rounds=rounds)
        trainer = GRPOTrainer(tiny_llama(len(tokenizer), seed=3), tokenizer, cfg, reward)
        steps = []
        trainer.on_step = lambda step, metrics, records: steps.append((metrics, records))
        trainer.train(problems)
        return steps

    plain, refilled = run(0), run(3)
    for metrics, records in plain:
        assert metrics["groups_generated"] == 4 and len(records) == 32
    assert sum(m["frac_zero_variance_groups"] > 0 for m, _ in plain) > 0  # unsolvable problems were drawn
    for (metrics, records), (base, _) in zip(refilled, plain):
        trained_groups = {r["group_index"] for r in records if r["trained"]}
        assert len(trained_groups) <= 4  # never more than the step's share
        assert len(records) == 8 * metrics["groups_generated"]  # every generation recorded
        assert len({(r["group_index"], r["sample_index"]) for r in records}) == len(records)  # unique keys
        assert metrics["frac_groups_kept"] == pytest.approx(len(trained_groups) / metrics["groups_generated"])
        assert len(trained_groups) >= base["trained_rows"] // 8  # at least as many groups with signal
    assert sum(m["groups_generated"] for m, _ in refilled) > 12  # refills happened
    assert sum(m["trained_rows"] for m, _ in refilled) > sum(m["trained_rows"] for m, _ in plain)
