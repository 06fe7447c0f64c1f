"""Head training on real backbone features: a separable toy task is learned, and the head loads."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from langchain_core.decisions import Noul

from clef_guard import DecisionHead, LocalDecisionModel
from clef_guard.engine.head import READINGS, averaged
from clef_guard.engine.local import DEFAULT_HEAD
from clef_guard.engine.requests import parse_questions
from clef_guard.training.examples import Example
from clef_guard.training.features import Features, extract_features, load_replay, replay_path, save_replay
from clef_guard.training.fit import (
    TrainConfig,
    batch_loss,
    calibrate_head,
    option_loss,
    predict,
    train_head,
)
from clef_guard.training.lora import AdapterConfig, FrozenLayers, train_adapter

QUESTION = Noul(instructions="Does the message mention an animal?")
ANIMALS = ["cat", "dog", "horse", "parrot", "rabbit", "goat", "tiger", "sheep", "mouse", "duck", "whale", "eagle"]
OBJECTS = ["chair", "lamp", "spoon", "table", "pencil", "bottle", "window", "carpet", "phone", "kettle", "brick", "drawer"]
UNSEEN = ["apple", "banana", "guitar", "violin", "truck", "bicycle", "river", "mountain", "candle", "blanket",
          "hammer", "ladder", "pillow", "basket", "mirror", "wallet", "helmet", "jacket", "bucket", "rocket"]


def _toy(words: list[str], label: str, offset: int) -> list[Example]:
    templates = ["I saw a {} this morning.", "There is a {} in the garden.", "My neighbour bought a {}."]
    return [
        Example(f"{label}-{offset + i}", templates[i % 3].format(w), QUESTION, label) for i, w in enumerate(words)
    ]


TRAIN = _toy(ANIMALS[:9], "yes", 0) + _toy(OBJECTS[:9], "no", 0)


@pytest.fixture(scope="module")
def toy(engine: LocalDecisionModel, tmp_path_factory: pytest.TempPathFactory) -> tuple[list, list]:
    cache = tmp_path_factory.mktemp("features")
    test = _toy(ANIMALS[9:], "yes", 9) + _toy(OBJECTS[9:], "no", 9)
    return extract_features(engine, TRAIN, cache=cache), extract_features(engine, test, cache=cache)


def _accuracy(head: DecisionHead | None, features: list) -> float:
    return sum(int(p.argmax()) == f.label for p, f in zip(predict(head, features), features)) / len(features)


def test_training_lowers_the_loss_and_beats_chance(engine: LocalDecisionModel, toy: tuple[list, list]) -> None:
    train, test = toy
    head, history = train_head(train, engine.backbone.hidden_size, TrainConfig(epochs=60, batch_size=6, lr=3e-2))
    assert history[-1] < history[0] * 0.5
    assert _accuracy(head, train) >= 0.9
    assert _accuracy(head, test) > 0.5


def test_the_hidden_layer_learns_a_rule_no_linear_probe_can() -> None:
    """Yes when exactly one of two feature directions is positive (XOR): a linear probe is at chance."""
    generator = torch.Generator().manual_seed(0)
    points = torch.randn(600, 8, generator=generator)  # 6 noise directions, as strong once standardized
    points[:, :2] += 0.5 * points[:, :2].sign()  # a margin around the two axes that decide
    labels = ((points[:, 0] > 0) ^ (points[:, 1] > 0)).long()
    features = [Features("noul", torch.stack([torch.zeros(8), x]), torch.zeros(2), int(y)) for x, y in zip(points, labels)]
    head, _ = train_head(features[:500], 8, TrainConfig(epochs=80))
    assert _accuracy(head, features[500:]) >= 0.75
    head.hidden_out.data.zero_()
    assert _accuracy(head, features[500:]) < 0.65, "the linear part alone cannot have learned it"


def test_a_batch_goes_through_the_head_at_once_as_each_question_would_alone() -> None:
    """Training reads a ragged batch (nouls, choices and scores, one with its own temperature) in one
    pass: its loss and gradients are those of the questions one by one."""
    generator = torch.Generator().manual_seed(0)
    head = DecisionHead(8).eval()  # dropout off: the two ways must see the same units
    for parameter in head.parameters():
        parameter.data.copy_(0.5 * torch.randn(parameter.shape, generator=generator))
    head.question_temperatures = {"own": 2.5}
    batch = [
        Features(reading, torch.randn(n, 8, generator=generator), torch.randn(n, generator=generator), label, question=question)
        for reading, n, label, question in
        [("noul", 2, 1, None), ("choice", 5, 3, None), ("score", 4, 0, "own"), ("noul", 2, 0, "other"), ("choice", 3, 2, None)]
    ]
    logits, label = batch[1].logits(head), batch[1].label  # one question's loss, written out
    smoothed = torch.full((5,), 0.05 / 5) + 0.95 * torch.nn.functional.one_hot(torch.tensor(label), 5)
    by_hand = -(smoothed * logits.log_softmax(-1)).sum() + ((logits.softmax(-1) - torch.eye(5)[label]) ** 2).sum()
    assert torch.allclose(option_loss(logits, label, label_smoothing=0.05, brier_weight=1.0), by_hand, atol=1e-5)
    together = batch_loss(head, batch, label_smoothing=0.05, brier_weight=1.0)
    alone = torch.stack([option_loss(item.logits(head), item.label, label_smoothing=0.05, brier_weight=1.0) for item in batch]).mean()
    assert torch.allclose(together, alone, atol=1e-5)
    trained = [p for p in head.parameters() if p.requires_grad]
    gradients = [torch.autograd.grad(loss, trained, allow_unused=True, materialize_grads=True) for loss in (together, alone)]
    for a, b in zip(*gradients, strict=True):
        assert torch.allclose(a, b, atol=1e-5)
    for item, row in zip(batch, predict(head, batch), strict=True):
        assert torch.allclose(row, torch.softmax(item.logits(head), -1), atol=1e-6)


def test_what_a_head_learns_does_not_depend_on_each_feature_dimension_s_scale(tmp_path: Path) -> None:
    """A language model's hidden states have a few dimensions hundreds of times larger than the
    rest: the head standardizes by its training features, so rescaling and shifting dimensions
    changes nothing it learns, and the statistics travel in the file."""
    generator = torch.Generator().manual_seed(0)
    points = torch.randn(300, 16, generator=generator)
    labels = (points[:, 1] + 0.3 * points[:, 2] > 0).long()
    scale, shift = torch.logspace(-1, 2.5, 16), 50 * torch.randn(16, generator=generator)

    def features(moved: bool) -> list[Features]:
        rows = [torch.stack([-x, x]) * scale + shift if moved else torch.stack([-x, x]) for x in points]
        return [Features("noul", h, torch.zeros(2), int(y)) for h, y in zip(rows, labels)]

    plain, moved = features(False), features(True)
    plain_head, _ = train_head(plain[:200], 16, TrainConfig(epochs=20))
    moved_head, _ = train_head(moved[:200], 16, TrainConfig(epochs=20))
    for a, b in zip(predict(plain_head, plain[200:]), predict(moved_head, moved[200:])):
        assert torch.allclose(a, b, atol=1e-3)
    assert _accuracy(moved_head, moved[200:]) >= 0.9
    moved_head.save(tmp_path / "decision_head.safetensors")
    loaded = DecisionHead.load(tmp_path / "decision_head.safetensors", 16)
    for a, b in zip(predict(loaded, moved[200:]), predict(moved_head, moved[200:])):
        assert torch.allclose(a, b, atol=1e-6)


def test_each_question_gets_its_own_temperature_through_the_file_and_the_engine(engine: LocalDecisionModel, tmp_path: Path) -> None:
    """An untrained head reads the backbone's log-probabilities: one question's are mostly right but too
    soft, another's sharp but wrong half the time, a third's always right; per question, the first two get
    the temperature they need, and the third keeps its reading's (with no errors the fit would run to 0)."""
    generator = torch.Generator().manual_seed(0)
    width, features = engine.backbone.hidden_size, []
    for i in range(80):
        label = i % 2
        right = torch.tensor([0.0, 0.2]) if label else torch.tensor([0.2, 0.0])
        soft = right if i % 8 else right.flip(0)
        sharp = torch.tensor([0.0, 4.0]) if torch.rand(1, generator=generator) < 0.5 else torch.tensor([4.0, 0.0])
        features += [Features("noul", torch.zeros(2, width), soft, label, question="soft"),
                     Features("noul", torch.zeros(2, width), sharp, label, question="sharp"),
                     Features("noul", torch.zeros(2, width), right, label, question="right")]
    head = DecisionHead(width)
    temperatures = calibrate_head(head, features, per_question=True)
    assert temperatures["soft"] < 0.2 and temperatures["sharp"] > 5 and set(temperatures) == {"noul", "soft", "sharp"}
    assert set(calibrate_head(DecisionHead(width), features)) == {"noul"}

    (question,) = parse_questions({"animal": QUESTION})
    head.question_temperatures = {question.key: 0.25}
    head.save(tmp_path / "head.safetensors")
    assert DecisionHead.load(tmp_path / "head.safetensors", width).question_temperatures == {question.key: 0.25}
    request = {"state": "A fox ran across the road.", "questions": {"renamed": QUESTION}}  # the key ignores the id
    tuned = LocalDecisionModel(head=str(tmp_path / "head.safetensors")).invoke(request).nouls["renamed"].noul
    backbone = LocalDecisionModel(default_head=False).invoke(request).nouls["renamed"].noul
    logit = torch.logit(torch.tensor([tuned, backbone], dtype=torch.float64))
    assert float(logit[0]) == pytest.approx(4 * float(logit[1]), rel=1e-3)


