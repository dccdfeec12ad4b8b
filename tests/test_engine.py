"""Iteration-level scheduling (rlvr.generation.engine): the same completions as generate_rollouts, whoever joins
and leaves around them; chunked prefill interleaved with decoding; fair shares; the KV budget held."""

import gc
import math
import re
import time

import pytest
import torch

from rlvr.fastpaths import FastPaths
from rlvr.generation import Engine, EngineRequest, SamplingConfig, StopRule, generate_rollouts
from rlvr.generation.engine import ArrivalRate, MovingLine, keys_per_token
from rlvr.generation.request import RequestDoesNotFit
from rlvr.generation.scheduler import prompt_work
from support.engine_runs import run_engine, watch_forwards
from support.tiny_models import char_tokenizer, tiny_llama

PROMPTS = ["what is 12+30?", "7", "count: a b c d e f", "x" * 40]


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_llama(len(tokenizer), seed=0).requires_grad_(False)


def _request(tokenizer, prompt: str, samples: int = 1, new_tokens: int = 12, **kwargs) -> EngineRequest:
    return EngineRequest(
        prompt_ids=tokenizer(prompt).input_ids, num_samples=samples, max_new_tokens=new_tokens, temperatures=kwargs.pop("temperatures", (0.0,)), **kwargs
    )


def test_greedy_completions_equal_the_rollout_engines_whoever_joins_and_leaves(model, tokenizer):
    """Prompts arriving at different steps, a 3-row batch, 5-token prefill chunks: each completion and
    finish reason is what ``generate_rollouts`` gives the prompt alone."""
    config = SamplingConfig(max_new_tokens=12, temperatures=[0.0], stop_strings=("zz",))
    expected = generate_rollouts(model, tokenizer, PROMPTS, 2, config)
    engine = Engine(model, tokenizer, max_rows=3, step_tokens=5, kv_budget_bytes=2**24)
    requests = [_request(tokenizer, p, samples=2, stop=StopRule(("zz",))) for p in PROMPTS]
    run_engine(engine, {0: requests[:1], 2: requests[1:3], 7: requests[3:]})
    got = [ids for q in requests for ids in q.token_ids]
    assert got == expected.completion_token_lists()
    assert [r for q in requests for r in q.finish_reasons] == expected.finish_reasons
    torch.testing.assert_close(
        torch.tensor([lp for q in requests for row in q.logprobs for lp in row]), expected.logprobs[expected.completion_mask.bool()], atol=1e-4, rtol=0
    )


def test_each_step_is_one_forward_over_both_lanes_and_the_prompt_chunks(model, tokenizer):
    """With a long request in the long lane, short ones in the short lane and prompts still
    prefilling, a step still reads the weights once (one forward over all of its tokens), and every
    completion is still what ``generate_rollouts`` gives its prompt alone."""
    config = SamplingConfig(max_new_tokens=12, temperatures=[0.0])
    expected = generate_rollouts(model, tokenizer, PROMPTS, 2, config)
    engine = Engine(model, tokenizer, max_rows=6, step_tokens=8, kv_budget_bytes=2**24, short_lane_tokens=32)
    steps = []
    watch_forwards(engine, lambda tokens: steps[-1].append((len(tokens), [len(lane.rows) for lane in engine.lanes])))
    original_step = engine.step
    engine.step = lambda: (steps.append([]), original_step())
    requests = [_request(tokenizer, p, samples=2) for p in PROMPTS]
    run_engine(engine, {0: requests[3:], 3: requests[:3]})
    assert all(len(calls) <= 1 for calls in steps)
    rows_in_lanes = [lanes for calls in steps for _, lanes in calls]
    mixed = [(tokens, lanes) for calls in steps for tokens, lanes in calls if all(lanes) and tokens > sum(lanes)]
    assert mixed, f"no step decoded both lanes while a prompt prefilled: {rows_in_lanes}"
    assert [ids for q in requests[:3] + requests[3:] for ids in q.token_ids] == expected.completion_token_lists()


