"""Confidence formulas and answer shapes, checked against hand-computed values."""

from __future__ import annotations

import math

import pytest
from langchain_core.decisions import Choice, Noul, Score

from clef_guard.engine.answers import build_answer, choice_confidence, score_confidence
from clef_guard.engine.requests import parse_questions


def test_choice_confidence_is_zero_at_uniform_and_one_at_certainty() -> None:
    assert choice_confidence([0.25] * 4) == 0.0
    assert choice_confidence([1.0, 0.0, 0.0]) == 1.0
    assert math.isclose(choice_confidence([0.7, 0.2, 0.1]), (0.7 - 1 / 3) / (1 - 1 / 3))


def test_score_confidence_follows_mean_absolute_deviation_from_the_mode() -> None:
    # 4 levels: uniform spread around the middle (1.5) is (1.5 + 0.5 + 0.5 + 1.5) / 4 = 1.0
    assert math.isclose(score_confidence([0.0, 0.0, 1.0, 0.0]), 1.0)
    assert math.isclose(score_confidence([0.0, 0.0, 0.5, 0.5]), 1 - 0.5 / 1.0)
    assert score_confidence([0.5, 0.0, 0.0, 0.5]) == 0.0  # spread 1.5 > uniform: clipped


def test_score_answer_is_the_expected_level_with_the_legend() -> None:
    (question,) = parse_questions({"s": Score(instructions="How bad?", criteria=["low", "mid", "high"])})
    answer = build_answer(question, [0.2, 0.3, 0.5])
    assert math.isclose(answer.score, 0.3 + 2 * 0.5)
    assert answer.legend == {0: "low", 1: "mid", 2: "high"}
    assert list(answer.probabilities) == [0, 1, 2]


def test_choice_answer_is_the_argmax_keyed_by_label() -> None:
    (question,) = parse_questions({"c": Choice(instructions="Which?", criteria={"a": None, "b": None, "c": None})})
    answer = build_answer(question, [0.1, 0.6, 0.3])
    assert answer.choice == "b"
    assert answer.probabilities == pytest.approx({"a": 0.1, "b": 0.6, "c": 0.3})


def test_noul_answer_is_the_probability_of_yes() -> None:
    (question,) = parse_questions({"n": Noul(instructions="Is it?")})
    assert build_answer(question, [0.25, 0.75]).noul == pytest.approx(0.75)
