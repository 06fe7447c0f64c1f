"""Evaluate any decision model on a labeled task, through its public ``invoke``.

Every example is one real request, so the numbers include everything a user pays for
(serialisation, the engine, the head) and ``p50_ms`` is a real per-request latency.
``SparrowDecisionModel`` wraps the peer ``sparrow-decider`` (pip, numpy, its own
weights) so both are measured in the same run.
"""

from __future__ import annotations

import statistics
import textwrap
import time
from collections.abc import Callable, Sequence
from typing import Any

from langchain_core.decisions import (
    BaseDecisionModel,
    ClassifierResponse,
    Question,
    State,
)

from clef_guard.engine.encoder import is_none_label
from clef_guard.engine.requests import parse_questions
from clef_guard.engine.state import state_segments
from clef_guard.errors import ClefGuardError
from clef_guard.training.calibrate import calibration_metrics
from clef_guard.training.examples import Example


def evaluate(
    engine: BaseDecisionModel,
    task: str,
    examples: Sequence[Example],
    *,
    on_progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Accuracy, macro-F1, ECE, Brier and median latency of ``engine`` on ``examples``.

    Where the examples ask more than one question, ``questions`` scores each of them too.
    """
    if not examples:
        raise ClefGuardError(f"task {task!r} has no examples to evaluate")
    distributions, latencies = [], []
    for done, example in enumerate(examples, start=1):
        (parsed,) = parse_questions({"q": example.question})
        start = time.perf_counter()
        response = engine.invoke({"state": example.state, "questions": {"q": example.question}})
        latencies.append(1000 * (time.perf_counter() - start))
        distributions.append(option_probabilities(response.answers["q"], parsed.options))
        if on_progress:
            on_progress(done, len(examples))
    result = {
        "task": task,
        "engine": getattr(engine, "model", type(engine).__name__),
        **score(examples, distributions),
        "p50_ms": statistics.median(latencies),
    }
    questions = score_by_question(examples, distributions)
    return {**result, "questions": questions} if len(questions) > 1 else result


def score_by_question(examples: Sequence[Example], distributions: Sequence[Sequence[float]]) -> list[dict[str, Any]]:
    """:func:`score` of each question asked, named by its instructions (shortened), most examples first."""
    groups: dict[str, tuple[str, list[int]]] = {}
    for index, example in enumerate(examples):
        (parsed,) = parse_questions({"q": example.question})
        groups.setdefault(parsed.key, (question_text(example.question), []))[1].append(index)
    scored = [
        {"question": text, **score([examples[i] for i in rows], [distributions[i] for i in rows])}
        for text, rows in groups.values()
    ]
    return sorted(scored, key=lambda row: -row["n"])


def question_text(question: Question) -> str:
    """A question as a person reads it in a report: its instructions, shortened."""
    return textwrap.shorten(str(question.instructions), 80)


def score(examples: Sequence[Example], distributions: Sequence[Sequence[float]]) -> dict[str, Any]:
    """``n``, accuracy, macro-F1, ECE and Brier of option probabilities (in each question's option order).

    ``ece_noise`` is the ECE a perfectly calibrated engine with the same confidences would show
    on this many rows (:func:`sampling_ece`): the floor the measured ECE is read against. Where
    a question has a "none of these" option (``oos``, ``other``, ...) and the rows hold both
    kinds, ``none_auroc`` is how well its probability tells the rows that are none from the rest.
    """
    if not examples:
        raise ClefGuardError("no examples to score")
    labels, predictions, gold, none_scores = [], [], [], []
    for example, probabilities in zip(examples, distributions, strict=True):
        (parsed,) = parse_questions({"q": example.question})
        labels.append(example.label)
        predictions.append(parsed.options[max(range(len(probabilities)), key=probabilities.__getitem__)])
        gold.append(parsed.options.index(example.label))
        nones = [i for i, option in enumerate(parsed.options) if is_none_label(option)]
        if nones:
            none_scores.append((sum(probabilities[i] for i in nones), is_none_label(example.label)))
    metrics = calibration_metrics(distributions, gold)
    scored = {"n": len(examples), "accuracy": metrics.pop("accuracy"), "macro_f1": macro_f1(labels, predictions), **metrics}
    positives = [s for s, none in none_scores if none]
    negatives = [s for s, none in none_scores if not none]
    if positives and negatives:
        scored["none_auroc"] = auroc(positives, negatives)
    return scored


def auroc(positives: Sequence[float], negatives: Sequence[float]) -> float:
    """The chance that a random positive scores above a random negative (ties count half)."""
    ranked = sorted([(s, 1) for s in positives] + [(s, 0) for s in negatives])
    rank_sum, start = 0.0, 0
    while start < len(ranked):  # tied scores share the mean of their ranks
        end = start
        while end < len(ranked) and ranked[end][0] == ranked[start][0]:
            end += 1
        rank_sum += (start + end + 1) / 2 * sum(label for _, label in ranked[start:end])
        start = end
    n_pos, n_neg = len(positives), len(negatives)
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def macro_f1(labels: Sequence[str], predictions: Sequence[str]) -> float:
    """Unweighted mean of per-class F1 over the classes present in the labels."""
    scores = []
    for cls in sorted(set(labels)):
        tp = sum(1 for y, p in zip(labels, predictions, strict=True) if y == cls and p == cls)
        fp = sum(1 for y, p in zip(labels, predictions, strict=True) if y != cls and p == cls)
        fn = sum(1 for y, p in zip(labels, predictions, strict=True) if y == cls and p != cls)
        scores.append(2 * tp / (2 * tp + fp + fn) if tp else 0.0)
    return sum(scores) / len(scores)


def option_probabilities(answer: Any, options: tuple[str, ...]) -> list[float]:
    """An answer's probabilities in ``options``' order (a noul's as [no, yes])."""
    if answer.type == "noul":
        return [1.0 - answer.noul, answer.noul]
    by_key = {str(k): v for k, v in answer.probabilities.items()}
    return [float(by_key.get(option, 0.0)) for option in options]


class SparrowDecisionModel(BaseDecisionModel):
    """The peer ``sparrow-decider`` as a ``BaseDecisionModel`` (a baseline in evaluations).

    It reads the same serialised state text as our engine, so both see the same data.
    """

    model: str = "sparrow-nano-general-v1.1"
    _decider: Any = None

    def model_post_init(self, context: Any, /) -> None:
        """Load the peer's bundled weights."""
        try:
            from sparrow_decider import Decider
        except ImportError as exc:
            raise ClefGuardError("the sparrow baseline needs: pip install 'clef-guard[eval]' (sparrow-decider)") from exc
        self._decider = Decider.load(self.model)

    @property
    def _provider(self) -> str:
        return "sparrow_decider"

    def _classify(self, state: State, questions: dict[str, Question]) -> ClassifierResponse:
        text = "\n".join(state_segments(state))
        wire = {qid: q.model_dump(exclude_none=True) if hasattr(q, "model_dump") else q for qid, q in questions.items()}
        return ClassifierResponse.model_validate({"model": self.model, "answers": self._decider.ask(text, wire)})
