"""Checkpoints: atomic, complete, a killed run resumes to the very same weights, and loading one runs
no code (the trainer state is safetensors + JSON; a planted pickle is refused, never unpickled)."""

import io
import os
import random

import numpy as np
import pytest
import torch

import rlvr.grpo.checkpoint as checkpoint_module
from rlvr.generation import SamplingConfig
from rlvr.grpo import GRPOConfig, GRPOTrainer, LoRAConfig, WorldSizeChanged, export_merged, latest_checkpoint
from rlvr.grpo.trainer_loop import decay_param_groups
from rlvr.policy import load_policy
from support.tiny_models import COPY_DIGIT_CHARS, char_tokenizer, tiny_llama
from support.tiny_models import COPY_DIGIT_PROBLEMS as PROBLEMS
from support.tiny_models import copy_digit_reward as reward


def config(**overrides) -> GRPOConfig:
    settings = dict(
        group_size=8,
        prompts_per_step=6,
        sampling=SamplingConfig(max_new_tokens=4, temperatures=[0.8, 1.0]),
        lr=1e-2,
        warmup_steps=2,
        total_steps=6,
        num_iterations=2,
        num_minibatches=2,
        micro_batch_size=16,
        checkpoint_every=2,
        keep_checkpoints=2,
        seed=3,
    )
    return GRPOConfig(**(settings | overrides))


class Killed(Exception):
    pass


def kill_after(step: int):
    def on_step(current, metrics, records):
        if current == step:
            raise Killed

    return on_step


def weights(trainer: GRPOTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.policy.state_dict().items()}


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("lora", [None, LoRAConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "lm_head"])])
def test_killed_run_resumes_to_identical_weights(tmp_path, lora):
    tokenizer = char_tokenizer(COPY_DIGIT_CHARS)
    straight = GRPOTrainer(tiny_llama(len(tokenizer), seed=0), tokenizer, config(lora=lora), reward, checkpoint_dir=tmp_path / "a")
    straight_history = straight.train(PROBLEMS)

    first = GRPOTrainer(
        tiny_llama(len(tokenizer), seed=0),
        tokenizer,
        config(lora=lora),
        reward,
        checkpoint_dir=tmp_path / "b",
        on_step=kill_after(3),
    )
    with pytest.raises(Killed):
        first.train(PROBLEMS)
    assert latest_checkpoint(tmp_path / "b").name == "step-000002"  # step 3 finished but was not saved

    # a fresh process: different initial weights, which the checkpoint must overwrite (with LoRA,
    # the same base model and fresh adapters)
    fresh = tiny_llama(len(tokenizer), seed=0 if lora else 1)
    resumed = GRPOTrainer(fresh, tokenizer, config(lora=lora), reward, checkpoint_dir=tmp_path / "b")
    resumed_history = resumed.train(PROBLEMS)
    assert [h["step"] for h in resumed_history] == [3, 4, 5, 6]
    assert [h["reward_mean"] for h in resumed_history] == [h["reward_mean"] for h in straight_history[2:]]
    assert [h["lr"] for h in resumed_history] == [h["lr"] for h in straight_history[2:]]
    final, expected = weights(resumed), weights(straight)
    assert final.keys() == expected.keys()
    assert all(torch.equal(final[k], expected[k]) for k in expected)
    assert any(not torch.equal(final[k], weights(first)[k]) for k in expected)  # it did train past the kill


def test_checkpoint_layout_is_a_loadable_policy(tmp_path):
    tokenizer = char_tokenizer(COPY_DIGIT_CHARS)
    trainer = GRPOTrainer(tiny_llama(len(tokenizer), seed=0), tokenizer, config(), reward, checkpoint_dir=tmp_path)
    history = trainer.train(PROBLEMS)
    assert history[-1]["checkpoint"] == str(tmp_path / "step-000006")
    assert (tmp_path / "latest").read_text() == "step-000006"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000004", "step-000006"]  # keep 2
    assert {p.name for p in (tmp_path / "step-000006").iterdir()} == {"model", "trainer_state.safetensors", "trainer_state.json", "meta.json"}
    model, loaded_tokenizer = load_policy(tmp_path / "step-000006" / "model")
    assert loaded_tokenizer.padding_side == "left" and loaded_tokenizer("12:").input_ids == tokenizer("12:").input_ids
    assert all(torch.equal(v, trainer.policy.state_dict()[k]) for k, v in model.state_dict().items())
    state = checkpoint_module.read_trainer_state(tmp_path / "step-000006")
    assert state["step"] == 6 and state["config"]["seed"] == 3 and len(state["rng"]) == 1