def test_a_saved_head_is_the_same_bytes_every_time(tmp_path: Path) -> None:
    """The safetensors writer orders metadata by hash, differently run to run; the head's file sorts its header."""
    head = DecisionHead(16)
    head.question_temperatures = {"b" * 16: 0.5, "a" * 16: 2.0}
    head.save(tmp_path / "one.safetensors")
    head.save(tmp_path / "two.safetensors")
    blob = (tmp_path / "one.safetensors").read_bytes()
    header = json.loads(blob[8 : 8 + int.from_bytes(blob[:8], "little")])
    assert list(header) == sorted(header) and list(header["__metadata__"]) == sorted(header["__metadata__"])
    assert blob == (tmp_path / "two.safetensors").read_bytes()
    assert DecisionHead.load(tmp_path / "one.safetensors", 16).question_temperatures == head.question_temperatures


def test_a_head_trained_on_nouls_leaves_choices_to_the_backbone(engine: LocalDecisionModel, toy: tuple[list, list]) -> None:
    train, _ = toy
    head, _ = train_head(train, engine.backbone.hidden_size, TrainConfig(epochs=5, batch_size=6))
    hidden, logprob = torch.randn(4, engine.backbone.hidden_size), torch.tensor([-1.0, -2.0, -0.5, -3.0])
    with torch.no_grad():
        assert torch.equal(head(hidden, logprob, "choice"), logprob)
        assert not torch.equal(head(hidden, logprob, "noul"), logprob)


