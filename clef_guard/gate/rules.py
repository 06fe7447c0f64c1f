"""Rules over answers: a policy's CEL conditions, applied in order; the first that holds decides."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from langchain_core.decisions import ChoiceAnswer, NoulAnswer, ScoreAnswer

from clef_guard.engine.answers import build_answer
from clef_guard.engine.requests import ParsedQuestion, parse_questions
from clef_guard.errors import EngineError
from clef_guard.gate.trail import marks_of
from clef_guard.gate.verdict import PolicyDecision
from clef_guard.policy.load import EMPTY_FLOW, CompiledRule, Policy

PATTERN_TIMEOUT_S = 0.25
"""Longest a label pattern may search one result (a pathological pattern fails closed)."""
FORECAST_BUDGET = 256
"""Most rule evaluations :func:`relevant_questions` spends on a call (the shipped policies take at most 49);
past it the policy asks every question, so that a policy of many questions and rules costs no more
to forecast than a few milliseconds."""


def evaluate_rules(
    policy: Policy,
    answers: Mapping[str, Any],
    call: Mapping[str, Any],
    context: Mapping[str, Any],
    *,
    flow: Mapping[str, Any] = EMPTY_FLOW,
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
    index, failure = first_deciding(policy, cel_variables(policy, answers, call, context, flow))
    if failure is not None:  # a rule that cannot be evaluated fails closed
        rule = policy.rules[index]
        error = f"rule {rule.id!r} could not be evaluated: {failure}"
        return failed_decision(policy, error, rule=rule.id, answers=answers, calibrated=calibrated, escalated=escalated)
    if index < len(policy.rules):
        rule = policy.rules[index]
        return PolicyDecision(policy.name, rule.then, rule.id, rule.message, dict(answers), policy.thresholds, calibrated, None, escalated)
    return PolicyDecision(policy.name, policy.default, None, "", dict(answers), policy.thresholds, calibrated, None, escalated)


def first_deciding(policy: Policy, variables: Mapping[str, Any]) -> tuple[int, Exception | None]:
    """The index of the first rule that holds or fails (with its failure), or ``len(policy.rules)``."""
    for index, rule in enumerate(policy.rules):
        outcome = _holds(rule, variables)
        if outcome is not False:  # holds, or fails: reported by the caller
            return index, None if outcome is True else outcome
    return len(policy.rules), None


def _holds(rule: CompiledRule, variables: Mapping[str, Any]) -> bool | Exception:
    """Whether ``rule`` holds on ``variables``, or why it cannot be evaluated."""
    try:
        return rule.program_for(variables).execute(variables) is True
    except Exception as exc:
        return exc


def _reads_whole_map(policy: Policy) -> bool:
    """Whether a rule or label rule of ``policy`` reads the answers map as a whole (``has(answers.x)``,
    ``answers.size()``): then an unasked answer cannot be told from an absent one, so every question is asked."""
    return any(rule.reads is None for rule in policy.rules) or any(label.reads_answers for label in policy.labels)


def next_questions(
    policy: Policy,
    answers: Mapping[str, Any],
    call: Mapping[str, Any],
    context: Mapping[str, Any],
    flow: Mapping[str, Any] = EMPTY_FLOW,
    *,
    at_once: bool = False,
    relevant: tuple[str, ...] | None = None,
) -> tuple[str, ...]:
    """The questions to ask next so that ``policy``'s rules can decide on ``answers`` (those so far).

    The rules run in order with the unasked questions missing. A missing answer fails a
    rule, unless CEL's ``&&``, ``||`` and ``?:`` make it irrelevant (``false && x`` is false
    whatever ``x`` is): so a rule that evaluates now evaluates the same once every question
    is answered, and ``evaluate_rules`` on ``answers`` decides exactly what it would on all
    of them. The first rule that cannot evaluate yet says what to ask: before any answer,
    the first unasked question it reads (in the policy's order); after, every unasked
    question it and the later rules read. ``()``: the rules decide (or fail closed) on what
    is known. A rule or label rule that reads the answers map as a whole needs every answer.
    ``at_once``: every unasked question the first rule that cannot evaluate and the later ones
    read, even before any answer. ``relevant``: of those, only the ones in it
    (:func:`relevant_questions`) while any is; the rest once no other is left.
    """
    unasked = [qid for qid in policy.questions if qid not in answers]
    if not unasked or any(answer_problem(answer) for answer in answers.values()):
        return ()
    if _reads_whole_map(policy):
        return tuple(unasked)
    reads = [rule.reads for rule in policy.rules]
    index, failure = first_deciding(policy, cel_variables(policy, answers, call, context, flow))
    if failure is None:  # a rule holds, or none does: decided
        return ()
    # a missing answer, or a failure evaluate_rules reports once nothing it reads is missing
    first = not answers and not at_once
    read_now = set(reads[index] or ()) if first else {qid for read in reads[index:] for qid in read or ()}
    wanted = [qid for qid in unasked if qid in read_now]
    if relevant is not None:
        wanted = [qid for qid in wanted if qid in relevant] or wanted
    return tuple(wanted[:1] if first else wanted)


def relevant_questions(
    policy: Policy,
    call: Mapping[str, Any],
    context: Mapping[str, Any],
    flow: Mapping[str, Any] = EMPTY_FLOW,
) -> tuple[str, ...]:
    """The questions whose answers can change ``policy``'s decision on this call, in the policy's order.

    A question is left out when the call's facts leave no rule a use for it: on a call that
    ``facts.known_destructive`` flags, ``known_destructive || answers.destructive >= t`` holds
    whatever ``destructive`` says. It is tried at every corner of the answers (each yes/no at 0
    and 1, each score at its lowest and highest level, each choice at each of its labels): left
    out when, at every corner, the rules evaluate without it whenever they do with it. This is a
    forecast, not what decides: an answer a rule turns out to need is asked in another round
    (:func:`next_questions`), so the verdict is the one all the answers give. A forecast that
    would take more than :data:`FORECAST_BUDGET` rule evaluations, or a rule that reads the
    answers map as a whole, keeps every question.
    """
    qids = tuple(policy.questions)
    if not qids or _reads_whole_map(policy):
        return qids
    parsed = parse_questions(policy.questions)
    choices = [[cel_value(build_answer(q, [float(i == k) for i in range(len(q.options))])) for k in _corner_options(q)] for q in parsed]
    if math.prod(len(values) for values in choices) > FORECAST_BUDGET:
        return qids
    base = cel_variables(policy, {}, call, context, flow)
    settled = {i: _holds(rule, base) for i, rule in enumerate(policy.rules) if not rule.reads}  # the same at every corner
    needed: set[str] = set()
    spent = len(settled)
    for corner in itertools.product(*choices):
        answers = dict(zip(qids, corner, strict=True))
        for i, rule in enumerate(policy.rules):  # the rules as they run with every answer, up to the one that decides
            for qid in [qid for qid in rule.reads or () if qid not in needed]:  # does the rule evaluate without it?
                spent += 1
                if isinstance(_holds(rule, {**base, "answers": {k: v for k, v in answers.items() if k != qid}}), Exception):
                    needed.add(qid)
            spent += i not in settled
            outcome = settled[i] if i in settled else _holds(rule, {**base, "answers": answers})
            if outcome is not False:  # it holds, or fails with every answer (not for want of any one)
                break
        if spent > FORECAST_BUDGET:
            return qids
    return tuple(qid for qid in qids if qid in needed)


def _corner_options(question: ParsedQuestion) -> range | tuple[int, ...]:
    """The options a corner gives ``question`` all its probability: a score's extremes, else every option."""
    last = len(question.options) - 1
    return (0, last) if question.kind == "score" else range(last + 1)


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
    policy: Policy,
    answers: Mapping[str, Any],
    call: Mapping[str, Any],
    context: Mapping[str, Any],
    flow: Mapping[str, Any] = EMPTY_FLOW,
) -> list[tuple[str, bool | str]]:
    """Every rule's outcome (``True``, ``False`` or an error text), for explanations."""
    variables = cel_variables(policy, answers, call, context, flow)
    trace: list[tuple[str, bool | str]] = []
    for rule in policy.rules:  # a failure is reported, not raised: this is a diagnostic view
        outcome = _holds(rule, variables)
        trace.append((rule.id, f"error: {outcome}" if isinstance(outcome, Exception) else outcome))
    return trace


