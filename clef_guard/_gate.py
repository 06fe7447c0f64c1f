"""The gate: match policies, ask the engine once, apply the rules, combine the verdicts.

One check, in order:

1. every policy that applies to the call (tool glob, step, ``applies_to.when``, phase);
2. the questions of all of them, merged (identical questions asked once) into one
   engine request per distinct state view, under a timeout;
3. each policy's rules in order over its answers: the first that holds decides, else
   the policy's ``default``; an engine or rule failure gives the policy's ``on_error``;
4. the strictest action wins (deny > escalate > confirm > allow), every reason is kept;
5. ``escalate`` asks the same questions of the stronger engine when one is configured,
   then hands what is still unclear to a human reviewer when the integration has one,
   and denies otherwise.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypedDict, Unpack

import yaml
from langchain_core.decisions import BaseDecisionModel, ChoiceAnswer, ClassifierResponse, NoulAnswer, ScoreAnswer
from langchain_core.messages import BaseMessage

from clef_guard._errors import EngineError, EngineTimeoutError, PolicyError
from clef_guard._policy import SEVERITY, Policy
from clef_guard._state import _as_message
from clef_guard._telemetry import Telemetry

_log = logging.getLogger("clef_guard")
_EXECUTOR = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="clef-guard")


@dataclass(frozen=True)
class PolicyDecision:
    """What one policy decided, and from what."""

    policy: str
    action: str
    rule: str | None
    """The rule that held; ``None`` for the policy's default or its ``on_error``."""
    message: str
    answers: dict[str, Any]
    """This policy's answers (``langchain_core.decisions`` answers), by question id."""
    thresholds: dict[str, float]
    calibrated: bool
    error: str | None = None
    escalated: bool = False
    """Whether these answers came from the escalation engine."""


@dataclass(frozen=True)
class Verdict:
    """The gate's decision for one tool call (or route)."""

    action: str
    """``allow``, ``confirm``, ``escalate`` (to a human reviewer) or ``deny``."""
    policy: str | None
    rule: str | None
    message: str
    decisions: tuple[PolicyDecision, ...]
    tool_call: dict[str, Any]
    latency_ms: float
    engine: str | None
    escalation_engine: str | None = None
    error: str | None = None
    phase: str = "before_tool"
    """``before_tool`` (a proposed call), ``after_tool`` (its result) or ``route``."""
    input_tokens: int = 0
    """Tokens the engines read for this decision."""

    @property
    def allowed(self) -> bool:
        """Whether the tool may run without anyone's approval."""
        return self.action == "allow"

    @property
    def answers(self) -> dict[str, dict[str, Any]]:
        """Every answer, by policy then question id."""
        return {d.policy: d.answers for d in self.decisions}

    @property
    def thresholds(self) -> dict[str, dict[str, float]]:
        """The thresholds each policy used, after calibration."""
        return {d.policy: d.thresholds for d in self.decisions}

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready view (answers as plain dicts)."""
        data = asdict(self)
        data["decisions"] = [
            {**asdict(d), "answers": {k: a.model_dump() for k, a in d.answers.items()}} for d in self.decisions
        ]
        return data


class CheckOptions(TypedDict, total=False):
    """Keyword options of :meth:`Guard.check` and :meth:`Guard.acheck`."""

    phase: str
    """``before_tool`` (default), ``after_tool`` (with ``tool_result``) or ``route``."""
    step: str | None
    """The graph step or route name, matched against ``applies_to.steps``."""
    context: Mapping[str, Any]
    """Extra facts for CEL conditions (``context.<key>``); never shown to the engine."""
    tool_description: str | None
    """The tool's description, shown to the engine when a policy asks for it."""
    tool_result: Any
    """What the tool returned, for ``after_tool`` checks."""


@dataclass
class _Check:
    """One check in progress."""

    call: dict[str, Any]
    state: Any
    context: dict[str, Any]
    description: str | None
    policies: list[Policy]
    groups: list[_Group]
    start: float
    phase: str
    start_ns: int = field(default_factory=time.time_ns)
    errors: list[BaseException] = field(default_factory=list)
    input_tokens: int = 0


@dataclass
class _Group:
    """Policies sharing one state view, asked in one engine request."""

    state: dict[str, Any]
    questions: dict[str, Any] = field(default_factory=dict)
    """Engine question id -> question (identical questions share an id)."""
    ids: dict[tuple[str, str], str] = field(default_factory=dict)
    """(policy, question id) -> engine question id."""
    policies: list[Policy] = field(default_factory=list)


