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
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypedDict, Unpack

from langchain_core.decisions import BaseDecisionModel, ClassifierResponse

from clef_guard.errors import EngineTimeoutError, PolicyError
from clef_guard.gate.rules import (
    Labeling,
    evaluate_rules,
    failed_decision,
    label_result,
)
from clef_guard.gate.trail import (
    carried_labels,
    flow_variables,
    model_turns,
    read_trail,
    user_given,
    user_text,
)
from clef_guard.gate.verdict import PolicyDecision, Verdict
from clef_guard.gate.view import (
    engine_state,
    normalise_call,
    result_windows,
    upcoming_state,
)
from clef_guard.policy.calibration import load_calibration
from clef_guard.policy.load import HINTS, Policy
from clef_guard.policy.schema import SEVERITY, Mode
from clef_guard.telemetry.spans import Telemetry

_log = logging.getLogger("clef_guard")
_WORKERS = 8
"""Engine calls one Guard runs at once (its own pool: a hung engine stalls that Guard alone)."""


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
    tool_info: ToolInfo
    """What the tool declares of itself (MCP annotations, metadata, tags), for rules only."""


class ToolInfo(TypedDict, total=False):
    """What a tool says about itself; rules read it as ``tool.annotations``, ``tool.metadata``, ``tool.tags``."""

    description: str
    annotations: Mapping[str, Any]
    """MCP hints (``readOnlyHint``, ``destructiveHint``, ``idempotentHint``, ``openWorldHint``)."""
    metadata: Mapping[str, Any]
    tags: Sequence[str]


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
    flow: dict[str, Any]
    """``history`` and ``labels`` of the thread, from the state's trail."""
    start_ns: int = field(default_factory=time.time_ns)
    errors: list[BaseException] = field(default_factory=list)
    input_tokens: int = 0
    cached_tokens: int = 0
    settled: list[PolicyDecision] = field(default_factory=list)
    """Decisions made without the engine: policies with no questions, or whose ``applies_to.when`` failed."""