def test_a_crash_while_saving_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    tokenizer = char_tokenizer(COPY_DIGIT_CHARS)
    model = tiny_llama(len(tokenizer), seed=0)
    trainer = GRPOTrainer(model, tokenizer, config(total_steps=4), reward, checkpoint_dir=tmp_path)
    real_save = checkpoint_module.save_file

    def failing_save(tensors, path, *args, **kwargs):
        if "step-000004" in str(path):
            raise OSError("disk full")
        return real_save(tensors, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint_module, "save_file", failing_save)
    with pytest.raises(OSError, match="disk full"):
        trainer.train(PROBLEMS)
    assert latest_checkpoint(tmp_path).name == "step-000002"
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-000002"]  # no half-written folder left


def test_lora_checkpoint_holds_the_adapter_and_exports_merged_weights(tmp_path):
    tokenizer = char_tokenizer(COPY_DIGIT_CHARS)
    lora = LoRAConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "lm_head"])
    model = tiny_llama(len(tokenizer), seed=0)
    trainer = GRPOTrainer(model, tokenizer, config(total_steps=2, lora=lora), reward, checkpoint_dir=tmp_path)
    trainer.train(PROBLEMS)
    saved = {p.name for p in (tmp_path / "step-000002" / "model").iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json"} <= saved and "model.safetensors" not in saved

    export_merged(trainer.policy, tokenizer, tmp_path / "merged")
    merged, _ = load_policy(tmp_path / "merged")
    ids = torch.tensor([tokenizer("37:1").input_ids])
    with torch.no_grad():
        expected = trainer.policy(input_ids=ids).logits
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, atol=1e-5, rtol=1e-5)


def test_a_checkpoint_of_another_world_size_is_not_resumed(tmp_path):
    """Each rank's data share and sampling seeds depend on the world size: resuming across sizes
    would silently train on other data with other randomness."""
    tokenizer = char_tokenizer(COPY_DIGIT_CHARS)
    first = GRPOTrainer(tiny_llama(len(tokenizer)), tokenizer, config(total_steps=2), reward, checkpoint_dir=tmp_path)
    first.train(PROBLEMS)
    path = latest_checkpoint(tmp_path)
    state = checkpoint_module.read_trainer_state(path)
    state["rng"] = state["rng"] * 2  # as two ranks would have written it
    checkpoint_module.write_trainer_state(path, state)
    again = GRPOTrainer(tiny_llama(len(tokenizer)), tokenizer, config(total_steps=4), reward, checkpoint_dir=tmp_path)
    with pytest.raises(WorldSizeChanged, match="written by 2 rank\\(s\\) and this run has 1: it cannot resume"):
        again.train(PROBLEMS)


def test_records_per_rank_reach_on_step_on_every_rank():
    tokenizer = char_tokenizer(COPY_DIGIT_CHARS)
    seen = []
    trainer = GRPOTrainer(
        tiny_llama(len(tokenizer)),
        tokenizer,
        config(total_steps=1, checkpoint_every=0),
        reward,
        on_step=lambda step, metrics, records: seen.append(records),
        records_per_rank=True,
    )
    trainer.train(PROBLEMS)
    assert len(seen) == 1 and len(seen[0]) == 6 * 8 and {r["rank"] for r in seen[0]} == {0}