def test_a_warm_start_keeps_what_the_new_rows_never_ask(engine: LocalDecisionModel, toy: tuple[list, list]) -> None:
    """Fine-tuning the shipped head on yes/no rows leaves its choice and score readings as they were."""
    train, test = toy
    shipped = DecisionHead.load(DEFAULT_HEAD, engine.backbone.hidden_size)
    head, history = train_head(train, engine.backbone.hidden_size, TrainConfig(epochs=20, batch_size=6), init=shipped)
    noul, choice = READINGS.index("noul"), READINGS.index("choice")
    assert torch.equal(head.feature_mean, shipped.feature_mean) and torch.equal(head.log_temperature, shipped.log_temperature)
    assert torch.equal(head.proj.weight[choice], shipped.proj.weight[choice]) and head.lm_weight[choice] == shipped.lm_weight[choice]
    assert not torch.equal(head.proj.weight[noul], shipped.proj.weight[noul])
    assert history[-1] < history[0] and _accuracy(head, test) >= _accuracy(shipped, test)


def test_a_warm_start_of_several_members_answers_their_mean_logits_from_one_file(
    engine: LocalDecisionModel, toy: tuple[list, list], tmp_path: Path
) -> None:
    """``members=3``: three seeds' heads served as one, wider head (saved and loaded as any head)."""
    train, test = toy
    shipped, size = DecisionHead.load(DEFAULT_HEAD, engine.backbone.hidden_size), engine.backbone.hidden_size
    config = TrainConfig(epochs=10, batch_size=6, seed=4)
    members = [train_head(train, size, replace(config, seed=4 + k), init=shipped)[0] for k in range(3)]
    merged, history = train_head(train, size, replace(config, members=3), init=shipped)
    assert len(history) == config.epochs
    merged.save(tmp_path / "merged.safetensors")
    loaded = DecisionHead.load(tmp_path / "merged.safetensors", size)
    assert loaded.width == 3 * shipped.width
    with torch.no_grad():
        for f in test:
            want = torch.stack([m(f.hidden, f.lm_logprob, f.reading) for m in members]).mean(0)
            assert torch.allclose(loaded(f.hidden, f.lm_logprob, f.reading), want, atol=1e-4)
        assert len({float(m(test[0].hidden, test[0].lm_logprob, "noul")[0]) for m in members}) == 3  # the seeds differ