@dataclass
class _Group:
    """Policies sharing one state view, asked in one engine request."""

    state: dict[str, Any]
    span: tuple[int, int] | None = None
    """The window of the tool result this group reads (``None``: all of it)."""
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
    mode
        ``enforce``, or ``shadow``: every policy decides and is audited as usual, and
        nothing is blocked (a policy file can say ``mode: shadow`` for itself alone).
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
        mode: Mode = "enforce",
    ) -> None:
        if mode not in ("enforce", "shadow"):
            raise ValueError(f"mode is 'enforce' or 'shadow', not {mode!r}")
        overrides = load_calibration(calibration) if calibration is not None else {}
        by_name: dict[str, Policy] = {}
        for policy in policies:
            if policy.name in by_name:
                raise PolicyError(
                    f"two policies are named {policy.name!r} ({by_name[policy.name].source} and {policy.source}); "
                    "their answers would mix",
                    field="name",
                    hint="give every policy a distinct name",
                )
            by_name[policy.name] = policy
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
        self.mode = mode
        self._enforcing = {p.name for p in self.policies if mode == "enforce" and p.mode == "enforce"}
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix="clef-guard")
        self._ahead: concurrent.futures.Future[None] | None = None
        self._ahead_lock = threading.Lock()

    @property
    def engine(self) -> BaseDecisionModel:
        """The decision model; the embedded engine is loaded on first use."""
        if self._engine is None:
            from clef_guard.engine.local import LocalDecisionModel

            self._engine = LocalDecisionModel()
        return self._engine

    def matching(self, tool_call: Mapping[str, Any], state: Any = None, **options: Unpack[CheckOptions]) -> list[Policy]:
        """The policies that apply to ``tool_call`` at this phase and step (errors in ``applies_to.when`` raise)."""
        call, flow = situation(tool_call, state, options)
        phase, step, context = options.get("phase", "before_tool"), options.get("step"), options.get("context") or {}
        return [p for p in self.policies if p.matches(call["name"], phase=phase, step=step, context=context, tool=call, flow=flow)]

    def read_ahead(self, state: Any) -> concurrent.futures.Future[None] | None:
        """Start reading ``state`` in the background as the policies' views of the next call will begin.

        Call it when tool results arrive (the integrations do): the engine reads them while
        the agent's model writes its next step, and the next check reads only that step,
        the call and the questions. A newer call replaces one that has not started. It
        never decides anything; an engine without :meth:`LocalDecisionModel.prefill
        <clef_guard.engine.local.LocalDecisionModel.prefill>`, or not loaded yet, skips it.
        Returns the reading's future, or ``None`` when there is nothing to read.
        """
        prefill = getattr(self._engine, "prefill", None)
        if prefill is None:
            return None
        views = {}
        for policy in self.policies:
            if policy.applies_to.phase == "before_tool" and policy.questions:
                upcoming = upcoming_state(policy, state)
                if upcoming is not None:
                    views.setdefault(json.dumps(upcoming, default=str, sort_keys=True), upcoming)
        with self._ahead_lock:
            if self._ahead is not None:
                self._ahead.cancel()  # superseded: a cancelled future that already runs finishes harmlessly
            self._ahead = self._pool.submit(_read_ahead, prefill, list(views.values())) if views else None
            return self._ahead

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
        tools: Mapping[str, ToolInfo] | None = None,
        **options: Unpack[CheckOptions],
    ) -> list[Verdict]:
        """Check calls proposed together (parallel tool calls) in one engine batch.

        ``tools`` maps tool names to what they declare (their description, annotations,
        ...). The calls share the state, so a local engine's prefix cache serves all but
        the first. A state holding a trail (:data:`~clef_guard.gate.trail.TRAIL_KEY`) gives
        rules the thread's ``history`` and ``labels``.
        """
        runs = [self._begin(call, state, _with_tool(options, call, tools)) for call in tool_calls]
        decisions = self._decide_runs(runs, self._ask([g for r in runs for g in r.groups]))
        again = [self._escalation_groups(r, d) for r, d in zip(runs, decisions, strict=True)]
        if any(again):
            replies = self._ask([g for groups in again for g in groups], escalation=True)
            decisions = self._merge_runs(runs, decisions, again, replies)
        return self._publish(runs, [self._verdict(r, d) for r, d in zip(runs, decisions, strict=True)])

    async def acheck_many(
        self,
        tool_calls: Sequence[Mapping[str, Any]],
        state: Any = None,
        *,
        tools: Mapping[str, ToolInfo] | None = None,
        **options: Unpack[CheckOptions],
    ) -> list[Verdict]:
        """Async twin of :meth:`check_many`."""
        runs = [self._begin(call, state, _with_tool(options, call, tools)) for call in tool_calls]
        decisions = self._decide_runs(runs, await self._aask([g for r in runs for g in r.groups]))
        again = [self._escalation_groups(r, d) for r, d in zip(runs, decisions, strict=True)]
        if any(again):
            replies = await self._aask([g for groups in again for g in groups], escalation=True)
            decisions = self._merge_runs(runs, decisions, again, replies)
        return self._publish(runs, [self._verdict(r, d) for r, d in zip(runs, decisions, strict=True)])

    def _decide_runs(self, runs: list[_Check], replies: list[ClassifierResponse | Exception]) -> list[list[PolicyDecision]]:
        """Split one batch of replies back to the checks that asked them."""
        decided, offset = [], 0
        for run in runs:
            decided.append(run.settled + self._decide_all(run, run.groups, replies[offset : offset + len(run.groups)]))
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
        start = time.perf_counter()
        call, flow = situation(tool_call, state, options)
        context = dict(options.get("context") or {})
        phase = options.get("phase", "before_tool")
        description = options.get("tool_description") or (options.get("tool_info") or {}).get("description")
        run = _Check(call, state, context, description, [], [], start, phase, flow)
        for policy in self.policies:  # the call keeps its result, for after_tool conditions
            try:
                applies = policy.matches(call["name"], phase=phase, step=options.get("step"), context=context, tool=call, flow=flow)
            except Exception as exc:  # a condition that cannot be read may hide a match: fail closed
                run.errors.append(exc)
                run.settled.append(failed_decision(policy, f"applies_to.when could not be evaluated: {_describe(exc)}"))
                continue
            if applies and not policy.questions:  # rules alone decide: no engine call
                run.settled.append(evaluate_rules(policy, {}, call, context, flow=flow, calibrated=policy.name in self._calibrated))
            elif applies:
                run.policies.append(policy)
        run.groups.extend(self._groups(run, run.policies))
        return run

    def _groups(self, run: _Check, policies: list[Policy]) -> list[_Group]:
        """One engine request per distinct state view (and result window); identical questions asked once."""
        groups: dict[str, _Group] = {}
        for policy in policies:
            result = run.call.get("result") if policy.state.tool_result else None
            for span in result_windows(result, policy.state.result_window):
                view_key = policy.state.model_dump_json(exclude={"result_window"}) + json.dumps(span)
                group = groups.get(view_key)
                if group is None:
                    call = run.call if span is None else {**run.call, "result": run.call["result"][span[0] : span[1]]}
                    group = groups[view_key] = _Group(engine_state(policy, call, run.state, run.description), span)
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

    def _ask(self, groups: list[_Group], *, escalation: bool = False) -> list[ClassifierResponse | Exception]:
        """One engine batch for ``groups``; failures (the engine's load too) and the timeout come back as exceptions."""
        if not groups:
            return []
        requests = [{"state": g.state, "questions": g.questions} for g in groups]
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        try:
            future = self._pool.submit(self._batch, requests, escalation, deadline)
            return list(future.result(timeout=self.timeout_s))
        except concurrent.futures.TimeoutError:
            future.cancel()
            return [EngineTimeoutError(f"the engine did not answer within {self.timeout_s} s")] * len(groups)
        except Exception as exc:  # any engine failure must fail closed, never propagate as allow
            return [exc] * len(groups)

    def _batch(self, requests: list[dict[str, Any]], escalation: bool, deadline: float | None) -> list[Any]:
        if deadline is not None and time.monotonic() > deadline:  # waited past its timeout for a worker: skip the work
            raise EngineTimeoutError(f"the engine did not answer within {self.timeout_s} s")
        engine = self.escalation if escalation else self.engine
        assert engine is not None  # escalation groups exist only with an escalation engine
        return engine.batch(requests, return_exceptions=True)

    async def _aask(self, groups: list[_Group], *, escalation: bool = False) -> list[ClassifierResponse | Exception]:
        """Async twin of :meth:`_ask`."""
        if not groups:
            return []
        requests = [{"state": g.state, "questions": g.questions} for g in groups]
        try:
            engine = self.escalation if escalation else self.engine
            assert engine is not None  # escalation groups exist only with an escalation engine
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
                run.cached_tokens += int((reply.usage.get("input_token_details") or {}).get("cache_read") or 0)
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
                    decision = failed_decision(policy, str(error), calibrated=calibrated, escalated=escalated)
                else:
                    decision = evaluate_rules(
                        policy, answers, run.call, run.context, flow=run.flow, calibrated=calibrated, escalated=escalated
                    )
                decisions.append(decision if group.span is None else replace(decision, span=group.span))
        return _strictest_window(decisions)

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

    def _labeling(self, run: _Check, decisions: list[PolicyDecision]) -> Labeling:
        """The labels every policy's label rules attach to an ``after_tool`` check's result."""
        engine_asked = {p.name for p in run.policies}
        asked = {d.policy: d for d in decisions if d.policy in engine_asked}
        labels: set[str] = set()
        marks: list[str] = []
        errors: list[str] = []
        for policy in self.policies:
            if not policy.labels:
                continue
            decision = asked.get(policy.name)
            answers = None if decision is None else decision.answers
            labeling = label_result(policy, answers, run.call, run.context, run.flow, failed=decision is not None and bool(decision.error))
            labels.update(labeling.labels)
            marks += labeling.marks
            errors += [labeling.error] if labeling.error else []
        return Labeling(tuple(sorted(labels)), tuple(dict.fromkeys(marks)), "; ".join(errors) or None)

    def _verdict(self, run: _Check, decisions: list[PolicyDecision]) -> Verdict:
        call, start = run.call, run.start
        engine_name = getattr(self._engine, "model", None) if self._engine is not None else None
        escalation_name = getattr(self.escalation, "model", None) if self.escalation is not None else None
        labeling = self._labeling(run, decisions) if run.phase == "after_tool" else Labeling()
        errors = [d.error for d in decisions if d.error] + ([labeling.error] if labeling.error else [])
        flow = {"labels": labeling.labels, "marks": labeling.marks, "thread_labels": tuple(run.flow["labels"])}
        decisions = [d if d.policy in self._enforcing else replace(d, enforced=False) for d in decisions]
        enforced = [d for d in decisions if d.enforced]
        final = max(enforced, key=lambda d: SEVERITY[d.action]) if enforced else None
        floor = SEVERITY[final.action if final else "allow"]
        stricter = [d for d in decisions if not d.enforced and SEVERITY[d.action] > floor]
        shadowed = max(stricter, key=lambda d: SEVERITY[d.action]) if stricter else None
        if final is None:
            return Verdict(
                "allow", None, None, "no policy applies" if not decisions else "only policies in shadow mode apply",
                tuple(decisions), call, _ms(start), engine_name, escalation_name, "; ".join(errors) or None, run.phase,
                run.input_tokens, shadowed, **flow, cached_tokens=run.cached_tokens,
            )
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
            shadowed=shadowed,
            decisions=tuple(decisions),
            tool_call=call,
            latency_ms=_ms(start),
            engine=engine_name,
            escalation_engine=escalation_name,
            error="; ".join(errors) or None,
            phase=run.phase,
            input_tokens=run.input_tokens,
            cached_tokens=run.cached_tokens,
            **flow,
        )




