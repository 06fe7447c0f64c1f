"""How familiar a question is to the decision head, and how far its answers are trusted.

A head trained on some questions is confidently wrong on questions unlike them
(``benchmarks/quality.py unseen``: a head that never saw MetaTool's question read it at 0.40
with ECE 0.40). So a head remembers the questions it was trained on (their kind and
:func:`question_text`), and the engine's sentence encoder measures how close a new question
comes to the nearest of them of its own kind (the cosine of the two texts, 1 for a question
trained on verbatim). Kind matters because each kind is its own reading with its own weights
(:mod:`clef_guard.engine.head`): a head trained on "Is the agent's action unsafe?" has
learned nothing about reading the levels of "How clearly unsafe is it?". The head's logits
are multiplied by :func:`familiarity_scale` of that cosine: 1 for a trained question,
falling towards 0 (every option equally likely) for a question unlike any. Multiplying logits by a positive number never changes which option is most
likely, so accuracy is untouched; only the confidence moves.

The scale's two constants were fitted by log-loss on dev rows of the leave-one-family-out
heads of ``quality.py unseen`` (each family's rows unseen by one head, seen by the others;
``--fit-familiarity`` refits them), and the test rows of the held-out families judge it
(docs/results.md).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from clef_guard.engine.backbone import cache_dir
from clef_guard.engine.head import KnownQuestion
from clef_guard.engine.requests import ParsedQuestion
from clef_guard.engine.state import content_text

if TYPE_CHECKING:
    from clef_guard.engine.encoder import Encoder

FAMILIARITY_SLOPE = 9.2
"""How fast trust falls as a question's cosine to the nearest trained question drops."""
FAMILIARITY_MIDPOINT = 0.82
"""The cosine at which the head's logits would keep half the weight they keep at 1."""
_CACHE_SIZE = 8192


def question_text(question: ParsedQuestion) -> str:
    """What a question asks, as one text: its instructions, then its options (a score's levels)."""
    text = content_text(question.instructions)
    if question.kind == "noul":
        return text
    options = question.descriptions if question.kind == "score" else question.options
    return f"{text} " + " / ".join(content_text(option) for option in options)


def familiarity_scale(cosine: float, slope: float = FAMILIARITY_SLOPE, midpoint: float = FAMILIARITY_MIDPOINT) -> float:
    """The factor on the head's logits for a question whose nearest trained question is at ``cosine``
    (``slope`` and ``midpoint`` other than the shipped ones: to refit them, ``quality.py unseen --fit-familiarity``)."""
    def weight(c: float) -> float:
        return 1.0 / (1.0 + math.exp(-slope * (c - midpoint)))

    return min(1.0, weight(cosine) / weight(1.0))


class QuestionMemory:
    """The questions a head was trained on, embedded once by a sentence encoder (and kept on disk)."""

    def __init__(self, known: Sequence[KnownQuestion], encoder: Encoder, encoder_name: str) -> None:
        self._encoder = encoder
        known = sorted(set(known))
        self._kinds = [question.kind for question in known]
        texts = [question.text for question in known]
        digest = hashlib.sha256(json.dumps([encoder_name, texts]).encode()).hexdigest()[:16]
        path = cache_dir() / "question-vectors" / f"{digest}.pt"
        if path.exists():
            self._vectors = torch.load(path, weights_only=True)
        else:
            self._vectors = encoder.embed(texts)
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(f"{path.name}.{os.getpid()}-{threading.get_ident()}.partial")
            torch.save(self._vectors, partial)
            partial.replace(path)
        self._cosines: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def cosine(self, question: ParsedQuestion) -> float:
        """The cosine between ``question`` and the nearest trained question of its kind (a question
        of a head that kept no kinds counts as every kind; 0 where there is none), computed once per question."""
        with self._lock:
            known = self._cosines.get(question.key)
        if known is None:
            rows = [i for i, kind in enumerate(self._kinds) if kind in (question.kind, "")]
            query = self._encoder.embed([question_text(question)])[0]
            known = float((self._vectors[rows] @ query).max()) if rows else 0.0
            with self._lock:
                self._cosines[question.key] = known
                while len(self._cosines) > _CACHE_SIZE:
                    self._cosines.popitem(last=False)
        return known
