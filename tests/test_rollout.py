"""Rollouts through the engine: shapes, padding, seeds, temperatures, finish reasons, row dropping, HF parity."""

import pytest
import torch

from rlvr.chat import ControlTokensError, render_messages
from rlvr.generation import Rollouts, SamplingConfig, concat_rollouts, generate_rollouts, sample_tokens, score_tokens, stream_rollouts
from rlvr.generation.generator import NativeGenerator
from rlvr.generation.sampler import GREEDY_BELOW_TEMPERATURE, _top_p_filter
from rlvr.generation.stops import NO_STOP_RULE, StopChecker, StopRule
from rlvr.tasks import GSM8K
from rlvr.tasks.gsm8k.prompt import render_prompt
from support.tiny_models import char_tokenizer, embedded_tokenizer, tiny_llama

PROMPTS = ["what is 12+30?", "7", "count: a b c d e f"]


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_llama(len(tokenizer), seed=0)


def full_forward_logprobs(model, tokenizer, rollouts: Rollouts) -> torch.Tensor:
    """Log-probs of each completion token recomputed by one unpadded forward per row."""
    out = torch.zeros_like(rollouts.logprobs)
    for row, (prompt, completion) in enumerate(zip(rollouts.prompt_ids, rollouts.completion_token_lists())):
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        temperature = float(rollouts.temperatures[row]) or 1.0
        logprobs = torch.log_softmax(logits / temperature, dim=-1)
        out[row, : len(completion)] = logprobs.gather(1, torch.tensor(completion)[:, None]).squeeze(1)
    return out


