"""A scripted decision model: answers chosen by the test, keyed by question instructions.

A stand-in for the engine where a test is about rules, not about the model. It is a
real ``BaseDecisionModel``, so it goes through the same invoke/ainvoke paths.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from langchain_core.decisions import (
    BaseDecisionModel,
    Choice,
    ClassifierResponse,
    Noul,
    Question,
    State,
)

from clef_guard.engine.answers import build_answer
from clef_guard.engine.requests import parse_questions
from clef_guard.engine.state import to_json


class BareDecisionModel(BaseDecisionModel):
    """A decision model of these tests' own (its provider is ``test``): subclasses answer in ``_classify``."""

    @property
    def _provider(self) -> str:
        return "test"


class ScriptedDecisionModel(BareDecisionModel):
    """Answers from ``script``: instruction substring -> P(yes) or option probabilities.

    A noul not in the script gets 0.5; a choice or score gets a uniform distribution.
    ``on_state`` maps a text in the state to the P(yes) of every noul, before ``script``.
    ``calls`` records every request; ``delay_s`` and ``fail`` simulate a slow or broken engine.
    """

    model: str = "scripted"
    script: dict[str, Any] = {}
    on_state: dict[str, float] = {}
    delay_s: float = 0.0
    fail: bool = False
    calls: list[dict[str, Any]] = []

    def _classify(self, state: State, questions: dict[str, Question]) -> ClassifierResponse:
        self.calls.append({"state": state, "questions": dict(questions)})
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.fail:
            raise RuntimeError("scripted engine failure")
        answers = {}
        seen = to_json(state)
        by_state = next((p for text, p in self.on_state.items() if text in seen), None)
        for parsed in parse_questions(questions):
            wanted = next((v for k, v in self.script.items() if k in str(parsed.instructions)), None)
            if by_state is not None and isinstance(parsed.source, Noul):
                wanted = by_state
            answers[parsed.id] = build_answer(parsed, _distribution(parsed.source, parsed.options, wanted))
        return ClassifierResponse(model=self.model, answers=answers)


def _distribution(question: Any, options: tuple[str, ...], wanted: Any) -> list[float]:
    if isinstance(question, Noul):
        p = 0.5 if wanted is None else float(wanted)
        return [1 - p, p]
    if wanted is None:
        return [1 / len(options)] * len(options)
    if isinstance(wanted, Mapping):
        return [float(wanted.get(o, 0.0)) for o in options]
    if isinstance(question, Choice):  # a label: all mass on it
        return [1.0 if o == wanted else 0.0 for o in options]
    return [1.0 if o == str(wanted) else 0.0 for o in options]
