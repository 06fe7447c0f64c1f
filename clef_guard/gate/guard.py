"""The gate: match policies, ask the engine once, apply the rules, combine the verdicts.

One check, in order:

1. every policy that applies to the call (tool glob, step, ``applies_to.when``, phase);
2. the questions of all of them that the call's facts leave a rule a use for (every one with
   ``Guard(every_question=True)``), merged (identical questions asked once) into one engine
   request per distinct state view, under a timeout; asked lazily (``Guard(lazy=True)``), a
   policy's questions come in rounds, only as many as its rules need to decide;
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
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar, Unpack

from langchain_core.decisions import BaseDecisionModel, ClassifierResponse, NoulAnswer

from clef_guard.errors import EngineTimeoutError, PolicyError
from clef_guard.gate.rules import (
    Labeling,
    evaluate_rules,
    failed_decision,
    label_result,
    next_questions,
    relevant_questions,
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
    Copied,
    argument_lines,
    engine_state,
    line_spans,
    normalise_call,
    result_windows,
    trusted_view,
    upcoming_state,
)
from clef_guard.policy.calibration import load_calibration
from clef_guard.policy.load import HINTS, Policy
from clef_guard.policy.schema import SEVERITY, Mode
from clef_guard.telemetry.spans import Telemetry

if TYPE_CHECKING:
    from clef_guard.engine.screen import Reading

_log = logging.getLogger("clef_guard")
_T = TypeVar("_T")
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
    units: list[_Unit]
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
    escalations: list[_Unit] = field(default_factory=list)
    relevant: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Per policy, the questions whose answers can change its decision on this call (:func:`relevant_questions`)."""


@dataclass
class _Unit:
    """One policy reading one view of the call (one window of a result it reads in windows)."""

    policy: Policy
    view: str
    """Names the state view; units with the same view share engine requests."""
    state: dict[str, Any]
    span: tuple[int, int] | None
    """The window of the tool result this unit reads (``None``: all of it)."""
    trusted_reading: bool = False
    """Whether ``state`` leaves out what the user and the system did not write (earlier results, argument prose)."""
    escalated: bool = False
    answers: dict[str, Any] = field(default_factory=dict)
    """The answers so far, by the policy's question ids."""
    familiarity: dict[str, float] = field(default_factory=dict)
    """How familiar each answered question was to the engine's head, where the engine says."""
    flagged: tuple[int, int] | None = None
    """The characters of the result a screen found most suspicious (the decision's ``span``)."""
    decision: PolicyDecision | None = None


@dataclass
class _Group:
    """One engine request: the questions units of one view ask in this round (identical ones once)."""

    state: dict[str, Any]
    questions: dict[str, Any] = field(default_factory=dict)
    """Engine question id -> question."""
    members: list[tuple[_Unit, dict[str, str]]] = field(default_factory=list)
    """Each unit, with its question ids -> engine question ids."""

    def add(self, unit: _Unit, qids: Sequence[str]) -> None:
        ids = {}
        for qid in qids:
            question = unit.policy.questions[qid]
            shared = next((eid for eid, q in self.questions.items() if q == question), None)
            if shared is None:
                shared = f"q{len(self.questions)}"
                self.questions[shared] = question
            ids[qid] = shared
        self.members.append((unit, ids))