def situation(tool_call: Mapping[str, Any], state: Any, options: CheckOptions) -> tuple[dict[str, Any], dict[str, Any]]:
    """The call as rules read it (with what its tool declares and the labels its arguments carry), and the thread's flow."""
    call = {**normalise_call(tool_call, options.get("tool_result")), **declared(options.get("tool_info") or {})}
    trail = read_trail(state)
    typed = user_text(state)
    call["labels"] = carried_labels(call["args"], trail, trusted=typed) if trail else []
    call["from_user"] = user_given(call["args"], typed)
    return call, flow_variables(trail, turn=model_turns(state), exclude=call["id"])


def _with_tool(options: CheckOptions, call: Mapping[str, Any], tools: Mapping[str, ToolInfo] | None) -> CheckOptions:
    if tools and call.get("name") in tools:
        return {**options, "tool_info": tools[call["name"]]}
    return options


def declared(info: ToolInfo) -> dict[str, Any]:
    """``tool.annotations``, ``tool.metadata`` and ``tool.tags`` as rules read them: JSON values,
    every MCP hint present (``null`` when the tool does not declare it)."""
    annotations = info.get("annotations") or {}
    hints = {hint: annotations.get(hint) if isinstance(annotations.get(hint), bool) else None for hint in HINTS}
    metadata = json.loads(json.dumps(dict(info.get("metadata") or {}), default=str))
    return {"annotations": hints, "metadata": metadata, "tags": [str(t) for t in info.get("tags") or ()]}


def _strictest_window(decisions: list[PolicyDecision]) -> list[PolicyDecision]:
    """One decision per policy: a policy that read a result in windows keeps its strictest window's."""
    kept: dict[str, PolicyDecision] = {}
    for decision in decisions:
        if decision.policy not in kept or SEVERITY[decision.action] > SEVERITY[kept[decision.policy].action]:
            kept[decision.policy] = decision
    return list(kept.values())


def _read_ahead(prefill: Callable[[Any], int], states: list[dict[str, Any]]) -> None:
    for state in states:
        try:
            prefill(state)
        except Exception:  # only a speed-up: the check that follows reads the state itself, and reports
            _log.debug("reading ahead failed", exc_info=True)


def _merge_escalated(first: list[PolicyDecision], again: list[PolicyDecision]) -> list[PolicyDecision]:
    replaced = {d.policy: d for d in again}
    return [replaced.get(d.policy, d) for d in first]


def _describe(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"


def _ms(start: float) -> float:
    return 1000 * (time.perf_counter() - start)