class Guard:
    """Checks tool calls against policies with a decision model.

    Parameters
    ----------
    policies
        Loaded policies (:func:`clef_guard.load_policies`).
    engine
        Any ``BaseDecisionModel``; the embedded ``LocalDecisionModel`` when omitted.
    escalation
        A stronger ``BaseDecisionModel`` asked when a rule says ``escalate``.
    human_review
        Whether a human can review escalations (integrations that can interrupt set it);
        without one, and without an answer from ``escalation``, escalations are denied.
    timeout_s
        Limit on each engine call; past it every waiting policy takes its ``on_error``.
    calibration
        A calibration file (or mapping) whose thresholds override the policies'.
    on_verdict
        Callables given every verdict as it is made (logging, UIs, tests); an error in
        one is logged and never changes the verdict.
    telemetry
        Where decisions are recorded as OpenTelemetry spans and metrics; the global
        providers, with no content captured, when omitted.
    """

    def __init__(
        self,
        policies: Sequence[Policy],
        *,
        engine: BaseDecisionModel | None = None,
        escalation: BaseDecisionModel | None = None,
        human_review: bool = False,
        timeout_s: float | None = 10.0,
        calibration: str | Path | Mapping[str, Any] | None = None,
        on_verdict: Sequence[Callable[[Verdict], None]] = (),
        telemetry: Telemetry | None = None,
    ) -> None:
        overrides = load_calibration(calibration) if calibration is not None else {}
        by_name = {p.name: p for p in policies}
        unknown = set(overrides) - set(by_name)
        if unknown:
            raise PolicyError(f"calibration names policies {sorted(unknown)} that are not loaded", field="policies")
        self.policies = [p.with_thresholds(overrides[p.name]) if p.name in overrides else p for p in policies]
        self._calibrated = set(overrides)
        self._engine = engine
        self.escalation = escalation
        self.human_review = human_review
        self.timeout_s = timeout_s
        self.on_verdict = list(on_verdict)
        self.telemetry = telemetry or Telemetry()

    @property
    def engine(self) -> BaseDecisionModel:
        """The decision model; the embedded engine is loaded on first use."""
        if self._engine is None:
            from clef_guard._engine import LocalDecisionModel

            self._engine = LocalDecisionModel()
        return self._engine

    def matching(self, tool_call: Mapping[str, Any], *, phase: str = "before_tool", step: str | None = None, context: Mapping[str, Any] | None = None) -> list[Policy]:
        """The policies that apply to ``tool_call`` at this phase and step."""
        return self._matching(_normalise_call(tool_call), phase, step, context or {})

    def _matching(self, call: dict[str, Any], phase: str, step: str | None, context: Mapping[str, Any]) -> list[Policy]:
        return [p for p in self.policies if p.matches(call["name"], phase=phase, step=step, context=context, tool=call)]

    def check(self, tool_call: Mapping[str, Any], state: Any = None, **options: Unpack[CheckOptions]) -> Verdict:
        """Decide whether ``tool_call`` (``{name, args, id}``) may run, given ``state``."""
        return self.check_many([tool_call], state, **options)[0]

    async def acheck(self, tool_call: Mapping[str, Any], state: Any = None, **options: Unpack[CheckOptions]) -> Verdict:
        """Async twin of :meth:`check`."""
        return (await self.acheck_many([tool_call], state, **options))[0]

    def check_many(
        self,
        tool_calls: Sequence[Mapping[str, Any]],
        state: Any = None,
        *,
        descriptions: Mapping[str, str] | None = None,
        **options: Unpack[CheckOptions],
    ) -> list[Verdict]:
        """Check calls proposed together (parallel tool calls) in one engine batch.

        ``descriptions`` maps tool names to their descriptions. The calls share the
        state, so a local engine's prefix cache serves all but the first.
        """
        runs = [self._begin(call, state, _with_description(options, call, descriptions)) for call in tool_calls]
        decisions = self._decide_runs(runs, self._ask(self.engine, [g for r in runs for g in r.groups]))
        again = [self._escalation_groups(r, d) for r, d in zip(runs, decisions, strict=True)]
        if any(again):
            replies = self._ask(self.escalation, [g for groups in again for g in groups])  # type: ignore[arg-type]
            decisions = self._merge_runs(runs, decisions, again, replies)
        return self._publish(runs, [self._verdict(r, d) for r, d in zip(runs, decisions, strict=True)])

    async def acheck_many(
        self,
        tool_calls: Sequence[Mapping[str, Any]],
        state: Any = None,
        *,
        descriptions: Mapping[str, str] | None = None,
        **options: Unpack[CheckOptions],
    ) -> list[Verdict]:
        """Async twin of :meth:`check_many`."""
        runs = [self._begin(call, state, _with_description(options, call, descriptions)) for call in tool_calls]
        decisions = self._decide_runs(runs, await self._aask(self.engine, [g for r in runs for g in r.groups]))
        again = [self._escalation_groups(r, d) for r, d in zip(runs, decisions, strict=True)]
        if any(again):
            replies = await self._aask(self.escalation, [g for groups in again for g in groups])  # type: ignore[arg-type]
            decisions = self._merge_runs(runs, decisions, again, replies)
        return self._publish(runs, [self._verdict(r, d) for r, d in zip(runs, decisions, strict=True)])

    def _decide_runs(self, runs: list[_Check], replies: list[ClassifierResponse | Exception]) -> list[list[PolicyDecision]]:
        """Split one batch of replies back to the checks that asked them."""
        decided, offset = [], 0
        for run in runs:
            decided.append(self._decide_all(run, run.groups, replies[offset : offset + len(run.groups)]))
            offset += len(run.groups)
        return decided

    def _merge_runs(
        self,
        runs: list[_Check],
        decisions: list[list[PolicyDecision]],
        again: list[list[_Group]],
        replies: list[ClassifierResponse | Exception],
    ) -> list[list[PolicyDecision]]:
        merged, offset = [], 0
        for run, first, groups in zip(runs, decisions, again, strict=True):
            second = self._decide_all(run, groups, replies[offset : offset + len(groups)], escalated=True)
            merged.append(_merge_escalated(first, second))
            offset += len(groups)
        return merged

    def _begin(self, tool_call: Mapping[str, Any], state: Any, options: CheckOptions) -> _Check:
        call = _normalise_call(tool_call, options.get("tool_result"))
        context = dict(options.get("context") or {})
        phase = options.get("phase", "before_tool")
        policies = self._matching(call, phase, options.get("step"), context)  # call keeps its result
        run = _Check(call, state, context, options.get("tool_description"), policies, [], time.perf_counter(), phase)
        run.groups.extend(self._groups(run, policies))
        return run

    def _groups(self, run: _Check, policies: list[Policy]) -> list[_Group]:
        """One engine request per distinct state view; identical questions asked once."""
        groups: dict[str, _Group] = {}
        for policy in policies:
            view_key = policy.state.model_dump_json()
            group = groups.get(view_key)
            if group is None:
                group = groups[view_key] = _Group(state=engine_state(policy, run.call, run.state, run.description))
            group.policies.append(policy)
            for qid, question in policy.questions.items():
                key = question.model_dump_json()
                shared = next((eid for eid, q in group.questions.items() if q.model_dump_json() == key), None)
                if shared is None:
                    shared = f"q{len(group.questions)}"
                    group.questions[shared] = question
                group.ids[(policy.name, qid)] = shared
        return list(groups.values())

    def _escalation_groups(self, run: _Check, decisions: list[PolicyDecision]) -> list[_Group]:
        """Requests for the escalation engine: the policies that said ``escalate``."""
        if self.escalation is None:
            return []
        escalating = {d.policy for d in decisions if d.action == "escalate"}
        return self._groups(run, [p for p in run.policies if p.name in escalating])

    def _ask(self, engine: BaseDecisionModel, groups: list[_Group]) -> list[ClassifierResponse | Exception]:
        """One engine batch for ``groups``; failures and the timeout come back as exceptions."""
        if not groups:
            return []
        requests = [{"state": g.state, "questions": g.questions} for g in groups]
        future = _EXECUTOR.submit(engine.batch, requests, return_exceptions=True)
        try:
            return list(future.result(timeout=self.timeout_s))
        except concurrent.futures.TimeoutError:
            future.cancel()
            return [EngineTimeoutError(f"the engine did not answer within {self.timeout_s} s")] * len(groups)
        except Exception as exc:  # any engine failure must fail closed, never propagate as allow
            return [exc] * len(groups)

    async def _aask(self, engine: BaseDecisionModel, groups: list[_Group]) -> list[ClassifierResponse | Exception]:
        """Async twin of :meth:`_ask`."""
        if not groups:
            return []
        requests = [{"state": g.state, "questions": g.questions} for g in groups]
        try:
            return list(await asyncio.wait_for(engine.abatch(requests, return_exceptions=True), timeout=self.timeout_s))
        except TimeoutError:
            return [EngineTimeoutError(f"the engine did not answer within {self.timeout_s} s")] * len(groups)
        except Exception as exc:  # any engine failure must fail closed
            return [exc] * len(groups)

    def _decide_all(
        self, run: _Check, groups: list[_Group], replies: list[ClassifierResponse | Exception], *, escalated: bool = False
    ) -> list[PolicyDecision]:
        """Each policy's decision from its group's reply; a failed reply fails closed."""
        decisions = []
        for group, reply in zip(groups, replies, strict=True):
            if isinstance(reply, Exception):
                run.errors.append(reply)
            elif reply.usage is not None:
                run.input_tokens += int(reply.usage.get("input_tokens") or 0)
            for policy in group.policies:
                calibrated = policy.name in self._calibrated
                answers = None
                if isinstance(reply, Exception):
                    error = _describe(reply)
                else:
                    missing = [qid for qid in policy.questions if group.ids[(policy.name, qid)] not in reply.answers]
                    error = f"the engine's response lacks questions {missing}" if missing else None
                    answers = {qid: reply.answers[group.ids[(policy.name, qid)]] for qid in policy.questions} if not missing else None
                if answers is None:
                    decisions.append(
                        PolicyDecision(policy.name, policy.on_error, None, f"guard failed closed: {error}", {},
                                       policy.thresholds, calibrated, error, escalated)
                    )
                else:
                    decisions.append(
                        evaluate_rules(policy, answers, run.call, run.context, calibrated=calibrated, escalated=escalated)
                    )
        return decisions

    def _publish(self, runs: list[_Check], verdicts: list[Verdict]) -> list[Verdict]:
        for run, verdict in zip(runs, verdicts, strict=True):
            try:
                self.telemetry.record(verdict, start_ns=run.start_ns, state=run.state, errors=run.errors)
            except Exception:  # auditing must never change or block a verdict
                _log.exception("recording a decision failed")
            for listener in self.on_verdict:
                try:
                    listener(verdict)
                except Exception:  # a listener must never change or block a verdict
                    _log.exception("an on_verdict listener failed")
        return verdicts

    def _verdict(self, run: _Check, decisions: list[PolicyDecision]) -> Verdict:
        call, start = run.call, run.start
        engine_name = getattr(self._engine, "model", None) if self._engine is not None else None
        escalation_name = getattr(self.escalation, "model", None) if self.escalation is not None else None
        errors = [d.error for d in decisions if d.error]
        if not decisions:
            return Verdict(
                "allow", None, None, "no policy applies", (), call, _ms(start), engine_name, escalation_name, None, run.phase, 0
            )
        final = max(decisions, key=lambda d: SEVERITY[d.action])
        action, message = final.action, final.message
        if action == "escalate" and not self.human_review:
            action = "deny"
            message = (final.message + " " if final.message else "") + (
                "(escalation was needed, and no stronger engine settled it and no human reviewer is configured)"
            )
        return Verdict(
            action=action,
            policy=final.policy,
            rule=final.rule,
            message=message,
            decisions=tuple(decisions),
            tool_call=call,
            latency_ms=_ms(start),
            engine=engine_name,
            escalation_engine=escalation_name,
            error="; ".join(errors) or None,
            phase=run.phase,
            input_tokens=run.input_tokens,
        )


