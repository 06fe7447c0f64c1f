"""The review log: every answer a person gives to a confirm or an escalation, as rows a head can learn from.

Each row is one reviewed verdict, written as ``clef-guard train --data`` and ``calibrate
--data`` read rows (``{state, questions, labels}``) plus what happened::

    {"id", "time", "thread", "tool", "policy", "rule", "action", "decision",
     "answers": {qid: the engine's answer}, "questions": {qid: question}, "labels": {qid: label},
     "state": what the engine read (only with record_states=True),
     "features": what the backbone read of it, per question (only with record_features=True)}

How an answer becomes labels: every row of a reviewed call asks :data:`SHOULD_RUN` of it,
labelled ``yes`` when the reviewer approved it unchanged and ``no`` when they edited,
rejected or answered in its place; a reviewed tool result (an ``after_tool`` escalation)
asks :data:`SHOULD_READ` of the window the policy found suspicious, ``yes`` when the
reviewer let the agent read it. A reviewer may also correct the policy's own questions in the
resume payload (``{"type": "approve", "corrections": {"requested": true}}``); those
become labels of the deciding policy's questions. Nothing else is guessed from the rule
that fired. States hold private data, so they are written only when asked for. Features
(``record_features=True``, a local engine) are the backbone's reading of the state for each
question: vectors, not text, and all a head trains on, so a warm start from them reads no
backbone, and a log kept without states still teaches a head. Rows with neither are a
record of reviews, and training skips them.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from langchain_core.decisions import Noul

from clef_guard.engine.local import LocalDecisionModel
from clef_guard.engine.state import jsonable, to_json

if TYPE_CHECKING:
    from langchain_core.decisions import BaseDecisionModel

    from clef_guard.gate.verdict import Verdict

SHOULD_RUN = Noul(instructions="Should this tool call run without asking a person first?")
"""The question every reviewed call answers (``should_run`` in a row)."""
SHOULD_READ = Noul(instructions="Should the agent read this tool result without a person checking it first?")
"""The question every reviewed tool result answers (``should_read`` in a row)."""
REVIEW_QUESTIONS = {"should_run": SHOULD_RUN, "should_read": SHOULD_READ}
"""The review questions by row key: a call's, and a result's."""


class ReviewLog:
    """Appends reviewed verdicts to a JSONL file, one row per review (a replayed resume is written once)."""

    def __init__(self, path: str | Path, *, record_states: bool = False, record_features: bool = False) -> None:
        self.path = Path(path)
        self.record_states = record_states
        self.record_features = record_features
        self._lock = threading.Lock()
        self._written: set[str] = set()

    @property
    def reads_state(self) -> bool:
        """Whether a row needs the state the engine read (to write it, or its features)."""
        return self.record_states or self.record_features

    def record(
        self,
        verdict: Verdict,
        decision: Mapping[str, Any],
        *,
        questions: Mapping[str, Any],
        state: Any = None,
        thread: str = "",
        engine: BaseDecisionModel | None = None,
        asks: str = "should_run",
    ) -> dict[str, Any] | None:
        """Write the row of ``verdict`` answered by ``decision``.

        ``questions`` are the deciding policy's, ``state`` what the engine read for it, and
        ``engine`` the guard's (a :class:`LocalDecisionModel` reads the features; another
        engine's rows have none). A failure to read them leaves them out and names its kind
        in ``features_error``: the reviewer's answer is written all the same. ``asks``: the
        review question the answer labels (a key of :data:`REVIEW_QUESTIONS`).

        Returns the row, or ``None`` when this review was already written (a node re-run on resume).
        """
        kind = str(decision.get("type"))
        review = REVIEW_QUESTIONS[asks]
        key = to_json([thread, verdict.tool_call.get("id"), verdict.tool_call.get("args"), verdict.policy, kind, asks])
        row_id = hashlib.sha256(key.encode()).hexdigest()[:16]
        with self._lock:
            if row_id in self._written:
                return None
        deciding = next((d for d in verdict.decisions if d.policy == verdict.policy), None)
        corrections = decision.get("corrections") or {}
        answers = dict(deciding.answers) if deciding else {}
        row: dict[str, Any] = {
            "id": row_id,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "thread": thread,
            "tool": verdict.tool_call.get("name"),
            "policy": verdict.policy,
            "rule": verdict.rule,
            "action": verdict.action,
            "decision": kind,
            "answers": {qid: answer.model_dump(mode="json") for qid, answer in answers.items()},
            "questions": {asks: review.model_dump(mode="json"), **{q: v.model_dump(mode="json") for q, v in questions.items()}},
            "labels": {
                asks: "yes" if kind == "approve" else "no",
                **{str(qid): value for qid, value in corrections.items() if qid in questions},
            },
        }
        if self.record_states:
            row["state"] = jsonable(state)
        if self.record_features and state is not None and isinstance(engine, LocalDecisionModel):
            try:
                row["features"] = engine.feature_record(state, {asks: review, **questions})
            except Exception as exc:  # the review stands without them
                row["features_error"] = type(exc).__name__
        with self._lock:
            if row_id in self._written:
                return None
            self._written.add(row_id)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
                handle.flush()
                os.fsync(handle.fileno())
        return row

