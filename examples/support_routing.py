"""Example 2: a hand-built LangGraph that routes support requests by intent.

    python examples/support_routing.py

The `triage` node asks the shipped support-routing policy's `choice` on the embedded
engine. Each team in the policy lists a few example requests, so the sentence encoder reads
the choice (few-shot routing, no backbone pass: milliseconds a route), and `other` is
"none of these": it wins when no team is close. The conditional edge goes to the chosen
team when the policy trusts the answer (its confidence clears the calibratable
`route_confidence` threshold, and it is not `other`), and to a human queue otherwise. A
customer who wants to leave goes to a person whatever the team: the policy's yes/no question
"Is the customer trying to leave?" is read by the encoder too. The whole answer stays in the
graph state under `intent`. None of these requests is one of the policy's examples.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any, TypedDict

sys.path.insert(0, str(Path(__file__).parent))

from _demo import console
from clef_guard.integrations.langgraph import intent_router
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages

from clef_guard import LocalDecisionModel

POLICY = Path(__file__).parent.parent / "policies" / "support-routing.yaml"
TEAMS = ("billing", "technical", "account", "sales")


class State(TypedDict, total=False):
    messages: Annotated[list[AnyMessage], add_messages]
    intent: dict[str, Any]


def build(engine: LocalDecisionModel) -> Any:
    router = intent_router(
        policy=POLICY,
        engine=engine,
        step="triage",
        routes={team: team for team in TEAMS} | {"other": "human"},
        fallback="human",
    )
    builder = StateGraph(State)
    builder.add_node("triage", router.node)
    for team in (*TEAMS, "human"):
        builder.add_node(team, lambda state, team=team: {"messages": [AIMessage(f"[{team} queue] picked up the request")]})
        builder.add_edge(team, END)
    builder.add_edge(START, "triage")
    builder.add_conditional_edges("triage", router, [*TEAMS, "human"])
    return builder.compile()


REQUESTS = [
    "My card was debited two times for the same order, can you give one back?",
    "Every time I open a report the page goes blank.",
    "I got a new phone and now I can't get into my account.",
    "How much would the enterprise tier cost for 200 people?",
    "Can you recommend a good book for the weekend?",
    "I want to stop paying for this, how do I get out?",
]


def main() -> None:
    with console.status("Loading the embedded engine..."):
        graph = build(LocalDecisionModel())
    for text in REQUESTS:
        state = graph.invoke({"messages": [HumanMessage(text)]})
        intent = state["intent"]
        probabilities = ", ".join(f"{k} {v:.2f}" for k, v in intent["answer"]["probabilities"].items())
        trusted = "trusted" if intent["confident"] else f"not trusted ({intent['rule']})"
        console.print(f"[bold]{text}[/bold]\n  -> {intent['route']}: {intent['label']} {trusted}; {probabilities}", highlight=False)


if __name__ == "__main__":
    main()
