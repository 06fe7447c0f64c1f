"""Calibration: temperature scaling, calibration metrics, reliability diagrams, thresholds.

Probabilities are honest when, among answers given with confidence ``c``, a fraction
``c`` is right. This module measures that (ECE, Brier), fixes it with one temperature
per question kind, and picks the thresholds a policy can trust:
:func:`choose_threshold` finds the lowest score threshold whose error rate among
accepted answers is at most ``target`` with the stated confidence, using the exact
Clopper-Pearson upper bound, tested in a fixed sequence from the strictest threshold
down (stopping at the first failure, so scanning many thresholds costs no extra
confidence: the Learn-then-Test fixed-sequence procedure).
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from clef_guard.errors import ClefGuardError


def expected_calibration_error(confidences: Sequence[float], correct: Sequence[bool], bins: int = 15) -> float:
    """Top-label ECE: the mean |accuracy - confidence| over equal-width confidence bins."""
    if len(confidences) != len(correct) or not confidences:
        raise ValueError("confidences and correct must be non-empty and of equal length")
    return float(_ece(torch.tensor(confidences, dtype=torch.float64), torch.tensor(correct), bins))


def sampling_ece(confidences: Sequence[float], bins: int = 15, *, draws: int = 200, seed: int = 0) -> float:
    """The ECE a perfectly calibrated model giving these confidences shows, on average, on this many answers.

    Binned ECE is biased upward on a few hundred answers. Here each answer is right with
    probability its confidence, in ``draws`` seeded simulations: a measured ECE near this
    value is within sampling noise, one well above it is miscalibration.
    """
    if not confidences:
        raise ValueError("confidences must be non-empty")
    probabilities = torch.tensor(confidences, dtype=torch.float64)
    generator = torch.Generator().manual_seed(seed)
    correct = torch.rand(draws, len(probabilities), generator=generator, dtype=torch.float64) < probabilities
    return float(_ece(probabilities, correct, bins).mean())


def calibration_metrics(probabilities: Sequence[Sequence[float]], labels: Sequence[int]) -> dict[str, float]:
    """Accuracy, ECE, its sampling noise (:func:`sampling_ece`) and Brier of option
    distributions against the index of each right option."""
    best = [max(range(len(row)), key=row.__getitem__) for row in probabilities]
    confidences = [row[b] for row, b in zip(probabilities, best, strict=True)]
    correct = [b == label for b, label in zip(best, labels, strict=True)]
    return {
        "accuracy": sum(correct) / len(correct),
        "ece": expected_calibration_error(confidences, correct),
        "ece_noise": sampling_ece(confidences),
        "brier": brier_score(probabilities, labels),
    }


def _bin_totals(confidences: torch.Tensor, correct: torch.Tensor, bins: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per equal-width bin (``b`` holds ``(b / bins, (b + 1) / bins]``, 0 the first): answers,
    summed confidence, and right answers for each row of ``correct`` (``[..., n]``, bools)."""
    index = (torch.ceil(confidences * bins) - 1).clamp(0, bins - 1).long()
    stated = torch.zeros(bins, dtype=torch.float64).index_add_(0, index, confidences)
    right = torch.zeros(*correct.shape[:-1], bins, dtype=torch.float64).index_add_(-1, index, correct.double())
    return torch.bincount(index, minlength=bins), stated, right


def _ece(confidences: torch.Tensor, correct: torch.Tensor, bins: int) -> torch.Tensor:
    """ECE of each row of ``correct`` (``[..., n]``, bools) against ``confidences`` (``[n]``)."""
    _, stated, right = _bin_totals(confidences, correct, bins)
    return (right - stated).abs().sum(-1) / len(confidences)


def brier_score(probabilities: Sequence[Sequence[float]], labels: Sequence[int]) -> float:
    """Mean over examples of the squared distance between the distribution and the one-hot label."""
    if len(probabilities) != len(labels) or not labels:
        raise ValueError("probabilities and labels must be non-empty and of equal length")
    return sum(
        sum((p - (1.0 if i == label else 0.0)) ** 2 for i, p in enumerate(row)) for row, label in zip(probabilities, labels, strict=True)
    ) / len(labels)


