"""SFT cold start: targets in the project's answer format, the loss on completion tokens only, it
learns, and a killed run resumes to the same weights."""

import pytest
import torch

from rlvr.answers import extract_final_answer, is_well_formed
from rlvr.generation import SamplingConfig, generate_rollouts
from rlvr.grpo import checkpoint as ckpt
from rlvr.sft import SFTConfig, SFTTrainer, sft_examples, sft_target
from support.tiny_models import COPY_DIGIT_CHARS, char_tokenizer, tiny_llama

NATALIA = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May."


def test_targets_are_reference_solutions_in_the_answer_format():
    target = sft_target(NATALIA, "72")
    assert target == ("Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips altogether in April and May.\n#### 72")
    assert extract_final_answer(target, "strict").value == 72 and is_well_formed(target)
    assert sft_target("", "5") == "#### 5"
    with pytest.raises(ValueError, match="answer_text is empty"):
        sft_target(NATALIA, " ")


def test_examples_use_the_shared_prompt_and_end_with_the_end_token(tiny_llama_dir):
    from rlvr.policy import load_tokenizer
    from rlvr.tasks.gsm8k.prompt import render_prompt

    tokenizer = load_tokenizer(tiny_llama_dir)
    [example] = sft_examples([{"question": "How many clips?", "solution": NATALIA, "answer_text": "72"}], tokenizer)
    assert tokenizer.decode(example["prompt_ids"]) == render_prompt(tokenizer, "How many clips?")
    assert tokenizer.decode(example["target_ids"]).endswith("#### 72" + tokenizer.eos_token)


def test_kept_annotations_hold_a_result_and_drop_the_rest():
    target = sft_target(NATALIA, "72", keep_calculator_annotations=True)
    assert target == ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72")
    assert sft_target("3 apples <<3>>3 and <<1+2=3>>3", "3", keep_calculator_annotations=True) == "3 apples 3 and <<1+2=3>>3\n#### 3"
    assert extract_final_answer(target, "strict").value == 72


@pytest.mark.parametrize("keep", [False, True], ids=["stripped", "kept"])
def test_calculator_results_are_the_environments_tokens(tiny_llama_dir, keep):
    """With annotations kept, the policy learns to write '<<48/2=' and to go on after '>>'; the
    '24>>' between is the calculator's at rollout time: those tokens are masked out of the loss."""
    from rlvr.environments import Calculator
    from rlvr.policy import load_tokenizer
    from rlvr.tasks.gsm8k.prompt import render_prompt, system_prompt_for

    tokenizer = load_tokenizer(tiny_llama_dir)
    row = {"question": "How many clips?", "solution": NATALIA, "answer_text": "72"}
    [example] = sft_examples([row], tokenizer, keep_calculator_annotations=keep, environment=Calculator())
    assert tokenizer.decode(example["prompt_ids"]) == render_prompt(tokenizer, "How many clips?", system_prompt_for(Calculator()))
    ids, environment = example["target_ids"], example["environment_mask"]
    assert len(environment) == len(ids)
    assert tokenizer.decode(ids) == sft_target(NATALIA, "72", keep) + tokenizer.eos_token
    spans, start = [], None  # runs of environment tokens, decoded
    for t, flag in enumerate(environment + [0]):
        if flag and start is None:
            start = t
        elif not flag and start is not None:
            spans.append((start, t))
            start = None
    if not keep:
        assert spans == [] and "<<" not in tokenizer.decode(ids)
        return
    assert [tokenizer.decode(ids[a:b]) for a, b in spans] == ["24>>", "72>>"]
    (a1, b1), (a2, _) = spans
    assert tokenizer.decode(ids[:a1]).endswith("= <<48/2=")  # the policy writes the call
    assert tokenizer.decode(ids[b1:a2]).startswith("24 clips in May.")  # and goes on after the result
    assert tokenizer.decode(ids[b1:a2]).endswith("<<48+24=")


def copy_examples(tokenizer):
    return [{"prompt_ids": tokenizer(f"{d}{d}:")["input_ids"], "target_ids": tokenizer(f"{d}")["input_ids"] + [1]} for d in range(10)]


