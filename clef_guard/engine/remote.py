"""``RemoteDecisionModel``: a decision model on the other side of System One over HTTP.

It speaks ``POST /v1/systemone`` (the request and answer schema of
``langchain_core.decisions``) to ``clef-guard serve``, to TypeSafe's Jev and
Jev-compatible servers, and to Cloudflare's Clef through the Workers AI REST route.

Every answer is checked against the questions asked before it is returned: one answer
per question id, of the question's type, with probabilities for exactly the options
asked that sum to 1, a ``choice`` that is the most probable option and a ``score`` that
is the expectation of its levels. An answer that fails is raised as
:class:`~clef_guard.RemoteEngineError`, never passed on as a decision.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping, Sequence
from typing import Any
from weakref import WeakKeyDictionary

import httpx
from langchain_core.decisions import (
    BaseDecisionModel,
    Choice,
    ClassifierResponse,
    Question,
    Score,
    State,
)
from langchain_core.messages import BaseMessage, convert_to_openai_messages
from pydantic import Field, PrivateAttr, SecretStr, TypeAdapter, ValidationError

from clef_guard.errors import (
    ClefGuardError,
    EngineTimeoutError,
    RemoteEngineError,
    RequestError,
)

# How far probabilities may sum from 1, and a score from their expectation (jevcompat
# SPEC §5): answers rounded to four decimals, as Clef's are, stay well inside it.
_TOLERANCE = 0.05
_ARGMAX_TOLERANCE = 0.005
_RETRYABLE_ERRORS = (httpx.NetworkError, httpx.ConnectTimeout, httpx.RemoteProtocolError)
_REQUEST_ID_HEADERS = ("x-request-id", "cf-ai-req-id", "x-typesafe-request-id", "cf-ray")
_QUESTIONS: TypeAdapter[dict[str, Question]] = TypeAdapter(dict[str, Question])


class RemoteDecisionModel(BaseDecisionModel):
    """A ``BaseDecisionModel`` answered by a System One server over HTTP.

    Sync and async calls share the same rules: ``timeout_s`` per HTTP operation; 429,
    5xx and connection failures retried up to ``max_retries`` times, waiting
    ``backoff_s * 2**attempt`` seconds (or the server's ``Retry-After``) capped at
    ``max_backoff_s``; any other 4xx raised at once. A 400, 413 or 422 raises
    :class:`~clef_guard.RequestError` (the request is at fault), anything else that
    fails :class:`~clef_guard.RemoteEngineError`, a timeout
    :class:`~clef_guard.EngineTimeoutError`. LangChain messages in the state travel as
    OpenAI-format message objects.

    Examples
    --------
    ``clef-guard serve`` or any Jev-compatible server (``model`` is what its
    ``GET /v1/models`` lists, or ``"jev-latest"``)::

        engine = RemoteDecisionModel("http://127.0.0.1:8000", "smollm2-135m-instruct")

    A stronger hosted model as the escalation tier, asked only when the local engine
    is unsure::

        guard = Guard(policies, engine=LocalDecisionModel(),
                      escalation=RemoteDecisionModel("https://api.typesafe.ai", "jev-latest", api_key=key))

    Cloudflare's Clef (``clef`` or ``clef-flash``) through the Workers AI REST route,
    ``POST https://api.cloudflare.com/client/v4/accounts/{account_id}/ai/run/@cf/cloudflare/{model}``
    with an API token that has Workers AI permission. Workers AI wraps the answer in
    ``{"result", "success", "errors", "messages"}``, which is unwrapped here. This form
    is as third-party integrations document it; it has not been tried against a live
    account from this project::

        clef = RemoteDecisionModel(
            f"https://api.cloudflare.com/client/v4/accounts/{account_id}/ai",
            "clef",
            api_key=cloudflare_api_token,
            endpoint="/run/@cf/cloudflare/clef",
        )
    """

    base_url: str
    """Server root, e.g. ``http://127.0.0.1:8000``; ``endpoint`` is appended to it."""
    model: str
    """Model name sent in every request."""
    api_key: SecretStr | None = None
    """Sent as ``Authorization: Bearer <api_key>``."""
    endpoint: str = "/v1/systemone"
    """The System One route under ``base_url``."""
    timeout_s: float = Field(default=30.0, gt=0)
    """Seconds allowed for each HTTP operation (connect, send, read)."""
    max_retries: int = Field(default=2, ge=0)
    """Retries after a 429, a 5xx or a connection failure."""
    backoff_s: float = Field(default=0.5, ge=0)
    """Wait before the first retry; doubled for each one after."""
    max_backoff_s: float = Field(default=8.0, ge=0)
    """Longest wait between two attempts, ``Retry-After`` included."""

    _client: httpx.Client = PrivateAttr()
    _async_clients: WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient] = PrivateAttr(
        default_factory=WeakKeyDictionary
    )

    def __init__(self, base_url: str, model: str, **kwargs: Any) -> None:
        super().__init__(base_url=base_url, model=model, **kwargs)

    def model_post_init(self, context: Any, /) -> None:
        """Open the connection pool for sync calls (async ones get one per event loop)."""
        self._client = httpx.Client(timeout=self.timeout_s)

    @property
    def _provider(self) -> str:
        return "system_one"

    @property
    def url(self) -> str:
        """The route every request is sent to."""
        return self.base_url.rstrip("/") + self.endpoint

    def _classify(self, state: State, questions: dict[str, Question]) -> ClassifierResponse:
        asked, body, headers = self._prepare(state, questions)
        attempt = 0
        while True:
            try:
                response = self._client.post(self.url, content=body, headers=headers)
            except httpx.HTTPError as exc:
                time.sleep(self._retry_delay(attempt, error=exc))
            else:
                if response.is_success:
                    return _parse_answer(self.url, response, asked)
                time.sleep(self._retry_delay(attempt, response=response))
            attempt += 1

    async def _aclassify(self, state: State, questions: dict[str, Question]) -> ClassifierResponse:
        asked, body, headers = self._prepare(state, questions)
        client = self._async_client()
        attempt = 0
        while True:
            try:
                response = await client.post(self.url, content=body, headers=headers)
            except httpx.HTTPError as exc:
                await asyncio.sleep(self._retry_delay(attempt, error=exc))
            else:
                if response.is_success:
                    return _parse_answer(self.url, response, asked)
                await asyncio.sleep(self._retry_delay(attempt, response=response))
            attempt += 1

    def _async_client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if loop not in self._async_clients:
            self._async_clients[loop] = httpx.AsyncClient(timeout=self.timeout_s)
        return self._async_clients[loop]

    def _prepare(self, state: State, questions: Mapping[str, Any]) -> tuple[dict[str, Any], bytes, dict[str, str]]:
        """The validated questions, the JSON body and the headers of one request."""
        try:
            asked = _QUESTIONS.validate_python(dict(questions))
        except ValidationError as exc:
            first = exc.errors()[0]
            qid, *where = [str(part) for part in first["loc"]]  # a dict's errors start at its key
            raise RequestError(first["msg"], question=qid, field=".".join(where) or None) from None
        payload = {
            "model": self.model,
            "state": _wire_state(state),
            "questions": {qid: question.model_dump(mode="json") for qid, question in asked.items()},
        }
        try:
            body = json.dumps(payload, ensure_ascii=False, allow_nan=False).encode()
        except (TypeError, ValueError) as exc:
            raise RequestError(f"cannot be sent as JSON: {exc}", field="state") from None
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.api_key is not None:
            headers["Authorization"] = f"Bearer {self.api_key.get_secret_value()}"
        return asked, body, headers

    def _retry_delay(self, attempt: int, *, response: httpx.Response | None = None, error: Exception | None = None) -> float:
        """Seconds to wait before the next attempt; raises when there is none to make."""
        if response is not None:
            retryable = response.status_code == 429 or response.status_code >= 500
        else:
            retryable = isinstance(error, _RETRYABLE_ERRORS)
        if not retryable or attempt >= self.max_retries:
            raise self._failure(attempt + 1, response, error)
        hinted = _retry_after(response) if response is not None else None
        return min(self.max_backoff_s, self.backoff_s * 2**attempt if hinted is None else hinted)

    def _failure(self, attempts: int, response: httpx.Response | None, error: Exception | None) -> ClefGuardError:
        tries = f"after {attempts} attempt{'s' if attempts > 1 else ''}"
        if response is None:
            if isinstance(error, httpx.TimeoutException):
                return EngineTimeoutError(f"{self.url}: no answer within {self.timeout_s} s ({tries}); raise timeout_s")
            return RemoteEngineError(f"cannot reach the server {tries}: {type(error).__name__}: {error}", url=self.url)
        status = response.status_code
        message = _error_message(response)
        if status in (400, 413, 422):
            question, field = _error_location(response)
            return RequestError(f"{self.url} refused the request ({status}): {message}", question=question, field=field)
        if status in (401, 403):
            hint = "check api_key"
        elif status == 404:
            hint = "check base_url, endpoint and model"
        else:
            hint = tries
        return RemoteEngineError(f"answered {status}: {message} ({hint})", url=self.url, status=status)


