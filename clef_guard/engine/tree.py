"""The question tree: every question and option of a request as branches of one sequence.

After the state's prefix, each question is a branch followed by its options. A boolean
attention pattern lets each token see the prefix, its own question and its own option,
so questions never see each other (answers do not depend on ids, order or neighbours),
and one forward pass scores every option of every question.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from clef_guard.engine.requests import ParsedQuestion

_LOGIT_CHUNK = 256


@dataclass(frozen=True)
class OptionFeatures:
    """What the engine read for each option of one question, in option order."""

    question: ParsedQuestion
    reading: str
    """How the head reads it: the question's kind, or ``"wide"`` (see :mod:`clef_guard.engine.head`)."""
    hidden: torch.Tensor
    """``[n_options, hidden_size]``: hidden state of each option's closing token (a wide
    choice: the vector of each option read as a state)."""
    lm_logprob: torch.Tensor
    """``[n_options]``: the backbone's own score of each option: the mean log-probability
    of its tokens (a wide choice: ``WIDE_MATCH_SCALE`` times the centred cosine between
    the query and the option)."""
    query: torch.Tensor
    """``[hidden_size]``: hidden state of the question's last token, where the answer starts
    (it has read the state and the question, but no option); from the penultimate layer
    for a wide choice."""

    def to_record(self) -> dict[str, Any]:
        """These features as JSON (vectors as float16 in base64): what a head trains on, without the state."""
        return {
            "reading": self.reading,
            "hidden": _packed(self.hidden),
            "lm_logprob": [float(x) for x in self.lm_logprob.float().cpu()],
            "query": _packed(self.query),
        }

    @classmethod
    def from_record(cls, record: Mapping[str, Any], question: ParsedQuestion) -> OptionFeatures:
        """The features :meth:`to_record` wrote for ``question``; a ``ValueError`` when they do not fit it."""
        hidden, query = _unpacked(record["hidden"]), _unpacked(record["query"])
        lm_logprob = torch.tensor(record["lm_logprob"], dtype=torch.float32)
        if hidden.shape[0] != len(question.options) or lm_logprob.shape != (len(question.options),):
            raise ValueError(f"features of {hidden.shape[0]} options for a question with {len(question.options)}")
        return cls(question, str(record["reading"]), hidden, lm_logprob, query)


def _packed(tensor: torch.Tensor) -> dict[str, Any]:
    data = tensor.detach().to(torch.float16).cpu().contiguous().numpy().tobytes()
    return {"shape": list(tensor.shape), "float16": base64.b64encode(data).decode("ascii")}


def _unpacked(packed: Mapping[str, Any]) -> torch.Tensor:
    flat = torch.frombuffer(bytearray(base64.b64decode(packed["float16"], validate=True)), dtype=torch.float16)
    return flat.reshape([int(n) for n in packed["shape"]]).float()


@dataclass(frozen=True)
class Branch:
    """One question's tokens and its options' tokens."""

    question: ParsedQuestion
    reading: str
    question_tokens: list[int]
    option_tokens: list[list[int]]

    @property
    def wide(self) -> bool:
        """Whether the question is read wide (its options are not in the tree)."""
        return self.reading == "wide"

    @property
    def length(self) -> int:
        """Tokens in the tree: a wide choice's options are not in it."""
        return len(self.question_tokens) + (0 if self.wide else sum(len(option) for option in self.option_tokens))


@dataclass(frozen=True)
class Tree:
    """Question and option tokens laid out as one sequence of branches after a prefix."""

    tokens: list[int]
    positions: list[int]
    allowed: torch.Tensor
    """``[L, prefix + L]`` boolean: what each tree token may attend to."""
    spans: list[list[tuple[int, int]]]
    """Per branch, the ``(start, end)`` of each option within the tree (none when wide)."""
    ends: list[int]
    """Per branch, the position of its question's last token within the tree."""


@dataclass(frozen=True)
class Hidden:
    """Hidden states of one forward pass: ``[len, hidden]`` each."""

    last: torch.Tensor
    wide: torch.Tensor | None
    """The penultimate layer's, where a wide choice reads its query; ``None`` unless asked for."""

    def rows(self, start: int, length: int) -> Hidden:
        """The states of ``length`` tokens from ``start``."""
        stop = start + length
        return Hidden(self.last[start:stop], None if self.wide is None else self.wide[start:stop])


