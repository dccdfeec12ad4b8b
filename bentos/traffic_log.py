"""The traffic log of the public endpoints: each request that reached generation appended to the JSONL
log (``rlvr.monitoring.traffic.TrafficLog``) with the status its client got and, when not 200, why, and the id of the
API key that sent it (never the key)."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from datetime import datetime, timezone

from bentos.admission import caller_key_id, cancelled_status
from bentos.serving_engine import RolloutResult
from rlvr.generation import EngineRequest

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

    def _append_traffic(self, entry: dict) -> None:
        """Append to the traffic log; a failed write (e.g. a full disk) must not fail the request."""
        try:
            self.traffic.append(entry)
        except OSError:
            logger.exception("rlvr_policy: could not append to the traffic log in %s", self.traffic.folder)


def generation_fields(result: RolloutResult) -> dict:
    return {
        "completions": result.texts,
        "finish_reasons": result.finish_reasons,
        "completion_tokens": result.completion_tokens,
        "generation_s": round(result.generation_s, 4),
        "batch_requests": result.batch_requests,
        "tool_calls": [[call.as_dict() for call in calls] for calls in result.tool_calls],
    }
