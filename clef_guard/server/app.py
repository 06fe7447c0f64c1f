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
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from datetime import date
from typing import Any

from langchain_core.decisions import (
    BaseDecisionModel,
    ClassifierRequest,
    ClassifierResponse,
    Question,
    Score,
)
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from clef_guard.errors import (
    EngineError,
    EngineTimeoutError,
    RemoteEngineError,
    RequestError,
    UnsupportedQuestionError,
)

MODEL_ALIAS = "jev-latest"
"""The model name Jev clients send by default; it names the served model."""
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_BATCH_WINDOW_MS = 5.0
DEFAULT_MAX_BATCH = 16
DEFAULT_REQUEST_TIMEOUT_S = 30.0

_log = logging.getLogger(__name__)
_SHUTDOWN = "the server shut down before answering; send the request again"
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
    metrics = _Metrics()
    batcher = _Batcher(engine, batch_window_ms / 1000, max_batch, metrics)
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
        middleware=[Middleware(_MetricsMiddleware, metrics=metrics)],
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
    batcher: _Batcher
    meters: _Metrics
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


@dataclass
class _Pending:
    request: ClassifierRequest
    future: asyncio.Future[ClassifierResponse]
    arrived: float = field(default_factory=time.monotonic)


@dataclass
class _Batcher:
    """Gathers concurrent requests into ``engine.abatch`` calls, one batch at a time."""

    engine: BaseDecisionModel
    window_s: float
    max_batch: int
    metrics: _Metrics
    _pending: list[_Pending] = field(default_factory=list)
    _arrived: asyncio.Event = field(default_factory=asyncio.Event)
    _full: asyncio.Event = field(default_factory=asyncio.Event)
    _worker: asyncio.Task[None] | None = None

    async def submit(self, request: ClassifierRequest) -> ClassifierResponse:
        """Queue ``request`` and wait for its answer (or its engine's error)."""
        if self._worker is None:
            self._worker = asyncio.create_task(self._run())
        future: asyncio.Future[ClassifierResponse] = asyncio.get_running_loop().create_future()
        self._pending.append(_Pending(request, future))
        self._signal()
        return await future

    async def close(self) -> None:
        """Stop the worker; requests still waiting get an :class:`EngineError`."""
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
            self._worker = None
        waiting, self._pending = self._pending, []
        _settle(waiting, [EngineError(_SHUTDOWN)] * len(waiting))

    def _signal(self) -> None:
        self.metrics.queue_depth.set(len(self._pending))
        if self._pending:
            self._arrived.set()
        if len(self._pending) >= self.max_batch:
            self._full.set()

    async def _run(self) -> None:
        while True:
            await self._arrived.wait()
            waited = time.monotonic() - self._pending[0].arrived
            if waited < self.window_s and not self._full.is_set():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.window_s - waited):
                        await self._full.wait()
            batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch :]
            self._arrived.clear()
            self._full.clear()
            self._signal()
            await self._answer([pending for pending in batch if not pending.future.done()])

    async def _answer(self, batch: list[_Pending]) -> None:
        if not batch:
            return
        self.metrics.batch_size.observe(len(batch))
        try:
            results = await self.engine.abatch([pending.request for pending in batch], return_exceptions=True)
        except asyncio.CancelledError:
            _settle(batch, [EngineError(_SHUTDOWN)] * len(batch))
            raise
        except Exception as exc:  # the batch as a whole failed: every caller in it gets the error
            results = [exc] * len(batch)
        _settle(batch, results)


def _settle(batch: list[_Pending], results: list[Any]) -> None:
    """Hand each caller still waiting its answer, or its error as the server reports it."""
    for pending, result in zip(batch, results, strict=True):
        if pending.future.done():  # the caller went away
            continue
        if isinstance(result, BaseException):
            pending.future.set_exception(_as_engine_failure(result))
        else:
            pending.future.set_result(result)


def _as_engine_failure(exc: BaseException) -> BaseException:
    """Request and engine errors as they are; anything else becomes an :class:`EngineError`."""
    if isinstance(exc, (RequestError, EngineError)):
        return exc
    error = EngineError(f"the engine failed: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


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


class _Metrics:
    """Prometheus metrics of one app, in a registry of its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "clef_guard_http_requests", "HTTP requests by route and status.", ["route", "status"], registry=self.registry
        )
        self.latency = Histogram(
            "clef_guard_http_request_duration_seconds", "Time to answer, by route.", ["route"], registry=self.registry
        )
        self.batch_size = Histogram(
            "clef_guard_engine_batch_size", "Requests per engine batch.",
            buckets=(1, 2, 4, 8, 16, 32, 64), registry=self.registry,
        )
        self.queue_depth = Gauge("clef_guard_engine_queue_depth", "Requests waiting for a batch.", registry=self.registry)


class _MetricsMiddleware:
    """Counts and times every HTTP request by route and status."""

    def __init__(self, app: ASGIApp, metrics: _Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        started = time.perf_counter()

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            route = scope["path"] if scope["path"] in _ROUTES else "other"
            self.metrics.requests.labels(route, str(status)).inc()
            self.metrics.latency.labels(route).observe(time.perf_counter() - started)
