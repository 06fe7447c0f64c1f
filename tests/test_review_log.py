"""The review log: a person's answers to confirmations become rows that train and calibrate read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from clef_guard.integrations.langchain import GuardMiddleware
from clef_guard.integrations.testing import ScriptedChatModel
from langchain.agents import create_agent
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.types import Command
from model import ScriptedDecisionModel
from test_langchain_middleware import POLICY, _tools

from clef_guard import Guard, parse_policy
from clef_guard.cli import main
from clef_guard.engine.state import state_segments
from clef_guard.telemetry.reviews import ReviewLog

CALLS = [[("write_note", {"name": "ask-1.txt", "text": "a"})], [("write_note", {"name": "ask-2.txt", "text": "b"})]]


def _reviewed(folder: Path, log: ReviewLog, answers: list[dict[str, Any]]) -> None:
    guard = Guard([parse_policy(POLICY)], engine=ScriptedDecisionModel(script={"delete": 0.3}), human_review=True)
    agent = create_agent(ScriptedChatModel(turns=CALLS), _tools(folder), middleware=[GuardMiddleware(guard, review_log=log)],
                         checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "review"}}
    result = agent.invoke({"messages": [("user", "write two notes")]}, config, version="v2")
    for answer in answers:
        (pending,) = result.interrupts
        result = agent.invoke(Command(resume={pending.id: answer}), config, version="v2")
    assert not result.interrupts


def test_each_answer_is_one_row_with_labels_and_no_state_unless_asked(tmp_path: Path) -> None:
    log = tmp_path / "reviews.jsonl"
    _reviewed(tmp_path, ReviewLog(log), [{"type": "approve", "corrections": {"destructive": False, "nope": True}}, {"type": "reject"}])
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(r["tool"], r["policy"], r["rule"], r["decision"]) for r in rows] == [
        ("write_note", "files", "ask", "approve"), ("write_note", "files", "ask", "reject")
    ]
    assert [r["labels"] for r in rows] == [{"should_run": "yes", "destructive": False}, {"should_run": "no"}]
    assert set(rows[0]["questions"]) == {"should_run", "destructive"} and rows[0]["answers"]["destructive"]["noul"] == 0.3
    assert all("state" not in r and r["thread"] for r in rows)
    assert (tmp_path / "ask-1.txt").exists() and not (tmp_path / "ask-2.txt").exists()


def test_rows_with_states_train_a_head_and_a_replayed_review_is_written_once(tmp_path: Path) -> None:
    log = tmp_path / "reviews.jsonl"
    reviews = ReviewLog(log, record_states=True)
    _reviewed(tmp_path, reviews, [{"type": "approve"}, {"type": "edit", "edited_action": {"name": "write_note", "args": {"name": "x.txt", "text": "c"}}}])
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["labels"]["should_run"] for r in rows] == ["yes", "no"]
    seen = rows[1]["state"]
    assert seen["tool"]["args"] == {"name": "ask-2.txt", "text": "b"}
    read = state_segments(seen)  # messages in dict form read exactly as the engine read them
    assert "user: write two notes" in read and 'tool_call write_note {"name": "ask-2.txt", "text": "b"}' in "\n".join(read)
    with log.open("a") as handle:  # a resume replayed in another process writes its row again
        handle.write(json.dumps(rows[0]) + "\n")
    out = tmp_path / "head"
    command = ["train", "--data", str(log), "--init-head", "default", "--out", str(out), "--epochs", "2", "--json"]
    assert main([*command, "--features", str(tmp_path / "cache")]) == 0
    assert json.loads((out / "train_report.json").read_text())["n"] == 2  # should_run of each row; the replayed row once
