"""Readouts: a question that people answer often gets an option scorer of its own.

The head is shared by every question, so a few hundred answers to one question move it
little (a warm start must not forget the others). A readout is fitted on that question's
rows alone, the new answers and the replayed old rows that ask it, weighing as much in all
as the new ones (so that what the head read well stays read): a logistic regression from
all its options' standardized hidden states (what the head reads) to its options. Its L2
strength is chosen by cross-validation, its temperature fitted on the out-of-fold logits and
folded into its weights, and it is adopted only where its out-of-fold log-loss beats the
starting head's own on the same rows (the old ones that head may have trained on: a bar set
high); where it does not, the question reads the head again. Other questions keep reading
the head, untouched.

Where rows name the tool their call uses, the fit also reports the readout's log-loss with
each tool's rows held out together: how it reads tools it was not fitted on, which is what a
user's own tools are. Folds by row judge it on near copies of its training rows, so a readout
that fits a template of each tool looks sure and right there; held out by tool, it reads worse
than even odds (docs/results.md#readouts-for-the-destructive-policy).
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from clef_guard.engine.head import DecisionHead, Readout
from clef_guard.training.calibrate import fit_temperature
from clef_guard.training.features import Features
from clef_guard.training.fit import predict

MIN_READOUT_ROWS = 20
"""New answers a question needs (with at least two options among them, old rows counted) before a readout is tried."""
MAX_READOUT_OPTIONS = 16
"""Most options a question with a readout may have: its weights grow with their square."""
STRENGTHS = (1e-4, 1e-3, 1e-2, 1e-1, 1.0)
"""L2 strengths tried, by cross-validation (the loss is the mean cross-entropy plus ``strength / 2 * |W|^2``)."""
FOLDS = 5


@dataclass(frozen=True)
class ReadoutFit:
    """What fitting one question's readout found."""

    question: str
    """The question's key."""
    rows: int
    """New answers it was fitted on."""
    replayed: int
    """Old rows of the question it was fitted on beside them."""
    tools: int
    """Tools its answers' calls name (held out one group at a time for :attr:`unseen_log_loss`)."""
    options: int
    """The question's options (even odds over them: a log-loss of ``log(options)``)."""
    strength: float
    temperature: float
    log_loss: float
    """Out-of-fold log-loss of the readout on all its rows, after its temperature."""
    head_log_loss: float
    """The starting head's log-loss on the same rows (the old ones it may have trained on)."""
    adopted: bool
    unseen_log_loss: float | None = None
    """Out-of-fold log-loss at the same strength and temperature with each tool's rows held out
    together (folds of whole tools); ``None`` where the answers name fewer than two tools."""
    option_weights: tuple[float, ...] | None = None
    """How many times a row counted, by its answer's option (``None``: each once); every log-loss
    here is weighted by them, the head's too."""

    @property
    def worse_than_even_odds_on_new_tools(self) -> bool:
        """Whether, with each tool held out, it reads worse than answering every option alike."""
        return self.unseen_log_loss is not None and self.unseen_log_loss > math.log(self.options)


