"""``RemoteDecisionModel``: our server, the jevcompat reference mock and its faults, retries."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from jevcompat.mock import MockConfig, Running
from langchain_core.decisions import Choice, Noul, Score
from langchain_core.messages import AIMessage, HumanMessage
from loopback import serving
from model import ScriptedDecisionModel
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from clef_guard import (
    EngineTimeoutError,
    RemoteDecisionModel,
    RemoteEngineError,
    RequestError,
)
from clef_guard.server.app import create_app

QUESTIONS = {
    "refund": Noul(instructions="Is the customer asking for money back?"),
    "drink": Choice(instructions="Which drink is mentioned?", criteria={"Café": None, "Thé": "Tea", "Eau": None}),
    "anger": Score(instructions="How frustrated is the customer?", criteria=["Calm", "Frustrated", "Very angry"]),
}
REQUEST = {"state": "Charged twice for one café order. Refund it, please.", "questions": QUESTIONS}
NOUL_ANSWER = {"model": "stub", "answers": {"q": {"type": "noul", "noul": 0.8}}, "usage": {"input_tokens": 3, "output_tokens": 0}}
ONE_NOUL = {"state": "s", "questions": {"q": Noul(instructions="Is it?")}}


@dataclass
class Stub:
    """A scripted System One server: answers ``replies`` in turn (the last one repeats)."""

    url: str = ""
    replies: list[tuple[int, Any]] = field(default_factory=list)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    delay_s: float = 0.0

    async def systemone(self, request: Request) -> Response:
        self.bodies.append(json.loads(await request.body()))
        await asyncio.sleep(self.delay_s)
        status, body = self.replies[min(len(self.bodies), len(self.replies)) - 1]
        return JSONResponse(body, status_code=status, headers={"Retry-After": "0", "cf-ray": "ray-1"})


@pytest.fixture
def stub() -> Iterator[Stub]:
    stub = Stub()
    with serving(Starlette(routes=[Route("/v1/systemone", stub.systemone, methods=["POST"])])) as stub.url:
        yield stub


@pytest.fixture(scope="module")
def reference() -> Iterator[tuple[MockConfig, str]]:
    """``jevcompat mock``, the spec-exact reference server; each test sets its faults."""
    config = MockConfig()
    with Running(config) as running:
        yield config, running.url


def _mock(reference: tuple[MockConfig, str], *faults: str, busy_every: int = 0, key: str | None = None) -> str:
    config, url = reference
    config.faults, config.busy_every, config.key = frozenset(faults), busy_every, key
    return url


def _remote(url: str, **kwargs: Any) -> RemoteDecisionModel:
    return RemoteDecisionModel(url, "jev-latest", backoff_s=0.01, **kwargs)


def test_our_server_sync_async_and_batch() -> None:
    engine = ScriptedDecisionModel(script={"money back": 0.9, "drink": "Thé", "frustrated": {"2": 1.0}})
    with serving(create_app(engine, api_key="k")) as url:
        remote = RemoteDecisionModel(url, "scripted", api_key="k")
        answers = [remote.invoke(REQUEST), asyncio.run(remote.ainvoke(REQUEST)), *asyncio.run(remote.abatch([REQUEST] * 2))]
    local = engine.invoke(REQUEST)
    for answer in answers:
        assert answer.answers == local.answers
        assert answer.model == "scripted" and answer.request_id


def test_jevcompat_mock_answers_are_accepted(reference: tuple[MockConfig, str]) -> None:
    url = _mock(reference, "no-usage", "float-usage", "unprefixed-extra", "confidence-margin")
    response = _remote(url).invoke(REQUEST)
    assert response.choices["drink"].choice in QUESTIONS["drink"].criteria
    assert response.request_id == "req_mock"


@pytest.mark.parametrize(
    "fault",
    [
        "xssi-200", "nan", "extra-answer", "first-question-only", "boolean-type", "noul-range",
        "choice-no-confidence", "choice-key-case", "nfd-keys", "choice-sum", "choice-second",
        "score-no-legend", "legend-1-based", "score-keys-1-based", "score-sum", "score-argmax", "confidence-over",
    ],
)
def test_malformed_mock_answers_raise(reference: tuple[MockConfig, str], fault: str) -> None:
    with pytest.raises(RemoteEngineError) as info:
        _remote(_mock(reference, fault)).invoke(REQUEST)
    assert "not a System One response" in str(info.value)
    assert info.value.status == 200


def test_mock_rate_limits_are_retried_and_refusals_are_not(reference: tuple[MockConfig, str]) -> None:
    remote = _remote(_mock(reference, busy_every=2))
    assert all(0 <= remote.invoke(ONE_NOUL).nouls["q"].noul <= 1 for _ in range(3))
    assert reference[0].requests >= 4  # every second one was a 429, retried
    with pytest.raises(RemoteEngineError, match="401.*check api_key"):
        _remote(_mock(reference, key="right"), api_key="wrong").invoke(ONE_NOUL)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_429_and_5xx_are_retried_with_backoff(stub: Stub, asynchronous: bool) -> None:
    stub.replies = [(503, {}), (429, {}), (200, NOUL_ANSWER)]
    remote = _remote(stub.url)
    response = asyncio.run(remote.ainvoke(ONE_NOUL)) if asynchronous else remote.invoke(ONE_NOUL)
    assert response.nouls["q"].noul == 0.8 and response.request_id == "ray-1"
    assert len(stub.bodies) == 3


def test_retries_give_up_with_a_clear_error(stub: Stub) -> None:
    stub.replies = [(500, {"detail": {"error_type": "engine_error", "message": "out of memory"}})]
    with pytest.raises(RemoteEngineError, match="answered 500: out of memory.*after 3 attempts") as info:
        _remote(stub.url, max_retries=2).invoke(ONE_NOUL)
    assert info.value.status == 500 and len(stub.bodies) == 3


@pytest.mark.parametrize(
    ("status", "body", "error"),
    [
        (422, {"detail": [{"loc": ["body", "questions", "q", "noul", "instructions"], "msg": "too long", "type": "x"}]}, RequestError),
        (400, {"detail": {"error_type": "api_usage_error", "message": "bad"}}, RequestError),
        (404, {"detail": {"error_type": "not_found", "message": "no such model"}}, RemoteEngineError),
        (403, {"detail": {"error_type": "authentication_error", "message": "no key"}}, RemoteEngineError),
    ],
)
def test_4xx_is_not_retried(stub: Stub, status: int, body: Any, error: type) -> None:
    stub.replies = [(status, body)]
    with pytest.raises(error) as info:
        asyncio.run(_remote(stub.url).ainvoke(ONE_NOUL))
    assert len(stub.bodies) == 1
    if status == 422:
        assert (info.value.question, info.value.field) == ("q", "noul.instructions")


def test_connection_failures_are_retried_then_raised() -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with pytest.raises(RemoteEngineError, match="cannot reach the server after 3 attempts"):
        _remote(url).invoke(ONE_NOUL)


def test_a_slow_server_times_out(stub: Stub) -> None:
    stub.replies, stub.delay_s = [(200, NOUL_ANSWER)], 1.0
    with pytest.raises(EngineTimeoutError, match="no answer within 0.2 s"):
        _remote(stub.url, timeout_s=0.2).invoke(ONE_NOUL)


def test_workers_ai_envelope_and_messages_on_the_wire(stub: Stub) -> None:
    stub.replies = [(200, {"result": NOUL_ANSWER, "success": True, "errors": [], "messages": []})]
    state = [HumanMessage("Delete the logs"), AIMessage("", tool_calls=[{"name": "rm", "args": {"path": "/logs"}, "id": "c1"}])]
    clef = RemoteDecisionModel(stub.url, "clef", endpoint="/v1/systemone", api_key="token")
    assert clef.invoke({"state": state, "questions": ONE_NOUL["questions"]}).nouls["q"].noul == 0.8
    sent = stub.bodies[0]
    assert sent["model"] == "clef" and sent["questions"]["q"]["type"] == "noul"
    assert sent["state"][0] == {"role": "user", "content": "Delete the logs"}
    assert sent["state"][1]["tool_calls"][0]["function"]["name"] == "rm"
    stub.replies = [(200, {"result": None, "success": False, "errors": [{"code": 5021, "message": "too large"}]})]
    with pytest.raises(RemoteEngineError, match="did not succeed: too large"):
        clef.invoke(ONE_NOUL)
