"""System One over HTTP: an ASGI app that serves any ``BaseDecisionModel``.

::

    POST /v1/systemone   {model, state, questions} -> the ClassifierResponse JSON
    GET  /v1/models      the served model and its ``jev-latest`` alias
    GET  /healthz        liveness; never needs a key
    GET  /metrics        Prometheus text format

A request that cannot be answered as written gets 422 ``{"detail": [{loc, msg, type}]}``
(a malformed message in the state, NaN or Infinity anywhere, a question id with control
characters), and no 422 repeats the values it was sent; every other error
``{"detail": {"error_type", "message"}}`` (401 key, 404 model or route, 413 body size,
504 past ``request_timeout_s``). A 5xx means the engine or the server failed, never the
request. A state longer than the engine's window costs what a full window does (the
engine drops its middle before reading it), so one huge request cannot stall the rest.

Concurrent requests are gathered for up to ``batch_window_ms`` (at most ``max_batch``
of them) and answered by one ``engine.abatch`` call, so an engine that shares forward
passes within a batch shares them across callers. While a batch runs, the next one
gathers.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from datetime import date
from typing import Any

from langchain_core.decisions import (
    BaseDecisionModel,
    ClassifierResponse,
    Question,
    Score,
)
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    generate_latest,
)
from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from clef_guard.errors import (
    EngineError,
    EngineTimeoutError,
    RemoteEngineError,
    RequestError,
    UnsupportedQuestionError,
)
from clef_guard.server.batcher import Batcher
from clef_guard.server.metrics import Metrics, MetricsMiddleware

MODEL_ALIAS = "jev-latest"
"""The model name Jev clients send by default; it names the served model."""
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_BATCH_WINDOW_MS = 5.0
DEFAULT_MAX_BATCH = 16
DEFAULT_REQUEST_TIMEOUT_S = 30.0

_log = logging.getLogger(__name__)
_ROUTES = ("/v1/systemone", "/v1/models", "/healthz", "/metrics")
_ERROR_TYPES = {
    401: "authentication_error",
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    500: "engine_error",
    502: "upstream_error",
    504: "timeout_error",
}


class SystemOneRequest(BaseModel):
    """The body of ``POST /v1/systemone``; unknown top-level fields are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str
    state: str | dict[str, JsonValue] | list[JsonValue]
    questions: dict[str, Question] = Field(min_length=1)


def create_app(
    engine: BaseDecisionModel,
    *,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    batch_window_ms: float = DEFAULT_BATCH_WINDOW_MS,
    max_batch: int = DEFAULT_MAX_BATCH,
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
) -> Starlette:
    """The System One app for ``engine``.

    Parameters
    ----------
    api_key
        When set, every route but ``/healthz`` needs ``Authorization: Bearer <api_key>``.
    max_body_bytes
        Larger request bodies get 413 before they are parsed.
    batch_window_ms, max_batch
        How long the first waiting request waits for others, and how many go to the
        engine together; ``0`` and ``1`` answer one request at a time.
    request_timeout_s
        A request not answered by then (queueing included) gets 504.
    """
    limits = (
        ("max_batch", max_batch, 1), ("batch_window_ms", batch_window_ms, 0), ("max_body_bytes", max_body_bytes, 1),
        ("request_timeout_s", request_timeout_s, 0.001),
    )
    for name, value, least in limits:
        if value < least:
            raise ValueError(f"{name} must be at least {least}, got {value}")
    metrics = Metrics()
    batcher = Batcher(engine, batch_window_ms / 1000, max_batch, metrics)
    service = _Service(engine, batcher, metrics, api_key, max_body_bytes, date.today().isoformat(), request_timeout_s)

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        yield
        await batcher.close()

    return Starlette(
        routes=[
            Route("/v1/systemone", service.systemone, methods=["POST"]),
            Route("/v1/models", service.models, methods=["GET"]),
            Route("/healthz", service.healthz, methods=["GET"]),
            Route("/metrics", service.prometheus, methods=["GET"]),
        ],
        middleware=[Middleware(MetricsMiddleware, metrics=metrics, routes=_ROUTES)],
        exception_handlers={
            HTTPException: _http_error,
            RequestError: _request_error,
            EngineError: _engine_error,
            Exception: _internal_error,
        },
        lifespan=lifespan,
    )


