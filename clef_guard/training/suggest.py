"""Example texts for a choice's options, suggested from requests nobody labeled.

A choice whose options carry a few example requests reads far better through the sentence
encoder than one with label words alone (BANKING77: 0.63 -> 0.85 with ten a label), but
writing ten examples for each of 77 intents is what users skip. A deployment usually has the
requests themselves, unlabeled (logs, tickets, a sample of traffic). :func:`suggest_examples`
reads them with the encoder, places each near the option it is closest to, and for each
option keeps the texts that are clearest about it: the largest margin over the runner-up
option, among texts whose best option clears the "none of these" floor. One round, from the
options as written (label, description, examples already there): more rounds, re-reading
with the suggestions added, moved the dev splits by less than a point either way.

The suggestions are a draft for a person, never applied by themselves: on public intent sets
a fifth to a quarter of them belong to another option, and whoever writes the unlabeled
texts writes the suggestions (``clef-guard suggest-examples`` prints them as YAML to read,
prune and paste). :func:`with_suggestions` adds them to a question, as the benchmarks do.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from langchain_core.decisions import Choice

from clef_guard.engine.encoder import Encoder, is_none_label, none_cosine
from clef_guard.engine.requests import MAX_EXAMPLES, parse_questions
from clef_guard.errors import ClefGuardError

PER_OPTION = 20
"""Suggestions an option gets by default: chosen on the dev splits of BANKING77, HWU64 and
CLINC150 with 3,000 unlabeled train requests each (10 a label: 0.677 / 0.600 / 0.767; 20:
0.687 / 0.615 / 0.761; label words alone 0.631 / 0.546 / 0.690)."""

_CHUNK = 512
"""Texts read between two progress reports."""
_YAML_WORDS = frozenset({"y", "n", "yes", "no", "on", "off", "true", "false", "null"})
"""Bare words YAML reads as something other than text."""


@dataclass(frozen=True)
class Suggestion:
    """One unlabeled text suggested as an example of an option."""

    text: str
    cosine: float
    """How close the encoder reads it to the option (the engine's option cosine)."""
    margin: float
    """How much closer than to the runner-up option (or than the "none of these" floor when
    the question has one topical option)."""


def suggest_examples(
    encoder: Encoder,
    question: Choice,
    texts: Sequence[str],
    *,
    per_option: int = PER_OPTION,
    on_progress: Callable[[int, int], None] | None = None,
) -> dict[str, list[Suggestion]]:
    """For each topical option of ``question`` (not "none of these"), up to ``per_option`` of
    ``texts`` that the encoder reads as clearly about it, clearest first. Blank texts, repeats
    and texts that already are an option's example are skipped; every option gets a list, empty
    when no text fits. ``on_progress(done, total)`` follows the reading of the texts. Raises
    :class:`ClefGuardError` when ``per_option`` is out of range."""
    if not 1 <= per_option <= MAX_EXAMPLES:
        raise ClefGuardError(f"per_option is how many examples an option gets: 1 to {MAX_EXAMPLES}, not {per_option}")
    (parsed,) = parse_questions({"question": question})
    known = {text.strip() for shown in parsed.examples for text in shown}
    stripped = (text.strip() for text in texts)
    unique = list(dict.fromkeys(text for text in stripped if text and text not in known))
    topical = [i for i, label in enumerate(parsed.options) if not is_none_label(label)]
    suggestions: dict[str, list[Suggestion]] = {parsed.options[i]: [] for i in topical}
    if not unique or not topical:
        return suggestions
    floor = none_cosine(parsed)
    vectors = []
    for start in range(0, len(unique), _CHUNK):
        vectors.append(encoder.embed(unique[start : start + _CHUNK]))
        if on_progress is not None:
            on_progress(start + len(vectors[-1]), len(unique))
    cosines = encoder.cosines(torch.cat(vectors), parsed)[topical].T  # [texts, topical options]
    if len(topical) == 1:
        best, second, owner = cosines[:, 0], torch.full_like(cosines[:, 0], floor), torch.zeros(len(unique), dtype=torch.long)
    else:
        top = cosines.topk(2, dim=1)
        best, second, owner = top.values[:, 0], top.values[:, 1], top.indices[:, 0]
    ranked = sorted(
        (i for i in range(len(unique)) if best[i] >= floor), key=lambda i: float(second[i] - best[i])
    )  # clearest first: the largest margin
    room = dict.fromkeys(suggestions, per_option)
    for i in ranked:
        label = parsed.options[topical[int(owner[i])]]
        if room[label]:
            room[label] -= 1
            suggestions[label].append(Suggestion(unique[i], float(best[i]), float(best[i] - second[i])))
    return suggestions


def with_suggestions(question: Choice, suggestions: Mapping[str, Sequence[Suggestion]]) -> Choice:
    """``question`` with each option's suggested texts added after its own examples (at most
    :data:`~clef_guard.engine.requests.MAX_EXAMPLES` an option, its own first)."""
    criteria: dict[str, Any] = {}
    for label, value in question.criteria.items():
        description, own, added = _option(value, suggestions.get(label, ()))
        criteria[label] = {"description": description, "examples": own + [s.text for s in added]} if added else value
    return Choice(instructions=question.instructions, criteria=criteria)


def suggestions_yaml(question: Choice, suggestions: Mapping[str, Sequence[Suggestion]], *, heading: str) -> str:
    """``question``'s ``criteria:`` as YAML to review and paste into a policy: every option as it
    is written, those with suggestions also listing them after their own examples, each marked
    with a comment (its cosine and margin). ``heading`` opens the comment on top."""
    lines = [
        f"# {_one_line(heading)}",
        "# Unlabeled texts placed by the sentence encoder, not labeled by anyone: on public intent sets",
        "# a fifth to a quarter belong to another option. Read each, delete those that do not belong,",
        "# and paste what is left as the question's `criteria:`.",
        "criteria:",
    ]
    for label, value in question.criteria.items():
        description, own, added = _option(value, suggestions.get(label, ()))
        if not added:
            lines.append(f"  {_key(label)}: {_flow(value)}")
            continue
        lines += [f"  {_key(label)}:", f"    description: {_flow(description)}", "    examples:"]
        lines += [f"      - {_flow(text)}" for text in own]
        lines += [f"      - {_flow(s.text)}  # suggested: cosine {s.cosine:.2f}, margin {s.margin:.2f}" for s in added]
    return "\n".join(lines) + "\n"


def _option(value: Any, suggested: Sequence[Suggestion]) -> tuple[Any, list[str], list[Suggestion]]:
    """An option's description, its own examples, and the suggestions that fit beside them."""
    written = isinstance(value, Mapping) and "examples" in value
    own = list(value["examples"]) if written else []
    return (value.get("description") if written else value), own, list(suggested)[: max(0, MAX_EXAMPLES - len(own))]


def _flow(value: Any) -> str:
    """``value`` as a one-line YAML flow value: JSON, with every character YAML would not read
    as itself (line and paragraph separators, controls) escaped."""
    return "".join(c if c.isprintable() or c == " " else f"\\U{ord(c):08x}" for c in json.dumps(value, ensure_ascii=False))


def _key(label: str) -> str:
    """An option's label as a YAML key: bare when YAML reads it back as that text, else quoted."""
    plain = re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", label) and label.lower() not in _YAML_WORDS
    return label if plain else _flow(label)


def _one_line(text: str) -> str:
    return " ".join(text.split())