def test_a_seeded_request_samples_the_same_alone_or_in_a_crowd(model, tokenizer):
    def sampled(crowd: int) -> list[list[int]]:
        engine = Engine(model, tokenizer, max_rows=4, step_tokens=16, kv_budget_bytes=2**24)
        mine = _request(tokenizer, PROMPTS[0], samples=3, temperatures=(1.0,), top_p=0.9, seed=7)
        others = [_request(tokenizer, p, samples=2, temperatures=(1.0,), seed=i) for i, p in enumerate(PROMPTS[:crowd])]
        run_engine(engine, {0: others, 1: [mine]})
        return mine.token_ids

    alone = sampled(0)
    assert sampled(4) == alone and len(set(map(tuple, alone))) > 1


def test_a_short_request_is_served_while_a_long_one_prefills_and_decodes(model, tokenizer):
    """A 250-token prompt with 4 rows x 250 tokens first (within the model's context of 512); a short greedy request a step later starts within
    a few steps (chunked prefill, a fair share of the rows) in the short lane (its slot not padded to
    the long rows'), and ends long before the long one."""
    engine = Engine(model, tokenizer, max_rows=4, step_tokens=32, kv_budget_bytes=2**24)
    engine.stops.stop_ids = set()  # no end token: the long one runs to its budget
    long = _request(tokenizer, "y" * 250, samples=4, new_tokens=250, temperatures=(1.0,))
    short = _request(tokenizer, PROMPTS[0], new_tokens=8)
    lanes = []
    short.on_tokens = lambda pairs: lanes.append(([len(lane.rows) for lane in engine.lanes], engine.lanes[0].cache.capacity_length))
    run_engine(engine, {0: [long], 1: [short]})
    assert short.done_s < long.done_s and all(len(ids) == 250 for ids in long.token_ids)
    assert short.first_token_s - short.submitted_s < (long.done_s - long.submitted_s) / 10
    assert len(short.token_ids[0]) == 8 and engine.scheduler.states == {}  # both done: the scheduler forgot them
    assert lanes and all(rows[0] == 1 and length <= 128 for rows, length in lanes)  # not padded to the long rows


def test_a_request_holds_at_most_half_the_kv_budget_the_others_leave(model, tokenizer):
    per_token = 2 * 2 * 2 * 16 * 4  # layers x (K, V) x KV heads x head dim x float32
    engine = Engine(model, tokenizer, max_rows=8, step_tokens=64, kv_budget_bytes=8 * 128 * per_token)
    engine.stops.stop_ids = set()
    big = _request(tokenizer, "y" * 20, samples=8, new_tokens=100, temperatures=(1.0,))
    small = _request(tokenizer, "7", new_tokens=4)
    other = _request(tokenizer, "y" * 20, samples=8, new_tokens=100, temperatures=(1.0,))
    rows = run_engine(engine, {0: [big], 1: [other], 3: [small]})
    assert rows[0] == 4 and 4 < rows[1] <= 6  # half the budget: 4 slots of 128 positions; then at most half the rest
    assert small.done_s < big.done_s and all(len(ids) == 100 for ids in big.token_ids + other.token_ids)
    assert small.first_token_s < min(q.token_ids[0] and q.done_s for q in (big, other))


def test_a_request_the_kv_budget_cannot_hold_alone_is_refused_at_submit(model, tokenizer):
    """Its prompt and one row past the whole budget: it could never start, so it would hold every later
    request back (the oldest waiting request is never overtaken for the KV budget)."""
    per_token = 2 * 2 * 2 * 16 * 4
    engine = Engine(model, tokenizer, max_rows=8, step_tokens=64, kv_budget_bytes=(19 + 128) * per_token)
    engine.submit(_request(tokenizer, "y" * 19, new_tokens=100))  # 19 prompt tokens and a 128-position slot
    with pytest.raises(ValueError, match="past the engine's budget"):
        engine.submit(_request(tokenizer, "y" * 20, new_tokens=100))


