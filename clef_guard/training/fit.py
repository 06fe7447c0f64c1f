"""Fitting a decision head on cached features, and its temperatures on a dev split.

The loss is label-smoothed cross-entropy plus a Brier term (which keeps the
probabilities honest); see :class:`TrainConfig` for the shipped head's recipe.
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import torch
from langchain_core.decisions import Question

from clef_guard.engine.head import HIDDEN_WIDTH, READINGS, DecisionHead, KnownQuestion, averaged
from clef_guard.engine.novelty import question_text
from clef_guard.engine.requests import parse_questions
from clef_guard.training.calibrate import (
    MIN_QUESTION_ERRORS,
    MIN_TEMPERATURE_EXAMPLES,
    fit_temperature,
)
from clef_guard.training.features import Features

_MIN_SCALE = 1e-3
"""Least spread a standardized feature is divided by (a dimension constant in training)."""


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of head training: the shipped head's recipe (``make default-head``), chosen on dev splits (docs/training.md)."""

    epochs: int = 80
    lr: float = 3e-3
    """Learning rate of the linear part (a faster one fits first and leaves the hidden layer little to learn)."""
    match_lr: float = 1e-3
    """Learning rate of the wide-choice map and its scale (``up @ down`` multiplies two learned matrices)."""
    hidden_lr: float = 3e-3
    """Learning rate of the hidden layer."""
    weight_decay: float = 1e-3
    label_smoothing: float = 0.05
    brier_weight: float = 1.0
    batch_size: int = 32
    seed: int = 0
    anchor: float = 0.0
    """Warm starts only: weight of an L2 pull towards the initial head's weights (keeps old tasks)."""
    members: int = 1
    """Heads trained with seeds ``seed``, ``seed + 1``, ... and served as one (:func:`~clef_guard.engine.head.averaged`):
    a warm start on a few hundred rows moves several points with its seed, their average does not (docs/results.md)."""


WARM_MEMBERS = 5
"""Heads a warm start (``clef-guard train --init-head``) trains and averages by default (``TrainConfig.members``)."""
WARM_ANCHOR = 0.03
"""A warm start's pull towards the head it starts from (``TrainConfig.anchor``), beside the replayed rows: chosen
on dev rows, where after 200 ASSEBench reviews replay alone cost the other tasks 1.7 points and this pull none,
for 1.3 points of the target's (docs/results.md#learning-from-reviews)."""


def option_losses(
    logits: Sequence[torch.Tensor], labels: Sequence[int], *, label_smoothing: float, brier_weight: float
) -> torch.Tensor:
    """Label-smoothed cross-entropy plus ``brier_weight`` times the Brier score of each question, computed at
    once over ragged ``logits`` (their options padded)."""
    padded = torch.nn.utils.rnn.pad_sequence(list(logits), batch_first=True, padding_value=-math.inf)
    sizes = torch.tensor([len(row) for row in logits], device=padded.device)
    present = torch.arange(padded.shape[1], device=padded.device) < sizes[:, None]
    log_probs = torch.log_softmax(padded, dim=-1).masked_fill(~present, 0.0)
    onehot = torch.nn.functional.one_hot(torch.tensor(list(labels), device=padded.device), padded.shape[1]).to(padded.dtype)
    target = present * label_smoothing / sizes[:, None] + (1.0 - label_smoothing) * onehot
    brier = ((log_probs.exp() * present - onehot) ** 2).sum(-1)
    return -(target * log_probs).sum(-1) + brier_weight * brier


def option_loss(logits: torch.Tensor, label: int, *, label_smoothing: float, brier_weight: float) -> torch.Tensor:
    """:func:`option_losses` of one question."""
    return option_losses([logits], [label], label_smoothing=label_smoothing, brier_weight=brier_weight)[0]


def batch_loss(
    head: DecisionHead, batch: Sequence[Features], *, label_smoothing: float, brier_weight: float
) -> torch.Tensor:
    """Mean :func:`option_losses` over a ragged batch of cached features."""
    labels = [item.label for item in batch]
    return option_losses(_batch_logits(head, batch), labels, label_smoothing=label_smoothing, brier_weight=brier_weight).mean()


_LISTED_CHUNK = 1024
"""Questions read as listed that go through the head in one pass (bounds the memory of a large ``predict``)."""