MIN_TEMPERATURE_EXAMPLES = 30
"""Fewer examples than this keep temperature 1: a handful of right answers drives it to 0."""
MIN_QUESTION_ERRORS = 5
"""A question gets a temperature of its own only with this many wrong answers among its
examples: with none the fit drives it to the floor of the range, and a few make it noise."""
TEMPERATURE_RANGE = (0.05, 20.0)


def fit_temperature(logits: Sequence[torch.Tensor], labels: Sequence[int], *, steps: int = 60) -> float:
    """The temperature (within :data:`TEMPERATURE_RANGE`) minimising the NLL of ``labels`` (ragged logits).

    The NLL is convex in the inverse temperature, so a golden-section search over its
    logarithm finds the minimum without the overflow a gradient line search can hit on
    very sharp logits. With fewer than :data:`MIN_TEMPERATURE_EXAMPLES` examples it returns 1.0.
    """
    if len(logits) != len(labels) or not labels:
        raise ValueError("logits and labels must be non-empty and of equal length")
    if len(labels) < MIN_TEMPERATURE_EXAMPLES:
        return 1.0
    width = max(len(row) for row in logits)
    padded = torch.full((len(logits), width), float("-inf"), dtype=torch.float64)
    for i, row in enumerate(logits):
        padded[i, : len(row)] = row.detach().double()
    targets = torch.tensor(list(labels))

    def nll(log_t: float) -> float:
        return float(torch.nn.functional.cross_entropy(padded / math.exp(log_t), targets))

    low, high = (math.log(bound) for bound in TEMPERATURE_RANGE)
    ratio = (math.sqrt(5) - 1) / 2
    a, b = high - ratio * (high - low), low + ratio * (high - low)
    f_a, f_b = nll(a), nll(b)
    for _ in range(steps):
        if f_a <= f_b:
            high, b, f_b = b, a, f_a
            a = high - ratio * (high - low)
            f_a = nll(a)
        else:
            low, a, f_a = a, b, f_b
            b = low + ratio * (high - low)
            f_b = nll(b)
    return math.exp((low + high) / 2)


def clopper_pearson_upper(errors: int, n: int, confidence: float = 0.95) -> float:
    """Exact one-sided upper confidence bound on a binomial rate (``errors`` out of ``n``)."""
    if not 0 <= errors <= n:
        raise ValueError(f"need 0 <= errors <= n, got {errors} of {n}")
    if n == 0 or errors == n:
        return 1.0
    alpha = 1.0 - confidence
    low, high = errors / n, 1.0
    for _ in range(100):  # bisection: P(X <= errors | n, p) is decreasing in p
        middle = (low + high) / 2
        if _binomial_cdf(errors, n, middle) > alpha:
            low = middle
        else:
            high = middle
    return high


@dataclass(frozen=True)
class ThresholdChoice:
    """The chosen threshold and what it buys."""

    threshold: float | None
    """Accept answers scoring at least this; ``None`` when no threshold meets the target."""
    coverage: float
    """Fraction of answers accepted."""
    errors: int
    accepted: int
    error_upper_bound: float
    """Clopper-Pearson upper bound on the error rate among accepted answers."""


def choose_threshold(
    scores: Sequence[float], correct: Sequence[bool], *, target_error: float, confidence: float = 0.95
) -> ThresholdChoice:
    """The lowest threshold whose accepted answers err at most ``target_error`` with ``confidence``.

    Thresholds are the distinct scores, tested from the highest down; testing stops at
    the first one whose Clopper-Pearson bound exceeds the target (fixed-sequence testing).
    Thresholds accepting fewer answers than any bound could pass with (``minimum_accepted``:
    it depends on counts alone, never on labels) are skipped rather than tested, so a
    lone top score cannot end the sequence.
    """
    if len(scores) != len(correct) or not scores:
        raise ValueError("scores and correct must be non-empty and of equal length")
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    best = ThresholdChoice(None, 0.0, 0, 0, 1.0)
    accepted = errors = 0
    index = 0
    while index < len(order):
        threshold = scores[order[index]]
        while index < len(order) and scores[order[index]] >= threshold:
            accepted += 1
            errors += not correct[order[index]]
            index += 1
        if accepted < minimum_accepted(target_error, confidence):
            continue
        bound = clopper_pearson_upper(errors, accepted, confidence)
        if bound > target_error:
            break
        best = ThresholdChoice(threshold, accepted / len(scores), errors, accepted, bound)
    return best


