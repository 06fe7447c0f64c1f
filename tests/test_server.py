"""``clef-guard serve``'s app on loopback: conformance, errors, auth, limits, batching."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from jevcompat import cli as jevcompat_cli
from jevcompat import client as jevcompat_client
from jevcompat.validate import validate_success
from langchain_core.decisions import Choice, Noul, Score
from loopback import serving
from model import ScriptedDecisionModel
from pydantic import Field

from clef_guard import LocalDecisionModel, RemoteDecisionModel
from clef_guard.server.app import create_app

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
NOUL = {"type": "noul", "instructions": "Is the customer asking for money back?"}
TICKET = "I was charged twice for my March invoice; please refund one of the charges."


class RecordingModel(ScriptedDecisionModel):
    """A scripted model that records the size of every ``abatch`` call."""

    batch_sizes: list[int] = Field(default_factory=list)

    async def abatch(self, inputs: list[Any], *args: Any, **kwargs: Any) -> list[Any]:
        self.batch_sizes.append(len(inputs))
        return await super().abatch(inputs, *args, **kwargs)


@pytest.fixture(scope="module")
def keyed_url() -> Iterator[str]:
    """A scripted engine behind a key and a 16 KiB body limit."""
    engine = ScriptedDecisionModel(script={"money back": 0.9})
    with serving(create_app(engine, api_key=KEY, max_body_bytes=16 * 1024)) as url:
        yield url


@pytest.fixture(scope="module")
def real_url(engine: LocalDecisionModel) -> Iterator[str]:
    """The real embedded engine, no key."""
    with serving(create_app(engine)) as url:
        yield url


def _post(url: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{url}/v1/systemone", content=content, headers={**AUTH, **(headers or {})}, timeout=60)


def test_jevcompat_test_passes_every_must(keyed_url: str, tmp_path: Path) -> None:
    report = tmp_path / "jevcompat.json"
    status = jevcompat_cli.main(["test", keyed_url, "--key", KEY, "--json", str(report)])
    summary = json.loads(report.read_text())["summary"]
    assert status == 0, summary
    assert summary["verdict"] == "conformant"
    assert summary["MUST"]["failed"] == 0 and summary["MUST"]["passed"] == 32
    failed = [r["id"] for r in json.loads(report.read_text())["results"] if r["status"] == "fail"]
    assert failed == ["noul.no-instructions"]  # langchain-core's Noul requires instructions (README)


def test_real_engine_answers_meet_the_spec(real_url: str) -> None:
    questions = {
        "refund": NOUL,
        "팀": {"type": "choice", "instructions": ["Route the ticket.", "Pick one team."],
               "criteria": {"결제": "Payments", "Technical": {"owns": ["bugs"]}, "🙂 other": None}},
        "anger": {"type": "score", "instructions": "How frustrated is the customer?", "criteria": ["Calm", "Frustrated", "Very angry"]},
    }
    state = {"subject": "Charged twice", "messages": [TICKET, "Still no refund."]}
    response = jevcompat_client.Client(real_url).ask(questions, state)
    assert response.status == 200
    assert validate_success({"questions": questions}, response) == []


def test_real_engine_over_http_matches_in_process(engine: LocalDecisionModel, real_url: str) -> None:
    questions = {
        "refund": Noul(instructions="Is the customer asking for money back?"),
        "team": Choice(instructions="Which team should handle it?", criteria={"billing": None, "tech": None}),
        "anger": Score(instructions="How angry is the customer?", criteria=["calm", "annoyed", "furious"]),
    }
    request = {"state": TICKET, "questions": questions}
    local = engine.invoke(request)
    remote = RemoteDecisionModel(real_url, engine.model, api_key="ignored-when-off")
    over_http = [remote.invoke(request), asyncio.run(remote.ainvoke(request))]
    for answer in over_http:
        assert answer.nouls["refund"].noul == pytest.approx(local.nouls["refund"].noul, abs=1e-4)
        assert answer.choices["team"].probabilities == pytest.approx(local.choices["team"].probabilities, abs=1e-4)
        assert answer.scores["anger"].score == pytest.approx(local.scores["anger"].score, abs=1e-4)
        assert answer.request_id
    models = httpx.get(f"{real_url}/v1/models").json()["models"]
    assert [m["name"] for m in models] == [engine.model, "jev-latest"]


@pytest.mark.parametrize(
    ("body", "loc", "kind"),
    [
        (b'{"model": "jev-latest", "state": "x", "questions": {', ["body"], "json_invalid"),
        ({"model": "jev-latest", "questions": {"q": NOUL}}, ["body", "state"], "missing"),
        ({"model": "jev-latest", "state": "x", "questions": {}}, ["body", "questions"], "too_short"),
        ({"model": "jev-latest", "state": None, "questions": {"q": NOUL}}, ["body", "state", "str"], "string_type"),
        (
            {"model": "jev-latest", "state": "x", "questions": {"s": {"type": "score", "instructions": "?", "criteria": {"0": "a"}}}},
            ["body", "questions", "s", "score", "criteria"],
            "list_type",
        ),
        (
            {"model": "jev-latest", "state": "x", "questions": {"s": {"type": "score", "instructions": "?", "criteria": ["a", None]}}},
            ["body", "questions", "s", "criteria", "1"],
            "value_error",
        ),
        (
            {"model": "jev-latest", "state": "x", "questions": {"where": {"type": "box", "instructions": "Find it"}}},
            ["body", "questions", "where", "type"],
            "unsupported_question",
        ),
    ],
)
def test_bad_requests_get_422_with_detail(keyed_url: str, body: Any, loc: list[str], kind: str) -> None:
    response = _post(keyed_url, body)
    assert response.status_code == 422
    detail = response.json()["detail"]
    assert {"loc": loc, "type": kind} == {"loc": detail[0]["loc"], "type": detail[0]["type"]}
    assert detail[0]["msg"]


def test_auth_size_and_model_errors_have_the_error_shape(keyed_url: str) -> None:
    ok = {"model": "jev-latest", "state": TICKET, "questions": {"q": NOUL}}
    missing = httpx.post(f"{keyed_url}/v1/systemone", json=ok)
    wrong = _post(keyed_url, ok, {"Authorization": "Bearer nope"})
    too_large = _post(keyed_url, {**ok, "state": "x" * 20_000})
    unknown = _post(keyed_url, {**ok, "model": "no-such-model"})
    expected = [(missing, 401, "authentication_error"), (wrong, 401, "authentication_error"),
                (too_large, 413, "request_too_large"), (unknown, 404, "not_found")]
    for response, status, error_type in expected:
        assert response.status_code == status
        assert response.json()["detail"]["error_type"] == error_type
    assert httpx.get(f"{keyed_url}/healthz").json()["status"] == "ok"
    assert httpx.get(f"{keyed_url}/v1/models").status_code == 401


def test_metrics_count_requests_and_batches(keyed_url: str) -> None:
    _post(keyed_url, {"model": "jev-latest", "state": TICKET, "questions": {"q": NOUL}})
    text = httpx.get(f"{keyed_url}/metrics", headers=AUTH).text
    assert 'clef_guard_http_requests_total{route="/v1/systemone",status="200"}' in text
    assert "clef_guard_engine_batch_size_count" in text


def test_engine_failure_is_a_json_5xx() -> None:
    with serving(create_app(ScriptedDecisionModel(fail=True))) as url:
        response = httpx.post(f"{url}/v1/systemone", json={"model": "scripted", "state": "x", "questions": {"q": NOUL}})
    assert response.status_code == 500
    assert response.json()["detail"] == {"error_type": "engine_error", "message": "the engine failed: RuntimeError: scripted engine failure"}


@pytest.mark.parametrize(("window_ms", "max_batch"), [(300.0, 8), (0.0, 1)])
def test_concurrent_requests_share_engine_batches(window_ms: float, max_batch: int) -> None:
    engine = RecordingModel()
    questions = {"q": NOUL}

    async def clients(url: str) -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as client:
            body = {"model": "scripted", "questions": questions}
            return await asyncio.gather(
                *(client.post(f"{url}/v1/systemone", json={**body, "state": f"ticket {i}"}) for i in range(8))
            )

    with serving(create_app(engine, batch_window_ms=window_ms, max_batch=max_batch)) as url:
        responses = asyncio.run(clients(url))
    assert [r.status_code for r in responses] == [200] * 8
    assert sum(engine.batch_sizes) == 8 and max(engine.batch_sizes) <= max_batch
    if max_batch > 1:
        assert len(engine.batch_sizes) < 8


SECRET = "4111-1111-1111-1111"


@pytest.mark.parametrize(
    ("state", "loc"),
    [
        ([{"role": "user", "content": {"card": SECRET}}], ["body", "state[0]"]),
        ([{"role": "assistant", "content": SECRET, "tool_calls": [{"bad": SECRET}]}], ["body", "state[0]"]),
    ],
)
def test_a_malformed_message_is_the_requests_fault_and_never_echoed(real_url: str, state: Any, loc: list[str]) -> None:
    """Such states got 500 engine_error with pydantic's input_value (the sent values) in the message."""
    response = httpx.post(f"{real_url}/v1/systemone", json={"model": "jev-latest", "state": state, "questions": {"q": NOUL}}, timeout=60)
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == loc
    assert SECRET not in response.text and "input_value" not in response.text


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "jev-latest", "state": {"amount": NaN}, "questions": {"q": {"type": "noul", "instructions": "?"}}}',
        b'{"model": "jev-latest", "state": [Infinity], "questions": {"q": {"type": "noul", "instructions": "?"}}}',
        b'{"model": "jev-latest", "state": "x", "questions": {"\\u0000": {"type": "noul", "instructions": "?"}}}',
    ],
)
def test_non_finite_numbers_and_control_character_ids_get_422(keyed_url: str, body: bytes) -> None:
    assert _post(keyed_url, body).status_code == 422


def test_a_request_past_its_deadline_gets_504() -> None:
    with serving(create_app(ScriptedDecisionModel(delay_s=2.0), request_timeout_s=0.2)) as url:
        response = httpx.post(f"{url}/v1/systemone", json={"model": "jev-latest", "state": "x", "questions": {"q": NOUL}}, timeout=60)
    assert response.status_code == 504
    assert response.json()["detail"]["error_type"] == "timeout_error"