def _batch_logits(head: DecisionHead, batch: Sequence[Features], *, readouts: bool = False) -> list[torch.Tensor]:
    """Each item's logits: listed items go through ``head`` together, and so do wide items that share a
    question's option vectors; with ``readouts``, a question with a readout of its own reads it instead
    (as the engine serves it; training and temperatures read the head's own logits)."""
    logits: dict[int, torch.Tensor] = {}
    shared: dict[tuple[int, str | None], list[tuple[int, torch.Tensor]]] = {}  # by options and question
    listed = []
    for index, item in enumerate(batch):
        if readouts and item.reading != "wide" and (readout := head.readout(item.question)) is not None:
            logits[index] = readout(head.standardized(item.hidden))
        elif item.reading != "wide":
            listed.append(index)
        elif item.query is not None:
            shared.setdefault((id(item.hidden), item.question), []).append((index, item.query))
        else:
            logits[index] = item.logits(head)  # raises: a wide choice needs its query
    for start in range(0, len(listed), _LISTED_CHUNK):
        chunk = listed[start : start + _LISTED_CHUNK]
        sizes = [len(batch[index].hidden) for index in chunk]
        rows = torch.tensor(sizes)
        readings = torch.tensor([READINGS.index(batch[index].reading) for index in chunk]).repeat_interleave(rows)
        temperatures = torch.stack([head.temperature(batch[index].reading, batch[index].question) for index in chunk])
        raw = head.listed(torch.cat([batch[index].hidden for index in chunk]), torch.cat([batch[index].lm_logprob for index in chunk]), readings)
        logits.update(zip(chunk, (raw / temperatures.repeat_interleave(rows)).split(sizes), strict=True))
    for group in shared.values():
        options = batch[group[0][0]].hidden
        scores = torch.stack([batch[index].lm_logprob for index, _ in group])
        rows = head(options, scores, "wide", torch.stack([query for _, query in group]), batch[group[0][0]].question)
        logits.update((index, row) for (index, _), row in zip(group, rows, strict=True))
    return [logits[index] for index in range(len(batch))]


def train_head(
    features: Sequence[Features],
    hidden_size: int,
    config: TrainConfig = TrainConfig(),
    *,
    init: DecisionHead | None = None,
    on_epoch: Callable[[int, float], None] | None = None,
) -> tuple[DecisionHead, list[float]]:
    """Fit a decision head on cached features; returns it and the loss of each epoch (averaged over
    ``config.members``; ``on_epoch`` counts every member's epochs).

    ``init`` warm-starts from an existing head (its standardisation and temperatures kept);
    the readings the features never ask keep ``init``'s weights.
    """
    if not features:
        raise ValueError("no training examples")
    if config.members < 1:
        raise ValueError(f"members must be at least 1, not {config.members}")
    if config.members > 1:
        runs = [
            train_head(
                features, hidden_size, replace(config, members=1, seed=config.seed + member), init=init,
                on_epoch=None if on_epoch is None else lambda epoch, loss, done=member * config.epochs: on_epoch(done + epoch, loss),
            )
            for member in range(config.members)
        ]
        return averaged([head for head, _ in runs]), [sum(losses) / len(runs) for losses in zip(*(h for _, h in runs), strict=True)]
    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    head = DecisionHead(hidden_size, init.width if init is not None else HIDDEN_WIDTH).train()
    if init is not None:
        head.readouts = copy.deepcopy(init.readouts)
        head.load_state_dict(init.state_dict())
        head.question_temperatures = dict(init.question_temperatures)
    listed = [f.hidden for f in features if f.reading != "wide"]
    if init is None and sum(len(h) for h in listed) > 1:  # the features' own mean and spread (see DecisionHead)
        rows = torch.cat(listed).float()
        head.feature_mean.copy_(rows.mean(0))
        head.feature_scale.copy_(rows.std(0).clamp_min(_MIN_SCALE))
    match = [head.match_up, head.match_down, head.log_match_scale]
    layer = [head.hidden_out, *head.hidden_norm.parameters(), *head.hidden_in.parameters()]
    linear = [p for p in head.parameters() if p.requires_grad and all(p is not m for m in (*match, *layer))]
    optimizer = torch.optim.AdamW(
        [{"params": linear}, {"params": match, "lr": config.match_lr}, {"params": layer, "lr": config.hidden_lr}],
        lr=config.lr,
        weight_decay=config.weight_decay,
    )
    anchored = [p.detach().clone() for p in head.parameters()] if init is not None and config.anchor > 0 else []
    order = list(range(len(features)))
    history = []
    for epoch in range(config.epochs):
        rng.shuffle(order)
        total = 0.0
        for start in range(0, len(order), config.batch_size):
            batch = [features[i] for i in order[start : start + config.batch_size]]
            optimizer.zero_grad()
            loss = batch_loss(head, batch, label_smoothing=config.label_smoothing, brier_weight=config.brier_weight)
            if anchored:
                loss = loss + config.anchor * sum(((p - p0) ** 2).sum() for p, p0 in zip(head.parameters(), anchored, strict=True))
            loss.backward()
            optimizer.step()
            total += loss.item() * len(batch)
        history.append(total / len(order))
        if on_epoch:
            on_epoch(epoch + 1, history[-1])
    with torch.no_grad():  # weight decay moved readings the data never asked: give them back the backbone (or init)
        for index, reading in enumerate(READINGS):
            if not any(f.reading == reading for f in features):
                for name in ("proj.weight", "proj.bias", "hidden_out", "lm_weight"):
                    row = head.get_parameter(name)[index]
                    row.copy_(init.get_parameter(name)[index] if init is not None else torch.full_like(row, float(name == "lm_weight")))
    return head.eval(), history


