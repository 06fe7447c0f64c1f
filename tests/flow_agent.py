"""A small agent for flow tests: real tools, a scripted model, the shipped flow policies, a SQLite checkpointer.

Run as a script it plays one step of a conversation in its own process (``start`` or
``resume``) and prints the thread's trail and what the mailbox sent, as JSON.
"""

from __future__ import annotations

import json
import sqlite3
import sys
from typing import Any

from clef_guard.integrations.langchain import GuardMiddleware
from clef_guard.integrations.testing import ScriptedChatModel
from langchain.agents import create_agent
from langchain_core.tools import tool
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.types import Command

from clef_guard import Guard, load_policies

SECRET = "AKIAQWERTYUIOPASDFGH"
OUTBOX: list[dict[str, str]] = []


@tool
def read_file(path: str) -> str:
    """Read a text file from the workspace."""
    return f"# deploy settings\nregion = eu-west-1\naws_access_key_id = {SECRET}\n" if path.endswith(".env") else "hello"


@tool
def send_email(to: str, body: str) -> str:
    """Send an email."""
    OUTBOX.append({"to": to, "body": body})
    return f"sent to {to}"


def agent(turns: list[Any], checkpointer: Any, guard: Guard | None = None) -> Any:
    """A ``create_agent`` graph that replays ``turns`` behind the shipped flow policies."""
    guard = guard or Guard(load_policies("secret-egress", "untrusted-then-act"), human_review=True)
    return create_agent(
        ScriptedChatModel(turns=turns), [read_file, send_email], middleware=[GuardMiddleware(guard)], checkpointer=checkpointer
    )


SCRIPT = [
    [("read_file", {"path": "deploy/.env"})],
    [("send_email", {"to": "ops@example.com", "body": "Deploy settings checked."})],
    [("send_email", {"to": "ops@example.com", "body": f"key: {SECRET.lower()}"})],
]


def main(database: str, step: str) -> None:
    """Play ``step`` of :data:`SCRIPT` on the thread kept in ``database``."""
    connection = sqlite3.connect(database, check_same_thread=False)
    graph = agent(SCRIPT, SqliteSaver(connection))
    config = {"configurable": {"thread_id": "flow"}}
    if step == "start":
        graph.invoke({"messages": [{"role": "user", "content": "Check the deploy settings and tell ops."}]}, config)
    else:
        graph.invoke(Command(resume={"type": "approve"}), config)
    state = graph.get_state(config)
    print(json.dumps({"trail": state.values.get("clef_guard_trail"), "outbox": OUTBOX, "interrupted": bool(state.interrupts)}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
