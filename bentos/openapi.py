"""The service's OpenAPI 3.1 document (``/docs.json``), built from the routes it serves: each BentoML API
(``/generate``, ``/solve``) with the pydantic models of its type hints, each plain Starlette route of its
mounted app with the models its view is ``@documented`` with, and BentoML's probes. Schemas are the ones
pydantic validates and serializes with (JSON Schema 2020-12, as OpenAPI 3.1 takes it); BentoML's own
``/docs.json`` would flatten every union to its first member (OpenAPI 3.0).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any, Callable

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.routing import Route

from bentos.limits import BODY_TIMEOUT_S, MAX_BODY_BYTES
from bentos.native_models import ErrorResponse
from bentos.openai_models import OpenAIErrorResponse

OPENAI_ERRORS = {  # the plain routes' own (/v1 and the tokenizer's), in OpenAI's error shape
    400: "Invalid request: `error.param` names the field (a value out of its bounds, something the engine cannot do, "
    "or the request's cost on the loaded model over a limit)",
    404: "No such model: `model` is not the served policy (see /v1/models)",
}
ERRORS = {
    400: "Invalid request: each error in `detail` names its field in `loc` (a value out of its bounds, or the "
    "request's cost on the loaded model over a limit: prompt tokens, context, KV-cache budget)",
    408: f"The body did not arrive within {BODY_TIMEOUT_S:g} s",
    413: f"The body is over {MAX_BODY_BYTES} bytes",
    415: "The body is not application/json",
    500: "Unexpected server error",
    503: "Overloaded (every slot is taken) or the policy is not loaded yet: retry after `Retry-After` seconds",
    504: "Not answered within the request timeout (its generation is stopped)",
}
PROBES = {  # BentoML's own routes: path -> (summary, media type, 503 when not ready)
    "/healthz": ("Healthz: alive (loading has not failed)", "text/plain", False),
    "/livez": ("Livez: alive (loading has not failed)", "text/plain", False),
    "/readyz": ("Readyz: loaded, warmed up and not saturated", "text/plain", True),
    "/metrics": ("Metrics in Prometheus text format", "text/plain", False),
}
EVENT_STREAM = {
    "schema": {  # each event (OpenAPI 3.1)
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {
                "type": "string",
                "description": "with stream: true, one chunk's JSON per event (chat.completion.chunk or text_completion; an error's last), then [DONE]",
            }
        },
    }
}


@dataclass(frozen=True)
class Documented:
    """What the document says of a plain Starlette route's view: its answer's model, its body's (a POST),
    whether it streams server-sent events, and whether it is 503 until the policy is loaded."""

    response: type[BaseModel]
    request: type[BaseModel] | None = None
    stream: bool = False
    unloaded_503: bool = False


def documented(response: type[BaseModel], **what: Any) -> Callable[[Callable], Callable]:
    """Mark a view for the document (see ``Documented``); its docstring's first line is the summary."""

    def mark(view: Callable) -> Callable:
        view.documented = Documented(response, **what)
        return view

    return mark


def openapi_document(service: Any, version: str, description: str) -> dict:
    """The document of a BentoML ``service`` class: its APIs, its mounted apps' documented routes, the probes."""
    operations = []  # (path, method, operation id, summary, request model, response model, Documented of a plain route)
    for api in service.apis.values():
        hints = typing.get_type_hints(api.func)
        request = next(model for name, model in hints.items() if name != "return")
        operations.append((api.route, "post", api.name, api.doc, request, hints["return"], None))
    for app, prefix, _name in service.mount_apps:
        for route in getattr(app, "routes", []):
            if isinstance(route, Route) and (what := getattr(route.endpoint, "documented", None)) is not None:
                method = "post" if what.request is not None else "get"
                operation_id = route.name.strip("_").removesuffix("_view")
                operations.append((prefix.rstrip("/") + route.path, method, operation_id, route.endpoint.__doc__, what.request, what.response, what))
    models = [(ErrorResponse, "serialization"), (OpenAIErrorResponse, "serialization")]
    for *_, request, response, _what in operations:
        models += [(request, "validation")] if request is not None else []
        models.append((response, "serialization"))
    refs, schemas = models_json_schema(list(dict.fromkeys(models)), ref_template="#/components/schemas/{model}")

    def json_body(model: type[BaseModel], mode: str = "serialization") -> dict:
        return {"application/json": {"schema": refs[(model, mode)]}}

    def errors(openai: bool) -> dict:
        shape = OpenAIErrorResponse if openai else ErrorResponse
        out = {str(code): {"description": text, "content": json_body(shape)} for code, text in {**ERRORS, **(OPENAI_ERRORS if openai else {})}.items()}
        out["503"]["headers"] = {"Retry-After": {"description": "seconds", "schema": {"type": "integer"}}}
        out["504"]["content"] = json_body(ErrorResponse)  # BentoML's own timeout answer
        return out

    paths = {}
    for path, method, operation_id, doc, request, response, what in operations:
        ok = json_body(response)
        if what is not None and what.stream:
            ok["text/event-stream"] = EVENT_STREAM
        responses = {"200": {"description": "OK", "content": ok}}
        if request is not None:
            responses.update(errors(openai=what is not None))
        elif what.unloaded_503:
            responses["503"] = {"description": "the policy is not loaded yet", "content": json_body(OpenAIErrorResponse)}
        operation = {"summary": " ".join((doc or operation_id).split("\n\n")[0].split()), "operationId": operation_id}
        if request is not None:
            operation["requestBody"] = {"required": True, "content": json_body(request, "validation")}
        paths[path] = {method: {**operation, "responses": responses}}
    for path, (summary, media_type, not_ready) in PROBES.items():
        responses = {"200": {"description": "OK", "content": {media_type: {"schema": {"type": "string"}}}}}
        if not_ready:
            responses["503"] = {"description": "not ready: loading, or every slot is taken", "content": {media_type: {"schema": {"type": "string"}}}}
        paths[path] = {"get": {"summary": summary, "operationId": summary.split()[0].lower(), "responses": responses}}
    return {
        "openapi": "3.1.0",
        "info": {"title": service.name, "version": version, "description": description},
        "paths": paths,
        "components": {"schemas": schemas["$defs"]},
    }
