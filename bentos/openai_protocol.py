"""The OpenAI-compatible API (``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``) and vLLM's
tokenizer endpoints (``/tokenize``, ``/detokenize``, ``/tokenizer_info``), as a mixin of ``RlvrPolicy``:
validated and cost-checked before any work (400 naming the field, in OpenAI's error shape), one engine request
per prompt batched with all others, stopped when the client hangs up or its time runs out, logged
in the traffic log. ``bentos.openai_api`` speaks the wire format; ``echo`` and ``logprobs: k`` score
prompt and completion in one forward pass on the model thread (``rlvr.generation.score_tokens``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from dataclasses import dataclass
from http import HTTPStatus
from typing import AsyncIterator

import bentoml
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from bentos import openai_api
from bentos.admission import EXCHANGE, FinishesTooLate, request_timeout_s
from bentos.limits import MAX_COMPLETION_TOKENS, MAX_SAMPLES
from bentos.openai_models import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    ChatMessage,
    Completion,
    CompletionChoice,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from bentos.openapi import documented
from bentos.request_cost import CostFields, invalid_request
from bentos.serving_engine import RolloutResult
from bentos.tokenizer_models import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse, TokenizerInfo
from bentos.traffic_log import generation_fields
from rlvr.chat import ControlTokensError, render_messages, with_instructions
from rlvr.evaluation import majority_vote
from rlvr.generation import EngineRequest, StopRule, TokenScores, score_tokens

logger = logging.getLogger("bentoml.rlvr_policy")


@dataclass(frozen=True)
class OpenAIReply:
    """Who a /v1 answer is: its kind, id, time and model, and the request it answers."""

    chat: bool
    response_id: str
    created: int
    model: str
    body: ChatCompletionRequest | CompletionRequest
    prompt_tokens: int


class StreamTimedOut(Exception):
    """A stream past the request timeout (recorded as 504, told to the client in its last event)."""

    error_code = HTTPStatus.GATEWAY_TIMEOUT


class OpenAIProtocol:
    """The ``/v1`` and tokenizer endpoints of ``RlvrPolicy`` (its model, tokenizers, request cost, engine, traffic log)."""

    def openai_models(self) -> ModelList:
        return ModelList(
            data=[ModelCard(id=self.model_version, created=self.created, owned_by="rlvr-ops", root=self.model_tag, max_model_len=self.context_tokens)]
        )

    async def openai_completions(self, request: Request, chat: bool) -> Response:
        """``POST /v1/chat/completions`` (``chat``) or ``/v1/completions``: validated and cost-checked before any
        work (400 naming the field, in OpenAI's error shape), one engine request per prompt batched
        with all others, stopped when the client hangs up or its time runs out, logged in the traffic log."""
        started, endpoint = time.perf_counter(), request.url.path
        response_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        schema = ChatCompletionRequest if chat else CompletionRequest
        try:
            body = schema.model_validate_json(await request.body())
            if body.model is not None and body.model not in self.model_names:
                return self._openai_refusal(
                    endpoint,
                    404,
                    f"the model `{body.model}` does not exist: this server serves `{self.model_version}` (GET /v1/models)",
                    "model",
                    "model_not_found",
                )
            prompts = self._openai_prompts(body, chat)
            max_tokens = body.new_tokens() if chat else body.max_tokens
            rows = "n" if body.n > 1 or len(prompts) == 1 else "prompt"
            if len(prompts) * body.n > MAX_SAMPLES:
                raise invalid_request(schema.__name__, rows, f"prompts x n = {len(prompts)} x {body.n}; at most {MAX_SAMPLES} choices per request")
            if len(prompts) * body.n * max_tokens > MAX_COMPLETION_TOKENS:
                raise invalid_request(
                    schema.__name__,
                    "max_tokens",
                    f"prompts x n x max_tokens = {len(prompts)} x {body.n} x {max_tokens}; at most {MAX_COMPLETION_TOKENS} completion tokens",
                )
            engine_requests = self._requests_within_limits(
                CostFields(schema.__name__, "messages" if chat else "prompt", rows, "max_tokens", chat),
                prompts,
                body.n,
                max_tokens,
                temperatures=(body.temperature,),
                top_p=body.top_p,
                stop=StopRule(tuple(body.stop)),
                seed=body.seed,
            )
        except ValidationError as err:
            return self._openai_refusal(endpoint, 400, *openai_api.error_parts(err))
        except FinishesTooLate as late:
            logger.info("503 on %s: %s", endpoint, late)
            return late.response(openai=True)
        record = {"endpoint": endpoint, "params": body.model_dump(exclude={"messages", "prompt"}, mode="json")}
        if chat:  # the traffic log's prompt: the question, as /solve logs it
            users = [m.content for m in body.messages if m.role == "user"]
            record.update(prompt=users[-1] if users else "", messages=[m.model_dump() for m in body.messages])
        else:
            shown = body.prompt if isinstance(body.prompt[0], str) else self.prompt_tokenizer.batch_decode(prompts)
            record.update(prompt=shown[0], **({"prompts": shown} if len(shown) > 1 else {}))
        reply = OpenAIReply(chat, response_id, int(time.time()), self.model_version, body, prompt_tokens=sum(len(ids) for ids in prompts))
        if body.stream:
            return openai_api.EventStream(self._openai_stream(reply, engine_requests, started, record))
        async with self._traffic_record(response_id, started, record):
            results = await asyncio.gather(*(self._rollouts(engine_request) for engine_request in engine_requests))
            scores = None
            if not chat and body.logprobs is not None and (body.echo or body.logprobs):  # prompt log-probs, alternatives: one scoring pass
                sequences = [list(engine_request.prompt_ids) + ids for engine_request, result in zip(engine_requests, results) for ids in result.token_ids]
                scores = await self._on_model(score_tokens, self.model, sequences, [body.temperature] * len(sequences), body.logprobs or 0)
            response = self._openai_response(reply, results, record, [engine_request.prompt_ids for engine_request in engine_requests], scores)
            return JSONResponse(response.model_dump(mode="json"))  # serialised here: a failure is logged as the 500 it is

    async def tokenize(self, request: Request, detokenize: bool) -> Response:
        """``POST /tokenize`` / ``/detokenize``, as vLLM's server has them (what lm-eval's remote tokenizer calls):
        ``/tokenize`` takes a ``prompt`` as it is, or chat ``messages`` rendered as ``/v1/chat/completions`` renders them."""
        schema = DetokenizeRequest if detokenize else TokenizeRequest
        try:
            body = schema.model_validate_json(await request.body())
        except ValidationError as err:
            return self._openai_refusal(request.url.path, 400, *openai_api.error_parts(err))
        if body.model is not None and body.model not in self.model_names:
            return self._openai_refusal(request.url.path, 404, f"the model `{body.model}` does not exist", "model", "model_not_found")
        if detokenize:
            if body.tokens and max(body.tokens) >= self.vocab_size:
                return self._openai_refusal(
                    request.url.path, 400, f"tokens: id {max(body.tokens)} is outside the vocabulary of {self.vocab_size}", "tokens", None
                )
            return JSONResponse(DetokenizeResponse(prompt=self.prompt_tokenizer.decode(body.tokens)).model_dump())
        text = body.prompt
        if body.messages is not None:
            try:
                text = self._chat_prompt(body.messages, "TokenizeRequest", body.add_generation_prompt)
            except ValidationError as err:
                return self._openai_refusal(request.url.path, 400, *openai_api.error_parts(err))
        ids = self.prompt_tokenizer(text, add_special_tokens=body.special_tokens()).input_ids
        strs = self.prompt_tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return JSONResponse(TokenizeResponse(count=len(ids), max_model_len=self.context_tokens, tokens=ids, token_strs=strs).model_dump())

    def tokenizer_info(self) -> TokenizerInfo | None:
        """``GET /tokenizer_info``, as vLLM's: the tokenizer's class, special tokens and chat template; None before loading."""
        tok = self.prompt_tokenizer
        if tok is None:
            return None
        return TokenizerInfo(
            tokenizer_class=type(tok).__name__,
            eos_token=tok.eos_token,
            bos_token=tok.bos_token,
            pad_token=tok.pad_token,
            chat_template=tok.chat_template,
            model_max_length=self.context_tokens,
        )

    def _openai_prompts(self, body, chat: bool) -> list[list[int]]:
        """The request's prompts as token ids: the chat messages rendered by ``_chat_prompt``, or the
        completions' prompts as they are."""
        if chat:
            return [self.prompt_tokenizer(self._chat_prompt(body.messages, "ChatCompletionRequest"), add_special_tokens=False).input_ids]
        if isinstance(body.prompt[0], str):
            return self.prompt_tokenizer(body.prompt, add_special_tokens=False).input_ids
        return body.prompt

    def _chat_prompt(self, chat: list[ChatMessage], title: str, add_generation_prompt: bool = True) -> str:
        """Chat messages with the policy's environment's instructions (``with_instructions``) rendered by
        ``render_messages`` (a 400 naming the message that holds control tokens); without
        ``add_generation_prompt``, the same chat template without the assistant's turn opened."""
        messages = [m.model_dump() for m in chat]
        fields = [f"messages[{i}].content" for i in range(len(messages))]
        messages = with_instructions(messages, self.environment)  # the tool instructions the policy was trained with
        fields = ["environment instructions"] * (len(messages) - len(fields)) + fields
        try:
            rendered = render_messages(self.prompt_tokenizer, messages, fields)
        except ControlTokensError as err:
            raise invalid_request(title, err.field, str(err)) from None
        if add_generation_prompt:
            return rendered
        return self.prompt_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)

    def _openai_response(
        self, reply: OpenAIReply, results: list[RolloutResult], record: dict, prompts: list[list[int]], scores: list[TokenScores] | None = None
    ):
        """The whole answer, its choices in order (prompt index x n + sample index), and the traffic record's
        generation fields (texts as the client got them; without an echoed prompt). ``scores``: each
        choice's prompt and completion scored (``echo``, ``logprobs`` above 0)."""
        texts, reasons, tokens, choices = [], [], [], []
        for p, result in enumerate(results):
            for decoded, engine_reason, ids, logprobs in zip(result.texts, result.finish_reasons, result.token_ids, result.logprobs):
                tokens.append(len(ids))
                text, stopped = openai_api.cut_at_stop(decoded, reply.body.stop)
                text = openai_api.returned_text(text, stopped, self.vocabulary.ends_inside_a_character(ids))
                listed = openai_api.logprob_token_count(self.vocabulary.text_offsets(ids), text, whole=text == decoded)
                ids, logprobs = ids[:listed], logprobs[:listed]
                reason = openai_api.finish_reason(engine_reason, stopped)
                index = len(choices)
                if reply.chat:
                    choices.append(
                        ChatChoice(
                            index=index,
                            message=AssistantMessage(content=text),
                            finish_reason=reason,
                            logprobs=openai_api.chat_logprobs(self.vocabulary.token_texts(ids), self.vocabulary.token_bytes(ids), logprobs)
                            if reply.body.logprobs
                            else None,
                        )
                    )
                else:
                    echoed = None
                    if reply.body.echo:
                        echoed = reply.body.prompt[p] if isinstance(reply.body.prompt[p], str) else self._decode(list(prompts[p]))
                    choices.append(
                        CompletionChoice(
                            index=index,
                            text=(echoed or "") + text,
                            finish_reason=reason,
                            logprobs=self._completion_logprobs(prompts[p], echoed, ids, logprobs, scores[index] if scores else None)
                            if reply.body.logprobs is not None
                            else None,
                        )
                    )
                texts.append(text)
                reasons.append(reason)
        used = openai_api.usage(reply.prompt_tokens, sum(tokens))
        merged = RolloutResult(
            texts=texts,
            finish_reasons=reasons,
            completion_tokens=tokens,
            generation_s=max(r.generation_s for r in results),
            batch_requests=max(r.batch_requests for r in results),
            prompt_tokens=reply.prompt_tokens,
        )
        default = next(iter(self.tasks.values()))  # a /v1 request names no task: its logged answers are the policy's first task's
        answers = [default.parse(text) for text in texts]
        answer, vote_share = majority_vote(answers)
        record.update(generation_fields(merged), answers=answers, answer=answer, vote_share=vote_share, usage=used.model_dump())
        response_type = ChatCompletion if reply.chat else Completion
        return response_type(id=reply.response_id, created=reply.created, model=reply.model, choices=choices, usage=used)

    def _completion_logprobs(self, prompt_ids, echoed: str | None, ids: list[int], sampled: list[float], score: TokenScores | None):
        """A completion choice's log-probs: the listed tokens' (the engine's own), after the prompt's when
        ``echoed`` (not None; its first token has none), each with the ``logprobs`` most likely tokens at its position
        and its offset in the choice's text (the echoed prompt and the completion, each decoded alone)."""
        vocabulary, before = self.vocabulary, len(prompt_ids) - 1  # the score of token i is at position i - 1

        def alternatives(position: int) -> dict[str, float] | None:
            if score is None or not score.top_ids:
                return None
            return dict(zip(vocabulary.token_texts(score.top_ids[position]), score.top_logprobs[position]))

        tokens, logprobs, offsets = vocabulary.token_texts(ids), list(sampled), vocabulary.text_offsets(ids)
        top = [alternatives(before + j) for j in range(len(ids))]
        if echoed is not None:
            tokens = vocabulary.token_texts(list(prompt_ids)) + tokens
            logprobs = [None, *score.logprobs[:before], *logprobs]
            top = [None, *(alternatives(j) for j in range(before)), *top]
            offsets = vocabulary.text_offsets(list(prompt_ids)) + [len(echoed) + offset for offset in offsets]
        return openai_api.completion_logprobs(tokens, logprobs, offsets, top)

    async def _openai_stream(self, reply: OpenAIReply, engine_requests: list[EngineRequest], started: float, record: dict) -> AsyncIterator[bytes]:
        """Server-sent events: each choice's text as its tokens are sampled (held back while it could still
        become a stop string), its finish reason, the usage when asked, ``[DONE]``. A stream past the request
        timeout ends with an error event (504 in the log and the metrics)."""
        loop, arrived = asyncio.get_running_loop(), asyncio.Queue()
        n = reply.body.n
        streams = [openai_api.TextStream(self._decode, reply.body.stop) for _ in range(len(engine_requests) * n)]
        for i, engine_request in enumerate(engine_requests):
            engine_request.on_tokens = lambda pairs, i=i: loop.call_soon_threadsafe(arrived.put_nowait, (i, pairs))
        deadline = started + request_timeout_s()
        say = functools.partial(openai_api.chunk, reply.chat, reply.response_id, reply.created, reply.model)
        try:
            async with self._traffic_record(reply.response_id, started, record):
                generation = asyncio.gather(*(self._rollouts(engine_request) for engine_request in engine_requests))
                generation.add_done_callback(lambda _: arrived.put_nowait(None))
                try:
                    if reply.chat:
                        for index in range(len(streams)):
                            yield openai_api.sse(say(index, role=True))
                    finished = False
                    while not finished:
                        try:
                            items = [await asyncio.wait_for(arrived.get(), deadline - time.perf_counter())]
                        except TimeoutError:
                            raise StreamTimedOut("timed out (the service's request timeout)") from None
                        while not arrived.empty():
                            items.append(arrived.get_nowait())
                        new: dict[int, list[int]] = {}
                        for item in items:
                            if item is None:
                                finished = True
                                continue
                            for sample, token in item[1]:
                                new.setdefault(item[0] * n + sample, []).append(token)
                        for index, tokens in new.items():
                            if delta := streams[index].add(tokens):
                                yield openai_api.sse(say(index, text=delta))
                    results = generation.result()
                finally:
                    generation.cancel()
                response = self._openai_response(reply, results, record, [engine_request.prompt_ids for engine_request in engine_requests])
                for choice, stream in zip(response.choices, streams):
                    text = choice.message.content if reply.chat else choice.text
                    rest = stream.finish(text)
                    yield openai_api.sse(say(choice.index, text=rest or None, finish=choice.finish_reason))
                if reply.body.include_usage():
                    yield openai_api.sse(openai_api.usage_chunk(reply.chat, reply.response_id, reply.created, reply.model, response.usage))
        except Exception as err:  # noqa: BLE001 - the response has begun: the error is its last event
            status = getattr(getattr(err, "error_code", None), "value", 500)
            if status == 500:
                logger.exception("rlvr_policy: a streamed %s request failed", record["endpoint"])
            if (exchange := EXCHANGE.get(None)) is not None:
                exchange.status = status
            yield openai_api.sse(openai_api.error_body(status, str(err) if status != 500 else "generation failed"))
        yield openai_api.SSE_DONE

    def _openai_refusal(self, endpoint: str, status: int, message: str, param: str | None, code: str | None):
        logger.info("%d on %s: %s", status, endpoint, message[:300])
        return openai_api.error_response(status, message, param, code)

    def _decode(self, token_ids: list[int]) -> str:
        """Completion text as the engine decodes it (special tokens skipped)."""
        return self.prompt_tokenizer.decode(token_ids, skip_special_tokens=True)