@dataclass
class _Service:
    """The routes of one app."""

    engine: BaseDecisionModel
    batcher: Batcher
    meters: Metrics
    api_key: str | None
    max_body_bytes: int
    serving_since: str
    request_timeout_s: float

    async def systemone(self, request: Request) -> Response:
        self._authorize(request)
        body = await self._body(request)
        if _has_non_finite(body):
            return _invalid([{"loc": ["body"], "msg": "NaN and Infinity are not JSON numbers", "type": "finite_number"}])
        try:
            call = SystemOneRequest.model_validate_json(body)
        except ValidationError as exc:
            return _invalid(
                [{"loc": ["body", *e["loc"]], "msg": e["msg"], "type": e["type"]} for e in exc.errors(include_url=False)]
            )
        _require_described_levels(call.questions)
        if call.model not in (self.engine.model, MODEL_ALIAS):
            raise HTTPException(
                404, f"model {call.model!r} is not served here; send {self.engine.model!r} or {MODEL_ALIAS!r}"
            )
        try:
            async with asyncio.timeout(self.request_timeout_s):
                response = await self.batcher.submit({"state": call.state, "questions": call.questions})
        except TimeoutError:
            raise EngineTimeoutError(f"the request was not answered within {self.request_timeout_s} s") from None
        return JSONResponse(_wire(response), headers={"x-request-id": response.request_id or uuid.uuid4().hex})

    async def models(self, request: Request) -> Response:
        """The served model and its alias; a local model has no release date, so the day
        this server started serving it stands in for one."""
        self._authorize(request)
        served = {"description": f"{type(self.engine).__name__} served by clef-guard", "release_date": self.serving_since}
        alias = {"description": f"alias of {self.engine.model}", "release_date": self.serving_since}
        return JSONResponse({"models": [{"name": self.engine.model, **served}, {"name": MODEL_ALIAS, **alias}]})

    async def healthz(self, _: Request) -> Response:
        return JSONResponse({"status": "ok", "model": self.engine.model})

    async def prometheus(self, request: Request) -> Response:
        self._authorize(request)
        return Response(generate_latest(self.meters.registry), media_type=CONTENT_TYPE_LATEST)

    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given:
            raise HTTPException(401, "missing API key: send Authorization: Bearer <key>", {"WWW-Authenticate": "Bearer"})
        if not hmac.compare_digest(given.strip().encode(), self.api_key.encode()):
            raise HTTPException(401, "the API key is not valid for this server", {"WWW-Authenticate": "Bearer"})

    async def _body(self, request: Request) -> bytes:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise self._too_large()
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body_bytes:
                raise self._too_large()
        return bytes(body)

    def _too_large(self) -> HTTPException:
        return HTTPException(
            413, f"the request body is over {self.max_body_bytes} bytes; send a shorter state or fewer questions"
        )


def _has_non_finite(body: bytes) -> bool:
    """Whether a JSON body holds NaN or Infinity, which Python's JSON (and pydantic's) read as numbers."""

    def refuse(name: str) -> Any:
        raise _NonFinite(name)

    try:
        json.loads(body, parse_constant=refuse)
    except _NonFinite:
        return True
    except ValueError:  # not JSON at all: validation says where
        return False
    return False


class _NonFinite(ValueError):
    pass


def _require_described_levels(questions: Mapping[str, Any]) -> None:
    """Refuse null score levels: their legend entry would be null, which Jev clients reject."""
    for qid, question in questions.items():
        if isinstance(question, Score):
            for level, description in enumerate(question.criteria):
                if description is None:
                    raise RequestError("a score level is null; describe every level", question=qid, field=f"criteria.{level}")


def _wire(response: ClassifierResponse) -> dict[str, Any]:
    """The response as langchain-core serialises it, less ``request_id`` (sent as the
    ``x-request-id`` header); fields a subclass adds get an ``x_`` prefix, and a missing
    ``usage`` reads as zero tokens."""
    body = response.model_dump(mode="json", exclude={"request_id"})
    wire = {key: value for key, value in body.items() if key in ClassifierResponse.model_fields}
    wire.update({f"x_{key}": value for key, value in body.items() if key not in ClassifierResponse.model_fields})
    wire["usage"] = wire["usage"] or {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0}
    return wire


def _invalid(detail: list[dict[str, Any]]) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=422)


def _error(status: int, message: str, headers: Mapping[str, str] | None = None, error_type: str | None = None) -> JSONResponse:
    error_type = error_type or _ERROR_TYPES.get(status, "api_error")
    return JSONResponse({"detail": {"error_type": error_type, "message": message}}, status_code=status, headers=headers)


async def _http_error(_: Request, exc: HTTPException) -> Response:
    return _error(exc.status_code, exc.detail, exc.headers)


async def _request_error(_: Request, exc: RequestError) -> Response:
    loc: list[str] = ["body"]
    if exc.question is not None:
        loc += ["questions", exc.question]
    if exc.field:
        loc += exc.field.split(".", 1)
    kind = "unsupported_question" if isinstance(exc, UnsupportedQuestionError) else "value_error"
    return _invalid([{"loc": loc, "msg": str(exc), "type": kind}])


async def _engine_error(_: Request, exc: EngineError) -> Response:
    _log.error("engine failure", exc_info=exc)
    status = 504 if isinstance(exc, EngineTimeoutError) else 502 if isinstance(exc, RemoteEngineError) else 500
    return _error(status, str(exc))


async def _internal_error(_: Request, exc: Exception) -> Response:
    return _error(500, f"the server failed: {type(exc).__name__}: {exc}", error_type="internal_error")