def _wire_state(value: Any) -> Any:
    """The state as JSON values, LangChain messages as OpenAI-format message objects."""
    if isinstance(value, BaseMessage):
        return convert_to_openai_messages(value)
    if isinstance(value, Mapping):
        return {str(key): _wire_state(item) for key, item in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray)):
        return [_wire_state(item) for item in value]
    return value


def _retry_after(response: httpx.Response) -> float | None:
    for header, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        try:
            return max(0.0, float(response.headers[header]) * scale)
        except (KeyError, ValueError):  # absent, or an HTTP date: back off instead
            continue
    return None


def _json(content: bytes) -> Any:
    """Strict JSON: NaN and Infinity are refused, as JSON itself does."""

    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not a JSON value")

    return json.loads(content, parse_constant=refuse)


def _error_message(response: httpx.Response) -> str:
    """What an error body says: ``detail`` (either shape), Cloudflare's ``errors``, or its text."""
    try:
        body = _json(response.content)
    except ValueError:
        body = None
    detail = body.get("detail") if isinstance(body, dict) else None
    if isinstance(detail, dict) and "message" in detail:
        return str(detail["message"])
    if isinstance(detail, list) and detail:
        return "; ".join(f"{'.'.join(map(str, d.get('loc', [])))}: {d.get('msg')}" for d in detail if isinstance(d, dict))
    if isinstance(body, dict) and isinstance(body.get("errors"), list) and body["errors"]:
        return "; ".join(str(e.get("message", e)) if isinstance(e, dict) else str(e) for e in body["errors"])
    return response.text[:300] or response.reason_phrase