def evaluate_rules(
    policy: Policy,
    answers: Mapping[str, Any],
    call: Mapping[str, Any],
    context: Mapping[str, Any],
    *,
    calibrated: bool = False,
    escalated: bool = False,
) -> PolicyDecision:
    """Apply ``policy``'s rules in order to its answers: the first that holds decides."""
    variables = cel_variables(policy, answers, call, context)
    for rule in policy.rules:
        try:
            holds = rule.program.execute(variables)
        except Exception as exc:  # a rule that cannot be evaluated fails closed
            error = f"rule {rule.id!r} could not be evaluated: {exc}"
            return PolicyDecision(policy.name, policy.on_error, rule.id, f"guard failed closed: {error}", dict(answers), policy.thresholds, calibrated, error, escalated)
        if holds is True:
            return PolicyDecision(policy.name, rule.then, rule.id, rule.message, dict(answers), policy.thresholds, calibrated, None, escalated)
    return PolicyDecision(policy.name, policy.default, None, "", dict(answers), policy.thresholds, calibrated, None, escalated)


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


def engine_state(policy: Policy, call: Mapping[str, Any], state: Any, description: str | None) -> dict[str, Any]:
    """The state the engine sees for ``policy``: the parts its ``state:`` section asks for."""
    view = policy.state
    payload: dict[str, Any] = {}
    if view.fields and isinstance(state, Mapping):
        payload["fields"] = {k: state[k] for k in view.fields if k in state}
    messages = _messages(state)
    if view.messages and messages:
        latest = messages[-view.messages :]
        opening = _opening(messages) if view.opening else []
        payload["messages"] = [*opening[: len(messages) - len(latest)], *latest]
    if view.tool_call:
        tool: dict[str, Any] = {"name": call["name"], "args": call["args"]}
        if view.tool_description and description:
            tool["description"] = description
        payload["tool"] = tool
    if view.tool_result and call.get("result") is not None:
        payload["tool_result"] = call["result"]
    return payload