def config(**overrides):
    return SFTConfig(**({"batch_size": 10, "micro_batch_size": 4, "total_steps": 40, "lr": 1e-2, "lr_decay": "constant", "seed": 1} | overrides))


def test_the_loss_is_the_mean_nll_of_completion_tokens_only():
    tokenizer = char_tokenizer(COPY_DIGIT_CHARS)
    model = tiny_llama(len(tokenizer), seed=2)
    examples = copy_examples(tokenizer)[:3]
    with torch.no_grad():  # by hand: one forward over prompt + target, log-softmax at the target positions
        nll, count = 0.0, 0
        for e in examples:
            ids = torch.tensor([e["prompt_ids"] + e["target_ids"]])
            logits = model(ids).logits[0, len(e["prompt_ids"]) - 1 : -1].log_softmax(-1)
            nll -= float(logits.gather(1, torch.tensor(e["target_ids"])[:, None]).sum())
            count += len(e["target_ids"])
    trainer = SFTTrainer(model, tokenizer, config(batch_size=3, micro_batch_size=2, compute_dtype="float32"))  # the float32 forward by hand
    assert trainer.step(examples)["loss"] == pytest.approx(nll / count, rel=1e-5)


def test_environment_tokens_are_context_outside_the_loss():
    """A target whose middle token the environment wrote: the loss is the mean NLL of the others,
    the environment's token still conditioning what follows."""
    tokenizer = char_tokenizer(COPY_DIGIT_CHARS)
    model = tiny_llama(len(tokenizer), seed=2)
    examples = [
        {"prompt_ids": tokenizer(f"{d}{d}:")["input_ids"], "target_ids": tokenizer(f"{d}:{d}")["input_ids"] + [1], "environment_mask": [0, 1, 1, 0]}
        for d in range(3)
    ]
    with torch.no_grad():
        nll, count = 0.0, 0
        for e in examples:
            ids = torch.tensor([e["prompt_ids"] + e["target_ids"]])
            logprobs = model(ids).logits[0, len(e["prompt_ids"]) - 1 : -1].log_softmax(-1).gather(1, torch.tensor(e["target_ids"])[:, None])
            policy = torch.tensor(e["environment_mask"]) == 0
            nll -= float(logprobs[policy].sum())
            count += int(policy.sum())
    metrics = SFTTrainer(model, tokenizer, config(batch_size=3, micro_batch_size=2, compute_dtype="float32")).step(examples)
    assert metrics["tokens"] == count == 6
    assert metrics["loss"] == pytest.approx(nll / count, rel=1e-5)


def test_sft_learns_the_copy_task():
    tokenizer = char_tokenizer(COPY_DIGIT_CHARS)
    model = tiny_llama(len(tokenizer), seed=0)
    history = SFTTrainer(model, tokenizer, config()).train(copy_examples(tokenizer))
    assert history[-1]["loss"] < 0.2 * history[0]["loss"]
    prompts = [f"{d}{d}:" for d in range(10)]
    rollouts = generate_rollouts(model, tokenizer, prompts, 1, SamplingConfig(max_new_tokens=2, temperatures=[0.0]))
    assert sum(text.startswith(str(d)) for d, text in enumerate(rollouts.texts)) >= 9