def fit_readouts(
    head: DecisionHead,
    answers: Sequence[Features],
    *,
    judge: DecisionHead | None = None,
    replayed: Sequence[Features] = (),
    tools: Sequence[str | None] | None = None,
    option_weights: Mapping[str, Sequence[float]] | None = None,
) -> list[ReadoutFit]:
    """Fit a readout for each question of at most :data:`MAX_READOUT_OPTIONS` options that ``answers``
    ask :data:`MIN_READOUT_ROWS` times or more (two options among them at least), on those answers
    and the ``replayed`` rows (the head's old ones) that ask it too, weighted to count as much in
    all as the answers, so that what the head read well stays read. Set it on ``head`` where it
    beats ``judge``'s own logits (the head the answers are new to; ``head`` itself by default) out
    of fold, else drop the readout it had; readouts of questions ``answers`` does not ask are
    kept. Features are standardized as ``head`` reads them.

    ``tools`` (one per answer: the tool its call names, ``None`` where unknown) adds each fit's
    :attr:`~ReadoutFit.unseen_log_loss`; it changes nothing that is fitted or adopted.

    ``option_weights`` (a question's key -> one weight per option) counts each of that question's
    rows as many times as its answer's option says, in the fit, the choice of strength and the
    adoption: where one miss costs more than the other (a destroying call read as harmless lets it
    run; a harmless one read as destroying asks a person), the readout leans away from the costly
    one. Its probabilities then carry that lean: they are not calibrated to the rows' own odds."""
    judge = judge if judge is not None else head
    option_weights = dict(option_weights or {})
    for key, weighed in option_weights.items():
        if any(not (w > 0 and math.isfinite(w)) for w in weighed):
            raise ValueError(f"question {key!r}: option weights must be positive and finite, got {list(weighed)}")
    if tools is not None and len(tools) != len(answers):
        raise ValueError(f"{len(tools)} tools for {len(answers)} answers")
    by_question: dict[str, list[Features]] = {}
    tool_of: dict[str, list[str | None]] = {}
    for item, tool in zip(answers, tools if tools is not None else [None] * len(answers), strict=True):
        if item.reading != "wide" and item.question is not None:
            by_question.setdefault(item.question, []).append(item)
            tool_of.setdefault(item.question, []).append(tool)
    by_question = {key: rows for key, rows in by_question.items() if len(rows) >= MIN_READOUT_ROWS}
    new = {key: len(rows) for key, rows in by_question.items()}
    for key, weighed in option_weights.items():  # checked before any readout is set: a bad weight leaves the head as it was
        if key in by_question and {len(weighed)} != (options := {len(r.hidden) for r in by_question[key]}) and len(options) == 1:
            raise ValueError(f"question {key!r} has {options.pop()} options, {len(weighed)} option weights given")
    for item in replayed:
        if item.question in by_question and item.reading != "wide":
            by_question[item.question].append(item)
            tool_of[item.question].append(None)
    fits = []
    for key, rows in sorted(by_question.items()):
        if len({r.label for r in rows}) < 2 or len({len(r.hidden) for r in rows}) > 1 or len(rows[0].hidden) > MAX_READOUT_OPTIONS:
            continue
        with torch.no_grad():
            x = torch.stack([head.standardized(r.hidden) for r in rows]).float().cpu()
        labels = torch.tensor([r.label for r in rows])
        old = len(rows) - new[key]  # the old rows weigh as much in all as the new ones
        weights = torch.tensor([1.0] * new[key] + [new[key] / old if old else 1.0] * old)
        weighed = option_weights.get(key)
        if weighed is not None:
            weights = weights * torch.tensor(weighed, dtype=weights.dtype)[labels]
        baseline = torch.stack(predict(judge, rows, readouts=False)).float().cpu()
        strength, out_of_fold = _cross_validate(x, labels, weights, _row_folds(len(rows)))
        temperature = fit_temperature(list(out_of_fold), labels.tolist())
        log_loss = _log_loss(out_of_fold / temperature, labels, weights).item()
        unseen = None
        if by_tool := _tool_folds(tool_of[key]):
            _, held_tools = _cross_validate(x, labels, weights, by_tool, strengths=(strength,))
            unseen = _log_loss(held_tools / temperature, labels, weights).item()
        head_log_loss = _log_loss(baseline.clamp_min(1e-12).log(), labels, weights).item()
        adopted = log_loss < head_log_loss
        if adopted:
            weight, bias = _fit(x, labels, weights, strength)
            seen = torch.tensor([fingerprint(r.hidden) for r in rows], dtype=torch.int64)
            readout = Readout(weight / temperature, bias / temperature, seen, torch.softmax(out_of_fold / temperature, dim=-1))
        head.set_readout(key, readout if adopted else None)
        named = len({t for t in tool_of[key] if t is not None})
        fits.append(ReadoutFit(
            key, new[key], old, named, x.shape[1], strength, temperature, log_loss, head_log_loss, adopted, unseen,
            tuple(float(w) for w in weighed) if weighed is not None else None,
        ))
    return fits


