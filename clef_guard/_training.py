"""Training a decision head on a frozen backbone, and optionally a LoRA adapter under it.

Stage one: run the backbone once per labeled example (``LocalDecisionModel.encode``)
and cache, for each option, the hidden state of its closing token and its mean
log-probability; then fit :class:`~clef_guard.DecisionHead` on the cache with
label-smoothed cross-entropy plus a Brier term (which keeps the probabilities honest).
Feature extraction dominates the cost and is resumable: features are cached per
example in ``<cache>/features/<backbone key>.pt`` and saved as they are made.

Stage two (:func:`train_adapter`, optional): LoRA matrices on the top layers of the
backbone, trained with the same loss jointly with the stage-one head. Every step runs
the backbone forward again, so it costs far more than stage one; keeping LoRA to the
top layers keeps the backward pass short.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from clef_guard._backbone import cache_dir
from clef_guard._datasets import Example
from clef_guard._engine import LocalDecisionModel
from clef_guard._errors import ClefGuardError
from clef_guard._calibration import MIN_QUESTION_ERRORS, MIN_TEMPERATURE_EXAMPLES, fit_temperature
from clef_guard._head import HEAD_FILE, READINGS, DecisionHead
from clef_guard._requests import ParsedQuestion, parse_questions
from clef_guard._state import state_segments, to_json


_SAVE_EVERY = 30.0
"""Seconds between saves of a growing feature cache, at least (each save rewrites the file)."""
_MIN_SCALE = 1e-3
"""Least spread a standardized feature is divided by (a dimension constant in training)."""
_WIDE_FEATURES = 2
"""Version of the wide features (2: one-word query on the penultimate layer, options read as states)."""


@dataclass
class Features:
    """What the backbone read for one labeled question (see ``OptionFeatures``)."""

    reading: str
    hidden: torch.Tensor
    lm_logprob: torch.Tensor
    label: int
    query: torch.Tensor | None = None
    """Stored for wide choices only, the one reading whose head uses it."""
    question: str | None = None
    """The question's key (:attr:`ParsedQuestion.key`), for its own temperature."""

    def logits(self, head: DecisionHead) -> torch.Tensor:
        """The option logits ``head`` gives these features."""
        return head(self.hidden, self.lm_logprob, self.reading, self.query, self.question)


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of head training: the shipped head's recipe (``make default-head``), chosen on dev splits (README)."""

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
    floats: dict[str, torch.Tensor] = {}  # one float copy of each shared label matrix
    last_save, save_every = time.monotonic(), _SAVE_EVERY
    for done, example in enumerate(examples, start=1):
        (parsed,) = parse_questions({"q": example.question})
        key = _example_key(example, parsed)
        reading = engine.reading(parsed)
        cached = stored.get(key)  # entries from before wide choices name their reading "kind"
        if cached is None or _stale(cached, reading):
            (encoded,) = engine.encode(example.state, [parsed]).features
            # clone(): leave inference mode's tensors behind, so training can use them
            hidden: torch.Tensor | str = encoded.hidden.to(torch.float16).cpu().clone()
            if reading == "wide":  # option vectors are the question's, not the example's: store them once
                shared = "labels:" + hashlib.sha256(hidden.numpy().tobytes()).hexdigest()
                stored.setdefault(shared, hidden)
                hidden = shared
            stored[key] = {
                "reading": reading,
                "hidden": hidden,
                "lm_logprob": encoded.lm_logprob.float().cpu().clone(),
                "label": list(parsed.options).index(example.label),
                "query": encoded.query.to(torch.float16).cpu().clone() if reading == "wide" else None,
                "wide_features": _WIDE_FEATURES if reading == "wide" else None,
            }
            fresh += 1
            if time.monotonic() - last_save > save_every:
                save_every = max(_SAVE_EVERY, 20 * _save(stored, path))  # saving stays under 5% of the time
                last_save = time.monotonic()
        entry = stored[key]
        query = entry["query"].float() if entry.get("query") is not None else None
        hidden = entry["hidden"]
        if isinstance(hidden, str):  # a shared label matrix: convert it once
            if hidden not in floats:
                floats[hidden] = stored[hidden].float()
            hidden = floats[hidden]
        else:
            hidden = hidden.float()
        features.append(Features(reading, hidden, entry["lm_logprob"], entry["label"], query, parsed.key))
        if on_progress:
            on_progress(done, len(examples))
    if fresh:
        _save(stored, path)
    return features


def _stale(entry: dict[str, Any], reading: str) -> bool:
    """Whether a cached entry was read another way, or wide by an older engine."""
    read = entry.get("reading", entry.get("kind"))
    return read != reading or (reading == "wide" and entry.get("wide_features") != _WIDE_FEATURES)


