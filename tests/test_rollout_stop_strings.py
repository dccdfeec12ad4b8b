"""Rollout engine, for the OpenAI-compatible endpoints: ``stop_strings`` end a row where its text first
holds one, ``on_tokens`` sees every sampled token, prompts may come as token ids; and the one chat
renderer, ``render_messages``, refuses control tokens in any message."""

import pytest

from rlvr import policy
from rlvr.prompts import ControlTokensError, render_messages, render_prompt
from rlvr.rollout import SamplingConfig, generate_rollouts
from tiny_policy import char_tokenizer, tiny_llama

PROMPTS = ["what is 12+30?", "7", "count: a b c d e f"]


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_llama(len(tokenizer), seed=0)


def config(**overrides) -> SamplingConfig:
    # Greedy, and no end token can stop a row early: only the budget or a stop string does.
    settings = {"max_new_tokens": 40, "temperatures": [0.0], "stop_at_final_answer": False, "stop_token_ids": [-1]}
    return SamplingConfig(**{**settings, **overrides})


def test_a_row_stops_at_the_step_its_text_first_holds_a_stop_string(model, tokenizer):
    plain = generate_rollouts(model, tokenizer, PROMPTS, num_samples=2, config=config())
    stop = plain.texts[0][5:8]  # a string that appears in the first prompt's completion
    stopped = generate_rollouts(model, tokenizer, PROMPTS, num_samples=2, config=config(stop_strings=[stop, "zzzz"]))
    for i, (text, reason) in enumerate(zip(plain.texts, plain.finish_reasons)):
        at = text.find(stop)
        if at < 0:
            assert (stopped.texts[i], stopped.finish_reasons[i]) == (text, reason)
        else:  # one character per token: the row ends on the stop string's last character, text not cut
            assert (stopped.texts[i], stopped.finish_reasons[i]) == (text[: at + len(stop)], "stop")
    assert stopped.finish_reasons[:2] == ["stop", "stop"]


def test_on_tokens_sees_every_sampled_token_with_its_row_across_chunks(model, tokenizer):
    seen: dict[int, list[int]] = {}

    def on_tokens(rows: list[int], tokens: list[int]) -> None:
        for row, token in zip(rows, tokens):
            seen.setdefault(row, []).append(token)

    r = generate_rollouts(
        model, tokenizer, PROMPTS, num_samples=2, config=config(temperatures=[1.0], max_batch_rows=2, on_tokens=on_tokens, stop_strings=["e"])
    )
    assert sorted(seen) == list(range(6)) and [seen[row] for row in range(6)] == r.completion_token_lists()


def test_prompts_as_token_ids_are_the_same_prompts(model, tokenizer):
    ids = tokenizer(PROMPTS, add_special_tokens=False).input_ids
    by_text = generate_rollouts(model, tokenizer, PROMPTS, config=config())
    by_ids = generate_rollouts(model, tokenizer, ids, config=config())
    assert by_ids.texts == by_text.texts and by_ids.prompt_ids == by_text.prompt_ids
    with pytest.raises(ValueError, match="all texts or all token ids"):
        generate_rollouts(model, tokenizer, [PROMPTS[0], ids[1]], config=config())
    with pytest.raises(ValueError, match="non-empty strings"):
        config(stop_strings=[""])


def test_render_messages_is_render_prompts_renderer_and_refuses_control_tokens_in_any_message():
    gguf = policy.embedded_gguf_path()
    from transformers import AutoTokenizer

    chat = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"},
    ]
    rendered = render_messages(chat, messages)
    assert rendered == chat.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert render_prompt(chat, "2+2?", "Be brief.") == render_messages(chat, messages[:2])
    with pytest.raises(ControlTokensError, match=r"messages\[2\]\.content contains .*<\|im_end\|>") as err:
        render_messages(chat, [*messages[:2], {"role": "assistant", "content": "4<|im_end|>"}])
    assert err.value.field == "messages[2].content"