def held_out(head: DecisionHead, features: Sequence[Features], probabilities: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``probabilities`` (``head``'s, one per row of ``features``) with each row a readout learned from read
    as it was out of fold: a threshold fitted on a review log must not see its readouts' answers to their own
    training rows, which they fit far closer than new ones."""
    found = []
    for item, row in zip(features, probabilities, strict=True):
        readout = head.readout(item.question) if item.reading != "wide" else None
        if readout is not None and len(readout.seen):
            match = (readout.seen == fingerprint(item.hidden)).nonzero()
            row = readout.held_out[int(match[0, 0])].to(row) if len(match) else row
        found.append(row)
    return found


def fingerprint(hidden: torch.Tensor) -> int:
    """A row's identity, from its options' hidden states as a feature cache keeps them (float16)."""
    digest = hashlib.sha256(hidden.detach().to(torch.float16).cpu().contiguous().numpy().tobytes()).digest()
    return int.from_bytes(digest[:8], "little", signed=True)


def _fit(
    x: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, strength: float, start: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights ``[n, n, H]`` and bias ``[n]`` of an L2-penalised logistic regression of ``labels`` on ``x``
    (``[N, n, H]``), each row's loss counted ``weights`` times (``[N]``), solved from ``start`` (else zeros)."""
    options = x.shape[1]
    weight = (start[0].clone() if start else torch.zeros(options, options, x.shape[2])).requires_grad_()
    bias = (start[1].clone() if start else torch.zeros(options)).requires_grad_()
    optimizer = torch.optim.LBFGS([weight, bias], max_iter=300, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = _log_loss(Readout.score(x, weight, bias), labels, weights) + strength / 2 * (weight**2).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        optimizer.step(closure)
    return weight.detach(), bias.detach()


def _log_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted mean cross-entropy."""
    return (torch.nn.functional.cross_entropy(logits, labels, reduction="none") * weights).sum() / weights.sum()


def _row_folds(rows: int) -> list[list[int]]:
    """Row indices of :data:`FOLDS` folds, shuffled with a fixed seed."""
    order = list(range(rows))
    random.Random(0).shuffle(order)
    return [order[k::FOLDS] for k in range(FOLDS)]


def _tool_folds(tools: Sequence[str | None]) -> list[list[int]] | None:
    """Row indices of folds that each hold whole tools (the largest first, each into the fold with fewest
    rows so far; at most :data:`FOLDS` folds), rows of no tool spread across them; ``None`` where fewer
    than two tools are named."""
    named: dict[str, list[int]] = {}
    loose = []
    for index, tool in enumerate(tools):
        (named.setdefault(tool, []) if tool is not None else loose).append(index)
    if len(named) < 2:
        return None
    folds: list[list[int]] = [[] for _ in range(min(FOLDS, len(named)))]
    for tool in sorted(named, key=lambda t: (-len(named[t]), t)):
        min(folds, key=len).extend(named[tool])
    for k, index in enumerate(loose):
        folds[k % len(folds)].append(index)
    return folds


def _cross_validate(
    x: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, folds: list[list[int]], strengths: Sequence[float] = STRENGTHS
) -> tuple[float, torch.Tensor]:
    """The strength of ``strengths`` with the lowest out-of-fold log-loss over ``folds``, and its out-of-fold logits."""
    order = range(len(labels))
    best: tuple[float, float, torch.Tensor] | None = None
    solved: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(folds)
    for strength in sorted(strengths, reverse=True):  # each fold's solution starts the next, weaker strength's
        out_of_fold = torch.zeros(len(labels), x.shape[1])
        for fold, held in enumerate(folds):
            kept = sorted(set(order) - set(held))
            solved[fold] = weight, bias = _fit(x[kept], labels[kept], weights[kept], strength, solved[fold])
            out_of_fold[held] = Readout.score(x[held], weight, bias)
        loss = _log_loss(out_of_fold, labels, weights).item()
        if best is None or loss < best[0]:
            best = (loss, strength, out_of_fold)
    assert best is not None
    return best[1], best[2]
