"""Calibration metrics, temperature scaling and the threshold bound, on simulated data."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from langchain_core.decisions import Choice

from clef_guard.training.calibrate import (
    TEMPERATURE_RANGE,
    _binomial_cdf,
    brier_score,
    choose_threshold,
    clopper_pearson_upper,
    expected_calibration_error,
    fit_temperature,
    minimum_accepted,
    reliability_diagram,
    sampling_ece,
    stop_threshold,
)
from clef_guard.training.evaluate import auroc, score
from clef_guard.training.examples import Example


def _calibrated(n: int, seed: int) -> tuple[list[float], list[bool]]:
    rng = random.Random(seed)
    confidences = [rng.uniform(0.3, 1.0) for _ in range(n)]
    return confidences, [rng.random() < c for c in confidences]


def test_ece_is_near_zero_when_calibrated_and_large_when_overconfident() -> None:
    confidences, correct = _calibrated(20000, 0)
    assert expected_calibration_error(confidences, correct) < 0.02
    overconfident = [min(1.0, c + 0.2) for c in confidences]
    assert expected_calibration_error(overconfident, correct) > 0.1


def test_ece_bins_answers_by_confidence() -> None:
    # bins of 0.2: {0.3, 0.4} (one right: 0.5 against 0.35), {0.9} (right), {0.0} (wrong)
    ece = expected_calibration_error([0.3, 0.4, 0.9, 0.0], [False, True, True, False], bins=5)
    assert ece == pytest.approx((2 * abs(0.5 - 0.35) + abs(1 - 0.9) + 0) / 4)


def test_sampling_ece_is_the_noise_a_calibrated_model_shows_on_few_answers() -> None:
    confidences, _ = _calibrated(100, 1)
    noise = sampling_ece(confidences)
    draws = [random.Random(seed) for seed in range(50)]
    measured = [expected_calibration_error(confidences, [rng.random() < c for c in confidences]) for rng in draws]
    assert 0.05 < noise < 0.15, "100 answers in 15 bins: a calibrated model is several points off"
    assert sum(measured) / len(measured) == pytest.approx(noise, rel=0.2)
    assert sampling_ece(_calibrated(20000, 2)[0]) < 0.01
    overconfident = [min(1.0, c + 0.3) for c in confidences]
    assert expected_calibration_error(overconfident, _calibrated(100, 1)[1]) > 2 * sampling_ece(overconfident)


def test_brier_score_of_known_distributions() -> None:
    assert brier_score([[1.0, 0.0], [0.5, 0.5]], [0, 1]) == pytest.approx((0 + 0.5) / 2)
    assert brier_score([[0.0, 0.0, 1.0]], [0]) == pytest.approx(2.0)


@given(st.lists(st.integers(0, 5), min_size=1, max_size=12), st.lists(st.integers(0, 5), min_size=1, max_size=12))
def test_auroc_is_the_share_of_pairs_ranked_right(positives: list[int], negatives: list[int]) -> None:
    pairs = [(p > n) + 0.5 * (p == n) for p in positives for n in negatives]
    assert auroc(positives, negatives) == pytest.approx(sum(pairs) / len(pairs))


def test_none_auroc_reads_the_none_options_probability() -> None:
    question = Choice(instructions="Which?", criteria={"a": None, "b": None, "other": "none of these"})
    rows = [Example(str(i), "text", question, label) for i, label in enumerate(["a", "b", "other", "other"])]
    scored = score(rows, [[0.7, 0.2, 0.1], [0.1, 0.6, 0.3], [0.3, 0.2, 0.5], [0.2, 0.5, 0.3]])
    assert scored["none_auroc"] == pytest.approx(0.875)  # 3.5 of 4 (none, not none) pairs in order
    assert "none_auroc" not in score(rows[:2], [[0.7, 0.2, 0.1], [0.1, 0.6, 0.3]])


def test_temperature_scaling_recovers_the_temperature_and_lowers_ece() -> None:
    torch.manual_seed(0)
    logits = [torch.randn(4) * 3 for _ in range(4000)]
    labels = [int(torch.multinomial(torch.softmax(z / 2.5, -1), 1)) for z in logits]
    temperature = fit_temperature(logits, labels)
    assert temperature == pytest.approx(2.5, rel=0.1)

    def ece(t: float) -> float:
        probs = [torch.softmax(z / t, -1) for z in logits]
        return expected_calibration_error([float(p.max()) for p in probs], [int(p.argmax()) == y for p, y in zip(probs, labels)])

    assert ece(temperature) < ece(1.0) / 2


def test_temperature_fit_survives_sharp_ragged_logits() -> None:
    torch.manual_seed(1)
    logits = [torch.randn(n) * 1000 for n in [2, 5, 8] * 20]  # confidently wrong half the time
    labels = [i % len(z) for i, z in enumerate(logits)]
    temperature = fit_temperature(logits, labels)
    assert TEMPERATURE_RANGE[0] <= temperature <= TEMPERATURE_RANGE[1]
    assert temperature > 10  # such logits must be softened a lot


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=1, max_value=300).flatmap(lambda n: st.tuples(st.just(n), st.integers(min_value=0, max_value=n - 1))))
def test_clopper_pearson_bound_has_its_exact_tail(case: tuple[int, int]) -> None:
    n, errors = case
    upper = clopper_pearson_upper(errors, n, 0.95)
    assert errors / n <= upper <= 1.0
    assert _binomial_cdf(errors, n, upper) == pytest.approx(0.05, abs=1e-6)
    assert clopper_pearson_upper(errors + 1, n, 0.95) >= upper


def test_bound_covers_the_true_rate_at_least_95_percent_of_the_time() -> None:
    rng = random.Random(1)
    misses = 0
    for _ in range(2000):
        errors = sum(rng.random() < 0.05 for _ in range(200))
        misses += clopper_pearson_upper(errors, 200, 0.95) < 0.05
    assert misses / 2000 <= 0.05 + 0.015


def test_chosen_thresholds_keep_the_true_error_under_target() -> None:
    """Scores carry signal (P(correct) = score); the true error above the chosen threshold
    must be at most the target in >= 95% of simulated calibration sets."""
    rng = random.Random(2)
    target, failures, runs = 0.05, 0, 300
    for _ in range(runs):
        scores = [rng.random() for _ in range(1000)]
        correct = [rng.random() < 0.5 + 0.5 * s for s in scores]
        choice = choose_threshold(scores, correct, target_error=target, confidence=0.95)
        if choice.threshold is not None:
            t = choice.threshold
            true_error = (1 - (0.5 + 0.5 * (1 + t) / 2))  # mean of 0.5 - 0.5 s over s ~ U(t, 1)
            failures += true_error > target
            assert 0 < choice.coverage <= 1 and choice.error_upper_bound <= target
    assert failures / runs <= 0.05 + 0.03


def test_a_lone_top_score_does_not_end_the_sequence() -> None:
    scores = [0.99] + [0.9] * 400 + [0.5] * 100
    correct = [True] + [True] * 400 + [False] * 100
    choice = choose_threshold(scores, correct, target_error=0.01)
    assert choice.threshold == 0.9 and choice.accepted == 401 and choice.errors == 0
    assert minimum_accepted(0.01) == 299 and minimum_accepted(0.05) == 59


def test_no_threshold_when_the_target_is_out_of_reach() -> None:
    choice = choose_threshold([0.9, 0.8, 0.7], [False, True, True], target_error=0.01)
    assert choice.threshold is None and choice.coverage == 0.0


def test_reliability_diagram_is_written(tmp_path: Path) -> None:
    confidences, correct = _calibrated(500, 3)
    path = reliability_diagram(confidences, correct, tmp_path / "reliability.png", title="toy")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_stop_thresholds_keep_the_true_false_alarm_rate_under_target() -> None:
    """Negatives score U(0, 1), positives U(0.5, 1): a threshold t stops 1 - t of the negatives,
    which must be at most the target in >= 95% of simulated calibration sets."""
    rng = random.Random(3)
    target, failures, runs = 0.02, 0, 300
    for _ in range(runs):
        labels = [rng.random() < 0.3 for _ in range(1000)]
        yes = [0.5 + 0.5 * rng.random() if label else rng.random() for label in labels]
        stop = stop_threshold(yes, labels, target_error=target)
        assert stop.threshold is not None and stop.false_alarm_bound <= target
        assert stop.false_alarms == sum(p >= stop.threshold for p, label in zip(yes, labels) if not label)
        failures += 1 - stop.threshold > target
    assert failures / runs <= 0.05 + 0.03


def test_too_few_negatives_give_no_stop_threshold() -> None:
    stop = stop_threshold([0.1] * 100 + [0.9] * 10, [False] * 100 + [True] * 10, target_error=0.01)
    assert stop.threshold is None and stop.negatives == 100 and stop.false_alarm_bound > 0.01
    clean = stop_threshold([0.1] * 400 + [0.9] * 10, [False] * 400 + [True] * 10, target_error=0.01)
    assert clean.threshold is not None and 0.1 < clean.threshold <= 0.9 and clean.recall == 1.0 and clean.false_alarms == 0


def test_negatives_answered_one_give_no_stop_threshold() -> None:
    """A threshold of 1.0 would still stop the negatives a saturated head answers 1.0: none can meet the target."""
    stop = stop_threshold([0.1] * 390 + [1.0] * 10 + [1.0] * 10, [False] * 400 + [True] * 10, target_error=0.01)
    assert stop.threshold is None and stop.false_alarms == 10 and stop.false_alarm_bound > 0.01
    fewer = stop_threshold([0.1] * 399 + [1.0] + [1.0] * 10, [False] * 400 + [True] * 10, target_error=0.02)
    assert fewer.threshold is not None and 0.1 < fewer.threshold < 1.0 and fewer.false_alarms == 1 and fewer.false_alarm_bound <= 0.02