def test_shapes_and_bookkeeping(model, tokenizer):
    config = SamplingConfig(max_new_tokens=12, temperatures=[0.5, 1.0, 0.0])
    r = generate_rollouts(model, tokenizer, PROMPTS, num_samples=4, config=config)
    n = len(PROMPTS) * 4
    assert len(r) == n and r.completion_ids.shape == r.logprobs.shape == r.completion_mask.shape
    assert r.completion_ids.shape[1] <= 12
    assert r.group_index.tolist() == [i // 4 for i in range(n)]
    assert r.sample_index.tolist() == [i % 4 for i in range(n)]
    assert r.temperatures.tolist() == [[0.5, 1.0, 0.0, 0.5][i % 4] for i in range(n)]
    assert r.prompt_ids[5] == tokenizer(PROMPTS[1]).input_ids
    lengths = r.completion_lengths
    assert ((r.completion_mask.cumsum(1) <= lengths[:, None]) | (r.completion_mask == 0)).all()  # right-padded
    assert (r.logprobs[r.completion_mask == 0] == 0).all() and (r.logprobs[r.completion_mask == 1] < 0).all()
    assert (r.completion_ids[r.completion_mask == 0] == tokenizer.pad_token_id).all()
    for row in range(n):
        assert r.finish_reasons[row] == ("length" if lengths[row] == 12 else "eos")
        assert r.texts[row] == tokenizer.decode(r.completion_token_lists()[row], skip_special_tokens=True)
    assert not r.completion_ids.is_inference() and not r.logprobs.is_inference()


def test_left_padding_gives_same_greedy_tokens_and_logprobs(model, tokenizer):
    config = SamplingConfig(max_new_tokens=10, temperatures=[0.0])
    batch = generate_rollouts(model, tokenizer, PROMPTS, num_samples=2, config=config)
    for i, prompt in enumerate(PROMPTS):
        alone = generate_rollouts(model, tokenizer, [prompt], num_samples=1, config=config)
        n = int(alone.completion_lengths[0])
        assert torch.equal(batch.completion_ids[2 * i, :n], alone.completion_ids[0, :n])
        assert torch.equal(batch.completion_ids[2 * i + 1, :n], alone.completion_ids[0, :n])
        torch.testing.assert_close(batch.logprobs[2 * i, :n], alone.logprobs[0, :n], atol=1e-5, rtol=1e-5)


def test_greedy_matches_hf_generate(model, tokenizer):
    config = SamplingConfig(max_new_tokens=15, temperatures=[0.0], stop_token_ids=[1])
    ours = generate_rollouts(model, tokenizer, PROMPTS, num_samples=1, config=config)
    enc = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    hf = model.generate(**enc, max_new_tokens=15, do_sample=False, eos_token_id=1, pad_token_id=0)
    hf = hf[:, enc.input_ids.shape[1] :]
    for row in range(len(PROMPTS)):
        n = int(ours.completion_lengths[row])
        assert hf[row, :n].tolist() == ours.completion_ids[row, :n].tolist()


def test_logprobs_follow_each_rows_temperature(model, tokenizer):
    config = SamplingConfig(max_new_tokens=8, temperatures=[0.3, 1.0, 2.0, 0.0], top_p=0.9, seed=3)
    r = generate_rollouts(model, tokenizer, PROMPTS[:2], num_samples=4, config=config)
    recomputed = full_forward_logprobs(model, tokenizer, r)
    torch.testing.assert_close(r.logprobs, recomputed, atol=1e-4, rtol=1e-4)
    at_temperature_one = full_forward_logprobs(model, tokenizer, Rollouts(**{**vars(r), "temperatures": torch.ones(8)}))
    differs = ~torch.isclose(r.logprobs, at_temperature_one, atol=1e-3).all(dim=1)
    assert differs.tolist() == [True, False, True, False] * 2  # T = 0.3 and 2 rows used their temperature
    greedy_alone = generate_rollouts(model, tokenizer, PROMPTS[:2], 1, SamplingConfig(8, [0.0]))
    assert r.completion_token_lists()[3::4] == greedy_alone.completion_token_lists()


def test_seeded_sampling_is_reproducible(model, tokenizer):
    config = SamplingConfig(max_new_tokens=10, temperatures=[1.0], seed=7)
    a = generate_rollouts(model, tokenizer, PROMPTS, num_samples=3, config=config)
    b = generate_rollouts(model, tokenizer, PROMPTS, num_samples=3, config=config)
    c = generate_rollouts(model, tokenizer, PROMPTS, num_samples=3, config=SamplingConfig(10, [1.0], seed=8))
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.completion_ids, c.completion_ids)
    assert len(set(a.texts[:3])) > 1  # samples of one group differ


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    assert torch.equal(_top_p_filter(probs.clone(), 0.7), torch.tensor([[0.0, 0.5, 0.0, 0.3]]))
    assert torch.equal(_top_p_filter(probs.clone(), 0.5), torch.tensor([[0.0, 0.5, 0.0, 0.0]]))
    # a tiny nucleus samples the argmax but reports the untruncated log-prob
    logits = torch.log(probs)
    generator = torch.Generator().manual_seed(0)
    tokens, logprobs = sample_tokens(logits, torch.tensor([1.0]), top_p=1e-6, generator=generator)
    assert tokens.tolist() == [1]
    torch.testing.assert_close(logprobs, torch.log(torch.tensor([0.5])))