@dataclass(frozen=True)
class StopThreshold:
    """A threshold at which "yes" stops a call, and what it costs and catches."""

    threshold: float | None
    """Stop at P(yes) of at least this; ``None`` when no threshold can be shown to meet the target (too few
    negatives, or more of them answered 1.0 than the target allows)."""
    false_alarms: int
    """"no" rows it stops."""
    negatives: int
    recall: float
    """Fraction of "yes" rows it stops."""
    false_alarm_bound: float
    """Clopper-Pearson upper bound on the fraction of "no" rows it stops."""


def stop_threshold(
    yes: Sequence[float], positive: Sequence[bool], *, target_error: float, confidence: float = 0.95
) -> StopThreshold:
    """The lowest threshold on P(yes) whose false alarms (``positive`` false, P(yes) at or
    above it) stay under ``target_error`` of the negatives with ``confidence``.

    The bound grows with the number of false alarms alone (the negatives are fixed), so the
    most false alarms the target allows sets the threshold: just above the next negative's score.
    """
    negatives = sorted((p for p, label in zip(yes, positive, strict=True) if not label), reverse=True)
    positives = [p for p, label in zip(yes, positive, strict=True) if label]
    allowed = -1
    while allowed + 1 <= len(negatives) and clopper_pearson_upper(allowed + 1, len(negatives), confidence) <= target_error:
        allowed += 1
    if allowed < 0:
        return StopThreshold(None, 0, len(negatives), 0.0, clopper_pearson_upper(0, len(negatives), confidence))
    above = negatives[allowed] if allowed < len(negatives) else 0.0  # the first negative it must not stop
    if above >= 1.0:  # no probability stops fewer: saturated answers on too many negatives
        saturated = sum(p >= 1.0 for p in negatives)
        return StopThreshold(None, saturated, len(negatives), 0.0, clopper_pearson_upper(saturated, len(negatives), confidence))
    threshold = math.nextafter(above, 2.0)
    false_alarms = sum(p >= threshold for p in negatives)
    recall = sum(p >= threshold for p in positives) / len(positives) if positives else float("nan")
    return StopThreshold(threshold, false_alarms, len(negatives), recall, clopper_pearson_upper(false_alarms, len(negatives), confidence))


def minimum_accepted(target_error: float, confidence: float = 0.95) -> int:
    """The fewest answers whose error bound can reach ``target_error`` (with zero errors)."""
    if not 0.0 < target_error < 1.0:
        raise ValueError(f"target_error must be in (0, 1), got {target_error}")
    return max(1, math.ceil(math.log(1.0 - confidence) / math.log(1.0 - target_error)))


def reliability_diagram(
    confidences: Sequence[float], correct: Sequence[bool], path: str | Path, *, title: str, bins: int = 15
) -> Path:
    """Write a reliability diagram (accuracy against confidence per bin, with counts) as PNG."""
    try:
        import matplotlib
    except ImportError:
        raise ClefGuardError("a reliability diagram needs matplotlib: pip install 'clef-guard[train]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts, stated, right = _bin_totals(torch.tensor(confidences, dtype=torch.float64), torch.tensor(correct), bins)
    used = counts > 0
    centres, accuracies = (stated[used] / counts[used]).tolist(), (right[used] / counts[used]).tolist()
    counts = counts[used].tolist()
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(5, 6), height_ratios=(3, 1), sharex=True)
    top.plot([0, 1], [0, 1], linestyle="--", color="grey", label="perfect calibration")
    top.plot(centres, accuracies, marker="o", label="answers")
    top.set_ylabel("accuracy")
    top.set_title(f"{textwrap.fill(title, 48)}\nECE {expected_calibration_error(confidences, correct, bins):.3f}, n={len(confidences)}")
    top.legend(loc="lower right")
    bottom.bar(centres, counts, width=1 / bins, color="tab:blue", alpha=0.6)
    bottom.set_xlabel("confidence")
    bottom.set_ylabel("answers")
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def _binomial_cdf(k: int, n: int, p: float) -> float:
    if p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 1.0 if k >= n else 0.0
    log_p, log_q = math.log(p), math.log1p(-p)
    terms = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p + (n - i) * log_q for i in range(k + 1)]
    top = max(terms)
    return min(1.0, math.exp(top) * sum(math.exp(t - top) for t in terms))