def test_a_killed_run_resumes_to_the_same_weights(tmp_path):
    tokenizer = char_tokenizer(COPY_DIGIT_CHARS)
    examples = copy_examples(tokenizer)
    straight = SFTTrainer(tiny_llama(len(tokenizer), seed=0), tokenizer, config(total_steps=6))
    straight.train(examples)

    class Killed(Exception):
        pass

    def kill_at_4(step, metrics):
        if step == 4:
            raise Killed

    first = SFTTrainer(tiny_llama(len(tokenizer), seed=0), tokenizer, config(total_steps=6, checkpoint_every=2), checkpoint_dir=tmp_path, on_step=kill_at_4)
    with pytest.raises(Killed):
        first.train(examples)
    resumed = SFTTrainer(tiny_llama(len(tokenizer), seed=5), tokenizer, config(total_steps=6, checkpoint_every=2), checkpoint_dir=tmp_path)
    resumed.train(examples)
    assert resumed.step_count == 6
    for (name, a), b in zip(straight.policy.state_dict().items(), resumed.policy.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_a_pickled_checkpoint_is_refused_not_run(tmp_path):
    """SFT checkpoints are the GRPO ones (trainer state as safetensors + JSON); resuming from a state
    file in the old pickle format fails naming it, and its code never runs."""
    tokenizer = char_tokenizer(COPY_DIGIT_CHARS)
    SFTTrainer(tiny_llama(len(tokenizer)), tokenizer, config(total_steps=2), checkpoint_dir=tmp_path).train(copy_examples(tokenizer))
    folder, marker = tmp_path / "step-000002", tmp_path / "pwned"
    (folder / ckpt.STATE_FILE).unlink()
    (folder / ckpt.STATE_TENSORS).unlink()

    class Exploit:
        def __reduce__(self):
            return open, (str(marker), "w")

    torch.save({"step": 2, "optimizer": Exploit()}, folder / ckpt.PICKLED_STATE_FILE)
    resumed = SFTTrainer(tiny_llama(len(tokenizer)), tokenizer, config(total_steps=4), checkpoint_dir=tmp_path)
    with pytest.raises(ckpt.PickledCheckpoint, match=f"{folder / ckpt.PICKLED_STATE_FILE} is a checkpoint in the old pickle format.*start the run afresh"):
        resumed.train(copy_examples(tokenizer))
    assert not marker.exists() and resumed.step_count == 0


@pytest.mark.slow  # materializes Dagster assets and trains
def test_the_sft_asset_is_the_cold_start_grpo_can_start_from(home, gsm8k_dir, tiny_llama_dir):
    """sft_policy on the tiny model: stored with its lineage and an MLflow run; grpo_training with
    init_from 'sft' starts from it; without it, that init_from fails naming the asset; eval_report
    pairs the three stages (base, SFT, GRPO) and says which moved accuracy."""
    from dagster import DagsterInstance, materialize

    from rlvr_assets import data, evaluation, models, sft, training
    from support.pipeline import resources_for, run_config

    res = resources_for(home)
    config = run_config(gsm8k_dir, tiny_llama_dir, steps=1, init_from="sft")
    ops = {k: v for k, v in config["ops"].items() if k in ("gsm8k_problems", "base_policy", "grpo_training")}
    with DagsterInstance.ephemeral() as instance:
        first = {k: v for k, v in ops.items() if k != "grpo_training"}
        assert materialize([data.gsm8k_problems, models.base_policy], resources=res, run_config={"ops": first}, instance=instance).success
        without = materialize(
            [training.grpo_training], resources=res, instance=instance, raise_on_error=False, run_config={"ops": {"grpo_training": ops["grpo_training"]}}
        )
        assert not without.success
        sft_ops = {"sft_policy": {"config": {"overrides": {"total_steps": 2, "batch_size": 4, "micro_batch_size": 2, "max_completion_tokens": 32}}}}
        result = materialize([sft.sft_policy], resources=res, run_config={"ops": sft_ops}, instance=instance)
        assert result.success
        stored = res["model_store"].latest("sft_policy")
        assert stored.manifest["steps"] == 2 and stored.manifest["base_policy_version"] == res["model_store"].latest("base_policy").version
        assert materialize([training.grpo_training], resources=res, instance=instance, run_config={"ops": {"grpo_training": ops["grpo_training"]}}).success
        report = materialize([evaluation.eval_report], resources=res, instance=instance, run_config={"ops": {"eval_report": config["ops"]["eval_report"]}})
        meta = report.asset_materializations_for_node("eval_report")[0].metadata
    assert res["model_store"].latest("grpo_checkpoint").manifest["parent_version"] == stored.version
    assert [line.split("|")[1].strip() for line in meta["stages"].value.splitlines()[2:]] == ["base", "SFT", "GRPO"]
    assert meta["moved_accuracy"].value.startswith("base ") and " -> SFT " in meta["moved_accuracy"].value
