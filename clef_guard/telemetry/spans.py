"""Audit: every gate decision becomes one OpenTelemetry span, with metrics beside it.

The span is a child of whatever span is current when the check starts, so it nests
under an instrumented agent or graph. It carries the verdict, the deciding policy and
rule, the thresholds, the engine, latency and tokens, and one ``gen_ai.evaluation.result``
event per answer. Tool arguments, tool results and the state are left out unless
``capture_content=True``; then they are cut to ``max_content_chars`` after ``redact``.
Without it, the texts of a failed check are scrubbed too: any string of six or more
characters from the tool call or the state (its values, not its keys or roles), and
pydantic's ``input_value=``, read ``[not recorded]``, so an exception that repeats what it
was given cannot carry it into the audit trail.
All names live in :mod:`clef_guard.telemetry.semconv`.
"""

from __future__ import annotations

import json
import re
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from langchain_core.messages import BaseMessage
from opentelemetry import metrics, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from clef_guard.engine.state import content_text, to_json
from clef_guard.telemetry import semconv as sc

if TYPE_CHECKING:
    from clef_guard.gate.verdict import Verdict

try:
    _VERSION = version("clef-guard")
except PackageNotFoundError:  # running from a source tree
    _VERSION = "0"


@dataclass
class Telemetry:
    """Where and how decisions are recorded.

    Parameters
    ----------
    tracer_provider, meter_provider
        OpenTelemetry providers; the global ones when omitted (no-ops until the
        application configures the SDK, e.g. with the standard ``OTEL_*`` variables).
    capture_content
        Put tool arguments, tool results and the state in spans (off by default).
    max_content_chars
        Longest captured content; longer text is cut and marked.
    redact
        Applied to every captured text before it is cut (mask emails, keys, ...).
    """

    tracer_provider: Any = None
    meter_provider: Any = None
    capture_content: bool = False
    max_content_chars: int = 2000
    redact: Callable[[str], str] | None = None
    _tracer: Any = field(init=False, repr=False)
    _decisions: Any = field(init=False, repr=False)
    _duration: Any = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._tracer = trace.get_tracer(sc.INSTRUMENTATION, _VERSION, tracer_provider=self.tracer_provider)
        meter = metrics.get_meter(sc.INSTRUMENTATION, _VERSION, meter_provider=self.meter_provider)
        self._decisions = meter.create_counter(sc.DECISIONS_COUNTER, unit="{decision}", description="Gate decisions")
        self._duration = meter.create_histogram(sc.DECISION_DURATION, unit="ms", description="Gate decision latency")

    def record(self, verdict: Verdict, *, start_ns: int, state: Any, errors: Sequence[BaseException]) -> None:
        """Emit the span (and metrics) of one decision that started at ``start_ns``."""
        failed = bool(errors or verdict.error)  # only a failure's texts can hold content: scrub those alone
        scrub = _scrubber(verdict.tool_call, state) if failed and not self.capture_content else _no_change
        span = self._tracer.start_span(
            sc.SPAN_NAME.format(name=sc.GUARDRAIL_NAME),
            kind=SpanKind.INTERNAL,
            start_time=start_ns,
            attributes=self._attributes(verdict, state, scrub),
        )
        for decision in verdict.decisions:
            for qid, answer in decision.answers.items():
                span.add_event(sc.EVALUATION_EVENT, _evaluation(decision.policy, qid, answer))
            outcome: dict[str, Any] = {sc.EVALUATION_POLICY: decision.policy, sc.DECISION_ACTION: decision.action, sc.ENFORCED: decision.enforced}
            if decision.rule:
                outcome[sc.DECISION_RULE] = decision.rule
            if decision.span:
                outcome[sc.DECISION_SPAN] = list(decision.span)
            if decision.trusted_reading:
                outcome[sc.DECISION_TRUSTED_READING] = True
            span.add_event(sc.POLICY_DECISION_EVENT, outcome)
        if failed:
            span.set_status(Status(StatusCode.ERROR, scrub(verdict.error or "guard error")))
            span.set_attribute(sc.ERROR_TYPE, type(errors[0]).__name__ if errors else "GuardError")
            span.set_attribute(sc.FAIL_CLOSED_ACTION, verdict.action)
            for error in {id(e): e for e in errors}.values():  # a batch failure is shared by its requests
                span.add_event(
                    "exception",
                    {
                        "exception.type": type(error).__name__,
                        "exception.message": scrub(str(error)),
                        "exception.stacktrace": scrub("".join(traceback.format_exception(error))),
                        "exception.escaped": False,
                    },
                )
        span.end(end_time=start_ns + int(verdict.latency_ms * 1e6) if verdict.latency_ms else time.time_ns())
        decided = verdict.shadowed or verdict
        labels = {sc.METRIC_POLICY: decided.policy or "none", sc.METRIC_VERDICT: decided.action, sc.METRIC_ENFORCED: verdict.enforced}
        self._decisions.add(1, labels)
        self._duration.record(verdict.latency_ms, labels)

    def _attributes(self, verdict: Verdict, state: Any, scrub: Callable[[str], str]) -> dict[str, Any]:
        call = verdict.tool_call
        decided = verdict.shadowed or verdict  # what the guard decided; verdict.action is what the caller enforces
        deciding = next((d for d in verdict.decisions if d.policy == decided.policy), None)
        attributes: dict[str, Any] = {
            sc.OPERATION_NAME: sc.OPERATION_VALUE,
            sc.PROVIDER_NAME: sc.INSTRUMENTATION,
            sc.GUARDRAIL_NAME_ATTR: sc.GUARDRAIL_NAME,
            sc.GUARDRAIL_VERSION: _VERSION,
            sc.TARGET_TYPE: sc.TARGET_TYPES.get(verdict.phase, verdict.phase),
            sc.TOOL_NAME: call["name"],
            sc.TOOL_CALL_ID: call.get("id", ""),
            sc.VERDICT_TYPE: decided.action,
            sc.ACTION_TYPE: sc.ACTION_TYPES[verdict.action],
            sc.ENFORCED: verdict.enforced,
            sc.ENFORCED_ACTION: verdict.action,
            sc.POLICIES: [d.policy for d in verdict.decisions],
            sc.LATENCY_MS: verdict.latency_ms,
            sc.USAGE_INPUT_TOKENS: verdict.input_tokens,
            sc.USAGE_CACHE_READ_TOKENS: verdict.cached_tokens,
            sc.CALIBRATED: any(d.calibrated for d in verdict.decisions),
        }
        optional = {
            sc.REQUEST_MODEL: verdict.engine,
            sc.ESCALATION_MODEL: verdict.escalation_engine,
            sc.POLICY_ID: decided.policy,
            sc.POLICY_RULE_ID: decided.rule,
            sc.MESSAGE: scrub(decided.message) or None,
            sc.RISK_SCORE: _risk(deciding.answers) if deciding else None,
            sc.THRESHOLDS: json.dumps(verdict.thresholds, sort_keys=True) if verdict.decisions else None,
            sc.RESULT_LABELS: list(verdict.labels) or None,
            sc.CALL_LABELS: list(call.get("labels") or ()) or None,
            sc.THREAD_LABELS: list(verdict.thread_labels) or None,
            sc.LEAST_FAMILIAR: min((f for known in verdict.familiarity.values() for f in known.values()), default=None),
        }
        attributes.update({k: v for k, v in optional.items() if v is not None})
        if self.capture_content:
            attributes[sc.TOOL_CALL_ARGUMENTS] = self._content(to_json(call["args"]))
            if state is not None:
                attributes[sc.STATE] = self._content(to_json(state))
            if call.get("result") is not None:
                attributes[sc.TOOL_RESULT] = self._content(str(call["result"]))
        return attributes

    def _content(self, text: str) -> str:
        if self.redact is not None:
            text = self.redact(text)
        if len(text) > self.max_content_chars:
            return text[: self.max_content_chars] + f"...[{len(text) - self.max_content_chars} chars cut]"
        return text


