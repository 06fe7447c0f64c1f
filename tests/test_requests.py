"""Request validation: every error names the question id and the field."""

from __future__ import annotations

import pytest
from langchain_core.decisions import Box, Choice, Noul, Score

from clef_guard import LocalDecisionModel, RequestError, UnsupportedQuestionError
from clef_guard.engine.requests import parse_questions


def _noul() -> Noul:
    return Noul(instructions="Is it?")


@pytest.mark.parametrize(
    ("questions", "question", "field", "phrase"),
    [
        ({}, None, "questions", "1 to 64"),
        ({f"q{i}": _noul() for i in range(65)}, None, "questions", "got 65"),
        ({"big": Choice(instructions="Which?", criteria={f"l{i}": None for i in range(256)})}, "big", "criteria", "255"),
        ({"e": Choice(instructions="Which?", criteria={" ": None, "b": None})}, "e", "criteria", "empty"),
        ({"d": Choice(instructions="Which?", criteria={"Yes": None, "yes ": None})}, "d", "criteria.yes ", "same label"),
        ({"s": {"type": "score", "instructions": "How?", "criteria": ["only"]}}, "s", "criteria", "at least 2"),
        ({"c": {"type": "choice", "instructions": "Which?", "criteria": {}}}, "c", "criteria", "at least 1"),
        ({"i": Noul(instructions="  ")}, "i", "instructions", "must not be empty"),
        ({"t": {"type": "maybe", "instructions": "?"}}, "t", "type", "noul, choice or score"),
    ],
)
def test_bad_questions_name_the_question_and_field(questions: dict, question: str | None, field: str | None, phrase: str) -> None:
    with pytest.raises(RequestError) as info:
        parse_questions(questions)
    assert info.value.question == question
    if field is not None:
        assert info.value.field == field
    assert phrase in str(info.value)


def test_box_is_refused_as_unsupported() -> None:
    with pytest.raises(UnsupportedQuestionError, match="not supported") as info:
        parse_questions({"where": Box(instructions="Find the cat")})
    assert info.value.question == "where"


def test_sixty_four_questions_and_255_options_are_accepted() -> None:
    parsed = parse_questions({f"q{i}": _noul() for i in range(64)})
    assert len(parsed) == 64
    (choice,) = parse_questions({"c": Choice(instructions="Which?", criteria={f"l{i}": None for i in range(255)})})
    assert len(choice.options) == 255


def test_engine_raises_request_errors_before_running_the_model(engine: LocalDecisionModel) -> None:
    with pytest.raises(RequestError, match="question 'x', field 'criteria.A'"):
        engine.invoke({"state": "s", "questions": {"x": Choice(instructions="?", criteria={"a": 1, "A": 2})}})
    with pytest.raises(RequestError, match="field 'state.when'"):
        engine.invoke({"state": {"when": object()}, "questions": {"q": _noul()}})
    with pytest.raises(RequestError, match="levels"):
        engine.invoke({"state": "s", "questions": {"q": Score(instructions="?", criteria=[str(i) for i in range(256)])}})