@documented(ModelList)
async def _models_view(_request) -> JSONResponse:
    """Models: the served policy"""
    return JSONResponse(bentoml.get_current_service().openai_models().model_dump())


@documented(ChatCompletion, request=ChatCompletionRequest, stream=True)
async def _chat_view(request: Request) -> Response:
    """Chat: OpenAI-compatible chat completions"""
    return await bentoml.get_current_service().openai_completions(request, chat=True)


@documented(Completion, request=CompletionRequest, stream=True)
async def _completions_view(request: Request) -> Response:
    """Completions: OpenAI-compatible completions of raw prompts"""
    return await bentoml.get_current_service().openai_completions(request, chat=False)


@documented(TokenizeResponse, request=TokenizeRequest)
async def _tokenize_view(request: Request) -> Response:
    """Tokenize: token ids of a prompt or a chat, as vLLM's /tokenize"""
    return await bentoml.get_current_service().tokenize(request, detokenize=False)


@documented(DetokenizeResponse, request=DetokenizeRequest)
async def _detokenize_view(request: Request) -> Response:
    """Detokenize: the text of token ids, as vLLM's /detokenize"""
    return await bentoml.get_current_service().tokenize(request, detokenize=True)


@documented(TokenizerInfo, unloaded_503=True)
async def _tokenizer_info_view(_request) -> Response:
    """Tokenizer_info: the tokenizer's class, special tokens and chat template, as vLLM's /tokenizer_info"""
    info = bentoml.get_current_service().tokenizer_info()
    if info is None:
        return openai_api.error_response(503, "the policy is not loaded yet")
    return JSONResponse(info.model_dump())


ROUTES = [
    Route("/v1/models", _models_view),
    Route("/v1/chat/completions", _chat_view, methods=["POST"]),
    Route("/v1/completions", _completions_view, methods=["POST"]),
    Route("/tokenize", _tokenize_view, methods=["POST"]),
    Route("/detokenize", _detokenize_view, methods=["POST"]),
    Route("/tokenizer_info", _tokenizer_info_view),
]
