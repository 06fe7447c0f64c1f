"""Concurrent requests gathered into ``engine.abatch`` calls, one batch at a time."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

from langchain_core.decisions import (
    BaseDecisionModel,
    ClassifierRequest,
    ClassifierResponse,
)

from clef_guard.errors import EngineError, RequestError
from clef_guard.server.metrics import Metrics

_SHUTDOWN = "the server shut down before answering; send the request again"


@dataclass
class _Pending:
    request: ClassifierRequest
    future: asyncio.Future[ClassifierResponse]
    arrived: float = field(default_factory=time.monotonic)


@dataclass
class Batcher:
    """Gathers concurrent requests into ``engine.abatch`` calls, one batch at a time."""

    engine: BaseDecisionModel
    window_s: float
    max_batch: int
    metrics: Metrics
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
