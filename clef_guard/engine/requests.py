"""Check a ``ClassifierRequest`` and turn it into questions the engine can score.

Every question becomes an ordered list of options: ``noul`` -> ``["no", "yes"]``,
``choice`` -> its labels, ``score`` -> its levels ``"0" .. "n-1"``. Errors name the
question id and the field at fault.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from langchain_core.decisions import Box, Choice, Noul, Question, Score
from pydantic import JsonValue, TypeAdapter, ValidationError

from clef_guard.engine.state import to_json
from clef_guard.errors import RequestError, UnsupportedQuestionError

MIN_QUESTIONS = 1
MAX_QUESTIONS = 64
MAX_OPTIONS = 255
MAX_QUESTION_ID = 128
"""Longest question id (ids are names, not content)."""
MIN_SCORE_LEVELS = 2

QuestionKind = Literal["noul", "choice", "score"]
NOUL_OPTIONS: tuple[str, str] = ("no", "yes")

_QUESTION_ADAPTER: TypeAdapter[Noul | Choice | Score | Box] = TypeAdapter(Question)


@dataclass(frozen=True)
class ParsedQuestion:
    """One validated question: its id, kind, instructions and options in wire order."""

    id: str
    kind: QuestionKind
    instructions: JsonValue
    options: tuple[str, ...]
    descriptions: tuple[JsonValue, ...]
    source: Noul | Choice | Score
    examples: tuple[tuple[str, ...], ...] = ()
    """A choice's example texts per option (``criteria: {label: {"description": ..., "examples": [...]}}``);
    empty when no option has any."""

    @property
    def key(self) -> str:
        """What the question asks, independent of its id: kind, instructions, options, their descriptions and examples."""
        body = to_json([self.kind, self.instructions, self.options, self.descriptions, *([self.examples] if self.examples else [])])
        return hashlib.sha256(body.encode()).hexdigest()[:16]


def parse_questions(questions: Any) -> list[ParsedQuestion]:
    """Validate the ``questions`` of a request; raise :class:`RequestError` on the first fault."""
    if not isinstance(questions, Mapping):
        raise RequestError(f"must be a mapping of question ids to questions, got {type(questions).__name__}", field="questions")
    if not MIN_QUESTIONS <= len(questions) <= MAX_QUESTIONS:
        raise RequestError(
            f"a request holds {MIN_QUESTIONS} to {MAX_QUESTIONS} questions, got {len(questions)}; "
            "split larger requests",
            field="questions",
        )
    return [_parse_one(qid, question) for qid, question in questions.items()]


def _parse_one(qid: Any, raw: Any) -> ParsedQuestion:
    if not isinstance(qid, str) or not qid:
        raise RequestError(f"question ids must be non-empty strings, got {qid!r}", field="questions")
    if not qid.isprintable() or len(qid) > MAX_QUESTION_ID:
        raise RequestError(
            f"question ids are printable text of at most {MAX_QUESTION_ID} characters (no control characters)",
            field="questions",
        )
    question = _coerce(qid, raw)
    if isinstance(question, Box):
        raise UnsupportedQuestionError(
            "Box questions are not supported by this engine (text-only backbone); "
            "ask a vision decision model instead",
            question=qid,
            field="type",
        )
    _require_instructions(qid, question.instructions)
    if isinstance(question, Noul):
        criteria = question.criteria
        descriptions = (criteria.false, criteria.true) if criteria else (None, None)
        return ParsedQuestion(qid, "noul", question.instructions, NOUL_OPTIONS, descriptions, question)
    if isinstance(question, Choice):
        labels = tuple(question.criteria)
        _check_labels(qid, labels)
        read = [_with_examples(qid, label, value) for label, value in question.criteria.items()]
        examples = tuple(e for _, e in read) if any(e for _, e in read) else ()
        return ParsedQuestion(qid, "choice", question.instructions, labels, tuple(d for d, _ in read), question, examples)
    levels = question.criteria
    if not MIN_SCORE_LEVELS <= len(levels) <= MAX_OPTIONS:
        raise RequestError(
            f"a score needs {MIN_SCORE_LEVELS} to {MAX_OPTIONS} levels, got {len(levels)}",
            question=qid,
            field="criteria",
        )
    return ParsedQuestion(
        qid, "score", question.instructions, tuple(str(i) for i in range(len(levels))), tuple(levels), question
    )


def _coerce(qid: str, raw: Any) -> Noul | Choice | Score | Box:
    if isinstance(raw, (Noul, Choice, Score, Box)):
        return raw
    try:
        return _QUESTION_ADAPTER.validate_python(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        location = [str(part) for part in first["loc"]]
        if location and location[0] in ("noul", "choice", "score", "box"):
            location = location[1:]  # the discriminator's tag, not a field
        field = ".".join(location) or "type"
        raise RequestError(
            f"{first['msg']}; write a noul, choice or score as in langchain_core.decisions",
            question=qid,
            field=field,
        ) from None


def _require_instructions(qid: str, instructions: JsonValue) -> None:
    if instructions is None or (isinstance(instructions, str) and not instructions.strip()) or instructions in ({}, []):
        raise RequestError("instructions must not be empty: write the full question", question=qid, field="instructions")


MAX_EXAMPLES = 64
"""Most example texts one option of a choice may carry."""


def _with_examples(qid: str, label: str, value: JsonValue) -> tuple[JsonValue, tuple[str, ...]]:
    """An option's description, and its example texts when it is written ``{"description": ..., "examples": [...]}``."""
    if not (isinstance(value, Mapping) and "examples" in value):
        return value, ()
    extra = set(value) - {"description", "examples"}
    examples = value["examples"]
    if extra:
        problem = f"has keys {sorted(extra)}; an option with examples has 'description' and 'examples' only"
    elif not isinstance(examples, list) or not all(isinstance(e, str) and e.strip() for e in examples):
        problem = "'examples' must be a list of non-empty texts"
    elif len(examples) > MAX_EXAMPLES:
        problem = f"has {len(examples)} examples; at most {MAX_EXAMPLES}"
    else:
        return value.get("description"), tuple(examples)
    raise RequestError(f"option {label!r} {problem}", question=qid, field=f"criteria.{label}")


def _check_labels(qid: str, labels: tuple[str, ...]) -> None:
    if len(labels) > MAX_OPTIONS:
        raise RequestError(
            f"a choice holds 1 to {MAX_OPTIONS} options, got {len(labels)}; group rare labels under 'other'",
            question=qid,
            field="criteria",
        )
    seen: dict[str, str] = {}
    for label in labels:
        key = label.strip().casefold()
        if not key:
            raise RequestError(f"option {label!r} is empty; give every option a name", question=qid, field="criteria")
        if key in seen:
            raise RequestError(
                f"options {seen[key]!r} and {label!r} are the same label; give each option a distinct name",
                question=qid,
                field=f"criteria.{label}",
            )
        seen[key] = label