def option_loss(logits: torch.Tensor, label: int, *, label_smoothing: float, brier_weight: float) -> torch.Tensor:
    """Label-smoothed cross-entropy plus ``brier_weight`` times the Brier score of one question."""
    n = logits.shape[0]
    log_probs = torch.log_softmax(logits, dim=-1)
    target = torch.full((n,), label_smoothing / n)
    target[label] += 1.0 - label_smoothing
    onehot = torch.zeros(n)
    onehot[label] = 1.0
    brier = ((log_probs.exp() - onehot) ** 2).sum()
    return -(target * log_probs).sum() + brier_weight * brier


def batch_loss(
    head: DecisionHead, batch: Sequence[Features], *, label_smoothing: float, brier_weight: float
) -> torch.Tensor:
    """Mean :func:`option_loss` over a ragged batch of cached features."""
    return torch.stack(
        [
            option_loss(logits, item.label, label_smoothing=label_smoothing, brier_weight=brier_weight)
            for item, logits in zip(batch, _batch_logits(head, batch), strict=True)
        ]
    ).mean()


def _batch_logits(head: DecisionHead, batch: Sequence[Features]) -> list[torch.Tensor]:
    """Each item's logits; wide items that share a question's option vectors go through ``head`` at once."""
    logits: dict[int, torch.Tensor] = {}
    shared: dict[tuple[int, str | None], list[tuple[int, torch.Tensor]]] = {}  # by options and question
    for index, item in enumerate(batch):
        if item.reading == "wide" and item.query is not None:
            shared.setdefault((id(item.hidden), item.question), []).append((index, item.query))
        else:
            logits[index] = item.logits(head)
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
    on_epoch: Callable[[int, float], None] | None = None,
) -> tuple[DecisionHead, list[float]]:
    """Fit a decision head on cached features; returns it and the loss of each epoch."""
    if not features:
        raise ValueError("no training examples")
    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    head = DecisionHead(hidden_size).train()
    listed = [f.hidden for f in features if f.reading != "wide"]
    if sum(len(h) for h in listed) > 1:  # the features' own mean and spread (see DecisionHead)
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
    with torch.no_grad():  # weight decay moved readings the data never asked: give them the backbone back
        for index, reading in enumerate(READINGS):
            if not any(f.reading == reading for f in features):
                head.proj.weight[index].zero_()
                head.proj.bias[index].zero_()
                head.hidden_out[index].zero_()
                head.lm_weight[index] = 1.0
    return head.eval(), history


@dataclass(frozen=True)
class AdapterConfig:
    """LoRA on the top layers of the backbone, trained jointly with the head."""

    layers: int = 4
    """How many of the top decoder layers get LoRA matrices (gradients stop below them)."""
    rank: int = 8
    alpha: int = 16
    epochs: int = 1
    lr: float = 2e-4
    """Learning rate of the LoRA matrices (the head keeps ``TrainConfig.lr / 10``)."""
    batch_size: int = 8


@dataclass
class AdapterHistory:
    """Per finished epoch of :func:`train_adapter`: its mean loss and its wall-clock seconds."""

    losses: list[float]
    seconds: list[float]


def train_adapter(
    engine: LocalDecisionModel,
    examples: Sequence[Example],
    head: DecisionHead,
    out: Path,
    config: AdapterConfig = AdapterConfig(),
    loss: TrainConfig = TrainConfig(),
    *,
    on_step: Callable[[int, int], None] | None = None,
) -> AdapterHistory:
    """Fit a LoRA adapter on ``engine``'s backbone together with ``head``, epoch by epoch.

    The adapter goes into the backbone in place, so ``engine`` answers with it afterwards.
    After every epoch ``out`` is written as an adapter folder (peft files plus the head,
    which ``LocalDecisionModel(adapter=out)`` loads) with ``train_progress.json``; a run
    into a folder that holds an unfinished one resumes after its last finished epoch.
    """
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from safetensors.torch import load_file

    total_layers = int(engine.backbone.lm.config.num_hidden_layers)
    if not 1 <= config.layers <= total_layers:
        raise ClefGuardError(f"LoRA layers must be 1 to {total_layers} (the backbone's depth), not {config.layers}")
    peft_config = LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=0.0,
        target_modules=sorted(  # every linear map inside the decoder layers, whatever this family names them
            {name.rsplit(".", 1)[-1] for name, module in engine.backbone.lm.named_modules()
             if isinstance(module, torch.nn.Linear) and ".layers." in name}
        ),
        layers_to_transform=list(range(total_layers - config.layers, total_layers)),
    )
    model = get_peft_model(engine.backbone.lm, peft_config)
    engine.clear_prefix_cache()  # cached prefixes were computed without the adapter
    progress_file = out / "train_progress.json"
    history = AdapterHistory([], [])
    if progress_file.exists():
        done = json.loads(progress_file.read_text())
        history = AdapterHistory(done["epoch_losses"], done["epoch_seconds"])
        set_peft_model_state_dict(model, load_file(str(out / "adapter_model.safetensors")))
        head.load_state_dict(DecisionHead.load(out / HEAD_FILE, head.hidden_size).state_dict())
    torch.manual_seed(loss.seed)
    rng = random.Random(loss.seed)
    head_params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in model.parameters() if p.requires_grad], "lr": config.lr},
            {"params": head_params, "lr": loss.lr / 10},
        ],
        weight_decay=loss.weight_decay,
    )
    parsed = [parse_questions({"q": example.question})[0] for example in examples]
    labels = [list(question.options).index(example.label) for question, example in zip(parsed, examples, strict=True)]
    order = list(range(len(examples)))
    steps = len(order) * config.epochs
    for _ in history.losses:
        rng.shuffle(order)  # replay the finished epochs' shuffles
    below = _FrozenLayers(engine.backbone.decoder, config.layers)
    with torch.enable_grad():
        for epoch in range(len(history.losses), config.epochs):
            rng.shuffle(order)
            total, started = 0.0, time.perf_counter()
            for start in range(0, len(order), config.batch_size):
                batch = order[start : start + config.batch_size]
                optimizer.zero_grad()
                for index in batch:
                    with below.reused(index):
                        (features,) = engine.encode_for_training(examples[index].state, [parsed[index]])
                    logits = head(features.hidden, features.lm_logprob, features.reading, features.query)
                    value = option_loss(
                        logits, labels[index], label_smoothing=loss.label_smoothing, brier_weight=loss.brier_weight
                    )
                    (value / len(batch)).backward()  # one example's graph at a time keeps memory flat
                    total += value.item()
                optimizer.step()
                if on_step:
                    on_step(epoch * len(order) + start + len(batch), steps)
            history.losses.append(total / len(order))
            history.seconds.append(round(time.perf_counter() - started, 1))
            out.mkdir(parents=True, exist_ok=True)
            model.save_pretrained(str(out))
            head.save(out / HEAD_FILE)
            progress = {"epoch_losses": history.losses, "epoch_seconds": history.seconds, "config": asdict(config)}
            progress_file.write_text(json.dumps(progress))
    engine.clear_prefix_cache()
    return history


