"""Stage two of training (optional): a LoRA adapter on the backbone's top layers.

LoRA matrices on the top layers of the backbone, trained with the stage-one loss jointly
with the head. Every step runs the backbone forward again, so it costs far more than
stage one; keeping LoRA to the top layers keeps the backward pass short, and the frozen
layers below run once per example (:class:`FrozenLayers`).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from clef_guard.engine.head import HEAD_FILE, DecisionHead
from clef_guard.engine.local import LocalDecisionModel
from clef_guard.engine.requests import parse_questions
from clef_guard.errors import ClefGuardError
from clef_guard.training.examples import Example
from clef_guard.training.fit import TrainConfig, option_loss


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
    try:
        from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    except ImportError:
        raise ClefGuardError("LoRA training needs peft: pip install 'clef-guard[train]'") from None
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
    below = FrozenLayers(engine.backbone.decoder, config.layers)
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


class FrozenLayers:
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


