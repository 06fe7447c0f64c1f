"""Turn option probabilities into ``langchain_core.decisions`` answers.

Confidence follows the formulas TypeSafe documents for the System One API, so a
threshold means the same here as on a hosted decision model:

- choice of ``n`` options: ``(max p - 1/n) / (1 - 1/n)``, clipped to ``[0, 1]``;
- score of ``n`` levels: ``1 - sum(p_i * |i - mode|) / U(n)`` with ``U(n)`` the mean
  absolute distance of a uniform distribution from its middle level, clipped at 0;
- noul: no confidence (the probability of yes is the answer).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from langchain_core.decisions import ChoiceAnswer, NoulAnswer, ScoreAnswer

from clef_guard.engine.requests import ParsedQuestion
from clef_guard.errors import EngineError

Answer = NoulAnswer | ChoiceAnswer | ScoreAnswer


def choice_confidence(probabilities: Sequence[float]) -> float:
    """Jev's choice confidence: how far the top probability sits above uniform."""
    n = len(probabilities)
    if n <= 1:
        return 1.0
    uniform = 1.0 / n
    return min(1.0, max(0.0, (max(probabilities) - uniform) / (1.0 - uniform)))


def score_confidence(probabilities: Sequence[float]) -> float:
    """Jev's score confidence: spread around the mode relative to a uniform spread."""
    n = len(probabilities)
    if n <= 1:
        return 1.0
    mode = _argmax(probabilities)
    spread = sum(p * abs(i - mode) for i, p in enumerate(probabilities))
    centre = (n - 1) / 2
    uniform_spread = sum(abs(i - centre) for i in range(n)) / n
    return min(1.0, max(0.0, 1.0 - spread / uniform_spread))


def build_answer(question: ParsedQuestion, probabilities: Sequence[float]) -> Answer:
    """Answer ``question`` from probabilities given in the order of ``question.options``.

    Raises :class:`EngineError` when they are not finite and non-negative with a positive
    sum (a NaN from a corrupt head or fp16 overflow): a gate then applies ``on_error``.
    """
    if not all(math.isfinite(p) and p >= 0.0 for p in probabilities) or not sum(probabilities) > 0.0:
        raise EngineError(f"question {question.id!r}: the engine computed probabilities that are not finite")
    probs = _normalised(probabilities)
    if question.kind == "noul":
        return NoulAnswer(type="noul", noul=probs[1])
    if question.kind == "choice":
        return ChoiceAnswer(
            type="choice",
            choice=question.options[_argmax(probs)],
            probabilities=dict(zip(question.options, probs, strict=True)),
            confidence=choice_confidence(probs),
        )
    return ScoreAnswer(
        type="score",
        score=sum(i * p for i, p in enumerate(probs)),
        legend=dict(enumerate(question.descriptions)),
        probabilities=dict(enumerate(probs)),
        confidence=score_confidence(probs),
    )


def _argmax(values: Sequence[float]) -> int:
    """Index of the largest value, the first one on a tie."""
    return max(range(len(values)), key=lambda i: (values[i], -i))


def _normalised(probabilities: Sequence[float]) -> list[float]:
    """Exact float sum of 1 after the softmax's rounding, every value in [0, 1]."""
    total = float(sum(probabilities))
    probs = [min(1.0, max(0.0, float(p) / total)) for p in probabilities]
    return probs