def test_heads_that_standardise_differently_are_not_averaged(toy: tuple[list, list]) -> None:
    train, _ = toy
    one, _ = train_head(train[:6], 576, TrainConfig(epochs=1))
    other, _ = train_head(train[6:], 576, TrainConfig(epochs=1))
    with pytest.raises(ValueError, match="feature_mean"):
        averaged([one, other])


def test_an_anchored_warm_start_stays_nearer_the_head_it_started_from(engine: LocalDecisionModel, toy: tuple[list, list]) -> None:
    train, _ = toy
    shipped = DecisionHead.load(DEFAULT_HEAD, engine.backbone.hidden_size)
    noul = READINGS.index("noul")

    def moved(anchor: float) -> float:
        head, _ = train_head(train, engine.backbone.hidden_size, TrainConfig(epochs=20, batch_size=6, anchor=anchor), init=shipped)
        return float((head.proj.weight[noul] - shipped.proj.weight[noul]).detach().norm())

    assert moved(10.0) < 0.5 * moved(0.0)


def test_a_head_s_replay_sample_keeps_every_question_and_reads_back_exactly(toy: tuple[list, list], tmp_path: Path) -> None:
    """A warm start replays the rows a head kept of its training, without their datasets or the backbone."""
    train, _ = toy
    other = [Features(f.reading, f.hidden, f.lm_logprob, 1 - f.label, None, "another question") for f in train[:3]]
    path = replay_path(tmp_path / "decision_head.safetensors")
    assert path.name == "decision_head.replay.safetensors"
    assert save_replay(train + other, path, rows=8) == 8
    kept = load_replay(path)
    assert sum(f.question == "another question" for f in kept) == 3  # each question in turn: the small one is kept whole
    assert len({f.question for f in kept[:2]}) == 2  # a prefix of the sample is balanced too (--replay N reads one)
    originals = {(f.question, f.label, f.lm_logprob.tolist()[0]): f for f in train + other}
    for f in kept:
        source = originals[(f.question, f.label, f.lm_logprob.tolist()[0])]
        assert f.reading == source.reading and torch.equal(f.lm_logprob, source.lm_logprob)
        assert torch.equal(f.hidden, source.hidden.to(torch.float16).float())
    save_replay(train, path, rows=8)
    written = path.read_bytes()
    save_replay(train, path, rows=8)
    assert path.read_bytes() == written  # a rebuilt head's sample is the same bytes
    assert load_replay(tmp_path / "missing.safetensors") == []


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