def calibrate_head(head: DecisionHead, features: Sequence[Features], *, per_question: bool = False) -> dict[str, float]:
    """Fit the head's temperatures on ``features`` (a dev split), in place.

    Each reading gets one temperature; with ``per_question``, so does each question with
    at least :data:`MIN_TEMPERATURE_EXAMPLES` examples of which :data:`MIN_QUESTION_ERRORS`
    are answered wrong (its own replaces its reading's).
    Readings with fewer keep temperature 1 (see :func:`fit_temperature`). Returns the
    temperature of every reading present, then of every question fitted (by key).
    """
    with torch.no_grad():
        head.log_temperature.zero_()
        head.question_temperatures = {}
        raw = _batch_logits(head, features)
        members: dict[str, list[int]] = {}  # a reading's examples, then a question's (keys are 16 hex digits)
        for index, f in enumerate(features):
            members.setdefault(f.reading, []).append(index)
            if per_question and f.question is not None:
                members.setdefault(f.question, []).append(index)
        wrong = {i for i, f in enumerate(features) if int(raw[i].argmax()) != f.label}
        temperatures = {
            name: fit_temperature([raw[i] for i in mine], [features[i].label for i in mine])
            for name, mine in members.items()
            if name in READINGS or (len(mine) >= MIN_TEMPERATURE_EXAMPLES and len(wrong.intersection(mine)) >= MIN_QUESTION_ERRORS)
        }
        for index, reading in enumerate(READINGS):
            if reading in temperatures:
                head.log_temperature[index] = math.log(temperatures[reading])
        head.question_temperatures = {k: t for k, t in temperatures.items() if k not in READINGS}
    return temperatures


def predict(
    head: DecisionHead | None, features: Sequence[Features], scales: Sequence[float] | None = None, *, readouts: bool = True
) -> list[torch.Tensor]:
    """Option probabilities per example (the backbone alone when ``head`` is ``None``), questions with a
    readout read by it unless ``readouts`` is false; ``scales`` multiply each example's logits, as the
    engine does by a question's familiarity."""
    with torch.no_grad():
        logits = _batch_logits(head, features, readouts=readouts) if head is not None else [f.lm_logprob for f in features]
        if scales is not None:
            logits = [row * scale for row, scale in zip(logits, scales, strict=True)]
        return [torch.softmax(row, dim=-1) for row in logits]


def trained_questions(questions: Iterable[Question], init: DecisionHead | None = None) -> tuple[KnownQuestion, ...]:
    """What a head trained on ``questions`` remembers of them (:attr:`DecisionHead.questions`), with
    the questions of the head it started from (a warm start replays their rows)."""
    known = {KnownQuestion(parsed.kind, question_text(parsed)) for question in questions for parsed in parse_questions({"q": question})}
    return tuple(sorted(known | set(init.questions if init is not None else ())))


