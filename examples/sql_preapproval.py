"""Example 3: a pre-approval gate for destructive SQL in a hand-built LangGraph.

    python examples/sql_preapproval.py

`guard_node` sits between the model and a plain `ToolNode`: read-only statements pass
untouched (the policy does not even apply), statements that wipe a database are denied
outright, and statements that change every row or drop a table wait for a person.
The reviewer here is scripted: it rejects the DROP TABLE and approves a bounded UPDATE.
"""

from __future__ import annotations

import sqlite3
import sys
import tempfile
from pathlib import Path
from typing import Annotated, TypedDict

sys.path.insert(0, str(Path(__file__).parent))

from _demo import ScriptedChatModel, console, print_verdict
from clef_guard.integrations.langgraph import guard_node
from langchain_core.messages import AnyMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import ToolNode
from langgraph.types import Command

from clef_guard import Guard, LocalDecisionModel, load_policy

POLICY = Path(__file__).parent.parent / "policies" / "destructive-actions.yaml"
STATEMENTS = [
    "SELECT count(*) FROM customers",
    "DROP DATABASE main",
    "DROP TABLE customers",
    "UPDATE customers SET tier = 'gold'",
]


class State(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        db = sqlite3.connect(Path(tmp) / "crm.db", check_same_thread=False)
        db.execute("CREATE TABLE customers (id INTEGER PRIMARY KEY, tier TEXT)")
        db.executemany("INSERT INTO customers (tier) VALUES (?)", [("basic",)] * 5)
        db.commit()

        @tool
        def run_sql(query: str) -> str:
            """Run one SQL statement on the CRM database."""
            cursor = db.execute(query)
            db.commit()
            return str(cursor.fetchall() if cursor.description else f"{cursor.rowcount} rows changed")

        with console.status("Loading the embedded engine..."):
            guard = Guard([load_policy(POLICY)], engine=LocalDecisionModel(), human_review=True, on_verdict=[print_verdict])
        model = ScriptedChatModel(turns=[[("run_sql", {"query": q})] for q in STATEMENTS] + ["Done."])
        builder = StateGraph(State)
        builder.add_node("agent", lambda state: {"messages": [model.invoke(state["messages"])]})
        builder.add_node("guard", guard_node(guard, tools_node="tools", back_to="agent"))
        builder.add_node("tools", ToolNode([run_sql]))
        builder.add_edge(START, "agent")
        builder.add_conditional_edges("agent", lambda s: "guard" if s["messages"][-1].tool_calls else END, ["guard", END])
        builder.add_edge("tools", "agent")
        graph = builder.compile(checkpointer=InMemorySaver())
        config = {"configurable": {"thread_id": "sql"}}

        result = graph.invoke({"messages": [HumanMessage("Clean up the CRM.")]}, config, version="v2")
        while result.interrupts:
            answers = {}
            for pending in result.interrupts:
                query = pending.value["args"]["query"]
                answers[pending.id] = (
                    {"type": "reject", "message": "Never drop the customers table."}
                    if query.startswith("DROP")
                    else {"type": "edit", "edited_action": {"name": "run_sql", "args": {"query": query + " WHERE id <= 2"}}}
                )
                console.print(f"[yellow]paused[/yellow] {query!r}: the reviewer answers {answers[pending.id]['type']}", highlight=False)
            result = graph.invoke(Command(resume=answers), config, version="v2")
        for message in result.value["messages"]:
            if isinstance(message, ToolMessage):
                console.print(f"{'ran' if message.status == 'success' else 'not run'}: {message.text[:100]}", highlight=False)
        console.print(f"customers by tier: {db.execute('SELECT tier, count(*) FROM customers GROUP BY tier').fetchall()}")
        db.close()


if __name__ == "__main__":
    main()