class Exploit:
    """Unpickling it creates ``marker``: what a planted checkpoint could do instead (run any code)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


@pytest.mark.parametrize("planted", [checkpoint_module.PICKLED_STATE_FILE, checkpoint_module.STATE_FILE, checkpoint_module.STATE_TENSORS])
def test_a_planted_pickle_is_refused_and_never_run(tmp_path, planted):
    """A pickle at the old state file's place (the new files gone) or in place of a new one: resuming
    fails with an error naming the file, before touching the model, and the pickle's code never runs."""
    tokenizer = char_tokenizer(COPY_DIGIT_CHARS)
    GRPOTrainer(tiny_llama(len(tokenizer)), tokenizer, config(total_steps=2), reward, checkpoint_dir=tmp_path / "run").train(PROBLEMS)
    folder, marker = latest_checkpoint(tmp_path / "run"), tmp_path / "pwned"
    if planted == checkpoint_module.PICKLED_STATE_FILE:  # a checkpoint as the old format left it
        (folder / checkpoint_module.STATE_FILE).unlink()
        (folder / checkpoint_module.STATE_TENSORS).unlink()
    torch.save({"step": 2, "optimizer": Exploit(marker)}, folder / planted)

    resumed = GRPOTrainer(tiny_llama(len(tokenizer), seed=1), tokenizer, config(total_steps=4), reward, checkpoint_dir=tmp_path / "run")
    before = weights(resumed)
    if planted == checkpoint_module.PICKLED_STATE_FILE:
        expected = f"{folder / planted} is a checkpoint in the old pickle format, which is not loaded .* start the run afresh"
        with pytest.raises(checkpoint_module.PickledCheckpoint, match=expected):
            resumed.train(PROBLEMS)
    else:
        with pytest.raises(ValueError, match=f"checkpoint {folder} holds no readable trainer state .*start the run afresh"):
            resumed.train(PROBLEMS)
    assert not marker.exists()
    assert resumed.step_count == 0 and all(torch.equal(v, before[k]) for k, v in weights(resumed).items())

    torch.load(io.BytesIO((folder / planted).read_bytes()), weights_only=False)  # the control: unpickling the planted bytes runs their code
    assert marker.exists()


def test_the_trainer_state_round_trips_exactly(tmp_path):
    """Optimizer moments, steps and param groups, the scheduler, config and every RNG come back equal:
    the resumed optimizer takes the same step, and the RNGs draw the same numbers."""
    model = tiny_llama(12, seed=0)
    optimizer = torch.optim.AdamW(decay_param_groups(model, 0.1), lr=1e-2, betas=(0.9, 0.99), fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (step + 1))
    ids = torch.randint(0, 12, (2, 5))
    for _ in range(3):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step(), scheduler.step(), optimizer.zero_grad()
    random.seed(1), np.random.seed(2), torch.manual_seed(3), np.random.standard_normal()  # numpy holds a cached gaussian
    state = {
        "step": 3,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": [checkpoint_module.capture_rng_state()],
        "config": {"betas": (0.9, 0.99), "lora": None},
    }
    checkpoint_module.write_trainer_state(tmp_path, state)
    expected_draws = (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3))

    loaded = checkpoint_module.read_trainer_state(tmp_path)
    saved_optimizer, loaded_optimizer = state["optimizer"], loaded["optimizer"]
    assert loaded_optimizer["param_groups"] == saved_optimizer["param_groups"] and isinstance(loaded_optimizer["param_groups"][0]["betas"], tuple)
    assert loaded_optimizer["state"].keys() == saved_optimizer["state"].keys() and len(saved_optimizer["state"]) > 0
    for index, moments in saved_optimizer["state"].items():
        assert moments.keys() == loaded_optimizer["state"][index].keys() == {"step", "exp_avg", "exp_avg_sq"}
        for name, tensor in moments.items():
            assert loaded_optimizer["state"][index][name].dtype == tensor.dtype and torch.equal(loaded_optimizer["state"][index][name], tensor)
    assert loaded["scheduler"] == state["scheduler"] and loaded["config"] == state["config"] and loaded["step"] == 3

    checkpoint_module.restore_rng_state(loaded["rng"][0])
    draws = (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3))
    assert draws[:2] == expected_draws[:2] and torch.equal(draws[2], expected_draws[2])

    twin = tiny_llama(12, seed=0)
    twin.load_state_dict(model.state_dict())
    twin_optimizer = torch.optim.AdamW(decay_param_groups(twin, 0.0), lr=1.0, fused=True)  # its settings come from the state
    twin_optimizer.load_state_dict(loaded_optimizer)
    for m, o in ((model, optimizer), (twin, twin_optimizer)):
        m(input_ids=ids, labels=ids).loss.backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))


def test_a_trainer_state_holding_an_unknown_type_is_not_written(tmp_path):
    with pytest.raises(TypeError, match="trainer state 'config/home' is a PosixPath"):
        checkpoint_module.write_trainer_state(tmp_path, {"step": 1, "config": {"home": tmp_path}})