def build_tree(prefix_len: int, branches: Sequence[Branch], device: torch.device | str) -> Tree:
    """Lay out branches after a prefix: each sees the prefix, its own question and itself."""
    tokens: list[int] = []
    positions: list[int] = []
    segment_start: list[int] = []
    question_span: list[tuple[int, int]] = []
    spans: list[list[tuple[int, int]]] = []
    ends: list[int] = []
    for branch in branches:
        q_start = len(tokens)
        q_len = len(branch.question_tokens)
        tokens += branch.question_tokens
        positions += range(prefix_len, prefix_len + q_len)
        segment_start += [q_start] * q_len
        question_span += [(q_start, q_start + q_len)] * q_len
        ends.append(len(tokens) - 1)
        option_spans = []
        for option in [] if branch.wide else branch.option_tokens:
            start = len(tokens)
            tokens += option
            positions += range(prefix_len + q_len, prefix_len + q_len + len(option))
            segment_start += [start] * len(option)
            question_span += [(q_start, q_start + q_len)] * len(option)
            option_spans.append((start, len(tokens)))
        spans.append(option_spans)
    rows = torch.arange(len(tokens), device=device)[:, None]
    cols = torch.arange(len(tokens), device=device)[None, :]
    q_bounds = torch.tensor(question_span, device=device)
    in_question = (cols >= q_bounds[:, :1]) & (cols < q_bounds[:, 1:])
    in_segment = cols >= torch.tensor(segment_start, device=device)[:, None]
    allowed = (in_question | in_segment) & (cols <= rows)
    allowed = torch.cat([torch.ones(len(tokens), prefix_len, dtype=torch.bool, device=device), allowed], dim=1)
    return Tree(tokens, positions, allowed, spans, ends)


def with_prefix_rows(tree: Tree, start: int) -> torch.Tensor:
    """``tree.allowed`` below the rows of the prefix's tokens from ``start`` on, for a pass that
    reads them too: each sees the prefix up to itself and no branch."""
    device = tree.allowed.device
    rows = torch.arange(start, tree.allowed.shape[1] - len(tree.tokens), device=device)[:, None]
    cols = torch.arange(tree.allowed.shape[1], device=device)[None, :]
    return torch.cat([cols <= rows, tree.allowed])


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean ``[rows, cols]`` attention pattern as the ``[1, 1, rows, cols]`` additive mask."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def target_logprobs(
    logits_of: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, branches: Sequence[Branch], tree: Tree
) -> list[torch.Tensor]:
    """Mean log-probability of each option's tokens, per branch, in chunks over the vocabulary.

    ``logits_of`` maps hidden rows to float32 next-token logits (:meth:`clef_guard.engine.backbone.Backbone.logits`).

    A wide choice's options are not in the tree: its entry is empty.
    """
    predictors: list[int] = []
    targets: list[int] = []
    owners: list[int] = []
    option_index = 0
    for branch, option_spans, question_last in zip(branches, tree.spans, tree.ends, strict=True):
        for option, (start, _) in zip(branch.option_tokens, option_spans):  # no spans: a wide branch
            predictors += [question_last, *range(start, start + len(option) - 1)]
            targets += option
            owners += [option_index] * len(option)
            option_index += 1
    device = hidden.device
    predictor_t = torch.tensor(predictors, dtype=torch.long, device=device)
    target_t = torch.tensor(targets, dtype=torch.long, device=device)
    token_logprobs = torch.empty(len(predictors), dtype=torch.float32, device=device)
    for start in range(0, len(predictors), _LOGIT_CHUNK):
        chunk = slice(start, start + _LOGIT_CHUNK)
        logits = logits_of(hidden[predictor_t[chunk]])
        token_logprobs[chunk] = logits.log_softmax(-1).gather(-1, target_t[chunk, None]).squeeze(-1)
    owner_t = torch.tensor(owners, dtype=torch.long, device=device)
    sums = torch.zeros(option_index, dtype=torch.float32, device=device).index_add_(0, owner_t, token_logprobs)
    counts = torch.bincount(owner_t, minlength=option_index).float()
    means = sums / counts
    result, offset = [], 0
    for spans in tree.spans:
        result.append(means[offset : offset + len(spans)])
        offset += len(spans)
    return result