def cel_variables(
    policy: Policy,
    answers: Mapping[str, Any],
    call: Mapping[str, Any],
    context: Mapping[str, Any],
    flow: Mapping[str, Any] = EMPTY_FLOW,
) -> dict[str, Any]:
    """The variables a rule's CEL condition sees, with the call's facts where the policy has any
    and they evaluate (:meth:`Policy.fact_values`)."""
    variables = {
        "answers": {qid: cel_value(answer) for qid, answer in answers.items()},
        "thresholds": dict(policy.thresholds),
        "tool": dict(call),
        "context": dict(context),
        "history": list(flow["history"]),
        "labels": list(flow["labels"]),
    }
    facts = policy.fact_values(variables)
    return variables if facts is None else {**variables, "facts": facts}


@dataclass(frozen=True)
class Labeling:
    """The labels a policy's label rules attach to one tool result."""

    labels: tuple[str, ...] = ()
    marks: tuple[str, ...] = ()
    """Provenance marks of the labeled text (:func:`clef_guard.gate.trail.marks_of`)."""
    error: str | None = None
    """A rule that could not be read attaches its label (the stricter reading) and says why here."""


def label_result(
    policy: Policy,
    answers: Mapping[str, Any] | None,
    call: Mapping[str, Any],
    context: Mapping[str, Any],
    flow: Mapping[str, Any] = EMPTY_FLOW,
    *,
    failed: bool = False,
) -> Labeling:
    """Apply ``policy``'s label rules to ``call["result"]``.

    ``answers`` is ``None`` when the policy was not asked about this result: rules that read
    answers are skipped. ``failed``: it was asked and has no usable answers, so those rules
    attach their labels unread (the stricter reading).
    """
    text = str(call.get("result") or "")
    variables = cel_variables(policy, answers or {}, call, context, flow)
    labels: list[str] = []
    marks: list[str] = []
    errors: list[str] = []
    for rule in policy.labels:
        if not rule.reads(call["name"]) or (rule.reads_answers and answers is None):
            continue
        if rule.reads_answers and failed:
            errors.append(f"label rule {rule.label!r} attached without the engine's answers")
            labels.append(rule.label)
            continue
        try:
            if rule.program is not None and rule.program.execute(variables) is not True:
                continue
            spans = None
            if rule.pattern is not None:
                group = "mark" if "mark" in rule.pattern.groupindex else 0
                spans = [m.group(group) or m.group(0) for m in rule.pattern.finditer(text, timeout=PATTERN_TIMEOUT_S)]
                if not spans:
                    continue
        except Exception as exc:  # an unreadable rule attaches its label: stricter, never looser
            errors.append(f"label rule {rule.label!r} could not be evaluated: {type(exc).__name__}: {exc}")
            labels.append(rule.label)
            continue
        labels.append(rule.label)
        marks += marks_of(text, spans)
    return Labeling(tuple(sorted(set(labels))), tuple(dict.fromkeys(marks)), "; ".join(errors) or None)


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