_Reply = ClassifierResponse | Exception


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
    lazy
        Ask a policy's questions only as its rules need them: rules that need no answer
        first, then its first question, then the rest the remaining rules read
        (:func:`~clef_guard.gate.rules.next_questions`); the verdict is the one all the
        answers give. Fewer tokens, more passes: off by default, since on the in-process
        CPU engine a pass costs what about 50 tokens do and every question at once read
        faster in the measured agent loop (docs/results.md); on for policies that ask
        many long questions their rules seldom need.
    every_question
        Ask every question of a policy that applies. By default a question the call's facts
        leave no rule a use for is not asked (on a call ``facts.known_destructive`` flags,
        ``known_destructive || answers.destructive >= t`` never reads ``destructive``:
        :func:`~clef_guard.gate.rules.relevant_questions`), and the verdict is the same; set
        it where traces or review logs should hold every answer.
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
        lazy: bool = False,
        every_question: bool = False,
    ) -> None:
        if mode not in ("enforce", "shadow"):
            raise ValueError(f"mode is 'enforce' or 'shadow', not {mode!r}")
        if lazy and every_question:
            raise ValueError("lazy asks only what the rules need, every_question asks everything: pick one")
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
        self.lazy = lazy
        self.every_question = every_question
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
        copied = Copied(state)
        for policy in self.policies:
            if policy.applies_to.phase == "before_tool" and policy.questions:
                upcoming = upcoming_state(policy, state)
                if upcoming is None:
                    continue
                readings = [upcoming]
                if policy.state.checks_trusted:
                    readings.append(_trusted(policy, upcoming, copied))
                if policy.state.argument_lines:  # how each line reading begins: the prose out, the results in
                    readings.append(trusted_view(upcoming, copied, results=False))
                for view in readings:
                    if view is not None:
                        views.setdefault(json.dumps(view, default=str, sort_keys=True), view)
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
        for escalation in (False, True):
            deadline = self._deadline()
            rounds = self._rounds(runs, escalation=escalation, deadline=deadline)
            groups = next(rounds, None)
            while groups is not None:
                groups = _send(rounds, self._ask(groups, escalation=escalation, deadline=deadline))
        return self._publish(runs, [self._verdict(run, self._decisions(run)) for run in runs])

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
        offload = any(policy.screens for run in runs for policy in run.policies)
        for escalation in (False, True):
            deadline = self._deadline()
            rounds = self._rounds(runs, escalation=escalation, deadline=deadline)
            groups = await _step(offload, next, rounds, None)
            while groups is not None:
                groups = await _step(offload, _send, rounds, await self._aask(groups, escalation=escalation, deadline=deadline))
        return self._publish(runs, [self._verdict(run, self._decisions(run)) for run in runs])

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
        run.units = self._units(run, run.policies)
        return run

    def _units(self, run: _Check, policies: list[Policy], *, escalated: bool = False) -> list[_Unit]:
        """Each policy's reading of each view of the call (and result window); one state per distinct view."""
        states: dict[str, dict[str, Any]] = {}
        trusted: dict[str, dict[str, Any] | None] = {}
        lines: dict[str, list[dict[str, Any]]] = {}
        units = []
        copied = Copied(run.state)
        for policy in policies:
            result = run.call.get("result") if policy.state.tool_result else None
            spans = result_windows(result, policy.state.result_window)
            if policy.state.result_lines:
                spans += [span for span in line_spans(result) if span not in spans]
            for span in spans:
                view = policy.state.model_dump_json(exclude=_READINGS) + json.dumps(span)
                if view not in states:
                    call = run.call if span is None else {**run.call, "result": run.call["result"][span[0] : span[1]]}
                    states[view] = engine_state(policy, call, run.state, run.description)
                units.append(_Unit(policy, view, states[view], span, escalated=escalated))
                if policy.state.checks_trusted:
                    key = f"{view}/trusted/{policy.state.check_without_results}/{policy.state.check_without_prose}"
                    if key not in trusted:
                        trusted[key] = _trusted(policy, states[view], copied)
                    if trusted[key] is not None:
                        units.append(_Unit(policy, key, trusted[key], span, True, escalated))
                if policy.state.argument_lines:
                    if view not in lines:
                        lines[view] = argument_lines(states[view], copied)
                    for index, cut in enumerate(lines[view]):
                        units.append(_Unit(policy, f"{view}/lines/{index}", cut, span, True, escalated))
        return units

    def _rounds(self, runs: list[_Check], *, escalation: bool, deadline: float | None) -> Generator[list[_Group], list[_Reply], None]:
        """Engine requests, round after round, until every unit has decided: each round decides the units
        whose rules can, and asks what the others need next; the replies come back through ``send``.
        Screens answer here, within ``deadline`` too."""
        if escalation:
            if self.escalation is None:
                return
            for run in runs:
                escalating = {d.policy for d in self._decisions(run) if d.action == "escalate"}
                run.escalations = self._units(run, [p for p in run.policies if p.name in escalating], escalated=True)
        lazy = self.lazy and not escalation
        while True:
            asked = []
            for run in runs:
                groups: dict[str, _Group] = {}
                for unit in run.escalations if escalation else run.units:
                    wanted = self._wanted(run, unit, lazy=lazy)
                    while unit.decision is None and (screened := [qid for qid in wanted if qid in unit.policy.screens]):
                        self._screen(run, unit, screened, deadline)  # answered here: ask what the rules need next
                        wanted = self._wanted(run, unit, lazy=lazy)
                    if unit.decision is not None:
                        continue
                    if wanted:
                        groups.setdefault(unit.view, _Group(unit.state)).add(unit, wanted)
                    else:
                        unit.decision = self._evaluate(run, unit)
                asked.append((run, list(groups.values())))
            batch = [group for _, groups in asked for group in groups]
            if not batch:
                return
            replies = iter((yield batch))
            for run, groups in asked:
                for group in groups:
                    self._take(run, group, next(replies))

    def _take(self, run: _Check, group: _Group, reply: _Reply) -> None:
        """Give each unit of ``group`` its answers from ``reply``; a failed reply fails its units closed."""
        if isinstance(reply, Exception):
            run.errors.append(reply)
        elif reply.usage is not None:
            run.input_tokens += int(reply.usage.get("input_tokens") or 0)
            run.cached_tokens += int((reply.usage.get("input_token_details") or {}).get("cache_read") or 0)
        for unit, ids in group.members:
            if isinstance(reply, Exception):
                error = _describe(reply)
            elif missing := [qid for qid, eid in ids.items() if eid not in reply.answers]:
                error = f"the engine's response lacks questions {missing}"
            else:
                unit.answers.update({qid: reply.answers[eid] for qid, eid in ids.items()})
                familiar = getattr(reply, "familiarity", None) or {}
                unit.familiarity.update({qid: familiar[eid] for qid, eid in ids.items() if eid in familiar})
                continue
            calibrated = unit.policy.name in self._calibrated
            unit.decision = failed_decision(unit.policy, error, answers=unit.answers, calibrated=calibrated, escalated=unit.escalated)

    def _wanted(self, run: _Check, unit: _Unit, *, lazy: bool) -> tuple[str, ...]:
        """The questions ``unit`` needs answered next: those its rules can use on this call's facts, all
        at once or as the rules need them (lazy); then any a rule turns out to need."""
        if unit.decision is not None:
            return ()
        if self.every_question:
            return tuple(qid for qid in unit.policy.questions if qid not in unit.answers)
        name = unit.policy.name
        if name not in run.relevant:
            run.relevant[name] = relevant_questions(unit.policy, run.call, run.context, run.flow)
        return next_questions(
            unit.policy, unit.answers, run.call, run.context, run.flow, at_once=not lazy, relevant=run.relevant[name]
        )

    def _screen(self, run: _Check, unit: _Unit, questions: Sequence[str], deadline: float | None) -> None:
        """Answer ``questions`` of ``unit`` with their screens, in this process (:mod:`clef_guard.engine.screen`),
        on the part of the result it reads; a screen that fails, cannot load or reads past ``deadline``
        fails the unit closed."""
        result = run.call.get("result")
        text = "" if result is None else result if isinstance(result, str) else json.dumps(result, default=str)
        start, end = unit.span or (0, len(text))
        for qid in questions:
            name = unit.policy.screens[qid]
            try:
                reading = self._within(deadline, f"screen {name!r}", _read_screen, name, text[start:end])
            except Exception as exc:  # fail closed: on_error decides
                run.errors.append(exc)
                unit.decision = failed_decision(
                    unit.policy, f"screen {name!r} failed: {_describe(exc)}", answers=unit.answers,
                    calibrated=unit.policy.name in self._calibrated, escalated=unit.escalated,
                )
                return
            unit.answers[qid] = NoulAnswer(type="noul", noul=reading.probability)
            if reading.span is not None:
                unit.flagged = (start + reading.span[0], start + reading.span[1])

    def _evaluate(self, run: _Check, unit: _Unit) -> PolicyDecision:
        decision = evaluate_rules(
            unit.policy, unit.answers, run.call, run.context, flow=run.flow,
            calibrated=unit.policy.name in self._calibrated, escalated=unit.escalated,
        )
        return replace(decision, span=unit.flagged or unit.span, trusted_reading=unit.trusted_reading)

    def _decisions(self, run: _Check) -> list[PolicyDecision]:
        """One decision per policy: the engine's (escalated where the escalation engine answered), then the settled."""
        first = _strictest([u.decision for u in run.units if u.decision is not None])
        again = {d.policy: d for d in _strictest([u.decision for u in run.escalations if u.decision is not None])}
        return run.settled + [again.get(d.policy, d) for d in first]

    def _deadline(self) -> float | None:
        return None if self.timeout_s is None else time.monotonic() + self.timeout_s

    def _ask(self, groups: list[_Group], *, escalation: bool, deadline: float | None) -> list[_Reply]:
        """One engine batch for ``groups``; failures (the engine's load too) and the timeout come back as exceptions."""
        requests = [{"state": g.state, "questions": g.questions} for g in groups]
        try:
            return list(self._within(deadline, "the engine", self._batch, requests, escalation, deadline))
        except Exception as exc:  # any engine failure, the timeout too, must fail closed, never propagate as allow
            return [exc] * len(groups)

    def _within(self, deadline: float | None, what: str, function: Callable[..., _T], *args: Any) -> _T:
        """``function(*args)`` in this Guard's pool, given up on at ``deadline`` (an :class:`EngineTimeoutError`
        naming ``what``; the work, which cannot be interrupted, finishes in the background)."""
        future = self._pool.submit(function, *args)
        try:
            return future.result(timeout=_left(deadline))
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise self._timed_out(what) from None

    def _batch(self, requests: list[dict[str, Any]], escalation: bool, deadline: float | None) -> list[Any]:
        if deadline is not None and time.monotonic() > deadline:  # waited past its timeout for a worker: skip the work
            raise self._timed_out()
        engine = self.escalation if escalation else self.engine
        assert engine is not None  # escalation groups exist only with an escalation engine
        return engine.batch(requests, return_exceptions=True)

    async def _aask(self, groups: list[_Group], *, escalation: bool, deadline: float | None) -> list[_Reply]:
        """Async twin of :meth:`_ask`."""
        requests = [{"state": g.state, "questions": g.questions} for g in groups]
        try:
            engine = self.escalation if escalation else self.engine
            assert engine is not None  # escalation groups exist only with an escalation engine
            return list(await asyncio.wait_for(engine.abatch(requests, return_exceptions=True), timeout=_left(deadline)))
        except TimeoutError:
            return [self._timed_out()] * len(groups)
        except Exception as exc:  # any engine failure must fail closed
            return [exc] * len(groups)

    def _timed_out(self, what: str = "the engine") -> EngineTimeoutError:
        return EngineTimeoutError(f"{what} did not answer within {self.timeout_s} s")

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
        recorded = {"labels": labeling.labels, "marks": labeling.marks, "thread_labels": tuple(run.flow["labels"])}
        familiarity: dict[str, dict[str, float]] = {}
        for unit in run.units:  # a result read in windows: each question's least familiar reading
            known = familiarity.setdefault(unit.policy.name, {})
            known.update({qid: min(f, known.get(qid, f)) for qid, f in unit.familiarity.items()})
        recorded["familiarity"] = {name: known for name, known in familiarity.items() if known}
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
                run.input_tokens, shadowed, **recorded, cached_tokens=run.cached_tokens,
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
            **recorded,
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


