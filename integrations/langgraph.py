"""LangGraph graphs: a guarded ``ToolNode``, a guard node for hand-built graphs, intent routing.

.. code-block:: python

    from clef_guard.integrations.langgraph import guarded_tool_node, guard_node, intent_router

    builder.add_node("tools", guarded_tool_node(tools, guard))          # gate inside ToolNode
    # or, in a hand-built graph, gate before a plain ToolNode:
    builder.add_node("guard", guard_node(guard, tools_node="tools", back_to="agent"))
    builder.add_node("tools", ToolNode(tools))

    router = intent_router(policy="policies/support-routing.yaml", step="triage", fallback="human")
    builder.add_node("triage", router.node)
    builder.add_conditional_edges("triage", router)

Verdicts act as in :mod:`clef_guard.integrations.langchain`: allow runs, deny answers
with an error ``ToolMessage``, confirm and escalate interrupt for a human.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any

import yaml
from clef_guard.integrations._tools import (
    GateOptions,
    ReviewDecision,
    ToolGate,
    _Edited,
    thread_of,
)
from langchain_core.decisions import BaseDecisionModel, Choice
from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.runnables import RunnableConfig, RunnableLambda
from langchain_core.tools import BaseTool
from langgraph.graph import MessagesState
from langgraph.prebuilt import ToolNode
from langgraph.types import Command, Send, interrupt

from clef_guard import Guard, Policy, PolicyError, Verdict, load_policy, parse_policy
from clef_guard.gate.trail import TRAIL_KEY, merge_trail, model_turns, trail_entry
from clef_guard.telemetry.reviews import ReviewLog

_ALL_DECISIONS: tuple[ReviewDecision, ...] = ("approve", "edit", "reject", "respond")


class GuardedMessagesState(MessagesState):
    """``MessagesState`` with the thread's trail, which flow rules read as ``history`` and ``labels``."""

    clef_guard_trail: Annotated[list[dict[str, Any]], merge_trail]


def guarded_tool_node(
    tools: Sequence[BaseTool | Any], guard: Guard, *, gate: GateOptions | None = None, **tool_node_kwargs: Any
) -> ToolNode:
    """A prebuilt ``ToolNode`` whose every call passes the guard (its wrap hooks).

    Parallel calls are checked in one engine batch. When the graph gives the node the
    whole AI message, calls that need a person interrupt one after another; send each
    call on its own (``Send``, as ``create_agent`` does) to get all interrupts at once.
    ``gate`` sets what a reviewer may answer and whether results are screened. Give the
    graph a trail channel (:class:`GuardedMessagesState`, or ``clef_guard_trail`` with the
    reducer :func:`~clef_guard.gate.trail.merge_trail` in your own state) for flow rules.
    """
    tool_gate = ToolGate(guard, messages_key=tool_node_kwargs.get("messages_key", "messages"), **(gate or {}))
    return ToolNode(tools, wrap_tool_call=tool_gate.wrap, awrap_tool_call=tool_gate.awrap, **tool_node_kwargs)