def _error_location(response: httpx.Response) -> tuple[str | None, str | None]:
    """Question id and field of the first validation error, from ``detail[0].loc``."""
    try:
        loc = [str(part) for part in _json(response.content)["detail"][0]["loc"]]
    except (ValueError, TypeError, KeyError, IndexError):
        return None, None
    if loc[:1] == ["body"]:
        loc = loc[1:]
    if loc[:1] == ["questions"] and len(loc) > 1:
        return loc[1], ".".join(loc[2:]) or None
    return None, ".".join(loc) or None


def _parse_answer(url: str, response: httpx.Response, asked: dict[str, Any]) -> ClassifierResponse:
    """The response, checked against the questions asked; raises when it is not an answer to them."""

    def malformed(problem: str) -> RemoteEngineError:
        return RemoteEngineError(
            f"the answer is not a System One response to this request: {problem}", url=url, status=response.status_code
        )

    try:
        body = _json(response.content)
    except ValueError as exc:
        raise malformed(f"not JSON ({exc}); the body starts {response.text[:80]!r}") from None
    if isinstance(body, dict) and {"result", "success"} <= body.keys():  # Workers AI's envelope
        if body["success"] is not True:
            raise RemoteEngineError(f"the call did not succeed: {_error_message(response)}", url=url, status=response.status_code)
        body = body["result"]
    try:
        parsed = ClassifierResponse.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise malformed(f"{'.'.join(map(str, first['loc'])) or 'body'}: {first['msg']}") from None
    problems = _answer_problems(asked, parsed)
    if problems:
        raise malformed("; ".join(problems[:3]) + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""))
    if parsed.request_id is None:
        parsed.request_id = next((response.headers[h] for h in _REQUEST_ID_HEADERS if h in response.headers), None)
    return parsed


def _answer_problems(asked: dict[str, Any], response: ClassifierResponse) -> list[str]:
    """Everything in ``response`` that does not answer ``asked`` as System One defines it."""
    answers = response.answers
    problems = [f"no answer for question {qid!r}" for qid in asked if qid not in answers]
    problems += [f"an answer for {qid!r}, which was not asked" for qid in answers if qid not in asked]
    for qid, question in asked.items():
        answer = answers.get(qid)
        if answer is None:
            continue
        if answer.type != question.type:
            problems.append(f"answer {qid!r} is a {answer.type}, the question a {question.type}")
        elif isinstance(question, Choice):
            problems += _distribution_problems(qid, list(question.criteria), answer.probabilities)
            top = max(answer.probabilities.values(), default=0.0)
            if answer.choice not in question.criteria or answer.probabilities.get(answer.choice, -1.0) < top - _ARGMAX_TOLERANCE:
                problems.append(f"answer {qid!r} chose {answer.choice!r}, which is not the most probable option")
        elif isinstance(question, Score):
            levels = list(range(len(question.criteria)))
            problems += _distribution_problems(qid, levels, answer.probabilities)
            if sorted(answer.legend) != levels:
                problems.append(f"answer {qid!r} has legend levels {sorted(answer.legend)}, expected {levels}")
            expected = sum(level * p for level, p in answer.probabilities.items())
            if abs(answer.score - expected) > _TOLERANCE:
                problems.append(f"answer {qid!r} has score {answer.score}, its probabilities give {expected:.4f}")
    return problems


def _distribution_problems(qid: str, options: list[Any], probabilities: Mapping[Any, float]) -> list[str]:
    if set(probabilities) != set(options):
        return [f"answer {qid!r} gives probabilities for {sorted(probabilities, key=str)}, the options are {options}"]
    total = sum(probabilities.values())
    if any(not 0.0 <= p <= 1.0 for p in probabilities.values()) or abs(total - 1.0) > _TOLERANCE:
        return [f"answer {qid!r} has probabilities outside [0, 1] or summing to {total:.4f}, not 1"]
    return []
