"""Tool-calling rollouts (rlvr.environments.driver in rlvr.generation.outputs): an injection's tokens
are written into the row's KV cache (what re-prefilling would give), marked as the environment's, and
never end the row; without an environment nothing changes."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field, replace

import pytest
import torch

import rlvr.generation.executor as executor_module
from rlvr.environments.base import Injection, SingleTurn, ToolCall
from rlvr.generation import Engine, EngineRequest, SamplingConfig, generate_rollouts
from rlvr.generation.model_runner import ModelForward
from rlvr.tasks import GSM8K
from support.tiny_models import CHARS, char_tokenizer, tiny_llama

PROMPTS = ["what is 12+30?", "7", "count: a b c d e f"]
INJECTED = "=42\n"


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer(CHARS + "<>")


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_llama(len(tokenizer), seed=0).requires_grad_(False)


@dataclass
class InjectAfter:
    """A fake environment: the episode of row r injects ``text`` after its ``after[r % len(after)]``-th policy
    token (at most once); ``on_turn_end``: instead, on the first turn end (after sleeping ``delay_s``)."""

    after: tuple[int, ...] = (3,)
    text: str = INJECTED
    on_turn_end: bool = False
    delay_s: float = 0.0
    name: str = "inject_after"
    instructions: str = ""
    _episodes: int = field(default=0, repr=False)

    def episode(self) -> _InjectAfterEpisode:
        self._episodes += 1
        return _InjectAfterEpisode(self, self.after[(self._episodes - 1) % len(self.after)])

    def options(self) -> dict:
        return {}


class _InjectAfterEpisode:
    def __init__(self, environment: InjectAfter, after: int):
        self.environment, self.after, self.seen = environment, after, 0
        self.calls: list[ToolCall] = []

    def observe(self, text: str, ended_turn: bool) -> Injection | None:
        self.seen += 1
        trigger = ended_turn if self.environment.on_turn_end else self.seen == self.after
        if not trigger or self.calls:
            return None
        time.sleep(self.environment.delay_s)
        call = ToolCall(index=0, tool="fake", call=text, result=self.environment.text, error=None, latency_s=self.environment.delay_s)
        self.calls.append(call)
        return Injection(self.environment.text, call)


class NoOp(InjectAfter):
    """An environment whose episodes see every token and never inject."""

    def episode(self) -> _InjectAfterEpisode:
        return _InjectAfterEpisode(self, after=-1)


def _config(**kwargs) -> SamplingConfig:
    return SamplingConfig(**{"max_new_tokens": 16, "temperatures": [0.0], "stop_token_ids": [], **kwargs})


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def test_an_injection_is_written_after_the_third_policy_token(model, tokenizer):
    out = generate_rollouts(model, tokenizer, PROMPTS, 2, _config(temperatures=[1.0, 0.0], environment=InjectAfter()))
    injected = _ids(tokenizer, INJECTED)
    span = slice(3, 3 + len(injected))
    assert out.completion_ids[:, span].tolist() == [injected] * len(out)
    expected_mask = torch.zeros_like(out.completion_mask)
    expected_mask[:, span] = 1
    assert torch.equal(out.environment_mask, expected_mask)
    assert (out.logprobs[:, span] == 0).all() and (out.logprobs[:, :3] < 0).all()
    assert torch.equal(out.policy_mask, out.completion_mask - expected_mask)
    assert [[c.result for c in calls] for calls in out.tool_calls] == [[INJECTED]] * len(out)
    assert out.finish_reasons == ["length"] * len(out)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (CUDA graph capture and replay)")


@pytest.mark.parametrize("path", ["fused", "plain", pytest.param("cuda_graphs", marks=CUDA)])
def test_appending_an_injection_to_the_cache_equals_prefilling_it(model, tokenizer, path):
    """Greedy continuation after an injection == greedy generation from prompt + policy tokens + injection
    (on CPU with and without the fused decoder; on CUDA in replayed fixed-shape steps)."""
    fast = {"fused_decode": path == "fused", "packed_linears": path == "fused"}
    if path == "cuda_graphs":
        model, fast = copy.deepcopy(model).cuda(), {"cuda_graphs": True}
    out = generate_rollouts(model, tokenizer, PROMPTS, 1, _config(environment=InjectAfter(), fast_paths=fast))
    head = 3 + len(_ids(tokenizer, INJECTED))
    prefixes = [prompt + ids[:head] for prompt, ids in zip(out.prompt_ids, out.completion_token_lists())]
    again = generate_rollouts(model, tokenizer, prefixes, 1, _config(max_new_tokens=16 - head, fast_paths=fast))
    assert [ids[head:] for ids in out.completion_token_lists()] == again.completion_token_lists()


def test_rows_of_one_batch_inject_at_different_steps(model, tokenizer):
    afters = (1, 4, 7, 2)
    out = generate_rollouts(model, tokenizer, PROMPTS[:2], 2, _config(environment=InjectAfter(after=afters)))
    injected = _ids(tokenizer, INJECTED)
    for row, after in enumerate(afters):
        ids = out.completion_token_lists()[row]
        assert ids[after : after + len(injected)] == injected
        assert out.environment_mask[row].nonzero().flatten().tolist() == list(range(after, after + len(injected)))


def test_an_injection_on_a_stop_token_keeps_the_row_going(model, tokenizer):
    first = generate_rollouts(model, tokenizer, PROMPTS[:1], 1, _config()).completion_token_lists()[0][0]
    alone = generate_rollouts(model, tokenizer, PROMPTS[:1], 1, _config(stop_token_ids=[first], environment=NoOp()))
    assert alone.completion_token_lists() == [[first]] and alone.finish_reasons == ["eos"]
    out = generate_rollouts(model, tokenizer, PROMPTS[:1], 1, _config(stop_token_ids=[first], environment=InjectAfter(on_turn_end=True)))
    ids, injected = out.completion_token_lists()[0], _ids(tokenizer, INJECTED)
    assert ids[0] == first and ids[1 : 1 + len(injected)] == injected  # the stop token stays the policy's
    assert out.environment_mask[0, : 1 + len(injected)].tolist() == [0] + [1] * len(injected)
    assert len(ids) > 1 + len(injected)
    assert out.finish_reasons == ["eos" if ids[-1] == first else "length"]


def test_a_budget_spent_mid_injection_ends_the_row_at_length(model, tokenizer):
    out = generate_rollouts(model, tokenizer, PROMPTS, 1, _config(max_new_tokens=5, environment=InjectAfter(text="<<==>>")))
    assert out.finish_reasons == ["length"] * 3
    assert out.completion_ids[:, 3:].tolist() == [_ids(tokenizer, "<<")] * 3
    assert out.environment_mask[:, 3:].tolist() == [[1, 1]] * 3


def test_injected_tokens_never_end_the_row(model, tokenizer):
    """An injection holding an end token and a completed '#### <number>' line: the row goes on."""
    text = "\n#### 4\n<eos>"
    config = _config(max_new_tokens=14, stop_token_ids=None, environment=InjectAfter(text=text))
    out = generate_rollouts(model, tokenizer, PROMPTS, 1, config, [GSM8K.stop_rule] * len(PROMPTS))
    injected = _ids(tokenizer, text)
    assert 1 in injected  # <eos> became the end token
    assert out.completion_ids[:, 3 : 3 + len(injected)].tolist() == [injected] * 3
    assert all(length > 3 + len(injected) for length in out.completion_lengths.tolist())


def test_without_tools_rollouts_are_bit_identical(model, tokenizer, monkeypatch):
    """None, SingleTurn and an environment that never injects give the same rollouts; the fused CPU
    decoder still steps them (the model's own forward is never called for a decode step)."""

    def plain_step(*args, **kwargs):
        raise AssertionError("the model's own forward ran")

    monkeypatch.setattr(ModelForward, "forward", plain_step)
    config, stops = _config(temperatures=[1.0, 0.0, 0.7], top_p=0.9, stop_token_ids=None, seed=3), [GSM8K.stop_rule] * len(PROMPTS)
    runs = [generate_rollouts(model, tokenizer, PROMPTS, 3, _config(**{**vars(config), "environment": env}), stops) for env in (None, SingleTurn(), NoOp())]
    for other in runs[1:]:
        assert torch.equal(other.completion_ids, runs[0].completion_ids)
        assert torch.equal(other.logprobs, runs[0].logprobs)
        assert other.finish_reasons == runs[0].finish_reasons and other.texts == runs[0].texts
        assert not other.environment_mask.any() and other.tool_calls == [[]] * len(other)


def test_chunks_concatenate_environment_masks_and_calls(model, tokenizer):
    config = _config(environment=InjectAfter(after=(4,)), max_batch_rows=2)
    out = generate_rollouts(model, tokenizer, PROMPTS, 2, config)
    whole = generate_rollouts(model, tokenizer, PROMPTS, 2, _config(environment=InjectAfter(after=(4,))))
    assert torch.equal(out.environment_mask, whole.environment_mask) and torch.equal(out.completion_ids, whole.completion_ids)
    assert [len(calls) for calls in out.tool_calls] == [1] * 6


@pytest.mark.parametrize("environment", [InjectAfter(after=(2, 6)), InjectAfter(on_turn_end=True, delay_s=0.05)], ids=["inline", "parked"])
def test_the_serving_engine_gives_the_rollout_engines_completions(model, tokenizer, environment):
    """Greedy, 2 samples per prompt, prompts joining at different steps; a turn-end tool runs off the
    engine's thread (its row parked) while the other rows decode."""
    first = generate_rollouts(model, tokenizer, PROMPTS[:1], 1, _config()).completion_token_lists()[0][0]
    stops = [first] if environment.on_turn_end else []
    expected = generate_rollouts(model, tokenizer, PROMPTS, 2, _config(stop_token_ids=stops, environment=environment))
    engine = Engine(model, tokenizer, max_rows=4, step_tokens=6, kv_budget_bytes=2**24)
    engine.stops.stop_ids = set(stops)
    # a fresh environment per request: its samples' episodes are made in order, as the rollout engine's are
    requests = [EngineRequest(_ids(tokenizer, p), 2, (0.0,), 16, environment=replace(environment)) for p in PROMPTS]
    for step in range(2000):
        if step in (0, 3):
            for request in requests[:1] if step == 0 else requests[1:]:
                engine.submit(request)
        engine.take_submissions()
        engine.step()
        if all(q.done_s is not None for q in requests):
            break
        time.sleep(0.001 if any(r.parked for r in engine.rows) else 0)  # parked rows' environments run in threads: yield to them
    assert [ids for q in requests for ids in q.token_ids] == expected.completion_token_lists()
    assert [r for q in requests for r in q.finish_reasons] == expected.finish_reasons
    masks = [m for q in requests for m in q.environment_masks]
    assert masks == [row[:n].tolist() for row, n in zip(expected.environment_mask, expected.completion_lengths.tolist())]
    assert [len(c) for q in requests for c in q.tool_calls] == [len(c) for c in expected.tool_calls]
    assert sum(map(sum, masks)) > 0
    logprobs = torch.tensor([lp for q in requests for row in q.logprobs for lp in row])
    torch.testing.assert_close(logprobs, expected.logprobs[expected.completion_mask.bool()], atol=1e-4, rtol=0)


def test_the_calculator_answers_an_annotation(model, tokenizer, monkeypatch):
    """A scripted policy writes '<<48/2='; the calculator writes '24>>' into the row, then the model decodes on."""
    calculator = pytest.importorskip("rlvr.environments.calculator")
    script = _ids(tokenizer, "<<48/2=")
    sample = executor_module.sample_tokens
    steps = iter(range(10**6))

    def scripted(logits, *args, **kwargs):
        tokens, logprobs = sample(logits, *args, **kwargs)
        step = next(steps)
        if step < len(script):
            tokens[:] = script[step]
        return tokens, logprobs

    monkeypatch.setattr(executor_module, "sample_tokens", scripted)
    out = generate_rollouts(model, tokenizer, PROMPTS[:1], 1, _config(environment=calculator.Calculator()))
    ids = out.completion_token_lists()[0]
    assert tokenizer.decode(ids).startswith("<<48/2=24>>")
    result = _ids(tokenizer, "24>>")
    assert out.environment_mask[0].nonzero().flatten().tolist() == list(range(len(script), len(script) + len(result)))
    assert [(c.call, c.result, c.error) for c in out.tool_calls[0]] == [("48/2", "24", None)]


def test_a_program_turn_gets_a_tool_turn_and_the_row_goes_on(monkeypatch):
    """A scripted policy ends its turn with a ```python block (the end token ``<|im_end|>``): the code
    tool's ChatML tool turn is written with its markers as special tokens, and the row goes on."""
    from support.tiny_models import tiny_llama_with_embedded_tokenizer

    code = pytest.importorskip("rlvr.environments.code")
    model, tokenizer = tiny_llama_with_embedded_tokenizer()
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    script = _ids(tokenizer, "```python\nprint(6*7)\n```") + [im_end]
    sample, steps = executor_module.sample_tokens, iter(range(10**6))

    def scripted(logits, *args, **kwargs):
        tokens, logprobs = sample(logits, *args, **kwargs)
        if (step := next(steps)) < len(script):
            tokens[:] = script[step]
        return tokens, logprobs

    monkeypatch.setattr(executor_module, "sample_tokens", scripted)
    config = SamplingConfig(max_new_tokens=len(script) + 30, temperatures=[0.0], environment=code.CodeTool.for_tokenizer(tokenizer))
    out = generate_rollouts(model.requires_grad_(False), tokenizer, [_ids(tokenizer, "Question: 6*7?")], 1, config)
    ids, turn = out.completion_token_lists()[0], _ids(tokenizer, "\n<|im_start|>tool\n42\n<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") in turn
    assert ids[: len(script)] == script and ids[len(script) : len(script) + len(turn)] == turn
    assert out.environment_mask[0].tolist()[: len(script) + len(turn)] == [0] * len(script) + [1] * len(turn)
    assert len(ids) > len(script) + len(turn) and [c.result for c in out.tool_calls[0]] == ["42\n"]