def test_the_training_forward_pass_matches_the_engine(engine: LocalDecisionModel) -> None:
    questions = parse_questions({"animal": QUESTION, "colour": {"type": "choice", "instructions": "Colour?",
                                                                 "criteria": {"red": None, "green": None, "blue": None}}})
    state = {"messages": [{"role": "user", "content": "A green parrot sat on the red lamp."}]}
    served = engine.encode(state, questions).features
    trained = engine.encode_for_training(state, questions)
    for a, b in zip(served, trained, strict=True):
        assert torch.allclose(a.hidden, b.hidden, atol=1e-3) and torch.allclose(a.lm_logprob, b.lm_logprob, atol=1e-4)


def _train_loss(engine: LocalDecisionModel, head: DecisionHead, examples: list[Example]) -> float:
    total = 0.0
    with torch.inference_mode():
        for example in examples:
            (features,) = engine.encode(example.state, parse_questions({"q": example.question})).features
            label = features.question.options.index(example.label)
            logits = head(features.hidden, features.lm_logprob, "noul")
            total += option_loss(logits, label, label_smoothing=0.05, brier_weight=1.0).item()
    return total / len(examples)


def test_lora_training_lowers_the_loss_saves_a_loadable_adapter_and_resumes(
    toy: tuple[list, list], tmp_path: Path
) -> None:
    train, _ = toy
    fresh = LocalDecisionModel(default_head=False)  # the adapter goes into this backbone in place
    head, _ = train_head(train, fresh.backbone.hidden_size, TrainConfig(epochs=60, batch_size=6, lr=3e-2))
    few = TRAIN[:4] + TRAIN[-4:]  # four of each answer keeps the test quick
    before = _train_loss(fresh, head, few)
    # one full-batch step with a small rate is a descent step, so the loss must fall; the
    # head's rate is 0 here, so the fall is the adapter's
    config = AdapterConfig(layers=2, rank=4, epochs=1, lr=2e-5, batch_size=len(few))
    history = train_adapter(fresh, few, head, tmp_path, config, TrainConfig(lr=0.0))
    assert len(history.losses) == len(history.seconds) == 1
    assert _train_loss(fresh, head, few) < before

    loaded = LocalDecisionModel(adapter=str(tmp_path))
    assert loaded.decision_head is not None
    questions = parse_questions({"animal": QUESTION})
    with torch.inference_mode():
        (trained,) = fresh.encode("A fox ran across the road.", questions).features
        in_process = head(trained.hidden, trained.lm_logprob, "noul")
        from_disk = loaded.option_logits(loaded.encode("A fox ran across the road.", questions).features[0])
    assert torch.allclose(in_process, from_disk, atol=1e-3)

    steps: list[int] = []
    resumed = train_adapter(
        LocalDecisionModel(default_head=False), few, head, tmp_path, config, TrainConfig(lr=0.0),
        on_step=lambda done, total: steps.append(done),
    )
    assert resumed == history and steps == []  # the epoch was done: nothing runs again


