"""A request's cost on the loaded model, checked before it is queued: a 400 naming the field when a
prompt is over ``MAX_PROMPT_TOKENS`` (the service's limit), when the engine could never run it (its
``check``: the model's context or sliding window, a token id outside the vocabulary, the KV cache of all
its rows over the budget, ``$RLVR_KV_CACHE_BUDGET_MIB``), or its work more than the engine's measured
speed finishes within the request timeout; a 503
(:class:`~bentos.admission.FinishesTooLate`) when the queue ahead would make it finish past the timeout at
the share of their token budget rows lately use
(``$RLVR_REFUSE_PAST_TIMEOUT=0`` admits either to run into the timeout instead)."""

from __future__ import annotations

from typing import NamedTuple

from pydantic import ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

from bentos.admission import FinishesTooLate, refuse_past_timeout, request_timeout_s
from bentos.limits import MAX_PROMPT_TOKENS
from rlvr.generation import EngineRequest
from rlvr.generation.request import RequestDoesNotFit
from rlvr.tasks import Task


def invalid_request(title: str, field_name: str, message: str) -> ValidationError:
    """A 400 naming ``field_name`` in the shape of pydantic's own (BentoML answers a ValidationError so)."""
    error = PydanticCustomError("request_cost", "{message}", {"message": message})
    return ValidationError.from_exception_data(title, [InitErrorDetails(type=error, loc=(field_name,), input=None)])


class CostFields(NamedTuple):
    """The request fields a 400 on its cost names."""

    title: str  # the request model
    prompt: str
    rows: str
    new_tokens: str
    templated: bool  # the prompt is counted in the chat template


class RequestCost:
    """The service's request-cost checks (a mixin of ``RlvrPolicy``: its ``serving_engine``,
    ``prompt_tokenizer`` and ``environment``). A request's ``max_new_tokens`` bounds its rows' tokens, the
    environment's injected ones included."""

    def _within_timeout(self, names: CostFields, prompt_ids: list[int], rows: int, max_new_tokens: int) -> None:
        """A 400 naming the new-tokens field when the engine's measured speed cannot finish the request in
        time even alone, its rows making every token of their budget; :class:`FinishesTooLate` when the work
        queued ahead of it would make it finish late, its rows making the share of their budget rows lately
        have (``typical_s``): a request that would likely finish in time is not refused."""
        if not refuse_past_timeout():
            return
        prompt_tokens = len(prompt_ids)
        timeout_s, estimated_s = request_timeout_s(), self.serving_engine.estimated_s(prompt_tokens, rows, max_new_tokens)
        if estimated_s > timeout_s:
            step_ms = 1000 * self.serving_engine.step_seconds
            raise invalid_request(
                names.title,
                names.new_tokens,
                f"{names.rows} x {names.new_tokens} = {rows} x {max_new_tokens} tokens after a {prompt_tokens}-token prompt: "
                f"at least {estimated_s:.0f} s at the engine's measured {step_ms:.0f} ms per step, over the request "
                f"timeout of {timeout_s:.0f} s",
            )
        typical_s = self.serving_engine.typical_s(prompt_tokens, rows, max_new_tokens)
        if (wait_s := self.serving_engine.start_wait_s(prompt_ids)) + typical_s > timeout_s:
            raise FinishesTooLate(wait_s, typical_s, timeout_s)

    def _rendered(self, title: str, text_field: str, question: str, task: Task) -> list[int]:
        """The question in ``task``'s training prompt (the policy's environment's instructions included), as
        token ids; a 400 naming the field when the prompt builder refuses it (control tokens)."""
        try:
            prompt = task.render_prompt(self.prompt_tokenizer, {"problem_id": "request", "question": question}, self.environment)
        except ValueError as err:
            raise invalid_request(title, text_field, f"{text_field} refused by the prompt builder: {err}") from None
        return self.prompt_tokenizer(prompt, add_special_tokens=False).input_ids

    def _requests_within_limits(
        self, names: CostFields, prompts: list[list[int]], rows: int, max_new_tokens: int, seed: int | None = None, **sampling
    ) -> list[EngineRequest]:
        """One engine request per prompt, in the policy's environment, once the request's cost on the loaded
        model fits; else a 400 naming the field: each prompt within ``MAX_PROMPT_TOKENS``, then whatever the
        engine's ``check`` refuses (each prompt alone, and all the request's rows together). ``seed``: the
        client's (the same choices alone or batched), else the engine's next."""
        title, where = names.title, " in the chat template" if names.templated else ""
        for ids in prompts:
            if len(ids) > MAX_PROMPT_TOKENS:
                raise invalid_request(title, names.prompt, f"{names.prompt} is {len(ids)} tokens{where}; at most {MAX_PROMPT_TOKENS}")
        requests = [
            EngineRequest(prompt_ids=list(ids), num_samples=rows, max_new_tokens=max_new_tokens, environment=self.environment, **sampling) for ids in prompts
        ]
        try:
            self.serving_engine.check(*requests)
        except RequestDoesNotFit as err:
            field_name = getattr(names, err.part)
            what = {
                "prompt": f"{names.prompt}{where}",
                "new_tokens": f"{names.prompt}{where} + {names.new_tokens}",
                "rows": f"{names.rows} x ({names.prompt} + {names.new_tokens})",
            }[err.part]
            raise invalid_request(title, field_name, f"{what}: {err}") from None
        self._within_timeout(names, max(prompts, key=len), rows * len(prompts), max_new_tokens)
        for request in requests:
            request.seed = self.serving_engine.next_seed() if seed is None else seed
        return requests
