"""LangGraph: guarded ToolNode, guard node before a plain ToolNode, intent routing; real graphs."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Annotated, Any, TypedDict

import pytest
from clef_guard.integrations.langgraph import (
    guard_node,
    guarded_tool_node,
    intent_router,
)
from clef_guard.integrations.testing import ScriptedChatModel
from langchain_core.decisions import Choice
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import ToolNode
from langgraph.types import Command
from model import ScriptedDecisionModel
from test_langchain_middleware import POLICY

from clef_guard import Guard, LocalDecisionModel, parse_policy

CONFIG = {"configurable": {"thread_id": "g"}}


class State(TypedDict, total=False):
    messages: Annotated[list[AnyMessage], add_messages]
    intent: dict[str, Any]


def _tools(folder: Path) -> list[Any]:
    @tool
    def write_note(name: str, text: str) -> str:
        """Write a note file."""
        (folder / name).write_text(text)
        return f"wrote {name}"

    return [write_note]


def _graph(folder: Path, turns: list[Any], *, with_guard_node: bool, checkpointer: Any = None) -> Any:
    guard = Guard([parse_policy(POLICY)], engine=ScriptedDecisionModel(), human_review=True)
    model = ScriptedChatModel(turns=turns)
    builder = StateGraph(State)
    builder.add_node("agent", lambda state: {"messages": [model.invoke(state["messages"])]})
    builder.add_edge(START, "agent")
    if with_guard_node:
        builder.add_node("guard", guard_node(guard, tools_node="tools", back_to="agent"))
        builder.add_node("tools", ToolNode(_tools(folder)))
        builder.add_conditional_edges("agent", lambda s: "guard" if s["messages"][-1].tool_calls else END, ["guard", END])
    else:
        builder.add_node("tools", guarded_tool_node(_tools(folder), guard))
        builder.add_conditional_edges("agent", lambda s: "tools" if s["messages"][-1].tool_calls else END, ["tools", END])
    builder.add_edge("tools", "agent")
    return builder.compile(checkpointer=checkpointer or InMemorySaver())


def _tool_statuses(state: dict[str, Any]) -> dict[str, str]:
    return {m.tool_call_id: m.status for m in state["messages"] if isinstance(m, ToolMessage)}


@pytest.mark.parametrize("with_guard_node", [False, True])
def test_allow_runs_and_deny_never_runs(tmp_path: Path, with_guard_node: bool) -> None:
    (tmp_path / "keep.txt").write_text("precious")
    turns = [[("write_note", {"name": "keep.txt", "text": "gone"}), ("write_note", {"name": "new.txt", "text": "hi"})]]
    result = _graph(tmp_path, turns, with_guard_node=with_guard_node).invoke({"messages": [HumanMessage("go")]}, CONFIG)
    assert (tmp_path / "keep.txt").read_text() == "precious"
    assert (tmp_path / "new.txt").read_text() == "hi"
    assert _tool_statuses(result) == {"call-0-0": "error", "call-0-1": "success"}


@pytest.mark.parametrize("with_guard_node", [False, True])
@pytest.mark.parametrize(
    ("decision", "expected"),
    [
        ({"type": "approve"}, "draft"),
        ({"type": "reject"}, None),
        ({"type": "edit", "edited_action": {"name": "write_note", "args": {"name": "ask.txt", "text": "edited"}}}, "edited"),
    ],
)
def test_confirm_round_trip_through_a_sqlite_checkpointer(tmp_path: Path, with_guard_node: bool, decision: dict, expected: str | None) -> None:
    connection = sqlite3.connect(tmp_path / "checkpoints.db", check_same_thread=False)
    turns = [[("write_note", {"name": "ask.txt", "text": "draft"})]]
    graph = _graph(tmp_path, turns, with_guard_node=with_guard_node, checkpointer=SqliteSaver(connection))
    paused = graph.invoke({"messages": [HumanMessage("go")]}, CONFIG, version="v2")
    (pending,) = paused.interrupts
    assert pending.value["clef_guard"]["rule"] == "ask"
    assert not (tmp_path / "ask.txt").exists()
    # resume from a fresh graph on the same database, as a new process would
    resumed = _graph(tmp_path, turns, with_guard_node=with_guard_node, checkpointer=SqliteSaver(connection))
    resumed.invoke(Command(resume={pending.id: decision}), CONFIG, version="v2")
    connection.close()
    assert (tmp_path / "ask.txt").read_text() == expected if expected else not (tmp_path / "ask.txt").exists()


@pytest.mark.parametrize("with_guard_node", [False, True])
def test_edited_call_is_gated_again(tmp_path: Path, with_guard_node: bool) -> None:
    (tmp_path / "keep.txt").write_text("precious")
    graph = _graph(tmp_path, [[("write_note", {"name": "ask.txt", "text": "x"})]], with_guard_node=with_guard_node)
    (pending,) = graph.invoke({"messages": [HumanMessage("go")]}, CONFIG, version="v2").interrupts
    edit = {"type": "edit", "edited_action": {"name": "write_note", "args": {"name": "keep.txt", "text": "overwritten"}}}
    result = graph.invoke(Command(resume={pending.id: edit}), CONFIG, version="v2")
    assert (tmp_path / "keep.txt").read_text() == "precious"
    assert _tool_statuses(result.value) == {"call-0-0": "error"}


@pytest.mark.parametrize("with_guard_node", [False, True])
async def test_parallel_interrupts_keep_ids_async(tmp_path: Path, with_guard_node: bool) -> None:
    """In one graph node, interrupts surface one after another (create_agent sends each
    call to its own task, so there they come at once: see the middleware tests). Each
    has its own id, and its answer reaches its own call."""
    calls = [("write_note", {"name": "ask-1.txt", "text": "1"}), ("write_note", {"name": "ask-2.txt", "text": "2"})]
    graph = _graph(tmp_path, [calls], with_guard_node=with_guard_node)
    answers = {"ask-1.txt": {"type": "approve"}, "ask-2.txt": {"type": "reject"}}
    result = await graph.ainvoke({"messages": [HumanMessage("go")]}, CONFIG, version="v2")
    seen: dict[str, str] = {}
    while result.interrupts:
        seen.update({i.value["args"]["name"]: i.id for i in result.interrupts})
        resume = {i.id: answers[i.value["args"]["name"]] for i in result.interrupts}
        result = await graph.ainvoke(Command(resume=resume), CONFIG, version="v2")
    assert set(seen) == {"ask-1.txt", "ask-2.txt"} and len(set(seen.values())) == 2
    assert (tmp_path / "ask-1.txt").exists() and not (tmp_path / "ask-2.txt").exists()
    assert _tool_statuses(result.value) == {"call-0-0": "success", "call-0-1": "error"}


TRIAGE = Choice(
    instructions="Which team should handle the customer's request?",
    criteria={"billing": "Charges and refunds.", "technical": "Errors and outages."},
)


def _routing_graph(router: Any) -> Any:
    builder = StateGraph(State)
    builder.add_node("triage", router.node)
    for name in ("billing", "technical", "human"):
        builder.add_node(name, lambda state, name=name: {"messages": [AIMessage(f"{name} here")]})
        builder.add_edge(name, END)
    builder.add_edge(START, "triage")
    builder.add_conditional_edges("triage", router, ["billing", "technical", "human"])
    return builder.compile(checkpointer=InMemorySaver())


@pytest.mark.parametrize(("threshold", "confident"), [(0.0, True), (1.0, False)])
def test_intent_router_goes_to_the_choice_only_when_confident(engine: LocalDecisionModel, threshold: float, confident: bool) -> None:
    router = intent_router(question=TRIAGE, engine=engine, threshold=threshold, fallback="human", step="triage")
    result = _routing_graph(router).invoke({"messages": [HumanMessage("I was charged twice for my order")]}, CONFIG)
    intent = result["intent"]
    assert intent["confident"] is confident
    assert set(intent["answer"]["probabilities"]) == {"billing", "technical"}
    expected = intent["label"] if confident else "human"
    assert intent["route"] == expected and result["messages"][-1].text == f"{expected} here"


def test_intent_router_can_ask_a_person(engine: LocalDecisionModel) -> None:
    router = intent_router(question=TRIAGE, engine=engine, threshold=1.0, fallback="human", step="triage", human_review=True)
    graph = _routing_graph(router)
    (pending,) = graph.invoke({"messages": [HumanMessage("The app crashes")]}, CONFIG, version="v2").interrupts
    assert pending.value["type"] == "route_review" and pending.value["options"] == ["billing", "technical"]
    result = graph.invoke(Command(resume={pending.id: "technical"}), CONFIG, version="v2")
    assert result.value["intent"]["route"] == "technical" and result.value["messages"][-1].text == "technical here"


@pytest.mark.parametrize(
    ("text", "label", "route", "rule"),
    [
        ("Refund my last invoice, the amount was wrong.", "billing", "billing", None),
        ("Since the update the mobile app freezes on the login screen.", "technical", "technical", None),
        ("Please give me your best price for 30 licences.", "sales", "human", None),
        ("Who won the football match last night?", "other", "human", "unsure"),  # no team is close: escalated
        ("We are done with you, how do I get out of this contract?", "other", "human", "leaving"),  # a person talks to them
    ],
)
def test_intent_router_with_the_shipped_routing_policy(engine: LocalDecisionModel, text: str, label: str, route: str, rule: str | None) -> None:
    policy = Path(__file__).parent.parent / "policies" / "support-routing.yaml"
    routes = {"billing": "billing", "technical": "technical", "account": "human", "sales": "human", "other": "human"}
    router = intent_router(policy=policy, engine=engine, routes=routes, fallback="human", step="triage")
    result = _routing_graph(router).invoke({"messages": [HumanMessage(text)]}, CONFIG)
    intent = result["intent"]
    assert (intent["label"], intent["route"], intent["policy"]) == (label, route, "support-routing")
    assert intent["confident"] is (rule is None)
    assert intent["rule"] == rule