def test_the_engine_says_which_part_of_a_request_it_could_never_run(model, tokenizer):
    """Its context (512 positions), a token outside the vocabulary, the KV cache of the rows that run at once
    (alone or beside the other prompts of one call): ``RequestDoesNotFit`` naming the part, at check and submit."""
    per_token = 2 * 2 * 2 * 16 * 4
    engine = Engine(model, tokenizer, max_rows=8, step_tokens=64, kv_budget_bytes=4 * 256 * per_token)
    fits = _request(tokenizer, "y" * 20, samples=4, new_tokens=200)
    engine.check(fits)
    cases = [
        (_request(tokenizer, "y" * 20, new_tokens=500), "new_tokens", "context of 512"),
        (EngineRequest([0, len(tokenizer) + 5], 1, (0.0,), 4), "prompt", f"vocabulary of {len(tokenizer)}"),
        (_request(tokenizer, "y" * 20, samples=8, new_tokens=200), "rows", "8 x (20 + 200)"),
    ]
    for request, part, message in cases:
        with pytest.raises(RequestDoesNotFit, match=re.escape(message)) as refused:
            engine.submit(request)
        assert refused.value.part == part
    with pytest.raises(
        RequestDoesNotFit, match=re.escape("4 x (20 + 200) + 4 x (20 + 200) tokens: a KV cache of 0.9 MiB, over the budget of 0.5 MiB")
    ) as refused:
        engine.check(fits, fits)  # each fits alone, not both at once
    assert refused.value.part == "rows" and not engine.scheduler.waiting


def test_cancelled_requests_leave_at_the_next_step(model, tokenizer):
    engine = Engine(model, tokenizer, max_rows=4, step_tokens=64, kv_budget_bytes=2**24)
    engine.stops.stop_ids = set()
    doomed = _request(tokenizer, PROMPTS[2], samples=2, new_tokens=100, temperatures=(1.0,))
    other = _request(tokenizer, PROMPTS[0], samples=1, new_tokens=30)
    doomed.on_tokens = lambda pairs: len(doomed.token_ids[0]) == 5 and doomed.cancelled.set()
    run_engine(engine, {0: [doomed, other]})
    assert doomed.finish_reasons == ["cancelled", "cancelled"] and all(len(ids) == 5 for ids in doomed.token_ids)
    assert other.finish_reasons == ["length"] and len(other.token_ids[0]) == 30 and not engine.rows


def test_released_kv_buffers_are_freed_at_once_not_by_the_cyclic_collector(model, tokenizer):
    """Caches replaced (a lane resized, or cleared when its last row leaves) and prompt caches free their
    tensors as soon as the engine drops them: none sits in a reference cycle, which would hold up to
    the KV budget until Python's cyclic collector happened to run."""
    engine = Engine(model, tokenizer, max_rows=4, step_tokens=16)
    gc.collect()
    gc.disable()
    try:
        run_engine(engine, {0: [_request(tokenizer, p, samples=2) for p in PROMPTS], 3: [_request(tokenizer, PROMPTS[3], samples=3, new_tokens=20)]})
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        cyclic = [o for o in gc.garbage if type(o) is torch.Tensor]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert not cyclic, f"{len(cyclic)} tensors ({sum(t.nbytes for t in cyclic)} bytes) were freed only by the cyclic collector"


def test_a_requests_time_is_estimated_from_the_measured_step_time(model, tokenizer):
    """Prompt chunks, then the new tokens in waves of at most ``max_rows`` rows, at the measured step time."""
    engine = Engine(model, tokenizer, max_rows=4, step_tokens=16, kv_budget_bytes=2**24)
    run_engine(engine, {0: [_request(tokenizer, p, samples=2) for p in PROMPTS]})
    step = engine.step_seconds
    assert 0 < step < 1
    assert engine.estimated_seconds(10, 4, 100) == pytest.approx((1 + 100) * step)
    assert engine.estimated_seconds(40, 9, 100) == pytest.approx((3 + 3 * 100) * step)  # 3 chunks, 3 waves of 4 rows


def test_a_requests_typical_time_counts_the_share_of_their_budget_rows_have_made(model, tokenizer):
    """Until a row finishes, a request's rows are counted at their whole budget; once rows stop early
    (here every row at its first token), at the share of it they have lately made."""
    engine = Engine(model, tokenizer, max_rows=4, step_tokens=16, kv_budget_bytes=2**24)
    engine.stops.stop_ids = set()
    run_engine(engine, {0: [_request(tokenizer, PROMPTS[0], new_tokens=4)]})
    assert engine.row_fill == 1 and engine.typical_seconds(10, 4, 100) == engine.estimated_seconds(10, 4, 100)
    engine.stops.stop_ids = set(range(engine.vocab_size))
    run_engine(engine, {0: [_request(tokenizer, p, samples=4, new_tokens=100) for p in PROMPTS]})
    assert engine.row_fill < 0.5
    assert engine.typical_seconds(10, 4, 100) == pytest.approx((1 + round(100 * engine.row_fill)) * engine.step_seconds)


