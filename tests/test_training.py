"""Head training on real backbone features: a separable toy task is learned, and the head loads."""

from __future__ import annotations

from pathlib import Path

import pytest
from langchain_core.decisions import Noul

from clef_guard import DecisionHead, LocalDecisionModel
from clef_guard._datasets import Example
from clef_guard._training import TrainConfig, extract_features, predict, train_head

QUESTION = Noul(instructions="Does the message mention an animal?")
ANIMALS = ["cat", "dog", "horse", "parrot", "rabbit", "goat", "tiger", "sheep", "mouse", "duck", "whale", "eagle"]
OBJECTS = ["chair", "lamp", "spoon", "table", "pencil", "bottle", "window", "carpet", "phone", "kettle", "brick", "drawer"]


def _toy(words: list[str], label: str, offset: int) -> list[Example]:
    templates = ["I saw a {} this morning.", "There is a {} in the garden.", "My neighbour bought a {}."]
    return [
        Example(f"{label}-{offset + i}", templates[i % 3].format(w), QUESTION, label) for i, w in enumerate(words)
    ]


@pytest.fixture(scope="module")
def toy(engine: LocalDecisionModel, tmp_path_factory: pytest.TempPathFactory) -> tuple[list, list]:
    cache = tmp_path_factory.mktemp("features")
    train = _toy(ANIMALS[:9], "yes", 0) + _toy(OBJECTS[:9], "no", 0)
    test = _toy(ANIMALS[9:], "yes", 9) + _toy(OBJECTS[9:], "no", 9)
    return extract_features(engine, train, cache=cache), extract_features(engine, test, cache=cache)


def _accuracy(head: DecisionHead | None, features: list) -> float:
    return sum(int(p.argmax()) == f.label for p, f in zip(predict(head, features), features)) / len(features)


def test_training_lowers_the_loss_and_beats_chance(engine: LocalDecisionModel, toy: tuple[list, list]) -> None:
    train, test = toy
    head, history = train_head(train, engine.backbone.hidden_size, TrainConfig(epochs=60, batch_size=6, lr=3e-2))
    assert history[-1] < history[0] * 0.5
    assert _accuracy(head, train) >= 0.9
    assert _accuracy(head, test) > 0.5


def test_feature_cache_is_reused(engine: LocalDecisionModel, tmp_path: Path) -> None:
    examples = _toy(ANIMALS[:2], "yes", 0)
    first = extract_features(engine, examples, cache=tmp_path)
    cached = list(tmp_path.glob("*.pt"))
    assert len(cached) == 1
    engine_calls: list[int] = []
    again = extract_features(engine, examples, cache=tmp_path, on_progress=lambda done, total: engine_calls.append(done))
    assert engine_calls == [1, 2]
    assert all((a.hidden == b.hidden).all() and a.label == b.label for a, b in zip(first, again))


def test_a_trained_head_loads_into_the_engine_and_changes_answers(engine: LocalDecisionModel, toy: tuple[list, list], tmp_path: Path) -> None:
    train, _ = toy
    head, _ = train_head(train, engine.backbone.hidden_size, TrainConfig(epochs=60, batch_size=6, lr=3e-2))
    head.save(tmp_path / "decision_head.safetensors")
    tuned = LocalDecisionModel(head=str(tmp_path / "decision_head.safetensors"))
    request = {"state": "A fox ran across the road.", "questions": {"animal": QUESTION}}
    assert abs(tuned.invoke(request).nouls["animal"].noul - engine.invoke(request).nouls["animal"].noul) > 0.05
