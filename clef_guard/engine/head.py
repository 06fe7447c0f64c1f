"""The decision head: turns per-option features into option logits.

A question is read in one of four ways (:data:`READINGS`): a ``noul``, a ``score``, a
``choice`` whose options the prompt lists (each option a branch of the forward pass),
and a ``wide`` choice, one with more options than the engine lists (see
``LocalDecisionModel.wide_choice_options``).

For a listed option the engine extracts the hidden state of the token that closes it
(it has read the state, the question and the option) and the backbone's mean
log-probability of the option's tokens. The head standardizes ``h`` with the mean and
spread of its training features (``x = (h - mean) / scale``: a language model's hidden
states have a few dimensions hundreds of times larger than the rest, which would otherwise
set the probe's effective regularisation) and scores it as
``w[r] . x + b[r] + v[r] . gelu(W norm(x)) + lm_weight[r] * lm_logprob`` for reading ``r``:
a linear probe plus one small hidden layer that the listed readings share. The hidden
layer lets one head answer unrelated yes/no questions (a tool's need, an injection, an
unsafe agent action) without one direction of ``h`` serving them all.

A wide choice is read like a bi-encoder: ``query`` is the hidden state where the one-word
answer would start (it has read the state and the question, no option), each option
``h`` is the query of the same question asked about the option's label alone, and
``lm_logprob`` is the backbone's own match, :data:`WIDE_MATCH_SCALE` times their
:func:`centred_cosine`. A trained head learns a map ``M = 1 + up @ down`` of that space
(low rank, starting at the identity) and adds ``s * (cos(Mq, Mh) - cos(q, h))``. It has
no per-label weights, so a trained head still matches labels it never saw, though a map
fitted to one intent set reads another worse than the untrained one does (docs/results.md). A
many-way choice then costs one question plus cached option vectors.

Every reading has its own weights and a temperature, so learning choices does not cost
yes/no accuracy, and a reading the head was never trained on reads the backbone alone
(``w = 0``, ``v = 0``, ``U = 0``, ``lm_weight = 1``, temperature 1), as an engine without a head does.
A question calibrated on enough labeled answers has its own temperature
(:attr:`DecisionHead.question_temperatures`, by :attr:`ParsedQuestion.key`), which
replaces its reading's.

A question people have answered often enough can have a readout of its own
(:attr:`DecisionHead.readouts`, by question key; fitted by
:func:`clef_guard.training.readout.fit_readouts` on a review log): a linear map from all its
options' standardized hidden states to its option logits, its temperature folded in. Where a
question has one, it answers that question in the head's place; the head stays what every
other question reads.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save
from torch import nn

from clef_guard.errors import ModelLoadError

READINGS: tuple[str, ...] = ("noul", "choice", "score", "wide")
HEAD_FILE = "decision_head.safetensors"
MATCH_RANK = 128
"""Rank of the learned change to the wide-choice space (``up @ down``)."""
WIDE_MATCH_SCALE = 12.5
"""Logit per unit of centred cosine between a wide choice's query and an option: the
inverse of the temperature fitted on CLINC150 dev rows read wide by the backbone alone."""
HIDDEN_WIDTH = 256
"""Width of the hidden layer the listed readings share."""
_DROPOUT = 0.1
_FORMAT = "clef-guard-head/7"
"""The one head format this version reads (its metadata ``format``); older heads are retrained."""
_MATCH = ("match_up", "match_down", "log_match_scale")
_HIDDEN = ("hidden_norm.weight", "hidden_norm.bias", "hidden_in.weight", "hidden_in.bias", "hidden_out")


class KnownQuestion(NamedTuple):
    """A question a head was trained on: its kind (``noul``, ``choice``, ``score``; ``""`` in a
    head written before kinds were kept) and its :func:`~clef_guard.engine.novelty.question_text`."""

    kind: str
    text: str


def centred_cosine(query: torch.Tensor, options: torch.Tensor) -> torch.Tensor:
    """Cosine of ``query`` (``[H]`` or ``[B, H]``) with each of ``options`` (``[n, H]``), all
    centred on the options' mean: ``[n]`` or ``[B, n]``.

    Centring removes what every option shares (the question, the prompt), which otherwise
    dominates the cosine; it needs no statistics beyond the question's own options.
    """
    center = options.mean(0)
    unit = nn.functional.normalize
    return unit(query - center, dim=-1) @ unit(options - center, dim=-1).T


def sorted_header(blob: bytes) -> bytes:
    """A safetensors file with its header's keys sorted, so that equal contents are equal bytes.

    The writer orders the metadata by hash, differently from run to run; sorting moves no
    tensor (each names its own offsets) and keeps the header's length.
    """
    size = int.from_bytes(blob[:8], "little")
    header = json.dumps(json.loads(blob[8 : 8 + size]), sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    return blob[:8] + header.ljust(size) + blob[8 + size :] if len(header) <= size else blob


class Readout(nn.Module):
    """One question's own option scorer: ``logits = weight . x + bias``, with ``x`` the standardized
    hidden states of all the question's options in its order (``weight`` ``[n, n, H]``, ``bias`` ``[n]``).

    It remembers the answers it learned from: ``seen`` (``[N]``, each one's fingerprint) and
    ``held_out`` (``[N, n]``, the probabilities a readout fitted without it gave it), so that
    thresholds fitted on those rows read them as if new (:func:`clef_guard.training.readout.held_out`)."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor, seen: torch.Tensor | None = None, held_out: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("bias", bias)
        self.register_buffer("seen", seen if seen is not None else torch.zeros(0, dtype=torch.int64))
        self.register_buffer("held_out", held_out if held_out is not None else torch.zeros(0, len(bias)))

    def forward(self, standardized: torch.Tensor) -> torch.Tensor:
        """Option logits of ``standardized`` (``[n, H]``, or ``[B, n, H]`` for ``[B, n]``)."""
        return self.score(standardized, self.weight, self.bias)

    @staticmethod
    def score(standardized: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """What a readout of ``weight`` and ``bias`` gives ``standardized`` (also while they are being fitted)."""
        return torch.einsum("...jh,ijh->...i", standardized, weight) + bias


class DecisionHead(nn.Module):
    """Linear option scorer over hidden states and LM log-probabilities, per reading."""

    def __init__(self, hidden_size: int, width: int = HIDDEN_WIDTH) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.proj = nn.Linear(hidden_size, len(READINGS))
        self.lm_weight = nn.Parameter(torch.ones(len(READINGS)))
        self.log_temperature = nn.Parameter(torch.zeros(len(READINGS)), requires_grad=False)
        self.match_up = nn.Parameter(torch.zeros(hidden_size, MATCH_RANK))
        self.match_down = nn.Parameter(torch.randn(MATCH_RANK, hidden_size) / hidden_size**0.5)
        self.log_match_scale = nn.Parameter(torch.tensor(WIDE_MATCH_SCALE).log())
        self.hidden_norm = nn.LayerNorm(hidden_size)
        self.hidden_in = nn.Linear(hidden_size, width)
        self.hidden_out = nn.Parameter(torch.zeros(len(READINGS), width))
        self.dropout = nn.Dropout(_DROPOUT)
        self.register_buffer("feature_mean", torch.zeros(hidden_size))
        self.register_buffer("feature_scale", torch.ones(hidden_size))
        self.question_temperatures: dict[str, float] = {}
        """Temperature of each question calibrated on its own, by question key; others use their reading's."""
        self.questions: tuple[KnownQuestion, ...] = ()
        """The questions it was trained on, sorted: the engine trusts its answers to a question as
        far as the question resembles one of them of its kind."""
        self.readouts = nn.ModuleDict()
        """Questions answered by a readout of their own (:class:`Readout`), as ``"q" + key``."""
        self.layers: int | None = None
        """The decoder layers whose output it reads (the engine runs only those); ``None``: all of them."""
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(
        self,
        hidden: torch.Tensor,
        lm_logprob: torch.Tensor,
        reading: str,
        query: torch.Tensor | None = None,
        question: str | None = None,
    ) -> torch.Tensor:
        """Option logits for one question: ``hidden`` is ``[n, H]``, ``lm_logprob`` ``[n]``.

        ``query`` (``[H]``) is required for the ``wide`` reading and ignored otherwise. A wide
        choice also takes a batch of questions over the same options: ``query`` ``[B, H]`` and
        ``lm_logprob`` ``[B, n]`` give ``[B, n]`` logits. ``question`` (a question's key)
        picks its own temperature where it has one.
        """
        k = READINGS.index(reading)
        if (readout := self.readout(question)) is not None and reading != "wide":
            return readout(self.standardized(hidden))
        if reading == "wide":  # no per-option weights: they would learn the training labels, not the match
            if query is None:
                raise ValueError("a wide choice is scored against the question's query vector")
            hidden = hidden.to(self.proj.weight.dtype)
            query = query.to(hidden.dtype)
            mapped = centred_cosine(self.wide_map(query), self.wide_map(hidden))
            raw = self.lm_weight[k] * lm_logprob + self.log_match_scale.exp() * (mapped - centred_cosine(query, hidden))
        else:
            raw = self.listed(hidden, lm_logprob, torch.full((len(hidden),), k))
        return raw / self.temperature(reading, question)

    def listed(self, hidden: torch.Tensor, lm_logprob: torch.Tensor, readings: torch.Tensor) -> torch.Tensor:
        """Logits before temperature of options read as listed, of any number of questions at once:
        ``hidden`` ``[N, H]``, ``lm_logprob`` ``[N]`` and ``readings`` (each row's index in :data:`READINGS`) ``[N]``."""
        hidden = self.standardized(hidden)
        shared = self.dropout(nn.functional.gelu(self.hidden_in(self.dropout(self.hidden_norm(hidden)))))
        readings = readings.to(hidden.device)
        column = readings[:, None]
        raw = (hidden @ self.proj.weight.T).gather(1, column) + (shared @ self.hidden_out.T).gather(1, column)
        return raw.squeeze(1) + self.proj.bias[readings] + self.lm_weight[readings] * lm_logprob

    def standardized(self, hidden: torch.Tensor) -> torch.Tensor:
        """Listed options' hidden states as the head reads them: less its training features' mean, over their spread."""
        return (hidden.to(self.proj.weight.dtype) - self.feature_mean) / self.feature_scale

    def readout(self, question: str | None) -> Readout | None:
        """The readout of the question keyed ``question``, if it has one."""
        name = f"q{question}"
        return self.readouts[name] if question is not None and name in self.readouts else None  # type: ignore[return-value]

    def set_readout(self, question: str, readout: Readout | None) -> None:
        """Answer the question keyed ``question`` with ``readout`` from now on (``None``: with the head again)."""
        if readout is None:
            if f"q{question}" in self.readouts:
                del self.readouts[f"q{question}"]
        else:
            self.readouts[f"q{question}"] = readout.to(self.feature_mean.device)

    def temperature(self, reading: str, question: str | None = None) -> torch.Tensor:
        """What a question's logits are divided by (a scalar): its own temperature where it has one, else its reading's."""
        if question in self.question_temperatures:
            return torch.tensor(self.question_temperatures[question])
        return self.log_temperature[READINGS.index(reading)].exp()

    @property
    def width(self) -> int:
        """Width of the hidden layer (:data:`HIDDEN_WIDTH`; a multiple of it for an :func:`averaged` head)."""
        return self.hidden_out.shape[1]

    @property
    def reads_wide(self) -> bool:
        """Whether the wide map was trained: an untrained one is the identity, and the engine
        then gives wide choices to its sentence encoder."""
        return bool(self.match_up.any())

    def wide_map(self, vectors: torch.Tensor) -> torch.Tensor:
        """``[n, H]`` wide-choice vectors through the learned map ``1 + up @ down``."""
        return vectors + (vectors @ self.match_down.T) @ self.match_up.T

    def save(self, path: str | Path) -> None:
        """Write the head as safetensors with its format and width in the metadata."""
        tensors = {name: value.detach().cpu().contiguous() for name, value in self.state_dict().items()}
        for unused, names in ((not self.reads_wide, _MATCH), (not self.hidden_out.any(), _HIDDEN)):
            if unused:  # an untrained wide map is the identity, an untrained hidden layer adds 0: load recreates them
                tensors = {name: value for name, value in tensors.items() if name not in names}
        metadata = {"format": _FORMAT, "hidden_size": str(self.hidden_size)}
        if self.question_temperatures:
            metadata["question_temperatures"] = json.dumps(self.question_temperatures, sort_keys=True)
        if self.questions:
            metadata["questions"] = json.dumps(sorted(self.questions))
        if self.layers is not None:
            metadata["layers"] = str(self.layers)
        Path(path).write_bytes(sorted_header(save(tensors, metadata=metadata)))

    @classmethod
    def load(cls, path: str | Path, hidden_size: int) -> DecisionHead:
        """Read a head written by :meth:`save` in the current format, ready to answer; its width must match the backbone's."""
        try:
            tensors = load_file(str(path))
            with safe_open(str(path), "pt") as handle:
                metadata = handle.metadata() or {}
            file_format = metadata.get("format")
            question_temperatures = {str(k): float(t) for k, t in json.loads(metadata.get("question_temperatures", "{}")).items()}
            questions = tuple(_known(entry) for entry in json.loads(metadata.get("questions", "[]")))
            layers = int(metadata["layers"]) if "layers" in metadata else None
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            raise ModelLoadError(f"cannot read decision head {str(path)!r}: {exc}") from exc
        if file_format != _FORMAT:
            raise ModelLoadError(
                f"decision head {str(path)!r} is in format {file_format!r}; this clef-guard reads {_FORMAT!r} only: "
                "retrain it with `clef-guard train` (or load it with the clef-guard that wrote it)"
            )
        width = tensors["proj.weight"].shape[-1]
        if width != hidden_size:
            raise ModelLoadError(
                f"decision head {str(path)!r} is {width} wide but the backbone's hidden size is "
                f"{hidden_size}: train a head for this backbone"
            )
        head = cls(hidden_size, tensors["hidden_in.weight"].shape[0] if "hidden_in.weight" in tensors else HIDDEN_WIDTH)
        fresh = head.state_dict()
        for name in (*_MATCH, *_HIDDEN):  # saved untrained they are left out (see save): recreate them
            tensors.setdefault(name, fresh[name])
        for name in [n for n in tensors if n.startswith("readouts.") and n.endswith(".weight")]:
            key = name.split(".")[1]
            parts = [tensors.get(f"readouts.{key}.{part}") for part in ("weight", "bias", "seen", "held_out")]
            if any(part is None for part in parts):
                raise ModelLoadError(f"decision head {str(path)!r}: the readout {key!r} lacks some of weight, bias, seen, held_out")
            head.readouts[key] = Readout(*parts)  # type: ignore[arg-type]
        head.load_state_dict(tensors)
        head.question_temperatures = question_temperatures
        head.questions = questions
        head.layers = layers
        return head.eval()  # a loaded head answers: no dropout


def averaged(heads: Sequence[DecisionHead]) -> DecisionHead:
    """One head whose logits are the mean of ``heads``' logits: the linear parts averaged, the hidden
    layers side by side (each one's normalisation scale and shift folded into its first layer). The
    heads must share their standardisation, wide map and temperatures, as warm starts of one head on
    listed questions do; its trained questions are theirs together."""
    first = heads[0]
    states = [head.state_dict() for head in heads]
    shared = ("feature_mean", "feature_scale", "log_temperature", *_MATCH)
    for other, state in zip(heads[1:], states[1:], strict=True):
        differs = [name for name in shared if not torch.equal(states[0][name], state[name])]
        if other.layers != first.layers:
            differs.append("layers")
        if differs or other.question_temperatures != first.question_temperatures:
            raise ValueError(f"heads differ in {differs or 'question temperatures'}: only heads that share them can be averaged")
    merged = DecisionHead(first.hidden_size, sum(h.width for h in heads))
    target = merged.state_dict()  # shares storage with merged's parameters and buffers
    with torch.no_grad():
        for name in shared:
            target[name].copy_(states[0][name])
        for name in ("proj.weight", "proj.bias", "lm_weight"):
            target[name].copy_(torch.stack([state[name] for state in states]).mean(0))
        merged.hidden_norm.weight.fill_(1.0)
        merged.hidden_norm.bias.zero_()
        merged.hidden_in.weight.copy_(torch.cat([h.hidden_in.weight * h.hidden_norm.weight for h in heads]))
        merged.hidden_in.bias.copy_(torch.cat([h.hidden_in.weight @ h.hidden_norm.bias + h.hidden_in.bias for h in heads]))
        merged.hidden_out.copy_(torch.cat([h.hidden_out for h in heads], dim=1) / len(heads))
    merged.readouts = copy.deepcopy(first.readouts)
    merged.layers = first.layers
    merged.question_temperatures = dict(first.question_temperatures)
    merged.questions = tuple(sorted({q for h in heads for q in h.questions}))
    return merged.eval()


def _known(entry: str | list[str]) -> KnownQuestion:
    """A stored trained question: ``[kind, text]``, or a bare text from a head that kept no kinds
    (a malformed entry raises, and :meth:`DecisionHead.load` names the file)."""
    if isinstance(entry, str):
        return KnownQuestion("", entry)
    kind, text = entry
    return KnownQuestion(str(kind), str(text))
