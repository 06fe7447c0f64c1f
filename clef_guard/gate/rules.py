"""Rules over answers: a policy's CEL conditions, applied in order; the first that holds decides."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from langchain_core.decisions import ChoiceAnswer, NoulAnswer, ScoreAnswer

from clef_guard.errors import EngineError
from clef_guard.gate.verdict import PolicyDecision
from clef_guard.policy.load import Policy


def evaluate_rules(
    policy: Policy,
    answers: Mapping[str, Any],
    call: Mapping[str, Any],
    context: Mapping[str, Any],
    *,
    calibrated: bool = False,
    escalated: bool = False,
) -> PolicyDecision:
    """Apply ``policy``'s rules in order to its answers: the first that holds decides.

    An answer that is not a usable probability (NaN, infinite, out of ``[0, 1]``) or a
    rule that cannot be evaluated gives the policy's ``on_error``: it never reads as allow.
    """
    unusable = next((f"answer {qid!r} {problem}" for qid, a in answers.items() if (problem := answer_problem(a))), None)
    if unusable is not None:
        return failed_decision(policy, f"the engine's {unusable}", answers=answers, calibrated=calibrated, escalated=escalated)
    variables = cel_variables(policy, answers, call, context)
    for rule in policy.rules:
        try:
            holds = rule.program.execute(variables)
        except Exception as exc:  # a rule that cannot be evaluated fails closed
            error = f"rule {rule.id!r} could not be evaluated: {exc}"
            return failed_decision(policy, error, rule=rule.id, answers=answers, calibrated=calibrated, escalated=escalated)
        if holds is True:
            return PolicyDecision(policy.name, rule.then, rule.id, rule.message, dict(answers), policy.thresholds, calibrated, None, escalated)
    return PolicyDecision(policy.name, policy.default, None, "", dict(answers), policy.thresholds, calibrated, None, escalated)


def failed_decision(
    policy: Policy,
    error: str,
    *,
    rule: str | None = None,
    answers: Mapping[str, Any] | None = None,
    calibrated: bool = False,
    escalated: bool = False,
) -> PolicyDecision:
    """``policy``'s ``on_error`` decision, with what went wrong."""
    return PolicyDecision(
        policy.name, policy.on_error, rule, f"guard failed closed: {error}", dict(answers or {}),
        policy.thresholds, calibrated, error, escalated,
    )


def answer_problem(answer: Any) -> str | None:
    """Why ``answer`` cannot be used in a rule (not an answer, or not finite probabilities), else ``None``."""
    if isinstance(answer, NoulAnswer):
        numbers = [answer.noul]
    elif isinstance(answer, (ChoiceAnswer, ScoreAnswer)):
        numbers = [*answer.probabilities.values(), answer.confidence]
    else:
        return f"is a {type(answer).__name__}, not a noul, choice or score answer"
    finite_score = not isinstance(answer, ScoreAnswer) or math.isfinite(answer.score)
    if finite_score and all(isinstance(x, (int, float)) and math.isfinite(x) and 0.0 <= x <= 1.0 for x in numbers):
        return None
    return "is not a probability (NaN, infinite or outside [0, 1])"


def rule_trace(
    policy: Policy, answers: Mapping[str, Any], call: Mapping[str, Any], context: Mapping[str, Any]
) -> list[tuple[str, bool | str]]:
    """Every rule's outcome (``True``, ``False`` or an error text), for explanations."""
    variables = cel_variables(policy, answers, call, context)
    trace: list[tuple[str, bool | str]] = []
    for rule in policy.rules:
        try:
            trace.append((rule.id, rule.program.execute(variables) is True))
        except Exception as exc:  # reported, not raised: this is a diagnostic view
            trace.append((rule.id, f"error: {exc}"))
    return trace


def cel_variables(
    policy: Policy, answers: Mapping[str, Any], call: Mapping[str, Any], context: Mapping[str, Any]
) -> dict[str, Any]:
    """The variables a rule's CEL condition sees."""
    return {
        "answers": {qid: cel_value(answer) for qid, answer in answers.items()},
        "thresholds": dict(policy.thresholds),
        "tool": dict(call),
        "context": dict(context),
    }


def cel_value(answer: Any) -> Any:
    """An answer as CEL sees it: a noul is its probability; others are maps."""
    if isinstance(answer, NoulAnswer):
        return answer.noul
    if isinstance(answer, ChoiceAnswer):
        return {"choice": answer.choice, "confidence": answer.confidence, "probabilities": dict(answer.probabilities)}
    if isinstance(answer, ScoreAnswer):
        return {
            "score": answer.score,
            "confidence": answer.confidence,
            "probabilities": {str(k): v for k, v in answer.probabilities.items()},
        }
    raise EngineError(f"cannot use a {type(answer).__name__} in a policy rule")
