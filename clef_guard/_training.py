"""Training a decision head on a frozen backbone, from cached features.

The recipe: run the backbone once per labeled example (``LocalDecisionModel.encode``)
and cache, for each option, the hidden state of its closing token and its mean
log-probability; then fit :class:`~clef_guard.DecisionHead` on the cache with
label-smoothed cross-entropy plus a Brier term (which keeps the probabilities honest).
Feature extraction dominates the cost and is resumable: features are cached per
example in ``<cache>/features/<backbone key>.pt`` and saved as they are made.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from clef_guard._backbone import cache_dir
from clef_guard._datasets import Example
from clef_guard._engine import LocalDecisionModel
from clef_guard._head import DecisionHead
from clef_guard._requests import parse_questions
from clef_guard._state import to_json


@dataclass
class Features:
    """What the backbone read for one labeled question."""

    kind: str
    hidden: torch.Tensor
    lm_logprob: torch.Tensor
    label: int


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of head training (the defaults are what the shipped head used)."""

    epochs: int = 40
    lr: float = 2e-2
    weight_decay: float = 1e-3
    label_smoothing: float = 0.05
    brier_weight: float = 1.0
    batch_size: int = 32
    seed: int = 0


def extract_features(
    engine: LocalDecisionModel,
    examples: Sequence[Example],
    *,
    cache: Path | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> list[Features]:
    """Features for every example, reusing (and extending) the on-disk cache."""
    path = (cache or cache_dir() / "features") / f"{_backbone_key(engine)}.pt"
    stored: dict[str, dict[str, Any]] = torch.load(path) if path.exists() else {}
    features, fresh = [], 0
    last_save = time.monotonic()
    for done, example in enumerate(examples, start=1):
        key = _example_key(example)
        if key not in stored:
            (parsed,) = parse_questions({"q": example.question})
            (encoded,) = engine.encode(example.state, [parsed]).features
            stored[key] = {
                "kind": parsed.kind,
                # clone(): leave inference mode's tensors behind, so training can use them
                "hidden": encoded.hidden.to(torch.float16).cpu().clone(),
                "lm_logprob": encoded.lm_logprob.float().cpu().clone(),
                "label": list(parsed.options).index(example.label),
            }
            fresh += 1
            if time.monotonic() - last_save > 30:
                _save(stored, path)
                last_save = time.monotonic()
        entry = stored[key]
        features.append(Features(entry["kind"], entry["hidden"].float(), entry["lm_logprob"], entry["label"]))
        if on_progress:
            on_progress(done, len(examples))
    if fresh:
        _save(stored, path)
    return features


def batch_loss(
    head: DecisionHead, batch: Sequence[Features], *, label_smoothing: float, brier_weight: float
) -> torch.Tensor:
    """Label-smoothed cross-entropy plus ``brier_weight`` times the Brier score, over a ragged batch."""
    losses = []
    for item in batch:
        logits = head(item.hidden, item.lm_logprob, item.kind)
        n = logits.shape[0]
        log_probs = torch.log_softmax(logits, dim=-1)
        target = torch.full((n,), label_smoothing / n)
        target[item.label] += 1.0 - label_smoothing
        onehot = torch.zeros(n)
        onehot[item.label] = 1.0
        brier = ((log_probs.exp() - onehot) ** 2).sum()
        losses.append(-(target * log_probs).sum() + brier_weight * brier)
    return torch.stack(losses).mean()


def train_head(
    features: Sequence[Features],
    hidden_size: int,
    config: TrainConfig = TrainConfig(),
    *,
    on_epoch: Callable[[int, float], None] | None = None,
) -> tuple[DecisionHead, list[float]]:
    """Fit a decision head on cached features; returns it and the loss of each epoch."""
    if not features:
        raise ValueError("no training examples")
    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    head = DecisionHead(hidden_size)
    trainable = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=config.lr, weight_decay=config.weight_decay)
    order = list(range(len(features)))
    history = []
    for epoch in range(config.epochs):
        rng.shuffle(order)
        total = 0.0
        for start in range(0, len(order), config.batch_size):
            batch = [features[i] for i in order[start : start + config.batch_size]]
            optimizer.zero_grad()
            loss = batch_loss(head, batch, label_smoothing=config.label_smoothing, brier_weight=config.brier_weight)
            loss.backward()
            optimizer.step()
            total += loss.item() * len(batch)
        history.append(total / len(order))
        if on_epoch:
            on_epoch(epoch + 1, history[-1])
    return head.eval(), history


def predict(head: DecisionHead | None, features: Sequence[Features]) -> list[torch.Tensor]:
    """Option probabilities per example (the backbone alone when ``head`` is ``None``)."""
    with torch.no_grad():
        return [
            torch.softmax(head(f.hidden, f.lm_logprob, f.kind) if head is not None else f.lm_logprob, dim=-1)
            for f in features
        ]


def config_dict(config: TrainConfig) -> dict[str, Any]:
    """The config as plain data, for reports."""
    return asdict(config)


def _backbone_key(engine: LocalDecisionModel) -> str:
    identity = json.dumps({"model": engine.model, "adapter": engine.adapter, "layout": 1}, sort_keys=True)
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


def _example_key(example: Example) -> str:
    body = to_json({"state": example.state, "question": example.question.model_dump()})
    return hashlib.sha256(body.encode()).hexdigest()


def _save(stored: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_suffix(".tmp")
    torch.save(stored, staging)
    staging.replace(path)
