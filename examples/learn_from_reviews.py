"""Learn from the people who review: roll a policy out in shadow, log reviews, warm-start a head.

1. Shadow: the built-in destructive-actions policy watches an agent's calls and blocks
   nothing; the audit says what it would have done.
2. Enforced, with a review log: confirmations interrupt, a scripted reviewer answers
   (approving some calls, rejecting others, correcting one answer), and every answer
   becomes a labelled row with the backbone's reading of the call (its features).
3. ``clef-guard train --data reviews.jsonl --init-head default`` warm-starts the shipped
   head on those rows' features, replaying the sample of training rows the shipped head
   carries, and the new head answers "should this run without asking?". (Once a question
   has 20 answers in the log, it also gets a readout of its own: docs/training.md#readouts.)

    python examples/learn_from_reviews.py
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from _demo import ScriptedChatModel, console, print_verdict
from clef_guard.integrations.langchain import GuardMiddleware
from langchain.agents import create_agent
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.types import Command

from clef_guard import Guard, LocalDecisionModel, load_policies
from clef_guard.cli import main as clef_guard_cli
from clef_guard.telemetry.reviews import SHOULD_RUN, ReviewLog

CALLS = [
    [("remove_file", {"path": "build/cache/objects.bin"})],
    [("remove_file", {"path": "reports/2026-q3-board.pdf"})],
    [("truncate_table", {"table": "session_tokens"})],
    [("remove_file", {"path": "tmp/render-7.png"})],
]
REVIEWER = {  # what a person answers, by the call's first argument
    "build/cache/objects.bin": {"type": "approve"},
    "reports/2026-q3-board.pdf": {"type": "reject", "message": "keep board reports", "corrections": {"requested": False}},
    "session_tokens": {"type": "approve"},
    "tmp/render-7.png": {"type": "approve"},
}
PAST = {"approve": "approved", "reject": "rejected", "edit": "edited", "respond": "answered instead"}


def _tools(removed: list[str]) -> list[Any]:
    @tool
    def remove_file(path: str) -> str:
        """Remove a file from the team share."""
        removed.append(path)
        return f"removed {path}"

    @tool
    def truncate_table(table: str) -> str:
        """Delete every row of a database table."""
        removed.append(table)
        return f"emptied {table}"

    return [remove_file, truncate_table]


def run(engine: LocalDecisionModel, mode: str, review_log: ReviewLog | None) -> list[str]:
    """The agent's conversation under a guard in ``mode``; returns what its tools removed."""
    guard = Guard(load_policies("destructive-actions"), engine=engine, human_review=True, mode=mode, on_verdict=[print_verdict])
    middleware = GuardMiddleware(guard, **({"review_log": review_log} if review_log else {}))
    removed: list[str] = []
    agent = create_agent(ScriptedChatModel(turns=CALLS), _tools(removed), middleware=[middleware], checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": mode}}
    result = agent.invoke({"messages": [("user", "Free some space on the team share.")]}, config, version="v2")
    while result.interrupts:
        pending = result.interrupts[0]
        answer = REVIEWER[next(iter(pending.value["args"].values()))]
        console.print(f"  the reviewer answers {answer}", style="cyan")
        result = agent.invoke(Command(resume={pending.id: answer}), config, version="v2")
    return removed


def main() -> None:
    engine = LocalDecisionModel()
    with tempfile.TemporaryDirectory() as folder:
        reviews = Path(folder) / "reviews.jsonl"
        console.rule("1. Shadow: nothing is blocked, the audit says what would have been")
        console.print(f"removed: {run(engine, 'shadow', None)}")
        console.rule("2. Enforced, every review logged")
        # Features are what training reads; the states are kept here only to ask the new head again below.
        console.print(f"removed: {run(engine, 'enforce', ReviewLog(reviews, record_features=True, record_states=True))}")
        rows = [json.loads(line) for line in reviews.read_text().splitlines()]
        for row in rows:
            console.print(f"  row: {row['tool']} {row['decision']} -> labels {row['labels']}", highlight=False)
        console.rule("3. Warm-start the shipped head on the reviews")
        out = Path(folder) / "head"
        clef_guard_cli(["train", "--data", str(reviews), "--init-head", "default", "--out", str(out), "--epochs", "40"])
        tuned = LocalDecisionModel(head=str(out / "decision_head.safetensors"))
        console.print("P(should run without asking), on the reviewed calls the head just learned from:")
        for row in rows:
            request = {"state": row["state"], "questions": {"should_run": SHOULD_RUN}}
            before, after = (model.invoke(request).nouls["should_run"].noul for model in (engine, tuned))
            console.print(f"  {row['tool']} ({PAST[row['decision']]}): shipped head {before:.2f}, after the reviews {after:.2f}", highlight=False)


if __name__ == "__main__":
    main()
