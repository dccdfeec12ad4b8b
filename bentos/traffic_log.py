"""The traffic log of the public endpoints: each request that reached generation appended to the JSONL
log (``rlvr.monitoring.traffic.TrafficLog``) with the status its client got and, when not 200, why, the id of the
API key that sent it (never the key) and, when 200, its usage: ``prompt_tokens``, ``generated_tokens`` and
``compute_s``, also counted in its key's ``/metrics`` counters and daily tokens (``count_usage``)."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from datetime import datetime, timezone

from bentos.admission import caller_key_id, cancelled_status
from bentos.api_keys import ACCESS, Access
from bentos.metrics import ANONYMOUS, KEY_COMPLETION_TOKENS, KEY_COMPUTE_SECONDS, KEY_PROMPT_TOKENS
from bentos.serving_engine import RolloutResult
from rlvr.generation import EngineRequest
from rlvr.monitoring.traffic import request_tokens, request_usage

logger = logging.getLogger("bentoml.rlvr_policy")
_REQUESTS: contextvars.ContextVar[list[EngineRequest] | None] = contextvars.ContextVar("rlvr_traffic_requests", default=None)


def note_request(request: EngineRequest) -> None:
    """Tell the enclosing traffic record about an engine request it waits for (a record that is not 200 keeps their progress)."""
    requests = _REQUESTS.get()
    if requests is not None:
        requests.append(request)


class TrafficRecording:
    """A mixin of ``RlvrPolicy`` (its ``traffic``, ``model_version``, ``model_tag``, ``batching``)."""

    @contextlib.asynccontextmanager
    async def _traffic_record(self, request_id: str, started: float, record: dict):
        """Append the request's traffic record on exit: the status its client got (200; 499 when it hung
        up; 504 when its time ran out; the error's) and, when not 200, why and each sample's tokens so far."""
        received_at, status, why = datetime.now(timezone.utc), 200, None
        requests: list[EngineRequest] = []
        _REQUESTS.set(requests)  # the request's own task; not reset: a stream's record may close in another context
        try:
            yield record
        except (asyncio.CancelledError, GeneratorExit):  # GeneratorExit: a stream closed by its response
            status, why = cancelled_status()
            raise
        except BaseException as err:
            status = getattr(getattr(err, "error_code", None), "value", 500)
            why = f"{type(err).__name__}: {err}"[:500]
            raise
        finally:
            entry = {
                "timestamp": received_at.isoformat(timespec="milliseconds"),
                "request_id": request_id,
                "model_version": self.model_version,
                "model_tag": self.model_tag,
                "api_key_id": caller_key_id(),
                **record,
                "status": status,
                "latency_s": round(time.perf_counter() - started, 4),
                "batching": self.batching,
            }
            if why is not None:
                entry["error"] = why
                if requests:
                    entry["completion_tokens_so_far"] = [len(ids) for request in requests for ids in request.token_ids]
            self._append_traffic(entry)
            count_usage(entry)

    def _append_traffic(self, entry: dict) -> None:
        """Append to the traffic log; a failed write (e.g. a full disk) must not fail the request."""
        try:
            self.traffic.append(entry)
        except OSError:
            logger.exception("rlvr_policy: could not append to the traffic log in %s", self.traffic.folder)


def count_usage(entry: dict, access: Access = ACCESS) -> None:
    """A request answered 200 in its key's ``/metrics`` counters and daily tokens (``request_tokens``)."""
    tokens = request_tokens(entry)
    if tokens is None:
        return
    used, key_id = request_usage(entry), entry.get("api_key_id")
    label = key_id or ANONYMOUS
    KEY_PROMPT_TOKENS.labels(api_key_id=label).inc(used["prompt_tokens"])
    KEY_COMPLETION_TOKENS.labels(api_key_id=label).inc(used["generated_tokens"])
    KEY_COMPUTE_SECONDS.labels(api_key_id=label).inc(used["compute_s"] or 0.0)
    access.tokens_today.add(key_id, tokens)


def generation_fields(result: RolloutResult) -> dict:
    """A finished request's outputs and usage, as its traffic record holds them (``compute_s``: from its
    submission to the engine, queueing included, to its last token)."""
    return {
        "prompt_tokens": result.prompt_tokens,
        "generated_tokens": sum(result.completion_tokens),
        "compute_s": round(result.generation_s, 4),
        "completions": result.texts,
        "finish_reasons": result.finish_reasons,
        "completion_tokens": result.completion_tokens,
        "generation_s": round(result.generation_s, 4),
        "batch_requests": result.batch_requests,
        "tool_calls": [[call.as_dict() for call in calls] for calls in result.tool_calls],
    }