def guard_node(
    guard: Guard,
    *,
    tools_node: str = "tools",
    back_to: str = "agent",
    allowed_decisions: Sequence[ReviewDecision] = _ALL_DECISIONS,
    messages_key: str = "messages",
    review_log: ReviewLog | None = None,
) -> RunnableLambda[Any, Command[Any]]:
    """A node to place between the model and a plain ``ToolNode`` in a hand-built graph.

    It gates every tool call of the last AI message: allowed and approved calls go to
    ``tools_node`` (one ``Send`` each); denied and rejected ones are answered with a
    ``ToolMessage``; when nothing is left to run, the graph goes to ``back_to`` so
    the model reads the answers. Calls that need a person interrupt one after another
    (a node raises one interrupt at a time), each with its own interrupt id.
    """
    gate = ToolGate(guard, allowed_decisions=allowed_decisions, check_results=False, **({"review_log": review_log} if review_log else {}))

    def review(state: Mapping[str, Any], verdicts: list[Verdict], thread: str) -> list[Any]:
        calls = _last_ai_message(state, messages_key).tool_calls
        return [gate.review(call, verdict, state=state, thread=thread) for call, verdict in zip(calls, verdicts, strict=True)]

    def command(state: Mapping[str, Any], verdicts: list[Verdict], outcomes: list[Any], rechecked: list[Verdict]) -> Command[Any]:
        sends, answers = [], []
        again = iter(rechecked)
        for outcome in outcomes:
            if isinstance(outcome, _Edited):
                outcome = gate.after_edit(outcome.call, next(again))
            if isinstance(outcome, ToolMessage):
                answers.append(outcome)
            else:
                sends.append(Send(tools_node, {"__type": "tool_call_with_context", "tool_call": outcome, "state": state}))
        update: dict[str, Any] = {messages_key: answers}
        if TRAIL_KEY in state:  # history for flow rules; results reach a plain ToolNode unlabeled
            calls, turn = _last_ai_message(state, messages_key).tool_calls, model_turns(state)
            update[TRAIL_KEY] = [trail_entry(c, turn=turn, verdict=v.action) for c, v in zip(calls, verdicts, strict=True)]
        return Command(update=update, goto=sends or back_to)

    def run(state: Mapping[str, Any], config: RunnableConfig) -> Command[Any]:
        thread = thread_of(config)
        verdicts = gate.verdicts(_last_ai_message(state, messages_key).tool_calls, state, thread=thread)
        outcomes = review(state, verdicts, thread)
        edits = [o.call for o in outcomes if isinstance(o, _Edited)]
        return command(state, verdicts, outcomes, guard.check_many(edits, state) if edits else [])

    async def arun(state: Mapping[str, Any], config: RunnableConfig) -> Command[Any]:
        calls, thread = _last_ai_message(state, messages_key).tool_calls, thread_of(config)
        verdicts = await gate.averdicts(calls, state, thread=thread)
        outcomes = review(state, verdicts, thread)
        edits = [o.call for o in outcomes if isinstance(o, _Edited)]
        return command(state, verdicts, outcomes, await guard.acheck_many(edits, state) if edits else [])

    return RunnableLambda(run, afunc=arun, name="clef_guard")


class IntentRouter:
    """Routes a graph by a ``choice``: :attr:`node` asks and records, calling the router reads.

    The node writes ``{state_key: {"route", "label", "confident", "answer", "policy", "rule"}}``
    into the graph state, so the full answer (every label's probability) stays there.
    """

    def __init__(
        self,
        guard: Guard,
        policy: Policy,
        question_id: str,
        *,
        routes: Mapping[str, str],
        fallback: str,
        step: str,
        state_key: str,
        human_review: bool,
    ) -> None:
        self.guard, self.policy, self.question_id = guard, policy, question_id
        self.routes, self.fallback, self.step = dict(routes), fallback, step
        self.state_key, self.human_review = state_key, human_review
        self.node = RunnableLambda(self._node, afunc=self._anode, name="intent_router")

    def __call__(self, state: Mapping[str, Any]) -> str:
        """The conditional-edge function: the route the node chose."""
        return state[self.state_key]["route"]

    def _node(self, state: Mapping[str, Any]) -> dict[str, Any]:
        return self._record(self.guard.check({"name": "route", "args": {}}, state, phase="route", step=self.step))

    async def _anode(self, state: Mapping[str, Any]) -> dict[str, Any]:
        return self._record(await self.guard.acheck({"name": "route", "args": {}}, state, phase="route", step=self.step))

    def _record(self, verdict: Verdict) -> dict[str, Any]:
        decision = next((d for d in verdict.decisions if d.policy == self.policy.name), None)
        answer = decision.answers.get(self.question_id) if decision else None
        label = answer.choice if answer is not None else None
        confident = verdict.action == "allow" and label is not None
        route = self.routes.get(label, self.fallback) if confident and label is not None else self.fallback
        if not confident and self.human_review:
            picked = interrupt(
                {
                    "type": "route_review",
                    "step": self.step,
                    "options": list(self.routes),
                    "reason": verdict.message or verdict.error,
                    "answer": answer.model_dump() if answer is not None else None,
                }
            )
            if picked not in self.routes:
                raise PolicyError(f"the reviewer picked {picked!r}; choose one of {sorted(self.routes)}", field="resume")
            label, route = picked, self.routes[picked]
        return {
            self.state_key: {
                "route": route,
                "label": label,
                "confident": confident,
                "answer": answer.model_dump() if answer is not None else None,
                "policy": verdict.policy,
                "rule": verdict.rule,
                "error": verdict.error,
            }
        }