def _nucleus_by_full_sort(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The nucleus by its definition: sort each row, keep the tokens whose mass before them falls short of top-p."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    sorted_probs[sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p.unsqueeze(1)] = 0.0
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


@pytest.mark.parametrize("scale", [0.5, 3.0, 8.0, 30.0])
def test_top_p_finds_each_rows_nucleus_among_its_candidates_or_past_them(scale):
    """Flat rows (a nucleus of thousands of tokens, past every candidate list) and peaked ones (a few
    tokens), each row its own top-p: the same nucleus as a full sort; a row at top-p 1 is left whole."""
    generator = torch.Generator().manual_seed(int(scale * 10))
    probs = torch.softmax(torch.randn(24, 6000, generator=generator) * scale, dim=-1)
    top_p = torch.rand(24, generator=generator) * 0.6 + 0.4
    top_p[::5] = 1.0
    filtered = _top_p_filter(probs, top_p)
    truncated = top_p < 1.0
    assert torch.equal(filtered[truncated], _nucleus_by_full_sort(probs[truncated], top_p[truncated]))
    assert torch.equal(filtered[~truncated], probs[~truncated])
    assert torch.equal(_top_p_filter(probs, 0.9), _nucleus_by_full_sort(probs, torch.full((24,), 0.9)))


@pytest.mark.parametrize("temperature", [1e-38, 5e-324, GREEDY_BELOW_TEMPERATURE / 2])
def test_a_temperature_too_small_to_divide_by_is_greedy(temperature):
    """logits / 1e-38 overflows float32: such a row (sampled beside an ordinary one) takes the argmax,
    its log-prob the model's own (temperature 1), finite."""
    logits = torch.tensor([[0.0, 3.0, 1.0, -2.0], [0.5, 0.1, 0.2, 2.5]]) * 50
    assert torch.isinf(logits.float() / torch.tensor(1e-38)).any() or temperature == 5e-324
    generator = torch.Generator().manual_seed(0)
    for top_p in (1.0, 0.9):
        tokens, logprobs = sample_tokens(logits, torch.tensor([temperature, 1.0]), top_p, generator)
        assert tokens[0].item() == 1 and torch.isfinite(logprobs).all()
        torch.testing.assert_close(logprobs[0], torch.log_softmax(logits[0], dim=-1)[1])


def test_a_tiny_temperature_decodes_as_greedy_end_to_end(model, tokenizer):
    greedy = generate_rollouts(model, tokenizer, PROMPTS, 2, SamplingConfig(max_new_tokens=8, temperatures=[0.0]))
    tiny = generate_rollouts(model, tokenizer, PROMPTS, 2, SamplingConfig(max_new_tokens=8, temperatures=[1e-38]))
    assert torch.equal(greedy.completion_ids, tiny.completion_ids) and torch.isfinite(tiny.logprobs).all()
    torch.testing.assert_close(greedy.logprobs, tiny.logprobs)


def test_scored_tokens_are_the_sampled_log_probs_and_the_top_alternatives(model, tokenizer):
    """Scoring prompt + completion in one forward gives the engine's own log-probs of the completion (at
    each row's temperature), the full forward's for the prompt, and top-1 is the argmax (greedy rows' token)."""
    rollouts = generate_rollouts(model, tokenizer, PROMPTS, 2, SamplingConfig(max_new_tokens=6, temperatures=[0.0, 0.7]))
    sequences = [p + c for p, c in zip(rollouts.prompt_ids, rollouts.completion_token_lists())]
    scores = score_tokens(model, sequences, rollouts.temperatures.tolist(), top_k=2, positions_per_chunk=3)
    for row, (prompt, completion, score) in enumerate(zip(rollouts.prompt_ids, rollouts.completion_token_lists(), scores)):
        assert len(score.logprobs) == len(score.top_ids) == len(prompt) + len(completion) - 1
        torch.testing.assert_close(torch.tensor(score.logprobs[len(prompt) - 1 :]), rollouts.logprobs[row, : len(completion)], atol=1e-4, rtol=0)
        assert all(v[0] >= v[1] for v in score.top_logprobs)
        if rollouts.temperatures[row] == 0:
            assert [ids[0] for ids in score.top_ids[len(prompt) - 1 :]] == completion
    ids = torch.tensor([sequences[0]])
    with torch.no_grad():
        full = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1).gather(1, ids[0, 1:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(scores[0].logprobs), full, atol=1e-4, rtol=0)


def test_micro_batches_stream_the_same_rollouts(model, tokenizer):
    config = SamplingConfig(max_new_tokens=8, temperatures=[0.0])
    whole = generate_rollouts(model, tokenizer, PROMPTS, num_samples=2, config=config)
    config.max_batch_rows = 4
    chunks = list(stream_rollouts(model, tokenizer, PROMPTS, num_samples=2, config=config))
    assert [len(c) for c in chunks] == [4, 2]
    assert torch.cat([c.group_index for c in chunks]).tolist() == whole.group_index.tolist()
    joined = generate_rollouts(model, tokenizer, PROMPTS, num_samples=2, config=config)
    assert torch.equal(joined.completion_ids, whole.completion_ids)


def test_finish_reasons_follow_the_stop_rules(tokenizer):
    """The stop checker, token by token: an end token, a completed answer line, the budget; the end token
    is part of the completion, and a row ends at the first token that completes its reason."""
    checker = StopChecker(tiny_llama(len(tokenizer)), tokenizer)
    eos = tokenizer.eos_token_id

    def run(text: str, budget: int = 30, at_answer: bool = True, end: bool = True) -> tuple[str | None, int]:
        ids = tokenizer(text).input_ids + ([eos] if end else [])
        for n in range(1, len(ids) + 1):
            if (reason := checker.finish_reason(ids[:n], budget, GSM8K.stop_rule if at_answer else NO_STOP_RULE)) is not None:
                return reason, n
        return None, len(ids)

    assert run("hello") == ("eos", 6)
    assert run("so 6*7\n#### 42\nand more text") == ("answer", 15)  # right after the answer line
    assert run("no newline ever " * 3, end=False) == ("length", 30)
    assert run("#### 7") == ("answer", 7)  # an end token closing an answer line
    assert run("so 6*7\n#### 42\nand more text", at_answer=False) == ("eos", 29)


def test_an_answer_line_is_whatever_the_rule_accepts(tokenizer):
    """The engine knows no answer format: the rule's ``answer_line`` decides which completed line ends a row."""
    checker = StopChecker(tiny_llama(len(tokenizer)), tokenizer)
    ids = tokenizer("think\nanswer: 7\nmore").input_ids
    labelled = StopRule(answer_line=lambda line: line.startswith("answer: "))
    reasons = [checker.finish_reason(ids[:n], 30, labelled) for n in range(1, len(ids) + 1)]
    first = next(n for n, reason in enumerate(reasons, 1) if reason is not None)
    assert reasons[first - 1] == "answer" and tokenizer.decode(ids[:first]).endswith("answer: 7\n")
    assert all(checker.finish_reason(ids[:n], 30, GSM8K.stop_rule) is None for n in range(1, len(ids) + 1))


def greedy(**overrides) -> SamplingConfig:
    # No end token can stop a row early: only the budget or a stop string does.
    settings = {"max_new_tokens": 40, "temperatures": [0.0], "stop_token_ids": [-1]}
    return SamplingConfig(**{**settings, **overrides})


def test_each_prompt_stops_on_its_own_rule(model, tokenizer):
    """A mixture's prompts in one call: each row ends on its prompt's rule (its task's), the others run on."""
    plain = generate_rollouts(model, tokenizer, PROMPTS, num_samples=1, config=greedy())
    stop = plain.texts[0][5:8]
    rules = [StopRule((stop,))] + [None] * (len(PROMPTS) - 1)
    mixed = generate_rollouts(model, tokenizer, PROMPTS, num_samples=1, config=greedy(), stops=rules)
    assert mixed.finish_reasons[0] == "stop" and stop in mixed.texts[0] and len(mixed.texts[0]) < len(plain.texts[0])
    assert mixed.texts[1:] == plain.texts[1:] and mixed.finish_reasons[1:] == plain.finish_reasons[1:]
    with pytest.raises(ValueError, match="one per prompt"):
        generate_rollouts(model, tokenizer, PROMPTS, num_samples=1, config=greedy(), stops=rules[:1])


def test_a_row_stops_at_the_step_its_text_first_holds_a_stop_string(model, tokenizer):
    plain = generate_rollouts(model, tokenizer, PROMPTS, num_samples=2, config=greedy())
    stop = plain.texts[0][5:8]  # a string that appears in the first prompt's completion
    stopped = generate_rollouts(model, tokenizer, PROMPTS, num_samples=2, config=greedy(stop_strings=[stop, "zzzz"]))
    for i, (text, reason) in enumerate(zip(plain.texts, plain.finish_reasons)):
        at = text.find(stop)
        if at < 0:
            assert (stopped.texts[i], stopped.finish_reasons[i]) == (text, reason)
        else:  # one character per token: the row ends on the stop string's last character, text not cut
            assert (stopped.texts[i], stopped.finish_reasons[i]) == (text[: at + len(stop)], "stop")
    assert stopped.finish_reasons[:2] == ["stop", "stop"]


def test_prompts_as_token_ids_are_the_same_prompts(model, tokenizer):
    ids = tokenizer(PROMPTS, add_special_tokens=False).input_ids
    by_text = generate_rollouts(model, tokenizer, PROMPTS, config=greedy())
    by_ids = generate_rollouts(model, tokenizer, ids, config=greedy())
    assert by_ids.texts == by_text.texts and by_ids.prompt_ids == by_text.prompt_ids
    with pytest.raises(ValueError, match="all texts or all token ids"):
        generate_rollouts(model, tokenizer, [PROMPTS[0], ids[1]], config=greedy())
    with pytest.raises(ValueError, match="non-empty strings"):
        greedy(stop_strings=[""])


def test_render_messages_is_render_prompts_renderer_and_refuses_control_tokens_in_any_message():
    chat = embedded_tokenizer()
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


LONG_PROMPTS = ["the same opening for every prompt: " + tail for tail in ("12+30?", "7", "a b c")]  # past a prefix block


@pytest.mark.parametrize("trainable", [True, False], ids=["trainable", "frozen"])
def test_a_trainers_calls_share_one_engine_that_follows_its_weight_updates(tokenizer, trainable):
    model = tiny_llama(len(tokenizer), seed=3).requires_grad_(trainable)
    generator = NativeGenerator(model, tokenizer)
    config = SamplingConfig(max_new_tokens=10, temperatures=[0.0])
    first = concat_rollouts(list(generator.stream(LONG_PROMPTS, 2, config)))
    engine = generator.backend.engine
    assert engine.prefixes.bytes > 0 and engine.executor is None and engine.kv_bytes() == engine.prefixes.bytes  # nothing but the prefixes kept
    assert not engine.weights_changed()
    with torch.no_grad():  # the trainer's update: in place
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(1)))
    assert engine.weights_changed()
    engine.refresh()
    assert engine.prefixes.bytes == 0 and not engine.weights_changed()  # its blocks came from the old weights
    after = concat_rollouts(list(generator.stream(LONG_PROMPTS, 2, config)))
    assert generator.backend.engine is engine
    fresh = generate_rollouts(model, tokenizer, LONG_PROMPTS, num_samples=2, config=config)  # an engine of its own
    assert torch.equal(after.completion_ids, fresh.completion_ids) and torch.equal(after.logprobs, fresh.logprobs)
    assert not torch.equal(after.completion_ids, first.completion_ids)


def test_a_larger_call_resizes_the_kept_engine(model, tokenizer):
    generator = NativeGenerator(model, tokenizer)
    config = SamplingConfig(max_new_tokens=6, temperatures=[0.0])
    small = concat_rollouts(list(generator.stream(PROMPTS[:1], 1, config)))
    engine = generator.backend.engine
    large = concat_rollouts(list(generator.stream(PROMPTS, 4, config)))
    assert generator.backend.engine is engine and engine.max_rows == len(PROMPTS) * 4
    assert large.completion_ids[0, : small.completion_lengths[0]].tolist() == small.completion_token_lists()[0]
    assert torch.equal(large.completion_ids, generate_rollouts(model, tokenizer, PROMPTS, num_samples=4, config=config).completion_ids)
