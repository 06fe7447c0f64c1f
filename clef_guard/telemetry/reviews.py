"""The review log: every answer a person gives to a confirm or an escalation, as rows a head can learn from.

Each row is one reviewed verdict, written as ``clef-guard train --data`` and ``calibrate
--data`` read rows (``{state, questions, labels}``) plus what happened::

    {"id", "time", "thread", "tool", "policy", "rule", "action", "decision",
     "answers": {qid: the engine's answer}, "questions": {qid: question}, "labels": {qid: label},
     "state": what the engine read (only with record_states=True)}

How an answer becomes labels: every row asks :data:`SHOULD_RUN` of the call, labelled
``yes`` when the reviewer approved it unchanged and ``no`` when they edited, rejected or
answered in its place. A reviewer may also correct the policy's own questions in the
resume payload (``{"type": "approve", "corrections": {"requested": true}}``); those
become labels of the deciding policy's questions. Nothing else is guessed from the rule
that fired. States hold private data, so they are written only when asked for; rows
without a state are a record of reviews, and training skips them.
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

from clef_guard.engine.state import jsonable, to_json

if TYPE_CHECKING:
    from clef_guard.gate.verdict import Verdict

SHOULD_RUN = Noul(instructions="Should this tool call run without asking a person first?")
"""The question every reviewed call answers (``should_run`` in a row)."""


class ReviewLog:
    """Appends reviewed verdicts to a JSONL file, one row per review (a replayed resume is written once)."""

    def __init__(self, path: str | Path, *, record_states: bool = False) -> None:
        self.path = Path(path)
        self.record_states = record_states
        self._lock = threading.Lock()
        self._written: set[str] = set()

    def record(
        self, verdict: Verdict, decision: Mapping[str, Any], *, questions: Mapping[str, Any], state: Any = None, thread: str = ""
    ) -> dict[str, Any] | None:
        """Write the row of ``verdict`` answered by ``decision``.

        ``questions`` are the deciding policy's, ``state`` what the engine read for it.

        Returns the row, or ``None`` when this review was already written (a node re-run on resume).
        """
        deciding = next((d for d in verdict.decisions if d.policy == verdict.policy), None)
        kind = str(decision.get("type"))
        key = to_json([thread, verdict.tool_call.get("id"), verdict.tool_call.get("args"), verdict.policy, kind])
        row_id = hashlib.sha256(key.encode()).hexdigest()[:16]
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
            "questions": {"should_run": SHOULD_RUN.model_dump(mode="json"), **{q: v.model_dump(mode="json") for q, v in questions.items()}},
            "labels": {
                "should_run": "yes" if kind == "approve" else "no",
                **{str(qid): value for qid, value in corrections.items() if qid in questions},
            },
        }
        if self.record_states:
            row["state"] = jsonable(state)
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

