"""The review log: a person's answers to confirmations become rows that train and calibrate read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from clef_guard.integrations.langchain import GuardMiddleware
from clef_guard.integrations.testing import ScriptedChatModel
from langchain.agents import create_agent
from langchain_core.decisions import BaseDecisionModel
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.types import Command
from model import ScriptedDecisionModel
from test_langchain_middleware import POLICY, _tools

from clef_guard import Guard, LocalDecisionModel, parse_policy
from clef_guard.cli import main
from clef_guard.engine.head import HEAD_FILE, HIDDEN_WIDTH, DecisionHead
from clef_guard.engine.local import DEFAULT_HEAD
from clef_guard.engine.requests import parse_questions
from clef_guard.engine.state import state_segments
from clef_guard.engine.tree import OptionFeatures
from clef_guard.telemetry.reviews import ReviewLog
from clef_guard.training.fit import WARM_ANCHOR, WARM_MEMBERS

CALLS = [[("write_note", {"name": "ask-1.txt", "text": "a"})], [("write_note", {"name": "ask-2.txt", "text": "b"})]]


def _reviewed(
    folder: Path, log: ReviewLog, answers: list[dict[str, Any]], engine: BaseDecisionModel | None = None, **guard_kwargs: Any
) -> None:
    engine = engine or ScriptedDecisionModel(script={"delete": 0.3})
    guard = Guard([parse_policy(POLICY)], engine=engine, human_review=True, **guard_kwargs)
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
    # the `ask` rule decides on the call alone: every_question, so that the rows carry the engine's answer too
    reviews = [{"type": "approve", "corrections": {"destructive": False, "nope": True}}, {"type": "reject"}]
    _reviewed(tmp_path, ReviewLog(log), reviews, every_question=True)
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
    report = json.loads((out / "train_report.json").read_text())
    assert report["n"] == 2  # should_run of each row; the replayed row once
    assert report["config"]["members"] == WARM_MEMBERS  # a warm start averages seeds by default
    assert report["config"]["anchor"] == WARM_ANCHOR  # and is pulled towards the head it starts from
    warmed = DecisionHead.load(out / HEAD_FILE, 576)
    assert set(DecisionHead.load(DEFAULT_HEAD, 576).questions) < set(warmed.questions)  # the old questions and the reviews' own
    again = tmp_path / "again"  # next week's warm start from this one: an average is warm-started as one head, no wider
    assert main(["train", "--data", str(log), "--init-head", str(out / HEAD_FILE), "--out", str(again), "--epochs", "2", "--json",
                 "--anchor", "0", "--features", str(tmp_path / "cache")]) == 0
    assert DecisionHead.load(again / HEAD_FILE, 576).width == warmed.width == WARM_MEMBERS * HIDDEN_WIDTH
    assert json.loads((again / "train_report.json").read_text())["config"]["anchor"] == 0  # --anchor 0: no pull
    assert main([*command, "--members", "0", "--features", str(tmp_path / "cache")]) != 0


def test_features_are_what_the_backbone_read_and_train_a_head_without_any_state(
    tmp_path: Path, engine: LocalDecisionModel, capsys: pytest.CaptureFixture[str]
) -> None:
    """With record_features the log keeps the backbone's reading instead of the text: a warm start reads no backbone."""
    both, alone = tmp_path / "both.jsonl", tmp_path / "features.jsonl"
    answers = [{"type": "approve", "corrections": {"destructive": False}}, {"type": "reject"}]
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    _reviewed(tmp_path / "a", ReviewLog(both, record_states=True, record_features=True), answers, engine)
    _reviewed(tmp_path / "b", ReviewLog(alone, record_features=True), answers, engine)
    rows = [json.loads(line) for line in both.read_text().splitlines()]
    for row in rows:
        assert row["features"]["backbone"] == engine.feature_key and set(row["features"]["questions"]) == set(row["questions"])
        for question in parse_questions(row["questions"]):
            logged = OptionFeatures.from_record(row["features"]["questions"][question.id], question)
            (read,) = engine.encode(row["state"], [question]).features
            assert logged.reading == read.reading
            assert torch.allclose(logged.hidden, read.hidden, rtol=2e-3, atol=2e-2)  # float16, as training caches them
            assert torch.allclose(logged.lm_logprob, read.lm_logprob, atol=1e-4)
    featured = [json.loads(line) for line in alone.read_text().splitlines()]
    assert all("state" not in row and "features" in row for row in featured)
    out, cache = tmp_path / "head", tmp_path / "cache"
    command = ["train", "--data", str(alone), "--init-head", "default", "--out", str(out), "--epochs", "2", "--json"]
    assert main([*command, "--features", str(cache)]) == 0
    report = json.loads((out / "train_report.json").read_text())
    assert (report["n"], report["read_with_the_backbone"]) == (3, 0)  # should_run twice, the correction once
    assert not cache.exists()  # nothing was read with the backbone
    for row in featured:  # another backbone's features are not this one's: without a state, nothing to learn from
        row["features"]["backbone"] = "another"
    alone.write_text("".join(json.dumps(row) + "\n" for row in featured))
    assert main([*command, "--features", str(cache)]) != 0
    assert "no examples" in capsys.readouterr().err
