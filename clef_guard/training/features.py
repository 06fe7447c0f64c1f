"""Stage one of training: what the frozen backbone reads for each labeled example, cached.

The backbone runs once per labeled example (``LocalDecisionModel.encode``); for each
option, the hidden state of its closing token and its mean log-probability are cached.
Extraction dominates the cost of training and is resumable: features are cached per
example in ``<cache>/features/<backbone key>.pt`` and saved as they are made.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import random
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save

from clef_guard.engine.backbone import cache_dir
from clef_guard.engine.head import DecisionHead, sorted_header
from clef_guard.engine.local import LocalDecisionModel
from clef_guard.engine.requests import ParsedQuestion, parse_questions
from clef_guard.engine.state import state_segments, to_json
from clef_guard.engine.tree import OptionFeatures
from clef_guard.training.examples import Example

_SAVE_EVERY = 30.0
"""Seconds between saves of a growing feature cache, at least (each save rewrites the file)."""
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

    @classmethod
    def labeled(cls, read: OptionFeatures, label: str) -> Features:
        """What the engine read for one question (a review log's record, say), with its correct answer."""
        question = read.question
        query = read.query.float() if read.reading == "wide" else None
        return cls(read.reading, read.hidden.float(), read.lm_logprob.float(), list(question.options).index(label), query, question.key)


def extract_features(
    engine: LocalDecisionModel,
    examples: Sequence[Example],
    *,
    cache: Path | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> list[Features]:
    """Features for every example, reusing (and extending) the on-disk cache."""
    path = (cache or cache_dir() / "features") / f"{engine.feature_key}.pt"
    stored: dict[str, dict[str, Any]] = _load(path)
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


def _example_key(example: Example, question: ParsedQuestion) -> str:
    """Key of an example's features: the text the engine reads and what its question asks (a new rendering is a new key)."""
    body = to_json({"state": state_segments(example.state), "question": question.key})
    return hashlib.sha256(body.encode()).hexdigest()


_SEEN: dict[Path, int] = {}
"""Each cache file's modification time when this process last read or wrote it."""


def _load(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    _SEEN[path] = path.stat().st_mtime_ns
    return torch.load(path)


def _save(stored: dict[str, Any], path: Path) -> float:
    """Write the whole cache atomically; returns the seconds it took.

    Processes filling one cache (two benchmarks, a benchmark and ``clef-guard train``) each
    write their own temporary file, under a lock, and a writer first takes in what another
    saved since it last read the file, so no one's features are lost.
    """
    started = time.monotonic()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists() and path.stat().st_mtime_ns != _SEEN.get(path):
            for key, value in torch.load(path).items():
                stored.setdefault(key, value)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=path.stem, suffix=".tmp", delete=False) as staging:
            torch.save(stored, staging)
        Path(staging.name).replace(path)
        _SEEN[path] = path.stat().st_mtime_ns
    return time.monotonic() - started


REPLAY_ROWS = 200
"""Rows a head keeps of what it was trained on (:func:`save_replay`), for warm starts to replay."""


def replay_path(head: Path) -> Path:
    """Where the replay sample of the head file ``head`` lives: beside it, ``<name>.replay.safetensors``."""
    return head.with_name(head.name.removesuffix(".safetensors") + ".replay.safetensors")


def save_replay(features: Sequence[Features], path: Path, *, rows: int = REPLAY_ROWS, seed: int = 0) -> int:
    """Keep a sample of ``features`` at ``path``: the same number from each question, in turn, up to ``rows``.

    A warm start that replays it does not forget the head's old tasks, and needs neither
    their datasets nor a backbone pass over them. Wide readings (option vectors) are left
    out. Returns the rows kept.
    """
    by_question: dict[str | None, list[Features]] = {}
    for f in features:
        if f.reading != "wide":
            by_question.setdefault(f.question, []).append(f)
    rng = random.Random(seed)
    pools = [rng.sample(group, len(group)) for _, group in sorted(by_question.items(), key=lambda item: str(item[0]))]
    kept: list[Features] = []
    while len(kept) < rows and any(pools):
        kept += [pool.pop() for pool in pools if pool][: rows - len(kept)]
    if not kept:
        return 0
    tensors = {
        "hidden": torch.cat([f.hidden for f in kept]).to(torch.float16).contiguous(),
        "lm_logprob": torch.cat([f.lm_logprob for f in kept]).float().contiguous(),
        "options": torch.tensor([len(f.lm_logprob) for f in kept]),
        "label": torch.tensor([f.label for f in kept]),
    }
    rows_meta = [[f.reading, f.question] for f in kept]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(sorted_header(save(tensors, metadata={"format": "clef-guard-replay/1", "rows": json.dumps(rows_meta)})))
    return len(kept)


def load_replay(path: Path) -> list[Features]:
    """The rows :func:`save_replay` kept; none when ``path`` does not exist."""
    if not path.exists():
        return []
    with safe_open(str(path), framework="pt") as handle:
        meta = handle.metadata() or {}
    if meta.get("format") != "clef-guard-replay/1":
        raise ValueError(f"{path} is not a clef-guard replay file")
    tensors = load_file(str(path))
    hidden = tensors["hidden"].float().split(tensors["options"].tolist())
    logprob = tensors["lm_logprob"].split(tensors["options"].tolist())
    return [
        Features(reading, h, lp, int(label), None, question)
        for (reading, question), h, lp, label in zip(json.loads(meta["rows"]), hidden, logprob, tensors["label"].tolist(), strict=True)
    ]
