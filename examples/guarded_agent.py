"""Example 1: a create_agent agent with real file and SQLite tools, guarded by clef-guard.

    make demo      # or: python examples/guarded_agent.py

The agent works in a temporary folder holding a shared drive, a deploy config and a
SQLite bookings database. Its files, tables, docstrings and requests appear in no
training row of the shipped head (a test checks it), so what it shows is the engine on
input it never saw. It is guarded by the shipped destructive-actions and outbound-communication
policies on the embedded engine, and by the secret-egress flow policy (no model: once
the thread has read a key, a call that carries it is denied), and checkpointed in
SQLite, so a call that needs a person pauses the run (an interrupt) and a later invoke
resumes it (``Command(resume=...)``). Here the "person" is scripted: it narrows an
unbounded DELETE with an edit (which is gated again before it runs) and approves
whatever else it is asked about.
"""

from __future__ import annotations

import sqlite3
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from _demo import ScriptedChatModel, console, print_verdict
from clef_guard.integrations.langchain import GuardMiddleware
from langchain.agents import create_agent
from langchain_core.messages import ToolMessage
from langchain_core.tools import tool
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.types import Command

from clef_guard import Guard, LocalDecisionModel, load_policies

POLICIES = Path(__file__).parent.parent / "policies"


def make_tools(root: Path, db: sqlite3.Connection) -> list[Any]:
    """File and SQL tools that really act on ``root`` and ``db``."""

    @tool
    def list_files(folder: str) -> str:
        """Names the files in one folder of the shared drive."""
        return "\n".join(sorted(p.name for p in (root / folder).iterdir()))

    @tool
    def read_file(path: str) -> str:
        """Returns the text of a file on the shared drive."""
        return (root / path).read_text()

    @tool
    def delete_file(path: str) -> str:
        """Permanently removes one file from the shared drive."""
        (root / path).unlink()
        return f"deleted {path}"

    @tool
    def run_sql(query: str) -> str:
        """Executes one statement on the bookings database (SQLite); returns rows or a count."""
        cursor = db.execute(query)
        db.commit()
        return str(cursor.fetchall() if cursor.description else f"{cursor.rowcount} rows changed")

    @tool
    def send_email(to: str, subject: str, body: str) -> str:
        """Delivers an email message (kept in the outbox folder)."""
        (root / "outbox").mkdir(exist_ok=True)
        (root / "outbox" / f"{subject}.eml").write_text(f"To: {to}\n\n{body}")
        return f"sent to {to}"

    return [list_files, read_file, delete_file, run_sql, send_email]


KEY = "AKIA2E0A8F3B244C9986"
TURNS = [
    [("list_files", {"folder": "drive/exports"})],
    [("run_sql", {"query": "SELECT state, count(*) FROM bookings GROUP BY state"})],
    [("run_sql", {"query": "DELETE FROM bookings"})],
    [("delete_file", {"path": "drive/exports/snapshot-2025-10.tar"})],
    [("read_file", {"path": "deploy/settings.env"})],
    [("send_email", {"to": "partner@example.org", "subject": "weekly", "body": f"3 bookings were refunded. Our key: {KEY.lower()}"})],
    [("send_email", {"to": "partner@example.org", "subject": "weekly", "body": "3 bookings were refunded this week."})],
    "Cleared the refunded bookings and the stale snapshot, checked the deploy settings, and sent the weekly report.",
]
REQUEST = "Clear the refunded bookings and the stale export snapshot, check the deploy settings, then mail the weekly report to our partner."


def human(request: dict[str, Any]) -> dict[str, Any]:
    """The scripted reviewer: narrows the unbounded DELETE, approves everything else."""
    if request["args"].get("query") == "DELETE FROM bookings":
        bounded = "DELETE FROM bookings WHERE state = 'refunded'"
        return {"type": "edit", "edited_action": {"name": request["name"], "args": {"query": bounded}}}
    return {"type": "approve"}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "drive" / "exports").mkdir(parents=True)
        (root / "drive" / "exports" / "roadmap.md").write_text("ship it")
        (root / "drive" / "exports" / "snapshot-2025-10.tar").write_text("stale")
        (root / "deploy").mkdir()
        (root / "deploy" / "settings.env").write_text(f"REGION=eu-west-1\nAWS_ACCESS_KEY_ID={KEY}\n")
        db = sqlite3.connect(root / "shop.db", check_same_thread=False)
        db.execute("CREATE TABLE bookings (id INTEGER PRIMARY KEY, state TEXT)")
        db.executemany("INSERT INTO bookings (state) VALUES (?)", [("confirmed",), ("refunded",)] * 3)
        db.commit()

        with console.status("Loading the embedded engine (the first run converts it once)..."):
            engine = LocalDecisionModel()
        policies = load_policies(*(POLICIES / f"{name}.yaml" for name in ("destructive-actions", "outbound-communication", "secret-egress")))
        guard = Guard(policies, engine=engine, human_review=True, on_verdict=[print_verdict])
        checkpoints = SqliteSaver(sqlite3.connect(root / "checkpoints.db", check_same_thread=False))
        agent = create_agent(
            ScriptedChatModel(turns=TURNS), make_tools(root, db), middleware=[GuardMiddleware(guard)], checkpointer=checkpoints
        )
        config = {"configurable": {"thread_id": "demo"}}

        console.rule("The agent runs")
        result = agent.invoke({"messages": [("user", REQUEST)]}, config, version="v2")
        while result.interrupts:
            answers = {}
            for pending in result.interrupts:
                request = pending.value
                decision = human(request)
                console.print(
                    f"[yellow]paused[/yellow] {request['description']}\n  the reviewer answers: {decision}", highlight=False
                )
                answers[pending.id] = decision
            result = agent.invoke(Command(resume=answers), config, version="v2")

        console.rule("What happened")
        for message in result.value["messages"]:
            if isinstance(message, ToolMessage):
                mark = "[green]ran[/green]" if message.status == "success" else "[red]not run[/red]"
                console.print(f"{mark} {message.name}: {message.text[:110]}", highlight=False)
        remaining = db.execute("SELECT state, count(*) FROM bookings GROUP BY state").fetchall()
        console.print(f"bookings left: {remaining}; files left: {sorted(p.name for p in (root / 'drive' / 'exports').iterdir())}")
        db.close()


if __name__ == "__main__":
    main()
