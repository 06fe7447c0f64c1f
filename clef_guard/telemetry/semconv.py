"""Every telemetry name clef-guard emits, in one place.

The OpenTelemetry GenAI conventions cover the operation, tool and model attributes and
the evaluation event. The guardrail attributes follow the draft under review
(open-telemetry/semantic-conventions-genai#427: a ``run_guardrail`` span with
``gen_ai.security.*`` attributes); its prefix is still moving, so when it lands only
this module changes. Names under ``clef_guard.`` are our own.
"""

from __future__ import annotations

INSTRUMENTATION = "clef_guard"

SPAN_NAME = "run_guardrail {name}"
GUARDRAIL_NAME = "clef-guard"

# GenAI conventions (stable names)
OPERATION_NAME = "gen_ai.operation.name"
OPERATION_VALUE = "run_guardrail"
PROVIDER_NAME = "gen_ai.provider.name"
REQUEST_MODEL = "gen_ai.request.model"
TOOL_NAME = "gen_ai.tool.name"
TOOL_CALL_ID = "gen_ai.tool.call.id"
TOOL_CALL_ARGUMENTS = "gen_ai.tool.call.arguments"  # opt-in content
USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
USAGE_CACHE_READ_TOKENS = "gen_ai.usage.cache_read.input_tokens"  # included in USAGE_INPUT_TOKENS
ERROR_TYPE = "error.type"

EVALUATION_EVENT = "gen_ai.evaluation.result"
EVALUATION_NAME = "gen_ai.evaluation.name"
EVALUATION_SCORE_VALUE = "gen_ai.evaluation.score.value"
EVALUATION_SCORE_LABEL = "gen_ai.evaluation.score.label"
EVALUATION_EXPLANATION = "gen_ai.evaluation.explanation"

# Guardrail draft (semantic-conventions-genai#427)
GUARDRAIL_NAME_ATTR = "gen_ai.security.guardrail.name"
GUARDRAIL_VERSION = "gen_ai.security.guardrail.version"
TARGET_TYPE = "gen_ai.security.target.type"
VERDICT_TYPE = "gen_ai.security.verdict.type"
ACTION_TYPE = "gen_ai.security.action.type"
POLICY_ID = "gen_ai.security.policy.id"
POLICY_RULE_ID = "gen_ai.security.policy.rule.id"
RISK_SCORE = "gen_ai.security.risk.score"

TARGET_TYPES = {"before_tool": "tool_call", "after_tool": "tool_result", "route": "route"}
ACTION_TYPES = {"allow": "allow", "deny": "block", "confirm": "human_review", "escalate": "human_review"}
"""What the caller enforces for each verdict (integrations interrupt for confirm/escalate)."""

# clef-guard's own
POLICIES = "clef_guard.policies"
MESSAGE = "clef_guard.message"
THRESHOLDS = "clef_guard.thresholds"
CALIBRATED = "clef_guard.calibrated"
LEAST_FAMILIAR = "clef_guard.question.familiarity.min"  # the least familiar question any policy's head answered
ESCALATION_MODEL = "clef_guard.escalation.model"
FAIL_CLOSED_ACTION = "clef_guard.fail_closed.action"
LATENCY_MS = "clef_guard.latency_ms"
STATE = "clef_guard.state"  # opt-in content
TOOL_RESULT = "clef_guard.tool.result"  # opt-in content
EVALUATION_POLICY = "clef_guard.policy"
ENFORCED = "clef_guard.enforced"
RESULT_LABELS = "clef_guard.labels"
"""Labels the policies attached to the tool's result (names only, never the labeled text)."""
CALL_LABELS = "clef_guard.tool.labels"
"""Labels of earlier results whose text the call's arguments carry."""
THREAD_LABELS = "clef_guard.thread.labels"
"""Every label the thread carried when the check ran."""
"""Whether the verdict is what the caller enforced (``false``: a policy in shadow mode decided stricter)."""
ENFORCED_ACTION = "clef_guard.enforced.action"
POLICY_DECISION_EVENT = "clef_guard.policy.decision"
"""One event per policy that applied: its action, rule and whether it was enforced."""
DECISION_ACTION = "clef_guard.policy.action"
DECISION_RULE = "clef_guard.policy.rule"
DECISION_TRUSTED_READING = "clef_guard.policy.trusted_reading"  # true: the stricter reading left out earlier results and argument prose
DECISION_SPAN = "clef_guard.policy.result_span"  # [start, end) characters of the result window that decided

# Metrics
DECISIONS_COUNTER = "clef_guard.decisions"
DECISION_DURATION = "clef_guard.decision.duration"
METRIC_POLICY = "clef_guard.policy"
METRIC_VERDICT = "clef_guard.verdict"
METRIC_ENFORCED = "clef_guard.enforced"
RESULT_LABELS = "clef_guard.labels"
"""Labels the policies attached to the tool's result (names only, never the labeled text)."""
CALL_LABELS = "clef_guard.tool.labels"
"""Labels of earlier results whose text the call's arguments carry."""
THREAD_LABELS = "clef_guard.thread.labels"
"""Every label the thread carried when the check ran."""