def test_frozen_layers_run_once_and_their_output_is_reused_exactly(engine: LocalDecisionModel) -> None:
    questions = parse_questions({"animal": QUESTION})
    decoder = engine.backbone.decoder
    bottom_calls: list[int] = []
    handle = decoder.layers[0].register_forward_hook(lambda *_: bottom_calls.append(1))
    below = FrozenLayers(decoder, 2)
    try:
        with below.reused(7):
            (first,) = engine.encode_for_training("A goat ate the lamp.", questions)
        with below.reused(7):
            (again,) = engine.encode_for_training("A goat ate the lamp.", questions)
    finally:
        handle.remove()
    assert bottom_calls == [1]  # the second pass ran the top two layers only
    assert len(decoder.layers) == engine.backbone.lm.config.num_hidden_layers
    assert torch.allclose(first.hidden, again.hidden, atol=1e-5)
    assert torch.allclose(first.lm_logprob, again.lm_logprob, atol=1e-5)


def test_a_wide_choice_matches_unseen_labels_and_a_head_sharpens_it(wide_engine: LocalDecisionModel, tmp_path: Path) -> None:
    from langchain_core.decisions import Choice

    words = ANIMALS + OBJECTS[:8]  # 20 options: more than the engine lists
    question = Choice(instructions="Which thing does the message mention?", criteria={w: None for w in words})
    templates = ["I saw a {} this morning.", "There is a {} in the garden.", "My neighbour bought a {}.",
                 "We talked about a {} at lunch.", "Look, a {} near the door!"]
    rows = [Example(f"{t}-{w}", template.format(w), question, w) for t, template in enumerate(templates) for w in words]
    train = extract_features(wide_engine, rows[:60], cache=tmp_path)
    test = extract_features(wide_engine, rows[60:], cache=tmp_path)
    assert {f.reading for f in train} == {"wide"} and all(f.query is not None for f in train)
    assert train[0].hidden is train[1].hidden  # one label matrix per question, shared by its examples
    assert _accuracy(None, test) > 0.6  # the backbone alone, never trained on these labels (chance: 0.05)
    head, history = train_head(train, wide_engine.backbone.hidden_size, TrainConfig(epochs=30, batch_size=10))
    assert history[-1] < history[0] * 0.7
    assert _accuracy(head, test) >= _accuracy(None, test)
    # what it learned is a map of the space, not these labels: 20 words it never saw still match
    unseen = Choice(instructions=question.instructions, criteria={w: None for w in UNSEEN})
    novel = [Example(f"u{t}-{w}", template.format(w), unseen, w) for t, template in enumerate(templates[:2]) for w in UNSEEN]
    assert _accuracy(head, extract_features(wide_engine, novel, cache=tmp_path)) > 0.9
    head.save(tmp_path / "wide.safetensors")
    served = LocalDecisionModel(head=str(tmp_path / "wide.safetensors"))
    (parsed,) = parse_questions({"q": question})
    assert served.reading(parsed) == "wide"
    # serving reads the map exactly as training did
    answer = served.invoke({"state": rows[0].state, "questions": {"q": question}}).answers["q"]
    (trained,) = predict(head, extract_features(wide_engine, [Example("s", rows[0].state, question, words[0])], cache=tmp_path))
    assert [answer.probabilities[w] for w in words] == pytest.approx(trained.tolist(), abs=1e-3)


def test_processes_sharing_a_feature_cache_keep_each_others_features(tmp_path: Path) -> None:
    """Two benchmarks (or a benchmark and `clef-guard train`) filling one cache lose nothing and do not collide."""
    import subprocess
    import sys

    from clef_guard.training.features import _load, _save

    path = tmp_path / "features" / "key.pt"
    _save({"a": torch.ones(2)}, path)
    other = f"import torch; from pathlib import Path; from clef_guard.training.features import _save; _save({{'b': torch.zeros(2)}}, Path({str(path)!r}))"
    subprocess.run([sys.executable, "-c", other], check=True)
    _save({"a": torch.ones(2), "c": torch.full((2,), 3.0)}, path)  # written after the other process: its "b" stays
    assert set(_load(path)) == {"a", "b", "c"}
    assert not list(path.parent.glob("*.tmp"))