def _strictest(decisions: list[PolicyDecision]) -> list[PolicyDecision]:
    """One decision per policy: the strictest of its readings (result windows and lines, the
    trusted reading, argument lines); on a tie, the first (the reading with everything)."""
    kept: dict[str, PolicyDecision] = {}
    for decision in decisions:
        if decision.policy not in kept or SEVERITY[decision.action] > SEVERITY[kept[decision.policy].action]:
            kept[decision.policy] = decision
    return list(kept.values())


_READINGS = {"result_window", "result_lines", "argument_lines", "check_without_results", "check_without_prose"}
"""``state:`` fields that choose which readings a policy makes, not what one reading holds."""


def _trusted(policy: Policy, engine_view: dict[str, Any], copied: Copied) -> dict[str, Any] | None:
    """``policy``'s trusted reading of ``engine_view`` (:func:`~clef_guard.gate.view.trusted_view`), as its ``state:`` asks."""
    return trusted_view(engine_view, copied, results=policy.state.check_without_results, prose=policy.state.check_without_prose)


def _read_screen(name: str, text: str) -> Reading:
    from clef_guard.engine.screen import load_screen

    return load_screen(name).read(text)


def _read_ahead(prefill: Callable[[Any], int], states: list[dict[str, Any]]) -> None:
    for state in states:
        try:
            prefill(state)
        except Exception:  # only a speed-up: the check that follows reads the state itself, and reports
            _log.debug("reading ahead failed", exc_info=True)


async def _step(offload: bool, function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)``, a step of the rounds; in a worker thread when it may run a screen (a model
    pass of tens to hundreds of milliseconds), so that the event loop keeps serving meanwhile."""
    return await asyncio.to_thread(function, *args) if offload else function(*args)


def _send(rounds: Generator[list[_Group], list[_Reply], None], replies: list[_Reply]) -> list[_Group] | None:
    """The next round's requests, or ``None`` when every unit has decided."""
    try:
        return rounds.send(replies)
    except StopIteration:
        return None


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _describe(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"


def _ms(start: float) -> float:
    return 1000 * (time.perf_counter() - start)
