"""A labeled example (state, question, answer), and the seeded sampling and splits every task uses."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from langchain_core.decisions import Choice, Noul

_T = TypeVar("_T")


@dataclass(frozen=True)
class Example:
    """One labeled request: the state, one question, and its correct answer."""

    id: str
    """Stable id within the task, from the data where it has one (else file and row)."""
    state: str | dict[str, Any] | list[Any]
    """What the engine reads: text, or JSON-like data with messages as role/content dicts."""
    question: Noul | Choice
    """The question asked about ``state``; one per task, except where a task asks several (``policies``)."""
    label: str
    """The correct answer: a key of ``question.criteria`` for a Choice, "yes" or "no" for a Noul."""


def sample(examples: list[Example], limit: int | None, seed: int) -> list[Example]:
    """``limit`` examples drawn with ``random.Random(seed)``, in their original order (all when ``limit`` is ``None``)."""
    if limit is None or limit >= len(examples):
        return examples
    keep = sorted(random.Random(seed).sample(range(len(examples)), limit))
    return [examples[index] for index in keep]


def seeded_split(task: str, items: Sequence[_T], *, dev: float, test: float) -> dict[str, list[_T]]:
    """Split ``items`` by a shuffle seeded with ``task``: dev and test fractions, the rest train."""
    order = list(range(len(items)))
    random.Random(f"clef-guard/{task}").shuffle(order)
    n_dev, n_test = round(len(items) * dev), round(len(items) * test)
    parts = {"dev": order[:n_dev], "test": order[n_dev : n_dev + n_test], "train": order[n_dev + n_test :]}
    return {split: [items[index] for index in sorted(indices)] for split, indices in parts.items()}



WHEN_TO_CALL = Choice(
    instructions="How should the assistant respond to the user's request, given the tools it has?",
    criteria={
        "tool_call": "Call a tool: one serves the request and every required argument is given.",
        "request_for_info": "Ask the user for more: a tool fits but a required argument is missing.",
        "cannot_answer": "Say it cannot help: none of the tools can serve the request.",
    },
)
"""The question of the ``when2call`` and ``tool-use`` tasks."""