_NOT_RECORDED = "[not recorded]"
_PYDANTIC_INPUT = re.compile(r"input_value=.*?(?=, input_type=|\]$)", re.S | re.M)
_SHORTEST_SCRUBBED = 6


def _no_change(text: str) -> str:
    return text


def _scrubber(call: Mapping[str, Any], state: Any) -> Callable[[str], str]:
    """Removes from a text every string the tool call or the state holds (longest first)."""
    found = {text for text in _strings([call.get("args"), call.get("result"), state]) if len(text) >= _SHORTEST_SCRUBBED}
    held = sorted(found, key=len, reverse=True)

    def scrub(text: str) -> str:
        text = _PYDANTIC_INPUT.sub("input_value=" + _NOT_RECORDED, text)
        for value in held:
            text = text.replace(value, _NOT_RECORDED)
        return text

    return scrub


def _strings(value: Any) -> Iterator[str]:
    """Every string value inside ``value`` (message contents and tool-call arguments too; not keys or roles)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, BaseMessage):
            yield content_text(item.content)
            stack.extend(call.get("args", {}) for call in getattr(item, "tool_calls", None) or [])
        elif isinstance(item, Mapping):
            stack.extend(v for k, v in item.items() if k != "role")
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif item is not None and not isinstance(item, (bool, int, float)):
            yield str(item)


def _evaluation(policy: str, qid: str, answer: Any) -> dict[str, Any]:
    """The ``gen_ai.evaluation.result`` attributes of one answer."""
    if answer.type == "noul":
        value, label = answer.noul, "yes" if answer.noul >= 0.5 else "no"
    elif answer.type == "choice":
        value, label = answer.confidence, answer.choice
    else:
        value, label = answer.score, str(round(answer.score))
    return {
        sc.EVALUATION_NAME: f"{policy}.{qid}",
        sc.EVALUATION_SCORE_VALUE: float(value),
        sc.EVALUATION_SCORE_LABEL: label,
        sc.EVALUATION_POLICY: policy,
    }


def _risk(answers: dict[str, Any]) -> float | None:
    """The deciding policy's risk score: its highest probability of yes, if it asked a noul."""
    nouls = [a.noul for a in answers.values() if a.type == "noul"]
    return max(nouls) if nouls else None