class _FrozenLayers:
    """Runs the layers below the LoRA ones once per example and reuses what they produce.

    Those layers are frozen, so their output for an example never changes: the first pass
    records the hidden states entering the lowest LoRA layer, and later passes feed them
    straight into it, running only the top layers. That makes an epoch after the first
    cost about ``top / depth`` of a full pass. A decoder without a ``layers`` list runs
    in full every time.
    """

    def __init__(self, decoder: Any, top: int) -> None:
        layers = getattr(decoder, "layers", None)
        self._decoder = decoder if isinstance(layers, torch.nn.ModuleList) and top < len(layers) else None
        self._top = top
        self._inputs: dict[int, torch.Tensor] = {}

    @contextmanager
    def reused(self, key: int) -> Iterator[None]:
        """Within this block, the backbone pass for example ``key`` records or reuses the frozen part."""
        if self._decoder is None:
            yield
            return
        layers = self._decoder.layers
        lowest = layers[len(layers) - self._top]
        if key not in self._inputs:
            def record(module: Any, args: tuple[Any, ...]) -> None:
                if args:  # a family that passes hidden states by keyword is never replayed
                    self._inputs[key] = args[0].detach()

            handle = lowest.register_forward_pre_hook(record)
            try:
                yield
            finally:
                handle.remove()
            return

        def replay(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
            return (self._inputs[key], *args[1:])

        handle = lowest.register_forward_pre_hook(replay)
        self._decoder.layers = torch.nn.ModuleList(list(layers)[-self._top :])
        try:
            yield
        finally:
            self._decoder.layers = layers
            handle.remove()


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


def predict(head: DecisionHead | None, features: Sequence[Features]) -> list[torch.Tensor]:
    """Option probabilities per example (the backbone alone when ``head`` is ``None``)."""
    with torch.no_grad():
        logits = _batch_logits(head, features) if head is not None else [f.lm_logprob for f in features]
        return [torch.softmax(row, dim=-1) for row in logits]


def _backbone_key(engine: LocalDecisionModel) -> str:
    adapter = None
    if engine.adapter is not None:  # by content: retraining into the same folder must not reuse features
        weights = Path(engine.adapter) / "adapter_model.safetensors"
        adapter = hashlib.sha256(weights.read_bytes()).hexdigest() if weights.exists() else engine.adapter
    identity = json.dumps({"model": engine.model, "adapter": adapter, "layout": 2}, sort_keys=True)
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


def _example_key(example: Example, question: ParsedQuestion) -> str:
    """Key of an example's features: the text the engine reads and what its question asks (a new rendering is a new key)."""
    body = to_json({"state": state_segments(example.state), "question": question.key})
    return hashlib.sha256(body.encode()).hexdigest()


def _save(stored: dict[str, Any], path: Path) -> float:
    """Write the whole cache (atomically); returns the seconds it took."""
    started = time.monotonic()
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_suffix(".tmp")
    torch.save(stored, staging)
    staging.replace(path)
    return time.monotonic() - started