def load_calibration(source: str | Path | Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """Threshold overrides by policy from a calibration file (YAML or JSON) or mapping.

    The file reads ``{version: 1, policies: {<policy>: {thresholds: {<name>: <0..1>}}}}``;
    ``clef-guard calibrate`` writes it.
    """
    name = str(source) if not isinstance(source, Mapping) else "<calibration>"
    if isinstance(source, Mapping):
        data: Any = source
    else:
        try:
            data = yaml.safe_load(Path(source).read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError) as exc:
            raise PolicyError(f"cannot read the calibration file: {exc}", file=name) from None
    if not isinstance(data, Mapping) or data.get("version") != 1 or not isinstance(data.get("policies"), Mapping):
        raise PolicyError("a calibration file is a mapping with 'version: 1' and 'policies:'", file=name)
    overrides: dict[str, dict[str, float]] = {}
    for policy, entry in data["policies"].items():
        thresholds = entry.get("thresholds", {}) if isinstance(entry, Mapping) else None
        if not isinstance(thresholds, Mapping):
            raise PolicyError("must map threshold names to numbers", file=name, field=f"policies.{policy}.thresholds")
        for key, value in thresholds.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise PolicyError(
                    f"threshold {value!r} is not a probability",
                    file=name,
                    field=f"policies.{policy}.thresholds.{key}",
                    hint="write a number from 0 to 1",
                )
        overrides[str(policy)] = {str(k): float(v) for k, v in thresholds.items()}
    return overrides


def _opening(messages: Sequence[Any]) -> list[Any]:
    """The conversation's leading system turns and, right after them, its first user turn.

    A mapping counts as the message it renders as (:func:`clef_guard._state._as_message`).
    """
    for index, message in enumerate(messages):
        read = message if isinstance(message, BaseMessage) else _as_message(message)
        kind = read.type if read is not None else None
        if kind != "system":
            return list(messages[: index + (kind == "human")])
    return list(messages)


def _messages(state: Any) -> list[Any]:
    if isinstance(state, Mapping):
        state = state.get("messages")
    if isinstance(state, Sequence) and not isinstance(state, str) and all(isinstance(m, (BaseMessage, Mapping)) for m in state):
        return list(state)
    return []


def _normalise_call(tool_call: Mapping[str, Any], result: Any = None) -> dict[str, Any]:
    name = tool_call.get("name")
    if not isinstance(name, str) or not name:
        raise PolicyError("a tool call needs a non-empty 'name'", field="tool_call.name")
    args = tool_call.get("args") or {}
    if not isinstance(args, Mapping):
        raise PolicyError("a tool call's 'args' must be a mapping", field="tool_call.args")
    args_json = json.dumps(dict(args), default=str, sort_keys=True, ensure_ascii=False)
    call = {"name": name, "args": json.loads(args_json), "args_json": args_json, "id": str(tool_call.get("id") or "")}
    if result is not None:
        call["result"] = result if isinstance(result, str) else json.dumps(result, default=str, sort_keys=True)
    return call


def _with_description(
    options: CheckOptions, call: Mapping[str, Any], descriptions: Mapping[str, str] | None
) -> CheckOptions:
    if descriptions and call.get("name") in descriptions:
        return {**options, "tool_description": descriptions[call["name"]]}
    return options


def _merge_escalated(first: list[PolicyDecision], again: list[PolicyDecision]) -> list[PolicyDecision]:
    replaced = {d.policy: d for d in again}
    return [replaced.get(d.policy, d) for d in first]


def _describe(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"


def _ms(start: float) -> float:
    return 1000 * (time.perf_counter() - start)