def intent_router(
    *,
    fallback: str,
    policy: Policy | str | Path | None = None,
    question: Choice | None = None,
    routes: Mapping[str, str] | None = None,
    engine: BaseDecisionModel | None = None,
    threshold: float = 0.5,
    step: str = "route",
    messages: int = 6,
    state_key: str = "intent",
    human_review: bool = False,
    calibration: str | Path | Mapping[str, Any] | None = None,
) -> IntentRouter:
    """A router for ``add_conditional_edges`` that asks a ``choice`` and trusts it only when sure.

    Give either ``policy`` (a ``phase: route`` policy with one choice question; its
    rules decide when the answer is trusted) or ``question`` (an inline ``Choice``; it
    is trusted when its confidence is at least ``threshold``). ``routes`` maps labels to
    node names (default: each label is a node). An untrusted answer goes to
    ``fallback``, or to a person (an interrupt answered with a label) with ``human_review``.
    """
    if (policy is None) == (question is None):
        raise PolicyError("give intent_router exactly one of policy= or question=", field="intent_router")
    if question is not None:
        policy = _inline_policy(question, threshold=threshold, step=step, messages=messages)
    elif not isinstance(policy, Policy):
        policy = load_policy(policy)  # type: ignore[arg-type]
    assert isinstance(policy, Policy)
    choices = [qid for qid, q in policy.questions.items() if isinstance(q, Choice)]
    if len(choices) != 1 or policy.applies_to.phase != "route":
        raise PolicyError(
            "a routing policy needs 'phase: route' and exactly one choice question",
            file=policy.source,
            field="questions",
        )
    labels = list(policy.questions[choices[0]].criteria)  # type: ignore[union-attr]
    guard = Guard([policy], engine=engine, calibration=calibration, human_review=True)
    if policy.applies_to.steps is not None and step not in policy.applies_to.steps:
        raise PolicyError(f"policy {policy.name!r} does not apply to step {step!r}", file=policy.source, field="applies_to.steps")
    return IntentRouter(
        guard,
        policy,
        choices[0],
        routes=routes or {label: label for label in labels},
        fallback=fallback,
        step=step,
        state_key=state_key,
        human_review=human_review,
    )


def _inline_policy(question: Choice, *, threshold: float, step: str, messages: int) -> Policy:
    data = {
        "version": 1,
        "name": "inline-route",
        "applies_to": {"tools": ["route"], "steps": [step], "phase": "route"},
        "state": {"tool_call": False, "messages": messages},
        "questions": {"route": question.model_dump()},
        "thresholds": {"confidence": threshold},
        "rules": [{"id": "unsure", "when": "answers.route.confidence < thresholds.confidence", "then": "escalate"}],
    }
    return parse_policy(yaml.safe_dump(data, sort_keys=False), source="<intent_router>")


def _last_ai_message(state: Mapping[str, Any], key: str) -> AIMessage:
    for message in reversed(state.get(key, [])):
        if isinstance(message, AIMessage):
            return message
    raise PolicyError("the guard node needs an AI message with tool calls in the state", field=key)


__all__ = ["GuardedMessagesState", "IntentRouter", "guard_node", "guarded_tool_node", "intent_router"]