def test_a_new_prompts_start_wait_counts_only_what_the_prefix_cache_holds_none_of(model, tokenizer):
    """The start wait of a new prompt counts its tokens past the run of blocks the prefix cache holds of
    it now: a served prompt again all but its last partial block (and last token), a prompt sharing a
    36-character opening all but the opening's two whole blocks, an unrelated prompt every token."""
    engine = Engine(model, tokenizer, max_rows=4, step_tokens=64, kv_budget_bytes=2**24)
    opening = "you are a careful solver. question: "
    served = [_request(tokenizer, f"{opening}{i} + {i} = ? {'and then some more words' * 2}", new_tokens=2) for i in range(3)]
    run_engine(engine, {3 * i: [q] for i, q in enumerate(served)})
    again = served[1].prompt_ids
    assert len(again) > 64 and engine.start_wait(again).prompt_tokens == len(again) - 16 * ((len(again) - 1) // 16)
    shared = tokenizer(f"{opening}what is 12 + 30, said slowly? " * 3).input_ids
    assert engine.start_wait(shared).prompt_tokens == len(shared) - 32
    unrelated = tokenizer("zebra " * 40).input_ids
    assert engine.start_wait(unrelated).prompt_tokens == len(unrelated)
    assert engine.start_wait_steps(again) < engine.start_wait_steps(unrelated)


def test_a_whole_prompts_first_tokens_come_back_in_its_steps_output_for_rows_that_start_later(model, tokenizer):
    """The executor samples every row's first token in the step that completes the prompt and returns them
    as data; rows waiting for a slot (one slot here) start later with the token drawn then."""
    engine = Engine(model, tokenizer, max_rows=1, step_tokens=8, kv_budget_bytes=2**24)
    request = _request(tokenizer, PROMPTS[2], samples=3, new_tokens=4)
    outputs, apply = [], engine.outputs.update_from_output
    engine.outputs.update_from_output = lambda output: (outputs.append(output), apply(output))
    run_engine(engine, {0: [request]})
    prefills = [p for output in outputs for p in output.prefill]
    assert [p.end for p in prefills] == [8, 16, len(request.prompt_ids)] and [len(p.tokens) for p in prefills] == [0, 0, 3]
    whole = model(torch.tensor([request.prompt_ids])).logits[0, -1]
    assert prefills[-1].tokens == [int(whole.argmax())] * 3 and [ids[0] for ids in request.token_ids] == prefills[-1].tokens
    assert prefills[-1].logprobs == pytest.approx([float(whole.log_softmax(-1).max())] * 3, abs=1e-5)


def test_the_executor_keeps_each_sampling_rows_generator_until_its_request_is_done(model, tokenizer):
    """Generators live in the executor by (request id, sample), made from the plan's seeds: one per
    sampled row while its request runs (greedy rows have none), none once the plan says it is done."""
    engine = Engine(model, tokenizer, max_rows=8, step_tokens=64, kv_budget_bytes=2**24)
    engine.stops.stop_ids = set()
    sampled = _request(tokenizer, PROMPTS[0], samples=3, new_tokens=6, temperatures=(1.0,), seed=5)
    greedy = _request(tokenizer, PROMPTS[1], samples=2, new_tokens=20)
    for request in (sampled, greedy):
        engine.submit(request)
    engine.take_submissions()
    for _ in range(3):  # a few steps in: both running
        engine.step()
    assert sampled.done_s is None and set(engine.executor.generators) == {(sampled.request_id, k) for k in range(3)}
    while greedy.done_s is None:
        engine.step()
    engine.step()  # the next plan names them done
    assert engine.executor.generators == {}
    again = _request(tokenizer, PROMPTS[0], samples=3, new_tokens=6, temperatures=(1.0,), seed=5)
    run_engine(engine, {0: [again]})
    assert again.token_ids == sampled.token_ids  # the same seeds, the same draws


def test_the_services_warm_up_measures_a_decode_step_and_a_prompt_token(model, tokenizer):
    """The service's first requests are estimated from its warm-up: a step's time and what a prompt token
    adds (its last run prefills the prompt again, not from the prefix cache), which then holds it again."""
    from bentos.serving_engine import ServingEngine

    serving = ServingEngine(model, tokenizer, 2**24, seed=0)
    # a few hundred tokens: their time stands well above a tiny model's step-to-step noise
    prompt = _request(tokenizer, "warm up with a prompt of a few hundred tokens, please. " * 6).prompt_ids
    serving.warm_up(lambda: EngineRequest(prompt, num_samples=1, temperatures=(0.0,), max_new_tokens=4))
    engine = serving.engine
    assert engine.decode_step_seconds > 0 and engine.prompt_token_seconds > 0
    assert engine.start_wait(prompt).prompt_tokens < len(prompt)


def test_the_services_unseeded_requests_take_the_seeds_counted_from_its_own(model, tokenizer):
    from bentos.serving_engine import ServingEngine

    serving = ServingEngine(model, tokenizer, 2**24, seed=7)
    assert [serving.next_seed() for _ in range(3)] == [7, 8, 9]


def test_a_steps_prompt_time_is_split_into_a_fixed_part_and_a_part_per_token():
    """Steps with prompt tokens add a fixed time (admitting rows, growing a lane) and a time per token:
    fitted from steps of different prompt lengths; through 0 while every step had about as many."""
    line = MovingLine()
    for tokens in [10, 200, 50, 400, 30, 120] * 5:
        line.add(tokens, 0.3 + 0.002 * tokens)
    assert line.intercept == pytest.approx(0.3) and line.slope == pytest.approx(0.002) and line.at(100) == pytest.approx(0.5)
    same = MovingLine()
    for _ in range(5):
        same.add(100, 0.5)
    assert same.intercept == 0 and same.slope == pytest.approx(0.005)
    assert MovingLine().at(100) == 0


def test_keys_per_token_weighs_a_keys_attention_against_a_tokens_projections(model):
    """The projections' weights (embeddings and output head left out, tied or not) over the multiply-adds
    of one key's scores and weighted values in every layer."""
    config = model.config
    projections = sum(m.weight.numel() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear))
    per_key = 2 * config.num_attention_heads * (config.hidden_size // config.num_attention_heads) * config.num_hidden_layers
    assert keys_per_token(model) == pytest.approx(projections / per_key, rel=0.01)
    tied = tiny_llama(model.config.vocab_size, tie_word_embeddings=True)
    assert keys_per_token(tied) == pytest.approx(keys_per_token(model), rel=1e-6)


def test_a_new_prompts_start_wait_counts_its_attention(model, tokenizer):
    """An idle engine without a prefix cache: a new prompt's wait is its own prefill, every token at its
    position (a long prompt's later tokens attend to more keys), at the measured time per token."""
    engine = Engine(model, tokenizer, max_rows=2, step_tokens=64, kv_budget_bytes=2**24, prefix_cache_bytes=0)
    prompt = _request(tokenizer, "a prompt long enough for its attention to count. " * 8).prompt_ids
    wait = engine.start_wait(prompt)
    assert wait.prompt_tokens == len(prompt)
    assert wait.prompt_work == pytest.approx(prompt_work(0, len(prompt), keys_per_token(model))) and wait.prompt_work > len(prompt)


def test_a_step_past_its_estimate_leaves_what_overrunning_steps_lately_ran_past_theirs(model, tokenizer, monkeypatch):
    """The step under way counts its estimate less its time so far; once past it, not 0 but the moving
    average of the overruns measured so far (steps that ran past their estimate, by how much)."""
    engine = Engine(model, tokenizer, max_rows=2, step_tokens=64, kv_budget_bytes=2**24)
    clock = [100.0]
    monkeypatch.setattr("rlvr.generation.engine.time.monotonic", lambda: clock[0])
    engine._step_started_s, engine._step_estimate_s = 100.0, 0.5
    clock[0] = 100.2
    assert engine.start_wait().under_way_s == pytest.approx(0.3)
    clock[0] = 100.7
    assert engine.start_wait().under_way_s == 0  # no overrun measured yet
    engine._step_started_s = 0.0
    forward = engine._forward

    def slow_forward():
        result = forward()
        engine._step_estimate_s, clock[0] = 0.5, clock[0] + 0.9  # this step: 0.4 s past its estimate
        return result

    monkeypatch.setattr(engine, "_forward", slow_forward)
    engine.submit(_request(tokenizer, "a prompt"))
    engine.take_submissions()
    engine.step()
    assert engine._overrun_s == pytest.approx(0.4)
    engine._step_started_s, engine._step_estimate_s = clock[0], 0.5
    clock[0] += 0.6
    assert engine.start_wait().under_way_s == pytest.approx(0.4)


def test_the_arrival_rate_follows_the_recent_arrivals():
    """A steady 100 tokens every half second reads ~200 a second once past its horizon, and fades after."""
    rate = ArrivalRate(horizon_s=10.0)
    assert rate.per_s(0.0) == 0
    for i in range(400):
        rate.add(100, i * 0.5)
    assert rate.per_s(199.5) == pytest.approx(200, rel=0.03)
    assert rate.per_s(209.5) == pytest.approx(rate.per_s(199.5) / math.e)


def test_a_new_prompt_expects_the_prompts_arriving_before_its_step_to_join_it(model, tokenizer):
    """Prompts waiting ahead of a new one take time to prefill; those arriving meanwhile (at the rate
    they lately have) join its prompt's step, as far as the step's budget; a request without a prompt
    (``/readyz``) expects none."""
    engine = Engine(model, tokenizer, max_rows=4, step_tokens=64, max_step_tokens=256, kv_budget_bytes=2**24, prefix_cache_bytes=0)
    engine.decode_step_seconds = 0.01
    for tokens in (50, 100, 200):
        engine._prompt_steps.add(tokens, 0.001 * tokens)  # 1 ms a prompt token
    prompt = _request(tokenizer, "a new prompt " * 4).prompt_ids
    assert engine.start_wait(prompt).arriving_tokens == 0  # nothing arrived yet, nothing waits
    for _ in range(3):
        engine.submit(_request(tokenizer, "a prompt waiting ahead of it " * 2))
    wait = engine.start_wait(prompt)
    rate, ahead_s = engine.arrivals.per_s(time.monotonic()), (wait.prompt_work - prompt_work(0, len(prompt), keys_per_token(model))) * 0.001
    assert rate > 0 and ahead_s > 0 and wait.arriving_tokens == pytest.approx(rate * ahead_s, rel=0.01)
    assert wait.seconds == pytest.approx(wait._replace(arriving_tokens=0).seconds + 0.001 * wait.arriving_tokens)
    assert engine.start_wait().arriving_tokens == 0
    engine.arrivals.add(10**9, time.monotonic())  # a flood: its step fills up
    wait = engine.start_wait(prompt)
    assert 0 < wait.arriving_tokens == engine._backlog().prefill_budget - wait.prompt_tokens


def test_a_cpu_engine_keeps_freed_memory_where_its_plan_says(model, tokenizer, monkeypatch):
    """Each CPU step's logits and sampling temporaries would otherwise be page-faulted in afresh."""
    calls = []
    monkeypatch.setattr("rlvr.generation.engine.keep_freed_memory", lambda: calls.append(1))
    Engine(model, tokenizer, max_rows=2, kv_budget_bytes=2**24)
    assert calls == [1]
    Engine(model, tokenizer, max_rows=2, kv_budget_bytes=2**24, fast_paths=FastPaths(keep_freed_memory=False))
    assert calls == [1]


def test_the_start_wait_follows_the_rows_ahead_once_asked(model, tokenizer):
    """Steps build the backlog only once someone has asked for the start wait (training never does);
    then a request queued behind a running one waits for its rows, and an idle engine starts in a step."""
    engine = Engine(model, tokenizer, max_rows=1, step_tokens=64, kv_budget_bytes=2**24)
    engine.stops.stop_ids = set()
    first, second = (_request(tokenizer, PROMPTS[0], new_tokens=20) for _ in range(2))
    for request in (first, second):
        engine.submit(request)
    engine.take_submissions()
    engine.step()
    assert engine.backlog.requests == ()  # not asked: not built
    assert engine.start_wait_steps() == 1
    engine.step()
    assert [(len(q.running), q.pending) for q in engine.backlog.requests] == [(1, 0), (0, 1)]
    assert engine.start_wait_steps() > 20 and engine.start_wait_s() > 0
    while not second.done_s:
        engine.step()
    assert engine.start_wait_steps() == 1


def test_requests_submitted_since_the_last_step_count_in_the_start_wait(model, tokenizer):
    """A burst between two steps: each new request's wait counts the rows of those submitted before it."""
    engine = Engine(model, tokenizer, max_rows=1, step_tokens=64, kv_budget_bytes=2**24)
    engine.stops.stop_ids = set()
    first, second, third = (_request(tokenizer, PROMPTS[0], new_tokens=20) for _ in range(3))
    engine.submit(first)
    engine.take_submissions()
    engine.start_wait_s()
    engine.step()
    engine.step()
    assert [(len(q.running), q.pending) for q in engine.backlog.requests] == [(1, 0)]
    alone = engine.start_wait_s()
    engine.submit(second)
    behind_one = engine.start_wait_s()
    engine.submit(third)
    behind_two = engine.start_wait_s()
    assert 0 < alone < behind_one < behind_two
    engine.take_submissions()
    assert engine.start_wait_s() == behind_two  # taken in, but the backlog is the last step's until the next
    engine.step()
    assert [(q.pending, q.tokens) for q in engine.backlog.requests[1:]] == [(1, 20), (1, 20)]  # now the step's backlog holds them


def _estimated_and_measured_steps(engine: Engine, arrivals: dict[int, list[EngineRequest]]) -> list[tuple[float, int]]:
    """Each arrival's start wait in steps, as estimated just before it is submitted (as the service asks)
    and as measured (its first token's step less the steps run before it was submitted)."""
    estimates, submitted_at, first_at = {}, {}, {}
    for request in (q for qs in arrivals.values() for q in qs):
        request.on_tokens = lambda pairs, request=request: first_at.setdefault(request, engine.steps)
    engine.start_wait_steps()  # asked from the start, as the service does
    for step in range(500):
        for request in arrivals.get(step, []):
            estimates[request] = engine.start_wait_steps(request.prompt_ids)
            submitted_at[request] = engine.steps
            engine.submit(request)
        engine.take_submissions()
        engine.step()
        if len(first_at) == len(estimates) and step >= max(arrivals):
            return [(estimates[q], first_at[q] - submitted_at[q]) for q in estimates]
    raise AssertionError("the engine did not start every request")


def test_the_start_wait_estimated_at_submission_is_within_1_5x_of_the_measured_one(model, tokenizer):
    """8 row slots: a 2-row request and a 7-row one (4 of its rows start, its fair share), then requests
    queue behind them. A new request waits for the next slot to free, not for every row queued ahead of it
    (the 7-row request's waiting rows start after the newer requests' first rows), in steps counted."""
    engine = Engine(model, tokenizer, max_rows=8, step_tokens=64, kv_budget_bytes=2**24)
    engine.stops.stop_ids = set()  # every row runs to its budget: the expected tokens are exact
    arrivals = {
        0: [_request(tokenizer, PROMPTS[0], samples=2, new_tokens=40), _request(tokenizer, PROMPTS[2], samples=7, new_tokens=30)],
        2: [_request(tokenizer, PROMPTS[1], new_tokens=10)],
        3: [_request(tokenizer, PROMPTS[0], samples=3, new_tokens=12), _request(tokenizer, PROMPTS[1], samples=2, new_tokens=8)],
        5: [_request(tokenizer, PROMPTS[3], new_tokens=20)],
        20: [_request(tokenizer, PROMPTS[1], new_tokens=6)],
        24: [_request(tokenizer, PROMPTS[1], samples=2, new_tokens=9)],
    }
    waits = _estimated_and_measured_steps(engine, arrivals)
    assert len([measured for _, measured in waits if measured > 2]) >= 4, waits  # most queued
    assert all(measured / 1.5 <= estimated <= 1.5 * measured for estimated, measured in waits), waits


def test_a_small_request_beside_a_max_cost_one_is_estimated_to_start_soon(model, tokenizer):
    """The max-cost request holds half the KV budget (4 of its 8 rows) and its other rows wait: a small
    request still starts at once beside it (a first row always fits), and is estimated to."""
    per_token = 2 * 2 * 2 * 16 * 4
    engine = Engine(model, tokenizer, max_rows=8, step_tokens=64, kv_budget_bytes=8 * 128 * per_token)
    engine.stops.stop_ids = set()
    big = _request(tokenizer, "y" * 20, samples=8, new_tokens=100, temperatures=(1.0,))
    smalls = [_request(tokenizer, "7", new_tokens=4) for _ in range(3)]
    waits = _estimated_and_measured_steps(engine, {0: [big], 5: smalls[:1], 30: smalls[1:2], 60: smalls[2:]})
    assert waits[0][1] <= 2 and all(measured <= 2 and estimated <= 3 for estimated, measured in waits[1:]), waits
